"""A small pre-LayerNorm causal transformer in Flax Linen, parameterised by a precision policy.

Where each dtype is used (the usual mixed-precision practice, e.g. Micikevicius et al. 2018,
"Mixed Precision Training", and Keras' mixed-precision guide):

* every parameter is stored in ``param_dtype``;
* embeddings, attention projections, the MLP, the residual stream and the output projection
  compute in ``compute_dtype``;
* LayerNorm and the attention softmax compute in float32: their reductions (mean, variance,
  sum of exponentials) lose too much precision, and overflow, in float16;
* logits leave the model in ``output_dtype``; the loss (`cross_entropy`) always upcasts them
  to float32 before the log-softmax.

Decoding (`decode`, `generate`) runs the same params one position at a time against a key/value
cache per layer (`init_cache`: a `jaxmp.KVCache`, bfloat16 or int8 or FP8) with the layers of
the training path applied to their own params, so that a step reads the cached keys and values
instead of recomputing the window; `TransformerLM.__call__` (training, evaluation) is unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmp


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention and an MLP, with residuals."""

    num_heads: int
    mlp_ratio: int
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        d_model = x.shape[-1]
        h = nn.LayerNorm(dtype=jnp.float32, param_dtype=self.param_dtype, name="ln_attn")(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            force_fp32_for_softmax=True,
            deterministic=True,
            name="attn",
        )(h, mask=mask)
        x = x + h.astype(self.dtype)
        h = nn.LayerNorm(dtype=jnp.float32, param_dtype=self.param_dtype, name="ln_mlp")(x)
        h = nn.Dense(
            self.mlp_ratio * d_model, dtype=self.dtype, param_dtype=self.param_dtype, name="fc"
        )(h)
        h = nn.gelu(h)
        h = nn.Dense(d_model, dtype=self.dtype, param_dtype=self.param_dtype, name="proj")(h)
        return x + h.astype(self.dtype)


class TransformerLM(nn.Module):
    """Character-level causal language model; returns logits of shape ``(batch, len, vocab)``."""

    vocab_size: int
    max_len: int
    num_layers: int
    num_heads: int
    d_model: int
    mlp_ratio: int
    dtype: jnp.dtype = jnp.float32  # compute dtype
    param_dtype: jnp.dtype = jnp.float32
    output_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        length = tokens.shape[-1]
        embed = nn.Embed(
            self.vocab_size,
            self.d_model,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            embedding_init=nn.initializers.normal(0.02),
            name="embed",
        )
        pos = nn.Embed(
            self.max_len,
            self.d_model,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            embedding_init=nn.initializers.normal(0.02),
            name="pos_embed",
        )
        x = embed(tokens) + pos(jnp.arange(length))[None]
        mask = nn.make_causal_mask(jnp.ones((1, length), jnp.int32))
        for i in range(self.num_layers):
            x = Block(
                self.num_heads, self.mlp_ratio, self.dtype, self.param_dtype, name=f"block_{i}"
            )(x, mask)
        x = nn.LayerNorm(dtype=jnp.float32, param_dtype=self.param_dtype, name="ln_final")(x)
        logits = nn.Dense(
            self.vocab_size, dtype=self.dtype, param_dtype=self.param_dtype, name="head"
        )(x)
        return logits.astype(self.output_dtype)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-character cross-entropy in nats, computed in float32 whatever the logits' dtype."""
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), targets
    ).mean()


# --- Decoding with a key/value cache ----------------------------------------------------------


def init_cache(
    model: TransformerLM,
    batch: int,
    format: str | None,
    dtype: Any = None,
    block_size: int | None = None,
) -> tuple[jaxmp.KVCache, ...]:
    """An empty cache per layer, ``(batch, max_len, heads, head_dim)``, in `format`
    (``"int8"``, ``"fp8"``, or None: unquantised), reading back (attention computed) in `dtype`
    (default the model's compute dtype), with `jaxmp.KVCache.create`'s `block_size`."""
    shape = (batch, model.max_len, model.num_heads, model.d_model // model.num_heads)
    dtype = model.dtype if dtype is None else dtype
    return tuple(
        jaxmp.KVCache.create(shape, format, dtype=dtype, block_size=block_size)
        for _ in range(model.num_layers)
    )


def decode(
    model: TransformerLM,
    params: Any,
    caches: tuple[jaxmp.KVCache, ...],
    tokens: jax.Array,
    pos: jax.typing.ArrayLike,
) -> tuple[jax.Array, tuple[jaxmp.KVCache, ...]]:
    """Logits of `tokens` (``(batch, L)``, at positions ``pos, ..., pos + L - 1``) given the
    positions before them in `caches`, and the caches with these positions written.

    The computation of `TransformerLM.__call__`, layer by layer with the same Flax layers and
    dtypes, except the attention: the query attends over the cache (`jaxmp.KVCache.attend`,
    scores and softmax in float32) instead of over the window. A prompt is written with one
    call (``pos=0``), then one token per call. Run it with `jaxmp.quantized` on params from
    `jaxmp.quantize` of the full forward: the same matmul weights.
    """
    dtype, param_dtype = model.dtype, model.param_dtype
    heads = model.num_heads
    head_dim = model.d_model // heads

    def apply(module: nn.Module, p: Any, *args: Any) -> Any:
        return module.apply({"params": p}, *args)

    def layer_norm(p: Any, x: jax.Array) -> jax.Array:
        return apply(nn.LayerNorm(dtype=jnp.float32, param_dtype=param_dtype), p, x)

    def dense(p: Any, x: jax.Array, features: Any, axis: Any = -1) -> jax.Array:
        layer = nn.DenseGeneral(features, axis=axis, dtype=dtype, param_dtype=param_dtype)
        return apply(layer, p, x)

    length = tokens.shape[-1]
    positions = jnp.asarray(pos, jnp.int32) + jnp.arange(length, dtype=jnp.int32)
    embed = nn.Embed(model.vocab_size, model.d_model, dtype=dtype, param_dtype=param_dtype)
    pos_embed = nn.Embed(model.max_len, model.d_model, dtype=dtype, param_dtype=param_dtype)
    x = apply(embed, params["embed"], tokens) + apply(pos_embed, params["pos_embed"], positions)
    new_caches = []
    for i, cache in enumerate(caches):
        p = params[f"block_{i}"]
        h = layer_norm(p["ln_attn"], x)
        attn = p["attn"]
        q, k, v = (dense(attn[name], h, (heads, head_dim)) for name in ("query", "key", "value"))
        cache = cache.update(k, v, pos)
        new_caches.append(cache)
        h = dense(attn["out"], cache.attend(q, pos), model.d_model, axis=(-2, -1))
        x = x + h.astype(dtype)
        h = layer_norm(p["ln_mlp"], x)
        h = nn.gelu(dense(p["fc"], h, model.mlp_ratio * model.d_model))
        x = x + dense(p["proj"], h, model.d_model).astype(dtype)
    x = layer_norm(params["ln_final"], x)
    logits = dense(params["head"], x, model.vocab_size)
    return logits.astype(model.output_dtype), tuple(new_caches)


def generate(
    model: TransformerLM,
    params: Any,
    prompt: Any,
    steps: int,
    format: str | None,
    *,
    cache_dtype: Any = None,
    block_size: int | None = None,
    forced: Any = None,
    apply: Callable[..., Any] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy decoding of `steps` tokens after `prompt` (``(batch, P)``, P at most
    ``max_len``) with a cache in `format`; past the model's window (learned positions up to
    ``max_len``), the last ``max_len // 2`` tokens are written again from position 0.

    With `forced` (``(batch, steps)``), each step reads the forced token before it instead of
    its own choice (teacher forcing): the logits of two caches at the same inputs.
    `cache_dtype` and `block_size` are `init_cache`'s `dtype` and `block_size`.
    `apply` is `decode`'s signature without the model (default `decode`; for quantised params,
    ``jaxmp.quantized(functools.partial(decode, model))``).

    Returns:
      The tokens chosen (argmax, ``(batch, steps)``, int32) and their logits (float32).
    """
    prompt = np.asarray(prompt, np.int32)
    batch, start = prompt.shape
    if not 1 <= start <= model.max_len:
        raise ValueError(f"`prompt` must hold 1 to {model.max_len} tokens, got {start}.")
    run = jax.jit(apply or functools.partial(decode, model))
    caches = init_cache(model, batch, format, cache_dtype, block_size)
    keep = model.max_len // 2
    sequence = prompt
    logits, caches = run(params, caches, jnp.asarray(prompt), 0)
    pos = start
    chosen, out = [], []
    for step in range(steps):
        last = np.asarray(logits[:, -1], np.float32)
        out.append(last)
        chosen.append(np.argmax(last, -1).astype(np.int32))
        token = chosen[-1] if forced is None else np.asarray(forced, np.int32)[:, step]
        sequence = np.concatenate([sequence, token[:, None]], axis=1)
        if step == steps - 1:
            break
        if pos == model.max_len:  # the window is full: keep its last half
            logits, caches = run(params, caches, jnp.asarray(sequence[:, -keep:]), 0)
            pos = keep
        else:
            logits, caches = run(params, caches, jnp.asarray(token[:, None]), pos)
            pos += 1
    return np.stack(chosen, axis=1), np.stack(out, axis=1)
