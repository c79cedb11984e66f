"""Cost at real model sizes: compile time, step time and memory as the model grows.

Six measurements, each selectable with ``--only``:

``update``
  Lower and compile time of one optimizer update plus `optax.apply_updates` (the programs of
  `update_cost.py`) over trees of N leaves of 64x64 (float32 params; float16 for the
  float16-params rows), for plain `optax.adam`, jaxmp and the peers. Every compile is fresh
  (the learning rate differs each time, so nothing is cached); the approaches are interleaved
  in a rotating order and each figure is the best of ``--repeats``; the ratio is to plain
  `optax.adam` of the same round of measurements. The HLO instruction count of the compiled
  program (deterministic) is shown beside.
``breakdown``
  Instructions per leaf of the compiled update (plain Adam, `loss_scaling(adam)`,
  `mixed_precision` with float16 params) by opcode, at 64 leaves: where the extra compile
  work of each wrapper is. Deterministic.
``deep``
  The same for a full train step of the main job's transformer (`examples/lm/model.py`,
  unscanned, 16 parameter leaves per layer) with the main job's optimizer
  (``clip_by_global_norm`` and AdamW): plain optax in float32, jaxmp under mixed_float16
  and the same step written by hand.
``autocast``
  Trace time (``jax.jit(step).trace``) and lower + compile time of a training step of a Flax
  transformer (`autocast_cost.py`'s) as the layer count grows: written with explicit
  ``dtype=float16`` arguments against the float32 model under `jaxmp.autocast`, with the
  layers unrolled and with ``nn.scan`` over the layers (the recommended layout).
``steptime``
  Milliseconds per update at ``--steptime-leaves`` leaves, jaxmp against the same update
  written by hand, in interleaved rounds (one call of each per round, rotating order);
  median over the rounds.
``memory``
  ``memory_analysis()`` of the main job's train step per policy at three model sizes, and
  the bytes per parameter of params plus optimizer state for every policy, read from the
  state pytrees (``jax.eval_shape``: nothing is computed).

With ``--before PATH`` (another checkout, e.g. ``git worktree add /tmp/before <commit>``),
``--only update`` compiles plain Adam, `jaxmp.loss_scaling` and `jaxmp.mixed_precision` with
float16 params with the jaxmp of both checkouts, each compile in a fresh process, interleaved.

The peers that check each leaf on its own and select after the update (jmp's glue, Flax's
`DynamicScale` with ``jnp.where``, the hand-written steps) compile in time quadratic in the leaf
count (2 minutes at 250 leaves on 2 CPU cores, not finished after 6 at 500): beyond 250 leaves
name the linear rows with ``--approaches``. On 2 CPU cores ``--only update`` at its default
leaves took 8 minutes and ``--only steptime`` 4 minutes.

Run from the repository root::

    PYTHONPATH=. python benchmarks/compile_cost.py
    PYTHONPATH=. python benchmarks/compile_cost.py --only update --leaves 500 2000 \\
        --approaches optax.adam "jaxmp.loss_scaling(adam)"
    PYTHONPATH=. python benchmarks/compile_cost.py --only deep --layers 12 24 48
    PYTHONPATH=. python benchmarks/compile_cost.py --only autocast --autocast-layers 2 8 16 32
    PYTHONPATH=. python benchmarks/compile_cost.py --only update --before /tmp/before
"""

from __future__ import annotations

import argparse
import collections
import functools
import inspect
import os
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if sys.argv[1:2] == ["--child"]:  # one compile in a fresh process, jaxmp from another checkout
    sys.path.insert(0, os.path.abspath(sys.argv[2]))

import _hlo  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import update_cost  # noqa: E402

import jaxmp  # noqa: E402

F32, F16, BF16 = jnp.float32, jnp.float16, jnp.bfloat16

# ---------------------------------------------------------------------------------------------
# Timing.


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def lower_and_compile(fn: Callable, *args: Any) -> dict[str, Any]:
    """``jax.jit(fn).lower(*args)`` then ``.compile()``: wall seconds of each, and the program."""
    t0, c0 = time.perf_counter(), _cpu_s()
    lowered = jax.jit(fn).lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2, c2 = time.perf_counter(), _cpu_s()
    return dict(lower=t1 - t0, compile=t2 - t1, total=t2 - t0, cpu=c2 - c0, compiled=compiled)


def _instruction_lines(compiled: Any) -> list[str]:
    """The instruction lines of the optimised HLO module, fused computations included."""
    return [line for line in compiled.as_text().splitlines() if " = " in line and "%" in line]


def hlo_instructions(compiled: Any) -> int:
    """Instructions of the optimised HLO module, fused computations included."""
    return len(_instruction_lines(compiled))


def interleaved(
    builders: dict[str, Callable[[int], dict[str, Any]]], repeats: int
) -> dict[str, dict[str, Any]]:
    """Runs every builder `repeats` times in a rotating order; the best (least) of each figure.

    ``builders[name](round)`` compiles something fresh and returns `lower_and_compile`'s
    dict. The ratio of two names is then of figures measured in the same rounds.
    """
    names = list(builders)
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            result = builders[name](r)
            samples[name].append(result)
    best = {}
    for name, runs in samples.items():
        best[name] = {k: min(run[k] for run in runs) for k in ("lower", "compile", "total", "cpu")}
        best[name]["instructions"] = runs[0].get("instructions")
    return best


# ---------------------------------------------------------------------------------------------
# 1. The update alone, by leaf count.

_FRESH = iter(range(1, 10**9))


def _fresh_lr() -> float:
    """A learning rate never used before in this process: a fresh trace and compile."""
    return 1e-3 * (1.0 + 1e-6 * next(_FRESH))


def _tx(make: Callable[[Any], Any]) -> Callable[[Any], tuple[Any, Any]]:
    def build(adam):
        tx = make(adam)
        return tx.init, update_cost._apply(tx)

    return build


# (name, params dtype, (adam -> (init, step))); the first is the reference.
UPDATE_APPROACHES: list[tuple[str, Any, Callable[[Any], tuple[Any, Any]]]] = [
    ("optax.adam", F32, _tx(lambda adam: adam)),
    ("jaxmp.loss_scaling(adam)", F32, _tx(jaxmp.loss_scaling)),
    (
        "jaxmp.mixed_precision(adam, 'p=f16,c=f16')",
        F16,
        _tx(lambda adam: jaxmp.mixed_precision(adam, "p=f16,c=f16")),
    ),
    ("optax.apply_if_finite(adam) + scaling", F32, update_cost._apply_if_finite),
    ("jmp glue", F32, update_cost._jmp),
    ("flax DynamicScale + jnp.where", F32, update_cost._flax),
    ("hand-written loss scaling (select after)", F32, update_cost._naive),
    ("hand-written f32 master + loss scaling, f16 params", F16, update_cost._naive_master),
]


def leaf_tree(n: int, dtype: Any, shape: tuple[int, ...] = (64, 64)) -> dict[str, jax.Array]:
    return {f"p{i:05d}": jnp.zeros(shape, dtype) for i in range(n)}


def compile_update(build: Callable, dtype: Any, n: int) -> dict[str, Any]:
    init, step = build(optax.adam(_fresh_lr()))
    params = leaf_tree(n, dtype)
    opt_state = jax.eval_shape(init, jax.tree.map(lambda p: p.astype(F32), params))
    result = lower_and_compile(step, params, opt_state, params)
    result["instructions"] = hlo_instructions(result.pop("compiled"))
    return result


def update_compile_times(
    leaves: list[int], repeats: int, names: list[str] | None = None
) -> dict[int, dict[str, dict[str, Any]]]:
    approaches = [a for a in UPDATE_APPROACHES if names is None or a[0] in names]
    try:
        import jmp  # noqa: F401, PLC0415
    except ImportError:  # jmp is optional
        approaches = [a for a in approaches if a[0] != "jmp glue"]
    for _, dtype, build in approaches:  # warm up: one-time costs of each code path
        compile_update(build, dtype, 2)
    out = {}
    for n in leaves:
        builders = {
            name: functools.partial(lambda b, d, n, r: compile_update(b, d, n), build, dtype, n)
            for name, dtype, build in approaches
        }
        out[n] = interleaved(builders, repeats)
        print(f"  ({n} leaves done)", file=sys.stderr, flush=True)
    return out


_OPCODE = re.compile(r"= \S+ ([a-z][\w\-]*)\(")
BREAKDOWN_OPCODES = ["parameter", "broadcast", "constant", "multiply", "select", "convert"]


def breakdown_rows(n: int = 64) -> list[list[str]]:
    """Instructions per leaf of the compiled update by opcode (deterministic), for plain Adam,
    `loss_scaling(adam)` and `mixed_precision` with float16 params."""
    rows = []
    for name, dtype, build in UPDATE_APPROACHES[:3]:
        compiled, _ = update_cost.compile_update(*build(optax.adam(1e-3)), leaf_tree(n, dtype))
        lines = _instruction_lines(compiled)
        ops = collections.Counter(m[1] for m in map(_OPCODE.search, lines) if m)
        total = len(lines)
        named = [ops[op] for op in BREAKDOWN_OPCODES]
        rows.append(
            [name, f"{total / n:.1f}", f"{ops['fusion'] / n:.2f}"]
            + [f"{c / n:.2f}" for c in named]
            + [f"{(total - sum(named) - ops['fusion']) / n:.2f}"]
        )
    return rows


BEFORE_AFTER = [
    "optax.adam",
    "jaxmp.loss_scaling(adam)",
    "jaxmp.mixed_precision(adam, 'p=f16,c=f16')",
]


def _child(root: str, name: str, n: int) -> None:
    """``--child ROOT NAME N``: prints one `compile_update` result as JSON (fresh process)."""
    import json  # noqa: PLC0415

    dtype, build = next((d, b) for a, d, b in UPDATE_APPROACHES if a == name)
    compile_update(build, dtype, 2)  # one-time costs of the code path
    print(json.dumps(compile_update(build, dtype, n)))


def before_after(before: str, leaves: list[int], repeats: int) -> dict[int, dict[str, Any]]:
    """Compile times with this checkout's jaxmp and with the one at `before`, interleaved.

    Each compile runs in a fresh process; the checkouts alternate in a rotating order.
    """
    import json  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    roots = {"after": os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "before": before}
    cases = [(w, name) for w in ("after", "before") for name in BEFORE_AFTER]
    out: dict[int, dict[str, Any]] = {}
    for n in leaves:
        samples: dict[tuple[str, str], list[dict[str, Any]]] = {c: [] for c in cases}
        for r in range(repeats):
            for case in cases[r % len(cases) :] + cases[: r % len(cases)]:
                which, name = case
                cmd = [sys.executable, os.path.abspath(__file__), "--child", roots[which], name]
                proc = subprocess.run([*cmd, str(n)], capture_output=True, text=True, check=True)
                samples[case].append(json.loads(proc.stdout.strip().splitlines()[-1]))
        out[n] = {
            case: {k: min(s[k] for s in runs) for k in ("lower", "compile", "total", "cpu")}
            | {"instructions": runs[0]["instructions"]}
            for case, runs in samples.items()
        }
        print(f"  ({n} leaves done)", file=sys.stderr, flush=True)
    return out


def before_after_table(results: dict[int, dict[Any, dict[str, Any]]]) -> str:
    rows = []
    for n, by_case in results.items():
        for name in BEFORE_AFTER:
            row = [str(n), name]
            for which in ("before", "after"):
                r, base = by_case[which, name], by_case[which, BEFORE_AFTER[0]]
                row += [
                    f"{r['total']:.2f}",
                    f"{r['total'] / base['total']:.2f}",
                    f"{r['cpu'] / base['cpu']:.2f}",
                    f"{r['instructions']:,}",
                ]
            rows.append(row)
    header = ["leaves", "update"]
    for which in ("before", "after"):
        header += [f"{which}: total s", "vs adam", "CPU vs adam", "HLO instructions"]
    return _hlo.table(header, rows)


def update_table(results: dict[int, dict[str, dict[str, Any]]]) -> str:
    rows = []
    for n, by_name in results.items():
        base = next(iter(by_name.values()))
        for name, r in by_name.items():
            rows.append(
                [
                    str(n),
                    name,
                    f"{r['lower']:.2f}",
                    f"{r['compile']:.2f}",
                    f"{r['total']:.2f}",
                    f"{r['total'] / base['total']:.2f}",
                    f"{r['cpu'] / base['cpu']:.2f}",
                    f"{r['instructions']:,}",
                ]
            )
    header = ["leaves", "update", "lower s", "compile s", "total s", "vs adam", "CPU vs adam"]
    return _hlo.table([*header, "HLO instructions"], rows)


# ---------------------------------------------------------------------------------------------
# 2. A full train step of the main job's transformer, unscanned, by layer count.


def _lm_model(layers: int, policy: Any, d_model: int = 64) -> Any:
    from examples.lm import model as lm  # noqa: PLC0415

    return lm.TransformerLM(
        vocab_size=64,
        max_len=32,
        num_layers=layers,
        num_heads=4,
        d_model=d_model,
        mlp_ratio=4,
        dtype=policy.compute_dtype,
        param_dtype=policy.param_dtype,
        output_dtype=policy.output_dtype,
    )


def _main_job_inner(learning_rate: float) -> optax.GradientTransformation:
    # The main job's optimizer (examples/lm/steps.py), with a constant learning rate.
    return optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(learning_rate, b2=0.99, weight_decay=0.01)
    )


def lm_train_step(
    approach: str, precision: str, layers: int, d_model: int = 64, batch: int = 4
) -> tuple[Callable, tuple[Any, ...]]:
    """``(step, abstract args)`` of the main job's train step, not jitted.

    `approach` is ``"optax"`` (plain `optax` in `precision`, no loss scaling), ``"jaxmp"``
    (`jaxmp.mixed_precision` and `jaxmp.value_and_grad`, as in `examples/lm/steps.py`) or
    ``"manual"`` (the same casts, loss scaling, finiteness check, selects and scale update
    written inline, selecting after the update).
    """
    from examples.lm import model as lm  # noqa: PLC0415

    policy = jaxmp.get_policy(precision)
    model = _lm_model(layers, policy, d_model)
    tokens = jax.ShapeDtypeStruct((batch, 33), jnp.int32)
    f32_model = _lm_model(layers, jaxmp.get_policy("float32"), d_model)
    params_f32 = jax.eval_shape(
        lambda: f32_model.init(jax.random.key(0), jnp.zeros((1, 32), jnp.int32))["params"]
    )
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, policy.param_dtype), params_f32)
    inner = _main_job_inner(_fresh_lr())

    def loss_fn(p, t):
        return lm.cross_entropy(model.apply({"params": p}, t[:, :-1]), t[:, 1:])

    if approach == "optax":
        opt_state = jax.eval_shape(inner.init, params)

        def step(p, s, t):
            loss, grads = jax.value_and_grad(loss_fn)(p, t)
            updates, s = inner.update(grads, s, p)
            return optax.apply_updates(p, updates), s, loss

        return step, (params, opt_state, tokens)

    if approach == "jaxmp":
        tx = jaxmp.mixed_precision(inner, policy)
        opt_state = jax.eval_shape(tx.init, params_f32)
        grad_fn = jaxmp.value_and_grad(loss_fn)

        def step(p, s, t):
            loss, grads = grad_fn(jaxmp.get_loss_scale(s), p, t)
            updates, s = tx.update(grads, s, p)
            return optax.apply_updates(p, updates), s, loss

        return step, (params, opt_state, tokens)

    # approach == "manual"; float32 params (mixed_float16 keeps them), dynamic scale 2**15.
    opt_state = (
        jax.eval_shape(inner.init, params),
        jax.ShapeDtypeStruct((), F32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )

    def step(p, s, t):
        inner_state, scale, counter = s
        loss, grads = jax.value_and_grad(lambda q: loss_fn(q, t) * scale)(p)
        grads = jax.tree.map(lambda g: g.astype(F32) * (1.0 / scale), grads)
        finite = jnp.stack([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]).all()
        updates, new_inner = inner.update(grads, inner_state, p)
        updates = jax.tree.map(lambda u: jnp.where(finite, u, 0.0), updates)
        inner_state = jax.tree.map(functools.partial(jnp.where, finite), new_inner, inner_state)
        scale, counter = update_cost._adjust(scale, counter, finite)
        return optax.apply_updates(p, updates), (inner_state, scale, counter), loss / scale

    return step, (params, opt_state, tokens)


DEEP_APPROACHES = [
    ("plain optax, float32", "optax", "float32"),
    ("plain optax, float16 compute, no loss scaling", "optax", "mixed_float16"),
    ("jaxmp, mixed_float16", "jaxmp", "mixed_float16"),
    ("hand-written, mixed_float16", "manual", "mixed_float16"),
]


def deep_compile_times(layers: list[int], repeats: int) -> dict[int, dict[str, dict[str, Any]]]:
    def build(approach, precision, n_layers, r):
        step, args = lm_train_step(approach, precision, n_layers)
        result = lower_and_compile(step, *args)
        result["instructions"] = hlo_instructions(result.pop("compiled"))
        return result

    out = {}
    for n_layers in layers:
        builders = {
            label: functools.partial(build, approach, precision, n_layers)
            for label, approach, precision in DEEP_APPROACHES
        }
        out[n_layers] = interleaved(builders, repeats)
        out[n_layers]["leaves"] = len(
            jax.tree.leaves(lm_train_step("optax", "float32", n_layers)[1][0])
        )
        print(f"  ({n_layers} layers done)", file=sys.stderr, flush=True)
    return out


def deep_table(results: dict[int, dict[str, dict[str, Any]]]) -> str:
    rows = []
    for n_layers, by_name in results.items():
        by_name = dict(by_name)
        leaves = by_name.pop("leaves")
        base = next(iter(by_name.values()))
        for name, r in by_name.items():
            rows.append(
                [
                    f"{n_layers} ({leaves})",
                    name,
                    f"{r['lower']:.2f}",
                    f"{r['compile']:.2f}",
                    f"{r['total']:.2f}",
                    f"{r['total'] / base['total']:.2f}",
                    f"{r['cpu'] / base['cpu']:.2f}",
                ]
            )
    header = ["layers (leaves)", "train step", "lower s", "compile s", "total s"]
    return _hlo.table([*header, "vs optax", "CPU vs optax"], rows)


# ---------------------------------------------------------------------------------------------
# 3. Autocast against explicit dtypes, unrolled and scanned.


def _autocast_models(layers: int, scan: bool, dtype: Any) -> Any:
    import autocast_cost  # noqa: PLC0415
    import flax.linen as nn  # noqa: PLC0415

    features, heads, vocab = 64, 4, 64
    if not scan:
        return autocast_cost.TransformerLM(vocab, features, layers, heads, dtype=dtype)

    class _ScanBody(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return autocast_cost.Block(features, heads, dtype=dtype)(x), None

    class ScannedLM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(vocab, features, dtype=dtype)(tokens)
            stack = nn.scan(
                _ScanBody,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=layers,
            )
            x, _ = stack(name="layers")(x, None)
            x = nn.LayerNorm(dtype=dtype)(x)
            return nn.Dense(vocab, dtype=dtype)(x)

    return ScannedLM()


def autocast_times(layers: list[int], repeats: int) -> dict[tuple[int, str], dict[str, Any]]:
    import autocast_cost  # noqa: PLC0415

    tokens = jnp.zeros((4, 33), jnp.int32)
    policy = jaxmp.get_policy("mixed_float16")
    out = {}

    def build(n_layers, scan, variant, r):
        del r
        explicit = variant == "explicit"
        model = _autocast_models(n_layers, scan, F16 if explicit else None)
        f32_model = _autocast_models(n_layers, scan, None)
        params = jax.eval_shape(lambda: f32_model.init(jax.random.key(0), tokens[:, :-1]))
        params = params["params"]
        wrap = (lambda f: f) if explicit else (lambda f: jaxmp.autocast(f, policy))
        step = autocast_cost._step_fn(model, wrap)
        # A fresh function object each time: nothing cached.
        fn = jax.jit(lambda p, t: step(p, t))
        t0, c0 = time.perf_counter(), _cpu_s()
        traced = fn.trace(params, tokens)
        t1 = time.perf_counter()
        traced.lower().compile()
        t2, c2 = time.perf_counter(), _cpu_s()
        return dict(lower=t1 - t0, compile=t2 - t1, total=t2 - t0, cpu=c2 - c0)

    for n_layers in layers:
        for scan in (False, True):
            layout = "nn.scan" if scan else "unrolled"
            builders = {
                variant: functools.partial(build, n_layers, scan, variant)
                for variant in ("explicit", "autocast")
            }
            for variant, r in interleaved(builders, repeats).items():
                out[n_layers, f"{layout}, {variant}"] = r
            print(f"  ({n_layers} layers, {layout} done)", file=sys.stderr, flush=True)
    return out


def autocast_table(results: dict[tuple[int, str], dict[str, Any]]) -> str:
    rows = []
    for (n_layers, name), r in results.items():
        layout, variant = name.split(", ")
        base = results[n_layers, f"{layout}, explicit"]
        rows.append(
            [
                str(n_layers),
                layout,
                variant,
                f"{r['lower']:.2f}",
                f"{r['compile']:.2f}",
                f"{r['total']:.2f}",
                f"{r['total'] / base['total']:.2f}",
            ]
        )
    header = ["layers", "layout", "model", "trace s", "lower+compile s", "total s"]
    return _hlo.table([*header, "vs explicit"], rows)


# ---------------------------------------------------------------------------------------------
# 4. Step time of the update at many leaves, jaxmp against the hand-written update.

STEP_APPROACHES = [
    ("hand-written loss scaling (select after)", F32, update_cost._naive),
    ("jaxmp.loss_scaling(adam)", F32, _tx(jaxmp.loss_scaling)),
    ("optax.adam (no loss scaling)", F32, _tx(lambda adam: adam)),
    ("hand-written f32 master + loss scaling, f16 params", F16, update_cost._naive_master),
    (
        "jaxmp.mixed_precision(adam, 'p=f16,c=f16')",
        F16,
        _tx(lambda adam: jaxmp.mixed_precision(adam, "p=f16,c=f16")),
    ),
]


def step_times(n: int, rounds: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    calls = {}
    for name, dtype, build in STEP_APPROACHES:
        init, step = build(optax.adam(1e-3))
        params = {
            k: jnp.asarray(rng.normal(size=v.shape), dtype) for k, v in leaf_tree(n, F32).items()
        }
        grads = jax.tree.map(lambda p: p * 1e-3, params)
        state = jax.jit(init)(jax.tree.map(lambda p: p.astype(F32), params))
        fn = jax.jit(step)
        jax.block_until_ready(fn(grads, state, params))
        calls[name] = (fn, grads, state, params)
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn, grads, state, params = calls[name]
            t0 = time.perf_counter()
            jax.block_until_ready(fn(grads, state, params))
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def step_table(times: dict[str, float]) -> str:
    refs = {F32: STEP_APPROACHES[0][0], F16: STEP_APPROACHES[3][0]}
    rows = []
    for name, dtype, _ in STEP_APPROACHES:
        ref = times[refs[dtype]]
        rows.append(
            [name, jnp.dtype(dtype).name, f"{times[name] * 1e3:.1f}", f"{times[name] / ref:.3f}"]
        )
    return _hlo.table(["update", "params", "ms / update", "vs hand-written"], rows)


# ---------------------------------------------------------------------------------------------
# 5. Memory: the compiled train step per policy, and bytes per parameter of the state.

MEMORY_SIZES = [(2, 128), (4, 256), (8, 256)]  # (layers, d_model)
MEMORY_POLICIES = ["float32", "mixed_float16", "mixed_bfloat16", "p=f16,c=f16", "p=bf16,c=bf16"]


def memory_table_rows(sizes=MEMORY_SIZES, policies=MEMORY_POLICIES) -> list[list[str]]:
    rows = []
    for n_layers, d_model in sizes:
        base = None
        for precision in policies:
            approach = "optax" if precision == "float32" else "jaxmp"
            step, args = lm_train_step(approach, precision, n_layers, d_model, batch=16)
            compiled = jax.jit(step).lower(*args).compile()
            mem = compiled.memory_analysis()
            n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(args[0]))
            temp = mem.temp_size_in_bytes
            base = temp if base is None else base
            rows.append(
                [
                    f"{n_layers} x {d_model} ({n_params / 1e6:.2f}M)",
                    precision + (" (plain optax)" if approach == "optax" else ""),
                    f"{mem.argument_size_in_bytes / 1e6:.2f}",
                    f"{temp / 1e6:.2f}",
                    f"{temp / base:.3f}",
                ]
            )
    return rows


def _state_policies() -> list[tuple[str, dict[str, Any]]]:
    """(policy, extra `mixed_precision` keywords) for the bytes-per-parameter table."""
    rows: list[tuple[str, dict[str, Any]]] = [(p, {}) for p in MEMORY_POLICIES]
    options = inspect.signature(jaxmp.mixed_precision).parameters
    if "master_weights" in options:  # half-precision params without a master copy
        rows += [("p=bf16,c=bf16", {"master_weights": False})]
    if "moments" in options:
        rows += [("p=bf16,c=bf16", {"moments": "bfloat16"})]
    if "rounding" in options:  # docs/guides/low_memory.md
        no_master = {"master_weights": False}
        rows += [
            ("p=bf16,c=bf16", {**no_master, "rounding": "kahan"}),
            ("p=bf16,c=bf16", {**no_master, "rounding": "stochastic", "moments": "bf16"}),
            ("p=bf16,c=bf16", {**no_master, "rounding": "stochastic", "moments": "int8"}),
            ("p=bf16,c=bf16", {**no_master, "rounding": "stochastic", "moments": "fp8"}),
        ]
    return rows


def _with_dtype(x: Any, dtype: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, dtype)


def state_bytes_rows(layers: int = 4, d_model: int = 256) -> list[list[str]]:
    """Bytes per parameter of params and optimizer state (`mixed_precision(adam)`)."""
    f32_model = _lm_model(layers, jaxmp.get_policy("float32"), d_model)
    params_f32 = jax.eval_shape(
        lambda: f32_model.init(jax.random.key(0), jnp.zeros((1, 32), jnp.int32))["params"]
    )
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params_f32))

    def nbytes(tree):
        return sum(
            int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
            for x in jax.tree.leaves(tree)
            if hasattr(x, "dtype")
        )

    rows = [
        [
            "plain optax.adam, float32",
            "float32",
            f"{nbytes(params_f32) / n:.2f}",
            f"{nbytes(jax.eval_shape(optax.adam(1e-3).init, params_f32)) / n:.2f}",
        ]
    ]
    for precision, extra in _state_policies():
        policy = jaxmp.get_policy(precision)
        try:
            tx = jaxmp.mixed_precision(optax.adam(1e-3), policy, **extra)
            state = jax.eval_shape(tx.init, params_f32)
        except (TypeError, ValueError) as e:  # an option this version does not have
            rows.append([f"mixed_precision(adam, {precision!r}, {extra})", str(e)[:40], "", ""])
            continue
        params = jax.tree.map(functools.partial(_with_dtype, dtype=policy.param_dtype), params_f32)
        label = ", ".join([repr(precision), *(f"{k}={v!r}" for k, v in extra.items())])
        rows.append(
            [
                f"mixed_precision(adam, {label})",
                jnp.dtype(policy.param_dtype).name,
                f"{nbytes(params) / n:.2f}",
                f"{nbytes(state) / n:.2f}",
            ]
        )
    for row in rows:
        if row[2] and row[3]:
            row.append(f"{float(row[2]) + float(row[3]):.2f}")
    return rows


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        _child(argv[1], argv[2], int(argv[3]))
        return
    sections = ["update", "breakdown", "deep", "autocast", "steptime", "memory"]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", choices=sections, default=sections)
    parser.add_argument("--leaves", type=int, nargs="+", default=[10, 100, 250])
    parser.add_argument("--repeats", type=int, default=2, help="fresh compiles per figure")
    parser.add_argument(
        "--approaches", nargs="+", default=None, help="update rows to run (names as printed)"
    )
    parser.add_argument(
        "--before",
        default=None,
        help="another checkout (e.g. a git worktree of an older commit): with --only update, "
        "compile optax.adam, loss_scaling and mixed_precision p=f16 with both, in fresh "
        "processes, interleaved",
    )
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 12])
    parser.add_argument("--autocast-layers", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--steptime-leaves", type=int, default=250)
    parser.add_argument("--rounds", type=int, default=30, help="step-time rounds")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    print(_hlo.machine())
    if "update" in args.only and args.before:
        results = before_after(args.before, args.leaves, args.repeats)
        print(
            f"\nCompile time of one update + apply_updates, jaxmp at {args.before} (before) "
            f"and here (after), best of {args.repeats} fresh processes, interleaved\n"
        )
        print(before_after_table(results))
    elif "update" in args.only:
        results = update_compile_times(args.leaves, args.repeats, args.approaches)
        print(
            f"\nCompile time of one update + apply_updates, leaves of 64x64, "
            f"best of {args.repeats} fresh compiles, interleaved\n"
        )
        print(update_table(results))
    if "breakdown" in args.only:
        print(
            "\nInstructions per leaf of the compiled update + apply_updates by opcode, 64 "
            "leaves of 64x64 (deterministic)\n"
        )
        header = ["update", "per leaf", "fusions", *BREAKDOWN_OPCODES, "other"]
        print(_hlo.table(header, breakdown_rows()))
    if "deep" in args.only:
        results = deep_compile_times(args.layers, args.repeats)
        print(
            "\nCompile time of the main job's train step (examples/lm/model.py, d_model 64, "
            f"unscanned), best of {args.repeats} fresh compiles, interleaved\n"
        )
        print(deep_table(results))
    if "autocast" in args.only:
        results = autocast_times(args.autocast_layers, args.repeats)
        print(
            "\nAutocast against explicit float16 dtypes: trace and lower+compile time of a "
            f"training step (width 64), best of {args.repeats}, interleaved\n"
        )
        print(autocast_table(results))
    if "steptime" in args.only:
        times = step_times(args.steptime_leaves, args.rounds)
        print(
            f"\nStep time of the update at {args.steptime_leaves} leaves of 64x64, median of "
            f"{args.rounds} interleaved rounds\n"
        )
        print(step_table(times))
    if "memory" in args.only:
        print(
            "\nMemory of the main job's train step (batch 16, sequence 32), "
            "compiled.memory_analysis()\n"
        )
        header = ["model", "policy", "arguments MB", "temp MB", "temp vs float32"]
        print(_hlo.table(header, memory_table_rows()))
        print(
            "\nBytes per parameter of params and optimizer state (adam), from the state pytrees\n"
        )
        header = ["optimizer", "param dtype", "params B/param", "state B/param", "total B/param"]
        print(_hlo.table(header, state_bytes_rows()))
    print(f"\n(total {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    _hlo.real_compiles()
    main()
