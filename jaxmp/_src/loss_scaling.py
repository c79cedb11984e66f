"""`loss_scaling`: an optax wrapper that unscales, checks, skips and adjusts the loss scale."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxmp._src import casting, dtypes
from jaxmp._src import loss_scale as loss_scale_lib
from jaxmp._src import tree as tree_lib


class LossScalingState(NamedTuple):
  """State of `loss_scaling`.

  Attributes:
    inner_state: the wrapped transformation's state; bit-identical after a
      skipped step.
    loss_scale: the `LossScale` (a pytree of arrays) for the next step.
    grads_finite: whether the last step's gradients were finite.
    skipped_steps: total number of skipped (non-finite) steps.
    consecutive_skipped_steps: skipped steps in a row up to the last step.
  """

  inner_state: Any
  loss_scale: loss_scale_lib.LossScale
  grads_finite: jax.Array  # shape=(), dtype=bool
  skipped_steps: jax.Array  # shape=(), dtype=int32
  consecutive_skipped_steps: jax.Array  # shape=(), dtype=int32


def as_transformation(inner: Any, *, arg: str = "inner") -> optax.GradientTransformationExtraArgs:
  """Checks that `inner` is an optax transformation and adds extra-args support."""
  if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
    raise TypeError(
        f"`{arg}` must be an optax.GradientTransformation (with init and update), "
        f"got {inner!r}."
    )
  return optax.with_extra_args_support(inner)


def _finite_across(finite: jax.Array, axis_name: Any) -> jax.Array:
  if axis_name is None:
    return finite
  # The minimum over devices of 1/0: every device sees the same decision.
  return jax.lax.pmin(finite.astype(jnp.int32), axis_name) > 0


def loss_scaling(
    inner: optax.GradientTransformation,
    loss_scale: loss_scale_lib.LossScale | None = None,
    *,
    axis_name: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps `inner` so that it receives unscaled, finite float32 gradients.

  ``update(grads, state, params=None, **extra)`` takes the gradients of the
  *scaled* loss (in any floating dtype, for example those of
  `jaxmp.value_and_grad`). It casts them to float32, divides them by the loss
  scale that produced them (the one in `state`, see `jaxmp.get_loss_scale`),
  and checks that every element is finite (across `axis_name` when given). If
  so, `inner` runs on the unscaled float32 gradients. If not, the step is
  skipped: the updates are all zero and the inner state is kept bit-identical.
  Either way, the loss scale is then adjusted (`LossScale.adjust`).

  Unlike `optax.apply_if_finite`, it never gives up and applies a non-finite
  update, however many steps in a row are skipped.

  The skip is a select fused into the inner update (the inner update is
  computed and discarded on a skipped step), so wrapping costs one extra read
  of the gradients for the finiteness check and nothing more.

  Args:
    inner: the optax transformation to wrap (an optimizer or a chain).
    loss_scale: a `NoOpLossScale`, `StaticLossScale` or `DynamicLossScale`
      (jmp's are converted). Default: ``DynamicLossScale(2**15)``.
    axis_name: for `shard_map` / `pmap` code where each device holds its own
      gradients: the mapped axis name (or tuple of names) over which the
      finiteness decision is made, so that a NaN on one device skips the step on
      all of them. Not needed under `jax.jit` with sharded arrays, where the
      check already covers the global array.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a
    `LossScalingState`.

  Raises:
    TypeError: if `inner` is not an optax transformation or `loss_scale` is not
      a loss scale.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxmp
    >>> tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(2.0**10))
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> grads = {"w": jnp.array([2.0**10, jnp.inf])}  # overflowed scaled gradients
    >>> updates, state = jax.jit(tx.update)(grads, state, params)
    >>> updates["w"], state.loss_scale.loss_scale, state.skipped_steps
    (Array([0., 0.], dtype=float32), Array(512., dtype=float32), Array(1, dtype=int32))
  """
  inner = as_transformation(inner)
  scale0 = (loss_scale_lib.DynamicLossScale(2.0**15) if loss_scale is None
            else loss_scale_lib.as_loss_scale(loss_scale))

  def init_fn(params):
    return LossScalingState(
        inner_state=inner.init(params),
        loss_scale=jax.tree.map(jnp.asarray, scale0),
        grads_finite=jnp.array(True),
        skipped_steps=jnp.zeros((), jnp.int32),
        consecutive_skipped_steps=jnp.zeros((), jnp.int32),
    )

  def update_fn(updates, state, params=None, **extra_args):
    if not isinstance(state, LossScalingState):
      raise TypeError(
          f"`state` must be the LossScalingState made by this transformation's init, "
          f"got {type(state).__name__}."
      )
    if params is not None:
      tree_lib.check_same_structure(updates, params, names=("grads", "params"))
    scale = state.loss_scale
    grads = scale.unscale(casting.cast_tree(updates, dtypes.FLOAT32))
    finite = _finite_across(tree_lib.all_finite(grads), axis_name)
    new_updates, new_inner = inner.update(grads, state.inner_state, params, **extra_args)
    new_updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), new_updates)
    inner_state = tree_lib.select(
        finite, new_inner, state.inner_state, names=("new inner state", "old inner state")
    )
    skipped = (~finite).astype(jnp.int32)
    new_state = LossScalingState(
        inner_state=inner_state,
        loss_scale=scale.adjust(finite),
        grads_finite=finite,
        skipped_steps=state.skipped_steps + skipped,
        consecutive_skipped_steps=(state.consecutive_skipped_steps + skipped) * skipped,
    )
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
