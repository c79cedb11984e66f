"""The two-process demo as the README runs it: both processes print to one shared stdout."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

WORKER = pathlib.Path(__file__).resolve().parent / "distributed" / "multiprocess_worker.py"


@pytest.mark.slow
def test_two_processes_print_one_json_line_each():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu"
    )
    # `python worker 0 PORT 1 & python worker 1 PORT 1`, one stdout for both.
    command = f"{sys.executable} {WORKER} 0 {port} 1 & {sys.executable} {WORKER} 1 {port} 1; wait"
    proc = subprocess.run(
        ["sh", "-c", command], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    objects = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted(o["process_index"] for o in objects) == [0, 1]
    assert proc.stdout.count("{") == 2  # no object split over, or sharing, a line
