"""Tests of examples/serve.py: a tiny trained run served with each recipe; the command line."""

import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

import serve  # noqa: E402
import train  # noqa: E402
from lm import config as config_lib  # noqa: E402
from lm import loop  # noqa: E402
from lm import steps as steps_lib  # noqa: E402

from tests.conftest import environ_without_compilation_cache  # noqa: E402
from tests.test_train import TINY  # noqa: E402


@pytest.mark.slow
def test_tiny_run_served_with_every_recipe(tmp_path, capsys):
    config = config_lib.load("mixed_float16", TINY)
    loop.train_and_evaluate(
        config, tmp_path / "run", progress=False, verbose=False, sample_length=0, figure=False
    )
    rows = serve.serve(tmp_path / "run", group_size=16, batch=2, tokens=4, runs=1)
    assert [r.recipe for r in rows] == ["bf16", "int8", "int8_dynamic", "fp8", "int4"]
    base = rows[0]
    for r in rows:
        assert np.isfinite(r.val_loss) and r.tokens_per_s > 0
    by_name = {r.recipe: r for r in rows}
    assert abs(by_name["int8"].val_loss / base.val_loss - 1) < 0.01
    assert abs(by_name["int8_dynamic"].val_loss / base.val_loss - 1) < 0.015
    assert abs(by_name["fp8"].val_loss / base.val_loss - 1) < 0.01
    assert abs(by_name["int4"].val_loss / base.val_loss - 1) < 0.03
    # int8 and E4M3: one byte a weight against two, plus a float32 scale per output channel.
    for name in ("int8", "int8_dynamic", "fp8"):
        assert 0.5 < by_name[name].weight_bytes / base.weight_bytes < 0.56
    assert by_name["int4"].weight_bytes / base.weight_bytes == pytest.approx(0.25 + 2 / 16)
    assert by_name["int8"].param_bytes < base.param_bytes
    serve.main(
        ["--workdir", str(tmp_path / "run"), "--recipes", "int8", "--tokens", "2", "--runs", "1"]
    )
    table = capsys.readouterr().out
    assert table.splitlines()[0].startswith("| recipe | val loss | vs bf16 | param bytes")
    assert "| int8 |" in table


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workdir", "nowhere"], "--workdir: nowhere holds no run (no config.yaml)"),
        (
            ["--workdir", "x", "--recipes", "int9"],
            "--recipes must be names of int8, "
            "int8_dynamic, fp8, int4, got 'int9'. Did you mean 'int8'?",
        ),
    ],
)
def test_command_line_errors_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f": error: {message}" in err


# --- The run directory: relative paths, the default, unreadable checkpoints ----------------------


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A tiny run's directory as train.py leaves it, with checkpoints at steps 1 and 2 (saved
    from the initial state, not trained: serving reads only the params)."""
    config = config_lib.load("mixed_float16", TINY)
    workdir = tmp_path_factory.mktemp("saved") / "run"
    workdir.mkdir()
    (workdir / "config.yaml").write_text(config_lib.dump(config))
    built = steps_lib.programs(config, steps_lib.get_dataset(config.val_fraction).vocab_size)
    state = built.init(jax.random.PRNGKey(config.seed))
    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    with ocp.CheckpointManager(workdir / "checkpoints", options=options) as manager:
        for step in (1, 2):
            manager.save(step, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
    return workdir


def copy_of(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def truncate_largest_file(directory):
    largest = max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[:100])


def serve_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("serve.py: error: ")
    return err.removeprefix("serve.py: error: ").strip()


def test_a_relative_workdir_is_read(saved_run, monkeypatch):
    # `--workdir runs/q`, as the docs write it: orbax needs an absolute path.
    monkeypatch.chdir(saved_run.parent)
    config, _, params = serve.load_run(pathlib.Path(saved_run.name))
    assert config.d_model == 32
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))
    _, _, earlier = serve.load_run(pathlib.Path(saved_run.name), step=1)
    assert jax.tree.structure(earlier) == jax.tree.structure(params)


def test_serve_reads_the_run_train_writes_by_default(tmp_path, monkeypatch, capsys):
    # `python examples/train.py && python examples/serve.py`: the same run directory.
    monkeypatch.setattr(train, "REPO_ROOT", tmp_path)
    monkeypatch.chdir(tmp_path)
    message = serve_error([], capsys)
    assert message == (
        f"--workdir: runs/{train.DEFAULT_CONFIG} holds no run (no config.yaml); train one with "
        "python examples/train.py"
    )


def test_an_unreadable_checkpoint_is_served_messages_own(saved_run, tmp_path):
    # Through `python examples/serve.py` itself (a relative --workdir): one line, no traceback
    # of orbax's abandoned reads at exit, and serve.py's own advice (it has no --resume).
    workdir = copy_of(saved_run, tmp_path)
    truncate_largest_file(workdir / "checkpoints" / "2")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "serve.py"), "--workdir", "run"],
        cwd=tmp_path,
        env=environ_without_compilation_cache(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    (line,) = proc.stderr.splitlines()
    assert line.startswith("serve.py: error: --workdir: cannot read checkpoint run/checkpoints/2 (")
    assert line.endswith("; the one at step 1 can be read: serve it with --step 1.")
    assert "--resume" not in line and "--overwrite" not in line and "delete" not in line
    _, _, params = serve.load_run(workdir, step=1)  # what the message says works
    assert jax.tree.leaves(params)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--step", "7"],
            "--step: no checkpoint at step 7 in {run}/checkpoints; its checkpoints "
            "are at steps 1, 2.",
        ),
        (["--step", "0"], "--step must be positive, got 0."),
    ],
)
def test_step_errors(saved_run, argv, message, capsys):
    got = serve_error(["--workdir", str(saved_run), *argv], capsys)
    assert got == message.format(run=saved_run)
