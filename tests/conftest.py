"""Shared test configuration: dtype lists, the one tolerance table, jaxpr walkers, and one
persistent compilation cache for the whole run."""

import os
import pathlib
import shutil
import tempfile

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest

from jaxmp._src import compat

F16, BF16, F32 = jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
HALF_DTYPES = (F16, BF16)
FLOAT_DTYPES = (F16, BF16, F32)

# The one tolerance table for value comparisons (relative and absolute), by dtype.
TOLERANCE = {F32: 1e-6, BF16: 1e-2, F16: 1e-3}

#: The installed jaxlib's version, (major, minor, patch): some XLA behaviour differs by release.
JAXLIB_VERSION = tuple(int(part) for part in jaxlib.__version__.split(".")[:3])


def assert_close(actual, expected, dtype):
    """Compares values with the tolerance of `dtype` from the central table."""
    tol = TOLERANCE[jnp.dtype(dtype)]
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), np.asarray(expected, np.float64), rtol=tol, atol=tol
    )


def diagonal_cases(first, second, first_ids, second_ids):
    """The cases of a two-way matrix (every value of `first` with every value of `second`).

    The default run takes a diagonal, each value of either list at least once (case ``i``
    pairs ``first[i % len(first)]`` with ``second[i % len(second)]``); the other combinations
    are marked slow, and CI runs them all.
    """
    n = max(len(first), len(second))
    default = {(i % len(first), i % len(second)) for i in range(n)}
    return [
        pytest.param(a, b, id=f"{ia}-{ib}", marks=[] if (i, j) in default else [pytest.mark.slow])
        for i, (a, ia) in enumerate(zip(first, first_ids, strict=True))
        for j, (b, ib) in enumerate(zip(second, second_ids, strict=True))
    ]


@pytest.fixture(params=FLOAT_DTYPES, ids=lambda d: d.name)
def float_dtype(request):
    return request.param


@pytest.fixture(params=HALF_DTYPES, ids=lambda d: d.name)
def half_dtype(request):
    return request.param


def all_eqns(jaxpr):
    """Every equation of `jaxpr` and of its sub-jaxprs, depth first."""
    if isinstance(jaxpr, compat.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in compat.jaxprs_in_params(eqn.params):
            yield from all_eqns(sub)


def primitive_dtypes(jaxpr, names):
    """``(name, output dtype)`` of every equation whose primitive is in `names`, recursively."""
    return [
        (eqn.primitive.name, eqn.outvars[0].aval.dtype)
        for eqn in all_eqns(jaxpr)
        if eqn.primitive.name in names
    ]


FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def _jaxprs(jaxpr):
    """`jaxpr` and every sub-jaxpr, each open jaxpr once."""
    if isinstance(jaxpr, compat.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    yield jaxpr
    for eqn in jaxpr.eqns:
        for sub in compat.jaxprs_in_params(eqn.params):
            yield from _jaxprs(sub)


def _dequantized(var, producers):
    """Whether `var` is ``convert(fp8) * scale``: an FP8 operand as the FP8 GEMM reads it."""
    eqn = producers.get(var) if not isinstance(var, compat.Literal) else None
    if eqn is None or eqn.primitive.name != "mul":
        return False
    for v in eqn.invars:
        convert = producers.get(v) if not isinstance(v, compat.Literal) else None
        if convert is not None and convert.primitive.name == "convert_element_type":
            if jnp.dtype(convert.invars[0].aval.dtype) in FP8_DTYPES:
                return True
    return False


def _fp8_operand(var, producers):
    """An FP8 value (the block recipes' products), or one dequantised (per-tensor recipes)."""
    return jnp.dtype(var.aval.dtype) in FP8_DTYPES or _dequantized(var, producers)


def fp8_dots(jaxpr, primitive="dot_general"):
    """The matmuls of `jaxpr` whose two operands are FP8 values, anywhere."""
    found = []
    for sub in _jaxprs(jaxpr):
        producers = {v: e for e in sub.eqns for v in e.outvars}
        found += [
            e
            for e in sub.eqns
            if e.primitive.name == primitive and all(_fp8_operand(v, producers) for v in e.invars)
        ]
    return found


def plain_dots(jaxpr):
    fp8 = {id(e) for e in fp8_dots(jaxpr)}
    return [e for e in all_eqns(jaxpr) if e.primitive.name == "dot_general" and id(e) not in fp8]


_CACHE_DIR = "JAX_COMPILATION_CACHE_DIR"
# Every program is cached, however small or quick to compile.
_CACHE_MINIMA = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": float,
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": int,
}


def pytest_configure(config):
    """One persistent compilation cache for the run: its test processes (pytest-xdist workers)
    and the scripts they start inherit it through the environment, so a program compiled once
    (the same model step in a test, a docs page and a script) is loaded, not compiled again.
    The cache holds executables exactly as compiled; a directory set in the environment is used
    as it is and kept."""
    if _CACHE_DIR not in os.environ:  # the first process of the run: workers inherit it
        os.environ[_CACHE_DIR] = config._jaxmp_cache_dir = tempfile.mkdtemp(prefix="jaxmp-jit-")
        for name in _CACHE_MINIMA:
            os.environ.setdefault(name, "0")
    # jax read the environment when it was imported, before this hook.
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_DIR])
    for name, kind in _CACHE_MINIMA.items():
        if name in os.environ:
            jax.config.update(name.lower(), kind(os.environ[name]))


def environ_without_compilation_cache() -> dict[str, str]:
    """`os.environ` without the run's compilation cache, for a command whose stderr a test
    checks line by line: jaxlib 0.8 logs a line about the machine's features on stderr for
    every program it loads from the cache."""
    return {
        k: v
        for k, v in os.environ.items()
        if k != _CACHE_DIR and not k.startswith("JAX_PERSISTENT_CACHE_")
    }


_SLOW_LIST = pathlib.Path(__file__).with_name("slow_tests.txt")


@pytest.hookimpl(tryfirst=True)  # before `-m 'not slow'` deselects
def pytest_collection_modifyitems(config, items):
    """Marks slow the tests `slow_tests.txt` lists by id (the default run's time budget)."""
    listed = {
        line.strip()
        for line in _SLOW_LIST.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.slow)
    whole_suite = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    stale = listed - {item.nodeid for item in items}
    if whole_suite and not config.option.keyword and stale:
        raise pytest.UsageError(
            f"{_SLOW_LIST} lists tests that do not exist (renamed?): {sorted(stale)}"
        )


def pytest_unconfigure(config):
    cache_dir = getattr(config, "_jaxmp_cache_dir", None)
    if cache_dir is not None:
        shutil.rmtree(cache_dir, ignore_errors=True)


_STACK = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "equinox", "numpy")


def pytest_report_header(config):
    """The versions under test, first in every run's log (CI runs two stacks)."""
    import importlib.metadata
    import platform

    del config
    versions = []
    for name in _STACK:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name} (not installed)")
    return f"jaxmp stack: Python {platform.python_version()}, " + ", ".join(versions)
