"""Loss scales: no-op, static and dynamic (jmp-compatible, with bounds and hysteresis).

A loss scale multiplies the loss before differentiation so that small float16
gradients do not flush to zero, and divides the gradients afterwards. The
dynamic loss scale follows PyTorch GradScaler's growth-tracker rule (also
jmp's and Keras 3's): on the `period`-th consecutive finite step it grows by
`factor` and resets the counter; on a non-finite step it multiplies by
`backoff` (default ``1 / factor``) and resets the counter. Unlike PyTorch and
Keras, the result is always clamped to ``[min_loss_scale, max_loss_scale]``
(and to the largest finite power of two of the scale's dtype), so the scale is
never 0 or inf whatever the sequence of steps.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxmp._src import casting, dtypes

T = TypeVar("T")

_F32 = np.float32


def _as_array(x: Any, dtype: Any, *, arg: str, kind: str) -> Any:
    """Converts Python scalars to NumPy arrays; checks dtypes of array-likes.

    Leaves that are not arrays (tracers are arrays; `object()` and `None` appear
    when JAX rebuilds a pytree to inspect its structure) are returned unchanged,
    because this runs on every unflatten.
    """
    if isinstance(x, bool):
        raise TypeError(f"`{arg}` must be a {kind} number, got {x!r}.")
    if isinstance(x, (int, float)):
        with np.errstate(over="ignore"):  # out-of-range values become inf: reported as not finite
            return np.asarray(x, dtype)
    if hasattr(x, "dtype") and hasattr(x, "shape"):
        want = jnp.floating if kind == "floating-point" else jnp.integer
        try:
            ok = jnp.issubdtype(x.dtype, want)
        except TypeError:
            ok = False
        if not ok or jnp.shape(x) != ():
            raise TypeError(
                f"`{arg}` must be a scalar {kind} array, got dtype {x.dtype} and "
                f"shape {jnp.shape(x)}."
            )
    return x


def _check_positive_finite(value: Any, *, arg: str) -> None:
    if isinstance(value, np.ndarray) and not (np.isfinite(value) and value > 0):
        raise ValueError(f"`{arg}` must be finite and > 0, got {value}.")


def _scale_leaf(x: Any, factor: jax.Array) -> Any:
    if not dtypes.is_floating(x):
        return x
    dtype = dtypes.compute_dtype_of(x)
    return x.astype(dtype) * factor.astype(dtype)


def _register(cls: type[T]) -> type[T]:
    """Registers a frozen dataclass as a pytree, every field accounted for.

    Fields marked ``metadata=dict(static=True)`` are metadata, the rest are
    leaves, as with `jax.tree_util.register_dataclass`; the field lists come from
    `dataclasses.fields`, so no field can be left out (jmp 0.0.4 loses
    `min_loss_scale` that way). Unlike `register_dataclass`, unflattening does not
    call `__init__`: JAX rebuilds pytrees with placeholder leaves (`vmap`'s
    ``in_axes=0``, sharding trees, `object()`), which the constructor's checks
    and conversions must not see.
    """
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    data = tuple(f.name for f in fields if not f.metadata.get("static", False))
    meta = tuple(f.name for f in fields if f.metadata.get("static", False))

    def flatten_with_keys(x):
        children = tuple((jax.tree_util.GetAttrKey(n), getattr(x, n)) for n in data)
        return children, tuple(getattr(x, n) for n in meta)

    def flatten(x):
        return tuple(getattr(x, n) for n in data), tuple(getattr(x, n) for n in meta)

    def unflatten(aux, children):
        obj = object.__new__(cls)
        for name, value in zip(meta, aux, strict=True):
            object.__setattr__(obj, name, value)
        for name, value in zip(data, children, strict=True):
            object.__setattr__(obj, name, value)
        return obj

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    return cls


class LossScale(abc.ABC):
    """Base class of loss scales: `NoOpLossScale`, `StaticLossScale`, `DynamicLossScale`.

    Every loss scale is an immutable pytree with a float `loss_scale`, and three
    pure methods: `scale` (multiply floating leaves by the scale), `unscale`
    (multiply by its inverse) and `adjust` (the next loss scale given whether
    the gradients were finite).

    `scale` and `unscale` compute in float32 (float64 leaves stay float64):
    unscaling in float16 would flush the small gradients that loss scaling
    exists to preserve.
    """

    #: The current scale, a scalar float array.
    loss_scale: ArrayLike

    def scale(self, tree: T) -> T:
        """Multiplies floating-point leaves of `tree` by the loss scale, in float32."""
        factor = jnp.asarray(self.loss_scale)
        return jax.tree.map(lambda x: _scale_leaf(x, factor), tree)

    def unscale(self, tree: T) -> T:
        """Divides floating-point leaves of `tree` by the loss scale, in float32."""
        inv = 1.0 / jnp.asarray(self.loss_scale).astype(_F32)
        return jax.tree.map(lambda x: _scale_leaf(x, inv), tree)

    @abc.abstractmethod
    def adjust(self, grads_finite: ArrayLike) -> LossScale:
        """Returns the loss scale for the next step."""


@_register
@dataclasses.dataclass(frozen=True)
class NoOpLossScale(LossScale):
    """A loss scale of 1 that leaves values unchanged (for float32 and bfloat16).

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> jaxmp.NoOpLossScale().scale(jnp.float32(3.0))
      Array(3., dtype=float32)
    """

    @property
    def loss_scale(self) -> jax.Array:  # type: ignore[override]
        return jnp.ones((), _F32)

    def scale(self, tree: T) -> T:
        return tree

    def unscale(self, tree: T) -> T:
        return casting.widen_to_float32(tree)

    def adjust(self, grads_finite: ArrayLike) -> NoOpLossScale:
        del grads_finite
        return self


@_register
@dataclasses.dataclass(frozen=True)
class StaticLossScale(LossScale):
    """A fixed loss scale.

    Args:
      loss_scale: the scale, a positive finite float (stored as a float32 array
        when given as a Python number).

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> jaxmp.StaticLossScale(128.0).scale(jnp.float32(0.5))
      Array(64., dtype=float32)
    """

    loss_scale: ArrayLike  # shape=(), dtype=float32

    def __post_init__(self):
        value = _as_array(self.loss_scale, _F32, arg="loss_scale", kind="floating-point")
        _check_positive_finite(value, arg="loss_scale")
        object.__setattr__(self, "loss_scale", value)

    def adjust(self, grads_finite: ArrayLike) -> StaticLossScale:
        del grads_finite
        return self


def _largest_power_of_two(dtype: Any) -> float:
    """The largest power of two that `dtype` represents (2**15 for float16)."""
    return 2.0 ** math.floor(math.log2(float(jnp.finfo(dtype).max)))


@_register
@dataclasses.dataclass(frozen=True)
class DynamicLossScale(LossScale):
    """A loss scale that grows while gradients stay finite and backs off when they do not.

    The rule (PyTorch GradScaler's, jmp's and Keras 3's), applied by `adjust`:

    * finite step: ``counter += 1``; when ``counter == period``, the scale is
      multiplied by `factor` and `counter` resets to 0;
    * non-finite step: `counter` resets to 0 and, once `hysteresis` non-finite
      steps have come in a row, the scale is multiplied by `backoff`;
    * the scale is then clamped to ``[min_loss_scale, max_loss_scale]`` and to
      the largest power of two that its dtype represents (2**15 for a float16
      scale), so it is never 0, inf or NaN.

    With ``hysteresis=n`` the scale backs off on a non-finite step only when it
    is at least the n-th non-finite step in a row; any finite step resets that
    count. Megatron-LM and DeepSpeed also call their option "hysteresis", but
    their tracker is only refilled when the scale grows, so isolated overflows
    separated by finite steps add up there; here they do not.

    Every field survives `jax.jit`, `jax.tree.map` and flatten/unflatten: the
    configuration (period, factor, bounds, backoff, hysteresis) is static pytree
    metadata, and `loss_scale`, `counter` and `nonfinite_count` are array leaves.

    Args:
      loss_scale: the initial scale (a float, or a scalar float array; float16
        and bfloat16 scales are allowed and kept in their dtype).
      counter: consecutive finite steps since the last change (int32).
      period: finite steps between growths, >= 1.
      factor: growth factor, > 1.
      min_loss_scale: lower bound, > 0.
      max_loss_scale: upper bound, finite and >= `min_loss_scale`. The default,
        2**32, is Megatron-LM's.
      backoff: multiplier on overflow, in (0, 1); default ``1 / factor``.
      hysteresis: non-finite steps in a row before backing off, >= 1.
      nonfinite_count: consecutive non-finite steps so far (int32).

    Raises:
      ValueError / TypeError: naming the argument, for any value outside the
        ranges above.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> ls = jaxmp.DynamicLossScale(2.0**15, period=2)
      >>> ls = ls.adjust(jnp.array(True)).adjust(jnp.array(True))
      >>> ls.loss_scale
      Array(65536., dtype=float32)
      >>> ls.adjust(jnp.array(False)).loss_scale
      Array(32768., dtype=float32)
    """

    loss_scale: ArrayLike  # shape=(), dtype=float32 (or the given float dtype)
    counter: ArrayLike = dataclasses.field(  # shape=(), dtype=int32
        default_factory=lambda: np.zeros((), np.int32)
    )
    period: int = dataclasses.field(default=2000, metadata=dict(static=True))
    factor: float = dataclasses.field(default=2, metadata=dict(static=True))
    min_loss_scale: float = dataclasses.field(default=1.0, metadata=dict(static=True))
    _: dataclasses.KW_ONLY
    max_loss_scale: float = dataclasses.field(default=2.0**32, metadata=dict(static=True))
    backoff: float | None = dataclasses.field(default=None, metadata=dict(static=True))
    hysteresis: int = dataclasses.field(default=1, metadata=dict(static=True))
    nonfinite_count: ArrayLike = dataclasses.field(  # shape=(), dtype=int32
        default_factory=lambda: np.zeros((), np.int32)
    )

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        scale = _as_array(self.loss_scale, _F32, arg="loss_scale", kind="floating-point")
        _check_positive_finite(scale, arg="loss_scale")
        set_("loss_scale", scale)
        set_("counter", _as_array(self.counter, np.int32, arg="counter", kind="integer"))
        set_(
            "nonfinite_count",
            _as_array(self.nonfinite_count, np.int32, arg="nonfinite_count", kind="integer"),
        )
        # Static fields: normalised to Python numbers so they hash and compare by value
        # (a jnp array as a static field would make every jit a cache miss).
        if isinstance(self.period, bool) or not isinstance(self.period, (int, np.integer)):
            raise TypeError(f"`period` must be an int >= 1, got {self.period!r}.")
        if self.period < 1:
            raise ValueError(f"`period` must be an int >= 1, got {self.period!r}.")
        set_("period", int(self.period))
        if isinstance(self.hysteresis, bool) or not isinstance(self.hysteresis, (int, np.integer)):
            raise TypeError(f"`hysteresis` must be an int >= 1, got {self.hysteresis!r}.")
        if self.hysteresis < 1:
            raise ValueError(f"`hysteresis` must be an int >= 1, got {self.hysteresis!r}.")
        set_("hysteresis", int(self.hysteresis))
        factor = _python_float(self.factor, arg="factor")
        if not (math.isfinite(factor) and factor > 1):
            raise ValueError(f"`factor` must be a finite number > 1, got {self.factor!r}.")
        set_("factor", factor)
        backoff = (
            1.0 / factor if self.backoff is None else _python_float(self.backoff, arg="backoff")
        )
        if not 0 < backoff < 1:
            raise ValueError(f"`backoff` must be in (0, 1), got {self.backoff!r}.")
        set_("backoff", backoff)
        lo = _python_float(self.min_loss_scale, arg="min_loss_scale")
        hi = _python_float(self.max_loss_scale, arg="max_loss_scale")
        if not (math.isfinite(lo) and lo > 0):
            raise ValueError(
                f"`min_loss_scale` must be finite and > 0, got {self.min_loss_scale!r}."
            )
        if not (math.isfinite(hi) and hi >= lo):
            raise ValueError(
                f"`max_loss_scale` must be finite and >= min_loss_scale ({lo}), "
                f"got {self.max_loss_scale!r}."
            )
        set_("min_loss_scale", lo)
        set_("max_loss_scale", hi)

    def adjust(self, grads_finite: ArrayLike) -> DynamicLossScale:
        """Returns the next loss scale given whether this step's gradients were finite.

        Args:
          grads_finite: a scalar boolean.
        """
        from jaxmp._src.tree import check_scalar_bool  # noqa: PLC0415 (avoid import cycle)

        finite = check_scalar_bool(grads_finite, arg="grads_finite")
        scale = jnp.asarray(self.loss_scale)
        counter = jnp.asarray(self.counter)
        nonfinite = jnp.asarray(self.nonfinite_count)
        # Compute in float32 (powers of two stay exact), clamp, then go back to the
        # scale's own dtype; the clamp also keeps a float16 scale below 2**16 = inf.
        s32 = scale.astype(_F32)
        grow = counter + 1 >= self.period
        grown = jnp.where(grow, s32 * _F32(self.factor), s32)
        nonfinite_next = jnp.minimum(nonfinite + 1, self.hysteresis)
        backed_off = jnp.where(nonfinite_next >= self.hysteresis, s32 * _F32(self.backoff), s32)
        upper = min(self.max_loss_scale, _largest_power_of_two(scale.dtype))
        lower = max(self.min_loss_scale, float(jnp.finfo(scale.dtype).tiny))
        new_scale = jnp.clip(jnp.where(finite, grown, backed_off), _F32(lower), _F32(upper))
        return dataclasses.replace(
            self,
            loss_scale=new_scale.astype(scale.dtype),
            counter=jnp.where(finite & ~grow, counter + 1, 0).astype(counter.dtype),
            nonfinite_count=jnp.where(finite, 0, nonfinite_next).astype(nonfinite.dtype),
        )


def _python_float(value: Any, *, arg: str) -> float:
    if isinstance(value, bool):
        raise TypeError(f"`{arg}` must be a number, got {value!r}.")
    try:
        return float(value)
    except (TypeError, ValueError, jax.errors.ConcretizationTypeError):
        raise TypeError(f"`{arg}` must be a concrete Python number, got {value!r}.") from None


def as_loss_scale(value: Any, *, arg: str = "loss_scale") -> LossScale:
    """Converts jmp loss scales to jaxmp's and rejects anything that is not a loss scale."""
    if isinstance(value, LossScale):
        return value
    kind = type(value).__name__
    module = type(value).__module__ or ""
    if module.startswith("jmp"):
        if kind == "NoOpLossScale":
            return NoOpLossScale()
        if kind == "StaticLossScale":
            return StaticLossScale(value.loss_scale)
        if kind == "DynamicLossScale":
            return DynamicLossScale(
                value.loss_scale,
                value.counter,
                value.period,
                value.factor,
                float(np.asarray(value.min_loss_scale)),
            )
    raise TypeError(
        f"`{arg}` must be a jaxmp loss scale (NoOpLossScale, StaticLossScale or "
        f"DynamicLossScale) or None, got {value!r}."
    )
