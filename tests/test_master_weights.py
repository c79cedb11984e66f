import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxmp
from tests.conftest import F32, HALF_DTYPES


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
def test_tiny_updates_accumulate(dtype):
    params = {"w": jnp.ones((), dtype)}
    grads = {"w": jnp.ones((), dtype)}
    tx = jaxmp.master_weights(optax.sgd(1e-4))
    state = tx.init(params)

    @jax.jit
    def step(p, s):
        u, s = tx.update(grads, s, p)
        return optax.apply_updates(p, u), s

    plain_tx = optax.sgd(1e-4)
    plain, plain_state = params, plain_tx.init(params)
    for _ in range(200):
        params, state = step(params, state)
        u, plain_state = plain_tx.update(grads, plain_state, plain)
        plain = optax.apply_updates(plain, u)
    assert float(plain["w"]) == 1.0  # plain half-precision SGD is stuck
    np.testing.assert_allclose(float(state.master["w"]), 1 - 200 * 1e-4, rtol=1e-5)
    assert params["w"].dtype == dtype
    assert params["w"] == jnp.asarray(1 - 200 * 1e-4, F32).astype(dtype)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
def test_apply_updates_equals_rounded_master(dtype):
    rng = np.random.default_rng(0)
    full = {
        "w": jnp.asarray(rng.normal(size=(64,)), F32),
        "b": jnp.asarray(rng.normal(size=8), F32),
    }
    tx = jaxmp.master_weights(optax.adam(1e-2))
    state = tx.init(full)  # full-precision init: master starts exact
    chex.assert_trees_all_equal(state.master, full)
    params = jaxmp.cast_tree(full, dtype)
    step = jax.jit(tx.update)
    for _ in range(20):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), dtype), params)
        updates, state = step(grads, state, params)
        params = optax.apply_updates(params, updates)
        chex.assert_trees_all_equal(params, jaxmp.cast_tree(state.master, dtype))
        assert jax.tree.map(lambda m: m.dtype, state.master) == {"w": F32, "b": F32}


@settings(max_examples=60, deadline=None)
@given(
    st.floats(-6e4, 6e4, allow_subnormal=False),
    st.floats(-0.499, 1.0),
    st.sampled_from(HALF_DTYPES),
)
def test_delta_is_exact_property(param, step, dtype):
    # A step leaving a parameter within a factor of 2 of its value is applied exactly
    # (Sterbenz: the difference of two floats within a factor of 2 is exact).
    p = jnp.asarray(param, dtype)
    master = p.astype(F32) * (1 + jnp.float32(step))
    tx = jaxmp.master_weights(optax.identity())
    state = tx.init({"w": p})
    delta = {"w": master - p.astype(F32)}
    updates, state = tx.update(delta, state, {"w": p})
    assert updates["w"].dtype == dtype
    new = optax.apply_updates({"w": p}, updates)["w"]
    assert new.dtype == dtype
    assert new == state.master["w"].astype(dtype)


def test_update_requires_params():
    tx = jaxmp.master_weights(optax.sgd(0.1))
    state = tx.init({"w": jnp.ones(2)})
    with pytest.raises(ValueError, match="`params` must be passed"):
        tx.update({"w": jnp.ones(2)}, state)


def test_structure_mismatch_names_leaf():
    tx = jaxmp.master_weights(optax.sgd(0.1))
    state = tx.init({"w": jnp.ones(2)})
    with pytest.raises(ValueError, match=r"leaves only in `params`: \['v'\]"):
        tx.update({"w": jnp.ones(2)}, state, {"w": jnp.ones(2), "v": jnp.ones(1)})


def test_bad_dtype():
    with pytest.raises(ValueError, match="`dtype` must be a floating-point dtype, got int32"):
        jaxmp.master_weights(optax.sgd(0.1), jnp.int32)


def test_integer_leaves_pass_through():
    params = {"w": jnp.ones(2, jnp.float16), "step": jnp.int32(3)}
    tx = jaxmp.master_weights(optax.set_to_zero())
    state = tx.init(params)
    assert state.master["step"].dtype == jnp.int32
    updates, _ = tx.update({"w": jnp.ones(2, jnp.float16), "step": jnp.int32(0)}, state, params)
    assert updates["w"].dtype == jnp.float16
    assert updates["step"].dtype == jnp.int32 and int(updates["step"]) == 0


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
def test_update_is_strict_promotion_clean(dtype):
    tx = jaxmp.master_weights(optax.sgd(0.5))
    params = {"w": jnp.ones(2, dtype)}
    state = tx.init(params)
    with jax.numpy_dtype_promotion("strict"):
        updates, state = jax.jit(tx.update)({"w": jnp.ones(2, dtype)}, state, params)
    assert updates["w"].dtype == dtype
    np.testing.assert_array_equal(updates["w"], -0.5)
