"""How `mixed_precision` updates half-precision params and stores the optimizer's moments.

A float32 master copy (`master_weights`), or none and a rounding rule (round-to-nearest,
`stochastic_rounding`, `kahan_summation`); and the moments' storage format
(`compress_state`). The options are validated here, once, with errors that name them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import optax

from jaxmp._src import dtypes
from jaxmp._src import policy as policy_lib
from jaxmp._src.compress_state import check_moment_fields, compress_state, parse_format
from jaxmp._src.kahan_summation import kahan_summation
from jaxmp._src.master_weights import master_weights as master_weights_lib
from jaxmp._src.stochastic_rounding import check_param_specs, check_seed, stochastic_rounding

#: The values of `mixed_precision`'s ``rounding``.
ROUNDINGS = ("nearest", "stochastic", "kahan")


def check_rounding(rounding: object, *, arg: str = "rounding") -> str:
    if not isinstance(rounding, str):
        raise TypeError(
            f"`{arg}` must be one of {', '.join(map(repr, ROUNDINGS))}, got {rounding!r}."
        )
    if rounding not in ROUNDINGS:
        raise ValueError(
            f"`{arg}` must be one of {', '.join(map(repr, ROUNDINGS))}, got {rounding!r}."
            f"{dtypes.did_you_mean(rounding.strip().lower(), ROUNDINGS)}"
        )
    return rounding


def check_moments(moments: object, *, arg: str = "moments") -> tuple[str, str]:
    """``(first, second)`` storage formats from a format name or a pair of them."""
    if isinstance(moments, (tuple, list)):
        if len(moments) != 2:
            raise ValueError(
                f"`{arg}` must be a storage format or a pair (first moment, second moment) "
                f"of them, got {moments!r}."
            )
        return (
            parse_format(moments[0], arg=f"{arg}[0]"),
            parse_format(moments[1], arg=f"{arg}[1]"),
        )
    fmt = parse_format(moments, arg=arg)
    return fmt, fmt


def check_options(
    policy: policy_lib.Policy, master_weights: object, rounding: object
) -> tuple[bool, str]:
    """Whether to keep a master copy, and the rounding rule, validated against `policy`."""
    if master_weights is not None and not isinstance(master_weights, (bool, np.bool_)):
        raise TypeError(f"`master_weights` must be None, True or False, got {master_weights!r}.")
    rounding = check_rounding(rounding)
    half = policy.param_dtype in dtypes.HALF_DTYPES
    if master_weights and not half:
        raise ValueError(
            f"`master_weights=True` keeps a float32 copy of float16 or bfloat16 params, but the "
            f"policy {str(policy)!r} stores params in {policy.param_dtype.name}: use a policy "
            "with p=f16 or p=bf16, or leave `master_weights` unset."
        )
    keep = half if master_weights is None else bool(master_weights)
    if rounding != "nearest":
        if not half:
            raise ValueError(
                f"`rounding={rounding!r}` rounds float16 or bfloat16 params, but the policy "
                f"{str(policy)!r} stores params in {policy.param_dtype.name}: use a policy with "
                "p=f16 or p=bf16, or rounding='nearest'."
            )
        if keep:
            raise ValueError(
                f"`rounding={rounding!r}` is for params updated without a master copy: pass "
                "`master_weights=False` too (a float32 master copy keeps every update, and "
                "its rounding to the params' dtype is round-to-nearest)."
            )
    return keep, rounding


def wrap(
    inner: optax.GradientTransformation,
    policy: policy_lib.Policy,
    *,
    master_weights: bool | None = None,
    rounding: str = "nearest",
    moments: str | tuple[str, str] = "float32",
    moment_fields: Mapping[type, Mapping[str, str]] | None = None,
    param_specs: Any = None,
    seed: int = 0,
) -> optax.GradientTransformation:
    """`inner` with the state storage and param updates of `mixed_precision`'s options.

    Outermost first: `master_weights`, `stochastic_rounding` or `kahan_summation` (or
    nothing: round-to-nearest by `loss_scaling`), then `compress_state` (unless both
    moments are float32) around `inner`.
    """
    keep, rounding = check_options(policy, master_weights, rounding)
    first, second = check_moments(moments)
    seed = check_seed(seed)
    param_specs = check_param_specs(param_specs)
    if (first, second) != ("float32", "float32"):
        inner = compress_state(
            inner, first, second, moment_fields=moment_fields, param_specs=param_specs, seed=seed
        )
    else:
        check_moment_fields(moment_fields)
    if keep:
        return master_weights_lib(inner)
    if rounding == "stochastic":
        return stochastic_rounding(inner, seed=seed, param_specs=param_specs)
    if rounding == "kahan":
        return kahan_summation(inner, policy.param_dtype)
    return inner
