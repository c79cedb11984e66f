"""examples/lm/inspection.py: ``inspect.json`` written and read back (the inspected runs are in
tests/test_train.py)."""

import json
import pathlib
import sys

import jax.numpy as jnp

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

from lm import config as config_lib  # noqa: E402
from lm import inspection  # noqa: E402

import jaxmp  # noqa: E402


def test_a_resumed_run_keeps_the_entries_up_to_its_checkpoint(tmp_path):
    assert inspection.load_inspections(tmp_path, 10) == []  # no file
    (tmp_path / "inspect.json").write_text('{"inspections": [')
    assert inspection.load_inspections(tmp_path, 10) == []  # cut short
    entries = [{"step": 1}, {"step": 10}, {"step": 11}, "junk", {"no step": 0}]
    (tmp_path / "inspect.json").write_text(json.dumps({"inspections": entries}))
    assert inspection.load_inspections(tmp_path, 10) == [{"step": 1}, {"step": 10}]


def test_an_inspection_replaces_its_steps_entry(tmp_path):
    config = config_lib.load("mixed_float16")
    _, report = jax_report()
    entries = [{"step": 1, "old": True}, {"step": 3}]
    entry = inspection.write_inspection(tmp_path, config, 3, 1024.0, report, entries)
    assert [e["step"] for e in entries] == [1, 3] and entries[1] is entry
    assert entry["loss_scale"] == 1024.0 and entry["first_nonfinite"] is None
    assert entry["suggestion"] is None  # a forward pass only: no gradients to keep in range
    data = json.loads((tmp_path / "inspect.json").read_text())
    assert data["config"] == "mixed_float16" and data["precision"] == str(config.policy)
    assert data["inspections"] == json.loads(json.dumps(entries))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inspect.json", "inspect.png"]


def jax_report():
    def f(x):
        return jnp.tanh(x @ x.T).sum()

    return jaxmp.inspect(f, "mixed_float16")(jnp.ones((4, 4)))
