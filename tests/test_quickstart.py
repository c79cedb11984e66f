"""Smoke test of examples/quickstart.py: float16 params, FP32 master weights, loss scaling."""

import importlib.util
import math
import pathlib

import jax
import jax.numpy as jnp

PATH = pathlib.Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"


def load_quickstart():
    spec = importlib.util.spec_from_file_location("quickstart", PATH)
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
    # The scale doubles every 50 finite steps from 2^15; once it is large enough for float16
    # gradients to overflow, the step is skipped and the scale halves.
    scale = float(metrics["loss_scale"])
    skipped = int(metrics["skipped_steps"])
    assert math.log2(scale).is_integer() and 2.0**15 < scale < 2.0 ** (15 + 300 // 50)
    assert 1 <= skipped < 10
    assert metrics["loss_scale"].dtype == jnp.float32
