"""Op-level autocast: run an unmodified float32 function with per-primitive precision rules.

`autocast` traces a function to a jaxpr and evaluates it again, equation by equation,
casting each primitive's operands by one of three rules (the op lists live in
`jaxmp._src.autocast_rules`):

* **low precision** (`LOW_PRECISION_OPS`: ``dot_general``, ``conv_general_dilated``,
  ``ragged_dot_general``): floating operands are cast to the policy's compute dtype and the
  result stays in it (``preferred_element_type`` is set to the compute dtype), so the
  activations between two matmuls stay in the compute dtype.
* **float32** (`FLOAT32_OPS`: exp/log family, sums and other reductions, pow, rsqrt, special
  functions, linear algebra): floating operands narrower than float32 are cast to float32
  and the result is float32. A float32 result feeding a matmul is cast down at that matmul.
* **follow** (everything else): the op runs in the widest floating dtype among its
  *driving* operands, and the other floating operands are cast to it.

Which operands drive the promotion (the rule that keeps typical models free of
float32/float16 "bounce-back"):

* Values that are inputs of the function (parameters, the batch, closed-over constants),
  jaxpr literals, and values computed from those alone by follow ops (``bias.reshape``,
  ``scale * 2``) are *weak*, like a Python scalar in JAX's type promotion: they take the
  dtype of the computed activation they meet. A float32 Dense bias added to a float16
  matmul output gives float16, as in a model written with ``dtype=jnp.float16``, instead
  of bouncing the activation back to float32 after every matmul (what torch's
  "widest input wins" rule would do here, where the bias add is a separate op).
* Computed values promote to the widest: a float16 activation minus a float32 maximum
  (softmax) or mean (LayerNorm) runs in float32, so softmax, log-softmax and the
  normalisation all run in float32 up to the next matmul.
* 0-d operands do not drive the promotion when a higher-rank floating operand is present
  (torch's rule for 0-d tensors), so ``x * scale`` keeps the dtype of ``x``.

In a pre-LayerNorm transformer block this gives: the LayerNorm in float32, the q/k/v
projections, attention scores, MLP hidden activations and residual branches in the compute
dtype, softmax in float32 (its probabilities are cast down at the ``probs @ v`` matmul). A
float32 residual stream that enters as a function input is weak, so the first residual add
makes the stream the compute dtype (as in an explicit ``dtype=jnp.float16`` model).

Float32 paths: a value that exists only to feed a float32 op (a reduction, ``rsqrt``,
``exp``...) through elementwise and layout ops (`autocast_rules.FLOAT32_PATH_OPS`) is
computed in float32 from its compute-dtype inputs, whatever the op that writes it
(``square``, ``integer_pow``, ``pow``, ``x * x``, ``abs``). So the statistics of LayerNorm
(also its fast variance E[x²] - E[x]²) and RMSNorm, ``jnp.linalg.norm``, ``optax.safe_norm``
and the elementwise part of a squared-error loss do not overflow for activations above 256,
while ``square`` and ``integer_pow`` elsewhere (GELU's tanh approximation) follow their
input. Values that some other op also reads, the activations, stay in the compute dtype and
are widened where they enter the path (one backward pass per jaxpr: `_float32_paths`).

Losses have no primitives of their own: cross-entropy and other log/exp based losses run in
float32 through ``exp``, ``log`` and ``reduce_sum``; the mean of any loss is a float32 sum.

Constants beyond the compute dtype's range (``jnp.finfo(jnp.float32).min`` as a mask value,
``-1e9`` as a mask bias) are not weak: cast to float16 they would be -inf, and a fully
masked softmax row NaN. They drive the promotion like a computed float32 value, so the
masked scores and their softmax run in float32.

Other rules: ``convert_element_type`` between two float dtypes that the program wrote
(``x.astype(jnp.float32)`` on a float16 value) is kept, except the narrowing described
next; one that only changes weak typing is dropped. Integer, boolean and PRNG-key values
are never touched. Scatters, bit casts and ``custom_vjp`` functions are re-bound exactly as
traced, their floating operands cast back to the dtypes they were traced with.
``custom_jvp`` functions keep their custom rule: both the function and its JVP rule are
evaluated under autocast.

Half-precision parameters and inputs (the low-memory setup): on a float16 or bfloat16
array, ``jnp.mean``, ``jnp.sum``, ``jnp.var`` and Flax's norms widen to float32, reduce,
and narrow the result back to the input's dtype. The narrowing that only undoes the
program's own widening after a float32 op is dropped (`_restoring_converts`): the float32
result stays float32 up to the next low-precision op, like a float32 model's statistics,
and an output gets ``policy.output_dtype``. So a loss under ``p=bf16,c=bf16,o=f32`` is the
float32 mean, not the float32 mean rounded to bfloat16, and a float16 sum of squares of
262144 is 262144, not inf. A narrowing with no float32 op since the widening, or of a
float32 computation that also reads values the program did not widen (a float32 model's
``.astype(jnp.float16)``), is kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmp._src import attention, autocast_rules, compat, dtypes, interpret
from jaxmp._src import policy as policy_lib

FLOAT32_OPS = autocast_rules.FLOAT32_OPS
LOW_PRECISION_OPS = autocast_rules.LOW_PRECISION_OPS

# The name-stack scope `float32_region` opens; equations under it are evaluated as traced.
REGION_SCOPE = "jaxmp_float32_region"


def _known_primitive_names() -> frozenset[str]:
    """Names of the primitives JAX knows now (computed on use: later imports register more)."""
    names = compat.known_primitive_names()
    return frozenset(
        names
        | LOW_PRECISION_OPS
        | FLOAT32_OPS
        | autocast_rules.AS_TRACED_OPS
        | autocast_rules.INDEPENDENT_OPERAND_OPS
    )


# --------------------------------------------------------------------------------------------
# Small helpers.


def _is_float_dtype(dtype: Any) -> bool:
    try:
        return bool(jnp.issubdtype(dtype, jnp.floating))
    except TypeError:  # extended dtypes such as PRNG keys
        return False


def _is_float(x: Any) -> bool:
    return dtypes.is_floating(x)


def _cast(x: Any, dtype: Any, cache: dict[Any, Any] | None = None) -> Any:
    dtype = jnp.dtype(dtype)
    if jnp.dtype(x.dtype) == dtype:
        return x
    if cache is None:
        return lax.convert_element_type(x, dtype)
    # One convert per value and dtype within one jaxpr (the cache lives in one trace).
    key = (id(x), dtype)
    if key not in cache:
        cache[key] = (x, lax.convert_element_type(x, dtype))
    return cache[key][1]


def _promote(dtype_list: Iterable[Any]) -> np.dtype:
    # The rules' own promotion, whatever `jax.numpy_dtype_promotion` the caller runs
    # under (strict mode refuses float16 with float32).
    with jax.numpy_dtype_promotion("standard"):
        return functools.reduce(jnp.promote_types, dtype_list)


_bind = compat.bind


def _with_preferred_type(params: dict[str, Any], dtype: np.dtype) -> dict[str, Any]:
    preferred = params.get("preferred_element_type")
    if preferred is None or not _is_float_dtype(preferred) or preferred == dtype:
        return params
    return {**params, "preferred_element_type": jnp.dtype(dtype)}


@dataclasses.dataclass
class _Context:
    """The rules of one autocast call."""

    compute_dtype: np.dtype
    low_ops: frozenset[str]
    float32_ops: frozenset[str]
    fused_attention: bool = True


# --------------------------------------------------------------------------------------------
# The rules, over the shared re-interpretation core (`jaxmp._src.interpret`).


@functools.partial(jax.tree_util.register_dataclass, data_fields=["value"], meta_fields=["weak"])
@dataclasses.dataclass(frozen=True)
class _Value:
    """A value under autocast: the array, and whether it is weak (see the module docs)."""

    value: Any
    weak: bool


@dataclasses.dataclass
class _Frame:
    """Autocast's analysis of one jaxpr, and the float32 versions of its values."""

    regions: list[bool]
    paths: _Float32Paths
    restores: frozenset[int]  # narrowing converts that are dropped (`_restoring_converts`)
    wide_env: dict[Any, Any]  # the float32 versions of values on a float32 path
    cache: dict[Any, Any]  # one convert per value and dtype


class _AutocastRules(interpret.Rules):
    """Autocast as a rule set: each equation cast by `_apply`; control flow by the core."""

    keep_custom_rules = True

    def __init__(self, ctx: _Context):
        self.ctx = ctx

    def literal(self, value: Any) -> _Value:
        return _Value(value, not _out_of_range(value, self.ctx.compute_dtype))

    def value(self, v: _Value) -> Any:
        return v.value

    def wrap(self, x: Any) -> _Value:
        return _Value(x, False)

    def start(self, jaxpr: Any) -> _Frame:
        regions = [REGION_SCOPE in compat.name_stack_of(eqn) for eqn in jaxpr.eqns]
        paths = _float32_paths(jaxpr, self.ctx, regions)
        restores = _restoring_converts(jaxpr, self.ctx, regions)
        return _Frame(regions, paths, restores, {}, {})

    def apply(
        self, frame: _Frame, index: int, eqn: Any, vals: list[_Value], interp: Any
    ) -> list[_Value] | None:
        values = [v.value for v in vals]
        flags = [v.weak for v in vals]
        paths = frame.paths
        if index in paths.wide or index in paths.sinks:
            wide_vals = [
                frame.wide_env.get(v, x) if not isinstance(v, compat.Literal) else x
                for v, x in zip(eqn.invars, values, strict=True)
            ]
        if index in paths.wide:
            if index in frame.restores:
                wide_outs = wide_vals
            else:
                wide_outs = _run_wide(eqn, wide_vals, flags, frame.cache)
            for var, value in zip(eqn.outvars, wide_outs, strict=True):
                if not isinstance(var, compat.DropVar):
                    frame.wide_env[var] = value
            if index in paths.wide_only:
                return None
        if index in paths.sinks:
            values = wide_vals
        if index in frame.restores:
            return [_Value(values[0], False)]
        region = frame.regions[index]
        if not region and self.marked_attention(eqn):
            outs = attention.dispatch(eqn.params["name"], values, self.ctx.compute_dtype)
            return [_Value(x, False) for x in outs]
        if not region and eqn.primitive.name not in self.ctx.low_ops | self.ctx.float32_ops:
            outs = interp.higher_order(eqn, vals)
            if outs is not NotImplemented:
                return outs
        outs, out_flags = _apply(eqn, values, flags, self.ctx, region, frame.cache)
        return [_Value(x, f) for x, f in zip(outs, out_flags, strict=True)]

    def marked_attention(self, eqn: Any) -> bool:
        """Whether `eqn` is an attention marked while the function was traced, to dispatch
        (`jaxmp._src.attention`)."""
        return (
            self.ctx.fused_attention
            and eqn.primitive.name in ("jit", "pjit")
            and attention.is_marked(str(eqn.params.get("name", "")))
        )

    def fix(self, vals: list[_Value], like: list[_Value]) -> list[_Value]:
        # Loop carries keep the dtype (and weakness) of their initial value; branches of a
        # cond give the dtypes `join` chose.
        return [
            _Value(_cast_carry([v.value], [s.value.dtype])[0], s.weak)
            for v, s in zip(vals, like, strict=True)
        ]

    def join(self, branches: list[list[_Value]]) -> list[_Value]:
        # Branches may produce different dtypes under autocast: all return the widest.
        targets = []
        for outs in zip(*branches, strict=True):
            structs = [o.value for o in outs]
            if all(_is_float_dtype(s.dtype) for s in structs):
                dtype = _promote(s.dtype for s in structs)
            else:
                dtype = structs[0].dtype
            struct = jax.ShapeDtypeStruct(structs[0].shape, dtype)
            targets.append(_Value(struct, all(o.weak for o in outs)))
        return targets


@dataclasses.dataclass(frozen=True)
class _Float32Paths:
    """The float32 paths of one jaxpr, as equation indices (see `_float32_paths`).

    Attributes:
      sinks: float32 ops whose floating operands are read in their float32 version.
      wide: elementwise and layout equations whose float32 version a float32 op reads.
      wide_only: those of `wide` whose ordinary version nothing reads (only the float32
        version is computed).
    """

    sinks: frozenset[int]
    wide: frozenset[int]
    wide_only: frozenset[int]


def _float32_paths(jaxpr: Any, ctx: _Context, regions: list[bool]) -> _Float32Paths:
    """Finds the values that feed a float32 op through elementwise and layout ops only.

    One backward pass over the equations. A floating operand of a float32 op (a reduction,
    ``rsqrt``, ``exp``...) is read in its float32 version; the float32 version of a value
    computed by an op of `autocast_rules.FLOAT32_PATH_OPS` is that op evaluated in float32
    on the float32 versions of its operands, and that of any other value (a matmul output,
    an input, a reduction) is the value itself, widened. So ``mean(square(x @ w))`` squares
    the float16 matmul output in float32 and cannot overflow, while ``x @ w`` itself, and
    every activation some other op reads, stays in the compute dtype.
    """
    eqns = jaxpr.eqns
    need_wide: set[Any] = set()
    need_plain: set[Any] = {v for v in jaxpr.outvars if not isinstance(v, compat.Literal)}
    sinks, wide, wide_only = set(), set(), set()

    def float_vars(eqn: Any) -> list[Any]:
        return [
            v
            for v in eqn.invars
            if not isinstance(v, compat.Literal) and _is_float_dtype(v.aval.dtype)
        ]

    def all_vars(eqn: Any) -> list[Any]:
        return [v for v in eqn.invars if not isinstance(v, compat.Literal)]

    for i in reversed(range(len(eqns))):
        eqn = eqns[i]
        name = eqn.primitive.name
        if regions[i]:
            need_plain.update(all_vars(eqn))
        elif name in ctx.float32_ops and not compat.has_subjaxprs(eqn.params):
            sinks.add(i)
            need_wide.update(float_vars(eqn))
            need_plain.update(all_vars(eqn))
        elif name in autocast_rules.FLOAT32_PATH_OPS:
            is_wide = any(v in need_wide for v in eqn.outvars)
            is_plain = any(v in need_plain for v in eqn.outvars) or not is_wide
            if is_wide:
                wide.add(i)
                need_wide.update(float_vars(eqn))
                if not is_plain:
                    wide_only.add(i)
            if is_plain:
                need_plain.update(all_vars(eqn))
            else:  # integer and boolean operands (indices, predicates) are read as they are
                need_plain.update(v for v in all_vars(eqn) if v not in float_vars(eqn))
        else:
            need_plain.update(all_vars(eqn))
    return _Float32Paths(frozenset(sinks), frozenset(wide), frozenset(wide_only))


# How a float32 value of the traced program was computed, for `_restoring_converts`: from
# values the program widened from this half dtype (and constants), and whether a float32 op
# of autocast ran on the way.
_Widened = tuple[np.dtype, bool]


def _restoring_converts(jaxpr: Any, ctx: _Context, regions: list[bool]) -> frozenset[int]:
    """Finds the narrowing converts that only undo the program's own widening for a float32 op.

    On half-precision inputs, ``jnp.mean``, ``jnp.sum``, ``jnp.var`` and Flax's norms widen
    their input to float32, reduce, and narrow the result back to the input's dtype:
    ``convert(f16 -> f32)``, ``reduce_sum``, ``div``, ``convert(f32 -> f16)``. Autocast
    computes the reduction in float32 anyway, and the narrowing would round the float32
    result to the half dtype (a mean 7.7078 becomes 7.71875 in bfloat16, a float16 sum of
    262144 becomes inf) before a float32 output dtype widens it again. Such a convert is
    dropped: the value stays float32 up to the next low-precision op, as a float32 model's
    statistics do, and an output gets the policy's output dtype.

    One forward pass. A convert is dropped when it narrows float32 to a half dtype ``d`` and
    its operand was computed, through any ops other than low-precision ops, from values the
    program widened from ``d`` to float32, literals and values without floating inputs
    (``where`` counts), with at least one float32 op (`FLOAT32_OPS`) on the way. A widening
    and narrowing with no float32 op between, and narrowings of float32 computations that
    involve other float32 values (a float32 model's own ``.astype``), are kept.
    """
    f32 = dtypes.FLOAT32
    widened: dict[Any, _Widened | None] = {}  # None: computed without floating inputs
    restores = set()

    def contains(eqn: Any, names: frozenset[str]) -> bool:
        for sub in compat.jaxprs_in_params(eqn.params):
            sub_jaxpr = getattr(sub, "jaxpr", sub)
            for e in sub_jaxpr.eqns:
                if e.primitive.name in names or contains(e, names):
                    return True
        return False

    for i, eqn in enumerate(jaxpr.eqns):
        name = eqn.primitive.name
        if regions[i] or name in ctx.low_ops:
            continue
        float_ins = [v for v in eqn.invars if _is_float_dtype(_dtype_of(v))]
        known = [v for v in float_ins if not isinstance(v, compat.Literal)]
        outs = [v for v in eqn.outvars if _is_float_dtype(_dtype_of(v)) and _dtype_of(v) == f32]
        if name == "convert_element_type" and len(eqn.invars) == 1:
            (var,) = eqn.invars
            src, dst = _dtype_of(var), eqn.params["new_dtype"]
            if not _is_float_dtype(src):  # an integer or boolean count: a constant here
                widened.update((v, None) for v in outs)
            elif not _is_float_dtype(dst):
                pass
            elif src.itemsize < 4 and dst == f32:
                widened.update((v, (src, False)) for v in outs)
            elif src == f32 and jnp.dtype(dst).itemsize < 4:
                if known and widened.get(var) == (jnp.dtype(dst), True):
                    restores.add(i)
            elif src == jnp.dtype(dst) and known and var in widened:  # only weak type changes
                widened.update((v, widened[var]) for v in outs)
            continue
        if not outs or any(v not in widened for v in known):
            continue
        if compat.has_subjaxprs(eqn.params) and contains(eqn, ctx.low_ops):
            continue
        origins = [o for o in (widened[v] for v in known) if o is not None]
        sources = {o[0] for o in origins}
        if len(sources) > 1:
            continue
        if not sources:
            widened.update((v, None) for v in outs)
            continue
        ran = any(o[1] for o in origins) or name in ctx.float32_ops
        ran = ran or contains(eqn, ctx.float32_ops)
        widened.update((v, (sources.pop(), ran)) for v in outs)
    return frozenset(restores)


def _dtype_of(var: Any) -> Any:
    """The dtype of a jaxpr variable or literal (None for an aval without one: a token)."""
    return getattr(var.aval, "dtype", None)


def _run_wide(eqn: Any, vals: list[Any], flags: list[bool], cache: dict[Any, Any]) -> list[Any]:
    """The float32 version of an elementwise or layout equation (see `_float32_paths`)."""
    if eqn.primitive.name == "convert_element_type":
        return _convert_rule(eqn, vals, flags)[0]
    return _run_in_float32(eqn, vals, cache)


def _out_of_range(value: Any, dtype: np.dtype) -> bool:
    """Whether `value`, a constant, holds a finite number beyond `dtype`'s range.

    Such a constant (``jnp.finfo(jnp.float32).min`` as a mask value, ``-1e9`` as a mask
    bias) drives the promotion like a computed value instead of adapting to the compute
    dtype it meets: cast to float16 it would become -inf, and a fully masked row's softmax
    NaN. Only concrete values are looked at (literals, and constants up to 2**20 elements).
    """
    if isinstance(value, compat.Tracer) or not _is_float(value):
        return False
    if not _is_float_dtype(dtype) or jnp.finfo(dtype).bits >= 32:
        return False
    if np.size(value) > 2**20:
        return False
    values = np.abs(np.asarray(value, np.float64))
    limit = float(jnp.finfo(dtype).max)
    return bool(np.any(np.isfinite(values) & (values > limit)))


def _apply(
    eqn: Any,
    vals: list[Any],
    flags: list[bool],
    ctx: _Context,
    region: bool,
    cache: dict[Any, Any],
) -> tuple[list[Any], list[bool]]:
    name = eqn.primitive.name
    n_out = len(eqn.outvars)
    if region:
        return _as_traced(eqn, vals, cache), [False] * n_out
    if name in ctx.low_ops:
        return _run_in(eqn, vals, ctx.compute_dtype, cache, higher_ok=False), [False] * n_out
    if name in ctx.float32_ops:
        return _run_in_float32(eqn, vals, cache), [False] * n_out
    if name == "convert_element_type":
        return _convert_rule(eqn, vals, flags)
    if name in autocast_rules.AS_TRACED_OPS:
        return _as_traced(eqn, vals, cache), [False] * n_out
    if compat.has_subjaxprs(eqn.params):
        raise NotImplementedError(
            f"jaxmp.autocast cannot re-interpret the primitive `{name}`: it is a "
            "higher-order primitive (its parameters hold sub-jaxprs) with no autocast rule. "
            "Wrap the code that produces it in `jaxmp.float32_region` to run it as written, "
            f"or pass `float32_ops=jaxmp.FLOAT32_OPS | {{{name!r}}}` to re-bind it unchanged "
            "with its operands cast to the dtypes they were traced with."
        )
    if name in autocast_rules.INDEPENDENT_OPERAND_OPS:
        outs = _bind(eqn, vals)
        out_flags = list(flags) if len(flags) == len(outs) else [all(flags)] * len(outs)
        return outs, out_flags
    return _follow(eqn, vals, flags, cache, ctx.compute_dtype)


def _as_traced(eqn: Any, vals: list[Any], cache: dict[Any, Any]) -> list[Any]:
    """Re-binds `eqn` unchanged, floating operands cast to the dtypes they were traced with."""
    cast = [
        _cast(x, v.aval.dtype, cache) if _is_float(x) and _is_float_dtype(v.aval.dtype) else x
        for x, v in zip(vals, eqn.invars, strict=True)
    ]
    return _bind(eqn, cast)


def _run_in(
    eqn: Any, vals: list[Any], dtype: np.dtype, cache: dict[Any, Any], *, higher_ok: bool
) -> list[Any]:
    """Casts the floating operands of `eqn` to `dtype` and binds it there."""
    if compat.has_subjaxprs(eqn.params):
        if higher_ok:
            return _as_traced(eqn, vals, cache)
        raise NotImplementedError(
            f"jaxmp.autocast cannot run the higher-order primitive `{eqn.primitive.name}` in "
            f"{dtype}: its sub-jaxprs are typed for the dtypes it was traced with. Remove it "
            "from `low_precision_ops=` or add it to `float32_ops=`."
        )
    cast = [_cast(x, dtype, cache) if _is_float(x) else x for x in vals]
    if not any(_is_float(x) for x in vals):
        return _bind(eqn, cast)
    return _bind(eqn, cast, _with_preferred_type(eqn.params, dtype))


def _run_in_float32(eqn: Any, vals: list[Any], cache: dict[Any, Any]) -> list[Any]:
    float_dtypes = [jnp.dtype(x.dtype) for x in vals if _is_float(x)]
    dtype = _promote([dtypes.FLOAT32, *float_dtypes])
    return _run_in(eqn, vals, dtype, cache, higher_ok=True)


def _follow(
    eqn: Any,
    vals: list[Any],
    flags: list[bool],
    cache: dict[Any, Any],
    compute_dtype: np.dtype | None = None,
) -> tuple[list[Any], list[bool]]:
    """Runs `eqn` in the widest dtype of its driving floating operands (see module docs)."""
    floats = [i for i, x in enumerate(vals) if _is_float(x)]
    n_out = len(eqn.outvars)
    if not floats:
        return _bind(eqn, vals), [False] * n_out
    strong = [i for i in floats if not flags[i]]
    drivers = [i for i in strong if len(vals[i].shape) > 0] or strong or floats
    if compute_dtype is not None:
        # A 0-d constant beyond the compute dtype's range drives too (``x * 1e9``).
        drivers += [i for i in strong if _out_of_range(vals[i], compute_dtype)]
    dtype = _promote(jnp.dtype(vals[i].dtype) for i in drivers)
    cast = [_cast(x, dtype, cache) if i in floats else x for i, x in enumerate(vals)]
    out_weak = all(flags[i] for i in floats)
    return _bind(eqn, cast, _with_preferred_type(eqn.params, dtype)), [out_weak] * n_out


def _convert_rule(eqn: Any, vals: list[Any], flags: list[bool]) -> tuple[list[Any], list[bool]]:
    (x,) = vals
    new_dtype = eqn.params["new_dtype"]
    if _is_float(x) and _is_float_dtype(new_dtype):
        if jnp.dtype(eqn.invars[0].aval.dtype) == jnp.dtype(new_dtype):
            # Only the weak type changed in the traced program: keep the autocast dtype.
            return [x], [flags[0]]
        return _bind(eqn, [x]), [False]
    return _bind(eqn, [x]), [False]


def _cast_carry(values: list[Any], carry_dtypes: list[Any]) -> list[Any]:
    return [
        _cast(x, d) if _is_float(x) and _is_float_dtype(d) else x
        for x, d in zip(values, carry_dtypes, strict=True)
    ]


# --------------------------------------------------------------------------------------------
# Public API.


def _op_names(ops: Any, *, arg: str) -> frozenset[str]:
    if isinstance(ops, (str, compat.Primitive)) or not isinstance(ops, Iterable):
        raise TypeError(
            f"`{arg}` must be a collection of primitive names or `jax.extend.core.Primitive` "
            f"objects (for example `jaxmp.FLOAT32_OPS | {{'tanh'}}`), got {ops!r}."
        )
    names = set()
    known = _known_primitive_names()
    for op in ops:
        if isinstance(op, compat.Primitive):
            names.add(op.name)
        elif isinstance(op, str):
            if op not in known:
                close = difflib.get_close_matches(op, sorted(known), n=3)
                hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
                raise ValueError(
                    f"`{arg}` must name JAX primitives, got unknown primitive {op!r}.{hint} "
                    "Pass the `jax.extend.core.Primitive` object itself for a primitive "
                    "defined outside JAX."
                )
            names.add(op)
        else:
            raise TypeError(
                f"`{arg}` entries must be primitive names or `jax.extend.core.Primitive` "
                f"objects, got {op!r}."
            )
    return frozenset(names)


def _resolve_ops(low: Any, f32: Any) -> tuple[frozenset[str], frozenset[str]]:
    low_names = None if low is None else _op_names(low, arg="low_precision_ops")
    f32_names = None if f32 is None else _op_names(f32, arg="float32_ops")
    if low_names is not None and f32_names is not None:
        both = low_names & f32_names
        if both:
            raise ValueError(
                "`low_precision_ops` and `float32_ops` must not overlap, got "
                f"{sorted(both)} in both."
            )
    # A set given explicitly wins over the other list's default.
    if low_names is None:
        low_names = LOW_PRECISION_OPS - (f32_names or frozenset())
    if f32_names is None:
        f32_names = FLOAT32_OPS - low_names
    return low_names, f32_names


def _output_dtype(computed: Any, traced: Any, output_dtype: np.dtype) -> np.dtype:
    """The dtype of a floating output: `output_dtype`, unless that would narrow a value
    autocast computed in the plain call's own dtype.

    Such a value (a float32 loss or statistic, BatchNorm's running variance in a Linen
    mutable collection or an Equinox `State`) keeps the dtype of the plain call: narrowed to
    a half output dtype, state fed back to the next call would no longer match the model's
    variables, and a running variance of activations above 256 would be inf in float16.
    """
    computed, traced = jnp.dtype(computed), jnp.dtype(traced)
    if computed == traced and output_dtype.itemsize < computed.itemsize:
        return computed
    return output_dtype


class Autocast:
    """The function `autocast` returns; call it like the wrapped function.

    Attributes:
      policy: the `jaxmp.Policy` in use.
      low_precision_ops: names of the primitives run in the compute dtype.
      float32_ops: names of the primitives run in float32.
    """

    def __init__(
        self,
        fun: Callable[..., Any],
        policy: policy_lib.Policy,
        low_precision_ops: frozenset[str],
        float32_ops: frozenset[str],
        fused_attention: bool = True,
    ):
        functools.update_wrapper(self, fun, updated=())
        self._fun = fun
        self.policy = policy
        self.low_precision_ops = low_precision_ops
        self.float32_ops = float32_ops
        self.fused_attention = fused_attention
        self._jitted = jax.jit(self._run, static_argnums=(0, 1))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call_with(None, args, kwargs)

    def _call_with(self, extra: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Calls with `extra`, arrays the rules read besides the arguments (FP8 state)."""
        graph = interpret.split_graph_nodes((args, kwargs))
        if graph is not None:
            # NNX modules (BatchNorm statistics, the Rngs counters) are mutated in place:
            # call with their state and write the updated variables back, as `nnx.jit` does.
            nodes, others, state, write_back = graph
            out, new_leaves = self._call(True, (nodes, others, state), {}, extra)
            write_back(new_leaves)
            return out
        return self._call(False, args, kwargs, extra)

    def _call(
        self, graph: bool, args: tuple[Any, ...], kwargs: dict[str, Any], extra: Any = None
    ) -> Any:
        spec, dynamic = interpret.split_args(args, kwargs)
        if not any(isinstance(x, compat.Tracer) for x in (*dynamic, *jax.tree.leaves(extra))):
            if spec.hashable():
                # Called outside any transformation: trace, re-interpret and compile once
                # per argument signature.
                return self._jitted(graph, spec, extra, *dynamic)
        return self._run(graph, spec, extra, *dynamic)

    def jaxpr(self, *args: Any, **kwargs: Any) -> compat.ClosedJaxpr:
        """Returns the jaxpr autocast produces for these arguments (see `autocast_jaxpr`)."""
        spec, dynamic = interpret.split_args(args, kwargs)
        return jax.make_jaxpr(functools.partial(self._run, False, spec, None))(*dynamic)

    def _rules(self, ctx: _Context, extra: Any) -> interpret.Rules:
        """The rule set of one call (`jaxmp._src.fp8_autocast` adds FP8 matmuls)."""
        del extra
        return _AutocastRules(ctx)

    def _run(self, graph: bool, spec: interpret.ArgSpec, extra: Any, *dynamic: Any) -> Any:
        # With `graph`, the outputs are `(out, new_leaves)`: the state leaves the call
        # changed (None if unchanged).
        with attention.intercept() if self.fused_attention else contextlib.nullcontext():
            traced = interpret.trace_call(self._fun, graph, spec, dynamic)
        closed = traced.closed
        ctx = _Context(
            compute_dtype=self.policy.compute_dtype,
            low_ops=self.low_precision_ops,
            float32_ops=self.float32_ops,
            fused_attention=self.fused_attention,
        )
        interp = interpret.Interpreter(self._rules(ctx, extra))
        values = interp.eval_jaxpr(closed.jaxpr, closed.consts, [_Value(x, True) for x in dynamic])
        interp.rules.finish()
        outs = [v.value for v in values]
        n = traced.num_out
        outs = [
            _cast(x, _output_dtype(x.dtype, v.aval.dtype, self.policy.output_dtype))
            if _is_float(x) and _is_float_dtype(v.aval.dtype)
            else x
            for x, v in zip(outs[:n], closed.jaxpr.outvars[:n], strict=True)
        ] + [
            # Updated state keeps the dtype of the plain call, not the output dtype.
            _cast(x, v.aval.dtype) if _is_float(x) and _is_float_dtype(v.aval.dtype) else x
            for x, v in zip(outs[n:], closed.jaxpr.outvars[n:], strict=True)
        ]
        return jax.tree.unflatten(traced.out_tree, outs)

    def __repr__(self) -> str:
        name = getattr(self._fun, "__name__", repr(self._fun))
        return f"jaxmp.autocast({name}, {self.policy!r})"


def autocast(
    fun: Callable[..., Any],
    policy: policy_lib.Policy | str,
    *,
    low_precision_ops: Iterable[str | compat.Primitive] | None = None,
    float32_ops: Iterable[str | compat.Primitive] | None = None,
    fp8: Any = None,
    fp8_exclude: str | Iterable[str] | None = None,
    fused_attention: bool = True,
) -> Autocast:
    """Runs an unmodified function with op-level mixed precision (like ``torch.autocast``).

    The returned function traces `fun` to a jaxpr and evaluates it equation by equation:
    primitives in `low_precision_ops` (matmuls and convolutions) run in
    ``policy.compute_dtype``, primitives in `float32_ops` (exp/log family, reductions,
    special functions, linear algebra) run in float32, and all others follow their inputs
    (float32 parameters and inputs adapt to the activation dtype they meet; computed
    activations promote to the widest). The module documentation of
    ``jaxmp._src.autocast`` spells the rules out; `LOW_PRECISION_OPS` and `FLOAT32_OPS` hold
    the default lists. Floating outputs are cast to ``policy.output_dtype``, except that an
    output autocast computed in the dtype the plain call gives it is never narrowed: under a
    policy whose output dtype is half, float32 losses and statistics, normalisation outputs
    and updated state (Linen ``mutable`` collections, an Equinox ``State``) stay float32 as
    in the plain call (under the ``mixed_*`` policies, whose output dtype is float32, every
    floating output of a float32 function is float32). Returned state that autocast
    computes in the compute dtype (a Linen attention cache) gets the output dtype: feed
    such state back only under a policy whose output dtype is the state's. Parameters are
    used as given (``policy.param_dtype`` is not applied): float32 parameters are cast where
    they are used. With half-precision parameters and inputs, a reduction that the program
    itself widens to float32 and narrows back (``jnp.mean``, ``jnp.sum`` on a bfloat16
    array) keeps its float32 result up to the next matmul or the output, which gets
    ``policy.output_dtype``.

    Control flow (``jit``, ``scan``, ``while_loop``, ``cond``/``switch``, ``checkpoint``)
    is re-interpreted too; loop carries keep the dtype of their initial value. ``custom_jvp``
    functions keep their custom rule, ``custom_vjp`` functions run as traced. Wrap code that
    must not be touched in `float32_region`. Flax NNX modules among the arguments are
    handled like ``nnx.jit`` does: variables the call updates (BatchNorm statistics,
    ``nnx.Rngs`` counters) are written back, in their own dtypes. The result composes
    with ``jax.jit``, ``jax.grad`` and ``jax.vmap`` in any order. Call it under
    ``jax.jit``: called eagerly it compiles itself once per argument signature, but under
    an eager ``jax.grad`` or ``jax.vmap`` it re-traces on every call. Non-array arguments
    (Python scalars, strings, flags such as ``deterministic=True``) are static: they are
    baked into the trace.

    Args:
      fun: the function to run, written for float32 (or any dtype).
      policy: a `jaxmp.Policy` or a policy string for `jaxmp.get_policy`, such as
        ``"mixed_float16"`` or ``"mixed_bfloat16"``.
      low_precision_ops: primitives (names or `jax.extend.core.Primitive` objects) to run
        in the compute dtype, replacing `LOW_PRECISION_OPS`; extend the default with
        ``jaxmp.LOW_PRECISION_OPS | {...}`` or shrink it with ``- {...}``.
      float32_ops: primitives to run in float32, replacing `FLOAT32_OPS`. A primitive named
        in one of the two sets is removed from the other's default.
      fp8: an FP8 recipe (`Float8CurrentScaling`, `DelayedScaling`, `Float8BlockScaling`,
        `MXFP8BlockScaling`): every ``dot_general`` with floating operands (and, with a
        per-tensor recipe, every ``conv_general_dilated``) then runs in FP8, forward and
        backward, its result in the compute dtype (see the FP8 guide). The function is
        then a `Float8Autocast`, whose ``fp8_init`` and ``with_fp8_state`` handle the state
        of `DelayedScaling`.
      fp8_exclude: a regex (or several) fully matching the name stacks of the matmuls to
        keep out of FP8, which then follow the policy: the Linen module path with the top
        module's class first (``"TransformerLM/head"``, ``".*/head"``), or the names of
        ``jax.named_scope`` blocks.
      fused_attention: attention written with ``jax.nn.dot_product_attention`` (and Flax's
        attention functions and modules, see the autocast guide) runs as
        `jaxmp.dot_product_attention` on its operands cast to the compute dtype: cuDNN's
        fused kernel on NVIDIA GPUs where it applies, XLA's attention in the compute dtype
        elsewhere. False re-interprets the float32 attention op by op like any other code.

    Returns:
      A function with the signature of `fun`.

    Raises:
      TypeError: if `fun` is not callable, `policy` is neither a policy nor a string, an
        op set is not a collection of names and primitives, or `fp8` is not a recipe.
      ValueError: for an invalid policy string, an unknown primitive name, a primitive
        in both op sets, or an invalid regex in `fp8_exclude`.
      NotImplementedError: when called, for a higher-order primitive autocast has no rule
        for (the message names it and the way out).

    Example:
      >>> import jax, jax.numpy as jnp, jaxmp
      >>> def mlp(w, x):
      ...   return jax.nn.softmax(jnp.tanh(x @ w) @ w)
      >>> f = jax.jit(jaxmp.autocast(mlp, "mixed_float16"))
      >>> w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
      >>> f(w, x).dtype  # output_dtype of mixed_float16
      dtype('float32')
      >>> jaxpr = jaxmp.autocast_jaxpr(mlp, "mixed_float16")(w, x)
      >>> [str(e.outvars[0].aval.dtype) for e in jaxpr.eqns if e.primitive.name == "dot_general"]
      ['float16', 'float16']
    """
    if not callable(fun):
        raise TypeError(f"`fun` must be callable, got {fun!r}.")
    policy = policy_lib.as_policy(policy, arg="policy")
    low, f32 = _resolve_ops(low_precision_ops, float32_ops)
    if fp8 is not None or fp8_exclude is not None:
        if fp8 is None:
            raise TypeError("`fp8_exclude` needs an FP8 recipe: pass `fp8=` too.")
        if not _FP8:  # pragma: no cover - `import jaxmp` registers it
            raise RuntimeError("FP8 autocast is not registered: import jaxmp first.")
        return _FP8[0](fun, policy, low, f32, fp8, fp8_exclude, fused_attention)
    return Autocast(fun, policy, low, f32, fused_attention=fused_attention)


# The FP8 rule set (`jaxmp._src.fp8_autocast`, which builds on this module) is given to
# `autocast` from above, as a function building its `Autocast` subclass from the arguments.
_FP8: list[Callable[..., Autocast]] = []


def register_fp8(build: Callable[..., Autocast]) -> None:
    """Sets how `autocast` builds a function with an FP8 recipe: ``build(fun, policy,
    low_precision_ops, float32_ops, recipe, exclude, fused_attention)``, the recipe and
    `fp8_exclude` as the user gave them (it validates them)."""
    _FP8[:] = [build]


def autocast_jaxpr(
    fun: Callable[..., Any],
    policy: policy_lib.Policy | str,
    **kwargs: Any,
) -> Callable[..., compat.ClosedJaxpr]:
    """Returns a function that gives the jaxpr `autocast` produces, to inspect dtypes.

    Args:
      fun: the function, as for `autocast`.
      policy: the policy, as for `autocast`.
      **kwargs: `low_precision_ops` / `float32_ops`, as for `autocast`.

    Returns:
      A function taking `fun`'s arguments and returning a `jax.extend.core.ClosedJaxpr`.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmp
      >>> def logsumexp(x):
      ...     return jnp.log(jnp.sum(jnp.exp(x)))
      >>> jaxpr = jaxmp.autocast_jaxpr(logsumexp, "mixed_bfloat16")(jnp.ones(3))
      >>> sorted({str(e.outvars[0].aval.dtype) for e in jaxpr.eqns
      ...         if e.primitive.name in ("exp", "log", "reduce_sum")})
      ['float32']
    """
    return autocast(fun, policy, **kwargs).jaxpr


@contextlib.contextmanager
def _region_scope() -> Iterator[None]:
    with jax.named_scope(REGION_SCOPE):
        yield


def float32_region(fun: Callable[..., Any] | None = None) -> Any:
    """Marks code that `autocast` must run as written (in float32 for a float32 model).

    Use it as a decorator (``@jaxmp.float32_region``) or as a context manager inside the
    traced function (``with jaxmp.float32_region(): ...``). Every primitive traced inside
    is re-bound unchanged by `autocast`, with its floating inputs cast back to the dtypes
    they were traced with (float32 for a float32 model), so results leave the region in
    float32. It works by opening a ``jax.named_scope`` that autocast recognises; outside
    autocast it changes nothing.

    Args:
      fun: the function to mark; omit it to get a context manager.

    Returns:
      The wrapped function, or a context manager when `fun` is omitted.

    Raises:
      TypeError: if `fun` is given and is not callable.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> @jaxmp.float32_region
      ... def stable_head(h, w):
      ...   return h @ w
      >>> def model(w, x):
      ...   return stable_head(x @ w, w)
      >>> jaxpr = jaxmp.autocast_jaxpr(model, "mixed_float16")(jnp.ones((2, 2)), jnp.ones((1, 2)))
      >>> [str(e.outvars[0].aval.dtype) for e in jaxpr.eqns if e.primitive.name == "dot_general"]
      ['float16', 'float32']
    """
    if fun is None:
        return _region_scope()
    if not callable(fun):
        raise TypeError(f"`fun` must be callable or omitted, got {fun!r}.")

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with jax.named_scope(REGION_SCOPE):
            return fun(*args, **kwargs)

    return wrapped
