"""Attacks on `loss_scaling`'s promises: what a skipped step keeps out, and what it composes with.

The promise (README, `loss_scaling` docstring): a step whose unscaled gradients, ``value`` or
``grad`` extra argument are not finite is skipped (zero updates, inner state bit-identical);
with ``check_outputs=True`` so is a step whose updates, new inner state or ``params + updates``
are not finite. Gradients are never narrowed (float64 stays float64), complex gradients are
unscaled and checked, and nesting `loss_scaling` raises.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest

import jaxmp
from tests.conftest import F32


def _strict(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.numpy_dtype_promotion("strict"):
            return fn(*args, **kwargs)

    return wrapped


# --- float64 and complex gradients ------------------------------------------------------


def test_float64_gradients_are_never_narrowed():
    with jax.enable_x64(True):
        tx = jaxmp.loss_scaling(optax.sgd(1.0), jaxmp.StaticLossScale(4.0))
        params = {"w": jnp.ones(2, jnp.float64)}
        state = tx.init(params)
        grads = {"w": jnp.array([4e-12, 4e300], jnp.float64)}  # scaled by 4
        updates, state = jax.jit(_strict(tx.update))(grads, state, params)
        assert updates["w"].dtype == jnp.float64
        assert updates["w"].tolist() == [-1e-12, -1e300]
        assert bool(state.grads_finite) and int(state.skipped_steps) == 0


def test_complex_gradients_are_unscaled_and_checked():
    tx = jaxmp.loss_scaling(optax.sgd(1.0), jaxmp.StaticLossScale(1024.0))
    params = {"z": jnp.ones(2, jnp.complex64), "w": jnp.ones(2)}
    state = tx.init(params)
    step = jax.jit(_strict(tx.update))
    grads = {"z": jnp.array([1024 + 2048j, -1024j], jnp.complex64), "w": jnp.full(2, 1024.0)}
    updates, state = step(grads, state, params)
    assert updates["z"].dtype == jnp.complex64
    assert updates["z"].tolist() == [-1 - 2j, 1j]
    bad = {**grads, "z": grads["z"].at[1].set(complex(np.nan, 0.0))}
    updates, state = step(bad, state, params)
    assert not bool(state.grads_finite) and int(state.skipped_steps) == 1
    assert updates["z"].tolist() == [0j, 0j] and updates["w"].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_python_float_gradient_leaves_are_unscaled_and_checked(jit):
    # A Python float gradient (an Equinox module's float field) is a number like any other.
    tx = jaxmp.loss_scaling(optax.sgd(1.0), jaxmp.StaticLossScale(4.0))
    params = {"alpha": 0.5, "w": jnp.ones(2)}
    update = jax.jit(tx.update) if jit else tx.update
    updates, state = update({"alpha": 4.0, "w": jnp.full(2, 4.0)}, tx.init(params), params)
    assert float(updates["alpha"]) == -1.0 and updates["alpha"].dtype == F32
    updates, state = update({"alpha": float("inf"), "w": jnp.full(2, 4.0)}, state, params)
    assert int(state.skipped_steps) == 1 and float(updates["alpha"]) == 0.0


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
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["float16", "bfloat16"])
def test_half_params_updates_keep_each_param_dtype(dtype, apply, promotion):
    # Without master weights, applying the updates to float16 or bfloat16 params keeps
    # their dtype, with optax's and Equinox's apply_updates, under standard and strict
    # promotion (Equinox adds without casting back: float32 updates would make the params
    # float32 after the first step; strict promotion refused float16 + float32).
    tx = jaxmp.loss_scaling(optax.sgd(0.05, momentum=0.9), jaxmp.StaticLossScale(4.0))
    params = {"w": jnp.linspace(1, 3, 40).astype(dtype), "b": jnp.ones(3, dtype)}
    state = tx.init(params)
    # Under strict promotion, the update itself too: the float32 state and updates meet
    # only float32 values inside it.
    step = jax.jit(_strict(tx.update) if promotion == "strict" else tx.update)
    # Plain optax with a float32 state, its float32 updates applied by optax (standard
    # promotion rounds each sum to the param's dtype): the same params, since every step
    # stays within a factor of 2.
    plain = optax.sgd(0.05, momentum=0.9)
    ref, ref_state = params, plain.init(jax.tree.map(lambda p: p.astype(F32), params))
    for k in range(3):
        grads = jax.tree.map(lambda p, k=k: jnp.full(p.shape, 0.375 * (k + 1), F32), params)
        scaled = jax.tree.map(lambda g: (g * 4.0).astype(dtype), grads)
        updates, state = step(scaled, state, params)
        assert jax.tree.map(lambda u: u.dtype, updates) == {"w": dtype, "b": dtype}
        with jax.numpy_dtype_promotion(promotion):
            params = _apply_fns()[apply](params, updates)
        assert jax.tree.map(lambda p: p.dtype, params) == {"w": dtype, "b": dtype}
        ref_updates, ref_state = plain.update(grads, ref_state)
        ref = optax.apply_updates(ref, ref_updates)
        chex.assert_trees_all_equal(params, ref)
    assert jax.tree.map(lambda m: m.dtype, state.inner_state[0].trace) == {"w": F32, "b": F32}


def test_half_params_never_overflow_to_inf():
    # Without master weights, a float16 param at 64992 stepping by 600 saturates at 65504
    # (float32 updates would give inf in `optax.apply_updates`); a step of more than 65504,
    # -64992 to 5008, moves it by 65504.
    tx = jaxmp.loss_scaling(optax.sgd(1.0), jaxmp.NoOpLossScale())
    params = {"w": jnp.array([64992.0, -64992.0, 1.0], jnp.float16)}
    grads = {"w": jnp.array([-600.0, -70000.0, -0.5], F32)}
    updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert optax.apply_updates(params, updates)["w"].tolist() == [65504.0, 512.0, 1.5]
    assert bool(state.grads_finite)


# --- extra arguments --------------------------------------------------------------------


def test_non_finite_value_skips_reduce_on_plateau():
    inner = optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau(patience=1))
    tx = jaxmp.loss_scaling(inner, jaxmp.StaticLossScale(2.0))
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    step = jax.jit(tx.update)
    grads = {"w": jnp.full(3, 2.0)}
    _, state = step(grads, state, params, value=jnp.float32(1.0))
    before = state.inner_state
    for bad in (jnp.nan, jnp.inf):
        updates, state = step(grads, state, params, value=jnp.float32(bad))
        chex.assert_trees_all_equal(state.inner_state, before)
        assert updates["w"].tolist() == [0.0, 0.0, 0.0]
    assert int(state.skipped_steps) == 2
    assert np.isfinite(float(state.inner_state[1].avg_value))


def test_grad_extra_argument_is_unscaled():
    seen = {}

    def update(updates, state, params=None, *, grad=None, **extra):
        del params, extra
        seen["grad"] = grad
        return updates, state

    inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)
    tx = jaxmp.loss_scaling(inner, jaxmp.StaticLossScale(1024.0))
    params = {"w": jnp.ones(2)}
    scaled = {"w": jnp.full(2, 1024.0, jnp.float16)}
    tx.update(scaled, tx.init(params), params, grad=scaled)
    assert seen["grad"]["w"].dtype == F32 and seen["grad"]["w"].tolist() == [1.0, 1.0]
    _, state = tx.update(scaled, tx.init(params), params, grad={"w": jnp.full(2, jnp.inf)})
    assert not bool(state.grads_finite)


def test_lbfgs_matches_optax_on_unscaled_gradients():
    def loss(params):
        return jnp.sum((params["w"] - jnp.arange(3.0)) ** 2)

    params = {"w": jnp.zeros(3)}
    ours = jaxmp.loss_scaling(optax.lbfgs(), jaxmp.StaticLossScale(2.0**10))
    theirs = optax.lbfgs()
    ours_state, their_state = ours.init(params), theirs.init(params)
    p_ours = p_theirs = params
    for _ in range(2):
        value, grads = jax.value_and_grad(loss)(p_ours)
        scaled = jax.tree.map(lambda g: g * 2.0**10, grads)
        u, ours_state = ours.update(
            scaled, ours_state, p_ours, value=value, grad=scaled, value_fn=loss
        )
        p_ours = optax.apply_updates(p_ours, u)
        value, grads = jax.value_and_grad(loss)(p_theirs)
        u, their_state = theirs.update(
            grads, their_state, p_theirs, value=value, grad=grads, value_fn=loss
        )
        p_theirs = optax.apply_updates(p_theirs, u)
    chex.assert_trees_all_close(p_ours, p_theirs, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(p_ours, {"w": jnp.arange(3.0)}, atol=1e-5)


# --- skipped steps: hypergradients, debug_nans ------------------------------------------


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_hypergradient_of_a_skipped_step_is_zero(jit):
    params = {"w": jnp.ones(2)}

    def applied(lr):
        tx = jaxmp.loss_scaling(optax.adam(lr), jaxmp.StaticLossScale(1.0))
        updates, _ = tx.update({"w": jnp.array([1.0, jnp.inf])}, tx.init(params), params)
        return jnp.sum(optax.apply_updates(params, updates)["w"])

    grad = jax.grad(applied)
    value = (jax.jit(grad) if jit else grad)(jnp.float32(0.1))
    assert float(value) == 0.0


@pytest.mark.parametrize(
    "inner",
    [
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1)),
        optax.MultiSteps(optax.adam(0.1), every_k_schedule=2),
        optax.inject_hyperparams(optax.adam)(learning_rate=0.1),
    ],
    ids=["chain(clip_by_global_norm, adam)", "MultiSteps", "inject_hyperparams"],
)
def test_debug_nans_jitted_overflow_step_does_not_raise(inner):
    # Under jit only the outputs are checked, and a skipped step's are finite. (Eager, an
    # inner update that divides by the gradients' norm computes 0 / 0 on the zeros it runs
    # on, as plain optax does on zero gradients: `jax_debug_nans` fires there.)
    tx = jaxmp.mixed_precision(inner, "p=f16,c=f16")
    params = {"w": jnp.ones(3, jnp.float16)}
    state = tx.init(params)
    with jax.debug_nans(True):
        updates, state = jax.jit(tx.update)(
            {"w": jnp.array([1.0, jnp.inf, -jnp.inf], jnp.float16)}, state, params
        )
    assert updates["w"].tolist() == [0.0, 0.0, 0.0] and int(state.skipped_steps) == 1


def test_hypergradient_through_scan_vmap_jit_ignores_the_skipped_step():
    # jit(vmap(grad(scan(update)))) with float16 params and master weights: a skipped step
    # in the middle of the run contributes exactly nothing, to the params or to their
    # gradient with respect to the learning rate.
    full = {"w": jnp.linspace(1.0, 2.0, 40).reshape(5, 8), "b": jnp.ones(3)}
    grads = [jax.tree.map(lambda p, k=k: jnp.full(p.shape, 0.25 * (k + 1)), full) for k in range(2)]
    poisoned = {**grads[1], "w": grads[1]["w"].at[1, 2].set(jnp.nan)}

    def final_sum(lr, sequence):
        tx = jaxmp.mixed_precision(optax.adam(lr), "p=f16,c=f16")

        def body(carry, g):
            p, s = carry
            scale = jaxmp.get_loss_scale(s).loss_scale
            scaled = jax.tree.map(lambda g, p: (g * scale).astype(p.dtype), g, p)
            u, s = tx.update(scaled, s, p)
            return (optax.apply_updates(p, u), s), s.skipped_steps

        (p, _), skipped = jax.lax.scan(
            body, (jaxmp.cast_tree(full, jnp.float16), tx.init(full)), sequence
        )
        return sum(jnp.sum(x.astype(F32)) for x in jax.tree.leaves(p)), skipped

    hyper = jax.jit(jax.vmap(jax.grad(final_sum, has_aux=True), in_axes=(0, None)))
    lrs = jnp.array([0.01, 0.05])
    stack = lambda trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)  # noqa: E731
    with_skip, skipped = hyper(lrs, stack([grads[0], poisoned, grads[1]]))
    without, _ = hyper(lrs, stack(grads))
    assert skipped.tolist() == [[0, 1, 1], [0, 1, 1]]
    assert bool(jnp.all(jnp.isfinite(with_skip))) and bool(jnp.all(with_skip != 0))
    np.testing.assert_array_equal(with_skip, without)


def test_debug_nans_eager_overflow_step_does_not_raise():
    tx = jaxmp.loss_scaling(optax.adam(0.1), jaxmp.DynamicLossScale(2.0**4))
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    with jax.debug_nans(True):
        updates, state = tx.update({"w": jnp.array([1.0, jnp.inf])}, state, params)
    assert updates["w"].tolist() == [0.0, 0.0] and int(state.skipped_steps) == 1


# --- check_outputs: finite gradients, non-finite results --------------------------------

OUTPUT_ATTACKS = {
    # A finite gradient of 1e20 makes Adam's second moment inf (1e40).
    "adam_nu_overflow": (optax.adam(1e-3), {"w": jnp.ones(2)}, {"w": jnp.full(2, 1e20)}),
    # eps=0 with zero gradients: 0 / 0.
    "adam_eps0": (optax.adam(1e-3, eps=0.0), {"w": jnp.ones(2)}, {"w": jnp.zeros(2)}),
    # params + updates overflows float32.
    "sgd_param_overflow": (optax.sgd(1.0), {"w": jnp.full(2, 3e38)}, {"w": jnp.full(2, -1e38)}),
}


@pytest.mark.parametrize("name", sorted(OUTPUT_ATTACKS))
def test_check_outputs_skips_non_finite_results(name):
    inner, params, grads = OUTPUT_ATTACKS[name]
    plain = jaxmp.loss_scaling(inner, jaxmp.NoOpLossScale())
    updates, state = jax.jit(plain.update)(grads, plain.init(params), params)
    unguarded = (optax.apply_updates(params, updates), state.inner_state)
    assert not bool(jaxmp.all_finite(unguarded))  # the attack works without the check
    tx = jaxmp.loss_scaling(inner, jaxmp.NoOpLossScale(), check_outputs=True)
    state = tx.init(params)
    updates, new_state = jax.jit(tx.update)(grads, state, params)
    assert not bool(new_state.grads_finite) and int(new_state.skipped_steps) == 1
    chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
    chex.assert_trees_all_equal(optax.apply_updates(params, updates), params)


def test_check_outputs_checks_the_inner_update_before_it_saturates():
    # float16 params without a master copy: SGD's float32 update is -inf. Put in float16
    # it saturates (the param goes to -65504); check_outputs sees the inf and skips.
    params, grads = {"w": jnp.ones(2, jnp.float16)}, {"w": jnp.full(2, 1e10)}
    plain = jaxmp.loss_scaling(optax.sgd(1e30), jaxmp.NoOpLossScale())
    updates, _ = jax.jit(plain.update)(grads, plain.init(params), params)
    assert optax.apply_updates(params, updates)["w"].tolist() == [-65504.0, -65504.0]
    tx = jaxmp.loss_scaling(optax.sgd(1e30), jaxmp.NoOpLossScale(), check_outputs=True)
    updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert int(state.skipped_steps) == 1 and updates["w"].tolist() == [0.0, 0.0]


def test_check_outputs_takes_finite_steps():
    tx = jaxmp.loss_scaling(optax.adam(0.1), jaxmp.StaticLossScale(4.0), check_outputs=True)
    params = {"w": jnp.ones(2)}
    updates, state = jax.jit(tx.update)({"w": jnp.full(2, 4.0)}, tx.init(params), params)
    ref, _ = optax.adam(0.1).update({"w": jnp.ones(2)}, optax.adam(0.1).init(params), params)
    chex.assert_trees_all_close(updates, ref, rtol=1e-6)
    assert bool(state.grads_finite)
    with pytest.raises(TypeError, match="`check_outputs` must be a bool, got 1"):
        jaxmp.loss_scaling(optax.sgd(1.0), check_outputs=1)


# --- nesting ----------------------------------------------------------------------------


def test_nesting_raises_at_init():
    with pytest.raises(ValueError, match=r"must not contain jaxmp.loss_scaling .* at <root>"):
        jaxmp.mixed_precision(jaxmp.loss_scaling(optax.sgd(1.0)), "float32").init(
            {"w": jnp.ones(2)}
        )
    inner = optax.chain(optax.clip(1.0), jaxmp.loss_scaling(optax.sgd(1.0)))
    with pytest.raises(ValueError, match=r"state is at \[1\]"):
        jaxmp.loss_scaling(inner).init({"w": jnp.ones(2)})


# --- composition ------------------------------------------------------------------------


def test_lookahead_inside():
    inner = optax.lookahead(optax.sgd(0.5), sync_period=2, slow_step_size=0.5)
    tx = jaxmp.loss_scaling(inner, jaxmp.StaticLossScale(8.0))
    params = optax.LookaheadParams.init_synced({"w": jnp.ones(2)})
    ours, theirs = params, params
    state, their_state = tx.init(params), inner.init(params)
    step = jax.jit(tx.update)
    for _ in range(3):
        updates, state = step({"w": jnp.full(2, 8.0)}, state, ours)
        ours = optax.apply_updates(ours, updates)
        updates, their_state = inner.update({"w": jnp.ones(2)}, their_state, theirs)
        theirs = optax.apply_updates(theirs, updates)
    chex.assert_trees_all_close(ours, theirs, rtol=1e-6)
    _, state = step({"w": jnp.array([8.0, jnp.nan])}, state, ours)
    assert int(state.skipped_steps) == 1


def test_shard_map_check_vma_per_device_gradients_without_axis_name():
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    tx = jaxmp.loss_scaling(optax.adam(0.1), jaxmp.DynamicLossScale(2.0**4))
    params = {"w": jnp.ones((1, 4))}
    state = tx.init(params)
    replicated = jax.tree.map(lambda _: jax.P(), state)
    per_device = jax.tree.map(lambda _: jax.P("data"), state)

    def step(p, s, g):
        updates, s = tx.update(g, s, p)
        # With axis_name=None each device decides alone: its state is device-varying.
        return updates, jax.tree.map(lambda x: x[None], s)

    sharded = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(jax.P(), replicated, jax.P("data")),
            out_specs=(jax.P("data"), per_device),
            check_vma=True,
        )
    )
    grads = {"w": jnp.full((1, 4), 16.0)}
    updates, new_state = sharded(params, state, grads)
    ref, ref_state = jax.jit(tx.update)(grads, state, params)
    chex.assert_trees_all_close(updates, ref, rtol=1e-6)
    chex.assert_trees_all_close(jax.tree.map(lambda x: x[0], new_state), ref_state, rtol=1e-6)


def test_integer_and_boolean_params_with_adam_keep_state_dtypes():
    tx = jaxmp.loss_scaling(optax.adam(0.1), jaxmp.DynamicLossScale(2.0**4))
    params = {"w": jnp.ones(3), "i": jnp.int32(3), "b": jnp.array(True)}
    state = tx.init(params)

    def body(carry, bad):
        p, s = carry
        g = {"w": jnp.where(bad, jnp.nan, 16.0) * jnp.ones(3), "i": jnp.int32(0), "b": False}
        u, s = tx.update(jax.tree.map(jnp.asarray, g), s, p)
        return (optax.apply_updates(p, u), s), s.skipped_steps

    (new_params, new_state), skipped = jax.lax.scan(
        body, (params, state), jnp.array([False, True, False])
    )
    chex.assert_trees_all_equal_dtypes(new_state, state)
    chex.assert_trees_all_equal_dtypes(new_params, params)
    assert skipped.tolist() == [0, 1, 1]
    assert int(new_params["i"]) == 3 and bool(new_params["b"])


def test_unfiltered_equinox_module_as_params():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0))  # holds activation functions
    grads = eqx.filter_grad(lambda m: jnp.sum(m(jnp.ones(2))))(model)
    inner = optax.adamw(0.1)
    tx = jaxmp.loss_scaling(inner, jaxmp.StaticLossScale(4.0))
    scaled = jax.tree.map(lambda g: g * 4.0, grads)
    state = tx.init(eqx.filter(model, eqx.is_array))
    updates, state = eqx.filter_jit(tx.update)(scaled, state, model)
    ref, _ = inner.update(grads, inner.init(eqx.filter(model, eqx.is_array)), model)
    ours = eqx.filter(eqx.apply_updates(model, updates), eqx.is_array)
    chex.assert_trees_all_close(ours, eqx.filter(eqx.apply_updates(model, ref), eqx.is_array))
    bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan) if g.ndim == 1 else g, scaled)
    updates, state = eqx.filter_jit(tx.update)(bad, state, model)
    assert int(state.skipped_steps) == 1


def test_schedule_free_eval_params_through_the_wrappers():
    inner = optax.contrib.schedule_free_sgd(1.0, b1=0.5)
    full = {"w": jnp.array([1.0, 2.0])}
    grads = {"w": jnp.array([0.25, -0.5])}
    updates, plain_state = inner.update(grads, inner.init(full), full)
    expected = optax.contrib.schedule_free_eval_params(
        plain_state, optax.apply_updates(full, updates)
    )
    for policy, dtype in (("float32", F32), ("p=f16,c=f16", jnp.float16)):
        tx = jaxmp.mixed_precision(inner, policy, jaxmp.StaticLossScale(2.0))
        params = jaxmp.cast_tree(full, dtype)
        scaled = jax.tree.map(lambda g, d=dtype: (g * 2).astype(d), grads)
        updates, state = jax.jit(tx.update)(scaled, tx.init(full), params)
        out = jaxmp.schedule_free_eval_params(state, optax.apply_updates(params, updates))
        assert out["w"].dtype == dtype
        assert out["w"].tolist() == expected["w"].astype(dtype).tolist()
        assert type(jaxmp.inner_state(state)).__name__ == "ScheduleFreeState"
