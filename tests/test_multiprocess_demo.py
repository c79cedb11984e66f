"""The two-process demo as the README runs it: both processes print to one shared stdout."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile

import pytest

from tests.test_distributed import TIMEOUT_S, _env, _free_port

WORKER = pathlib.Path(__file__).resolve().parent / "distributed" / "multiprocess_worker.py"


@pytest.mark.slow
def test_two_processes_print_one_json_line_each():
    port = _free_port()
    # `python worker 0 PORT 1 & python worker 1 PORT 1`, one stdout for both (a file: nothing
    # waits on a full pipe). In a session of its own, so that a timeout kills both workers,
    # not only the shell.
    command = f"{sys.executable} {WORKER} 0 {port} 1 & {sys.executable} {WORKER} 1 {port} 1; wait"
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            ["sh", "-c", command],
            env=_env(4, cache=False),
            stdout=out,
            stderr=err,
            text=True,
            start_new_session=True,
        )
        timed_out = False
        try:
            proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    assert not timed_out, f"both workers killed after {TIMEOUT_S} s:\n{stderr[-3000:]}"
    assert proc.returncode == 0, stderr[-3000:]
    objects = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert sorted(o["process_index"] for o in objects) == [0, 1]
    assert stdout.count("{") == 2  # no object split over, or sharing, a line
