import jax
import jax.numpy as jnp
import optax
import pytest

import jaxmp


def _params():
    return {"w": jnp.ones(3)}


@pytest.mark.parametrize(
    "make",
    [
        lambda: jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(4.0)),
        lambda: optax.chain(
            optax.clip(1.0), jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(4.0))
        ),
        lambda: optax.named_chain(
            ("clip", optax.clip(1.0)),
            ("mp", jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(4.0))),
        ),
        lambda: optax.MultiSteps(
            jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(4.0)), 2
        ),
        lambda: optax.inject_hyperparams(
            lambda learning_rate: jaxmp.loss_scaling(
                optax.sgd(learning_rate), jaxmp.DynamicLossScale(4.0)
            )
        )(0.1),
        lambda: jaxmp.mixed_precision(optax.sgd(0.1), "float16", jaxmp.DynamicLossScale(4.0)),
    ],
    ids=["plain", "chain", "named_chain", "multisteps", "inject_hyperparams", "mixed"],
)
def test_get_loss_scale_finds_nested_state(make):
    tx = make()
    state = tx.init(_params())
    ls = jaxmp.get_loss_scale(state)
    assert isinstance(ls, jaxmp.DynamicLossScale) and float(ls.loss_scale) == 4.0
    metrics = jax.jit(jaxmp.loss_scale_metrics)(state)
    assert float(metrics["loss_scale"]) == 4.0
    assert metrics["grads_finite"].dtype == jnp.bool_
    assert metrics["skipped_steps"].dtype == jnp.int32
    assert metrics["consecutive_skipped_steps"].dtype == jnp.int32


def test_opt_state_attribute():
    class Holder:
        def __init__(self, opt_state):
            self.opt_state = opt_state

    tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.StaticLossScale(2.0))
    assert float(jaxmp.get_loss_scale(Holder(tx.init(_params()))).loss_scale) == 2.0


def test_noop_metrics():
    state = jaxmp.mixed_precision(optax.sgd(0.1), "bf16").init(_params())
    assert float(jaxmp.loss_scale_metrics(state)["loss_scale"]) == 1.0


def test_missing_state_error_says_how_to_fix():
    with pytest.raises(ValueError, match=r"wrap the optimizer with `jaxmp.loss_scaling\(tx\)`"):
        jaxmp.get_loss_scale(optax.adam(0.1).init(_params()))


def test_two_states_is_an_error():
    tx = optax.chain(jaxmp.loss_scaling(optax.sgd(0.1)), jaxmp.loss_scaling(optax.sgd(0.1)))
    with pytest.raises(ValueError, match=r"more than one .* at \[0\], \[1\]"):
        jaxmp.get_loss_scale(tx.init(_params()))


@pytest.mark.parametrize(
    "loss_scale",
    [jaxmp.NoOpLossScale(), jaxmp.StaticLossScale(8.0), jaxmp.DynamicLossScale(4.0)],
    ids=lambda ls: type(ls).__name__,
)
@pytest.mark.parametrize("copies", [1, 3])
def test_metrics_share_one_shape_on_stacked_state(loss_scale, copies):
    """A state stacked for `jax.pmap` (`flax.jax_utils.replicate` adds a leading axis to
    every leaf) gives every metric that axis, also a loss scale that is not a leaf (the
    no-op and a concrete static scale): ``metrics["loss_scale"][0]`` works whatever the
    loss scale, as ``metrics["skipped_steps"][0]`` does."""
    state = jaxmp.loss_scaling(optax.sgd(0.1), loss_scale).init(_params())
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *([state] * copies))
    metrics = jax.jit(jaxmp.loss_scale_metrics)(stacked)
    assert {k: v.shape for k, v in metrics.items()} == dict.fromkeys(metrics, (copies,))
    assert metrics["loss_scale"].dtype == jnp.float32
    expected = float(loss_scale.loss_scale)
    assert [float(v) for v in metrics["loss_scale"]] == [expected] * copies
    # Unstacked, every metric is a scalar.
    metrics = jax.jit(jaxmp.loss_scale_metrics)(state)
    assert {k: v.shape for k, v in metrics.items()} == dict.fromkeys(metrics, ())
