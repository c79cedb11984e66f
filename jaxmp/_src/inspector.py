"""The precision inspector: which op overflows, underflows or loses precision, and where.

`inspect` traces a function to a jaxpr and evaluates it again over the re-interpretation core
(`jaxmp._src.interpret`), with a rule set that re-binds every equation exactly as traced and
measures each floating output on device. The measurements are extra outputs of the program
(no host callbacks), so an inspected function runs under `jax.jit` and compiles once.

What is measured, per op output (one row, see `OpStats`):

* of the value the op produced: max ``|x|`` over finite values, the smallest nonzero ``|x|``, the
  counts of NaN and inf, and whether the op made a non-finite value from finite inputs;
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

Counts, extremes and exponents are read from the bits of the values, so they are exact on
every backend, subnormals included (XLA on CPU treats subnormal operands of comparisons as
zero). Whether a value rounds to zero or overflows in a format is decided against thresholds
found once on the host by converting with ``ml_dtypes``/numpy (round to nearest even), so the
fractions equal what ``x.astype(format)`` gives in numpy. Float64 values (``jax_enable_x64``)
are measured in float64; everything narrower is widened to float32, which is exact.

Ops inside ``scan`` and ``while`` have one row for all iterations: counts and histograms are
summed, extremes taken over every iteration, and the relative error is that of all iterations'
outputs taken as one array. A row inside a ``cond`` branch counts only the calls that took it
(`OpStats.calls` is 0 for a branch never taken).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from jaxmp._src import autocast as autocast_lib
from jaxmp._src import autocast_rules, compat, interpret
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
    hist: Any  # int32[_NUM_BINS]: binary exponents of nonzero finite reference values
    first: Any  # int32: clock of the first call making a non-finite value from finite inputs


class _Record(NamedTuple):
    """One row's statistics as the program computes them: the raw outputs of its reduction.

    Turned into `Stats` once, for all rows together, when the report is made: a conversion
    per row would be a kernel per row for XLA to compile.
    """

    calls: Any  # int32
    maxima: tuple[Any, ...]  # magnitude bits: max |x|, inf - min nonzero |x|, max |ref|
    counts: tuple[Any, ...]  # int32: nonzero, (flush, overflow) per format, nan, inf[, lost]
    norms: tuple[Any, ...]  # (s, q) of the error and of the reference, or () without one
    first: Any  # int32
    hist: Any  # int32[_NUM_BINS]


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


def _measure(
    value: Any,
    ref: Any,
    inputs_finite: Any,
    clock: Any,
    formats: Sequence[str],
) -> _Record:
    """The statistics of one op output (`ref` None: the value is its own reference).

    Every count, extreme and norm, and the clock of a non-finite value made from finite
    inputs, come out of one variadic reduction, and the histogram out of one scatter: XLA
    compiles a dozen separate reductions per op an order of magnitude slower, and an
    inspected program has hundreds of ops.
    """
    mag, layout = _magnitude(jnp.ravel(value))
    inf = np.asarray(layout.inf_bits, layout.uint_dtype)
    u0 = np.asarray(0, layout.uint_dtype)
    finite = mag < inf
    r = value if ref is None else ref
    r_flat = jnp.ravel(r)
    r_mag, r_layout = _magnitude(r_flat)
    r_inf = np.asarray(r_layout.inf_bits, r_layout.uint_dtype)
    r_u0 = np.asarray(0, r_layout.uint_dtype)
    r_finite = r_mag < r_inf
    r_nonzero = r_finite & (r_mag > 0)

    maxima = [
        jnp.where(finite, mag, u0),  # max |x|
        jnp.where(finite & (mag > 0), inf - mag, u0),  # inf - min nonzero |x|
        jnp.where(r_finite, r_mag, r_u0),  # max |ref|
    ]
    counts = [r_nonzero]
    for fmt in formats:
        flush_bits, over_bits = _thresholds(fmt, r_layout)
        counts.append(r_nonzero & (r_mag <= np.asarray(flush_bits, r_layout.uint_dtype)))
        counts.append(r_finite & (r_mag >= np.asarray(over_bits, r_layout.uint_dtype)))
    counts += [mag > inf, mag == inf]  # NaN, inf
    norms: list[Any] = []
    if ref is not None:
        counts.append(r_nonzero & (mag == 0))  # lost to underflow
        wide = lax.convert_element_type(jnp.ravel(value), r.dtype)
        diff = jnp.abs(jnp.where(r_finite, wide - jnp.where(r_finite, r_flat, 0), 0))
        # A non-finite value where the reference is finite: an infinite error.
        diff = jnp.where(r_finite & ~finite, jnp.inf, diff)
        size = jnp.abs(jnp.where(r_finite, r_flat, 0))
        for x in (diff, size):
            norms += [x, (x > 0).astype(r.dtype)]
    # The clock where a value is non-finite and the inputs were all finite (min: the first).
    first = jnp.where(~finite & inputs_finite, clock, np.int32(_NEVER)).astype(jnp.int32)
    operands = [*maxima, *(c.astype(jnp.int32) for c in counts), *norms, first]
    inits = [u0, u0, r_u0, *([np.int32(0)] * len(counts))]
    inits += [np.asarray(0, r.dtype)] * len(norms) + [np.int32(_NEVER)]
    n_max, n_count, n_norm = len(maxima), len(counts), len(norms)

    def step(a: Sequence[Any], b: Sequence[Any]) -> list[Any]:
        out = [jnp.maximum(x, y) for x, y in zip(a[:n_max], b[:n_max], strict=True)]
        out += [x + y for x, y in zip(a[n_max:], b[n_max:], strict=True)][:n_count]
        for k in range(n_max + n_count, n_max + n_count + n_norm, 2):
            out += list(_scaled_norm_step((a[k], a[k + 1]), (b[k], b[k + 1])))
        return [*out, jnp.minimum(a[-1], b[-1])]

    reduced = lax.reduce(operands, inits, step, (0,))
    # Zeros and non-finite values go to an index past the end, which the scatter drops.
    bins = jnp.clip(_exponents(r_mag, r_layout), EXPONENT_MIN, EXPONENT_MAX) - EXPONENT_MIN
    bins = jnp.where(r_nonzero, bins, _NUM_BINS)
    hist = jnp.zeros(_NUM_BINS, jnp.int32).at[bins].add(np.int32(1), mode="drop")
    return _Record(
        calls=np.int32(1),
        maxima=tuple(reduced[:n_max]),
        counts=tuple(reduced[n_max : n_max + n_count]),
        norms=tuple(reduced[n_max + n_count : n_max + n_count + n_norm]),
        first=reduced[-1],
        hist=hist,
    )


def _empty_record(struct: _Record) -> _Record:
    """The identity of `_combine` for records of the structure `struct`."""
    return _Record(
        calls=np.int32(0),
        maxima=tuple(np.zeros((), s.dtype) for s in struct.maxima),
        counts=tuple(np.int32(0) for _ in struct.counts),
        norms=tuple(np.zeros((), s.dtype) for s in struct.norms),
        first=np.int32(_NEVER),
        hist=np.zeros(struct.hist.shape, np.int32),
    )


def _combine(a: _Record, b: _Record) -> _Record:
    """Two records of one op combined: two iterations of a loop."""
    norms: list[Any] = []
    for k in range(0, len(a.norms), 2):
        norms += _scaled_norm_step(a.norms[k : k + 2], b.norms[k : k + 2])
    return _Record(
        calls=a.calls + b.calls,
        maxima=tuple(jnp.maximum(x, y) for x, y in zip(a.maxima, b.maxima, strict=True)),
        counts=tuple(x + y for x, y in zip(a.counts, b.counts, strict=True)),
        norms=tuple(norms),
        first=jnp.minimum(a.first, b.first),
        hist=a.hist + b.hist,
    )


def _floats_from_bits(bits: list[Any]) -> Any:
    """Stacks magnitude bits of several rows into their float values (one conversion)."""
    stat = _stat_float()
    if len(bits) == 1 and bits[0].ndim == 1:  # already stacked (`_min_bits`)
        return lax.bitcast_convert_type(bits[0], jnp.float32).astype(stat)
    dtypes = {jnp.dtype(b.dtype) for b in bits}
    if dtypes == {np.dtype(np.uint32)}:
        return lax.bitcast_convert_type(jnp.stack(bits), jnp.float32).astype(stat)
    # Float64 rows (jax_enable_x64) next to float32 ones: each converted on its own.
    return jnp.stack(
        [
            lax.bitcast_convert_type(
                b, np.float64 if jnp.dtype(b.dtype) == np.uint64 else np.float32
            ).astype(stat)
            for b in bits
        ]
    )


def _stats(records: list[_Record], num_formats: int, reference: bool) -> Stats:
    """The rows' `Stats`, from their records: every conversion once over all rows."""
    stat = _stat_float()
    n = len(records)
    if not n:
        ints, floats = jnp.zeros((0,), jnp.int32), jnp.zeros((0,), stat)
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
            hist=jnp.zeros((0, _NUM_BINS), jnp.int32),
            first=ints,
        )

    def column(values: list[Any], dtype: Any = None) -> Any:
        return jnp.stack([jnp.asarray(v, dtype) for v in values])

    # One stack per statistic over the rows (not one per row: a kernel each to compile).
    counts = jnp.stack(
        [column([r.counts[k] for r in records]) for k in range(len(records[0].counts))], axis=1
    )
    max_bits = [r.maxima[0] for r in records]
    min_bits = _min_bits([r.maxima[1] for r in records])
    if reference:
        norms = [column([jnp.asarray(r.norms[k], stat) for r in records]) for k in range(4)]
        err = norms[0] * jnp.sqrt(norms[1])
        ref_norm = norms[2] * jnp.sqrt(norms[3])
        lost = counts[:, 3 + 2 * num_formats]
    else:
        err = ref_norm = jnp.zeros((n,), stat)
        lost = jnp.zeros((n,), jnp.int32)
    return Stats(
        calls=column([r.calls for r in records], jnp.int32),
        nan=counts[:, 1 + 2 * num_formats],
        inf=counts[:, 2 + 2 * num_formats],
        max_abs=_floats_from_bits(max_bits),
        min_abs=_floats_from_bits(min_bits),
        nonzero=counts[:, 0],
        flush=counts[:, 1 : 1 + 2 * num_formats : 2],
        overflow=counts[:, 2 : 2 + 2 * num_formats : 2],
        lost=lost,
        err=err,
        ref_norm=ref_norm,
        ref_max=_floats_from_bits([r.maxima[2] for r in records]),
        hist=column([r.hist for r in records]),
        first=column([r.first for r in records], jnp.int32),
    )


def _min_bits(below_inf: list[Any]) -> list[Any] | Any:
    """``inf - bits``: the smallest nonzero magnitude from its `_measure` encoding."""
    if {jnp.dtype(b.dtype) for b in below_inf} == {np.dtype(np.uint32)}:
        return [np.asarray(_F32.inf_bits, np.uint32) - jnp.stack(below_inf)]
    return [
        np.asarray((_F64 if jnp.dtype(b.dtype) == np.uint64 else _F32).inf_bits, b.dtype) - b
        for b in below_inf
    ]


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


def _is_library_file(path: str) -> bool:
    return os.path.realpath(path).startswith(_library_dirs())


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
    loops: tuple[str, ...] = ()


def _meta(eqn: Any, output: int, value: Any, location: interpret.Location) -> _Meta:
    frames = [f for f in location.frames if not _is_library_file(f[0])] or list(location.frames)
    file, line, function = frames[0] if frames else ("", 0, "")
    stack = location.name_stack
    backward = any(kind == "transform" and name == "transpose" for kind, name in stack)
    return _Meta(
        primitive=eqn.primitive.name,
        output=output,
        num_outputs=len(eqn.outvars),
        shape=tuple(int(d) for d in np.shape(value)),
        dtype=jnp.dtype(value.dtype).name,
        module=_module_path(location.name_stack),
        phase="backward" if backward else "forward",
        file=file,
        line=line,
        function=function,
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


@functools.partial(jax.tree_util.register_dataclass, data_fields=["value", "ref"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class _Value:
    """A value under inspection: the program's array and its float32 reference (or None)."""

    value: Any
    ref: Any


@dataclasses.dataclass
class _Frame:
    """The inspector's state in one jaxpr: whether values are finite, known or derivable."""

    finite: dict[Any, Any]  # var -> whether all its values are finite (a traced bool)
    moved: dict[Any, list[tuple[Any, Any]]]  # var -> (var, value) of the values it moves


def _all_finite(x: Any) -> Any:
    if isinstance(x, (np.ndarray, np.generic)):
        return np.bool_(np.all(np.isfinite(x)))
    mag, layout = _magnitude(x)
    return jnp.all(mag < np.asarray(layout.inf_bits, layout.uint_dtype))


def _finite_of(frame: _Frame, pairs: list[tuple[Any, Any]]) -> Any:
    """Whether every value of `pairs` (``(var, value)``) is finite.

    Known for an op's measured output (its NaN and inf counts); for a moved value, from the
    values it moves (finite sources give a finite result); else one reduction, cached.
    """
    flags = []
    for var, x in pairs:
        if isinstance(var, compat.Literal):
            flags.append(_all_finite(x))
            continue
        if var not in frame.finite:
            sources = frame.moved.get(var)
            frame.finite[var] = _all_finite(x) if sources is None else _finite_of(frame, sources)
        flags.append(frame.finite[var])
    return functools.reduce(jnp.logical_and, flags, jnp.bool_(True))


class _InspectRules(interpret.Rules):
    emits = True
    keep_custom_rules = False

    def __init__(self, formats: tuple[str, ...], reference: bool):
        self.formats = formats
        self.reference = reference

    def input(self, x: Any) -> _Value:
        return _Value(x, _widen(x) if self.reference and _is_float(x) else None)

    def literal(self, value: Any) -> _Value:
        return self.input(value)

    def value(self, v: _Value) -> Any:
        return v.value

    def start(self, jaxpr: Any) -> _Frame:
        del jaxpr
        return _Frame({}, {})

    def apply(
        self, frame: _Frame, index: int, eqn: Any, vals: list[_Value], interp: Any
    ) -> list[_Value]:
        del index
        if compat.has_subjaxprs(eqn.params):
            outs = interp.higher_order(eqn, vals)
            if outs is not NotImplemented:
                return outs
        values = [v.value for v in vals]
        outs = compat.bind(eqn, values)
        refs = self._references(eqn, vals, outs) if self.reference else [None] * len(outs)
        measured = eqn.primitive.name not in MOVEMENT_OPS
        inputs_finite = None
        results = []
        for k, (var, out, ref) in enumerate(zip(eqn.outvars, outs, refs, strict=True)):
            results.append(_Value(out, ref))
            if not _is_float(out) or isinstance(var, compat.DropVar):
                continue
            if not measured:
                # Moved values are finite if their sources are (asked only when needed).
                frame.moved[var] = [
                    (v, x) for v, x in zip(eqn.invars, values, strict=True) if _is_float(x)
                ]
                continue
            if inputs_finite is None:
                inputs_finite = self._inputs_finite(frame, eqn, values)
            record = _measure(out, ref, inputs_finite, interp.tick(), self.formats)
            interp.emit(_meta(eqn, k, out, interp.location(eqn)), record)
            n = len(self.formats)
            frame.finite[var] = (record.counts[1 + 2 * n] + record.counts[2 + 2 * n]) == 0
        return results

    def _inputs_finite(self, frame: _Frame, eqn: Any, values: list[Any]) -> Any:
        pairs = [(v, x) for v, x in zip(eqn.invars, values, strict=True) if _is_float(x)]
        return _finite_of(frame, pairs)

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

    def fix(self, vals: list[_Value], like: list[_Value]) -> list[_Value]:
        fixed = []
        for v, s in zip(vals, like, strict=True):
            ref = None
            if s.ref is not None:
                ref = v.ref if v.ref is not None else _widen(v.value)
                ref = interpret._cast_like(ref, s.ref)
            fixed.append(_Value(v.value, ref))
        return fixed

    def empty(self, struct: Any) -> _Record:
        return _empty_record(struct)

    def combine(self, a: _Record, b: _Record) -> _Record:
        return _combine(a, b)

    def in_loop(self, meta: _Meta, kind: str, detail: str) -> _Meta:
        return dataclasses.replace(meta, loops=(f"{kind} ({detail})", *meta.loops))


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
        it differentiates).
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
      created_nonfinite: whether a call made a NaN or inf from finite inputs.
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
    """

    loss_scale: float
    underflow: float
    current_underflow: float
    max_abs: float
    margin: float
    format: str
    rows: int

    def __str__(self) -> str:
        return (
            f"loss scale {_power_of_two(self.loss_scale)}: {_percent(self.underflow)} of the "
            f"nonzero backward values flush to zero in {self.format} "
            f"(at the inspected scale: {_percent(self.current_underflow)}); largest backward "
            f"value {self.max_abs:.3g} at the inspected scale, margin {self.margin:g}"
        )


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
    data_fields=["stats"],
    meta_fields=["metas", "formats", "reference"],
)
@dataclasses.dataclass(frozen=True)
class Report:
    """What `inspect` measured: one row per floating-point op output, in program order.

    A pytree: its statistics are arrays (stacked over the rows) and everything else is
    static, so a jitted function can return it. Reading it (`rows`, ``str``, `to_json`,
    `plot`) copies the arrays to the host once.

    Attributes:
      stats: the rows' statistics, arrays with a leading axis over the rows.
      metas: the rows' static part (op, location, shape, dtype, loops).
      formats: the formats measured against.
      reference: whether the rows were compared with a float32 evaluation of the program.
    """

    stats: Stats
    metas: tuple[_Meta, ...]
    formats: tuple[str, ...]
    reference: bool

    def __len__(self) -> int:
        return len(self.metas)

    @functools.cached_property
    def rows(self) -> list[OpStats]:
        """The rows as `OpStats`, in program order."""
        host = jax.tree.map(np.asarray, jax.device_get(self.stats))
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
                    created_nonfinite=int(host.first[i]) != _NEVER,
                    histogram=np.asarray(host.hist[i]),
                )
            )
        return rows

    @functools.cached_property
    def _first_clock(self) -> np.ndarray:
        return np.asarray(jax.device_get(self.stats.first))

    @property
    def first_nonfinite(self) -> OpStats | None:
        """The first op, in execution order, to make a NaN or inf from finite inputs.

        Where the NaN came from: the op `jax_debug_nans` (or ``jax_debug_infs``, for an
        overflow to inf) names. Inside a loop, execution order counts iterations: an op that
        went non-finite in iteration 3 comes before one that did in iteration 5, whatever
        their order in the loop body. None if every value is finite.
        """
        first = self._first_clock
        if not len(first) or int(first.min()) == _NEVER:
            return None
        return self.rows[int(np.argmin(first))]

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
        """
        return [
            r
            for r in self.rows
            if (primitive is None or r.primitive == primitive)
            and (module is None or r.module == module)
            and (phase is None or r.phase == phase)
            and (line is None or r.line == line)
        ]

    def suggest_loss_scale(
        self, loss_scale: float = 1.0, *, margin: float = 2.0, format: str = "float16"
    ) -> LossScaleSuggestion:
        """The largest power-of-two loss scale keeping the backward pass inside `format`.

        The backward values considered are those the program stores in `format` when it
        computes in it (the mixed-precision program's float16 gradients), else all of them
        (a float32 program asking what float16 would need). Their largest float32-reference
        magnitude, rescaled from `loss_scale` to the candidate scale and times `margin`, must
        stay at most the format's largest finite value. The underflow left is read from the
        exponent histograms: the values below 2^-25 after scaling (those round to zero in
        float16; in general, below half the format's smallest subnormal).

        Args:
          loss_scale: the loss scale the inspected gradients were computed with (the current
            scale of a dynamic loss scale; 1 for a plain `jax.grad`).
          margin: headroom factor, at least 1 (2: one binade below overflow).
          format: the format whose range to keep (float16 by default).

        Returns:
          A `LossScaleSuggestion`.

        Raises:
          ValueError: for a non-positive `loss_scale`, a `margin` below 1, a non-floating
            `format`, a report without a backward pass (inspect a `jax.grad` or
            `jax.value_and_grad` function) or whose backward values are all zero.
        """
        if not (isinstance(loss_scale, (int, float)) and loss_scale > 0):
            raise ValueError(f"`loss_scale` must be a positive number, got {loss_scale!r}.")
        if not (isinstance(margin, (int, float)) and margin >= 1):
            raise ValueError(f"`margin` must be a number of at least 1, got {margin!r}.")
        (fmt,) = _check_formats([format])
        backward = [r for r in self.rows if r.phase == "backward"]
        if not backward:
            raise ValueError(
                "The report has no backward pass: inspect a `jax.grad` or "
                "`jax.value_and_grad` function (or `jaxmp.value_and_grad`) to get one."
            )
        stored = [r for r in backward if r.dtype == fmt]
        rows = stored or backward
        max_abs = max(r.ref_max_abs for r in rows)
        if not max_abs > 0:
            raise ValueError("Every backward value is zero: any loss scale keeps them in range.")
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
            loss_scale=float(loss_scale) * 2.0**shift,
            underflow=flushed(shift),
            current_underflow=flushed(0),
            max_abs=max_abs,
            margin=float(margin),
            format=fmt,
            rows=len(rows),
        )

    # -- Reading.

    def _severity(self, row: OpStats) -> tuple[Any, ...]:
        fmt = self.formats[0]
        return (
            row.created_nonfinite,
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

    def table(self, limit: int | None = 40) -> str:
        """A readable table: the `limit` worst rows, grouped by module.

        Rows rank by, in order: made a non-finite value from finite inputs; holds NaN or inf;
        overflow fraction in the first format; fraction lost to underflow; flush fraction
        in the first format; relative error. Modules appear in the order of their worst row.
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
        ]
        first = self.first_nonfinite
        if first is None:
            lines.append("first non-finite value: none (every value is finite)")
        else:
            lines.append(
                f"first non-finite value: {first.op} ({first.phase}) at {first.location} "
                f"in {first.module or '(no module)'}"
            )
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
                    r.op + ("!" if r.created_nonfinite else ""),
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
        if limit is not None and len(self.rows) > len(rows):
            lines.append(
                f"({len(rows)} worst of {len(self.rows)} rows; report.table(limit=None) lists "
                "all; ! marks an op that made a non-finite value from finite inputs)"
            )
        else:
            lines.append("(! marks an op that made a non-finite value from finite inputs)")
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
            "exponent_range": [EXPONENT_MIN, EXPONENT_MAX],
            "first_nonfinite": None if first is None else first.index,
            "rows": [r.to_dict() for r in self.rows],
        }

    def to_json(self, indent: int | None = None) -> str:
        """The report as JSON: formats, ``first_nonfinite`` (a row index) and the rows.

        Non-finite numbers are written as null; a histogram as ``{"exponent_min", "counts"}``
        over its nonzero range.
        """
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def plot(self, path: str | os.PathLike[str] | None = None, **kwargs: Any) -> Any:
        """Per-module histograms of value exponents against each format's range (a Figure).

        The figure of Micikevicius et al. (2018), "Mixed Precision Training", for every
        module: how the values' binary exponents spread (forward values left, backward
        values right), against the range each format represents (normal and subnormal).
        Needs matplotlib (``pip install matplotlib``, or the ``examples`` extra).

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
    records: list[tuple[_Meta, _Record]], formats: tuple[str, ...], reference: bool
) -> Report:
    metas = tuple(m for m, _ in records)
    stats = _stats([r for _, r in records], len(formats), reference)
    return Report(stats=stats, metas=metas, formats=formats, reference=reference)


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
    """

    def __init__(
        self,
        fun: Callable[..., Any],
        policy: policy_lib.Policy | None,
        formats: tuple[str, ...],
    ):
        functools.update_wrapper(self, fun, updated=())
        self._fun = fun
        self.policy = policy
        self.formats = formats
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
        traced = interpret.trace_call(
            self._program, graph, spec, dynamic, before_call=_name_nnx_modules if graph else None
        )
        closed = traced.closed
        reference = self.policy is not None or _computes_in_low_precision(closed.jaxpr)
        rules = _InspectRules(self.formats, reference)
        interp = interpret.Interpreter(rules)
        values = interp.eval_jaxpr(closed.jaxpr, closed.consts, [rules.input(x) for x in dynamic])
        outs = jax.tree.unflatten(traced.out_tree, [v.value for v in values])
        return outs, _make_report(interp.records, self.formats, reference)

    def __repr__(self) -> str:
        name = getattr(self._fun, "__name__", repr(self._fun))
        return f"jaxmp.inspect({name}, {self.policy!r}, formats={list(self.formats)})"


def inspect(
    fun: Callable[..., Any],
    policy: policy_lib.Policy | str | None = None,
    *,
    formats: Sequence[str] = DEFAULT_FORMATS,
) -> Inspect:
    """Measures every floating-point op of `fun`: range, underflow, overflow and error.

    The returned function has `fun`'s signature and returns ``(outputs, report)``: `fun`'s
    outputs, computed as `fun` computes them, and a `Report` with one row per floating-point
    op output in program order: the forward pass, and when `fun` is a `jax.grad` or
    `jax.value_and_grad` function (or `jaxmp.value_and_grad`, `nnx.grad`) the backward pass,
    which is then part of the program. Rows go through ``jit``, ``scan``, ``while``,
    ``cond``, ``checkpoint`` and custom derivative rules; ops inside loops have one row
    aggregated over the iterations. Ops that only move values (reshape, transpose, slice,
    broadcast, select; `MOVEMENT_OPS`) have no row.

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

    Args:
      fun: the function to inspect.
      policy: None to inspect `fun` as written, or a `jaxmp.Policy` or policy string: the
        function then runs under ``jaxmp.autocast(fun, policy)`` and that program is
        inspected.
      formats: the floating formats to measure against (dtype names: ``"float16"``,
        ``"bfloat16"``, ``"float8_e4m3fn"``, ``"float8_e5m2"``...). The first one ranks the
        rows of the table.

    Returns:
      An `Inspect`: a function with `fun`'s signature returning ``(outputs, report)``.

    Raises:
      TypeError: if `fun` is not callable, `policy` is not a policy, string or None, or
        `formats` is not a sequence of names.
      ValueError: for an invalid policy string, or a format that is not a floating dtype.

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
    return Inspect(fun, policy, _check_formats(formats))
