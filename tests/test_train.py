"""Tests of examples/train.py: tiny runs with numbers asserted, the command line, interrupts.

One tiny run (`finished`) is trained once and shared: the resume, interrupt, refusal and figure
tests compare against it or work on copies of its directory. Runs of equal configs share
compiled programs through a persistent compilation cache, so each later run compiles nothing.
"""

import dataclasses
import functools
import json
import math
import pathlib
import shutil
import signal
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

import loss_scale_tools  # noqa: E402
import train  # noqa: E402
from lm import config as config_lib  # noqa: E402
from lm import data as data_lib  # noqa: E402
from lm import figures, rundir  # noqa: E402
from lm import model as model_lib  # noqa: E402

import jaxmp  # noqa: E402
from tests.conftest import all_eqns, environ_without_compilation_cache, fp8_dots  # noqa: E402

TINY = (
    "num_layers=1",
    "num_heads=2",
    "d_model=32",
    "mlp_ratio=2",
    "seq_len=16",
    "batch_size=8",
    "steps=24",
    "warmup_steps=2",
    "learning_rate=0.01",
    "eval_interval=12",
    "eval_batches=2",
    "checkpoint_interval=100",
)
# The shared run: starting at 2^20, float16 gradients overflow, so the first steps are skipped
# and the scale halves; it then doubles every 4 finite steps until it overflows again.
RUN = TINY + ("checkpoint_interval=8", "loss_scale_init=1048576.0", "loss_scale_period=4")
SHIPPED = (
    "fp32",
    "mixed_float16",
    "mixed_bfloat16",
    "float16_master_weights",
    "float16_no_loss_scale",
    "bf16_master_weights",
    "bf16_round_to_nearest",
    "bf16_stochastic_rounding",
    "bf16_kahan_summation",
    "bf16_8bit_states",
    "mixed_fp8",
    "mixed_fp8_delayed",
    "mixed_fp8_block",
    "int4_qat",
    "fp8_qat",
)


def tiny(name, *overrides):
    return config_lib.load(name, TINY + overrides)


def run(config, workdir, **kwargs):
    kwargs.setdefault("sample_length", 0)
    kwargs.setdefault("figure", False)
    return train.train_and_evaluate(config, workdir, progress=False, verbose=False, **kwargs)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """The shared tiny run, trained to the end (checkpoints at steps 16 and 24 remain)."""
    config = config_lib.load("mixed_float16", RUN)
    return run(config, tmp_path_factory.mktemp("finished") / "run", figure=True)


def copy_run(result, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(result.workdir, target)
    return target


def snapshot(directory):
    """Every file under `directory`, by relative path, with its bytes."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(pathlib.Path(directory).rglob("*"))
        if p.is_file()
    }


def metrics_steps(workdir):
    with open(workdir / "metrics.jsonl") as f:
        jsonl = [json.loads(line)["step"] for line in f]
    csv_rows = (workdir / "metrics.csv").read_text().splitlines()[1:]
    return jsonl, [int(row.split(",")[0]) for row in csv_rows]


def without_time(history):
    return [{k: v for k, v in r.items() if k != "step_time_s"} for r in history]


def assert_identical(a, b):
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_same_run(result, reference):
    """`result` (interrupted and resumed) is bit for bit the uninterrupted `reference`."""
    assert_identical(result.state.params, reference.state.params)
    assert_identical(result.state.opt_state, reference.state.opt_state)
    assert without_time(result.history) == without_time(reference.history)
    assert result.final_val_loss == reference.final_val_loss
    steps = list(range(1, reference.config.steps + 1))
    assert metrics_steps(result.workdir) == (steps, steps)


def check_loss_scale_rule(config, history):
    """The dynamic rule: halve on a skipped step, double after `period` finite steps."""
    previous, finite_run = config.loss_scale_init, 0
    for record in history:
        scale = record["loss_scale"]
        if record["skipped"]:
            assert scale == max(previous / 2, config.loss_scale_min)
            finite_run = 0
        else:
            finite_run += 1
            expected = previous * 2 if finite_run == config.loss_scale_period else previous
            finite_run %= config.loss_scale_period
            assert scale == expected
        previous = scale


# --- A run's numbers and outputs -------------------------------------------------------------


def test_shipped_configs_are_the_documented_ones():
    assert set(SHIPPED) <= set(config_lib.available())
    for name in config_lib.available():
        config = config_lib.load(name)
        assert config.name == name
        assert config.mesh == ""
    assert config_lib.load("mixed_float16").policy == jaxmp.get_policy("mixed_float16")
    assert config_lib.load("float16_master_weights").policy.param_dtype == jnp.float16
    assert config_lib.load("float16_no_loss_scale").loss_scale == "none"
    assert set(train.COMPARE_ORDER) == set(config_lib.available())
    fp8 = {name: config_lib.load(name) for name in SHIPPED if name.startswith("mixed_fp8")}
    assert {c.policy for c in fp8.values()} == {jaxmp.get_policy("mixed_bfloat16")}
    assert [c.fp8 for c in fp8.values()] == ["current", "delayed", "block"]
    assert config_lib.load("mixed_bfloat16").fp8 == "none"
    qat = {name: config_lib.load(name) for name in SHIPPED if name.endswith("_qat")}
    assert {c.policy for c in qat.values()} == {jaxmp.get_policy("mixed_bfloat16")}
    assert [(c.qat, c.qat_start) for c in qat.values()] == [("int4", 1000), ("fp8", 1000)]
    low = {name: config_lib.load(name) for name in SHIPPED if name.startswith("bf16_")}
    assert {c.policy for c in low.values()} == {jaxmp.get_policy("p=bf16,c=bf16,o=f32")}
    assert [c.master_weights for c in low.values()] == [True, False, False, False, False]
    assert low["bf16_stochastic_rounding"].rounding == "stochastic"
    assert (
        low["bf16_stochastic_rounding"].first_moment,
        low["bf16_8bit_states"].second_moment,
    ) == (
        "bfloat16",
        "int8",
    )


def check_run(result):
    config = result.config
    history = result.history
    losses = np.array([r["train_loss"] for r in history])
    assert len(history) == config.steps
    assert np.all(np.isfinite(losses))
    assert losses[-4:].mean() < losses[:4].mean() - 0.5, losses
    assert math.isfinite(result.final_val_loss)
    assert result.final_val_loss < math.log(train.get_dataset(0.1).vocab_size)
    assert result.peak_memory_bytes is None or result.peak_memory_bytes > 0
    policy = config.policy
    assert {leaf.dtype for leaf in jax.tree.leaves(result.state.params)} == {policy.param_dtype}
    assert int(result.state.step) == config.steps

    scales = np.array([r["loss_scale"] for r in history])
    skipped = np.array([r["skipped"] for r in history])
    assert history[-1]["skipped_total"] == skipped.sum() == result.skipped_steps
    if config.loss_scale == "none":
        np.testing.assert_array_equal(scales, 1.0)
        assert result.skipped_steps == 0
    else:
        assert config.loss_scale == "dynamic"
        check_loss_scale_rule(config, history)
        assert scales.max() > scales.min()

    workdir = result.workdir
    steps = list(range(1, config.steps + 1))
    assert metrics_steps(workdir) == (steps, steps)
    header = (workdir / "metrics.csv").read_text().splitlines()[0]
    assert header.split(",") == list(train.COLUMNS)
    assert config_lib.load(str(workdir / "config.yaml")) == config
    assert (workdir / "losses.png").stat().st_size > 0
    assert train.checkpoint_steps(workdir)[-1] == config.steps


def test_finished_run(finished):
    check_run(finished)
    # Skips first (the scale starts too high), then growth every 4 finite steps.
    skipped = [r["skipped"] for r in finished.history]
    assert skipped[:2] == [True, True] and finished.history[0]["loss_scale"] == 2.0**19
    assert max(r["loss_scale"] for r in finished.history[5:]) > min(
        r["loss_scale"] for r in finished.history
    )
    metrics = jaxmp.loss_scale_metrics(finished.state.opt_state)
    assert int(metrics["skipped_steps"]) == finished.skipped_steps
    assert train.checkpoint_steps(finished.workdir) == [16, 24]


@pytest.mark.slow
@pytest.mark.parametrize("name", SHIPPED)
def test_train_shipped_config(name, tmp_path):
    # A scale period of 4 makes the dynamic configs grow (and possibly back off) in 24 steps;
    # a quantization-aware config trains its last 12 so.
    qat = ("qat_start=12",) if config_lib.load(name).qat != "none" else ()
    check_run(run(tiny(name, "loss_scale_period=4", *qat), tmp_path, figure=True))


@pytest.mark.slow
def test_static_loss_scale_is_constant(tmp_path):
    config = tiny("mixed_float16", "loss_scale=static", "loss_scale_init=1024.0", "steps=6")
    result = run(config, tmp_path)
    assert [r["loss_scale"] for r in result.history] == [1024.0] * 6
    assert result.skipped_steps == 0


@pytest.mark.slow  # two minutes on 2 CPU cores: the inspected step compiles for long
def test_inspect_reports_the_steps_and_leaves_training_unchanged(tmp_path):
    # Starting at 2^16, float16 gradients overflow: the first steps are skipped. The report of
    # each step must name a non-finite op exactly when the step is skipped.
    config = tiny("mixed_float16", "steps=4", "loss_scale_init=65536.0", "loss_scale_period=2")
    plain = run(config, tmp_path / "plain")
    (tmp_path / "inspected").mkdir()
    inspected = run(config, tmp_path / "inspected", inspect_steps=(1, 2, 3, 4))
    assert without_time(inspected.history) == without_time(plain.history)
    assert_identical(inspected.state.params, plain.state.params)
    names = {p.name for p in inspected.workdir.iterdir()}
    assert names == {p.name for p in plain.workdir.iterdir()} | {"inspect.json", "inspect.png"}
    data = json.loads((inspected.workdir / "inspect.json").read_text())
    assert data["config"] == config.name and data["precision"] == str(config.policy)
    entries = data["inspections"]
    assert [e["step"] for e in entries] == [1, 2, 3, 4]
    scales = [config.loss_scale_init] + [r["loss_scale"] for r in plain.history]
    skipped = [r["skipped"] for r in plain.history]
    assert skipped[0] and not all(skipped)
    for entry, scale, was_skipped in zip(entries, scales, skipped, strict=False):
        assert entry["loss_scale"] == scale
        assert (entry["first_nonfinite"] is not None) == was_skipped, entry["first_nonfinite"]
        suggested = entry["suggested_loss_scale"]
        assert suggested == 2.0 ** round(math.log2(suggested))
        if was_skipped:  # the suggestion scales the overflowing gradients back into range
            assert suggested < scale and "(backward)" in entry["first_nonfinite"]
        rows = entry["report"]["rows"]
        assert {r["phase"] for r in rows} == {"forward", "backward"}
        assert any(r["module"].startswith("TransformerLM/block_0/") for r in rows)
        assert any(r["dtype"] == "float16" and r["primitive"] == "dot_general" for r in rows)
    assert (inspected.workdir / "inspect.png").stat().st_size > 10_000


def test_inspect_steps_are_parsed():
    assert train.parse_inspect_steps("", 30) == (1, 30)
    assert train.parse_inspect_steps("5,1,5", 30) == (1, 5)
    for bad in ("0", "31", "1,x", ",", "1.5"):
        with pytest.raises(ValueError, match=r"--inspect expects comma-separated steps from 1"):
            train.parse_inspect_steps(bad, 30)


def test_batches_depend_only_on_seed_and_step():
    dataset = train.get_dataset(0.1)
    a = data_lib.train_batch(dataset.train, 0, 5, 4, 16)
    b = data_lib.train_batch(dataset.train, 0, 5, 4, 16)
    c = data_lib.train_batch(dataset.train, 0, 6, 4, 16)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[0][:, 1:], a[1][:, :-1])  # targets are inputs shifted
    assert not np.array_equal(a[0], c[0])
    assert dataset.decode(dataset.encode("The for")) == "The for"
    assert len(dataset.val) == pytest.approx(0.1 * (len(dataset.train) + len(dataset.val)), 1)
    assert 3.0 < data_lib.unigram_entropy(dataset.train, dataset.val, dataset.vocab_size) < 3.5


def test_corpus_is_the_same_text_on_every_python(monkeypatch):
    # Each Python release ships a different revision of pydoc_data's topics; the main job reads
    # the stored copy, so its data does not depend on the Python that runs it.
    import types

    text = data_lib.load_corpus()
    assert (len(text), len(set(text))) == (464_970, 103)
    fake = types.ModuleType("pydoc_data.topics")
    fake.topics = {"a": "another Python's text"}
    monkeypatch.setitem(sys.modules, "pydoc_data.topics", fake)
    assert data_lib.python_docs_text() == "another Python's text"
    assert data_lib.load_corpus() == text


def test_a_damaged_corpus_is_an_error(tmp_path, monkeypatch):
    import lzma

    damaged = tmp_path / "corpus.txt.xz"
    damaged.write_bytes(lzma.compress(data_lib.load_corpus()[:-1].encode()))
    monkeypatch.setattr(data_lib, "CORPUS_PATH", damaged)
    with pytest.raises(ValueError, match=r"corpus.txt.xz is damaged: sha256 [0-9a-f]{64}"):
        data_lib.load_corpus()


# --- Nothing is lost: refusal, overwrite, resume --------------------------------------------


def test_new_run_refuses_a_finished_run(finished):
    before = snapshot(finished.workdir)
    with pytest.raises(train.RunDirError, match="--resume.*--overwrite") as excinfo:
        run(finished.config, finished.workdir)
    assert "checkpoint at step 24" in str(excinfo.value)
    assert snapshot(finished.workdir) == before


def test_overwrite_replaces_only_the_run(finished, tmp_path):
    workdir = copy_run(finished, tmp_path)
    (workdir / "notes.txt").write_text("mine")
    (workdir / "metrics.jsonl").write_text('{"step": 1}\n')  # will be replaced
    result = run(finished.config, workdir, overwrite=True)
    assert (workdir / "notes.txt").read_text() == "mine"
    assert_same_run(result, finished)


def test_resume_without_checkpoint_is_an_error(tmp_path):
    with pytest.raises(train.RunDirError, match="no checkpoint in .*does not exist"):
        run(tiny("mixed_float16"), tmp_path / "typo", resume=True)
    assert not (tmp_path / "typo").exists()


class Interrupt:
    """Patches `MetricsWriter.write` to interrupt a run at step `at`, in one of three ways."""

    def __init__(self, monkeypatch, at, how):
        original = train.MetricsWriter.write

        def write(writer, record):
            if record["step"] != at:
                return original(writer, record)
            if how == "before_row":  # Ctrl-C after the step ran, before its row is written
                raise KeyboardInterrupt
            if how == "between_files":  # Ctrl-C with the JSON line written, the CSV row not
                writer._jsonl.write(json.dumps(record) + "\n")
                raise KeyboardInterrupt
            assert how == "sigint"  # a real SIGINT arriving while the step is in progress
            signal.raise_signal(signal.SIGINT)
            return original(writer, record)

        monkeypatch.setattr(train.MetricsWriter, "write", write)


def test_interrupts_then_resume_give_the_uninterrupted_run(finished, tmp_path, monkeypatch):
    workdir = tmp_path / "run"
    # The handler the run must put back: Python's own, or SIG_IGN in a process started in the
    # background by a shell without job control.
    handler = signal.getsignal(signal.SIGINT)
    # (how, at, the step of the checkpoint left behind): a SIGINT lets the step finish; an
    # interrupt before the step's rows are complete leaves the checkpoint of the step before.
    interrupts = [("before_row", 5, 4), ("sigint", 10, 10), ("between_files", 15, 14)]
    for i, (how, at, saved) in enumerate(interrupts):
        with monkeypatch.context() as patch:
            Interrupt(patch, at=at, how=how)
            with pytest.raises(KeyboardInterrupt):
                run(finished.config, workdir, resume=i > 0)
        assert train.checkpoint_steps(workdir)[-1] == saved, how
        jsonl, csv_steps = metrics_steps(workdir)
        assert csv_steps == list(range(1, saved + 1)), how
        assert jsonl[:saved] == csv_steps and len(jsonl) <= saved + 1, how
    assert signal.getsignal(signal.SIGINT) is handler
    assert_same_run(run(finished.config, workdir, resume=True), finished)


def test_resume_after_a_crash_recomputes_the_rows_after_the_checkpoint(finished, tmp_path):
    # A run killed after step 24's rows were written but before its checkpoint, mid-line.
    workdir = copy_run(finished, tmp_path)
    shutil.rmtree(workdir / "checkpoints" / "24")
    with open(workdir / "metrics.jsonl", "a") as f:
        f.write('{"step": 25, "train_lo')
    hook = sys.unraisablehook
    assert_same_run(run(finished.config, workdir, resume=True), finished)
    assert sys.unraisablehook is hook  # a good restore puts the previous hook back


def test_a_resume_that_changes_the_config_says_so(finished, tmp_path, capsys):
    # Extending a finished run is legitimate (--resume --set steps=...); rewriting its
    # config.yaml in silence is not.
    workdir = copy_run(finished, tmp_path)
    config = config_lib.load(str(workdir / "config.yaml"), ["steps=26"])
    capsys.readouterr()
    result = run(config, workdir, resume=True)
    assert result.history[-1]["step"] == 26
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "mixed_float16: extending the run from 24 to 26 steps (config.yaml updated)"
    ]
    assert config_lib.load(str(workdir / "config.yaml")) == config
    # Other keys too, each named; a resume that changes nothing says nothing.
    changed = config_lib.load(str(workdir / "config.yaml"), ["steps=27", "eval_interval=9"])
    run(changed, workdir, resume=True)
    assert capsys.readouterr().out.splitlines() == [
        "mixed_float16: extending the run from 26 to 27 steps, eval_interval 12 -> 9 "
        "(config.yaml updated)"
    ]
    run(changed, workdir, resume=True)
    assert capsys.readouterr().out == ""


def test_failed_restore_hook_drops_only_closed_loop_reports():
    seen = []
    hook = functools.partial(rundir._ignore_abandoned_reads, seen.append)
    errors = [RuntimeError("Event loop is closed"), RuntimeError("other"), ValueError("bad")]
    for error in errors:
        hook(types.SimpleNamespace(exc_value=error))
    assert [u.exc_value for u in seen] == errors[1:]


def test_resume_with_missing_rows_is_an_error(finished, tmp_path):
    workdir = copy_run(finished, tmp_path)
    lines = (workdir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (workdir / "metrics.jsonl").write_text("".join(lines[:5] + lines[6:]))
    before = snapshot(workdir)
    with pytest.raises(train.RunDirError, match=r"has no rows for steps 6 \(of 1 to 24"):
        run(finished.config, workdir, resume=True)
    assert snapshot(workdir) == before


# --- The command line: one line on stderr, exit status 2, nothing touched ------------------


def _truncate_largest_file(directory):
    largest = max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[:100])


@pytest.fixture(scope="module")
def cli(finished, tmp_path_factory):
    """Runs every case of `CLI_CASES` (forked from one process that imported train.py)."""
    base = tmp_path_factory.mktemp("cli")
    (base / "bad.yaml").write_text("precision: mixed_float16\nsteps: [1, 2\n")
    kept = ("refused", "overwrite_bad_set", "corrupt", "other_shapes")
    for name in (*kept, "compare/mixed_float16"):
        shutil.copytree(finished.workdir, base / name)
    _truncate_largest_file(base / "corrupt" / "checkpoints" / "24")
    before = {name: snapshot(base / name) for name in kept}
    cases = {name: args for name, (args, _) in CLI_CASES.items()}
    (base / "cases.json").write_text(json.dumps(cases))
    out = base / "out"
    out.mkdir()
    subprocess.run(
        [sys.executable, str(ROOT / "tests" / "train_cli.py"), "cases.json", str(out)],
        cwd=base,
        env=environ_without_compilation_cache(),
        check=True,
        timeout=300,
    )

    def result(name):
        return (
            int((out / f"{name}.status").read_text()),
            (out / f"{name}.err").read_text(),
            (out / f"{name}.out").read_text(),
        )

    return base, before, result


def _set(*keys):
    return [arg for key in keys for arg in ("--set", key)]


# Every file in configs/, listed by name, whatever configs are added.
VALID_NAMES = "valid names are: " + ", ".join(
    sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
)
CLI_CASES = {
    "malformed_yaml": (
        ["--config", "bad.yaml"],
        ["config file bad.yaml is not valid YAML at line 3, column 1", "mapping of `key: value`"],
    ),
    # `fp32.yaml` is found in configs/: the error is about the override, not the file.
    "config_file_name": (
        ["--config", "fp32.yaml", *_set("steps=0")],
        ["config key `steps` must be > 0, got 0"],
    ),
    "unknown_file_name": (
        ["--config", "fp64.yaml"],
        ["config file fp64.yaml not found; " + VALID_NAMES, "(or the path of a YAML file)"],
    ),
    "missing_path": (
        ["--config", "no/such/dir/run.yaml"],
        ["config file no/such/dir/run.yaml not found; " + VALID_NAMES],
    ),
    "unknown_name": (["--config", "fp64"], ["unknown config 'fp64'; " + VALID_NAMES]),
    "misspelt_name": (
        ["--config", "mixed_flaot16"],
        ["unknown config 'mixed_flaot16'; " + VALID_NAMES, "Did you mean 'mixed_float16'?"],
    ),
    # One CPU device: the error says how to simulate four, as the sharding guide does.
    "mesh_beyond_the_devices": (
        ["--mesh", "data=4"],
        [
            "`mesh` sizes must multiply to the device count (1), got 'data=4' (product 4)",
            "On a CPU, simulate 4 devices by starting the run with "
            "XLA_FLAGS=--xla_force_host_platform_device_count=4 (set before JAX starts; see "
            "docs/guides/sharding.md).",
        ],
    ),
    "unknown_key": (
        _set("colour=red"),
        ["unknown config key `colour`; valid keys are: name, precision, loss_scale"],
    ),
    "bad_value": (_set("steps=ten"), ["config key `steps` must be int, got 'ten'"]),
    "bad_precision": (_set("precision=f17"), ["config key `precision`", "f17"]),
    "bad_fp8": (
        _set("fp8=e4m3"),
        ["config key `fp8` must be one of none, current, delayed, block, mxfp8, got 'e4m3'."],
    ),
    "set_without_value": (
        _set("steps"),
        ["--set expects KEY=VALUE, got 'steps'; valid keys are: name, precision"],
    ),
    "refused": (
        ["--workdir", "refused", *_set(*RUN)],
        [
            "refused already holds a run (checkpoint at step 24); continue it with --resume, "
            "replace it with --overwrite, or choose another --workdir."
        ],
    ),
    "overwrite_bad_set": (
        ["--workdir", "overwrite_bad_set", "--overwrite", *_set(*RUN, "steps=-3")],
        ["config key `steps` must be > 0, got -3"],
    ),
    "resume_no_checkpoint": (
        ["--workdir", "typo", "--resume"],
        ["--resume: no checkpoint in typo/checkpoints (the directory does not exist)"],
    ),
    "corrupt_checkpoint": (
        ["--workdir", "corrupt", "--resume"],
        [
            "--resume: cannot read checkpoint corrupt/checkpoints/24 (",
            "delete it to resume from step 16, or start again with --overwrite.",
        ],
    ),
    # Neither checkpoint reads as a model of another d_model: the files are not at fault, and
    # deleting the latest (the advice for a damaged one) would lose a good checkpoint.
    "resume_other_shapes": (
        ["--workdir", "other_shapes", "--resume", *_set("d_model=64")],
        [
            "--resume: cannot read checkpoint other_shapes/checkpoints/24 (",
            "; nor can the one at step 16: the config may not describe the run's model (a --set "
            "of its shape?); resume with the run's own config, or start again with --overwrite.",
        ],
    ),
    "compare_refused": (
        ["--compare", "fp32,mixed_float16", "--workdir", "compare"],
        ["compare already holds runs (mixed_float16); continue them with --resume, replace"],
    ),
    "inspect_bad_steps": (
        ["--inspect", "0,3", *_set(*RUN)],
        ["--inspect expects comma-separated steps from 1 to 24 (the config's steps), got '0,3'."],
    ),
    "inspect_with_compare": (
        ["--inspect", "--compare", "fp32,mixed_float16"],
        ["--inspect inspects one run; it does not combine with --compare."],
    ),
    "resume_and_overwrite": (
        ["--resume", "--overwrite"],
        ["argument --overwrite: not allowed with argument --resume (see --help)"],
    ),
}


@pytest.mark.parametrize("case", CLI_CASES)
def test_cli_error_is_one_line(cli, case):
    base, before, result = cli
    status, err, out = result(case)
    assert status == 2, (status, err, out)
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("train.py: error: ")
    for text in CLI_CASES[case][1]:
        assert text in err, err
    assert out == ""
    if case in before:  # nothing in a run directory was touched
        assert snapshot(base / case) == before[case]


def test_script_error_is_one_line(tmp_path):
    # The same, through `python examples/train.py` itself: a fresh interpreter and no traceback.
    (tmp_path / "bad.yaml").write_text("precision: [mixed_float16\n")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "train.py"), "--config", "bad.yaml"],
        cwd=tmp_path,
        env=environ_without_compilation_cache(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "train.py: error: config file bad.yaml is not valid YAML at line 2, column 1: expected "
        "',' or ']', but got '<stream end>'; a config is a mapping of `key: value` lines."
    ]


def test_help_lists_configs_and_keys(capsys):
    with pytest.raises(SystemExit) as excinfo:
        train.main(["--help"])
    assert excinfo.value.code == 0
    text = capsys.readouterr().out
    for name in config_lib.available():
        assert f"\n  {name} " in text
    for field in dataclasses.fields(config_lib.Config):
        assert f"{field.name}=" in text
    assert "--overwrite" in text and "--resume" in text


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("colour=red",), "unknown config key `colour`; valid keys are: name, precision"),
        (("precision=f17",), "Unknown dtype or policy name 'f17' in config key `precision`. "
         "Did you mean 'f16'? Expected a dtype name ('f16', 'float16', 'bf16', "),
        (("precision=p=f16,c=int8",), "Unknown dtype 'int8' for key 'c' in config key "
         "`precision` 'p=f16,c=int8'. Valid names are 'f16', "),
        (("precision=p=f16,x=f32",), "config key `precision` 'p=f16,x=f32' has bad part 'x=f32': "
         "keys must be one of 'p', 'params', 'c', 'compute', 'o', 'output'."),
        (("precision=",), "config key `precision` is empty; expected a dtype name"),
        (("loss_scale=sometimes",), "`loss_scale` must be one of auto, dynamic, static, none"),
        (("steps=-1",), "config key `steps` must be > 0, got -1"),
        (("steps=ten",), "config key `steps` must be int, got 'ten'"),
        (("learning_rate=fast",), "config key `learning_rate` must be float, got 'fast'"),
        (("loss_scale_factor=1",), "config key `loss_scale_factor` must be an integer >= 2"),
        (("loss_scale_init=1e40",), "config key `loss_scale_init`"),
        (("d_model=30", "num_heads=4"), "config key `d_model` (30) must be divisible"),
        (("master_weights=maybe",), "config key `master_weights` must be true or false, got"),
        (("rounding=stochastc",), "config key `rounding` must be one of nearest, stochastic, "
         "kahan, got 'stochastc'. Did you mean 'stochastic'?"),
        (("first_moment=int4",), "config key `first_moment` must be one of float32, bfloat16, "
         "int8, fp8, got 'int4'. Did you mean 'int8'?"),
        (("second_moment=fp16",), "config key `second_moment` must be one of"),
        (("fp8=curent",), "config key `fp8` must be one of none, current, delayed, block, "
         "mxfp8, got 'curent'. Did you mean 'current'?"),
        (("qat=in4",), "config key `qat` must be one of none, int8, int8_dynamic, fp8, int4, "
         "got 'in4'. Did you mean 'int4'?"),
        (("qat_start=-1",), "config key `qat_start` must be >= 0, got -1"),
        (("qat_start=100",), "config key `qat_start` (100) is the step quantization-aware "
         "training starts after; set `qat` to a recipe too"),
        (("qat=int4", "qat_start=1500"), "config key `qat_start` (1500) must be < `steps` "
         "(1500): quantization-aware training starts after it"),
        (("qat=int8", "fp8=current", "precision=mixed_bfloat16"),
         "config keys `fp8` and `qat` (fp8='current', qat='int8'): quantization-aware training "
         "runs the recipe's kernels in the forward pass; train the model without `fp8`"),
        (("precision=p=bf16,c=bf16", "rounding=stochastic"),
         "config keys `precision`, `master_weights`, `rounding` (precision='p=bf16,c=bf16', "
         "master_weights=True, rounding='stochastic'): `rounding='stochastic'` is for params "
         "updated without a master copy"),
        (("master_weights=false", "rounding=kahan"),
         "`rounding='kahan'` rounds float16 or bfloat16 params, but the policy "
         "'p=f32,c=f16,o=f32' stores params in float32"),
    ],
)  # fmt: skip
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ValueError) as excinfo:
        config_lib.load("mixed_float16", overrides)
    assert message in str(excinfo.value)
    assert "policy_name" not in str(excinfo.value)  # jaxmp.get_policy's argument, not a key


def test_config_file_errors(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("precision: mixed_float16\nbatch: 3\n")
    with pytest.raises(ValueError, match=f"config file {path}: unknown config key `batch`"):
        config_lib.load(str(path))
    path.write_text("precision: mixed_float16\nlearning_rate: 3e-3\n")  # YAML reads a string
    assert config_lib.load(str(path)).learning_rate == 0.003
    path.write_text("precision: bf16\nmaster_weights: no\n")  # YAML 1.1 reads a bool
    assert config_lib.load(str(path)).master_weights is False
    path.write_text("precision: bf16\nmaster_weights: 0\n")
    with pytest.raises(
        ValueError, match="config key `master_weights` must be true or false, got 0"
    ):
        config_lib.load(str(path))
    path.write_text("- a list\n")
    with pytest.raises(ValueError, match="must hold a mapping of `key: value` lines"):
        config_lib.load(str(path))
    with pytest.raises(ValueError, match="unknown config 'fp64'; valid names are: "):
        config_lib.load("fp64")
    assert config_lib.config_path("fp32.yaml") == config_lib.CONFIG_DIR / "fp32.yaml"
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(ValueError, match="is not a file"):
        config_lib.config_path(str(tmp_path / "dir.yaml"))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: config_lib.load("mixed_flaot16"), "Did you mean 'mixed_float16'?"),
        (lambda: config_lib.load("fp23.yaml"), "Did you mean 'fp32'?"),
        (lambda: config_lib.load("mixed_float16", ["stpes=3"]), "Did you mean 'steps'?"),
        (lambda: config_lib.from_dict({"batchsize": 3}), "Did you mean 'batch_size'?"),
    ],
    ids=["config_name", "config_file_name", "set_key", "file_key"],
)
def test_typos_get_a_did_you_mean(call, message):
    with pytest.raises(ValueError) as excinfo:
        call()
    assert str(excinfo.value).endswith(message), str(excinfo.value)


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        (("precision=bfloat16",), "mixed_float16+precision=bfloat16"),
        (("precision=p=bf16,c=bf16,o=f32", "fp8=current"),
         "mixed_float16+precision=p=bf16,c=bf16,o=f32+fp8=current"),
        (("loss_scale=none",), "mixed_float16+loss_scale=none"),
        (("qat=int4",), "mixed_float16+qat=int4"),
        (("qat=int4", "qat_start=100"), "mixed_float16+qat=int4+qat_start=100"),
        (("master_weights=false", "precision=bf16"),
         "mixed_float16+precision=bf16+master_weights=false"),
        # The same policy written another way, tuning numbers, and an explicit name: kept.
        (("precision=p=f32,c=f16,o=f32",), "mixed_float16"),
        (("loss_scale_init=1024", "steps=20"), "mixed_float16"),
        (("precision=bfloat16", "name=bf16_run"), "bf16_run"),
    ],
)  # fmt: skip
def test_a_run_whose_precision_is_overridden_is_named_after_it(overrides, name):
    """``--set precision=bfloat16`` on the default config trains bfloat16: the run is not
    named (and stored in ``runs/``) as ``mixed_float16``."""
    config = config_lib.load("mixed_float16", overrides)
    assert config.name == name
    # The name is kept when the run's own config.yaml is loaded again (as --resume does).
    reloaded = config_lib.from_dict(yaml.safe_load(config_lib.dump(config)))
    assert reloaded == config


def test_cli_run_directory_follows_the_overridden_precision(tmp_path, monkeypatch):
    seen = {}

    def fake_train(config, workdir, **kwargs):
        seen["config"], seen["workdir"] = config, pathlib.Path(workdir)
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "train_and_evaluate", fake_train)
    monkeypatch.setattr(train, "REPO_ROOT", tmp_path)
    with pytest.raises(SystemExit):
        train.main(["--set", "precision=bfloat16", "--no-progress"])
    assert seen["config"].name == "mixed_float16+precision=bfloat16"
    assert seen["config"].policy == jaxmp.get_policy("bfloat16")
    assert seen["workdir"] == tmp_path / "runs" / "mixed_float16+precision=bfloat16"


# --- The first-step check: gradients must follow the loss scale ------------------------------


@pytest.mark.slow
def test_unscaled_gradients_stop_the_run(tmp_path, monkeypatch):
    def unscaled(fun, argnums=0):  # the mistake: jax.value_and_grad of the unscaled loss
        return lambda loss_scale, *args: jax.value_and_grad(fun, argnums)(*args)

    monkeypatch.setattr(jaxmp, "value_and_grad", unscaled)
    config = tiny("mixed_float16", "steps=2")
    try:
        with pytest.raises(loss_scale_tools.LossScalingError, match="jaxmp.value_and_grad"):
            run(config, tmp_path / "run")
    finally:
        train.programs.cache_clear()  # it holds the train step built with `unscaled`
    assert not (tmp_path / "run").exists()


# --- Figures and the summary ------------------------------------------------------------------


def _data_lines(ax, labelled=False):
    """The lines of `ax` drawn from per-step data (not reference lines or a few markers)."""
    return [
        line
        for line in ax.get_lines()
        if len(line.get_xdata()) > 2 and not (labelled and line.get_label().startswith("_"))
    ]


def test_run_figure_panels_tell_something(finished):
    fig = train.run_figure(finished)
    try:
        ax_loss, ax_scale, ax_speed = fig.axes
        for ax in fig.axes:
            lines = _data_lines(ax)
            assert lines, ax.get_title()
            assert any(np.ptp(np.asarray(line.get_ydata(), float)) > 0 for line in lines)
            for line in lines:  # no flat zero line
                assert np.any(np.asarray(line.get_ydata(), float) != 0), ax.get_title()
        markers = [line for line in ax_scale.get_lines() if line.get_marker() == "x"]
        assert len(markers) == 1 and len(markers[0].get_xdata()) == finished.skipped_steps
        assert f"{finished.skipped_steps} in all" in ax_scale.get_title()
        assert all(np.asarray(line.get_ydata()).min() > 0 for line in _data_lines(ax_speed))
        assert "throughput" in ax_speed.get_title()
    finally:
        figures.pyplot().close(fig)


def _variant(result, name, precision, loss_factor, scale=None):
    history = [
        {
            **r,
            "train_loss": r["train_loss"] * loss_factor,
            "val_loss": r["val_loss"] and r["val_loss"] * loss_factor,
        }
        for r in result.history
    ]
    if scale is not None:
        history = [
            {**r, "loss_scale": scale, "skipped": False, "skipped_total": 0} for r in history
        ]
    config = dataclasses.replace(result.config, name=name, precision=precision)
    return dataclasses.replace(result, config=config, history=history)


def test_comparison_figure_separates_configs(finished):
    results = [
        _variant(finished, "fp32", "f32", 0.99, scale=1.0),
        finished,  # mixed_float16
        _variant(finished, "float16_master_weights", "p=f16,c=f16,o=f32", 1.005),
        _variant(finished, "mixed_bfloat16", "mixed_bfloat16", 1.0, scale=1.0),
    ]
    fig = train.comparison_figure(results)
    try:
        ax_loss, ax_diff, ax_scale = fig.axes
        # Every config is drawn in its own colour, line style and marker.
        diff_lines = _data_lines(ax_diff, labelled=True)
        assert len({(line.get_color(), line.get_linestyle()) for line in diff_lines}) == 3
        names = {r.config.name for r in results}
        val_markers = [line for line in ax_loss.get_lines() if line.get_label() in names]
        assert len({(line.get_color(), line.get_marker()) for line in val_markers}) == 4
        # Differences from fp32 on a scale that shows them: ~1.0%, ~1.5% and ~1.0%.
        diffs = {line.get_label(): np.asarray(line.get_ydata())[-1] for line in diff_lines}
        assert diffs["mixed_float16"] == pytest.approx(100 / 0.99 - 100, abs=0.05)
        assert diffs["float16_master_weights"] == pytest.approx(100 * 1.005 / 0.99 - 100, abs=0.05)
        low, high = ax_diff.get_ylim()
        assert high - low < 5 * max(abs(v) for v in diffs.values())
        # Equal loss-scale trajectories stay visible side by side; unscaled configs are named.
        scale_lines = _data_lines(ax_scale, labelled=True)
        assert [line.get_label() for line in scale_lines] == [
            "mixed_float16",
            "float16_master_weights",
        ]
        a, b = (np.asarray(line.get_ydata()) for line in scale_lines)
        assert np.all(a != b) and np.allclose(a, b, rtol=0.2)
        assert scale_lines[0].get_linestyle() != scale_lines[1].get_linestyle()
        assert "no loss scaling (scale 1): fp32, mixed_bfloat16" in ax_scale.get_title()
    finally:
        figures.pyplot().close(fig)


def test_signed_percent_has_no_negative_zero():
    assert train.signed_percent(-0.00001) == "+0.00%"
    assert train.signed_percent(0.0) == "+0.00%"
    assert train.signed_percent(0.01234) == "+1.23%"
    assert train.signed_percent(-0.01234) == "-1.23%"


def test_scales_print_as_powers_of_two():
    assert loss_scale_tools.describe_scale(2.0**20) == "2^20"
    assert loss_scale_tools.describe_scale(1.0) == "2^0"
    assert loss_scale_tools.describe_scale(np.float32(32768.0)) == "2^15"
    assert loss_scale_tools.describe_scale(1000.0) == "1000"


@pytest.mark.slow
def test_gradient_underflow_shows_what_loss_scaling_prevents():
    config = tiny("float16_no_loss_scale")
    dataset = train.get_dataset(config.val_fraction)
    state = train.create_train_state(config, jax.random.PRNGKey(0), vocab_size=dataset.vocab_size)
    params = jax.tree.map(lambda x: x, state.params)
    # A confident output layer makes most probabilities, and so their gradients, tiny.
    params["head"]["kernel"] = params["head"]["kernel"] * 5.0
    batch = data_lib.eval_batches(dataset.val, 1, config.batch_size, config.seq_len)[0]
    kwargs = dict(vocab_size=dataset.vocab_size)
    f32 = config_lib.load("fp32", TINY)
    assert train.logit_gradient_underflow(f32, params, batch, **kwargs) == 0.0
    unscaled = train.logit_gradient_underflow(config, params, batch, 1.0, **kwargs)
    scaled = train.logit_gradient_underflow(config, params, batch, 2.0**15, **kwargs)
    assert unscaled > 0.2 and scaled < unscaled / 5, (unscaled, scaled)
    param_unscaled = train.gradient_underflow(config, params, batch, 1.0, **kwargs)
    param_scaled = train.gradient_underflow(config, params, batch, 2.0**15, **kwargs)
    assert 0.0 < param_unscaled < unscaled and param_scaled <= param_unscaled


@pytest.mark.slow
def test_compare_writes_a_summary_and_resumes_without_training(tmp_path):
    configs = train.load_configs(["fp32", "float16_no_loss_scale"], tmp_path, TINY + ("steps=8",))
    results, table = train.compare(configs, tmp_path, progress=False)
    assert [r.config.name for r in results] == ["fp32", "float16_no_loss_scale"]
    rows = [line for line in table.splitlines() if line.startswith("| fp32") or "no_loss" in line]
    assert rows[0].split("|")[4].strip() == "+0.00%"
    assert len(rows[1].split("|")) == 13
    assert "nats/char" in table and "samples" in table
    for r in results:
        assert len(r.sample) == 80 and set(r.sample) <= set(train.get_dataset(0.1).vocab)
    assert (tmp_path / "summary.md").read_text().strip() == table
    assert (tmp_path / "compare.png").stat().st_size > 0
    assert json.loads((tmp_path / "summary.json").read_text())[0]["config"] == "fp32"
    # Again: refused; with resume, the finished runs are evaluated, not trained again.
    runs = {
        name: snapshot(tmp_path / name / "checkpoints")
        for name in ("fp32", "float16_no_loss_scale")
    }
    with pytest.raises(train.RunDirError, match="already holds runs"):
        train.compare(configs, tmp_path, progress=False)
    again, table_again = train.compare(configs, tmp_path, resume=True, progress=False)
    assert [r.final_val_loss for r in again] == [r.final_val_loss for r in results]
    assert {name: snapshot(tmp_path / name / "checkpoints") for name in runs} == runs


@pytest.mark.slow
def test_sigint_to_the_command_saves_a_consistent_run(tmp_path):
    # A real Ctrl-C to `python examples/train.py` (a long run, so it arrives mid-training).
    workdir = tmp_path / "run"
    env = dict(environ_without_compilation_cache(), PYTHONUNBUFFERED="1")
    args = [sys.executable, str(EXAMPLES / "train.py"), "--workdir", str(workdir), "--no-progress"]
    proc = subprocess.Popen(
        args + _set(*RUN, "steps=100000", "eval_interval=100000"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    for line in proc.stdout:
        if line.startswith("step "):
            proc.send_signal(signal.SIGINT)
            break
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert err == ""
    stopped = int(out.strip().splitlines()[-1].split("stopped after step ")[1].split(",")[0])
    assert train.checkpoint_steps(workdir)[-1] == stopped
    steps = list(range(1, stopped + 1))
    assert metrics_steps(workdir) == (steps, steps)
    # Resuming continues from there: every step exactly once.
    proc = subprocess.run(
        args + ["--resume"] + _set(f"steps={stopped + 3}"),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    steps = list(range(1, stopped + 4))
    assert metrics_steps(workdir) == (steps, steps)


# --- FP8 (config key `fp8`) ------------------------------------------------------------------


def forward_matmuls(config, vocab_size=64):
    """``(the FP8 matmuls, the operand dtypes of the others)`` of `config`'s eval step."""
    built = train.programs(config, vocab_size)
    state = jax.eval_shape(built.init, jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((config.batch_size, config.seq_len), jnp.int32)
    jaxpr = jax.make_jaxpr(built.eval_step)(state.params, tokens, tokens, state.fp8_state)
    in_fp8 = fp8_dots(jaxpr)
    fp8_ids = {id(e) for e in in_fp8}
    others = [
        tuple(jnp.dtype(v.aval.dtype) for v in e.invars)
        for e in all_eqns(jaxpr.jaxpr)
        if e.primitive.name == "dot_general" and id(e) not in fp8_ids
    ]
    return in_fp8, others


@pytest.mark.parametrize("fp8", list(config_lib.FP8_RECIPES))
def test_fp8_key_runs_the_linear_layers_in_fp8(fp8):
    config = tiny("mixed_bfloat16", f"fp8={fp8}", "num_layers=2")
    in_fp8, others = forward_matmuls(config)
    bf16 = jnp.dtype(jnp.bfloat16)
    # Per block: query, key, value, out, fc and proj in FP8; the attention's two products of
    # activations in bfloat16; then the head in bfloat16.
    assert len(in_fp8) + len(others) == 2 * 8 + 1
    assert len(in_fp8) == (0 if fp8 == "none" else 2 * 6)
    if fp8 != "none":
        assert others.count((bf16, bf16)) == 2 * 2 + 1
    assert ("FP8" in config.describe()) == (fp8 != "none")


def test_every_precision_starts_from_the_same_float32_init():
    """`create_train_state`: one float32 init for every config of the model, stored in the
    param dtype; the FP32 master weights of half-precision params hold it exactly."""
    names = ("fp32", "mixed_float16", "mixed_fp8_delayed", "float16_master_weights")
    states = {
        n: train.create_train_state(tiny(n), jax.random.PRNGKey(0), vocab_size=40) for n in names
    }
    reference = states["fp32"].params
    assert {x.dtype for x in jax.tree.leaves(reference)} == {jnp.dtype(jnp.float32)}
    assert_identical(states["mixed_float16"].params, reference)
    assert_identical(states["mixed_fp8_delayed"].params, reference)
    half = states["float16_master_weights"]
    assert_identical(half.params, jax.tree.map(lambda x: x.astype(jnp.float16), reference))
    is_master = lambda x: isinstance(x, jaxmp.MasterWeightsState)  # noqa: E731
    (master,) = [s for s in jax.tree.leaves(half.opt_state, is_leaf=is_master) if is_master(s)]
    assert_identical(master.master, reference)


QAT_TINY = ("d_model=128", "steps=12", "eval_interval=6", "checkpoint_interval=6", "qat_start=6")


def test_int4_qat_config_trains_what_serves(tmp_path):
    # The shipped config with tiny settings; d_model 128, so that int4's groups of 128 fit
    # every matmul. Six steps as mixed_bfloat16, then quantization-aware training.
    shipped = config_lib.load("int4_qat")
    assert (shipped.policy, shipped.loss_scale, shipped.qat) == (
        jaxmp.get_policy("mixed_bfloat16"),
        "none",
        "int4",
    )
    assert shipped.steps == config_lib.load("mixed_bfloat16").steps
    assert shipped.seed == config_lib.load("mixed_bfloat16").seed
    config = tiny("int4_qat", *QAT_TINY)
    result = run(config, tmp_path / "qat")
    losses = np.array([r["train_loss"] for r in result.history])
    assert np.all(np.isfinite(losses)) and losses[-2:].mean() < losses[:2].mean() - 0.5
    assert {x.dtype for x in jax.tree.leaves(result.state.params)} == {jnp.dtype(jnp.float32)}
    # What the run learned is what serves: its forward pass is that of jaxmp.quantized on
    # jaxmp.quantize of its params, every matmul weight in int4, bit for bit; its
    # validation loss is that model's.
    dataset = train.get_dataset(config.val_fraction)
    model = train.programs(config, dataset.vocab_size).model

    def apply(p, x):
        return model.apply({"params": p}, x)

    batches = data_lib.eval_batches(dataset.val, 2, config.batch_size, config.seq_len)
    params = result.state.params
    plan = jaxmp.quantization_plan(apply, params, batches[0][0], recipe=config.qat_recipe)
    assert sum(leaf.quantized for leaf in plan) == 7  # q, k, v, out, fc, proj, head
    q = jaxmp.quantize(apply, params, batches[0][0], recipe=config.qat_recipe)
    qat = jaxmp.quantization_aware(apply, recipe=config.qat_recipe)
    served = jax.jit(jaxmp.quantized(apply))
    losses = []
    for inputs, targets in batches:
        logits = served(q, inputs)
        trained = jax.jit(qat)(params, inputs)
        assert np.asarray(logits).tobytes() == np.asarray(trained).tobytes()
        losses.append(float(model_lib.cross_entropy(logits, targets)))
    assert result.final_val_loss == pytest.approx(np.mean(losses), rel=1e-6)


@pytest.mark.slow  # two runs
def test_a_qat_fine_tune_is_the_run_without_qat_until_qat_start(tmp_path):
    result = run(tiny("int4_qat", *QAT_TINY), tmp_path / "qat")
    plain = run(tiny("mixed_bfloat16", *QAT_TINY[:-1]), tmp_path / "plain")
    losses = [r["train_loss"] for r in result.history]
    before = [r["train_loss"] for r in plain.history]
    assert losses[:6] == before[:6] and losses[6] != before[6]


def test_qat_anneals_the_learning_rate_to_zero():
    # The fine-tune keeps mixed_bfloat16's rate up to `qat_start`, then a cosine to zero; from
    # the start, the one cosine ends at zero instead of a tenth.
    plain = train.learning_rate_schedule(config_lib.load("mixed_bfloat16"))
    config = config_lib.load("int4_qat")
    qat = train.learning_rate_schedule(config)
    start, steps = config.qat_start, config.steps
    for step in (0, 1, 25, 50, 700, start):
        assert float(qat(step)) == float(plain(step)), step
    after = np.array([float(qat(s)) for s in range(start, steps + 1, 25)])
    assert np.all(np.diff(after) < 0) and after[-1] == 0.0
    assert float(plain(steps)) == pytest.approx(0.1 * config.learning_rate)
    from_start = train.learning_rate_schedule(config_lib.load("int4_qat", ["qat_start=0"]))
    assert float(from_start(25)) == float(plain(25))  # the same warmup
    assert float(from_start(steps)) == 0.0


@pytest.mark.slow  # a training run; FP8's numerics are tested op by op in test_fp8*.py
def test_fp8_current_scaling_trains_like_bfloat16(tmp_path):
    bf16 = run(tiny("mixed_bfloat16", "steps=8"), tmp_path / "bf16")
    fp8 = run(tiny("mixed_fp8", "steps=8"), tmp_path / "fp8")
    assert fp8.state.fp8_state is None
    losses = np.array([r["train_loss"] for r in fp8.history])
    assert np.all(np.isfinite(losses)) and losses[-2:].mean() < losses[:2].mean() - 0.5
    assert {x.dtype for x in jax.tree.leaves(fp8.state.params)} == {jnp.dtype(jnp.float32)}
    # The same data, seed and steps: within 1% of the bfloat16 validation loss (the FP8 guide
    # has the longer runs).
    assert abs(fp8.final_val_loss - bf16.final_val_loss) <= 0.01 * bf16.final_val_loss
    assert fp8.final_val_loss != bf16.final_val_loss  # the matmuls did change


@pytest.mark.slow
def test_delayed_fp8_state_is_trained_checkpointed_and_resumed_bit_identically(tmp_path):
    config = tiny("mixed_fp8_delayed", "steps=8")
    straight = run(config, tmp_path / "straight")
    state = straight.state.fp8_state
    assert isinstance(state, jaxmp.Float8State) and len(state.amax_history) == 6
    for history in state.amax_history.values():  # (roles, 16): the last 8 slots filled
        assert history.shape == (3, 16)
        assert np.all(np.asarray(history)[:, -8:] > 0) and np.all(np.asarray(history)[:, :8] == 0)
    interrupted = tmp_path / "resumed"
    stopped = run(config, interrupted, stop_at=4)
    assert int(stopped.state.step) == 4 and train.checkpoint_steps(interrupted) == [4]
    resumed = run(config, interrupted, resume=True)
    assert_same_run(resumed, straight)
    assert_identical(resumed.state.fp8_state, straight.state.fp8_state)
