"""Per-module policies shared by `jaxmp.linen` and `jaxmp.nnx` (no Flax import here)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp

from jaxmp._src import policy as policy_lib

# The attributes a Flax module (Linen or NNX) reads for its compute and param dtypes.
DTYPE_ATTR = "dtype"
PARAM_DTYPE_ATTR = "param_dtype"


def path_string(path: Sequence[Any]) -> str:
    """The path `overrides` regexes match: ``"/Block_0/LayerNorm_1"``; the root is ``"/"``."""
    return "/" + "/".join(str(part) for part in path)


@dataclasses.dataclass(frozen=True)
class ModulePolicies:
    """A policy for every module: the first matching override, else the default.

    Attributes:
      default: the policy of modules no override matches.
      overrides: ``(key, policy)`` pairs in the order given; a key is a module
        class (matched with `isinstance`) or a compiled regex (matched with
        `re.fullmatch` against `path_string` of the module's path).
    """

    default: policy_lib.Policy
    overrides: tuple[tuple[type | re.Pattern, policy_lib.Policy], ...]

    def override_for(self, module: Any, path: Sequence[Any]) -> policy_lib.Policy | None:
        """The policy of the first override matching the module, or None."""
        path_str = None
        for key, policy in self.overrides:
            if isinstance(key, type):
                if isinstance(module, key):
                    return policy
            else:
                if path_str is None:
                    path_str = path_string(path)
                if key.fullmatch(path_str):
                    return policy
        return None

    def policy_for(self, module: Any, path: Sequence[Any]) -> policy_lib.Policy:
        override = self.override_for(module, path)
        return self.default if override is None else override


def module_policies(
    policy: policy_lib.Policy | str,
    overrides: Mapping[type | str, policy_lib.Policy | str] | None,
    *,
    module_base: type,
) -> ModulePolicies:
    """Validates `policy` and `overrides` into a `ModulePolicies`.

    Raises:
      TypeError / ValueError: naming ``policy`` or the bad ``overrides`` entry.
    """
    policy = policy_lib.as_policy(policy, arg="policy")
    if overrides is None:
        overrides = {}
    if not isinstance(overrides, Mapping):
        raise TypeError(
            "`overrides` must be a mapping from module classes or module-path regexes to "
            f"policies, got {type(overrides).__name__}."
        )
    pairs = []
    for key, value in overrides.items():
        if isinstance(key, type):
            if not issubclass(key, module_base):
                raise TypeError(
                    f"`overrides` keys must be {module_base.__module__}.{module_base.__name__} "
                    f"subclasses or module-path regex strings, got {key!r}."
                )
            matcher: type | re.Pattern = key
        elif isinstance(key, str):
            try:
                matcher = re.compile(key)
            except re.error as e:
                raise ValueError(
                    f"`overrides` key {key!r} must be a valid regular expression ({e})."
                ) from None
        else:
            raise TypeError(
                "`overrides` keys must be module classes or module-path regex strings, "
                f"got {key!r}."
            )
        value_policy = policy_lib.as_policy(value, arg=f"overrides[{key!r}]")
        pairs.append((matcher, value_policy))
    return ModulePolicies(default=policy, overrides=tuple(pairs))


def has_field(module: Any, name: str) -> bool:
    """Whether `module` declares the attribute `name` (a dtype it honours)."""
    if dataclasses.is_dataclass(module):
        return any(f.name == name for f in dataclasses.fields(module))
    return name in vars(module)


def _same_dtype(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    try:
        return jnp.dtype(a) == jnp.dtype(b)
    except TypeError:  # not a dtype: compare as given
        return bool(a == b)


def is_explicit(module: Any, name: str) -> bool:
    """Whether the dataclass field `name` of `module` holds a value other than its default.

    A Linen module's ``dtype`` or ``param_dtype`` given explicitly (``nn.Dense(4,
    dtype=jnp.float32)``, or ``dtype=config.dtype`` as in Flax's examples) is kept by
    `jaxmp.linen.policy_scope`. A value equal to the field's default (``param_dtype=
    jnp.float32`` on most Flax modules) cannot be told from the default and is not explicit.
    """
    for field in dataclasses.fields(module):
        if field.name == name:
            if field.default is not dataclasses.MISSING:
                default = field.default
            elif field.default_factory is not dataclasses.MISSING:
                default = field.default_factory()
            else:  # a required field: always given explicitly
                return True
            return not _same_dtype(getattr(module, name), default)
    return False
