"""The inspector's statistics: the formats, the bits of values, and the measurement of
values measured together, on device or (constants) with numpy.

The outputs of one body (the program, a loop body, a branch, a ``checkpoint``) of one dtype
and of nearby sizes are measured together, padded with zeros to one size (`_measure`): one
scatter counts each value's class by its reference's bin (`_Bins`: every count and the
histogram), and a few float reductions give the extremes and the norms. A body's
measurements are a record (`_Batch`); the records of a loop's iterations combine
(`_combine`), and the records of a program are read into a `Stats` per row (`_group_stats`).
See the package's docstring for what is measured.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from jaxmp._src import compat

DEFAULT_FORMATS = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")

# Binary exponents floor(log2|x|) the histograms count: every nonzero finite float32 value
# (subnormals from 2^-149). Float64 values beyond count in the end bins.
EXPONENT_MIN, EXPONENT_MAX = -149, 127
_NUM_BINS = EXPONENT_MAX - EXPONENT_MIN + 1
_NEVER = np.iinfo(np.int32).max


# --------------------------------------------------------------------------------------------
# Formats and bit layouts.


class _Layout(NamedTuple):
    """How the statistics read a floating dtype's bits."""

    float_dtype: np.dtype  # the dtype values are measured in (float32 or float64)
    uint_dtype: np.dtype
    mantissa_bits: int
    bias: int

    @property
    def inf_bits(self) -> int:
        return int(np.asarray(np.inf, self.float_dtype).view(self.uint_dtype))

    @property
    def magnitude_mask(self) -> int:
        return (1 << (8 * self.uint_dtype.itemsize - 1)) - 1


_F32 = _Layout(np.dtype(np.float32), np.dtype(np.uint32), 23, 127)
_F64 = _Layout(np.dtype(np.float64), np.dtype(np.uint64), 52, 1023)


def _layout(dtype: Any) -> _Layout:
    return _F64 if jnp.dtype(dtype) == np.dtype(np.float64) else _F32


def _format_dtype(name: Any) -> np.dtype:
    try:
        return np.dtype(getattr(ml_dtypes, name)) if isinstance(name, str) else np.dtype(name)
    except (AttributeError, TypeError):
        pass
    try:
        return np.dtype(name)
    except TypeError:
        return np.dtype(object)


def _check_formats(formats: Any) -> tuple[str, ...]:
    if isinstance(formats, str) or not isinstance(formats, Iterable):
        raise TypeError(f"`formats` must be a sequence of dtype names, got {formats!r}.")
    names = []
    for fmt in formats:
        dtype = _format_dtype(fmt)
        if dtype == np.dtype(object) or not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"`formats` must name floating dtypes (for example {', '.join(DEFAULT_FORMATS)}), "
                f"got {fmt!r}."
            )
        names.append(dtype.name)
    if not names:
        raise ValueError("`formats` must name at least one floating dtype, got none.")
    if len(set(names)) != len(names):
        raise ValueError(f"`formats` must not repeat a dtype, got {list(formats)!r}.")
    return tuple(names)


@functools.cache
def _thresholds(fmt: str, layout: _Layout) -> tuple[int, int]:
    """``(flush, overflow)`` magnitude bits of `layout` for storing in `fmt`.

    A nonzero value rounds to zero in `fmt` iff its magnitude bits are at most `flush`, and
    overflows (to inf, or NaN in formats without inf) iff they are at least `overflow`. Found
    by bisection over the bit patterns, converting with numpy/ml_dtypes (round to nearest even,
    monotonic in the magnitude).
    """
    target = _format_dtype(fmt)

    def convert(bits: int) -> float:
        value = np.asarray(bits, layout.uint_dtype).view(layout.float_dtype)
        with np.errstate(over="ignore", invalid="ignore"):
            return float(np.asarray(value).astype(target).astype(np.float64))

    inf = layout.inf_bits
    lo, hi = 0, inf  # convert(lo) == 0; find the largest such bits
    if convert(1) != 0:
        flush = 0
    else:
        lo = 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if convert(mid) == 0 else (lo, mid)
        flush = lo
    lo, hi = 0, inf  # math.isfinite(convert(lo)); find the smallest bits that are not
    if math.isfinite(convert(inf - 1)):
        return flush, inf
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if math.isfinite(convert(mid)) else (lo, mid)
    return flush, hi


_SHORT_DTYPES = {
    "float64": "f64",
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "float8_e4m3fn": "e4m3fn",
    "float8_e5m2": "e5m2",
    "float8_e4m3fnuz": "e4m3fnuz",
    "float8_e5m2fnuz": "e5m2fnuz",
    "float8_e4m3b11fnuz": "e4m3b11",
    "float8_e4m3": "e4m3",
    "float8_e3m4": "e3m4",
    "float8_e8m0fnu": "e8m0",
}


def _short(dtype: str) -> str:
    return _SHORT_DTYPES.get(dtype, dtype)


# --------------------------------------------------------------------------------------------
# Statistics on device.


class Stats(NamedTuple):
    """The statistics of a `Report`'s rows: arrays with a leading axis over the rows."""

    calls: Any  # int32: times the op ran
    nan: Any  # int32
    inf: Any  # int32
    max_abs: Any  # float: max |x| over finite values (0 if none)
    min_abs: Any  # float: smallest nonzero |x| over finite values (inf if none)
    nonzero: Any  # int32: nonzero finite reference values
    flush: Any  # int32[formats]: of those, rounding to zero in each format
    overflow: Any  # int32[formats]: finite reference values overflowing each format
    lost: Any  # int32: nonzero finite reference values that are zero in the program
    err: Any  # float: ||y - y_ref|| over finite reference values
    ref_norm: Any  # float: ||y_ref|| over finite reference values
    ref_max: Any  # float: max |y_ref| over finite values
    ref_bad: Any  # int32: reference values that are NaN or inf
    hist: Any  # int32[_NUM_BINS]: binary exponents of nonzero finite reference values
    first: Any  # int32: clock of the first call making a NaN or inf its inputs did not hold
    held: Any  # int32: clock of the first call whose output held a NaN or inf


def _stat_float() -> np.dtype:
    # float64 when jax_enable_x64 is on, else float32.
    return np.dtype(jax.dtypes.canonicalize_dtype(np.float64))


def _magnitude(x: Any) -> tuple[Any, _Layout]:
    layout = _layout(x.dtype)
    wide = x if x.dtype == layout.float_dtype else lax.convert_element_type(x, layout.float_dtype)
    bits = lax.bitcast_convert_type(wide, layout.uint_dtype)
    return bits & np.asarray(layout.magnitude_mask, layout.uint_dtype), layout


def _exponents(mag: Any, layout: _Layout) -> Any:
    """floor(log2|x|) from the magnitude bits (any value for zero)."""
    signed = np.dtype(f"int{8 * layout.uint_dtype.itemsize}")
    field = (mag >> layout.mantissa_bits).astype(signed)
    width = 8 * layout.uint_dtype.itemsize
    top_bit = (width - 1) - lax.clz(mag).astype(signed)  # subnormals: value = mag * 2^-(bias-1+m)
    subnormal = top_bit - (layout.bias - 1 + layout.mantissa_bits)
    return jnp.where(field > 0, field - layout.bias, subnormal)


def _host_exponent(bits: int, layout: _Layout) -> int:
    """`_exponents` of one nonzero magnitude, on the host."""
    field = bits >> layout.mantissa_bits
    if field > 0:
        return field - layout.bias
    return (bits.bit_length() - 1) - (layout.bias - 1 + layout.mantissa_bits)


def _first_bits(exponent: int, layout: _Layout) -> int:
    """The smallest magnitude bits whose binary exponent is at least `exponent`."""
    lowest_normal = 1 - layout.bias
    if exponent >= lowest_normal:
        return (exponent + layout.bias) << layout.mantissa_bits
    return 1 << (exponent - lowest_normal + layout.mantissa_bits)


class _Bins(NamedTuple):
    """The bins a layout's reference magnitudes are counted in, and how to read them.

    A magnitude r (bits) goes to bin ``b(r) + j(r)``: b is 0 for zero, 1 + the position of its
    binary exponent (clipped to the histogram's range) for a nonzero finite value, and
    ``_NUM_BINS + 1`` for NaN and inf; j is the number of `cuts` (the formats' flush and
    overflow thresholds) at most r. Both grow with r, and the bin strictly from one (b, j)
    pair to the next, so for a cut or the start of an exponent bin t, the values below t are
    exactly those in the bins below ``index(t)``: every statistic is a sum over a range of
    bins. One scatter per value counts them all (instead of a reduction per statistic).
    """

    cuts: tuple[int, ...]  # sorted magnitude bits
    size: int  # number of bins
    exponent_edges: np.ndarray  # int[_NUM_BINS + 1]: first bin of each exponent, then the end
    one: int  # first bin of the nonzero values
    inf: int  # first bin of the non-finite values
    flush: np.ndarray  # int[formats]: first bin of the values not rounding to zero
    overflow: np.ndarray  # int[formats]: first bin of the values overflowing


@functools.cache
def _bins(formats: tuple[str, ...], layout: _Layout) -> _Bins:
    thresholds = [_thresholds(fmt, layout) for fmt in formats]
    inf = layout.inf_bits
    cuts = tuple(sorted({c for f, o in thresholds for c in (f + 1, o) if c < inf}))

    def index(bits: int) -> int:
        if bits == 0:
            bin_ = 0
        elif bits >= inf:
            bin_ = _NUM_BINS + 1
        else:
            exponent = min(max(_host_exponent(bits, layout), EXPONENT_MIN), EXPONENT_MAX)
            bin_ = 1 + exponent - EXPONENT_MIN
        return bin_ + bisect.bisect_right(cuts, bits)

    starts = [index(1)]
    starts += [index(_first_bits(e, layout)) for e in range(EXPONENT_MIN + 1, EXPONENT_MAX + 1)]
    return _Bins(
        cuts=cuts,
        size=_NUM_BINS + 2 + len(cuts),
        exponent_edges=np.asarray([*starts, index(inf)], np.int32),
        one=index(1),
        inf=index(inf),
        flush=np.asarray([index(f + 1) for f, _ in thresholds], np.int32),
        overflow=np.asarray([index(o) for _, o in thresholds], np.int32),
    )


def _subnormal_extremes(
    xs: tuple[Any, ...], layout: _Layout, subnormal: tuple[Any, ...], one_pass: bool = False
) -> list[tuple[Any, Any]]:
    """For each array of `xs` (rows of one shape): the bits of the largest and the smallest
    subnormal magnitude along the last axis (0 and inf: none). Reduced as integers, only where
    a row of them holds some (`subnormal`: the count per row of each, from the histogram): XLA
    on CPU compares subnormal floats as zero. With `one_pass` (rows on one device), in one
    variadic reduction for all of them (XLA's partitioner would gather sharded rows for it).
    `xs` are the rows' arrays themselves (a ``lax.cond`` operand computed from them would be
    stored)."""
    udt = layout.uint_dtype
    inf = np.asarray(layout.inf_bits, udt)
    zero = np.asarray(0, udt)
    smallest_normal = np.asarray(1 << layout.mantissa_bits, udt)

    def exact(xs: tuple[Any, ...]) -> list[tuple[Any, Any]]:
        operands = []
        for x in xs:
            mag, _ = _magnitude(x)
            below = (mag > 0) & (mag < smallest_normal)
            operands += [jnp.where(below, mag, zero), jnp.where(below, mag, inf)]
        if one_pass:
            reduced = _variadic(operands, [zero, inf] * len(xs), [lax.max, lax.min] * len(xs))
        else:
            kinds = [jnp.max, jnp.min] * len(xs)
            reduced = tuple(f(x, axis=-1) for x, f in zip(operands, kinds, strict=True))
        return [(reduced[2 * k], reduced[2 * k + 1]) for k in range(len(xs))]

    def none(xs: tuple[Any, ...]) -> list[tuple[Any, Any]]:
        return [
            (
                compat.vary_like(jnp.zeros(x.shape[:-1], udt), x),
                compat.vary_like(jnp.full(x.shape[:-1], inf, udt), x),
            )
            for x in xs
        ]

    held = functools.reduce(jnp.logical_or, [jnp.any(n > 0) for n in subnormal])
    return lax.cond(held, exact, none, xs)


def _variadic(operands: list[Any], inits: list[Any], kinds: list[Any]) -> tuple[Any, ...]:
    """One reduction of `operands` along their last axis, each with its op of `kinds`."""

    def reducer(a: Any, b: Any) -> Any:
        return tuple(kind(x, y) for kind, x, y in zip(kinds, a, b, strict=True))

    return tuple(lax.reduce(tuple(operands), tuple(inits), reducer, (1,)))


def _join_extremes(hi_max: Any, hi_min: Any, lo: tuple[Any, Any], layout: _Layout) -> Any:
    """The bits of the largest and smallest nonzero finite magnitudes from the normal ones'
    float reductions (0 and inf: none) and the subnormal ones' bits (`_subnormal_extremes`)."""
    udt = layout.uint_dtype
    lo_max, lo_min = lo
    largest = jnp.where(hi_max > 0, lax.bitcast_convert_type(hi_max, udt), lo_max)
    inf = np.asarray(layout.inf_bits, udt)
    smallest = jnp.where(lo_min < inf, lo_min, lax.bitcast_convert_type(hi_min, udt))
    return largest, smallest


def _extremes(x: Any, layout: _Layout, subnormal: Any, largest_only: bool = False) -> Any:
    """The bits of the largest and the smallest nonzero finite magnitude along the last axis.

    Reduced as floats (XLA vectorizes a float max; an integer one is several times slower on
    CPU), which is exact for normal values; subnormal values by `_subnormal_extremes`. None:
    0 for the largest, inf for the smallest.
    """
    fdt, udt = layout.float_dtype, layout.uint_dtype
    mag, _ = _magnitude(x)
    inf = np.asarray(layout.inf_bits, udt)
    smallest_normal = np.asarray(1 << layout.mantissa_bits, udt)
    normal = (mag >= smallest_normal) & (mag < inf)
    as_float = lax.bitcast_convert_type(mag, fdt)
    zero, infinity = np.asarray(0, fdt), np.asarray(np.inf, fdt)
    hi_max = jnp.max(jnp.where(normal, as_float, zero), axis=-1, initial=zero)
    hi_min = jnp.min(jnp.where(normal, as_float, infinity), axis=-1, initial=infinity)
    (lo,) = _subnormal_extremes((x,), layout, (subnormal,))
    largest, smallest = _join_extremes(hi_max, hi_min, lo, layout)
    return largest if largest_only else (largest, smallest)


def _counted(s: Any, q: Any) -> Any:
    """The scale `s` of a partial norm ``(s, q)`` where it has a nonzero square, else 0."""
    return jnp.where(q > 0, s, jnp.zeros_like(s))


def _scaled_norm_step(a: tuple[Any, Any], b: tuple[Any, Any]) -> tuple[Any, Any]:
    """Combines two partial norms ``(s, q)``, norm ``s * sqrt(q)`` (LAPACK's nrm2 scaling).

    The squares are taken relative to the largest scale of a nonzero part: no overflow, no
    underflow of the values that matter (a part with no nonzero square, whose scale is 1 or 0,
    is left out: a tiny part must not be taken relative to 1).
    """
    (s1, q1), (s2, q2) = a, b
    s1, s2 = _counted(s1, q1), _counted(s2, q2)
    s = jnp.maximum(s1, s2)
    safe = jnp.where((s > 0) & (s < jnp.inf), s, 1)
    q = _rescaled(q1, s1 / safe) + _rescaled(q2, s2 / safe)
    q = jnp.where(s == jnp.inf, 1, jnp.where(s > 0, q, 0))
    return s, q


def _rescaled(q: Any, ratio: Any) -> Any:
    """``q * ratio^2`` as ``(q * ratio) * ratio``: for a ratio below 2^-63 its square alone is
    subnormal, flushed to zero on CPU, where the product with a large `q` is a normal number."""
    return (q * ratio) * ratio


# Classes of a value the histograms count it in.
_ZERO, _SUBNORMAL, _NORMAL, _INF, _NAN = range(5)
_KINDS = 5


class _Group(NamedTuple):
    """The statistics of rows measured together (one size, after padding): arrays over them."""

    maxima: tuple[Any, Any, Any]  # bits: max |x|, min nonzero |x| (inf: none), max |ref|
    hist: Any  # int32[rows, _KINDS * bins]: counts per (class of the value, bin of the ref)
    norms: tuple[Any, ...]  # (s, q) of the error and of the reference, or () without one


def _measure(
    values: Any,
    refs: Any,
    formats: tuple[str, ...],
    one_pass: bool = False,
    axes: tuple[str, ...] = (),
) -> _Group:
    """The statistics of each row of `values` (``[rows, n]``; `refs` None: its own reference).

    One scatter counts the class of each value (zero, subnormal, normal, inf, NaN) by the bin
    of its reference (`_Bins`): every count and the histogram. Then simple reductions, which
    XLA vectorizes: the extremes (`_extremes`) and the sums of squares of the error and of
    the reference, relative to the largest reference value; with `one_pass` (rows on one
    device) and float32 rows, all of them in one variadic reduction (`_reduce_float32`).

    With mesh `axes` (inside ``shard_map``), `values` and `refs` are the blocks of the rows on
    this device and the statistics are the rows' (`_reduce_over`): the norms are relative to
    the row's largest reference, as on one device, not to the block's (an error 1e19 times a
    block's largest reference would overflow).
    """
    mag, layout = _magnitude(values)
    inf = np.asarray(layout.inf_bits, layout.uint_dtype)
    r_mag, r_layout = (mag, layout) if refs is None else _magnitude(refs)
    r_inf = np.asarray(r_layout.inf_bits, r_layout.uint_dtype)
    bins = _bins(formats, r_layout)
    i32 = jnp.int32
    smallest_normal = np.asarray(1 << layout.mantissa_bits, layout.uint_dtype)
    kind = (
        (mag > 0).astype(i32)
        + (mag >= smallest_normal).astype(i32)
        + (mag >= inf).astype(i32)
        + (mag > inf).astype(i32)
    )
    exponent = jnp.clip(_exponents(r_mag, r_layout), EXPONENT_MIN, EXPONENT_MAX)
    bin_ = jnp.where(
        r_mag == 0, 0, jnp.where(r_mag >= r_inf, _NUM_BINS + 1, 1 + exponent - EXPONENT_MIN)
    ).astype(i32)
    for cut in bins.cuts:
        bin_ = bin_ + (r_mag >= np.asarray(cut, r_layout.uint_dtype)).astype(i32)
    rows = values.shape[0]
    width = _KINDS * bins.size
    index = kind * bins.size + bin_ + (jnp.arange(rows, dtype=i32) * width)[:, None]
    hist = jnp.zeros(rows * width, i32).at[index.ravel()].add(1, mode="promise_in_bounds")
    hist = hist.reshape(rows, _KINDS, bins.size)
    if axes:  # the rows' counts, which the norms' scale is read from
        hist = lax.psum(hist, axes)
    if one_pass and layout == _F32 and r_layout == _F32:
        return _reduce_over(_reduce_float32(values, refs, hist, bins), axes)
    largest, smallest = _extremes(values, layout, _kinds(hist)[:, _SUBNORMAL])
    norms: tuple[Any, ...] = ()
    if refs is None:
        ref_max = largest
    else:
        r_subnormal = _reference_subnormals(hist, bins, r_layout)
        ref_max = _extremes(refs, r_layout, r_subnormal, largest_only=True)
        if axes:
            ref_max = lax.pmax(ref_max, axes)
        diff, size = _error_and_size(values, refs)
        # Both relative to a power of two near the largest reference value (`_power_of_two`):
        # no overflow, no underflow that matters (an error 1e19 times the largest value would
        # overflow: it is inf anyway).
        signed = np.dtype(f"int{8 * r_layout.uint_dtype.itemsize}")
        field = (ref_max >> r_layout.mantissa_bits).astype(signed)  # 0: zero or subnormal
        exponent = jnp.where(field > 0, field - r_layout.bias, -r_layout.bias)
        scale, inverse = _power_of_two(exponent, r_layout)
        sums = [jnp.sum(jnp.square(x * inverse[:, None]), axis=-1) for x in (diff, size)]
        norms = _norm_pairs(sums, scale)
    group = _Group(maxima=(largest, smallest, ref_max), hist=hist.reshape(rows, width), norms=norms)
    return _reduce_over(group, axes)


def _reduce_over(group: _Group, axes: tuple[str, ...]) -> _Group:
    """The statistics of rows from those of their blocks on the devices along mesh `axes`
    (inside ``shard_map``; the counts already summed by `_measure`): extremes over every
    block, norms combined as in `_scaled_norm_step`. Without `axes`, `group` itself."""
    if not axes:
        return group

    def over(reduce: Any, x: Any) -> Any:
        # Along the axes `x` still varies along: `_measure` reduced a float64 row's largest
        # reference already, for the norms' scale.
        left = tuple(a for a in axes if a in compat.varying_axes(x))
        return reduce(x, left) if left else x

    largest, smallest, ref_max = group.maxima
    maxima = (over(lax.pmax, largest), over(lax.pmin, smallest), over(lax.pmax, ref_max))
    norms: list[Any] = []
    for k in range(0, len(group.norms), 2):
        s, q = group.norms[k : k + 2]
        s = _counted(s, q)
        top = lax.pmax(s, axes)
        safe = jnp.where((top > 0) & (top < jnp.inf), top, 1)
        q = lax.psum(_rescaled(q, s / safe), axes)
        norms += [top, jnp.where(top == jnp.inf, 1, jnp.where(top > 0, q, 0))]
    return _Group(maxima=maxima, hist=group.hist, norms=tuple(norms))


def _error_and_size(values: Any, refs: Any) -> tuple[Any, Any]:
    """``|value - ref|`` and ``|ref|`` where the reference is finite (0 elsewhere); the error
    is inf where the value is non-finite and its reference finite."""
    value = lax.convert_element_type(values, refs.dtype)
    r_finite = jnp.isfinite(refs)
    diff = jnp.abs(jnp.where(r_finite, value - jnp.where(r_finite, refs, 0), 0))
    diff = jnp.where(r_finite & ~jnp.isfinite(value), jnp.inf, diff)
    return diff, jnp.abs(jnp.where(r_finite, refs, 0))


def _norm_pairs(sums: Iterable[Any], scale: Any) -> tuple[Any, ...]:
    """The ``(s, q)`` pair of each sum of squares relative to `scale` (norm ``s * sqrt(q)``):
    an infinite sum is ``(inf, 1)``."""
    pairs: tuple[Any, ...] = ()
    for q in sums:
        infinite = jnp.isinf(q)
        pairs += (jnp.where(infinite, jnp.inf, scale), jnp.where(infinite, 1, q))
    return pairs


def _bin_exponents(bins: _Bins) -> np.ndarray:
    """The binary exponent of each bin of `bins` (those of the nonzero finite magnitudes;
    the others' are not read)."""
    exponents = np.searchsorted(bins.exponent_edges[:-1], np.arange(bins.size), "right") - 1
    return (exponents + EXPONENT_MIN).astype(np.int32)


def _power_of_two(exponent: Any, layout: _Layout) -> tuple[Any, Any]:
    """``(2^e, 2^-e)`` in `layout`'s float dtype, e the binary exponent of a row's largest
    reference, clipped to the normal range (both normal numbers: XLA multiplies by the
    inverse, and a subnormal one would be flushed to zero); 0 where the row has no normal
    nonzero finite reference (all zero, subnormal or non-finite: scale 1, as on the host)."""
    lowest = 1 - layout.bias
    exponent = jnp.where(exponent < lowest, 0, jnp.minimum(exponent, layout.bias - 1))
    one = layout.float_dtype.type(1)
    return jnp.ldexp(one, exponent), jnp.ldexp(one, -exponent)


def _norm_scale(hist: Any, bins: _Bins) -> tuple[Any, Any]:
    """`_power_of_two` of the largest nonzero finite float32 reference of each row, read from
    its histogram (the highest nonzero bin): references below ``2^(e+1)`` (``4 * 2^e`` where
    clipped at 126), scaling by it exact."""
    counts = _bin_counts(hist)
    positions = jnp.arange(bins.size, dtype=jnp.int32)
    finite_nonzero = (positions >= bins.one) & (positions < bins.inf)
    top = jnp.max(jnp.where((counts > 0) & finite_nonzero, positions, bins.one), axis=-1)
    return _power_of_two(jnp.asarray(_bin_exponents(bins))[top], _F32)


def _reduce_float32(values: Any, refs: Any, hist: Any, bins: _Bins) -> _Group:
    """`_measure`'s extremes and norms of float32 rows in one variadic reduction (one pass over
    the values and the references, where separate reductions take one each), and the
    subnormal extremes of both in one conditional one; the norms relative to `_norm_scale`'s
    power of two.
    """
    layout = _F32
    f32 = np.dtype(np.float32)
    tiny, infinity, zero = f32.type(np.finfo(f32).tiny), f32.type(np.inf), f32.type(0)
    magnitude = jnp.abs(values)
    normal = (magnitude >= tiny) & (magnitude < infinity)  # False for NaN
    operands = [jnp.where(normal, magnitude, zero), jnp.where(normal, magnitude, infinity)]
    inits = [zero, infinity]
    kinds = [lax.max, lax.min]
    subnormal = _kinds(hist)[:, _SUBNORMAL]
    scale: Any = None
    if refs is not None:
        r_magnitude = jnp.abs(refs)
        r_normal = (r_magnitude >= tiny) & (r_magnitude < infinity)
        scale, inverse = _norm_scale(hist, bins)
        diff, size = _error_and_size(values, refs)
        operands += [
            jnp.where(r_normal, r_magnitude, zero),
            jnp.square(diff * inverse[:, None]),
            jnp.square(size * inverse[:, None]),
        ]
        inits += [zero, zero, zero]
        kinds += [lax.max, lax.add, lax.add]

    reduced = _variadic(operands, inits, kinds)
    # The subnormal extremes of the values and of the references in one conditional reduction.
    xs: tuple[Any, ...] = (values,)
    counts: tuple[Any, ...] = (subnormal,)
    if refs is not None:
        xs, counts = (values, refs), (subnormal, _reference_subnormals(hist, bins, layout))
    lo = _subnormal_extremes(xs, layout, counts, one_pass=True)
    largest, smallest = _join_extremes(reduced[0], reduced[1], lo[0], layout)
    norms: tuple[Any, ...] = ()
    if refs is None:
        ref_max = largest
    else:
        ref_max, _ = _join_extremes(reduced[2], infinity, lo[1], layout)
        norms = _norm_pairs(reduced[3:], scale)
    return _Group(
        maxima=(largest, smallest, ref_max), hist=hist.reshape(len(values), -1), norms=norms
    )


def _reference_subnormals(hist: Any, bins: _Bins, layout: _Layout) -> Any:
    """The subnormal references of each row (their exponent bins of `hist`, every class)."""
    edges = bins.exponent_edges
    return _bin_counts(hist)[:, edges[0] : edges[_first_normal_bin(layout)]].sum(axis=-1)


def _kinds(hist: Any) -> Any:
    """The count of each class of values of each row of `hist` (``[rows, _KINDS, bins]``): one
    reduction that every statistic read from it shares (XLA merges equal expressions)."""
    return hist.reshape(hist.shape[0], _KINDS, -1).sum(axis=-1)


def _bin_counts(hist: Any) -> Any:
    """The count in each reference bin of each row of `hist` (every class of values), one
    reduction shared like `_kinds`."""
    return hist.reshape(hist.shape[0], _KINDS, -1).sum(axis=1)


def _first_normal_bin(layout: _Layout) -> int:
    """The exponent bin of the smallest normal value of `layout`."""
    return max(1 - layout.bias - EXPONENT_MIN, 0)


def _host_magnitude(x: np.ndarray) -> tuple[np.ndarray, _Layout]:
    layout = _layout(x.dtype)
    bits = np.asarray(x, layout.float_dtype).view(layout.uint_dtype)
    return bits & layout.uint_dtype.type(layout.magnitude_mask), layout


def _host_extremes(mag: np.ndarray, layout: _Layout) -> tuple[int, int]:
    kept = mag[(mag > 0) & (mag < layout.inf_bits)]
    return (int(kept.max()), int(kept.min())) if kept.size else (0, layout.inf_bits)


def _host_norm(x: np.ndarray, scale: float, dtype: np.dtype) -> tuple[np.ndarray, ...]:
    """`_measure`'s ``(s, q)`` of `x` relative to `scale`, the largest reference value."""
    scale = scale if scale > 0 else 1.0
    with np.errstate(over="ignore"):
        q = float(np.sum(np.square(x / scale)))
    s, q = (math.inf, 1.0) if math.isinf(q) else (scale, q)
    return np.asarray([s], dtype), np.asarray([q], dtype)


def _measure_host(value: Any, ref: Any, formats: tuple[str, ...]) -> _Group:
    """`_measure` of one value known while tracing (a constant), with numpy: exactly the
    same statistics, and nothing for the device to compute or XLA to fold."""
    v = np.ravel(np.asarray(value))
    mag, layout = _host_magnitude(v)
    r = v if ref is None else np.ravel(np.asarray(ref))
    r_mag, r_layout = (mag, layout) if ref is None else _host_magnitude(r)
    bins = _bins(formats, r_layout)
    inf, r_inf = layout.inf_bits, r_layout.inf_bits
    kind = (
        (mag > 0).astype(np.int64) + (mag >= 1 << layout.mantissa_bits) + (mag >= inf) + (mag > inf)
    )
    field = (r_mag >> r_layout.mantissa_bits).astype(np.int64)
    _, top = np.frexp(r_mag.astype(np.float64))  # exact below 2^53: subnormal bit patterns
    exponent = np.where(
        field > 0, field - r_layout.bias, (top - 1) - (r_layout.bias - 1 + r_layout.mantissa_bits)
    )
    exponent = np.clip(exponent, EXPONENT_MIN, EXPONENT_MAX)
    bin_ = np.where(
        r_mag == 0, 0, np.where(r_mag >= r_inf, _NUM_BINS + 1, 1 + exponent - EXPONENT_MIN)
    )
    bin_ = bin_ + np.searchsorted(np.asarray(bins.cuts, r_layout.uint_dtype), r_mag, "right")
    hist = np.bincount(kind * bins.size + bin_, minlength=_KINDS * bins.size).astype(np.int32)
    largest, smallest = _host_extremes(mag, layout)
    ref_max = largest if ref is None else _host_extremes(r_mag, r_layout)[0]
    norms: tuple[Any, ...] = ()
    if ref is not None:
        wide, r_wide = v.astype(np.float64), r.astype(np.float64)
        finite, r_finite = mag < inf, r_mag < r_inf
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.abs(np.where(r_finite, wide - np.where(r_finite, r_wide, 0), 0))
        diff = np.where(r_finite & ~finite, np.inf, diff)
        size = np.abs(np.where(r_finite, r_wide, 0))
        dtype = np.dtype(r.dtype)
        scale = float(np.asarray(ref_max, r_layout.uint_dtype).view(r_layout.float_dtype))
        norms = (*_host_norm(diff, scale, dtype), *_host_norm(size, scale, dtype))
    return _Group(
        maxima=(
            np.asarray([largest], layout.uint_dtype),
            np.asarray([smallest], layout.uint_dtype),
            np.asarray([ref_max], r_layout.uint_dtype),
        ),
        hist=hist[None],
        norms=norms,
    )


def _nonfinite_counts(values: Any) -> tuple[Any, Any]:
    """NaN and inf counts of each row of `values` (``[rows, n]``), in one reduction."""
    mag, layout = _magnitude(values)
    inf = np.asarray(layout.inf_bits, layout.uint_dtype)
    counts = jnp.sum(jnp.stack([mag > inf, mag == inf], axis=1).astype(jnp.int32), axis=-1)
    return counts[:, 0], counts[:, 1]


class _Batch(NamedTuple):
    """The records of one body's measured values (the static part: `_BatchMeta`)."""

    calls: Any  # int32: times the body ran
    groups: tuple[_Group, ...]
    first: Any  # int32[rows]: clock of the first call making a NaN or inf the inputs lacked
    held: Any  # int32[rows]: clock of the first call whose output held a NaN or inf
    sources: Any  # int32[sources, 3]: NaN and inf counts, and whether it made a row non-finite


def _uint_inf(dtype: Any) -> Any:
    return np.asarray((_F64 if jnp.dtype(dtype).itemsize == 8 else _F32).inf_bits, dtype)


def _empty_batch(struct: _Batch) -> _Batch:
    """The identity of `_combine` for records of the structure `struct`."""

    def zeros(s: Any) -> Any:
        return np.zeros(s.shape, s.dtype)

    groups = tuple(
        _Group(
            maxima=(
                zeros(g.maxima[0]),
                np.full(g.maxima[1].shape, _uint_inf(g.maxima[1].dtype)),
                zeros(g.maxima[2]),
            ),
            hist=zeros(g.hist),
            norms=tuple(zeros(n) for n in g.norms),
        )
        for g in struct.groups
    )
    return _Batch(
        calls=np.int32(0),
        groups=groups,
        first=np.full(struct.first.shape, _NEVER, np.int32),
        held=np.full(struct.held.shape, _NEVER, np.int32),
        sources=zeros(struct.sources),
    )


def _combine(a: _Batch, b: _Batch) -> _Batch:
    """Two records of one body combined: two iterations of a loop."""
    groups = []
    for ga, gb in zip(a.groups, b.groups, strict=True):
        norms: list[Any] = []
        for k in range(0, len(ga.norms), 2):
            norms += _scaled_norm_step(ga.norms[k : k + 2], gb.norms[k : k + 2])
        (max_a, min_a, ref_a), (max_b, min_b, ref_b) = ga.maxima, gb.maxima
        maxima = (jnp.maximum(max_a, max_b), jnp.minimum(min_a, min_b), jnp.maximum(ref_a, ref_b))
        groups.append(_Group(maxima=maxima, hist=ga.hist + gb.hist, norms=tuple(norms)))
    return _Batch(
        calls=a.calls + b.calls,
        groups=tuple(groups),
        first=jnp.minimum(a.first, b.first),
        held=jnp.minimum(a.held, b.held),
        sources=a.sources + b.sources,
    )


def _floats(bits: Any) -> Any:
    """Magnitude bits as the values they encode, in the statistics' float dtype."""
    fdt = np.float64 if jnp.dtype(bits.dtype).itemsize == 8 else np.float32
    return lax.bitcast_convert_type(bits, fdt).astype(_stat_float())


@functools.cache
def _reading(formats: tuple[str, ...], layout: _Layout) -> np.ndarray:
    """The 0/1 matrix summing `_Bins` into statistics: the exponent histogram, then the
    nonzero values, the flushed and the overflowing ones per format, the non-finite ones."""
    bins = _bins(formats, layout)
    columns = []

    def between(start: int, stop: int) -> np.ndarray:
        column = np.zeros(bins.size, np.int32)
        column[start:stop] = 1
        return column

    edges = bins.exponent_edges
    columns += [between(a, b) for a, b in zip(edges[:-1], edges[1:], strict=True)]
    columns.append(between(bins.one, bins.inf))
    columns += [between(bins.one, f) for f in bins.flush]
    columns += [between(o, bins.inf) for o in bins.overflow]
    columns.append(between(bins.inf, bins.size))
    return np.stack(columns, axis=1)


def _group_stats(groups: list[_Group], formats: tuple[str, ...], reference: bool) -> Stats:
    """`Stats` of the rows of `groups` (all of one pair of layouts), in their order."""
    stat = _stat_float()
    ref_bits = groups[0].maxima[2]
    layout = _F64 if jnp.dtype(ref_bits.dtype).itemsize == 8 else _F32
    reading = _reading(formats, layout)
    hist = jnp.concatenate([g.hist for g in groups]).reshape(-1, _KINDS, len(reading))
    # Every statistic is a sum over a range of bins: one integer product for all of them.
    columns = hist.sum(axis=1) @ reading
    n, f = hist.shape[0], len(formats)
    nonzero = columns[:, _NUM_BINS]

    def maxima(k: int) -> Any:
        return _floats(jnp.concatenate([g.maxima[k] for g in groups]))

    if reference:
        norms = [jnp.concatenate([g.norms[k] for g in groups]).astype(stat) for k in range(4)]
        err = norms[0] * jnp.sqrt(norms[1])
        ref_norm = norms[2] * jnp.sqrt(norms[3])
        lost = hist[:, _ZERO] @ reading[:, _NUM_BINS]  # zero in the program, not in the ref
    else:
        err = ref_norm = jnp.zeros((n,), stat)
        lost = jnp.zeros((n,), jnp.int32)
    return Stats(
        calls=jnp.zeros((n,), jnp.int32),  # filled in by `_make_report`
        nan=hist[:, _NAN].sum(axis=-1),
        inf=hist[:, _INF].sum(axis=-1),
        max_abs=maxima(0),
        min_abs=maxima(1),
        nonzero=nonzero,
        flush=columns[:, _NUM_BINS + 1 : _NUM_BINS + 1 + f],
        overflow=columns[:, _NUM_BINS + 1 + f : _NUM_BINS + 1 + 2 * f],
        lost=lost,
        err=err,
        ref_norm=ref_norm,
        ref_max=maxima(2),
        ref_bad=columns[:, -1],
        hist=columns[:, :_NUM_BINS],
        first=jnp.zeros((n,), jnp.int32),  # filled in by `_make_report`
        held=jnp.zeros((n,), jnp.int32),
    )


def _empty_stats(num_formats: int) -> Stats:
    ints, floats = jnp.zeros((0,), jnp.int32), jnp.zeros((0,), _stat_float())
    pairs = jnp.zeros((0, num_formats), jnp.int32)
    return Stats(
        calls=ints,
        nan=ints,
        inf=ints,
        max_abs=floats,
        min_abs=floats,
        nonzero=ints,
        flush=pairs,
        overflow=pairs,
        lost=ints,
        err=floats,
        ref_norm=floats,
        ref_max=floats,
        ref_bad=ints,
        hist=jnp.zeros((0, _NUM_BINS), jnp.int32),
        first=ints,
        held=ints,
    )
