"""The precision inspector: which op overflows, underflows or loses precision, and where.

`inspect` traces a function to a jaxpr and evaluates it again over the re-interpretation core
(`jaxmp._src.interpret`), with a rule set that re-binds every equation exactly as traced and
measures each floating output on device. The measurements are extra outputs of the program
(no host callbacks), so an inspected function runs under `jax.jit` and compiles once.

What is measured, per op output (one row, see `OpStats`):

* of the value the op produced: max ``|x|`` over finite values, the smallest nonzero ``|x|``, the
  counts of NaN and inf, and whether the op made a NaN from inputs holding none or an inf from
  finite inputs (the op ``jax_debug_nans`` and ``jax_debug_infs`` name);
* of the value the op *should* have produced (its float32 reference when the program computes
  in lower precision, else the value itself): for each format, the fraction of nonzero values
  that would round to zero and that would overflow if stored in it, and a histogram of binary
  exponents. A value float16 has already flushed to zero cannot show that it was flushed: its
  float32 reference can;
* when the program computes in lower precision (or a `policy` is given): the fraction of
  nonzero reference values that are zero in the program (lost to underflow) and the relative
  error ``||y - y_ref|| / ||y_ref||`` of the output against the same program evaluated in
  float32. The reference is a second evaluation carried along the first: each op applied in
  float32 (float64 stays float64) to the references of its operands, casts to lower precision
  left out; it follows the program's own integer and boolean values (indices, comparisons),
  so both take the same branches.

How: the outputs of one body (the program, a loop body, a branch, a ``checkpoint``) wait until
it ends, then those of one size and dtypes are measured together (`_measure`): one scatter
counts each value's class by its reference's bin (`_Bins`: every count and the histogram),
and a few float reductions give the extremes and the norms. XLA compiles one set of kernels
per group instead of one per op. Values that depend on no argument (constants) are computed
once while tracing and measured then, with numpy (`_measure_host`). Where each NaN or inf
came from is decided from the counts: for each row, whether its inputs held any (the rows
and checks its inputs are, the constants known while tracing), and the arguments and the
constants holding some are the report's sources (`Report.nonfinite_sources`).

Counts, extremes and exponents are read from the bits of the values, so they are exact on
every backend, subnormals included (XLA on CPU treats subnormal operands of comparisons as
zero: rows holding subnormal values have their extremes reduced again as integers). Whether
a value rounds to zero or overflows in a format is decided against thresholds found once on
the host by converting with ``ml_dtypes``/numpy (round to nearest even), so the fractions
equal what ``x.astype(format)`` gives in numpy. Float64 values (``jax_enable_x64``)
are measured in float64; everything narrower is widened to float32, which is exact.

Ops inside ``scan`` and ``while`` have one row for all iterations: counts and histograms are
summed, extremes taken over every iteration, and the relative error is that of all iterations'
outputs taken as one array. A row inside a ``cond`` branch counts only the calls that took it
(`OpStats.calls` is 0 for a branch never taken).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import difflib
import functools
import importlib.util
import json
import math
import os
import re
import sys
import sysconfig
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from jaxmp._src import autocast as autocast_lib
from jaxmp._src import autocast_rules, compat, interpret
from jaxmp._src import loss_scale as loss_scale_lib
from jaxmp._src import policy as policy_lib

DEFAULT_FORMATS = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")

#: Primitives whose outputs are values of their inputs moved or selected, never new values,
#: and allocations whose values are not computed: they get no row (they cannot round,
#: overflow or make a NaN).
MOVEMENT_OPS: frozenset[str] = autocast_rules.LAYOUT_OPS | {
    "empty",
    "empty2",
    "select_n",
    "copy",
    "copy_p",
    "device_put",
    "optimization_barrier",
    "pvary",
    "split",
    "sharding_constraint",
    "mesh_cast",
}

# The reference of these outputs is the program's value itself: their parameters pin the
# dtypes of their operands (scatter combiners, bit casts, callbacks) or they hold sub-jaxprs.
_AS_VALUE_OPS = autocast_rules.AS_TRACED_OPS

# Binary exponents floor(log2|x|) the histograms count: every nonzero finite float32 value
# (subnormals from 2^-149). Float64 values beyond count in the end bins.
EXPONENT_MIN, EXPONENT_MAX = -149, 127
_NUM_BINS = EXPONENT_MAX - EXPONENT_MIN + 1
_NEVER = np.iinfo(np.int32).max

# Scopes JAX itself opens (the recomputation in a checkpoint's backward pass): not modules.
_JAX_SCOPES = frozenset({"rematted_computation"})

# Packages whose frames are not the user's code (JAX's own and the standard library are left
# out by JAX): a row points at the user's line that called into them.
_LIBRARIES = (
    "jaxmp",
    "flax",
    "optax",
    "equinox",
    "chex",
    "orbax",
    "jmp",
    "haiku",
    "numpy",
    "ml_dtypes",
    "jaxlib",
)


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


def _extremes(x: Any, layout: _Layout, subnormal: Any, largest_only: bool = False) -> Any:
    """The bits of the largest and the smallest nonzero finite magnitude along the last axis.

    Reduced as floats (XLA vectorizes a float max; an integer one is several times slower on
    CPU), which is exact for normal values. XLA on CPU compares subnormal floats as zero: when
    a row holds subnormal values (`subnormal`, their count per row, from the histogram), they
    are reduced again as integers, only then. None: 0 for the largest, inf for the smallest.
    `x` is the rows' array itself (a ``lax.cond`` operand computed from it would be stored).
    """
    fdt, udt = layout.float_dtype, layout.uint_dtype
    mag, _ = _magnitude(x)
    inf = np.asarray(layout.inf_bits, udt)
    smallest_normal = np.asarray(1 << layout.mantissa_bits, udt)
    normal = (mag >= smallest_normal) & (mag < inf)
    as_float = lax.bitcast_convert_type(mag, fdt)
    zero, infinity = np.asarray(0, fdt), np.asarray(np.inf, fdt)
    hi_max = jnp.max(jnp.where(normal, as_float, zero), axis=-1, initial=zero)
    if not largest_only:
        hi_min = jnp.min(jnp.where(normal, as_float, infinity), axis=-1, initial=infinity)

    def exact(x: Any) -> tuple[Any, Any]:
        mag, _ = _magnitude(x)
        below = (mag > 0) & (mag < smallest_normal)
        lo_max = jnp.max(jnp.where(below, mag, np.asarray(0, udt)), axis=-1)
        lo_min = jnp.min(jnp.where(below, mag, inf), axis=-1)
        return lo_max, lo_min

    def none(x: Any) -> tuple[Any, Any]:
        rows = x.shape[:-1]
        return jnp.zeros(rows, udt), jnp.full(rows, inf, udt)

    lo_max, lo_min = lax.cond(jnp.any(subnormal > 0), exact, none, x)
    largest = jnp.where(hi_max > 0, lax.bitcast_convert_type(hi_max, udt), lo_max)
    if largest_only:
        return largest
    smallest = jnp.where(lo_min < inf, lo_min, lax.bitcast_convert_type(hi_min, udt))
    return largest, smallest


def _scaled_norm_step(a: tuple[Any, Any], b: tuple[Any, Any]) -> tuple[Any, Any]:
    """Combines two partial norms ``(s, q)``, norm ``s * sqrt(q)`` (LAPACK's nrm2 scaling).

    The squares are taken relative to the largest ``|x|`` so far: no overflow, no underflow of
    the values that matter.
    """
    (s1, q1), (s2, q2) = a, b
    s = jnp.maximum(s1, s2)
    safe = jnp.where((s > 0) & (s < jnp.inf), s, 1)
    q = q1 * jnp.square(s1 / safe) + q2 * jnp.square(s2 / safe)
    q = jnp.where(s == jnp.inf, 1, jnp.where(s > 0, q, 0))
    return s, q


# Classes of a value the histograms count it in.
_ZERO, _SUBNORMAL, _NORMAL, _INF, _NAN = range(5)
_KINDS = 5


class _Group(NamedTuple):
    """The statistics of the rows of one size and dtypes measured together: arrays over them."""

    maxima: tuple[Any, Any, Any]  # bits: max |x|, min nonzero |x| (inf: none), max |ref|
    hist: Any  # int32[rows, _KINDS * bins]: counts per (class of the value, bin of the ref)
    norms: tuple[Any, ...]  # (s, q) of the error and of the reference, or () without one


def _measure(values: Any, refs: Any, formats: tuple[str, ...]) -> _Group:
    """The statistics of each row of `values` (``[rows, n]``; `refs` None: its own reference).

    One scatter counts the class of each value (zero, subnormal, normal, inf, NaN) by the bin
    of its reference (`_Bins`): every count and the histogram. Then simple reductions, which
    XLA vectorizes: the extremes (`_extremes`) and the sums of squares of the error and of
    the reference, relative to the largest reference value.
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
    largest, smallest = _extremes(values, layout, hist[:, _SUBNORMAL].sum(axis=-1))
    norms: tuple[Any, ...] = ()
    if refs is None:
        ref_max = largest
    else:
        r_edges = bins.exponent_edges
        r_subnormal = hist[:, :, r_edges[0] : r_edges[_first_normal_bin(r_layout)]].sum(axis=(1, 2))
        ref_max = _extremes(refs, r_layout, r_subnormal, largest_only=True)
        finite, r_finite = mag < inf, r_mag < r_inf
        value = lax.convert_element_type(values, refs.dtype)
        diff = jnp.abs(jnp.where(r_finite, value - jnp.where(r_finite, refs, 0), 0))
        # A non-finite value where the reference is finite: an infinite error.
        diff = jnp.where(r_finite & ~finite, jnp.inf, diff)
        size = jnp.abs(jnp.where(r_finite, refs, 0))
        # Both relative to the largest reference value: no overflow, no underflow that
        # matters (an error 1e19 times the largest value would overflow: it is inf anyway).
        scale = lax.bitcast_convert_type(ref_max, refs.dtype)
        scale = jnp.where(scale > 0, scale, 1)
        for x in (diff, size):
            q = jnp.sum(jnp.square(x / scale[:, None]), axis=-1)
            infinite = jnp.isinf(q)  # norm s * sqrt(q): an inf error is (inf, 1)
            norms += (jnp.where(infinite, jnp.inf, scale), jnp.where(infinite, 1, q))
    return _Group(maxima=(largest, smallest, ref_max), hist=hist.reshape(rows, width), norms=norms)


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


# --------------------------------------------------------------------------------------------
# Locations.


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    dirs = []
    for name in _LIBRARIES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        for path in (spec.submodule_search_locations or []) if spec else []:
            dirs.append(os.path.join(os.path.realpath(path), ""))
    return tuple(dirs)


@functools.cache
def _own_dir() -> str:
    return os.path.join(os.path.realpath(os.path.dirname(os.path.dirname(__file__))), "")


@functools.cache
def _not_users_dirs() -> tuple[str, ...]:
    """Directories whose frames are never the user's: the libraries', JAX's, Python's."""
    dirs = set(_library_dirs())
    for module in (jax, np):
        dirs.add(os.path.join(os.path.realpath(os.path.dirname(str(module.__file__))), ""))
    for key in ("stdlib", "platstdlib"):
        dirs.add(os.path.join(os.path.realpath(sysconfig.get_paths()[key]), ""))
    return tuple(dirs)


@functools.cache
def _is_library_file(path: str) -> bool:
    return os.path.realpath(path).startswith(_library_dirs())


@functools.cache
def _is_users_file(path: str) -> bool:
    return not path.startswith("<frozen") and not os.path.realpath(path).startswith(
        _not_users_dirs()
    )


def _caller() -> tuple[str, int, str]:
    """``(file, line, function)`` of the innermost frame of the user's code calling now.

    Where the inspected function was called from: the rows of jaxmp's own ops (loss scaling,
    autocast's casts of the outputs) point there. Read while tracing, so it is the call that
    traced the function.
    """
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if _is_users_file(path):
            return path, frame.f_lineno, frame.f_code.co_name
        frame = frame.f_back
    return "", 0, ""


def _module_path(parts: Sequence[tuple[str, str]]) -> str:
    """The module path (scopes) of a name stack.

    After a transform nested inside scopes, JAX re-opens the same scopes (a checkpoint's
    backward pass is traced again under ``jvp(Module)``): scopes repeating the path from its
    start there are skipped, and the scopes JAX itself opens are left out.
    """
    scopes: list[str] = []
    replay: int | None = None
    for kind, name in parts:
        if kind == "transform":
            replay = 0 if scopes else None
            continue
        if replay is not None and replay < len(scopes) and scopes[replay] == name:
            replay += 1
            continue
        replay = None
        if name and name not in _JAX_SCOPES:
            scopes.append(name)
    return "/".join(scopes)


@dataclasses.dataclass(frozen=True)
class _Meta:
    """The static part of a row."""

    primitive: str
    output: int  # index among the op's outputs
    num_outputs: int
    shape: tuple[int, ...]
    dtype: str
    module: str
    phase: str  # "forward" or "backward"
    file: str
    line: int
    function: str
    library: str = ""  # "jaxmp" for jaxmp's own ops (file and line: the user's call)
    loops: tuple[str, ...] = ()


def _phase(location: interpret.Location) -> str:
    backward = any(k == "transform" and n == "transpose" for k, n in location.name_stack)
    return "backward" if backward else "forward"


def _where(location: interpret.Location, caller: tuple[str, int, str]) -> tuple[str, int, str, str]:
    """``(file, line, function, library)`` of an op: the user's innermost frame.

    An op of jaxmp's own code (no frame of the user's: the loss scale's multiply, autocast's
    casts of the outputs) is marked ``"jaxmp"`` and points at the user's call of the
    inspected function. Without a frame of the user's, another library's innermost frame.
    """
    frames = list(location.frames)
    user = [f for f in frames if not _is_library_file(f[0])]
    if user:
        return (*user[0], "")
    if frames and os.path.realpath(frames[0][0]).startswith(_own_dir()):
        return (*caller, "jaxmp")
    return (*(frames[0] if frames else ("", 0, "")), "")


def _meta(
    eqn: Any, output: int, value: Any, location: interpret.Location, caller: tuple[str, int, str]
) -> _Meta:
    file, line, function, library = _where(location, caller)
    return _Meta(
        primitive=eqn.primitive.name,
        output=output,
        num_outputs=len(eqn.outvars),
        shape=tuple(int(d) for d in np.shape(value)),
        dtype=jnp.dtype(value.dtype).name,
        module=_module_path(location.name_stack),
        phase=_phase(location),
        file=file,
        line=line,
        function=function,
        library=library,
    )


@dataclasses.dataclass(frozen=True, eq=False)
class _Origin:
    """A value the program did not compute from its arguments: an argument or a constant.

    A constant is named by the op that made it from finite constants, or by the first op
    reading it (a literal, a closed-over array). `nan` and `inf` are its counts when they are
    known while tracing (`static`), else counted on device.
    """

    kind: str  # "argument" or "constant"
    name: str
    shape: tuple[int, ...]
    dtype: str
    primitive: str
    module: str
    phase: str
    file: str
    line: int
    function: str
    static: bool = False
    nan: int = 0
    inf: int = 0


def _constant_name(value: Any) -> str:
    """A scalar constant's value (``-inf``), else its dtype and shape."""
    if not isinstance(value, compat.Tracer) and np.size(value) == 1:
        return str(np.asarray(value).reshape(()).item())
    return f"{_short(jnp.dtype(value.dtype).name)}[{','.join(map(str, np.shape(value)))}]"


def _origin(
    kind: str, name: str, value: Any, eqn: Any, interp: Any, caller: tuple[str, int, str]
) -> _Origin:
    array = np.asarray(value) if not isinstance(value, compat.Tracer) else None
    nan = inf = 0
    if array is not None:
        with np.errstate(invalid="ignore"):
            wide = array.astype(np.float64)
        nan, inf = int(np.isnan(wide).sum()), int(np.isinf(wide).sum())
    if eqn is None:
        where: tuple[str, int, str, str] = (*caller, "")
        primitive, module, phase = "", "", "forward"
    else:
        location = interp.location(eqn)
        where = _where(location, caller)
        primitive, module = eqn.primitive.name, _module_path(location.name_stack)
        phase = _phase(location)
    return _Origin(
        kind=kind,
        name=name,
        shape=tuple(int(d) for d in np.shape(value)),
        dtype=jnp.dtype(value.dtype).name,
        primitive=primitive,
        module=module,
        phase=phase,
        file=where[0],
        line=where[1],
        function=where[2],
        static=array is not None,
        nan=nan,
        inf=inf,
    )


# --------------------------------------------------------------------------------------------
# The rule set.


def _is_float(x: Any) -> bool:
    return interpret._is_float_dtype(getattr(x, "dtype", None) or np.asarray(x).dtype)


def _wide_dtype(*dtypes: Any) -> np.dtype:
    wide = np.dtype(np.float32)
    for dtype in dtypes:
        if interpret._is_float_dtype(dtype) and jnp.dtype(dtype).itemsize > wide.itemsize:
            wide = jnp.dtype(dtype)
    return wide


def _widen(x: Any) -> Any:
    dtype = _wide_dtype(x.dtype)
    if jnp.dtype(x.dtype) == dtype:
        return x
    if isinstance(x, (np.ndarray, np.generic)):
        return np.asarray(x, dtype)
    return lax.convert_element_type(x, dtype)


class _Known(NamedTuple):
    """What is known while tracing of a constant's values."""

    nan: bool  # holds a NaN
    bad: bool  # holds a NaN or an inf


_FINITE = _Known(False, False)


def _known(x: Any) -> _Known:
    array = np.asarray(x)
    if not interpret._is_float_dtype(array.dtype):
        return _FINITE
    with np.errstate(invalid="ignore"):
        wide = array.astype(np.float64)
    nan = bool(np.isnan(wide).any())
    return _Known(nan, nan or bool(np.isinf(wide).any()))


@dataclasses.dataclass(eq=False)
class _Entry:
    """A value of the current body measured on device: a row, or a check (NaN and inf only).

    A row keeps what decides whether the op made its NaN or inf: `deps`, the entries of its
    inputs that are known only on device, and `known`, what its constant inputs hold.
    """

    value: Any
    ref: Any = None
    meta: _Meta | None = None  # a row's static part (None: a check)
    seq: int = 0  # a row's position in program order
    clock: Any = None
    deps: tuple[_Entry, ...] = ()
    known: _Known = _FINITE
    origin: _Origin | None = None  # a check counting an argument or a constant
    result: tuple[Any, Any, int] | None = None  # (has NaN, has NaN or inf, index) once measured
    # A constant's row, measured while tracing: its statistics, and whether it made a NaN or
    # inf, made one from a non-finite constant input, held one.
    host: _Group | None = None
    made: bool = False
    from_constant: bool = False
    held: bool = False


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["value", "ref"],
    meta_fields=[],
    drop_fields=["flag", "dynamic", "origin", "row"],
)
@dataclasses.dataclass(eq=False)
class _Value:
    """A value under inspection: the program's array and its float32 reference (or None).

    What is known of its NaN and inf (`flag`) and where it comes from stay with the value
    while it is evaluated in one body; a loop or branch body starts over (they are dropped
    when the value is flattened).
    """

    value: Any
    ref: Any
    # `_Known` (a constant), an `_Entry` (measured on device), a tuple of the `_Value`s it
    # moves (a layout op), or None: not known yet (checked when a measured op reads it).
    flag: Any = None
    dynamic: bool = True  # whether it depends on the function's arguments
    origin: _Origin | None = None  # for a constant: the source it is reported as
    row: bool = False  # for a constant: its NaN or inf were made by an op with a row


@dataclasses.dataclass
class _Pending:
    """The entries of a body not measured yet."""

    entries: list[_Entry] = dataclasses.field(default_factory=list)
    nbytes: int = 0
    # Non-finite constants known while tracing, and the rows reading them.
    known_sources: dict[_Origin, list[_Entry]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class _RowMeta:
    seq: int
    meta: _Meta
    group: int
    position: int


@dataclasses.dataclass(frozen=True)
class _BatchMeta:
    """The static part of a `_Batch`: its rows (in program order) and sources."""

    rows: tuple[_RowMeta, ...]
    groups: tuple[tuple[str, str], ...]  # the bit dtypes (value, reference) of each group
    sources: tuple[_Origin, ...]


# Bytes of values waiting to be measured together above which they are measured: each is
# kept alive until then.
_PENDING_BYTES = 1 << 28
# Rows are measured together by size: those of `_LARGE` values or more when their sizes are
# equal, smaller ones by the power of four their size rounds up to (padded to the longest,
# at most four times their size: they cost little). A group is a dozen kernels for XLA to
# compile, and a model has hundreds of rows of a few sizes.
_LARGE = 1 << 16


def _placement(x: Any) -> Any:
    """A key equal for values that can be stacked without moving data between devices."""
    group = compat.sharding_group(x)
    try:
        hash(group)
    except TypeError:
        return str(group)
    return group


def _bucket(x: Any) -> int:
    size = int(np.size(x))
    if size >= _LARGE:
        return size
    return 4 ** max((size - 1).bit_length() + 1 >> 1, 4)


# Constants up to this many elements, computed from constants, are computed while tracing.
_FOLD_SIZE = 1 << 16
# Called in place rather than through a nested jit: their values are measured with the
# caller's (one batch), and the program is the same after XLA inlines the call.
_INLINED = frozenset({"jit", "pjit", "closed_call", "core_call"})


class _InspectRules(interpret.Rules):
    emits = True
    keep_custom_rules = False

    def __init__(
        self,
        formats: tuple[str, ...],
        reference: bool,
        every: int,
        modules: re.Pattern[str] | None,
        caller: tuple[str, int, str],
    ):
        self.formats = formats
        self.reference = reference
        self.every = every
        self.modules = modules
        self.caller = caller
        self.constants = {"forward": 0, "backward": 0}  # op outputs not measured: constants
        self._pending = _Pending()
        self._seq = 0
        self._seen = 0  # op outputs that could be sampled
        self._counted: set[_Origin] = set()  # sources counted on device

    # -- Values.

    def argument(self, x: Any, name: str) -> _Value:
        """An argument of the inspected function (`name`: its path); counted as a source."""
        v = _Value(x, _widen(x) if self.reference and _is_float(x) else None)
        if _is_float(x):
            origin = _origin("argument", name, x, None, None, self.caller)
            v.flag = self._add(_Entry(x, origin=origin), None)
            self._counted.add(origin)
        return v

    def literal(self, value: Any) -> _Value:
        ref = _widen(value) if self.reference and _is_float(value) else None
        return _Value(value, ref, flag=_known(value), dynamic=False)

    def const(self, value: Any) -> _Value:
        v = self.literal(value) if not isinstance(value, compat.Tracer) else None
        if v is None:  # closed over from an enclosing trace: counted on device if read
            ref = _widen(value) if self.reference and _is_float(value) else None
            v = _Value(value, ref, dynamic=False)
        return v

    def value(self, v: _Value) -> Any:
        return v.value

    # -- Bodies: their values are measured together when the body ends.

    @contextlib.contextmanager
    def body(self, interp: interpret.Interpreter) -> Iterator[None]:
        saved, self._pending = self._pending, _Pending()
        try:
            yield
            self._flush(interp)
        finally:
            self._pending = saved

    def _add(self, entry: _Entry, interp: Any) -> _Entry:
        pending = self._pending
        pending.entries.append(entry)
        for x in (entry.value, entry.ref):
            if x is not None:
                pending.nbytes += int(np.prod(np.shape(x))) * jnp.dtype(x.dtype).itemsize
        if interp is not None and pending.nbytes > _PENDING_BYTES:
            self._flush(interp)
        return entry

    # -- Equations.

    def apply(
        self, frame: Any, index: int, eqn: Any, vals: list[_Value], interp: Any
    ) -> list[_Value]:
        del frame, index
        name = eqn.primitive.name
        if name in _INLINED:
            param = "call_jaxpr" if "call_jaxpr" in eqn.params else "jaxpr"
            return interp.inline(eqn, vals, param)
        if compat.has_subjaxprs(eqn.params):
            outs = interp.higher_order(eqn, vals)
            if outs is not NotImplemented:
                return outs
        values = [v.value for v in vals]
        dynamic = any(v.dynamic for v in vals)
        fold = not dynamic and self._foldable(eqn, values)
        # A constant computed from constants (up to `_FOLD_SIZE` values) is computed now,
        # once: XLA would fold it at every compile, and what it holds is known.
        with jax.ensure_compile_time_eval() if fold else contextlib.nullcontext():
            outs = compat.bind(eqn, values)
            refs = self._references(eqn, vals, outs) if self.reference else [None] * len(outs)
        moves = name in MOVEMENT_OPS
        results = []
        for k, (var, out, ref) in enumerate(zip(eqn.outvars, outs, refs, strict=True)):
            v = _Value(out, ref, dynamic=dynamic)
            results.append(v)
            if not _is_float(out) or isinstance(var, compat.DropVar):
                continue
            if moves and not fold:
                # Moved values hold NaN or inf if their sources do (asked only when needed).
                v.flag = tuple(x for x in vals if _is_float(x.value))
            elif not dynamic:
                self._constant(eqn, k, v, vals, fold, moves, interp)
            else:
                meta = self._sampled(eqn, k, out, interp)
                if meta is not None:
                    v.flag = self._row(meta, v, vals, eqn, interp)
        return results

    def _foldable(self, eqn: Any, values: list[Any]) -> bool:
        if eqn.effects or any(isinstance(x, compat.Tracer) for x in values):
            return False
        size = sum(int(np.prod(getattr(v.aval, "shape", ()))) for v in eqn.outvars)
        return size <= _FOLD_SIZE

    def _constant(
        self,
        eqn: Any,
        output: int,
        v: _Value,
        vals: list[_Value],
        fold: bool,
        moves: bool,
        interp: Any,
    ) -> None:
        """A value depending on no argument: measured now if it was computed now.

        A non-finite one is reported with the constant input it came from, or as a row's if
        an op made it; a constant computed on device (too large to compute now) has no row
        and is named by the op that made it (counted on device if a measured op reads it).
        """
        bad = [x for x in vals if isinstance(x.flag, _Known) and x.flag.bad]
        if not fold:
            if not moves:
                self.constants[_phase(interp.location(eqn))] += 1
        else:
            v.flag = _known(v.value)
            meta = None if moves else self._sampled(eqn, output, v.value, interp)
            made = meta is not None and self._host_row(meta, v, vals, eqn, interp).made
            if not v.flag.bad:
                return
            if made:
                v.row = True
                return
        if bad:
            v.row = bad[0].row
            v.origin = None if v.row else self._origin_of(bad[0], eqn, interp)
        else:
            name = _constant_name(v.value)
            v.origin = _origin("constant", name, v.value, eqn, interp, self.caller)

    def _host_row(
        self, meta: _Meta, v: _Value, vals: list[_Value], eqn: Any, interp: Any
    ) -> _Entry:
        """The row of a constant computed while tracing: measured with numpy, now."""
        known: list[tuple[_Known, _Origin | None]] = []
        self._inputs(vals, eqn, interp, {}, known, set())
        group = _measure_host(v.value, v.ref, self.formats)
        hist = group.hist.reshape(_KINDS, -1)
        out_nan, out_inf = bool(hist[_NAN].sum()), bool(hist[_INF].sum())
        in_nan, in_bad = any(k.nan for k, _ in known), any(k.bad for k, _ in known)
        made = (out_nan and not in_nan) or (out_inf and not in_bad)
        entry = _Entry(
            v.value,
            v.ref,
            meta=meta,
            seq=self._seq,
            clock=interp.tick(),
            host=group,
            made=made,
            from_constant=(out_nan or out_inf) and in_bad and not made,
            held=out_nan or out_inf,
        )
        self._seq += 1
        for _, origin in known:
            if origin is not None:
                self._pending.known_sources.setdefault(origin, []).append(entry)
        self._pending.entries.append(entry)
        return entry

    def _origin_of(self, v: _Value, eqn: Any, interp: Any) -> _Origin:
        """`v`'s origin; a literal or closed-over array is named by `eqn`, its first reader."""
        if v.origin is None:
            v.origin = _origin(
                "constant", _constant_name(v.value), v.value, eqn, interp, self.caller
            )
        return v.origin

    def _sampled(self, eqn: Any, output: int, value: Any, interp: Any) -> _Meta | None:
        """The row's static part, or None if sampling leaves it out."""
        meta = _meta(eqn, output, value, interp.location(eqn), self.caller)
        if self.modules is not None and not self.modules.search(meta.module):
            return None
        self._seen += 1
        return meta if (self._seen - 1) % self.every == 0 else None

    def _row(self, meta: _Meta, v: _Value, vals: list[_Value], eqn: Any, interp: Any) -> _Entry:
        deps: dict[int, _Entry] = {}
        known: list[tuple[_Known, _Origin | None]] = []
        self._inputs(vals, eqn, interp, deps, known, set())
        entry = _Entry(
            v.value,
            v.ref,
            meta=meta,
            seq=self._seq,
            clock=interp.tick(),
            deps=tuple(deps.values()),
            known=_Known(any(k.nan for k, _ in known), any(k.bad for k, _ in known)),
        )
        self._seq += 1
        for _, origin in known:
            if origin is not None:
                self._pending.known_sources.setdefault(origin, []).append(entry)
        return self._add(entry, interp)

    def _inputs(
        self,
        vals: Iterable[_Value],
        eqn: Any,
        interp: Any,
        deps: dict[int, _Entry],
        known: list[tuple[_Known, _Origin | None]],
        seen: set[int],
    ) -> None:
        """The entries, and the non-finite constants, that the floating values `vals` hold."""
        for v in vals:
            if id(v) in seen or not _is_float(v.value):
                continue
            seen.add(id(v))
            if isinstance(v.flag, _Known):
                if v.flag.bad:  # a source, unless an op with a row made it
                    known.append((v.flag, None if v.row else self._origin_of(v, eqn, interp)))
                continue
            if isinstance(v.flag, tuple):
                self._inputs(v.flag, eqn, interp, deps, known, seen)
                continue
            if v.flag is None:
                origin = None
                if not v.dynamic:  # a constant known only on device: a source if it is bad
                    candidate = self._origin_of(v, eqn, interp)
                    if not candidate.static and candidate not in self._counted:
                        origin = candidate
                        self._counted.add(candidate)
                v.flag = self._add(_Entry(v.value, origin=origin), None)
            deps[id(v.flag)] = v.flag

    def _references(self, eqn: Any, vals: list[_Value], outs: list[Any]) -> list[Any]:
        name = eqn.primitive.name
        if not any(_is_float(o) for o in outs):
            return [None] * len(outs)
        if name == "convert_element_type":
            (v,) = vals
            source = v.ref if v.ref is not None else v.value
            (out,) = outs
            if not _is_float(out):
                return [None]
            # A cast to a narrower float is left out of the float32 evaluation.
            return [lax.convert_element_type(source, _wide_dtype(out.dtype, source.dtype))]
        if name in _AS_VALUE_OPS or compat.has_subjaxprs(eqn.params):
            return [_widen(o) if _is_float(o) else None for o in outs]
        sources = [v.ref if v.ref is not None else v.value for v in vals]
        wide = _wide_dtype(*(x.dtype for x in [*sources, *outs]))
        sources = [lax.convert_element_type(x, wide) if _is_float(x) else x for x in sources]
        params = eqn.params
        preferred = params.get("preferred_element_type")
        if preferred is not None and interpret._is_float_dtype(preferred):
            params = {**params, "preferred_element_type": wide}
        try:
            refs = compat.bind(eqn, sources, params)
        except (TypeError, ValueError):
            # A primitive whose parameters pin a narrower dtype: its reference restarts from
            # the program's value.
            return [_widen(o) if _is_float(o) else None for o in outs]
        return [
            (r.astype(_wide_dtype(o.dtype, r.dtype)) if _is_float(r) else _widen(o))
            if _is_float(o)
            else None
            for o, r in zip(outs, refs, strict=True)
        ]

    # -- Measuring a body's values together.

    def _flush(self, interp: Any) -> None:
        """Measures the pending entries and emits them as one record (`_Batch`).

        Rows of one size and dtypes are measured together (`_measure`): XLA compiles one
        reduction per group, not one per row, and an inspected program has hundreds of rows
        of a few sizes. Then whether each row made a NaN or inf its inputs did not hold.
        """
        pending, self._pending = self._pending, _Pending()
        if not pending.entries:
            return
        device = [e for e in pending.entries if e.meta is not None and e.host is None]
        host = [e for e in pending.entries if e.host is not None]
        checks = [e for e in pending.entries if e.meta is None]
        rows = device + host
        # Grouped by the float dtypes they are measured in (float16 and bfloat16 widened to
        # float32, exactly), size, and where they live: stacking values of two shardings
        # would move them between devices (`compat.sharding_group`).
        device_groups: dict[Any, list[_Entry]] = {}
        for e in device:
            key = (_layout(e.value.dtype), None if e.ref is None else _layout(e.ref.dtype))
            place = (_placement(e.value), None if e.ref is None else _placement(e.ref))
            device_groups.setdefault((*key, _bucket(e.value), place), []).append(e)
        host_groups: dict[Any, list[_Entry]] = {}
        for e in host:
            assert e.host is not None
            key = (e.host.maxima[0].dtype.name, e.host.maxima[2].dtype.name)
            host_groups.setdefault(key, []).append(e)
        check_groups: dict[Any, list[_Entry]] = {}
        for e in checks:
            check_key = (_layout(e.value.dtype), _bucket(e.value), _placement(e.value))
            check_groups.setdefault(check_key, []).append(e)

        def stacked(xs: list[Any]) -> Any:
            # Padded with zeros, which change no statistic (no count, extreme or norm); one
            # concatenation (a pad per row is a kernel per row).
            n = max(int(np.size(x)) for x in xs)
            dtype = _layout(xs[0].dtype).float_dtype
            parts = []
            for x in xs:
                parts.append(lax.convert_element_type(jnp.ravel(x), dtype))
                if np.size(x) < n:
                    parts.append(jnp.zeros((n - int(np.size(x)),), dtype))
            return lax.concatenate(parts, 0).reshape(len(xs), n)

        groups: list[_Group] = []
        positions: dict[int, tuple[int, int]] = {}  # row -> (group, position in it)
        order: list[_Entry] = []  # the entries measured on device, in the order of `nan`
        nans, infs = [], []
        for (_, ref_dtype, _, _), members in device_groups.items():
            refs = None if ref_dtype is None else stacked([e.ref for e in members])
            group = _measure(stacked([e.value for e in members]), refs, self.formats)
            hist = group.hist.reshape(len(members), _KINDS, -1)
            nans.append(hist[:, _NAN].sum(axis=-1))
            infs.append(hist[:, _INF].sum(axis=-1))
            positions.update({id(e): (len(groups), p) for p, e in enumerate(members)})
            groups.append(group)
            order += members
        for members in host_groups.values():
            parts = [e.host for e in members if e.host is not None]
            group = jax.tree.map(lambda *xs: np.concatenate(xs), *parts)
            positions.update({id(e): (len(groups), p) for p, e in enumerate(members)})
            groups.append(group)
        for members in check_groups.values():
            nan, inf = _nonfinite_counts(stacked([e.value for e in members]))
            nans.append(nan)
            infs.append(inf)
            order += members
        index = {id(e): i for i, e in enumerate(order)}
        nan = jnp.concatenate(nans) if nans else jnp.zeros((0,), jnp.int32)
        inf = jnp.concatenate(infs) if infs else jnp.zeros((0,), jnp.int32)
        has_nan, bad = nan > 0, (nan + inf) > 0
        for e in order:
            e.result = (has_nan, bad, index[id(e)])

        first, held, from_constant = self._made(device, order, index, has_nan, inf, bad)
        if host:  # constants' rows: known while tracing, but not their clocks
            never = np.int32(_NEVER)
            first = jnp.concatenate(
                [first, jnp.stack([e.clock if e.made else never for e in host])]
            )
            held = jnp.concatenate([held, jnp.stack([e.clock if e.held else never for e in host])])
            constant = np.asarray([e.from_constant for e in host], bool)
            from_constant = jnp.concatenate([from_constant, constant])

        # Sources: arguments and constants counted on device, and non-finite constants known
        # while tracing that made a row non-finite (with finite inputs otherwise).
        sources, counts = [], []
        for e in checks:
            if e.origin is not None:
                i = index[id(e)]
                made = (nan[i] + inf[i] > 0).astype(jnp.int32)
                sources.append(e.origin)
                counts.append(jnp.stack([nan[i], inf[i], made]))
        row_index = {id(e): r for r, e in enumerate(rows)}
        for origin, readers in pending.known_sources.items():
            at = np.asarray([row_index[id(e)] for e in readers], np.int32)
            sources.append(origin)
            made = from_constant[at].any().astype(jnp.int32)
            counts.append(jnp.stack([jnp.int32(0), jnp.int32(0), made]))
        keys = [(g.maxima[0].dtype.name, g.maxima[2].dtype.name) for g in groups]
        meta = _BatchMeta(
            rows=tuple(_RowMeta(e.seq, e.meta, *positions[id(e)]) for e in rows if e.meta),
            groups=tuple(keys),
            sources=tuple(sources),
        )
        record = _Batch(
            calls=np.int32(1),
            groups=tuple(groups),
            first=first.astype(jnp.int32),
            held=held.astype(jnp.int32),
            sources=jnp.stack(counts) if counts else np.zeros((0, 3), np.int32),
        )
        interp.emit(meta, record)

    def _made(
        self,
        rows: list[_Entry],
        order: list[_Entry],
        index: dict[int, int],
        has_nan: Any,
        inf: Any,
        bad: Any,
    ) -> tuple[Any, Any, Any]:
        """For the rows measured on device: clocks of making and of holding a NaN or inf, and
        whether a non-finite constant input made it.

        Whether the inputs of each row held NaN, or NaN or inf, is a gather of the flags of
        the entries its inputs are (of this batch, or of an earlier one).
        """
        if not rows:
            empty = jnp.zeros((0,), jnp.int32)
            return empty, empty, jnp.zeros((0,), bool)
        earlier: dict[int, int] = {}
        extra_nan: list[Any] = []
        extra_bad: list[Any] = []
        table = []
        for e in rows:
            positions = []
            for d in e.deps:
                assert d.result is not None
                d_nan, d_bad, i = d.result
                if d_nan is has_nan:
                    positions.append(i)
                    continue
                if id(d) not in earlier:
                    earlier[id(d)] = len(order) + len(extra_nan)
                    extra_nan.append(d_nan[i])
                    extra_bad.append(d_bad[i])
                positions.append(earlier[id(d)])
            table.append(positions)
        false = len(order) + len(extra_nan)
        gather = np.full((len(rows), max([len(p) for p in table] + [1])), false, np.int32)
        for r, positions in enumerate(table):
            gather[r, : len(positions)] = positions
        flags_nan = jnp.concatenate([has_nan, jnp.stack([*extra_nan, jnp.bool_(False)])])
        flags_bad = jnp.concatenate([bad, jnp.stack([*extra_bad, jnp.bool_(False)])])
        in_nan = flags_nan[gather].any(axis=-1)
        in_bad = flags_bad[gather].any(axis=-1)
        at = np.asarray([index[id(e)] for e in rows], np.int32)
        out_nan, out_inf, out_bad = has_nan[at], inf[at] > 0, bad[at]
        known_nan = np.asarray([e.known.nan for e in rows], bool)
        known_bad = np.asarray([e.known.bad for e in rows], bool)
        # A NaN from inputs holding none, an inf from finite inputs (jax_debug_nans' and
        # jax_debug_infs' op); the inputs include the constants known while tracing.
        made = (out_nan & ~in_nan & ~known_nan) | (out_inf & ~in_bad & ~known_bad)
        clocks = jnp.stack([e.clock for e in rows])
        first = jnp.where(made, clocks, np.int32(_NEVER))
        held = jnp.where(out_bad, clocks, np.int32(_NEVER))
        return first, held, out_bad & ~in_bad & known_bad & ~made

    # -- Loops and branches.

    def fix(self, vals: list[_Value], like: list[_Value]) -> list[_Value]:
        fixed = []
        for v, s in zip(vals, like, strict=True):
            ref = None
            if s.ref is not None:
                ref = v.ref if v.ref is not None else _widen(v.value)
                ref = interpret._cast_like(ref, s.ref)
            fixed.append(_Value(v.value, ref))
        return fixed

    def empty(self, struct: _Batch) -> _Batch:
        return _empty_batch(struct)

    def combine(self, a: _Batch, b: _Batch) -> _Batch:
        return _combine(a, b)

    def in_loop(self, meta: _BatchMeta, kind: str, detail: str) -> _BatchMeta:
        loop = f"{kind} ({detail})"
        rows = tuple(
            dataclasses.replace(r, meta=dataclasses.replace(r.meta, loops=(loop, *r.meta.loops)))
            for r in meta.rows
        )
        return dataclasses.replace(meta, rows=rows)


def _computes_in_low_precision(jaxpr: Any) -> bool:
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            dtype = var.aval.dtype if hasattr(var.aval, "dtype") else None
            if interpret._is_float_dtype(dtype) and jnp.dtype(dtype).itemsize < 4:
                return True
        for sub in compat.jaxprs_in_params(eqn.params):
            if _computes_in_low_precision(compat.jaxpr_and_consts(sub)[0]):
                return True
    return False


# --------------------------------------------------------------------------------------------
# The report.


@dataclasses.dataclass(frozen=True)
class OpStats:
    """One row of a `Report`: an op output's statistics, host side.

    Attributes:
      index: the row's position in program order.
      primitive: the JAX primitive (``exp``, ``dot_general``, ``convert_element_type``...).
      module: the module path (Flax module names, `jax.named_scope` names), "" if none.
      phase: ``"forward"``, or ``"backward"`` for an op of a derivative (transposed by
        `jax.grad`, `jax.value_and_grad`, `jax.vjp`).
      file, line, function: the user's code that made the op (for a backward op, the line
        it differentiates); for an op of jaxmp's own code, the user's call of the inspected
        function.
      library: ``"jaxmp"`` for an op of jaxmp's own code that the user's code does not
        call directly (the loss scale's multiply in `jaxmp.value_and_grad`, autocast's
        casts of the outputs), else ``""``. Such rows rank after the user's, and the figure
        and `Report.suggest_loss_scale` leave them out.
      shape, dtype: the output's, as the program computes it.
      output: the output's index among the op's outputs.
      loops: the loops and branches around the op, outermost first (``"scan (8
        iterations)"``, ``"while (body)"``, ``"cond (branch 1 of 2)"``).
      calls: times the op ran (iterations of its loops; 0 in a branch never taken).
      max_abs: max ``|x|`` over the finite values the op produced (0 if none).
      min_abs: the smallest nonzero ``|x|`` (None if all are zero or non-finite).
      nan, inf: counts over all calls.
      nonzero: nonzero finite values of the reference (the value itself without one).
      flush: per format, the fraction of `nonzero` that would round to zero if stored in it.
      overflow: per format, the fraction of `nonzero` that would overflow if stored in it.
      underflow: the fraction of `nonzero` that is zero in the program (lost to underflow);
        None without a float32 reference.
      rel_error: ``||y - y_ref|| / ||y_ref||`` against the program evaluated in float32;
        None without a reference.
      ref_max_abs: max ``|x|`` of the reference.
      ref_nonfinite: values whose reference is NaN or inf (the value itself, without one).
      created_nonfinite: whether a call made a NaN from inputs holding none, or an inf from
        finite inputs (what ``jax_debug_nans`` and ``jax_debug_infs`` look for).
      histogram: counts of nonzero finite reference values by binary exponent
        ``floor(log2|x|)``, from `EXPONENT_MIN` to `EXPONENT_MAX`.
    """

    index: int
    primitive: str
    module: str
    phase: str
    file: str
    line: int
    function: str
    shape: tuple[int, ...]
    dtype: str
    output: int
    loops: tuple[str, ...]
    calls: int
    max_abs: float
    min_abs: float | None
    nan: int
    inf: int
    nonzero: int
    flush: dict[str, float]
    overflow: dict[str, float]
    underflow: float | None
    rel_error: float | None
    ref_max_abs: float
    created_nonfinite: bool
    histogram: np.ndarray = dataclasses.field(repr=False, compare=False)
    library: str = ""
    ref_nonfinite: int = 0

    @property
    def location(self) -> str:
        """``file:line`` of the user's code (the file's base name)."""
        return f"{os.path.basename(self.file)}:{self.line}" if self.file else "?"

    @property
    def op(self) -> str:
        """The primitive, with the output index for an op of several outputs."""
        return self.primitive if self.output == 0 else f"{self.primitive}[{self.output}]"

    def to_dict(self) -> dict[str, Any]:
        """The row as plain JSON values (non-finite floats as None)."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "histogram":
                nonzero = np.flatnonzero(value)
                if len(nonzero):
                    lo, hi = int(nonzero[0]), int(nonzero[-1])
                    value = {
                        "exponent_min": EXPONENT_MIN + lo,
                        "counts": [int(c) for c in value[lo : hi + 1]],
                    }
                else:
                    value = {"exponent_min": None, "counts": []}
            out[field.name] = _json_value(value)
        return out


def _json_value(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_value(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_json_value(v) for v in value]
    return value


@dataclasses.dataclass(frozen=True)
class NonfiniteSource:
    """A NaN or inf the program did not compute: in an argument, or in a constant.

    Attributes:
      kind: ``"argument"`` (an argument of the inspected function) or ``"constant"`` (a
        literal such as ``-jnp.inf`` or ``1e5`` rounded to inf in float16, a closed-over
        array, or a value computed from constants only).
      name: the argument's path (``"args[0]['w']"``), or the constant's value if it is a
        scalar (``"-inf"``), else its dtype and shape.
      shape, dtype: the value's.
      nan, inf: its counts of NaN and inf (over all calls, inside a loop).
      primitive, module, phase, file, line, function: the op that made the constant, or the
        first op reading it (empty for an argument, whose file and line are the user's call
        of the inspected function).
    """

    kind: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    nan: int
    inf: int
    primitive: str
    module: str
    phase: str
    file: str
    line: int
    function: str

    @property
    def location(self) -> str:
        """``file:line`` (the file's base name)."""
        return f"{os.path.basename(self.file)}:{self.line}" if self.file else "?"

    def __str__(self) -> str:
        counts = ", ".join(f"{n} {what}" for n, what in ((self.nan, "NaN"), (self.inf, "inf")) if n)
        text = f"{self.kind} {self.name} ({counts})"
        if self.kind == "constant":
            text += f" at {self.location} ({self.primitive}, {self.phase})"
        return text

    def to_dict(self) -> dict[str, Any]:
        """The source as plain JSON values."""
        return {f.name: _json_value(getattr(self, f.name)) for f in dataclasses.fields(self)}


class LossScaleSuggestion(NamedTuple):
    """What `Report.suggest_loss_scale` found.

    Attributes:
      loss_scale: the largest power of two keeping every backward value inside the format's
        range with the margin.
      underflow: the fraction of nonzero backward values that would still round to zero in
        the format under `loss_scale`.
      current_underflow: the same fraction under the loss scale the report was made with.
      max_abs: the largest ``|x|`` of the backward values at the loss scale the report was made
        with (of their float32 reference).
      margin: the headroom kept: ``max_abs * loss_scale / current * margin <= format max``.
      format: the format whose range is kept.
      rows: how many backward rows were considered.
      nonfinite: NaN and inf values among them at the inspected scale (overflowed, or from
        a non-finite input); `loss_scale` keeps their finite float32 reference in range.
      reference_nonfinite: of those, the ones NaN or inf in the float32 reference too: no
        loss scale changes them (see `Report.first_nonfinite`).
    """

    loss_scale: float
    underflow: float
    current_underflow: float
    max_abs: float
    margin: float
    format: str
    rows: int
    nonfinite: int = 0
    reference_nonfinite: int = 0

    def __str__(self) -> str:
        text = (
            f"loss scale {_power_of_two(self.loss_scale)}: {_percent(self.underflow)} of the "
            f"nonzero backward values flush to zero in {self.format} "
            f"(at the inspected scale: {_percent(self.current_underflow)}); largest backward "
            f"value {self.max_abs:.3g} at the inspected scale, margin {self.margin:g}"
        )
        if self.nonfinite:
            text += (
                f"; {self.nonfinite} backward values were NaN or inf at the inspected scale "
                f"({self.reference_nonfinite} in the float32 reference too: no loss scale "
                "changes those)"
            )
        return text


def _power_of_two(x: float) -> str:
    exponent = math.log2(x) if x > 0 else math.nan
    if math.isfinite(exponent) and exponent == int(exponent):
        return f"2^{int(exponent)}"
    return f"{x:g}"


def _percent(fraction: float) -> str:
    if fraction == 0:
        return "0%"
    if fraction < 1e-4:
        return f"{100 * fraction:.1e}%"
    return f"{100 * fraction:.2f}%"


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


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["stats", "source_counts"],
    meta_fields=["metas", "formats", "reference", "sources", "sampling", "constants"],
)
@dataclasses.dataclass(frozen=True)
class Report:
    """What `inspect` measured: one row per floating-point op output, in program order.

    A pytree: its statistics are arrays (stacked over the rows) and everything else is
    static, so a jitted function can return it. Reading it (`rows`, ``str``, `to_json`,
    `plot`) copies the arrays to the host once. A report that comes out of `jax.vmap` (of an
    inspected function) has a leading axis over the examples: reading it combines them (the
    counts and histograms summed, `calls` counting each example, extremes and norms over all).

    Attributes:
      stats: the rows' statistics, arrays with a leading axis over the rows.
      metas: the rows' static part (op, location, shape, dtype, loops).
      formats: the formats measured against.
      reference: whether the rows were compared with a float32 evaluation of the program.
      source_counts: int32[sources, 3]: NaN and inf counts of each of `sources`, and whether
        it made a row non-finite.
      sources: the arguments and the constants whose NaN and inf were counted.
      sampling: "" when every op was measured, else which were (``every``, ``modules``).
      constants: ``(phase, count)`` of the op outputs that depend on no argument (constants:
        not measured).
    """

    stats: Stats
    metas: tuple[_Meta, ...]
    formats: tuple[str, ...]
    reference: bool
    source_counts: Any = dataclasses.field(default_factory=lambda: np.zeros((0, 3), np.int32))
    sources: tuple[_Origin, ...] = ()
    sampling: str = ""
    constants: tuple[tuple[str, int], ...] = ()

    def __len__(self) -> int:
        return len(self.metas)

    @functools.cached_property
    def _host(self) -> tuple[Stats, np.ndarray]:
        """The statistics on the host, combined over the leading axes `jax.vmap` added."""
        stats = Stats(*(np.asarray(x) for x in jax.device_get(tuple(self.stats))))
        counts = np.asarray(jax.device_get(self.source_counts))
        axes = tuple(range(stats.calls.ndim - 1))
        if axes:

            def norm(x: np.ndarray) -> np.ndarray:
                return np.sqrt(np.sum(np.square(x.astype(np.float64)), axis=axes))

            total = {f: getattr(stats, f).sum(axis=axes) for f in _SUMMED}
            stats = Stats(
                **total,
                max_abs=stats.max_abs.max(axis=axes),
                min_abs=stats.min_abs.min(axis=axes),
                ref_max=stats.ref_max.max(axis=axes),
                err=norm(stats.err),
                ref_norm=norm(stats.ref_norm),
                first=stats.first.min(axis=axes),
                held=stats.held.min(axis=axes),
            )
            counts = counts.sum(axis=axes[: counts.ndim - 2])
        return stats, counts

    @functools.cached_property
    def rows(self) -> list[OpStats]:
        """The rows as `OpStats`, in program order."""
        host, _ = self._host
        rows = []
        for i, meta in enumerate(self.metas):
            nonzero = int(host.nonzero[i])
            denominator = max(nonzero, 1)
            min_abs = float(host.min_abs[i])
            err, ref_norm = float(host.err[i]), float(host.ref_norm[i])
            if not self.reference:
                rel_error = None
            elif ref_norm > 0:
                rel_error = err / ref_norm
            else:
                rel_error = 0.0 if err == 0 else math.inf
            rows.append(
                OpStats(
                    index=i,
                    primitive=meta.primitive,
                    module=meta.module,
                    phase=meta.phase,
                    file=meta.file,
                    line=meta.line,
                    function=meta.function,
                    library=meta.library,
                    shape=meta.shape,
                    dtype=meta.dtype,
                    output=meta.output,
                    loops=meta.loops,
                    calls=int(host.calls[i]),
                    max_abs=float(host.max_abs[i]),
                    min_abs=min_abs if math.isfinite(min_abs) else None,
                    nan=int(host.nan[i]),
                    inf=int(host.inf[i]),
                    nonzero=nonzero,
                    flush={
                        f: int(host.flush[i][k]) / denominator for k, f in enumerate(self.formats)
                    },
                    overflow={
                        f: int(host.overflow[i][k]) / denominator
                        for k, f in enumerate(self.formats)
                    },
                    underflow=int(host.lost[i]) / denominator if self.reference else None,
                    rel_error=rel_error,
                    ref_max_abs=float(host.ref_max[i]),
                    ref_nonfinite=int(host.ref_bad[i]),
                    created_nonfinite=int(host.first[i]) != _NEVER,
                    histogram=np.asarray(host.hist[i]),
                )
            )
        return rows

    @property
    def first_nonfinite(self) -> OpStats | None:
        """Where the first NaN or inf came from: the op ``jax_debug_nans`` would name.

        The first op, in execution order, that made a NaN from inputs holding none, or an inf
        from finite inputs: the op ``jax_debug_nans`` names for a NaN (``jax_debug_infs`` for
        an inf) when the arguments are finite. When no op made one, the NaN and inf came from
        the arguments or from constants (`nonfinite_sources`): then the first op whose output
        holds one (the first that ``jax_debug_nans`` or ``jax_debug_infs`` sees). Inside a
        loop, execution order counts iterations: an op that went non-finite in iteration 3
        comes before one that did in iteration 5, whatever their order in the loop body.
        None if every measured value is finite (with ``every`` or ``modules``, the ops left
        out are not candidates).
        """
        host, _ = self._host
        for clocks in (host.first, host.held):
            if len(clocks) and int(clocks.min()) != _NEVER:
                return self.rows[int(np.argmin(clocks))]
        return None

    @property
    def nonfinite_sources(self) -> list[NonfiniteSource]:
        """The NaN and inf the program did not compute, in program order.

        The arguments holding NaN or inf, and the constants that do and that an op read with
        otherwise finite inputs (a ``-jnp.inf`` mask in ``jnp.where``; ``1e5`` rounded to inf
        in float16): where `first_nonfinite`'s NaN may have started.
        """
        _, counts = self._host
        out: list[NonfiniteSource] = []
        seen = set()
        for origin, (nan, inf, made) in zip(self.sources, counts.tolist(), strict=True):
            if origin.static:
                nan, inf = origin.nan, origin.inf
            # One literal of the source is often several of the program (forward, backward).
            key = (origin.kind, origin.name, origin.dtype, origin.file, origin.line)
            if not made or not nan + inf or (origin.static and key in seen):
                continue
            seen.add(key)
            out.append(
                NonfiniteSource(
                    kind=origin.kind,
                    name=origin.name,
                    shape=origin.shape,
                    dtype=origin.dtype,
                    nan=int(nan),
                    inf=int(inf),
                    primitive=origin.primitive,
                    module=origin.module,
                    phase=origin.phase,
                    file=origin.file,
                    line=origin.line,
                    function=origin.function,
                )
            )
        return out

    def find(
        self,
        primitive: str | None = None,
        *,
        module: str | None = None,
        phase: str | None = None,
        line: int | None = None,
    ) -> list[OpStats]:
        """The rows matching every criterion given, in program order.

        Args:
          primitive: the primitive's name.
          module: the module path, exactly.
          phase: ``"forward"`` or ``"backward"``.
          line: the source line.

        Raises:
          ValueError: for a `primitive` that is no JAX primitive, a `module` that no row
            has, or a `phase` other than the two (with the close names, if any).
        """
        if primitive is not None:
            present = {r.primitive for r in self.rows}
            if primitive not in present and primitive not in compat.known_primitive_names():
                raise ValueError(
                    f"`primitive` must name a JAX primitive, got {primitive!r}"
                    f"{_did_you_mean(primitive, present, compat.known_primitive_names())}."
                )
        if phase is not None and phase not in _PHASES:
            guess = _PHASE_ALIASES.get(str(phase).lower())
            hint = f"; did you mean {guess!r}" if guess else _did_you_mean(str(phase), _PHASES)
            raise ValueError(f"`phase` must be 'forward' or 'backward', got {phase!r}{hint}.")
        if module is not None:
            modules = list(dict.fromkeys(r.module for r in self.rows))
            if module not in modules:
                listed = ", ".join(repr(m) for m in modules[:12]) + (
                    ", ..." if len(modules) > 12 else ""
                )
                raise ValueError(
                    f"`module` must be a module path of the report, got {module!r}"
                    f"{_did_you_mean(str(module), modules)}; its modules: {listed or 'none'}."
                )
        return [
            r
            for r in self.rows
            if (primitive is None or r.primitive == primitive)
            and (module is None or r.module == module)
            and (phase is None or r.phase == phase)
            and (line is None or r.line == line)
        ]

    def suggest_loss_scale(
        self,
        loss_scale: ArrayLike | loss_scale_lib.LossScale = 1.0,
        *,
        margin: float = 2.0,
        format: str = "float16",
    ) -> LossScaleSuggestion:
        """The largest power-of-two loss scale keeping the backward pass inside `format`.

        The backward values considered are those the program stores in `format` when it
        computes in it (the mixed-precision program's float16 gradients), else all of them
        (a float32 program asking what float16 would need); jaxmp's own ops (the loss scale's
        multiply, `OpStats.library`) are left out. Their largest float32-reference magnitude,
        rescaled from `loss_scale` to the candidate scale and times `margin`, must stay at
        most the format's largest finite value. The underflow left is read from the exponent
        histograms: the values below 2^-25 after scaling (those round to zero in float16; in
        general, below half the format's smallest subnormal).

        Args:
          loss_scale: the loss scale the inspected gradients were computed with: a number, a
            scalar array, or the loss scale object itself (`jaxmp.DynamicLossScale`,
            `jaxmp.StaticLossScale`, a jmp loss scale: its current scale); 1 for a plain
            `jax.grad`.
          margin: headroom factor, at least 1 (2: one binade below overflow).
          format: the format whose range to keep (float16 by default).

        Returns:
          A `LossScaleSuggestion`.

        Raises:
          ValueError: for a `loss_scale` that is not a positive number or a loss scale, a
            `margin` below 1, a non-floating `format`, a report without a measured backward
            pass (inspect a `jax.grad` or `jax.value_and_grad` function), or none of whose
            backward values is finite and nonzero (the message says which).
          TypeError: for a traced `loss_scale` (call it outside `jax.jit`).
        """
        scale = _loss_scale_value(loss_scale)
        if not (isinstance(margin, (int, float)) and margin >= 1):
            raise ValueError(f"`margin` must be a number of at least 1, got {margin!r}.")
        (fmt,) = _check_formats([format])
        backward = [r for r in self.rows if r.phase == "backward" and not r.library]
        if not backward:
            constants = dict(self.constants).get("backward", 0)
            if constants:
                raise ValueError(
                    f"The report's backward pass has no measured op: its {constants} op "
                    "outputs depend on no argument (constants are not measured), so there is "
                    "no gradient value to keep in range."
                )
            raise ValueError(
                "The report has no backward pass: inspect a `jax.grad` or "
                "`jax.value_and_grad` function (or `jaxmp.value_and_grad`) to get one."
            )
        stored = [r for r in backward if r.dtype == fmt]
        rows = stored or backward
        which = f"backward values stored in {fmt}" if stored else "backward values"
        max_abs = max(r.ref_max_abs for r in rows)
        nonfinite = sum(r.nan + r.inf for r in rows)
        if not max_abs > 0:
            if nonfinite:
                raise ValueError(
                    f"None of the {which} is finite and nonzero ({nonfinite} are NaN or inf): "
                    "no loss scale brings them into range. "
                    + "; ".join(self._nonfinite_lines())
                    + "."
                )
            raise ValueError(
                f"Every one of the {which} is zero: any loss scale keeps them in range."
            )
        info = ml_dtypes.finfo(_format_dtype(fmt))
        limit = float(info.max)
        shift = math.floor(math.log2(limit / (max_abs * margin)))
        while max_abs * margin * 2.0**shift > limit:  # log2 rounding at the edge
            shift -= 1
        hist = np.sum([r.histogram for r in rows], axis=0)
        total = max(int(hist.sum()), 1)
        # Values below half the smallest subnormal round to zero: exponent < log2(tiny) - 1.
        lowest = int(round(math.log2(float(info.smallest_subnormal)))) - 1
        exponents = np.arange(EXPONENT_MIN, EXPONENT_MAX + 1)

        def flushed(shift: int) -> float:
            return float(hist[exponents + shift < lowest].sum()) / total

        return LossScaleSuggestion(
            loss_scale=scale * 2.0**shift,
            underflow=flushed(shift),
            current_underflow=flushed(0),
            max_abs=max_abs,
            margin=float(margin),
            format=fmt,
            rows=len(rows),
            nonfinite=nonfinite,
            reference_nonfinite=sum(r.ref_nonfinite for r in rows),
        )

    # -- Reading.

    def _severity(self, row: OpStats) -> tuple[Any, ...]:
        fmt = self.formats[0]
        return (
            row.created_nonfinite,
            not row.library,
            row.nan + row.inf > 0,
            row.overflow[fmt],
            row.underflow or 0.0,
            row.flush[fmt],
            row.rel_error or 0.0,
        )

    def worst(self, limit: int | None = 20) -> list[OpStats]:
        """The rows from worst to best (see `table`), at most `limit` of them."""
        ranked = sorted(self.rows, key=lambda r: (self._severity(r), -r.index), reverse=True)
        return ranked if limit is None else ranked[:limit]

    def _nonfinite_lines(self) -> list[str]:
        first, sources = self.first_nonfinite, self.nonfinite_sources
        if first is None and not sources:
            every = "every measured value" if self.sampling else "every value"
            return [f"first non-finite value: none ({every} is finite)"]
        lines = []
        if first is not None:
            how = "made by it" if first.created_nonfinite else "read from an input"
            lines.append(
                f"first non-finite value: {first.op} ({first.phase}) at {first.location} "
                f"in {first.module or '(no module)'} ({how})"
            )
        if sources:
            lines.append("non-finite inputs: " + "; ".join(str(s) for s in sources))
        return lines

    def table(self, limit: int | None = 40) -> str:
        """A readable table: the `limit` worst rows, grouped by module.

        Rows rank by, in order: made a non-finite value from finite inputs; the user's code
        before jaxmp's own (marked ``[jaxmp]``); holds NaN or inf; overflow fraction in the
        first format; fraction lost to underflow; flush fraction in the first format;
        relative error. Modules appear in the order of their worst row.
        """
        rows = self.worst(limit)
        n_fwd = sum(r.phase == "forward" for r in self.rows)
        lines = [
            f"jaxmp.inspect: {len(self.rows)} ops ({n_fwd} forward, "
            f"{len(self.rows) - n_fwd} backward)"
            + (
                "; reference: the program evaluated in float32"
                if self.reference
                else "; no float32 reference (the program computes in float32 or wider)"
            )
            + (f"; sampled: {self.sampling}" if self.sampling else "")
        ]
        lines += self._nonfinite_lines()
        lines.append(
            "per format: % of nonzero values that would flush to zero / overflow if stored "
            "in it" + ("; lost: % of nonzero values zero in the program" if self.reference else "")
        )
        header = ["#", "op", "pass", "at", "value", "max|x|", "min|x|>0", "nan", "inf"]
        header += [f"{_short(f)} flush/over" for f in self.formats]
        if self.reference:
            header += ["lost", "rel.err"]
        header += ["loop"]
        groups: dict[str, list[OpStats]] = {}
        for row in rows:
            groups.setdefault(row.module, []).append(row)
        table: list[list[str]] = []
        for module, members in groups.items():
            table.append([f"module {module or '(no module)'}"])
            for r in members:
                cells = [
                    str(r.index),
                    r.op
                    + ("!" if r.created_nonfinite else "")
                    + (f" [{r.library}]" if r.library else ""),
                    "bwd" if r.phase == "backward" else "fwd",
                    r.location,
                    f"{_short(r.dtype)}[{','.join(map(str, r.shape))}]",
                    _num(r.max_abs),
                    _num(r.min_abs),
                    str(r.nan),
                    str(r.inf),
                ]
                cells += [_pair(r.flush[f], r.overflow[f]) for f in self.formats]
                if self.reference:
                    cells += [_pct(r.underflow or 0.0), _num(r.rel_error)]
                loops = "; ".join(r.loops)
                if r.calls != 1 or loops:
                    loops = f"{loops} x{r.calls}" if loops else f"x{r.calls}"
                cells += [loops]
                table.append(cells)
        widths = [len(h) for h in header]
        for cells in table:
            if len(cells) > 1:
                widths = [max(w, len(c)) for w, c in zip(widths, cells, strict=True)]
        lines.append("  " + "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
        for cells in table:
            if len(cells) == 1:
                lines.append(cells[0])
            else:
                lines.append(
                    "  " + "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))
                )
        legend = "! marks an op that made a non-finite value from finite inputs"
        if any(r.library for r in rows):
            legend += "; [jaxmp] an op of jaxmp's own code, at the user's call"
        if limit is not None and len(self.rows) > len(rows):
            lines.append(
                f"({len(rows)} worst of {len(self.rows)} rows; report.table(limit=None) lists "
                f"all; {legend})"
            )
        else:
            lines.append(f"({legend})")
        return "\n".join(line.rstrip() for line in lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"<jaxmp.inspect Report: {len(self.metas)} rows, formats {list(self.formats)}>"

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON values (see `to_json`)."""
        first = self.first_nonfinite
        return {
            "formats": list(self.formats),
            "reference": self.reference,
            "sampling": self.sampling,
            "exponent_range": [EXPONENT_MIN, EXPONENT_MAX],
            "first_nonfinite": None if first is None else first.index,
            "nonfinite_sources": [s.to_dict() for s in self.nonfinite_sources],
            "rows": [r.to_dict() for r in self.rows],
        }

    def to_json(self, indent: int | None = None) -> str:
        """The report as JSON: formats, ``first_nonfinite`` (a row index), the non-finite
        sources and the rows.

        Non-finite numbers are written as null; a histogram as ``{"exponent_min", "counts"}``
        over its nonzero range.
        """
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def plot(self, path: str | os.PathLike[str] | None = None, **kwargs: Any) -> Any:
        """Per-module histograms of value exponents against each format's range (a Figure).

        The figure of Micikevicius et al. (2018), "Mixed Precision Training", for every
        module: how the values' binary exponents spread (forward values left, backward
        values right), against the range each format represents (normal and subnormal).
        The rows of jaxmp's own ops (`OpStats.library`) are left out. Needs matplotlib
        (``pip install matplotlib``, or the ``examples`` extra).

        Args:
          path: where to save it as PNG (nothing is saved when None).
          **kwargs: ``max_modules`` (default 32: the modules holding the most values, the
            others pooled) and ``title``.

        Returns:
          The matplotlib Figure.

        Raises:
          ImportError: if matplotlib is not installed.
        """
        from jaxmp._src import inspector_plot

        return inspector_plot.plot(self, path, **kwargs)


_SUMMED = ("calls", "nan", "inf", "nonzero", "flush", "overflow", "lost", "ref_bad", "hist")
_PHASES = ("forward", "backward")
_PHASE_ALIASES = {"fwd": "forward", "fw": "forward", "bwd": "backward", "bw": "backward"}


def _did_you_mean(name: str, *choices: Iterable[str]) -> str:
    """``"; did you mean 'x'"`` for the closest of `choices` (the first set that has one)."""
    for options in choices:
        close = difflib.get_close_matches(name, sorted(options), n=1)
        if close:
            return f"; did you mean {close[0]!r}"
    return ""


def _loss_scale_value(loss_scale: Any) -> float:
    """The current scale of `loss_scale`: a number, a scalar array, or a loss scale object."""
    value = loss_scale
    if isinstance(loss_scale, loss_scale_lib.LossScale) or (
        not isinstance(loss_scale, (str, bytes, type)) and hasattr(loss_scale, "loss_scale")
    ):
        value = loss_scale.loss_scale  # jaxmp's loss scales and jmp's
    if isinstance(value, compat.Tracer):
        raise TypeError(
            f"`loss_scale` must be concrete: call suggest_loss_scale outside `jax.jit`, got "
            f"the traced {value!r}."
        )
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, (jax.Array, np.ndarray, np.generic)) and np.shape(value) == ():
        number = float(np.asarray(value))
    else:
        number = math.nan
    if not number > 0 or not math.isfinite(number):
        raise ValueError(
            "`loss_scale` must be a positive number or a loss scale (jaxmp.DynamicLossScale, "
            f"jaxmp.StaticLossScale, a scalar array), got {loss_scale!r}."
        )
    return number


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    if not math.isfinite(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.2g}" if 1e-2 <= abs(x) < 1e4 else f"{x:.1e}"


def _pct(fraction: float) -> str:
    if fraction == 0:
        return "0"
    value = 100 * fraction
    return f"{value:.3g}" if value >= 0.01 else "<.01"


def _pair(flush: float, overflow: float) -> str:
    if flush == 0 and overflow == 0:
        return "-"
    return f"{_pct(flush)}/{_pct(overflow)}"


def _make_report(
    records: list[tuple[_BatchMeta, _Batch]],
    formats: tuple[str, ...],
    reference: bool,
    sampling: str,
    constants: dict[str, int],
) -> Report:
    """The `Report` of the records of a program: its rows' statistics, in program order.

    Every conversion is made once over all rows of one pair of layouts (not one per row: a
    kernel each for XLA to compile), then one gather per statistic puts them in order.
    """
    rows = []  # (seq, meta, group key, index among that key's rows, index among all batches')
    by_key: dict[tuple[str, str], list[_Group]] = {}
    sizes: dict[tuple[str, str], int] = {}
    calls, firsts, helds = [], [], []
    sources: dict[_Origin, list[Any]] = {}
    done = 0
    for meta, batch in records:
        starts = []
        for key, group in zip(meta.groups, batch.groups, strict=True):
            starts.append((key, sizes.get(key, 0)))
            by_key.setdefault(key, []).append(group)
            sizes[key] = sizes.get(key, 0) + int(group.hist.shape[0])
        for r, row in enumerate(meta.rows):
            key, start = starts[row.group]
            rows.append((row.seq, row.meta, key, start + row.position, done + r))
        calls.append(jnp.broadcast_to(jnp.asarray(batch.calls, jnp.int32), (len(meta.rows),)))
        firsts.append(batch.first)
        helds.append(batch.held)
        done += len(meta.rows)
        for s, origin in enumerate(meta.sources):
            sources.setdefault(origin, []).append(batch.sources[s])
    rows.sort(key=lambda r: r[0])
    if rows:
        keys = list(by_key)
        offsets = dict(zip(keys, np.cumsum([0] + [sizes[k] for k in keys])[:-1], strict=True))
        parts = [_group_stats(by_key[k], formats, reference) for k in keys]
        at = np.asarray([offsets[key] + i for _, _, key, i, _ in rows], np.int32)
        stats = Stats(*(jnp.concatenate(field)[at] for field in zip(*parts, strict=True)))
        order = np.asarray([b for *_, b in rows], np.int32)
        stats = stats._replace(
            calls=jnp.concatenate(calls)[order],
            first=jnp.concatenate(firsts)[order],
            held=jnp.concatenate(helds)[order],
        )
    else:
        stats = _empty_stats(len(formats))
    source_counts = (
        jnp.stack([functools.reduce(jnp.add, c) for c in sources.values()])
        if sources
        else np.zeros((0, 3), np.int32)
    )
    return Report(
        stats=stats,
        source_counts=source_counts,
        metas=tuple(m for _, m, *_ in rows),
        formats=formats,
        reference=reference,
        sources=tuple(sources),
        sampling=sampling,
        constants=tuple(constants.items()),
    )


# --------------------------------------------------------------------------------------------
# Public API.


def _name_nnx_modules(tree: Any) -> None:
    """Makes each Flax NNX module in `tree` run its ``__call__`` under a `jax.named_scope`.

    So that rows name the module path, as Flax Linen's do: `tree` holds the modules merged
    inside the inspector's trace, fresh copies and never the caller's objects. Each copy's
    class becomes a subclass whose ``__call__`` opens a scope named by the module's attribute
    path in the enclosing module (the class name for a module passed as an argument).
    `nnx.split` records the subclass, so the copies `nnx.grad` and `nnx.value_and_grad` make
    inside the call are named too. Called only when `tree` holds NNX graph nodes, so
    ``flax.nnx`` is imported already (`import jaxmp` does not import Flax).
    """
    from flax import nnx

    for root in jax.tree.leaves(tree, is_leaf=nnx.graph.is_graph_node):
        if not nnx.graph.is_graph_node(root):
            continue
        modules = {
            tuple(path): node for path, node in nnx.iter_graph(root) if isinstance(node, nnx.Module)
        }
        for path, node in modules.items():
            parent = max(
                (p for p in modules if len(p) < len(path) and path[: len(p)] == p),
                key=len,
                default=(),
            )
            name = "/".join(str(k) for k in path[len(parent) :]) if path else type(node).__name__
            if _defines_call(type(node)):
                node.__class__ = _scoped_class(
                    getattr(type(node), "_jaxmp_unscoped", type(node)), name
                )


def _defines_call(cls: type) -> bool:
    return any("__call__" in vars(k) for k in cls.__mro__ if k is not object)


@functools.cache
def _scoped_class(cls: type, name: str) -> type:
    """`cls` with ``__call__`` under ``jax.named_scope(name)`` (one class per pair)."""
    unscoped_call = cls.__call__  # type: ignore[operator]

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        with jax.named_scope(name):
            return unscoped_call(self, *args, **kwargs)

    namespace = {
        "__call__": __call__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "_jaxmp_unscoped": cls,
    }
    return type(cls)(cls.__name__, (cls,), namespace)


class Inspect:
    """The function `inspect` returns: call it like `fun`; it returns ``(outputs, report)``.

    Attributes:
      policy: the `jaxmp.Policy` the function runs under with `jaxmp.autocast`, or None
        (the function runs as written).
      formats: the formats measured against.
      every: every how many ops one is measured (1: all).
      modules: the regular expression choosing the modules measured, or None (all).
    """

    def __init__(
        self,
        fun: Callable[..., Any],
        policy: policy_lib.Policy | None,
        formats: tuple[str, ...],
        every: int = 1,
        modules: re.Pattern[str] | None = None,
    ):
        functools.update_wrapper(self, fun, updated=())
        self._fun = fun
        self.policy = policy
        self.formats = formats
        self.every = every
        self.modules = modules
        self._program = fun if policy is None else autocast_lib.autocast(fun, policy)
        self._jitted = jax.jit(self._run, static_argnums=(0, 1))

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, Report]:
        graph = interpret.split_graph_nodes((args, kwargs))
        if graph is not None:
            # NNX modules are called with their state, and the variables the call updates
            # are written back, as `jaxmp.autocast` and `nnx.jit` do.
            nodes, others, state, write_back = graph
            (out, new_leaves), report = self._call(True, (nodes, others, state), {})
            write_back(new_leaves)
            return out, report
        return self._call(False, args, kwargs)

    def _call(self, graph: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        spec, dynamic = interpret.split_args(args, kwargs)
        if not any(isinstance(x, compat.Tracer) for x in dynamic) and spec.hashable():
            # Called outside any transformation: trace, re-interpret and compile once per
            # argument signature.
            return self._jitted(graph, spec, *dynamic)
        return self._run(graph, spec, *dynamic)

    def _run(self, graph: bool, spec: interpret.ArgSpec, *dynamic: Any) -> Any:
        caller = _caller()
        traced = interpret.trace_call(
            self._program, graph, spec, dynamic, before_call=_name_nnx_modules if graph else None
        )
        closed = traced.closed
        reference = self.policy is not None or _computes_in_low_precision(closed.jaxpr)
        rules = _InspectRules(self.formats, reference, self.every, self.modules, caller)
        interp = interpret.Interpreter(rules)
        with rules.body(interp):  # the top level's values are measured together
            names = _argument_names(spec, graph)
            args = [rules.argument(x, n) for x, n in zip(dynamic, names, strict=True)]
            values = interp.eval_jaxpr(closed.jaxpr, closed.consts, args)
        outs = jax.tree.unflatten(traced.out_tree, [v.value for v in values])
        report = _make_report(
            interp.records, self.formats, reference, self._sampling(), rules.constants
        )
        return outs, report

    def _sampling(self) -> str:
        which = []
        if self.every > 1:
            which.append(f"every {_ordinal(self.every)} op")
        if self.modules is not None:
            which.append(f"in modules matching {self.modules.pattern!r}")
        return " ".join(which)

    def __repr__(self) -> str:
        name = getattr(self._fun, "__name__", repr(self._fun))
        extra = f", every={self.every}" if self.every > 1 else ""
        if self.modules is not None:
            extra += f", modules={self.modules.pattern!r}"
        return f"jaxmp.inspect({name}, {self.policy!r}, formats={list(self.formats)}{extra})"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _argument_names(spec: interpret.ArgSpec, graph: bool) -> list[str]:
    """The paths of the array arguments (``"args[0]['w']"``), in the order of their leaves."""
    static = {i for i, _ in spec.static}
    placeholder = jax.tree.unflatten(spec.treedef, list(range(spec.num_leaves)))
    names = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(placeholder)[0]:
        if leaf in static:
            continue
        if graph:  # (nodes, others, state) of the NNX split
            head = "state" if path[1].idx == 2 else "args"  # type: ignore[attr-defined]
            names.append(head + jax.tree_util.keystr(path[2:]))
        else:
            head = "args" if path[0].idx == 0 else "kwargs"  # type: ignore[attr-defined]
            names.append(head + jax.tree_util.keystr(path[1:]))
    return names


def inspect(
    fun: Callable[..., Any],
    policy: policy_lib.Policy | str | None = None,
    *,
    formats: Sequence[str] = DEFAULT_FORMATS,
    every: int = 1,
    modules: str | re.Pattern[str] | None = None,
) -> Inspect:
    """Measures every floating-point op of `fun`: range, underflow, overflow and error.

    The returned function has `fun`'s signature and returns ``(outputs, report)``: `fun`'s
    outputs, computed as `fun` computes them, and a `Report` with one row per floating-point
    op output in program order: the forward pass, and when `fun` is a `jax.grad` or
    `jax.value_and_grad` function (or `jaxmp.value_and_grad`, `nnx.grad`) the backward pass,
    which is then part of the program. Rows go through ``jit``, ``scan``, ``while``,
    ``cond``, ``checkpoint`` and custom derivative rules; ops inside loops have one row
    aggregated over the iterations. Ops that only move values (reshape, transpose, slice,
    broadcast, select; `MOVEMENT_OPS`) have no row. Ops that depend on no argument (on
    constants only) are computed once while tracing and measured then, when their output has
    at most 65536 values; a larger one has no row (its NaN and inf still count when a
    measured op reads it, see `Report.nonfinite_sources`).

    Each row has the primitive, the module path (Flax Linen module names, `jax.named_scope`
    names; the attribute path of the Flax NNX modules passed as arguments) and the user's
    ``file:line``, the output's shape and dtype, max ``|x|``, the smallest nonzero ``|x|``,
    the counts of NaN and inf, and for each format the fraction of nonzero values that would
    flush to zero or overflow if stored in it. When the program computes in lower precision,
    or under a `policy`, each row also has the fraction of values lost to underflow and the relative
    error against the same program evaluated in float32 (see `jaxmp._src.inspector`).

    The statistics are computed on device as extra outputs of the program: call the
    returned function under `jax.jit` (inside a train step, every N steps); it is traced
    once per argument signature. Called eagerly, it compiles itself once per signature.
    The outputs of one size and dtypes are measured together (one reduction for all of
    them), so each is kept alive until the end of its loop body or jit body, or until 256
    MiB of them wait: inspecting adds memory. For a larger model, `every` and `modules`
    measure a sample of the ops.

    Args:
      fun: the function to inspect.
      policy: None to inspect `fun` as written, or a `jaxmp.Policy` or policy string: the
        function then runs under ``jaxmp.autocast(fun, policy)`` and that program is
        inspected.
      formats: the floating formats to measure against (dtype names: ``"float16"``,
        ``"bfloat16"``, ``"float8_e4m3fn"``, ``"float8_e5m2"``...). The first one ranks the
        rows of the table.
      every: measure one op output in `every` (in program order, counting those `modules`
        keeps): 1 measures all. The float32 reference is still evaluated for every op.
      modules: a regular expression: only the op outputs whose module path it matches
        (``re.search``) are measured; None measures all.

    Returns:
      An `Inspect`: a function with `fun`'s signature returning ``(outputs, report)``.

    Raises:
      TypeError: if `fun` is not callable, `policy` is not a policy, string or None,
        `formats` is not a sequence of names, `every` not an int or `modules` not a string.
      ValueError: for an invalid policy string, a format that is not a floating dtype,
        `every` below 1 or a `modules` that is not a valid regular expression.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmp
      >>> def loss(w, x):
      ...   return jnp.exp(x @ w).sum()
      >>> w, x = jnp.full((2, 2), 6.0), jnp.ones((1, 2))
      >>> (value, grads), report = jaxmp.inspect(jax.value_and_grad(loss))(w, x)
      >>> row = report.find("exp")[0]
      >>> row.phase, row.max_abs > 65504, row.overflow["float16"]
      ('forward', True, 1.0)
      >>> report.suggest_loss_scale().loss_scale  # gradients of 1.6e5: scale down
      0.125
    """
    if not callable(fun):
        raise TypeError(f"`fun` must be callable, got {fun!r}.")
    if policy is not None:
        policy = policy_lib.as_policy(policy, arg="policy")
    if not isinstance(every, int) or isinstance(every, bool):
        raise TypeError(f"`every` must be a positive int, got {every!r}.")
    if every < 1:
        raise ValueError(f"`every` must be a positive int, got {every!r}.")
    if modules is not None and not isinstance(modules, re.Pattern):
        if not isinstance(modules, str):
            raise TypeError(
                f"`modules` must be a regular expression (a str or re.Pattern), got {modules!r}."
            )
        try:
            modules = re.compile(modules)
        except re.error as e:
            raise ValueError(
                f"`modules` must be a regular expression (re.search on each row's module "
                f"path), got {modules!r}: {e}."
            ) from None
    return Inspect(fun, policy, _check_formats(formats), every, modules)
