"""Precision policies: which dtype params, computation and outputs use."""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jaxmp._src import casting, display, dtypes

T = TypeVar("T")

_KEYS = {
    "p": "param",
    "params": "param",
    "c": "compute",
    "compute": "compute",
    "o": "output",
    "output": "output",
}
# Keras' policy names (keras.mixed_precision.Policy).
_KERAS_NAMES = {
    "mixed_float16": ("f32", "f16", "f32"),
    "mixed_bfloat16": ("f32", "bf16", "f32"),
}


@dataclasses.dataclass(frozen=True)
class Policy:
    """A mixed-precision policy: the dtypes of params, computation and outputs.

    A policy is a frozen, hashable value (usable as a static `jax.jit` argument);
    two policies are equal when their three dtypes are. Its casting methods are
    pure and touch only floating-point leaves (see `cast_tree`). `str(policy)`
    parses back into an equal policy with `get_policy`.

    Args:
      param_dtype: dtype params are stored in.
      compute_dtype: dtype the forward and backward computation runs in
        (default: `param_dtype`).
      output_dtype: dtype of the model's outputs (default: `compute_dtype`).

    Raises:
      ValueError / TypeError: when a dtype is not float16, bfloat16, float32 or
        float64 (for example an integer dtype), naming the argument.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> policy = jaxmp.Policy(jnp.float32, jnp.float16, jnp.float32)
      >>> str(policy)
      'p=f32,c=f16,o=f32'
      >>> policy.cast_to_compute({"x": jnp.ones(2)})["x"].dtype
      dtype('float16')
      >>> policy == jaxmp.get_policy("mixed_float16")
      True
    """

    # The constructor also accepts names and scalar types; `__post_init__`
    # normalises each to a `numpy.dtype` once.
    param_dtype: np.dtype
    compute_dtype: np.dtype = None  # type: ignore[assignment]
    output_dtype: np.dtype = None  # type: ignore[assignment]

    def __post_init__(self):
        param = dtypes.as_float_dtype(self.param_dtype, arg="param_dtype")
        compute = (
            param
            if self.compute_dtype is None
            else dtypes.as_float_dtype(self.compute_dtype, arg="compute_dtype")
        )
        output = (
            compute
            if self.output_dtype is None
            else dtypes.as_float_dtype(self.output_dtype, arg="output_dtype")
        )
        object.__setattr__(self, "param_dtype", param)
        object.__setattr__(self, "compute_dtype", compute)
        object.__setattr__(self, "output_dtype", output)

    def cast_to_param(self, x: T) -> T:
        """Casts floating-point leaves of `x` to `param_dtype`."""
        return casting.cast_tree(x, self.param_dtype)

    def cast_to_compute(self, x: T) -> T:
        """Casts floating-point leaves of `x` to `compute_dtype`."""
        return casting.cast_tree(x, self.compute_dtype)

    def cast_to_output(self, x: T) -> T:
        """Casts floating-point leaves of `x` to `output_dtype`."""
        return casting.cast_tree(x, self.output_dtype)

    def with_param_dtype(self, param_dtype: DTypeLike) -> Policy:
        """Returns a copy with `param_dtype` replaced."""
        return dataclasses.replace(
            self, param_dtype=dtypes.as_float_dtype(param_dtype, arg="param_dtype")
        )

    def with_compute_dtype(self, compute_dtype: DTypeLike) -> Policy:
        """Returns a copy with `compute_dtype` replaced."""
        return dataclasses.replace(
            self, compute_dtype=dtypes.as_float_dtype(compute_dtype, arg="compute_dtype")
        )

    def with_output_dtype(self, output_dtype: DTypeLike) -> Policy:
        """Returns a copy with `output_dtype` replaced."""
        return dataclasses.replace(
            self, output_dtype=dtypes.as_float_dtype(output_dtype, arg="output_dtype")
        )

    @property
    def is_half(self) -> bool:
        """Whether the computation runs in float16 or bfloat16."""
        return self.compute_dtype in dtypes.HALF_DTYPES

    @property
    def needs_loss_scaling(self) -> bool:
        """Whether the computation runs in float16, whose range needs loss scaling."""
        return self.compute_dtype == jnp.dtype(jnp.float16)

    def __str__(self) -> str:
        parts = (self.param_dtype, self.compute_dtype, self.output_dtype)
        return "p={},c={},o={}".format(*(dtypes.canonical_name(d) for d in parts))

    def __repr__(self) -> str:
        return f"Policy({str(self)!r})"

    def _repr_html_(self) -> str:
        """The policy in a notebook: its three dtypes, and whether it needs loss scaling."""
        compute = self.compute_dtype.name
        if self.needs_loss_scaling:
            note = f"computes in {compute}: needs loss scaling (jaxmp.mixed_precision adds it)"
        else:
            note = f"computes in {compute}: no loss scaling needed"
        return display.html_table(
            ["", "params", "compute", "output"],
            [["dtype", self.param_dtype.name, compute, self.output_dtype.name]],
            title=f"jaxmp.{self!r}",
            after=[note],
        )


def _valid_grammar() -> str:
    return (
        f"a dtype name ({dtypes.valid_dtype_names()}), a Keras name "
        f"({', '.join(repr(n) for n in _KERAS_NAMES)}) or comma-separated "
        "'key=dtype' pairs with keys 'p'/'params', 'c'/'compute', 'o'/'output' "
        "(for example 'p=f32,c=f16,o=f32')"
    )


def get_policy(policy_name: str | Policy) -> Policy:
    """Parses a policy string (jmp's grammar plus Keras' names).

    Accepted forms (case and spaces are ignored):

    * a dtype for all three parts: ``"f32"``, ``"float16"``, ``"bf16"``, ``"half"``
      (Keras' ``"float32"``, ``"float16"`` and ``"bfloat16"`` are these too);
    * Keras' ``"mixed_float16"`` (params f32, compute f16, output f32) and
      ``"mixed_bfloat16"`` (params f32, compute bf16, output f32);
    * jmp's ``"p=f32,c=f16,o=f32"`` with keys ``p``/``params``, ``c``/``compute``,
      ``o``/``output``: params default to f32, compute to params, output to compute.

    A `Policy` passes through unchanged, and a floating-point dtype means the
    same as its name (``jnp.float16`` is ``"float16"``: everything in float16).

    Args:
      policy_name: the policy string, a `Policy` or a floating-point dtype
        (jmp's keyword name).

    Returns:
      The `Policy`.

    Raises:
      ValueError: naming the bad token, the closest valid name and the valid
        choices (the message starts with jmp's "Unknown dtype").
      TypeError: if `policy_name` is none of the above.

    Example:
      >>> import jaxmp
      >>> jaxmp.get_policy("c=bf16")
      Policy('p=f32,c=bf16,o=bf16')
      >>> jaxmp.get_policy("mixed_float16")
      Policy('p=f32,c=f16,o=f32')
      >>> jaxmp.get_policy("mixed_flaot16")
      Traceback (most recent call last):
      ...
      ValueError: Unknown dtype or policy name 'mixed_flaot16'... Did you mean 'mixed_float16'?...
    """
    return as_policy(policy_name, arg="policy_name")


def as_policy(value: object, *, arg: str) -> Policy:
    """`get_policy` for an argument the user named `arg` (`policy`, say): errors name it."""
    if isinstance(value, Policy):
        return value
    if not isinstance(value, str):
        try:
            dtype = dtypes.as_float_dtype(value, arg=arg)
        except (TypeError, ValueError):
            raise TypeError(
                f"`{arg}` must be a policy string (such as 'mixed_float16' or "
                f"'mixed_bfloat16'), a jaxmp.Policy or a floating-point dtype, got {value!r}."
            ) from None
        return Policy(dtype, dtype, dtype)
    text = "".join(value.split()).lower()
    if not text:
        raise ValueError(f"`{arg}` is empty; expected {_valid_grammar()}.")
    if text in _KERAS_NAMES:
        return Policy(*(dtypes.parse_dtype(n) for n in _KERAS_NAMES[text]))
    if "=" not in text:
        try:
            dtype = dtypes.parse_dtype(text, arg=arg)
        except ValueError:
            names = [*_KERAS_NAMES, *dtypes.dtype_names(), "half"]
            raise ValueError(
                f"Unknown dtype or policy name {value!r} in `{arg}`."
                f"{dtypes.did_you_mean(text, names)} Expected {_valid_grammar()}."
            ) from None
        return Policy(dtype, dtype, dtype)
    parts: dict[str, np.dtype] = {}
    for part in text.split(","):
        key, sep, name = part.partition("=")
        if not sep or key not in _KEYS:
            hint = dtypes.did_you_mean(key, _KEYS) if sep else ""
            raise ValueError(
                f"`{arg}` {value!r} has bad part {part!r}: keys must be one of "
                f"{', '.join(repr(k) for k in _KEYS)}.{hint} Expected {_valid_grammar()}."
            )
        if _KEYS[key] in parts:
            raise ValueError(f"`{arg}` {value!r} sets the {_KEYS[key]} dtype twice.")
        try:
            parts[_KEYS[key]] = dtypes.parse_dtype(name, arg=arg)
        except ValueError:
            raise ValueError(
                f"Unknown dtype {name!r} for key {key!r} in `{arg}` {value!r}."
                f"{dtypes.did_you_mean(name, [*dtypes.dtype_names(), 'half'])} Valid names "
                f"are {dtypes.valid_dtype_names()}."
            ) from None
    param = parts.get("param", jnp.dtype(jnp.float32))
    compute = parts.get("compute", param)
    output = parts.get("output", compute)
    return Policy(param, compute, output)
