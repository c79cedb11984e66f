"""A full train step of a small char-transformer: jaxmp against hand-written code and its peers.

Three measurements, in one run:

1. Temporaries: ``compiled.memory_analysis().temp_size_in_bytes`` of the jitted step, float32
   against mixed float16 and bfloat16, for every approach (see `_model.make_step`).
2. Step time: every approach's compiled step under mixed_float16, run in interleaved rounds
   (one step of each per round, in a rotating order), median over the rounds; the ratio of
   jaxmp to the hand-written step ("manual") is the figure of merit.
3. Compile time: ``jax.jit(step).lower(...)`` and ``.compile()`` of a freshly built step
   (a new function object each time, so nothing is cached), median of several, for jaxmp
   and the hand-written step, alternating.

Run from the repository root::

    PYTHONPATH=. python benchmarks/train_step.py            # a few minutes on 2 CPU cores
    PYTHONPATH=. python benchmarks/train_step.py --quick    # fewer repetitions
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _hlo  # noqa: E402
import _model  # noqa: E402
import jax  # noqa: E402

LABELS = {
    "optax": "plain optax.adam (no loss scaling)",
    "jaxmp": "jaxmp.mixed_precision + value_and_grad",
    "manual": "hand-written (same casts, scale, check, selects)",
    "jmp": "jmp glue (scale/unscale, all_finite, select_tree)",
    "apply_if_finite": "optax.apply_if_finite + inline scaling",
    "flax": "flax DynamicScale + jnp.where",
}


def _compile(approach: str, precision: str, config: _model.Config, tokens: Any):
    """Builds, lowers and compiles a fresh step; returns (compiled, carry, lower s, compile s)."""
    init, step = _model.make_step(approach, precision, config)
    carry = init(0)
    jax.block_until_ready(carry)
    t0 = time.perf_counter()
    lowered = jax.jit(step).lower(carry, tokens)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return compiled, carry, t1 - t0, t2 - t1


def memory(config: _model.Config, tokens: Any, precisions, approaches) -> dict:
    """Temp bytes per (approach, precision); also keeps the compiled steps for timing."""
    out = {}
    for precision in precisions:
        for approach in approaches:
            compiled, carry, _, _ = _compile(approach, precision, config, tokens)
            mem = compiled.memory_analysis()
            out[approach, precision] = dict(
                temp=mem.temp_size_in_bytes,
                args=mem.argument_size_in_bytes,
                compiled=compiled,
                carry=carry,
            )
    return out


def step_times(compiled: dict[str, tuple[Any, Any]], tokens: Any, rounds: int) -> dict:
    """Median seconds per step of each compiled step, interleaved over `rounds` rounds."""
    carries = {}
    for name, (fn, carry) in compiled.items():  # warm up: first call, then one more
        carry, loss = fn(carry, tokens)
        carry, loss = fn(carry, tokens)
        jax.block_until_ready(carry)
        carries[name] = carry
    times: dict[str, list[float]] = {name: [] for name in compiled}
    names = list(compiled)
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            fn = compiled[name][0]
            t0 = time.perf_counter()
            carry, loss = fn(carries[name], tokens)
            jax.block_until_ready((carry, loss))
            times[name].append(time.perf_counter() - t0)
            carries[name] = carry
    return {name: statistics.median(t) for name, t in times.items()}


def compile_times(config: _model.Config, tokens: Any, approaches, precision, repeats: int):
    """Median (lower, compile) seconds of fresh builds, alternating between approaches."""
    samples: dict[str, list[tuple[float, float]]] = {a: [] for a in approaches}
    for r in range(repeats):
        order = approaches if r % 2 == 0 else approaches[::-1]
        for approach in order:
            _, _, lower_s, compile_s = _compile(approach, precision, config, tokens)
            samples[approach].append((lower_s, compile_s))
    return {
        a: (
            statistics.median(s[0] for s in v),
            statistics.median(s[1] for s in v),
            statistics.median(s[0] + s[1] for s in v),
        )
        for a, v in samples.items()
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="cpu", choices=sorted(_model.CONFIGS))
    parser.add_argument("--rounds", type=int, default=30, help="step-time rounds")
    parser.add_argument("--compiles", type=int, default=5, help="fresh compiles per approach")
    parser.add_argument("--quick", action="store_true", help="10 rounds, 3 compiles")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.compiles = 10, 3
    config = _model.CONFIGS[args.config]
    tokens = _model.batch(config)
    print(_hlo.machine())
    print(
        f"Model: {_model.num_params(config) / 1e6:.2f}M params, {config}; "
        f"tokens per step {config.batch_size * config.seq_len}"
    )

    # 1. Memory.
    t_start = time.perf_counter()
    mem = memory(config, tokens, ["mixed_float16"], _model.APPROACHES)
    mem.update(memory(config, tokens, ["float32", "mixed_bfloat16"], ["optax", "jaxmp"]))
    mem.update(memory(config, tokens, ["p=f16,c=f16"], ["jaxmp"]))
    base = mem["optax", "float32"]["temp"]
    rows = []
    for (approach, precision), m in mem.items():
        rows.append(
            [
                LABELS[approach],
                precision + (" (f32 master)" if precision.startswith("p=") else ""),
                f"{m['temp'] / 1e6:.2f}",
                f"{m['temp'] / base:.3f}",
            ]
        )
    order = {"float32": 0, "mixed_float16": 1, "mixed_bfloat16": 2}
    rows.sort(key=lambda r: (order.get(r[1], 3), r[0]))
    print("\nTemporaries of the compiled train step (memory_analysis().temp_size_in_bytes)\n")
    print(_hlo.table(["approach", "precision", "temp MB", "vs optax f32"], rows))
    jm = {p: mem["jaxmp", p]["temp"] for p in ("float32", "mixed_float16", "mixed_bfloat16")}
    print(
        f"\njaxmp mixed_float16 / float32 temporaries: {jm['mixed_float16'] / jm['float32']:.3f}; "
        f"mixed_bfloat16 / float32: {jm['mixed_bfloat16'] / jm['float32']:.3f}"
    )

    # 2. Step time (mixed_float16, all approaches, interleaved).
    compiled = {
        a: (mem[a, "mixed_float16"]["compiled"], mem[a, "mixed_float16"]["carry"])
        for a in _model.APPROACHES
    }
    times = step_times(compiled, tokens, args.rounds)
    print(f"\nStep time, mixed_float16, median of {args.rounds} interleaved rounds\n")
    ref = times["manual"]
    rows = [[LABELS[a], f"{times[a] * 1e3:.1f}", f"{times[a] / ref:.3f}"] for a in times]
    print(_hlo.table(["approach", "ms / step", "vs hand-written"], rows))

    # 3. Compile time.
    ct = compile_times(config, tokens, ["jaxmp", "manual"], "mixed_float16", args.compiles)
    print(f"\nLower + compile time, mixed_float16, median of {args.compiles} fresh builds\n")
    rows = [
        [LABELS[a], f"{lo:.2f}", f"{co:.2f}", f"{tot:.2f}", f"{tot / ct['manual'][2]:.3f}"]
        for a, (lo, co, tot) in ct.items()
    ]
    print(_hlo.table(["approach", "lower s", "compile s", "total s", "vs hand-written"], rows))
    print(f"\n(total benchmark time {time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    _hlo.real_compiles()
    main()
