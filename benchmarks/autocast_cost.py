"""What `jaxmp.autocast` costs against a model written with explicit ``dtype=`` arguments.

Compiles one training step (forward and backward) of a small Flax Linen transformer three
ways and prints XLA's estimates for each:

* ``float32``: the model as written, in float32;
* ``explicit``: the same model with ``dtype=jnp.float16`` on every module (params float32);
* ``autocast``: the float32 model wrapped in ``jaxmp.autocast(..., "mixed_float16")``.

Columns: temp bytes (``compiled.memory_analysis().temp_size_in_bytes``), bytes accessed
(``compiled.cost_analysis()["bytes accessed"]``), and the wall time of tracing
(``jax.jit(step).trace``) and of lowering plus compiling.

Run from the repository root::

    python -m benchmarks.autocast_cost
    python -m benchmarks.autocast_cost --batch 8 --length 128 --features 256 --layers 4
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jaxmp
from jaxmp._src.autocast import autocast


class Block(nn.Module):
    features: int
    heads: int
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        h = nn.LayerNorm(dtype=self.dtype)(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, dtype=self.dtype)(
            h, h, mask=mask
        )
        h = nn.LayerNorm(dtype=self.dtype)(x)
        h = nn.Dense(4 * self.features, dtype=self.dtype)(h)
        return x + nn.Dense(self.features, dtype=self.dtype)(nn.gelu(h))


class TransformerLM(nn.Module):
    vocab: int = 256
    features: int = 64
    layers: int = 2
    heads: int = 4
    dtype: Any = None

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.features, dtype=self.dtype)(tokens)
        for _ in range(self.layers):
            x = Block(self.features, self.heads, dtype=self.dtype)(x)
        x = nn.LayerNorm(dtype=self.dtype)(x)
        return nn.Dense(self.vocab, dtype=self.dtype)(x)


def _step_fn(model: TransformerLM, wrap):
    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1])
        # Float32 loss for every variant (the explicit model returns float16 logits).
        logits = logits.astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return jax.value_and_grad(wrap(loss_fn))


def _analyse(step, params, tokens, *, time_it: bool) -> dict[str, float]:
    start = time.perf_counter()
    traced = jax.jit(step).trace(params, tokens)
    trace_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = traced.lower().compile()
    compile_s = time.perf_counter() - start
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older JAX returns one dict per computation
        cost = cost[0]
    result = {
        "temp_bytes": float(compiled.memory_analysis().temp_size_in_bytes),
        "bytes_accessed": float(cost["bytes accessed"]),
        "trace_s": trace_s,
        "compile_s": compile_s,
    }
    if time_it:
        jax.block_until_ready(compiled(params, tokens))
        start = time.perf_counter()
        for _ in range(10):
            out = compiled(params, tokens)
        jax.block_until_ready(out)
        result["step_ms"] = (time.perf_counter() - start) / 10 * 1e3
    return result


def measure(
    batch: int = 8,
    length: int = 64,
    features: int = 128,
    layers: int = 2,
    heads: int = 4,
    vocab: int = 256,
    time_it: bool = True,
    variants: tuple[str, ...] = ("float32", "explicit", "autocast"),
) -> dict[str, dict[str, float]]:
    """Compiles the three variants of the train step and returns their costs."""
    # Without timing only the compiled steps' costs are read: shapes are enough, no values.
    build = (lambda f, *args: jax.jit(f)(*args)) if time_it else jax.eval_shape
    tokens = build(lambda: jax.random.randint(jax.random.key(0), (batch, length + 1), 0, vocab))
    f32_model = TransformerLM(vocab, features, layers, heads)
    f16_model = TransformerLM(vocab, features, layers, heads, dtype=jnp.float16)
    params = build(lambda t: f32_model.init(jax.random.key(1), t[:, :-1]), tokens)["params"]
    policy = jaxmp.get_policy("mixed_float16")
    steps = {
        "float32": _step_fn(f32_model, lambda f: f),
        "explicit": _step_fn(f16_model, lambda f: f),
        "autocast": _step_fn(f32_model, lambda f: autocast(f, policy)),
    }
    return {name: _analyse(steps[name], params, tokens, time_it=time_it) for name in variants}


def format_table(results: dict[str, dict[str, float]]) -> str:
    base = results["explicit"]
    lines = [
        "| variant | temp bytes | bytes accessed | vs explicit | trace s | compile s | step ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['temp_bytes']:,.0f} | {r['bytes_accessed']:,.0f} | "
            f"{r['bytes_accessed'] / base['bytes_accessed']:.3f} | {r['trace_s']:.3f} | "
            f"{r['compile_s']:.3f} | {r.get('step_ms', float('nan')):.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    args = parser.parse_args()
    results = measure(args.batch, args.length, args.features, args.layers, args.heads)
    print(f"backend: {jax.default_backend()}, jax {jax.__version__}")
    print(format_table(results))


if __name__ == "__main__":
    main()
