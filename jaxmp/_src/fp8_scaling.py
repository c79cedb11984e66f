"""FP8 scales and quantisation: amaxes, power-of-two and per-block scales, the delayed rule.

Every scale keeps non-finite values out: an amax is that of the finite values, and
`quantize` keeps an inf or NaN what it is, so an overflow before quantisation is never turned
into a finite number. The per-tensor scales are powers of two that stay exact in the dtype a
product is dequantised in (`exponent_range`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxmp._src import compat
from jaxmp._src.fp8 import _F32_MAX, ROLE_GRAD, ROLE_LHS, ROLE_RHS, DelayedScaling, fp8_max


def delayed_update(
    history: jax.Array, scale: jax.Array, amax: jax.Array, recipe: DelayedScaling
) -> tuple[jax.Array, jax.Array]:
    """One step of Transformer Engine's delayed-scaling rule for the three roles.

    `history` has shape ``(..., 3, L)``, `scale` and `amax` ``(..., 3)``: the amax just
    observed (of the finite values: a non-finite value never enters the history) is recorded
    as entry 0, the amax of the window is reduced from the history, the scale recomputed as
    the largest power of two not above ``(fp8_max / amax) / 2**margin`` (kept where the amax
    is zero), and the history rotated by -1 with its first entry zeroed.
    """
    history = history.at[..., 0].set(amax)
    if recipe.amax_compute == "max":
        window = jnp.max(history, axis=-1)
    else:
        window = history[..., 0]
    exponents = jnp.stack(
        [
            pow2_exponent(window[..., ROLE_LHS], recipe.fwd_dtype),
            pow2_exponent(window[..., ROLE_RHS], recipe.fwd_dtype),
            pow2_exponent(window[..., ROLE_GRAD], recipe.bwd_dtype),
        ],
        axis=-1,
    )
    exponents = jnp.clip(exponents - recipe.margin, -_F32_EXP, _F32_EXP)
    new_scale = jnp.where(window > 0, jnp.ldexp(jnp.float32(1.0), exponents), scale)
    history = jnp.roll(history, -1, axis=-1).at[..., 0].set(0.0)
    return history, new_scale


# --------------------------------------------------------------------------------------------
# Quantisation.

# Scales are kept within float32's normal range, so that a scale and its inverse are both
# exact (XLA:CPU flushes subnormal float32 values to zero).
_F32_EXP = 126


def amax(x: jax.Array) -> jax.Array:
    """The largest absolute finite value of `x` in float32 (0 if none), the same on every device.

    Non-finite values are left out: they stay non-finite through quantisation (`quantize`),
    and the scale of the others is the one they would have without them. Under
    ``jax.shard_map`` the local maximum is reduced (``lax.pmax``) over the mesh axes `x`
    varies along, so that every device takes the same scaling decision; under ``jit`` with
    sharded arrays the reduction is global already.
    """
    if not x.size:
        return jnp.zeros((), jnp.float32)
    finite = jnp.where(jnp.isfinite(x), jnp.abs(x), jnp.zeros((), x.dtype))
    local = jnp.max(finite).astype(jnp.float32)
    axes = compat.varying_axes(x)
    if axes:
        local = lax.pmax(local, tuple(sorted(axes)))
    return local


@jax.custom_batching.custom_vmap
def observed_amax(x: jax.Array, history: jax.Array) -> jax.Array:
    """`amax` of `x`, as recorded in the delayed-scaling `history` it belongs to.

    Under ``jax.vmap`` with one state for every example (`history` not batched), the amax of
    the whole batch: the state's next value is that of the batched program, one value, not
    one per example (which the state's gradient would add up). With a state per example,
    one amax per example.
    """
    del history
    return amax(x)


@observed_amax.def_vmap
def _observed_amax_vmap(
    axis_size: int, in_batched: Sequence[bool], x: jax.Array, history: jax.Array
) -> tuple[jax.Array, bool]:
    del axis_size
    x_batched, history_batched = in_batched
    if x_batched and history_batched:
        return jax.vmap(amax)(x), True
    return amax(x), False


def scale_from_amax(amax_value: jax.Array, dtype: Any) -> jax.Array:
    """``fp8_max / amax``; 1 where the amax is zero or not finite, finite where it is tiny."""
    amax_value = jnp.asarray(amax_value, jnp.float32)
    scale = jnp.float32(fp8_max(dtype)) / amax_value
    scale = jnp.where((amax_value > 0) & jnp.isfinite(amax_value), scale, jnp.float32(1.0))
    return jnp.minimum(scale, jnp.float32(_F32_MAX))


def quantize(
    x: jax.Array, scale: jax.Array, dtype: Any, limit: jax.Array | None = None
) -> jax.Array:
    """``x * scale`` in float32, saturated and cast to FP8 (nearest).

    Finite values saturate at `limit` (the format's largest value by default); infinities
    and NaNs stay what they are (E4M3 has no infinity: they become NaN), so that an overflow
    before quantisation is never turned into a finite number.
    """
    if limit is None:
        limit = jnp.float32(fp8_max(dtype))
    x = x.astype(jnp.float32)
    q = jnp.clip(x * scale, -limit, limit)
    return jnp.where(jnp.isinf(x), x, q).astype(dtype)


def finite_limit(exponent: jax.Array, fp8_dtype: Any, *dequant_dtypes: Any) -> jax.Array:
    """The largest FP8 value that, dequantised by ``2**-exponent``, is finite in every one of
    `dequant_dtypes` (float32 scalar).

    A finite value just below a dtype's largest (65,000 in float16) is scaled into the FP8
    format's top binade and may round up to an FP8 value whose dequantised value is beyond
    the dtype's range: inf, where the plain product is finite. Saturating at this limit
    instead keeps every finite value finite.
    """
    limit = jnp.float32(fp8_max(fp8_dtype))
    for dtype in dequant_dtypes:
        largest = min(float(jnp.finfo(dtype).max), _F32_MAX)  # the limit is float32
        reach = jnp.ldexp(jnp.float32(largest), exponent)  # inf when beyond f32
        reach = jnp.minimum(reach, jnp.float32(fp8_max(fp8_dtype)))
        nearest = reach.astype(fp8_dtype)
        bits = lax.bitcast_convert_type(nearest, jnp.uint8)
        below = lax.bitcast_convert_type(bits - jnp.uint8(1), fp8_dtype)  # the next lower
        value = jnp.where(nearest.astype(jnp.float32) > reach, below, nearest)
        limit = jnp.minimum(limit, value.astype(jnp.float32))
    return limit


def _emax(dtype: Any) -> int:
    """The exponent of the largest power of two of an FP8 format (8 for E4M3, 15 for E5M2)."""
    return int(math.floor(math.log2(fp8_max(dtype))))


def pow2_exponent(amax_value: jax.Array, dtype: Any) -> jax.Array:
    """The largest ``e`` with ``amax * 2**e <= fp8_max`` (int32, exact); 0 where amax is 0.

    ``frexp`` gives ``amax = m * 2**k`` exactly (``m`` in [0.5, 1)); with ``fp8_max = top *
    2**emax`` (``top`` in [1, 2)), ``amax * 2**e = 2m * 2**(k - 1 + e)`` is at most
    ``fp8_max`` for ``e = emax - k + 1`` when ``2m <= top`` and one less otherwise.
    """
    amax_value = jnp.asarray(amax_value, jnp.float32)
    emax = _emax(dtype)
    top = jnp.float32(fp8_max(dtype) / 2.0**emax)
    mantissa, exponent = jnp.frexp(amax_value)
    e = emax - exponent.astype(jnp.int32) + 1 - (2 * mantissa > top).astype(jnp.int32)
    return jnp.where(amax_value > 0, e, 0)


def mx_exponent(amax_value: jax.Array, dtype: Any) -> jax.Array:
    """The MX shared exponent: the smallest ``x`` with ``amax / 2**x <= fp8_max``.

    Rounded up, so that a block's largest value does not saturate (Transformer Engine's MXFP8
    cast, which rounds the E8M0 scale toward +infinity; the OCP specification's example
    conversion, ``floor(log2(amax)) - emax_elem``, clips block maxima above ``1.75 * 2**k``
    for E4M3). An all-zero block gets 0 (scale 1, exact). Clamped to [-126, 126], where the
    scale and its inverse are both normal float32 values, inside E8M0's range.
    """
    return jnp.clip(-pow2_exponent(amax_value, dtype), -_F32_EXP, _F32_EXP)


def quantize_blocks(
    x: jax.Array,
    dtype: Any,
    tile: int,
    rows: int = 1,
    *,
    power_of_two: bool = False,
    dequant_dtypes: Sequence[Any] = (),
) -> tuple[jax.Array, jax.Array]:
    """Quantises ``x`` of shape ``(b, f, k)`` per block of `rows` x `tile` values of ``(f, k)``.

    Returns ``(q, scale_inv)``: ``q`` of shape ``(b, f, k // tile, tile)`` (``k`` padded with
    zeros to a multiple of `tile`) and ``scale_inv`` of shape ``(b, f, k // tile)``, float32,
    each row of a block carrying the block's inverse scale. With `power_of_two` the scales
    are MX scales (`mx_exponent`), stored as E8M0 and returned as float32. A block's scale
    comes from its finite values; its non-finite values stay non-finite (`quantize`).

    With `power_of_two`, every dequantised value ``q * scale_inv`` of a finite value is
    finite in float32 and in each of `dequant_dtypes`: a power-of-two scale leaves a block's
    largest value in the format's top binade, where it may round up past the dtype's largest
    (float16's 64992 is 253.875 * 2**8, rounded to 256 by E4M3, and 256 * 2**8 is inf), so
    it saturates at `finite_limit` instead, one limit per block. A float32 scale
    (``fp8_max / amax``) takes the block's largest value to the format's largest without
    rounding it up: its dequantised values are the block's own up to float32 rounding.
    """
    b, f, k = x.shape
    kb, fb = -(-k // tile), -(-f // rows)
    padded = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, fb * rows - f), (0, kb * tile - k)))
    blocks = padded.reshape(b, fb, rows, kb, tile)
    finite = jnp.where(jnp.isfinite(blocks), jnp.abs(blocks), jnp.float32(0.0))
    block_amax = jnp.max(finite, axis=(2, 4))  # (b, fb, kb)
    if power_of_two:
        exponent = mx_exponent(block_amax, dtype)
        scale = jnp.ldexp(jnp.float32(1.0), -exponent)
        # The E8M0 scale as stored: 2**exponent, exact for every exponent in its range.
        scale_inv = jnp.ldexp(jnp.float32(1.0), exponent).astype(jnp.float8_e8m0fnu)
        scale_inv = scale_inv.astype(jnp.float32)
        limit = finite_limit(-exponent, dtype, jnp.float32, *dequant_dtypes)
        limit = limit[:, :, None, :, None]
    else:
        scale = scale_from_amax(block_amax, dtype)
        scale_inv = 1.0 / scale
        limit = None
    q = quantize(blocks, scale[:, :, None, :, None], dtype, limit)
    q = q.reshape(b, fb * rows, kb, tile)[:, :f]
    scale_inv = jnp.repeat(scale_inv, rows, axis=1)[:, :f]
    return q, scale_inv


# --------------------------------------------------------------------------------------------
# Per-tensor scales: powers of two, exact in the dtype the product is computed in.


def exponent_range(fp8_dtype: Any, *dequant_dtypes: Any) -> tuple[int, int]:
    """The per-tensor scale exponents ``e`` (scale ``2**e``) usable with each `dequant_dtypes`.

    The FP8 GEMM dequantises each operand as ``q.astype(dtype) * 2**-e`` (the pattern XLA
    folds into the GEMM's scale arguments): that is exact when the format's smallest value
    times ``2**-e`` is at least `dtype`'s smallest value (only values the dtype itself could
    not hold are given up), and ``2**-e`` is finite there (float16: ``e >= -15``).
    """
    tiny_fp8 = math.log2(float(jnp.finfo(fp8_dtype).smallest_subnormal))
    low, high = -_F32_EXP, _F32_EXP
    for dtype in dequant_dtypes:
        finfo = jnp.finfo(dtype)
        high = min(high, int(tiny_fp8 - math.log2(float(finfo.smallest_subnormal))))
        low = max(low, -int(math.floor(math.log2(float(finfo.max)))))
    return low, high


def tensor_exponent(x: jax.Array, fp8_dtype: Any, *dequant_dtypes: Any) -> jax.Array:
    """Current scaling's exponent: the largest power of two not above ``fp8_max / amax(x)``."""
    low, high = exponent_range(fp8_dtype, *dequant_dtypes)
    return jnp.clip(pow2_exponent(amax(x), fp8_dtype), low, high)


def state_exponent(scale: jax.Array, fp8_dtype: Any, *dequant_dtypes: Any) -> jax.Array:
    """The exponent of a delayed-scaling scale (rounded down to a power of two), clamped."""
    low, high = exponent_range(fp8_dtype, *dequant_dtypes)
    _, exponent = jnp.frexp(jnp.where(scale > 0, scale, jnp.float32(1.0)))
    return jnp.clip(exponent.astype(jnp.int32) - 1, low, high)
