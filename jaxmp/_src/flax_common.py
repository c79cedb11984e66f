"""Per-module policies shared by `jaxmp.linen` and `jaxmp.nnx` (no Flax import here)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

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

    def policy_for(self, module: Any, path: Sequence[Any]) -> policy_lib.Policy:
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
        return self.default


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
