"""The notebooks run in a Jupyter kernel (nbclient), and what they show is there: the
quickstart trains and draws its figures; jaxmp's objects show their tables and figures
(`_repr_html_`: a policy, the optimizer state, the inspector's report with its figure, the
quantization plan, the FP8 matmuls). Each notebook is kept in sync with its jupytext script.

Executing a notebook starts a kernel and compiles its steps: slow tests, which CI runs
(`.ci/run`, the newest stack: ``-m "slow or not slow"``)."""

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
NOTEBOOKS = ("quickstart_notebook", "inspector_notebook")


def _sources(notebook):
    return [(cell.cell_type, cell.source.strip()) for cell in notebook.cells]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_in_sync_with_its_script(name):
    script = jupytext.read(EXAMPLES / f"{name}.py")
    notebook = nbformat.read(EXAMPLES / f"{name}.ipynb", as_version=4)
    assert _sources(script) == _sources(notebook), (
        f"examples/{name}.ipynb is out of date; regenerate it with "
        f"`jupytext --update --to ipynb examples/{name}.py`"
    )


def _execute(notebook):
    """`notebook` executed in a Jupyter kernel, in examples/; its outputs, none an error."""
    client = nbclient.NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": EXAMPLES}}
    )
    client.execute()
    outputs = [out for cell in notebook.cells for out in cell.get("outputs", [])]
    errors = [out for out in outputs if out.output_type == "error"]
    assert not errors, "\n".join(f"{e.ename}: {e.evalue}" for e in errors)
    return outputs


def _html(cell):
    """The HTML a code cell shows as its value."""
    (out,) = [o for o in cell.outputs if o.output_type == "execute_result"]
    return out.data["text/html"]


def _code_cell(notebook, text):
    """The code cell holding `text`."""
    (cell,) = [c for c in notebook.cells if c.cell_type == "code" and text in c.source]
    return cell


def _value_of(notebook, last_line):
    """The HTML of the code cell whose last line (the value it shows) is `last_line`."""
    (cell,) = [
        c
        for c in notebook.cells
        if c.cell_type == "code" and c.source.strip().splitlines()[-1] == last_line
    ]
    return _html(cell)


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
    "runs": {name: [str(p[0]["w"].dtype), history] for name, (p, history, _) in runs.items()},
}))
"""


@pytest.mark.slow  # executes the notebook, which trains
def test_notebook_executes_and_trains():
    # One execution through a Jupyter kernel checks both that the notebook runs and, through
    # its printed report, the numbers (the script has the same cells: see the test above).
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    notebook.cells.append(nbformat.v4.new_code_cell(REPORT))
    outputs = _execute(notebook)
    text = "".join(out.get("text", "") for out in outputs if out.output_type == "stream")
    assert "float16 + master weights: param dtype float16" in text
    # Loss scales print as powers of two, as in train.py and quickstart.py.
    assert len(re.findall(r", loss scale 2\^\d+, skipped steps", text)) == 3
    assert "float16(1e-8)               = 0.0" in text
    # The tables: the policy's dtypes, the optimizer state's loss scale and skipped steps.
    policy = _value_of(notebook, "policy")
    assert "<td>dtype</td><td>float32</td><td>float16</td><td>float32</td>" in policy
    state = _value_of(notebook, "opt_state")
    assert "<th>loss scale</th>" in state and "<th>skipped steps</th>" in state
    # The figures: the losses, and jaxmp.plot_loss_scale's (shown by the inline backend).
    for text_in_cell in ("ax.plot(", "jaxmp.plot_loss_scale("):
        cell = _code_cell(notebook, text_in_cell)
        assert [o for o in cell.outputs if "image/png" in o.get("data", {})], text_in_cell
    report = json.loads(text.split("REPORT ", 1)[1].splitlines()[0])
    assert report["recovered"] == pytest.approx(1e-8, rel=1e-3)
    _check_runs({name: (dtype, history) for name, (dtype, history) in report["runs"].items()})
    # The state shown is the mixed_float16 run's last.
    last = next(h for n, (_, h) in report["runs"].items() if n == "mixed_float16")[-1]
    assert f"<td>{last['skipped_steps']}</td>" in state


@pytest.mark.slow  # executes the notebook: a kernel, and the inspected step compiled
def test_inspector_notebook_shows_its_tables_and_figures():
    notebook = nbformat.read(EXAMPLES / "inspector_notebook.ipynb", as_version=4)
    _execute(notebook)
    report = _value_of(notebook, "report")
    assert re.search(r"jaxmp.inspect: \d+ ops \(\d+ forward, \d+ backward\); reference", report)
    assert "first non-finite value: none (every value is finite)" in report
    assert "suggested loss scale: 2^" in report
    assert "<th>module</th>" in report and "<td>layer_2</td>" in report
    assert '<img src="data:image/png;base64,' in report  # the figure, inline
    nan_report = _value_of(notebook, "nan_report")
    assert re.search(
        r"first non-finite value: exp \(forward\) at \S+:\d+ in attention \(made by it\)",
        nan_report,
    )
    plan = _value_of(notebook, "plan")
    assert "jaxmp.quantization_plan: 2 of 6 floating leaves quantised" in plan
    assert "<td>layer_2/w</td><td>no</td><td>excluded by &#x27;layer_2&#x27;</td>" in plan
    fp8 = _value_of(notebook, "fp8_predict.fp8_matmuls(params, x)")
    assert "2 of 3 matmuls run in FP8" in fp8
    assert "<td>layer_2</td><td>dot_general</td><td>no</td>" in fp8
