"""The inspector's rule set over the re-interpretation core (`jaxmp._src.interpret`).

Every equation is re-bound exactly as traced; each floating output is a row, measured with
the others of its body when the body ends (`jaxmp._src.inspector.stats`), and carries a
float32 reference evaluated along the program when it computes in lower precision. Values
that depend on no argument (constants) are computed once while tracing and measured then,
with numpy. Where each NaN or inf came from is decided from the counts: for each row, whether
its inputs held any (the rows and checks its inputs are, the constants known while tracing),
and the arguments and the constants holding some are the report's sources
(`Report.nonfinite_sources`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmp._src import autocast_rules, compat, interpret
from jaxmp._src.inspector import locations
from jaxmp._src.inspector import stats as stats_lib

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
    "reshard",
}

# The reference of these outputs is the program's value itself: their parameters pin the
# dtypes of their operands (scatter combiners, bit casts, callbacks) or they hold sub-jaxprs.
_AS_VALUE_OPS = autocast_rules.AS_TRACED_OPS


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
    meta: locations._Meta | None = None  # a row's static part (None: a check)
    seq: int = 0  # a row's position in program order
    clock: Any = None
    deps: tuple[_Entry, ...] = ()
    known: _Known = _FINITE
    origin: locations._Origin | None = None  # a check counting an argument or a constant
    result: tuple[Any, Any, int] | None = None  # (has NaN, has NaN or inf, index) once measured
    # A constant's row, measured while tracing: its statistics, and whether it made a NaN or
    # inf, held one read from (or made out of) a non-finite constant input, held one.
    host: stats_lib._Group | None = None
    made: bool = False
    from_constant: bool = False
    held: bool = False


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
    origin: locations._Origin | None = None  # for a constant: the source it is reported as
    row: bool = False  # for a constant: its NaN or inf were made by an op with a row


# A pytree of its two arrays; the rest is dropped when it is flattened (a loop or branch body
# starts over). Registered by hand: `register_dataclass(drop_fields=...)` rejects named
# fields on the oldest jax supported (0.8.2).
jax.tree_util.register_pytree_node(
    _Value,
    lambda v: ((v.value, v.ref), None),
    lambda _, children: _Value(*children),
)


@dataclasses.dataclass
class _Pending:
    """The entries of a body not measured yet."""

    entries: list[_Entry] = dataclasses.field(default_factory=list)
    nbytes: int = 0
    # Non-finite constants known while tracing, and the rows reading them.
    known_sources: dict[locations._Origin, list[_Entry]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class _RowMeta:
    seq: int
    meta: locations._Meta
    group: int
    position: int


@dataclasses.dataclass(frozen=True)
class _BatchMeta:
    """The static part of a `_Batch`: its rows (in program order) and sources."""

    rows: tuple[_RowMeta, ...]
    groups: tuple[tuple[str, str], ...]  # the bit dtypes (value, reference) of each group
    sources: tuple[locations._Origin, ...]


# Bytes of values waiting to be measured together above which they are measured: each is
# kept alive until then.
_PENDING_BYTES = 1 << 28
# Rows are measured together by size (`_size_groups`): the rows of a shorter size join the
# group of a longer one, padded with zeros to its size, while the group's padding stays at
# most this many values or a thirty-second of its own. A group is a dozen kernels for XLA to
# compile, and a model has hundreds of rows of a few sizes.
_PAD_VALUES = 1 << 20


def _placement(x: Any) -> Any:
    """A key equal for values that can be stacked without moving data between devices."""
    explicit = compat.explicit_sharding(x)
    if explicit is not None:  # measured on each device's block: any shape
        return ("explicit", explicit)
    group = compat.sharding_group(x)
    try:
        hash(group)
    except TypeError:
        return str(group)
    return group


def _local(placement: Any) -> bool:
    """Whether values of `placement` are measured where they are (one device, or each
    device's block of a value sharded over ``Explicit`` axes)."""
    return placement is None or (isinstance(placement, tuple) and placement[0] == "explicit")


def _size_groups(entries: list[_Entry], pad: bool = True) -> list[list[_Entry]]:
    """`entries` in groups measured together: by size, from the longest rows down, the rows
    of each size joining the group before (padded with zeros to its longest) while the
    group's padding, all sizes together, stays at most `_PAD_VALUES` values or a
    thirty-second of the group's own values. Without `pad` (sharded rows: zeros would not
    share their sharding), rows of one size only."""
    by_size: dict[int, list[_Entry]] = {}
    for e in entries:
        by_size.setdefault(int(np.size(e.value)), []).append(e)
    groups: list[list[_Entry]] = []
    longest = values = padded = 0
    for size in sorted(by_size, reverse=True):
        members = by_size[size]
        own = size * len(members)
        padding = padded + (longest - size) * len(members)
        if pad and groups and padding <= max((values + own) // 32, _PAD_VALUES):
            groups[-1] += members
            values += own
            padded = padding
        else:
            groups.append(list(members))
            longest, values, padded = size, own, 0
    return groups


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
        self._counted: set[locations._Origin] = set()  # sources counted on device

    # -- Values.

    def argument(self, x: Any, name: str) -> _Value:
        """An argument of the inspected function (`name`: its path); counted as a source."""
        v = _Value(x, _widen(x) if self.reference and _is_float(x) else None)
        if _is_float(x):
            origin = locations._origin("argument", name, x, None, None, self.caller)
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
        # A value held as unsummed parts on the devices is measured as the sum they make.
        entry.value = compat.summed(entry.value)
        if entry.ref is not None:
            entry.ref = compat.summed(entry.ref)
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
                self.constants[locations._phase(interp.location(eqn))] += 1
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
            self._origin_of(v, eqn, interp)

    def _host_row(
        self, meta: locations._Meta, v: _Value, vals: list[_Value], eqn: Any, interp: Any
    ) -> _Entry:
        """The row of a constant computed while tracing: measured with numpy, now."""
        known: list[tuple[_Known, locations._Origin | None]] = []
        self._inputs(vals, eqn, interp, {}, known, set())
        group = stats_lib._measure_host(v.value, v.ref, self.formats)
        hist = group.hist.reshape(stats_lib._KINDS, -1)
        out_nan, out_inf = bool(hist[stats_lib._NAN].sum()), bool(hist[stats_lib._INF].sum())
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
            from_constant=(out_nan or out_inf) and in_bad,
            held=out_nan or out_inf,
        )
        self._numbered(entry, known)
        self._pending.entries.append(entry)
        return entry

    def _numbered(
        self, entry: _Entry, known: list[tuple[_Known, locations._Origin | None]]
    ) -> None:
        """Gives `entry` the next row number and records it as reading the non-finite
        constants and arguments in `known`."""
        self._seq += 1
        for _, origin in known:
            if origin is not None:
                self._pending.known_sources.setdefault(origin, []).append(entry)

    def _origin_of(self, v: _Value, eqn: Any, interp: Any) -> locations._Origin:
        """`v`'s origin; a literal or closed-over array is named by `eqn`, its first reader."""
        if v.origin is None:
            v.origin = locations._origin(
                "constant", locations._constant_name(v.value), v.value, eqn, interp, self.caller
            )
        return v.origin

    def _sampled(self, eqn: Any, output: int, value: Any, interp: Any) -> locations._Meta | None:
        """The row's static part, or None if sampling leaves it out."""
        meta = locations._meta(eqn, output, value, interp.location(eqn), self.caller)
        if self.modules is not None and not self.modules.search(meta.module):
            return None
        self._seen += 1
        return meta if (self._seen - 1) % self.every == 0 else None

    def _row(
        self, meta: locations._Meta, v: _Value, vals: list[_Value], eqn: Any, interp: Any
    ) -> _Entry:
        deps: dict[int, _Entry] = {}
        known: list[tuple[_Known, locations._Origin | None]] = []
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
        self._numbered(entry, known)
        return self._add(entry, interp)

    def _inputs(
        self,
        vals: Iterable[_Value],
        eqn: Any,
        interp: Any,
        deps: dict[int, _Entry],
        known: list[tuple[_Known, locations._Origin | None]],
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

        Rows of one dtype and of nearby sizes are measured together (`_size_groups`,
        `_measure`): XLA compiles one set of kernels per group, not one per row, and an
        inspected program has hundreds of rows of a few sizes. Then whether each row made a
        NaN or inf its inputs did not hold.
        """
        pending, self._pending = self._pending, _Pending()
        if not pending.entries:
            return
        device = [e for e in pending.entries if e.meta is not None and e.host is None]
        host = [e for e in pending.entries if e.host is not None]
        checks = [e for e in pending.entries if e.meta is None]
        rows = device + host
        # Grouped by the float dtypes they are measured in (float16 and bfloat16 widened to
        # float32, exactly), where they live (stacking values of two shardings would move
        # them between devices: `compat.sharding_group`), then by size (`_size_groups`).
        device_groups: dict[Any, list[_Entry]] = {}
        for e in device:
            key = (
                stats_lib._layout(e.value.dtype),
                None if e.ref is None else stats_lib._layout(e.ref.dtype),
            )
            place = (_placement(e.value), None if e.ref is None else _placement(e.ref))
            device_groups.setdefault((*key, place), []).append(e)
        host_groups: dict[Any, list[_Entry]] = {}
        for e in host:
            assert e.host is not None
            key = (e.host.maxima[0].dtype.name, e.host.maxima[2].dtype.name)
            host_groups.setdefault(key, []).append(e)
        check_groups: dict[Any, list[_Entry]] = {}
        for e in checks:
            check_key = (stats_lib._layout(e.value.dtype), _placement(e.value))
            check_groups.setdefault(check_key, []).append(e)

        def stacked(xs: list[Any]) -> Any:
            # Padded with zeros, which change no statistic (no count, extreme or norm); one
            # concatenation (a pad per row is a kernel per row).
            n = max(int(np.size(x)) for x in xs)
            dtype = stats_lib._layout(xs[0].dtype).float_dtype
            parts = []
            for x in xs:
                parts.append(lax.convert_element_type(jnp.ravel(x), dtype))
                if np.size(x) < n:
                    parts.append(jnp.zeros((n - int(np.size(x)),), dtype))
            return lax.concatenate(parts, 0).reshape(len(xs), n)

        groups: list[stats_lib._Group] = []
        positions: dict[int, tuple[int, int]] = {}  # row -> (group, position in it)
        order: list[_Entry] = []  # the entries measured on device, in the order of `nan`
        nans, infs = [], []
        # Rows on one device, and rows sharded over `Explicit` mesh axes (measured block by
        # block on their devices: `compat.per_shard`), are padded to nearby sizes and reduced
        # in one pass (a variadic reduction). Other sharded rows are not: XLA's partitioner
        # would gather them for it.
        sized = [
            (ref_dtype, local, members)
            for (_, ref_dtype, place), entries in device_groups.items()
            for local in [all(_local(p) for p in place)]
            for members in _size_groups(entries, pad=local)
        ]

        def measure(one_pass: bool, axes: tuple[str, ...], values: list[Any], refs: Any) -> Any:
            ref = None if refs is None else stacked(refs)
            group = stats_lib._measure(stacked(values), ref, self.formats, one_pass, axes)
            kinds = stats_lib._kinds(group.hist)
            return group, kinds[:, stats_lib._NAN], kinds[:, stats_lib._INF]

        for ref_dtype, one_pass, members in sized:
            group, nan, inf = compat.per_shard(
                functools.partial(measure, one_pass),
                [e.value for e in members],
                None if ref_dtype is None else [e.ref for e in members],
            )
            nans.append(nan)
            infs.append(inf)
            positions.update({id(e): (len(groups), p) for p, e in enumerate(members)})
            groups.append(group)
            order += members
        for members in host_groups.values():
            parts = [e.host for e in members if e.host is not None]
            group = jax.tree.map(lambda *xs: np.concatenate(xs), *parts)
            positions.update({id(e): (len(groups), p) for p, e in enumerate(members)})
            groups.append(group)

        def count(axes: tuple[str, ...], values: list[Any]) -> Any:
            counts = stats_lib._nonfinite_counts(stacked(values))
            return tuple(lax.psum(c, axes) if axes else c for c in counts)

        for (_, place), entries in check_groups.items():
            for members in _size_groups(entries, pad=_local(place)):
                nan, inf = compat.per_shard(count, [e.value for e in members])
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
            never = np.int32(stats_lib._NEVER)
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
        record = stats_lib._Batch(
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
        whether a non-finite constant input made it hold one: its other inputs were finite
        (a NaN the row made from the constant, ``0 * inf``, counts: the inf started it).

        Whether the inputs of each row held NaN, or NaN or inf, is a gather of the flags of
        the entries its inputs are (of this batch, or of an earlier one).
        """
        if not rows:
            empty = jnp.zeros((0,), jnp.int32)
            return empty, empty, jnp.zeros((0,), bool)
        # The flags of inputs measured in earlier batches: one gather from each batch's.
        earlier: dict[int, tuple[Any, Any, dict[int, int]]] = {}  # flags, and index -> slot
        for e in rows:
            for d in e.deps:
                assert d.result is not None
                d_nan, d_bad, i = d.result
                if d_nan is not has_nan:
                    slots = earlier.setdefault(id(d_nan), (d_nan, d_bad, {}))[2]
                    slots.setdefault(i, len(slots))
        offsets: dict[int, int] = {}
        start = len(order)
        for key, (_, _, slots) in earlier.items():
            offsets[key] = start
            start += len(slots)
        table = []
        for e in rows:
            positions = []
            for d in e.deps:
                assert d.result is not None
                d_nan, _, i = d.result
                key = id(d_nan)
                positions.append(i if d_nan is has_nan else offsets[key] + earlier[key][2][i])
            table.append(positions)
        gather = np.full((len(rows), max([len(p) for p in table] + [1])), start, np.int32)
        for r, positions in enumerate(table):
            gather[r, : len(positions)] = positions
        gathered = [
            (f_nan[at], f_bad[at])
            for f_nan, f_bad, slots in earlier.values()
            for at in [np.asarray(list(slots), np.int32)]
        ]
        false = jnp.zeros((1,), bool)
        flags_nan = jnp.concatenate([has_nan, *(n for n, _ in gathered), false])
        flags_bad = jnp.concatenate([bad, *(b for _, b in gathered), false])
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
        first = jnp.where(made, clocks, np.int32(stats_lib._NEVER))
        held = jnp.where(out_bad, clocks, np.int32(stats_lib._NEVER))
        return first, held, out_bad & ~in_bad & known_bad

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

    def empty(self, struct: stats_lib._Batch) -> stats_lib._Batch:
        return stats_lib._empty_batch(struct)

    def combine(self, a: stats_lib._Batch, b: stats_lib._Batch) -> stats_lib._Batch:
        return stats_lib._combine(a, b)

    def in_loop(self, meta: _BatchMeta, kind: str, detail: str) -> _BatchMeta:
        loop = f"{kind} ({detail})"
        rows = tuple(
            dataclasses.replace(r, meta=dataclasses.replace(r.meta, loops=(loop, *r.meta.loops)))
            for r in meta.rows
        )
        return dataclasses.replace(meta, rows=rows)
