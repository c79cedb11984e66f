"""What `jaxmp.inspect` costs inside the main job's jitted train step.

The main job's train step (``examples/lm/steps.py``, config ``mixed_float16``) against the same
step with its loss and gradients computed by ``jaxmp.inspect(jaxmp.value_and_grad(loss_fn))``,
the report returned from the jitted step (the pattern of docs/guides/inspector.md: an
inspected step every N steps, a plain one otherwise). Three measurements:

1. Traces: each step is jitted once and called for every round; a Python counter in the loss
   function counts its traces (one per jitted step is the promise: never once per call).
2. The first call of each jitted step: trace and lower, compile, and one run, each timed (wall
   clock, and the process's CPU time for the compile: on a machine shared with other jobs
   the wall clock of a compile is the more inflated), once each.
3. Step time: both compiled steps run in interleaved rounds (one call of each per round, in
   alternating order), median over the rounds; and what inspecting every N steps adds to the
   mean step time.
4. Where a row's time goes: the statistics of 8 float16 outputs of the size of the main job's
   MLP activations (32 x 64 x 512), measured together as the inspector measures rows of one
   size, per row, against one elementwise add over the same array; and the parts no exact
   histogram avoids: a bin index per value, a scatter of precomputed indices, stacking the
   rows into their group (``--rows-only`` runs only this).

``--every N`` and ``--modules REGEX`` inspect a sample of the ops (`jaxmp.inspect`'s options).
``--no-statistics`` is a diagnostic: every group of rows gets one maximum per row instead of
its statistics (the report's numbers are then meaningless), which measures what the inspected
step costs before any statistic: the program, its float32 reference and the rows kept for
measuring. ``--no-reference``, a second diagnostic, leaves out the float32 reference (the
report then has no relative errors); with both, what is left is each op's output kept and
stacked into its group of rows.

Run from the repository root::

    PYTHONPATH=. python benchmarks/inspect_cost.py            # the main job's model, ~5 min
    PYTHONPATH=. python benchmarks/inspect_cost.py --every 4  # one op output in 4
    PYTHONPATH=. python benchmarks/inspect_cost.py --quick    # a tiny model, 5 rounds
    PYTHONPATH=. python benchmarks/inspect_cost.py --rows-only    # measurement 4, ~10 s
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import _hlo  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import train  # noqa: E402
from lm import config as config_lib  # noqa: E402
from lm import data as data_lib  # noqa: E402

import jaxmp  # noqa: E402
from jaxmp._src.inspector import api as inspector_api  # noqa: E402
from jaxmp._src.inspector import stats as inspector_stats  # noqa: E402

TINY = ("num_layers=1", "num_heads=2", "d_model=32", "mlp_ratio=2", "seq_len=16", "batch_size=8")


def make_steps(
    config: config_lib.Config,
    vocab_size: int,
    traces: list[str],
    every: int = 1,
    modules: str | None = None,
):
    """The plain and the inspected train step (unjitted); each trace appends to `traces`."""
    built = train.programs(config, vocab_size)
    model, tx = built.model, built.tx
    loss_fn = train.make_loss_fn(model)

    def counted(name):
        def fn(*args):
            traces.append(name)
            return loss_fn(*args)

        return fn

    grad = jaxmp.value_and_grad(counted("plain"))
    inspected = jaxmp.inspect(
        jaxmp.value_and_grad(counted("inspected")), every=every, modules=modules
    )

    def update(state, grads):
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return state._replace(step=state.step + 1, params=params, opt_state=opt_state)

    def plain_step(state, inputs, targets):
        loss, grads = grad(jaxmp.get_loss_scale(state.opt_state), state.params, inputs, targets)
        return update(state, grads), loss

    def inspected_step(state, inputs, targets):
        loss_scale = jaxmp.get_loss_scale(state.opt_state)
        (loss, grads), report = inspected(loss_scale, state.params, inputs, targets)
        return update(state, grads), loss, report

    return built, {"plain": plain_step, "inspected": inspected_step}


def row_cost(rounds: int = 15) -> None:
    """Milliseconds of one row's statistics, interleaved medians (measurement 4)."""
    rows = 8
    x = jax.random.normal(jax.random.key(0), (rows, 32 * 64 * 512)).astype(jnp.float16)
    ref = x.astype(jnp.float32) * 1.0001  # a float32 reference, as under a policy
    formats = inspector_stats.DEFAULT_FORMATS

    def record(v, r):
        return inspector_stats._measure(v.astype(jnp.float32), r, formats, one_pass=True)

    width = rows * 256

    def bin_index(r):  # the simplest bin: the float32 exponent field, offset by row
        bits = jax.lax.bitcast_convert_type(r, jnp.uint32)
        offsets = jnp.arange(rows, dtype=jnp.int32)[:, None] * 256
        return ((bits >> 23) & 0xFF).astype(jnp.int32) + offsets

    def scatter(index):
        hist = jnp.zeros(width, jnp.int32)
        return hist.at[index.ravel()].add(1, mode="promise_in_bounds")

    def produce(v, r):  # the rows and their references, each from its own op
        return [
            (v[i] * jnp.float16(1 + i / 64), r[i] * np.float32(1 + i / 64)) for i in range(rows)
        ]

    def stack(v, r):  # the same rows stacked into their group (float32), as the rows are
        pairs = produce(v, r)
        return jnp.stack([a.astype(jnp.float32) for a, _ in pairs]), jnp.stack(
            [b for _, b in pairs]
        )

    index = jax.jit(bin_index)(ref.reshape(rows, -1))
    scatter_jit = jax.jit(scatter)
    fns = {
        "one elementwise add (for scale)": jax.jit(lambda v, r: v.astype(jnp.float32) + r),
        "row statistics": jax.jit(record),
        "the histogram alone": jax.jit(lambda v, r: record(v, r).hist),
        "the extremes alone": jax.jit(lambda v, r: record(v, r).maxima),
        "an int32 bin index per value (exponent field)": jax.jit(lambda v, r: bin_index(r)),
        # The indices are an argument (a constant's scatter would be folded while compiling).
        "a scatter of precomputed bin indices": lambda v, r: scatter_jit(index),
        "8 rows computed and stacked into a group": jax.jit(stack),
        "the same rows computed, not stacked": jax.jit(produce),
    }
    for fn in fns.values():
        jax.block_until_ready(fn(x, ref))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x, ref))
            times[name].append((time.perf_counter() - t0) / rows)
    print(
        f"\nOne row: float16[32,64,512] with its float32 reference, {rows} rows measured "
        f"together, per row, median of {rounds} rounds (the extremes and the histogram each "
        "include what they share)\n"
    )
    table = [[name, f"{statistics.median(t) * 1e3:.1f}"] for name, t in times.items()]
    print(_hlo.table(["program", "ms"], table))


def _without_statistics() -> None:
    """Replaces the statistics of each group of rows by one maximum per row (`--no-statistics`)."""

    def measure(
        values: Any, refs: Any, formats: Any, one_pass: bool = False, axes: Any = ()
    ) -> Any:
        mag, layout = inspector_stats._magnitude(values)
        largest = jnp.max(mag, axis=-1)
        if refs is not None:
            largest = jnp.maximum(largest, jnp.max(inspector_stats._magnitude(refs)[0], axis=-1))
        width = inspector_stats._KINDS * inspector_stats._bins(formats, layout).size
        hist = jnp.zeros((values.shape[0], width), jnp.int32)
        norms = () if refs is None else (jnp.zeros(values.shape[:1], jnp.float32),) * 4
        group = inspector_stats._Group(maxima=(largest,) * 3, hist=hist, norms=norms)
        return inspector_stats._reduce_over(group, axes)

    inspector_stats._measure = measure


def _without_reference() -> None:
    """No float32 reference for any op (`--no-reference`): the inspector's choice for a
    program that computes only in float32."""
    inspector_api._computes_in_low_precision = lambda jaxpr: False


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="mixed_float16", help="a config of configs/")
    parser.add_argument("--rounds", type=int, default=20, help="step-time rounds")
    parser.add_argument("--quick", action="store_true", help="a tiny model, 5 rounds")
    parser.add_argument("--rows-only", action="store_true", help="only measurement 4")
    parser.add_argument("--every", type=int, default=1, help="inspect one op output in N")
    parser.add_argument("--modules", default=None, help="inspect these modules (a regex)")
    parser.add_argument(
        "--no-statistics",
        action="store_true",
        help="a diagnostic: one maximum per row instead of the statistics",
    )
    parser.add_argument(
        "--no-reference",
        action="store_true",
        help="a diagnostic: no float32 reference (no relative errors)",
    )
    args = parser.parse_args(argv)
    if args.no_statistics:
        _without_statistics()
    if args.no_reference:
        _without_reference()
    if args.rows_only:
        print(_hlo.machine())
        row_cost()
        return
    overrides: tuple[str, ...] = ()
    if args.quick:
        args.rounds, overrides = 5, TINY
    config = config_lib.load(args.config, overrides)
    dataset = train.get_dataset(config.val_fraction)
    traces: list[str] = []
    built, steps = make_steps(config, dataset.vocab_size, traces, args.every, args.modules)
    state = built.init(jax.random.PRNGKey(config.seed))
    batch = data_lib.train_batch(dataset.train, config.seed, 0, config.batch_size, config.seq_len)
    print(_hlo.machine())
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    print(
        f"Model: the main job's transformer, {n_params / 1e6:.2f}M params, config "
        f"{config.name} ({config.policy}), {config.num_layers} layers, d_model {config.d_model}, "
        f"batch {config.batch_size} x {config.seq_len}"
    )

    t_start = time.perf_counter()
    jitted: dict[str, Any] = {}
    outputs: dict[str, Any] = {}
    parts: dict[str, dict[str, float]] = {}
    for name, step in steps.items():
        t0 = time.perf_counter()
        lowered = jax.jit(step).lower(state, *batch)
        t1, c1 = time.perf_counter(), time.process_time()
        jitted[name] = lowered.compile()
        t2, c2 = time.perf_counter(), time.process_time()
        outputs[name] = jax.block_until_ready(jitted[name](state, *batch))
        t3 = time.perf_counter()
        parts[name] = {
            "trace and lower": t1 - t0,
            "compile": t2 - t1,
            "compile, CPU": c2 - c1,
            "first run": t3 - t2,
            "first call": t3 - t0,
        }
    report = outputs["inspected"][2]
    sampled = f", sampled: {report.sampling}" if report.sampling else ""
    compared = "compared with a float32 reference" if report.reference else "no float32 reference"
    print(f"\nFirst call (the inspected step has {len(report)} rows, {compared}{sampled})\n")
    table = [
        [
            what,
            *(f"{parts[n][what]:.1f}" for n in jitted),
            f"{parts['inspected'][what] / parts['plain'][what]:.1f}",
        ]
        for what in parts["plain"]
    ]
    print(_hlo.table(["seconds", *jitted, "ratio"], table))

    # Step time: interleaved rounds, each step advancing its own state.
    states = {name: out[0] for name, out in outputs.items()}
    times: dict[str, list[float]] = {name: [] for name in jitted}
    names = list(jitted)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            out = jitted[name](states[name], *batch)
            jax.block_until_ready(out)
            times[name].append(time.perf_counter() - t0)
            states[name] = out[0]
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"\nStep time, median of {args.rounds} interleaved rounds\n")
    rows = [
        [name, f"{median[name] * 1e3:.1f}", f"{median[name] / median['plain']:.2f}"]
        for name in names
    ]
    print(_hlo.table(["step", "ms / step", "vs plain"], rows))
    extra = median["inspected"] - median["plain"]
    every = ", ".join(f"N={n}: +{100 * extra / n / median['plain']:.1f}%" for n in (1, 10, 100))
    print(f"\nMean step time, inspecting every N steps: {every}")

    counts = {name: traces.count(name) for name in names}
    calls = args.rounds + 1  # the first call and the rounds
    print(f"\nTraces of each loss function over {calls} calls of its jitted step: {counts}")
    if counts != dict.fromkeys(names, 1):
        raise SystemExit(f"a jitted step was traced more than once: {counts}")
    if args.no_reference and report.reference:
        raise SystemExit("--no-reference: the inspected step still computed a reference")
    if not args.no_statistics:  # the rows' statistics are what it replaced
        row_cost()
    print(f"\n(total benchmark time {time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    _hlo.real_compiles()
    main()
