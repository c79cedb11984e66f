"""Fault-injection soak: thousands of steps with inf/NaN injected at random rates."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp

STEPS = 3000


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["mixed_float16", "float16", "bfloat16"])
@pytest.mark.parametrize("rate", [0.01, 0.2, 0.7])
def test_soak_never_corrupts_state(policy, rate):
    policy = jaxmp.get_policy(policy)
    # The bound keeps these small gradients from overflowing on their own, so that every
    # skip is an injected one.
    loss_scale = jaxmp.DynamicLossScale(2.0**8, period=50, max_loss_scale=2.0**12)
    tx = jaxmp.mixed_precision(optax.adam(1e-3), policy, loss_scale)
    rng = np.random.default_rng(int(rate * 100))
    full = {"w": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32), "b": jnp.zeros(8)}
    params = policy.cast_to_param(full)
    state = tx.init(full)
    x = jnp.asarray(rng.normal(size=(STEPS, 4, 16)), jnp.float32)
    poison = rng.random(STEPS) < rate
    kinds = rng.integers(0, 3, STEPS)  # +inf, -inf, nan

    def loss_fn(p, xb):
        p = policy.cast_to_compute(p)
        out = jnp.tanh(xb.astype(policy.compute_dtype) @ p["w"] + p["b"]).astype(jnp.float32)
        return jnp.mean(out**2)

    def body(carry, inputs):
        params, state = carry
        xb, bad, kind = inputs
        _, grads = jaxmp.value_and_grad(loss_fn)(jaxmp.get_loss_scale(state), params, xb)
        value = jnp.select([kind == 0, kind == 1], [jnp.inf, -jnp.inf], jnp.nan)
        where = (3, 5)  # one element of one leaf
        grads["w"] = grads["w"].at[where].set(jnp.where(bad, value, grads["w"][where]))
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        finite = jaxmp.all_finite((params, state))
        metrics = jaxmp.loss_scale_metrics(state)
        return (params, state), (finite, metrics["loss_scale"], metrics["grads_finite"])

    (params, state), (finite, scales, grads_finite) = jax.jit(
        lambda c, i: jax.lax.scan(body, c, i)
    )((params, state), (x, jnp.asarray(poison), jnp.asarray(kinds)))
    assert bool(np.all(finite))  # params and optimizer state finite after every step
    scales = np.asarray(scales)
    assert np.all(np.isfinite(scales)) and np.all(scales >= 1.0) and np.all(scales <= 2.0**12)
    np.testing.assert_array_equal(np.asarray(grads_finite), ~poison)
    # Every injected fault is skipped, and nothing else is (these gradients never overflow
    # at the scales the rule reaches).
    assert int(state.skipped_steps) == int(poison.sum())
    assert all(leaf.dtype == policy.param_dtype for leaf in jax.tree.leaves(params))
