"""`master_weights`: a float32 master copy of half-precision params in the optimizer state."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import DTypeLike

from jaxmp._src import casting, dtypes, staging
from jaxmp._src import tree as tree_lib
from jaxmp._src.loss_scaling import as_transformation


class MasterWeightsState(NamedTuple):
    """State of `master_weights`.

    Attributes:
      master: the full-precision copy of the params that `inner` updates.
      inner_state: the wrapped transformation's state.
      saturated_steps: with ``count_saturated=True``, the steps after which some
        master value was at the largest finite value of its param's dtype (where
        it is clipped, so as never to round to inf); 0 otherwise.
    """

    master: Any
    inner_state: Any
    saturated_steps: jax.Array  # shape=(), dtype=int32


def _is_float_param(x: Any) -> bool:
    return dtypes.is_floating(x) or isinstance(x, float)


def _is_complex_param(x: Any) -> bool:
    return tree_lib.is_complex(x) or isinstance(x, complex)


def _master_leaf(x: Any, dtype: Any) -> Any:
    if isinstance(x, float):  # a Python float param (an Equinox module's field, say)
        return jnp.asarray(x, dtype)
    if isinstance(x, complex):
        return jnp.asarray(x, jnp.complex64)
    return casting.cast_tree(x, dtype)


def _step(master: Any, update: Any, param: Any) -> tuple[Any, Any, Any]:
    """One leaf: the new master copy, the update for the param, and the clip limit.

    The new master copy is clipped to the finite range of the param's dtype and the
    update is in the param's dtype (`tree.update_to`): ``param + update`` is the rounded
    master copy whenever the two are within a factor of 2 of each other, which any step
    of an optimizer that moves a param by less than half its magnitude satisfies, and is
    never inf.
    """
    if _is_complex_param(param):
        # No complex half-precision dtype exists: the master copy is the param itself,
        # and the update is the inner one, in the param's dtype.
        param = jnp.asarray(param)
        new = _plus(master, update)
        return new, (new - param.astype(new.dtype)).astype(param.dtype), None
    if not _is_float_param(param):
        # Integer, boolean and other leaves are not trained: zero updates (None for
        # leaves that are not numbers, as Equinox marks them) and no limit.
        if isinstance(param, (jax.Array, np.ndarray, np.generic, int)):
            return master, jnp.zeros_like(param), None
        return master, None, None
    param = jnp.asarray(param)
    return tree_lib.update_to(_plus(master, update), param)


def _plus(master: Any, update: Any) -> Any:
    """``master + update`` in the master copy's dtype (`master` when there is no update)."""
    if update is None:
        return master
    if isinstance(update, jax.Array) and jnp.shape(update) == jnp.shape(master):
        # `lax` directly: the same addition as `+`, traced in a fraction of the time
        # (once per leaf of the model).
        if jnp.dtype(update.dtype) != jnp.dtype(master.dtype):
            update = jax.lax.convert_element_type(update, master.dtype)
        return jax.lax.add(master, update)
    return master + jnp.asarray(update).astype(master.dtype)


def master_weights(
    inner: optax.GradientTransformation,
    dtype: DTypeLike = jnp.float32,
    *,
    count_saturated: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Keeps a full-precision master copy of the params and runs `inner` on it.

    For params stored in float16 or bfloat16: the optimizer state holds a
    `dtype` (float32) copy of the params, `inner` runs on that copy, and the
    returned updates are such that ``optax.apply_updates(params, updates)`` (or
    ``equinox.apply_updates``) gives the new master copy cast to each param's
    dtype. So updates far below float16's resolution still accumulate in the
    master copy and reach the params once they add up (after 200 SGD steps of
    1e-4, the params reach ``1 - 200 * 1e-4``, where plain float16 SGD stays at
    1.0).

    The updates have each param's dtype, so applying them keeps it under
    standard and strict dtype promotion. ``params + updates`` is exactly the
    rounded master copy whenever a step leaves a parameter within a factor of 2
    of its value (a difference of two float16 values within a factor of 2 is
    exact in float16); beyond that, within rounding of the update.

    Params never become inf from a finite master copy: a master value beyond the
    param dtype's largest finite value (65504 for float16) is clipped to it
    (saturated), the master copy with it; a step longer than that value (float16's
    -65000 to 5000) moves the param by that value, the rest following at the next
    step. The clip is free (it is fused into the
    update); counting the steps where it bites, in ``saturated_steps``, reads the
    master copy once more and is opt-in (``count_saturated=True``: one float32
    copy of the params, 0.10x of Adam's update traffic, see BENCHMARKS.md). NaN is not clipped:
    `loss_scaling`'s ``check_outputs=True`` skips such steps.

    Integer and boolean params are not trained: their updates are zeros of their
    dtype and their master copy is the param itself. Python float leaves (fields
    of an Equinox module) are trained as float32 params. Complex params are
    trained as they are (their master copy is the param, complex64 at least).

    Args:
      inner: the optax transformation to run on the master copy.
      dtype: the master copy's dtype, float32 by default.
      count_saturated: count the steps that saturate a param in
        ``saturated_steps`` (off by default).

    Returns:
      An `optax.GradientTransformationExtraArgs` with a `MasterWeightsState`.
      `init` accepts full-precision params (the master copy starts exact) or
      the half-precision ones. `update` requires `params`.

    Raises:
      TypeError / ValueError: for a bad `inner` or `dtype`; at trace time, if
        `update` is called without `params`.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxmp
      >>> tx = jaxmp.master_weights(optax.sgd(1e-4))
      >>> params = {"w": jnp.ones((), jnp.float16)}
      >>> state = tx.init(params)
      >>> step = jax.jit(lambda p, s: tx.update({"w": jnp.ones((), jnp.float16)}, s, p))
      >>> for _ in range(200):
      ...     updates, state = step(params, state)
      ...     params = optax.apply_updates(params, updates)
      >>> params["w"], state.master["w"]
      (Array(0.98, dtype=float16), Array(0.97999..., dtype=float32))
    """
    inner = as_transformation(inner)
    master_dtype = dtypes.as_float_dtype(dtype, arg="dtype")
    if not isinstance(count_saturated, bool):
        raise TypeError(f"`count_saturated` must be a bool, got {count_saturated!r}.")

    @staging.staged
    def init_fn(params):
        master = jax.tree.map(lambda x: _master_leaf(x, master_dtype), params)
        return MasterWeightsState(
            master=master,
            inner_state=inner.init(master),
            saturated_steps=jnp.zeros((), jnp.int32),
        )

    def update_fn(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError(
                "`params` must be passed to the update of jaxmp.master_weights (and of "
                "jaxmp.mixed_precision with half-precision params): "
                "call `tx.update(grads, opt_state, params)`."
            )
        tree_lib.check_same_structure(params, state.master, names=("params", "master copy"))
        updates = casting.cast_tree(updates, master_dtype)
        inner_updates, inner_state = inner.update(
            updates, state.inner_state, state.master, **extra_args
        )
        p_leaves, p_def = jax.tree.flatten(params)
        m_leaves = p_def.flatten_up_to(state.master)
        u_leaves = p_def.flatten_up_to(inner_updates)  # a None update covers its subtree
        steps = [_step(m, u, p) for m, u, p in zip(m_leaves, u_leaves, p_leaves, strict=True)]
        master = jax.tree.unflatten(p_def, [m for m, _, _ in steps])
        out = jax.tree.unflatten(p_def, [d for _, d, _ in steps])
        saturated_steps = state.saturated_steps
        if count_saturated:
            # Reads the written master copy once more, row by row (`tree.all_true`): the
            # mask reduced inside the update's own fusion would make XLA:CPU write it
            # out (4.5 float32 copies of the params for Adam, against 1.0 here).
            below = [jnp.abs(m) < lim for m, _, lim in steps if lim is not None]
            saturated_steps += (~tree_lib.all_true(below)).astype(jnp.int32)
        return out, MasterWeightsState(
            master=master, inner_state=inner_state, saturated_steps=saturated_steps
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
