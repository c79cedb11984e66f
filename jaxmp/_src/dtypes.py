"""Floating-point dtype names, parsing and validation shared by every module."""

from __future__ import annotations

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


def valid_dtype_names() -> str:
    """Returns the accepted dtype names, for error messages."""
    return ", ".join(repr(n) for n in (*_NAME_TO_DTYPE, "half"))


def half_dtype() -> np.dtype:
    """Returns the half-precision dtype for the default backend.

    bfloat16 on TPU, float16 everywhere else (jmp's rule).

    Example:
      >>> import jaxmp
      >>> jaxmp.half_dtype()  # on CPU and GPU
      dtype('float16')
    """
    platform = jax.local_devices()[0].platform
    return jnp.dtype(jnp.bfloat16 if platform == "tpu" else jnp.float16)


def canonical_name(dtype: np.dtype) -> str:
    """Returns the short name (`f16`, `bf16`, `f32`, `f64`) of a supported dtype."""
    return _DTYPE_NAMES[jnp.dtype(dtype)][0]


def parse_dtype(value: str, *, arg: str = "dtype") -> np.dtype:
    """Parses a dtype name such as ``"bf16"``, ``"float32"`` or ``"half"``.

    Case and surrounding spaces are ignored.

    Raises:
      ValueError: naming `arg`, the bad token and the valid names.
    """
    if not isinstance(value, str):
        raise TypeError(f"`{arg}` must be a dtype name string, got {value!r}.")
    token = value.strip().lower()
    if token == "half":
        return half_dtype()
    try:
        return _NAME_TO_DTYPE[token]
    except KeyError:
        raise ValueError(
            f"`{arg}` got unknown dtype {value!r}; valid names are {valid_dtype_names()}."
        ) from None


def as_float_dtype(value: object, *, arg: str) -> np.dtype:
    """Normalises a dtype-like (name, numpy/jax dtype or scalar type) once.

    Raises:
      TypeError / ValueError: naming `arg` when `value` is not one of the supported
        floating-point dtypes (float16, bfloat16, float32, float64).
    """
    if isinstance(value, str):
        return parse_dtype(value, arg=arg)
    try:
        dtype = jnp.dtype(value)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(
            f"`{arg}` must be a floating-point dtype, got {value!r}; valid choices are "
            f"{', '.join(str(d) for d in SUPPORTED_DTYPES)} or one of {valid_dtype_names()}."
        ) from None
    if dtype not in _DTYPE_NAMES:
        raise ValueError(
            f"`{arg}` must be a floating-point dtype, got {dtype}; valid choices are "
            f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}."
        )
    return dtype


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
