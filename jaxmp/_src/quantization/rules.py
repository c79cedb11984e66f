"""Running a function on quantised params: `jaxmp.quantized`, a rule set over the core.

``jaxmp.quantized(fun)(qparams, *args)`` traces the unmodified `fun` with each
`QuantizedArray` standing for an array of its original shape and dtype, and evaluates the
jaxpr with the shared re-interpretation core (`jaxmp._src.interpret`). A value is a plain
array or a `QuantizedArray` (a pytree: it crosses ``jit``, ``scan``, ``while`` and ``cond``
bodies as its values and scales, its contraction axes counted from the end so that a
scanned slice of a stacked weight keeps them). What each equation does with a quantised
operand:

* ``dot_general`` contracting the weight's contraction axes runs the recipe's kernel:
  weight-only int8 converts the weight to the dtype the matmul had inside the dot and scales
  the float32 output per output channel; `Int8DynamicActivations` quantises the other
  operand per row and runs int8 x int8 -> int32; `Float8Rowwise` E4M3 x E4M3 -> float32
  (on CPU, whose dot would widen FP8 operands to float32 copies, as bfloat16 x bfloat16 ->
  float32: the same products); `Int4WeightOnly` dequantises the weight into the matmul's
  dtype in one pass and accumulates in float32. No float32 copy of a weight is made.
* ``conv_general_dilated`` whose kernel (rhs) is quantised over its input-feature and spatial
  axes runs the same kernels as a convolution (`quantized_conv`): the weight-only recipes on
  the kernel, the dynamic ones on both operands, the activations with one scale per batch
  element (`quantize_conv_activations`), int8 x int8 -> int32 and E4M3 x E4M3 -> float32.
* ``convert_element_type`` to a floating dtype keeps the weight quantised (the dtype is
  recorded); so do ``transpose`` and ``rev`` (values and scales transposed or reversed: a
  transposed convolution's kernel), except for int4.
* ``jit``, ``scan``, ``while``, ``cond``, ``checkpoint`` and custom-rule functions are
  evaluated under these rules (custom JVP/VJP rules inlined: this is inference).
* Every other equation dequantises its quantised operands and runs as traced.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmp._src import compat, interpret
from jaxmp._src.quantization import recipes as q_lib

__all__ = ["Quantized", "quantized"]


def _dequantize(x: Any) -> Any:
    return x.dequantize() if q_lib.is_quantized(x) else x


def _to_output(
    scale: jax.Array, side: int, dimension_numbers: Any, ndims: tuple[int, int]
) -> jax.Array:
    """A keepdims scale of operand `side` (0: lhs, 1: rhs), laid out to broadcast against
    the ``dot_general`` output (batch axes, lhs free axes, rhs free axes)."""
    (lc, rc), (lb, rb) = dimension_numbers
    contract, batch = ((lc, lb), (rc, rb))[side]
    other_contract, other_batch = ((lc, lb), (rc, rb))[1 - side]
    ndim = ndims[side]
    free = [d for d in range(ndim) if d not in contract and d not in batch]
    n_other_free = ndims[1 - side] - len(other_contract) - len(other_batch)
    s = jnp.transpose(scale, (*batch, *free, *contract))
    kept = s.shape[: len(batch) + len(free)]
    ones = (1,) * n_other_free
    nb = len(batch)
    shape = (*kept, *ones) if side == 0 else (*kept[:nb], *ones, *kept[nb:])
    return s.reshape(shape)


def _fits(x: q_lib.QuantizedArray, dims: Sequence[int]) -> bool:
    ndim = x.ndim
    return tuple(sorted(d - ndim for d in dims)) == x.contract


def weight_side(dimension_numbers: Any, lhs: Any, rhs: Any) -> int | None:
    """Which operand of a ``dot_general`` is a quantised weight its kernel can run on: 1 (the
    rhs) or 0 (the lhs), the other one not quantised and the dot contracting the weight's
    contraction axes; None otherwise (both dequantised, as any other op's operands)."""
    (lc, rc), _ = dimension_numbers
    if q_lib.is_quantized(rhs) and not q_lib.is_quantized(lhs) and _fits(rhs, rc):
        return 1
    if q_lib.is_quantized(lhs) and not q_lib.is_quantized(rhs) and _fits(lhs, lc):
        return 0
    return None


def quantize_activations(
    x: jax.Array, side: int, dimension_numbers: Any, recipe: Any, act_scale: Any = None
) -> tuple[jax.Array, jax.Array]:
    """``(values, scales)`` of the activations `x` as the dynamic recipes' kernel reads them:
    one scale per row (each position of the axes the dot does not contract), `x` rounded on
    the recipe's grid. `side` is the weight's (`weight_side`); `act_scale` the weight's
    (`activation_scale`)."""
    (lc, rc), _ = dimension_numbers
    scale = activation_scale(x, (lc, rc)[1 - side], recipe, act_scale)
    return q_lib.quantize_values(x, scale, recipe), scale


def activation_scale(x: jax.Array, axes: Sequence[int], recipe: Any, act_scale: Any) -> jax.Array:
    """The scale of each row of activations `x` (`axes`, the contracted ones, kept with size
    1), by the weight's `QuantizedArray.act_scale`:

    * None: the row's absmax over `recipe.qmax` (`absmax_scale`), computed at run time;
    * a float array (`jaxmp.calibrate`'s): that static scale for every row, no amax taken;
      values beyond its range saturate at the grid's largest, and a row holding NaN or inf
      gets a NaN scale (made from its values), so that its outputs are NaN (never a finite
      number);
    * an integer array (while `jaxmp.calibrate` runs): the absmax scale, and the amax of
      the whole of `x` reported for the ids the array holds (`observing`).
    """
    if act_scale is None:
        return q_lib.absmax_scale(x, axes, recipe.qmax)
    dtype = q_lib.scale_dtype(x.dtype)
    if jnp.issubdtype(act_scale.dtype, jnp.integer):
        _report_amax(act_scale, q_lib.nan_max_abs(x.astype(dtype), range(x.ndim)).reshape(()))
        return q_lib.absmax_scale(x, axes, recipe.qmax)
    # One value, repeated over the output channels: the first (no reduction at run time).
    static = jnp.ravel(act_scale)[0].astype(dtype)
    # NaN for a row holding NaN or inf, made from its own values (0 * inf, 0 * NaN): no NaN
    # constant for jax_debug_nans to stop at where every value is finite.
    wide = x.astype(dtype)
    bad = jnp.sum(jnp.where(jnp.isfinite(wide), jnp.zeros_like(wide), wide), axes, keepdims=True)
    return static + bad * 0


# The calibration running, if any: ``record(site, ids, amax)`` and the sites traced so far.
_observer: contextvars.ContextVar[tuple[Callable[..., None], itertools.count[int]] | None] = (
    contextvars.ContextVar("jaxmp_calibration_observer", default=None)
)


@contextlib.contextmanager
def observing(record: Callable[[int, np.ndarray, np.ndarray], None]) -> Iterator[None]:
    """Within it, the functions `jaxmp.quantized` traces report the amax of the activations
    of each weight whose ``act_scale`` holds integer ids: ``record(site, ids, amax)`` on the
    host, `site` numbering the kernels in the order they were traced (a weight used by two
    matmuls reports from two sites)."""
    token = _observer.set((record, itertools.count()))
    try:
        yield
    finally:
        _observer.reset(token)


def _report_amax(ids: jax.Array, amax: jax.Array) -> None:
    observer = _observer.get()
    if observer is None:
        raise ValueError(
            "a QuantizedArray's act_scale holds integer ids outside jaxmp.calibrate; it must "
            "be None or a float array of static scales."
        )
    record, sites = observer
    jax.debug.callback(functools.partial(record, next(sites)), ids, amax)


def quantized_dot(
    x: jax.Array,
    w: q_lib.QuantizedArray,
    side: int,
    dimension_numbers: Any,
    precision: Any,
    out_dtype: Any,
) -> jax.Array:
    """The recipe's kernel for ``dot_general`` of activations `x` and quantised weight `w`.

    `side` is the weight's operand (1: ``dot_general(x, w)``, 0: ``dot_general(w, x)``,
    `weight_side`); `dimension_numbers` and `precision` are the traced dot's, `out_dtype`
    its output's dtype. `jaxmp.quantized` and `jaxmp.quantization_aware` run this one
    function, so that training and serving compute the same numbers.
    """
    dn = dimension_numbers
    x = jnp.asarray(x)
    ndims = (x.ndim, w.ndim) if side == 1 else (w.ndim, x.ndim)

    def dot(a: jax.Array, b: jax.Array, preferred: Any) -> jax.Array:
        operands = (b, a) if side == 0 else (a, b)  # a: the activations, b: the weight
        return _batch_first_dot(*operands, dn, precision, preferred)

    # Rescaled in float32, or float64 for a float64 matmul (its range).
    acc_dtype = q_lib.scale_dtype(out_dtype)
    recipe = w.recipe
    if isinstance(recipe, q_lib.Int4WeightOnly):
        # Dequantised into the matmul's dtype in one pass, read in the order it is stored,
        # accumulated in float32: with a transposed operand, or a bfloat16 output, XLA:CPU
        # widens the weight to a float32 copy.
        moved, axes = q_lib.dequantize_moved(w)
        (lc, rc), (lb, rb) = dn
        if side == 1:
            rc, rb = tuple(axes[d] for d in rc), tuple(axes[d] for d in rb)
        else:
            lc, lb = tuple(axes[d] for d in lc), tuple(axes[d] for d in lb)
        operands = (moved, x) if side == 0 else (x, moved)
        y = lax.dot_general(
            *operands, ((lc, rc), (lb, rb)), precision=precision, preferred_element_type=acc_dtype
        )
        return y.astype(out_dtype)
    w_scale = _to_output(w.scales, side, dn, ndims).astype(acc_dtype)
    if isinstance(recipe, q_lib.Int8WeightOnly):
        y = dot(x, w.values.astype(w.dtype), acc_dtype) * w_scale
        return y.astype(out_dtype)
    xq, x_scale = quantize_activations(x, side, dn, recipe, w.act_scale)
    if isinstance(recipe, q_lib.Int8DynamicActivations):
        acc = dot(xq, w.values, jnp.int32)
    else:
        acc = _fp8_product(dot, xq, w.values)
    y = acc.astype(acc_dtype) * _to_output(x_scale, 1 - side, dn, ndims).astype(acc_dtype)
    return (y * w_scale).astype(out_dtype)


def conv_kernel_fits(params: dict[str, Any], lhs: Any, rhs: Any) -> bool:
    """Whether a ``conv_general_dilated`` (its equation's `params`) of activations `lhs` and
    kernel `rhs` can run the recipe's kernel: `rhs` quantised over the convolution's
    contraction axes (the kernel's input-feature and spatial axes), `lhs` not quantised, no
    batch groups (the plan quantises no kernel of such a convolution)."""
    if not q_lib.is_quantized(rhs) or q_lib.is_quantized(lhs) or params["batch_group_count"] != 1:
        return False
    return _fits(rhs, params["dimension_numbers"].rhs_spec[1:])


def quantize_conv_activations(
    x: jax.Array, params: dict[str, Any], recipe: Any, act_scale: Any = None
) -> tuple[jax.Array, jax.Array]:
    """``(values, scales)`` of a convolution's activations (lhs) `x` as the dynamic recipes'
    kernel reads them: one absmax scale per batch element, `x` rounded on the recipe's grid.

    Per batch element because a scale comes out of a convolution's sum only where it is
    constant over every value that sum reads: the window of an output position reads every
    input feature (of its group) over a patch of positions, and the windows of neighbouring
    positions overlap, so a scale constant over each window is constant over the whole image.
    (A matmul's per-row scale is the same rule: the row is what one output reads.)
    """
    batch = params["dimension_numbers"].lhs_spec[0]
    axes = tuple(d for d in range(x.ndim) if d != batch)
    scale = activation_scale(x, axes, recipe, act_scale)
    return q_lib.quantize_values(x, scale, recipe), scale


def _along(scale: jax.Array, axis: int, ndim: int) -> jax.Array:
    """A scale of one value per position of one axis (the others of size 1), laid out to
    broadcast along axis `axis` of an array of `ndim` axes."""
    shape = [1] * ndim
    shape[axis] = -1
    return scale.reshape(shape)


def quantized_conv(x: jax.Array, w: q_lib.QuantizedArray, eqn: Any) -> jax.Array:
    """The recipe's kernel for convolution `eqn` (a ``conv_general_dilated``) of activations
    `x` and quantised kernel `w` (`conv_kernel_fits`).

    As `quantized_dot`: weight-only int8 converts the kernel to the convolution's dtype and
    scales the float32 output per output feature; int4 dequantises the kernel into the
    convolution's dtype in one pass, read as it is stored (the dimension numbers follow it),
    and accumulates in float32; the dynamic recipes quantise the activations
    (`quantize_conv_activations`) and run int8 x int8 -> int32 or E4M3 x E4M3 -> float32 (on
    CPU as bfloat16 x bfloat16), rescaled by the image's and the output feature's scales.
    `jaxmp.quantized` and `jaxmp.quantization_aware` run this one function. (On jax < 0.10
    the weight-only recipes convolve in float32: `compat.CONV_TRANSPOSE_NEEDS_ONE_DTYPE`.)
    """
    params = eqn.params
    dn = params["dimension_numbers"]
    out_dtype = eqn.outvars[0].aval.dtype
    acc_dtype = q_lib.scale_dtype(out_dtype)  # float32, float64 for a float64 convolution
    x = jnp.asarray(x)
    ndim = x.ndim

    def conv(a: jax.Array, b: jax.Array, preferred: Any, rhs_spec: Any = None) -> jax.Array:
        changes: dict[str, Any] = {"preferred_element_type": jnp.dtype(preferred)}
        if rhs_spec is not None:
            changes["dimension_numbers"] = dn._replace(rhs_spec=rhs_spec)
        (y,) = compat.bind(eqn, [a, b], {**params, **changes})
        return y  # type: ignore[no-any-return]

    def linear(x: jax.Array, kernel: jax.Array, rhs_spec: Any = None) -> jax.Array:
        # The weight-only recipes' convolution, linear in `x` and differentiated as it is.
        if compat.CONV_TRANSPOSE_NEEDS_ONE_DTYPE and x.dtype != acc_dtype:
            # Differentiable on jax < 0.10: the same products (those of float16 and bfloat16
            # values are exact in float32), the same float32 accumulation.
            x, kernel = x.astype(acc_dtype), kernel.astype(acc_dtype)
        return conv(x, kernel, acc_dtype, rhs_spec)

    recipe = w.recipe
    if isinstance(recipe, q_lib.Int4WeightOnly):
        moved, axes = q_lib.dequantize_moved(w)
        return linear(x, moved, tuple(axes[d] for d in dn.rhs_spec)).astype(out_dtype)
    # The kernel's scales: one per output feature (the other axes, contracted, of size 1).
    w_scale = _along(w.scales, dn.out_spec[1], ndim).astype(acc_dtype)
    if isinstance(recipe, q_lib.Int8WeightOnly):
        return (linear(x, w.values.astype(w.dtype)) * w_scale).astype(out_dtype)
    xq, x_scale = quantize_conv_activations(x, params, recipe, w.act_scale)
    if isinstance(recipe, q_lib.Int8DynamicActivations):
        acc = conv(xq, w.values, jnp.int32)
    else:
        acc = _fp8_product(conv, xq, w.values)
    y = acc.astype(acc_dtype) * _along(x_scale, dn.out_spec[0], ndim).astype(acc_dtype)
    return (y * w_scale).astype(out_dtype)


def _conv(eqn: Any, vals: list[Any]) -> list[Any]:
    if not conv_kernel_fits(eqn.params, *vals):
        return compat.bind(eqn, [_dequantize(v) for v in vals])
    return [quantized_conv(vals[0], vals[1], eqn)]


def _batch_first_dot(
    lhs: jax.Array, rhs: jax.Array, dn: Any, precision: Any, preferred: Any
) -> jax.Array:
    """``lax.dot_general(lhs, rhs, dn, ...)`` with each operand's batch axes moved first
    where they are not (the same result: a dot's output is its batch axes, then the free
    axes of each operand in order). XLA:CPU has no batched bfloat16 x bfloat16 -> float32
    dot for some layouts whose batch axes are not leading (a per-head weight)."""
    (lc, rc), (lb, rb) = dn

    def batch_first(x: jax.Array, contract: Any, batch: Any) -> tuple[jax.Array, tuple[int, ...]]:
        if tuple(batch) == tuple(range(len(batch))):
            return x, tuple(contract)
        perm = (*batch, *(d for d in range(x.ndim) if d not in batch))
        where = {d: i for i, d in enumerate(perm)}
        return lax.transpose(x, perm), tuple(where[d] for d in contract)

    lhs, lc = batch_first(lhs, lc, lb)
    rhs, rc = batch_first(rhs, rc, rb)
    leading = tuple(range(len(lb)))
    return lax.dot_general(
        lhs,
        rhs,
        ((lc, rc), (leading, leading)),
        precision=precision,
        preferred_element_type=preferred,
    )


def _dot(eqn: Any, vals: list[Any]) -> list[Any]:
    params = eqn.params
    dn = params["dimension_numbers"]
    side = weight_side(dn, *vals)
    if side is None:
        return compat.bind(eqn, [_dequantize(v) for v in vals])
    out_dtype = eqn.outvars[0].aval.dtype
    y = quantized_dot(vals[1 - side], vals[side], side, dn, params.get("precision"), out_dtype)
    return [y]


def _fp8_product(dot: Callable[..., jax.Array], xq: jax.Array, wq: jax.Array) -> jax.Array:
    """E4M3 x E4M3 with float32 accumulation: the FP8 GEMM where the backend has one; on CPU,
    whose dot widens FP8 operands to float32 copies, both in bfloat16 (exact: every E4M3
    value is a bfloat16 value, and their products float32 values)."""

    def native(a: jax.Array, b: jax.Array) -> jax.Array:
        return dot(a, b, jnp.float32)

    def widened(a: jax.Array, b: jax.Array) -> jax.Array:
        return dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), jnp.float32)

    return lax.platform_dependent(xq, wq, cpu=widened, default=native)


#: The layout ops a quantised weight goes through kept quantised (`_layout`).
LAYOUT_OPS = ("convert_element_type", "transpose", "rev")


def _layout(eqn: Any, x: q_lib.QuantizedArray) -> Any:
    """A ``convert_element_type``, ``transpose`` or ``rev`` of a quantised weight, kept
    quantised (None: dequantised)."""
    name = eqn.primitive.name
    if name == "convert_element_type":
        dtype = jnp.dtype(eqn.outvars[0].aval.dtype)
        if not q_lib.is_float_dtype(dtype):
            return None
        return dataclasses.replace(x, dtype=dtype)
    if isinstance(x.recipe, q_lib.Int4WeightOnly):
        return None  # its values are laid out by output channel and group: dequantised
    if name == "rev":  # the scales have the weight's axes (1 where contracted): reversed too
        dims = tuple(eqn.params["dimensions"])
        act = None if x.act_scale is None else lax.rev(x.act_scale, dims)
        return dataclasses.replace(
            x, values=lax.rev(x.values, dims), scales=lax.rev(x.scales, dims), act_scale=act
        )
    perm = tuple(eqn.params["permutation"])
    ndim = len(perm)
    old = {c + ndim for c in x.contract}
    contract = tuple(i - ndim for i, p in enumerate(perm) if p in old)
    sizes = tuple(x.values.shape[perm[i + ndim]] for i in contract)
    return q_lib.QuantizedArray(
        jnp.transpose(x.values, perm),
        jnp.transpose(x.scales, perm),
        x.recipe,
        x.dtype,
        contract,
        sizes,
        None if x.act_scale is None else jnp.transpose(x.act_scale, perm),
    )


class _QuantizedRules(interpret.Rules):
    """Values are arrays or `QuantizedArray`s (see the module docs)."""

    keep_custom_rules = False  # inference: custom JVP/VJP functions are evaluated inline

    def literal(self, value: Any) -> Any:
        return value

    def value(self, v: Any) -> Any:
        return _dequantize(v)

    def wrap(self, x: Any) -> Any:
        return x

    def apply(
        self, frame: Any, index: int, eqn: Any, vals: list[Any], interp: Any
    ) -> list[Any] | None:
        if not any(q_lib.is_quantized(v) for v in vals):
            return compat.bind(eqn, vals)
        name = eqn.primitive.name
        if name == "dot_general":
            return _dot(eqn, vals)
        if name == "conv_general_dilated":
            return _conv(eqn, vals)
        if name in LAYOUT_OPS:
            out = _layout(eqn, vals[0])
            if out is not None:
                return [out]
        elif compat.has_subjaxprs(eqn.params):
            outs = interp.higher_order(eqn, vals)
            if outs is not NotImplemented:
                return outs
        return compat.bind(eqn, [_dequantize(v) for v in vals])

    def fix(self, vals: list[Any], like: list[Any]) -> list[Any]:
        # A loop carry or branch output that was an array stays one.
        return [
            v if q_lib.is_quantized(s) else _dequantize(v) for v, s in zip(vals, like, strict=True)
        ]


def _split(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[interpret.ArgSpec, list[Any]]:
    leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=q_lib.is_quantized)

    def dynamic(x: Any) -> bool:
        return (
            q_lib.is_quantized(x)
            or isinstance(x, (jax.Array, np.ndarray, np.generic))
            or compat.is_tracer(x)
        )

    static = tuple((i, x) for i, x in enumerate(leaves) if not dynamic(x))
    return interpret.ArgSpec(treedef, static, len(leaves)), [x for x in leaves if dynamic(x)]


def _is_zero(x: Any) -> bool:
    return compat.is_symbolic_zero(x)


def _instantiate(tangent: Any, primal: Any) -> Any:
    """A symbolic zero tangent as an array of zeros (float0 for an integer primal)."""
    if not compat.is_symbolic_zero(tangent):
        return tangent
    if jnp.issubdtype(jnp.result_type(primal), jnp.inexact):
        return jnp.zeros_like(primal)
    return np.zeros(np.shape(primal), jax.dtypes.float0)


class Quantized:
    """The function `quantized` returns; call it like the wrapped function."""

    def __init__(self, fun: Callable[..., Any]):
        functools.update_wrapper(self, fun, updated=())
        self._fun = fun
        self._jitted = jax.jit(self._run, static_argnums=0)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        spec, dynamic = _split(args, kwargs)
        if spec.hashable() and not any(compat.is_tracer(x) for x in jax.tree.leaves(dynamic)):
            return self._jitted(spec, *dynamic)  # compiled once per argument signature
        return self._run(spec, *dynamic)

    def jaxpr(self, *args: Any, **kwargs: Any) -> Any:
        """The jaxpr that runs for these arguments (its matmuls are the recipes' kernels),
        without the `jax.custom_jvp` around it that refuses differentiation."""
        spec, dynamic = _split(args, kwargs)
        return jax.make_jaxpr(functools.partial(self._eval, spec))(*dynamic)

    def _run(self, spec: interpret.ArgSpec, *dynamic: Any) -> Any:
        run = jax.custom_jvp(functools.partial(self._eval, spec))
        run.defjvp(functools.partial(self._derivative, spec), symbolic_zeros=True)
        return run(*dynamic)

    def _derivative(self, spec: interpret.ArgSpec, primals: Any, tangents: Any) -> Any:
        """The derivative with respect to the arguments that are not quantised, the
        quantised weights constants: that of the quantised computation itself. Refused
        with respect to the quantised weights (rounding to their grid has no useful
        derivative) and through the dynamic recipes' quantised activations (that of
        rounding, zero almost everywhere). JAX calls this only when a tangent flows in."""
        weights = [q_lib.is_quantized(x) for x in primals]
        moving = [
            not all(compat.is_symbolic_zero(t) for t in jax.tree.leaves(t, is_leaf=_is_zero))
            for t in tangents
        ]
        if any(w and m for w, m in zip(weights, moving, strict=True)):
            raise TypeError(
                f"{self!r} cannot be differentiated with respect to its quantised weights: "
                "rounding to the quantised grid has no useful derivative. Train through the "
                "rounding with `jaxmp.quantization_aware` (a straight-through gradient), or "
                "differentiate the function with the unquantised params."
            )
        dynamic = sorted(
            {x.recipe.name for x, w in zip(primals, weights, strict=True) if w}
            & {q_lib.Int8DynamicActivations.name, q_lib.Float8Rowwise.name}
        )
        if dynamic:
            raise TypeError(
                f"{self!r} quantises the activations too ({', '.join(dynamic)}): its derivative "
                "with respect to the inputs would be that of rounding them. Use a weight-only "
                "recipe ('int8', 'int4'), whose derivative with respect to the inputs is "
                "exact, or train with `jaxmp.quantization_aware`."
            )
        free = [i for i, w in enumerate(weights) if not w]

        def of_the_rest(*rest: Any) -> Any:
            args = list(primals)
            for i, value in zip(free, rest, strict=True):
                args[i] = value
            return self._eval(spec, *args)

        rest_tangents = [
            jax.tree.map(_instantiate, tangents[i], primals[i], is_leaf=_is_zero) for i in free
        ]
        return jax.jvp(of_the_rest, [primals[i] for i in free], rest_tangents)

    def _eval(self, spec: interpret.ArgSpec, *dynamic: Any) -> Any:
        structs = [
            jax.ShapeDtypeStruct(x.shape, x.dtype) if q_lib.is_quantized(x) else x for x in dynamic
        ]
        traced = interpret.trace_call(self._fun, False, spec, structs)
        closed = traced.closed
        interp = interpret.Interpreter(_QuantizedRules())
        outs = interp.eval_jaxpr(closed.jaxpr, closed.consts, list(dynamic))
        return jax.tree.unflatten(traced.out_tree, [_dequantize(x) for x in outs])

    def __repr__(self) -> str:
        return f"jaxmp.quantized({getattr(self._fun, '__name__', repr(self._fun))})"


def quantized(fun: Callable[..., Any]) -> Quantized:
    """Runs `fun` on params from `jaxmp.quantize`: its matmuls use the quantised weights.

    The function is unmodified: it is traced with each `QuantizedArray` standing for an
    array of the original shape and dtype, and re-interpreted so that a matmul reading a
    quantised weight runs its recipe's kernel and any other use dequantises it (see the
    module docs). The model's own dtypes are kept: a bfloat16 model's weight-only matmuls
    run in bfloat16 with float32 accumulation, its outputs have the dtypes of the plain call.
    Arguments that are not quantised pass through unchanged. Outside a transformation each
    argument signature is traced and compiled once; it composes with `jax.jit`, `jax.vmap`
    and `lax.scan` (quantised params may be scanned over, a stack of layers sliced per step).
    With a weight-only recipe (int8, int4) it can be differentiated with respect to its
    other arguments (saliency maps, adversarial examples): the exact derivative of the
    quantised computation, the quantised weights constants. A derivative with respect to the
    quantised weights, or through the activations the dynamic recipes round (int8_dynamic,
    fp8), is a TypeError, never the silently wrong derivative of rounding: train through the
    rounding with `jaxmp.quantization_aware`.

    Args:
      fun: the function `jaxmp.quantize` was given.

    Returns:
      A callable with `fun`'s signature (`Quantized`).

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> def layer(p, x):
      ...     return x @ p["w"]
      >>> p = {"w": jnp.arange(12.0).reshape(3, 4) - 6}
      >>> q = jaxmp.quantize(layer, p, jnp.ones((2, 3)), recipe="int8_dynamic")
      >>> x = jnp.ones((2, 3))
      >>> y = jaxmp.quantized(layer)(q, x)  # int8 x int8 -> int32, rescaled
      >>> y.dtype, bool(jnp.abs(y - layer(p, x)).max() < 0.05)
      (dtype('float32'), True)
    """
    if not callable(fun):
        raise TypeError(f"`fun` must be callable, got {fun!r}.")
    return Quantized(fun)
