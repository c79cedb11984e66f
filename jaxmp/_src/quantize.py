"""Post-training quantisation of a model's matmul weights: recipes, `QuantizedArray`, `quantize`.

A recipe says how a weight is stored and how its matmuls run (`jaxmp.quantized`, in
`jaxmp._src.quantize_rules`). Which leaves of the params are matmul weights comes from how the
function uses them, not from their names: `quantize` traces ``fun(params, *example_args)`` and
follows each param leaf through the jaxpr (into ``jit``, ``scan``, ``while``, ``cond``,
``checkpoint`` and custom-rule bodies, and through ``convert_element_type`` and ``transpose``)
to the ``dot_general`` equations that read it. A leaf every use of which is an operand of a
``dot_general`` contracting the same axes is a matmul weight: those axes are its contraction
axes, every other axis (the stacked layers of a scanned leaf included) an output channel.

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
import math
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import compat
from jaxmp._src.patterns import compile_exclude

__all__ = [
    "Float8Rowwise",
    "Int4WeightOnly",
    "Int8DynamicActivations",
    "Int8WeightOnly",
    "QuantizedArray",
    "QuantizedLeaf",
    "get_recipe",
    "quantization_plan",
    "quantize",
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
    data_fields=["values", "scales"],
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
    """

    values: jax.Array
    scales: jax.Array
    recipe: Any
    dtype: Any
    contract: tuple[int, ...]
    contract_shape: tuple[int, ...]

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
        """Bytes stored: values and scales."""
        return int(self.values.size * self.values.dtype.itemsize) + int(
            self.scales.size * self.scales.dtype.itemsize
        )

    def dequantize(self, dtype: Any = None) -> jax.Array:
        """The weight it stands for, in `dtype` (default its own)."""
        dtype = self.dtype if dtype is None else jnp.dtype(dtype)
        if not isinstance(self.recipe, Int4WeightOnly):
            return (self.values.astype(self.scales.dtype) * self.scales).astype(dtype)
        q = unpack_int4(self.values)
        free = q.shape[:-1]
        groups = q.reshape(*free, -1, self.recipe.group_size).astype(self.scales.dtype)
        x = (groups * self.scales[..., None]).reshape(*free, *self.contract_shape)
        ndim = len(free) + len(self.contract)
        source = tuple(range(len(free), ndim))
        return jnp.moveaxis(x, source, tuple(c + ndim for c in self.contract)).astype(dtype)

    def __repr__(self) -> str:
        return (
            f"QuantizedArray({self.recipe.name}, shape={self.shape}, "
            f"dtype={jnp.dtype(self.dtype).name}, contract={self.contract})"
        )


def is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedArray)


def scale_dtype(dtype: Any) -> Any:
    """The dtype of the scales of a value of `dtype`: float32, float64 for float64 (whose
    range float32 cannot hold: 1e300 would overflow, 1e-300 become 0)."""
    return jnp.dtype(jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32)


def absmax_scale(x: jax.Array, axes: Sequence[int], qmax: float) -> jax.Array:
    """``amax / qmax`` over `axes` (kept, size 1), in `scale_dtype`.

    1 where the amax is 0 (no 0 / 0), at least the dtype's smallest normal number (a
    subnormal amax / qmax may be flushed to 0), NaN or inf where the amax is: a NaN or an
    inf reaching a matmul gives a non-finite output, as without quantisation.
    """
    dtype = scale_dtype(x.dtype)
    amax = jnp.max(jnp.abs(x.astype(dtype)), axis=tuple(axes), keepdims=True)
    scale = jnp.maximum(amax / qmax, jnp.finfo(dtype).tiny)  # maximum propagates NaN
    return jnp.where(amax == 0, jnp.ones_like(scale), scale)


def quantize_values(x: jax.Array, scale: jax.Array, recipe: Any) -> jax.Array:
    """`x / scale` rounded to nearest on the recipe's grid: E4M3, or int8 in
    ``[-qmax, qmax]`` (int4's values are `int4_search`'s)."""
    y = x.astype(scale.dtype) / scale
    if recipe.storage == _FP8:
        return jnp.clip(y, -_FP8_MAX, _FP8_MAX).astype(_FP8)
    return jnp.clip(jnp.round(y), -recipe.qmax, recipe.qmax).astype(jnp.int8)


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
    return jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], -1)


def quantize_array(x: jax.Array, contract: Sequence[int], recipe: Any) -> QuantizedArray:
    """`x` quantised with `recipe`, `contract` its contraction axes (compiled once per shape:
    the axes normalised here, so that ``(0,)`` and ``(-2,)`` share one compilation)."""
    return _quantize_array(x, tuple(sorted(int(c) % x.ndim for c in contract)), recipe)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize_array(x: jax.Array, contract: tuple[int, ...], recipe: Any) -> QuantizedArray:
    ndim = x.ndim
    negative = tuple(c - ndim for c in contract)
    contract_shape = tuple(x.shape[c] for c in contract)
    dtype = jnp.dtype(x.dtype)
    if not isinstance(recipe, Int4WeightOnly):
        scale = absmax_scale(x, contract, recipe.qmax)
        values = quantize_values(x, scale, recipe)
        return QuantizedArray(values, scale, recipe, dtype, negative, contract_shape)
    free = [i for i in range(ndim) if i not in contract]
    k = math.prod(contract_shape)
    moved = jnp.transpose(x, (*free, *contract)).reshape(*[x.shape[i] for i in free], k)
    groups = moved.reshape(*moved.shape[:-1], k // recipe.group_size, recipe.group_size)
    scale, ints = int4_search(groups)
    values = pack_int4(ints.reshape(moved.shape))
    return QuantizedArray(values, scale[..., 0], recipe, dtype, negative, contract_shape)


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

    def candidate(r: float, scale: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        ints = jnp.clip(jnp.round(x / scale), -8, 7)
        err = jnp.sum(jnp.square(ints * r - normalised), axis=-1, keepdims=True)
        return scale, ints, err

    best_scale, best_ints, best_err = candidate(1.0, base)
    for r in INT4_SCALE_FRACTIONS[1:]:
        # Never below the smallest normal number (a subnormal scale may be flushed to 0).
        scale, ints, err = candidate(r, jnp.maximum(base * r, jnp.finfo(base.dtype).tiny))
        better = err < best_err
        best_scale = jnp.where(better, scale, best_scale)
        best_ints = jnp.where(better, ints, best_ints)
        best_err = jnp.where(better, err, best_err)
    return best_scale, best_ints.astype(jnp.int8)


# --------------------------------------------------------------------------------------------
# Which leaves are matmul weights.


class QuantizedLeaf(NamedTuple):
    """One floating leaf of the params under `quantize` (`jaxmp.quantization_plan`).

    Attributes:
      path: its path, the string ``exclude`` patterns are searched in (``"params/fc/kernel"``).
      quantized: whether it is quantised.
      reason: why or why not (``"matmul weight, contracted over axes (0,)"``,
        ``"excluded by 'head'"``, ``"also used by gather"``, ...).
    """

    path: str
    quantized: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class _Origin:
    """A jaxpr value that is a param leaf seen through layout ops: axis i of the value is
    axis ``axes[i]`` of the leaf."""

    leaf: int
    axes: tuple[int, ...]


# Call-like primitives whose body takes the equation's operands one to one, and the parameter
# holding the body.
_CALLS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
}
_SAME_LAYOUT = frozenset({"convert_element_type", "copy", "copy_p"})


def _is_float_dtype(dtype: Any) -> bool:
    try:
        return bool(jnp.issubdtype(dtype, jnp.floating))
    except TypeError:
        return False


def _uses(jaxpr: Any, origins: dict[Any, _Origin], uses: list[set[Any]]) -> None:
    """Adds to ``uses[leaf]`` each use of a param leaf in `jaxpr`: ``("dot", contraction
    axes of the leaf)`` or ``("other", primitive name)``."""

    def tracked(var: Any) -> _Origin | None:
        return None if isinstance(var, compat.Literal) else origins.get(var)

    def recurse(sub: Any, pairs: Sequence[tuple[Any, _Origin | None]]) -> None:
        inner, _ = compat.jaxpr_and_consts(sub)
        _uses(inner, {v: o for v, o in pairs if o is not None}, uses)

    def other(name: str, found: Sequence[_Origin | None]) -> None:
        for o in found:
            if o is not None:
                uses[o.leaf].add(("other", name))

    for eqn in jaxpr.eqns:
        found = [tracked(v) for v in eqn.invars]
        if not any(found):
            continue
        name, params = eqn.primitive.name, eqn.params
        if name == "dot_general":
            (lc, rc), _ = params["dimension_numbers"]
            for o, dims in zip(found, (lc, rc), strict=True):
                if o is not None:
                    uses[o.leaf].add(("dot", tuple(sorted(o.axes[d] for d in dims))))
        elif name in _SAME_LAYOUT and _is_float_dtype(eqn.outvars[0].aval.dtype):
            origins[eqn.outvars[0]] = found[0]  # type: ignore[assignment]
        elif name == "transpose":
            o = found[0]
            assert o is not None
            origins[eqn.outvars[0]] = _Origin(
                o.leaf, tuple(o.axes[p] for p in params["permutation"])
            )
        elif name in _CALLS:
            sub, _ = compat.jaxpr_and_consts(params[_CALLS[name]])
            if len(sub.invars) != len(found):
                other(name, found)
                continue
            recurse(params[_CALLS[name]], list(zip(sub.invars, found, strict=True)))
        elif name == "scan":
            n_consts, n_carry = compat.scan_counts(params)
            sub, _ = compat.jaxpr_and_consts(params["jaxpr"])
            other("scan carry", found[n_consts : n_consts + n_carry])
            pairs = list(zip(sub.invars[:n_consts], found[:n_consts], strict=True))
            for var, o in zip(
                sub.invars[n_consts + n_carry :], found[n_consts + n_carry :], strict=True
            ):
                # Each iteration sees the leaf without its leading (stacked) axis.
                pairs.append((var, None if o is None else _Origin(o.leaf, o.axes[1:])))
            recurse(params["jaxpr"], pairs)
        elif name == "while":
            n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
            other("while carry", found[n_cond + n_body :])
            for key, part in (
                ("cond_jaxpr", found[:n_cond]),
                ("body_jaxpr", found[n_cond : n_cond + n_body]),
            ):
                sub, _ = compat.jaxpr_and_consts(params[key])
                recurse(params[key], list(zip(sub.invars, part, strict=False)))
        elif name == "cond":
            other("cond index", found[:1])
            for branch in params["branches"]:
                sub, _ = compat.jaxpr_and_consts(branch)
                recurse(branch, list(zip(sub.invars, found[1:], strict=True)))
        else:
            other(name, found)
    for var in jaxpr.outvars:
        o = tracked(var)
        if o is not None:
            uses[o.leaf].add(("other", "returned"))


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_string(path: Sequence[Any]) -> str:
    """A leaf's path as its keys joined by ``/`` (``"params/Dense_0/kernel"``)."""
    return "/".join(_key_name(k) for k in path)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


@dataclasses.dataclass(frozen=True)
class _Decision:
    path: str
    index: int  # in the flat leaves
    contract: tuple[int, ...] | None  # None: left as it is
    reason: str


def _plan(
    fun: Callable[..., Any],
    params: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    recipe: Any,
    exclude: Any,
) -> tuple[Recipe, list[Any], Any, list[_Decision]]:
    recipe = get_recipe(recipe)
    patterns = compile_exclude(exclude, "exclude")
    with_path, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_quantized)
    for key_path, leaf in with_path:
        if is_quantized(leaf):
            raise ValueError(
                f"`params` leaf {path_string(key_path)!r} is already quantised ({leaf!r}); "
                "quantise the original params (`QuantizedArray.dequantize()` approximates one)."
            )
    leaves = [leaf for _, leaf in with_path]
    arrays = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]

    def flat(*values: Any) -> Any:
        full = list(leaves)
        for i, v in zip(arrays, values, strict=True):
            full[i] = v
        return fun(jax.tree.unflatten(treedef, full), *args, **kwargs)

    structs = [jax.ShapeDtypeStruct(np.shape(leaves[i]), leaves[i].dtype) for i in arrays]
    closed = jax.make_jaxpr(flat)(*structs)
    uses: list[set[Any]] = [set() for _ in arrays]
    origins = {
        var: _Origin(k, tuple(range(len(s.shape))))
        for k, (var, s) in enumerate(zip(closed.jaxpr.invars, structs, strict=True))
    }
    _uses(closed.jaxpr, origins, uses)

    matched: set[int] = set()
    decisions = []
    for k, i in enumerate(arrays):
        path = path_string(with_path[i][0])
        leaf = leaves[i]
        if not _is_float_dtype(leaf.dtype):
            continue  # int, bool and key leaves are never candidates
        decisions.append(_decide(path, i, leaf, uses[k], recipe, patterns, matched))
    unmatched = [p.pattern for j, p in enumerate(patterns) if j not in matched]
    if unmatched:
        names = [d.path for d in decisions]
        close = difflib.get_close_matches(unmatched[0], names, n=1, cutoff=0.3)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"`exclude` pattern {unmatched[0]!r} matches no floating leaf of the params "
            f"(searched with re.search in their paths: {', '.join(names)}).{hint}"
        )
    return recipe, leaves, treedef, decisions


def _decide(
    path: str,
    index: int,
    leaf: Any,
    uses: set[Any],
    recipe: Any,
    patterns: tuple[re.Pattern[str], ...],
    matched: set[int],
) -> _Decision:
    for j, pattern in enumerate(patterns):
        if pattern.search(path):
            matched.add(j)
            return _Decision(path, index, None, f"excluded by {pattern.pattern!r}")
    others = sorted(name for kind, name in uses if kind == "other")
    dots = sorted({axes for kind, axes in uses if kind == "dot"})
    if not dots:
        used = f"used by {', '.join(others)}" if others else "unused"
        return _Decision(path, index, None, f"not a matmul weight ({used})")
    if others:
        return _Decision(path, index, None, f"a matmul weight also used by {', '.join(others)}")
    if len(dots) > 1:
        shown = " and ".join(str(d) for d in dots)
        return _Decision(path, index, None, f"matmuls contract different axes: {shown}")
    (contract,) = dots
    if isinstance(recipe, Int4WeightOnly):
        k = math.prod(np.shape(leaf)[c] for c in contract)
        if k % recipe.group_size:
            return _Decision(
                path,
                index,
                None,
                f"contraction size {k} is not a multiple of group_size {recipe.group_size}",
            )
    _check_finite(path, leaf)
    return _Decision(path, index, contract, f"matmul weight, contracted over axes {contract}")


def _check_finite(path: str, leaf: Any) -> None:
    if compat.is_tracer(leaf):
        return  # quantised inside a transformation: the values are not known here
    values = np.asarray(jax.device_get(leaf), np.float64)
    bad = ~np.isfinite(values)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"`params` leaf {path!r} holds NaN or inf ({int(bad.sum())} of {values.size} "
            f"values, the first at index {first}: {values[first]}); a scale cannot represent "
            "it. Fix the weight, or keep it unquantised with exclude=[...]."
        )


def quantization_plan(
    fun: Callable[..., Any],
    params: Any,
    *example_args: Any,
    recipe: Any,
    exclude: Any = (),
    **example_kwargs: Any,
) -> tuple[QuantizedLeaf, ...]:
    """What `quantize` does with each floating leaf of `params`, and why.

    Takes `quantize`'s arguments (the weights' values are checked for NaN and inf too).

    Returns:
      One `QuantizedLeaf` per floating leaf, in the order of the params' leaves.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> def mlp(p, x):
      ...     return jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]
      >>> p = {"b": jnp.zeros(4), "v": jnp.ones((4, 2)), "w": jnp.ones((8, 4))}
      >>> for leaf in jaxmp.quantization_plan(mlp, p, jnp.ones((1, 8)), recipe="int8"):
      ...     print(leaf.path, leaf.quantized, leaf.reason)
      b False not a matmul weight (used by broadcast_in_dim)
      v True matmul weight, contracted over axes (0,)
      w True matmul weight, contracted over axes (0,)
    """
    _, _, _, decisions = _plan(fun, params, example_args, example_kwargs, recipe, exclude)
    return tuple(QuantizedLeaf(d.path, d.contract is not None, d.reason) for d in decisions)


def quantize(
    fun: Callable[..., Any],
    params: Any,
    *example_args: Any,
    recipe: Any,
    exclude: Any = (),
    **example_kwargs: Any,
) -> Any:
    """Quantises the matmul weights among `params` with `recipe`; run them with `quantized`.

    ``fun(params, *example_args, **example_kwargs)`` is traced (not run) to find which
    leaves are matmul weights and their contraction axes (see the module docs): a leaf read
    by ``dot_general`` only, through ``convert_element_type`` and ``transpose`` and inside
    ``jit``, ``scan`` (a stacked leaf scanned over layers), ``while``, ``cond`` and
    ``checkpoint``. Other floating leaves, and every int or bool leaf, are returned as they
    are (the same objects): biases, norms, an embedding read by ``gather`` only; a tied
    embedding (``gather`` and a matmul) is left unquantised too. `quantization_plan` lists
    each floating leaf with the reason.

    Args:
      fun: the model function, ``fun(params, *args, **kwargs)``; for Flax Linen
        ``model.apply`` with ``{"params": params}``, for Equinox a function of the module.
      params: any pytree; its array leaves are the candidates.
      *example_args: arguments of one call of `fun` (arrays or ``jax.ShapeDtypeStruct``).
      recipe: `Int8WeightOnly`, `Int8DynamicActivations`, `Float8Rowwise`, `Int4WeightOnly`,
        or the name of one: ``"int8"``, ``"int8_dynamic"``, ``"fp8"``, ``"int4"``.
      exclude: regexes kept unquantised: a leaf whose path (its keys joined by ``/``, such
        as ``"params/head/kernel"``) contains a match (`re.search`) is left as it is. Each
        pattern must match a floating leaf.
      **example_kwargs: keyword arguments of that call.

    Returns:
      `params` with each matmul weight replaced by a `QuantizedArray`.

    Raises:
      ValueError: for an unknown recipe name or an exclude pattern matching no leaf (both
        listing the valid choices), a weight holding NaN or inf, or a leaf that is a
        `QuantizedArray` already (both naming its path).
      TypeError: for a recipe or exclude of the wrong type.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> def mlp(p, x):
      ...     return jnp.tanh(x @ p["w"]) @ p["v"]
      >>> p = {"v": jnp.ones((256, 2)), "w": jnp.ones((8, 256))}
      >>> q = jaxmp.quantize(mlp, p, jnp.ones((1, 8)), recipe="int8")
      >>> q["w"]
      QuantizedArray(int8, shape=(8, 256), dtype=float32, contract=(-2,))
      >>> jaxmp.quantized(mlp)(q, jnp.ones((1, 8))).shape
      (1, 2)
    """
    recipe, leaves, treedef, decisions = _plan(
        fun, params, example_args, example_kwargs, recipe, exclude
    )
    out = list(leaves)
    for d in decisions:
        if d.contract is not None:
            out[d.index] = quantize_array(jnp.asarray(leaves[d.index]), d.contract, recipe)
    return jax.tree.unflatten(treedef, out)
