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
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxmp._src import compat, dtypes

T = TypeVar("T")

_F32 = np.float32
_INT32_MAX = 2**31 - 1
_INT32_MAX_TEXT = "2**31 - 1"


def _show(value: Any) -> str:
    """What the user passed, for error messages: ``0.0 (float32 array)``, ``'2'``, ``None``.

    Concrete scalar arrays are shown by their value and dtype; long reprs are shortened.
    """
    if hasattr(value, "dtype") and jnp.shape(value) == ():
        array = _concrete(value)
        if array is not None:
            return f"{array.item()!r} ({np.dtype(array.dtype).name} array)"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}...{text[-8:]} ({type(value).__name__})"


def _concrete(x: Any) -> np.ndarray | None:
    """`x` as a NumPy array, or None when it is a tracer (its value is not known)."""
    if compat.is_tracer(x):
        # Checked first: the error `np.asarray` raises for a tracer describes where the
        # value came from, walking the whole program traced so far.
        return None
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _real_number(value: Any, *, arg: str, rule: str, warn_int: bool = False) -> float:
    """A concrete real number (Python, NumPy or a scalar array) as a Python float.

    Booleans, strings, complex numbers, ``None``, sequences and traced values are
    TypeErrors naming `arg`; so are arrays that are not scalars.
    """
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"`{arg}` must be {rule}, got {_show(value)}.")
    if isinstance(value, (int, float)):
        try:
            return float(value)
        except OverflowError:  # a Python int beyond float64: out of range, like inf
            return math.inf
    if not (hasattr(value, "dtype") and hasattr(value, "shape")):
        raise TypeError(f"`{arg}` must be {rule}, got {_show(value)} ({type(value).__name__}).")
    dtype = jnp.dtype(value.dtype)
    if jnp.shape(value) != () or not (
        jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
    ):
        raise TypeError(
            f"`{arg}` must be {rule}, got an array of dtype {dtype} and shape {jnp.shape(value)}."
        )
    array = _concrete(value)
    if array is None:
        raise TypeError(
            f"`{arg}` must be a concrete number (it is static configuration), got a traced "
            f"value {_show(value)}."
        )
    if warn_int and jnp.issubdtype(dtype, jnp.integer):
        # jmp's warning, word for word, so that code filtering it keeps working.
        warnings.warn(f"Expected floating type for {arg}, got {dtype}", stacklevel=4)
    return float(array)


def _int_option(value: Any, *, arg: str) -> int:
    """A static integer option in [1, 2**31 - 1] (it is compared with int32 counters)."""
    rule = f"an int in [1, {_INT32_MAX_TEXT}]"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"`{arg}` must be {rule}, got {_show(value)}.")
    if isinstance(value, (float, np.floating)):
        if not float(value).is_integer():  # 5.0 is 5 (jmp's tests pass period=5.)
            raise TypeError(f"`{arg}` must be {rule}, got {_show(value)}.")
        value = int(value)
    if not 1 <= int(value) <= _INT32_MAX:
        raise ValueError(f"`{arg}` must be {rule}, got {_show(value)}.")
    return int(value)


def _scale_dtype(value: Any, *, arg: str) -> np.dtype:
    """The dtype a loss scale keeps: float16, bfloat16 or float32 (float64 and ints: float32)."""
    rule = "a positive float or a scalar floating-point array"
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"`{arg}` must be {rule}, got {_show(value)}.")
    if isinstance(value, (int, float)):
        return jnp.dtype(_F32)
    if not (hasattr(value, "dtype") and hasattr(value, "shape")):
        raise TypeError(f"`{arg}` must be {rule}, got {_show(value)} ({type(value).__name__}).")
    dtype = jnp.dtype(value.dtype)
    if jnp.shape(value) != () or not (
        jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
    ):
        raise TypeError(
            f"`{arg}` must be {rule}, got an array of dtype {dtype} and shape {jnp.shape(value)}."
        )
    if jnp.issubdtype(dtype, jnp.integer):
        # jmp warns and goes on; so does jaxmp, converting to float32.
        warnings.warn(
            f"Expected floating type for {arg}, got {dtype}; using float32.", stacklevel=5
        )
        return jnp.dtype(_F32)
    return dtype if dtype.itemsize <= 4 else jnp.dtype(_F32)


def _scale_range(dtype: Any) -> tuple[float, float]:
    """Loss scales `dtype` holds with scale and 1 / scale finite: [smallest normal, max]."""
    info = jnp.finfo(dtype)
    return float(info.tiny), float(info.max)


def _check_scale(
    value: Any, *, arg: str, lo: float, hi: float, bounds: str, keep_arrays: bool = True
) -> Any:
    """Validates a loss scale value: a concrete one must lie in [lo, hi]; a traced one is clamped.

    Returns a concrete value as a NumPy array in the scale's dtype, or unchanged if it is
    already a jax array of that dtype and `keep_arrays`; a traced one as a jax array.
    NaN, which no clamp removes, becomes 1 (then clamped), so no scale is ever NaN.
    """
    dtype = _scale_dtype(value, arg=arg)
    array = _concrete(value) if not isinstance(value, (int, float)) else None
    if isinstance(value, (int, float)) or array is not None:
        number = _real_number(value, arg=arg, rule="a positive float")
        if not (math.isfinite(number) and lo <= number <= hi):
            raise ValueError(f"`{arg}` must be a finite number in {bounds}, got {_show(value)}.")
        with np.errstate(over="ignore", under="ignore"):
            stored = np.asarray(number, dtype)
        if not (lo <= float(stored) <= hi):  # rounding to `dtype` left the range
            raise ValueError(
                f"`{arg}` must be a finite number in {bounds}, got {_show(value)} "
                f"({float(stored)} in {dtype})."
            )
        if keep_arrays and isinstance(value, jax.Array) and jnp.dtype(value.dtype) == dtype:
            return value
        return stored
    traced = jnp.asarray(value).astype(dtype)
    one = jnp.clip(jnp.ones((), _F32), _F32(lo), _F32(hi))
    clamped = jnp.clip(traced.astype(_F32), _F32(lo), _F32(hi))
    return jnp.where(jnp.isnan(clamped), one, clamped).astype(dtype)


def _check_count(value: Any, *, arg: str, upper: int) -> Any:
    """A counter in [0, upper]: a concrete one is checked, a traced one is clamped (int32)."""
    rule = f"an int in [0, {upper}]"
    if isinstance(value, (bool, np.bool_)) or not (
        isinstance(value, int) or (hasattr(value, "dtype") and hasattr(value, "shape"))
    ):
        raise TypeError(f"`{arg}` must be {rule}, got {_show(value)}.")
    if not isinstance(value, int):
        dtype = jnp.dtype(value.dtype)
        if jnp.shape(value) != () or not jnp.issubdtype(dtype, jnp.integer):
            raise TypeError(
                f"`{arg}` must be {rule} (a scalar integer array), got dtype {dtype} and "
                f"shape {jnp.shape(value)}."
            )
    array = _concrete(value) if not isinstance(value, int) else np.asarray(value)
    if array is None:
        return jnp.clip(jnp.asarray(value), 0, upper).astype(np.int32)
    if not 0 <= int(array) <= upper:
        raise ValueError(f"`{arg}` must be {rule}, got {_show(value)}.")
    if isinstance(value, int) or jnp.dtype(value.dtype) != np.int32:
        return np.asarray(int(array), np.int32)
    return value


def _scale_leaf(x: Any, factor: jax.Array) -> Any:
    if not dtypes.is_floating(x):
        return x
    dtype = dtypes.compute_dtype_of(x)
    return x.astype(dtype) * factor.astype(dtype)


def _unscale_leaf(x: Any, inv: jax.Array) -> Any:
    if not dtypes.is_floating(x):
        return x
    dtype = dtypes.compute_dtype_of(x)
    return (x.astype(dtype) * inv.astype(dtype)).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class _FrozenArray:
    """A concrete NumPy scalar as hashable pytree metadata (treedefs hash their metadata)."""

    data: bytes
    dtype: str

    @classmethod
    def of(cls, value: Any) -> Any:
        if isinstance(value, (np.ndarray, np.generic)):
            array = np.asarray(value)
            return cls(array.tobytes(), array.dtype.str)
        return value

    def thaw(self) -> np.ndarray:
        return np.frombuffer(self.data, np.dtype(self.dtype)).reshape(())


def _thaw(value: Any) -> Any:
    return value.thaw() if isinstance(value, _FrozenArray) else value


def _register(leaf_names: Callable[[Any], tuple[str, ...]]) -> Callable[[type[T]], type[T]]:
    """Registers a frozen dataclass as a pytree, every field accounted for.

    `leaf_names(obj)` says which fields are leaves; every other field is static
    metadata (concrete NumPy values frozen to hashable bytes). The names travel in
    the treedef, so unflattening restores each field by name: no field can be left
    out (jmp 0.0.4 loses `min_loss_scale` that way). Unflattening does not call
    `__init__`: JAX rebuilds pytrees with placeholder leaves (`vmap`'s
    ``in_axes=0``, sharding trees, `object()`), which the constructor's checks and
    conversions must not see.
    """

    def register(cls: type[T]) -> type[T]:
        names = tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

        def split(x):
            data = leaf_names(x)
            meta = tuple((n, _FrozenArray.of(getattr(x, n))) for n in names if n not in data)
            return data, meta

        def flatten_with_keys(x):
            data, meta = split(x)
            keyed = tuple((jax.tree_util.GetAttrKey(n), getattr(x, n)) for n in data)
            return keyed, (data, meta)

        def flatten(x):
            data, meta = split(x)
            return tuple(getattr(x, n) for n in data), (data, meta)

        def unflatten(aux, children):
            data, meta = aux
            obj = object.__new__(cls)
            for name, value in meta:
                object.__setattr__(obj, name, _thaw(value))
            for name, value in zip(data, children, strict=True):
                object.__setattr__(obj, name, value)
            return obj

        jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
        return cls

    return register


class LossScale(abc.ABC):
    """Base class of loss scales: `NoOpLossScale`, `StaticLossScale`, `DynamicLossScale`.

    Every loss scale is an immutable pytree with a float `loss_scale`, and three
    pure methods: `scale` (multiply floating leaves by the scale), `unscale`
    (multiply by its inverse) and `adjust` (the next loss scale given whether
    the gradients were finite).

    `scale` computes in float32 (float64 leaves stay float64) and returns
    float32 leaves, so a scaled float16 loss cannot overflow. `unscale`
    computes in float32 too (unscaling in float16 would flush the small
    gradients that loss scaling exists to preserve) and, as jmp does, gives
    each leaf back in its own dtype. `jaxmp.loss_scaling` does not use
    `unscale`: it widens the gradients to at least float32 and keeps them so.
    """

    #: The current scale, a scalar float array.
    loss_scale: ArrayLike

    def scale(self, tree: T) -> T:
        """Multiplies floating-point leaves of `tree` by the loss scale, in float32."""
        factor = jnp.asarray(self.loss_scale)
        return jax.tree.map(lambda x: _scale_leaf(x, factor), tree)

    def unscale(self, tree: T) -> T:
        """Divides floating-point leaves of `tree` by the loss scale, in float32.

        Each leaf keeps its dtype (jmp's behaviour); the product is computed in
        float32, so a float16 gradient of 2**10 under a scale of 2**30 becomes
        2**-20, not the 0 that float16 arithmetic would give.
        """
        inv = 1.0 / jnp.asarray(self.loss_scale).astype(_F32)
        return jax.tree.map(lambda x: _unscale_leaf(x, inv), tree)

    @abc.abstractmethod
    def adjust(self, grads_finite: ArrayLike) -> LossScale:
        """Returns the loss scale for the next step."""


@_register(lambda x: ())
@dataclasses.dataclass(frozen=True)
class NoOpLossScale(LossScale):
    """A loss scale of 1 that leaves values unchanged (for float32 and bfloat16).

    `scale` and `unscale` return their argument itself, as jmp's do.

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
        return tree

    def adjust(self, grads_finite: ArrayLike) -> NoOpLossScale:
        del grads_finite
        return self


def _static_leaves(x: Any) -> tuple[str, ...]:
    # A concrete scale is metadata (jmp's StaticLossScale has no leaves, so it can be
    # a static `jax.jit` argument); one made under a trace is a leaf.
    return () if isinstance(x.loss_scale, (np.ndarray, np.generic)) else ("loss_scale",)


def _range_text(dtype: Any) -> str:
    """``"float16's normal range [6.1035156e-05, 65504.0]"``: the scales `dtype` holds."""
    lo, hi = _scale_range(dtype)
    return f"{np.dtype(dtype).name}'s normal range [{str(np.float32(lo))}, {str(np.float32(hi))}]"


@_register(_static_leaves)
@dataclasses.dataclass(frozen=True, eq=False)
class StaticLossScale(LossScale):
    """A fixed loss scale.

    A concrete scale is static pytree metadata, so a `StaticLossScale` has no
    leaves, hashes by value and can be a static `jax.jit` argument (as in
    jmp); one built from a traced value is a leaf.

    Args:
      loss_scale: the scale: a Python number or a scalar float16, bfloat16 or
        float32 array (kept in its dtype; Python numbers and integer arrays
        become float32, integer arrays with a warning), at least the smallest
        normal number of its dtype and at most its largest finite value. A
        traced value cannot be checked: NaN becomes 1 and the rest is clamped
        into that range.

    Raises:
      TypeError: naming `loss_scale`, for a value that is not a real number
        (strings, None, sequences, complex, bool, arrays that are not scalars).
      ValueError: naming `loss_scale`, for a number outside the range above
        (0, negative, inf, NaN, 1e-45 in float32).

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> jaxmp.StaticLossScale(128.0).scale(jnp.float32(0.5))
      Array(64., dtype=float32)
    """

    loss_scale: ArrayLike  # shape=(), dtype=float32 (or the given float dtype)

    def __post_init__(self):
        dtype = _scale_dtype(self.loss_scale, arg="loss_scale")
        lo, hi = _scale_range(dtype)
        value = _check_scale(
            self.loss_scale,
            arg="loss_scale",
            lo=lo,
            hi=hi,
            bounds=_range_text(dtype),
            keep_arrays=False,  # concrete: static metadata, as a NumPy scalar
        )
        object.__setattr__(self, "loss_scale", value)

    def _key(self) -> Any:
        if isinstance(self.loss_scale, (np.ndarray, np.generic)):
            return (float(self.loss_scale), np.dtype(self.loss_scale.dtype).name)
        return id(self)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._key() == other._key()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), self._key()))

    def __repr__(self) -> str:
        return f"StaticLossScale({self.loss_scale!r})"

    def adjust(self, grads_finite: ArrayLike) -> StaticLossScale:
        del grads_finite
        return self


def _largest_power_of_two(dtype: Any) -> float:
    """The largest power of two that `dtype` represents (2**15 for float16)."""
    return 2.0 ** math.floor(math.log2(float(jnp.finfo(dtype).max)))


def _dynamic_leaves(x: Any) -> tuple[str, ...]:
    # jmp's DynamicLossScale flattens to exactly [loss_scale, counter]; the count of
    # non-finite steps in a row is a leaf only when hysteresis needs it (with
    # hysteresis=1 it is always 0).
    if x.hysteresis == 1:
        return ("loss_scale", "counter")
    return ("loss_scale", "counter", "nonfinite_count")


@_register(_dynamic_leaves)
@dataclasses.dataclass(frozen=True)
class DynamicLossScale(LossScale):
    """A loss scale that grows while gradients stay finite and backs off when they do not.

    The rule (PyTorch GradScaler's, jmp's and Keras 3's), applied by `adjust`:

    * finite step: ``counter += 1``; when ``counter == period``, the scale is
      multiplied by `factor` and `counter` resets to 0;
    * non-finite step: `counter` resets to 0 and, once `hysteresis` non-finite
      steps have come in a row, the scale is multiplied by `backoff`;
    * the scale is then clamped to ``[min_loss_scale, max_loss_scale]``, to the
      largest power of two that its dtype represents (2**15 for a float16
      scale) and to the smallest normal number of its dtype (so a
      ``min_loss_scale`` of 0, jmp's "no floor", still never reaches 0). A NaN
      scale (one put in by hand or by a tree map) is taken as 1 before the rule
      runs. So `adjust` never returns a scale of 0, inf or NaN.

    With ``hysteresis=n`` the scale backs off on a non-finite step only when it
    is at least the n-th non-finite step in a row; any finite step resets that
    count. Megatron-LM and DeepSpeed also call their option "hysteresis", but
    their tracker is only refilled when the scale grows, so isolated overflows
    separated by finite steps add up there; here they do not.

    Every field survives `jax.jit`, `jax.tree.map` and flatten/unflatten: the
    configuration (period, factor, bounds, backoff, hysteresis) is static pytree
    metadata; `loss_scale` and `counter` are the leaves (as in jmp), and
    `nonfinite_count` is a third one when ``hysteresis > 1``.

    Every argument is checked when the object is built; the error names the
    argument, the value and the valid range. Values traced under `jax.jit`
    (`loss_scale`, `counter`, `nonfinite_count`) cannot be checked there: NaN
    becomes 1, and they are clamped into their ranges.

    Args:
      loss_scale: the initial scale (a Python number, or a scalar float16,
        bfloat16 or float32 array, kept in its dtype; integer arrays become
        float32 with a warning), within the bounds below.
      counter: consecutive finite steps since the last change, an int in
        ``[0, period - 1]``.
      period: finite steps between growths, an int in ``[1, 2**31 - 1]``.
      factor: growth factor, > 1 and at most float32's largest value.
      min_loss_scale: lower bound, >= 0 (0 means no floor other than the
        smallest normal number of the scale's dtype).
      max_loss_scale: upper bound, finite, > 0 and >= `min_loss_scale`. The
        default, 2**32, is Megatron-LM's.
      backoff: multiplier on overflow, in ``[2**-126, 1)``; default
        ``1 / factor``.
      hysteresis: non-finite steps in a row before backing off, an int in
        ``[1, 2**31 - 1]``.
      nonfinite_count: consecutive non-finite steps so far, an int in
        ``[0, hysteresis - 1]`` (it saturates at ``hysteresis - 1``; with
        ``hysteresis=1`` it is always 0).

    Raises:
      TypeError: naming the argument, for a value of the wrong type (strings,
        None, complex, bool, non-integral counts, traced configuration).
      ValueError: naming the argument, for a value outside its range; also for
        an initial `loss_scale` outside ``[min_loss_scale, max_loss_scale]``.

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
    period: int = 2000
    factor: float = 2
    min_loss_scale: float = 1.0
    _: dataclasses.KW_ONLY
    max_loss_scale: float = 2.0**32
    backoff: float | None = None
    hysteresis: int = 1
    nonfinite_count: ArrayLike = dataclasses.field(  # shape=(), dtype=int32
        default_factory=lambda: np.zeros((), np.int32)
    )

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        # Static fields: normalised to Python numbers so they hash and compare by value
        # (a jnp array as a static field would make every jit a cache miss).
        set_("period", _int_option(self.period, arg="period"))
        set_("hysteresis", _int_option(self.hysteresis, arg="hysteresis"))
        f32_max = float(np.finfo(_F32).max)
        factor = _real_number(self.factor, arg="factor", rule="a number > 1")
        if not (math.isfinite(factor) and 1 < factor <= f32_max):
            raise ValueError(
                f"`factor` must be a finite number in (1, {str(np.float32(f32_max))}] (float32 "
                f"holds it), got {_show(self.factor)}."
            )
        set_("factor", factor)
        tiny = float(np.finfo(_F32).tiny)
        if self.backoff is None:
            backoff = 1.0 / factor
        else:
            backoff = _real_number(self.backoff, arg="backoff", rule="a number in (0, 1)")
        if not tiny <= backoff < 1:
            raise ValueError(
                f"`backoff` must be a number in [{str(np.float32(tiny))}, 1) (float32 holds it), "
                f"got {_show(self.backoff)}."
            )
        set_("backoff", backoff)
        lo = _real_number(
            self.min_loss_scale, arg="min_loss_scale", rule="a number >= 0", warn_int=True
        )
        if not (math.isfinite(lo) and lo >= 0):
            raise ValueError(
                f"`min_loss_scale` must be a finite number >= 0, got {_show(self.min_loss_scale)}."
            )
        hi = _real_number(self.max_loss_scale, arg="max_loss_scale", rule="a number > 0")
        if not (math.isfinite(hi) and hi > 0 and hi >= lo):
            raise ValueError(
                f"`max_loss_scale` must be a finite number > 0 and >= min_loss_scale ({lo}), "
                f"got {_show(self.max_loss_scale)}."
            )
        set_("min_loss_scale", lo)
        set_("max_loss_scale", hi)
        dtype = _scale_dtype(self.loss_scale, arg="loss_scale")
        lower, upper = self._bounds(dtype)
        set_(
            "loss_scale",
            _check_scale(
                self.loss_scale,
                arg="loss_scale",
                lo=lower,
                hi=upper,
                bounds=(
                    f"[min_loss_scale, max_loss_scale] = [{lower!r}, {upper!r}] within "
                    f"{_range_text(dtype)}"
                ),
            ),
        )
        set_("counter", _check_count(self.counter, arg="counter", upper=self.period - 1))
        set_(
            "nonfinite_count",
            _check_count(self.nonfinite_count, arg="nonfinite_count", upper=self.hysteresis - 1),
        )

    def _bounds(self, dtype: Any) -> tuple[float, float]:
        """The scales this object can hold in `dtype`: its bounds within the dtype's range."""
        tiny, _ = _scale_range(dtype)
        lower = max(self.min_loss_scale, tiny)
        upper = min(self.max_loss_scale, _largest_power_of_two(dtype))
        return lower, max(lower, upper)

    def adjust(self, grads_finite: ArrayLike) -> DynamicLossScale:
        """Returns the next loss scale given whether this step's gradients were finite.

        Args:
          grads_finite: a scalar boolean.
        """
        from jaxmp._src.tree import check_scalar_bool  # noqa: PLC0415 (avoid import cycle)

        finite = check_scalar_bool(grads_finite, arg="grads_finite")
        scale = jnp.asarray(self.loss_scale)
        counter = jnp.asarray(self.counter)
        lower, upper = self._bounds(scale.dtype)
        # Compute in float32 (powers of two stay exact), clamp, then go back to the
        # scale's own dtype; the clamp also keeps a float16 scale below 2**16 = inf.
        s32 = scale.astype(_F32)
        s32 = jnp.where(jnp.isnan(s32), _F32(min(max(1.0, lower), upper)), s32)
        grow = counter + 1 >= self.period
        grown = jnp.where(grow, s32 * _F32(self.factor), s32)
        if self.hysteresis == 1:
            backed_off = s32 * _F32(self.backoff)
            nonfinite_count = self.nonfinite_count
        else:
            # The count saturates at hysteresis - 1: from there on every non-finite
            # step in the run backs off.
            nonfinite = jnp.asarray(self.nonfinite_count)
            backed_off = jnp.where(nonfinite + 1 >= self.hysteresis, s32 * _F32(self.backoff), s32)
            nonfinite_next = jnp.minimum(nonfinite + 1, self.hysteresis - 1)
            nonfinite_count = jnp.where(finite, 0, nonfinite_next).astype(nonfinite.dtype)
        new_scale = jnp.clip(jnp.where(finite, grown, backed_off), _F32(lower), _F32(upper))
        return dataclasses.replace(
            self,
            loss_scale=new_scale.astype(scale.dtype),
            counter=jnp.where(finite & ~grow, counter + 1, 0).astype(counter.dtype),
            nonfinite_count=nonfinite_count,
        )


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
