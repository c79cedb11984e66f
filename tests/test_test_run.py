"""The test run's own setup (tests/conftest.py): one persistent compilation cache per run."""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from .conftest import environ_without_compilation_cache

ROOT = pathlib.Path(__file__).resolve().parents[1]
_REPORT = "JAXMP_TEST_REPORT_CACHE_DIR"


def test_run_shares_one_compilation_cache():
    path = os.environ["JAX_COMPILATION_CACHE_DIR"]
    assert jax.config.jax_compilation_cache_dir == path and os.path.isdir(path)
    jax.jit(lambda x: x * 3.0 + 1.0)(jnp.arange(5.0)).block_until_ready()
    assert os.listdir(path)  # compiled programs are written there
    if _REPORT in os.environ:
        pathlib.Path(os.environ[_REPORT]).write_text(path)


@pytest.mark.parametrize("own_dir", [False, True], ids=["temporary", "users"])
def test_run_removes_its_cache_and_keeps_a_users(tmp_path, own_dir):
    env = environ_without_compilation_cache()
    report = tmp_path / "cache_dir.txt"
    env[_REPORT] = str(report)
    mine = tmp_path / "mine"
    if own_dir:
        mine.mkdir()
        env["JAX_COMPILATION_CACHE_DIR"] = str(mine)
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    test = f"{pathlib.Path(__file__).relative_to(ROOT)}::test_run_shares_one_compilation_cache"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", test],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    used = pathlib.Path(report.read_text())
    if own_dir:
        assert used == mine and any(mine.iterdir())  # used, and left in place
    else:
        assert used.name.startswith("jaxmp-jit-") and not used.exists()  # removed at the end
