"""What a quantised weight is: the recipes, `QuantizedArray`, and their numerics.

A recipe says how a weight is stored (int8, E4M3 or packed int4 values, float32 scales) and
how its matmuls run (`jaxmp._src.quantization.rules`). The numerics here are shared by
quantising a leaf (`jaxmp._src.quantization.leaf`) and running a matmul on one.

Round-to-nearest, symmetric, calibration-free, as in the peers' defaults: Keras 3's
``model.quantize("int8" | "float8" | "int4")``, torchao's ``Int8WeightOnlyConfig``,
``Int8DynamicActivationInt8WeightConfig``, ``Float8DynamicActivationFloat8WeightConfig(
granularity=PerRow())`` and ``Int4WeightOnlyConfig(group_size=128)``; per-row activation and
per-channel weight absmax scales as in LLM.int8() (Dettmers et al. 2022) and SmoothQuant
(Xiao et al. 2023), and FP8 rowwise scaling as in Transformer Engine and FBGEMM.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import operator
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import compat

__all__ = [
    "Float8Rowwise",
    "Int4WeightOnly",
    "Int8DynamicActivations",
    "Int8WeightOnly",
    "QuantizedArray",
    "get_recipe",
]

_FP8 = jnp.dtype(jnp.float8_e4m3fn)
_FP8_MAX = float(jnp.finfo(_FP8).max)  # 448


# --------------------------------------------------------------------------------------------
# Recipes.


@dataclasses.dataclass(frozen=True)
class Int8WeightOnly:
    """Int8 weights, one float32 scale per output channel; activations keep their dtype.

    Symmetric round-to-nearest: ``scale = amax / 127`` over the contraction axes (1 for a
    channel of zeros), values in [-127, 127]. The matmul converts the int8 weight to the
    activations' dtype inside the dot and multiplies its float32 output by the scale of each
    output channel: the same as dequantising first, without a dequantised copy in memory.
    Keras 3's ``model.quantize("int8")`` weights, torchao's ``Int8WeightOnlyConfig``.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> jaxmp.Int8WeightOnly()
      Int8WeightOnly()
    """

    name: ClassVar[str] = "int8"
    storage: ClassVar[Any] = jnp.dtype(jnp.int8)
    qmax: ClassVar[float] = 127.0


@dataclasses.dataclass(frozen=True)
class Int8DynamicActivations:
    """Int8 weights per output channel and int8 activations per row, scaled at run time.

    The weights as `Int8WeightOnly`; each row of the activations (the axes the matmul does
    not contract) gets ``scale = amax / 127`` when the matmul runs, and the dot is int8 x int8
    with int32 accumulation (``preferred_element_type=int32``), rescaled in float32 by row
    scale times channel scale, its result in the dtype the model's matmul had. LLM.int8()'s
    vector-wise quantisation without the outlier decomposition; torchao's
    ``Int8DynamicActivationInt8WeightConfig``.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> jaxmp.Int8DynamicActivations()
      Int8DynamicActivations()
    """

    name: ClassVar[str] = "int8_dynamic"
    storage: ClassVar[Any] = jnp.dtype(jnp.int8)
    qmax: ClassVar[float] = 127.0


@dataclasses.dataclass(frozen=True)
class Float8Rowwise:
    """FP8 E4M3 weights per output channel and activations per row, float32 scales.

    ``scale = amax / 448`` (E4M3's largest finite value) per output channel of the weight and
    per row of the activations, computed when the matmul runs; the dot is E4M3 x E4M3 with
    float32 accumulation, rescaled by both scales. Rowwise scaling as in Transformer Engine's
    and FBGEMM's FP8 GEMMs, torchao's ``Float8DynamicActivationFloat8WeightConfig(
    granularity=PerRow())``, Keras 3's ``model.quantize("float8")`` (per tensor there).

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> jaxmp.Float8Rowwise()
      Float8Rowwise()
    """

    name: ClassVar[str] = "fp8"
    storage: ClassVar[Any] = _FP8
    qmax: ClassVar[float] = _FP8_MAX


@dataclasses.dataclass(frozen=True)
class Int4WeightOnly:
    """Int4 weights in groups along the contraction axes, packed two per byte.

    Symmetric round-to-nearest in [-8, 7], one float32 scale per group of `group_size`
    consecutive values along the (flattened) contraction axes; two values per uint8. The scale
    is chosen per group from the weight alone: of ``amax / 7 * r`` for r = 1, 0.95, ..., 0.6,
    the one whose rounded and clipped values have the smallest squared error (with r = 1 among
    them, never more than plain absmax rounding's; on the main job's model, +2.3% validation
    loss against +3.1% for plain ``amax / 7``). A weight whose contraction size is not a
    multiple of `group_size` is left unquantised (`quantization_plan` says so). The matmul
    dequantises the weight to the activations' dtype (the scale varies along the contraction,
    so it cannot be applied to the output). torchao's ``Int4WeightOnlyConfig(group_size=128)``
    (asymmetric there), Keras 3's ``model.quantize("int4")``.

    Args:
      group_size: values per scale, a positive even integer, numpy's too (default 128).

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> jaxmp.Int4WeightOnly(group_size=64)
      Int4WeightOnly(group_size=64)
    """

    group_size: int = 128

    name: ClassVar[str] = "int4"
    storage: ClassVar[Any] = jnp.dtype(jnp.uint8)
    qmax: ClassVar[float] = 7.0  # the first candidate scale is amax / 7 (`int4_search`)

    def __post_init__(self) -> None:
        size = self.group_size
        try:
            n = -1 if isinstance(size, bool) else operator.index(size)
        except TypeError:
            n = -1
        if n < 2 or n % 2:
            raise ValueError(
                f"`group_size` must be a positive even integer (64, 128, 256, ...), got {size!r}."
            )
        object.__setattr__(self, "group_size", n)  # a numpy integer stored as an int


Recipe = Int8WeightOnly | Int8DynamicActivations | Float8Rowwise | Int4WeightOnly

_RECIPE_TYPES = (Int8WeightOnly, Int8DynamicActivations, Float8Rowwise, Int4WeightOnly)
#: The recipes by name, for ``recipe="int8"``.
RECIPES: dict[str, Any] = {cls.name: cls for cls in _RECIPE_TYPES}


def get_recipe(recipe: Any) -> Recipe:
    """`recipe` as a recipe object: one of them, or its name (``"int8"``, ``"fp8"``, ...).

    Raises:
      ValueError: for an unknown name, listing the names (and the closest one).
      TypeError: for anything else.
    """
    if isinstance(recipe, _RECIPE_TYPES):
        return recipe
    choices = ", ".join(repr(n) for n in RECIPES)
    if isinstance(recipe, str):
        if recipe in RECIPES:
            return RECIPES[recipe]()  # type: ignore[no-any-return]
        close = difflib.get_close_matches(recipe, list(RECIPES), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"`recipe` must be one of {choices}, got {recipe!r}.{hint}")
    classes = ", ".join(f"jaxmp.{c.__name__}()" for c in RECIPES.values())
    got = repr(recipe)
    if isinstance(recipe, type) and recipe in RECIPES.values():
        got = f"the class jaxmp.{recipe.__name__}; pass an instance: jaxmp.{recipe.__name__}()"
    raise TypeError(
        f"`recipe` must be a quantisation recipe ({classes}) or its name ({choices}), got {got}."
    )


# --------------------------------------------------------------------------------------------
# The quantised array.


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["values", "scales", "act_scale"],
    meta_fields=["recipe", "dtype", "contract", "contract_shape"],
)
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """A quantised matmul weight: a pytree of its stored values and scales.

    ``jit``, ``vmap``, ``lax.scan`` over a stacked leaf and orbax see two array leaves; the
    recipe, the original dtype and the contraction axes are static. Axes are counted from the
    end (``-2`` for the rows of a ``(d_in, d_out)`` kernel), so a slice of a stacked weight
    (a scan over layers) is still described by them.

    Attributes:
      values: int8 or E4M3 values of the weight's shape; for `Int4WeightOnly`, uint8 of shape
        ``(*output channels, contraction size // 2)`` (the contraction axes moved last,
        flattened, two values per byte).
      scales: float32 (float64 for a float64 weight); the weight's shape with 1 on the
        contraction axes, or for `Int4WeightOnly` ``(*output channels, contraction size //
        group_size)``.
      recipe: the recipe it was quantised with.
      dtype: the dtype of the weight it stands for.
      contract: the contraction axes, negative.
      contract_shape: their sizes.
      act_scale: None (the activations' scales are computed at run time), or, after
        `jaxmp.calibrate`, the static scale of the activations this weight's matmul reads
        (float32, float64 for a float64 weight): the shape of `scales`, one value repeated
        over the output channels, so that it is sliced with the weight (a stacked leaf
        scanned over layers keeps one scale per layer).
    """

    values: jax.Array
    scales: jax.Array
    recipe: Any
    dtype: Any
    contract: tuple[int, ...]
    contract_shape: tuple[int, ...]
    act_scale: Any = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the weight it stands for."""
        if not isinstance(self.recipe, Int4WeightOnly):
            return tuple(np.shape(self.values))
        free = list(np.shape(self.values)[:-1])
        ndim = len(free) + len(self.contract)
        positions = {c + ndim: s for c, s in zip(self.contract, self.contract_shape, strict=True)}
        return tuple(positions[i] if i in positions else free.pop(0) for i in range(ndim))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes stored: values and scales (and the static activation scales)."""
        arrays = [self.values, self.scales] + ([] if self.act_scale is None else [self.act_scale])
        return sum(int(a.size * a.dtype.itemsize) for a in arrays)

    def dequantize(self, dtype: Any = None) -> jax.Array:
        """The weight it stands for, in `dtype` (default its own).

        Each value times its scale in the scales' dtype (float32), rounded once to `dtype`:
        one elementwise pass whose only output is the `dtype` array (an int4 weight is
        unpacked inside the same pass), so no float32 copy of the weight is written.
        """
        if not isinstance(self.recipe, Int4WeightOnly):
            dtype = self.dtype if dtype is None else jnp.dtype(dtype)
            return (self.values.astype(self.scales.dtype) * self.scales).astype(dtype)
        moved, axes = dequantize_moved(self, dtype)
        # Axis i of the weight is axis axes[i] of `moved`.
        return jnp.transpose(moved, axes)

    def __repr__(self) -> str:
        static = "" if self.act_scale is None else ", calibrated"
        return (
            f"QuantizedArray({self.recipe.name}, shape={self.shape}, "
            f"dtype={jnp.dtype(self.dtype).name}, contract={self.contract}{static})"
        )


def dequantize_moved(q: QuantizedArray, dtype: Any = None) -> tuple[jax.Array, tuple[int, ...]]:
    """Int4 weight `q` dequantised as `QuantizedArray.dequantize` does, in the order its
    values are stored: the output channels, then the contraction axes. Also, for each axis
    of the weight, its axis in that array (so that a matmul can read it as it lies: a
    transposed bfloat16 operand of a dot is widened to float32 by XLA:CPU)."""
    dtype = q.dtype if dtype is None else jnp.dtype(dtype)
    ints = unpack_int4(q.values)
    free = ints.shape[:-1]
    groups = ints.reshape(*free, q.scales.shape[-1], q.recipe.group_size)
    x = (groups.astype(q.scales.dtype) * q.scales[..., None]).astype(dtype)
    ndim = len(free) + len(q.contract)
    contract = [c + ndim for c in q.contract]
    free_axes = [i for i in range(ndim) if i not in contract]
    axes = [0] * ndim
    for position, axis in enumerate((*free_axes, *contract)):
        axes[axis] = position
    return x.reshape(*free, *q.contract_shape), tuple(axes)


def is_float_dtype(dtype: Any) -> bool:
    """Whether `dtype` is a floating-point dtype (False for anything that is not a dtype)."""
    try:
        return bool(jnp.issubdtype(dtype, jnp.floating))
    except TypeError:
        return False


def is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedArray)


def scale_dtype(dtype: Any) -> Any:
    """The dtype of the scales of a value of `dtype`: float32, float64 for float64 (whose
    range float32 cannot hold: 1e300 would overflow, 1e-300 become 0)."""
    return jnp.dtype(jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32)


def absmax_scale(x: jax.Array, axes: Sequence[int], qmax: float) -> jax.Array:
    """``amax / qmax`` over `axes` (kept, size 1), in `scale_dtype`, computed as
    `over_qmax` does.

    1 where the amax is 0 (no 0 / 0), at least the dtype's smallest normal number (a
    subnormal amax / qmax may be flushed to 0), NaN or inf where the amax is: a NaN or an
    inf reaching a matmul gives a non-finite output, as without quantisation.
    """
    dtype = scale_dtype(x.dtype)
    amax = nan_max_abs(x.astype(dtype), axes)
    scale = jnp.maximum(over_qmax(amax, qmax), jnp.finfo(dtype).tiny)  # maximum keeps NaN
    return jnp.where(amax == 0, jnp.ones_like(scale), scale)


def over_qmax(amax: Any, qmax: float) -> Any:
    """``amax / qmax`` as ``amax * (1 / qmax)``, the reciprocal rounded to `amax`'s dtype
    (a jax or numpy array of float32 or float64).

    XLA compiles a division by a constant into that product, and runs a division it is
    handed at run time (jax's op-by-op dispatch, on some releases) as a division: they
    differ in the last bit for about half of all values, and a scale one bit off moves the
    values at a rounding tie to the other grid point. Written as the product, every program,
    eager or jitted, on every release, computes the same scale.
    """
    dtype = np.dtype(amax.dtype)
    return amax * (np.asarray(1, dtype) / np.asarray(qmax, dtype))


def nan_max_abs(x: jax.Array, axes: Sequence[int]) -> jax.Array:
    """The largest magnitude of float32 or float64 `x` over `axes` (kept), NaN where a NaN is.

    Taken on the bits as integers (those of non-negative floats order as the floats do, a
    NaN's above inf's): XLA:CPU's vectorised float maximum over more than a few rows skips
    NaN (jax 0.12: ``jnp.max(abs(w), axis=0)`` of a 64 x 64 `w` holding one NaN is 1.0), and
    a NaN activation lost there would be quantised to a finite number.
    """
    ints = jnp.dtype(jnp.int64 if x.dtype == jnp.float64 else jnp.int32)
    bits = jax.lax.bitcast_convert_type(jnp.abs(x), ints)
    # `initial` 0 (the bits of 0.0): an empty contraction has an amax of 0, hence a scale of 1.
    top = jnp.max(bits, axis=tuple(axes), keepdims=True, initial=np.zeros((), ints))
    return jax.lax.bitcast_convert_type(top, x.dtype)


def quantize_values(x: jax.Array, scale: jax.Array, recipe: Any) -> jax.Array:
    """`x / scale` rounded to nearest on the recipe's grid: E4M3, or int8 in
    ``[-qmax, qmax]`` (int4's values are `int4_search`'s)."""
    y = x.astype(scale.dtype) / scale
    if recipe.storage == _FP8:
        y = jnp.clip(y, -_FP8_MAX, _FP8_MAX)
        if compat.FP8_CONVERT_MAY_ROUND_TWICE:
            y = _on_the_e4m3_grid(y)  # then every conversion is exact
        return y.astype(_FP8)
    return jnp.clip(jnp.round(y), -recipe.qmax, recipe.qmax).astype(jnp.int8)


def _on_the_e4m3_grid(y: jax.Array) -> jax.Array:
    """Float32 or float64 `y` (at most 448 in magnitude, or NaN) rounded to the nearest E4M3
    value (ties to even), in `y`'s dtype: the mantissa rounded to 3 bits on its bits as
    integers; below E4M3's smallest normal number (2^-6), to a multiple of 2^-9."""
    uint = jnp.dtype(jnp.uint64 if y.dtype == jnp.float64 else jnp.uint32)
    drop = jnp.finfo(y.dtype).nmant - 3  # the mantissa bits E4M3 has not
    bits = jax.lax.bitcast_convert_type(y, uint)
    half = np.asarray((1 << (drop - 1)) - 1, uint)
    odd = (bits >> np.asarray(drop, uint)) & np.asarray(1, uint)
    kept = np.asarray(~((1 << drop) - 1) & np.iinfo(uint).max, uint)
    normal = jax.lax.bitcast_convert_type((bits + half + odd) & kept, y.dtype)
    subnormal = jnp.round(y * 2.0**9) * 2.0**-9  # exact: a power of two
    return jnp.where(jnp.abs(y) < 2.0**-6, subnormal, normal)


def pack_int4(q: jax.Array) -> jax.Array:
    """int8 values in [-8, 7], even last axis, two per uint8 (the first in the low nibble)."""
    low = q[..., 0::2].astype(jnp.uint8) & 0xF
    high = q[..., 1::2].astype(jnp.uint8) & 0xF
    return low | (high << 4)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """`pack_int4`'s inverse: int8 values, the last axis twice as long."""

    def signed(nibble: jax.Array) -> jax.Array:
        n = nibble.astype(jnp.int8)
        return jnp.where(n >= 8, n - 16, n).astype(jnp.int8)

    low, high = signed(packed & 0xF), signed(packed >> 4)
    # The last axis's length given, not -1: a weight with no output channels has none to infer.
    return jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


#: The int4 scale candidates, as fractions of ``amax / 7`` (1: nothing clipped).
INT4_SCALE_FRACTIONS = tuple(float(r) for r in np.linspace(1.0, 0.6, 9))


def int4_search(groups: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(scale, ints)`` of each group (the last axis) of `groups` in int4: for each candidate
    scale ``amax / 7 * r`` (`INT4_SCALE_FRACTIONS`), the values rounded to nearest and clipped
    to [-8, 7]; per group, the candidate with the smallest squared error, the first of equals.

    Round-to-nearest with a clipping range chosen from the weight alone (no calibration data):
    with ``r = 1`` among the candidates, a group's error is never above plain absmax rounding's.
    """
    # 1 for an all-zero group, where every candidate is exact.
    base = absmax_scale(groups, (-1,), Int4WeightOnly.qmax)
    x = groups.astype(base.dtype)
    # The errors relative to `base` (values in [-7, 7]): their squares neither overflow nor
    # underflow, whatever the weights' magnitude.
    normalised = x / base

    def error(r: Any, scale: jax.Array) -> jax.Array:
        ints = jnp.clip(jnp.round(x / scale), -8, 7)
        return jnp.sum(jnp.square(ints * r - normalised), axis=-1, keepdims=True)

    # The scale is chosen first, from each candidate's error (one number a group), and the
    # values rounded once with it. The candidates are tried one after the other in a loop:
    # written out as nine independent computations, XLA:CPU keeps each one's rounded values,
    # a float32 copy of the groups apiece, alive at once.
    tiny = jnp.finfo(base.dtype).tiny
    fractions = jnp.asarray(INT4_SCALE_FRACTIONS[1:], base.dtype)

    def step(i: Any, best: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        r = fractions[i]
        # Never below the smallest normal number (a subnormal scale may be flushed to 0).
        scale = jnp.maximum(base * r, tiny)
        err = error(r, scale)
        better = err < best[1]
        return jnp.where(better, scale, best[0]), jnp.where(better, err, best[1])

    best_scale, _ = jax.lax.fori_loop(
        0, len(INT4_SCALE_FRACTIONS) - 1, step, (base, error(1.0, base))
    )
    return best_scale, jnp.clip(jnp.round(x / best_scale), -8, 7).astype(jnp.int8)
