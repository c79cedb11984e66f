"""examples/lm/rundir.py: which run directories a run accepts, what --overwrite deletes, and
the checkpoints in one (the whole runs are in tests/test_train.py)."""

import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

from lm import rundir  # noqa: E402


def test_a_new_run_needs_an_empty_or_missing_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert rundir.check_workdir(tmp_path / "new", resume=False, overwrite=False) == []
    (tmp_path / "empty").mkdir()
    assert rundir.check_workdir(tmp_path / "empty", resume=False, overwrite=False) == []
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(rundir.RunDirError, match=r"^mine already holds files; continue it"):
        rundir.check_workdir(tmp_path / "mine", resume=False, overwrite=False)
    (tmp_path / "mine" / "metrics.jsonl").write_text("")
    with pytest.raises(rundir.RunDirError, match=r"^mine already holds a run \(no checkpoint\)"):
        rundir.check_workdir(tmp_path / "mine", resume=False, overwrite=False)
    assert rundir.check_workdir(tmp_path / "mine", resume=False, overwrite=True) == []
    (tmp_path / "file").write_text("")
    with pytest.raises(rundir.RunDirError, match=r"^--workdir file is a file; choose a directory"):
        rundir.check_workdir(tmp_path / "file", resume=False, overwrite=True)
    with pytest.raises(ValueError, match="exclude each other"):
        rundir.check_workdir(tmp_path / "new", resume=True, overwrite=True)


def test_resume_needs_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(rundir.RunDirError, match=r"in typo/checkpoints \(the directory does not"):
        rundir.check_workdir(tmp_path / "typo", resume=True, overwrite=False)
    (tmp_path / "run").mkdir()
    with pytest.raises(rundir.RunDirError, match=r"in run/checkpoints \(none found\)"):
        rundir.check_workdir(tmp_path / "run", resume=True, overwrite=False)


def test_checkpoints_are_listed_and_restored(tmp_path):
    state = {"params": jnp.arange(3, dtype=jnp.float16), "step": jnp.int32(0)}
    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    with ocp.CheckpointManager(tmp_path / "checkpoints", options=options) as manager:
        for step in (4, 8, 12):
            saved = {**state, "step": jnp.int32(step)}
            manager.save(step, args=ocp.args.StandardSave(saved))
        manager.wait_until_finished()
    steps = rundir.checkpoint_steps(tmp_path)
    assert steps == [8, 12]  # the latest two are kept
    assert rundir.check_workdir(tmp_path, resume=True, overwrite=False) == steps
    hook = sys.unraisablehook
    restored = rundir.restore_checkpoint(tmp_path, steps, state)
    assert sys.unraisablehook is hook
    assert int(restored["step"]) == 12 and restored["params"].dtype == jnp.float16
    np.testing.assert_array_equal(restored["params"], state["params"])
    with pytest.raises(rundir.RunDirError, match=r"already holds a run \(checkpoint at step 12\)"):
        rundir.check_workdir(tmp_path, resume=False, overwrite=False)
    assert rundir.checkpoint_steps(tmp_path / "elsewhere") == []


def test_overwrite_deletes_only_the_run_outputs(tmp_path):
    outside = tmp_path / "outside.png"
    outside.write_text("kept")
    run = tmp_path / "run"
    (run / "checkpoints" / "8").mkdir(parents=True)
    (run / "checkpoints" / "8" / "data").write_text("")
    for name in ("config.yaml", "metrics.jsonl", "metrics.csv", "inspect.json", "notes.txt"):
        (run / name).write_text("")
    (run / "losses.png").symlink_to(outside)  # the link goes; what it points to stays
    rundir.remove_run_outputs(run)
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]
    assert outside.read_text() == "kept"
    rundir.remove_run_outputs(run)  # nothing left to delete: no error


def test_paths_in_messages_are_relative_to_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    assert rundir.show_path(tmp_path / "cwd" / "runs" / "a") == "runs/a"
    assert rundir.show_path(tmp_path / "cwd") == "."
    assert rundir.show_path("runs/../runs/b") == "runs/b"
    assert rundir.show_path(tmp_path / "other") == str((tmp_path / "other").resolve())


def test_a_checkpoint_error_is_shortened_to_one_line():
    long = ValueError("first line\n  second " + "x" * 300)
    assert rundir._short_reason(long) == ("first line second " + "x" * 300)[:157] + "..."
    details = RuntimeError("DATA_LOSS: bad chunk See full TensorStore details: {...}")
    assert rundir._short_reason(details) == "DATA_LOSS: bad chunk"
    assert rundir._short_reason(OSError()) == "OSError"
