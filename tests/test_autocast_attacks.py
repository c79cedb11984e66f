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
from jax import lax

from jaxmp._src.autocast import autocast
from tests.conftest import F32, HALF_DTYPES, assert_close

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
