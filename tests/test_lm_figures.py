"""examples/lm/figures.py: the smoothing the panels draw, and a run without loss scaling (the
figures of real runs are checked in tests/test_train.py)."""

import pathlib
import sys

import numpy as np

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

from lm import config as config_lib  # noqa: E402
from lm import figures  # noqa: E402
from lm.metrics import RunResult  # noqa: E402


def test_smoothing_is_centred_and_averages_what_the_edges_have():
    np.testing.assert_allclose(figures._smooth([0, 0, 3, 0, 0], window=3), [0, 1, 1, 1, 0])
    np.testing.assert_allclose(figures._smooth([2, 4, 6], window=3), [3, 4, 5])  # no lag
    np.testing.assert_allclose(figures._smooth(np.full(200, 7.0)), 7.0)
    # The default window is a 60th of the run: none below 120 steps, then 3 steps centred.
    zigzag = np.tile([0.0, 3.0], 60)
    np.testing.assert_array_equal(figures._smooth(zigzag[:118]), zigzag[:118])
    np.testing.assert_allclose(figures._smooth(zigzag)[1:-1], np.tile([1.0, 2.0], 59))


def test_rolling_median_ignores_a_spike():
    values = np.array([1.0, 1.0, 50.0, 1.0, 1.0])
    np.testing.assert_array_equal(figures._rolling_median(values, 3), np.ones(5))


def test_a_run_without_loss_scaling_says_so(tmp_path):
    history = [
        {
            "step": s,
            "train_loss": 4.0 - s / 20,
            "val_loss": 3.5 if s == 20 else None,
            "loss_scale": 1.0,
            "skipped": False,
            "skipped_total": 0,
            "step_time_s": 0.01 + s / 1000,
        }
        for s in range(1, 21)
    ]
    config = config_lib.load("fp32")
    result = RunResult(config, tmp_path, None, history, 3.5, 3.2, None, "")
    fig = figures.run_figure(result)
    try:
        ax_loss, ax_scale, ax_speed = fig.axes
        assert ax_scale.get_title() == "loss scale: none (1 throughout, no step skipped)"
        assert not [line for line in ax_scale.get_lines() if line.get_marker() == "x"]
        assert ax_loss.get_title() == "fp32 (p=f32,c=f32,o=f32): final validation loss 3.5000"
    finally:
        figures.pyplot().close(fig)
    figures.plot_run(result, tmp_path / "losses.png")
    assert (tmp_path / "losses.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
