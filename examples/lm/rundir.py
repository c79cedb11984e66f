"""The run directory: nothing in it is replaced without ``--overwrite``; its checkpoints.

A new run needs an empty (or missing) directory, ``--resume`` a readable checkpoint in it, and
``--overwrite`` replaces only the run's own outputs (`RUN_OUTPUTS`); `check_workdir` decides
before anything is written, and every refusal is a `RunDirError` whose one-line message says
what to do. Checkpoints are orbax's, in ``checkpoints/``: `checkpoint_steps` lists them and
`restore_checkpoint` reads the latest, turning one it cannot read into an `UnreadableCheckpoint`
that names it and the earlier checkpoint to fall back to (if that one can be read).
"""

from __future__ import annotations

import functools
import logging
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


class UnreadableCheckpoint(RunDirError):
    """A checkpoint that cannot be read as the state asked for.

    The message is ``--resume``'s; a command of its own words one from the attributes.

    Attributes:
      path: the checkpoint's directory, as messages show it.
      reason: the error, in one short line.
      earlier: the steps of the run's earlier checkpoints, latest first.
      fallback: the latest of `earlier` that can be read, or None. When none can while there
        are some, the files are not the cause (a config that does not describe the run's
        model, say): deleting the checkpoint would not help.
    """

    def __init__(self, path: str, reason: str, earlier: Sequence[int], fallback: int | None):
        self.path, self.reason = path, reason
        self.earlier, self.fallback = tuple(earlier), fallback
        if fallback is not None:
            advice = f"delete it to resume from step {fallback}, or start again with --overwrite."
        elif earlier:
            advice = (
                f"nor can the one at step {self.earlier[0]}: the config may not describe the "
                "run's model (a --set of its shape?); resume with the run's own config, or "
                "start again with --overwrite."
            )
        else:
            advice = "there is no earlier one: start again with --overwrite."
        super().__init__(f"--resume: cannot read checkpoint {path} ({reason}); {advice}")


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
    ckpt_dir = pathlib.Path(workdir).resolve() / "checkpoints"  # orbax takes absolute paths
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

    `workdir` may be relative (orbax is given it absolute).

    Raises:
      UnreadableCheckpoint: if the checkpoint cannot be read (truncated or corrupt files, or
        arrays of other shapes than `state`'s), naming it and whether an earlier one can be.
    """
    workdir = pathlib.Path(workdir).resolve()
    step = steps[-1]
    previous_hook = sys.unraisablehook
    sys.unraisablehook = functools.partial(_ignore_abandoned_reads, previous_hook)
    try:
        restored = _read(workdir, step, state)
    except Exception as e:  # orbax and tensorstore raise plain Exceptions for damaged files
        # Reads still in flight finish after this error is reported: their reports stay silenced.
        warnings.filterwarnings("ignore", r"coroutine '.*' was never awaited", RuntimeWarning)
        earlier = sorted(steps[:-1], reverse=True)
        raise UnreadableCheckpoint(
            show_path(workdir / "checkpoints" / str(step)),
            f"{type(e).__name__}: {_short_reason(e)}",
            earlier,
            next((s for s in earlier if _readable(workdir, s, state)), None),
        ) from None
    sys.unraisablehook = previous_hook
    return restored


def _read(workdir: pathlib.Path, step: int, state: Any) -> Any:
    options = ocp.CheckpointManagerOptions(create=False)
    with ocp.CheckpointManager(workdir / "checkpoints", options=options) as manager:
        return manager.restore(step, args=ocp.args.StandardRestore(state))


def _readable(workdir: pathlib.Path, step: int, state: Any) -> bool:
    try:
        _read(workdir, step, state)
    except Exception:  # as in `restore_checkpoint`
        return False
    return True


def silence_abandoned_reads() -> None:
    """Before a command exits on an `UnreadableCheckpoint`: orbax's failed reads stay behind
    (asyncio tasks, coroutines), and at exit Python would print each as a traceback after the
    one-line error."""
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    sys.unraisablehook = lambda unraisable: None


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
