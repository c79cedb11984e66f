"""`value_and_grad` and `filter_value_and_grad`: gradients of the scaled loss, value of the
unscaled one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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


def is_inexact_array(x: Any) -> bool:
    """Whether `x` is a floating or complex array: what the filtered path differentiates
    (`equinox.is_inexact_array`)."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) and bool(
        jnp.issubdtype(x.dtype, jnp.inexact)
    )


def _differentiable(x: Any) -> bool:
    if isinstance(x, (float, complex)) and not isinstance(x, bool):
        return True
    return is_inexact_array(x)


def _check_differentiable(args: tuple[Any, ...], argnums: int | tuple[int, ...]) -> None:
    """A TypeError naming the first leaf of a differentiated argument that jax.grad refuses."""
    for argnum in (argnums,) if isinstance(argnums, int) else argnums:
        if argnum >= len(args):
            continue  # jax.value_and_grad reports it
        for path, leaf in jax.tree_util.tree_leaves_with_path(args[argnum]):
            if not _differentiable(leaf):
                what = (
                    f"an array of dtype {jnp.dtype(leaf.dtype)}"
                    if hasattr(leaf, "dtype") and hasattr(leaf, "shape")
                    else f"an object of type {type(leaf).__name__}"
                )
                raise TypeError(
                    f"`fun`'s argument {argnum} must hold only floating arrays to "
                    f"differentiate, got {what} at {jax.tree_util.keystr(path)}. For a "
                    "tree with other leaves (an Equinox module, integer counters), use "
                    "jaxmp.filter_value_and_grad, which differentiates the floating arrays "
                    "of its first argument only."
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
        _check_differentiable(args, argnums)
        scaled = scaled_loss_fn(fun, as_loss_scale_object(loss_scale), has_aux)
        grad_fn = jax.value_and_grad(scaled, argnums=argnums, has_aux=True)
        (_, value), grads = grad_fn(*args, **kwargs)
        return value, grads

    return g


def filter_value_and_grad(
    fun: Callable[..., Any], *, has_aux: bool = False
) -> Callable[..., tuple[Any, Any]]:
    """`jaxmp.value_and_grad` with Equinox's filtering (`equinox.filter_value_and_grad`).

    Returns ``g(loss_scale, x, *args, **kwargs) -> (value, grads)``. The gradients are
    taken with respect to the floating (and complex) arrays of the first positional
    argument `x`, such as an Equinox module, whatever its other leaves are (activation
    functions, integer arrays, Python scalars): `grads` has the structure of `x` with the
    gradients of ``loss_scale.scale(loss)`` at those arrays and None at every other leaf,
    as `equinox.filter_value_and_grad` gives, ready for the update of
    `jaxmp.mixed_precision` (initialise it with ``equinox.filter(model,
    equinox.is_inexact_array)``) and for `equinox.apply_updates`. `value` is `fun`'s own
    output, unscaled. Equinox itself is not needed.

    Args:
      fun: the loss function ``fun(x, *args, **kwargs)``; returns a scalar (or
        ``(scalar, aux)``).
      has_aux: whether `fun` returns ``(loss, aux)``.

    Returns:
      The function ``g``; `loss_scale` is a `LossScale` (as returned by
      `jaxmp.get_loss_scale`) or a scalar.

    Raises:
      TypeError: for a `fun` that is not callable or a `has_aux` that is not a bool; when
        ``g`` is called without the first positional argument.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> model = {"w": jnp.ones(2), "activation": jnp.tanh}
      >>> loss_fn = lambda m, x: jnp.sum(m["activation"](m["w"] * x))
      >>> loss, grads = jaxmp.filter_value_and_grad(loss_fn)(1024.0, model, jnp.zeros(2))
      >>> grads["w"], grads["activation"]
      (Array([0., 0.], dtype=float32), None)
    """
    if not callable(fun):
        raise TypeError(f"`fun` must be callable, got {fun!r}.")
    if not isinstance(has_aux, bool):
        raise TypeError(f"`has_aux` must be a bool, got {has_aux!r}.")

    def g(loss_scale, *args, **kwargs):
        if not args:
            raise TypeError(
                "jaxmp.filter_value_and_grad differentiates `fun`'s first positional "
                "argument: call it as g(loss_scale, x, *args), with x positional."
            )
        x, rest = args[0], args[1:]
        leaves, treedef = jax.tree.flatten(x)
        mask = [is_inexact_array(leaf) for leaf in leaves]
        diff = [leaf for leaf, m in zip(leaves, mask, strict=True) if m]
        scaled = scaled_loss_fn(fun, as_loss_scale_object(loss_scale), has_aux)

        def of_diff(diff, *rest, **kwargs):
            it = iter(diff)
            full = [next(it) if m else leaf for leaf, m in zip(leaves, mask, strict=True)]
            return scaled(jax.tree.unflatten(treedef, full), *rest, **kwargs)

        (_, value), diff_grads = jax.value_and_grad(of_diff, has_aux=True)(diff, *rest, **kwargs)
        it = iter(diff_grads)
        grads = jax.tree.unflatten(treedef, [next(it) if m else None for m in mask])
        return value, grads

    return g
