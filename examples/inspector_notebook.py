# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The precision inspector and quantization, in a notebook
#
# `jaxmp.inspect` measures every floating-point op of a step: its range, what float16 and the
# FP8 formats would flush to zero or overflow, the error against the same program in float32,
# and where a NaN or inf came from. In a notebook its report shows itself: the header (the
# first non-finite value, the loss scale the gradients allow), the worst ops as a table, and
# the exponent histograms of each module against each format's range. The quantization plan
# and the list of FP8 matmuls show themselves as tables too. Everything runs in seconds on a
# CPU.

# %%
import jax
import jax.numpy as jnp

import jaxmp

# %% [markdown]
# ## A model
#
# A float32 MLP, a `jax.named_scope` per layer (Flax modules name their scopes themselves).
# The inspector runs it under `mixed_float16`: computing in float16, compared with float32.


# %%
def init(key, sizes=(16, 64, 64, 4)):
    keys = jax.random.split(key, len(sizes) - 1)
    return {
        f"layer_{i}": {"w": jax.random.normal(k, (m, n)) / jnp.sqrt(m), "b": jnp.zeros(n)}
        for i, (k, m, n) in enumerate(zip(keys, sizes[:-1], sizes[1:], strict=True))
    }


def predict(params, x):
    h = x
    for i in range(len(params)):
        layer = params[f"layer_{i}"]
        with jax.named_scope(f"layer_{i}"):
            h = h @ layer["w"] + layer["b"]
            if i < len(params) - 1:
                h = jnp.tanh(h)
    return h


def loss_fn(params, x, y):
    return jnp.mean((predict(params, x) - y) ** 2)


params = init(jax.random.key(0))
x = jax.random.normal(jax.random.key(1), (256, 16))
y = jax.random.normal(jax.random.key(2), (256, 4))

# %% [markdown]
# ## The report of one step
#
# The report of `jax.value_and_grad(loss_fn)`: the forward and the backward pass, one row per
# op output, the worst first.

# %%
inspected = jaxmp.inspect(jax.value_and_grad(loss_fn), "mixed_float16")
(loss, grads), report = inspected(params, x, y)
report

# %% [markdown]
# The suggested loss scale, and what is left to underflow at it:

# %%
print(report.suggest_loss_scale())

# %% [markdown]
# ## Where a NaN comes from
#
# Attention scores exponentiated without subtracting their maximum overflow, and the softmax
# divides inf by inf. The header names the op that made the first non-finite value, and its
# line.


# %%
def attention(q, k, v):
    with jax.named_scope("attention"):
        scores = jnp.exp(q @ k.T)  # no max subtracted: overflows float32 for large logits
        return (scores / scores.sum(axis=-1, keepdims=True)) @ v


q = jnp.full((4, 8), 12.0)
_, nan_report = jaxmp.inspect(attention)(q, q, q)
nan_report

# %% [markdown]
# ## Quantising for inference
#
# `jaxmp.quantization_plan` says which param leaves `jaxmp.quantize` turns into int8 (the
# matmul weights, found from how `predict` uses them) and why the others stay as they are;
# `exclude` keeps the output layer in float32.

# %%
plan = jaxmp.quantization_plan(predict, params, x, recipe="int8", exclude="layer_2")
plan

# %%
quantized = jaxmp.quantize(predict, params, x, recipe="int8", exclude="layer_2")
error = jnp.abs(jaxmp.quantized(predict)(quantized, x) - predict(params, x)).max()
print(f"largest difference from float32: {float(error):.2e}")

# %% [markdown]
# ## FP8 matmuls
#
# Under an FP8 recipe, `fp8_matmuls` lists every matmul, whether it runs in FP8, and why;
# `fp8_exclude` keeps a layer out.

# %%
fp8_predict = jaxmp.autocast(
    predict, "mixed_bfloat16", fp8=jaxmp.Float8CurrentScaling(), fp8_exclude="layer_2"
)
fp8_predict.fp8_matmuls(params, x)
