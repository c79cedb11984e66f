"""The figures: ``losses.png`` of one run (`run_figure`), ``compare.png`` of several.

Every panel draws per-step data from `RunResult.history`: the losses (raw and smoothed) with
the validation loss and the unigram baseline, the loss scale with the skipped steps, the
throughput; the comparison adds each config's difference from the fp32 run. Matplotlib is
imported on first use (`pyplot`), with the non-interactive Agg backend.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

import jaxmp
from lm.metrics import RunResult

# One style per config, the same in every panel: colour, line style and marker all differ, so
# that curves lying on top of each other stay distinguishable.
STYLES = (
    ("C0", "-", "o"),
    ("C1", "--", "s"),
    ("C2", "-.", "^"),
    ("C4", ":", "D"),  # purple, not red: often on top of the orange of the second config
    ("C3", (0, (5, 1, 1, 1)), "v"),
    ("C5", (0, (1, 1)), "P"),
    ("C6", (0, (3, 1, 1, 1, 1, 1)), "X"),
)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _column(result: RunResult, key: str, dtype: Any = np.float64) -> np.ndarray:
    return np.array([r[key] for r in result.history], dtype=dtype)


def _val_curve(result: RunResult) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in result.history if r["val_loss"] is not None}


def _smooth(values: np.ndarray, window: int | None = None) -> np.ndarray:
    """Centred moving average (no lag); the window is a 60th of the run unless given."""
    values = np.asarray(values, dtype=np.float64)
    if window is None:
        window = max(len(values) // 60, 1)
    half = window // 2
    sums = np.concatenate([[0.0], np.cumsum(values)])
    lo = np.maximum(np.arange(len(values)) - half, 0)
    hi = np.minimum(np.arange(len(values)) + half + 1, len(values))
    return (sums[hi] - sums[lo]) / (hi - lo)


def _rolling_median(values: np.ndarray, window: int) -> np.ndarray:
    half = max(window // 2, 0)
    return np.array(
        [np.median(values[max(i - half, 0) : i + half + 1]) for i in range(len(values))]
    )


def _uses_loss_scaling(result: RunResult) -> bool:
    return bool(np.any(_column(result, "loss_scale") != 1.0)) or result.skipped_steps > 0


def run_figure(result: RunResult):
    """One run: loss, loss scale with its skipped steps, and throughput (a matplotlib Figure)."""
    plt = pyplot()
    fig, (ax_loss, ax_scale, ax_speed) = plt.subplots(
        3, 1, figsize=(9, 9), sharex=True, height_ratios=(3, 2, 2)
    )
    steps = _column(result, "step", np.int64)
    train = _column(result, "train_loss")
    ax_loss.plot(steps, train, color="C0", alpha=0.25, lw=0.8, label="training loss")
    ax_loss.plot(steps, _smooth(train), color="C0", lw=1.5, label="training loss, smoothed")
    val = _val_curve(result)
    if val:
        ax_loss.plot(list(val), list(val.values()), "o-", color="C1", ms=4, label="validation")
    ax_loss.axhline(result.unigram_loss, color="gray", ls="--", lw=1, label="unigram baseline")
    ax_loss.set_ylabel("loss (nats/char)")
    ax_loss.set_title(
        f"{result.config.name} ({result.config.policy}): final validation loss "
        f"{result.final_val_loss:.4f}"
    )
    ax_loss.legend(fontsize=8)

    scales = _column(result, "loss_scale")
    skipped = _column(result, "skipped", bool)
    ax_scale.step(steps, scales, where="post", color="C2", label="loss scale")
    if skipped.any():
        ax_scale.plot(steps[skipped], scales[skipped], "x", color="C3", ms=7, label="skipped step")
        ax_scale.legend(fontsize=8)
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_ylabel("loss scale")
    if _uses_loss_scaling(result):
        ax_scale.set_title(
            f"loss scale (x: step skipped, non-finite gradients; {result.skipped_steps} in all)"
        )
    else:
        ax_scale.set_title("loss scale: none (1 throughout, no step skipped)")

    chars = result.config.batch_size * result.config.seq_len
    speed = chars / np.maximum(_column(result, "step_time_s"), 1e-9) / 1000
    ax_speed.plot(steps, speed, color="C4", alpha=0.25, lw=0.8)
    window = max(len(speed) // 30, 5)
    ax_speed.plot(steps, _rolling_median(speed, window), color="C4", lw=1.5)
    ax_speed.set_ylim(bottom=0)
    ax_speed.set_ylabel("thousand chars/s")
    ax_speed.set_xlabel("step")
    ax_speed.set_title(
        f"throughput (per step, and rolling median of {window}); median "
        f"{1000 * result.median_step_time:.1f} ms/step"
    )
    fig.tight_layout()
    return fig


def comparison_figure(results: Sequence[RunResult]):
    """Several runs: losses, their differences from the fp32 run, and the loss scales."""
    plt = pyplot()
    fig, (ax_loss, ax_diff, ax_scale) = plt.subplots(
        3, 1, figsize=(9, 10), sharex=True, height_ratios=(3, 3, 2)
    )
    reference = _reference(results)
    ref_steps = _column(reference, "step", np.int64)
    ref_train = _column(reference, "train_loss")
    ref_val = _val_curve(reference)
    last_step = max(int(r.history[-1]["step"]) for r in results if r.history)
    # Validation markers of different configs side by side rather than on top of each other.
    nudge = 0.006 * last_step

    ax_loss.plot(
        ref_steps,
        _smooth(ref_train),
        color="gray",
        lw=1,
        label=f"{reference.config.name} training loss, smoothed",
    )
    ax_loss.axhline(results[0].unigram_loss, color="gray", ls="--", lw=1, label="unigram baseline")
    for i, result in enumerate(results):
        color, linestyle, marker = STYLES[i % len(STYLES)]
        offset = (i - (len(results) - 1) / 2) * nudge
        val = _val_curve(result)
        if val:
            ax_loss.plot(
                np.array(list(val)) + offset,
                list(val.values()),
                marker=marker,
                ls="none",
                color=color,
                ms=5,
                label=result.config.name,
            )
        if result is reference:
            continue
        steps = _column(result, "step", np.int64)
        common = np.intersect1d(steps, ref_steps)
        if len(common):
            mine = _column(result, "train_loss")[np.searchsorted(steps, common)]
            theirs = ref_train[np.searchsorted(ref_steps, common)]
            diff = _smooth(100 * (mine / theirs - 1))
            ax_diff.plot(common, diff, color=color, ls=linestyle, lw=1.5, label=result.config.name)
        both = [s for s in val if s in ref_val]
        if both:
            ax_diff.plot(
                both,
                [100 * (val[s] / ref_val[s] - 1) for s in both],
                marker=marker,
                ls="none",
                color=color,
                ms=6,
                mec="black",
                mew=0.5,
            )
    ax_loss.set_ylabel("loss (nats/char)")
    ax_loss.set_title(
        f"validation loss (markers); training loss of {reference.config.name} (line, smoothed)",
        fontsize=10,
    )
    ax_loss.legend(fontsize=8, ncol=2)
    ax_diff.axhline(0.0, color="gray", lw=1)
    ax_diff.set_ylabel(f"% vs {reference.config.name}")
    ax_diff.set_title(
        f"difference from {reference.config.name} (%): training loss on the same batches "
        "(lines, smoothed), validation loss (markers)",
        fontsize=10,
    )
    if ax_diff.get_legend_handles_labels()[0]:
        ax_diff.legend(fontsize=8, ncol=2)

    scaled = [r for r in results if _uses_loss_scaling(r)]
    for k, result in enumerate(scaled):
        color, linestyle, marker = STYLES[results.index(result) % len(STYLES)]
        # Equal trajectories (mixed_float16 and float16 master weights often are) would hide
        # each other: nudge each by a fraction of an octave.
        nudge_octaves = 0.08 * (k - (len(scaled) - 1) / 2)
        steps = _column(result, "step", np.int64)
        scales = _column(result, "loss_scale") * 2.0**nudge_octaves
        skipped = _column(result, "skipped", bool)
        ax_scale.step(
            steps, scales, where="post", color=color, ls=linestyle, lw=1.5, label=result.config.name
        )
        if skipped.any():
            ax_scale.plot(steps[skipped], scales[skipped], marker="x", ls="none", color=color, ms=7)
    unscaled = [r.config.name for r in results if not _uses_loss_scaling(r)]
    title = "loss scale (x: skipped step"
    if len(scaled) > 1:
        title += "; equal lines nudged apart, by up to 0.1 octave"
    title += ")"
    if unscaled:
        title += f"\nno loss scaling (scale 1): {', '.join(unscaled)}"
    ax_scale.set_title(title, fontsize=10)
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_ylabel("loss scale")
    ax_scale.set_xlabel("step")
    if scaled:
        ax_scale.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_run(result: RunResult, path: pathlib.Path) -> None:
    """Saves `run_figure(result)` to `path`."""
    _save(run_figure(result), path)


def plot_comparison(results: Sequence[RunResult], path: pathlib.Path) -> None:
    """Saves `comparison_figure(results)` to `path`."""
    _save(comparison_figure(results), path)


def _save(fig, path: pathlib.Path) -> None:
    fig.savefig(path, dpi=100)
    pyplot().close(fig)


def _reference(results: Sequence[RunResult]) -> RunResult:
    """The fp32 run if there is one, else the first."""
    f32 = jaxmp.get_policy("f32")
    return next((r for r in results if r.config.policy == f32), results[0])
