"""Runs ``examples/train.py ARGS`` for many argument lists, each in a process of its own.

Usage: ``python tests/train_cli.py CASES_JSON OUT_DIR``, where CASES_JSON maps case names to
argument lists. Importing train.py (JAX, Flax, orbax) takes seconds of CPU per process, so this
process imports it once and forks one child per case. Each child runs ``train.main(ARGS)``
exactly as ``python examples/train.py ARGS`` would, with stdout and stderr redirected to
``OUT_DIR/NAME.out`` and ``OUT_DIR/NAME.err``, and leaves through normal interpreter shutdown;
its exit status goes to ``OUT_DIR/NAME.status``. Nothing here has started JAX's runtime before
the fork (that would make forking unsafe).
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import sys

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import train  # noqa: E402


def fork_cases(cases: dict[str, list[str]], out: pathlib.Path) -> tuple[str, list[str]] | None:
    """Forks a child per case; returns ``(name, args)`` in a child, None in the parent."""
    gc.freeze()  # The children's garbage collector then leaves the shared pages alone.
    children = {}
    for name, args in cases.items():
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            for fd, suffix in ((1, "out"), (2, "err")):
                target = os.open(out / f"{name}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(target, fd)
                os.close(target)
            return name, args
        children[pid] = name
    for pid, name in children.items():
        _, status = os.waitpid(pid, 0)
        (out / f"{name}.status").write_text(str(os.waitstatus_to_exitcode(status)))
    return None


if __name__ == "__main__":
    case = fork_cases(json.loads(pathlib.Path(sys.argv[1]).read_text()), pathlib.Path(sys.argv[2]))
    if case is not None:
        train.main(case[1])
