"""`jaxmp.inspect`: traces a function, evaluates it with the inspector's rule set over the
re-interpretation core, and makes the `Report` of its measurements."""

from __future__ import annotations

import functools
import logging
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import autocast as autocast_lib
from jaxmp._src import compat, interpret
from jaxmp._src import policy as policy_lib
from jaxmp._src.inspector import locations
from jaxmp._src.inspector import report as report_lib
from jaxmp._src.inspector import rules as rules_lib
from jaxmp._src.inspector import stats as stats_lib

# `inspect`'s line for a large program: Python logging, not `warnings` (a warning would be an
# error in a test suite run with ``filterwarnings = error``). WARNING is the level Python
# shows without any logging set up; ``logging.getLogger("jaxmp.inspect").setLevel("ERROR")``
# silences it.
logger = logging.getLogger("jaxmp.inspect")

# A program measuring more values than this a call gets the line: at the main job's cost on
# CPU (BENCHMARKS.md: about 8.5 ns per measured value), 10M values add about 0.1 s a call.
LARGE_PROGRAM_VALUES = 10_000_000

_SCAN = re.compile(r"scan \((\d+) iterations\)")


def _measured_values(metas: Sequence[locations._Meta]) -> int:
    """The values the rows `metas` measure in one call: a row in a ``scan`` counts each
    iteration (`interpret` names the loop ``"scan (N iterations)"``); a ``while`` loop's
    body, whose iterations are known only when it runs, counts once."""
    total = 0
    for meta in metas:
        iterations = math.prod(int(m[1]) for loop in meta.loops if (m := _SCAN.fullmatch(loop)))
        total += math.prod(meta.shape) * iterations
    return total


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


def _make_report(
    records: list[tuple[rules_lib._BatchMeta, stats_lib._Batch]],
    formats: tuple[str, ...],
    reference: bool,
    sampling: str,
    constants: dict[str, int],
) -> report_lib.Report:
    """The `Report` of the records of a program: its rows' statistics, in program order.

    Every conversion is made once over all rows of one pair of layouts (not one per row: a
    kernel each for XLA to compile), then one gather per statistic puts them in order.
    """
    rows = []  # (seq, meta, group key, index among that key's rows, index among all batches')
    by_key: dict[tuple[str, str], list[stats_lib._Group]] = {}
    sizes: dict[tuple[str, str], int] = {}
    calls, firsts, helds = [], [], []
    sources: dict[locations._Origin, list[Any]] = {}
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
        parts = [stats_lib._group_stats(by_key[k], formats, reference) for k in keys]
        at = np.asarray([offsets[key] + i for _, _, key, i, _ in rows], np.int32)
        stats = stats_lib.Stats(*(jnp.concatenate(field)[at] for field in zip(*parts, strict=True)))
        order = np.asarray([b for *_, b in rows], np.int32)
        stats = stats._replace(
            calls=jnp.concatenate(calls)[order],
            first=jnp.concatenate(firsts)[order],
            held=jnp.concatenate(helds)[order],
        )
    else:
        stats = stats_lib._empty_stats(len(formats))
    source_counts = (
        jnp.stack([functools.reduce(jnp.add, c) for c in sources.values()])
        if sources
        else np.zeros((0, 3), np.int32)
    )
    return report_lib.Report(
        stats=stats,
        source_counts=source_counts,
        metas=tuple(m for _, m, *_ in rows),
        formats=formats,
        reference=reference,
        sources=tuple(sources),
        sampling=sampling,
        constants=tuple(constants.items()),
    )


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

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, report_lib.Report]:
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
        caller = locations._caller()
        # NNX modules merged inside the trace are named by `jaxmp.nnx` (their module paths).
        traced = interpret.trace_call(self._program, graph, spec, dynamic)
        closed = traced.closed
        reference = self.policy is not None or _computes_in_low_precision(closed.jaxpr)
        rules = rules_lib._InspectRules(self.formats, reference, self.every, self.modules, caller)
        interp = interpret.Interpreter(rules)
        with rules.body(interp):  # the top level's values are measured together
            names = _argument_names(spec, graph)
            args = [rules.argument(x, n) for x, n in zip(dynamic, names, strict=True)]
            values = interp.eval_jaxpr(closed.jaxpr, closed.consts, args)
        outs = jax.tree.unflatten(traced.out_tree, [v.value for v in values])
        report = _make_report(
            interp.records, self.formats, reference, self._sampling(), rules.constants
        )
        measured = _measured_values(report.metas)
        if measured > LARGE_PROGRAM_VALUES:
            logger.warning(
                "jaxmp.inspect(%s): measuring %d op output%s, %.1fM values a call; inspected, "
                "a train step ran about 10x as long as plain on CPU: inspect every N steps, "
                "or measure a sample (every=16, modules='regex'). "
                "logging.getLogger('jaxmp.inspect').setLevel('ERROR') silences this line.",
                getattr(self._fun, "__name__", "fun"),
                len(report.metas),
                "" if len(report.metas) == 1 else "s",
                measured / 1e6,
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
    formats: Sequence[str] = stats_lib.DEFAULT_FORMATS,
    every: int = 1,
    modules: str | re.Pattern[str] | None = None,
) -> Inspect:
    """Measures every floating-point op of `fun`: range, underflow, overflow and error.

    The returned function has `fun`'s signature and returns ``(outputs, report)``: `fun`'s
    outputs, computed by `fun`'s ops (the compiler may fuse or order a sum differently where
    the statistics read a value too: the last bits can differ), and a `Report` with one row
    per floating-point op output in program order: the forward pass, and when `fun` is a
    `jax.grad` or `jax.value_and_grad` function (or `jaxmp.value_and_grad`, `nnx.grad`) the
    backward pass, which is then part of the program. Rows go through ``jit``, ``scan``,
    ``while``, ``cond``, ``checkpoint`` and custom derivative rules; ops inside loops have
    one row aggregated over the iterations. Ops that only move values (reshape, transpose,
    slice, broadcast, select; `MOVEMENT_OPS`) have no row. Ops that depend on no argument (on
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
    Outputs of one dtype and of nearby sizes are measured together (padded with zeros to
    the longest: one set of kernels for all of them), so each is kept alive until the end
    of its loop body or jit body, or until 256 MiB of them wait: inspecting adds memory.
    For a larger model, `every` and `modules` measure a sample of the ops. A program that
    measures more than `LARGE_PROGRAM_VALUES` (10 million) values a call says so in one line
    when it is traced: how many op outputs and values (each iteration of a ``scan`` counted),
    logged at WARNING to the ``"jaxmp.inspect"`` logger, not a Python warning
    (``logging.getLogger("jaxmp.inspect").setLevel("ERROR")`` silences it).

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
    return Inspect(fun, policy, stats_lib._check_formats(formats), every, modules)
