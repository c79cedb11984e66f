"""`master_weights`: a float32 master copy of half-precision params in the optimizer state."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import DTypeLike

from jaxmp._src import casting, dtypes
from jaxmp._src import tree as tree_lib
from jaxmp._src.loss_scaling import as_transformation


class MasterWeightsState(NamedTuple):
    """State of `master_weights`.

    Attributes:
      master: the full-precision copy of the params that `inner` updates.
      inner_state: the wrapped transformation's state.
    """

    master: Any
    inner_state: Any


def _delta(new_master: jax.Array, param: jax.Array) -> jax.Array:
    # The update that takes `param` to `new_master` rounded to the param dtype,
    # computed in float32 so that `param + delta` recovers that value exactly
    # (always when the step changes the parameter by less than a factor of 2**12,
    # that is, in practice, always; see the docstring).
    target = new_master.astype(param.dtype)
    # By width, not `jnp.promote_types`, which strict dtype promotion refuses.
    wide = max(jnp.dtype(param.dtype), jnp.dtype(new_master.dtype), key=lambda d: d.itemsize)
    return target.astype(wide) - param.astype(wide)


def master_weights(
    inner: optax.GradientTransformation, dtype: DTypeLike = jnp.float32
) -> optax.GradientTransformationExtraArgs:
    """Keeps a full-precision master copy of the params and runs `inner` on it.

    For params stored in float16 or bfloat16: the optimizer state holds a
    `dtype` (float32) copy of the params, `inner` runs on that copy, and the
    returned updates are such that ``optax.apply_updates(params, updates)``
    equals the new master copy cast to each param's dtype. So updates far below
    float16's resolution still accumulate in the master copy and reach the
    params once they add up (after 200 SGD steps of 1e-4, the params reach
    ``1 - 200 * 1e-4``, where plain float16 SGD stays at 1.0).

    The updates are float32; ``params + updates`` is exact (and so equals the
    rounded master copy) whenever a step changes a parameter by less than a
    factor of 2**12 in magnitude (float16; 2**15 for bfloat16). Within a factor of
    that, the result is within one unit in the last place.

    Args:
      inner: the optax transformation to run on the master copy.
      dtype: the master copy's dtype, float32 by default.

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

    def init_fn(params):
        master = casting.cast_tree(params, master_dtype)
        return MasterWeightsState(master=master, inner_state=inner.init(master))

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
        master = optax.apply_updates(state.master, inner_updates)
        out = jax.tree.map(_delta, master, params)
        return out, MasterWeightsState(master=master, inner_state=inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
