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
it ends, then those of one dtype and of nearby sizes are measured together, padded with zeros
to the longest (`rules._size_groups`, `stats._measure`): one scatter counts each value's class
by its reference's bin (`stats._Bins`: every count and the histogram), and a few float
reductions give the extremes and the norms. XLA compiles one set of kernels per group instead
of one per op. Values that depend on no argument (constants) are computed
once while tracing and measured then, with numpy (`stats._measure_host`). Where each NaN or inf
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

The package, one idea a module, each depending only on those before it:

* `stats`: the formats and the bit layouts, the statistics of values measured together
  (on device, or with numpy for constants) and their reductions over loops and rows.
* `locations`: where a row comes from: the module path, the user's ``file:line``, the pass,
  and the arguments and constants a NaN or inf can come from.
* `rules`: the rule set over the re-interpretation core (`jaxmp._src.interpret`): the float32
  reference, the rows, the NaN and inf sources, the values of a body measured together.
* `report`: `Report` and its rows (`OpStats`), the table, JSON, `Report.find` and
  `Report.suggest_loss_scale`.
* `plot`: the figure of `Report.plot`, which registers itself with `report` (the report
  never imports the figure).
* `api`: `inspect` and `Inspect`: trace, evaluate with the rules, make the `Report`.
"""

from jaxmp._src.inspector import plot as _plot  # noqa: F401  (registers `Report.plot`'s figure)
from jaxmp._src.inspector.api import Inspect, inspect
from jaxmp._src.inspector.report import LossScaleSuggestion, NonfiniteSource, OpStats, Report
from jaxmp._src.inspector.rules import MOVEMENT_OPS
from jaxmp._src.inspector.stats import DEFAULT_FORMATS, EXPONENT_MAX, EXPONENT_MIN, Stats

__all__ = [
    "DEFAULT_FORMATS",
    "EXPONENT_MAX",
    "EXPONENT_MIN",
    "MOVEMENT_OPS",
    "Inspect",
    "LossScaleSuggestion",
    "NonfiniteSource",
    "OpStats",
    "Report",
    "Stats",
    "inspect",
]
