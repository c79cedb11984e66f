"""Quantising one leaf at a real model's sizes: in chunks, where it lives, checked on device.

A vocabulary-sized head is 0.5 to 4 GB. Quantised whole, the int4 scale search holds a
dozen float32 temporaries of the leaf's size (20x the leaf: 11 GB for a 4096 x 65536
bfloat16 head); checked for NaN on the host, the leaf is copied there as float64 (4x). Here
a leaf larger than `CHUNK_VALUES` is quantised a slice of output channels at a time, in one
compiled loop that writes each slice's values and scales into place, so the temporaries are
those of one slice; a NaN or inf is found on the device, from the scales the quantisation
computes anyway (a scale is not finite exactly where its channel or group holds a value
that is not), and the leaf is read again only to say where, when there is one.

A leaf sharded over several devices is quantised where it lives: the loop runs over an
output-channel axis that is not sharded (none: the leaf is quantised whole, by each device
on its block), and the values and scales are sharded like the leaf (`_output_shardings`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from jaxmp._src import compat
from jaxmp._src.quantization.recipes import (
    Int4WeightOnly,
    QuantizedArray,
    absmax_scale,
    int4_search,
    pack_int4,
    quantize_values,
)

#: A leaf is quantised in slices of at most this many values (16 MB as float32) and at most
#: 1/`SLICES` of the leaf, but not below `MIN_SLICE_VALUES` (a smaller leaf is quantised
#: whole): the temporaries of one slice (the int4 search holds about six float32 copies of
#: it) stay a fraction of the leaf, whatever its size.
CHUNK_VALUES = 1 << 22
SLICES = 16
MIN_SLICE_VALUES = 1 << 16


def quantize_array(x: jax.Array, contract: Sequence[int], recipe: Any) -> QuantizedArray:
    """`x` quantised with `recipe`, `contract` its contraction axes.

    Outside a trace, compiled once per shape, axes, recipe and placement (the axes
    normalised here, so that ``(0,)`` and ``(-2,)`` share one compilation); inside one,
    traced into the enclosing program. Not checked for NaN or inf: see `check_finite`.
    """
    axes = tuple(sorted(int(c) % np.ndim(x) for c in contract))
    if compat.is_tracer(x):
        return _quantize(x, axes, recipe, *_slices(x.shape, axes, avoid=frozenset()))
    x = jnp.asarray(x)
    return program(x, axes, recipe)(x)


def program(x: jax.Array, axes: tuple[int, ...], recipe: Any) -> Any:
    """The compiled function `quantize_array` runs on leaf `x` (outside a trace): sliced
    along an output-channel axis that is not sharded, its outputs placed like `x`."""
    axis, size = _slices(x.shape, axes, avoid=_sharded_axes(x))
    return _compiled(axes, recipe, axis, size, _output_shardings(x, axes, recipe))


@functools.lru_cache(maxsize=256)
def _compiled(
    axes: tuple[int, ...], recipe: Any, axis: int | None, size: int, shardings: Any
) -> Any:
    fn = functools.partial(_quantize, contract=axes, recipe=recipe, axis=axis, size=size)
    return jax.jit(fn, out_shardings=shardings)


def _sharded_axes(x: Any) -> frozenset[int]:
    """The axes of `x` split over several devices (every axis, for a placement that is not
    a `NamedSharding` over several devices; none on one device or inside a trace)."""
    sharding = getattr(x, "sharding", None) if not compat.is_tracer(x) else None
    if sharding is None or len(sharding.device_set) <= 1:
        return frozenset()
    if not isinstance(sharding, NamedSharding):
        return frozenset(range(x.ndim))
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    return frozenset(i for i, entry in enumerate(spec) if entry is not None)


def _slices(
    shape: tuple[int, ...], contract: tuple[int, ...], avoid: frozenset[int]
) -> tuple[int | None, int]:
    """``(axis, size)``: quantise `size` positions of output-channel axis `axis` at a time;
    ``(None, 0)``: the whole leaf at once (small enough, or no axis to cut along)."""
    total = math.prod(shape)
    free = [i for i in range(len(shape)) if i not in contract and i not in avoid]
    target = min(CHUNK_VALUES, max(total // SLICES, MIN_SLICE_VALUES))
    if total <= target or not free:
        return None, 0
    axis = max(free, key=lambda i: shape[i])
    per_position = total // shape[axis]
    size = max(1, target // per_position)
    if size >= shape[axis]:
        return None, 0
    return axis, size


def _output_axes(ndim: int, contract: tuple[int, ...], recipe: Any, axis: int) -> int:
    """The axis of the values and scales that axis `axis` of the leaf becomes."""
    if not isinstance(recipe, Int4WeightOnly):
        return axis
    return [i for i in range(ndim) if i not in contract].index(axis)


def _output_shardings(x: jax.Array, contract: tuple[int, ...], recipe: Any) -> Any:
    """The values' and scales' shardings for a leaf on a `NamedSharding` over several
    devices (each output axis split as the leaf axis it comes from; the contraction axes
    of the scales, of size 1, whole); None elsewhere (XLA places them)."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or len(sharding.device_set) <= 1:
        return None
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    if not isinstance(recipe, Int4WeightOnly):
        values = spec
        scales = tuple(None if i in contract else s for i, s in enumerate(spec))
    else:
        free = tuple(spec[i] for i in range(x.ndim) if i not in contract)
        # The contraction axes are flattened into the last: split as the one contraction
        # axis is, if there is one and each device's block of it holds whole groups.
        last = spec[contract[0]] if len(contract) == 1 else None
        if last is not None:
            names = (last,) if isinstance(last, str) else tuple(last)
            parts = math.prod(sharding.mesh.shape[n] for n in names)
            if x.shape[contract[0]] % (parts * recipe.group_size):
                last = None
        values = scales = (*free, last)

    def named(entries: tuple[Any, ...]) -> NamedSharding:
        return NamedSharding(sharding.mesh, PartitionSpec(*entries), memory_kind=None)

    negative = tuple(c - x.ndim for c in contract)
    contract_shape = tuple(x.shape[c] for c in contract)
    # The pytree of the result, its two arrays' places holding their shardings.
    return QuantizedArray(
        named(values),  # type: ignore[arg-type]
        named(scales),  # type: ignore[arg-type]
        recipe,
        jnp.dtype(x.dtype),
        negative,
        contract_shape,
    )


def _quantize(
    x: jax.Array, contract: tuple[int, ...], recipe: Any, axis: int | None, size: int
) -> QuantizedArray:
    """`x` quantised whole (`axis` None), or `size` positions of its axis `axis` at a time in
    a loop that writes each slice's values and scales into place."""
    if axis is None:
        return _whole(x, contract, recipe)
    out = jax.eval_shape(functools.partial(_whole, contract=contract, recipe=recipe), x)
    out_axis = _output_axes(x.ndim, contract, recipe, axis)

    raw, bits = x, None
    cpu = jax.default_backend() == "cpu"
    if compat.LOOPS_WIDEN_BFLOAT16_ON_CPU and cpu and x.dtype == jnp.bfloat16:
        # Read as uint16 in the loop (`compat.LOOPS_WIDEN_BFLOAT16_ON_CPU`): one copy of the
        # leaf, where older XLA:CPU made a float32 one (two).
        raw, bits = lax.bitcast_convert_type(x, jnp.uint16), x.dtype

    def put(buffers: tuple[jax.Array, jax.Array], start: Any, n: int) -> tuple[Any, Any]:
        chunk = lax.dynamic_slice_in_dim(raw, start, n, axis)
        if bits is not None:
            chunk = lax.bitcast_convert_type(chunk, bits)
        q = _whole(chunk, contract, recipe)
        values, scales = buffers
        return (
            lax.dynamic_update_slice_in_dim(values, stored(q.values), start, out_axis),
            lax.dynamic_update_slice_in_dim(scales, q.scales, start, out_axis),
        )

    # FP8 values are written into place as their bits (uint8): XLA:CPU writes FP8 slices
    # element by element, 100x slower.
    fp8 = jnp.issubdtype(out.values.dtype, jnp.floating)
    kept = jnp.dtype(jnp.uint8) if fp8 else out.values.dtype

    def stored(values: jax.Array) -> jax.Array:
        return lax.bitcast_convert_type(values, kept) if values.dtype != kept else values

    count, rest = divmod(x.shape[axis], size)
    buffers = (jnp.zeros(out.values.shape, kept), jnp.zeros(out.scales.shape, out.scales.dtype))
    buffers = lax.fori_loop(0, count, lambda i, b: put(b, i * size, size), buffers)
    if rest:
        buffers = put(buffers, count * size, rest)
    values, scales = buffers
    if values.dtype != out.values.dtype:
        values = lax.bitcast_convert_type(values, out.values.dtype)
    return QuantizedArray(values, scales, recipe, out.dtype, out.contract, out.contract_shape)


def _whole(x: jax.Array, contract: tuple[int, ...], recipe: Any) -> QuantizedArray:
    """`x` quantised at once (`contract`: its contraction axes, non-negative, sorted)."""
    ndim = x.ndim
    negative = tuple(c - ndim for c in contract)
    contract_shape = tuple(x.shape[c] for c in contract)
    dtype = jnp.dtype(x.dtype)
    if not isinstance(recipe, Int4WeightOnly):
        scale = absmax_scale(x, contract, recipe.qmax)  # 1 over a zero-size contraction
        values = quantize_values(x, scale, recipe)
        return QuantizedArray(values, scale, recipe, dtype, negative, contract_shape)
    free = [i for i in range(ndim) if i not in contract]
    k = math.prod(contract_shape)
    g = recipe.group_size
    moved = jnp.transpose(x, (*free, *contract)).reshape(*[x.shape[i] for i in free], k)
    groups = moved.reshape(*moved.shape[:-1], k // g, g)
    scale, ints = int4_search(groups)
    # Packed within each group (the group size is even): the same bytes as packing the
    # whole row, with no strided read across a sharded contraction axis.
    values = pack_int4(ints).reshape(*moved.shape[:-1], k // 2)
    return QuantizedArray(values, scale[..., 0], recipe, dtype, negative, contract_shape)


# --------------------------------------------------------------------------------------------
# NaN and inf, found on the device.


def all_finite(x: jax.Array) -> bool:
    """Whether every value of `x` is finite, reduced where `x` lives (one bool read back)."""
    return bool(_replicated(_all_finite, x)(x))


def _all_finite(x: jax.Array) -> jax.Array:
    return jnp.all(jnp.isfinite(x))


def nonfinite_error(path: str, x: jax.Array) -> ValueError:
    """The error for leaf `path`, which holds NaN or inf: how many, the first and its value
    (found on the device; a few numbers are read back)."""
    per_row, row, col, value = _replicated(_first_nonfinite, x)(x)
    count = int(np.sum(np.asarray(per_row), dtype=np.int64))
    if x.ndim == 0:
        first: tuple[int, ...] = ()
    elif x.ndim == 1:
        first = (int(col),)
    else:
        rest = np.unravel_index(int(col), x.shape[1:])
        first = (int(row), *(int(i) for i in rest))
    return ValueError(
        f"`params` leaf {path!r} holds NaN or inf ({count} of {x.size} values, the first at "
        f"index {first}: {float(value)}); a scale cannot represent it. Fix the weight, or "
        "keep it unquantised with exclude=[...]."
    )


def _replicated(fn: Any, x: jax.Array) -> Any:
    """`fn` compiled with its outputs on every device of `x`'s mesh (readable by every
    process, for a leaf spread over several), or where XLA places them."""
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and len(sharding.device_set) > 1:
        return jax.jit(fn, out_shardings=NamedSharding(sharding.mesh, PartitionSpec()))
    return jax.jit(fn)


def _first_nonfinite(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Per row (the first axis), the count of values that are not finite; the first such
    value's row, its position in the row, and the value."""
    rows = x.reshape(x.shape[0] if x.ndim >= 2 else 1, -1)
    bad = ~jnp.isfinite(rows)
    per_row = jnp.sum(bad, axis=1, dtype=jnp.int32)
    row = jnp.argmax(per_row > 0)
    col = jnp.argmax(lax.dynamic_index_in_dim(bad, row, keepdims=False))
    value = lax.dynamic_index_in_dim(rows, row, keepdims=False)[col]
    return per_row, row, col, value


def check_finite(path: str, x: Any, quantized: QuantizedArray | None = None) -> None:
    """Raises `nonfinite_error` if leaf `x` holds NaN or inf; nothing inside a trace.

    With `quantized` (`x` quantised), its scales are read instead of `x`: a scale is not
    finite exactly where its channel or group holds a value that is not.
    """
    if compat.is_tracer(x) or (quantized is not None and compat.is_tracer(quantized.scales)):
        return
    if not all_finite(quantized.scales if quantized is not None else x):
        raise nonfinite_error(path, jnp.asarray(x))
