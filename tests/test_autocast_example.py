"""Smoke test of examples/autocast_digits.py: an unmodified float32 NNX CNN (BatchNorm,
Dropout) trained under `jaxmp.autocast` against the same model run as written."""

import importlib.util
import pathlib
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import jaxmp

from .conftest import F16, F32, primitive_dtypes

PATH = pathlib.Path(__file__).resolve().parents[1] / "examples" / "autocast_digits.py"
STEPS = 150


def load_example():
    spec = importlib.util.spec_from_file_location("autocast_digits", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


example = load_example()


# Trains the example (a digits classifier, several epochs): with the tests marked slow.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results():
    return {
        policy: example.train_and_evaluate(
            example.Config(policy=policy, steps=STEPS, eval_every=STEPS // 2)
        )
        for policy in ("float32", "mixed_float16")
    }


def test_loss_is_finite_and_falls(results):
    losses = results["mixed_float16"]["losses"]
    assert losses.shape == (STEPS,) and np.all(np.isfinite(losses))
    assert losses[-10:].mean() < 0.2 * losses[:5].mean(), (losses[:5], losses[-10:])
    assert results["mixed_float16"]["skipped_steps"] < 5


def test_accuracy_and_loss_near_float32(results):
    (_, loss32, acc32), (_, loss, acc) = (results[p]["evals"][-1] for p in results)
    assert acc32 > 0.85, acc32
    assert abs(acc - acc32) <= 0.02, (acc, acc32)
    assert abs(loss - loss32) <= 0.1 * loss32 + 0.02, (loss, loss32)


def test_batch_norm_statistics_and_dropout_rngs_update(results):
    model, model32 = results["mixed_float16"]["model"], results["float32"]["model"]
    # Each Dropout layer draws one mask per training step, none in evaluation.
    for drop, drop32 in ((model.dropout1, model32.dropout1), (model.dropout2, model32.dropout2)):
        assert int(drop.rngs.count[...]) == int(drop32.rngs.count[...]) == STEPS
    for norm in (model.batch_norm1, model.batch_norm2):
        assert norm.mean[...].dtype == F32 and norm.var[...].dtype == F32
        assert float(np.abs(norm.mean[...]).max()) > 0.01
        assert not np.allclose(norm.var[...], 1.0)


def test_matmuls_and_convolutions_run_in_float16():
    config = example.Config(policy="mixed_float16", steps=1)
    model, optimizer = example.create(config)
    train_step = example.make_train_step(config)
    graphdef, state = nnx.split((model, optimizer))
    (x, y), _ = example.load_data()

    def step(state, x, y):
        return train_step(*nnx.merge(graphdef, state), x, y)

    jaxpr = jax.make_jaxpr(step)(state, x[:8], y[:8])
    products = primitive_dtypes(jaxpr, {"dot_general", "conv_general_dilated"})
    # Forward: 2 convolutions and 2 matmuls; backward: their transposes.
    assert len(products) >= 8 and {dtype for _, dtype in products} == {F16}, products

    # The forward pass: BatchNorm statistics, softmax and the loss reduce in float32.
    forward = jaxmp.autocast(example.loss_fn, config.policy)
    model_def, model_state = nnx.split(model)
    jaxpr = jax.make_jaxpr(lambda s, x, y: forward(nnx.merge(model_def, s), x, y))(
        model_state, x[:8], y[:8]
    )
    reductions = primitive_dtypes(jaxpr, {"reduce_sum", "reduce_max"})
    assert len(reductions) >= 6 and {dtype for _, dtype in reductions} == {F32}, reductions
    # The params stay float32: autocast casts them where they are used.
    assert {p.dtype for p in jax.tree.leaves(nnx.state(model, nnx.Param))} == {F32}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"policy": "float12"}, "float12"),
        ({"steps": 0}, "`steps` must be a positive int, got 0"),
        ({"learning_rate": -1.0}, "`learning_rate` must be positive"),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        example.Config(**kwargs)


def test_main_runs(capsys):
    # The default batch size: the same programs as the mixed_float16 run of `results`.
    example.main(["--steps", "2", "--eval-every", "1"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "policy mixed_float16, 2 steps of 64 images"
    assert [line.split()[1] for line in out[1:3]] == ["1", "2"]
    assert out[-1].startswith("final test accuracy")
