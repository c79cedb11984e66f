"""Finding jaxmp's loss-scaling state inside nested optimizer states."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxmp._src import dtypes
from jaxmp._src import loss_scale as loss_scale_lib
from jaxmp._src.compress_state import CompressStateState, decompressed
from jaxmp._src.kahan_summation import KahanSummationState
from jaxmp._src.loss_scaling import LossScalingState
from jaxmp._src.master_weights import MasterWeightsState
from jaxmp._src.stochastic_rounding import StochasticRoundingState

# The states of jaxmp's wrappers between `loss_scaling` and the optimizer.
PARAM_UPDATE_STATES = (MasterWeightsState, StochasticRoundingState, KahanSummationState)


def _unwrap(opt_state: Any) -> Any:
    # Train states (flax.training.train_state.TrainState) and NNX optimizers keep
    # the optax state in `.opt_state`; NNX wraps it in Variables with `.value`.
    if not isinstance(opt_state, tuple) and hasattr(opt_state, "opt_state"):
        opt_state = opt_state.opt_state
    return opt_state


def _is_variable(x: Any) -> bool:
    return type(x).__module__.startswith("flax.nnx") and hasattr(x, "get_value")


def find_loss_scaling_states(opt_state: Any) -> list[tuple[str, LossScalingState]]:
    """Returns every `LossScalingState` in `opt_state` with its tree path."""
    leaves = jax.tree_util.tree_flatten_with_path(
        _unwrap(opt_state), is_leaf=lambda x: isinstance(x, LossScalingState)
    )[0]
    return [
        (jax.tree_util.keystr(path), _strip_variables(leaf))
        for path, leaf in leaves
        if isinstance(leaf, LossScalingState)
    ]


def _strip_variables(tree: Any) -> Any:
    """Replaces NNX Variables (which `nnx.Optimizer` wraps state leaves in) by their values."""
    return jax.tree.map(
        lambda x: x.get_value() if _is_variable(x) else x, tree, is_leaf=_is_variable
    )


def loss_scaling_state(opt_state: Any) -> LossScalingState:
    """Returns the one `LossScalingState` inside `opt_state`.

    Raises:
      ValueError: if there is none (wrap the optimizer with `jaxmp.loss_scaling`
        or `jaxmp.mixed_precision`) or more than one.
    """
    found = find_loss_scaling_states(opt_state)
    if not found:
        raise ValueError(
            f"`opt_state` holds no jaxmp loss-scaling state (got {type(opt_state).__name__}); "
            "wrap the optimizer with `jaxmp.loss_scaling(tx)` or `jaxmp.mixed_precision(tx, "
            "policy)` and pass the state it initialises."
        )
    if len(found) > 1:
        raise ValueError(
            "`opt_state` holds more than one jaxmp loss-scaling state, at "
            f"{', '.join(path or '<root>' for path, _ in found)}; wrap the optimizer once."
        )
    return found[0][1]


def get_loss_scale(opt_state: Any) -> loss_scale_lib.LossScale:
    """Returns the current loss scale from anywhere inside an optimizer state.

    Works on the state of `loss_scaling` / `mixed_precision` nested in optax
    chains, `named_chain`, `partition` and the like, and on objects holding it
    in an ``opt_state`` attribute (Flax train states, NNX optimizers). Finding it
    is all this does: `loss_scaling` itself belongs outermost, followed at most by
    transformations of its updates, and by none when a master copy is kept
    (wrappers such as `optax.MultiSteps` or `optax.apply_if_finite` around it hide
    overflows from the scaler; see docs/reference/semantics.md, "Composition").

    Args:
      opt_state: an optimizer state, or an object with an ``opt_state``.

    Returns:
      The `LossScale` to scale the next loss with (its ``.loss_scale`` is the
      value as an array).

    Raises:
      ValueError: if the state holds no loss-scaling state (it says to wrap the
        optimizer with `jaxmp.loss_scaling`), or several.

    Example:
      >>> import jax.numpy as jnp, optax, jaxmp
      >>> tx = optax.chain(jaxmp.loss_scaling(optax.sgd(0.1)), optax.clip(1.0))
      >>> jaxmp.get_loss_scale(tx.init({"w": jnp.ones(2)})).loss_scale
      Array(32768., dtype=float32)
    """
    return loss_scaling_state(opt_state).loss_scale


def loss_scale_metrics(opt_state: Any) -> dict[str, jax.Array]:
    """Returns the loss-scaling metrics for logging, as a dict of scalar arrays.

    Keys: ``loss_scale`` (float32), ``grads_finite`` (bool, the last step's),
    ``skipped_steps`` and ``consecutive_skipped_steps`` (int32). All four have one
    shape: ``()`` for the state of one replica, and the leading axes of a stacked
    state (``flax.jax_utils.replicate`` for ``jax.pmap``) for each of them, also
    ``loss_scale`` where the scale is not an array of the state (`NoOpLossScale`, a
    concrete `StaticLossScale`), so ``metrics["loss_scale"][0]`` works whatever the
    policy.

    Example:
      >>> import jax.numpy as jnp, optax, jaxmp
      >>> state = jaxmp.loss_scaling(optax.sgd(0.1)).init({"w": jnp.ones(2)})
      >>> sorted(jaxmp.loss_scale_metrics(state))
      ['consecutive_skipped_steps', 'grads_finite', 'loss_scale', 'skipped_steps']
    """
    state = loss_scaling_state(opt_state)
    loss_scale = jnp.asarray(state.loss_scale.loss_scale).astype(jnp.float32)
    # A scale that is pytree metadata (no-op, concrete static) has no replica axis of its
    # own: give it the counters' shape (issue 29, Flax wmt's `metrics["loss_scale"][0]`).
    loss_scale = jnp.broadcast_to(loss_scale, jnp.shape(state.skipped_steps))
    return {
        "loss_scale": loss_scale,
        "grads_finite": state.grads_finite,
        "skipped_steps": state.skipped_steps,
        "consecutive_skipped_steps": state.consecutive_skipped_steps,
    }


def _unwrap_param_updates(state: Any) -> Any:
    """`state` without jaxmp's wrappers (other than `master_weights`), decompressed."""
    while True:
        if isinstance(state, (StochasticRoundingState, KahanSummationState)):
            state = state.inner_state
        elif isinstance(state, CompressStateState):
            state = decompressed(state)
        else:
            return state


def inner_state(opt_state: Any) -> Any:
    """Returns the state of the optimizer that `loss_scaling` / `mixed_precision` wraps.

    The ``inner_state`` of the `LossScalingState` inside `opt_state` and, when
    `master_weights`, `stochastic_rounding`, `kahan_summation` or `compress_state`
    sits in between (`mixed_precision` with half-precision params, or with
    compressed moments), that of each of them, decompressed: the state of the
    optax optimizer you passed, for the helpers that read it
    (`optax.contrib.schedule_free_eval_params`, `optax.tree.get`). The state of
    one of these wrappers without `loss_scaling` around it is looked through the
    same way.

    Raises:
      ValueError: as `get_loss_scale`, for a state that is neither.

    Example:
      >>> import jax.numpy as jnp, optax, jaxmp
      >>> tx = jaxmp.mixed_precision(optax.adam(1e-3), "p=f16,c=f16")
      >>> type(jaxmp.inner_state(tx.init({"w": jnp.ones(2)}))[0]).__name__
      'ScaleByAdamState'
    """
    wrappers = (*PARAM_UPDATE_STATES, CompressStateState)
    state = _unwrap(opt_state)
    if not isinstance(state, wrappers):
        state = loss_scaling_state(opt_state).inner_state
    while isinstance(state, wrappers):
        state = _unwrap_param_updates(state)
        if isinstance(state, MasterWeightsState):
            state = state.inner_state
    return state


def schedule_free_eval_params(opt_state: Any, params: Any) -> Any:
    """`optax.contrib.schedule_free_eval_params` through jaxmp's wrappers.

    With a master copy (`mixed_precision` with half-precision params), the
    evaluation params are computed from the float32 master copy and cast to each
    param's dtype; otherwise from `params`, as optax does (and cast to each param's
    dtype: without a master copy the optimizer's state is float32).

    Args:
      opt_state: the state of ``loss_scaling(schedule_free(...))`` or
        ``mixed_precision(schedule_free(...), policy)``, or an object holding it.
      params: the current params (they give the structure and the dtypes).

    Returns:
      The params to evaluate the model with, in the dtypes of `params`.

    Raises:
      ValueError: if `opt_state` holds no loss-scaling state, or the wrapped
        optimizer's state is not a ScheduleFreeState (optax's message).

    Example:
      >>> import jax.numpy as jnp, optax, jaxmp
      >>> tx = jaxmp.mixed_precision(optax.contrib.schedule_free_sgd(1.0), "p=f16,c=f16")
      >>> params = {"w": jnp.ones(2, jnp.float16)}
      >>> jaxmp.schedule_free_eval_params(tx.init(params), params)["w"].dtype
      dtype('float16')
    """
    from optax import contrib  # noqa: PLC0415 (optax.contrib is not imported by optax)

    state = _unwrap_param_updates(loss_scaling_state(opt_state).inner_state)
    if not isinstance(state, MasterWeightsState):
        # Without a master copy the optimizer's state is float32 (`loss_scaling` widens
        # half-precision params for it), and so are the evaluation params it gives.
        master = contrib.schedule_free_eval_params(state, params)
    else:
        master = contrib.schedule_free_eval_params(
            _unwrap_param_updates(state.inner_state), state.master
        )
    return jax.tree.map(
        lambda m, p: m.astype(p.dtype) if dtypes.is_floating(p) else p, master, params
    )
