"""`mixed_precision`: loss scaling and master weights chosen from a policy, in one call."""

from __future__ import annotations

from typing import Any

import optax

from jaxmp._src import dtypes
from jaxmp._src import loss_scale as loss_scale_lib
from jaxmp._src import policy as policy_lib
from jaxmp._src.loss_scaling import as_transformation, loss_scaling
from jaxmp._src.master_weights import master_weights


def default_loss_scale(policy: policy_lib.Policy | str) -> loss_scale_lib.LossScale:
    """The loss scale `mixed_precision` uses for `policy` when none is given.

    ``DynamicLossScale(2**15)`` for float16 compute, whose narrow range
    flushes small gradients to zero; `NoOpLossScale` for bfloat16 and float32,
    whose range is float32's.

    Example:
      >>> import jaxmp
      >>> type(jaxmp.default_loss_scale("mixed_bfloat16")).__name__
      'NoOpLossScale'
    """
    policy = policy_lib.as_policy(policy, arg="policy")
    if policy.needs_loss_scaling:
        return loss_scale_lib.DynamicLossScale(2.0**15)
    return loss_scale_lib.NoOpLossScale()


def mixed_precision(
    inner: optax.GradientTransformation,
    policy: policy_lib.Policy | str,
    loss_scale: loss_scale_lib.LossScale | None = None,
    *,
    axis_name: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optimizer for training under `policy`.

    The result is always ``loss_scaling(...)`` (so skipping non-finite steps and
    `get_loss_scale` work the same for every policy) around ``inner``, with
    `master_weights` in between when the policy stores params in float16 or
    bfloat16.

    Initialise it with the full-precision params (so the master copy starts
    exact) and keep the params themselves in ``policy.param_dtype``.

    Args:
      inner: the optimizer (any optax transformation).
      policy: a `Policy` or a policy string for `get_policy`.
      loss_scale: the loss scale; default `default_loss_scale(policy)`.
      axis_name: passed to `loss_scaling`, for `shard_map` / `pmap` code.

    Returns:
      An `optax.GradientTransformationExtraArgs`.

    Raises:
      TypeError / ValueError: for a bad `inner`, `policy` or `loss_scale`.

    Example:
      >>> import jax.numpy as jnp, optax, jaxmp
      >>> tx = jaxmp.mixed_precision(optax.adam(1e-3), "p=f16,c=f16")
      >>> state = tx.init({"w": jnp.ones(3)})
      >>> jaxmp.get_loss_scale(state).loss_scale
      Array(32768., dtype=float32)
    """
    inner = as_transformation(inner)
    policy = policy_lib.as_policy(policy, arg="policy")
    if loss_scale is None:
        loss_scale = default_loss_scale(policy)
    else:
        loss_scale = loss_scale_lib.as_loss_scale(loss_scale)
    if policy.param_dtype in dtypes.HALF_DTYPES:
        inner = master_weights(inner)
    return loss_scaling(inner, loss_scale, axis_name=axis_name)
