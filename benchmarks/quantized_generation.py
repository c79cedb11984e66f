"""Generation with quantised weights and a quantised key/value cache: a decoder's tokens/s and
memory, bfloat16 against each `jaxmp.quantize` recipe and each `jaxmp.KVCache` format, and the
int8/FP8 GEMMs of its compiled programs.

The model is a pre-norm transformer decoder in plain JAX (`Config`; params a dict, layers
stacked and run by `lax.scan`, a `jaxmp.KVCache` stacked the same way), bfloat16 params and
activations, attention scores and softmax in float32. Its function ``step(params, cache,
tokens, pos)`` runs ``tokens`` (``(batch, length)``) at positions ``pos, pos + 1, ...``
against the cache and returns the next token's logits and the cache; it is the unmodified
model for every row, run by `jaxmp.quantized` with params from `jaxmp.quantize` (the matmul
weights, the head included, found from the function; the embedding is a lookup and stays
bfloat16).

For each batch size (1 and 64), each of bfloat16, ``int8``, ``int8_dynamic``, ``fp8`` and
``int4`` with a bfloat16 cache, and bfloat16 weights with an int8 and an FP8 cache (``int8
KV``, ``fp8 KV``: one scale per head and position, the attention reading the one-byte values
with the scales applied outside its products): **decode**: ``new_tokens`` greedy steps of one
token per sequence in one jitted ``lax.fori_loop`` (each step reads every weight once and the
whole cache: memory-bound), tokens/s = ``batch * new_tokens / median time``; **prefill**: the
``prompt`` tokens of each sequence in one call, tokens/s = ``batch * prompt / median time``;
the bytes of the params and of the cache, the compiled decode program's temporaries
(``memory_analysis()``), and the low-precision GEMMs: the ``dot_general``s of the lowered
decode program whose operands are both int8 or both FP8 (`_hlo.quantized_gemms`) and the GEMMs
of the compiled program reading an int8, int4 or FP8 operand
(`_hlo.compiled_low_precision_gemms`: XLA's cuBLAS or Triton calls on a GPU, where a
weight-only int8 GEMM reads its int8 weight only if XLA fused the conversion into it). The
lines after the table give the ratios the targets are about (on a GPU: int8 weight-only decode
at batch 1 >= 1.5x bfloat16's tokens/s at d_model 4096; an int8 cache's decode at batch 64
>= 1.2x the bfloat16 cache's; int8 weights + activations or FP8 prefill at batch 64 >= 1.3x).

Run from the repository root (a part of `gpu_benchmark.py` too)::

    PYTHONPATH=. python benchmarks/quantized_generation.py
    PYTHONPATH=. python benchmarks/quantized_generation.py --tiny   # a CPU smoke test
    PYTHONPATH=. python benchmarks/quantized_generation.py --tiny --lower cuda   # no GPU needed
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _hlo  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import jaxmp  # noqa: E402

RECIPES = ("int8", "int8_dynamic", "fp8", "int4")
KV_CACHES = ("int8", "fp8")  # rows "int8 KV" and "fp8 KV": bfloat16 weights, a quantised cache
BATCHES = (1, 64)


@dataclasses.dataclass(frozen=True)
class Config:
    d_model: int = 4096
    layers: int = 4
    heads: int = 32
    mlp_ratio: int = 4
    vocab: int = 32000
    prompt: int = 256  # tokens per sequence in prefill
    new_tokens: int = 64  # decoded per sequence

    @property
    def context(self) -> int:  # the cache's length
        return self.prompt + self.new_tokens


CONFIGS = {
    "default": Config(),
    "tiny": Config(d_model=128, layers=2, heads=4, vocab=256, prompt=16, new_tokens=8),
}
BF16 = jnp.dtype(jnp.bfloat16)


def init_params(config: Config, seed: int = 0) -> dict[str, Any]:
    """Random bfloat16 params (normal, scaled by fan-in): one dict, layers stacked."""
    d, hidden, n = config.d_model, config.mlp_ratio * config.d_model, config.layers
    shapes = {
        "wq": (n, d, d), "wk": (n, d, d), "wv": (n, d, d), "wo": (n, d, d),
        "w1": (n, d, hidden), "w2": (n, hidden, d),
    }  # fmt: skip
    keys = jax.random.split(jax.random.key(seed), len(shapes) + 2)

    def normal(key: Any, shape: tuple[int, ...]) -> jax.Array:
        return (jax.random.normal(key, shape, jnp.float32) / math.sqrt(shape[-2])).astype(BF16)

    layers = {name: normal(k, s) for k, (name, s) in zip(keys, shapes.items(), strict=False)}
    layers["norm1"] = jnp.ones((n, d), BF16)
    layers["norm2"] = jnp.ones((n, d), BF16)
    return {
        "embed": jax.random.normal(keys[-2], (config.vocab, d), jnp.float32).astype(BF16),
        "layers": layers,
        "norm": jnp.ones((d,), BF16),
        "head": normal(keys[-1], (d, config.vocab)),
    }


def empty_cache(config: Config, batch: int, kv_cache: str | None = None) -> jaxmp.KVCache:
    """An empty cache of every layer, ``(layers, batch, context, heads, head_dim)``: bfloat16
    (`kv_cache` None), or ``"int8"`` or ``"fp8"`` read back in bfloat16."""
    shape = (config.layers, batch, config.context, config.heads, config.d_model // config.heads)
    return jaxmp.KVCache.create(shape, kv_cache, dtype=BF16)


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (normed * scale.astype(jnp.float32)).astype(x.dtype)


def make_step(config: Config) -> Any:
    """``step(params, cache, tokens, pos) -> (logits of the last token, cache)``."""
    heads, d = config.heads, config.d_model
    head_dim = d // heads

    def layer(x: jax.Array, layer_and_cache: Any, pos: jax.Array) -> Any:
        p, cache = layer_and_cache
        batch, length, _ = x.shape
        h = _rms_norm(x, p["norm1"])

        def split(y: jax.Array) -> jax.Array:
            return y.reshape(batch, length, heads, head_dim)

        cache = cache.update(split(h @ p["wk"]), split(h @ p["wv"]), pos)
        attended = cache.attend(split(h @ p["wq"]), pos).reshape(batch, length, d)
        x = x + attended @ p["wo"]
        h = _rms_norm(x, p["norm2"])
        x = x + jax.nn.gelu(h @ p["w1"]) @ p["w2"]
        return x, cache

    def step(params: Any, cache: Any, tokens: jax.Array, pos: jax.Array) -> Any:
        x = jnp.take(params["embed"], tokens, axis=0)
        body = functools.partial(layer, pos=pos)
        x, cache = lax.scan(body, x, (params["layers"], cache))
        logits = _rms_norm(x[:, -1], params["norm"]) @ params["head"]
        return logits.astype(jnp.float32), cache

    return step


def make_programs(config: Config, quantized: bool) -> tuple[Any, Any]:
    """``(prefill, decode)``: prefill(params, cache, prompt) -> (next tokens, cache);
    decode(params, cache, first, pos) -> the ``new_tokens`` tokens generated greedily."""
    step = make_step(config)
    run = jaxmp.quantized(step) if quantized else step

    def prefill(params: Any, cache: Any, prompt: jax.Array) -> Any:
        logits, cache = run(params, cache, prompt, jnp.zeros((), jnp.int32))
        return jnp.argmax(logits, -1).astype(jnp.int32), cache

    def decode(params: Any, cache: Any, first: jax.Array, pos: jax.Array) -> jax.Array:
        # Column 0 is the prefill's token; step i reads column i and writes column i + 1.
        out = jnp.zeros((first.shape[0], config.new_tokens + 1), jnp.int32).at[:, 0].set(first)

        def body(i: jax.Array, carry: Any) -> Any:
            cache, out = carry
            token = lax.dynamic_index_in_dim(out, i, 1)
            logits, cache = run(params, cache, token, pos + i)
            nxt = jnp.argmax(logits, -1).astype(jnp.int32)
            return cache, lax.dynamic_update_index_in_dim(out, nxt, i + 1, 1)

        return lax.fori_loop(0, config.new_tokens, body, (cache, out))[1][:, 1:]

    return prefill, decode


def quantize_params(config: Config, params: Any, recipe: str | None, cache: Any) -> Any:
    """`params` quantised with `recipe` (None: as they are) by `jaxmp.quantize` of the decoder's
    step, traced with `cache` and one token per sequence."""
    if recipe is None:
        return params
    tokens = jnp.zeros((cache.shape[1], 1), jnp.int32)
    pos = jnp.zeros((), jnp.int32)
    return jaxmp.quantize(make_step(config), params, cache, tokens, pos, recipe=recipe)


def param_bytes(params: Any) -> int:
    return sum(int(x.nbytes) for x in jax.tree.leaves(params))


def _timed(compiled: Any, args: tuple[Any, ...], repeats: int) -> float:
    jax.block_until_ready(compiled(*args))  # warm-up
    return _hlo.median_time(lambda: jax.block_until_ready(compiled(*args)), repeats)


def measure_row(
    config: Config,
    params: Any,
    recipe: str | None,
    batch: int,
    repeats: int,
    kv_cache: str | None = None,
) -> dict[str, Any]:
    """One row: `recipe` (None: bfloat16) at `batch`, with a `kv_cache` cache (None:
    bfloat16)."""
    cache = empty_cache(config, batch, kv_cache)
    prompt = jax.random.randint(jax.random.key(1), (batch, config.prompt), 0, config.vocab)
    params = quantize_params(config, params, recipe, cache)
    prefill, decode = make_programs(config, quantized=recipe is not None)
    t0 = time.perf_counter()
    prefill_c = jax.jit(prefill).lower(params, cache, prompt).compile()
    first, filled = prefill_c(params, cache, prompt)
    pos = jnp.asarray(config.prompt, jnp.int32)
    decode_lowered = jax.jit(decode).lower(params, filled, first, pos)
    decode_c = decode_lowered.compile()
    compile_s = time.perf_counter() - t0
    prefill_s = _timed(prefill_c, (params, cache, prompt), repeats)
    decode_s = _timed(decode_c, (params, filled, first, pos), repeats)
    tokens = decode_c(params, filled, first, pos)
    return dict(
        decode_tps=batch * config.new_tokens / decode_s,
        prefill_tps=batch * config.prompt / prefill_s,
        param_bytes=param_bytes(params),
        cache_bytes=cache.nbytes,
        temp=decode_c.memory_analysis().temp_size_in_bytes,
        gemms_lowered=len(_hlo.quantized_gemms(decode_lowered.as_text())),
        gemms_compiled=_hlo.compiled_low_precision_gemms(decode_c.as_text()),
        compile_s=compile_s,
        tokens=tokens,
    )


def measure(
    config: Config,
    recipes: Sequence[str] = RECIPES,
    batches: Sequence[int] = BATCHES,
    repeats: int = 5,
    deadline: float = math.inf,
    progress: Any = None,
    kv_caches: Sequence[str] = KV_CACHES,
) -> dict[tuple[str, int], dict[str, Any] | None]:
    """Every row, bfloat16 first at each batch, then the recipes, then bfloat16 weights with
    each of `kv_caches` (rows ``"int8 KV"``, ``"fp8 KV"``); a row past `deadline` is None, a
    row that raised (out of memory, say) ``{"error": ...}``. `progress(message)` before and
    after each."""
    params = init_params(config)
    results: dict[tuple[str, int], dict[str, Any] | None] = {}
    rows = [*((name, name, None) for name in ("bf16", *recipes))]
    rows += [(f"{kv} KV", "bf16", kv) for kv in kv_caches]
    for batch in batches:
        for name, weights, kv_cache in rows:
            if time.perf_counter() > deadline:
                results[name, batch] = None
                continue
            if progress:
                progress(f"generation {name}, batch {batch}: compiling and timing")
            try:
                recipe = None if weights == "bf16" else weights
                row = measure_row(config, params, recipe, batch, repeats, kv_cache)
            except Exception as e:  # noqa: BLE001
                row = {"error": _hlo.error_line(e)}
            results[name, batch] = row
            if progress:
                progress(f"generation {name}, batch {batch}: {_describe(row)}")
    return results


def _describe(row: dict[str, Any] | None) -> str:
    if row is None:
        return "skipped (time budget)"
    if "error" in row:
        return row["error"]
    return f"decode {row['decode_tps']:,.0f} tokens/s, prefill {row['prefill_tps']:,.0f} tokens/s"


def report(config: Config, results: dict[tuple[str, int], dict[str, Any] | None]) -> str:
    """The table and the target ratios (each against bfloat16 at the same batch)."""
    header = [
        "recipe", "batch", "decode tokens/s", "vs bf16", "prefill tokens/s", "vs bf16",
        "param GB", "vs bf16", "KV cache MB", "vs bf16", "decode temp GB",
        "int8/FP8 GEMMs (lowered / compiled)", "compile s",
    ]  # fmt: skip
    rows = []
    for (name, batch), r in results.items():
        if r is None or "error" in r:
            rows.append([name, batch, _describe(r)] + [""] * (len(header) - 3))
            continue
        base = results.get(("bf16", batch))
        ok = base is not None and "error" not in base

        def ratio(key: str, r: dict[str, Any] = r, base: Any = base, ok: bool = ok) -> str:
            return f"{r[key] / base[key]:.2f}" if ok else ""

        rows.append(
            [
                name, batch, f"{r['decode_tps']:,.0f}", ratio("decode_tps"),
                f"{r['prefill_tps']:,.0f}", ratio("prefill_tps"),
                f"{r['param_bytes'] / 1e9:.3f}", ratio("param_bytes"),
                f"{r['cache_bytes'] / 1e6:.3f}", ratio("cache_bytes"),
                f"{r['temp'] / 1e9:.3f}", f"{r['gemms_lowered']} / {r['gemms_compiled']}",
                f"{r['compile_s']:.1f}",
            ]
        )  # fmt: skip
    lines = [
        f"Generation, d_model {config.d_model}, {config.layers} layers, vocab {config.vocab}: "
        f"prefill of {config.prompt} tokens, decode of {config.new_tokens} (KV cache of "
        f"{config.context} positions); bfloat16 params, activations and cache, each recipe from "
        "jaxmp.quantize of the same params, the KV rows with bfloat16 weights and a "
        "jaxmp.KVCache\n",
        _hlo.table(header, rows),
        "",
    ]
    targets = [
        ("int8", 1, "decode_tps", "decode", 1.5),
        ("int8 KV", 64, "decode_tps", "decode", 1.2),
        ("int8_dynamic", 64, "prefill_tps", "prefill", 1.3),
        ("fp8", 64, "prefill_tps", "prefill", 1.3),
    ]
    for name, batch, key, what, target in targets:
        r, base = results.get((name, batch)), results.get(("bf16", batch))
        if r and base and "error" not in r and "error" not in base:
            lines.append(
                f"{name}, batch {batch}: {r[key] / base[key]:.2f}x bfloat16's {what} tokens/s "
                f"(target on a GPU: {target}x)"
            )
    return "\n".join(lines)


def lowered_gemms(config: Config, platform: str) -> dict[str, list[dict[str, Any]]]:
    """Per recipe (and ``"bf16"``), the int8/FP8 GEMMs of the decode program lowered for
    `platform` (``"cuda"`` needs jax's CUDA plugin installed, not a GPU)."""
    params = init_params(config)
    cache = empty_cache(config, 1)
    first, pos = jnp.zeros((1,), jnp.int32), jnp.asarray(config.prompt, jnp.int32)
    found = {}
    for name in ("bf16", *RECIPES):
        recipe = None if name == "bf16" else name
        p = quantize_params(config, params, recipe, cache)
        decode = make_programs(config, quantized=recipe is not None)[1]
        lowered = jax.jit(decode).trace(p, cache, first, pos).lower(lowering_platforms=(platform,))
        found[name] = _hlo.quantized_gemms(lowered.as_text())
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model, for a CPU smoke test")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per program (median)")
    parser.add_argument(
        "--budget-s", type=float, default=600.0, help="rows not started by then are skipped"
    )
    parser.add_argument(
        "--lower",
        metavar="PLATFORM",
        help="only lower the decode programs for PLATFORM (cuda: with jax's CUDA plugin, no "
        "GPU needed) and print their int8/FP8 GEMMs",
    )
    args = parser.parse_args(argv)
    config = CONFIGS["tiny" if args.tiny else "default"]
    if args.lower:
        for name, gemms in lowered_gemms(config, args.lower).items():
            kinds = sorted(
                {f"{a} x {b} -> {r}" for (a, b), r in ((g["operands"], g["result"]) for g in gemms)}
            )
            print(f"{name}: {len(gemms)} int8/FP8 GEMMs per decode step {kinds}")
        return
    start = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - start:5.0f} s] {message}", file=sys.stderr, flush=True)

    print(_hlo.machine())
    results = measure(
        config, repeats=args.repeats, deadline=start + args.budget_s, progress=progress
    )
    print(report(config, results))


if __name__ == "__main__":
    _hlo.real_compiles()
    main()
