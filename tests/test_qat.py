"""Tests of jaxmp.quantization_aware: the serving numerics in the forward pass, bit for bit, and
the straight-through gradient, under every transformation and with the rest of jaxmp."""

import equinox as eqx
import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import jaxmp
from jaxmp._src.quantization import recipes as q_lib
from tests.conftest import JAXLIB_VERSION, assert_close, diagonal_cases
from tests.test_quantize import _NnxModel, _weights, model_lib
from tests.test_quantize_conv import _random_variables

RECIPES = {
    "int8": jaxmp.Int8WeightOnly(),
    "int8_dynamic": jaxmp.Int8DynamicActivations(),
    "fp8": jaxmp.Float8Rowwise(),
    "int4": jaxmp.Int4WeightOnly(group_size=32),
}
NAMES = list(RECIPES)
WEIGHT_ONLY = ("int8", "int4")
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
DTYPE_IDS = ["float32", "bfloat16", "float16"]


def _one_by_default(default):
    """Every recipe; only `default` in the default run (the others marked slow)."""
    return [pytest.param(n, marks=[] if n == default else [pytest.mark.slow]) for n in NAMES]


def _mlp(p, x):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return h @ p["w2"]


def _mlp_params(dtype=jnp.float32):
    w1 = _weights((64, 128), seed=1) / 8  # outlier rows and channels, an all-zero channel
    w2 = np.random.default_rng(2).normal(size=(128, 32)) / 11
    return {
        "w1": jnp.asarray(w1, dtype),
        "b1": jnp.full((128,), 0.1, dtype),
        "w2": jnp.asarray(w2, dtype),
    }


def _x(dtype=jnp.float32, shape=(8, 64), seed=3):
    return jax.random.normal(jax.random.key(seed), shape).astype(dtype)


def assert_bits(actual, expected, what=""):
    """Bit for bit: the same dtype, shape and bytes (a NaN equals itself, -0 is not 0)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    assert actual.tobytes() == expected.tobytes(), (
        f"{what}: {np.sum(actual != expected)} of {actual.size} values differ; largest "
        f"difference {np.nanmax(np.abs(actual.astype(np.float64) - expected))}"
    )


# XLA:CPU before jaxlib 0.12 may compile two programs' equal matmuls differently (a weight
# quantised inside the program fused into the matmul's loop in one, read from memory in the
# other) and round the last bits of some outputs differently. (Bit for bit on 0.12.0 and
# 0.12.1.)
_FUSION_MAY_ROUND = JAXLIB_VERSION < (0, 12)


def assert_bits_of_programs(actual, expected, what=""):
    """`assert_bits` for the results of two different programs: bit for bit on jaxlib >=
    0.12; on older ones `assert_within_ulps` (see `_FUSION_MAY_ROUND`)."""
    if _FUSION_MAY_ROUND:
        assert_within_ulps(actual, expected, what)
    else:
        assert_bits(actual, expected, what)


def assert_within_ulps(actual, expected, what="", ulps=4):
    """The same dtype, shape, zeros and non-finite values, and the rest within `ulps` units in
    the last place of the largest value."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    assert np.array_equal(a == 0, e == 0) and np.array_equal(np.isfinite(a), np.isfinite(e)), what
    finite = np.isfinite(e)
    ulp = float(np.finfo(actual.dtype).eps) * np.abs(e[finite]).max(initial=0.0)
    assert np.abs(a[finite] - e[finite]).max(initial=0.0) <= ulps * ulp, what


def _served(fun, params, *args, recipe, exclude=()):
    """What serving runs: `quantize` of the params, then `quantized(fun)`."""
    q = jaxmp.quantize(fun, params, *args, recipe=recipe, exclude=exclude)
    return jaxmp.quantized(fun)(q, *args)


# --------------------------------------------------------------------------------------------
# The forward pass is what serves.


def _assert_forward_serves(qat, params, x, served):
    """`qat`'s forward pass is `served` bit for bit: eager, under jit, and as the value of a
    differentiated call. Returns that call's gradients."""
    assert_bits(qat(params, x), served, "eager")
    assert_bits(jax.jit(qat)(params, x), served, "jit")

    def loss(p):
        y = qat(p, x)
        return y.astype(jnp.float32).sum(), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    assert_bits(y, served, "value_and_grad")
    return grads


@pytest.mark.parametrize(("name", "dtype"), diagonal_cases(NAMES, DTYPES, NAMES, DTYPE_IDS))
def test_forward_is_bit_identical_to_serving(name, dtype):
    p, x = _mlp_params(dtype), _x(dtype)
    recipe = RECIPES[name]
    qat = jaxmp.quantization_aware(_mlp, recipe=recipe)
    served = _served(_mlp, p, x, recipe=recipe)
    _assert_forward_serves(qat, p, x, served)
    # and it is not the float model's.
    assert not np.array_equal(np.asarray(served), np.asarray(_mlp(p, x)))


@pytest.mark.parametrize("name", NAMES)
def test_the_quantize_method_serves_with_the_same_recipe_and_exclude(name):
    p, x = _mlp_params(), _x()
    qat = jaxmp.quantization_aware(_mlp, recipe=RECIPES[name], exclude=["w2"])
    q = qat.quantize(p, x)
    assert isinstance(q["w1"], jaxmp.QuantizedArray) and q["w1"].recipe == RECIPES[name]
    assert q["w2"] is p["w2"]
    assert_bits(jax.jit(qat)(p, x), jaxmp.quantized(_mlp)(q, x))
    assert qat.recipe == RECIPES[name] and qat.exclude == ("w2",)
    assert repr(qat) == f"jaxmp.quantization_aware(_mlp, recipe={RECIPES[name]!r}, exclude=('w2',))"


def test_a_recipe_name_is_the_recipe():
    p, x = _mlp_params(), _x()
    qat = jaxmp.quantization_aware(_mlp, recipe="int4")
    assert qat.recipe == jaxmp.Int4WeightOnly()
    p = {**p, "w1": jnp.asarray(_weights((128, 128)) / 8), "w2": p["w2"]}
    x = _x(shape=(4, 128))
    # w2 contracts 128: quantised; the same leaves as quantize, with the default group size.
    assert_bits(qat(p, x), _served(_mlp, p, x, recipe="int4"))


# --------------------------------------------------------------------------------------------
# The gradient: straight-through into the weights, exact (or straight-through, for quantised
# activations) into everything else.


def _fake_quantized_rows(x, recipe):
    """The activations the dynamic recipes' matmul reads, dequantised: each row rounded on
    the recipe's grid with its absmax scale."""
    scale = q_lib.absmax_scale(x, (1,), recipe.qmax)
    return (q_lib.quantize_values(x, scale, recipe).astype(scale.dtype) * scale).astype(x.dtype)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_weight_gradient_is_the_straight_through_gradient(name, dtype):
    # y = x @ w: the gradient of sum(y * c) with respect to w is that of the float matmul of
    # the activations the kernel reads, x^T c, as if rounding were the identity (STE), and
    # zero for a weight the grid clips (int4's scale may leave a group's largest values
    # outside [-8, 7] steps; the absmax scales clip nothing).
    recipe = RECIPES[name]
    w = jnp.asarray(_weights((64, 16)) / 8, dtype)
    x, c = _x(dtype, (8, 64)), _x(dtype, (8, 16), seed=4)

    def loss(w, model):
        return jnp.sum((model({"w": w}, x) * c).astype(jnp.float32))

    qat = jaxmp.quantization_aware(lambda p, x: x @ p["w"], recipe=recipe)
    got = jax.jit(jax.grad(loss, argnums=0), static_argnums=1)(w, lambda p, _: qat(p, x))
    x_read = x if name in WEIGHT_ONLY else _fake_quantized_rows(x, recipe)
    expected = jax.jit(jax.grad(loss), static_argnums=1)(w, lambda p, _: x_read @ p["w"])
    unclipped = _unclipped(w, qat.quantize({"w": w}, x)["w"])
    assert unclipped.all() == (name != "int4")  # int4 clips some of these weights
    expected = jnp.where(unclipped, expected, jnp.zeros_like(expected))
    assert got.dtype == dtype
    assert_bits_of_programs(got, expected)
    if name not in WEIGHT_ONLY:
        assert not np.array_equal(np.asarray(x_read), np.asarray(x))  # the rows were rounded


def _unclipped(w, q):
    """numpy's: where `w` (contracted over its first axis) rounds inside its grid's range,
    with the scales of its quantised form `q`."""
    w = np.asarray(w, np.float32)
    scales = np.asarray(q.scales)
    if q.recipe.name != "int4":  # one scale per output channel
        return np.abs(np.round(w / scales)) <= q.recipe.qmax
    step = np.repeat(scales.T, q.recipe.group_size, axis=0)  # (groups, channels) -> w's shape
    r = np.round(w / step)
    return (r >= -8) & (r <= 7)


@pytest.mark.parametrize(
    ("name", "dtype"), diagonal_cases(list(WEIGHT_ONLY), DTYPES, list(WEIGHT_ONLY), DTYPE_IDS)
)
def test_input_gradient_of_weight_only_recipes_is_the_exact_derivative(name, dtype):
    # With the weight a constant, the quantised forward is differentiable in the input and
    # the bias: the derivative JAX takes of the serving program itself.
    recipe = RECIPES[name]
    p, x, c = _mlp_params(dtype), _x(dtype), _x(dtype, (8, 32), seed=5)
    qat = jaxmp.quantization_aware(_mlp, recipe=recipe)
    q = jaxmp.quantize(_mlp, p, x, recipe=recipe)
    closed = jaxmp.quantized(_mlp).jaxpr(q, x)
    serve = jax.extend.core.jaxpr_as_fun(closed)
    q_leaves = [*jax.tree.leaves(q["b1"]), *jax.tree.leaves(q["w1"]), *jax.tree.leaves(q["w2"])]

    def served(b1, x):  # jaxpr inputs: b1, w1's values and scales, w2's, x
        return serve(b1, *q_leaves[1:], x)[0]

    def loss(y):
        return jnp.sum((y * c).astype(jnp.float32))

    got_b, got_x = jax.jit(jax.grad(lambda b, x: loss(qat({**p, "b1": b}, x)), (0, 1)))(p["b1"], x)
    exp_b, exp_x = jax.jit(jax.grad(lambda b, x: loss(served(b, x)), (0, 1)))(p["b1"], x)
    # The same derivative; XLA may order the sums of a matmul of an operand computed in the
    # program (the weight quantised in training) otherwise than of one given as an argument.
    assert got_x.dtype == exp_x.dtype == got_b.dtype == dtype
    assert_close(got_x, exp_x, dtype)
    assert_close(got_b, exp_b, dtype)


@pytest.mark.parametrize("name", ["int8_dynamic", "fp8"])
def test_input_gradient_of_activation_recipes_is_straight_through(name):
    # Rounding the activations has a derivative of zero: their gradient is straight-through
    # too (as in torchao's QAT), c w^T with the weight as served.
    recipe = RECIPES[name]
    p, x, c = {"w": jnp.asarray(_weights((64, 16)))}, _x(), _x(shape=(8, 16), seed=4)
    qat = jaxmp.quantization_aware(lambda p, x: x @ p["w"], recipe=recipe)
    w_served = jaxmp.quantize(lambda p, x: x @ p["w"], p, x, recipe=recipe)["w"].dequantize()
    got = jax.jit(jax.grad(lambda x: jnp.sum(qat(p, x) * c)))(x)
    expected = jax.jit(jax.grad(lambda x: jnp.sum((x @ w_served) * c)))(x)
    assert_bits(got, expected)
    assert np.abs(np.asarray(got)).min() > 0  # not the zero derivative of rounding


def test_forward_mode_agrees_with_reverse_mode():
    p, x = _mlp_params(), _x()
    qat = jaxmp.quantization_aware(_mlp, recipe="int8_dynamic")

    def loss(p):
        return jnp.sum(qat(p, x) ** 2)

    grads = jax.grad(loss)(p)
    tangent = jax.tree.map(lambda g: jnp.ones_like(g) / g.size, p)
    _, jvp = jax.jvp(loss, (p,), (tangent,))
    dot = sum(
        jnp.vdot(g, t)
        for g, t in zip(jax.tree.leaves(grads), jax.tree.leaves(tangent), strict=True)
    )
    np.testing.assert_allclose(float(jvp), float(dot), rtol=1e-5)


# --------------------------------------------------------------------------------------------
# Transformation orders.


def _layer(p, h):
    return jnp.tanh(h @ p["w"])


def _stack(ps, h):
    return lax.scan(lambda c, p: (_layer(p, c), None), h, ps)[0]


def _remat_stack(ps, h):
    return lax.scan(lambda c, p: (jax.checkpoint(_layer)(p, c), None), h, ps)[0]


# One recipe in the default run (each compiles a dozen programs); every one with the slow tests.
@pytest.mark.parametrize("name", _one_by_default("int8_dynamic"))
def test_transformation_orders(name):
    recipe = RECIPES[name]
    layers = {"w": jax.random.normal(jax.random.key(14), (3, 64, 64)) / 8}
    x = _x(shape=(4, 64))
    qat = jaxmp.quantization_aware(_stack, recipe=recipe)

    def loss(fn):
        return lambda ps, x: jnp.sum(fn(ps, x) ** 2)

    y = qat(layers, x)
    assert_bits(y, _served(_stack, layers, x, recipe=recipe), "scan over a stacked leaf")
    g = jax.grad(loss(qat))(layers, x)
    assert np.isfinite(np.asarray(g["w"])).all() and np.abs(np.asarray(g["w"])).max() > 0
    qat_layer = jaxmp.quantization_aware(_layer, recipe=recipe)

    def scanned_by_the_caller(ps, x):
        return lax.scan(lambda c, p: (qat_layer(p, c), None), x, ps)[0]

    orders = {
        "jit(grad)": jax.jit(jax.grad(loss(qat)))(layers, x),
        "grad(jit)": jax.grad(loss(jax.jit(qat)))(layers, x),
        "grad(remat)": jax.grad(loss(jax.checkpoint(qat)))(layers, x),
        "remat inside": jax.grad(loss(jaxmp.quantization_aware(_remat_stack, recipe=recipe)))(
            layers, x
        ),
        "grad(vmap) over the batch": jax.grad(
            lambda ps, x: jnp.sum(jax.vmap(qat, in_axes=(None, 0))(ps, x[:, None]) ** 2)
        )(layers, x),
        "scan(qat) over the layers": jax.grad(loss(scanned_by_the_caller))(layers, x),
        "jit(scan(qat))": jax.jit(jax.grad(loss(scanned_by_the_caller)))(layers, x),
    }
    for order, grads in orders.items():
        assert_bits(grads["w"], g["w"], order)
    # vmap of the gradient over examples: each example's own gradient.
    per_example = jax.vmap(jax.grad(loss(qat)), in_axes=(None, 0))(layers, x[:, None])
    for i in range(4):
        one = jax.grad(loss(qat))(layers, x[i : i + 1])["w"]
        # A batched program: three layers' sums in another order. On jaxlib 0.12, within the
        # float32 tolerance; older XLA:CPU, fusing differently, reached 6.8 ulps of the
        # largest value (int4, jaxlib 0.8.2), past that tolerance near zero.
        if _FUSION_MAY_ROUND:
            assert_within_ulps(per_example["w"][i], one, f"example {i}", ulps=8)
        else:
            assert_close(per_example["w"][i], one, jnp.float32)
    # vmap over the params: each copy quantised on its own.
    copies = jax.tree.map(lambda w: jnp.stack([w, 2 * w]), layers)
    both = jax.jit(jax.vmap(qat, in_axes=(0, None)))(copies, x)
    assert_bits(both[0], y, "vmap over params, first copy")
    assert_bits(both[1], qat(jax.tree.map(lambda w: 2 * w, layers), x), "second copy")


# --------------------------------------------------------------------------------------------
# With the rest of jaxmp: mixed precision and loss scaling, autocast.


def _float16_model(p, x):
    p16 = jax.tree.map(lambda w: w.astype(jnp.float16), p)
    return _mlp(p16, x.astype(jnp.float16)).astype(jnp.float32)


@pytest.mark.parametrize("name", _one_by_default("int4"))
def test_float16_loss_scaling_scales_through_and_skips_bit_identically(name):
    qat = jaxmp.quantization_aware(_float16_model, recipe=RECIPES[name])
    p = _mlp_params()
    tx = jaxmp.mixed_precision(
        optax.adam(1e-3), "mixed_float16", jaxmp.DynamicLossScale(jnp.float32(2.0**15))
    )

    @jax.jit
    def step(p, opt_state, x):
        def loss_fn(p):
            return jnp.mean(qat(p, x) ** 2)

        loss, grads = jaxmp.value_and_grad(loss_fn)(jaxmp.get_loss_scale(opt_state), p)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss, grads

    x = _x()
    opt_state = tx.init(p)
    # The scaled loss's gradient flows through the straight-through estimator: at 2^15 it is
    # 32 times that at 2^10, bit for bit (float16 gradients far from overflow and underflow).
    at_2_10 = jaxmp.value_and_grad(lambda p: jnp.mean(qat(p, x) ** 2))(
        jaxmp.StaticLossScale(2.0**10), p
    )[1]
    new_p, new_state, loss, grads = step(p, opt_state, x)
    for key in ("w1", "w2", "b1"):
        assert_bits_of_programs(grads[key], at_2_10[key] * 32, key)
    assert bool(jaxmp.loss_scale_metrics(new_state)["grads_finite"])
    assert not np.array_equal(np.asarray(new_p["w1"]), np.asarray(p["w1"]))
    # 1e5 is inf in float16: the loss is not finite, the step is skipped, and the params and
    # the optimizer's state are bit for bit what they were.
    skipped_p, skipped_state, loss, _ = step(new_p, new_state, x.at[0, 0].set(1e5))
    assert not np.isfinite(float(loss))
    metrics = jaxmp.loss_scale_metrics(skipped_state)
    assert not bool(metrics["grads_finite"]) and float(metrics["loss_scale"]) == 2.0**14
    for key in p:
        assert_bits(skipped_p[key], new_p[key], key)
    before = jaxmp.inner_state(new_state)
    after = jaxmp.inner_state(skipped_state)
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        assert_bits(a, b, "optimizer state")


@pytest.mark.parametrize("name", _one_by_default("fp8"))
def test_quantization_aware_autocast_serves_as_quantized_autocast(name):
    # Autocast first (the model in bfloat16), then quantisation-aware training of that
    # function; it is served as quantized(autocast(model)).
    recipe = RECIPES[name]
    f = jaxmp.autocast(_mlp, "mixed_bfloat16")
    p, x = _mlp_params(), _x()
    qat = jaxmp.quantization_aware(f, recipe=recipe)
    y = jax.jit(qat)(p, x)
    assert y.dtype == jnp.float32  # the policy's output dtype
    assert_bits(y, _served(f, p, x, recipe=recipe))
    g = jax.jit(jax.grad(lambda p: jnp.sum(qat(p, x) ** 2)))(p)
    assert {k: v.dtype for k, v in g.items()} == {k: jnp.dtype(jnp.float32) for k in p}
    assert all(np.isfinite(np.asarray(v)).all() for v in g.values())


@pytest.mark.parametrize("name", _one_by_default("int8"))
def test_autocast_of_a_quantization_aware_function(name):
    # The other order: autocast re-interprets the quantisation-aware program, the kernels'
    # matmuls included (under its policy, as it would `jaxmp.quantized`'s); it runs, and its
    # derivative is the straight-through one.
    recipe = RECIPES[name]
    p16 = jax.tree.map(lambda w: w.astype(jnp.bfloat16), _mlp_params())
    x = _x(jnp.bfloat16)
    qat = jaxmp.quantization_aware(_mlp, recipe=recipe)
    outside = jaxmp.autocast(qat, "p=bf16,c=bf16,o=bf16")
    y = jax.jit(outside)(p16, x)
    assert y.dtype == jnp.bfloat16
    g = jax.jit(jax.grad(lambda p: jnp.sum(outside(p, x).astype(jnp.float32))))(p16)
    expected = jax.grad(lambda p: jnp.sum(qat(p, x).astype(jnp.float32)))(p16)
    # Autocast accumulates the kernels' matmuls in bfloat16 (float32 in the kernels): within
    # four bfloat16 steps of the largest value.
    for got, ref in ((y, qat(p16, x)), *((g[k], expected[k]) for k in p16)):
        got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
        assert np.abs(got - ref).max() <= 4 * 2.0**-7 * np.abs(ref).max()


# --------------------------------------------------------------------------------------------
# Linen, NNX, Equinox.


def _lm():
    # The main job's model: float32 params, bfloat16 compute (mixed_bfloat16).
    return model_lib.TransformerLM(
        vocab_size=40,
        max_len=16,
        num_layers=1,
        num_heads=2,
        d_model=64,
        mlp_ratio=2,
        dtype=jnp.bfloat16,
        param_dtype=jnp.float32,
        output_dtype=jnp.float32,
    )


# The main job's model trains with each recipe in tests/test_train.py too.
@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_linen_transformer_trains_what_serves(name):
    model, recipe = _lm(), RECIPES[name]
    tokens = jax.random.randint(jax.random.key(5), (2, 16), 0, 40)
    variables = model.init(jax.random.key(6), tokens)
    qat = jaxmp.quantization_aware(model.apply, recipe=recipe)
    tx = optax.adam(3e-3)

    @jax.jit
    def step(variables, opt_state):
        def loss_fn(v):
            return model_lib.cross_entropy(qat(v, tokens[:, :-1]), tokens[:, 1:])

        loss, grads = jax.value_and_grad(loss_fn)(variables)
        updates, opt_state = tx.update(grads, opt_state)
        return optax.apply_updates(variables, updates), opt_state, loss, grads

    opt_state = tx.init(variables)
    losses = []
    for _ in range(3):
        variables, opt_state, loss, grads = step(variables, opt_state)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    plan = jaxmp.quantization_plan(model.apply, variables, tokens, recipe=recipe)
    flat = dict(jax.tree_util.tree_flatten_with_path(grads)[0])
    by_path = {"/".join(k.key for k in path): g for path, g in flat.items()}
    assert sum(leaf.quantized for leaf in plan) == 7  # q, k, v, out, fc, proj, head
    for leaf in plan:
        g = np.asarray(by_path[leaf.path])
        assert np.isfinite(g).all() and np.abs(g).max() > 0, leaf.path
    # What the model learned is what serves.
    assert_bits(
        jax.jit(qat)(variables, tokens), _served(model.apply, variables, tokens, recipe=recipe)
    )


def test_nnx_module_state():
    # As with `quantize`: split the module, train its params through nnx.merge.
    graphdef, params, rest = nnx.split(_NnxModel(nnx.Rngs(0)), nnx.Param, ...)
    tokens = jnp.arange(16).reshape(2, 8) % 50

    def fun(params, x):
        return nnx.merge(graphdef, params, rest)(x)

    qat = jaxmp.quantization_aware(fun, recipe="int8_dynamic", exclude="head")
    served = _served(fun, params, tokens, recipe="int8_dynamic", exclude="head")
    assert_bits(jax.jit(qat)(params, tokens), served)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(qat(p, tokens) ** 2)))(params)
    for path in (("fc", "kernel"), ("attn", "query", "kernel"), ("head", "kernel")):
        g = grads
        for key in path:
            g = g[key]
        (g,) = jax.tree.leaves(g)
        assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).max() > 0, path


@pytest.mark.parametrize("name", _one_by_default("int8"))
def test_equinox_module_weight_on_the_left(name):
    # eqx.nn.Linear computes weight @ x: the weight is the left operand of its matmuls.
    mlp = eqx.nn.MLP(32, 8, 64, depth=2, key=jax.random.key(7))
    x = _x(shape=(32,))

    def fun(m, x):
        return m(x)

    qat = jaxmp.quantization_aware(fun, recipe=RECIPES[name])
    y = eqx.filter_jit(qat)(mlp, x)
    assert_bits_of_programs(y, _served(fun, mlp, x, recipe=RECIPES[name]))
    grads = eqx.filter_grad(lambda m: jnp.sum(qat(m, x) ** 2))(mlp)
    assert grads.layers[0].weight.shape == (64, 32)
    assert np.isfinite(np.asarray(grads.layers[0].weight)).all()
    assert np.abs(np.asarray(grads.layers[0].weight)).max() > 0


# --------------------------------------------------------------------------------------------
# exclude, errors.


def test_excluded_leaves_get_the_exact_gradient():
    p, x, c = _mlp_params(), _x(), _x(shape=(8, 32), seed=6)
    qat = jaxmp.quantization_aware(_mlp, recipe="int8", exclude=["w2"])
    q = jaxmp.quantize(_mlp, p, x, recipe="int8", exclude=["w2"])
    assert_bits(qat(p, x), jaxmp.quantized(_mlp)(q, x))
    closed = jaxmp.quantized(_mlp).jaxpr(q, x)
    serve = jax.extend.core.jaxpr_as_fun(closed)
    leaves = jax.tree.leaves(q)  # b1, w1's values and scales, w2

    got = jax.grad(lambda w2: jnp.sum(qat({**p, "w2": w2}, x) * c))(p["w2"])
    expected = jax.grad(lambda w2: jnp.sum(serve(*leaves[:3], w2, x)[0] * c))(p["w2"])
    assert_bits(got, expected)


def test_a_misspelt_exclude_pattern_is_the_error_of_quantize():
    p, x = _mlp_params(), _x()
    qat = jaxmp.quantization_aware(_mlp, recipe="int8", exclude=["w3"])
    with pytest.raises(ValueError) as expected:
        jaxmp.quantize(_mlp, p, x, recipe="int8", exclude=["w3"])
    with pytest.raises(ValueError) as got:
        qat(p, x)
    assert str(got.value) == str(expected.value)
    assert "`exclude` pattern 'w3' matches no floating leaf" in str(got.value)
    with pytest.raises(ValueError, match="matches no floating leaf"):
        jax.jit(jax.grad(lambda p: jnp.sum(qat(p, x))))(p)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"recipe": "int9"}, ValueError, "`recipe` must be one of 'int8', .* Did you mean 'int8'"),
        ({"recipe": jaxmp.Int8WeightOnly}, TypeError, "pass an instance"),
        ({"recipe": "int8", "exclude": 3}, TypeError, "`exclude`"),
        ({"recipe": "int8", "exclude": ["("]}, ValueError, "`exclude`"),
    ],
)
def test_bad_arguments_are_errors_at_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        jaxmp.quantization_aware(_mlp, **kwargs)


def test_fun_must_be_callable_and_recipe_is_required():
    with pytest.raises(TypeError, match="`fun` must be callable, got 3"):
        jaxmp.quantization_aware(3, recipe="int8")
    with pytest.raises(TypeError, match="recipe"):
        jaxmp.quantization_aware(_mlp)  # type: ignore[call-arg]


def test_quantised_params_are_an_error_naming_the_leaf():
    p, x = _mlp_params(), _x()
    q = jaxmp.quantize(_mlp, p, x, recipe="int8")
    with pytest.raises(ValueError, match=r"`params` leaf 'w1' is already quantised"):
        jaxmp.quantization_aware(_mlp, recipe="int8")(q, x)


# --------------------------------------------------------------------------------------------
# Attacks: extreme values, float64, strict promotion, leaves of every kind.


def _one_matmul(p, x):
    return x @ p["w"]


@pytest.mark.parametrize(("name", "dtype"), diagonal_cases(NAMES, DTYPES, NAMES, DTYPE_IDS))
def test_nonfinite_activations_stay_nonfinite(name, dtype):
    p = {"w": jnp.asarray(_weights((64, 8)) / 8, dtype)}
    x = _x(dtype, (4, 64)).at[0, 5].set(jnp.nan).at[1, 6].set(jnp.inf).at[2, 7].set(-jnp.inf)
    qat = jaxmp.quantization_aware(_one_matmul, recipe=RECIPES[name])
    y = np.asarray(jax.jit(qat)(p, x), np.float32)
    ref = np.asarray(_one_matmul(p, x), np.float32)
    np.testing.assert_array_equal(np.isfinite(y), np.isfinite(ref))
    assert not np.isfinite(y[:3]).any() and np.isnan(y[0]).all()
    # and the loss's gradient is not finite: a loss-scaled step is skipped.
    g = jax.grad(lambda p: jnp.sum(qat(p, x).astype(jnp.float32)))(p)
    assert not np.isfinite(np.asarray(g["w"], np.float32)).all()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_a_nonfinite_weight_gives_the_float_models_nonfinite_outputs(name, bad):
    # `quantize` refuses such a weight by name; in training it cannot raise (the weight is
    # traced), and a scale that is not finite must not make the output finite.
    w = np.asarray(_weights((64, 8)) / 8)
    w[5, 0] = bad
    p, x = {"w": jnp.asarray(w)}, _x(shape=(4, 64))
    qat = jaxmp.quantization_aware(_one_matmul, recipe=RECIPES[name])
    y = np.asarray(jax.jit(qat)(p, x))
    ref = np.asarray(_one_matmul(p, x))
    np.testing.assert_array_equal(np.isfinite(y), np.isfinite(ref))
    assert not np.isfinite(y[:, 0]).any() and np.isfinite(y[:, 1:]).all()


def test_float64_keeps_its_range_and_serves_bit_for_bit():
    with jax.enable_x64(True):
        w = jnp.asarray(_weights((64, 8)), jnp.float64)
        x = jax.random.normal(jax.random.key(11), (3, 64), jnp.float64)
        for name, recipe in RECIPES.items():
            for w_scale, x_scale in ((1e300, 1e-300), (1e-300, 1e300)):
                p = {"w": w * w_scale}
                qat = jaxmp.quantization_aware(_one_matmul, recipe=recipe)
                with jax.numpy_dtype_promotion("strict"):
                    y = jax.jit(qat)(p, x * x_scale)
                    g = jax.grad(lambda p, f=qat, s=x_scale: jnp.sum(f(p, x * s)))(p)
                assert y.dtype == g["w"].dtype == jnp.float64
                assert np.isfinite(np.asarray(y)).all() and np.isfinite(np.asarray(g["w"])).all()
                assert_bits(y, _served(_one_matmul, p, x * x_scale, recipe=recipe), name)


def _mixed_leaves(p, x):
    h = x @ p["w"].astype(x.dtype) + p["b"].astype(x.dtype)
    return h * p["n"], p["step"], p["mask"], p["z"]


@pytest.mark.parametrize(("name", "dtype"), diagonal_cases(NAMES, DTYPES, NAMES, DTYPE_IDS))
def test_leaves_of_every_kind_under_strict_promotion(name, dtype):
    p = {
        "w": jnp.asarray(_weights((64, 8)) / 8, jnp.float32),  # float32 master, cast to dtype
        "b": jnp.ones((8,), dtype),
        "n": 3,  # a Python int
        "step": jnp.asarray(3, jnp.int32),
        "mask": jnp.ones((4,), bool),
        "z": jnp.ones((2,), jnp.complex64),
    }
    x = _x(dtype, (2, 64))
    qat = jaxmp.quantization_aware(_mixed_leaves, recipe=RECIPES[name])
    with jax.numpy_dtype_promotion("strict"):
        outs = jax.jit(qat)(p, x)
        refs = _mixed_leaves(p, x)
        grads = jax.grad(lambda w, b: jnp.sum(qat({**p, "w": w, "b": b}, x)[0]), (0, 1))(
            p["w"], p["b"]
        )
    assert [o.dtype for o in outs] == [r.dtype for r in refs]
    assert_bits(outs[0], _served(_mixed_leaves, p, x, recipe=RECIPES[name])[0])
    assert grads[0].dtype == jnp.float32 and grads[1].dtype == dtype
    for out, ref in zip(outs[1:], refs[1:], strict=True):
        assert_bits(out, ref)


# --------------------------------------------------------------------------------------------
# Convolutions: the same kernels as jaxmp.quantized, the same straight-through gradients.

NHWC = ("NHWC", "HWIO", "NHWC")


class _LinenCNN(linen.Module):
    """A convolution, a grouped one, a transposed one (its kernel reversed and transposed on
    the way) and a dense head; every contraction a multiple of int4's groups of 32."""

    dtype: jnp.dtype = jnp.float32

    @linen.compact
    def __call__(self, x):  # (batch, 8, 8, 16)
        kw = {"dtype": self.dtype, "param_dtype": self.dtype}
        h = jax.nn.relu(linen.Conv(16, (4, 4), name="conv", **kw)(x))
        h = jax.nn.relu(linen.Conv(16, (4, 4), feature_group_count=2, name="grouped", **kw)(h))
        h = linen.ConvTranspose(32, (4, 4), (2, 2), transpose_kernel=True, name="up", **kw)(h)
        h = jax.nn.relu(h).reshape(h.shape[0], -1)
        # (Flattened, not pooled: XLA:CPU may sum a pooling otherwise where the program also
        # takes the gradient, a float model's output too.)
        return linen.Dense(10, name="head", **kw)(h)


@pytest.mark.parametrize(("name", "dtype"), diagonal_cases(NAMES, DTYPES, NAMES, DTYPE_IDS))
def test_convolutions_forward_is_bit_identical_to_serving(name, dtype):
    model = _LinenCNN(dtype)
    x = _x(dtype, (2, 8, 8, 16))
    variables = _random_variables(model, x)
    recipe = RECIPES[name]
    plan = jaxmp.quantization_plan(model.apply, variables, x, recipe=recipe)
    assert {leaf.path for leaf in plan if leaf.quantized} == {
        f"params/{layer}/kernel" for layer in ("conv", "grouped", "up", "head")
    }
    qat = jaxmp.quantization_aware(model.apply, recipe=recipe)
    served = _served(model.apply, variables, x, recipe=recipe)
    grads = _assert_forward_serves(qat, variables, x, served)
    for layer in ("conv", "grouped", "up", "head"):
        g = grads["params"][layer]["kernel"]
        assert g.dtype == dtype and np.abs(np.asarray(g, np.float32)).max() > 0, layer
    assert not np.array_equal(np.asarray(served), np.asarray(model.apply(variables, x)))


def _conv(p, x):
    return lax.conv_general_dilated(x, p["k"], (1, 1), "SAME", dimension_numbers=NHWC)


def _conv_kernel(dtype):
    """A (4, 4, 16, 16) kernel (a contraction of 256) with an outlier output feature."""
    k = np.random.default_rng(6).normal(size=(4, 4, 16, 16)) / 16
    k[..., 2] *= 50.0
    return jnp.asarray(k, dtype)


def _fake_quantized_images(x, recipe):
    """The activations the dynamic recipes' convolution reads, dequantised: each image
    rounded on the recipe's grid with its absmax scale."""
    scale = q_lib.absmax_scale(x, (1, 2, 3), recipe.qmax)
    return (q_lib.quantize_values(x, scale, recipe).astype(scale.dtype) * scale).astype(x.dtype)


def _conv_unclipped(k, q):
    """numpy's: where kernel `k` (HWIO, contracted over H, W, I) rounds inside its grid's
    range, with the scales of its quantised form `q`."""
    k = np.asarray(k, np.float32)
    scales = np.asarray(q.scales)
    if q.recipe.name != "int4":
        return np.abs(np.round(k / scales)) <= q.recipe.qmax
    # (out, groups) -> one per value of the flattened (H, W, I) contraction -> HWIO.
    step = np.repeat(scales, q.recipe.group_size, axis=1).reshape(16, 4, 4, 16)
    r = np.round(k / step.transpose(1, 2, 3, 0))
    return (r >= -8) & (r <= 7)


@pytest.mark.parametrize(("name", "dtype"), diagonal_cases(NAMES, DTYPES, NAMES, DTYPE_IDS))
def test_convolution_kernel_gradient_is_the_straight_through_gradient(name, dtype):
    recipe = RECIPES[name]
    k, x, c = _conv_kernel(dtype), _x(dtype, (4, 8, 8, 16)), _x(dtype, (4, 8, 8, 16), seed=4)

    def loss(k, model):
        return jnp.sum((model({"k": k}, x) * c).astype(jnp.float32))

    qat = jaxmp.quantization_aware(_conv, recipe=recipe)
    got = jax.jit(jax.grad(loss), static_argnums=1)(k, lambda p, _: qat(p, x))
    x_read = x if name in WEIGHT_ONLY else _fake_quantized_images(x, recipe)
    expected = jax.jit(jax.grad(loss), static_argnums=1)(k, lambda p, _: _conv(p, x_read))
    unclipped = _conv_unclipped(k, qat.quantize({"k": k}, x)["k"])
    assert unclipped.all() == (name != "int4")  # int4 clips some of these weights
    expected = jnp.where(unclipped, expected, jnp.zeros_like(expected))
    assert got.dtype == dtype
    assert_bits_of_programs(got, expected)
    if name not in WEIGHT_ONLY:
        assert not np.array_equal(np.asarray(x_read), np.asarray(x))  # the images were rounded


@pytest.mark.parametrize("name", NAMES)
def test_convolution_input_gradient(name):
    # Weight-only: the exact derivative of the served convolution (the kernel a constant);
    # dynamic: straight-through, the float convolution with the kernel as served.
    recipe = RECIPES[name]
    p, x, c = {"k": _conv_kernel(jnp.float32)}, _x(shape=(4, 8, 8, 16)), _x(shape=(4, 8, 8, 16))
    qat = jaxmp.quantization_aware(_conv, recipe=recipe)
    q = jaxmp.quantize(_conv, p, x, recipe=recipe)
    got = jax.jit(jax.grad(lambda x: jnp.sum(qat(p, x) * c)))(x)
    if name in WEIGHT_ONLY:
        serve = jax.extend.core.jaxpr_as_fun(jaxmp.quantized(_conv).jaxpr(q, x))
        leaves = jax.tree.leaves(q)
        expected = jax.jit(jax.grad(lambda x: jnp.sum(serve(*leaves, x)[0] * c)))(x)
        # Sums of 256 float32 products, ordered as each program's convolution orders them.
        scale = float(np.abs(np.asarray(expected)).max())
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * scale)
    else:
        k_served = {"k": q["k"].dequantize()}
        expected = jax.jit(jax.grad(lambda x: jnp.sum(_conv(k_served, x) * c)))(x)
        assert_bits(got, expected)
    assert np.abs(np.asarray(got)).min() > 0  # not the zero derivative of rounding


@pytest.mark.parametrize("name", ["int8_dynamic", "int4"])
def test_a_quantization_aware_cnn_keeps_the_skip_and_check_outputs_guarantees(name):
    # Against the existing guarantees: a step whose gradients are not finite changes nothing
    # but the loss-scaling state (with check_outputs), float16 params keep their dtype, and a
    # finite step trains.
    model = _LinenCNN(jnp.float16)
    x = _x(jnp.float16, (2, 8, 8, 16))
    variables = jax.tree.map(lambda a: a.astype(jnp.float16), _random_variables(model, x))
    qat = jaxmp.quantization_aware(model.apply, recipe=RECIPES[name])
    tx = jaxmp.mixed_precision(optax.adam(1e-3), "float16", master_weights=True, check_outputs=True)
    state = tx.init(variables)

    @jax.jit
    def step(v, state, x):
        def loss_fn(v):
            return jnp.mean(qat(v, x).astype(jnp.float32) ** 2)

        _, grads = jaxmp.value_and_grad(loss_fn)(jaxmp.get_loss_scale(state), v)
        updates, state = tx.update(grads, state, v)
        return optax.apply_updates(v, updates), state

    new_v, new_state = step(variables, state, x)
    assert jax.tree.all(jax.tree.map(lambda a: a.dtype == jnp.float16, new_v))
    assert bool(jaxmp.loss_scale_metrics(new_state)["grads_finite"])
    assert not np.array_equal(
        np.asarray(new_v["params"]["conv"]["kernel"]),
        np.asarray(variables["params"]["conv"]["kernel"]),
    )
    skipped_v, skipped_state = step(new_v, new_state, x.at[0, 0, 0, 0].set(jnp.inf))
    assert not bool(jaxmp.loss_scale_metrics(skipped_state)["grads_finite"])
    for a, b in zip(jax.tree.leaves(skipped_v), jax.tree.leaves(new_v), strict=True):
        assert_bits(a, b)
    for a, b in zip(
        jax.tree.leaves(jaxmp.inner_state(skipped_state)),
        jax.tree.leaves(jaxmp.inner_state(new_state)),
        strict=True,
    ):
        assert_bits(a, b)
