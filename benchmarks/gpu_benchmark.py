"""Throughput and model FLOPs utilisation of the char-transformer, float32 against mixed precision.

The model's attention is `jaxmp.dot_product_attention` (cuDNN's fused kernel for half-precision
operands on an NVIDIA GPU, XLA's attention for float32): the rows compare float32, mixed_float16
and mixed_bfloat16 with explicit module dtypes, `jaxmp.autocast` over the unmodified float32
model (whose attention autocast dispatches to the fused kernel), and, where torch is installed,
the same architecture in PyTorch eager with ``F.scaled_dot_product_attention``: float32 (TF32),
``torch.amp`` float16 with a ``GradScaler`` and ``torch.amp`` bfloat16 (`_torch_model`), at
d_model 1024 and 4096; lines after the table give the ratios the targets are about. The model
the earlier runs measured (einsum attention around a float32, rematerialised softmax) has
labelled rows of its own ("einsum attention: ...").

For one accelerator (sized for an H100/H200): for each precision, the jitted train step
(`_model.make_step`, params and optimizer state donated) is compiled, warmed up and timed;
tokens/s is ``batch * seq_len / median step time`` and MFU is the compiled step's FLOPs
(``cost_analysis()["flops"]``) per second over the peak (``--peak-tflops``, default 989: the
dense bfloat16/float16 tensor-core peak of an H100/H200 SXM; float32 rows use the same peak).
The temporaries of each compiled step (``memory_analysis().temp_size_in_bytes``) and the
update-traffic table of `update_cost.py` are measured there too. Cost at real model sizes:
two rows train a deep unscanned model (24 layers, 294 parameter leaves) in float32 and in
mixed_float16 with jaxmp, and three rows compile the optimizer update alone over 2,000
leaves (`compile_cost.py`'s programs: plain `optax.adam`, `jaxmp.loss_scaling(adam)` and
`jaxmp.mixed_precision` with float16 params); their "compile vs ref" column is the ratio of
lower + compile time to the first row run of their group. The FP8 rows run mixed_bfloat16 with
the linear layers' matmuls in FP8 (`jaxmp.autocast` with a recipe: current, delayed and block
scaling; the head and attention's products of activations stay in bfloat16, as in
examples/train.py's ``fp8`` key), on the "gpu" model and on a model with hidden size 4096 and
8,192 tokens per step (the h4096 rows, where the GEMMs are large enough for FP8 to pay); a line
after the table gives their tokens/s over their model's mixed_bfloat16 row (the targets on a
Hopper GPU: 1.1x at hidden 1024, 1.3x at 4096). Each train-step row counts its FP8 GEMMs: the
FP8 GEMM patterns of the lowered program (`_hlo.fp8_gemms`) and the cuBLASLt FP8 GEMM calls
XLA compiled from them (0 on a CPU). The GEMM rows time one (32768x4096) @ (4096x16384) product
alone, forward, bfloat16 against each recipe (the target: 1.6x for FP8). The low-memory row trains
bfloat16 params without a master copy, with stochastic rounding and bfloat16 Adam moments
(docs/guides/low_memory.md); a line after the table gives its argument bytes (params,
optimizer state, batch) and tokens/s against the mixed_bfloat16 row's. The generation table
(`quantized_generation.py`) decodes and prefills with a d_model 4096 decoder at batch 1 and 64
in bfloat16 and with each `jaxmp.quantize` recipe (int8, int8 weights + activations, FP8,
int4): tokens/s, param bytes, and the int8/FP8 GEMMs of the lowered and compiled programs.

Needs only jax, flax, optax, numpy and jaxmp (jmp is used when installed). It limits itself to
``--budget-s`` seconds (default 420), rows that do not fit are reported as skipped.
Run from the repository root::

    PYTHONPATH=. python benchmarks/gpu_benchmark.py
    PYTHONPATH=. python benchmarks/gpu_benchmark.py --tiny   # a CPU smoke test, seconds
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _hlo  # noqa: E402
import _model  # noqa: E402
import _torch_model  # noqa: E402
import compile_cost  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import quantized_generation  # noqa: E402
import update_cost  # noqa: E402

import jaxmp  # noqa: E402

# (label, approach, precision, config), most important first (the time budget may cut the
# last); the first row run of each config is the reference for its speed-up and ratios.
ROWS = [
    # The model with fused attention (`jaxmp.dot_product_attention`), d_model 1024.
    ("float32, optax.adam", "optax", "float32", "gpu"),
    ("mixed_float16, jaxmp", "jaxmp", "mixed_float16", "gpu"),
    ("mixed_bfloat16, jaxmp", "jaxmp", "mixed_bfloat16", "gpu"),
    ("autocast mixed_bfloat16, float32 model", "autocast", "mixed_bfloat16", "gpu"),
    ("torch fp32", "torch", "float32", "gpu"),
    ("torch.amp fp16 + GradScaler", "torch", "float16", "gpu"),
    ("torch.amp bf16", "torch", "bfloat16", "gpu"),
    ("mixed_bfloat16 + FP8 current, jaxmp", "fp8", "current", "gpu"),
    # d_model 4096, 8,192 tokens per step.
    ("h4096: float32, optax.adam", "optax", "float32", "gpu_4096"),
    ("h4096: mixed_bfloat16, jaxmp", "jaxmp", "mixed_bfloat16", "gpu_4096"),
    ("h4096: autocast mixed_bfloat16, float32 model", "autocast", "mixed_bfloat16", "gpu_4096"),
    ("h4096: torch.amp bf16", "torch", "bfloat16", "gpu_4096"),
    ("h4096: mixed_bfloat16 + FP8 current, jaxmp", "fp8", "current", "gpu_4096"),
    ("h4096: mixed_bfloat16 + FP8 delayed, jaxmp", "fp8", "delayed", "gpu_4096"),
    ("mixed_bfloat16 + FP8 delayed, jaxmp", "fp8", "delayed", "gpu"),
    ("mixed_bfloat16 + FP8 block, jaxmp", "fp8", "block", "gpu"),
    # The model the earlier runs measured: einsum attention around a float32 softmax.
    ("einsum attention: float32, optax.adam", "optax", "float32", "gpu_einsum"),
    ("einsum attention: mixed_float16, jaxmp", "jaxmp", "mixed_float16", "gpu_einsum"),
    ("low memory: bfloat16 params + moments, stochastic rounding", "lowmem", "bf16", "gpu"),
    ("float32, jaxmp", "jaxmp", "float32", "gpu"),
    ("mixed_float16, hand-written", "manual", "mixed_float16", "gpu"),
    ("deep: float32, optax.adam", "optax", "float32", "gpu_deep"),
    ("deep: mixed_float16, jaxmp", "jaxmp", "mixed_float16", "gpu_deep"),
]
# The configs of the rows, and their CPU smoke-test stand-ins (`--tiny`).
CONFIG_NAMES = {
    "gpu": "tiny_fused",
    "gpu_4096": "tiny_wide",
    "gpu_einsum": "tiny",
    "gpu_deep": "tiny_deep",
}
# Lines after the table: (row, the row it is compared with), tokens/s ratios (the targets on
# a Hopper GPU: autocast >= 0.95x the explicit-dtype row; mixed_bfloat16 >= 3x float32 and
# >= 1.15x torch.amp bf16).
COMPARISONS = [
    (f"{prefix}autocast mixed_bfloat16, float32 model", f"{prefix}mixed_bfloat16, jaxmp")
    for prefix in ("", "h4096: ")
] + [
    (f"{prefix}mixed_bfloat16, jaxmp", f"{prefix}{against}")
    for prefix in ("", "h4096: ")
    for against in ("float32, optax.adam", "torch.amp bf16")
]
# The update alone over many leaves: (label, `compile_cost.UPDATE_APPROACHES` name).
COMPILE_ROWS = [
    ("update: optax.adam", "optax.adam"),
    ("update: jaxmp.loss_scaling(adam)", "jaxmp.loss_scaling(adam)"),
    ("update: mixed_precision p=f16", "jaxmp.mixed_precision(adam, 'p=f16,c=f16')"),
]
# One GEMM alone, forward, bfloat16 against each recipe: (label, recipe name or None).
GEMM_ROWS = [
    ("GEMM: bfloat16", None),
    ("GEMM: FP8 current", "current"),
    ("GEMM: FP8 delayed", "delayed"),
    ("GEMM: FP8 block", "block"),
]
GEMM_SHAPE = (32768, 4096, 16384)  # (m, k, n): (m, k) @ (k, n)
TINY_GEMM_SHAPE = (64, 32, 48)
BF16_ROW = "mixed_bfloat16, jaxmp"
# The bfloat16 row each FP8 and low-memory row is compared with: its model's.
BF16_ROWS = {"gpu": BF16_ROW, "gpu_4096": "h4096: mixed_bfloat16, jaxmp"}
FP8_CALL = 'custom_call_target="__cublas$lt$matmul$f8"'
GENERATION = "quantized generation"  # the generation table, for --only


def fp8_calls(lowered: Any, compiled: Any) -> tuple[int, int]:
    """``(FP8 GEMM patterns in the lowered program, cuBLASLt FP8 GEMM calls compiled)``: the
    second is 0 where XLA has no FP8 GEMM (a CPU, a GPU before Ada)."""
    return len(_hlo.fp8_gemms(lowered.as_text())), compiled.as_text().count(FP8_CALL)


MIN_TIMED_STEPS = 3
# The FP8 rows' recipes (the "precision" of an "fp8" row) and the matmuls kept in bfloat16:
# the head (the model's only top-level Dense) and the attention einsums, named by equation.
FP8_RECIPES = {
    "current": jaxmp.Float8CurrentScaling(),
    "delayed": jaxmp.DelayedScaling(history_len=16),
    "block": jaxmp.Float8BlockScaling(),
}
HEAD = "CharTransformer/Dense_0"  # the model's only top-level Dense


def fp8_exclude(config: Any) -> tuple[str, ...]:
    """The matmuls kept in bfloat16: the head, and the einsum attention's two products of
    activations (named by their equation; the fused attention has none)."""
    return (HEAD,) if config.attention == "fused" else (HEAD, r".*->.*")


def make_fp8_step(recipe_name: str, config: Any, learning_rate: float = 1e-3) -> tuple[Any, Any]:
    """``(init, step)`` as `_model.make_step`'s jaxmp mixed_bfloat16 step, matmuls in FP8.

    The carry is ``(params, opt_state, fp8_state)``; the FP8 state is that of delayed scaling
    (``None`` for the stateless recipes), its next value the "gradient" of the current one.
    """
    bf16 = jnp.dtype(jnp.bfloat16)
    model = _model.CharTransformer(config, dtype=bf16, param_dtype=jnp.float32)
    apply = jaxmp.autocast(
        model.apply,
        "mixed_bfloat16",
        low_precision_ops=("dot_general",),
        float32_ops=(),
        fp8=FP8_RECIPES[recipe_name],
        fp8_exclude=fp8_exclude(config),
    )
    tx = jaxmp.mixed_precision(optax.adam(learning_rate), "mixed_bfloat16", jaxmp.NoOpLossScale())
    stateful = FP8_RECIPES[recipe_name].stateful

    def loss_fn(params, tokens, fp8_state):
        f = apply.with_fp8_state(fp8_state) if stateful else apply
        logits = f({"params": jaxmp.cast_tree(params, bf16)}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def init_carry(params):
        fp8_state = None
        if stateful:
            tokens = jnp.zeros((1, config.seq_len), jnp.int32)
            fp8_state = apply.fp8_init({"params": jaxmp.cast_tree(params, bf16)}, tokens)
        return params, tx.init(params), fp8_state

    grad_fn = jaxmp.value_and_grad(loss_fn, argnums=(0, 2) if stateful else 0)

    def step(carry, tokens):
        params, opt_state, fp8_state = carry
        loss, grads = grad_fn(jaxmp.get_loss_scale(opt_state), params, tokens, fp8_state)
        if stateful:
            grads, fp8_state = grads
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, fp8_state), loss

    return _model.init_from_seed(init_carry, config, jnp.float32), step


def make_lowmem_step(config: Any, learning_rate: float = 1e-3) -> tuple[Any, Any]:
    """``(init, step)`` as `_model.make_step`'s, with bfloat16 params and no master copy: Adam
    with stochastic rounding and bfloat16 moments (6 bytes per parameter, the low-memory guide's
    setting)."""
    bf16 = jnp.dtype(jnp.bfloat16)
    model = _model.CharTransformer(config, dtype=bf16, param_dtype=bf16)
    tx = jaxmp.mixed_precision(
        optax.adam(learning_rate),
        "p=bf16,c=bf16",
        jaxmp.NoOpLossScale(),
        master_weights=False,
        rounding="stochastic",
        moments="bfloat16",
    )

    loss_fn = functools.partial(_model._loss_fn, model, compute_dtype=bf16)

    def init_carry(params):
        # The float32 init of the other rows, then rounded: the same starting point.
        return jaxmp.cast_tree(params, bf16), tx.init(params)

    def step(carry, tokens):
        params, opt_state = carry
        loss, grads = jaxmp.value_and_grad(loss_fn)(jaxmp.get_loss_scale(opt_state), params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return _model.init_from_seed(init_carry, config, jnp.float32), step


def progress(start: float, message: str) -> None:
    """One line on stderr as each row starts and ends, so that a run stopped from outside (a
    time limit, a crash) still shows what it measured and where it stopped."""
    print(f"[{time.perf_counter() - start:5.0f} s] {message}", file=sys.stderr, flush=True)


def attempt(start: float, label: str, doing: str, measure: Any, *args: Any) -> dict[str, Any]:
    """Row `label`'s ``measure(*args)``, or ``{"error": ...}`` if it raised (out of memory, say:
    the run goes on); what it is `doing`, then its result, go to stderr (`progress`)."""
    progress(start, f"{label}: {doing}")
    try:
        result = measure(*args)
    except Exception as e:  # noqa: BLE001
        result = {"error": _hlo.error_line(e)}
    progress(start, f"{label}: {describe(result)}")
    return result


def describe(result: dict[str, Any] | None) -> str:
    if result is None:
        return "skipped (time budget)"
    if "error" in result:
        return result["error"]
    if "step_s" not in result:
        return f"compile {result['compile_s']:.1f} s"
    if "tflops" in result:
        return f"{result['step_s'] * 1e3:.3f} ms, {result['tflops']:.0f} TFLOP/s"
    return (
        f"compile {result['compile_s']:.1f} s, {result['step_s'] * 1e3:.1f} ms/step "
        f"({result['steps']} steps), temp {result['temp'] / 1e9:.2f} GB, loss {result['loss']:.3f}"
    )


def run_row(approach, precision, config, tokens, steps, deadline) -> dict[str, Any]:
    if approach == "torch":
        if not _torch_model.available():
            return {"error": "skipped: torch is not installed"}
        return _torch_model.measure(precision, config, tokens, steps, deadline)
    if approach == "fp8":
        init, step = make_fp8_step(precision, config)
    elif approach == "lowmem":
        init, step = make_lowmem_step(config)
    else:
        init, step = _model.make_step(approach, precision, config)
    carry = init(0)
    t0 = time.perf_counter()
    lowered = jax.jit(step, donate_argnums=0).lower(carry, tokens)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    patterns, calls = fp8_calls(lowered, compiled)
    flops = _hlo.flops(compiled)
    memory = compiled.memory_analysis()
    temp = memory.temp_size_in_bytes
    arguments = memory.argument_size_in_bytes
    for _ in range(2):  # warm-up
        carry, loss = compiled(carry, tokens)
    jax.block_until_ready(carry)
    times = []
    # At least `MIN_TIMED_STEPS` however long the compile took, so that a row that compiled
    # always has a time.
    while len(times) < steps and (len(times) < MIN_TIMED_STEPS or time.perf_counter() < deadline):
        t = time.perf_counter()
        carry, loss = compiled(carry, tokens)
        jax.block_until_ready((carry, loss))
        times.append(time.perf_counter() - t)
    return dict(
        step_s=statistics.median(times) if times else float("nan"),
        steps=len(times),
        flops=flops,
        temp=temp,
        arguments=arguments,
        compile_s=compile_s,
        loss=float(loss),
        fp8_patterns=patterns,
        fp8_calls=calls,
    )


def gemm_row(recipe_name: str | None, shape: tuple[int, int, int], repeats: int) -> dict[str, Any]:
    """One ``(m, k) @ (k, n)`` forward product in bfloat16 out of bfloat16 operands: plain, or
    under `jaxmp.autocast` with an FP8 recipe (delayed scaling with a state from one call)."""
    m, k, n = shape
    x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(1), (k, n)) / k**0.5).astype(jnp.bfloat16)
    if recipe_name is None:
        fn = jnp.matmul
    else:
        f = jaxmp.autocast(jnp.matmul, "p=bf16,c=bf16,o=bf16", fp8=FP8_RECIPES[recipe_name])
        fn = f.with_fp8_state(f.fp8_init(x, w)) if f.fp8.stateful else f
    t0 = time.perf_counter()
    lowered = jax.jit(fn).lower(x, w)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    patterns, calls = fp8_calls(lowered, compiled)
    jax.block_until_ready(compiled(x, w))  # warm-up
    step_s = _hlo.median_time(lambda: jax.block_until_ready(compiled(x, w)), repeats)
    return dict(
        compile_s=compile_s,
        step_s=step_s,
        tflops=2 * m * k * n / step_s / 1e12,
        fp8_patterns=patterns,
        fp8_calls=calls,
    )


def compile_row(name: str, leaves: int) -> dict[str, Any]:
    """Lower + compile seconds of one update over `leaves` leaves (`compile_cost.py`)."""
    (dtype, build) = next((d, b) for n, d, b in compile_cost.UPDATE_APPROACHES if n == name)
    result = compile_cost.compile_update(build, dtype, leaves)
    return dict(compile_s=result["total"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--tiny", action="store_true", help="tiny models and few leaves, for a CPU smoke test"
    )
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="peak TFLOP/s for MFU")
    parser.add_argument("--budget-s", type=float, default=420.0, help="self-imposed time limit")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per row (at most)")
    parser.add_argument(
        "--compile-leaves", type=int, default=2000, help="leaves of the update compile rows"
    )
    parser.add_argument(
        "--matmul-precision",
        default=None,
        choices=["default", "high", "highest"],
        help="jax_default_matmul_precision for the float32 rows (default: JAX's own, which "
        "on recent NVIDIA GPUs uses TF32 tensor cores for float32 matmuls)",
    )
    parser.add_argument("--no-update-table", action="store_true")
    parser.add_argument(
        "--no-generation-table",
        action="store_true",
        help="leave out quantized generation (quantized_generation.py)",
    )
    parser.add_argument(
        "--only",
        action="append",
        metavar="TEXT",
        help="run only the train-step and compile rows whose label contains TEXT, and the "
        f"generation table if {GENERATION!r} does (repeatable; "
        "ratios are to the first row run of each group; the FP8 and low-memory lines need the "
        f"{BF16_ROW!r} row)",
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    deadline = start + args.budget_s
    configs = {
        name: _model.CONFIGS[tiny if args.tiny else name] for name, tiny in CONFIG_NAMES.items()
    }
    compile_leaves = 20 if args.tiny else args.compile_leaves
    steps = 3 if args.tiny else args.steps
    tokens = {name: _model.batch(config) for name, config in configs.items()}
    print(_hlo.machine())
    for name, config in configs.items():
        print(f"Model {name}: {_model.num_params(config) / 1e6:.1f}M params, {config}")
    if args.matmul_precision:
        jax.config.update("jax_default_matmul_precision", args.matmul_precision)
    print(f"float32 matmul precision: {jax.config.jax_default_matmul_precision or 'JAX default'}")

    rows_to_run = [r for r in ROWS if not args.tiny or r[2] != "float32" or r[1] == "optax"]
    rows_to_run = [r for r in rows_to_run if not args.tiny or r[1] != "manual"]
    compile_rows = COMPILE_ROWS
    gemm_rows = GEMM_ROWS
    generation_table = not args.no_generation_table
    if args.only:
        rows_to_run = [r for r in rows_to_run if any(text in r[0] for text in args.only)]
        compile_rows = [r for r in compile_rows if any(text in r[0] for text in args.only)]
        gemm_rows = [r for r in gemm_rows if any(text in r[0] for text in args.only)]
        generation_table &= any(text in GENERATION for text in args.only)
        if not rows_to_run and not compile_rows and not gemm_rows and not generation_table:
            parser.error(
                f"--only {args.only}: no row's label contains it; the rows: "
                + "; ".join(r[0] for r in [*GEMM_ROWS, *ROWS, *COMPILE_ROWS])
                + f"; and the table {GENERATION!r}"
            )
    results: dict[str, Any] = {}
    # The GEMM rows first: seconds each, and the measure FP8's speed rests on.
    gemm_shape = TINY_GEMM_SHAPE if args.tiny else GEMM_SHAPE
    for label, recipe_name in gemm_rows:
        results[label] = attempt(
            start, label, "compiling and timing", gemm_row, recipe_name, gemm_shape, steps
        )
    tables = (0 if args.no_update_table else 1) + (1 if generation_table else 0)
    extra = len(compile_rows) + tables
    for i, (label, approach, precision, config_name) in enumerate(rows_to_run):
        # Leave each remaining row an equal share of the budget (compile included).
        left = len(rows_to_run) - i + extra
        share = (deadline - time.perf_counter()) / left
        if share < (1 if args.tiny else 20):
            results[label] = None
            continue
        row_deadline = time.perf_counter() + share
        config, batch = configs[config_name], tokens[config_name]
        results[label] = attempt(
            start, label, "compiling and timing", run_row,
            approach, precision, config, batch, steps, row_deadline,
        )  # fmt: skip
    for i, (label, name) in enumerate(compile_rows):
        left = len(compile_rows) - i + tables
        if (deadline - time.perf_counter()) / left < (1 if args.tiny else 30):
            results[label] = None
            continue
        results[label] = attempt(start, label, "compiling", compile_row, name, compile_leaves)

    refs = {}
    for label, _, _, config_name in rows_to_run:
        refs.setdefault(config_name, label)
    rows = []
    for label, _, _, config_name in rows_to_run:
        config = configs[config_name]
        ref = results.get(refs[config_name])
        r = results[label]
        if r is None or "error" in r:
            rows.append([label, describe(r)] + [""] * 8)
            continue
        ok = ref is not None and "error" not in ref
        tps = config.batch_size * config.seq_len / r["step_s"]
        mfu = r["flops"] / r["step_s"] / (args.peak_tflops * 1e12)  # nan for torch
        speedup = ref["step_s"] / r["step_s"] if ok else float("nan")
        temp_ratio = r["temp"] / ref["temp"] if ok else float("nan")
        compile_ratio = r["compile_s"] / ref["compile_s"] if ok else float("nan")
        rows.append(
            [
                label,
                f"{tps:,.0f}",
                f"{speedup:.2f}",
                f"{100 * mfu:.1f}",
                f"{r['step_s'] * 1e3:.1f} ({r['steps']})",
                f"{r['temp'] / 1e9:.2f} ({temp_ratio:.2f})",
                f"{r['compile_s']:.0f}",
                f"{compile_ratio:.2f}",
                f"{r['loss']:.3f}",
                f"{r['fp8_patterns']} / {r['fp8_calls']}",
            ]
        )
    if compile_rows:
        refs["update"] = compile_rows[0][0]
    ref = results.get(refs.get("update"))
    for label, _ in compile_rows:
        r = results[label]
        if r is None or "error" in r:
            rows.append([label, describe(r)] + [""] * 8)
            continue
        ok = ref is not None and "error" not in ref
        ratio = r["compile_s"] / ref["compile_s"] if ok else float("nan")
        blank = ["", "", "", "", ""]
        rows.append([f"{label} ({compile_leaves} leaves)", *blank, f"{r['compile_s']:.1f}"])
        rows[-1] += [f"{ratio:.2f}", "", ""]
    print(
        f"\nTrain step: tokens/s, MFU against {args.peak_tflops:g} TFLOP/s (FLOPs from the "
        "compiled step's cost analysis), compile = lower + compile seconds; ratios (vs ref) to "
        "the first row run of each group: " + "; ".join(refs.values()) + "\n"
    )
    header = [
        "precision, approach",
        "tokens/s",
        "vs ref",
        "MFU %",
        "ms/step (n)",
        "temp GB (vs ref)",
        "compile s",
        "compile vs ref",
        "loss",
        "FP8 GEMMs (lowered / cuBLASLt)",
    ]
    print(_hlo.table(header, rows))
    for label, approach, _, config_name in rows_to_run:
        r = results[label]
        if approach not in ("fp8", "lowmem") or r is None or "error" in r:
            continue
        bf16_row = BF16_ROWS.get(config_name, BF16_ROW)
        bf16 = results.get(bf16_row)
        if bf16 is None or "error" in bf16:
            print(f"{label}: no {bf16_row} row to compare with")
        elif approach == "fp8":
            print(f"{label}: {bf16['step_s'] / r['step_s']:.2f}x the tokens/s of {bf16_row}")
        else:
            print(
                f"{label}: params + optimizer state + batch {r['arguments'] / 1e9:.3f} GB, "
                f"{r['arguments'] / bf16['arguments']:.2f}x {bf16_row}'s "
                f"({bf16['arguments'] / 1e9:.3f} GB); {bf16['step_s'] / r['step_s']:.2f}x its "
                "tokens/s"
            )

    for label, against in COMPARISONS:
        r, ref = results.get(label), results.get(against)
        if r and ref and "error" not in r and "error" not in ref:
            print(f"{label}: {ref['step_s'] / r['step_s']:.2f}x the tokens/s of {against}")

    if gemm_rows:
        gemm_table = []
        ref = results.get(gemm_rows[0][0])
        for label, _ in gemm_rows:
            r = results[label]
            if r is None or "error" in r:
                gemm_table.append([label, describe(r), "", "", "", ""])
                continue
            ok = ref is not None and "error" not in ref
            speedup = ref["step_s"] / r["step_s"] if ok else float("nan")
            gemm_table.append(
                [
                    label,
                    f"{r['step_s'] * 1e3:.3f}",
                    f"{r['tflops']:.0f}",
                    f"{speedup:.2f}",
                    f"{r['fp8_patterns']} / {r['fp8_calls']}",
                    f"{r['compile_s']:.1f}",
                ]
            )
        m, k, n = gemm_shape
        print(f"\nOne GEMM, ({m}x{k}) @ ({k}x{n}), forward, bfloat16 out; vs {gemm_rows[0][0]}:\n")
        gemm_header = ["GEMM", "ms", "TFLOP/s", "vs ref", "FP8 GEMMs (lowered / cuBLASLt)"]
        print(_hlo.table([*gemm_header, "compile s"], gemm_table))

    if generation_table:
        # An equal share of what is left with the update table; rows past it are skipped.
        share = (deadline - time.perf_counter()) / tables
        config = quantized_generation.CONFIGS["tiny" if args.tiny else "default"]
        generation = quantized_generation.measure(
            config,
            repeats=steps,
            deadline=time.perf_counter() + share,
            progress=functools.partial(progress, start),
        )
        print()
        print(quantized_generation.report(config, generation))
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
    _hlo.real_compiles()
    main()
