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
# # jaxmp quickstart
#
# Mixed-precision training in four steps, on tiny synthetic data so every cell runs in seconds
# on a CPU:
#
# 1. a **policy** says which dtype params, computation and outputs use;
# 2. float16 has a narrow range, so small gradients **underflow** to zero: a **loss scale**
#    multiplies the loss before the backward pass and the optimizer divides it out;
# 3. `jaxmp.mixed_precision` wraps an optax optimizer with loss scaling (and FP32 master weights
#    when params are half precision), so a train step is ordinary optax code;
# 4. `jaxmp.loss_scale_metrics` reports the scale and the skipped steps for logging, and
#    `jaxmp.plot_loss_scale` draws their history.
#
# In a notebook, jaxmp's objects show themselves as tables: a policy, the optimizer state (its
# loss scale and skipped steps), and the reports of the precision inspector and of quantization
# (`inspector_notebook.ipynb`).

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import optax
from loss_scale_tools import describe_scale  # examples/loss_scale_tools.py: 2^15, not 32768

import jaxmp

# %% [markdown]
# ## Policies
#
# `jaxmp.get_policy` parses jmp's grammar (`"p=f32,c=f16,o=f32"`) and Keras' names.

# %%
for spec in ["f32", "mixed_float16", "mixed_bfloat16", "p=f16,c=f16,o=f32"]:
    policy = jaxmp.get_policy(spec)
    print(
        f"{spec:>18}: params {policy.param_dtype}, compute {policy.compute_dtype}, "
        f"output {policy.output_dtype}"
    )

policy = jaxmp.get_policy("mixed_float16")
tree = {"w": jnp.ones(2), "step": jnp.array(3)}
print(jax.tree.map(lambda x: x.dtype, policy.cast_to_compute(tree)))  # only floats are cast

# %% [markdown]
# A policy as a cell's value: its three dtypes, and whether it needs loss scaling.

# %%
policy

# %% [markdown]
# ## Why loss scaling
#
# float16's smallest subnormal is about 6e-8. A gradient of 1e-8 rounds to zero; multiplied by
# a loss scale of 2^15 first, it survives, and dividing by the scale in float32 recovers it.

# %%
tiny = jnp.float32(1e-8)
scale = 2.0**15
recovered = (tiny * scale).astype(jnp.float16).astype(jnp.float32) / scale
print("float16(1e-8)               =", tiny.astype(jnp.float16))
print("float16(1e-8 * 2^15) / 2^15 =", recovered)

# %% [markdown]
# ## Data and model
#
# A two-class problem: points on two noisy interleaved spirals, and a small MLP that computes
# in the policy's compute dtype. The loss is reduced in float32.


# %%
def make_data(key, n=512):
    k1, k2 = jax.random.split(key)
    t = jax.random.uniform(k1, (n,), minval=0.5, maxval=3.0) * jnp.pi
    label = jnp.arange(n) % 2
    angle = t + jnp.pi * label
    x = jnp.stack([t * jnp.cos(angle), t * jnp.sin(angle)], axis=1) / 5.0
    x = x + 0.05 * jax.random.normal(k2, x.shape)
    return x, label


def init_params(key, sizes=(2, 64, 64, 2)):
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (m, n)) * jnp.sqrt(2.0 / m), "b": jnp.zeros(n)}
        for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def loss_fn(params, x, labels, policy):
    h = policy.cast_to_compute(x)
    params = policy.cast_to_compute(params)
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    logits = h @ params[-1]["w"] + params[-1]["b"]
    logits = policy.cast_to_output(logits).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


x, labels = make_data(jax.random.PRNGKey(0))
params_f32 = init_params(jax.random.PRNGKey(1))
print(
    x.shape, labels.shape, "initial loss:", loss_fn(params_f32, x, labels, jaxmp.get_policy("f32"))
)

# %% [markdown]
# ## A loss-scaled train step
#
# `jaxmp.value_and_grad` differentiates the loss times the current loss scale; `tx.update`
# unscales in float32, skips the step if any gradient is not finite, and adjusts the scale.
# `init` gets the float32 params (the FP32 master copy starts exact); the params themselves
# are stored in `policy.param_dtype`.


# %%
def train(spec, loss_scale=None, steps=300, lr=3e-3):
    policy = jaxmp.get_policy(spec)
    tx = jaxmp.mixed_precision(optax.adam(lr), policy, loss_scale)
    opt_state = tx.init(params_f32)
    params = policy.cast_to_param(params_f32)

    @jax.jit
    def train_step(params, opt_state):
        loss_scale = jaxmp.get_loss_scale(opt_state)
        loss, grads = jaxmp.value_and_grad(loss_fn)(loss_scale, params, x, labels, policy)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss, jaxmp.loss_scale_metrics(opt_state)

    history = []
    for _ in range(steps):
        params, opt_state, loss, metrics = train_step(params, opt_state)
        history.append({"loss": float(loss), **{k: v.item() for k, v in metrics.items()}})
    return params, history, opt_state


runs = {
    "f32": train("f32"),
    # Grow the scale every 25 finite steps so this short run shows it back off on overflow.
    "mixed_float16": train("mixed_float16", jaxmp.DynamicLossScale(2.0**15, period=25)),
    "float16 + master weights": train(
        "p=f16,c=f16,o=f32", jaxmp.DynamicLossScale(2.0**15, period=25)
    ),
}

# %% [markdown]
# ## Metrics

# %%
for name, (params, history, _) in runs.items():
    last = history[-1]
    print(
        f"{name:>24}: param dtype {params[0]['w'].dtype}, final loss {last['loss']:.4f}, "
        f"loss scale {describe_scale(last['loss_scale'])}, skipped steps {last['skipped_steps']}"
    )

# %%
fig, ax = plt.subplots(figsize=(9, 3))
for name, (_, history, _) in runs.items():
    ax.plot([h["loss"] for h in history], label=name)
ax.set(xlabel="step", ylabel="loss", yscale="log", title="training loss")
ax.legend()
fig.tight_layout()

# %% [markdown]
# The optimizer state of the mixed_float16 run: its loss scale, whether the last step was
# finite, and the steps skipped (gradients not finite: the update left out, the scale halved).

# %%
_, history, opt_state = runs["mixed_float16"]
opt_state

# %% [markdown]
# `jaxmp.plot_loss_scale` draws the history of the metrics the train step returned: the loss
# scale grows every 25 finite steps and halves at each skipped step (x).

# %%
fig = jaxmp.plot_loss_scale(history, title="mixed_float16, DynamicLossScale(2^15, period=25)")
