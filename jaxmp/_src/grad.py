"""`value_and_grad`: gradients of the scaled loss, value of the unscaled one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxmp._src import loss_scale as loss_scale_lib


def as_loss_scale_object(loss_scale: Any) -> loss_scale_lib.LossScale:
    """A `LossScale`, jmp loss scale, or a scalar float (as a static scale)."""
    if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
        return loss_scale_lib.StaticLossScale(float(loss_scale))
    if hasattr(loss_scale, "dtype") and jnp.shape(loss_scale) == ():
        return loss_scale_lib.StaticLossScale(loss_scale)
    return loss_scale_lib.as_loss_scale(loss_scale)


def scaled_loss_fn(
    fun: Callable[..., Any], scale: loss_scale_lib.LossScale, has_aux: bool
) -> Callable[..., tuple[jax.Array, Any]]:
    """Wraps a loss function to return ``(scale.scale(loss), fun's own output)``.

    Raises a TypeError at trace time, naming `fun`, when the loss is not a
    scalar or `has_aux` is set and `fun` does not return a pair.
    """

    def scaled(*args, **kwargs):
        out = fun(*args, **kwargs)
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(
                    "`fun` must return a pair (loss, aux) when has_aux=True, got "
                    f"{type(out).__name__}."
                )
            loss = out[0]
        else:
            loss = out
        if jnp.shape(loss) != ():
            raise TypeError(
                f"`fun` must return a scalar loss, got shape {jnp.shape(loss)}; reduce it "
                "(for example with .mean()) before returning."
            )
        return scale.scale(loss), out

    return scaled


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_argnums(argnums: Any) -> int | tuple[int, ...]:
    """`argnums` if it is an int or a non-empty sequence of distinct ints; else a TypeError."""
    if _is_int(argnums):
        return argnums
    if isinstance(argnums, Sequence) and not isinstance(argnums, str) and argnums:
        if all(_is_int(a) for a in argnums):
            if len(set(argnums)) != len(argnums):
                raise ValueError(f"`argnums` must not repeat an index, got {argnums!r}.")
            return tuple(argnums)
    raise TypeError(
        f"`argnums` must be an int or a non-empty sequence of ints (positions of the "
        f"arguments to differentiate), got {argnums!r}."
    )


def value_and_grad(
    fun: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable[..., tuple[Any, Any]]:
    """Like `jax.value_and_grad`, differentiating the loss multiplied by a loss scale.

    Returns ``g(loss_scale, *args, **kwargs) -> (value, grads)``: `value` is
    `fun`'s own output (the unscaled loss, or ``(loss, aux)`` with `has_aux`),
    `grads` are the gradients of ``loss_scale.scale(loss)`` (computed in float32),
    ready for the update of `jaxmp.loss_scaling` or `jaxmp.mixed_precision`,
    which unscales them.

    Args:
      fun: the loss function; returns a scalar (or ``(scalar, aux)``).
      argnums: which positional argument(s) of `fun` to differentiate.
      has_aux: whether `fun` returns ``(loss, aux)``.

    Returns:
      The function ``g``; `loss_scale` is a `LossScale` (as returned by
      `jaxmp.get_loss_scale`) or a scalar.

    Raises:
      TypeError / ValueError: naming the argument, for a `fun` that is not callable,
        `argnums` that are not ints and a `has_aux` that is not a bool.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> loss_fn = lambda w: jnp.sum(w.astype(jnp.float16) ** 2).astype(jnp.float32)
      >>> loss, grads = jaxmp.value_and_grad(loss_fn)(jaxmp.StaticLossScale(1024.0), jnp.ones(2))
      >>> loss, grads
      (Array(2., dtype=float32), Array([2048., 2048.], dtype=float32))
    """
    if not callable(fun):
        raise TypeError(f"`fun` must be callable, got {fun!r}.")
    argnums = _check_argnums(argnums)
    if not isinstance(has_aux, bool):
        raise TypeError(f"`has_aux` must be a bool, got {has_aux!r}.")

    def g(loss_scale, *args, **kwargs):
        scaled = scaled_loss_fn(fun, as_loss_scale_object(loss_scale), has_aux)
        grad_fn = jax.value_and_grad(scaled, argnums=argnums, has_aux=True)
        (_, value), grads = grad_fn(*args, **kwargs)
        return value, grads

    return g
