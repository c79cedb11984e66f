"""Floating-point dtype names, parsing and validation shared by every module."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Canonical name first: it is the one `str(policy)` prints.
_DTYPE_NAMES: dict[np.dtype, tuple[str, ...]] = {
    jnp.dtype(jnp.float16): ("f16", "float16"),
    jnp.dtype(jnp.bfloat16): ("bf16", "bfloat16"),
    jnp.dtype(jnp.float32): ("f32", "float32", "full"),
    jnp.dtype(jnp.float64): ("f64", "float64"),
}
_NAME_TO_DTYPE: dict[str, np.dtype] = {
    name: dtype for dtype, names in _DTYPE_NAMES.items() for name in names
}
#: Dtypes a policy may hold.
SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(_DTYPE_NAMES)
#: Dtypes that count as half precision.
HALF_DTYPES: tuple[np.dtype, ...] = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
FLOAT32: np.dtype = jnp.dtype(jnp.float32)


def dtype_names() -> tuple[str, ...]:
    """Every accepted dtype name except ``"half"``."""
    return tuple(_NAME_TO_DTYPE)


def valid_dtype_names() -> str:
    """Returns the accepted dtype names, for error messages."""
    return ", ".join(repr(n) for n in (*_NAME_TO_DTYPE, "half"))


def did_you_mean(token: str, choices: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for the choice closest to a misspelt `token`, or ``""``."""
    close = difflib.get_close_matches(token, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def half_dtype() -> Any:
    """Returns the half-precision dtype for the default backend.

    bfloat16 on TPU, float16 everywhere else (jmp's rule). As in jmp, the result
    is the scalar type (`jnp.float16` or `jnp.bfloat16`), which compares equal
    to the `numpy.dtype` and can be called: ``jaxmp.half_dtype()(2**15)``.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> jaxmp.half_dtype() == jnp.float16  # on CPU and GPU
      True
      >>> float(jaxmp.half_dtype()(2**15))
      32768.0
    """
    platform = jax.local_devices()[0].platform
    return jnp.bfloat16 if platform == "tpu" else jnp.float16


def canonical_name(dtype: np.dtype) -> str:
    """Returns the short name (`f16`, `bf16`, `f32`, `f64`) of a supported dtype."""
    return _DTYPE_NAMES[jnp.dtype(dtype)][0]


def parse_dtype(value: str, *, arg: str = "dtype") -> np.dtype:
    """Parses a dtype name such as ``"bf16"``, ``"float32"`` or ``"half"``.

    Case and surrounding spaces are ignored.

    Raises:
      ValueError: naming `arg`, the bad token, the closest valid name and the
        valid names (the message starts with jmp's "Unknown dtype").
    """
    if not isinstance(value, str):
        raise TypeError(f"`{arg}` must be a dtype name string, got {value!r}.")
    token = value.strip().lower()
    if token == "half":
        return jnp.dtype(half_dtype())
    try:
        return _NAME_TO_DTYPE[token]
    except KeyError:
        hint = did_you_mean(token, [*dtype_names(), "half"])
        raise ValueError(
            f"Unknown dtype {value!r} in `{arg}`.{hint} Valid names are {valid_dtype_names()}."
        ) from None


# Python's own types: `jnp.dtype(float)` is float64 and `jnp.dtype(None)` is float64 too,
# which is never what a mixed-precision argument means.
_PYTHON_TYPES = {float: "float", int: "int", complex: "complex", bool: "bool"}


def as_float_dtype(value: object, *, arg: str) -> np.dtype:
    """Normalises a dtype-like (name, numpy/jax dtype or scalar type) once.

    Raises:
      TypeError / ValueError: naming `arg` when `value` is not one of the supported
        floating-point dtypes (float16, bfloat16, float32, float64), including
        ``None`` and Python's ``float`` (which NumPy would read as float64).
    """
    if isinstance(value, str):
        return parse_dtype(value, arg=arg)
    choices = f"{', '.join(d.name for d in SUPPORTED_DTYPES)} (or a name: {valid_dtype_names()})"
    if value is None:
        raise TypeError(f"`{arg}` must be a floating-point dtype, got None; valid: {choices}.")
    if isinstance(value, type) and value in _PYTHON_TYPES:
        raise TypeError(
            f"`{arg}` must be a floating-point dtype, got Python's `{_PYTHON_TYPES[value]}` "
            "type, which NumPy reads as a 64-bit dtype; pass jnp.float32 (or 'f32') for "
            f"float32. Valid: {choices}."
        )
    try:
        dtype = jnp.dtype(value)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(
            f"`{arg}` must be a floating-point dtype, got {value!r}; valid: {choices}."
        ) from None
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"`{arg}` must be a floating-point dtype, got {dtype}; valid: {choices}.")
    return dtype


class _DtypeNames(Mapping):
    """jmp's ``dtype_to_names``: names of each dtype, looked up by any dtype-like."""

    def __getitem__(self, key: Any) -> tuple[str, ...]:
        try:
            return _DTYPE_NAMES[jnp.dtype(key)]
        except TypeError:
            raise KeyError(key) from None

    def __iter__(self) -> Iterator[np.dtype]:
        return iter(_DTYPE_NAMES)

    def __len__(self) -> int:
        return len(_DTYPE_NAMES)

    def __repr__(self) -> str:
        return repr({d.name: n for d, n in _DTYPE_NAMES.items()})


#: The names of each supported dtype, canonical name first (jmp's ``dtype_to_names``);
#: keys may be any dtype-like (``np.float16``, ``jnp.float16``, ``np.dtype("float16")``).
dtype_to_names: Mapping[Any, tuple[str, ...]] = _DtypeNames()


def is_floating(x: object) -> bool:
    """Whether `x` is an array (or array spec) with a real floating-point dtype."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or not hasattr(x, "shape"):
        return False
    try:
        return bool(jnp.issubdtype(dtype, jnp.floating))
    except TypeError:  # extended dtypes such as PRNG keys
        return False


def compute_dtype_of(x: object) -> np.dtype:
    """The dtype jaxmp computes in for floating leaf `x`: float32, or wider if `x` is wider."""
    # Not `jnp.promote_types`: under `jax.numpy_dtype_promotion("strict")` it refuses
    # float16 with float32.
    dtype = jnp.dtype(x.dtype)  # type: ignore[attr-defined]
    return dtype if dtype.itemsize >= FLOAT32.itemsize else FLOAT32
