"""Runs every jaxmp benchmark, one after the other, each in its own process.

`update_cost.py` and `train_step.py` always; `gpu_benchmark.py` too when JAX sees a GPU (or with
``--gpu``). Extra arguments after ``--`` go to `train_step.py`. Run from the repository root::

    PYTHONPATH=. python benchmarks/run_all.py
    PYTHONPATH=. python benchmarks/run_all.py -- --quick
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _has_gpu() -> bool:
    probe = "import jax; print(jax.default_backend())"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return out.stdout.strip() in ("gpu", "cuda", "rocm")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpu", action="store_true", help="run gpu_benchmark.py as well")
    parser.add_argument("rest", nargs="*", help="arguments for train_step.py (after --)")
    args = parser.parse_args()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
    }
    scripts = [["update_cost.py"], ["train_step.py", *args.rest]]
    if args.gpu or _has_gpu():
        scripts.append(["gpu_benchmark.py"])
    status = 0
    for script, *script_args in scripts:
        print(f"\n## {script} {' '.join(script_args)}\n", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, os.path.join(HERE, script), *script_args], env=env)
        print(f"\n({script}: exit {proc.returncode}, {time.perf_counter() - t0:.0f} s)", flush=True)
        status = status or proc.returncode
    return status


if __name__ == "__main__":
    sys.exit(main())
