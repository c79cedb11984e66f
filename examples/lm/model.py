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
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


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
