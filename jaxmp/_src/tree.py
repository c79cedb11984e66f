"""Tree utilities: finiteness, selection and structure checks that name the leaf."""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax.tree_util import keystr

from jaxmp._src import dtypes

T = TypeVar("T")


def all_finite(tree: Any) -> jax.Array:
  """Returns a scalar boolean array: whether every floating-point leaf is finite.

  Integer and boolean leaves are always finite and are not read. An empty tree
  is finite.

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> jaxmp.all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])})
    Array(False, dtype=bool)
  """
  checks = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree) if dtypes.is_floating(x)]
  if not checks:
    return jnp.array(True)
  if len(checks) == 1:
    return checks[0]
  return jnp.stack(checks).all()


def check_scalar_bool(pred: Any, *, arg: str) -> jax.Array:
  """Validates that `pred` is a scalar boolean array-like and returns it as an array."""
  shape = jnp.shape(pred)
  dtype = jnp.result_type(pred)
  if shape != () or dtype != jnp.bool_:
    raise ValueError(f"`{arg}` must be a scalar boolean, got shape {shape} and dtype {dtype}.")
  return jnp.asarray(pred)


def check_same_structure(a: Any, b: Any, *, names: tuple[str, str], check_dtypes: bool = False):
  """Raises a ValueError naming the first leaf path where `a` and `b` differ."""
  a_leaves, a_def = jax.tree_util.tree_flatten_with_path(a)
  b_leaves, b_def = jax.tree_util.tree_flatten_with_path(b)
  if a_def != b_def:  # type: ignore[operator]
    a_paths = {keystr(p) for p, _ in a_leaves}
    b_paths = {keystr(p) for p, _ in b_leaves}
    only_a = sorted(a_paths - b_paths)[:3]
    only_b = sorted(b_paths - a_paths)[:3]
    detail = ""
    if only_a:
      detail += f" leaves only in `{names[0]}`: {', '.join(only_a)};"
    if only_b:
      detail += f" leaves only in `{names[1]}`: {', '.join(only_b)};"
    raise ValueError(
        f"`{names[0]}` and `{names[1]}` must have the same tree structure;{detail} "
        f"got {a_def} and {b_def}."
    )
  if check_dtypes:
    for (path, x), (_, y) in zip(a_leaves, b_leaves, strict=True):
      if jnp.shape(x) != jnp.shape(y) or jnp.result_type(x) != jnp.result_type(y):
        raise ValueError(
            f"`{names[0]}` and `{names[1]}` differ at leaf {keystr(path)}: "
            f"{jnp.result_type(x)}{list(jnp.shape(x))} vs {jnp.result_type(y)}{list(jnp.shape(y))}."
        )


def select_tree(pred: jax.typing.ArrayLike, a: T, b: T) -> T:
  """Selects `a` where `pred` is true and `b` otherwise, leaf by leaf.

  Args:
    pred: a scalar boolean.
    a: a pytree.
    b: a pytree with the same structure, shapes and dtypes as `a`.

  Returns:
    A pytree of the structure of `a`.

  Raises:
    ValueError: if `pred` is not a scalar boolean, or the trees differ (the
      message names the first differing leaf).

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> jaxmp.select_tree(jnp.array(False), {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})
    {'w': Array([0., 0.], dtype=float32)}
  """
  return select(pred, a, b, names=("a", "b"))


def select(pred: jax.typing.ArrayLike, a: T, b: T, *, names: tuple[str, str]) -> T:
  """`select_tree` whose error messages use the caller's argument `names`."""
  pred = check_scalar_bool(pred, arg="pred")
  check_same_structure(a, b, names=names, check_dtypes=True)
  return jax.tree.map(lambda x, y: jax.lax.select(pred, x, y), a, b)
