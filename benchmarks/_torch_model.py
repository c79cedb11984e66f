"""The benchmark's char-transformer in PyTorch, trained eagerly with ``torch.amp`` (GPU rows).

The architecture of `_model.CharTransformer` with ``attention="fused"``: token and position
embeddings, pre-LayerNorm blocks (a fused qkv projection, causal
``F.scaled_dot_product_attention``, an output projection, a GELU MLP of `mlp_ratio`), a final
LayerNorm and a head; Adam at the same learning rate. ``precision`` is ``"float32"`` (TF32
matmuls, as JAX's default on the GPU), ``"float16"`` (``torch.autocast`` with a
``GradScaler``) or ``"bfloat16"`` (``torch.autocast``): what a PyTorch user runs.

Imported only where torch is installed (the GPU machine); `available` says whether it is.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from typing import Any


def available() -> bool:
    return importlib.util.find_spec("torch") is not None


def measure(precision: str, config: Any, tokens: Any, steps: int, deadline: float) -> dict:
    """Times the train step like `gpu_benchmark.run_row`: warm-up, then at least 3 steps and
    at most `steps` (until `deadline`); peak memory from ``torch.cuda`` on a GPU."""
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: N812, PLC0415
    from torch import nn  # noqa: PLC0415

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    c = config

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = c.d_model
            self.ln_attn, self.ln_mlp = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.attn_out = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.proj = nn.Linear(d, c.mlp_ratio * d), nn.Linear(c.mlp_ratio * d, d)

        def forward(self, x: Any) -> Any:
            b, t, d = x.shape
            qkv = self.qkv(self.ln_attn(x)).view(b, t, 3, c.num_heads, d // c.num_heads)
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (b, heads, t, hd)
            h = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.attn_out(h.transpose(1, 2).reshape(b, t, d))
            return x + self.proj(F.gelu(self.fc(self.ln_mlp(x)), approximate="tanh"))

    class CharTransformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(c.vocab_size, c.d_model)
            self.pos = nn.Parameter(torch.randn(c.seq_len, c.d_model) * 0.02)
            self.blocks = nn.ModuleList([Block() for _ in range(c.num_layers)])
            self.ln_final, self.head = nn.LayerNorm(c.d_model), nn.Linear(c.d_model, c.vocab_size)

        def forward(self, tokens: Any) -> Any:
            x = self.embed(tokens) + self.pos[: tokens.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_final(x))

    torch.manual_seed(0)
    model = CharTransformer().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    amp_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(precision)
    scaler = torch.amp.GradScaler(device, enabled=precision == "float16")
    batch = torch.as_tensor(np.asarray(tokens), device=device, dtype=torch.long)
    inputs, targets = batch[:, :-1], batch[:, 1:]

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(
            device, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None
        ):
            logits = model(inputs)
            loss = F.cross_entropy(logits.float().reshape(-1, c.vocab_size), targets.reshape(-1))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(2):  # warm-up (kernel selection)
        loss = step()
    sync()
    warmup_s = time.perf_counter() - t0
    times = []
    while len(times) < steps and (len(times) < 3 or time.perf_counter() < deadline):
        t = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    return dict(
        step_s=statistics.median(times),
        steps=len(times),
        flops=float("nan"),
        temp=peak,
        arguments=0,
        compile_s=warmup_s,
        loss=float(loss.detach()),
        fp8_patterns=0,
        fp8_calls=0,
    )
