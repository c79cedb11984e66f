"""Quickstart: float16 training with FP32 master weights and dynamic loss scaling.

A two-layer MLP fits a synthetic regression target. Params are stored in float16 and the
forward and backward passes run in float16; `jaxmp.mixed_precision` keeps an FP32 master copy
of the params in the optimizer state, unscales the gradients, skips steps whose gradients are
not finite and adjusts the loss scale. Before training, a first-step check makes sure the
gradients are those of the scaled loss. Run: python examples/quickstart.py
"""

import jax
import jax.numpy as jnp
import optax
from loss_scale_tools import check_gradients_are_scaled, describe_scale, grad_norm

import jaxmp


def init_params(key, sizes=(16, 64, 1)):
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (m, n)) / jnp.sqrt(m), "b": jnp.zeros(n)}
        for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def loss_fn(params, x, y, policy):
    h = policy.cast_to_compute(x)
    for i, layer in enumerate(policy.cast_to_compute(params)):
        h = h @ layer["w"] + layer["b"]
        h = jax.nn.gelu(h) if i < len(params) - 1 else h
    # Reduce in float32: a float16 sum of squares overflows far sooner.
    return jnp.mean((policy.cast_to_output(h)[:, 0] - y) ** 2)


def train(steps=300, seed=0, log_every=50):
    """Returns the float16 params, the final loss and the loss-scale metrics."""
    policy = jaxmp.get_policy("p=f16,c=f16,o=f32")
    kx, kw, kp = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(kx, (256, 16))
    y = jnp.sin(x @ jax.random.normal(kw, (16,)))
    params_f32 = init_params(kp)
    # Grow the scale every 25 finite steps (default 2000) so a short run shows it back off.
    loss_scale = jaxmp.DynamicLossScale(2.0**15, period=25)
    learning_rate = optax.cosine_decay_schedule(1e-2, steps, alpha=0.05)
    tx = jaxmp.mixed_precision(optax.adam(learning_rate), policy, loss_scale)
    opt_state = tx.init(params_f32)  # the FP32 master copy starts exact
    params = policy.cast_to_param(params_f32)

    @jax.jit
    def train_step(params, opt_state):
        loss_scale = jaxmp.get_loss_scale(opt_state)
        loss, grads = jaxmp.value_and_grad(loss_fn)(loss_scale, params, x, y, policy)
        updates, opt_state = tx.update(grads, opt_state, params)
        metrics = jaxmp.loss_scale_metrics(opt_state)
        metrics["grad_norm"] = grad_norm(grads)
        return optax.apply_updates(params, updates), opt_state, loss, metrics

    # Gradients from jax.grad instead of jaxmp.value_and_grad would train silently with updates
    # 2^15 times too small: at loss scales 1 and 2, the gradients must double.
    check_gradients_are_scaled(lambda state: train_step(params, state)[3]["grad_norm"], opt_state)
    for step in range(1, steps + 1):
        params, opt_state, loss, metrics = train_step(params, opt_state)
        if step % log_every == 0 or step == 1:
            print(
                f"step {step:4d}  loss {float(loss):.5f}  "
                f"loss scale {describe_scale(metrics['loss_scale'])}  "
                f"skipped steps {int(metrics['skipped_steps'])}"
            )
    return params, float(loss), metrics


if __name__ == "__main__":
    params, loss, _ = train()
    print("param dtype:", params[0]["w"].dtype, " final loss:", loss)
