"""The Equinox recipe: float16 params, FP32 master weights, loss scaling, on the 8x8 digits.

The train step is the one the README shows: `jaxmp.filter_value_and_grad` (Equinox's
filtering: an `eqx.nn.MLP` holds its activation functions as leaves),
`jaxmp.mixed_precision` initialised with the float32 params, and `equinox.apply_updates`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from sklearn.datasets import load_digits

import jaxmp

from .conftest import F16, F32, assert_close

eqx = pytest.importorskip("equinox", reason="equinox is an optional test dependency")

STEPS = 300
BATCH = 64


def digits():
    """Train/test split of the flattened 8x8 digits in [0, 1], fixed order."""
    x, y = load_digits(return_X_y=True)
    perm = np.random.default_rng(0).permutation(len(x))
    x = (x[perm] / 16.0).astype(np.float32)
    y = y[perm].astype(np.int32)
    return (x[:1437], y[:1437]), (x[1437:], y[1437:])


def make(policy, seed=0):
    """A float32 Equinox MLP; the optimizer starts from its float32 params, then the model
    is stored in the policy's param dtype."""
    model = eqx.nn.MLP(64, 10, 128, 2, key=jax.random.key(seed))
    tx = jaxmp.mixed_precision(optax.adam(3e-3), policy)
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    return jaxmp.get_policy(policy).cast_to_param(model), tx, opt_state


def loss_fn(model, x, y, policy):
    logits = jax.vmap(model)(policy.cast_to_compute(x))
    logits = policy.cast_to_output(logits)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@eqx.filter_jit
def train_step(model, opt_state, x, y, tx, policy):
    loss_scale = jaxmp.get_loss_scale(opt_state)
    loss, grads = jaxmp.filter_value_and_grad(loss_fn)(loss_scale, model, x, y, policy)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, opt_state = tx.update(grads, opt_state, params)
    model = eqx.apply_updates(model, updates)
    return model, opt_state, loss, jaxmp.loss_scale_metrics(opt_state)


@eqx.filter_jit
def accuracy(model, x, y, policy):
    logits = jax.vmap(model)(policy.cast_to_compute(x))
    return jnp.mean(jnp.argmax(logits, -1) == y)


@pytest.fixture(scope="module")
def trained():
    (x_train, y_train), (x_test, y_test) = digits()
    rng = np.random.default_rng(0)
    indices = [rng.choice(1437, BATCH, replace=False) for _ in range(STEPS)]
    out = {}
    for name in ("float32", "p=f16,c=f16,o=f32"):
        policy = jaxmp.get_policy(name)
        model, tx, opt_state = make(name)
        losses = []
        for idx in indices:
            model, opt_state, loss, metrics = train_step(
                model, opt_state, x_train[idx], y_train[idx], tx, policy
            )
            losses.append(float(loss))
        acc = float(accuracy(model, x_test, y_test, policy))
        out[name] = (model, opt_state, np.asarray(losses), metrics, acc)
    return out


def test_float16_params_stay_float16_through_equinox_apply_updates(trained):
    model, opt_state, _, _, _ = trained["p=f16,c=f16,o=f32"]
    params = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
    assert len(params) == 6 and {p.dtype for p in params} == {F16}
    # The activation functions are still there, untouched.
    assert model.activation is jax.nn.relu and model.final_activation is not None
    assert isinstance(opt_state.inner_state, jaxmp.MasterWeightsState)
    master = jax.tree.leaves(opt_state.inner_state.master)
    assert {m.dtype for m in master} == {F32}
    for p, m in zip(params, master, strict=True):  # the params are the rounded master copy
        assert_close(p, m.astype(F16), F16)


def test_float16_training_matches_float32(trained):
    _, _, losses32, _, acc32 = trained["float32"]
    _, _, losses, metrics, acc = trained["p=f16,c=f16,o=f32"]
    assert np.all(np.isfinite(losses)) and losses[-20:].mean() < 0.25 * losses[:5].mean()
    assert acc32 > 0.9, acc32
    assert abs(acc - acc32) <= 0.01, (acc, acc32)
    skipped = int(metrics["skipped_steps"])
    assert skipped < 10 and float(metrics["loss_scale"]) == 2.0 ** (15 - skipped)
    final, final32 = losses[-20:].mean(), losses32[-20:].mean()
    assert abs(final - final32) <= 0.1 * final32, (final, final32)
