"""Smoke test of examples/quickstart.py: float16 params, FP32 master weights, loss scaling; and
of the first-step check it shares with train.py (examples/loss_scale_tools.py)."""

import importlib.util
import math
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import optax
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import loss_scale_tools  # noqa: E402

import jaxmp  # noqa: E402


def load_quickstart():
    spec = importlib.util.spec_from_file_location("quickstart", EXAMPLES / "quickstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_trains_in_float16(capsys):
    quickstart = load_quickstart()
    params, loss, metrics = quickstart.train(steps=300, log_every=100)
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in out] == ["1", "100", "200", "300"]
    first_loss = float(out[0].split()[3])
    assert math.isfinite(loss) and loss < first_loss / 100, (first_loss, loss)
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.float16)}
    # The scale doubles every 25 finite steps from 2^15; once it is large enough for float16
    # gradients to overflow, the step is skipped and the scale halves.
    scale = float(metrics["loss_scale"])
    skipped = int(metrics["skipped_steps"])
    assert math.log2(scale).is_integer() and 2.0**15 < scale < 2.0 ** (15 + 300 // 25)
    assert 1 <= skipped < 10
    assert metrics["loss_scale"].dtype == jnp.float32
    # Scales print as train.py prints them: powers of two.
    printed = [re.search(r"loss scale (\S+)", line).group(1) for line in out]
    assert printed[0] == "2^15" and printed[-1] == f"2^{int(math.log2(scale))}"


def _patched_value_and_grad(monkeypatch, scale_power):
    """Makes `jaxmp.value_and_grad` return gradients times ``loss_scale ** scale_power``."""
    original = jaxmp.value_and_grad

    def value_and_grad(fun):
        def wrapped(loss_scale, *args):
            value, grads = jax.value_and_grad(fun)(*args)
            if scale_power == 2:  # the loss scaled twice
                _, grads = original(fun)(loss_scale, *args)
                grads = jax.tree.map(lambda g: g * loss_scale.loss_scale, grads)
            return value, grads

        return wrapped

    monkeypatch.setattr(jaxmp, "value_and_grad", value_and_grad)


def test_quickstart_stops_on_unscaled_gradients(monkeypatch):
    # The mistake: `jax.grad(loss_fn)` instead of `jaxmp.value_and_grad(loss_fn)(loss_scale, ...)`.
    _patched_value_and_grad(monkeypatch, 0)
    with pytest.raises(loss_scale_tools.LossScalingError) as excinfo:
        load_quickstart().train(steps=1)
    message = str(excinfo.value)
    assert "changed by x1 when the loss scale doubled (expected x2)" in message
    assert "come from the unscaled loss (`jax.grad`?)" in message
    assert "jaxmp.value_and_grad(loss_fn)(loss_scale, ...)" in message


def test_quickstart_stops_on_a_loss_scaled_twice(monkeypatch):
    _patched_value_and_grad(monkeypatch, 2)
    with pytest.raises(loss_scale_tools.LossScalingError, match=r"x4 .*scaled twice"):
        load_quickstart().train(steps=1)


def _step(params, loss_scale_power):
    """A tiny step reporting the norm of gradients times ``loss_scale ** power``."""

    def grad_norm_at(opt_state):
        scale = jaxmp.get_loss_scale(opt_state).loss_scale
        return loss_scale_tools.grad_norm(
            jax.tree.map(lambda p: 3.0 * p * scale**loss_scale_power, params)
        )

    return grad_norm_at


@pytest.mark.parametrize("loss_scale", [jaxmp.StaticLossScale(8.0), jaxmp.NoOpLossScale()])
def test_check_skips_loss_scales_it_cannot_vary(loss_scale):
    params = {"w": jnp.ones(3)}
    opt_state = jaxmp.loss_scaling(optax.sgd(0.1), loss_scale).init(params)
    assert loss_scale_tools.with_loss_scale(opt_state, 2.0) is None
    assert loss_scale_tools.check_gradients_are_scaled(_step(params, 0), opt_state) is None


def test_check_accepts_scaled_gradients_and_names_other_ratios():
    params = {"w": jnp.ones(3, jnp.float16), "b": jnp.zeros(2)}
    opt_state = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(2.0**15)).init(params)
    moved = loss_scale_tools.with_loss_scale(opt_state, 2.0)
    assert float(jaxmp.get_loss_scale(moved).loss_scale) == 2.0
    assert jaxmp.get_loss_scale(moved).loss_scale.dtype == jnp.float32
    assert loss_scale_tools.check_gradients_are_scaled(_step(params, 1), opt_state) == 2.0
    with pytest.raises(loss_scale_tools.LossScalingError, match="not proportional"):
        loss_scale_tools.check_gradients_are_scaled(_step(params, 0.5), opt_state)
