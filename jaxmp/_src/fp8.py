"""FP8 training: scaling recipes as values, and the state of the delayed recipe.

An FP8 matmul quantises both operands to an 8-bit float format with a scale, multiplies the
FP8 values with float32 accumulation and writes the result in the policy's compute dtype
(`jaxmp._src.fp8_dot`). Its backward pass quantises the incoming gradient (E5M2 by default:
two more exponent bits than E4M3, for the wider range of gradients) and runs the two
transposed products the same way. How the scales are chosen is the *recipe*:

* `Float8CurrentScaling` (Transformer Engine's ``Float8CurrentScaling``; torchao's
  "tensorwise" float8): one scale per tensor, the largest power of two not above
  ``fp8_max / amax`` of the tensor itself. Stateless.
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

Scales and quantisation: `jaxmp._src.fp8_scaling`; the products: `jaxmp._src.fp8_dot`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

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
    min_size: int

    def _check_common(self) -> None:
        """Checks (and normalises) the fields every recipe has."""
        object.__setattr__(self, "fwd_dtype", _fp8_dtype(self.fwd_dtype, "fwd_dtype"))
        object.__setattr__(self, "bwd_dtype", _fp8_dtype(self.bwd_dtype, "bwd_dtype"))
        object.__setattr__(self, "min_size", _positive_int(self.min_size, "min_size", minimum=0))


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(_Recipe):
    """Per-tensor FP8 scaling from the tensor's own amax ("tensorwise"; stateless).

    Each operand of an FP8 matmul is multiplied by the largest power of two that keeps its
    largest finite absolute value within the format's largest finite value (``fp8_max /
    amax``, rounded down to a power of two), cast to FP8 (NaN and inf stay NaN and inf), and
    dequantised by the same power of two in the compute dtype, in which the product is
    computed. The same for the gradient in the backward pass. As
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
        self._check_common()


@dataclasses.dataclass(frozen=True)
class DelayedScaling(_Recipe):
    """Per-tensor FP8 scaling from a history of amaxes (Transformer Engine's default recipe).

    Each FP8 matmul keeps, for its two operands and its gradient, the amaxes of the last
    `history_len` steps and a scale. A step quantises with the scale computed at the end of
    the previous step, records the tensor's amax in the history, and computes the next
    scale with Transformer Engine's rule (``nvte_delayed_scaling_recipe_amax_and_scale_update``):
    ``amax = max(history)`` (or ``history[0]``, the current step's, for ``"most_recent"``),
    ``scale = (fp8_max / amax) / 2**margin`` rounded down to a power of two (the old scale
    kept when the amax is zero; an amax is that of the finite values, so NaN and inf never
    enter the history), then the history is rotated by one and its first entry zeroed. The
    state starts with a zero history and scales of 1.

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
        self._check_common()


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
        self._check_common()


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(_Recipe):
    """MXFP8: blocks of 32 values sharing a power-of-two scale (OCP MX specification v1.0).

    Every block of `block_size` consecutive values along the contracted dimension shares
    one scale ``X = 2**e`` stored as an E8M0 exponent, ``e`` the smallest with ``amax / X``
    at most the format's largest value (Transformer Engine's rounding up; the OCP
    specification's example conversion, ``floor(log2(amax)) - emax_elem``, clips block
    maxima above ``1.75 * 2**k`` for E4M3), clamped to [-126, 126]; the values are ``v / X``
    cast to FP8, saturating at the largest FP8 value whose dequantised value is finite in
    the dtype of the product (a block near float16's largest value would otherwise round up
    to inf there). Dequantising multiplies by a power of two, which is exact. Operands and
    gradients are blocked alike. Transformer Engine's ``MXFP8BlockScaling`` recipe.

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
        self._check_common()


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
