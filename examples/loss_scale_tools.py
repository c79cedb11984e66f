"""Loss-scale helpers shared by the examples: how a scale is printed, and a first-step check.

`check_gradients_are_scaled` catches the one mistake that loss scaling cannot report by itself:
gradients computed with `jax.grad(loss_fn)` instead of
``jaxmp.value_and_grad(loss_fn)(loss_scale, ...)``. The optimizer divides every gradient by the
loss scale, so unscaled gradients train silently with updates 2^15 times too small (less with
Adam, which partly normalises them away). Nothing in one step's numbers shows it, but doubling the
loss scale does: the gradients of the scaled loss double, those of the unscaled loss do not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def describe_scale(scale: float) -> str:
    """A loss scale as a power of two when it is one (``2^15``), else in ``%g`` form."""
    scale = float(scale)
    if scale > 0 and math.isfinite(scale) and math.log2(scale).is_integer():
        return f"2^{int(math.log2(scale))}"
    return f"{scale:g}"


def grad_norm(grads: Any) -> jax.Array:
    """The global L2 norm of `grads`, computed in float32 (a float16 sum of squares overflows)."""
    leaves = [jnp.asarray(g, jnp.float32) for g in jax.tree.leaves(grads)]
    return jnp.sqrt(sum(jnp.sum(g * g) for g in leaves))


class LossScalingError(RuntimeError):
    """A train step whose gradients do not follow the loss scale."""


def with_loss_scale(opt_state: Any, value: float) -> Any | None:
    """`opt_state` with its dynamic loss scale set to `value`; None if it has no such array.

    The loss scale of a `jaxmp.DynamicLossScale` is an array in the state (the leaf
    ``<LossScalingState>.loss_scale.loss_scale``), so a compiled train step runs at another scale
    without recompiling. Static and no-op loss scales are compile-time constants.
    """
    found = []

    def replace(path, leaf):
        names = [getattr(key, "name", None) for key in path[-2:]]
        if names != ["loss_scale", "loss_scale"]:
            return leaf
        found.append(path)
        new = jnp.asarray(value, leaf.dtype)
        sharding = getattr(leaf, "sharding", None)
        return new if sharding is None else jax.device_put(new, sharding)

    new_state = jax.tree_util.tree_map_with_path(replace, opt_state)
    return new_state if len(found) == 1 else None


def check_gradients_are_scaled(
    grad_norm_at: Callable[[Any], Any], opt_state: Any, *, tolerance: float = 0.05
) -> float | None:
    """Raises `LossScalingError` unless a train step's gradients are proportional to the scale.

    Runs the step twice, at loss scales 1 and 2: the gradient norm must double. This costs two
    executions of the compiled step and no compilation; call it once, before training.

    Args:
      grad_norm_at: runs the train step from an optimizer state and returns the global norm of
        the gradients it passes to ``tx.update`` (`grad_norm`).
      opt_state: the optimizer state before the first step.
      tolerance: allowed relative deviation of the ratio from 2 (half-precision rounding of
        tiny gradients differs slightly between the two scales).

    Returns:
      The measured ratio, or None when nothing could be checked: the loss scale is not a
      dynamic one, or a gradient norm is zero or not finite.

    Raises:
      LossScalingError: naming the fix, when the ratio is 1 (gradients of the unscaled loss),
        4 (the loss scaled twice) or anything else but 2.
    """
    states = [with_loss_scale(opt_state, scale) for scale in (1.0, 2.0)]
    if states[0] is None:
        return None
    low, high = (float(grad_norm_at(state)) for state in states)
    if not (math.isfinite(low) and math.isfinite(high) and low > 0):
        return None
    ratio = high / low
    if abs(ratio / 2 - 1) <= tolerance:
        return ratio
    fix = (
        "compute them with `jaxmp.value_and_grad(loss_fn)(loss_scale, ...)`, where "
        "`loss_scale = jaxmp.get_loss_scale(opt_state)`"
    )
    if abs(ratio - 1) <= tolerance:
        problem = (
            "come from the unscaled loss (`jax.grad`?), and the optimizer divides them by the "
            "loss scale, so every update would be that many times too small"
        )
    elif abs(ratio / 4 - 1) <= tolerance:
        problem = "come from a loss scaled twice"
    else:
        problem = "are not proportional to the loss scale"
    raise LossScalingError(
        f"the train step's gradients changed by x{ratio:.3g} when the loss scale doubled "
        f"(expected x2): they {problem}; {fix}."
    )
