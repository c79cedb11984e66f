"""`loss_scaling`: an optax wrapper that unscales, checks, skips and adjusts the loss scale."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxmp._src import casting, compat, dtypes
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


def _select_state(finite: jax.Array, new: Any, old: Any) -> Any:
    return tree_lib.select(finite, new, old, names=("new inner state", "old inner state"))


def _zero_unless(finite: jax.Array, updates: Any) -> Any:
    return jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), updates)


def _is_traced(tree: Any) -> bool:
    return any(compat.is_tracer(x) for x in jax.tree.leaves(tree))


def _guarded_update(
    inner: optax.GradientTransformationExtraArgs,
    finite: jax.Array,
    grads: Any,
    inner_state: Any,
    params: Any,
    extra_args: dict[str, Any],
) -> tuple[Any, Any]:
    """`inner.update`, then zero updates and the old inner state unless `finite`.

    Under a trace, the selects are placed where `inner` computes each new state
    leaf (`_update_selecting_at_source`); eagerly, after the update.
    """
    if _is_traced((grads, inner_state)):
        try:
            return _update_selecting_at_source(
                inner, finite, grads, inner_state, params, extra_args
            )
        except (jax.errors.JAXTypeError, NotImplementedError):
            # What `inner` cannot do as a jaxpr of (grads, state) (Python control
            # flow on a state leaf that is concrete, say) takes the plain path
            # below, which raises the same error if the update itself is at fault.
            pass
    new_updates, new_inner = inner.update(grads, inner_state, params, **extra_args)
    return _zero_unless(finite, new_updates), _select_state(finite, new_inner, inner_state)


def _update_selecting_at_source(
    inner: optax.GradientTransformationExtraArgs,
    finite: jax.Array,
    grads: Any,
    inner_state: Any,
    params: Any,
    extra_args: dict[str, Any],
) -> tuple[Any, Any]:
    """`_guarded_update` with each new state leaf selected where it is computed.

    Selecting the new state after the update leaves the unselected new state
    (Adam's new moments, say) needed by two consumers: the selected state and the
    updates computed from it. XLA then recomputes it inside the updates' fusion,
    reading the gradients and the old state once more (a quarter more memory
    traffic for Adam). Here the update runs as a jaxpr in which every new state
    value is replaced by ``select(finite, new, old)`` as soon as it is computed,
    so later computations, the updates included, read the selected state that is
    written anyway. Where `finite` is true every value is unchanged; where it is
    false the updates are garbage and zeroed as before.
    """
    g_leaves, g_def = jax.tree.flatten(grads)
    s_leaves, s_def = jax.tree.flatten(inner_state)

    def run(g, s):
        return inner.update(
            jax.tree.unflatten(g_def, g), jax.tree.unflatten(s_def, s), params, **extra_args
        )

    closed, (u_shape, s_shape) = jax.make_jaxpr(run, return_shape=True)(g_leaves, s_leaves)
    tree_lib.check_same_structure(
        s_shape, inner_state, names=("new inner state", "old inner state"), check_dtypes=True
    )
    jaxpr = closed.jaxpr
    n_updates = len(jax.tree.leaves(u_shape))
    state_vars = jaxpr.outvars[n_updates:]
    inputs = set(jaxpr.invars) | set(jaxpr.constvars)
    old_of: dict[Any, Any] = {}  # new state var -> old value; None: select at the end
    for var, old in zip(state_vars, s_leaves, strict=True):
        if not isinstance(var, compat.Literal) and var not in inputs:
            old_of[var] = None if var in old_of else old

    env: dict[Any, Any] = {}

    def read(var):
        return var.val if isinstance(var, compat.Literal) else env[var]

    def write(var, value):
        old = old_of.get(var)
        env[var] = value if old is None else jax.lax.select(finite, value, old)

    for var, value in zip(jaxpr.constvars, closed.consts, strict=True):
        env[var] = value
    for var, value in zip(jaxpr.invars, g_leaves + s_leaves, strict=True):
        env[var] = value
    for eqn in jaxpr.eqns:
        with compat.eqn_context(eqn):
            out = compat.bind(eqn, [read(v) for v in eqn.invars])
        for var, value in zip(eqn.outvars, out, strict=True):
            write(var, value)

    outs = [read(var) for var in jaxpr.outvars]
    new_updates = jax.tree.unflatten(jax.tree.structure(u_shape), outs[:n_updates])
    new_state = []
    for var, value, old in zip(state_vars, outs[n_updates:], s_leaves, strict=True):
        done = not isinstance(var, compat.Literal) and old_of.get(var) is not None
        new_state.append(value if done else jax.lax.select(finite, jnp.asarray(value), old))
    return (
        _zero_unless(finite, new_updates),
        jax.tree.unflatten(jax.tree.structure(s_shape), new_state),
    )


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
    computed and discarded on a skipped step): under `jax.jit`, each new state
    leaf is selected where `inner` computes it, so the updates are computed from
    the selected state that is written anyway. Wrapping Adam then costs one extra
    read of the gradients, for the finiteness check, and nothing more (see
    BENCHMARKS.md).

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
    scale0 = (
        loss_scale_lib.DynamicLossScale(2.0**15)
        if loss_scale is None
        else loss_scale_lib.as_loss_scale(loss_scale)
    )

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
        new_updates, inner_state = _guarded_update(
            inner, finite, grads, state.inner_state, params, extra_args
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
