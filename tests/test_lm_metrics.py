"""examples/lm/metrics.py: the per-step rows written and read back, and a run's result."""

import dataclasses
import json
import math
import pathlib
import sys

import jax.numpy as jnp
import optax
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

from lm import config as config_lib  # noqa: E402
from lm import metrics, rundir  # noqa: E402
from lm.steps import TrainState  # noqa: E402

import jaxmp  # noqa: E402


def row(step, val_loss=None, skipped=False, skipped_total=0, step_time_s=0.5):
    return {
        "step": step,
        "train_loss": 4.0 - step / 10,
        "val_loss": val_loss,
        "loss_scale": 32768.0,
        "skipped": skipped,
        "skipped_total": skipped_total,
        "step_time_s": step_time_s,
    }


def read(workdir):
    jsonl = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    csv_lines = (workdir / "metrics.csv").read_text().splitlines()
    return jsonl, csv_lines


def test_writer_starts_from_the_history_and_appends(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("stale\n")
    writer = metrics.MetricsWriter(tmp_path, [row(1), row(2, val_loss=3.5)])
    jsonl, csv_lines = read(tmp_path)  # written, and replaced atomically, before any step
    assert jsonl == [row(1), row(2, val_loss=3.5)]
    assert csv_lines[0].split(",") == list(metrics.COLUMNS)
    assert csv_lines[1] == "1,3.9,,32768.0,False,0,0.5"  # no evaluation: an empty cell
    assert csv_lines[2].split(",")[2] == "3.5"
    writer.write(row(3, skipped=True, skipped_total=1))
    writer.flush()
    jsonl, csv_lines = read(tmp_path)
    assert [r["step"] for r in jsonl] == [1, 2, 3] and len(csv_lines) == 4
    assert csv_lines[3] == "3,3.7,,32768.0,True,1,0.5"
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.csv", "metrics.jsonl"]


def test_history_is_read_up_to_the_checkpoint(tmp_path):
    lines = [json.dumps(row(step)) for step in (1, 2, 3, 4)]
    lines.insert(1, "not json")
    lines.append('{"step": 5, "train_lo')  # a crash in the middle of a line
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    assert metrics.load_history(tmp_path, 3) == [row(1), row(2), row(3)]
    assert metrics.load_history(tmp_path, 0) == []


def test_missing_rows_are_an_error_naming_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps(row(1)) + "\n")
    message = r"metrics.jsonl has no rows for steps 2, 3, 4, 5, 6, ... \(of 1 to 9, the check"
    with pytest.raises(rundir.RunDirError, match=message):
        metrics.load_history(tmp_path, 9)
    (tmp_path / "metrics.jsonl").unlink()
    with pytest.raises(rundir.RunDirError, match=r"no rows for steps 1, 2 \(of 1 to 2"):
        metrics.load_history(tmp_path, 2)


def test_run_result_numbers():
    params = {"w": jnp.zeros((64, 64), jnp.float16)}
    tx = jaxmp.mixed_precision(optax.sgd(0.1), "p=f16,c=f16,o=f32")
    state = TrainState(jnp.int32(3), params, tx.init(params))
    history = [
        row(1, step_time_s=9.0),
        row(2, skipped=True, skipped_total=1, step_time_s=0.25),
        row(3, skipped_total=1, step_time_s=0.75),
        row(4, skipped_total=1, step_time_s=0.5),
    ]
    result = metrics.RunResult(
        config=config_lib.Config(),
        workdir=pathlib.Path("run"),
        state=state,
        history=history,
        final_val_loss=3.0,
        unigram_loss=3.2,
        peak_memory_bytes=None,
        sample="",
    )
    assert result.skipped_steps == 1
    assert result.median_step_time == 0.5  # the first step (compilation warm-up) left out
    assert result.final_loss_scale == 2.0**15
    # float16 params (2 bytes) and their float32 master copy (4), and a few scalars in all
    assert 6 < result.bytes_per_param < 6.01
    empty = dataclasses.replace(result, history=[])
    assert empty.skipped_steps == 0 and math.isnan(empty.median_step_time)
