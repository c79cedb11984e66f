"""Smoke tests of examples/train.py: a few steps of tiny configs, with numbers asserted."""

import json
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import train  # noqa: E402
from lm import config as config_lib  # noqa: E402
from lm import data as data_lib  # noqa: E402

import jaxmp  # noqa: E402

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
SHIPPED = (
    "fp32",
    "mixed_float16",
    "mixed_bfloat16",
    "float16_master_weights",
    "float16_no_loss_scale",
)


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
    """Runs of equal configs share compiled steps through a persistent cache (faster tests)."""
    options = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    saved = {name: getattr(jax.config, name) for name in options}
    jax.config.update(options[0], str(tmp_path_factory.mktemp("jax_cache")))
    jax.config.update(options[1], 0.0)
    yield
    for name, value in saved.items():
        jax.config.update(name, value)


@pytest.fixture(scope="module")
def shipped_runs(tmp_path_factory):
    """Each shipped config trained once (tiny), shared by the tests that inspect the result."""
    cache = {}

    def get(name):
        if name not in cache:
            workdir = tmp_path_factory.mktemp(name)
            cache[name] = run(tiny(name, "loss_scale_period=4"), workdir)
        return cache[name]

    return get


def tiny(name, *overrides):
    return config_lib.load(name, TINY + overrides)


def run(config, workdir, **kwargs):
    kwargs.setdefault("sample_length", 0)
    return train.train_and_evaluate(config, workdir, progress=False, verbose=False, **kwargs)


def test_shipped_configs_are_the_documented_ones():
    assert set(SHIPPED) <= set(config_lib.available())
    for name in config_lib.available():
        config = config_lib.load(name)
        assert config.name == name
        assert config.mesh == ""
    assert config_lib.load("mixed_float16").policy == jaxmp.get_policy("mixed_float16")
    assert config_lib.load("float16_master_weights").policy.param_dtype == jnp.float16
    assert config_lib.load("float16_no_loss_scale").loss_scale == "none"


@pytest.mark.parametrize("name", SHIPPED)
def test_train_shipped_config(name, shipped_runs):
    # A scale period of 4 makes the dynamic configs grow (and possibly back off) in 24 steps.
    result = shipped_runs(name)
    config = result.config
    tmp_path = result.workdir
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
        previous, finite_run = config.loss_scale_init, 0
        for scale, was_skipped in zip(scales, skipped, strict=True):
            if was_skipped:
                assert scale == max(previous / 2, config.loss_scale_min)
                finite_run = 0
            else:
                finite_run += 1
                expected = previous * 2 if finite_run == config.loss_scale_period else previous
                finite_run %= config.loss_scale_period
                assert scale == expected
            previous = scale
        assert scales.max() > config.loss_scale_init  # it grew at least once

    # Outputs: metrics (JSONL and CSV), the resolved config, the figure, a checkpoint.
    with open(tmp_path / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == list(range(1, config.steps + 1))
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0]
    assert header.split(",") == list(train.COLUMNS)
    assert config_lib.load(str(tmp_path / "config.yaml")) == config
    assert (tmp_path / "losses.png").stat().st_size > 0
    assert (tmp_path / "checkpoints" / str(config.steps)).is_dir()


def test_dynamic_scale_backs_off_and_skips(tmp_path):
    # Starting at 2^20, float16 gradients overflow: steps are skipped and the scale halves
    # until the gradients are finite again.
    config = tiny("mixed_float16", "loss_scale_init=1048576.0", "steps=12")
    result = run(config, tmp_path)
    skipped = [r["skipped"] for r in result.history]
    assert result.skipped_steps >= 2
    assert skipped[0] and not skipped[-1]
    assert result.history[0]["loss_scale"] == 2.0**19
    assert result.final_loss_scale == 2.0 ** (20 - result.skipped_steps)
    metrics = jaxmp.loss_scale_metrics(result.state.opt_state)
    assert int(metrics["skipped_steps"]) == result.skipped_steps


def test_static_loss_scale_is_constant(tmp_path):
    config = tiny("mixed_float16", "loss_scale=static", "loss_scale_init=1024.0", "steps=6")
    result = run(config, tmp_path)
    assert [r["loss_scale"] for r in result.history] == [1024.0] * 6
    assert result.skipped_steps == 0


def test_resume_is_bit_identical(tmp_path, shipped_runs):
    # Stop half-way (as if interrupted), resume from the checkpoint, finish: the same run.
    full = shipped_runs("mixed_float16")
    config = full.config
    first = run(config, tmp_path, stop_at=config.steps // 2)
    assert int(first.state.step) == config.steps // 2
    resumed = run(config, tmp_path, resume=True)
    assert int(resumed.state.step) == config.steps

    def assert_identical(a, b):
        leaves_a, tree_a = jax.tree.flatten(a)
        leaves_b, tree_b = jax.tree.flatten(b)
        assert tree_a == tree_b
        for x, y in zip(leaves_a, leaves_b, strict=True):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    assert_identical(full.state.params, resumed.state.params)
    assert_identical(full.state.opt_state, resumed.state.opt_state)
    drop_time = [{k: v for k, v in r.items() if k != "step_time_s"} for r in full.history]
    assert drop_time == [
        {k: v for k, v in r.items() if k != "step_time_s"} for r in resumed.history
    ]
    assert resumed.final_val_loss == full.final_val_loss


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


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("colour=red",), "unknown config key `colour`; valid keys are: name, precision"),
        (("precision=f17",), "config key `precision`: Unknown dtype or policy name 'f17'"),
        (("precision=p=f16,c=int8",), "config key `precision`"),
        (("loss_scale=sometimes",), "`loss_scale` must be one of auto, dynamic, static, none"),
        (("steps=-1",), "config key `steps` must be > 0, got -1"),
        (("steps=ten",), "config key `steps` must be int, got 'ten'"),
        (("learning_rate=fast",), "config key `learning_rate` must be float, got 'fast'"),
        (("loss_scale_factor=1",), "config key `loss_scale_factor` must be an integer >= 2"),
        (("loss_scale_init=1e40",), "config key `loss_scale_init`"),
        (("d_model=30", "num_heads=4"), "config key `d_model` (30) must be divisible"),
    ],
)
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ValueError) as excinfo:
        config_lib.load("mixed_float16", overrides)
    assert message in str(excinfo.value)


def test_config_file_errors(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("precision: mixed_float16\nbatch: 3\n")
    with pytest.raises(ValueError, match="unknown config key `batch`"):
        config_lib.load(str(path))
    path.write_text("precision: mixed_float16\nlearning_rate: 3e-3\n")  # YAML reads a string
    assert config_lib.load(str(path)).learning_rate == 0.003
    with pytest.raises(ValueError, match="unknown config 'fp64'; valid names are: "):
        config_lib.load("fp64")


def test_main_reports_config_errors(capsys):
    with pytest.raises(SystemExit) as excinfo:
        train.main(["--set", "precision=f17"])
    assert excinfo.value.code == 2
    assert "config key `precision`" in capsys.readouterr().err


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


def test_compare_writes_a_summary(tmp_path, capsys):
    results, table = train.compare(
        ["fp32", "float16_no_loss_scale"], tmp_path, TINY + ("steps=8",), progress=False
    )
    assert [r.config.name for r in results] == ["fp32", "float16_no_loss_scale"]
    rows = [line for line in table.splitlines() if line.startswith("| fp32") or "no_loss" in line]
    assert rows[0].split("|")[4].strip() == "+0.00%"
    assert len(rows[1].split("|")) == 12
    assert "nats/char" in table and "samples" in table
    for r in results:
        assert len(r.sample) == 80 and set(r.sample) <= set(train.get_dataset(0.1).vocab)
    assert (tmp_path / "summary.md").read_text().strip() == table
    assert (tmp_path / "compare.png").stat().st_size > 0
    assert json.loads((tmp_path / "summary.json").read_text())[0]["config"] == "fp32"
