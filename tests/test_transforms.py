"""One registry of every public jaxmp transform, run through a shared harness."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp

F16 = jnp.dtype(jnp.float16)

TRANSFORMS = {
    "loss_scaling/dynamic": lambda: jaxmp.loss_scaling(
        optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**8, period=2)
    ),
    "loss_scaling/static": lambda: jaxmp.loss_scaling(
        optax.sgd(1e-2), jaxmp.StaticLossScale(2.0**4)
    ),
    "loss_scaling/noop": lambda: jaxmp.loss_scaling(optax.adamw(1e-2), jaxmp.NoOpLossScale()),
    "master_weights": lambda: jaxmp.loss_scaling(jaxmp.master_weights(optax.adam(1e-2))),
    "mixed_precision/mixed_float16": lambda: jaxmp.mixed_precision(
        optax.adam(1e-2), "mixed_float16"
    ),
    "mixed_precision/float16": lambda: jaxmp.mixed_precision(optax.adam(1e-2), "float16"),
    "mixed_precision/bfloat16": lambda: jaxmp.mixed_precision(optax.lion(1e-3), "bfloat16"),
    "mixed_precision/bfloat16_stochastic_8bit": lambda: jaxmp.mixed_precision(
        optax.adam(1e-2),
        "bfloat16",
        master_weights=False,
        rounding="stochastic",
        moments=("int8", "fp8"),
    ),
    "mixed_precision/float16_kahan": lambda: jaxmp.mixed_precision(
        optax.adam(1e-2), "float16", master_weights=False, rounding="kahan", moments="bf16"
    ),
}
PARAM_DTYPES = {
    "master_weights": F16,
    "mixed_precision/float16": F16,
    "mixed_precision/bfloat16": jnp.dtype(jnp.bfloat16),
    "mixed_precision/bfloat16_stochastic_8bit": jnp.dtype(jnp.bfloat16),
    "mixed_precision/float16_kahan": F16,
}


def _params(name):
    full = {
        "dense": {"kernel": jnp.linspace(-1, 1, 12).reshape(3, 4), "bias": jnp.zeros(4)},
        "scale": jnp.ones(()),
    }
    return full, jaxmp.cast_tree(full, PARAM_DTYPES.get(name, jnp.float32))


def _grads(params, scale, bad=False):
    grads = jax.tree.map(lambda p: (jnp.full(p.shape, 0.25) * scale).astype(p.dtype), params)
    if bad:
        grads["dense"]["kernel"] = grads["dense"]["kernel"].at[1, 1].set(jnp.nan)
    return grads


@pytest.fixture(params=sorted(TRANSFORMS))
def case(request):
    name = request.param
    full, params = _params(name)
    tx = TRANSFORMS[name]()
    return name, tx, full, params


def _step(tx):
    @jax.jit
    def step(params, state, bad):
        scale = jaxmp.get_loss_scale(state).loss_scale
        grads = _grads(params, scale)
        grads = jax.tree.map(lambda g: jnp.where(bad, jnp.nan, g).astype(g.dtype), grads)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def test_init_update_under_jit_keeps_dtypes_and_structure(case):
    name, tx, full, params = case
    state = jax.jit(tx.init)(full)
    step = _step(tx)
    new_params, new_state = step(params, state, jnp.array(False))
    chex.assert_trees_all_equal_structs(new_state, state)
    chex.assert_trees_all_equal_dtypes(new_state, state)
    chex.assert_trees_all_equal_dtypes(new_params, params)
    pairs = zip(jax.tree.leaves(new_params), jax.tree.leaves(params), strict=True)
    assert not all(np.array_equal(a, b) for a, b in pairs)


def test_skip_on_non_finite(case):
    name, tx, full, params = case
    state = tx.init(full)
    step = _step(tx)
    params, state = step(params, state, jnp.array(False))
    new_params, new_state = step(params, state, jnp.array(True))
    chex.assert_trees_all_equal(new_params, params)
    chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
    metrics = jaxmp.loss_scale_metrics(new_state)
    assert int(metrics["skipped_steps"]) == 1 and not bool(metrics["grads_finite"])
    old_scale = float(jaxmp.get_loss_scale(state).loss_scale)
    new_scale = float(metrics["loss_scale"])
    is_dynamic = isinstance(jaxmp.get_loss_scale(state), jaxmp.DynamicLossScale)
    assert new_scale == (old_scale / 2 if is_dynamic else old_scale)
    assert bool(jaxmp.all_finite((new_params, new_state)))


def test_state_pytree_round_trip(case):
    name, tx, full, params = case
    state = tx.init(full)
    leaves, treedef = jax.tree.flatten(state)
    chex.assert_trees_all_equal(jax.tree.unflatten(treedef, leaves), state)
    rebuilt = jax.tree.map(lambda x: x, state)
    assert jax.tree.structure(rebuilt) == treedef
    ls, rebuilt_ls = jaxmp.get_loss_scale(state), jaxmp.get_loss_scale(rebuilt)
    assert type(ls) is type(rebuilt_ls)
    for field in getattr(ls, "__dataclass_fields__", {}):
        assert np.array_equal(
            np.asarray(getattr(ls, field)), np.asarray(getattr(rebuilt_ls, field))
        )
    for leaf in leaves:
        assert isinstance(leaf, jax.Array)


def test_no_retrace(case):
    name, tx, full, params = case
    traces = []

    @jax.jit
    def step(params, state, bad):
        traces.append(1)
        return _step(tx)(params, state, bad)

    state = tx.init(full)
    for bad in [False, True, False]:
        params, state = step(params, state, jnp.array(bad))
    assert len(traces) == 1
