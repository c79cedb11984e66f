import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from tests.conftest import BF16, F16, F32


@pytest.mark.parametrize(
    "policy, scale_type, has_master",
    [
        ("mixed_float16", jaxmp.DynamicLossScale, False),
        ("float16", jaxmp.DynamicLossScale, True),
        ("mixed_bfloat16", jaxmp.NoOpLossScale, False),
        ("bfloat16", jaxmp.NoOpLossScale, True),
        ("float32", jaxmp.NoOpLossScale, False),
        ("p=bf16,c=f16", jaxmp.DynamicLossScale, True),
    ],
)
def test_composition_per_policy(policy, scale_type, has_master):
    tx = jaxmp.mixed_precision(optax.adam(1e-3), policy)
    state = tx.init({"w": jnp.ones(3)})
    assert isinstance(state, jaxmp.LossScalingState)
    assert type(jaxmp.get_loss_scale(state)) is scale_type
    assert isinstance(state.inner_state, jaxmp.MasterWeightsState) == has_master
    if scale_type is jaxmp.DynamicLossScale:
        assert float(jaxmp.get_loss_scale(state).loss_scale) == 2.0**15


def test_explicit_loss_scale_and_policy_object():
    policy = jaxmp.Policy(F32, BF16, F32)
    tx = jaxmp.mixed_precision(optax.sgd(0.1), policy, jaxmp.StaticLossScale(8.0))
    assert float(jaxmp.get_loss_scale(tx.init({"w": jnp.ones(1)})).loss_scale) == 8.0


def _mlp_loss(params, x, y, compute_dtype):
    p = jaxmp.cast_tree(params, compute_dtype)
    h = jnp.tanh(x.astype(compute_dtype) @ p["w1"] + p["b1"])
    out = (h @ p["w2"]).astype(F32)
    return jnp.mean((out - y) ** 2)


@pytest.mark.parametrize("policy_name", ["mixed_float16", "float16", "mixed_bfloat16", "bfloat16"])
def test_trains_like_float32(policy_name):
    policy = jaxmp.get_policy(policy_name)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(64, 8)), F32)
    y = jnp.asarray(np.sin(np.asarray(x).sum(1, keepdims=True)), F32)
    k1, k2 = jax.random.split(jax.random.key(0))
    full = {
        "w1": jax.random.normal(k1, (8, 32)) / 3,
        "b1": jnp.zeros(32),
        "w2": jax.random.normal(k2, (32, 1)) / 6,
    }

    def train(policy):
        tx = jaxmp.mixed_precision(optax.adam(1e-2), policy)
        state = tx.init(full)
        params = policy.cast_to_param(full)

        @jax.jit
        def step(params, state):
            loss, grads = jaxmp.value_and_grad(_mlp_loss)(
                jaxmp.get_loss_scale(state), params, x, y, policy.compute_dtype
            )
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, loss

        for _ in range(150):
            params, state, loss = step(params, state)
        assert all(leaf.dtype == policy.param_dtype for leaf in jax.tree.leaves(params))
        return float(_mlp_loss(jaxmp.cast_to_full(params), x, y, F32)), state

    initial = float(_mlp_loss(full, x, y, F32))
    ref, _ = train(jaxmp.get_policy("float32"))
    ours, state = train(policy)
    assert ours < 0.02 * initial  # it learned
    assert abs(ours - ref) < 0.005 * initial  # as well as float32 did
    if policy.compute_dtype == F16:
        scale = float(jaxmp.get_loss_scale(state).loss_scale)
        skipped = int(state.skipped_steps)
        assert scale == 2.0 ** (15 - skipped)  # period 2000: no growth, one halving per skip


def test_bad_arguments():
    with pytest.raises(ValueError, match="Unknown dtype or policy name 'fp8' in `policy`"):
        jaxmp.mixed_precision(optax.sgd(0.1), "fp8")
    with pytest.raises(TypeError, match="`inner` must be an optax.GradientTransformation"):
        jaxmp.mixed_precision("adam", "f32")
    with pytest.raises(TypeError, match="`loss_scale` must be a jaxmp loss scale"):
        jaxmp.mixed_precision(optax.sgd(0.1), "f32", "dynamic")


def test_default_loss_scale():
    assert isinstance(jaxmp.default_loss_scale("c=f16"), jaxmp.DynamicLossScale)
    assert isinstance(jaxmp.default_loss_scale(jaxmp.Policy(F16, BF16)), jaxmp.NoOpLossScale)


def test_skipped_step_keeps_params_and_state():
    tx = jaxmp.mixed_precision(optax.adam(0.1), "float16")
    full = {"w": jnp.linspace(-1, 1, 5)}
    state = tx.init(full)
    params = jaxmp.cast_tree(full, F16)
    updates, new_state = jax.jit(tx.update)({"w": jnp.full(5, jnp.inf, F16)}, state, params)
    new_params = optax.apply_updates(params, updates)
    chex.assert_trees_all_equal(new_params, params)
    chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)


def test_axis_name_reaches_loss_scaling():
    tx = jaxmp.mixed_precision(optax.sgd(1.0), "mixed_float16", axis_name="devices")
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    grads = {"w": jnp.array([[1.0, 1.0], [jnp.nan, 1.0]])}  # device 1 overflows

    def update(g, s, p):
        return tx.update(g, s, p)

    _, states = jax.vmap(update, in_axes=(0, None, None), out_axes=(0, 0), axis_name="devices")(
        grads, state, params
    )
    assert states.skipped_steps.tolist() == [1, 1]  # both devices skip
