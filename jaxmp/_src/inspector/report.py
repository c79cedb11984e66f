"""What `jaxmp.inspect` returns: the `Report`, its rows (`OpStats`), the sources of NaN and
inf, and the loss scale the backward pass allows; read as a table, JSON, or a figure.

The figure (`Report.plot`) is drawn by `jaxmp._src.inspector.plot`, which registers itself
here (`register_figure`): the report never imports it, and matplotlib is imported only when
a figure is made.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import ml_dtypes
import numpy as np
from jax.typing import ArrayLike

from jaxmp._src import compat, display
from jaxmp._src import loss_scale as loss_scale_lib
from jaxmp._src.inspector import stats as stats_lib

# The types of `Report`'s fields, by the names its signature shows.
from jaxmp._src.inspector.locations import _Meta, _Origin
from jaxmp._src.inspector.stats import Stats

# Draws `Report.plot`'s figure: ``figure(report, path, **kwargs)``, registered by
# `jaxmp._src.inspector.plot` (which depends on the report, never the other way).
_figure: Callable[..., Any] | None = None


def register_figure(figure: Callable[..., Any]) -> None:
    """Makes `Report.plot` draw with ``figure(report, path, **kwargs)``."""
    global _figure
    _figure = figure


@dataclasses.dataclass(frozen=True)
class OpStats:
    """One row of a `Report`: an op output's statistics, host side.

    Attributes:
      index: the row's position in program order.
      primitive: the JAX primitive (``exp``, ``dot_general``, ``convert_element_type``...).
      module: the module path (Flax module names, `jax.named_scope` names), "" if none.
      phase: ``"forward"``, or ``"backward"`` for an op of a derivative (transposed by
        `jax.grad`, `jax.value_and_grad`, `jax.vjp`).
      file: the file of the user's code that made the op (for a backward op, of the line
        it differentiates); for an op of jaxmp's code, of the user's line calling into
        jaxmp (the user's call of the inspected function if none).
      line: that code's line number.
      function: the function holding that line.
      library: ``"jaxmp"`` for an op of jaxmp's machinery around the model (the loss
        scale's multiply in `jaxmp.value_and_grad`, the optimizer wrappers, autocast's casts
        of the outputs) however the user's code calls it, else ``""``. Such rows rank after
        the user's, and the figure and `Report.suggest_loss_scale` leave them out.
      shape: the output's shape, as the program computes it.
      dtype: the output's dtype, as the program computes it.
      output: the output's index among the op's outputs.
      loops: the loops and branches around the op, outermost first (``"scan (8
        iterations)"``, ``"while (body)"``, ``"cond (branch 1 of 2)"``).
      calls: times the op ran (iterations of its loops; 0 in a branch never taken).
      max_abs: max ``|x|`` over the finite values the op produced (0 if none).
      min_abs: the smallest nonzero ``|x|`` (None if all are zero or non-finite).
      nan: the count of NaN values over all calls.
      inf: the count of infinite values over all calls.
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
                        "exponent_min": stats_lib.EXPONENT_MIN + lo,
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
      shape: the value's shape.
      dtype: the value's dtype.
      nan: its count of NaN values (over all calls, inside a loop).
      inf: its count of infinite values (over all calls, inside a loop).
      primitive: the primitive of the op that made the constant, or of the first op
        reading it; ``""`` for an argument.
      module: that op's module path; ``""`` for an argument.
      phase: that op's phase, as in `OpStats`; ``"forward"`` for an argument.
      file: the file of that op's line; for an argument, of the user's call of the
        inspected function.
      line: that line's number.
      function: the function holding that line.
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
                    created_nonfinite=int(host.first[i]) != stats_lib._NEVER,
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
            if len(clocks) and int(clocks.min()) != stats_lib._NEVER:
                return self.rows[int(np.argmin(clocks))]
        return None

    @property
    def nonfinite_sources(self) -> list[NonfiniteSource]:
        """The NaN and inf the program did not compute, in program order.

        The arguments holding NaN or inf, and the constants that do and that an op read with
        otherwise finite inputs (a ``-jnp.inf`` mask in ``jnp.where``; ``1e5`` rounded to inf
        in float16), also where that op made a NaN of it (``0 * inf``): where
        `first_nonfinite`'s NaN may have started.
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
        (fmt,) = stats_lib._check_formats([format])
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
        info = ml_dtypes.finfo(stats_lib._format_dtype(fmt))
        limit = float(info.max)
        shift = math.floor(math.log2(limit / (max_abs * margin)))
        while max_abs * margin * 2.0**shift > limit:  # log2 rounding at the edge
            shift -= 1
        hist = np.sum([r.histogram for r in rows], axis=0)
        total = max(int(hist.sum()), 1)
        # Values below half the smallest subnormal round to zero: exponent < log2(tiny) - 1.
        lowest = int(round(math.log2(float(info.smallest_subnormal)))) - 1
        exponents = np.arange(stats_lib.EXPONENT_MIN, stats_lib.EXPONENT_MAX + 1)

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

    def _nonfinite_lines(self, sources_limit: int | None = None) -> list[str]:
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
            listed = "; ".join(str(s) for s in sources[:sources_limit])
            if sources_limit is not None and len(sources) > sources_limit:
                listed += f"; and {len(sources) - sources_limit} more (report.nonfinite_sources)"
            lines.append("non-finite inputs: " + listed)
        return lines

    def _summary(self) -> str:
        n_fwd = sum(r.phase == "forward" for r in self.rows)
        return (
            f"jaxmp.inspect: {len(self.rows)} ops ({n_fwd} forward, "
            f"{len(self.rows) - n_fwd} backward)"
            + (
                "; reference: the program evaluated in float32"
                if self.reference
                else "; no float32 reference (the program computes in float32 or wider)"
            )
            + (f"; sampled: {self.sampling}" if self.sampling else "")
        )

    def _legend(self) -> str:
        return (
            "per format: % of nonzero values that would flush to zero / overflow if stored "
            "in it" + ("; lost: % of nonzero values zero in the program" if self.reference else "")
        )

    def _header(self) -> list[str]:
        header = ["#", "op", "pass", "at", "value", "max|x|", "min|x|>0", "nan", "inf"]
        header += [f"{stats_lib._short(f)} flush/over" for f in self.formats]
        if self.reference:
            header += ["lost", "rel.err"]
        return header + ["loop"]

    def _cells(self, r: OpStats) -> list[str]:
        cells = [
            str(r.index),
            r.op + ("!" if r.created_nonfinite else "") + (f" [{r.library}]" if r.library else ""),
            "bwd" if r.phase == "backward" else "fwd",
            r.location,
            f"{stats_lib._short(r.dtype)}[{','.join(map(str, r.shape))}]",
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
        return cells + [loops]

    def _marks(self, rows: list[OpStats]) -> str:
        legend = "! marks an op that made a non-finite value from finite inputs"
        if any(r.library for r in rows):
            legend += "; [jaxmp] an op of jaxmp's own code, at the user's call"
        return legend

    def table(self, limit: int | None = 40) -> str:
        """A readable table: the `limit` worst rows, grouped by module.

        Rows rank by, in order: made a non-finite value from finite inputs; the user's code
        before jaxmp's own (marked ``[jaxmp]``); holds NaN or inf; overflow fraction in the
        first format; fraction lost to underflow; flush fraction in the first format;
        relative error. Modules appear in the order of their worst row.
        """
        rows = self.worst(limit)
        lines = [self._summary(), *self._nonfinite_lines(), self._legend()]
        header = self._header()
        groups: dict[str, list[OpStats]] = {}
        for row in rows:
            groups.setdefault(row.module, []).append(row)
        table: list[list[str]] = []
        for module, members in groups.items():
            table.append([f"module {module or '(no module)'}"])
            table += [self._cells(r) for r in members]
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
        legend = self._marks(rows)
        if limit is not None and len(self.rows) > len(rows):
            lines.append(
                f"({len(rows)} worst of {len(self.rows)} rows; report.table(limit=None) lists "
                f"all; {legend})"
            )
        else:
            lines.append(f"({legend})")
        return "\n".join(line.rstrip() for line in lines)

    def _suggestion_line(self) -> str:
        try:
            suggestion = self.suggest_loss_scale()
        except ValueError as e:
            if not any(r.phase == "backward" for r in self.rows):
                return "no backward pass: no loss scale to suggest"
            return f"no loss scale to suggest: {e}"
        scale = display.power_of_two(suggestion.loss_scale)
        return (
            f"suggested loss scale: {scale} for gradients computed at scale 1 (jax.grad), "
            f"else {scale} x their scale (report.suggest_loss_scale(loss_scale)); "
            f"{_percent(suggestion.underflow)} of the nonzero backward values flush to zero in "
            f"{suggestion.format} there"
        )

    def _concrete(self) -> bool:
        return display.concrete((self.stats, self.source_counts))

    def _repr_html_(self, figure: bool = True) -> str | None:
        """The report in a notebook: its header (the first non-finite value, the suggested
        loss scale), the `display.MAX_ROWS` worst rows as a table, and the figure (`plot`);
        None for a report holding no values (traced, or from `jax.eval_shape`)."""
        if not self._concrete():
            return None
        rows = self.worst(display.MAX_ROWS)
        header = self._header()
        cells = [
            [c[0], r.module or "(no module)", *c[1:]]
            for r, c in ((r, self._cells(r)) for r in rows)
        ]
        more = ""
        if len(self.rows) > len(rows):
            more = (
                f"{len(rows)} worst of {len(self.rows)} rows shown; "
                "report.table(limit=None) lists all"
            )
        text = display.html_table(
            [header[0], "module", *header[1:]],
            cells,
            title=self._summary(),
            notes=[
                *self._nonfinite_lines(sources_limit=5),
                self._suggestion_line(),
                self._legend(),
            ],
            after=[
                more,
                self._marks(rows),
            ],
        )
        if not figure or not self.rows:
            return text
        try:
            image = display.figure_html(self.plot(), alt="exponent histograms per module")
        except ImportError as e:
            image = f"<p>{display.escape(f'figure: {e}')}</p>"
        return text.removesuffix("</div>") + image + "\n</div>"

    def __str__(self) -> str:
        return self.table()

    _repr_pretty_ = display.pretty(table)

    def __repr__(self) -> str:
        return f"<jaxmp.inspect Report: {len(self.metas)} rows, formats {list(self.formats)}>"

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON values (see `to_json`)."""
        first = self.first_nonfinite
        return {
            "formats": list(self.formats),
            "reference": self.reference,
            "sampling": self.sampling,
            "exponent_range": [stats_lib.EXPONENT_MIN, stats_lib.EXPONENT_MAX],
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
        if _figure is None:  # registered when `jaxmp._src.inspector` is imported
            raise ImportError("`Report.plot` needs `jaxmp._src.inspector.plot` imported.")
        return _figure(self, path, **kwargs)


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
