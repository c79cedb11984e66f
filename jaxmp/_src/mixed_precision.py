"""`mixed_precision`: loss scaling and master weights chosen from a policy, in one call."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optax

from jaxmp._src import loss_scale as loss_scale_lib
from jaxmp._src import low_memory
from jaxmp._src import policy as policy_lib
from jaxmp._src.loss_scaling import as_transformation, loss_scaling


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
    master_weights: bool | None = None,
    rounding: str = "nearest",
    moments: str | tuple[str, str] = "float32",
    moment_fields: Mapping[type, Mapping[str, str]] | None = None,
    param_specs: Any = None,
    check_outputs: bool = False,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optimizer for training under `policy`.

    The result is always ``loss_scaling(...)`` (so skipping non-finite steps and
    `get_loss_scale` work the same for every policy) around ``inner``, with
    `master_weights` in between when the policy stores params in float16 or
    bfloat16.

    Initialise it with the full-precision params (so the master copy starts
    exact) and keep the params themselves in ``policy.param_dtype``.

    For less memory (see the low-memory guide), half-precision params can go
    without the master copy (``master_weights=False``): each update is then
    rounded to the params' dtype to nearest (``rounding="nearest"``, which loses
    updates below half a unit in the last place), stochastically
    (``"stochastic"``, `jaxmp.stochastic_rounding`) or with a compensation buffer
    (``"kahan"``, `jaxmp.kahan_summation`). And the optimizer's moments can be
    stored in fewer bytes (``moments``, `jaxmp.compress_state`). With bfloat16
    params, stochastic rounding and bfloat16 moments, Adam takes 6 bytes per
    parameter instead of 12 (float32) or 14 (float16 params and a master copy).

    Args:
      inner: the optimizer (any optax transformation).
      policy: a `Policy` or a policy string for `get_policy`.
      loss_scale: the loss scale; default `default_loss_scale(policy)`.
      axis_name: passed to `loss_scaling`, for `shard_map` / `pmap` code.
      master_weights: keep a float32 master copy of float16 or bfloat16 params
        (`jaxmp.master_weights`). Default (None): for such params, yes.
      rounding: without a master copy, how the new half-precision params are
        rounded: ``"nearest"``, ``"stochastic"`` or ``"kahan"``.
      moments: the storage format of the optimizer's moments (`compress_state`):
        ``"float32"`` (as computed), ``"bfloat16"``, ``"int8"`` or ``"fp8"``, or a
        pair for the first and the second moment.
      moment_fields: for compressed moments, what the fields of state types that
        `compress_state` does not know hold (``{StateType: {field: "first" |
        "second" | "keep" | "inner"}}``; see `compress_state`).
      param_specs: for an update inside `jax.shard_map` with params split over
        mesh axes: the params' `PartitionSpec` as given to ``in_specs``, so that
        stochastic rounding (of params and of compressed moments) draws each
        element's random bits from its index in the whole param, as unsharded.
      check_outputs: also skip a step whose updates, new optimizer state or new
        params are not finite (`loss_scaling`'s ``check_outputs``): Adam's second
        moment of a gradient of 1e20 is inf, in every moment format. Off by
        default: the check reads the new state and params once more (with
        bfloat16 params and moments, about twice the memory traffic of the
        update). Without it, an update that overflows on finite gradients is
        applied: an infinite second moment stays infinite (with compressed
        moments too) and the params it divides stop moving.
      seed: the seed of the PRNG keys of stochastic rounding (of the params and of
        compressed moments).

    Returns:
      An `optax.GradientTransformationExtraArgs`.

    Raises:
      TypeError / ValueError: for a bad argument (naming it, and the valid
        choices), or a ``rounding`` other than ``"nearest"`` with a master copy or
        float32 params.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxmp
      >>> tx = jaxmp.mixed_precision(optax.adam(1e-3), "p=f16,c=f16")
      >>> state = tx.init({"w": jnp.ones(3)})
      >>> jaxmp.get_loss_scale(state).loss_scale
      Array(32768., dtype=float32)
      >>> tx = jaxmp.mixed_precision(optax.adam(1e-3), "p=bf16,c=bf16", master_weights=False,
      ...                            rounding="stochastic", moments="bfloat16")
      >>> params = {"w": jnp.ones((256, 256), jnp.bfloat16)}
      >>> leaves = jax.tree.leaves((params, tx.init(params)))
      >>> sum(x.nbytes for x in leaves) / params["w"].size  # bytes per parameter
      6.0...
    """
    inner = as_transformation(inner)
    policy = policy_lib.as_policy(policy, arg="policy")
    if loss_scale is None:
        loss_scale = default_loss_scale(policy)
    else:
        loss_scale = loss_scale_lib.as_loss_scale(loss_scale)
    inner = low_memory.wrap(
        inner,
        policy,
        master_weights=master_weights,
        rounding=rounding,
        moments=moments,
        moment_fields=moment_fields,
        param_specs=param_specs,
        seed=seed,
    )
    return loss_scaling(inner, loss_scale, axis_name=axis_name, check_outputs=check_outputs)
