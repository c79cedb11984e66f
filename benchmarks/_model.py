"""A small character-level transformer LM (Flax Linen) and train steps for the benchmarks.

Self-contained (jax, flax, optax, numpy, jaxmp): `gpu_benchmark.py` runs it on machines with
nothing else installed. The model is a pre-LayerNorm causal transformer: token and position
embeddings, `num_layers` blocks of multi-head causal self-attention and a GELU MLP, a final
LayerNorm and an output projection. Every parameter is stored in `param_dtype`; the matmuls,
the residual stream and the saved activations are in `dtype`; LayerNorm statistics and the
attention softmax are computed in float32 and cast back to `dtype`, and rematerialised in the
backward pass (`jax.checkpoint`) so that only `dtype` activations are kept between the passes.

Train steps (all take and return ``(params, opt_state, loss_scale_state)``-style tuples, see
`make_step`):

* ``"optax"``: plain `optax.adam`, no loss scaling (the baseline);
* ``"jaxmp"``: `jaxmp.mixed_precision` with `jaxmp.value_and_grad`;
* ``"manual"``: the same casts, scaling, finiteness check and selects written inline;
* ``"jmp"``: jmp's ``DynamicLossScale.scale/unscale``, ``jmp.all_finite`` and
  ``jmp.select_tree`` over params and optimizer state;
* ``"apply_if_finite"``: `optax.apply_if_finite` around adam, with a static-per-step loss scale
  written inline (optax has no loss scaling of its own);
* ``"flax"``: ``flax.training.dynamic_scale.DynamicScale.value_and_grad`` and the
  ``jnp.where`` over params and optimizer state of Flax's ImageNet example.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmp

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int = 96
    seq_len: int = 128
    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 2
    mlp_ratio: int = 4
    batch_size: int = 16
    # "einsum": two einsums around a float32, rematerialised softmax; "fused":
    # `jaxmp.dot_product_attention` (cuDNN's fused kernel for half-precision operands on an
    # NVIDIA GPU, XLA's attention elsewhere and for float32).
    attention: str = "einsum"


# Named configurations. "cpu" compiles in a few seconds on a laptop CPU; "update" is only used
# for its parameter tree (about 1.5M parameters); "gpu" is sized for one H100/H200.
CONFIGS = {
    "tiny": Config(seq_len=32, d_model=32, num_heads=2, num_layers=1, batch_size=2),
    "cpu": Config(),
    "update": Config(d_model=256, num_layers=2, seq_len=128),
    "gpu": Config(
        vocab_size=256,
        seq_len=1024,
        d_model=1024,
        num_heads=16,
        num_layers=8,
        batch_size=32,
        attention="fused",
    ),
    # The same with the einsum attention: the model the GPU rows used before (a labelled row).
    "gpu_einsum": Config(
        vocab_size=256, seq_len=1024, d_model=1024, num_heads=16, num_layers=8, batch_size=32
    ),
    "tiny_fused": Config(
        seq_len=32, d_model=32, num_heads=2, num_layers=1, batch_size=2, attention="fused"
    ),
    # Deep and unscanned (12 parameter leaves per block, 293 leaves): compile time as the
    # model grows (`gpu_benchmark.py`'s deep rows); "tiny_deep" is its CPU smoke test.
    "gpu_deep": Config(
        vocab_size=256, seq_len=512, d_model=512, num_heads=8, num_layers=24, batch_size=32
    ),
    "tiny_deep": Config(seq_len=32, d_model=32, num_heads=2, num_layers=4, batch_size=2),
    # Hidden size 4096 and 8,192 tokens per step: GEMMs large enough for FP8 to pay
    # (`gpu_benchmark.py`'s h4096 rows); "tiny_wide" is its CPU smoke test.
    "gpu_4096": Config(
        vocab_size=256,
        seq_len=1024,
        d_model=4096,
        num_heads=32,
        num_layers=2,
        batch_size=8,
        attention="fused",
    ),
    "tiny_wide": Config(
        seq_len=32, d_model=64, num_heads=2, num_layers=1, batch_size=2, attention="fused"
    ),
}


class _LayerNorm(nn.Module):
    """LayerNorm with float32 statistics, returning `dtype`."""

    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (d,), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (d,), self.param_dtype)
        return _layer_norm(x, scale, bias)


@jax.checkpoint
def _layer_norm(x, scale, bias):
    # Rematerialised: the backward pass keeps `x` (in the compute dtype) and recomputes the
    # float32 intermediates, instead of keeping them in float32.
    x32 = x.astype(F32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + 1e-5)
    return (y * scale.astype(F32) + bias.astype(F32)).astype(x.dtype)


@jax.checkpoint
def _causal_softmax(logits):
    # Float32 softmax, rematerialised for the same reason as `_layer_norm`.
    t = logits.shape[-1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    masked = jnp.where(causal, logits.astype(F32), -1e9)
    return jax.nn.softmax(masked, axis=-1).astype(logits.dtype)


class _Block(nn.Module):
    num_heads: int
    mlp_ratio: int
    dtype: Any
    param_dtype: Any
    attention: str = "einsum"

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        dense = functools.partial(nn.Dense, dtype=self.dtype, param_dtype=self.param_dtype)
        h = _LayerNorm(self.dtype, self.param_dtype, name="ln_attn")(x)
        qkv = dense(3 * d, name="qkv")(h).reshape(b, t, 3, self.num_heads, d // self.num_heads)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if self.attention == "fused":
            h = jaxmp.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d)
        else:
            logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // self.num_heads)
            probs = _causal_softmax(logits)
            h = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d)
        x = x + dense(d, name="attn_out")(h)
        h = _LayerNorm(self.dtype, self.param_dtype, name="ln_mlp")(x)
        h = nn.gelu(dense(self.mlp_ratio * d, name="fc")(h))
        return x + dense(d, name="proj")(h)


class CharTransformer(nn.Module):
    """Causal character-level transformer; returns float32 logits ``(batch, len, vocab)``."""

    config: Config
    dtype: Any = F32
    param_dtype: Any = F32

    @nn.compact
    def __call__(self, tokens):
        c = self.config
        embed = nn.Embed(c.vocab_size, c.d_model, dtype=self.dtype, param_dtype=self.param_dtype)
        pos = self.param(
            "pos_embed", nn.initializers.normal(0.02), (c.seq_len, c.d_model), self.param_dtype
        )
        x = embed(tokens) + pos[: tokens.shape[1]].astype(self.dtype)
        for i in range(c.num_layers):
            x = _Block(
                c.num_heads,
                c.mlp_ratio,
                self.dtype,
                self.param_dtype,
                c.attention,
                name=f"block_{i}",
            )(x)
        x = _LayerNorm(self.dtype, self.param_dtype, name="ln_final")(x)
        logits = nn.Dense(c.vocab_size, dtype=self.dtype, param_dtype=self.param_dtype)(x)
        return logits.astype(F32)


def batch(config: Config, seed: int = 0) -> jax.Array:
    """A random batch of token ids, ``(batch_size, seq_len + 1)``: inputs and next tokens."""
    rng = np.random.default_rng(seed)
    shape = (config.batch_size, config.seq_len + 1)
    return jnp.asarray(rng.integers(0, config.vocab_size, shape), jnp.int32)


def param_shapes(config: Config, param_dtype: Any = F32) -> Any:
    """The parameter tree as `jax.ShapeDtypeStruct`s (nothing is computed)."""
    model = CharTransformer(config, param_dtype=param_dtype)
    tokens = jax.ShapeDtypeStruct((1, config.seq_len), jnp.int32)
    return jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]


def num_params(config: Config) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(param_shapes(config)))


# ---------------------------------------------------------------------------------------------
# Train steps.

APPROACHES = ("optax", "jaxmp", "autocast", "manual", "jmp", "apply_if_finite", "flax")
PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")


def _dtypes(precision: str) -> tuple[Any, Any]:
    """(param dtype, compute dtype); the mixed policies keep float32 params (Keras semantics)."""
    policy = jaxmp.get_policy(precision)
    return policy.param_dtype, policy.compute_dtype


def _loss_fn(model, params, tokens, compute_dtype):
    # Params are cast to the compute dtype on the way in, as jaxmp.Policy.cast_to_compute does.
    logits = model.apply({"params": jaxmp.cast_tree(params, compute_dtype)}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def _initial_scale(precision: str) -> float:
    return 2.0**15 if jaxmp.get_policy(precision).compute_dtype == jnp.float16 else 1.0


def make_step(
    approach: str, precision: str, config: Config, learning_rate: float = 1e-3
) -> tuple[Any, Any]:
    """Returns ``(init, step)``.

    ``init(seed) -> carry`` and ``step(carry, tokens) -> (carry, loss)``; `init` runs two
    jitted programs (`initial_params`, then the approach's state from them), `step` is not
    jitted. `precision` is a `jaxmp.get_policy` string.
    Float16 compute uses a dynamic loss scale starting at 2**15 for every approach but "optax"
    (which never scales); bfloat16 and float32 use a loss scale of 1 where the approach needs
    one.
    """
    init_carry, step = _init_and_step(approach, precision, config, learning_rate)
    param_dtype, _ = _dtypes(precision)
    return init_from_seed(init_carry, config, param_dtype), step


def init_from_seed(init_carry: Any, config: Config, param_dtype: Any) -> Any:
    """``seed -> carry``: `initial_params` (shared by every approach), then the jitted
    ``init_carry(params) -> carry``."""
    init_carry = jax.jit(init_carry)
    return lambda seed: init_carry(initial_params(config, param_dtype, seed))


@functools.partial(jax.jit, static_argnums=(0, 1))
def initial_params(config: Config, param_dtype: Any, seed: int) -> Any:
    """The model's initial params, in `param_dtype`: one compile per config and dtype, shared
    by every approach and precision (the values do not depend on the compute dtype)."""
    model = CharTransformer(config, param_dtype=param_dtype)
    tokens = jnp.zeros((1, config.seq_len), jnp.int32)
    return jaxmp.cast_tree(model.init(jax.random.key(seed), tokens)["params"], param_dtype)


def _init_and_step(
    approach: str, precision: str, config: Config, learning_rate: float
) -> tuple[Any, Any]:
    if approach not in APPROACHES:
        raise ValueError(f"`approach` must be one of {APPROACHES}, got {approach!r}.")
    param_dtype, compute_dtype = _dtypes(precision)
    model = CharTransformer(config, dtype=compute_dtype, param_dtype=param_dtype)
    adam = optax.adam(learning_rate)
    loss_fn = functools.partial(_loss_fn, model, compute_dtype=compute_dtype)

    scale0 = _initial_scale(precision)

    if approach == "optax":

        def init(params):
            return params, adam.init(params)

        def step(carry, tokens):
            params, opt_state = carry
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
            updates, opt_state = adam.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        return init, step

    if approach in ("jaxmp", "autocast"):
        step_loss = loss_fn
        if approach == "autocast":
            # The unmodified float32 model under `jaxmp.autocast`: no dtype in the model.
            apply = jaxmp.autocast(
                CharTransformer(config, dtype=F32, param_dtype=F32).apply, precision
            )

            def step_loss(params, tokens):
                logits = apply({"params": params}, tokens[:, :-1])
                return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss_scale = jaxmp.DynamicLossScale(scale0) if scale0 != 1.0 else jaxmp.NoOpLossScale()
        tx = jaxmp.mixed_precision(adam, precision, loss_scale)

        def init(params):
            return params, tx.init(params)

        def step(carry, tokens):
            params, opt_state = carry
            loss_scale = jaxmp.get_loss_scale(opt_state)
            loss, grads = jaxmp.value_and_grad(step_loss)(loss_scale, params, tokens)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        return init, step

    if approach == "manual":
        # What the jaxmp step does, written out: scale the loss, unscale the float32
        # gradients, check them, update, select, adjust the scale.
        def init(params):
            return params, adam.init(params), jnp.asarray(scale0, F32), jnp.zeros((), jnp.int32)

        def step(carry, tokens):
            params, opt_state, scale, counter = carry
            loss, grads = jax.value_and_grad(lambda p: loss_fn(p, tokens) * scale)(params)
            loss = loss / scale
            grads = jax.tree.map(lambda g: g.astype(F32) * (1.0 / scale), grads)
            finite = jnp.stack([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]).all()
            updates, new_opt = adam.update(grads, opt_state, params)
            updates = jax.tree.map(lambda u: jnp.where(finite, u, 0.0), updates)
            opt_state = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new_opt, opt_state)
            grow = counter + 1 >= 2000
            scale = jnp.where(finite, jnp.where(grow, scale * 2.0, scale), scale * 0.5)
            scale = jnp.clip(scale, 1.0, 2.0**32)
            counter = jnp.where(finite & ~grow, counter + 1, 0)
            return (optax.apply_updates(params, updates), opt_state, scale, counter), loss

        return init, step

    if approach == "jmp":
        import jmp  # noqa: PLC0415 (optional dependency)

        def init(params):
            # jmp 0.0.4's DynamicLossScale flattens to (loss_scale, counter) and rebuilds
            # min_loss_scale from its default, so it is carried as those two arrays.
            return params, adam.init(params), jnp.asarray(scale0, F32), jnp.zeros((), jnp.int32)

        def step(carry, tokens):
            params, opt_state, scale, counter = carry
            ls = jmp.DynamicLossScale(scale, counter, period=2000)
            loss, grads = jax.value_and_grad(lambda p: ls.scale(loss_fn(p, tokens)))(params)
            loss = ls.unscale(loss)
            grads = ls.unscale(jax.tree.map(lambda g: g.astype(F32), grads))
            finite = jmp.all_finite(grads)
            ls = ls.adjust(finite)
            updates, new_opt = adam.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            params = jmp.select_tree(finite, new_params, params)
            opt_state = jmp.select_tree(finite, new_opt, opt_state)
            return (params, opt_state, ls.loss_scale, ls.counter), loss

        return init, step

    if approach == "apply_if_finite":
        tx = optax.apply_if_finite(adam, max_consecutive_errors=10**9)

        def init(params):
            return params, tx.init(params), jnp.asarray(scale0, F32)

        def step(carry, tokens):
            params, opt_state, scale = carry
            loss, grads = jax.value_and_grad(lambda p: loss_fn(p, tokens) * scale)(params)
            grads = jax.tree.map(lambda g: g.astype(F32) / scale, grads)
            updates, new_state = tx.update(grads, opt_state, params)
            # optax has no loss scale: halve on a skipped step, as a user would write it.
            scale = jnp.where(new_state.last_finite, scale, jnp.maximum(scale * 0.5, 1.0))
            return (optax.apply_updates(params, updates), new_state, scale), loss / scale

        return init, step

    # approach == "flax"
    from flax.training import dynamic_scale as dynamic_scale_lib  # noqa: PLC0415

    def init(params):
        ds = dynamic_scale_lib.DynamicScale(scale=jnp.asarray(scale0, F32))
        return params, adam.init(params), ds

    def step(carry, tokens):
        params, opt_state, ds = carry
        grad_fn = ds.value_and_grad(lambda p: loss_fn(p, tokens))
        ds, is_fin, loss, grads = grad_fn(params)
        grads = jax.tree.map(lambda g: g.astype(F32), grads)
        updates, new_opt = adam.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        # As in Flax's ImageNet example.
        params = jax.tree.map(functools.partial(jnp.where, is_fin), new_params, params)
        opt_state = jax.tree.map(functools.partial(jnp.where, is_fin), new_opt, opt_state)
        return (params, opt_state, ds), loss

    return init, step
