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

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> jaxmp.Float8CurrentScaling()
      Float8CurrentScaling(fwd_dtype=dtype(float8_e4m3fn), bwd_dtype=dtype(float8_e5m2))
      >>> jaxmp.Float8CurrentScaling(bwd_dtype=jnp.float16)
      Traceback (most recent call last):
      ...
      ValueError: `bwd_dtype` must be one of float8_e4m3fn, float8_e5m2, got float16.
    """

    fwd_dtype: Any = E4M3
    bwd_dtype: Any = E5M2

    def __post_init__(self) -> None:
        self._check_dtypes()


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

    def __post_init__(self) -> None:
        object.__setattr__(self, "history_len", _positive_int(self.history_len, "history_len"))
        if self.amax_compute not in AMAX_COMPUTE_ALGOS:
            choices = ", ".join(repr(a) for a in AMAX_COMPUTE_ALGOS)
            raise ValueError(f"`amax_compute` must be one of {choices}, got {self.amax_compute!r}.")
        object.__setattr__(self, "margin", _positive_int(self.margin, "margin", minimum=0))
        self._check_dtypes()


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

    def __post_init__(self) -> None:
        object.__setattr__(self, "tile_size", _positive_int(self.tile_size, "tile_size"))
        object.__setattr__(
            self,
            "weight_block_size",
            _positive_int(self.weight_block_size, "weight_block_size"),
        )
        self._check_dtypes()


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

    Example:
      >>> import jaxmp
      >>> jaxmp.MXFP8BlockScaling().block_size
      32
    """

    per_tensor: ClassVar[bool] = False

    block_size: int = 32
    fwd_dtype: Any = E4M3
    bwd_dtype: Any = E5M2

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_size", _positive_int(self.block_size, "block_size"))
        self._check_dtypes()


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
    observed is recorded as entry 0, the amax of the window is reduced from the history,
    the scale recomputed (kept where the amax is zero or not finite, float32's largest value
    where it would be infinite), and the history rotated by -1 with its first entry zeroed.
    """
    history = history.at[..., 0].set(amax)
    if recipe.amax_compute == "max":
        window = jnp.max(history, axis=-1)
    else:
        window = history[..., 0]
    maxima = jnp.asarray(
        [fp8_max(recipe.fwd_dtype), fp8_max(recipe.fwd_dtype), fp8_max(recipe.bwd_dtype)],
        jnp.float32,
    )
    new_scale = (maxima / window) / jnp.float32(2.0**recipe.margin)
    keep = ~(window > 0) | ~jnp.isfinite(window)
    new_scale = jnp.where(keep, scale, new_scale)
    new_scale = jnp.where(jnp.isinf(new_scale), jnp.float32(_F32_MAX), new_scale)
    history = jnp.roll(history, -1, axis=-1).at[..., 0].set(0.0)
    return history, new_scale


# --------------------------------------------------------------------------------------------
# Quantisation.


def amax(x: jax.Array) -> jax.Array:
    """The largest absolute value of `x` in float32, the same on every device.

    Under ``jax.shard_map`` the local maximum is reduced (``lax.pmax``) over the mesh axes
    `x` varies along, so that every device takes the same scaling decision; under ``jit``
    with sharded arrays the reduction is global already.
    """
    local = jnp.max(jnp.abs(x.astype(jnp.float32))) if x.size else jnp.zeros((), jnp.float32)
    axes = compat.varying_axes(x)
    if axes:
        local = lax.pmax(local, tuple(sorted(axes)))
    return local


def scale_from_amax(amax_value: jax.Array, dtype: Any) -> jax.Array:
    """``fp8_max / amax``; 1 where the amax is zero or not finite, finite where it is tiny."""
    amax_value = jnp.asarray(amax_value, jnp.float32)
    scale = jnp.float32(fp8_max(dtype)) / amax_value
    scale = jnp.where((amax_value > 0) & jnp.isfinite(amax_value), scale, jnp.float32(1.0))
    return jnp.minimum(scale, jnp.float32(_F32_MAX))


def quantize(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """``x * scale`` in float32, saturated to the format's range and cast to FP8 (nearest)."""
    limit = jnp.float32(fp8_max(dtype))
    return jnp.clip(x.astype(jnp.float32) * scale, -limit, limit).astype(dtype)


def _emax(dtype: Any) -> int:
    """The exponent of the largest power of two of an FP8 format (8 for E4M3, 15 for E5M2)."""
    return int(math.floor(math.log2(fp8_max(dtype))))


def mx_exponent(amax_value: jax.Array, dtype: Any) -> jax.Array:
    """The MX shared exponent ``floor(log2(amax)) - emax_elem``, clamped to E8M0's range.

    Computed exactly with ``frexp`` (``amax = m * 2**e``, ``m`` in [0.5, 1)); a zero block
    gets the smallest exponent, -127 (its values are zero whatever the scale).
    """
    _, exponent = jnp.frexp(amax_value.astype(jnp.float32))
    shared = exponent.astype(jnp.int32) - 1 - _emax(dtype)
    shared = jnp.where(amax_value > 0, shared, -127)
    return jnp.clip(shared, -127, 127)


def quantize_blocks(
    x: jax.Array, dtype: Any, tile: int, rows: int = 1, *, power_of_two: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Quantises ``x`` of shape ``(b, f, k)`` per block of `rows` x `tile` values of ``(f, k)``.

    Returns ``(q, scale_inv)``: ``q`` of shape ``(b, f, k // tile, tile)`` (``k`` padded with
    zeros to a multiple of `tile`) and ``scale_inv`` of shape ``(b, f, k // tile)``, float32,
    each row of a block carrying the block's inverse scale. With `power_of_two` the scales
    are MX scales (`mx_exponent`), stored as E8M0 and returned as float32.
    """
    b, f, k = x.shape
    kb, fb = -(-k // tile), -(-f // rows)
    padded = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, fb * rows - f), (0, kb * tile - k)))
    blocks = padded.reshape(b, fb, rows, kb, tile)
    block_amax = jnp.max(jnp.abs(blocks), axis=(2, 4))  # (b, fb, kb)
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
# The FP8 dot_general.


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["scale"], meta_fields=["dtype", "weight"]
)
@dataclasses.dataclass(frozen=True)
class Operand:
    """How one operand of an FP8 product is quantised.

    Attributes:
      dtype: the FP8 format.
      scale: the per-tensor scale (float32 scalar), or None: computed from the tensor
        (current scaling), or per block for the block recipes.
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


def _tensor_scale(x: jax.Array, op: Operand) -> jax.Array:
    return scale_from_amax(amax(x), op.dtype) if op.scale is None else op.scale


def scaled_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    lhs_op: Operand,
    rhs_op: Operand,
    recipe: Any,
) -> jax.Array:
    """The float32 product of `lhs` and `rhs` quantised as `lhs_op` and `rhs_op` say.

    Per-tensor recipes: one ``dot_general`` of the FP8 operands (float32 accumulation), times
    the two inverse scales. Block recipes: the contracted dimensions are flattened and cut
    into blocks, one ``dot_general`` batched over the blocks gives each block's float32
    partial sum, which is scaled by its two inverse scales and summed.
    """
    (lc, rc), (lb, rb) = dimension_numbers
    if recipe.per_tensor:
        sl, sr = _tensor_scale(lhs, lhs_op), _tensor_scale(rhs, rhs_op)
        out = lax.dot_general(
            quantize(lhs, sl, lhs_op.dtype),
            quantize(rhs, sr, rhs_op.dtype),
            dimension_numbers,
            preferred_element_type=jnp.float32,
        )
        return out * ((1.0 / sl) * (1.0 / sr))
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


def _site_scales(site: Any) -> tuple[Any, Any, Any]:
    """The (lhs, rhs, gradient) scales of a delayed-scaling `site`; Nones without one."""
    if site is None:
        return None, None, None
    # A zero scale is the state of a matmul that did not run last step: start afresh.
    scale = jnp.where(site[1] > 0, site[1], jnp.float32(1.0))
    return scale[ROLE_LHS], scale[ROLE_RHS], scale[ROLE_GRAD]


def _updated_site(site: Any, amaxes: Any, g: jax.Array, recipe: Any) -> Any:
    """The next ``(amax_history, scale)`` of `site` from this step's amaxes; None without one."""
    if site is None:
        return None
    observed = jnp.stack([amaxes[0], amaxes[1], amax(g)])
    return delayed_update(site[0], site[1], observed, recipe)


def _with_fp8_vjp(
    forward: Callable[..., Any], backward: Callable[..., Any], lhs: Any, rhs: Any, site: Any
) -> jax.Array:
    """``forward(lhs, rhs, site)[0]``, differentiated by `backward` (a `jax.custom_vjp`)."""

    @jax.custom_vjp
    def run(lhs: jax.Array, rhs: jax.Array, site: Any) -> jax.Array:
        return forward(lhs, rhs, site)[0]

    run.defvjp(forward, backward)
    return run(lhs, rhs, site)


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
    """
    dimension_numbers = tuple(
        tuple(tuple(int(d) for d in ds) for ds in pair) for pair in dimension_numbers
    )
    out_dtype = jnp.dtype(out_dtype)
    lw, rw = weights
    stateful = site is not None

    def forward(lhs: jax.Array, rhs: jax.Array, site: Any) -> tuple[jax.Array, Any]:
        sl, sr, _ = _site_scales(site)
        if recipe.per_tensor and sl is None:
            sl, sr = (
                _tensor_scale(lhs, Operand(recipe.fwd_dtype)),
                _tensor_scale(rhs, Operand(recipe.fwd_dtype)),
            )
        lhs_op = Operand(recipe.fwd_dtype, sl, lw)
        rhs_op = Operand(recipe.fwd_dtype, sr, rw)
        out = scaled_dot_general(lhs, rhs, dimension_numbers, lhs_op, rhs_op, recipe)
        amaxes = (amax(lhs), amax(rhs)) if stateful else None
        return out.astype(out_dtype), (lhs, rhs, lhs_op, rhs_op, amaxes, site)

    def backward(res: Any, g: jax.Array) -> tuple[Any, Any, Any]:
        lhs, rhs, lhs_op, rhs_op, amaxes, site = res
        _, _, sg = _site_scales(site)
        if recipe.per_tensor and sg is None:
            sg = _tensor_scale(g, Operand(recipe.bwd_dtype))
        g_op = Operand(recipe.bwd_dtype, sg)
        dims_l, axes_l = transpose_lhs(dimension_numbers, lhs.ndim, rhs.ndim)
        d_lhs = scaled_dot_general(g, rhs, dims_l, g_op, rhs_op, recipe)
        d_lhs = jnp.transpose(d_lhs, axes_l).astype(lhs.dtype)
        dims_r, axes_r = transpose_rhs(dimension_numbers, lhs.ndim, rhs.ndim)
        d_rhs = scaled_dot_general(g, lhs, dims_r, g_op, lhs_op, recipe)
        d_rhs = jnp.transpose(d_rhs, axes_r).astype(rhs.dtype)
        new_site = _updated_site(site, amaxes, g, recipe)
        return d_lhs, d_rhs, new_site

    return _with_fp8_vjp(forward, backward, lhs, rhs, site)


def fp8_conv(
    lhs: jax.Array,
    rhs: jax.Array,
    conv: Any,
    recipe: Any,
    out_dtype: Any,
    *,
    site: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """A convolution in FP8 with a per-tensor recipe, forward and backward.

    `conv(lhs, rhs)` binds the convolution with float32 accumulation. The forward pass runs
    it on the FP8 operands; the backward pass quantises the gradient and takes the
    convolution's own transposes (``jax.vjp``) at the dequantised FP8 values, in float32:
    the same products, without FP8-typed operands.
    """
    out_dtype = jnp.dtype(out_dtype)
    stateful = site is not None

    def forward(lhs: jax.Array, rhs: jax.Array, site: Any) -> tuple[jax.Array, Any]:
        sl, sr, _ = _site_scales(site)
        if sl is None:
            sl = scale_from_amax(amax(lhs), recipe.fwd_dtype)
            sr = scale_from_amax(amax(rhs), recipe.fwd_dtype)
        lq, rq = quantize(lhs, sl, recipe.fwd_dtype), quantize(rhs, sr, recipe.fwd_dtype)
        out = conv(lq, rq) * ((1.0 / sl) * (1.0 / sr))
        amaxes = (amax(lhs), amax(rhs)) if stateful else None
        return out.astype(out_dtype), (lhs, rhs, lq, rq, sl, sr, amaxes, site)

    def backward(res: Any, g: jax.Array) -> tuple[Any, Any, Any]:
        lhs, rhs, lq, rq, sl, sr, amaxes, site = res
        _, _, sg = _site_scales(site)
        if sg is None:
            sg = scale_from_amax(amax(g), recipe.bwd_dtype)
        gd = quantize(g, sg, recipe.bwd_dtype).astype(jnp.float32) / sg
        ld = lq.astype(jnp.float32) / sl
        rd = rq.astype(jnp.float32) / sr
        _, vjp = jax.vjp(conv, ld, rd)
        d_lhs, d_rhs = vjp(gd)
        new_site = _updated_site(site, amaxes, g, recipe)
        return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype), new_site

    return _with_fp8_vjp(forward, backward, lhs, rhs, site)
