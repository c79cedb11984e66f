"""FP8 matmuls: scaling recipes as values, quantisation, and the FP8 ``dot_general``.

An FP8 matmul quantises both operands to an 8-bit float format with a scale, multiplies the
FP8 values accumulating in float32 (``preferred_element_type=float32``), multiplies the
result by the inverse scales and returns it in the policy's compute dtype. Its backward pass
quantises the incoming gradient (E5M2 by default: two more exponent bits than E4M3, for the
wider range of gradients) and runs the two transposed products the same way. How the scales
are chosen is the *recipe*:

* `Float8CurrentScaling` (Transformer Engine's ``Float8CurrentScaling``; torchao's
  "tensorwise" float8): one float32 scale per tensor, ``fp8_max / amax`` of the tensor
  itself. Stateless.
* `DelayedScaling` (Transformer Engine's ``DelayedScaling``, its default recipe): one scale per
  tensor taken from a history of the amaxes of earlier steps, so the tensor is read once; the
  history and scales are state carried from step to step (`Float8State`).
* `Float8BlockScaling` (DeepSeek-V3, arXiv:2412.19437, section 3.3): one float32 scale per
  1x128 tile of activations and gradients (128 consecutive values along the contracted
  dimension) and per 128x128 block of weights. An outlier only costs its own tile the
  precision of the others. Stateless.
* `MXFP8BlockScaling` (OCP Microscaling Formats (MX) v1.0 specification, MXFP8): one shared
  power-of-two scale (an E8M0 exponent) per block of 32 values along the contracted
  dimension. Stateless.

CPUs have no FP8 arithmetic; XLA runs the FP8 types exactly, by emulation, so every result
here is the one an FP8 GEMM gives, up to the float32 summation order. The per-tensor recipes
lower to ``dot_general`` with FP8-typed operands and a float32 result, followed by the
multiplication by the scales: the pattern XLA's GPU compiler rewrites into a cuBLASLt FP8
GEMM. The block recipes lower to one FP8 ``dot_general`` batched over the blocks of the
contracted dimension, each block's partial sum scaled in float32 and summed (DeepSeek-V3's
"promotion to CUDA cores").
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmp._src import compat

__all__ = [
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Float8Recipe",
    "Float8State",
    "MXFP8BlockScaling",
]

F32 = jnp.dtype(jnp.float32)
E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)

#: The FP8 formats a recipe may use, by name (OCP FP8: E4M3 with no infinities, E5M2 IEEE-like).
FP8_DTYPES: dict[str, np.dtype] = {"float8_e4m3fn": E4M3, "float8_e5m2": E5M2}

AMAX_COMPUTE_ALGOS = ("max", "most_recent")

# Roles of the three quantised tensors of one matmul, in the state's arrays.
ROLE_LHS, ROLE_RHS, ROLE_GRAD = 0, 1, 2
NUM_ROLES = 3

_F32_MAX = float(jnp.finfo(jnp.float32).max)


def fp8_max(dtype: Any) -> float:
    """The largest finite value of an FP8 format (448 for E4M3, 57344 for E5M2)."""
    return float(jnp.finfo(dtype).max)


# --------------------------------------------------------------------------------------------
# Recipes.


def _fp8_dtype(value: Any, arg: str) -> np.dtype:
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype not in FP8_DTYPES.values():
        got = dtype.name if dtype is not None else repr(value)
        raise ValueError(f"`{arg}` must be one of {', '.join(FP8_DTYPES)}, got {got}.")
    return dtype


def _positive_int(value: Any, arg: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"`{arg}` must be an integer >= {minimum}, got {value!r}.")
    return int(value)


class _Recipe:
    """What every recipe has: the FP8 formats of the forward operands and of the gradients."""

    #: Whether the recipe carries state from step to step (`DelayedScaling`).
    stateful: ClassVar[bool] = False
    #: Whether scales are per tensor (else per tile or block of the contracted dimension).
    per_tensor: ClassVar[bool] = True

    fwd_dtype: Any
    bwd_dtype: Any

    def _check_dtypes(self) -> None:
        object.__setattr__(self, "fwd_dtype", _fp8_dtype(self.fwd_dtype, "fwd_dtype"))
        object.__setattr__(self, "bwd_dtype", _fp8_dtype(self.bwd_dtype, "bwd_dtype"))


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(_Recipe):
    """Per-tensor FP8 scaling from the tensor's own amax ("tensorwise"; stateless).

    Each operand of an FP8 matmul is multiplied by ``fp8_max / amax`` (its largest absolute
    value maps to the format's largest finite value), cast to FP8, and the float32 product
    is divided by both scales. The same for the gradient in the backward pass. As
    Transformer Engine's ``Float8CurrentScaling`` recipe (``Format.HYBRID``: E4M3 forward,
    E5M2 backward) and torchao's tensorwise float8 training. Under ``jax.shard_map`` the
    amax is reduced over the axes the tensor varies along, so every device uses one scale.

    Attributes:
      fwd_dtype: FP8 format of the forward operands (``jnp.float8_e4m3fn``).
      bwd_dtype: FP8 format of the gradients (``jnp.float8_e5m2``).
      min_size: a matmul whose rows, columns or contraction (``M``, ``N`` or ``K``, the
        batch dimensions aside) number fewer than this stays in the compute dtype: below
        some size quantising costs more than the FP8 GEMM saves (0: every matmul in FP8).

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> jaxmp.Float8CurrentScaling()
      Float8CurrentScaling(fwd_dtype=dtype(float8_e4m3fn), bwd_dtype=dtype(float8_e5m2), min_size=0)
      >>> jaxmp.Float8CurrentScaling(bwd_dtype=jnp.float16)
      Traceback (most recent call last):
      ...
      ValueError: `bwd_dtype` must be one of float8_e4m3fn, float8_e5m2, got float16.
    """

    fwd_dtype: Any = E4M3
    bwd_dtype: Any = E5M2
    min_size: int = 0

    def __post_init__(self) -> None:
        self._check_dtypes()
        object.__setattr__(self, "min_size", _positive_int(self.min_size, "min_size", minimum=0))


@dataclasses.dataclass(frozen=True)
class DelayedScaling(_Recipe):
    """Per-tensor FP8 scaling from a history of amaxes (Transformer Engine's default recipe).

    Each FP8 matmul keeps, for its two operands and its gradient, the amaxes of the last
    `history_len` steps and a scale. A step quantises with the scale computed at the end of
    the previous step, records the tensor's amax in the history, and computes the next
    scale with Transformer Engine's rule (``nvte_delayed_scaling_recipe_amax_and_scale_update``):
    ``amax = max(history)`` (or ``history[0]``, the current step's, for ``"most_recent"``),
    ``scale = (fp8_max / amax) / 2**margin`` (the old scale kept when the amax is zero or not
    finite), then the history is rotated by one and its first entry zeroed. The state starts
    with a zero history and scales of 1.

    The state is a `Float8State` (`jaxmp.Autocast.fp8_init`), an explicit argument of the
    call (`jaxmp.Autocast.with_fp8_state`); its gradient is its next value (see
    `Float8State`).

    Attributes:
      history_len: amaxes kept per tensor (Transformer Engine's default: 1024).
      amax_compute: ``"max"`` (the largest amax in the history) or ``"most_recent"``.
      margin: the scale is divided by ``2**margin`` (headroom above the expected amax).
      fwd_dtype: FP8 format of the forward operands (``jnp.float8_e4m3fn``).
      bwd_dtype: FP8 format of the gradients (``jnp.float8_e5m2``).
      min_size: a matmul whose rows, columns or contraction (``M``, ``N`` or ``K``, the
        batch dimensions aside) number fewer than this stays in the compute dtype: below
        some size quantising costs more than the FP8 GEMM saves (0: every matmul in FP8).

    Example:
      >>> import jaxmp
      >>> jaxmp.DelayedScaling(history_len=16, amax_compute="most_recent").history_len
      16
      >>> jaxmp.DelayedScaling(amax_compute="mean")
      Traceback (most recent call last):
      ...
      ValueError: `amax_compute` must be one of 'max', 'most_recent', got 'mean'.
    """

    stateful: ClassVar[bool] = True

    history_len: int = 1024
    amax_compute: str = "max"
    margin: int = 0
    fwd_dtype: Any = E4M3
    bwd_dtype: Any = E5M2
    min_size: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "history_len", _positive_int(self.history_len, "history_len"))
        if self.amax_compute not in AMAX_COMPUTE_ALGOS:
            choices = ", ".join(repr(a) for a in AMAX_COMPUTE_ALGOS)
            raise ValueError(f"`amax_compute` must be one of {choices}, got {self.amax_compute!r}.")
        object.__setattr__(self, "margin", _positive_int(self.margin, "margin", minimum=0))
        self._check_dtypes()
        object.__setattr__(self, "min_size", _positive_int(self.min_size, "min_size", minimum=0))


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling(_Recipe):
    """FP8 with one float32 scale per tile or block (DeepSeek-V3's fine-grained recipe).

    DeepSeek-V3 (arXiv:2412.19437, section 3.3.2) scales activations and gradients per 1x128
    tile (128 consecutive values along the contracted dimension of each row) and weights per
    128x128 block, each by ``fp8_max / amax`` of its own values, and accumulates each
    128-long block of the contraction in float32 before applying the two scales. An outlier
    then only lowers the precision of its own tile. Weights are the operands that come from
    the function's arguments (the parameters, also a batch passed in directly); every other
    operand is an activation. The backward pass tiles each operand along the dimension it
    contracts there (``1x128`` forward, ``128x1`` for the weight gradient). DeepSeek-V3 uses
    E4M3 for all tensors; pass ``bwd_dtype=jnp.float8_e4m3fn`` for that.

    Attributes:
      tile_size: values per activation and gradient tile along the contraction (128).
      weight_block_size: side of the square weight blocks (128).
      fwd_dtype: FP8 format of the forward operands (``jnp.float8_e4m3fn``).
      bwd_dtype: FP8 format of the gradients (``jnp.float8_e5m2``).
      min_size: a matmul whose rows, columns or contraction (``M``, ``N`` or ``K``, the
        batch dimensions aside) number fewer than this stays in the compute dtype: below
        some size quantising costs more than the FP8 GEMM saves (0: every matmul in FP8).

    Example:
      >>> import jaxmp
      >>> jaxmp.Float8BlockScaling().tile_size
      128
      >>> jaxmp.Float8BlockScaling(tile_size=0)
      Traceback (most recent call last):
      ...
      ValueError: `tile_size` must be an integer >= 1, got 0.
    """

    per_tensor: ClassVar[bool] = False

    tile_size: int = 128
    weight_block_size: int = 128
    fwd_dtype: Any = E4M3
    bwd_dtype: Any = E5M2
    min_size: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "tile_size", _positive_int(self.tile_size, "tile_size"))
        object.__setattr__(
            self,
            "weight_block_size",
            _positive_int(self.weight_block_size, "weight_block_size"),
        )
        self._check_dtypes()
        object.__setattr__(self, "min_size", _positive_int(self.min_size, "min_size", minimum=0))


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(_Recipe):
    """MXFP8: blocks of 32 values sharing a power-of-two scale (OCP MX specification v1.0).

    Every block of `block_size` consecutive values along the contracted dimension shares
    one scale ``X = 2**e`` stored as an E8M0 exponent, with ``e = floor(log2(amax)) -
    emax_elem`` (``emax_elem`` = 8 for E4M3, 15 for E5M2) clamped to E8M0's range
    [-127, 127]; the values are ``v / X`` cast to FP8, saturating at the format's largest
    finite value (the OCP specification's conversion). Dequantising multiplies by a power
    of two, which is exact. Operands and gradients are blocked alike. Transformer Engine's
    ``MXFP8BlockScaling`` recipe.

    Attributes:
      block_size: values sharing one scale (32 in the specification).
      fwd_dtype: FP8 format of the forward operands (``jnp.float8_e4m3fn``).
      bwd_dtype: FP8 format of the gradients (``jnp.float8_e5m2``).
      min_size: a matmul whose rows, columns or contraction (``M``, ``N`` or ``K``, the
        batch dimensions aside) number fewer than this stays in the compute dtype: below
        some size quantising costs more than the FP8 GEMM saves (0: every matmul in FP8).

    Example:
      >>> import jaxmp
      >>> jaxmp.MXFP8BlockScaling().block_size
      32
    """

    per_tensor: ClassVar[bool] = False

    block_size: int = 32
    fwd_dtype: Any = E4M3
    bwd_dtype: Any = E5M2
    min_size: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_size", _positive_int(self.block_size, "block_size"))
        self._check_dtypes()
        object.__setattr__(self, "min_size", _positive_int(self.min_size, "min_size", minimum=0))


#: Any FP8 recipe.
Float8Recipe = Float8CurrentScaling | DelayedScaling | Float8BlockScaling | MXFP8BlockScaling
RECIPES = (Float8CurrentScaling, DelayedScaling, Float8BlockScaling, MXFP8BlockScaling)


def check_recipe(recipe: Any, arg: str = "fp8") -> Float8Recipe:
    """`recipe` if it is a recipe; a TypeError naming the recipes otherwise."""
    if not isinstance(recipe, RECIPES):
        names = ", ".join(f"jaxmp.{r.__name__}" for r in RECIPES)
        raise TypeError(f"`{arg}` must be an FP8 recipe ({names}), got {recipe!r}.")
    return recipe


# --------------------------------------------------------------------------------------------
# State of the delayed recipe.


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["amax_history", "scale"],
    meta_fields=["names"],
)
@dataclasses.dataclass(frozen=True)
class Float8State:
    """The state of `DelayedScaling`: an amax history and scales per FP8 matmul.

    Create it with `jaxmp.Autocast.fp8_init` and pass it with
    `jaxmp.Autocast.with_fp8_state`. It is updated through the gradient: differentiate
    the loss with respect to the state too, and the "gradient" you get for it is the state
    of the next step (the FP8 matmuls' backward passes return it; Flax's
    ``_overwrite_with_gradient`` works the same way). Replace the state with it; do not give
    it to the optimizer. `jaxmp.linen.TrainState` and `jaxmp.nnx.Optimizer` do this
    themselves. A matmul whose backward pass did not run in the step (in a ``cond`` branch
    not taken, or whose output does not reach the loss) gets a zero state back, which
    starts it again from scales of 1. Keys are the matmul's position in the program; a
    matmul inside a ``scan`` has one history per iteration (leading axes: the loop lengths).

    Attributes:
      amax_history: per FP8 matmul, float32 of shape ``(*loop lengths, 3, history_len)``,
        rows: left operand, right operand, gradient; entry 0 is the current step's amax.
      scale: per FP8 matmul, float32 of shape ``(*loop lengths, 3)``: the scales the next
        step quantises with.
      names: static; per FP8 matmul, its key and its name stack (the module path).
    """

    amax_history: dict[str, jax.Array]
    scale: dict[str, jax.Array]
    names: tuple[tuple[str, str], ...] = ()


def initial_site_state(lengths: Sequence[int], history_len: int) -> tuple[jax.Array, jax.Array]:
    """A zero history and scales of 1 (Transformer Engine's initial state)."""
    history = jnp.zeros((*lengths, NUM_ROLES, history_len), jnp.float32)
    scale = jnp.ones((*lengths, NUM_ROLES), jnp.float32)
    return history, scale


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


def quantize(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """``x * scale`` in float32, saturated to the format's range and cast to FP8 (nearest).

    Finite values saturate at the format's largest value; infinities and NaNs stay what they
    are (E4M3 has no infinity: they become NaN), so that an overflow before quantisation is
    never turned into a finite number.
    """
    limit = jnp.float32(fp8_max(dtype))
    x = x.astype(jnp.float32)
    q = jnp.clip(x * scale, -limit, limit)
    return jnp.where(jnp.isinf(x), x, q).astype(dtype)


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

    Rounded up, so that a block's largest value never saturates (Transformer Engine's MXFP8
    cast, which rounds the E8M0 scale toward +infinity; the OCP specification's example
    conversion, ``floor(log2(amax)) - emax_elem``, clips block maxima above ``1.75 * 2**k``
    for E4M3). An all-zero block gets 0 (scale 1, exact). Clamped to [-126, 126], where the
    scale and its inverse are both normal float32 values, inside E8M0's range.
    """
    return jnp.clip(-pow2_exponent(amax_value, dtype), -_F32_EXP, _F32_EXP)


def quantize_blocks(
    x: jax.Array, dtype: Any, tile: int, rows: int = 1, *, power_of_two: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Quantises ``x`` of shape ``(b, f, k)`` per block of `rows` x `tile` values of ``(f, k)``.

    Returns ``(q, scale_inv)``: ``q`` of shape ``(b, f, k // tile, tile)`` (``k`` padded with
    zeros to a multiple of `tile`) and ``scale_inv`` of shape ``(b, f, k // tile)``, float32,
    each row of a block carrying the block's inverse scale. With `power_of_two` the scales
    are MX scales (`mx_exponent`), stored as E8M0 and returned as float32. A block's scale
    comes from its finite values; its non-finite values stay non-finite (`quantize`).
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
    else:
        scale = scale_from_amax(block_amax, dtype)
        scale_inv = 1.0 / scale
    q = quantize(blocks, scale[:, :, None, :, None], dtype)
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


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q", "exponent"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Quantized:
    """An operand quantised per tensor, in the layout one product contracts it in.

    Attributes:
      q: the FP8 values, dimensions ordered (batch, free, contracted).
      exponent: the scale's exponent (int32 scalar): ``x * 2**exponent`` was quantised.
    """

    q: jax.Array
    exponent: jax.Array


def quantize_tensor(
    x: jax.Array,
    exponent: jax.Array,
    dtype: Any,
    contract: Sequence[int],
    batch: Sequence[int],
) -> Quantized:
    """`x` laid out (batch, free, contracted) and quantised with the scale ``2**exponent``.

    The transposition happens before the quantisation, in `x`'s own dtype, so no FP8 tensor
    is ever transposed: the FP8 GEMM reads both operands with the contracted dimensions
    minor (cuBLASLt's "TN" layout on Hopper) and XLA fuses the transposition into the
    quantisation.
    """
    free = [d for d in range(x.ndim) if d not in contract and d not in batch]
    laid_out = jnp.transpose(x, (*batch, *free, *contract))
    scale = jnp.ldexp(jnp.float32(1.0), exponent)
    return Quantized(quantize(laid_out, scale, dtype), exponent)


def dequantized_dot(
    a: Quantized, b: Quantized, nbatch: int, ncontract: int, out_dtype: Any
) -> jax.Array:
    """The product of two operands from `quantize_tensor`, in `out_dtype`.

    Each operand is dequantised in `out_dtype` (``q.astype(out_dtype) * 2**-exponent``,
    exact), and one ``dot_general`` contracting their trailing `ncontract` dimensions (their
    leading `nbatch` are batch dimensions) writes the result in `out_dtype` directly: the
    pattern XLA's GPU compiler rewrites into a cuBLASLt FP8 GEMM whose scale arguments are
    the two inverse scales and whose output is `out_dtype` (float32 accumulation), with no
    float32 product written in between.
    """
    out_dtype = jnp.dtype(out_dtype)

    def dequantize(x: Quantized) -> jax.Array:
        inverse = jnp.ldexp(jnp.float32(1.0), -x.exponent).astype(out_dtype)
        return x.q.astype(out_dtype) * inverse

    batch = tuple(range(nbatch))
    dims = (
        (
            tuple(range(a.q.ndim - ncontract, a.q.ndim)),
            tuple(range(b.q.ndim - ncontract, b.q.ndim)),
        ),
        (batch, batch),
    )
    return lax.dot_general(dequantize(a), dequantize(b), dims, preferred_element_type=out_dtype)


# --------------------------------------------------------------------------------------------
# The block recipes' product.


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["scale"], meta_fields=["dtype", "weight"]
)
@dataclasses.dataclass(frozen=True)
class Operand:
    """How one operand of a block-scaled product is quantised.

    Attributes:
      dtype: the FP8 format.
      scale: unused by the block recipes (their scales are per block); kept None.
      weight: whether the operand is a weight (square blocks under `Float8BlockScaling`).
    """

    dtype: Any
    scale: Any = None
    weight: bool = False


def _canonical(x: jax.Array, contract: Sequence[int], batch: Sequence[int]) -> jax.Array:
    """`x` as ``(batch, free, contracted)``, each group of dimensions flattened into one."""
    free = [d for d in range(x.ndim) if d not in contract and d not in batch]
    x = jnp.transpose(x, (*batch, *free, *contract))
    b = math.prod(x.shape[: len(batch)])
    f = math.prod(x.shape[len(batch) : len(batch) + len(free)])
    k = math.prod(x.shape[len(batch) + len(free) :])
    return x.reshape(b, f, k)


def _block_layout(recipe: Any, op: Operand) -> tuple[int, int, bool]:
    """``(tile, rows, power_of_two)`` of an operand under a block recipe."""
    if isinstance(recipe, MXFP8BlockScaling):
        return recipe.block_size, 1, True
    if op.weight:
        return recipe.weight_block_size, recipe.weight_block_size, False
    return recipe.tile_size, 1, False


def block_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    lhs_op: Operand,
    rhs_op: Operand,
    recipe: Any,
) -> jax.Array:
    """The float32 product of `lhs` and `rhs` under a block recipe.

    The contracted dimensions are flattened and cut into blocks, one ``dot_general`` batched
    over the blocks gives each block's float32 partial sum, which is scaled by its two
    inverse scales and summed (DeepSeek-V3's "promotion to CUDA cores"). On Hopper this is
    an emulation: one small FP8 GEMM per block, not a block-scaled GEMM kernel.
    """
    (lc, rc), (lb, rb) = dimension_numbers
    out_shape = (
        *[lhs.shape[d] for d in lb],
        *[lhs.shape[d] for d in range(lhs.ndim) if d not in lc and d not in lb],
        *[rhs.shape[d] for d in range(rhs.ndim) if d not in rc and d not in rb],
    )
    # Both operands are cut at the same points of the contraction: padded with zeros to a
    # multiple of both block lengths, and each block split into pieces of their gcd.
    tiles = (_block_layout(recipe, lhs_op)[0], _block_layout(recipe, rhs_op)[0])
    k = math.prod(lhs.shape[d] for d in lc)
    padded_k = -(-k // math.lcm(*tiles)) * math.lcm(*tiles)
    piece = math.gcd(*tiles)
    lq, ls = _quantize_operand(lhs, lc, lb, lhs_op, recipe, padded_k, piece)
    rq, rs = _quantize_operand(rhs, rc, rb, rhs_op, recipe, padded_k, piece)
    # (b, m, kb, t) x (b, n, kb, t) -> (b, kb, m, n): one float32 partial sum per block.
    partial = lax.dot_general(
        lq, rq, (((3,), (3,)), ((0, 2), (0, 2))), preferred_element_type=jnp.float32
    )
    scaled = partial * jnp.swapaxes(ls, 1, 2)[:, :, :, None] * jnp.swapaxes(rs, 1, 2)[:, :, None]
    return jnp.sum(scaled, axis=1).reshape(out_shape)


def _quantize_operand(
    x: jax.Array,
    contract: Sequence[int],
    batch: Sequence[int],
    op: Operand,
    recipe: Any,
    padded_k: int,
    piece: int,
) -> tuple[jax.Array, jax.Array]:
    """`x` as ``(b, f, padded_k // piece, piece)`` FP8 blocks and their inverse scales."""
    x3 = _canonical(x, contract, batch)
    x3 = jnp.pad(x3, ((0, 0), (0, 0), (0, padded_k - x3.shape[2])))
    tile, rows, power_of_two = _block_layout(recipe, op)
    q, scale_inv = quantize_blocks(x3, op.dtype, tile, rows, power_of_two=power_of_two)
    b, f, kb, t = q.shape
    if t == piece:
        return q, scale_inv
    return q.reshape(b, f, kb * (t // piece), piece), jnp.repeat(scale_inv, t // piece, axis=2)


# --------------------------------------------------------------------------------------------
# The products of a dot_general's backward pass.


def _remaining(n: int, *removed: Sequence[int]) -> list[int]:
    gone = set(itertools.chain(*removed))
    return [i for i in range(n) if i not in gone]


def _ranges_like(*groups: Sequence[int]) -> list[tuple[int, ...]]:
    out, start = [], 0
    for group in groups:
        out.append(tuple(range(start, start + len(group))))
        start += len(group)
    return out


def transpose_lhs(
    dimension_numbers: Any, x_ndim: int, y_ndim: int, *, swap_ans: bool = False
) -> tuple[Any, tuple[int, ...]]:
    """The product giving the gradient of a ``dot_general``'s left operand from its output's.

    Returns the dimension numbers of ``dot_general(g, y)`` and the permutation taking its
    result to the layout of ``x``: JAX's own transpose rule of ``dot_general``
    (``_dot_general_transpose_lhs``), so that the FP8 backward computes exactly the products
    JAX would. With `swap_ans` (and swapped dimension numbers) it gives the right operand's.
    """
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    x_kept = _remaining(x_ndim, x_contract, x_batch)
    y_kept = _remaining(y_ndim, y_contract, y_batch)
    if swap_ans:
        ans_batch, ans_y, _ = _ranges_like(x_batch, y_kept, x_kept)
    else:
        ans_batch, _, ans_y = _ranges_like(x_batch, x_kept, y_kept)
    dims = ((ans_y, tuple(y_kept)), (ans_batch, tuple(y_batch)))
    order = np.argsort(np.asarray(y_contract, dtype=np.int64))
    x_contract_sorted_by_y = [int(x_contract[i]) for i in order]
    out_axes = np.argsort(np.asarray([*x_batch, *x_kept, *x_contract_sorted_by_y], np.int64))
    return dims, tuple(int(a) for a in out_axes)


def transpose_rhs(dimension_numbers: Any, x_ndim: int, y_ndim: int) -> tuple[Any, tuple[int, ...]]:
    """As `transpose_lhs`, for the right operand (``dot_general(g, x)``)."""
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    swapped = ((y_contract, x_contract), (y_batch, x_batch))
    return transpose_lhs(swapped, y_ndim, x_ndim, swap_ans=True)


def rhs_gradient_product(
    dimension_numbers: Any, x_ndim: int, y_ndim: int
) -> tuple[Any, tuple[int, ...]]:
    """The product giving the right operand's gradient as ``dot_general(x, g)``.

    ``x`` first: the result's layout is (batch, x's contracted dimensions, y's free
    dimensions), which is ``y``'s own layout for the usual ``x @ w`` (no transposition of
    the result). Returns the dimension numbers and the permutation to ``y``'s layout.
    """
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    x_kept = _remaining(x_ndim, x_contract, x_batch)
    y_kept = _remaining(y_ndim, y_contract, y_batch)
    ans_batch, ans_x, ans_y = _ranges_like(x_batch, x_kept, y_kept)
    dims = ((tuple(x_kept), ans_x), (tuple(x_batch), ans_batch))
    # The result's middle dimensions are x's contracted ones in x's order; each stands for
    # the y dimension it is contracted with.
    x_order = np.argsort(np.asarray(x_contract, dtype=np.int64))
    y_contract_by_x = [int(y_contract[i]) for i in x_order]
    out_axes = np.argsort(np.asarray([*y_batch, *y_contract_by_x, *y_kept], np.int64))
    return dims, tuple(int(a) for a in out_axes)


# --------------------------------------------------------------------------------------------
# The FP8 dot_general.


def _exponents(
    site: Any,
    roles: Sequence[int],
    formats: Sequence[Any],
    tensors: Sequence[jax.Array],
    dtypes: Sequence[Any],
) -> list[jax.Array]:
    """The scale exponents of `tensors` (in `roles`, quantised to `formats`) for products
    dequantised in each of `dtypes`: current scaling's, or the delayed-scaling `site`'s."""
    if site is None:
        return [tensor_exponent(x, f, *dtypes) for x, f in zip(tensors, formats, strict=True)]
    return [state_exponent(site[1][r], f, *dtypes) for r, f in zip(roles, formats, strict=True)]


def _updated_site(site: Any, amaxes: Any, g: jax.Array, recipe: Any) -> Any:
    """The next ``(amax_history, scale)`` of `site` from this step's amaxes; None without one."""
    if site is None:
        return None
    observed = jnp.stack([amaxes[0], amaxes[1], observed_amax(g, site[0])])
    return delayed_update(site[0], site[1], observed, recipe)


@jax.custom_jvp
def _first_order_only(x: Any) -> Any:
    """The identity, which refuses to be differentiated: see `_with_fp8_vjp`."""
    return x


@_first_order_only.defjvp
def _first_order_only_jvp(primals: Any, tangents: Any) -> Any:
    del primals, tangents
    raise NotImplementedError(
        "an FP8 matmul's backward pass is not differentiable: higher derivatives (jax.hessian, "
        "a Hessian-vector product, jax.grad of jax.grad) through an FP8 matmul are not "
        "defined. Keep the matmul out of FP8 (`fp8_exclude`, `jaxmp.float32_region`) or "
        "compute them without the `fp8` recipe."
    )


def _with_fp8_vjp(
    forward: Callable[..., Any], backward: Callable[..., Any], lhs: Any, rhs: Any, site: Any
) -> jax.Array:
    """``forward(lhs, rhs, site)[0]``, differentiated by `backward` (a `jax.custom_vjp`).

    The forward and backward passes round values to FP8, which has no derivative: their own
    inputs pass `_first_order_only`, so that differentiating them (a second derivative) is a
    clear error instead of NaN. A first derivative never differentiates them.
    """

    def guarded_forward(lhs: Any, rhs: Any, site: Any) -> Any:
        return forward(*_first_order_only((lhs, rhs, site)))

    def guarded_backward(res: Any, g: jax.Array) -> Any:
        return backward(*_first_order_only((res, g)))

    @jax.custom_vjp
    def run(lhs: jax.Array, rhs: jax.Array, site: Any) -> jax.Array:
        return guarded_forward(lhs, rhs, site)[0]

    run.defvjp(guarded_forward, guarded_backward)
    return run(lhs, rhs, site)


def _dims(dimension_numbers: Any) -> Any:
    return tuple(tuple(tuple(int(d) for d in ds) for ds in pair) for pair in dimension_numbers)


def fp8_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    recipe: Any,
    out_dtype: Any,
    *,
    weights: tuple[bool, bool] = (False, False),
    site: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """``lax.dot_general(lhs, rhs, dimension_numbers)`` in FP8, forward and backward.

    The result is in `out_dtype`. The backward pass (a ``jax.custom_vjp``) quantises the
    incoming gradient in ``recipe.bwd_dtype`` and the operands as in the forward pass, and
    returns the gradients in the operands' dtypes. With `DelayedScaling`, `site` is the
    matmul's ``(amax_history, scale)`` (shapes ``(3, L)`` and ``(3,)``) and its gradient is
    the updated pair (`Float8State`).

    Per-tensor recipes quantise each operand once per product it enters, in the layout that
    product contracts it in (`quantize_tensor`), and save the FP8 operands of the backward
    products as residuals (one byte per value instead of the compute dtype's two).
    """
    dims = _dims(dimension_numbers)
    out_dtype = jnp.dtype(out_dtype)
    if recipe.per_tensor:
        passes = _per_tensor_passes(dims, recipe, out_dtype, lhs, rhs)
    else:
        passes = _block_passes(dims, recipe, out_dtype, weights)
    return _with_fp8_vjp(*passes, lhs, rhs, site)


def _per_tensor_passes(
    dims: Any, recipe: Any, out_dtype: np.dtype, lhs: Any, rhs: Any
) -> tuple[Any, Any]:
    """The forward and backward passes of a per-tensor recipe's FP8 ``dot_general``.

    Every scale is a power of two that stays exact in each dtype the operand is dequantised
    in: the forward product's `out_dtype` and the backward product's operand dtypes.
    """
    (lc, rc), (lb, rb) = dims
    fwd, bwd = recipe.fwd_dtype, recipe.bwd_dtype
    lhs_dtype, rhs_dtype = jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype)
    lhs_ndim, rhs_ndim = lhs.ndim, rhs.ndim
    dequant = (out_dtype, lhs_dtype, rhs_dtype)
    dims_l, axes_l = transpose_lhs(dims, lhs_ndim, rhs_ndim)  # d_lhs = dot_general(g, rhs)
    dims_r, axes_r = rhs_gradient_product(dims, lhs_ndim, rhs_ndim)  # d_rhs = (lhs, g)

    def forward(lhs: jax.Array, rhs: jax.Array, site: Any) -> tuple[jax.Array, Any]:
        el, er = _exponents(site, (ROLE_LHS, ROLE_RHS), (fwd, fwd), (lhs, rhs), dequant)
        out = dequantized_dot(
            quantize_tensor(lhs, el, fwd, lc, lb),
            quantize_tensor(rhs, er, fwd, rc, rb),
            len(lb),
            len(lc),
            out_dtype,
        )
        # The operands as the backward products contract them, saved in FP8.
        rhs_q = quantize_tensor(rhs, er, fwd, dims_l[0][1], dims_l[1][1])
        lhs_q = quantize_tensor(lhs, el, fwd, dims_r[0][0], dims_r[1][0])
        amaxes = None
        if site is not None:
            amaxes = (observed_amax(lhs, site[0]), observed_amax(rhs, site[0]))
        return out, (rhs_q, lhs_q, amaxes, site)

    def backward(res: Any, g: jax.Array) -> tuple[Any, Any, Any]:
        rhs_q, lhs_q, amaxes, site = res
        (eg,) = _exponents(site, (ROLE_GRAD,), (bwd,), (g,), (lhs_dtype, rhs_dtype))
        g_l = quantize_tensor(g, eg, bwd, dims_l[0][0], dims_l[1][0])
        d_lhs = dequantized_dot(g_l, rhs_q, len(dims_l[1][0]), len(dims_l[0][0]), lhs_dtype)
        g_r = quantize_tensor(g, eg, bwd, dims_r[0][1], dims_r[1][1])
        d_rhs = dequantized_dot(lhs_q, g_r, len(dims_r[1][0]), len(dims_r[0][0]), rhs_dtype)
        new_site = _updated_site(site, amaxes, g, recipe)
        return jnp.transpose(d_lhs, axes_l), jnp.transpose(d_rhs, axes_r), new_site

    return forward, backward


def _block_passes(
    dims: Any, recipe: Any, out_dtype: np.dtype, weights: tuple[bool, bool]
) -> tuple[Any, Any]:
    """The forward and backward passes of a block recipe's FP8 ``dot_general``."""
    lhs_op = Operand(recipe.fwd_dtype, None, weights[0])
    rhs_op = Operand(recipe.fwd_dtype, None, weights[1])
    g_op = Operand(recipe.bwd_dtype)

    def forward(lhs: jax.Array, rhs: jax.Array, site: Any) -> tuple[jax.Array, Any]:
        out = block_dot_general(lhs, rhs, dims, lhs_op, rhs_op, recipe)
        return out.astype(out_dtype), (lhs, rhs)

    def backward(res: Any, g: jax.Array) -> tuple[Any, Any, Any]:
        lhs, rhs = res
        dims_l, axes_l = transpose_lhs(dims, lhs.ndim, rhs.ndim)
        d_lhs = block_dot_general(g, rhs, dims_l, g_op, rhs_op, recipe)
        d_lhs = jnp.transpose(d_lhs, axes_l).astype(lhs.dtype)
        dims_r, axes_r = transpose_rhs(dims, lhs.ndim, rhs.ndim)
        d_rhs = block_dot_general(g, lhs, dims_r, g_op, lhs_op, recipe)
        d_rhs = jnp.transpose(d_rhs, axes_r).astype(rhs.dtype)
        return d_lhs, d_rhs, None

    return forward, backward


def fp8_conv(
    lhs: jax.Array,
    rhs: jax.Array,
    conv: Callable[..., Any],
    recipe: Any,
    out_dtype: Any,
    *,
    site: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """A convolution in FP8 with a per-tensor recipe, forward and backward.

    `conv(lhs, rhs, dtype)` binds the convolution with its result in `dtype`. The forward
    pass runs it on the operands dequantised in `out_dtype` (``q.astype(out_dtype) *
    2**-exponent``, the pattern of an FP8 convolution), its result in `out_dtype`; the
    backward pass quantises the gradient and takes the convolution's own transposes
    (``jax.vjp``) at the dequantised FP8 values, in the operands' dtypes.
    """
    out_dtype = jnp.dtype(out_dtype)
    fwd, bwd = recipe.fwd_dtype, recipe.bwd_dtype

    def dequantized(x: jax.Array, exponent: jax.Array, fmt: Any, dtype: Any) -> jax.Array:
        q = quantize(x, jnp.ldexp(jnp.float32(1.0), exponent), fmt)
        return q.astype(dtype) * jnp.ldexp(jnp.float32(1.0), -exponent).astype(dtype)

    def forward(lhs: jax.Array, rhs: jax.Array, site: Any) -> tuple[jax.Array, Any]:
        dtypes = (out_dtype, lhs.dtype, rhs.dtype)
        el, er = _exponents(site, (ROLE_LHS, ROLE_RHS), (fwd, fwd), (lhs, rhs), dtypes)
        out = conv(
            dequantized(lhs, el, fwd, out_dtype), dequantized(rhs, er, fwd, out_dtype), out_dtype
        )
        amaxes = None
        if site is not None:
            amaxes = (observed_amax(lhs, site[0]), observed_amax(rhs, site[0]))
        return out, (lhs, rhs, el, er, amaxes, site)

    def backward(res: Any, g: jax.Array) -> tuple[Any, Any, Any]:
        lhs, rhs, el, er, amaxes, site = res
        (eg,) = _exponents(site, (ROLE_GRAD,), (bwd,), (g,), (g.dtype,))
        gd = dequantized(g, eg, bwd, g.dtype)
        ld = dequantized(lhs, el, fwd, g.dtype)
        rd = dequantized(rhs, er, fwd, g.dtype)
        _, vjp = jax.vjp(lambda a, b: conv(a, b, g.dtype), ld, rd)
        d_lhs, d_rhs = vjp(gd)
        new_site = _updated_site(site, amaxes, g, recipe)
        return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype), new_site

    return _with_fp8_vjp(forward, backward, lhs, rhs, site)
