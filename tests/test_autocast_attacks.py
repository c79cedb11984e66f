"""Attack tests for `jaxmp.autocast`: the promises it makes on real model code.

Each test runs an unmodified float32 pattern under autocast and compares the values with the
plain float32 call, with the compute dtype's tolerance from the central table. The inputs are
chosen exactly representable in float16 and bfloat16 (small multiples of 1/4, 300 and 61440),
so that any difference comes from how autocast computes, not from rounding the inputs.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import jaxmp
from jaxmp._src.autocast import autocast
from tests.conftest import F32, HALF_DTYPES, all_eqns, assert_close

POLICIES = {jnp.dtype(jnp.float16): "mixed_float16", jnp.dtype(jnp.bfloat16): "mixed_bfloat16"}


def activations(features=8):
    """Rows of activations: one above 256, one above 60000 (float16's max is 65504), one small."""
    x = np.full((3, features), 0.5, np.float32)
    x[0, 3] = 300.0
    x[1, 5] = 61440.0
    x[2] = np.linspace(-2.0, 2.0, features)
    return jnp.asarray(x)


def through_matmul(fn):
    """``fn(x @ w)`` with ``w`` the identity: the activation `fn` sees is a computed
    (compute-dtype) value under autocast, equal to `x` itself."""
    return lambda w, x: fn(x @ w)


def check_against_float32(fn, dtype, x=None):
    x = activations() if x is None else x
    w = jnp.eye(x.shape[-1])
    model = through_matmul(fn)
    expected = jax.jit(model)(w, x)
    out = jax.jit(autocast(model, POLICIES[dtype]))(w, x)
    assert out.dtype == expected.dtype
    assert bool(jnp.all(jnp.isfinite(out))), out
    assert_close(out, expected, dtype)


# ---------------------------------------------------------------------------------------------
# Norms and variances: the values feeding a float32 reduction are computed in float32.


def rms_with(square):
    return lambda x: x * lax.rsqrt(jnp.mean(square(x), -1, keepdims=True) + 1e-6)


NORM_PATTERNS = {
    "integer_pow": rms_with(lambda x: x**2),
    "mul": rms_with(lambda x: x * x),
    "square": rms_with(jnp.square),
    "pow": rms_with(lambda x: x**2.0),
    "abs_then_pow": rms_with(lambda x: jnp.abs(x) ** 2),
    "fast_variance": lambda x: (
        (x - x.mean(-1, keepdims=True))
        * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) - x.mean(-1, keepdims=True) ** 2 + 1e-6)
    ),
    "linalg_norm": lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True),
    "linalg_norm_flat": lambda x: x / jnp.linalg.norm(x),
    "optax_safe_norm": lambda x: x / optax.safe_norm(x, 1e-6, axis=-1, keepdims=True),
    "l1_norm_of_square": lambda x: x / jnp.sum(jnp.abs(x * x), -1, keepdims=True),
    "jax_nn_standardize": lambda x: jax.nn.standardize(x, axis=-1),
    "var": lambda x: x / jnp.sqrt(jnp.var(x, -1, keepdims=True)),
    "max_of_square": lambda x: x / jnp.sqrt(jnp.max(x * x, -1, keepdims=True)),
}


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("pattern", sorted(NORM_PATTERNS))
def test_norm_statistics_match_float32(pattern, dtype):
    check_against_float32(NORM_PATTERNS[pattern], dtype)


class LinenNorms(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.LayerNorm()(x), nn.RMSNorm()(x), nn.LayerNorm(use_fast_variance=False)(x)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_flax_linen_layer_norm_and_rms_norm_match_float32(dtype):
    model = LinenNorms()
    x = activations()
    w = jnp.eye(x.shape[-1])
    variables = model.init(jax.random.key(0), x)

    def forward(variables, w, x):
        return model.apply(variables, x @ w)

    expected = jax.jit(forward)(variables, w, x)
    out = jax.jit(autocast(forward, POLICIES[dtype]))(variables, w, x)
    for o, e in zip(out, expected, strict=True):
        assert o.dtype == F32
        assert_close(o, e, dtype)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_rms_norm_gradients_match_float32(dtype):
    """The float32 statistics also give the float32 gradients (not zeros, not inf)."""
    x = activations()
    w = jnp.eye(x.shape[-1])
    target = jnp.linspace(-1.0, 1.0, x.size).reshape(x.shape)

    # Scaled as under loss scaling: the 61440 row's gradients (~1e-5) are float16 subnormals.
    scale = 2.0**12

    def loss(w, x):
        return jnp.sum(NORM_PATTERNS["integer_pow"](x @ w) * target) * scale

    expected = jax.jit(jax.grad(loss, argnums=1))(w, x) / scale
    grads = jax.jit(jax.grad(autocast(loss, POLICIES[dtype]), argnums=1))(w, x) / scale
    assert grads.dtype == F32
    # The gradient of each row of `x` scales as 1/rms: compare each row at its own scale.
    row_scale = jnp.max(jnp.abs(expected), axis=-1, keepdims=True)
    assert_close(grads / row_scale, expected / row_scale, dtype)


# ---------------------------------------------------------------------------------------------
# Large constants: a finfo(float32).min mask meeting a compute-dtype activation.


def masked_softmax_where(scores, mask):
    return jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(jnp.float32).min), axis=-1)


def masked_softmax_bias(scores, mask):
    bias = jnp.where(mask, 0.0, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores + bias, axis=-1)


def masked_softmax_bias_product(scores, mask):
    return jax.nn.softmax(scores + (1.0 - mask.astype(jnp.float32)) * -1e9, axis=-1)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize(
    "masked_softmax",
    [masked_softmax_where, masked_softmax_bias, masked_softmax_bias_product],
    ids=lambda f: f.__name__,
)
def test_large_negative_mask_gives_the_float32_softmax(masked_softmax, dtype):
    q = jnp.asarray(np.linspace(-2.0, 2.0, 4 * 8, dtype=np.float32).reshape(4, 8))
    k = jnp.asarray(np.linspace(1.0, -1.0, 4 * 8, dtype=np.float32).reshape(4, 8))
    mask = jnp.asarray(np.tril(np.ones((4, 4), bool)))
    mask = mask.at[2].set(False)  # a fully masked row: float32 gives the uniform distribution

    def attention(q, k, mask):
        return masked_softmax(q @ k.T, mask)

    expected = jax.jit(attention)(q, k, mask)
    out = jax.jit(autocast(attention, POLICIES[dtype]))(q, k, mask)
    assert bool(jnp.all(jnp.isfinite(out))), out
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_flax_attention_mask_gives_the_float32_answer(dtype):
    """Flax's own masking (``jnp.finfo(dtype).min`` in `dot_product_attention_weights`)."""
    model = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)
    x = jnp.asarray(np.linspace(-1.0, 1.0, 2 * 4 * 8, dtype=np.float32).reshape(2, 4, 8))
    mask = nn.make_causal_mask(jnp.ones((2, 4)))
    mask = mask.at[1, :, 2].set(False)  # a fully masked query row
    variables = model.init(jax.random.key(0), x, x, mask=mask)

    def forward(variables, x, mask):
        return model.apply(variables, x, x, mask=mask)

    expected = jax.jit(forward)(variables, x, mask)
    out = jax.jit(autocast(forward, POLICIES[dtype]))(variables, x, mask)
    assert bool(jnp.all(jnp.isfinite(out))), out
    scale = float(jnp.max(jnp.abs(expected)))
    assert_close(out / scale, expected / scale, dtype)


# ---------------------------------------------------------------------------------------------
# State updates made inside an autocast function come out as in the plain call: the same
# values within the compute dtype's tolerance and the same dtypes, under every policy (also
# those whose output dtype is half: BatchNorm's running variance of a 61440 activation is
# 6e8, inf in float16).

STATE_POLICIES = ["mixed_float16", "mixed_bfloat16", "c=f16,o=f16", "c=bf16,o=bf16"]


def state_batch():
    """A float32 model's batch: a row whose activations reach 400 (above 256), one whose
    first activation is 61440 (above 60000; float16's max is 65504), and rows of multiples
    of 1/2. With `state_kernel`, the half-precision matmul is exact."""
    x = ((np.arange(6 * 8) % 9 - 4) / 2).astype(np.float32).reshape(6, 8)
    x[:2] = 0.0
    x[0, 3] = 400.0
    x[1, 5] = 61440.0
    return jnp.asarray(x)


def exact_kernel(shape=(8, 16)):
    """Multiples of 1/4 in [-0.75, 0.75]: products and sums exact in float16 and bfloat16."""
    i, j = np.indices(shape)
    return jnp.asarray((((3 * i + 5 * j) % 7 - 3) / 4).astype(np.float32))


def state_kernel():
    """`exact_kernel` with weight 1 from the large inputs to feature 0 (activations 400, 61440)."""
    kernel = np.array(exact_kernel())
    kernel[3, 0] = kernel[5, 0] = 1.0
    return jnp.asarray(kernel)


def test_state_batch_has_the_large_activations():
    h = state_batch() @ state_kernel()
    assert float(h[0, 0]) == 400.0 and float(jnp.max(jnp.abs(h[0]))) > 256.0
    assert float(h[1, 0]) == 61440.0 and float(jnp.max(jnp.abs(h[2:]))) < 256.0


def compute_dtype(policy):
    return jaxmp.get_policy(policy).compute_dtype


def assert_same_state_leaves(leaves, ref_leaves, dtype):
    """Same dtypes; floating values within `dtype`'s tolerance, the rest exactly."""
    for leaf, ref in zip(leaves, ref_leaves, strict=True):
        if jnp.issubdtype(ref.dtype, jax.dtypes.prng_key):
            np.testing.assert_array_equal(jax.random.key_data(leaf), jax.random.key_data(ref))
            continue
        assert leaf.dtype == ref.dtype
        if jnp.issubdtype(ref.dtype, jnp.floating):
            assert bool(jnp.all(jnp.isfinite(leaf))), leaf
            assert_close(leaf, ref, dtype)
        else:  # counters, flags: exactly
            np.testing.assert_array_equal(leaf, ref)


def assert_output_matches(out, expected, policy):
    """The output equals the float32 call within the compute dtype's tolerance.

    The models end in BatchNorm (and Dropout), which autocast computes in float32 like the
    plain call: the output stays float32 under every policy, a half output dtype included.
    """
    assert out.dtype == F32
    assert bool(jnp.all(jnp.isfinite(out))), out
    # The same dropout mask where there is one.
    np.testing.assert_array_equal(out == 0, expected == 0)
    assert_close(out, expected, compute_dtype(policy))


class NnxBatchNormDropout(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(8, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, momentum=0.5, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.norm(self.linear(x)))


def nnx_models():
    """The model under test and a reference with the same params and Rngs."""
    models = NnxBatchNormDropout(nnx.Rngs(0)), NnxBatchNormDropout(nnx.Rngs(0))
    for model in models:
        model.linear.kernel[...] = state_kernel()
    return models


def assert_same_nnx_state(model, reference, dtype):
    state = nnx.state(model)
    ref_state = nnx.state(reference)
    assert jax.tree.structure(state) == jax.tree.structure(ref_state)
    assert_same_state_leaves(jax.tree.leaves(state), jax.tree.leaves(ref_state), dtype)


@pytest.mark.parametrize("policy", STATE_POLICIES)
@pytest.mark.parametrize("under_jit", [False, True], ids=["eager", "nnx_jit"])
def test_nnx_batch_norm_statistics_and_rngs_counter_update(under_jit, policy):
    model, reference = nnx_models()
    forward = autocast(lambda m, x: m(x), policy)
    if under_jit:
        forward = nnx.jit(forward)
    plain = nnx.jit(lambda m, x: m(x))
    x = state_batch()
    for step in range(2):
        out = forward(model, x + step)
        expected = plain(reference, x + step)
        assert_output_matches(out, expected, policy)
        assert_same_nnx_state(model, reference, compute_dtype(policy))
    assert int(model.drop.rngs.count[...]) == 2
    assert float(model.norm.var[...][0]) > 65504.0  # beyond float16, kept float32


def test_nnx_state_updates_inside_nnx_grad():
    """autocast inside an NNX training step: the statistics update through nnx.grad."""
    dtype = jnp.dtype(jnp.float16)
    model, reference = nnx_models()

    def make_step(apply):
        @nnx.jit
        def step(model, x):
            return nnx.grad(lambda m: jnp.mean(apply(m, x) ** 2))(model)

        return step

    grads = make_step(autocast(lambda m, x: m(x), "mixed_float16"))(model, state_batch())
    ref_grads = make_step(lambda m, x: m(x))(reference, state_batch())
    assert_same_nnx_state(model, reference, dtype)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(ref_grads))
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert_close(g / scale, r / scale, dtype)


class LinenBatchNormDropout(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
        return nn.Dropout(0.5, deterministic=not train)(x)


@pytest.mark.parametrize("policy", STATE_POLICIES)
def test_linen_mutable_collections_update(policy):
    model = LinenBatchNormDropout()
    x = state_batch()
    variables = model.init(jax.random.key(0), x, train=False)
    variables["params"]["Dense_0"]["kernel"] = state_kernel()

    def forward(variables, x, key):
        return model.apply(variables, x, train=True, mutable=["batch_stats"], rngs={"dropout": key})

    key = jax.random.key(1)
    for step in range(2):
        out, updates = jax.jit(autocast(forward, policy))(variables, x + step, key)
        expected, ref_updates = jax.jit(forward)(variables, x + step, key)
        assert_output_matches(out, expected, policy)
        assert jax.tree.structure(updates) == jax.tree.structure(ref_updates)
        assert_same_state_leaves(
            jax.tree.leaves(updates), jax.tree.leaves(ref_updates), compute_dtype(policy)
        )
        variables = {**variables, **ref_updates}
    assert float(updates["batch_stats"]["BatchNorm_0"]["var"][0]) > 65504.0


@pytest.mark.parametrize("policy", STATE_POLICIES)
def test_equinox_state_updates(policy):
    eqx = pytest.importorskip("equinox", reason="equinox is an optional test dependency")

    class Model(eqx.Module):
        linear: eqx.nn.Linear
        norm: eqx.nn.BatchNorm
        drop: eqx.nn.Dropout

        def __init__(self, key):
            self.linear = eqx.nn.Linear(8, 16, key=key)
            self.norm = eqx.nn.BatchNorm(16, axis_name="batch", momentum=0.5, mode="ema")
            self.drop = eqx.nn.Dropout(0.5)

        def __call__(self, x, state, key):
            x, state = self.norm(self.linear(x), state)
            return self.drop(x, key=key), state

    model, state = eqx.nn.make_with_state(Model)(jax.random.key(0))
    model = eqx.tree_at(lambda m: m.linear.weight, model, state_kernel().T)
    model = eqx.tree_at(lambda m: m.linear.bias, model, jnp.zeros(16))

    def forward(model, state, x, key):
        keys = jax.random.split(key, x.shape[0])
        return jax.vmap(model, axis_name="batch", in_axes=(0, None, 0), out_axes=(0, None))(
            x, state, keys
        )

    x, key = state_batch(), jax.random.key(1)
    for step in range(2):
        out, new_state = eqx.filter_jit(autocast(forward, policy))(model, state, x + step, key)
        expected, ref_state = eqx.filter_jit(forward)(model, state, x + step, key)
        assert_output_matches(out, expected, policy)
        assert jax.tree.structure(new_state) == jax.tree.structure(ref_state)
        assert_same_state_leaves(
            jax.tree.leaves(new_state), jax.tree.leaves(ref_state), compute_dtype(policy)
        )
        state = ref_state
    running_var = [leaf for leaf in jax.tree.leaves(new_state) if leaf.ndim == 1][1]
    assert float(running_var[0]) > 65504.0


def test_linen_attention_cache_round_trip():
    """A decoding cache (computed in the compute dtype) comes back in the output dtype,
    float32 under mixed_float16, so it can be fed to the next step as in the plain call."""
    model = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, decode=True)
    x = jnp.asarray(np.linspace(-1.0, 1.0, 3 * 8, dtype=np.float32).reshape(1, 3, 8))
    variables = model.init(jax.random.key(0), x, x)

    def step(variables, token):
        return model.apply(variables, token, token, mutable=["cache"])

    cast_step, plain_step = jax.jit(autocast(step, "mixed_float16")), jax.jit(step)
    cast_vars, plain_vars = variables, variables
    for i in range(3):
        out, cache = cast_step(cast_vars, x[:, i : i + 1])
        expected, ref_cache = plain_step(plain_vars, x[:, i : i + 1])
        assert out.dtype == F32
        assert_close(out, expected, jnp.float16)
        assert jax.tree.structure(cache) == jax.tree.structure(ref_cache)
        assert_same_state_leaves(jax.tree.leaves(cache), jax.tree.leaves(ref_cache), jnp.float16)
        cast_vars, plain_vars = {**variables, **cache}, {**variables, **ref_cache}


# ---------------------------------------------------------------------------------------------
# Half-precision params and inputs (the low-memory setup): the program itself widens a
# reduction's input to float32 and narrows the result back (`jnp.mean`, `jnp.sum`, `jnp.var`
# on float16 or bfloat16 arrays); autocast drops the narrowing, so the float32 result reaches
# the output (in `policy.output_dtype`) without a round trip through the half dtype.

HALF_PARAM_POLICIES = {
    jnp.dtype(jnp.float16): ("p=f16,c=f16,o=f32", "p=f16,c=f16,o=f16"),
    jnp.dtype(jnp.bfloat16): ("p=bf16,c=bf16,o=f32", "p=bf16,c=bf16,o=bf16"),
}


def half_param_batch(dtype):
    """Multiples of 1/4 up to 2.75: exact in both half dtypes, their squares too, but the
    mean of the squares (2.7728...) is not: rounded to bfloat16 it is 2.765625."""
    x = ((np.arange(32 * 16) % 23 - 11) / 4).astype(np.float32).reshape(32, 16)
    return jnp.asarray(x, dtype)


REDUCTION_LOSSES = {
    "mean_of_squares": lambda h: jnp.mean(h**2),
    "sum_then_scale": lambda h: jnp.sum(h * h) / h.size,
    "var": lambda h: jnp.var(h),
    "masked_mean": lambda h: jnp.mean(h * h, where=h != 0.25),
    "mean_then_scalar_ops": lambda h: jnp.sqrt(jnp.mean(h * h, -1)).sum() * 0.5,
}


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("loss", sorted(REDUCTION_LOSSES))
def test_half_params_reduction_keeps_float32_result(loss, dtype):
    """The result equals the float32 program's: the matmul (identity weights) and the
    squares are exact, so any difference is the half dtype's rounding of the result."""
    fn = REDUCTION_LOSSES[loss]

    def model(w, x):
        return fn(x @ w)

    x = half_param_batch(dtype)
    w = jnp.eye(16, dtype=dtype)
    expected = jax.jit(model)(w.astype(F32), x.astype(F32))
    policy = jaxmp.get_policy(HALF_PARAM_POLICIES[dtype][0])
    with jax.numpy_dtype_promotion("strict"):
        out = jax.jit(autocast(model, policy))(w, x)
    assert out.dtype == F32
    assert_close(out, expected, F32)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_half_params_sum_above_half_range_is_finite(dtype):
    """A sum of squares of 262144 (float16's max is 65504) is not narrowed to inf."""
    x = jnp.full((2**16,), 2.0, dtype)
    out = jax.jit(autocast(lambda x: jnp.sum(x * x), HALF_PARAM_POLICIES[dtype][0]))(x)
    assert out.dtype == F32
    assert float(out) == 262144.0


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("which", [0, 1], ids=["o=f32", "o=half"])
def test_half_params_reduction_output_has_output_dtype(which, dtype):
    policy = jaxmp.get_policy(HALF_PARAM_POLICIES[dtype][which])
    x = half_param_batch(dtype)
    out = jax.jit(autocast(lambda x: jnp.mean(x * x), policy))(x)
    assert out.dtype == policy.output_dtype


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_half_params_statistic_stays_float32_up_to_the_next_matmul(dtype):
    """A LayerNorm written for half inputs runs in float32 up to the next matmul, as
    autocast runs a float32 model's LayerNorm; the matmul itself is in the compute dtype."""
    model = nn.Sequential([nn.LayerNorm(dtype=dtype, param_dtype=dtype), nn.Dense(8)])
    x = half_param_batch(dtype)
    variables = model.init(jax.random.key(0), x)
    variables = jax.tree.map(lambda v: v.astype(dtype), variables)
    policy = HALF_PARAM_POLICIES[dtype][0]
    jaxpr = jaxmp.autocast_jaxpr(model.apply, policy)(variables, x)
    narrowing = [
        e
        for e in all_eqns(jaxpr)
        if e.primitive.name == "convert_element_type"
        and e.invars[0].aval.dtype == F32
        and e.outvars[0].aval.dtype == dtype
    ]
    # Only the matmul's operand is cast down: the normalised activation, once.
    assert len(narrowing) == 1
    (dot,) = [e for e in all_eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert dot.outvars[0].aval.dtype == dtype
    assert narrowing[0].outvars[0] in dot.invars
    expected = jax.jit(model.apply)(jax.tree.map(lambda v: v.astype(F32), variables), x)
    out = jax.jit(autocast(model.apply, policy))(variables, x)
    assert out.dtype == F32
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_narrowing_the_program_wrote_elsewhere_is_kept(dtype):
    """Only the narrowing back after a float32 op is dropped: a float32 model's own
    ``.astype(half)``, a widen-then-narrow round trip with no float32 op between, and a
    narrowing of a float32 reduction of float32 values stay as written."""

    def f32_model(w, x):
        return jnp.sum(x @ w).astype(dtype), (x @ w).astype(dtype)

    def round_trip(x):
        return x.astype(F32).astype(dtype) * x

    w, x = jnp.eye(16), half_param_batch(dtype).astype(F32)
    policy = HALF_PARAM_POLICIES[dtype][1]  # output dtype half: the output cast is a no-op
    total, h = jax.jit(autocast(f32_model, policy))(w, x)
    assert (total.dtype, h.dtype) == (dtype, dtype)
    jaxpr = jaxmp.autocast_jaxpr(round_trip, policy)(x.astype(dtype))
    assert [str(v.aval.dtype) for e in jaxpr.eqns for v in e.outvars] == [
        "float32",
        str(dtype),
        str(dtype),
    ]


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_half_params_gradients_keep_param_dtype(dtype):
    x = half_param_batch(dtype)
    w = jnp.eye(16, dtype=dtype)

    def loss(w, x):
        return jnp.mean((x @ w) ** 2)

    grads = jax.jit(jax.grad(autocast(loss, HALF_PARAM_POLICIES[dtype][0])))(w, x)
    expected = jax.jit(jax.grad(loss))(w.astype(F32), x.astype(F32))
    assert grads.dtype == dtype
    assert_close(grads, expected, dtype)
