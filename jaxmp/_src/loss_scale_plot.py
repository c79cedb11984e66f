"""`plot_loss_scale`: the loss-scale history of a run and its skipped steps, as a figure.

Drawn from what a training loop logs anyway: the `jaxmp.loss_scale_metrics` of each step
(``loss_scale``, ``skipped_steps``, ``grads_finite``), with the loss if the entries hold one.
matplotlib is imported on use (`jaxmp._src.display.pyplot`): ``import jaxmp`` does not need it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jax.typing import ArrayLike

from jaxmp._src import display

_REQUIRED = ("loss_scale", "skipped_steps")
_OPTIONAL = ("grads_finite", "loss")


def _per_step(key: str, values: Any) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim > 1:
        raise ValueError(
            f"`metrics` must hold one value per step, got {key!r} of shape {array.shape}: of "
            f"metrics stacked over replicas or devices pass one replica's (`m[{key!r}][0]` "
            "for each step's `m`)."
        )
    return array.reshape(-1)


def _columns(metrics: Any) -> dict[str, np.ndarray]:
    """`metrics` as one array per key, over the steps."""
    if isinstance(metrics, Mapping):
        for key in _REQUIRED:
            if key not in metrics:
                raise ValueError(
                    f"`metrics` has no {key!r}: pass the dicts `jaxmp.loss_scale_metrics` "
                    f"returns (any keys of yours beside), got the keys {sorted(metrics)}."
                )
        keys = [k for k in (*_REQUIRED, *_OPTIONAL) if k in metrics]
        columns = {k: _per_step(k, metrics[k]) for k in keys}
    elif isinstance(metrics, Sequence) and not isinstance(metrics, (str, bytes)):
        if not metrics:
            raise ValueError("`metrics` must hold at least one step, got an empty sequence.")
        for i, entry in enumerate(metrics):
            if not isinstance(entry, Mapping):
                raise TypeError(
                    f"entry {i} of `metrics` must be a dict of `jaxmp.loss_scale_metrics`, "
                    f"got {entry!r}."
                )
            for key in _REQUIRED:
                if key not in entry:
                    raise ValueError(
                        f"entry {i} of `metrics` has no {key!r}: pass the dicts "
                        "`jaxmp.loss_scale_metrics` returns (any keys of yours beside), got "
                        f"the keys {sorted(entry)}."
                    )
        keys = [k for k in (*_REQUIRED, *_OPTIONAL) if all(k in m for m in metrics)]
        columns = {k: _per_step(k, np.stack([np.asarray(m[k]) for m in metrics])) for k in keys}
    else:
        raise TypeError(
            "`metrics` must be a sequence of `jaxmp.loss_scale_metrics` dicts (one per step) "
            f"or one such dict stacked over the steps, got {metrics!r}."
        )
    lengths = {len(v) for v in columns.values()}
    if len(lengths) > 1:
        shown = ", ".join(f"{k!r}: {len(v)}" for k, v in columns.items())
        raise ValueError(f"`metrics` must have as many values of each key, got {shown}.")
    if lengths == {0}:
        raise ValueError("`metrics` must hold at least one step, got none.")
    return columns


def _smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Centred moving average (no lag)."""
    half = window // 2
    sums = np.concatenate([[0.0], np.cumsum(values)])
    lo = np.maximum(np.arange(len(values)) - half, 0)
    hi = np.minimum(np.arange(len(values)) + half + 1, len(values))
    return (sums[hi] - sums[lo]) / (hi - lo)


def plot_loss_scale(
    metrics: Sequence[Mapping[str, Any]] | Mapping[str, Any],
    path: str | os.PathLike[str] | None = None,
    *,
    loss: ArrayLike | Sequence[float] | None = None,
    steps: ArrayLike | Sequence[int] | None = None,
    title: str | None = None,
) -> Any:
    """The loss scale of a run over its steps, with the skipped steps marked (a Figure).

    Made for a notebook cell after a run: the metrics are the `jaxmp.loss_scale_metrics` of
    each step, as a training loop logs them (a list of dicts, which may hold keys of the
    loop's own, such as ``"loss"``), or one dict of arrays stacked over the steps (returned by
    a `jax.lax.scan` over the steps). The scale is drawn as a step line on a log2 axis; a
    cross marks each entry at which the run's count of skipped steps grew (a step whose
    gradients were not finite, skipped and the scale backed off), or whose own step was
    skipped (``grads_finite`` False). When metrics are logged every N steps, a skip shows at
    the next logged entry. Above it, the loss, when given or held by every entry as
    ``"loss"``. Needs matplotlib (``pip install matplotlib``).

    Args:
      metrics: per-step `jaxmp.loss_scale_metrics` (``loss_scale`` and ``skipped_steps`` are
        read, and ``grads_finite`` and ``loss`` where every entry holds them), one value per
        step: of metrics stacked over replicas, one replica's.
      path: where to save the figure as PNG (nothing is saved when None).
      loss: the loss of each entry (default: the entries' ``"loss"``, if they all have one).
      steps: the step number of each entry (default: 0, 1, 2, ...).
      title: a title above the figure.

    Returns:
      The matplotlib Figure.

    Raises:
      ValueError: for metrics without ``loss_scale`` or ``skipped_steps`` (naming the
        entry), holding several values per step, or no step; `loss` or `steps` of another
        length.
      TypeError: for metrics that are neither a sequence of dicts nor a dict.
      ImportError: if matplotlib is not installed.

    Example:
      >>> import jax.numpy as jnp, optax, jaxmp
      >>> tx = jaxmp.mixed_precision(optax.sgd(0.1), "mixed_float16")
      >>> state = tx.init({"w": jnp.ones(2)})
      >>> history = [{"loss": 1.0, **jaxmp.loss_scale_metrics(state)}] * 3
      >>> fig = jaxmp.plot_loss_scale(history)
      >>> [ax.get_ylabel() for ax in fig.axes]
      ['loss', 'loss scale']
    """
    columns = _columns(metrics)
    n = len(columns["loss_scale"])
    for name, given in (("steps", steps), ("loss", loss)):
        if given is not None and np.shape(given) != (n,):
            raise ValueError(
                f"`{name}` must have one value per entry ({n}), got {np.size(given)} of shape "
                f"{np.shape(given)}."
            )
    x = np.arange(n) if steps is None else np.asarray(steps)
    losses = columns.get("loss") if loss is None else np.asarray(loss, np.float64)
    scales = columns["loss_scale"].astype(np.float64)
    counts = columns["skipped_steps"].astype(np.int64)
    skipped = np.diff(counts, prepend=counts[0]) > 0
    if "grads_finite" in columns:
        skipped |= ~columns["grads_finite"].astype(bool)

    plt = display.pyplot("jaxmp.plot_loss_scale")
    if losses is None:
        fig, ax_scale = plt.subplots(figsize=(9, 3.2))
        axes = [ax_scale]
    else:
        fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True, height_ratios=(3, 2))
        ax_loss, ax_scale = axes
        ax_loss.plot(x, losses, color="C0", alpha=0.35 if n > 60 else 1.0, lw=0.9, label="loss")
        window = n // 60
        if window > 1:
            ax_loss.plot(x, _smooth(losses, window), color="C0", lw=1.6, label="loss, smoothed")
            ax_loss.legend(fontsize=8)
        finite = losses[np.isfinite(losses)]
        if len(finite) and finite.min() > 0 and finite.max() > 10 * finite.min():
            ax_loss.set_yscale("log")
        ax_loss.set_ylabel("loss")
    ax_scale.step(x, scales, where="post", color="C2", label="loss scale")
    ax_scale.plot(x[skipped], scales[skipped], "x", color="C3", ms=7, label="skipped step")
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_ylabel("loss scale")
    ax_scale.set_xlabel("step")
    total = int(counts[-1])
    if total == 0 and np.all(scales == 1.0):
        ax_scale.set_title("loss scale: none (1 throughout, no step skipped)", fontsize=10)
    else:
        low, high = display.power_of_two(scales.min()), display.power_of_two(scales.max())
        span = low if low == high else f"{low} to {high}"
        plural = "step" if total == 1 else "steps"
        ax_scale.set_title(
            f"loss scale {span} (x: a skipped step; {total} skipped {plural} in all)",
            fontsize=10,
        )
        if skipped.any():
            ax_scale.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig
