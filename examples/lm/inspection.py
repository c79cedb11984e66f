"""``--inspect``: `jaxmp.inspect` reports of the train step at chosen steps.

The steps come from the command line (`parse_inspect_steps`); before each, the loop runs the
step's forward and backward pass under `jaxmp.inspect` (`make_inspected_grad`) and
`write_inspection` adds the report to ``inspect.json`` and draws ``inspect.png``. A resumed run
keeps the entries up to its checkpoint (`load_inspections`). The training itself is unchanged.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import jax
from loss_scale_tools import describe_scale

import jaxmp
from lm import config as config_lib
from lm import model as model_lib
from lm.figures import pyplot
from lm.steps import make_fp8_apply, make_loss_fn


def parse_inspect_steps(text: str, steps: int) -> tuple[int, ...]:
    """The steps ``--inspect`` names (``"1,100"``; ``""``: the first and the last step).

    Raises:
      ValueError: one line naming the value and the valid steps.
    """
    if not text:
        return tuple(sorted({1, steps}))
    try:
        chosen = [int(s) for s in text.split(",")]
    except ValueError:
        chosen = []
    if not chosen or not all(1 <= s <= steps for s in chosen):
        raise ValueError(
            f"--inspect expects comma-separated steps from 1 to {steps} (the config's steps), "
            f"got {text!r}."
        )
    return tuple(sorted(set(chosen)))


def make_inspected_grad(config: config_lib.Config, model: model_lib.TransformerLM):
    """The train step's loss and gradients under `jaxmp.inspect`, jitted.

    ``(loss_scale, params, inputs, targets, fp8_state) -> ((loss, grads), report)``: the
    model's forward and backward pass at the step's loss scale, as the train step computes
    them (FP8 included). The optimizer update is left out: it computes in float32, and its ops
    (a set per parameter) would make the inspected program several times slower to compile.
    """
    loss_fn = make_loss_fn(model, make_fp8_apply(config, model))
    argnums = (0, 3) if config.fp8 == "delayed" else 0
    return jax.jit(jaxmp.inspect(jaxmp.value_and_grad(loss_fn, argnums=argnums)))


def load_inspections(workdir: pathlib.Path, upto: int) -> list[dict[str, Any]]:
    """The entries of ``inspect.json`` up to step `upto` (a resumed run's checkpoint step)."""
    try:
        entries = json.loads((workdir / "inspect.json").read_text())["inspections"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [e for e in entries if isinstance(e, dict) and e.get("step", upto + 1) <= upto]


def write_inspection(
    workdir: pathlib.Path,
    config: config_lib.Config,
    step: int,
    loss_scale: float,
    report: jaxmp.Report,
    entries: list[dict[str, Any]],
) -> dict[str, Any]:
    """Adds `report` of `step` to `entries`; writes them to ``inspect.json``, its figure to
    ``inspect.png`` (each replaced atomically). Returns the new entry."""
    try:
        suggestion = report.suggest_loss_scale(loss_scale)
    except ValueError:  # no backward value to keep in range
        suggestion = None
    first = report.first_nonfinite
    entry = {
        "step": step,
        "loss_scale": loss_scale,
        "suggested_loss_scale": None if suggestion is None else suggestion.loss_scale,
        "suggestion": None if suggestion is None else str(suggestion),
        "first_nonfinite": None
        if first is None
        else f"{first.op} ({first.phase}) at {first.location} in {first.module or '(no module)'}",
        "report": report.to_dict(),
    }
    entries[:] = [e for e in entries if e["step"] != step] + [entry]
    data = {"config": config.name, "precision": str(config.policy), "inspections": entries}
    tmp = workdir / "inspect.json.tmp"
    tmp.write_text(json.dumps(data, allow_nan=False) + "\n")
    os.replace(tmp, workdir / "inspect.json")
    title = f"{config.name} ({config.policy}), step {step}, loss scale {describe_scale(loss_scale)}"
    fig = report.plot(workdir / "inspect.tmp.png", title=title)
    pyplot().close(fig)
    os.replace(workdir / "inspect.tmp.png", workdir / "inspect.png")
    return entry
