"""The run directory: nothing in it is replaced without ``--overwrite``; its checkpoints.

A new run needs an empty (or missing) directory, ``--resume`` a readable checkpoint in it, and
``--overwrite`` replaces only the run's own outputs (`RUN_OUTPUTS`); `check_workdir` decides
before anything is written, and every refusal is a `RunDirError` whose one-line message says
what to do. Checkpoints are orbax's, in ``checkpoints/``: `checkpoint_steps` lists them and
`restore_checkpoint` reads the latest, turning a damaged one into a `RunDirError` that names it
and the checkpoint to fall back to.
"""

from __future__ import annotations

import functools
import pathlib
import shutil
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import orbax.checkpoint as ocp

from lm.steps import TrainState

RUN_OUTPUTS = (
    "config.yaml",
    "metrics.jsonl",
    "metrics.csv",
    "losses.png",
    "checkpoints",
    "inspect.json",
    "inspect.png",
)


class RunDirError(ValueError):
    """The run directory does not fit the request; the one-line message says what to do.

    A new run into a directory that is not empty, ``--resume`` without a checkpoint, or a
    checkpoint that cannot be read. Raised before anything in the directory is changed.
    """


def show_path(path: str | pathlib.Path) -> str:
    """`path` relative to the working directory when it is inside it, for messages."""
    path = pathlib.Path(path).resolve()
    try:
        return str(path.relative_to(pathlib.Path.cwd().resolve())) or "."
    except ValueError:
        return str(path)


def is_empty(path: pathlib.Path) -> bool:
    return not path.exists() or (path.is_dir() and not any(path.iterdir()))


def checkpoint_steps(workdir: pathlib.Path) -> list[int]:
    """The steps of the complete checkpoints in ``workdir/checkpoints``, ascending."""
    ckpt_dir = workdir / "checkpoints"
    if not ckpt_dir.is_dir():
        return []
    options = ocp.CheckpointManagerOptions(create=False)
    with ocp.CheckpointManager(ckpt_dir, options=options) as manager:
        return sorted(manager.all_steps())


def _describe_run(workdir: pathlib.Path) -> str:
    steps = checkpoint_steps(workdir)
    if steps:
        return f"a run (checkpoint at step {steps[-1]})"
    if any((workdir / name).exists() for name in RUN_OUTPUTS):
        return "a run (no checkpoint)"
    return "files"


def check_workdir(workdir: pathlib.Path, *, resume: bool, overwrite: bool) -> list[int]:
    """Checks that `workdir` fits the request; returns its checkpoint steps.

    A new run needs an empty (or missing) directory, ``resume`` needs a checkpoint in it, and
    ``overwrite`` accepts anything (it replaces only the run's own outputs, `RUN_OUTPUTS`).

    Raises:
      RunDirError: naming the directory and the options that apply.
    """
    if resume and overwrite:
        raise ValueError("`resume` and `overwrite` exclude each other.")
    where = show_path(workdir)
    if workdir.exists() and not workdir.is_dir():
        raise RunDirError(f"--workdir {where} is a file; choose a directory.")
    if resume:
        steps = checkpoint_steps(workdir)
        if not steps:
            found = "the directory does not exist" if not workdir.exists() else "none found"
            raise RunDirError(
                f"--resume: no checkpoint in {where}/checkpoints ({found}); check --workdir, "
                "or start a new run without --resume."
            )
        return steps
    if overwrite or is_empty(workdir):
        return []
    raise RunDirError(
        f"{where} already holds {_describe_run(workdir)}; continue it with --resume, replace "
        "it with --overwrite, or choose another --workdir."
    )


def remove_run_outputs(workdir: pathlib.Path, names: Sequence[str] = RUN_OUTPUTS) -> None:
    """Deletes what a run wrote, or a comparison with `lm.compare.COMPARE_OUTPUTS`.

    Other files in `workdir` stay.
    """
    for name in names:
        path = workdir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def _short_reason(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    text = text.split(" See full TensorStore details")[0]
    return text if len(text) <= 160 else text[:157] + "..."


def restore_checkpoint(workdir: pathlib.Path, steps: Sequence[int], state: Any) -> TrainState:
    """Restores the latest of `steps` as `state` (arrays or `jax.ShapeDtypeStruct`s) lays out.

    Raises:
      RunDirError: if the checkpoint cannot be read (truncated or corrupt files), naming it.
    """
    step = steps[-1]
    options = ocp.CheckpointManagerOptions(create=False)
    previous_hook = sys.unraisablehook
    sys.unraisablehook = functools.partial(_ignore_abandoned_reads, previous_hook)
    try:
        with ocp.CheckpointManager(workdir / "checkpoints", options=options) as manager:
            restored = manager.restore(step, args=ocp.args.StandardRestore(state))
    except Exception as e:  # orbax and tensorstore raise plain Exceptions for damaged files
        # Reads still in flight finish after this error is reported: their reports stay silenced.
        warnings.filterwarnings("ignore", r"coroutine '.*' was never awaited", RuntimeWarning)
        path = show_path(workdir / "checkpoints" / str(step))
        earlier = (
            f"delete it to resume from step {steps[-2]}, or"
            if len(steps) > 1
            else "there is no earlier one:"
        )
        raise RunDirError(
            f"--resume: cannot read checkpoint {path} ({type(e).__name__}: {_short_reason(e)}); "
            f"{earlier} start again with --overwrite."
        ) from None
    sys.unraisablehook = previous_hook
    return restored


def _ignore_abandoned_reads(previous: Any, unraisable: Any) -> None:
    """An unraisable-exception hook that drops the reports of a failed restore's leftover reads.

    When one read of a damaged checkpoint fails, orbax stops waiting and closes its event loop;
    tensorstore's threads then finish the other reads and try to post each result to that closed
    loop, and Python reports every attempt as a `RuntimeError: Event loop is closed` traceback.
    Those results are unwanted anyway (the coroutines that would have taken them are never awaited,
    a warning the caller silences too). Any other unraisable exception goes to `previous`.
    """
    error = unraisable.exc_value
    if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
        previous(unraisable)
