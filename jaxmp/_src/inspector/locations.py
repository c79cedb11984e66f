"""Where an inspected op comes from: its module path, the user's ``file:line``, its pass
(forward or backward), and the arguments and constants a NaN or inf can come from."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sys
import sysconfig
import types
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import compat, interpret
from jaxmp._src.inspector import stats as stats_lib

# Scopes JAX itself opens (the recomputation in a checkpoint's backward pass): not modules.
_JAX_SCOPES = frozenset({"rematted_computation"})

# Packages whose frames are not the user's code (JAX's own and the standard library are left
# out by JAX): a row points at the user's line that called into them.
_LIBRARIES = (
    "jaxmp",
    "flax",
    "optax",
    "equinox",
    "chex",
    "orbax",
    "jmp",
    "haiku",
    "numpy",
    "ml_dtypes",
    "jaxlib",
)


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    dirs = []
    for name in _LIBRARIES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        for path in (spec.submodule_search_locations or []) if spec else []:
            dirs.append(os.path.join(os.path.realpath(path), ""))
    return tuple(dirs)


@functools.cache
def _own_dir() -> str:
    """jaxmp's directory: this file is ``jaxmp/_src/inspector/locations.py``."""
    jaxmp_dir = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    return os.path.join(os.path.realpath(jaxmp_dir), "")


# jaxmp's machinery around the user's model: loss scaling, autocast's casts, the optimizer
# wrappers. Their ops are jaxmp's own (`_Meta.library`) wherever the user's code calls them.
# jaxmp's other code computes the user's model on its behalf (attention, the casts a user asks
# for): its ops are the user's. Paths inside the package.
_MACHINERY = (
    "_src/autocast.py",
    "_src/grad.py",
    "_src/loss_scale.py",
    "_src/loss_scaling.py",
    "_src/mixed_precision.py",
    "_src/master_weights.py",
    "_src/stochastic_rounding.py",
    "_src/kahan_summation.py",
    "_src/compress_state.py",
    "_src/low_memory.py",
)


@functools.cache
def _own_module(path: str) -> str | None:
    """`path` inside jaxmp (``"_src/grad.py"``), or None for a file outside it."""
    real = os.path.realpath(path)
    return real[len(_own_dir()) :].replace(os.sep, "/") if real.startswith(_own_dir()) else None


def _is_machinery(frames: Sequence[tuple[str, int, str]]) -> bool:
    """Whether an op of `frames` (innermost first) is made by jaxmp's machinery: one of the
    libraries' frames inside the user's innermost frame is in a module of `_MACHINERY` (the
    optimizer a wrapper runs is the wrapper's too)."""
    for file, _, function in frames:
        if _is_users_frame(file, function):
            return False
        if _own_module(file) in _MACHINERY:
            return True
    return False


@functools.cache
def _not_users_dirs() -> tuple[str, ...]:
    """Directories whose frames are never the user's: the libraries', JAX's, Python's."""
    dirs = set(_library_dirs())
    for module in (jax, np):
        dirs.add(os.path.join(os.path.realpath(os.path.dirname(str(module.__file__))), ""))
    for key in ("stdlib", "platstdlib"):
        dirs.add(os.path.join(os.path.realpath(sysconfig.get_paths()[key]), ""))
    return tuple(dirs)


@functools.cache
def _is_library_file(path: str) -> bool:
    return os.path.realpath(path).startswith(_library_dirs())


@functools.cache
def _is_users_file(path: str) -> bool:
    return not path.startswith("<frozen") and not os.path.realpath(path).startswith(
        _not_users_dirs()
    )


def _is_users_frame(path: str, function: str) -> bool:
    """Whether a frame of an op's traceback is the user's: not a library's, nor the
    ``__init__`` a dataclass generates (file ``<string>``)."""
    return not _is_library_file(path) and "__create_fn__" not in function


def _caller() -> tuple[str, int, str]:
    """``(file, line, function)`` of the innermost frame of the user's code calling now.

    Where the inspected function was called from: the rows of jaxmp's own ops (loss scaling,
    autocast's casts of the outputs) point there. Read while tracing, so it is the call that
    traced the function.
    """
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if _is_users_file(path):
            return path, frame.f_lineno, frame.f_code.co_name
        frame = frame.f_back
    return "", 0, ""


def _module_path(parts: Sequence[tuple[str, str]]) -> str:
    """The module path (scopes) of a name stack.

    After a transform nested inside scopes, JAX re-opens the same scopes (a checkpoint's
    backward pass is traced again under ``jvp(Module)``): scopes repeating the path from its
    start there are skipped, and the scopes JAX itself opens are left out.
    """
    scopes: list[str] = []
    replay: int | None = None
    for kind, name in parts:
        if kind == "transform":
            replay = 0 if scopes else None
            continue
        if replay is not None and replay < len(scopes) and scopes[replay] == name:
            replay += 1
            continue
        replay = None
        if name and name not in _JAX_SCOPES:
            scopes.append(name)
    return "/".join(scopes)


@dataclasses.dataclass(frozen=True)
class _Meta:
    """The static part of a row."""

    primitive: str
    output: int  # index among the op's outputs
    num_outputs: int
    shape: tuple[int, ...]
    dtype: str
    module: str
    phase: str  # "forward" or "backward"
    file: str
    line: int
    function: str
    library: str = ""  # "jaxmp" for jaxmp's own ops (file and line: the user's call)
    loops: tuple[str, ...] = ()


def _phase(location: interpret.Location) -> str:
    backward = any(k == "transform" and n == "transpose" for k, n in location.name_stack)
    return "backward" if backward else "forward"


def _where(location: interpret.Location, caller: tuple[str, int, str]) -> tuple[str, int, str, str]:
    """``(file, line, function, library)`` of an op: the user's innermost frame.

    An op of jaxmp's machinery (`_MACHINERY`: the loss scale's multiply, autocast's casts of
    the outputs) is marked ``"jaxmp"``, however the user's code reaches it (a lambda, a
    nested jit, a loop body). Without a frame of the user's, an op points at the user's call
    of the inspected function if jaxmp's code made it, else at another library's innermost
    frame.
    """
    frames = list(location.frames)
    library = "jaxmp" if _is_machinery(frames) else ""
    user = [f for f in frames if _is_users_frame(f[0], f[2])]
    if user:
        return (*user[0], library)
    if not frames or _own_module(frames[0][0]) is not None:
        return (*caller, library)
    return (*frames[0], library)


def _meta(
    eqn: Any, output: int, value: Any, location: interpret.Location, caller: tuple[str, int, str]
) -> _Meta:
    file, line, function, library = _where(location, caller)
    return _Meta(
        primitive=eqn.primitive.name,
        output=output,
        num_outputs=len(eqn.outvars),
        shape=tuple(int(d) for d in np.shape(value)),
        dtype=jnp.dtype(value.dtype).name,
        module=_module_path(location.name_stack),
        phase=_phase(location),
        file=file,
        line=line,
        function=function,
        library=library,
    )


@dataclasses.dataclass(frozen=True, eq=False)
class _Origin:
    """A value the program did not compute from its arguments: an argument or a constant.

    A constant is named by the op that made it from finite constants, or by the first op
    reading it (a literal, a closed-over array). `nan` and `inf` are its counts when they are
    known while tracing (`static`), else counted on device.
    """

    kind: str  # "argument" or "constant"
    name: str
    shape: tuple[int, ...]
    dtype: str
    primitive: str
    module: str
    phase: str
    file: str
    line: int
    function: str
    static: bool = False
    nan: int = 0
    inf: int = 0


def _constant_name(value: Any) -> str:
    """A scalar constant's value (``-inf``), else its dtype and shape."""
    if not isinstance(value, compat.Tracer) and np.size(value) == 1:
        return str(np.asarray(value).reshape(()).item())
    return f"{stats_lib._short(jnp.dtype(value.dtype).name)}[{','.join(map(str, np.shape(value)))}]"


def _origin(
    kind: str, name: str, value: Any, eqn: Any, interp: Any, caller: tuple[str, int, str]
) -> _Origin:
    array = np.asarray(value) if not isinstance(value, compat.Tracer) else None
    nan = inf = 0
    if array is not None:
        with np.errstate(invalid="ignore"):
            wide = array.astype(np.float64)
        nan, inf = int(np.isnan(wide).sum()), int(np.isinf(wide).sum())
    if eqn is None:
        where: tuple[str, int, str, str] = (*caller, "")
        primitive, module, phase = "", "", "forward"
    else:
        location = interp.location(eqn)
        where = _where(location, caller)
        primitive, module = eqn.primitive.name, _module_path(location.name_stack)
        phase = _phase(location)
    return _Origin(
        kind=kind,
        name=name,
        shape=tuple(int(d) for d in np.shape(value)),
        dtype=jnp.dtype(value.dtype).name,
        primitive=primitive,
        module=module,
        phase=phase,
        file=where[0],
        line=where[1],
        function=where[2],
        static=array is not None,
        nan=nan,
        inf=inf,
    )
