"""Tests of jaxmp.quantize and jaxmp.quantized: recipes against numpy, kernels, integrations."""

import pathlib
import re
import sys

import equinox as eqx
import flax.linen as linen
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax import lax

import jaxmp
from jaxmp._src.quantization import leaf as leaf_lib
from jaxmp._src.quantization import plan as plan_lib
from jaxmp._src.quantization import recipes as q_lib
from tests.conftest import assert_close, diagonal_cases

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

from lm import model as model_lib  # noqa: E402

RECIPES = {
    "int8": jaxmp.Int8WeightOnly(),
    "int8_dynamic": jaxmp.Int8DynamicActivations(),
    "fp8": jaxmp.Float8Rowwise(),
    "int4": jaxmp.Int4WeightOnly(group_size=32),
}
# Relative error of a quantised model's output against the same model in bfloat16 (the
# largest difference over the largest output), per recipe: 8-bit formats a few percent, E4M3
# (3 mantissa bits) and 4-bit groups more.
MODEL_TOLERANCE = {"int8": 0.03, "int8_dynamic": 0.05, "fp8": 0.12, "int4": 0.3}


def _weights(shape, seed=0):
    """Normal weights with an outlier row, an outlier column and an all-zero output channel."""
    w = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    w[1, :] *= 50.0  # an outlier input row (spread over every output channel)
    w[:, 2] *= 100.0  # an outlier output channel
    w[:, 3] = 0.0  # an all-zero output channel
    return w


# --------------------------------------------------------------------------------------------
# Each recipe against a numpy reference.


def _numpy_int8(w, scale=None):
    if scale is None:
        amax = np.abs(w).max(axis=0, keepdims=True)
        scale = np.where(amax > 0, amax / 127, 1).astype(np.float32)
    return np.clip(np.round(w / scale), -127, 127).astype(np.int8), scale


@pytest.mark.parametrize("name", ["int8", "int8_dynamic"])
def test_int8_matches_numpy(name):
    w = _weights((64, 16))
    q = leaf_lib.quantize_array(jnp.asarray(w), (0,), RECIPES[name])
    values, scale = _numpy_int8(w)
    # XLA's float32 division on CPU is not always correctly rounded: a scale may be 1 ulp off
    # numpy's, and the values are then numpy's rounding with that scale.
    np.testing.assert_allclose(np.asarray(q.scales), scale, rtol=2e-7)
    values, _ = _numpy_int8(w, np.asarray(q.scales))
    np.testing.assert_array_equal(np.asarray(q.values), values)
    assert q.values.dtype == jnp.int8 and q.scales.shape == (1, 16)
    assert np.all(np.asarray(q.scales)[0, 3] == 1.0)  # the all-zero channel
    assert np.all(np.asarray(q.dequantize())[:, 3] == 0.0)
    err = np.abs(np.asarray(q.dequantize()) - w)
    assert np.all(err <= scale / 2 * (1 + 1e-6))  # round to nearest: half a step


def test_fp8_matches_numpy():
    w = _weights((64, 16))
    q = leaf_lib.quantize_array(jnp.asarray(w), (0,), RECIPES["fp8"])
    amax = np.abs(w).max(axis=0, keepdims=True)
    scale = np.where(amax > 0, amax / 448, 1).astype(np.float32)
    np.testing.assert_allclose(np.asarray(q.scales), scale, rtol=2e-7)  # amax / 448, 1 ulp
    values = (w / np.asarray(q.scales)).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(q.values), values)
    deq = np.asarray(q.dequantize())
    # E4M3 keeps 3 mantissa bits: a relative error of at most 2^-4 above the subnormals.
    normal = np.abs(w / scale) >= 2.0**-6
    assert np.all(np.abs(deq - w)[normal] <= np.abs(w)[normal] * 2.0**-4 * (1 + 1e-6))
    assert np.all(deq[:, 3] == 0.0)


@pytest.mark.parametrize("form", ["quantized", "quantization_aware"])
def test_fp8_rounds_a_single_rows_activations_once(form):
    # Activations just past the tie between two E4M3 values (1 + 1/16 + 2^-12, between 1
    # and 1.125) round up to 1.125. Rounded through float16 first (XLA:CPU of jaxlib 0.8
    # does so where the conversion is fused into a one-row matmul), they would land on the
    # tie itself and round to even: 1.
    x = np.zeros((1, 64), np.float32)
    x[0, 0], x[0, 1] = 448.0, 1 + 1 / 16 + 2.0**-12  # the row's scale: about 1
    w = {"w": jnp.eye(64, dtype=jnp.float32)}
    fun = lambda p, x: x @ p["w"]  # noqa: E731
    if form == "quantized":
        w = jaxmp.quantize(fun, w, x, recipe="fp8")
        served = jax.jit(jaxmp.quantized(fun))
    else:
        served = jax.jit(jaxmp.quantization_aware(fun, recipe="fp8"))
    one, batch = served(w, jnp.asarray(x)), served(w, jnp.tile(jnp.asarray(x), (4, 1)))
    np.testing.assert_allclose(np.asarray(one)[0, 1], 1.125, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(one)[0], np.asarray(batch)[3])


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_rounding_onto_the_e4m3_grid_in_float_is_the_conversion(dtype):
    # The rounding jaxmp does itself where XLA:CPU may round a conversion twice
    # (`compat.FP8_CONVERT_MAY_ROUND_TWICE`): the same value as one conversion, everywhere.
    rng = np.random.default_rng(0)
    y = rng.normal(size=100_000) * 10.0 ** rng.uniform(-5, 2.7, 100_000)
    ties = [1 + 1 / 16, 1 + 3 / 16, 1 + 1 / 16 + 2.0**-12, 2.0**-6, 1.5 * 2.0**-9, 2.0**-10]
    y = np.clip(np.concatenate([y, ties, np.negative(ties), [448, -448, 0, -0.0]]), -448, 448)
    y = np.append(y, np.nan).astype(dtype)
    with jax.enable_x64(dtype == np.float64):
        got = np.asarray(q_lib._on_the_e4m3_grid(jnp.asarray(y)))
    expected = y.astype(ml_dtypes.float8_e4m3fn).astype(dtype)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(expected))


@pytest.mark.parametrize("qmax", [127.0, 448.0, 7.0], ids=["int8", "fp8", "int4"])
def test_a_scale_has_the_same_bits_eager_and_under_jit(qmax):
    # XLA compiles a division by a constant into a product with its reciprocal, one bit off
    # the quotient for about half of all values; some jax releases run an eager division as
    # one. A scale one bit off moves values at a rounding tie to the other grid point: the
    # scale is that product in every program.
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4096, 8)), jnp.float32)
    eager = q_lib.absmax_scale(x, (1,), qmax)
    jitted = jax.jit(q_lib.absmax_scale, static_argnums=(1, 2))(x, (1,), qmax)
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))
    amax = np.abs(np.asarray(x)).max(axis=1, keepdims=True)
    product = amax * (np.float32(1) / np.float32(qmax))
    np.testing.assert_array_equal(np.asarray(eager), product)
    assert np.any(product != amax / np.float32(qmax))  # the values this test needs


def test_a_dynamic_recipes_gradient_is_the_same_eager_and_under_jit():
    p = {"w": jnp.asarray(_weights((64, 32)) / 8)}
    x = jnp.asarray(np.random.default_rng(3).normal(size=(8, 64)), jnp.float16)
    qat = jaxmp.quantization_aware(lambda p, x: x @ p["w"].astype(x.dtype), recipe="fp8")

    def loss(p):
        return jnp.sum(qat(p, x).astype(jnp.float32) ** 2)

    eager, jitted = jax.grad(loss)(p)["w"], jax.jit(jax.grad(loss))(p)["w"]
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))


def _int4_reference(groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """numpy's int4 by groups (last axis): for each candidate ``amax / 7 * r`` (r = 1, 0.95,
    ..., 0.6), values rounded and clipped to [-8, 7]; per group, the candidate with the
    smallest squared error (the first of equals). ``(ints, scale)``."""
    amax = np.abs(groups).max(axis=-1, keepdims=True)
    best_err = np.full(amax.shape, np.inf)
    best_ints = np.zeros_like(groups)
    best_scale = np.zeros(amax.shape, np.float32)
    for r in np.linspace(1.0, 0.6, 9):
        scale = np.where(amax > 0, (amax / 7 * np.float32(r)).astype(np.float32), 1)
        ints = np.clip(np.round(groups / scale), -8, 7)
        err = ((ints * scale - groups) ** 2).sum(axis=-1, keepdims=True)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_ints = np.where(better, ints, best_ints)
        best_scale = np.where(better, scale, best_scale)
    return best_ints, best_scale


def test_int4_matches_numpy():
    w = _weights((64, 16))
    recipe = RECIPES["int4"]
    q = leaf_lib.quantize_array(jnp.asarray(w), (0,), recipe)
    groups = w.T.reshape(16, 2, 32)  # output channels, groups along the contraction, values
    ints, scale = _int4_reference(groups)
    np.testing.assert_allclose(np.asarray(q.scales), scale[..., 0], rtol=2e-7)
    unpacked = np.asarray(q_lib.unpack_int4(q.values)).reshape(16, 2, 32)
    # The candidates' errors can tie to float32 rounding: compare errors, then the values.
    err = ((unpacked * np.asarray(q.scales)[..., None] - groups) ** 2).sum(-1)
    ref_err = ((ints * scale - groups) ** 2).sum(-1)
    np.testing.assert_allclose(err, ref_err, rtol=1e-5)
    assert np.mean(unpacked == ints) > 0.99
    assert unpacked.min() >= -8 and unpacked.max() <= 7
    expected = (unpacked * np.asarray(q.scales)[..., None]).reshape(16, 64).T
    np.testing.assert_allclose(np.asarray(q.dequantize()), expected, rtol=1e-6)
    assert q.shape == (64, 16) and q.values.shape == (16, 32) and q.values.dtype == jnp.uint8


def test_int4_error_is_never_above_plain_absmax_rounding():
    # The scale search keeps absmax / 7 (r = 1) among its candidates: per group, the squared
    # error is at most plain symmetric rounding's, on Gaussian, heavy-tailed and outlier groups.
    rng = np.random.default_rng(7)
    w = np.concatenate(
        [
            rng.normal(size=(128, 8)),
            rng.standard_t(2, size=(128, 8)),
            np.where(rng.random((128, 8)) < 0.01, 50.0, rng.normal(size=(128, 8))),
        ],
        axis=1,
    ).astype(np.float32)
    q = leaf_lib.quantize_array(jnp.asarray(w), (0,), jaxmp.Int4WeightOnly(group_size=32))
    groups = w.T.reshape(24, 4, 32)
    amax = np.abs(groups).max(-1, keepdims=True)
    plain = np.clip(np.round(groups / (amax / 7)), -7, 7) * (amax / 7)
    deq = np.asarray(q.dequantize()).T.reshape(24, 4, 32)
    err, plain_err = ((deq - groups) ** 2).sum(-1), ((plain - groups) ** 2).sum(-1)
    assert np.all(err <= plain_err * (1 + 1e-5))
    gaussian = slice(0, 8)  # and, on Gaussian weights, smaller by more than 10% on average
    assert np.mean(err[gaussian] / plain_err[gaussian]) < 0.9

    # Groups near float32's smallest normal number: no candidate scale is flushed to 0.
    tiny = np.float32(np.finfo(np.float32).tiny)
    small = (np.linspace(-1, 1, 64, dtype=np.float32) * 3 * tiny)[:, None]
    q = leaf_lib.quantize_array(jnp.asarray(small), (0,), jaxmp.Int4WeightOnly(group_size=32))
    assert np.all(np.asarray(q.scales) >= tiny)
    deq = np.asarray(q.dequantize())
    assert np.all(np.sign(deq[[0, -1]]) == np.sign(small[[0, -1]]))  # the extremes kept


def test_int4_choice_does_not_depend_on_the_weights_scale():
    # The candidates' errors are compared relative to the group's absmax: scaling a weight by
    # a power of two scales its scales and keeps its values, from 1e-18 to 1e30.
    w = np.clip(np.random.default_rng(3).normal(size=(128, 16)), -4, 4).astype(np.float32)
    recipe = jaxmp.Int4WeightOnly(group_size=32)
    ref = leaf_lib.quantize_array(jnp.asarray(w), (0,), recipe)
    for k in (-60, 64, 100):
        q = leaf_lib.quantize_array(jnp.asarray(w * np.float32(2.0**k)), (0,), recipe)
        np.testing.assert_array_equal(np.asarray(q.values), np.asarray(ref.values), err_msg=k)
        np.testing.assert_array_equal(np.asarray(q.scales), np.asarray(ref.scales) * 2.0**k)


def test_round_trips_are_exact_on_the_grid():
    rng = np.random.default_rng(1)
    # Power-of-two steps: amax / 127 is then exact whatever the division's rounding.
    steps = 2.0 ** rng.integers(-10, 10, size=(1, 8)).astype(np.float32)
    ints = rng.integers(-127, 128, size=(32, 8))
    ints[0] = 127  # each channel reaches the top of the grid
    on_grid = (ints * steps).astype(np.float32)
    q = leaf_lib.quantize_array(jnp.asarray(on_grid), (0,), RECIPES["int8"])
    np.testing.assert_array_equal(np.asarray(q.dequantize()), on_grid)

    e4m3 = rng.normal(size=(32, 8)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    e4m3[0] = 448.0
    q = leaf_lib.quantize_array(jnp.asarray(e4m3), (0,), RECIPES["fp8"])
    np.testing.assert_array_equal(np.asarray(q.dequantize()), e4m3)

    nibbles = rng.integers(-7, 8, size=(64, 8)).astype(np.float32)
    nibbles[::32] = 7.0  # each group reaches the top
    q = leaf_lib.quantize_array(jnp.asarray(nibbles), (0,), RECIPES["int4"])
    np.testing.assert_array_equal(np.asarray(q.dequantize()), nibbles)
    packed = q_lib.pack_int4(jnp.asarray(np.arange(-8, 8, dtype=np.int8)))
    np.testing.assert_array_equal(np.asarray(q_lib.unpack_int4(packed)), np.arange(-8, 8))


def test_int4_storage_is_half_a_byte_per_weight():
    w = jnp.ones((1024, 256), jnp.bfloat16)
    q = leaf_lib.quantize_array(w, (0,), jaxmp.Int4WeightOnly())
    assert q.values.nbytes == w.size // 2
    assert q.scales.nbytes == 4 * w.size // 128
    assert q.nbytes / w.nbytes == pytest.approx(0.25 + 2 / 128)
    q8 = leaf_lib.quantize_array(w, (0,), jaxmp.Int8WeightOnly())
    assert q8.nbytes == w.size + 4 * 256


# --------------------------------------------------------------------------------------------
# The kernels.


def _mlp(p, x):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return h @ p["w2"]


def _mlp_params(dtype=jnp.bfloat16):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": (jax.random.normal(k1, (64, 128)) / 8).astype(dtype),
        "b1": jnp.full((128,), 0.1, dtype),
        "w2": (jax.random.normal(k2, (128, 32)) / 11).astype(dtype),
        "step": jnp.asarray(3, jnp.int32),
        "mask": jnp.ones((4,), bool),
    }


def _rel_err(y, ref):
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    return float(np.abs(y - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("name", list(RECIPES))
def test_mlp_output_within_tolerance_and_leaves_untouched(name):
    p = _mlp_params()
    x = jax.random.normal(jax.random.key(1), (8, 64)).astype(jnp.bfloat16)
    q = jaxmp.quantize(_mlp, p, x, recipe=RECIPES[name])
    for key in ("b1", "step", "mask"):  # bias, int and bool leaves: the very same arrays
        assert q[key] is p[key]
    assert isinstance(q["w1"], jaxmp.QuantizedArray) and q["w1"].dtype == jnp.bfloat16
    with jax.numpy_dtype_promotion("strict"):
        y = jax.jit(jaxmp.quantized(_mlp))(q, x)
    assert y.dtype == jnp.bfloat16 and y.shape == (8, 32)
    assert _rel_err(y, _mlp(p, x)) < MODEL_TOLERANCE[name]


def _dots(jaxpr):
    return [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "dot_general"]


def test_int8_dynamic_runs_an_int8_dot_with_int32_output():
    p, x = _mlp_params(jnp.float32), jnp.ones((8, 64))
    q = jaxmp.quantize(_mlp, p, x, recipe="int8_dynamic")
    dots = list(_dots(jaxmp.quantized(_mlp).jaxpr(q, x).jaxpr))
    assert len(dots) == 2
    for eqn in dots:
        assert [v.aval.dtype for v in eqn.invars] == [jnp.int8, jnp.int8]
        assert eqn.outvars[0].aval.dtype == jnp.int32


def test_fp8_runs_an_e4m3_dot_and_weight_only_keeps_the_weight_int8_until_the_dot():
    p, x = _mlp_params(jnp.float32), jnp.ones((8, 64))
    q = jaxmp.quantize(_mlp, p, x, recipe="fp8")
    for eqn in _dots(jaxmp.quantized(_mlp).jaxpr(q, x).jaxpr):
        assert [v.aval.dtype for v in eqn.invars] == [jnp.float8_e4m3fn] * 2
        assert eqn.outvars[0].aval.dtype == jnp.float32
    q = jaxmp.quantize(_mlp, p, x, recipe="int8")
    jaxpr = jaxmp.quantized(_mlp).jaxpr(q, x).jaxpr
    # The params enter as int8 values and float32 scales: no float copy of a weight is an input.
    int8_inputs = [v.aval.shape for v in jaxpr.invars if v.aval.dtype == jnp.int8]
    assert sorted(int8_inputs) == [(64, 128), (128, 32)]


def test_scanned_stack_of_layers_jit_and_vmap():
    layers = jax.random.normal(jax.random.key(2), (3, 64, 64)) / 8

    def net(w, x):
        def body(h, w_layer):  # transpose and convert on the way to the dot
            return jnp.tanh(h @ w_layer.T.astype(jnp.bfloat16).astype(jnp.float32)), None

        return jax.jit(lambda h: lax.scan(body, h, w)[0])(x)

    x = jax.random.normal(jax.random.key(3), (4, 64))
    ref = net(layers, x)
    for name, recipe in RECIPES.items():
        (leaf,) = jaxmp.quantization_plan(net, layers, x, recipe=recipe)
        assert leaf.quantized and "(2,)" in leaf.reason
        q = jaxmp.quantize(net, layers, x, recipe=recipe)
        assert q.scales.shape[0] == 3  # one set of scales per layer
        run = jaxmp.quantized(net)
        y = jax.jit(run)(q, x)
        assert _rel_err(y, ref) < MODEL_TOLERANCE[name]
        batched = jax.vmap(run, in_axes=(None, 0))(q, x[:, None])[:, 0]
        np.testing.assert_allclose(np.asarray(batched), np.asarray(y), rtol=1e-5, atol=1e-5)


def test_quantised_params_scanned_by_the_caller():
    layers = {"w": jax.random.normal(jax.random.key(4), (3, 32, 32)) / 6}

    def layer(p, h):
        return jnp.tanh(h @ p["w"])

    x = jnp.ones((2, 32))
    q = jaxmp.quantize(
        lambda ps, h: lax.scan(lambda c, p: (layer(p, c), None), h, ps)[0], layers, x, recipe="int8"
    )
    run = jaxmp.quantized(layer)

    def step(h, p):
        return run(p, h), None

    y, _ = lax.scan(step, x, q)
    ref, _ = lax.scan(lambda h, p: (layer(p, h), None), x, layers)
    assert _rel_err(y, ref) < MODEL_TOLERANCE["int8"]


def test_tied_embedding_and_non_matmul_uses_stay_unquantised():
    def lm(p, tokens):
        h = p["embed"][tokens]  # gather
        h = h @ p["w"]
        return h @ p["embed"].T  # the same table as the head

    p = {"embed": jnp.ones((16, 8)), "w": jnp.ones((8, 8))}
    plan = {
        leaf.path: leaf for leaf in jaxmp.quantization_plan(lm, p, jnp.arange(3), recipe="int8")
    }
    assert not plan["embed"].quantized and "gather" in plan["embed"].reason
    assert plan["w"].quantized
    q = jaxmp.quantize(lm, p, jnp.arange(3), recipe="int8")
    assert q["embed"] is p["embed"]


def test_other_uses_of_a_quantised_weight_dequantise():
    def f(p, x):
        return x @ p["w"]

    def g(p, x):
        return x @ p["w"] + jnp.sum(p["w"])  # a reduction reads the weight too

    p = {"w": jnp.arange(32.0).reshape(4, 8) / 7}
    q = jaxmp.quantize(f, p, jnp.ones((1, 4)), recipe="int8")
    y = jaxmp.quantized(g)(q, jnp.ones((1, 4)))
    assert _rel_err(y, g(p, jnp.ones((1, 4)))) < 0.01


# --------------------------------------------------------------------------------------------
# Integrations: Linen (the main job's model), Equinox, orbax.


@pytest.mark.parametrize(
    "name", ["int8", *(pytest.param(n, marks=pytest.mark.slow) for n in RECIPES if n != "int8")]
)
def test_main_job_transformer_against_bf16(name):
    model = model_lib.TransformerLM(
        vocab_size=40,
        max_len=16,
        num_layers=1,
        num_heads=2,
        d_model=64,
        mlp_ratio=2,
        dtype=jnp.bfloat16,
        param_dtype=jnp.bfloat16,
        output_dtype=jnp.float32,
    )
    tokens = jax.random.randint(jax.random.key(5), (2, 16), 0, 40)
    variables = model.init(jax.random.key(6), tokens)
    ref = model.apply(variables, tokens)
    recipe = RECIPES[name]
    plan = jaxmp.quantization_plan(model.apply, variables, tokens, recipe=recipe, exclude="embed")
    quantised = {leaf.path for leaf in plan if leaf.quantized}
    assert quantised == {
        "params/block_0/attn/query/kernel",
        "params/block_0/attn/key/kernel",
        "params/block_0/attn/value/kernel",
        "params/block_0/attn/out/kernel",  # contracts two axes (heads, head dim)
        "params/block_0/fc/kernel",
        "params/block_0/proj/kernel",
        "params/head/kernel",
    }
    q = jaxmp.quantize(model.apply, variables, tokens, recipe=recipe, exclude="embed")
    logits = jaxmp.quantized(model.apply)(q, tokens)
    assert logits.dtype == jnp.float32
    assert _rel_err(logits, ref) < MODEL_TOLERANCE[name]


def test_equinox_module():
    mlp = eqx.nn.MLP(32, 8, 64, depth=2, key=jax.random.key(7))
    x = jnp.ones((32,))
    q = jaxmp.quantize(lambda m, x: m(x), mlp, x, recipe="int8")
    assert isinstance(q.layers[0].weight, jaxmp.QuantizedArray)
    assert q.layers[0].bias is mlp.layers[0].bias
    y = eqx.filter_jit(jaxmp.quantized(lambda m, x: m(x)))(q, x)
    assert _rel_err(y, mlp(x)) < MODEL_TOLERANCE["int8"]


class _NnxModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(50, 64, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=4, in_features=64, decode=False, rngs=rngs)
        self.fc = nnx.Linear(64, 128, rngs=rngs)
        self.norm = nnx.LayerNorm(128, rngs=rngs)
        self.head = nnx.Linear(128, 50, rngs=rngs)
        self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

    def __call__(self, tokens):
        h = self.embed(tokens)
        h = h + self.attn(h)
        return self.head(self.norm(jax.nn.gelu(self.fc(h))))


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[] if n == "int8" else [pytest.mark.slow]) for n in RECIPES]
)
def test_nnx_module_state(name):
    # As the guide says: split the module, quantise its state through nnx.merge.
    graphdef, state = nnx.split(_NnxModel(nnx.Rngs(0)))
    tokens = jnp.arange(16).reshape(2, 8) % 50

    def fun(s, x):
        return nnx.merge(graphdef, s)(x)

    recipe = RECIPES[name]
    plan = jaxmp.quantization_plan(fun, state, tokens, recipe=recipe)
    plan = {leaf.path: leaf.quantized for leaf in plan}
    kernels = {f"{m}/kernel/value" for m in ("attn/query", "attn/key", "attn/value", "attn/out")}
    assert {p for p, quantized in plan.items() if quantized} == {
        *kernels,
        "fc/kernel/value",
        "head/kernel/value",
    }
    q = jaxmp.quantize(fun, state, tokens, recipe=recipe, exclude="head")

    def leaves(tree):
        flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=q_lib.is_quantized)[0]
        return {plan_lib.path_string(path): leaf for path, leaf in flat}

    got, before = leaves(q), leaves(state)
    for path, leaf in got.items():
        quantized = plan.get(path, False) and not path.startswith("head/")
        assert isinstance(leaf, jaxmp.QuantizedArray) == quantized, path
        if not quantized:  # the embedding, biases, norms, the head, the counter: the same objects
            assert leaf is before[path], path
    out = jax.jit(jaxmp.quantized(fun))(q, tokens)
    assert out.dtype == jnp.float32
    assert _rel_err(out, fun(state, tokens)) < MODEL_TOLERANCE[name]


@pytest.mark.parametrize("name", list(RECIPES))
def test_orbax_round_trip_is_bit_identical(tmp_path, name):
    p, x = _mlp_params(), jnp.ones((2, 64), jnp.bfloat16)
    q = jaxmp.quantize(_mlp, p, x, recipe=RECIPES[name])
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / name, q)
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(tmp_path / name, jax.eval_shape(lambda: q))
    assert jax.tree.structure(restored) == jax.tree.structure(q)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(q), strict=True):
        assert a.dtype == b.dtype
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    np.testing.assert_array_equal(
        np.asarray(jaxmp.quantized(_mlp)(restored, x), np.float32),
        np.asarray(jaxmp.quantized(_mlp)(q, x), np.float32),
    )


# --------------------------------------------------------------------------------------------
# Errors.


def test_recipe_errors_name_the_argument_and_the_choices():
    p, x = _mlp_params(), jnp.ones((2, 64), jnp.bfloat16)
    with pytest.raises(
        ValueError,
        match=r"`recipe` must be one of 'int8', .*'int4', got 'int9'.*"
        r"Did you mean 'int8'\?",
    ):
        jaxmp.quantize(_mlp, p, x, recipe="int9")
    with pytest.raises(TypeError, match=r"`recipe` must be a quantisation recipe .*Int8WeightOnly"):
        jaxmp.quantize(_mlp, p, x, recipe=8)
    with pytest.raises(
        TypeError,
        match=r"`recipe` must be .*got the class jaxmp.Int8WeightOnly; "
        r"pass an instance: jaxmp.Int8WeightOnly\(\)",
    ):
        jaxmp.quantize(_mlp, p, x, recipe=jaxmp.Int8WeightOnly)
    with pytest.raises(
        TypeError, match=r"`recipe` must be a quantisation recipe .*'int4'\), got DelayedScaling"
    ):
        jaxmp.quantize(_mlp, p, x, recipe=jaxmp.DelayedScaling())
    with pytest.raises(TypeError, match=r"`recipe` must be .*got None\."):
        jaxmp.quantization_plan(_mlp, p, x, recipe=None)
    with pytest.raises(ValueError, match=r"`group_size` must be a positive even integer.*got 33"):
        jaxmp.Int4WeightOnly(group_size=33)
    assert hash(jaxmp.Int4WeightOnly()) == hash(jaxmp.Int4WeightOnly(128))


def test_exclude_errors_list_the_leaves():
    p, x = _mlp_params(), jnp.ones((2, 64), jnp.bfloat16)
    with pytest.raises(
        ValueError,
        match=r"`exclude` pattern 'w3' matches no .*b1, w1, w2.*"
        r"Did you mean",
    ):
        jaxmp.quantize(_mlp, p, x, recipe="int8", exclude=["w3"])
    with pytest.raises(TypeError, match="`exclude` must be a regex or a sequence"):
        jaxmp.quantize(_mlp, p, x, recipe="int8", exclude=[3])
    q = jaxmp.quantize(_mlp, p, x, recipe="int8", exclude="w2")
    assert q["w2"] is p["w2"] and isinstance(q["w1"], jaxmp.QuantizedArray)


@pytest.mark.parametrize("bad", [0, -2, 1, 33, 2.0, 64.0, "64", True, None])
def test_group_size_errors(bad):
    with pytest.raises(
        ValueError,
        match=rf"`group_size` must be a positive even integer \(64, 128, 256, ...\), "
        rf"got {re.escape(repr(bad))}\.",
    ):
        jaxmp.Int4WeightOnly(group_size=bad)


def test_group_size_accepts_numpy_integers():
    recipe = jaxmp.Int4WeightOnly(group_size=np.int64(64))
    assert type(recipe.group_size) is int
    assert recipe == jaxmp.Int4WeightOnly(64) and hash(recipe) == hash(jaxmp.Int4WeightOnly(64))


@pytest.mark.parametrize("bad", [3, ["w1", 3], b"w1", {"w1"}])
def test_exclude_of_the_wrong_type(bad):
    p, x = _mlp_params(), jnp.ones((2, 64), jnp.bfloat16)
    with pytest.raises(
        TypeError,
        match=rf"`exclude` must be a regex or a sequence of regexes \(strings\), "
        rf"got {re.escape(repr(bad))}\.",
    ):
        jaxmp.quantize(_mlp, p, x, recipe="int8", exclude=bad)
    with pytest.raises(ValueError, match=r"`exclude` must hold valid regexes, got '\(\('"):
        jaxmp.quantize(_mlp, p, x, recipe="int8", exclude=["w1", "(("])


def test_int4_leaves_a_weight_whose_contraction_is_not_a_multiple_of_the_group():
    p, x = _mlp_params(), jnp.ones((2, 64), jnp.bfloat16)
    plan = jaxmp.quantization_plan(_mlp, p, x, recipe=jaxmp.Int4WeightOnly(group_size=128))
    reasons = {leaf.path: leaf.reason for leaf in plan}
    assert reasons["w1"] == "contraction size 64 is not a multiple of group_size 128"
    assert "matmul weight" in reasons["w2"]


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_weight_is_reported_with_its_path(bad):
    p, x = _mlp_params(jnp.float32), jnp.ones((2, 64))
    p["w2"] = p["w2"].at[5, 7].set(bad)
    with pytest.raises(
        ValueError,
        match=r"`params` leaf 'w2' holds NaN or inf \(1 of 4096 "
        r"values, the first at index \(5, 7\)",
    ):
        jaxmp.quantize(_mlp, p, x, recipe="int8")


# --------------------------------------------------------------------------------------------
# Attacks: the library's guarantees with quantised params (non-finite values, extreme
# magnitudes, every float dtype, strict promotion, jax_debug_nans, transformation orders,
# differentiation, bad arguments).


def _one_matmul(p, x):
    return x @ p["w"]


def _attack_weight(dtype):
    """Normal weights and columns made to be read exactly: all ones, all zeros (an all-zero
    channel: 0 * inf), alternating +-1 (a sum of 0) and 1/64."""
    w = np.random.default_rng(8).normal(size=(64, 8)).astype(np.float32) / 8
    w[:, 2], w[:, 3], w[:, 4], w[:, 5] = 1.0, 0.0, np.resize([1.0, -1.0], 64), 1 / 64
    return {"w": jnp.asarray(w, dtype)}


HALF_AND_SINGLE = [jnp.float16, jnp.bfloat16, jnp.float32]
HALF_AND_SINGLE_IDS = ["float16", "bfloat16", "float32"]


@pytest.mark.parametrize(
    ("name", "dtype"),
    diagonal_cases(list(RECIPES), HALF_AND_SINGLE, list(RECIPES), HALF_AND_SINGLE_IDS),
)
def test_nonfinite_activations_give_nonfinite_outputs(name, dtype):
    # As FP8 autocast: quantisation never turns a NaN or an overflow into a finite number
    # (a row's NaN must not vanish into a scale of 1), nor a finite value into NaN.
    p = _attack_weight(dtype)
    x = jax.random.normal(jax.random.key(9), (4, 64)).astype(dtype)
    x = x.at[0, 5].set(jnp.nan).at[1, 6].set(jnp.inf).at[2, 7].set(-jnp.inf)
    q = jaxmp.quantize(_one_matmul, p, x, recipe=RECIPES[name])
    y = jax.jit(jaxmp.quantized(_one_matmul))(q, x)
    ref = _one_matmul(p, x)
    assert y.dtype == ref.dtype
    np.testing.assert_array_equal(
        np.isfinite(np.asarray(y, np.float32)), np.isfinite(np.asarray(ref, np.float32))
    )
    assert not np.isfinite(np.asarray(y, np.float32)[:3]).any()
    assert np.isnan(np.asarray(y, np.float32)[0]).all()  # NaN stays NaN, not inf


@pytest.mark.parametrize(
    ("name", "dtype"),
    diagonal_cases(list(RECIPES), HALF_AND_SINGLE, list(RECIPES), HALF_AND_SINGLE_IDS),
)
def test_extreme_finite_activations_and_a_zero_row(name, dtype):
    p = _attack_weight(dtype)
    rows = np.ones((6, 64), np.float32) * np.array([[1.0], [1e20], [1e-30], [0.0], [3e4], [1e-45]])
    rows[0] = np.random.default_rng(10).normal(size=64)
    x = jnp.asarray(rows).astype(dtype)  # float16: 1e20 is inf, 1e-30 is 0
    q = jaxmp.quantize(_one_matmul, p, x, recipe=RECIPES[name])
    y = np.asarray(jax.jit(jaxmp.quantized(_one_matmul))(q, x), np.float32)
    ref = np.asarray(_one_matmul(p, x), np.float32)
    # float16: 3e4 times a column of ones overflows in both, 3e4 / 64 does not.
    np.testing.assert_array_equal(np.isfinite(y), np.isfinite(ref))
    assert not np.isnan(y[2:]).any()  # tiny and zero rows: no 0 / 0 in a scale
    np.testing.assert_array_equal(y[3], 0.0)
    for i in (0, 1, 2, 4):
        if np.isfinite(ref[i]).all() and np.abs(ref[i]).max() > 0:
            assert _rel_err(y[i], ref[i]) < MODEL_TOLERANCE[name], i


def test_float64_model_keeps_float64_range_and_dtype():
    # Scales and accumulation follow the model: float32 scales would overflow at 1e300 and
    # round 1e-300 to zero.
    with jax.enable_x64(True):
        w = _attack_weight(jnp.float64)["w"]
        x = jax.random.normal(jax.random.key(11), (3, 64), jnp.float64)
        for name, recipe in RECIPES.items():
            for w_scale, x_scale in ((1e300, 1e-300), (1e-300, 1e300), (1.0, 1e300)):
                p = {"w": w * w_scale}
                q = jaxmp.quantize(_one_matmul, p, x, recipe=recipe)
                with jax.numpy_dtype_promotion("strict"):
                    y = jax.jit(jaxmp.quantized(_one_matmul))(q, x * x_scale)
                ref = _one_matmul(p, x * x_scale)
                assert y.dtype == ref.dtype == jnp.float64
                assert np.isfinite(np.asarray(ref)).all() and np.isfinite(np.asarray(y)).all()
                err = _rel_err(y / (w_scale * x_scale), ref / (w_scale * x_scale))
                assert err < MODEL_TOLERANCE[name], (name, w_scale, x_scale)


def _mixed_leaves(p, x):
    h = x @ p["w"].astype(x.dtype) + p["b"].astype(x.dtype)
    return h * p["n"], p["step"], p["mask"], p["z"]


@pytest.mark.parametrize("x_dtype", HALF_AND_SINGLE)
@pytest.mark.parametrize("p_dtype", HALF_AND_SINGLE)
def test_dtypes_and_untouched_leaves_under_strict_promotion(p_dtype, x_dtype):
    p = {
        "w": _attack_weight(p_dtype)["w"],
        "b": jnp.ones((8,), p_dtype),
        "n": 3,  # a Python int
        "step": jnp.asarray(3, jnp.int32),
        "mask": jnp.ones((4,), bool),
        "z": jnp.ones((2,), jnp.complex64),
    }
    x = jax.random.normal(jax.random.key(12), (2, 64)).astype(x_dtype)
    for name, recipe in RECIPES.items():
        with jax.numpy_dtype_promotion("strict"):
            q = jaxmp.quantize(_mixed_leaves, p, x, recipe=recipe)
            outs = jax.jit(jaxmp.quantized(_mixed_leaves))(q, x)
            refs = _mixed_leaves(p, x)
        assert isinstance(q["w"], jaxmp.QuantizedArray) and q["w"].dtype == p_dtype
        for key in ("b", "n", "step", "mask", "z"):
            assert q[key] is p[key], (name, key)
        assert [o.dtype for o in outs] == [r.dtype for r in refs], name
        assert _rel_err(outs[0], refs[0]) < MODEL_TOLERANCE[name], name


def test_debug_nans_reports_no_false_nan():
    # All-zero weight channels, all-zero int4 groups and an all-zero activation row: each
    # scale is 1 there, never 0 / 0.
    p = _attack_weight(jnp.float32)
    x = jax.random.normal(jax.random.key(13), (3, 64)).at[1].set(0.0)
    for recipe in RECIPES.values():
        q = jaxmp.quantize(_one_matmul, p, x, recipe=recipe)
        with jax.debug_nans(True):
            y = jax.jit(jaxmp.quantized(_one_matmul))(q, x)
            jaxmp.quantized(_one_matmul)(q, jnp.zeros_like(x))
            jax.block_until_ready(y)
        assert np.isfinite(np.asarray(y)).all()


@pytest.mark.parametrize("name", list(RECIPES))
def test_transformation_orders(name):
    layers = {"w": jax.random.normal(jax.random.key(14), (3, 64, 64)) / 8}
    x = jax.random.normal(jax.random.key(15), (4, 64))

    def layer(p, h):
        return jnp.tanh(h @ p["w"])

    def stack(ps, h):
        return lax.scan(lambda c, p: (layer(p, c), None), h, ps)[0]

    q = jaxmp.quantize(stack, layers, x, recipe=RECIPES[name])
    run = jaxmp.quantized(stack)
    y = run(q, x)
    assert _rel_err(y, stack(layers, x)) < MODEL_TOLERANCE[name]
    run_layer = jaxmp.quantized(layer)
    jit_layer = jax.jit(run_layer)
    orders = {
        "jit(vmap)": jax.jit(jax.vmap(run, in_axes=(None, 0)))(q, x[:, None])[:, 0],
        "vmap(jit)": jax.vmap(jax.jit(run), in_axes=(None, 0))(q, x[:, None])[:, 0],
        "vmap(vmap)": jax.vmap(jax.vmap(run, in_axes=(None, 0)), in_axes=(None, 0))(
            q, x[:, None, None]
        )[:, 0, 0],
        "jit(scan) over the layers": jax.jit(
            lambda q, h: lax.scan(lambda c, p: (run_layer(p, c), None), h, q)[0]
        )(q, x),
        "scan(jit) over the layers": lax.scan(lambda c, p: (jit_layer(p, c), None), x, q)[0],
        "jit(jit)": jax.jit(jax.jit(run))(q, x),
    }
    for order, out in orders.items():
        np.testing.assert_allclose(
            np.asarray(out), np.asarray(y), rtol=1e-5, atol=1e-5, err_msg=order
        )


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_the_derivative_with_respect_to_the_inputs_of_a_weight_only_model(name):
    # The quantised weights are constants there: the derivative with respect to the inputs
    # is well defined (saliency maps, adversarial examples), the exact one of the quantised
    # model's computation, forward and reverse, under jit and vmap.
    p, x = _mlp_params(jnp.float32), jax.random.normal(jax.random.key(3), (2, 64))
    q = jaxmp.quantize(_mlp, p, x, recipe=RECIPES[name])
    run = jaxmp.quantized(_mlp)
    served = jax.extend.core.jaxpr_as_fun(run.jaxpr(q, x))
    leaves = jax.tree.leaves(q)

    def reference(x):  # the same computation, without the rule around it
        return served(*leaves, x)[0].sum()

    expected = jax.grad(reference)(x)
    assert float(jnp.abs(expected).max()) > 0
    # The same derivative, up to the order XLA sums in (float32's tolerance).
    assert_close(jax.grad(lambda x: run(q, x).sum())(x), expected, jnp.float32)
    assert_close(jax.jit(jax.grad(lambda x: run(q, x).sum()))(x), expected, jnp.float32)
    per_example = jax.vmap(jax.grad(lambda xi: run(q, xi[None]).sum()))(x)
    assert_close(per_example, expected, jnp.float32)
    _, tangent = jax.jvp(lambda x: run(q, x).sum(), (x,), (jnp.ones_like(x),))
    np.testing.assert_allclose(float(tangent), float(expected.sum()), rtol=1e-5)


@pytest.mark.parametrize("name", list(RECIPES))
def test_derivatives_with_respect_to_quantised_weights_are_refused(name):
    # Rounding to the int8/E4M3/int4 grid has no useful derivative: a derivative flowing
    # into the quantised weights is an error pointing at quantization-aware training, never
    # a silently zero or wrong gradient.
    p, x = _mlp_params(jnp.float32), jnp.ones((2, 64))
    q = jaxmp.quantize(_mlp, p, x, recipe=RECIPES[name])
    run = jaxmp.quantized(_mlp)
    message = r"jaxmp.quantized\(_mlp\) cannot be differentiated with respect to its quantised"
    with pytest.raises(TypeError, match=message):
        jax.grad(lambda q: run(q, x).sum(), allow_int=True)(q)
    with pytest.raises(TypeError, match="jaxmp.quantization_aware"):
        jax.jit(jax.grad(lambda s: run(jax.tree.map(lambda a: a * s, q), x).sum()))(1.0)
    # A derivative that does not flow through the quantised model is fine.
    y = run(q, x)
    g = jax.grad(lambda t: t * lax.stop_gradient(run(q, x)).sum() + t * run(q, x).sum())(2.0)
    np.testing.assert_allclose(float(g), 2 * float(y.sum()), rtol=1e-5)


@pytest.mark.parametrize("name", ["int8_dynamic", "fp8"])
def test_derivatives_through_quantised_activations_are_refused(name):
    # The dynamic recipes round the activations too: the derivative with respect to the
    # inputs would be that of rounding (zero almost everywhere) and of the row scales.
    p, x = _mlp_params(jnp.float32), jnp.ones((2, 64))
    q = jaxmp.quantize(_mlp, p, x, recipe=RECIPES[name])
    run = jaxmp.quantized(_mlp)
    message = r"quantises the activations too .* weight-only recipe .*quantization_aware"
    with pytest.raises(TypeError, match=message):
        jax.grad(lambda x: run(q, x).sum())(x)
    with pytest.raises(TypeError, match=message):
        jax.jvp(lambda x: run(q, x), (x,), (x,))


def test_quantising_twice_is_an_error_naming_the_leaf():
    p, x = _mlp_params(), jnp.ones((2, 64), jnp.bfloat16)
    q = jaxmp.quantize(_mlp, p, x, recipe="int8")
    message = r"`params` leaf 'w1' is already quantised \(QuantizedArray\(int8, shape=\(64, 128\)"
    for fun in (_mlp, jaxmp.quantized(_mlp)):
        with pytest.raises(ValueError, match=message):
            jaxmp.quantize(fun, q, x, recipe="int4")
        with pytest.raises(ValueError, match=message):
            jaxmp.quantization_plan(fun, q, x, recipe="int8")


def test_weak_typed_leaves_under_jit_and_strict_promotion():
    # Under jax.jit a Python scalar leaf is a weakly typed tracer; the plan's trace of the
    # function must see it so (an int32 times a float16 is an error under strict promotion,
    # a weak int is not).
    p = {"w": _attack_weight(jnp.float32)["w"], "n": 3}
    x = jax.random.normal(jax.random.key(12), (2, 64)).astype(jnp.float16)

    def f(p, x):
        return (x @ p["w"].astype(x.dtype)) * p["n"]

    with jax.numpy_dtype_promotion("strict"):
        q = jax.jit(lambda p, x: jaxmp.quantize(f, p, x, recipe="int8"))(p, x)
        plan = jaxmp.quantization_plan(f, p, x, recipe="int8")
    assert isinstance(q["w"], jaxmp.QuantizedArray) and plan[0].quantized


def test_int4_dequantize_keeps_the_axes_of_a_weight_of_three_axes():
    # An attention projection (d_model, heads, head_dim) contracting its first axis: the
    # values are stored by output channel (heads, head_dim, d_model); dequantised, the weight
    # has its own shape and values again.
    w = jnp.asarray(_weights((64, 96)).reshape(64, 4, 24))
    q = leaf_lib.quantize_array(w, (0,), RECIPES["int4"])
    assert q.shape == (64, 4, 24)
    deq = q.dequantize()
    assert deq.shape == (64, 4, 24)
    two_axes = leaf_lib.quantize_array(w.reshape(64, 96), (0,), RECIPES["int4"]).dequantize()
    np.testing.assert_array_equal(np.asarray(deq).reshape(64, 96), np.asarray(two_axes))


def test_the_plan_says_what_a_leaf_that_is_not_quantised_is():
    # Followed through the layout ops before the op that uses it (a Flax bias is reshaped,
    # then added): the reason names the use, not the reshape.
    class Model(linen.Module):
        @linen.compact
        def __call__(self, tokens):
            h = linen.LayerNorm()(linen.Embed(10, 8)(tokens))
            return linen.Dense(4)(h)

    model = Model()
    tokens = jnp.zeros((2,), jnp.int32)
    variables = model.init(jax.random.key(0), tokens)
    plan = {
        leaf.path: leaf.reason
        for leaf in jaxmp.quantization_plan(model.apply, variables, tokens, recipe="int8")
    }
    bias = "not a matmul weight: added to another value (as a bias is; after reshape)"
    assert plan["params/Dense_0/bias"] == plan["params/LayerNorm_0/bias"] == bias
    assert plan["params/LayerNorm_0/scale"] == (
        "not a matmul weight: multiplied by another value (as a scale is; after reshape)"
    )
    assert plan["params/Embed_0/embedding"] == "not a matmul weight: read by gather (an embedding)"
    assert plan["params/Dense_0/kernel"] == "matmul weight, contracted over axes (0,)"

    def tied(p, tokens):
        return p["embed"][tokens] @ p["embed"].T

    (leaf,) = jaxmp.quantization_plan(tied, {"embed": jnp.ones((10, 8))}, tokens, recipe="int8")
    assert leaf.reason == "a matmul weight also read by gather (an embedding)"

    def reshaped(p, x):
        return x @ p["w"].reshape(8, 4)

    (leaf,) = jaxmp.quantization_plan(
        reshaped, {"w": jnp.ones(32)}, jnp.ones((1, 8)), recipe="int8"
    )
    assert leaf.reason == (
        "not a matmul weight: reshaped, sliced or broadcast before its matmul (reshape)"
    )


def test_plan_reasons_claim_no_activations_for_params_combined_with_params():
    # A masked weight, a low-rank update, a normalised weight and a fused projection sliced
    # into three: each is left alone, and no reason calls the other operand activations.
    x = jnp.ones((2, 32))
    w, mask = jnp.ones((32, 8)), jnp.ones((32, 8))
    cases = {
        "masked": (lambda p, x: x @ (p["w"] * p["mask"]), {"w": w, "mask": mask}),
        "lora": (
            lambda p, x: x @ (p["w"] + p["a"] @ p["b"]),
            {"w": w, "a": jnp.ones((32, 2)), "b": jnp.ones((2, 8))},
        ),
        "normalised": (lambda p, x: x @ (p["w"] / jnp.linalg.norm(p["w"], axis=0)), {"w": w}),
        "sliced": (lambda p, x: sum(x @ p["w"][:, 4 * i : 4 * i + 4] for i in range(2)), {"w": w}),
    }
    reasons = {}
    for name, (fun, params) in cases.items():
        plan = jaxmp.quantization_plan(fun, params, x, recipe="int8")
        reasons[name] = {leaf.path: leaf.reason for leaf in plan}
        assert not any("activations" in r for r in reasons[name].values()), reasons[name]
    assert (
        reasons["masked"]["w"] == "not a matmul weight: multiplied by another value (as a scale is)"
    )
    assert reasons["lora"]["w"] == "not a matmul weight: added to another value (as a bias is)"
    assert reasons["lora"]["a"] == "matmul weight, contracted over axes (1,)"
    assert "in a division (as a scale is)" in reasons["normalised"]["w"]
    assert reasons["sliced"]["w"] == (
        "not a matmul weight: reshaped, sliced or broadcast before its matmul (slice)"
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("spec", ["ebd,edf->ebf", "bhd,hde->bhe", "bhd,dhe->bhe", "hbd,hde->bhe"])
def test_batched_matmuls_with_batch_axes_anywhere(spec, dtype):
    # Per-expert and per-head weights: the batch axes leading or not, in the activations and
    # in the weight (XLA:CPU has no batched bfloat16 x bfloat16 -> float32 dot for some of
    # these layouts: the kernels move the batch axes first).
    shapes = {"e": 4, "b": 8, "d": 128, "f": 64, "h": 4}
    x_spec, w_spec = spec.split("->")[0].split(",")
    rng = np.random.default_rng(0)
    p = {"w": jnp.asarray(rng.normal(size=[shapes[c] for c in w_spec]) / 11, dtype)}
    x = jnp.asarray(rng.normal(size=[shapes[c] for c in x_spec]), dtype)

    def fun(p, x):
        return jnp.einsum(spec, x, p["w"])

    ref = fun(p, x)
    for name, recipe in RECIPES.items():
        q = jaxmp.quantize(fun, p, x, recipe=recipe)
        assert isinstance(q["w"], jaxmp.QuantizedArray), name
        y = jax.jit(jaxmp.quantized(fun))(q, x)
        assert y.dtype == dtype and y.shape == ref.shape
        assert _rel_err(y, ref) < MODEL_TOLERANCE[name], name


@pytest.mark.parametrize("recipe", ["int8", "int4"])
def test_example_args_given_as_shapes(recipe):
    # As the docstring says: an example argument may be a jax.ShapeDtypeStruct (positional
    # or keyword), with the same result as an array of that shape.
    def fun(p, x, *, scale):
        return (x @ p["w"] + p["b"]) * scale

    rng = np.random.default_rng(0)
    p = {"w": jnp.asarray(rng.normal(size=(128, 8)), jnp.float32), "b": jnp.zeros(8)}
    x, scale = jnp.ones((2, 128)), jnp.ones(())
    shapes = jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((), jnp.float32)
    from_arrays = jaxmp.quantize(fun, p, x, recipe=recipe, scale=scale)
    from_shapes = jaxmp.quantize(fun, p, shapes[0], recipe=recipe, scale=shapes[1])
    assert jax.tree.structure(from_shapes) == jax.tree.structure(from_arrays)
    for a, b in zip(jax.tree.leaves(from_shapes), jax.tree.leaves(from_arrays), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    plan = jaxmp.quantization_plan(fun, p, shapes[0], recipe=recipe, scale=shapes[1])
    assert [leaf.quantized for leaf in plan] == [False, True]
