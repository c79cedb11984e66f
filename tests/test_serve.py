"""Tests of examples/serve.py: a tiny trained run served with each recipe; the command line."""

import json
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jaxmp

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
def test_tiny_run_served_with_every_recipe_and_kv_cache(tmp_path, capsys):
    config = config_lib.load("mixed_float16", TINY)
    loop.train_and_evaluate(
        config, tmp_path / "run", progress=False, verbose=False, sample_length=0, figure=False
    )
    rows = serve.serve(tmp_path / "run", group_size=16, batch=2, tokens=4, runs=1)
    names = [(r.recipe, r.kv_cache) for r in rows]
    assert names == [
        *((name, "bf16") for name in ("bf16", "int8", "int8_dynamic", "fp8", "int4")),
        ("bf16", "int8"),
        ("bf16", "fp8"),
    ]
    base = rows[0]
    for r in rows:
        assert np.isfinite(r.val_loss) and np.isfinite(r.cached_val_loss) and r.tokens_per_s > 0
    by_name = {r.recipe: r for r in rows if r.kv_cache == "bf16"}
    assert abs(by_name["int8"].val_loss / base.val_loss - 1) < 0.01
    assert abs(by_name["int8_dynamic"].val_loss / base.val_loss - 1) < 0.015
    assert abs(by_name["fp8"].val_loss / base.val_loss - 1) < 0.01
    assert abs(by_name["int4"].val_loss / base.val_loss - 1) < 0.03
    # int8 and E4M3: one byte a weight against two, plus a float32 scale per output channel.
    for name in ("int8", "int8_dynamic", "fp8"):
        assert 0.5 < by_name[name].weight_bytes / base.weight_bytes < 0.56
    assert by_name["int4"].weight_bytes / base.weight_bytes == pytest.approx(0.25 + 2 / 16)
    assert by_name["int8"].param_bytes < base.param_bytes
    # Through the bfloat16 cache, the full forward's loss (scores in float32 rather than
    # bfloat16); through the quantised caches, close to it. The weights are bfloat16's.
    assert base.cached_val_loss == pytest.approx(base.val_loss, rel=1e-3)
    by_cache = {r.kv_cache: r for r in rows if r.recipe == "bf16"}
    for fmt, head_dim in (("int8", 16), ("fp8", 16)):
        r = by_cache[fmt]
        assert r.val_loss == base.val_loss and r.param_bytes == base.param_bytes
        assert abs(r.cached_val_loss / base.cached_val_loss - 1) < 0.01
        extra = 2 if fmt == "int8" else 1  # the scale's bytes per (position, head)
        assert r.kv_cache_bytes / base.kv_cache_bytes == (head_dim + extra) / (2 * head_dim)
    serve.main(
        ["--workdir", str(tmp_path / "run"), "--recipes", "int8", "--kv-cache", "bf16,int8"]
        + ["--tokens", "2", "--runs", "1"]
    )
    table = capsys.readouterr().out
    header = table.splitlines()[0]
    assert header.startswith("| recipe | kv cache | val loss | vs bf16 | cached val loss |")
    lines = [line for line in table.splitlines() if line.startswith("| ")][1:]
    assert [line.split(" | ")[:2] for line in lines] == [
        ["| bf16", "bf16"],
        ["| int8", "bf16"],
        ["| bf16", "int8"],
    ]
    # serve.json: the table's rows and numbers, bf16 first.
    written = json.loads((tmp_path / "run" / "serve.json").read_text())
    assert [(r["recipe"], r["kv_cache"]) for r in written] == [
        ("bf16", "bf16"),
        ("int8", "bf16"),
        ("bf16", "int8"),
    ]
    for row, line in zip(written, lines, strict=True):
        assert {"recipe", "val_loss", "param_bytes", "tokens_per_s"} <= set(row)
        cells = line.strip("| ").split(" | ")
        assert f"{row['val_loss']:.4f}" == cells[2] and f"{row['param_bytes']:,}" == cells[6]
        assert f"{row['tokens_per_s']:,.0f}" == cells[-1]
        assert f"{row['kv_cache_bytes']:,}" == cells[10]
    # Greedy decoding with each quantised cache against the bfloat16 cache.
    capsys.readouterr()
    serve.main(
        ["--workdir", str(tmp_path / "run"), "--agreement", "12", "--prompts", "3"]
        + ["--kv-cache", "bf16,f32,int8,fp8"]
    )
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("Greedy decoding of 12 tokens after 3 prompts")
    rows = serve.kv_agreement(tmp_path / "run", ("int8", "fp8"), tokens=12, prompts=3)
    by_block = serve.kv_agreement(tmp_path / "run", ("int8",), tokens=12, prompts=3, block_size=8)
    assert by_block[0]["bytes_ratio"] == (8 + 2) / 16  # a scale per 8 values
    assert [r["kv_cache"] for r in rows] == ["int8", "fp8"]
    for r in rows:
        assert 0.5 <= r["same_forced"] <= 1 and 0 <= r["same_free"] <= 1
        assert r["same_text"] == np.mean([d == 12 for d in r["first_divergence"]])
        assert 0 < r["logits_max_abs"] and 0 < r["logits_max_rel"] < 0.2
        assert len(r["first_divergence"]) == 3
        assert f"| {r['kv_cache']} | {100 * r['same_forced']:.2f}% |" in out


def _row(recipe, kv_cache="bf16", val_loss=1.25):
    return serve.Row(
        recipe=recipe,
        val_loss=val_loss,
        param_bytes=1000,
        weight_bytes=800,
        tokens_per_s=123.4,
        kv_cache=kv_cache,
        kv_cache_bytes=4096,
        cached_val_loss=val_loss,
    )


def test_serve_json_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    rows = [_row("bf16"), _row("int8", val_loss=float("nan")), _row("bf16", "int8")]
    path = serve.write_rows(rows, tmp_path)
    assert path == tmp_path / "serve.json"
    written = json.loads(path.read_text())
    assert written[0] == {
        "recipe": "bf16",
        "val_loss": 1.25,
        "param_bytes": 1000,
        "tokens_per_s": 123.4,
        "kv_cache": "bf16",
        "cached_val_loss": 1.25,
        "weight_bytes": 800,
        "kv_cache_bytes": 4096,
    }
    assert written[1]["val_loss"] is None  # not a number: JSON's null, not NaN
    # A write that fails leaves the earlier serve.json as it was, and no other file.
    before = path.read_bytes()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(serve.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        serve.write_rows(rows[:1], tmp_path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["serve.json"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workdir", "nowhere"], "--workdir: nowhere holds no run (no config.yaml)"),
        (
            ["--workdir", "x", "--recipes", "int9"],
            "--recipes must be names of int8, int8_dynamic, fp8, int4, int8_calibrated, "
            "fp8_calibrated, got 'int9'. Did you mean 'int8'?",
        ),
        (
            ["--workdir", "x", "--kv-cache", "bf16,int9"],
            "--kv-cache must be names of bf16, f32, int8, fp8, got 'int9'. Did you mean 'int8'?",
        ),
        (
            ["--workdir", "x", "--agreement", "8", "--kv-cache", "bf16"],
            "--agreement compares caches with the bf16 cache: --kv-cache must name another "
            "(f32, int8, fp8), got bf16.",
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
        (
            ["--tokens", "14"],
            "--tokens must be in [1, 13] (the model's 16 positions after the 4-character "
            "prompt, the last one generated), got 14.",
        ),
        (
            ["--kv-block-size", "5", "--tokens", "2"],
            "--kv-block-size must be a positive divisor of head_dim 16, got 5.",
        ),
    ],
)
def test_step_errors(saved_run, argv, message, capsys):
    got = serve_error(["--workdir", str(saved_run), *argv], capsys)
    assert got == message.format(run=saved_run)


def test_the_served_weights_are_quantised_from_the_params_as_trained():
    # Rounded to bfloat16 first, a weight can land on another point of the grid than the
    # float32 weight quantization-aware training quantised: the recipes quantise the params
    # as trained, and only the other leaves are cast to bfloat16.
    config = config_lib.load("int4_qat", (*TINY, "d_model=128", "qat_start=0"))
    dataset = steps_lib.get_dataset(config.val_fraction)
    model = steps_lib.make_model(
        steps_lib.with_precision(config, serve.BASELINE), dataset.vocab_size
    )
    params = steps_lib.programs(config, dataset.vocab_size).init(jax.random.PRNGKey(0)).params

    def apply(p, x):
        return model.apply({"params": p}, x)

    example = jnp.zeros((1, config.seq_len), jnp.int32)
    recipe = config.qat_recipe
    served = serve.served_params(apply, params, example, recipe)
    trained = jaxmp.quantize(apply, params, example, recipe=recipe)
    rounded_first = jaxmp.quantize(
        apply, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), example, recipe=recipe
    )
    is_q = lambda x: isinstance(x, jaxmp.QuantizedArray)  # noqa: E731
    flat = zip(
        jax.tree.leaves(served, is_leaf=is_q),
        jax.tree.leaves(trained, is_leaf=is_q),
        jax.tree.leaves(rounded_first, is_leaf=is_q),
        jax.tree.leaves(params),
        strict=True,
    )
    differs = 0
    for got, want, other, param in flat:
        if is_q(want):
            assert is_q(got)
            assert np.asarray(got.values).tobytes() == np.asarray(want.values).tobytes()
            assert np.asarray(got.scales).tobytes() == np.asarray(want.scales).tobytes()
            differs += np.asarray(other.values).tobytes() != np.asarray(want.values).tobytes()
        else:
            assert got.dtype == jnp.bfloat16
            np.testing.assert_array_equal(got, param.astype(jnp.bfloat16))
    assert differs  # quantising the bfloat16 params would not serve what was trained
    bf16 = serve.served_params(apply, params, example, None)  # the baseline: all bfloat16
    for got, param in zip(jax.tree.leaves(bf16), jax.tree.leaves(params), strict=True):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(got, param.astype(jnp.bfloat16))


def test_calibrated_rows_serve_static_activation_scales(saved_run, monkeypatch):
    calls = []
    calibrate = jaxmp.calibrate

    def counting(fun, qparams, batches):
        batches = list(batches)
        calls.append(len(batches))
        return calibrate(fun, qparams, batches)

    monkeypatch.setattr(jaxmp, "calibrate", counting)
    rows = serve.serve(saved_run, ["fp8", "fp8_calibrated"], kv_caches=("bf16",), tokens=2, runs=1)
    assert [r.recipe for r in rows] == ["bf16", "fp8", "fp8_calibrated"]
    assert calls == [serve.CALIBRATION_BATCHES]
    base, dynamic, static = rows
    assert dynamic.val_loss != static.val_loss  # not the dynamic scales
    assert abs(static.val_loss / base.val_loss - 1) < 0.01
    # One float32 activation scale per output channel, stored with the weights.
    assert static.weight_bytes > dynamic.weight_bytes
