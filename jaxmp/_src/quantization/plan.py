"""Which leaves of a model's params are matmul weights or convolution kernels, and quantising
them: `quantize`.

Which leaves of the params are matmul weights comes from how the function uses them, not
from their names: `quantize` traces ``fun(params, *example_args)`` and follows each param
leaf through the jaxpr (into ``jit``, ``scan``, ``while``, ``cond``, ``checkpoint`` and
custom-rule bodies, and through ``convert_element_type``, ``transpose`` and ``rev``) to the
``dot_general`` and ``conv_general_dilated`` equations that read it. A leaf every use of which
is an operand of a ``dot_general`` contracting the same axes is a matmul weight: those axes
are its contraction axes, every other axis (the stacked layers of a scanned leaf included) an
output channel. A leaf every use of which is the kernel (rhs) of a ``conv_general_dilated``
is a convolution kernel: its input-feature and spatial axes (``dimension_numbers.rhs_spec``)
are its contraction axes, its output-feature axis an output channel, as for a matmul (each
output feature of a grouped or depthwise convolution contracts its own kernel slice: one
scale per output feature covers it). A convolution with ``batch_group_count > 1`` (the form
JAX gives the kernel gradient of a grouped convolution, not a layer's) leaves its kernel alone.
Each is then quantised leaf by leaf (`jaxmp._src.quantization.leaf`), in slices where it is
large, where it lives; the recipes and `QuantizedArray` are in
`jaxmp._src.quantization.recipes`, running a function on the result in
`jaxmp._src.quantization.rules`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxmp._src import compat, interpret
from jaxmp._src.display import QuantizationPlan
from jaxmp._src.patterns import compile_exclude
from jaxmp._src.quantization import leaf as leaf_lib
from jaxmp._src.quantization.recipes import (
    Int4WeightOnly,
    Recipe,
    get_recipe,
    is_float_dtype,
    is_quantized,
)

__all__ = ["QuantizedLeaf", "quantization_plan", "quantize"]


# --------------------------------------------------------------------------------------------
# Which leaves are matmul weights.


class QuantizedLeaf(NamedTuple):
    """One floating leaf of the params under `quantize` (`jaxmp.quantization_plan`).

    Attributes:
      path: its path, the string ``exclude`` patterns are searched in (``"params/fc/kernel"``).
      quantized: whether it is quantised.
      reason: why or why not (``"matmul weight, contracted over axes (0,)"``,
        ``"convolution kernel, contracted over axes (0, 1, 2)"``, ``"excluded by 'head'"``,
        ``"also used by gather"``, ...).
    """

    path: str
    quantized: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class _Origin:
    """A jaxpr value that is a param leaf seen through layout ops: axis i of the value is
    axis ``axes[i]`` of the leaf; None after a layout op whose axes are not followed
    (`_RESHAPING`, named in `after`), which only tells what the leaf is used for."""

    leaf: int
    axes: tuple[int, ...] | None
    after: tuple[str, ...] = ()


# Call-like primitives whose body takes the equation's operands one to one, and the parameter
# holding the body.
_CALLS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
}
_SAME_LAYOUT = frozenset({"convert_element_type", "copy", "copy_p"})
# Layout ops followed to the op that uses their result, for `quantization_plan`'s reason (a
# Flax bias is reshaped, then added): a leaf seen through one is not a matmul weight.
_RESHAPING = frozenset({"reshape", "broadcast_in_dim", "squeeze", "expand_dims", "slice"})
# Uses of a leaf by a convolution that leave it unquantised.
_CONV_INPUT = "conv_general_dilated lhs"
_CONV_BATCH_GROUPS = "conv_general_dilated batch groups"
# What a leaf is, from the op that uses it.
_USED_AS = {
    "add": "added to another value (as a bias is)",
    "add_any": "added to another value (as a bias is)",
    "sub": "in a subtraction (as a bias is)",
    "mul": "multiplied by another value (as a scale is)",
    "div": "in a division (as a scale is)",
    "gather": "read by gather (an embedding)",
    "dynamic_slice": "read by dynamic_slice (an embedding)",
    "dot_general": "reshaped, sliced or broadcast before its matmul",
    "conv_general_dilated": "reshaped, sliced or broadcast before its convolution",
    _CONV_INPUT: "the input of a convolution, not its kernel",
    _CONV_BATCH_GROUPS: "the kernel of a convolution with batch_group_count > 1",
    "returned": "returned by the function",
}


def _uses(jaxpr: Any, origins: dict[Any, _Origin], uses: list[set[Any]]) -> None:
    """Adds to ``uses[leaf]`` each use of a param leaf in `jaxpr`: ``("dot", contraction
    axes of the leaf)``, ``("conv", contraction axes of the leaf)`` (a convolution kernel) or
    ``("other", primitive name)``."""

    def tracked(var: Any) -> _Origin | None:
        return None if isinstance(var, compat.Literal) else origins.get(var)

    def recurse(sub: Any, pairs: Sequence[tuple[Any, _Origin | None]]) -> None:
        inner, _ = compat.jaxpr_and_consts(sub)
        _uses(inner, {v: o for v, o in pairs if o is not None}, uses)

    def other(name: str, found: Sequence[_Origin | None]) -> None:
        for o in found:
            if o is not None:
                after = f" after {', '.join(o.after)}" if o.after else ""
                uses[o.leaf].add(("other", name + after))

    for eqn in jaxpr.eqns:
        found = [tracked(v) for v in eqn.invars]
        if not any(found):
            continue
        name, params = eqn.primitive.name, eqn.params
        if name == "dot_general":
            (lc, rc), _ = params["dimension_numbers"]
            for o, dims in zip(found, (lc, rc), strict=True):
                if o is None:
                    continue
                if o.axes is None:
                    other(name, [o])
                else:
                    uses[o.leaf].add(("dot", tuple(sorted(o.axes[d] for d in dims))))
        elif name == "conv_general_dilated":
            lhs, rhs = found
            other(_CONV_INPUT, [lhs])
            if rhs is not None and (rhs.axes is None or params["batch_group_count"] != 1):
                other(name if rhs.axes is None else _CONV_BATCH_GROUPS, [rhs])
            elif rhs is not None:
                assert rhs.axes is not None
                # The kernel's input-feature and spatial axes are contracted (rhs_spec: out
                # feature, in feature, spatial...).
                spec = params["dimension_numbers"].rhs_spec
                uses[rhs.leaf].add(("conv", tuple(sorted(rhs.axes[d] for d in spec[1:]))))
        elif name in _SAME_LAYOUT and is_float_dtype(eqn.outvars[0].aval.dtype):
            origins[eqn.outvars[0]] = found[0]  # type: ignore[assignment]
        elif name == "transpose":
            o = found[0]
            assert o is not None
            axes = None if o.axes is None else tuple(o.axes[p] for p in params["permutation"])
            origins[eqn.outvars[0]] = _Origin(o.leaf, axes, o.after)
        elif name == "rev":  # the axes as they were (a transposed convolution's kernel)
            origins[eqn.outvars[0]] = found[0]  # type: ignore[assignment]
        elif name in _RESHAPING and sum(o is not None for o in found) == 1 and found[0]:
            o = found[0]
            origins[eqn.outvars[0]] = _Origin(o.leaf, None, (*o.after, name))
        elif name in _CALLS:
            sub, _ = compat.jaxpr_and_consts(params[_CALLS[name]])
            if len(sub.invars) != len(found):
                other(name, found)
                continue
            recurse(params[_CALLS[name]], list(zip(sub.invars, found, strict=True)))
        elif name == "scan":
            n_consts, n_carry = compat.scan_counts(params)
            sub, _ = compat.jaxpr_and_consts(params["jaxpr"])
            other("scan carry", found[n_consts : n_consts + n_carry])
            pairs = list(zip(sub.invars[:n_consts], found[:n_consts], strict=True))
            for var, o in zip(
                sub.invars[n_consts + n_carry :], found[n_consts + n_carry :], strict=True
            ):
                # Each iteration sees the leaf without its leading (stacked) axis.
                if o is not None:
                    o = _Origin(o.leaf, None if o.axes is None else o.axes[1:], o.after)
                pairs.append((var, o))
            recurse(params["jaxpr"], pairs)
        elif name == "while":
            n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
            other("while carry", found[n_cond + n_body :])
            for key, part in (
                ("cond_jaxpr", found[:n_cond]),
                ("body_jaxpr", found[n_cond : n_cond + n_body]),
            ):
                sub, _ = compat.jaxpr_and_consts(params[key])
                recurse(params[key], list(zip(sub.invars, part, strict=False)))
        elif name == "cond":
            other("cond index", found[:1])
            for branch in params["branches"]:
                sub, _ = compat.jaxpr_and_consts(branch)
                recurse(branch, list(zip(sub.invars, found[1:], strict=True)))
        else:
            other(name, found)
    for var in jaxpr.outvars:
        o = tracked(var)
        if o is not None:
            other("returned", [o])


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_string(path: Sequence[Any]) -> str:
    """A leaf's path as its keys joined by ``/`` (``"params/Dense_0/kernel"``)."""
    return "/".join(_key_name(k) for k in path)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


@dataclasses.dataclass(frozen=True)
class _Decision:
    path: str
    index: int  # in the flat leaves
    contract: tuple[int, ...] | None  # None: left as it is
    reason: str


def _plan(
    fun: Callable[..., Any],
    params: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    recipe: Any,
    exclude: Any,
) -> tuple[Recipe, list[Any], Any, list[_Decision]]:
    recipe = get_recipe(recipe)
    patterns = compile_exclude(exclude, "exclude")
    with_path, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_quantized)
    for key_path, leaf in with_path:
        if is_quantized(leaf):
            raise ValueError(
                f"`params` leaf {path_string(key_path)!r} is already quantised ({leaf!r}); "
                "quantise the original params (`QuantizedArray.dequantize()` approximates one)."
            )
    leaves = [leaf for _, leaf in with_path]
    arrays = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
    # Example arguments given as shapes (jax.ShapeDtypeStruct) are traced as inputs; the
    # others are the call's constants.
    arg_leaves, arg_tree = jax.tree.flatten((args, kwargs))
    shaped = [j for j, a in enumerate(arg_leaves) if isinstance(a, jax.ShapeDtypeStruct)]

    def flat(*values: Any) -> Any:
        full = list(leaves)
        for i, v in zip(arrays, values[: len(arrays)], strict=True):
            full[i] = v
        call = list(arg_leaves)
        for j, v in zip(shaped, values[len(arrays) :], strict=True):
            call[j] = v
        call_args, call_kwargs = jax.tree.unflatten(arg_tree, call)
        return fun(jax.tree.unflatten(treedef, full), *call_args, **call_kwargs)

    # Weak types kept (a Python scalar leaf under jax.jit): they decide the traced dtypes.
    structs = [interpret.shape_struct(leaves[i]) for i in arrays]
    closed = jax.make_jaxpr(flat)(*structs, *(arg_leaves[j] for j in shaped))
    uses: list[set[Any]] = [set() for _ in arrays]
    origins = {
        var: _Origin(k, tuple(range(len(s.shape))))
        for k, (var, s) in enumerate(zip(closed.jaxpr.invars[: len(arrays)], structs, strict=True))
    }
    _uses(closed.jaxpr, origins, uses)

    matched: set[int] = set()
    decisions = []
    for k, i in enumerate(arrays):
        path = path_string(with_path[i][0])
        leaf = leaves[i]
        if not is_float_dtype(leaf.dtype):
            continue  # int, bool and key leaves are never candidates
        decisions.append(_decide(path, i, leaf, uses[k], recipe, patterns, matched))
    unmatched = [p.pattern for j, p in enumerate(patterns) if j not in matched]
    if unmatched:
        names = [d.path for d in decisions]
        close = difflib.get_close_matches(unmatched[0], names, n=1, cutoff=0.3)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"`exclude` pattern {unmatched[0]!r} matches no floating leaf of the params "
            f"(searched with re.search in their paths: {', '.join(names)}).{hint}"
        )
    return recipe, leaves, treedef, decisions


def _used_as(others: Sequence[str]) -> str:
    """What the uses of a leaf (``"add after reshape"``, ``"gather"``) say it is, each with
    the ops it went through: ``"added to another value (as a bias is; after reshape)"``."""
    said = []
    for use in others:
        name, _, after = use.partition(" after ")
        text = _USED_AS.get(name, f"used by {name}")
        if after:
            text = text[:-1] + f"; after {after})" if text.endswith(")") else f"{text} ({after})"
        if text not in said:
            said.append(text)
    return ", ".join(said)


def _decide(
    path: str,
    index: int,
    leaf: Any,
    uses: set[Any],
    recipe: Any,
    patterns: tuple[re.Pattern[str], ...],
    matched: set[int],
) -> _Decision:
    for j, pattern in enumerate(patterns):
        if pattern.search(path):
            matched.add(j)
            return _Decision(path, index, None, f"excluded by {pattern.pattern!r}")
    others = sorted(name for kind, name in uses if kind == "other")
    kinds = sorted({kind for kind, _ in uses if kind != "other"})
    dots = sorted({axes for kind, axes in uses if kind != "other"})
    if not dots:
        used = _used_as(others) if others else "unused"
        return _Decision(path, index, None, f"not a matmul weight: {used}")
    what = " and ".join(_WHAT[kind] for kind in kinds)
    if others:
        return _Decision(path, index, None, f"a {what} also {_used_as(others)}")
    if len(dots) > 1:
        shown = " and ".join(str(d) for d in dots)
        ops = " and ".join(_WHAT_PLURAL[kind] for kind in kinds)
        return _Decision(path, index, None, f"{ops} contract different axes: {shown}")
    (contract,) = dots
    if isinstance(recipe, Int4WeightOnly):
        k = math.prod(np.shape(leaf)[c] for c in contract)
        if k % recipe.group_size:
            return _Decision(
                path,
                index,
                None,
                f"contraction size {k} is not a multiple of group_size {recipe.group_size}",
            )
    return _Decision(path, index, contract, f"{what}, contracted over axes {contract}")


_WHAT = {"dot": "matmul weight", "conv": "convolution kernel"}
_WHAT_PLURAL = {"dot": "matmuls", "conv": "convolutions"}


def quantization_plan(
    fun: Callable[..., Any],
    params: Any,
    *example_args: Any,
    recipe: Any,
    exclude: Any = (),
    **example_kwargs: Any,
) -> tuple[QuantizedLeaf, ...]:
    """What `quantize` does with each floating leaf of `params`, and why.

    Takes `quantize`'s arguments (the weights' values are checked for NaN and inf too).

    Returns:
      One `QuantizedLeaf` per floating leaf, in the order of the params' leaves.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> def mlp(p, x):
      ...     return jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]
      >>> p = {"b": jnp.zeros(4), "v": jnp.ones((4, 2)), "w": jnp.ones((8, 4))}
      >>> for leaf in jaxmp.quantization_plan(mlp, p, jnp.ones((1, 8)), recipe="int8"):
      ...     print(leaf.path, leaf.quantized, leaf.reason)
      b False not a matmul weight: added to another value (as a bias is; after ...)
      v True matmul weight, contracted over axes (0,)
      w True matmul weight, contracted over axes (0,)
    """
    _, leaves, _, decisions = _plan(fun, params, example_args, example_kwargs, recipe, exclude)
    for d in decisions:
        if d.contract is not None:
            leaf_lib.check_finite(d.path, leaves[d.index])
    return QuantizationPlan(
        QuantizedLeaf(d.path, d.contract is not None, d.reason) for d in decisions
    )


def quantize(
    fun: Callable[..., Any],
    params: Any,
    *example_args: Any,
    recipe: Any,
    exclude: Any = (),
    **example_kwargs: Any,
) -> Any:
    """Quantises the matmul weights and convolution kernels among `params` with `recipe`;
    run them with `quantized`.

    ``fun(params, *example_args, **example_kwargs)`` is traced (not run) to find which
    leaves are matmul weights and their contraction axes (see the module docs): a leaf read
    by ``dot_general`` only, or as the kernel of ``conv_general_dilated`` only, through
    ``convert_element_type`` and ``transpose`` and inside ``jit``, ``scan`` (a stacked leaf
    scanned over layers), ``while``, ``cond`` and ``checkpoint``. Other floating leaves,
    and every int or bool leaf, are returned as they are (the same objects): biases, norms,
    an embedding read by ``gather`` only; a tied embedding (``gather`` and a matmul) is left
    unquantised too. `quantization_plan` lists each floating leaf with the reason.

    Args:
      fun: the model function, ``fun(params, *args, **kwargs)``; for Flax Linen
        ``model.apply`` with ``{"params": params}``, for Equinox a function of the module.
      params: any pytree; its array leaves are the candidates.
      *example_args: arguments of one call of `fun` (arrays or ``jax.ShapeDtypeStruct``).
      recipe: `Int8WeightOnly`, `Int8DynamicActivations`, `Float8Rowwise`, `Int4WeightOnly`,
        or the name of one: ``"int8"``, ``"int8_dynamic"``, ``"fp8"``, ``"int4"``.
      exclude: regexes kept unquantised: a leaf whose path (its keys joined by ``/``, such
        as ``"params/head/kernel"``) contains a match (`re.search`) is left as it is. Each
        pattern must match a floating leaf.
      **example_kwargs: keyword arguments of that call.

    Returns:
      `params` with each matmul weight and convolution kernel replaced by a `QuantizedArray`.

    Raises:
      ValueError: for an unknown recipe name or an exclude pattern matching no leaf (both
        listing the valid choices), a weight holding NaN or inf, or a leaf that is a
        `QuantizedArray` already (both naming its path).
      TypeError: for a recipe or exclude of the wrong type.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> def mlp(p, x):
      ...     return jnp.tanh(x @ p["w"]) @ p["v"]
      >>> p = {"v": jnp.ones((256, 2)), "w": jnp.ones((8, 256))}
      >>> q = jaxmp.quantize(mlp, p, jnp.ones((1, 8)), recipe="int8")
      >>> q["w"]
      QuantizedArray(int8, shape=(8, 256), dtype=float32, contract=(-2,))
      >>> jaxmp.quantized(mlp)(q, jnp.ones((1, 8))).shape
      (1, 2)
    """
    recipe, leaves, treedef, decisions = _plan(
        fun, params, example_args, example_kwargs, recipe, exclude
    )
    out = list(leaves)
    for d in decisions:
        if d.contract is not None:
            q = leaf_lib.quantize_array(leaves[d.index], d.contract, recipe)
            leaf_lib.check_finite(d.path, leaves[d.index], q)
            out[d.index] = q
    return jax.tree.unflatten(treedef, out)
