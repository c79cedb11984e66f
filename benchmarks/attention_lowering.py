"""Which attention kernel each path lowers to on an NVIDIA GPU, checked without a GPU.

Lowers (``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``) a causal self-attention
written each way `jaxmp.autocast` dispatches (``jax.nn.dot_product_attention``, Flax Linen's
``MultiHeadDotProductAttention`` and ``dot_product_attention``, Flax NNX's ``MultiHeadAttention``
and ``dot_product_attention``, and `jaxmp.dot_product_attention` in a float32 model), forward
and backward, under autocast with a half-precision policy, with ``fused_attention=False``, and
the explicit-dtype calls; for each it counts cuDNN's fused attention custom calls
(``__cudnn$fmha...``) in the lowered program. XLA fuses attention into cuDNN calls no longer, so
the lowered program shows which kernel runs.

Needs JAX's CUDA plugin (``pip install "jax[cuda12]"``); no GPU (lowering only). Run from the
repository root::

    PYTHONPATH=. python benchmarks/attention_lowering.py
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import jaxmp
import jaxmp.linen  # noqa: F401 (marks Flax Linen's attention under autocast)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _hlo  # noqa: E402
import _model  # noqa: E402

B, T, N, H = 2, 128, 4, 64
CUDNN = re.compile(r'custom_call @?"?__cudnn\$fmha|__cudnn\$fmha')


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        return nn.MultiHeadDotProductAttention(num_heads=N, deterministic=True)(x, mask=mask)


def cases() -> list[tuple[str, Any, tuple[Any, ...]]]:
    q = k = v = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
    x = jnp.zeros((B, T, N * H))
    linen_params = LinenBlock().init(jax.random.key(0), x)
    graphdef, nnx_state = nnx.split(
        nnx.MultiHeadAttention(
            num_heads=N, in_features=N * H, decode=False, deterministic=True, rngs=nnx.Rngs(0)
        )
    )
    causal = nn.make_causal_mask(jnp.ones((B, T)))
    return [
        ("jax.nn.dot_product_attention", lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True), (q, k, v)),
        ("jaxmp.dot_product_attention", lambda q, k, v: jaxmp.dot_product_attention(
            q, k, v, is_causal=True), (q, k, v)),
        ("linen dot_product_attention", lambda q, k, v: nn.dot_product_attention(
            q, k, v, mask=causal), (q, k, v)),
        ("linen MultiHeadDotProductAttention", LinenBlock().apply, (linen_params, x)),
        ("nnx dot_product_attention", lambda q, k, v: nnx.dot_product_attention(
            q, k, v), (q, k, v)),
        ("nnx MultiHeadAttention", lambda state, x: nnx.merge(graphdef, state)(x),
         (nnx_state, x)),
    ]  # fmt: skip


def cudnn_calls(fn: Any, args: tuple[Any, ...]) -> int:
    """cuDNN fused-attention calls in the CUDA lowering of the forward and backward pass."""

    def loss(*args: Any) -> Any:
        return jnp.sum(fn(*args).astype(jnp.float32))

    traced = jax.jit(jax.grad(loss, tuple(range(len(args))))).trace(*args)
    lowered = traced.lower(lowering_platforms=("cuda",)).as_text()
    return len(CUDNN.findall(lowered))


def main() -> int:
    try:
        import jax_cuda12_plugin  # noqa: F401, PLC0415
    except ImportError:
        print("JAX's CUDA plugin is not installed (pip install 'jax[cuda12]'): nothing to lower.")
        return 2
    print(f"jax {jax.__version__}; cuDNN fused-attention calls in the CUDA lowering, fwd + bwd:")
    rows = []
    for name, fn, args in cases():
        row = [name]
        for label, f in (
            ("autocast mixed_bfloat16", jaxmp.autocast(fn, "mixed_bfloat16")),
            ("autocast mixed_float16", jaxmp.autocast(fn, "mixed_float16")),
            (
                "fused_attention=False",
                jaxmp.autocast(fn, "mixed_bfloat16", fused_attention=False),
            ),
            ("float32 as written", fn),
        ):
            try:
                row.append(str(cudnn_calls(f, args)))
            except Exception as e:  # noqa: BLE001
                row.append(_hlo.error_line(e, 60))
            del label
        rows.append(row)
    header = ["attention", "autocast bf16", "autocast f16", "fused_attention=False", "float32"]
    print(table(header, rows))
    print("\nThe GPU benchmark's train steps (`_model.make_step`, the fused-attention model):")
    rows = []
    for approach, precision in (
        ("optax", "float32"),
        ("jaxmp", "mixed_bfloat16"),
        ("jaxmp", "mixed_float16"),
        ("autocast", "mixed_bfloat16"),
    ):
        config = _model.CONFIGS["tiny_fused"]
        init, step = _model.make_step(approach, precision, config)
        carry = jax.eval_shape(init, 0)
        tokens = jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), jnp.int32)
        lowered = jax.jit(step).trace(carry, tokens).lower(lowering_platforms=("cuda",))
        calls = len(CUDNN.findall(lowered.as_text()))
        rows.append([f"{approach}, {precision}", str(calls)])
    print(table(["train step", "cuDNN attention calls (fwd + bwd, 1 layer)"], rows))
    return 0


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join(
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in lines
    )


if __name__ == "__main__":
    sys.exit(main())
