"""`kahan_summation`: what rounding loses is carried in a buffer of the params' dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from tests.conftest import BF16, F32, HALF_DTYPES


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
def test_tiny_updates_accumulate(dtype):
    params = {"w": jnp.ones((), dtype)}
    grads = {"w": jnp.ones((), dtype)}
    tx = jaxmp.kahan_summation(optax.sgd(1e-4))
    state = tx.init(params)
    assert state.compensation["w"].dtype == dtype

    @jax.jit
    def step(p, s):
        u, s = tx.update(grads, s, p)
        return optax.apply_updates(p, u), s

    for _ in range(200):
        params, state = step(params, state)
    exact = 1 - 200 * 1e-4
    spacing = float(jnp.finfo(dtype).eps) / 2  # below 1.0
    assert params["w"].dtype == dtype
    # The param is the exact sum to within one spacing (plain half-precision SGD stays at 1.0,
    # 0.02 away); with the buffer, to within a quarter of one (the buffer's own rounding).
    assert abs(float(params["w"]) - exact) <= spacing
    total = float(params["w"].astype(F32)) + float(state.compensation["w"].astype(F32))
    assert abs(total - exact) <= spacing / 4


def test_buffer_has_the_params_dtype_under_mixed_precision():
    # loss_scaling initialises what it wraps with float32 params: the buffer's dtype comes
    # from the policy.
    tx = jaxmp.mixed_precision(optax.adam(1e-3), "bf16", master_weights=False, rounding="kahan")
    state = tx.init({"w": jnp.ones((4, 3), F32), "step": jnp.int32(0)})
    kahan = state.inner_state
    assert isinstance(kahan, jaxmp.KahanSummationState)
    assert kahan.compensation["w"].dtype == BF16 and kahan.compensation["step"] is None
    assert kahan.inner_state[0].mu["w"].dtype == F32


def test_other_leaves_pass_through():
    params = {"w": jnp.ones(4, BF16), "f32": jnp.ones(3, F32), "step": jnp.int32(3)}
    tx = jaxmp.kahan_summation(optax.sgd(0.5))
    state = tx.init(params)
    grads = {"w": jnp.ones(4, BF16), "f32": jnp.ones(3, F32), "step": jnp.int32(0)}
    updates, state = jax.jit(tx.update)(grads, state, params)
    assert jax.tree.map(lambda u: u.dtype, updates) == jax.tree.map(lambda p: p.dtype, params)
    np.testing.assert_array_equal(updates["f32"], -0.5)
    assert int(updates["step"]) == 0 and state.compensation["step"] is None


def test_never_inf_at_the_edge_of_the_range():
    big = float(jnp.finfo(BF16).max)
    params = {"w": jnp.asarray([big, -big], BF16)}
    tx = jaxmp.kahan_summation(optax.sgd(1.0))
    state = tx.init(params)
    for _ in range(3):
        updates, state = jax.jit(tx.update)({"w": jnp.asarray([-big, big], F32)}, state, params)
        params = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(params["w"].astype(F32), [big, -big])


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
def test_update_is_strict_promotion_clean(dtype):
    tx = jaxmp.kahan_summation(optax.sgd(0.1))
    params = {"w": jnp.ones(8, dtype)}
    state = tx.init(params)
    with jax.numpy_dtype_promotion("strict"):
        updates, state = jax.jit(tx.update)({"w": jnp.ones(8, dtype)}, state, params)
        new = optax.apply_updates(params, updates)
    assert updates["w"].dtype == new["w"].dtype == state.compensation["w"].dtype == dtype


def test_bad_arguments():
    with pytest.raises(ValueError, match="`dtype` must be a floating-point dtype, got int32"):
        jaxmp.kahan_summation(optax.sgd(0.1), jnp.int32)
    tx = jaxmp.kahan_summation(optax.sgd(0.1))
    with pytest.raises(ValueError, match="`params` must be passed"):
        tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}))
