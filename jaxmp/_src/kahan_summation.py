"""`kahan_summation`: half-precision params updated without a master copy, with compensation.

Each step, what rounding the new param to its dtype loses is kept in a buffer of the
params' dtype and added to the next update (Kahan, 1965, "Further remarks on reducing
truncation errors"; for bfloat16 training, Zamirai et al., 2020, "Revisiting BFloat16
Training", arXiv 2010.06192). Param and buffer together hold about twice the bits of the
param alone: 4 bytes per bfloat16 param, against 6 with a float32 master copy.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import DTypeLike

from jaxmp._src import dtypes, staging
from jaxmp._src import tree as tree_lib
from jaxmp._src.loss_scaling import as_transformation
from jaxmp._src.stochastic_rounding import other_update, require_params, widen_floats


class KahanSummationState(NamedTuple):
    """State of `kahan_summation`.

    Attributes:
      compensation: per floating-point param, what rounding the param lost so far
        and the next update adds back (`dtype`, or the param's dtype); None for
        leaves that are not trained (integer, boolean, complex).
      inner_state: the wrapped transformation's state.
    """

    compensation: Any
    inner_state: Any


def _is_none(x: Any) -> bool:
    return x is None


def _compensation(x: Any, dtype: np.dtype | None) -> Any:
    if isinstance(x, float):  # a Python float param (an Equinox module's field, say)
        return jnp.zeros((), jnp.float32 if dtype is None else dtype)
    if not dtypes.is_floating(x):
        return None
    # `zeros_like`, so that `jaxmp.state_shardings` shards the buffer like its param.
    return jnp.zeros_like(x, x.dtype if dtype is None else dtype)


def _step(update: Any, param: Any, compensation: Any) -> tuple[Any, Any]:
    """One leaf: the update in the param's dtype and the new compensation."""
    if compensation is None or update is None:
        return other_update(update, param), compensation
    param = jnp.asarray(param)
    wide = dtypes.compute_dtype_of(param)
    # The update and the error carried from the last step, added to the param in at
    # least float32: `new` is what a master copy would hold.
    carried = jnp.asarray(update).astype(wide) + compensation.astype(wide)
    new = param.astype(wide) + carried
    new, delta, _ = tree_lib.update_to(new, param)
    # What rounding `new` to the param's dtype loses (exact in float32 for half-precision
    # params). It is what ``param + delta`` misses of `new` whenever that is exact (steps
    # within a factor of 2 of the param); computed from `new`, not from `delta`, so that
    # XLA need not write `delta` out for the two of them.
    lost = new - new.astype(param.dtype).astype(wide)
    return delta, lost.astype(compensation.dtype)


def kahan_summation(
    inner: optax.GradientTransformation, dtype: DTypeLike | None = None
) -> optax.GradientTransformationExtraArgs:
    """Runs `inner` in float32 and carries each param's rounding error to the next step.

    For params stored in bfloat16 or float16 and no master copy: the update from
    `inner` plus the compensation buffer is added to the param in float32, the
    result rounded to the param's dtype, and what the rounding lost stored in the
    buffer, to be added at the next step (Kahan summation). A step too small to
    move a param accumulates in the buffer until the sum does. The buffer has
    `dtype`: the params' dtype, so a bfloat16 param costs 4 bytes with its buffer,
    against 6 with a float32 master copy.

    The returned updates are in each param's dtype, as with `jaxmp.master_weights`:
    ``optax.apply_updates(params, updates)`` gives the new param, never inf (values
    beyond the dtype's range are clipped to its largest finite value), and the
    buffer holds what that update misses. Float32 and wider params are compensated
    the same way, in their own dtype. Integer, boolean and complex params have no
    buffer (None) and are updated as in `jaxmp.master_weights`.

    `inner` is initialised with the params widened to float32.

    Args:
      inner: the optax transformation computing the updates.
      dtype: the buffers' dtype. Default: each param's dtype as given to `init`.
        `jaxmp.loss_scaling` initialises the transformation it wraps with float32
        params, so under it pass the params' dtype here (`jaxmp.mixed_precision`
        does).

    Returns:
      An `optax.GradientTransformationExtraArgs` with a `KahanSummationState`.
      `update` requires `params`.

    Raises:
      TypeError / ValueError: for a bad `inner` or `dtype`; ValueError at trace
        time, if `update` is called without `params`.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxmp
      >>> tx = jaxmp.kahan_summation(optax.sgd(1e-4))
      >>> params = {"w": jnp.ones((), jnp.bfloat16)}
      >>> state = tx.init(params)
      >>> step = jax.jit(lambda p, s: tx.update({"w": jnp.ones((), jnp.bfloat16)}, s, p))
      >>> for _ in range(100):
      ...     updates, state = step(params, state)
      ...     params = optax.apply_updates(params, updates)
      >>> params["w"], state.compensation["w"]  # together 0.99006, about 1 - 100 * 1e-4
      (Array(0.988281, dtype=bfloat16), Array(0.00177765, dtype=bfloat16))
    """
    inner = as_transformation(inner)
    buffer_dtype = None if dtype is None else dtypes.as_float_dtype(dtype, arg="dtype")

    @staging.staged
    def init_fn(params):
        return KahanSummationState(
            compensation=jax.tree.map(lambda x: _compensation(x, buffer_dtype), params),
            inner_state=inner.init(widen_floats(params)),
        )

    def update_fn(updates, state, params=None, **extra_args):
        require_params(params, "kahan_summation")
        inner_updates, inner_state = inner.update(
            widen_floats(updates), state.inner_state, widen_floats(params), **extra_args
        )
        p_leaves, p_def = jax.tree.flatten(params)
        u_leaves = p_def.flatten_up_to(inner_updates)  # a None update covers its subtree
        c_leaves = jax.tree.flatten(state.compensation, is_leaf=_is_none)[0]
        if len(c_leaves) != len(p_leaves):
            tree_lib.check_same_structure(
                params, state.compensation, names=("params", "compensation")
            )
        steps = [_step(u, p, c) for u, p, c in zip(u_leaves, p_leaves, c_leaves, strict=True)]
        out = jax.tree.unflatten(p_def, [d for d, _ in steps])
        compensation = jax.tree.unflatten(p_def, [c for _, c in steps])
        return out, KahanSummationState(compensation=compensation, inner_state=inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
