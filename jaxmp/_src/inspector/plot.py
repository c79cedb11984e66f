"""The figure of `jaxmp.Report.plot`: per-module exponent histograms against format ranges.

matplotlib is imported here, on use: it is not a dependency of jaxmp (it comes with the
``examples`` extra). The figure depends on the report, never the other way: this module
registers `plot` with `jaxmp._src.inspector.report` when it is imported (by the package's
``__init__``), and `Report.plot` calls it.
"""

from __future__ import annotations

import math
import os
from typing import Any

import ml_dtypes
import numpy as np

from jaxmp._src import display
from jaxmp._src.inspector import report as report_lib
from jaxmp._src.inspector import stats as stats_lib

_PHASES = (
    ("forward", "forward values (activations)", "C0"),
    ("backward", "backward values (gradients)", "C1"),
)


def _pyplot() -> Any:
    return display.pyplot("jaxmp.Report.plot")


def _format_range(fmt: str) -> tuple[float, float, float]:
    """log2 of ``(smallest subnormal, smallest normal, largest finite)`` of `fmt`."""
    info = ml_dtypes.finfo(stats_lib._format_dtype(fmt))
    return (
        math.log2(float(info.smallest_subnormal)),
        math.log2(float(info.smallest_normal)),
        math.log2(float(info.max)),
    )


def _short_module(name: str, width: int = 40) -> str:
    """`name`, its middle elided to fit `width`: the model's name and the op's scope stay."""
    name = name or "(no module)"
    if len(name) <= width:
        return name
    head = width // 3
    return name[:head] + "..." + name[-(width - head - 3) :]


def plot(
    report: report_lib.Report,
    path: str | os.PathLike[str] | None = None,
    *,
    max_modules: int = 32,
    title: str | None = None,
) -> Any:
    """See `jaxmp.Report.plot`."""
    if not isinstance(max_modules, int) or max_modules < 1:
        raise ValueError(f"`max_modules` must be a positive int, got {max_modules!r}.")
    plt = _pyplot()
    rows = [r for r in report.rows if not r.library]  # jaxmp's own ops are not the model's
    fmt0 = report.formats[0]
    # Modules in program order of their first row; the ones holding the most values kept.
    order: dict[str, int] = {}
    totals: dict[str, int] = {}
    for r in rows:
        order.setdefault(r.module, len(order))
        totals[r.module] = totals.get(r.module, 0) + r.nonzero
    kept = sorted(order, key=lambda m: -totals[m])[:max_modules]
    pooled = len(order) > len(kept)
    modules = sorted(kept, key=order.__getitem__) + (["(other modules)"] if pooled else [])

    def group(module: str) -> str:
        return module if module in kept else "(other modules)"

    n_bins = stats_lib.EXPONENT_MAX - stats_lib.EXPONENT_MIN + 1
    hist = {(m, p): np.zeros(n_bins, np.int64) for m in modules for p, _, _ in _PHASES}
    flushed = {(m, p): 0 for m in modules for p, _, _ in _PHASES}
    over = {(m, p): 0 for m in modules for p, _, _ in _PHASES}
    for r in rows:
        key = (group(r.module), r.phase)
        hist[key] += r.histogram
        flushed[key] += round(r.flush[fmt0] * r.nonzero)
        over[key] += round(r.overflow[fmt0] * r.nonzero)
    phases = [p for p in _PHASES if any(hist[(m, p[0])].sum() for m in modules)] or [_PHASES[0]]

    # The x range: where the values are, and at least the first format's range.
    used = np.flatnonzero(np.sum(list(hist.values()), axis=0)) if hist else np.array([], int)
    sub0, _, max0 = _format_range(fmt0)
    lo = min([sub0 - 3] + ([stats_lib.EXPONENT_MIN + int(used[0]) - 2] if len(used) else []))
    hi = max([max0 + 3] + ([stats_lib.EXPONENT_MIN + int(used[-1]) + 3] if len(used) else []))
    lo, hi = max(lo, stats_lib.EXPONENT_MIN - 1), min(hi, stats_lib.EXPONENT_MAX + 2)

    n = len(modules)
    fig = plt.figure(figsize=(6.2 * len(phases) + 2.6, 2.6 + 0.42 * n + 0.3 * len(report.formats)))
    grid = fig.add_gridspec(
        2,
        len(phases),
        height_ratios=(0.3 * len(report.formats) + 0.4, 0.42 * n + 0.6),
        hspace=0.08,
        wspace=0.05,
    )
    edges = np.arange(stats_lib.EXPONENT_MIN, stats_lib.EXPONENT_MAX + 2)
    for col, (phase, label, color) in enumerate(phases):
        ax_fmt = fig.add_subplot(grid[0, col])
        ax = fig.add_subplot(grid[1, col], sharex=ax_fmt)
        # Format ranges: subnormal (light) and normal (dark) bars, one per format.
        for k, fmt in enumerate(report.formats):
            sub, normal, top = _format_range(fmt)
            y = len(report.formats) - 1 - k
            ax_fmt.barh(y, normal - sub, left=sub, height=0.6, color="C2", alpha=0.3)
            ax_fmt.barh(y, top - normal, left=normal, height=0.6, color="C2", alpha=0.8)
            ax_fmt.text(
                max(sub, lo) + 0.3, y, f"{fmt}", va="center", ha="left", fontsize=8, color="black"
            )
        ax_fmt.set_yticks([])
        ax_fmt.set_ylim(-0.6, len(report.formats) - 0.4)
        ax_fmt.tick_params(labelbottom=False)
        ax_fmt.set_title(
            f"{label}\nformat ranges (light: subnormal, dark: normal)", fontsize=9, loc="left"
        )
        # Where the first format flushes to zero and overflows.
        for target in (ax, ax_fmt):
            target.axvspan(lo, sub0 - 1, color="C3", alpha=0.08, lw=0)
            target.axvspan(max0, hi, color="C3", alpha=0.08, lw=0)
            target.axvline(sub0 - 1, color="C3", lw=0.8, ls="--")
            target.axvline(max0, color="C3", lw=0.8, ls="--")
        for i, module in enumerate(modules):
            base = n - 1 - i
            counts = hist[(module, phase)]
            total = counts.sum()
            if total:
                # Log counts: the tails a format loses (a few values in a million) stay visible.
                heights = np.log1p(counts) / np.log1p(counts.max()) * 0.85
                ax.stairs(heights + base, edges, baseline=base, fill=True, color=color, alpha=0.6)
                ax.stairs(heights + base, edges, baseline=base, color=color, lw=0.8)
            ax.axhline(base, color="gray", lw=0.4)
            notes = []
            nz = max(int(total), 1)
            if flushed[(module, phase)]:
                notes.append(f"{100 * flushed[(module, phase)] / nz:.2g}% flush")
            if over[(module, phase)]:
                notes.append(f"{100 * over[(module, phase)] / nz:.2g}% overflow")
            if notes:
                # At the left edge, where values are rare, on a white box over the histogram.
                ax.text(
                    lo + 0.5,
                    base + 0.55,
                    f"{_short_dtype(fmt0)}: " + ", ".join(notes),
                    ha="left",
                    va="center",
                    fontsize=7,
                    color="C3",
                    bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1},
                )
        ax.set_ylim(-0.2, n)
        ax.set_yticks([n - 1 - i + 0.35 for i in range(n)])
        ax.set_yticklabels([_short_module(m) for m in modules] if col == 0 else [], fontsize=8)
        if col:
            ax.tick_params(left=False)
        ax.set_xlim(lo, hi)
        ax.set_xlabel("log2 |x|  (binary exponent of each nonzero value)")
    head = title + "\n" if title else ""
    kind = "float32 reference values" if report.reference else "values"
    fig.suptitle(
        f"{head}Exponents of the {kind} of each module's ops (height: log of the count, "
        f"scaled to each histogram's peak)\nred: beyond {fmt0}'s range (rounds to zero below "
        f"2^{sub0 - 1:g}, overflows above 2^{max0:.3g}); red text: % of the module's values "
        f"that would flush to zero or overflow in {fmt0}",
        fontsize=10,
    )
    fig.subplots_adjust(
        left=0.2,
        right=0.98,
        top=1 - 1.35 / fig.get_figheight(),
        bottom=0.45 / fig.get_figheight() + 0.02,
    )
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def _short_dtype(name: str) -> str:
    return stats_lib._short(name)


report_lib.register_figure(plot)
