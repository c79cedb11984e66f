"""examples/lm/loop.py: the mesh check, evaluation and text samples (the loop itself trains in
tests/test_train.py)."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

from lm import config as config_lib  # noqa: E402
from lm import loop, steps  # noqa: E402


def test_a_mesh_beyond_the_cpu_devices_says_how_to_simulate_them():
    wanted = 2 * jax.device_count()
    with pytest.raises(ValueError) as excinfo:
        loop.check_mesh(f"data={wanted}")
    message = str(excinfo.value)
    assert "`mesh` sizes must multiply to the device count" in message
    assert message.endswith(
        f"On a CPU, simulate {wanted} devices by starting the run with XLA_FLAGS="
        f"--xla_force_host_platform_device_count={wanted} (set before JAX starts; see "
        "docs/guides/sharding.md)."
    )
    with pytest.raises(ValueError) as excinfo:  # a malformed spec: no hint
        loop.check_mesh("data")
    assert "XLA_FLAGS" not in str(excinfo.value)
    loop.check_mesh(f"data={jax.device_count()}")


def test_evaluate_is_the_mean_over_the_batches():
    def eval_step(params, inputs, targets, fp8_state):
        assert fp8_state == "fp8"
        return jnp.float32(params * inputs.sum() + targets.sum())

    batches = [(np.ones(2), np.zeros(2)), (np.full(2, 2.0), np.ones(2))]
    assert loop.evaluate(eval_step, 1.0, batches, "fp8") == (2.0 + 6.0) / 2


def test_samples_depend_on_the_seed_only():
    config = config_lib.load("fp32", ["num_layers=1", "d_model=16", "num_heads=2", "seq_len=8"])
    dataset = steps.get_dataset(config.val_fraction)
    built = steps.programs(config, dataset.vocab_size)
    params = built.init(jax.random.PRNGKey(0)).params
    a, b, c = (
        loop.generate(built.model, params, dataset, length=12, seed=seed) for seed in (0, 0, 1)
    )
    assert a == b != c  # 12 characters: longer than the context, so the window slides
    assert len(a) == 12 and set(a) <= set(dataset.vocab)
