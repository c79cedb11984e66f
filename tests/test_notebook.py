"""The quickstart notebook runs: as a script (jupytext percent format) and as a notebook."""

import json
import pathlib
import re

import jupytext
import nbclient
import nbformat
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
SCRIPT = EXAMPLES / "quickstart_notebook.py"
NOTEBOOK = EXAMPLES / "quickstart_notebook.ipynb"


def _sources(notebook):
    return [(cell.cell_type, cell.source.strip()) for cell in notebook.cells]


def test_notebook_is_in_sync_with_its_script():
    script = jupytext.read(SCRIPT)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    assert _sources(script) == _sources(notebook), (
        "examples/quickstart_notebook.ipynb is out of date; regenerate it with "
        "`jupytext --to ipynb examples/quickstart_notebook.py`"
    )


def _check_runs(runs):
    assert set(runs) == {"f32", "mixed_float16", "float16 + master weights"}
    for name, (dtype, history) in runs.items():
        assert dtype == ("float16" if "master" in name else "float32")
        assert history[-1]["loss"] < history[0]["loss"] / 10, name
        if name == "f32":
            assert {h["loss_scale"] for h in history} == {1.0}
        else:
            scales = [h["loss_scale"] for h in history]
            assert max(scales) > 2.0**15  # grew every 25 finite steps
            assert history[-1]["skipped_steps"] == sum(not h["grads_finite"] for h in history)


# The notebook's last cell, added for the test: what `_check_runs` needs, as one JSON line.
REPORT = """
import json
print("REPORT " + json.dumps({
    "recovered": float(recovered),
    "runs": {name: [str(p[0]["w"].dtype), history] for name, (p, history) in runs.items()},
}))
"""


@pytest.mark.slow  # executes the notebook, which trains
def test_notebook_executes_and_trains():
    # One execution through a Jupyter kernel checks both that the notebook runs and, through
    # its printed report, the numbers (the script has the same cells: see the test above).
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    notebook.cells.append(nbformat.v4.new_code_cell(REPORT))
    client = nbclient.NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": EXAMPLES}}
    )
    client.execute()
    outputs = [out for cell in notebook.cells for out in cell.get("outputs", [])]
    assert not [out for out in outputs if out.output_type == "error"]
    text = "".join(out.get("text", "") for out in outputs if out.output_type == "stream")
    assert "float16 + master weights: param dtype float16" in text
    # Loss scales print as powers of two, as in train.py and quickstart.py.
    assert len(re.findall(r", loss scale 2\^\d+, skipped steps", text)) == 3
    assert "float16(1e-8)               = 0.0" in text
    assert any("image/png" in out.get("data", {}) for out in outputs)
    report = json.loads(text.split("REPORT ", 1)[1].splitlines()[0])
    assert report["recovered"] == pytest.approx(1e-8, rel=1e-3)
    _check_runs({name: (dtype, history) for name, (dtype, history) in report["runs"].items()})
