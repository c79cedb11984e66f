import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from tests.conftest import F32, HALF_DTYPES


def _params():
    return {"w": jnp.arange(6.0).reshape(2, 3) / 10, "b": jnp.ones(3)}


def _grads(params, scale, dtype=jnp.float32, bad=None):
    grads = jax.tree.map(lambda p: (jnp.ones_like(p) * 0.5 * scale).astype(dtype), params)
    if bad is not None:
        grads["w"] = grads["w"].at[0, 1].set(bad)
    return grads


def _strict(fn):
    def wrapped(*args, **kwargs):
        with jax.numpy_dtype_promotion("strict"):
            return fn(*args, **kwargs)

    return wrapped


@pytest.mark.parametrize("grad_dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_unscales_in_float32_before_inner(grad_dtype):
    seen = []

    def record_init(params):
        return optax.EmptyState()

    def record_update(updates, state, params=None):
        seen.append(jax.tree.map(lambda u: u.dtype, updates))
        return updates, state

    tx = jaxmp.loss_scaling(
        optax.GradientTransformation(record_init, record_update), jaxmp.StaticLossScale(1024.0)
    )
    params = _params()
    state = tx.init(params)
    updates, state = jax.jit(_strict(tx.update))(_grads(params, 1024.0, grad_dtype), state, params)
    assert seen[-1] == {"w": F32, "b": F32}
    chex.assert_trees_all_equal(updates, jax.tree.map(lambda p: jnp.full_like(p, 0.5), params))


def test_skip_leaves_inner_state_bit_identical_and_zero_updates():
    tx = jaxmp.loss_scaling(optax.adam(0.1), jaxmp.DynamicLossScale(2.0**8, period=2))
    params = _params()
    state = tx.init(params)
    step = jax.jit(tx.update)  # optax.adam itself is not strict-promotion clean
    _, state = step(_grads(params, 2.0**8), state, params)  # one finite step: non-trivial moments
    before = state
    for bad in [jnp.inf, -jnp.inf, jnp.nan]:
        updates, state = step(_grads(params, 2.0**8, bad=bad), state, params)
        chex.assert_trees_all_equal(state.inner_state, before.inner_state)
        for leaf in jax.tree.leaves(updates):
            assert leaf.dtype == F32 and not np.any(np.asarray(leaf))
    assert int(state.skipped_steps) == 3 and int(state.consecutive_skipped_steps) == 3
    assert not bool(state.grads_finite)
    assert float(state.loss_scale.loss_scale) == 2.0**5
    updates, state = step(_grads(params, 2.0**5), state, params)
    assert bool(state.grads_finite) and int(state.consecutive_skipped_steps) == 0
    assert int(state.skipped_steps) == 3
    assert int(state.inner_state[0].count) == 2


def test_finite_step_matches_inner_on_unscaled_grads():
    inner = optax.adam(0.1)
    tx = jaxmp.loss_scaling(inner, jaxmp.StaticLossScale(2.0**12))
    params = _params()
    ours, _ = jax.jit(tx.update)(_grads(params, 2.0**12), tx.init(params), params)
    ref, _ = inner.update(_grads(params, 1.0), inner.init(params), params)
    chex.assert_trees_all_close(ours, ref, rtol=1e-6)


def test_never_gives_up_unlike_apply_if_finite():
    params = _params()
    tx = jaxmp.loss_scaling(optax.sgd(1.0), jaxmp.DynamicLossScale(1.0))
    state = tx.init(params)
    theirs = optax.apply_if_finite(optax.sgd(1.0), max_consecutive_errors=3)
    their_state = theirs.init(params)
    grads = _grads(params, 1.0, bad=jnp.nan)
    theirs_applied_nan = False
    for _ in range(6):
        updates, state = tx.update(grads, state, params)
        assert bool(jaxmp.all_finite(updates))
        their_updates, their_state = theirs.update(grads, their_state, params)
        theirs_applied_nan |= not bool(jaxmp.all_finite(their_updates))
    assert theirs_applied_nan  # optax gives up after max_consecutive_errors
    assert int(state.skipped_steps) == 6


def test_clip_by_global_norm_inside_sees_unscaled_grads():
    params = _params()
    inner = optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(1.0))
    tx = jaxmp.loss_scaling(inner, jaxmp.StaticLossScale(2.0**14))
    updates, _ = tx.update(_grads(params, 2.0**14), tx.init(params), params)
    norm = optax.tree.norm(updates)
    np.testing.assert_allclose(norm, 1e-3, rtol=1e-5)


def test_inject_hyperparams_inside():
    params = _params()
    inner = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
    tx = jaxmp.loss_scaling(inner, jaxmp.StaticLossScale(4.0))
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(_grads(params, 4.0), state, params)
    chex.assert_trees_all_close(updates, jax.tree.map(lambda p: jnp.full_like(p, -0.25), params))
    state.inner_state.hyperparams["learning_rate"] = jnp.asarray(1.0)
    updates, state = jax.jit(tx.update)(_grads(params, 4.0), state, params)
    chex.assert_trees_all_close(updates, jax.tree.map(lambda p: jnp.full_like(p, -0.5), params))


def test_multisteps_inside_loss_scaling_accumulates_unscaled():
    params = _params()
    tx = jaxmp.loss_scaling(
        optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2),
        jaxmp.DynamicLossScale(2.0**4, period=100),
    )
    state = tx.init(params)
    step = jax.jit(tx.update)
    # Mini-step 1 finite at scale 16, mini-step 2 overflows (skipped, scale halves, accumulator
    # untouched), mini-step 3 at scale 8 completes the accumulation.
    u1, state = step(_grads(params, 16.0), state, params)
    u2, state = step(_grads(params, 16.0, bad=jnp.inf), state, params)
    assert float(state.loss_scale.loss_scale) == 8.0 and int(state.skipped_steps) == 1
    u3, state = step(_grads(params, 8.0), state, params)
    for u in (u1, u2):
        assert not np.any(np.asarray(u["w"]))
    chex.assert_trees_all_close(u3, jax.tree.map(lambda p: jnp.full_like(p, -0.5), params))


def test_multisteps_skip_not_finite_inside_does_not_hide_overflow():
    params = _params()
    inner = optax.MultiSteps(
        optax.sgd(1.0), every_k_schedule=2, should_skip_update_fn=optax.skip_not_finite
    )
    tx = jaxmp.loss_scaling(inner, jaxmp.DynamicLossScale(2.0**4))
    state = tx.init(params)
    _, state = tx.update(_grads(params, 16.0, bad=jnp.nan), state, params)
    assert float(state.loss_scale.loss_scale) == 8.0  # the scaler saw the overflow


def test_multisteps_outside_skips_whole_accumulation():
    params = _params()
    tx = optax.MultiSteps(
        jaxmp.loss_scaling(optax.sgd(1.0), jaxmp.DynamicLossScale(2.0**4)), every_k_schedule=2
    )
    state = tx.init(params)
    _, state = tx.update(_grads(params, 16.0, bad=jnp.nan), state, params)
    updates, state = tx.update(_grads(params, 16.0), state, params)
    assert not np.any(np.asarray(updates["w"]))
    assert float(jaxmp.get_loss_scale(state).loss_scale) == 8.0


def test_state_is_arrays_only():
    tx = jaxmp.mixed_precision(optax.adam(0.1), "p=f16,c=f16")
    state = tx.init(_params())
    for leaf in jax.tree.leaves(state):
        assert isinstance(leaf, jax.Array), type(leaf)


def test_state_dtypes_and_structure_stable_under_scan():
    tx = jaxmp.loss_scaling(optax.adam(0.1), jaxmp.DynamicLossScale(2.0**8, period=2))
    params = _params()
    state = tx.init(params)
    grads = jnp.stack([jnp.ones(3) * 2.0**8, jnp.full(3, jnp.inf), jnp.ones(3)])

    def body(carry, g):
        p, s = carry
        u, s = tx.update({"w": jnp.ones((2, 3)) * g[0], "b": g}, s, p)
        return (optax.apply_updates(p, u), s), s.loss_scale.loss_scale

    (params2, state2), scales = jax.lax.scan(body, (params, state), grads)
    assert jax.tree.structure(state2) == jax.tree.structure(state)
    chex.assert_trees_all_equal_dtypes(state2, state)
    assert scales.tolist() == [256.0, 128.0, 128.0]


def test_vmap_over_independent_runs():
    tx = jaxmp.loss_scaling(optax.sgd(1.0), jaxmp.DynamicLossScale(2.0**4))
    params = {"w": jnp.ones((2, 3))}
    states = jax.vmap(tx.init)(params)
    grads = {"w": jnp.array([[1.0, 1.0, 1.0], [1.0, jnp.nan, 1.0]])}
    updates, states = jax.vmap(tx.update)(grads, states, params)
    assert states.skipped_steps.tolist() == [0, 1]
    assert states.loss_scale.loss_scale.tolist() == [16.0, 8.0]
    assert not np.any(np.asarray(updates["w"][1]))


def test_no_retrace_on_second_step():
    traces = []
    tx = jaxmp.loss_scaling(optax.adam(0.1))
    params = _params()

    @jax.jit
    def step(p, s, g):
        traces.append(1)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    state = tx.init(params)
    for bad in [None, jnp.nan, None]:
        params, state = step(params, state, _grads(params, 2.0**15, bad=bad))
    assert len(traces) == 1


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
def test_half_params_without_master(dtype):
    params = jaxmp.cast_tree(_params(), dtype)
    tx = jaxmp.loss_scaling(optax.sgd(0.5), jaxmp.StaticLossScale(2.0))
    updates, _ = tx.update(_grads(params, 2.0, dtype), tx.init(params), params)
    new = optax.apply_updates(params, updates)
    assert all(leaf.dtype == dtype for leaf in jax.tree.leaves(new))


def test_bad_arguments():
    with pytest.raises(TypeError, match="`inner` must be an optax.GradientTransformation"):
        jaxmp.loss_scaling(optax.adam)
    with pytest.raises(TypeError, match="`loss_scale` must be a jaxmp loss scale"):
        jaxmp.loss_scaling(optax.adam(0.1), 2.0**15)
    tx = jaxmp.loss_scaling(optax.adam(0.1))
    with pytest.raises(TypeError, match="`state` must be the LossScalingState"):
        tx.update(_params(), optax.adam(0.1).init(_params()), _params())


def test_grads_params_structure_mismatch_error():
    tx = jaxmp.loss_scaling(optax.adam(0.1))
    params = _params()
    state = tx.init(params)
    with pytest.raises(
        ValueError, match=r"`grads` and `params` .* leaves only in `params`: \['b'\]"
    ):
        tx.update({"w": params["w"]}, state, params)


def test_accepts_jmp_loss_scales():
    import jmp

    tx = jaxmp.loss_scaling(optax.sgd(1.0), jmp.DynamicLossScale(jnp.float32(8.0), period=5))
    ls = jaxmp.get_loss_scale(tx.init(_params()))
    assert isinstance(ls, jaxmp.DynamicLossScale) and ls.period == 5
    assert float(ls.loss_scale) == 8.0
    assert isinstance(
        jaxmp.get_loss_scale(
            jaxmp.loss_scaling(optax.sgd(1.0), jmp.NoOpLossScale()).init(_params())
        ),
        jaxmp.NoOpLossScale,
    )


@pytest.mark.parametrize("axis_name", [123, ("data", 1), (), b"data", {"data"}])
def test_bad_axis_name_fails_at_construction(axis_name):
    with pytest.raises(TypeError, match="`axis_name` must be None, a mapped axis name"):
        jaxmp.loss_scaling(optax.sgd(0.1), axis_name=axis_name)
    with pytest.raises(TypeError, match="`axis_name` must be None"):
        jaxmp.mixed_precision(optax.sgd(0.1), "mixed_float16", axis_name=axis_name)


@pytest.mark.parametrize("axis_name", ["data", ("data", "model"), ["data"]])
def test_axis_names_are_accepted(axis_name):
    jaxmp.loss_scaling(optax.sgd(0.1), axis_name=axis_name)
