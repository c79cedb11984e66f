"""examples/lm/compare.py: the configs of a comparison, their order, and its directory rules
(a whole comparison is trained in tests/test_train.py)."""

import pathlib
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

from lm import compare  # noqa: E402
from lm import config as config_lib  # noqa: E402
from lm.rundir import RunDirError  # noqa: E402


def test_configs_are_compared_in_the_documented_order():
    names = ["zeta", "mixed_float16", "alpha", "fp32", "mixed_fp8_block"]
    assert sorted(names, key=compare.compare_order) == [
        "fp32",
        "mixed_float16",
        "mixed_fp8_block",
        "alpha",  # configs not in COMPARE_ORDER come last, by name
        "zeta",
    ]


def test_a_resumed_comparison_reads_each_runs_own_config(tmp_path):
    (tmp_path / "fp32").mkdir()
    saved = config_lib.load("fp32", ["steps=7"])
    (tmp_path / "fp32" / "config.yaml").write_text(config_lib.dump(saved))
    fresh, resumed = (
        compare.load_configs(["fp32", "mixed_float16"], tmp_path, ["eval_batches=3"], resume=r)
        for r in (False, True)
    )
    assert [c.steps for c in fresh] == [config_lib.Config().steps] * 2
    assert [c.steps for c in resumed] == [7, config_lib.Config().steps]
    assert {c.eval_batches for c in fresh + resumed} == {3}  # --set applies to every run


def test_configs_of_a_comparison_need_distinct_names(tmp_path):
    with pytest.raises(ValueError, match=r"distinct names .*got fp32, fp32; do not --set name"):
        compare.load_configs(["fp32", "fp32"], tmp_path)
    with pytest.raises(ValueError, match=r"distinct names .*got x, x"):
        compare.load_configs(["fp32", "mixed_float16"], tmp_path, ["name=x"])


def test_the_directory_is_checked_before_any_training(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    configs = [config_lib.load("fp32")]
    with pytest.raises(RunDirError, match=r"^--resume: no runs of fp32 in cmp; check --workdir"):
        compare.compare(configs, tmp_path / "cmp", resume=True, progress=False)
    (tmp_path / "cmp").mkdir()
    (tmp_path / "cmp" / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match=r"^cmp already holds files; continue them with"):
        compare.compare(configs, tmp_path / "cmp", progress=False)
    (tmp_path / "cmp" / "old_run").mkdir()
    with pytest.raises(RunDirError, match=r"^cmp already holds runs \(old_run\)"):
        compare.compare(configs, tmp_path / "cmp", progress=False)
    with pytest.raises(ValueError, match="exclude each other"):
        compare.compare(configs, tmp_path / "cmp", resume=True, overwrite=True, progress=False)
    assert sorted(p.name for p in (tmp_path / "cmp").iterdir()) == ["notes.txt", "old_run"]
