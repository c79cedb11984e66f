"""Extra memory of every entry point that builds or transforms state, at a real model's sizes.

A user's largest leaf is a vocabulary-sized embedding or head: 4096 x 65536 in bfloat16 is
0.5 GB (an 8B model's head is 1 GB). For each entry point, one process of its own builds the
inputs, then calls the entry point while a thread samples the process's resident memory
(``/proc/self/statm``, every millisecond); the peak over the resident memory before the call
is the call's *extra memory*, compared with the bytes the call returns (state, quantised
params) or, for `jaxmp.quantize`, with the largest leaf. ``MALLOC_MMAP_THRESHOLD_`` makes the C
allocator hand every buffer of 64 KiB or more back when it is freed, so that the resident
memory before a call is not left over from an earlier one.

Bounds (each row says whether it holds): state-building calls (``init``, jitted ``update``)
at most 1.25x what they return; `jaxmp.quantize` at most 2x the largest leaf over what it
returns (the quantised params); `jaxmp.quantized` at run time at most one dequantised copy of
the largest weight in the compute dtype more than the unquantised model's own call.

Each entry point is measured twice in its process: its first call (tracing and compiling
included) and a second, warm, call on the same inputs. A row holds its bound when both calls'
extra memory is within it, plus `SLACK` for what does not scale with the model (the
compiler's own memory on a first call, Python objects, the sampler's resolution); a ratio is
shown where the reference is at least `SLACK`. Resident memory counts the pages a call
writes: a buffer of zeros the allocator hands out untouched is not resident until written.

Run from the repository root::

    PYTHONPATH=. python benchmarks/memory_at_scale.py                 # 4096 x 65536, 24 layers
    PYTHONPATH=. python benchmarks/memory_at_scale.py --rows 1024 --cols 16384 --no-stack
    PYTHONPATH=. python benchmarks/memory_at_scale.py --only quantize
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GB = 1e9

#: The bound of each kind of case, as a multiple of its reference (returned bytes or leaf).
BOUNDS = {"state": 1.25, "quantize": 2.0, "run": 1.0}
#: Extra memory allowed over each bound: what does not grow with the model (bytes).
SLACK = 64 * 2**20


# --------------------------------------------------------------------------------------------
# Measuring one call (in the child process).


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Peak:
    """The peak resident memory while the ``with`` block runs, sampled by a thread."""

    def __enter__(self) -> _Peak:
        self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _buffers(tree: Any) -> dict[int, int]:
    """The device buffers of `tree`'s arrays: pointer -> bytes (each shard counted once)."""
    import jax

    out = {}
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            for shard in leaf.addressable_shards:
                out[shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
    return out


def _measure(call, inputs: Any) -> dict[str, float]:
    """Runs ``call()`` twice; the extra memory and seconds of each, and the bytes returned
    (buffers of `inputs` that the result shares are not counted as returned)."""
    import jax

    result: dict[str, float] = {}
    for name in ("first", "warm"):
        gc.collect()
        before = _rss()
        t0 = time.perf_counter()
        with _Peak() as peak:
            out = call()
            jax.block_until_ready(out)
        seconds = time.perf_counter() - t0
        given = _buffers(inputs)
        returned = sum(b for p, b in _buffers(out).items() if p not in given)
        result[f"{name}_extra"] = peak.peak - before
        result[f"{name}_seconds"] = seconds
        result["returned"] = returned
        del out
    return result


# --------------------------------------------------------------------------------------------
# The inputs.


def _leaf(rows: int, cols: int, seed: int, dtype: Any) -> Any:
    """A (rows, cols) weight of normal values / sqrt(rows), made row block by row block so
    that no float32 copy of the whole leaf exists."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    out = np.empty((rows, cols), jnp.dtype(dtype))
    step = max(1, (1 << 24) // cols)
    for r in range(0, rows, step):
        block = rng.standard_normal((min(step, rows - r), cols), np.float32)
        out[r : r + step] = block / np.float32(np.sqrt(rows))
    return jax.device_put(out)


def _head_model(rows: int, cols: int) -> tuple[Any, Any, Any]:
    """A vocabulary head: ``x @ w`` for a (rows, cols) bfloat16 `w`."""
    import jax.numpy as jnp

    params = {"head": _leaf(rows, cols, 0, jnp.bfloat16)}

    def fun(p, x):
        return x @ p["head"]

    return fun, params, jnp.ones((8, rows), jnp.bfloat16)


STACK_LAYERS = 24


def _stack_model(d_model: int, vocab: int) -> tuple[Any, Any, Any]:
    """A 24-layer decoder's params, its layers stacked (scanned over), in bfloat16, and a
    forward pass over them (matmuls only: the shapes are what this measures)."""
    import jax
    import jax.numpy as jnp

    d, ff, n = d_model, 4 * d_model, STACK_LAYERS
    seed = iter(range(100))

    def stacked(a: int, b: int) -> Any:
        return jnp.stack([_leaf(a, b, next(seed), jnp.bfloat16) for _ in range(n)])

    params = {
        "embed": _leaf(vocab, d, next(seed), jnp.bfloat16),
        "layers": {
            "qkv": stacked(d, 3 * d),
            "out": stacked(d, d),
            "up": stacked(d, ff),
            "down": stacked(ff, d),
            "norm": jnp.ones((n, d), jnp.bfloat16),
        },
        "head": _leaf(d, vocab, next(seed), jnp.bfloat16),
    }

    def fun(p, tokens):
        x = p["embed"][tokens]

        def layer(x, lp):
            h = x * lp["norm"]
            qkv = h @ lp["qkv"]
            x = x + qkv[..., :d] @ lp["out"]
            x = x + jax.nn.gelu(x @ lp["up"]) @ lp["down"]
            return x, None

        x, _ = jax.lax.scan(layer, x, p["layers"])
        return x @ p["head"]

    return fun, params, jnp.zeros((8,), jnp.int32)


# --------------------------------------------------------------------------------------------
# The cases: name -> (kind, what it runs).

OPTIMIZERS = {
    # mixed_precision's configurations (bfloat16 params), by the name of the row.
    "master weights": dict(policy="p=bf16,c=bf16"),
    "no master copy, nearest": dict(policy="p=bf16,c=bf16", master_weights=False),
    "no master copy, bf16 moments, stochastic": dict(
        policy="p=bf16,c=bf16", master_weights=False, rounding="stochastic", moments="bfloat16"
    ),
    "no master copy, int8 moments, stochastic": dict(
        policy="p=bf16,c=bf16", master_weights=False, rounding="stochastic", moments="int8"
    ),
    "no master copy, int8 moments, nearest": dict(
        policy="p=bf16,c=bf16", master_weights=False, moments="int8"
    ),
    "no master copy, fp8 moments, kahan": dict(
        policy="p=bf16,c=bf16", master_weights=False, rounding="kahan", moments="fp8"
    ),
}
STANDALONE = ("compress_state int8", "stochastic_rounding", "kahan_summation", "master_weights")
RECIPES = ("int8", "int8_dynamic", "fp8", "int4")


def cases(stack: bool) -> list[str]:
    out = []
    models = ["head"] + (["stack"] if stack else [])
    for model in models:
        for name in OPTIMIZERS:
            for how in ("init eager", "init jitted", "update jitted"):
                out.append(f"{model}|mixed_precision {name}|{how}")
        for name in STANDALONE:
            out.append(f"{model}|{name}|init eager")
        for recipe in RECIPES:
            out.append(f"{model}|quantize {recipe}|eager")
            out.append(f"{model}|quantize {recipe}|jitted")
            out.append(f"{model}|quantized {recipe}|run")
        out.append(f"{model}|bf16 model|run")
        out.append(f"{model}|fp8 delayed state|init")
    return out


def _transform(name: str) -> Any:
    import jax.numpy as jnp
    import optax

    import jaxmp

    adam = optax.adam(1e-3)
    if name.startswith("mixed_precision "):
        return jaxmp.mixed_precision(adam, **OPTIMIZERS[name.removeprefix("mixed_precision ")])
    return {
        "compress_state int8": lambda: jaxmp.compress_state(adam, "int8"),
        "stochastic_rounding": lambda: jaxmp.stochastic_rounding(adam),
        "kahan_summation": lambda: jaxmp.kahan_summation(adam, jnp.bfloat16),
        "master_weights": lambda: jaxmp.master_weights(adam),
    }[name]()


def run_case(case: str, rows: int, cols: int) -> dict[str, Any]:
    """Builds the inputs of `case` and measures it (in this process)."""
    import jax
    import jax.numpy as jnp
    import optax

    import jaxmp

    model, entry, how = case.split("|")
    fun, params, x = _head_model(rows, cols) if model == "head" else _stack_model(rows, cols)
    leaves = jax.tree.leaves(params)
    largest = max(leaf.nbytes for leaf in leaves)
    reference = None  # the bytes the bound is a multiple of; None: the returned bytes
    inputs: Any = params
    if entry.startswith("quantize "):
        kind, recipe = "quantize", entry.split()[1]
        reference = largest
        if how == "eager":
            call = lambda: jaxmp.quantize(fun, params, x, recipe=recipe)  # noqa: E731
        else:
            jitted = jax.jit(lambda p: jaxmp.quantize(fun, p, x, recipe=recipe))
            call = lambda: jitted(params)  # noqa: E731
    elif entry.startswith("quantized ") or entry == "bf16 model":
        kind = "run"
        if entry == "bf16 model":
            run, inputs = jax.jit(fun), params
        else:
            inputs = jaxmp.quantize(fun, params, x, recipe=entry.split()[1])
            run = jaxmp.quantized(fun)
        jax.block_until_ready(inputs)
        call = lambda: run(inputs, x)  # noqa: E731
        # One dequantised copy of the largest weight, in the compute dtype.
        reference = largest
    elif entry == "fp8 delayed state":
        kind = "state"
        f = jaxmp.autocast(fun, "mixed_bfloat16", fp8=jaxmp.DelayedScaling())
        call = lambda: f.fp8_init(params, x)  # noqa: E731
    else:
        kind = "state"
        tx = _transform(entry)
        if how == "init eager":
            call = lambda: tx.init(params)  # noqa: E731
        elif how == "init jitted":
            init = jax.jit(tx.init)
            call = lambda: init(params)  # noqa: E731
        else:
            state = jax.jit(tx.init)(params)
            grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
            jax.block_until_ready((state, grads))
            inputs = (params, state, grads)

            @jax.jit
            def update(grads, state, params):
                updates, state = tx.update(grads, state, params)
                return optax.apply_updates(params, updates), state

            call = lambda: update(grads, state, params)  # noqa: E731
    measured = _measure(call, inputs)
    ref = measured["returned"] if reference is None else reference
    return {
        "case": case,
        "kind": kind,
        "leaf_bytes": largest,
        "param_bytes": sum(leaf.nbytes for leaf in leaves),
        "reference": ref,
        **measured,
    }


# --------------------------------------------------------------------------------------------
# The table (in the parent process).


def _row(r: dict[str, Any]) -> str:
    model, entry, how = r["case"].split("|")
    bound = BOUNDS[r["kind"]]
    shown, holds = [], True
    for name in ("first", "warm"):
        extra = r[f"{name}_extra"]
        if r["kind"] == "run":
            # Over the unquantised model's own call (its row's extra memory).
            extra -= r.get("plain_extra", {}).get(name, 0)
        elif r["kind"] == "quantize":
            # The temporaries: over the quantised weights it returns (a whole model's can
            # be larger than its largest leaf).
            extra -= r["returned"]
        holds = holds and extra <= bound * r["reference"] + SLACK
        ratio = f" ({extra / r['reference']:.2f}x)" if r["reference"] >= SLACK else ""
        shown.append(f"{r[f'{name}_extra'] / GB:.3f} GB{ratio}")
    of = {
        "state": "returned",
        "quantize": "largest leaf, over what it returns",
        "run": "largest leaf, over the bf16 model",
    }[r["kind"]]
    return (
        f"| {model} | {entry} | {how} | {r['returned'] / GB:.3f} GB | {shown[0]} | {shown[1]} | "
        f"{r['first_seconds']:.2f} s / {r['warm_seconds']:.2f} s | "
        f"<= {bound}x {of}: {'yes' if holds else '**no**'} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4096, help="the head's rows (d_model)")
    parser.add_argument("--cols", type=int, default=65536, help="the head's columns (vocab)")
    parser.add_argument("--stack-d-model", type=int, default=1024, help="the stack's d_model")
    parser.add_argument("--stack-vocab", type=int, default=32768, help="the stack's vocabulary")
    parser.add_argument("--no-stack", action="store_true", help="the head alone")
    parser.add_argument("--only", default="", help="run the cases whose name holds this")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, in a child process
    parser.add_argument("--table", help="print the table of a --json file, measuring nothing")
    args = parser.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            for r in json.load(f):
                print(_row(r))
        return 0

    if args.case:
        model = args.case.split("|")[0]
        dims = (args.rows, args.cols) if model == "head" else (args.stack_d_model, args.stack_vocab)
        print(json.dumps(run_case(args.case, *dims)))
        return 0

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
    }
    rows, plain = [], {}
    print(
        f"head: {args.rows} x {args.cols} bfloat16; stack: {STACK_LAYERS} layers, d_model "
        f"{args.stack_d_model}, vocabulary {args.stack_vocab}\n"
    )
    print(
        "| model | entry point | call | returns | extra, first call | extra, warm | seconds "
        "(first / warm) | bound |"
    )
    print("|---|---|---|---|---|---|---|---|")
    selected = [c for c in cases(not args.no_stack) if args.only in c]
    # The unquantised model's run first: the quantised runs are compared with it.
    selected.sort(key=lambda c: "bf16 model" not in c)
    for case in selected:
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--case",
            case,
            "--rows",
            str(args.rows),
            "--cols",
            str(args.cols),
            "--stack-d-model",
            str(args.stack_d_model),
            "--stack-vocab",
            str(args.stack_vocab),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            print(f"| {case} | failed: {proc.stderr.strip().splitlines()[-1:]} |", flush=True)
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        model = case.split("|")[0]
        if "bf16 model" in case:
            plain[model] = {"first": r["first_extra"], "warm": r["warm_extra"]}
        if r["kind"] == "run":
            r["plain_extra"] = plain.get(model, {})
        rows.append(r)
        print(_row(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
