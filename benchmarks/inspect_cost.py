"""What `jaxmp.inspect` costs inside the main job's jitted train step.

The main job's train step (``examples/lm/steps.py``, config ``mixed_float16``) against the same
step with its loss and gradients computed by ``jaxmp.inspect(jaxmp.value_and_grad(loss_fn))``,
the report returned from the jitted step (the pattern of docs/guides/inspector.md: an
inspected step every N steps, a plain one otherwise). Three measurements:

1. Traces: each step is jitted once and called for every round; a Python counter in the loss
   function counts its traces (one per jitted step is the promise: never once per call).
2. The first call of each jitted step: trace, lower, compile and one run (once each: the
   inspected step of the full model compiles for minutes on 2 CPU cores).
3. Step time: both compiled steps run in interleaved rounds (one call of each per round, in
   alternating order), median over the rounds; and what inspecting every N steps adds to the
   mean step time.
4. Where a row's time goes: the statistics of one float16 output of the size of the main
   job's MLP activations (32 x 64 x 512), with and without the exponent histogram, against
   one elementwise add over the same array (``--rows-only`` runs only this).

Run from the repository root::

    PYTHONPATH=. python benchmarks/inspect_cost.py            # the main job's model, ~5 min
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
import optax  # noqa: E402
import train  # noqa: E402
from lm import config as config_lib  # noqa: E402
from lm import data as data_lib  # noqa: E402

import jaxmp  # noqa: E402
from jaxmp._src import inspector  # noqa: E402

TINY = ("num_layers=1", "num_heads=2", "d_model=32", "mlp_ratio=2", "seq_len=16", "batch_size=8")


def make_steps(config: config_lib.Config, vocab_size: int, traces: list[str]):
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
    inspected = jaxmp.inspect(jaxmp.value_and_grad(counted("inspected")))

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
    x = jax.random.normal(jax.random.key(0), (32, 64, 512)).astype(jnp.float16)
    ref = x.astype(jnp.float32) * 1.0001  # a float32 reference, as under a policy
    formats = inspector.DEFAULT_FORMATS

    def record(v, r):
        return inspector._measure(v, r, jnp.bool_(True), jnp.int32(0), formats)

    fns = {
        "one elementwise add (for scale)": jax.jit(lambda v, r: v.astype(jnp.float32) + r),
        "row statistics": jax.jit(record),
        "without the histogram": jax.jit(lambda v, r: record(v, r)._replace(hist=None)),
        "the histogram alone": jax.jit(lambda v, r: record(v, r).hist),
    }
    for fn in fns.values():
        jax.block_until_ready(fn(x, ref))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x, ref))
            times[name].append(time.perf_counter() - t0)
    print(f"\nOne row: float16[32,64,512] with its float32 reference, median of {rounds} rounds\n")
    rows = [[name, f"{statistics.median(t) * 1e3:.1f}"] for name, t in times.items()]
    print(_hlo.table(["program", "ms"], rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="mixed_float16", help="a config of configs/")
    parser.add_argument("--rounds", type=int, default=20, help="step-time rounds")
    parser.add_argument("--quick", action="store_true", help="a tiny model, 5 rounds")
    parser.add_argument("--rows-only", action="store_true", help="only measurement 4")
    args = parser.parse_args(argv)
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
    built, steps = make_steps(config, dataset.vocab_size, traces)
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
    jitted = {name: jax.jit(step) for name, step in steps.items()}
    outputs: dict[str, Any] = {}
    first_call = {}
    for name, fn in jitted.items():
        t0 = time.perf_counter()
        outputs[name] = jax.block_until_ready(fn(state, *batch))
        first_call[name] = time.perf_counter() - t0
    report = outputs["inspected"][2]
    print(f"\nFirst call: trace, lower, compile, run (the inspected step has {len(report)} rows)\n")
    rows = [
        [name, f"{first_call[name]:.1f}", f"{first_call[name] / first_call['plain']:.1f}"]
        for name in jitted
    ]
    print(_hlo.table(["step", "first call s", "vs plain"], rows))

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
    row_cost()
    print(f"\n(total benchmark time {time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    _hlo.real_compiles()
    main()
