"""Attacks on `master_weights`' promises: params never become inf from a finite master copy;
applying the updates (optax or Equinox, standard or strict promotion) keeps each param's dtype
and gives the rounded master copy; integer, boolean and Python-float leaves are handled.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from tests.conftest import BF16, F16, F32, HALF_DTYPES


@pytest.mark.parametrize("count", [False, True], ids=["default", "count_saturated"])
def test_finite_master_never_gives_inf_float16_params(count):
    # param 65000, SGD, gradient -600: the master copy would be 65600, beyond float16's 65504.
    tx = jaxmp.master_weights(optax.sgd(1.0), count_saturated=count)
    params = {"w": jnp.float16(65000.0), "v": jnp.ones(40, F16)}
    state = tx.init(params)
    step = jax.jit(tx.update)
    grads = {"w": jnp.float16(-600.0), "v": jnp.zeros(40, F16)}
    updates, state = step(grads, state, params)
    new = optax.apply_updates(params, updates)
    assert new["w"].dtype == F16 and float(new["w"]) == 65504.0
    assert float(state.master["w"]) == 65504.0  # saturated with the param
    assert int(state.saturated_steps) == (1 if count else 0)
    grads = {"w": jnp.float16(0.0), "v": jnp.full(40, -1.0, F16)}  # nothing saturates...
    updates, state = step(grads, state, new)
    assert int(state.saturated_steps) == (2 if count else 0)  # ...but w stays at the limit
    grads = {"w": jnp.float16(1.0), "v": jnp.zeros(40, F16)}
    updates, state = step(grads, state, optax.apply_updates(new, updates))
    assert int(state.saturated_steps) == (2 if count else 0)


def test_bfloat16_and_negative_saturation():
    tx = jaxmp.master_weights(optax.sgd(1.0))
    big = float(jnp.finfo(BF16).max)
    params = {"w": jnp.array([-big, big], BF16)}
    state = tx.init(params)
    updates, state = jax.jit(tx.update)({"w": jnp.array([big, -big], BF16)}, state, params)
    new = optax.apply_updates(params, updates)
    assert new["w"].dtype == BF16 and new["w"].astype(F32).tolist() == [-big, big]
    assert bool(jaxmp.all_finite((new, state)))


def test_nan_is_not_clipped_and_check_outputs_skips_it():
    # adam(eps=0) with zero gradients divides 0 by 0: saturation does not hide a NaN.
    tx = jaxmp.master_weights(optax.adam(1e-3, eps=0.0))
    params = {"w": jnp.ones(2, F16)}
    _, state = jax.jit(tx.update)({"w": jnp.zeros(2, F16)}, tx.init(params), params)
    assert np.isnan(np.asarray(state.master["w"])).all()
    guarded = jaxmp.loss_scaling(
        jaxmp.master_weights(optax.adam(1e-3, eps=0.0)), jaxmp.NoOpLossScale(), check_outputs=True
    )
    state = guarded.init(params)
    updates, new_state = jax.jit(guarded.update)({"w": jnp.zeros(2, F16)}, state, params)
    assert int(new_state.skipped_steps) == 1
    chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
    chex.assert_trees_all_equal(optax.apply_updates(params, updates), params)


def _apply_fns():
    fns = {"optax": optax.apply_updates}
    try:
        import equinox as eqx

        fns["equinox"] = eqx.apply_updates
    except ImportError:  # equinox is in the test extra; without it only optax's is checked
        pass
    return fns


@pytest.mark.parametrize("promotion", ["standard", "strict"])
@pytest.mark.parametrize("apply", sorted(_apply_fns()))
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
def test_applied_updates_keep_dtype_and_equal_rounded_master(dtype, apply, promotion):
    apply_fn = _apply_fns()[apply]
    rng = np.random.default_rng(0)
    full = {"w": jnp.asarray(rng.normal(size=(33,)), F32), "b": jnp.asarray(rng.normal(size=3))}
    tx = jaxmp.mixed_precision(optax.adam(1e-2), f"p={dtype.name},c={dtype.name}")
    state = tx.init(full)
    params = jaxmp.cast_tree(full, dtype)
    step = jax.jit(tx.update)
    for _ in range(5):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), dtype), params)
        updates, state = step(grads, state, params)
        with jax.numpy_dtype_promotion(promotion):
            params = apply_fn(params, updates)
        assert jax.tree.map(lambda p: p.dtype, params) == {"w": dtype, "b": dtype}
        chex.assert_trees_all_equal(params, jaxmp.cast_tree(state.inner_state.master, dtype))


def test_integer_boolean_and_python_float_leaves():
    params = {"w": jnp.ones(2, F16), "i": jnp.int32(3), "b": jnp.array(True), "alpha": 0.5}
    tx = jaxmp.loss_scaling(jaxmp.master_weights(optax.adam(0.1)), jaxmp.StaticLossScale(2.0))
    state = tx.init(params)
    grads = {"w": jnp.full(2, 2.0, F16), "i": jnp.int32(0), "b": jnp.array(False), "alpha": 2.0}
    step = jax.jit(tx.update)
    updates, state = step(grads, state, params)
    assert updates["i"].dtype == jnp.int32 and int(updates["i"]) == 0
    assert updates["b"].dtype == jnp.bool_ and not bool(updates["b"])
    assert updates["alpha"].dtype == F32
    new = optax.apply_updates(params, updates)
    assert int(new["i"]) == 3 and bool(new["b"]) and new["w"].dtype == F16
    np.testing.assert_allclose(float(new["alpha"]), 0.4, rtol=1e-5)  # trained as float32
    master = state.inner_state.master
    assert master["i"].dtype == jnp.int32 and master["b"].dtype == jnp.bool_
    _, state2 = step(grads, state, new)  # the state stays stable in structure and dtype
    chex.assert_trees_all_equal_dtypes(state2, state)


def test_complex_params_are_trained():
    # complex64 is not half precision: its master copy is itself, and it trains as plain optax.
    tx = jaxmp.mixed_precision(optax.sgd(1.0), "p=f16,c=f16", jaxmp.StaticLossScale(4.0))
    params = {"z": jnp.array([1 + 1j, 2 - 1j], jnp.complex64), "w": jnp.ones(2, F16)}
    state = tx.init(params)
    grads = {"z": jnp.array([4 + 4j, -4j], jnp.complex64), "w": jnp.full(2, 4.0, F16)}
    step = jax.jit(tx.update)
    updates, state = step(grads, state, params)
    assert updates["z"].dtype == jnp.complex64 and updates["z"].tolist() == [-1 - 1j, 1j]
    with jax.numpy_dtype_promotion("strict"):
        new = optax.apply_updates(params, updates)
    assert new["z"].tolist() == [0j, 2 + 0j] and new["w"].tolist() == [0.0, 0.0]
    assert state.inner_state.master["z"].tolist() == [0j, 2 + 0j]
    _, state2 = step(grads, state, new)
    chex.assert_trees_all_equal_dtypes(state2, state)


def test_applied_update_is_the_rounded_master_exactly_within_a_factor_of_2():
    # The docstring's promise: ``params + updates`` is exactly the rounded master copy when
    # a step leaves a param within a factor of 2 of its value (Sterbenz); beyond, within
    # rounding of the update. Every sampled pair of positive and negative float16 values
    # within a factor of 2, moved there by one SGD step on the master copy.
    rng = np.random.default_rng(0)
    finite = np.arange(2**16, dtype=np.uint16).view(np.float16)
    finite = finite[np.isfinite(finite) & (finite != 0)]
    p = rng.choice(finite[np.abs(finite) < 32752], 8192)  # twice them stays finite
    t = (p.astype(np.float64) * rng.uniform(0.5, 2.0, p.size)).astype(np.float16)
    params, target = {"w": jnp.asarray(p)}, jnp.asarray(t)
    tx = jaxmp.master_weights(optax.sgd(1.0))
    grads = {"w": jnp.asarray(p.astype(F32) - t.astype(F32))}  # exact in float32
    updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
    np.testing.assert_array_equal(state.master["w"], target.astype(F32))
    np.testing.assert_array_equal(optax.apply_updates(params, updates)["w"], target)
    # A factor of 2.3: the float16 update 1.794 - 0.775 rounds, and so does the sum.
    params = {"w": jnp.array([0.775], F16)}
    target = jnp.array([1.794], F16)
    grads = {"w": params["w"].astype(F32) - target.astype(F32)}
    updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
    applied = optax.apply_updates(params, updates)["w"]
    assert applied.dtype == F16 and float(applied[0]) != float(target[0])
    assert float(applied[0]) == float(np.nextafter(target[0], np.float16(2)))  # one ulp off


@pytest.mark.parametrize("count", [False, True], ids=["default", "count_saturated"])
def test_steps_at_the_edge_of_the_range_never_give_inf_params(count):
    tx = jaxmp.master_weights(optax.sgd(1.0), count_saturated=count)
    step = jax.jit(tx.update)
    # A step larger than float16's largest value: -64992 to 5024 (the update, 70016, is
    # inf in float16). The param moves by 65504 and reaches the master copy next step.
    params = {"w": jnp.array([-64992.0, 1.0], F16)}
    state = tx.init(params)
    updates, state = step({"w": jnp.array([-70016.0, 0.0])}, state, params)
    params = optax.apply_updates(params, updates)
    assert params["w"].tolist() == [512.0, 1.0] and float(state.master["w"][0]) == 5024.0
    updates, state = step({"w": jnp.zeros(2)}, state, params)
    assert optax.apply_updates(params, updates)["w"].tolist() == [5024.0, 1.0]
    # Rounding twice at the edge: 32688 to the saturated 65504. The update 32816 rounds to
    # 32832 in float16, and 32688 + 32832 = 65520 rounds to inf; the update one ulp less,
    # 32800, gives 65488, which rounds (to even) to 65472.
    params = {"w": jnp.array([32688.0], F16)}
    updates, state = step({"w": jnp.array([-32816.0])}, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    assert float(state.master["w"][0]) == 65504.0
    assert new["w"].dtype == F16 and float(new["w"][0]) == 65472.0
