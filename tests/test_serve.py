"""Tests of examples/serve.py: a tiny trained run served with each recipe; the command line."""

import pathlib
import sys

import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

import serve  # noqa: E402
from lm import config as config_lib  # noqa: E402
from lm import loop  # noqa: E402

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
