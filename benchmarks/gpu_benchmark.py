"""Throughput and model FLOPs utilisation of the char-transformer, float32 against mixed precision.

For one accelerator (sized for an H100/H200): for each precision, the jitted train step
(`_model.make_step`, params and optimizer state donated) is compiled, warmed up and timed;
tokens/s is ``batch * seq_len / median step time`` and MFU is the compiled step's FLOPs
(``cost_analysis()["flops"]``) per second over the peak (``--peak-tflops``, default 989: the
dense bfloat16/float16 tensor-core peak of an H100/H200 SXM; float32 rows use the same peak).
The temporaries of each compiled step (``memory_analysis().temp_size_in_bytes``) and the
update-traffic table of `update_cost.py` are measured there too.

Needs only jax, flax, optax, numpy and jaxmp (jmp is used when installed). It limits itself to
``--budget-s`` seconds (default 420), rows that do not fit are reported as skipped.
Run from the repository root::

    PYTHONPATH=. python benchmarks/gpu_benchmark.py
    PYTHONPATH=. python benchmarks/gpu_benchmark.py --tiny   # a CPU smoke test, seconds
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
import update_cost  # noqa: E402

# (label, approach, precision), most important first (the time budget may cut the last);
# the first row is the reference for the speed-up and temporaries ratios.
ROWS = [
    ("float32, optax.adam", "optax", "float32"),
    ("mixed_float16, jaxmp", "jaxmp", "mixed_float16"),
    ("mixed_bfloat16, jaxmp", "jaxmp", "mixed_bfloat16"),
    ("float32, jaxmp", "jaxmp", "float32"),
    ("mixed_float16, hand-written", "manual", "mixed_float16"),
]


def run_row(approach, precision, config, tokens, steps, deadline) -> dict[str, Any]:
    init, step = _model.make_step(approach, precision, config)
    carry = init(0)
    t0 = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=0).lower(carry, tokens).compile()
    compile_s = time.perf_counter() - t0
    flops = _hlo.flops(compiled)
    temp = compiled.memory_analysis().temp_size_in_bytes
    for _ in range(2):  # warm-up
        carry, loss = compiled(carry, tokens)
    jax.block_until_ready(carry)
    times = []
    while len(times) < steps and time.perf_counter() < deadline:
        t = time.perf_counter()
        carry, loss = compiled(carry, tokens)
        jax.block_until_ready((carry, loss))
        times.append(time.perf_counter() - t)
    return dict(
        step_s=statistics.median(times) if times else float("nan"),
        steps=len(times),
        flops=flops,
        temp=temp,
        compile_s=compile_s,
        loss=float(loss),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--tiny", action="store_true", help="tiny model and three rows, for a CPU smoke test"
    )
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="peak TFLOP/s for MFU")
    parser.add_argument("--budget-s", type=float, default=420.0, help="self-imposed time limit")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per row (at most)")
    parser.add_argument(
        "--matmul-precision",
        default=None,
        choices=["default", "high", "highest"],
        help="jax_default_matmul_precision for the float32 rows (default: JAX's own, which "
        "on recent NVIDIA GPUs uses TF32 tensor cores for float32 matmuls)",
    )
    parser.add_argument("--no-update-table", action="store_true")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    deadline = start + args.budget_s
    config = _model.CONFIGS["tiny" if args.tiny else "gpu"]
    steps = 3 if args.tiny else args.steps
    tokens = _model.batch(config)
    print(_hlo.machine())
    print(f"Model: {_model.num_params(config) / 1e6:.1f}M params, {config}")
    if args.matmul_precision:
        jax.config.update("jax_default_matmul_precision", args.matmul_precision)
    print(f"float32 matmul precision: {jax.config.jax_default_matmul_precision or 'JAX default'}")

    rows_to_run = [r for r in ROWS if not args.tiny or r[2] != "float32" or r[1] == "optax"]
    rows_to_run = [r for r in rows_to_run if not args.tiny or r[1] != "manual"]
    results = {}
    for i, (label, approach, precision) in enumerate(rows_to_run):
        # Leave each remaining row an equal share of the budget (compile included).
        left = len(rows_to_run) - i + (0 if args.no_update_table else 1)
        share = (deadline - time.perf_counter()) / left
        if share < (1 if args.tiny else 20):
            results[label] = None
            continue
        row_deadline = time.perf_counter() + share
        try:
            results[label] = run_row(approach, precision, config, tokens, steps, row_deadline)
        except Exception as e:  # noqa: BLE001 (report, e.g., out of memory, and go on)
            results[label] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"}

    tokens_per_step = config.batch_size * config.seq_len
    ref = results.get(ROWS[0][0])
    rows = []
    for label, _, _ in rows_to_run:
        r = results[label]
        if r is None:
            rows.append([label, "skipped (time budget)", "", "", "", "", "", ""])
            continue
        if "error" in r:
            rows.append([label, r["error"], "", "", "", "", "", ""])
            continue
        tps = tokens_per_step / r["step_s"]
        mfu = r["flops"] / r["step_s"] / (args.peak_tflops * 1e12)
        speedup = ref["step_s"] / r["step_s"] if ref and "error" not in ref else float("nan")
        temp_ratio = r["temp"] / ref["temp"] if ref and "error" not in ref else float("nan")
        rows.append(
            [
                label,
                f"{tps:,.0f}",
                f"{speedup:.2f}",
                f"{100 * mfu:.1f}",
                f"{r['step_s'] * 1e3:.1f} ({r['steps']})",
                f"{r['temp'] / 1e9:.2f} ({temp_ratio:.2f})",
                f"{r['compile_s']:.0f}",
                f"{r['loss']:.3f}",
            ]
        )
    print(
        f"\nTrain step: {tokens_per_step} tokens per step, MFU against "
        f"{args.peak_tflops:g} TFLOP/s, FLOPs from the compiled step's cost analysis\n"
    )
    header = [
        "precision, approach",
        "tokens/s",
        "vs fp32",
        "MFU %",
        "ms/step (n)",
        "temp GB (vs fp32)",
        "compile s",
        "loss",
    ]
    print(_hlo.table(header, rows))

    if not args.no_update_table:
        remaining = deadline - time.perf_counter()
        if remaining < (1 if args.tiny else 30):
            print("\nUpdate traffic: skipped (time budget)")
        else:
            measured = update_cost.measure(_model.CONFIGS["tiny" if args.tiny else "update"])
            print()
            print(update_cost.report(measured))
    print(f"\n(total {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
