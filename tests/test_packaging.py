"""`python -m build` makes an sdist and a wheel that pass `twine check` and install and import.

The wheel is built from the sdist (what `python -m build` does), so both are checked. The
wheel is installed with `--no-deps` into a fresh virtual environment that sees this
environment's site-packages (jax, optax, numpy) behind its own, so the check is quick and
needs no package index.
"""

import os
import pathlib
import site
import subprocess
import sys
import tarfile
import tomllib
import venv
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
VERSION = PROJECT["version"]


def _run(*args, **kwargs) -> str:
    proc = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=600, **kwargs
    )
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("dist")
    # --no-isolation: build with this environment's setuptools (the test extra has >=77).
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", out, ROOT)
    return out


def _one(dist: pathlib.Path, pattern: str) -> pathlib.Path:
    (path,) = dist.glob(pattern)
    return path


def test_artifacts_are_named_by_the_version(dist):
    assert _one(dist, "*.whl").name == f"jaxmp-{VERSION}-py3-none-any.whl"
    assert _one(dist, "*.tar.gz").name == f"jaxmp-{VERSION}.tar.gz"


def test_twine_check_passes(dist):
    out = _run(sys.executable, "-m", "twine", "check", "--strict", *sorted(dist.iterdir()))
    assert out.count("PASSED") == 2, out


def test_wheel_holds_the_package_license_and_typing_marker(dist):
    with zipfile.ZipFile(_one(dist, "*.whl")) as whl:
        names = set(whl.namelist())
        metadata = whl.read(f"jaxmp-{VERSION}.dist-info/METADATA").decode()
    assert {"jaxmp/__init__.py", "jaxmp/py.typed", "jaxmp/linen.py", "jaxmp/nnx.py"} <= names
    assert f"jaxmp-{VERSION}.dist-info/licenses/LICENSE" in names
    assert not [n for n in names if n.startswith(("tests/", "examples/", "docs/"))]
    assert "License-Expression: Apache-2.0" in metadata
    assert f"Requires-Python: {PROJECT['requires-python']}" in metadata
    assert "Description-Content-Type: text/markdown" in metadata


def test_sdist_holds_the_sources_and_the_license(dist):
    with tarfile.open(_one(dist, "*.tar.gz")) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    assert {"pyproject.toml", "README.md", "LICENSE", "jaxmp/py.typed"} <= names
    assert "jaxmp/_src/loss_scaling.py" in names
    # The tests need the repository (examples/, configs/, docs/): they run from a clone.
    assert not [n for n in names if n.startswith(("tests/", "examples/", "docs/"))]


def test_wheel_installs_into_a_fresh_venv_and_imports(dist, tmp_path):
    env = tmp_path / "venv"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    wheel = _one(dist, "*.whl")
    pip = (sys.executable, "-m", "pip", "--python", python)
    _run(*pip, "install", "--no-deps", "--no-index", wheel)
    # The dependencies come from this environment, after the fresh one's own site-packages.
    where = "import site; print(site.getsitepackages()[0])"
    env_site = pathlib.Path(_run(python, "-I", "-c", where).strip())
    (env_site / "outer_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    check = f"""
import importlib.metadata, importlib.resources, pathlib, sys
import jaxmp
assert pathlib.Path(jaxmp.__file__).is_relative_to({str(env)!r}), jaxmp.__file__
assert jaxmp.__version__ == importlib.metadata.version("jaxmp") == {VERSION!r}
assert importlib.resources.files("jaxmp").joinpath("py.typed").is_file()
assert "flax" not in sys.modules, "import jaxmp must not import flax"
import optax, jax.numpy as jnp
tx = jaxmp.mixed_precision(optax.adam(1e-3), "mixed_float16")
assert float(jaxmp.get_loss_scale(tx.init({{"w": jnp.ones(2)}})).loss_scale) == 2.0**15
print("ok", jaxmp.__version__)
"""
    # -I: neither the working directory nor PYTHONPATH can put the source tree first.
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = _run(python, "-I", "-c", check, cwd=tmp_path, env=environ)
    assert out.strip() == f"ok {VERSION}"
