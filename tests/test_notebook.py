"""The quickstart notebook runs: as a script (jupytext percent format) and as a notebook."""

import pathlib
import runpy

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
    for name, (params, history) in runs.items():
        assert str(params[0]["w"].dtype) == ("float16" if "master" in name else "float32")
        assert history[-1]["loss"] < history[0]["loss"] / 10, name
        if name == "f32":
            assert {h["loss_scale"] for h in history} == {1.0}
        else:
            scales = [h["loss_scale"] for h in history]
            assert max(scales) > 2.0**15  # grew every 25 finite steps
            assert history[-1]["skipped_steps"] == sum(not h["grads_finite"] for h in history)


def test_script_runs(monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    namespace = runpy.run_path(str(SCRIPT), run_name="__main__")
    _check_runs(namespace["runs"])
    assert float(namespace["recovered"]) == pytest.approx(1e-8, rel=1e-3)
    namespace["plt"].close("all")


def test_notebook_executes():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": EXAMPLES}}
    )
    client.execute()
    outputs = [out for cell in notebook.cells for out in cell.get("outputs", [])]
    assert not [out for out in outputs if out.output_type == "error"]
    text = "".join(out.get("text", "") for out in outputs if out.output_type == "stream")
    assert "float16 + master weights: param dtype float16" in text
    assert "float16(1e-8)               = 0.0" in text
    assert any("image/png" in out.get("data", {}) for out in outputs)
