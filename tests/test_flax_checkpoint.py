"""Orbax checkpoints of Linen and NNX mixed-precision training resume bit-identically."""

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jaxmp
import jaxmp.nnx

from . import test_linen, test_nnx

STEPS = 10
SAVE_AT = 5
POISONED = (2, 7)  # one skipped step before the checkpoint, one after
POLICIES = ["mixed_float16", "p=f16,c=f16,o=f32"]


def _loss_scale():
    # A short period so the scale also grows during the run.
    return jaxmp.DynamicLossScale(2.0**10, period=2)


def _assert_identical(a, b):
    # Leaf by leaf, with the same paths (the static `tx` objects of two states
    # created apart are equivalent but not equal, so treedefs are not compared).
    a_leaves = jax.tree_util.tree_leaves_with_path(a)
    b_leaves = jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in a_leaves] == [p for p, _ in b_leaves]
    for (path, x), (_, y) in zip(a_leaves, b_leaves, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


def _batch(x, y, i):
    idx = np.random.default_rng(i).choice(len(x), test_linen.BATCH, replace=False)
    return x[idx], y[idx]


_linen_step = jax.jit(test_linen.train_step)


def _linen_steps(state, x, y, start, stop):
    for i in range(start, stop):
        state, _, _ = _linen_step(state, *_batch(x, y, i), i in POISONED)
    return state


@pytest.mark.parametrize("policy", POLICIES)
def test_linen_train_state_resumes_bit_identically(policy, tmp_path):
    (x, y), _ = test_linen.digits()

    # One optimizer object for all states, so that one compiled step serves them all.
    tx = jaxmp.mixed_precision(optax.adam(3e-3), policy, _loss_scale())

    def create():
        # Committed to the device, as a restored state is: the straight and the resumed run
        # then share one compiled step.
        return jax.device_put(test_linen.create_state(policy, tx=tx), jax.devices()[0])

    straight = _linen_steps(create(), x, y, 0, STEPS)

    first = _linen_steps(create(), x, y, 0, SAVE_AT)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "linen", first)
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(tmp_path / "linen", jax.eval_shape(create))
    assert isinstance(restored, test_linen.TrainState) and restored.policy == first.policy
    _assert_identical(restored, first)
    resumed = _linen_steps(restored, x, y, SAVE_AT, STEPS)

    _assert_identical(resumed, straight)
    metrics = resumed.metrics()
    assert int(metrics["skipped_steps"]) == len(POISONED)
    assert int(resumed.step) == STEPS - len(POISONED)
    assert isinstance(resumed.loss_scale, jaxmp.DynamicLossScale)
    assert resumed.loss_scale.period == 2  # static fields come from the target


def _nnx_steps(model, optimizer, x, y, policy, start, stop):
    for i in range(start, stop):
        test_nnx.jit_train_step(model, optimizer, *_batch(x, y, i), policy, i in POISONED)


@pytest.mark.parametrize("policy", POLICIES)
def test_nnx_model_and_optimizer_resume_bit_identically(policy, tmp_path):
    (x, y), _ = test_nnx.digits()

    def create(seed=0):
        return test_nnx.make(policy, seed=seed, loss_scale=_loss_scale())

    model, optimizer = create()
    _nnx_steps(model, optimizer, x, y, policy, 0, STEPS)
    straight = nnx.state((model, optimizer))

    model, optimizer = create()
    _nnx_steps(model, optimizer, x, y, policy, 0, SAVE_AT)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "nnx", nnx.state((model, optimizer)))
        checkpointer.wait_until_finished()
        # Restore into a fresh model and optimizer (another seed, so nothing is left over).
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: create(seed=1)))
        restored = checkpointer.restore(tmp_path / "nnx", abstract)
    model, optimizer = nnx.merge(graphdef, restored)
    assert isinstance(optimizer, jaxmp.nnx.Optimizer)
    _nnx_steps(model, optimizer, x, y, policy, SAVE_AT, STEPS)

    _assert_identical(nnx.state((model, optimizer)), straight)
    metrics = jaxmp.loss_scale_metrics(optimizer)
    assert int(metrics["skipped_steps"]) == len(POISONED)
    assert int(optimizer.step[...]) == STEPS - len(POISONED)
    assert model.hidden.kernel.get_value().dtype == jaxmp.get_policy(policy).param_dtype
