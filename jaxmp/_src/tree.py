"""Tree utilities: finiteness, selection and structure checks that name the leaf."""

from __future__ import annotations

import itertools
import math
import operator
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import keystr

from jaxmp._src import compat, dtypes

T = TypeVar("T")


# Leaves of more than 32 elements are checked row by row (`_rows_all`).
_ROWS_FROM = 33
# At most this many leaves are combined into one reduction (`_all_of`).
_GROUP = 32


def _row_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of one row for `_rows_all`: at most 32 elements per dimension."""
    size = math.prod(shape)
    # A row that is a whole trailing block of `shape` would be turned back into a
    # reduction over that block, which XLA:CPU splits (see `_rows_all`).
    trailing = set(itertools.accumulate(reversed(shape), operator.mul))
    for row in (512, 256, 128, 64):
        if size % row == 0 and row not in trailing:
            return (row // 32, 32)
    return (max(d for d in range(1, 33) if size % d == 0),)


def _combined(leaves: list[jax.Array], mask: Any) -> jax.Array:
    """``mask(x1) & mask(x2) & ...`` for `leaves` of one shape, as a balanced tree.

    A chain instead (``((m1 & m2) & m3) & ...``) of reshaped masks makes XLA's simplifier
    move one reshape per pass over the whole program, up to its limit of passes.
    """
    masks = [mask(x) for x in leaves]
    while len(masks) > 1:
        pairs = [jax.lax.bitwise_and(a, b) for a, b in zip(masks[::2], masks[1::2], strict=False)]
        masks = pairs + ([masks[-1]] if len(masks) % 2 else [])
    return masks[0]


def _rows_all(leaves: list[jax.Array], mask: Any) -> jax.Array:
    """Per-row conjunction of ``mask(x)`` over `leaves` of one shape: a boolean vector.

    Each leaf is read once, as rows of up to 512 elements: the masks of the leaves are
    combined element by element (`_combined`, one loop over all of them) and each row is
    reduced to one bool. XLA:CPU splits a reduction over a dimension of more than 32
    elements into a reduce-window whose input, the whole boolean array, is written out and
    read back: the plain ``isfinite(x).all()`` costs 1.5 reads of a float32 leaf. A
    reduction over dimensions of at most 32 fuses with the mask, and only one bool per row
    reaches memory. On GPU both forms are one fused read.

    One reduction for many leaves is also what keeps compile time down: XLA:CPU compiles a
    reduction several times slower than an elementwise fusion, so one per leaf made the
    finiteness check of a 2,000-leaf tree cost more compile time than Adam's update.
    """
    row = _row_shape(jnp.shape(leaves[0]))
    rows = jnp.reshape(_combined(leaves, mask), (-1, *row))
    return rows.all(axis=tuple(range(1, len(row) + 1)))


def _all_of(leaves: list[Any], mask: Any) -> jax.Array:
    """Whether ``mask(x)`` is true everywhere for every array in `leaves`, each read once.

    Leaves of the same dtype and shape are reduced together, up to `_GROUP` at a time:
    row by row (`_rows_all`) from 33 elements, at once below. The number of reductions
    then grows with the number of distinct leaf shapes, not with the number of leaves (an
    unscanned transformer repeats a dozen shapes per layer). Leaves of different shapes are
    not concatenated: XLA splits a reduction of a concatenation into one per operand.
    Nor are leaves that may be sharded differently (`compat.sharding_group`): combining
    them would move one to the other's devices.
    """
    groups: dict[tuple[Any, tuple[int, ...], Any], list[jax.Array]] = {}
    for x in leaves:
        key = (jnp.dtype(x.dtype), jnp.shape(x), compat.sharding_group(x))
        groups.setdefault(key, []).append(x)
    results, rows = [], []
    for (_, shape, sharding), group in groups.items():
        for chunk in _chunks(group):
            # A sharded leaf is reduced whole: reshaped into rows, it could be resharded.
            if sharding is not None or math.prod(shape) < _ROWS_FROM:
                results.append(_combined(chunk, mask).all())
            else:
                rows.append(_rows_all(chunk, mask))
    if rows:
        # The barrier keeps XLA from merging the per-row reductions back into
        # whole-leaf ones (see `_rows_all`).
        results += [r.all() for r in jax.lax.optimization_barrier(rows)]
    if not results:
        return jnp.array(True)
    return results[0] if len(results) == 1 else jnp.stack(results).all()


def _chunks(xs: list[T]) -> list[list[T]]:
    return [xs[i : i + _GROUP] for i in range(0, len(xs), _GROUP)]


def all_true(masks: list[jax.Array]) -> jax.Array:
    """Whether every element of every boolean array in `masks` is true, each read once.

    Row by row and many masks at once, like `all_finite` (see `_all_of`), so that XLA:CPU
    does not write the masks out to reduce them.
    """
    return _all_of([jnp.asarray(m) for m in masks], lambda m: m)


def is_complex(x: object) -> bool:
    """Whether `x` is an array (or array spec) with a complex floating-point dtype."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or not hasattr(x, "shape"):
        return False
    try:
        return bool(jnp.issubdtype(dtype, jnp.complexfloating))
    except TypeError:  # extended dtypes such as PRNG keys
        return False


def _checked_leaf(x: Any) -> Any:
    """`x` as an array if its finiteness is in question (floating or complex), else None."""
    if isinstance(x, (float, complex)):  # Python scalars: a NaN or inf is as bad in a float
        return jnp.asarray(x)
    if dtypes.is_floating(x) or is_complex(x):
        return x
    return None


def all_finite(tree: Any) -> jax.Array:
    """Returns a scalar boolean array: whether every floating-point leaf is finite.

    Real and complex floating-point arrays are checked (a complex element is
    finite when both its parts are), and so are Python floats and complex
    numbers. Integer and boolean leaves are always finite and are not read;
    other leaves (None, strings, functions) are ignored. An empty tree is
    finite. Each checked leaf is read once.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> jaxmp.all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])})
      Array(False, dtype=bool)
      >>> jaxmp.all_finite({"z": jnp.array([1 + 1j]), "lr": float("nan")})
      Array(False, dtype=bool)
    """
    leaves = [y for y in map(_checked_leaf, jax.tree.leaves(tree)) if y is not None]
    return _all_of(leaves, _isfinite)


def _isfinite(x: jax.Array) -> jax.Array:
    # `lax.is_finite` for real arrays: the same operation as `jnp.isfinite` with less
    # to trace (thousands of leaves); complex ones check both parts.
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating):
        return jax.lax.is_finite(x)
    return jnp.isfinite(x)


class ScalarBoolError(ValueError, AssertionError):
    """A predicate that is not a scalar boolean.

    A ValueError, and also an AssertionError because jmp asserts this (code that
    catches jmp's error keeps working with ``import jaxmp as jmp``).
    """


def check_scalar_bool(pred: Any, *, arg: str) -> jax.Array:
    """Validates that `pred` is a scalar boolean (array or Python bool) and returns an array.

    Raises:
      ScalarBoolError: naming `arg` and what was given.
    """
    if isinstance(pred, (bool, np.bool_)):
        return jnp.asarray(pred)
    if not (hasattr(pred, "dtype") and hasattr(pred, "shape")):
        raise ScalarBoolError(
            f"`{arg}` must be a scalar boolean array, got {pred!r} ({type(pred).__name__}); "
            "expected boolean scalar."
        )
    shape, dtype = jnp.shape(pred), jnp.dtype(pred.dtype)
    if shape != () or dtype != jnp.bool_:
        raise ScalarBoolError(
            f"`{arg}` must be a scalar boolean, got shape {shape} and dtype {dtype}; "
            "expected boolean scalar."
        )
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
                x_type = f"{jnp.result_type(x)}{list(jnp.shape(x))}"
                y_type = f"{jnp.result_type(y)}{list(jnp.shape(y))}"
                raise ValueError(
                    f"`{names[0]}` and `{names[1]}` differ at leaf {keystr(path)}: "
                    f"{x_type} vs {y_type}."
                )


def _cast(x: jax.Array, dtype: np.dtype) -> jax.Array:
    return x if jnp.dtype(x.dtype) == dtype else jax.lax.convert_element_type(x, dtype)


def _clip(x: jax.Array, limit: np.ndarray) -> jax.Array:
    """``jnp.clip(x, -limit, limit)``: the same maximum and minimum (NaN stays NaN)."""
    return jax.lax.min(jax.lax.max(x, -limit), limit)


def update_to(new: jax.Array, param: jax.Array) -> tuple[jax.Array, jax.Array, np.ndarray]:
    """The update, in `param`'s dtype, that takes `param` to `new` (a wider value).

    Returns ``(new clipped, update, limit)``. `new` is clipped to the finite range of
    `param`'s dtype (``±limit``: 65504 for float16), so that it never rounds to inf; NaN
    stays NaN. ``param + update`` in `param`'s dtype, as `optax.apply_updates` and
    `equinox.apply_updates` compute it, is then:

    * exactly the clipped `new` rounded to `param`'s dtype whenever the two are within a
      factor of 2 of each other (their difference is exact: Sterbenz's lemma);
    * otherwise within rounding of the update, and never inf: a step longer than `limit`
      (float16's -65000 to 5000) is cut to `limit`, the rest following at the next
      update; where ``param + update`` would round up to inf at the edge of the range
      (float16's 32688 + 32832 = 65520), the update is one unit in the last place smaller.
    """
    # `lax` operations throughout: the same operations as `jnp.clip`, `+` and `astype`,
    # with a fraction of their tracing time (this runs once per leaf of the model).
    p_dtype, n_dtype = jnp.dtype(param.dtype), jnp.dtype(new.dtype)
    limit = np.asarray(jnp.finfo(p_dtype).max).astype(n_dtype)
    new = _clip(new, limit)
    target = _cast(new, p_dtype)
    # By width, not `jnp.promote_types`, which strict dtype promotion refuses.
    wide = max(p_dtype, n_dtype, key=lambda d: d.itemsize)
    delta = jax.lax.sub(_cast(target, wide), _cast(param, wide))
    delta = _cast(_clip(delta, limit.astype(wide)), p_dtype)
    # One ulp toward 0, as a constant offset: the step down has no derivative, and the
    # update's derivative stays 1 (a hypergradient flows through it as through rounding).
    # Where it is used, `delta` is finite and nonzero (a finite `param` plus a zero or
    # NaN `delta` is never inf), and the floating-point number one ulp nearer 0 is the
    # one whose bits, as an integer of the same width, are one less (sign and magnitude):
    # what `jnp.nextafter(delta, 0)` gives there, in 4 instructions instead of about 20
    # (each compiled once per leaf: the update of a model with thousands of leaves).
    fixed = jax.lax.stop_gradient(delta)
    bits = jnp.dtype(f"int{8 * p_dtype.itemsize}")
    toward_0 = jax.lax.bitcast_convert_type(
        jax.lax.sub(jax.lax.bitcast_convert_type(fixed, bits), np.ones((), bits)), p_dtype
    )
    finite = jax.lax.is_finite(jax.lax.add(param, delta))
    # Where `param + delta` is NaN, both sides are NaN (`delta` is NaN then).
    delta = jax.lax.select(finite, delta, jax.lax.add(delta, jax.lax.sub(toward_0, fixed)))
    return new, delta, limit


def select_tree(pred: jax.typing.ArrayLike, a: T, b: T) -> T:
    """Selects `a` where `pred` is true and `b` otherwise, leaf by leaf.

    Args:
      pred: a scalar boolean.
      a: a pytree.
      b: a pytree with the same structure, shapes and dtypes as `a`.

    Returns:
      A pytree of the structure of `a`.

    Raises:
      ValueError: if `pred` is not a scalar boolean (the error is also an
        AssertionError, which jmp raises there), or the trees differ (the message
        names the first differing leaf).

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
