"""Quantization-aware training: `jaxmp.quantization_aware`, a rule set over the core.

``jaxmp.quantization_aware(fun, recipe=...)(params, *args)`` runs, in the forward pass, the
program `jaxmp.quantized` runs on ``jaxmp.quantize(fun, params, *args)``: the same plan of
which leaves are matmul weights (`jaxmp._src.quantization.plan`), each weight quantised by
the same code (`jaxmp._src.quantization.leaf`), inside the traced program, and each matmul
reading one run by the same kernel (`rules.quantized_dot`). What it adds is the derivative.

Each quantised weight is carried through the jaxpr as a `_Master`: the float weight (the
master copy the optimizer updates, seen through the same ``convert_element_type`` and
``transpose`` as its quantised form) beside its quantised form. A matmul reading one runs the
kernel on the quantised form, inside a `jax.custom_jvp` whose tangent is

* with respect to the weight, the straight-through estimator (STE): the derivative of the
  float matmul of the activations the kernel reads (the activations themselves for the
  weight-only recipes, their rounded rows for the dynamic ones) with the weight, as if
  rounding to the grid were the identity, and zero for a weight the grid clips (int4's scale
  may leave a group's largest values outside its range; the absmax scales clip nothing), as
  TensorFlow's and PyTorch's fake quantisation do: a clipped weight's value no longer moves
  the output, and a gradient would only push it further out;
* with respect to the activations, the exact derivative of the kernel for the weight-only
  recipes (the weight is then a constant: the kernel is linear in the activations), and for
  the dynamic recipes, whose kernel rounds the activations too, the straight-through one:
  the float matmul with the dequantised weight.

Any other use of a quantised weight (one `jaxmp.quantized` would dequantise) reads its
dequantised value, with a straight-through derivative. Everything else is the traced
function's own equations, differentiated by JAX.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxmp._src import compat, interpret
from jaxmp._src.patterns import compile_exclude
from jaxmp._src.quantization import leaf as leaf_lib
from jaxmp._src.quantization import plan as plan_lib
from jaxmp._src.quantization import recipes as q_lib
from jaxmp._src.quantization import rules as rules_lib

__all__ = ["QuantizationAware", "quantization_aware"]


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["w", "q", "unclipped"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class _Master:
    """A quantised weight in training: the float weight `w` and its quantised form `q`
    (computed from ``stop_gradient(w)``), both in the layout the program has reached, and
    where `w` lies within its grid's range (None: everywhere)."""

    w: jax.Array
    q: q_lib.QuantizedArray
    unclipped: jax.Array | None = None


def _unclipped(w: jax.Array, q: q_lib.QuantizedArray) -> jax.Array | None:
    """Where weight `w` rounds into its grid's range, not clipped: None for the absmax scales
    (``|w / scale| <= qmax``); for int4, whose scale may clip a group's largest values."""
    if not isinstance(q.recipe, q_lib.Int4WeightOnly):
        return None
    # Each value's scale, laid out as the weight: a weight of ones with `q`'s scales.
    ones = jnp.ones((*q.values.shape[:-1], 2 * q.values.shape[-1]), jnp.int8)
    step = dataclasses.replace(q, values=q_lib.pack_int4(ones)).dequantize(q.scales.dtype)
    r = jnp.round(w.astype(step.dtype) / step)  # as `int4_search` rounds, before clipping
    return (r >= -8) & (r <= 7)


def _masked(tangent: jax.Array, unclipped: jax.Array | None) -> jax.Array:
    if unclipped is None:
        return tangent
    return jnp.where(unclipped, tangent, jnp.zeros_like(tangent))


def _is_master(x: Any) -> bool:
    return isinstance(x, _Master)


@jax.custom_jvp
def _straight_through(w: jax.Array, served: jax.Array, unclipped: Any) -> jax.Array:
    """`served` (the dequantised weight), differentiated as `w` where `unclipped`."""
    del w, unclipped
    return served


@_straight_through.defjvp
def _straight_through_jvp(primals: Any, tangents: Any) -> tuple[jax.Array, jax.Array]:
    return primals[1], _masked(tangents[0], primals[2])


def _plain(v: Any) -> Any:
    """A value as an array: a quantised weight dequantised, its derivative straight through."""
    if not _is_master(v):
        return v
    return _straight_through(v.w, v.q.dequantize(), v.unclipped)


def _read_activations(x: jax.Array, recipe: Any, quantize: Callable[..., Any]) -> jax.Array:
    """The activations the recipe's kernel reads, in `x`'s dtype: `x` for the weight-only
    recipes; for the dynamic ones, `x` rounded on their grid by ``quantize(x)`` (``(values,
    scales)``: per row for a matmul, per image for a convolution) and scaled back."""
    if isinstance(recipe, (q_lib.Int8WeightOnly, q_lib.Int4WeightOnly)):
        return x
    xq, scale = quantize(x)
    return (xq.astype(scale.dtype) * scale).astype(x.dtype)


def _dot(eqn: Any, vals: list[Any]) -> list[Any]:
    dn = eqn.params["dimension_numbers"]
    side = rules_lib.weight_side(dn, *[v.q if _is_master(v) else v for v in vals])
    if side is None:
        return compat.bind(eqn, [_plain(v) for v in vals])
    precision = eqn.params.get("precision")
    out_dtype = eqn.outvars[0].aval.dtype

    def kernel(x: jax.Array, q: q_lib.QuantizedArray) -> jax.Array:
        return rules_lib.quantized_dot(x, q, side, dn, precision, out_dtype)

    def quantize(x: jax.Array, recipe: Any) -> Any:
        return rules_lib.quantize_activations(x, side, dn, recipe)

    return _through_kernel(eqn, vals, side, kernel, quantize)


def _conv(eqn: Any, vals: list[Any]) -> list[Any]:
    lhs, rhs = vals
    fits = _is_master(rhs) and rules_lib.conv_kernel_fits(
        eqn.params, lhs.q if _is_master(lhs) else lhs, rhs.q
    )
    if not fits:
        return compat.bind(eqn, [_plain(v) for v in vals])

    def kernel(x: jax.Array, q: q_lib.QuantizedArray) -> jax.Array:
        return rules_lib.quantized_conv(x, q, eqn)

    def quantize(x: jax.Array, recipe: Any) -> Any:
        return rules_lib.quantize_conv_activations(x, eqn.params, recipe)

    return _through_kernel(eqn, vals, 1, kernel, quantize)


def _through_kernel(
    eqn: Any,
    vals: list[Any],
    side: int,
    kernel: Callable[[jax.Array, q_lib.QuantizedArray], jax.Array],
    quantize: Callable[[jax.Array, Any], Any],
) -> list[Any]:
    """Matmul or convolution `eqn` of activations and the quantised weight ``vals[side]`` (a
    `_Master`): ``kernel(x, q)``, the served kernel, in the forward pass, differentiated as
    the module docs say (``quantize(x, recipe)``: the activations as the dynamic recipes'
    kernel rounds them)."""
    master: _Master = vals[side]
    recipe = master.q.recipe
    weight_only = isinstance(recipe, (q_lib.Int8WeightOnly, q_lib.Int4WeightOnly))

    def float_op(x: jax.Array, w: jax.Array) -> jax.Array:
        # The traced matmul or convolution itself (its dtypes, precision and output type).
        (y,) = compat.bind(eqn, [w, x] if side == 0 else [x, w])
        return y  # type: ignore[no-any-return]

    @jax.custom_jvp
    def op(x: jax.Array, w: jax.Array, q: q_lib.QuantizedArray, unclipped: Any) -> jax.Array:
        del w, unclipped
        return kernel(x, q)

    def op_jvp(primals: Any, tangents: Any) -> tuple[jax.Array, jax.Array]:
        x, w, q, unclipped = primals
        dx, dw, _, _ = tangents  # q is computed from stop_gradient(w): no tangent of its own
        y = kernel(x, q)
        terms = []
        if not compat.is_symbolic_zero(dx):
            if weight_only:  # the kernel is linear in x: its own derivative
                terms.append(jax.jvp(lambda x: kernel(x, q), (x,), (dx,))[1])
            else:  # rounded activations: straight through, onto the dequantised weight
                terms.append(float_op(dx, q.dequantize()))
        if not compat.is_symbolic_zero(dw):  # the weight: straight through
            read = _read_activations(x, recipe, lambda x: quantize(x, recipe))
            terms.append(float_op(read, _masked(dw, unclipped)))
        if not terms:
            return y, jnp.zeros_like(y)
        dy = terms[0] if len(terms) == 1 else terms[0] + terms[1]
        return y, dy.astype(y.dtype)

    op.defjvp(op_jvp, symbolic_zeros=True)
    return [op(jnp.asarray(vals[1 - side]), master.w, master.q, master.unclipped)]


class _QuantizationAwareRules(interpret.Rules):
    """Values are arrays or `_Master`s (see the module docs)."""

    # Custom-derivative functions a quantised weight reaches are evaluated inline (their
    # matmuls run the kernels, as in `jaxmp.quantized`, differentiated as above); those it
    # does not reach are bound as they are, their rules kept (`apply`).
    keep_custom_rules = False

    def literal(self, value: Any) -> Any:
        return value

    def value(self, v: Any) -> Any:
        return _plain(v)

    def wrap(self, x: Any) -> Any:
        return x

    def apply(
        self, frame: Any, index: int, eqn: Any, vals: list[Any], interp: Any
    ) -> list[Any] | None:
        if not any(_is_master(v) for v in vals):
            return compat.bind(eqn, vals)
        name = eqn.primitive.name
        if name == "dot_general":
            return _dot(eqn, vals)
        if name == "conv_general_dilated":
            return _conv(eqn, vals)
        if name in rules_lib.LAYOUT_OPS:
            master = vals[0]
            q = rules_lib._layout(eqn, master.q)  # as `jaxmp.quantized` lays it out
            if q is not None:
                (w,) = compat.bind(eqn, [master.w])
                unclipped = master.unclipped
                if unclipped is not None and name != "convert_element_type":
                    (unclipped,) = compat.bind(eqn, [unclipped])  # transposed or reversed
                return [_Master(w, q, unclipped)]
        elif compat.has_subjaxprs(eqn.params):
            outs = interp.higher_order(eqn, vals)
            if outs is not NotImplemented:
                return outs  # type: ignore[no-any-return]
        return compat.bind(eqn, [_plain(v) for v in vals])

    def fix(self, vals: list[Any], like: list[Any]) -> list[Any]:
        # A loop carry or branch output that was an array stays one.
        return [v if _is_master(s) else _plain(v) for v, s in zip(vals, like, strict=True)]


class QuantizationAware:
    """The function `quantization_aware` returns; call it like the wrapped function.

    Attributes:
      recipe: the recipe (an object, also when given by name).
      exclude: the exclude patterns, a tuple of strings.
    """

    def __init__(self, fun: Callable[..., Any], recipe: Any, exclude: Any = ()):
        functools.update_wrapper(self, fun, updated=())
        self._fun = fun
        self.recipe = q_lib.get_recipe(recipe)
        self.exclude = tuple(p.pattern for p in compile_exclude(exclude, "exclude"))
        self._jitted = jax.jit(self._run, static_argnums=0)

    def __call__(self, params: Any, *args: Any, **kwargs: Any) -> Any:
        spec, dynamic = interpret.split_args((params, *args), kwargs)
        if spec.hashable() and not any(compat.is_tracer(x) for x in dynamic):
            return self._jitted(spec, *dynamic)  # compiled once per argument signature
        return self._run(spec, *dynamic)

    def quantize(self, params: Any, *example_args: Any, **example_kwargs: Any) -> Any:
        """`jaxmp.quantize` of `params` with this function, recipe and exclude patterns:
        the params that `jaxmp.quantized` then serves with the numerics trained with."""
        return plan_lib.quantize(
            self._fun,
            params,
            *example_args,
            recipe=self.recipe,
            exclude=self.exclude,
            **example_kwargs,
        )

    def _run(self, spec: interpret.ArgSpec, *dynamic: Any) -> Any:
        (params, *args), kwargs = spec.merge(dynamic)
        _, leaves, _, decisions = plan_lib._plan(
            self._fun, params, tuple(args), kwargs, self.recipe, self.exclude
        )
        # The params' leaves come first among the call's (`split_args` flattens
        # ``((params, *args), kwargs)``); the static ones are not among `dynamic`.
        static = {i for i, _ in spec.static}
        position = {}
        k = 0
        for i in range(spec.num_leaves):
            if i not in static:
                position[i] = k
                k += 1
        values = list(dynamic)
        for d in decisions:
            if d.contract is not None:
                w = leaves[d.index]
                q = leaf_lib.quantize_array(lax.stop_gradient(w), d.contract, self.recipe)
                unclipped = _unclipped(lax.stop_gradient(w), q)
                values[position[d.index]] = _Master(w, q, unclipped)
        traced = interpret.trace_call(self._fun, False, spec, dynamic)
        closed = traced.closed
        interp = interpret.Interpreter(_QuantizationAwareRules())
        outs = interp.eval_jaxpr(closed.jaxpr, closed.consts, values)
        return jax.tree.unflatten(traced.out_tree, [_plain(x) for x in outs])

    def __repr__(self) -> str:
        name = getattr(self._fun, "__name__", repr(self._fun))
        exclude = f", exclude={self.exclude!r}" if self.exclude else ""
        return f"jaxmp.quantization_aware({name}, recipe={self.recipe!r}{exclude})"


def quantization_aware(
    fun: Callable[..., Any], *, recipe: Any, exclude: Any = ()
) -> QuantizationAware:
    """Trains `fun` with the numerics `jaxmp.quantized` serves: quantization-aware training.

    ``quantization_aware(fun, recipe=r)(params, *args)`` computes, in the forward pass, what
    ``jaxmp.quantized(fun)(jaxmp.quantize(fun, params, *args, recipe=r), *args)`` computes,
    bit for bit: the same leaves are matmul weights or convolution kernels
    (`jaxmp.quantization_plan`, the same `exclude` patterns), quantised by the same code
    inside the traced program at every call, and their matmuls and convolutions run the same
    kernels (int8 x int8 -> int32 for `"int8_dynamic"`, E4M3 x E4M3 for `"fp8"`, the int4
    weight dequantised into the matmul's dtype, ...); bit for bit as tested on jaxlib 0.12.0
    and 0.12.1, eager and under `jax.jit` (the XLA:CPU of jaxlib 0.8, fusing a weight's
    quantisation into its matmul, may round the last bit of some outputs differently).
    `params` stay float (the master copy the optimizer updates); the model learns around the
    rounding it will be served with, and `jaxmp.quantize` of the trained params serves
    exactly what was trained (`QuantizationAware.quantize` takes the same recipe and exclude
    patterns).

    The derivative of rounding to a grid is zero almost everywhere, so a quantised weight's
    gradient is the straight-through estimator (STE, Bengio et al. 2013, "Estimating or
    Propagating Gradients Through Stochastic Neurons for Conditional Computation"): rounding
    is differentiated as if it were the identity, the gradient of the float matmul of the
    activations the kernel reads with the weight, applied to the float weight, as in
    quantization-aware training by Jacob et al. 2018 ("Quantization and Training of Neural
    Networks for Efficient Integer-Arithmetic-Only Inference"); a weight outside the grid's
    range (clipped by an int4 scale below its group's largest value) gets no gradient, as
    TensorFlow's and PyTorch's fake quantisation give none. The weight-only recipes
    (`"int8"`, `"int4"`) leave the activations unrounded: the derivative with respect to
    them, and to anything else, is the exact derivative of the quantised forward. The
    dynamic recipes (`"int8_dynamic"`, `"fp8"`) round each row of the activations too, and
    the derivative with respect to them is straight-through as well (the float matmul with
    the dequantised weight), as torchao's QAT fake-quantises activations.

    It composes with `jax.jit`, `jax.grad`, `jax.jvp`, `jax.vmap`, `lax.scan` (a stack of
    layers scanned over, each layer its own scales), `jax.checkpoint`, loss scaling
    (`jaxmp.value_and_grad`, `jaxmp.mixed_precision`: the scaled gradient flows through the
    estimator, and a step whose gradients are not finite is skipped) and `jaxmp.autocast`
    (``quantization_aware(jaxmp.autocast(fun, policy), ...)`` is served as
    ``jaxmp.quantized(jaxmp.autocast(fun, policy))``; autocast around it re-interprets the
    kernels' matmuls too, under its policy, and is not the served program). A NaN or inf in
    the activations or a
    weight gives non-finite outputs wherever the float model's are (`jaxmp.quantize` refuses
    such a weight by name; a traced one cannot be refused).

    Args:
      fun: the model function, ``fun(params, *args, **kwargs)``, as given to
        `jaxmp.quantize`: Linen's ``model.apply``, a function of an Equinox module, or one
        that merges an NNX module's state (``nnx.merge(graphdef, state)(x)``).
      recipe: `Int8WeightOnly`, `Int8DynamicActivations`, `Float8Rowwise`,
        `Int4WeightOnly`, or the name of one: ``"int8"``, ``"int8_dynamic"``, ``"fp8"``,
        ``"int4"``.
      exclude: regexes of param paths kept in float, as in `jaxmp.quantize` (a pattern that
        matches no floating leaf is an error when the function is first called).

    Returns:
      A callable with `fun`'s signature (`QuantizationAware`).

    Raises:
      ValueError: for an unknown recipe name or an invalid regex (at once); for an exclude
        pattern matching no leaf, or params already quantised, when called.
      TypeError: for a `fun` that is not callable, a recipe or exclude of the wrong type.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmp
      >>> def layer(p, x):
      ...     return x @ p["w"]
      >>> p = {"w": jnp.arange(12.0).reshape(3, 4) - 6}
      >>> x = jnp.ones((2, 3))
      >>> qat = jaxmp.quantization_aware(layer, recipe="int8_dynamic")
      >>> y = qat(p, x)  # the int8 x int8 -> int32 matmul the served model runs
      >>> served = jaxmp.quantized(layer)(qat.quantize(p, x), x)
      >>> bool((y == served).all())
      True
      >>> jax.grad(lambda p: qat(p, x).sum())(p)["w"]  # straight through: x^T @ ones
      Array([[2., 2., 2., 2.],
             [2., 2., 2., 2.],
             [2., 2., 2., 2.]], dtype=float32)
    """
    if not callable(fun):
        raise TypeError(f"`fun` must be callable, got {fun!r}.")
    return QuantizationAware(fun, recipe, exclude)
