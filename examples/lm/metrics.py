"""A run's metrics: one row per step in ``metrics.jsonl`` and ``metrics.csv``, and its result.

`MetricsWriter` appends the rows as the run goes (`COLUMNS` in the CSV); `load_history` reads
them back for a resumed run, up to its checkpoint; `RunResult` is what a run returns, with the
numbers the command line and the comparison print (skipped steps, final loss scale, median
step time, bytes per parameter).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import pathlib
import statistics
from typing import Any

import jax

import jaxmp
from lm import config as config_lib
from lm.rundir import RunDirError, show_path
from lm.steps import TrainState

COLUMNS = (
    "step",
    "train_loss",
    "val_loss",
    "loss_scale",
    "skipped",
    "skipped_total",
    "step_time_s",
)


@dataclasses.dataclass
class RunResult:
    """What one run produced; `history` holds one metrics record per step."""

    config: config_lib.Config
    workdir: pathlib.Path
    state: TrainState
    history: list[dict[str, Any]]
    final_val_loss: float
    unigram_loss: float
    peak_memory_bytes: int | None
    sample: str

    @property
    def skipped_steps(self) -> int:
        return self.history[-1]["skipped_total"] if self.history else 0

    @property
    def final_loss_scale(self) -> float:
        return float(jaxmp.get_loss_scale(self.state.opt_state).loss_scale)

    @property
    def bytes_per_param(self) -> float:
        """Bytes of the params and the optimizer state per parameter, read from the state."""
        params = jax.tree.leaves(self.state.params)
        stored = jax.tree.leaves((self.state.params, self.state.opt_state))
        return sum(x.nbytes for x in stored) / sum(x.size for x in params)

    @property
    def median_step_time(self) -> float:
        # The first step of a fresh run includes compilation-related warm-up: leave it out.
        times = [r["step_time_s"] for r in self.history[1:]] or [math.nan]
        return statistics.median(times)


def load_history(workdir: pathlib.Path, upto: int) -> list[dict[str, Any]]:
    """The metrics rows of steps 1 to `upto` (a resumed run's checkpoint step).

    Rows after `upto` (a run that crashed after its last checkpoint) are dropped: the resumed
    run computes them again, identically. A last line cut short by the crash is ignored.

    Raises:
      RunDirError: if a row before the checkpoint is missing.
    """
    path = workdir / "metrics.jsonl"
    rows: dict[int, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                if 1 <= row["step"] <= upto:
                    rows[row["step"]] = row
    missing = [step for step in range(1, upto + 1) if step not in rows]
    if missing:
        listed = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
        raise RunDirError(
            f"--resume: {show_path(path)} has no rows for steps {listed} (of 1 to {upto}, the "
            "checkpoint's step); start again with --overwrite."
        )
    return [rows[step] for step in range(1, upto + 1)]


class MetricsWriter:
    """Appends one record per step to ``metrics.jsonl`` and ``metrics.csv``.

    A resumed run starts both files again from the rows up to its checkpoint, replacing them
    atomically, so a crash at any point leaves complete files behind.
    """

    def __init__(self, workdir: pathlib.Path, history: list[dict[str, Any]]):
        jsonl, csv_path = workdir / "metrics.jsonl", workdir / "metrics.csv"
        with open(jsonl.with_suffix(".jsonl.tmp"), "w") as f:
            f.writelines(json.dumps(record) + "\n" for record in history)
        with open(csv_path.with_suffix(".csv.tmp"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(self._csv_row(record) for record in history)
        os.replace(jsonl.with_suffix(".jsonl.tmp"), jsonl)
        os.replace(csv_path.with_suffix(".csv.tmp"), csv_path)
        self._jsonl = open(jsonl, "a")
        self._csv_file = open(csv_path, "a", newline="")
        self._csv = csv.DictWriter(self._csv_file, fieldnames=COLUMNS)

    @staticmethod
    def _csv_row(record: dict[str, Any]) -> dict[str, Any]:
        return {k: ("" if record[k] is None else record[k]) for k in COLUMNS}

    def write(self, record: dict[str, Any]) -> None:
        self._jsonl.write(json.dumps(record) + "\n")
        self._csv.writerow(self._csv_row(record))

    def flush(self) -> None:
        self._jsonl.flush()
        self._csv_file.flush()

    def close(self) -> None:
        self._jsonl.close()
        self._csv_file.close()
