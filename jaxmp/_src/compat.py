"""The one place jaxmp touches JAX internals, with one shim per difference between versions.

jaxmp re-interprets jaxprs (the core in `jaxmp._src.interpret`, under `jaxmp.autocast` and
`jaxmp.inspect`, and the select-at-source update of `jaxmp.loss_scaling`). That needs names
from ``jax.extend.core``, the parameters of the control-flow primitives, the way an equation
is re-bound and where it came from (name stack, user frames), all of which change between JAX
releases. Every such use goes through this module; nothing else in jaxmp imports
``jax._src`` or reads a primitive's parameters by a version-dependent key.

`INTERNAL_NAMES` lists every internal name used here; ``tests/test_compat.py`` checks that each
one exists on the installed JAX and names the one that is missing, so a new JAX release breaks
one clear test instead of autocast at a user's site.

Supported range: jax 0.8.2 (the floor, tested in CI) to jax 0.12 (the newest, tested in CI).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from jax.extend import source_info_util

__all__ = [
    "INTERNAL_NAMES",
    "LOOPS_WIDEN_BFLOAT16_ON_CPU",
    "ClosedJaxpr",
    "DropVar",
    "Jaxpr",
    "Literal",
    "Primitive",
    "SymbolicZero",
    "Tracer",
    "bind",
    "branches_platforms",
    "eqn_context",
    "has_subjaxprs",
    "inline_with_selects",
    "custom_jvp_rule_jaxpr",
    "is_symbolic_zero",
    "is_tracer",
    "jaxpr_and_consts",
    "jaxprs_in_params",
    "traced_functions",
    "known_primitive_names",
    "lowered_primitive_names",
    "name_stack_of",
    "name_stack_parts",
    "per_shard",
    "missing_internal_names",
    "primitives_in",
    "resolve",
    "scan_counts",
    "source_context",
    "user_frames",
    "varying_axes",
    "vary_like",
]


def _minor_version(version: str) -> tuple[int, ...]:
    """``(major, minor)`` of a version string such as ``"0.12.0.1"``."""
    return tuple(int(part) for part in version.split(".")[:2])


def _jaxlib_version() -> tuple[int, ...]:
    import jaxlib

    return _minor_version(jaxlib.__version__)


#: jax < 0.10 (0.8.2 and 0.9.2 read): the transpose of a convolution whose
#: ``preferred_element_type`` differs from its operands' dtype (float16 x float16 -> float32)
#: convolves the float32 cotangent with the float16 operand, which ``conv_general_dilated``
#: refuses ("requires arguments to have the same dtypes"); jax 0.10 converts the operand first.
CONV_TRANSPOSE_NEEDS_ONE_DTYPE = _minor_version(jax.__version__) < (0, 10)

#: jaxlib < 0.10 (0.8.2 measured; 0.10.2 does not): XLA:CPU converts float32 to
#: float8_e4m3fn through float16 where the conversion is fused into a one-row matmul, rounding
#: twice (1 + 1/16 + 2^-12 becomes 1, not 1.125); a standalone conversion rounds once.
FP8_CONVERT_MAY_ROUND_TWICE = _jaxlib_version() < (0, 10)

#: jaxlib < 0.12 (0.8.2 and 0.10.2 measured), XLA:CPU: a bfloat16 array read inside a loop
#: (a `lax.fori_loop` slicing a leaf) is converted to a float32 copy ahead of the loop, twice
#: the array; its bits as uint16 are not (one copy of the array instead). jaxlib 0.12 does
#: neither.
LOOPS_WIDEN_BFLOAT16_ON_CPU = _jaxlib_version() < (0, 12)

#: Every JAX name jaxmp relies on that is not part of JAX's stable public API: its name here
#: and the places it is looked up, first found wins. Attributes of jaxpr objects and primitive
#: parameters are checked by ``tests/test_compat.py``, which traces the programs that have them.
INTERNAL_NAMES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ClosedJaxpr", ("jax.extend.core.ClosedJaxpr",)),
    # jax < 0.10: only in jax._src.core; jax >= 0.10: jax.extend.core.
    ("DropVar", ("jax.extend.core.DropVar", "jax._src.core.DropVar")),
    ("Jaxpr", ("jax.extend.core.Jaxpr",)),
    ("Literal", ("jax.extend.core.Literal",)),
    ("Primitive", ("jax.extend.core.Primitive",)),
    # jax < 0.10: only in jax._src.core; jax >= 0.10: jax.extend.core.
    ("jaxprs_in_params", ("jax.extend.core.jaxprs_in_params", "jax._src.core.jaxprs_in_params")),
    ("primitives", ("jax.extend.core.primitives",)),
    ("current_name_stack", ("jax.extend.source_info_util.current_name_stack",)),
    ("user_context", ("jax.extend.source_info_util.user_context",)),
    # The user's frames of a traceback (JAX's own files and the standard library left out):
    # only in jax._src, same signature and `Frame` fields in jax 0.8 to 0.12.
    ("user_frames", ("jax._src.source_info_util.user_frames",)),
    ("Tracer", ("jax.core.Tracer",)),
    ("Var", ("jax.extend.core.Var",)),
    # The jit trace being built and how `jax.jit(inline=True)` copies a jaxpr's equations into
    # it: only in jax._src, the same in jax 0.8 to 0.12 (`inline_with_selects`).
    ("trace_ctx", ("jax._src.core.trace_ctx",)),
    ("DynamicJaxprTrace", ("jax._src.interpreters.partial_eval.DynamicJaxprTrace",)),
    ("DynamicJaxprTracer", ("jax._src.interpreters.partial_eval.DynamicJaxprTracer",)),
    ("inline_jaxpr_into_trace", ("jax._src.interpreters.partial_eval.inline_jaxpr_into_trace",)),
    ("current_source_info", ("jax.extend.source_info_util.current",)),
    ("SymbolicZero", ("jax.custom_derivatives.SymbolicZero",)),
    ("mlir_lowerings", ("jax._src.interpreters.mlir._lowerings",)),
    (
        "mlir_platform_specific_lowerings",
        ("jax._src.interpreters.mlir._platform_specific_lowerings",),
    ),
)


def _lookup(path: str) -> Any:
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    return getattr(module, attr, None)


def resolve(name: str) -> Any:
    """The object `INTERNAL_NAMES` lists under `name`, from the first place that has it.

    Raises:
      ImportError: naming every place looked in, when the installed JAX has none of them.
    """
    (places,) = [p for n, p in INTERNAL_NAMES if n == name]
    for path in places:
        found = _lookup(path)
        if found is not None:
            return found
    raise ImportError(
        f"jaxmp needs {' or '.join(places)}, which jax {jax.__version__} does not have; "
        "this JAX version is outside jaxmp's supported range (README, 'Supported versions')."
    )


def missing_internal_names() -> list[str]:
    """Returns, for each name of `INTERNAL_NAMES` the installed JAX lacks, where it looked."""
    return [
        " or ".join(places)
        for _, places in INTERNAL_NAMES
        if all(_lookup(path) is None for path in places)
    ]


ClosedJaxpr = resolve("ClosedJaxpr")
DropVar = resolve("DropVar")
Jaxpr = resolve("Jaxpr")
Literal = resolve("Literal")
Primitive = resolve("Primitive")
Tracer = resolve("Tracer")
SymbolicZero = resolve("SymbolicZero")
Var = resolve("Var")
jaxprs_in_params = resolve("jaxprs_in_params")


def is_tracer(x: Any) -> bool:
    """Whether `x` is a JAX tracer (a value being traced by jit, grad, vmap, ...)."""
    return isinstance(x, Tracer)


def has_subjaxprs(params: dict[str, Any]) -> bool:
    """Whether an equation's parameters hold sub-jaxprs (a higher-order primitive)."""
    return any(True for _ in jaxprs_in_params(params))


def jaxpr_and_consts(jaxpr: Any) -> tuple[Any, Sequence[Any]]:
    """Splits a sub-jaxpr parameter into an open jaxpr and the values of its constvars.

    jax < 0.12: control-flow primitives hold a ``ClosedJaxpr`` (``.jaxpr``, ``.consts``);
    ``remat`` holds an open ``Jaxpr`` with no constvars. jax 0.12: every sub-jaxpr is a
    ``Jaxpr`` that carries its constants itself (``.consts``, with ``.jaxpr`` returning the
    object itself).
    """
    consts = getattr(jaxpr, "consts", None)
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    if consts is None:
        if inner.constvars:
            raise NotImplementedError(  # pragma: no cover - no JAX in the range does this
                "jaxmp found an open sub-jaxpr with constvars and no values for them."
            )
        consts = ()
    return inner, consts


def is_symbolic_zero(x: Any) -> bool:
    """Whether a tangent given to a ``custom_jvp`` rule is a symbolic zero."""
    return type(x) is SymbolicZero


def custom_jvp_rule_jaxpr(params: dict[str, Any], zeros: Sequence[bool]) -> tuple[Any, Any, Any]:
    """The JVP rule of a ``custom_jvp_call`` equation as ``(jaxpr, consts, out_zeros)``.

    `zeros` marks the tangents that are symbolic zeros. The rule's jaxpr takes the primal
    operands (after the equation's ``num_consts`` constants) and the nonzero tangents.
    Same in jax 0.8 to 0.12: ``jvp_jaxpr_fun`` is a wrapped function of the zero mask.
    """
    jaxpr, consts, out_zeros = params["jvp_jaxpr_fun"].call_wrapped(*zeros)
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    if not consts:  # jax 0.12 may attach the constants to the jaxpr itself
        consts = getattr(jaxpr, "consts", None) or ()
    return inner, consts, out_zeros


def branches_platforms(params: dict[str, Any]) -> tuple[tuple[str, ...] | None, ...] | None:
    """The platforms of each branch of a ``cond`` staged by `lax.platform_dependent` (None
    for the default branch), or None for an ordinary ``cond``. The same parameter in jax 0.8
    to 0.12."""
    return params.get("branches_platforms")


def scan_counts(params: dict[str, Any]) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation.

    jax < 0.12: the parameters ``num_consts`` and ``num_carry``. jax 0.12: a flat tree
    ``ft_in`` of ``(consts, carry, xs)``.
    """
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carry, _ = params["ft_in"].unpack()
    return len(list(consts)), len(list(carry))


def bind(eqn: Any, vals: Sequence[Any], params: dict[str, Any] | None = None) -> list[Any]:
    """Re-binds `eqn`'s primitive on `vals` (with `params` in place of its own, if given).

    ``get_bind_params`` returns the parameters to bind with (a dict in jax 0.8 to 0.12;
    older releases returned ``(subfuns, params)``, still accepted).
    """
    params = eqn.params if params is None else params
    bind_params = eqn.primitive.get_bind_params(params)
    subfuns: Sequence[Any] = ()
    if isinstance(bind_params, tuple):  # pragma: no cover - older than the supported range
        subfuns, bind_params = bind_params
    out = eqn.primitive.bind(*subfuns, *vals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _one_equation(fn: Any, *avals: Any) -> tuple[Any, list[Any]] | None:
    """The single equation of ``make_jaxpr(fn)`` on arguments of `avals` and that jaxpr's
    input variables (the arguments, in order), or None."""
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
    jaxpr, consts = jaxpr_and_consts(jax.make_jaxpr(fn)(*specs))
    if len(jaxpr.eqns) != 1 or consts:
        return None
    (eqn,) = jaxpr.eqns
    invars = list(jaxpr.invars)
    if [v.aval for v in invars] != list(avals):
        return None  # the aval has more than a shape, dtype and weak type (a sharding, vma)
    if not all(isinstance(v, Var) and any(v is w for w in invars) for v in eqn.invars):
        return None
    return eqn, invars


def inline_with_selects(
    closed: Any, args: Sequence[Any], selects: dict[Any, tuple[Any, Any]]
) -> list[Any] | None:
    """`closed` applied to `args`, copied into the jit trace being built, with selects.

    `selects` maps a variable ``v`` computed by one of `closed`'s equations to ``(old, pred)``:
    the input variable holding its old value and a boolean array of its shape. Right after the
    equation that computes it, ``v`` is replaced by ``select(pred, v, old)``, and every later
    equation reads the selected value. The equations are copied as `jax.jit(inline=True)`
    copies a callee's (``inline_jaxpr_into_trace``, which reads only a jaxpr's ``constvars``,
    ``invars``, ``eqns`` and ``outvars``: the same in jax 0.8 to 0.12), not bound one by one
    again, which would trace the function a second time.

    Returns the outputs, every variable of `selects` selected where it is computed, or None
    when the copy does not apply: not inside a jit trace, an argument, constant or `pred` from
    another trace, or a type with more than a shape and dtype (a device-varying value under
    `shard_map`, an explicit sharding), whose selects the caller's binding types itself.
    """
    trace = resolve("trace_ctx").trace
    tracer_type = resolve("DynamicJaxprTracer")
    if not isinstance(trace, resolve("DynamicJaxprTrace")):
        return None

    def of_this_trace(values: Sequence[Any]) -> bool:
        return all(isinstance(t, tracer_type) and t._trace is trace for t in values)

    jaxpr, consts = jaxpr_and_consts(closed)
    const_vars, const_vals, lifted_vars, lifted_vals = [], [], [], []
    for var, value in zip(jaxpr.constvars, consts, strict=True):
        if isinstance(value, Tracer):
            lifted_vars.append(var)
            lifted_vals.append(value)
        else:
            const_vars.append(var)
            const_vals.append(value)
    if not of_this_trace([*lifted_vals, *args]):
        return None
    pred_vars: dict[int, Any] = {}  # id of a pred tracer -> its input variable
    pred_vals: list[Any] = []
    templates: dict[Any, Any] = {}
    eqns: list[Any] = []
    subst: dict[Any, Any] = {}  # a variable of `selects` -> its selected value

    def select_eqn(var: Any, old: Any, pred: Any) -> Any:
        aval = var.aval
        if old.aval != aval:
            raise _NotCopied
        pb = pred_vars.get(id(pred))
        if pb is None:
            pb = pred_vars[id(pred)] = Var(jax.typeof(pred))
            pred_vals.append(pred)
        key = (pb.aval, aval)
        if key not in templates:
            templates[key] = _one_equation(jax.lax.select, pb.aval, aval, aval)
        if templates[key] is None or templates[key][0].outvars[0].aval != aval:
            raise _NotCopied
        template, template_args = templates[key]
        out = Var(aval)
        position = {id(v): i for i, v in enumerate(template_args)}
        invars = [(pb, var, old)[position[id(v)]] for v in template.invars]
        subst[var] = out
        return template.replace(invars=invars, outvars=[out])

    try:
        for eqn in jaxpr.eqns:
            if subst and any(not isinstance(v, Literal) and v in subst for v in eqn.invars):
                eqn = eqn.replace(
                    invars=[v if isinstance(v, Literal) else subst.get(v, v) for v in eqn.invars]
                )
            eqns.append(eqn)
            for var in eqn.outvars:
                if not isinstance(var, DropVar) and var in selects and var not in subst:
                    eqns.append(select_eqn(var, *selects[var]))
    except _NotCopied:
        return None
    if len(subst) != len(selects):  # a variable no equation computes: not this function's use
        return None
    if not of_this_trace(pred_vals):
        return None
    program = _JaxprParts(
        constvars=const_vars,
        invars=[*lifted_vars, *jaxpr.invars, *pred_vars.values()],
        eqns=eqns,
        outvars=[v if isinstance(v, Literal) else subst.get(v, v) for v in jaxpr.outvars],
    )
    inline = resolve("inline_jaxpr_into_trace")
    tracers = [*lifted_vals, *args, *pred_vals]
    return list(inline(trace, resolve("current_source_info")(), program, const_vals, *tracers))


class _NotCopied(Exception):
    """A select `inline_with_selects` cannot write as an equation."""


class _JaxprParts:
    """The four parts of a jaxpr ``inline_jaxpr_into_trace`` reads."""

    def __init__(self, *, constvars: Any, invars: Any, eqns: Any, outvars: Any):
        self.constvars, self.invars, self.eqns, self.outvars = constvars, invars, eqns, outvars


def eqn_context(eqn: Any) -> contextlib.AbstractContextManager[Any]:
    """The context an equation was traced under (``eqn.ctx.manager``: compute type, ...)."""
    manager = getattr(getattr(eqn, "ctx", None), "manager", None)
    return manager if manager is not None else contextlib.nullcontext()


@contextlib.contextmanager
def source_context(eqn: Any) -> Iterator[None]:
    """Re-binds under `eqn`'s traceback and name stack, so errors and the new jaxpr point at
    the user's code and module path."""
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
        with eqn_context(eqn):
            yield


def name_stack_of(eqn: Any) -> str:
    """The name stack (``jax.named_scope`` path, Flax module path) of `eqn`, as a string."""
    return str(eqn.source_info.name_stack)


def name_stack_parts(eqn: Any) -> list[tuple[str, str]]:
    """`eqn`'s name stack as ``(kind, name)`` pairs, outermost first.

    kind is ``"transform"`` for a transformation (``jvp``, ``transpose``, ``vmap``...) and
    ``"scope"`` for a `jax.named_scope` (Flax Linen opens one per module call). The name stack's
    ``stack`` holds ``Scope`` and ``Transform`` objects with a ``name`` in jax 0.8 to 0.12.
    """
    parts = []
    for element in eqn.source_info.name_stack.stack:
        kind = "transform" if type(element).__name__ == "Transform" else "scope"
        parts.append((kind, str(element.name)))
    return parts


def user_frames(eqn: Any, traced: tuple[str, str] | None = None) -> list[tuple[str, int, str]]:
    """``(file, line, function)`` of the user's frames in `eqn`'s traceback, innermost first.

    Frames in JAX's own files and in the Python standard library are left out (JAX's test for
    user code, as in its error messages). The traceback is that of the line that bound the
    primitive; JAX gives the equations of a derivative the traceback of the line they
    differentiate. With `traced`, ``(file, name)`` of the function the jaxpr was traced from,
    the frames end at its frame: jax >= 0.9 ends a traceback there, jax 0.8 goes on with the
    frames of whoever called the tracing.
    """
    traceback = eqn.source_info.traceback
    if traceback is None:
        return []
    frames = [
        (frame.file_name, int(frame.start_line), frame.function_name)
        for frame in resolve("user_frames")(traceback)
    ]
    if traced is not None:
        for i, (file, _, function) in enumerate(frames):
            if file == traced[0] and function.rsplit(".", 1)[-1] == traced[1]:
                return frames[: i + 1]
    return frames


def traced_functions(eqn: Any) -> list[tuple[str, str]]:
    """``(file, name)`` of each function whose jaxpr is nested in `eqn` (a ``jit``'s, a
    loop's body), from the jaxprs' debug info (``func_src_info``: ``"name at file:line"``);
    those without one are left out."""
    found = []
    for sub in jaxprs_in_params(eqn.params):
        inner = sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub
        info = getattr(getattr(inner, "debug_info", None), "func_src_info", None)
        if not isinstance(info, str) or " at " not in info:
            continue
        name, _, where = info.rpartition(" at ")
        found.append((where.rsplit(":", 1)[0], name))
    return found


def varying_axes(x: Any) -> frozenset[str]:
    """The mesh axes `x` varies along inside ``jax.shard_map``; empty elsewhere.

    The "varying manual axes" of the value's type: ``jax.typeof(x).vma`` in jax 0.8,
    ``jax.typeof(x).manual_axis_type.varying`` in jax 0.10 to 0.12 (frozensets of axis
    names; empty outside ``shard_map`` and under ``check_vma=False``).
    """
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", None) or ())


def vary_like(x: Any, like: Any) -> Any:
    """`x` marked as varying along every mesh axis `like` varies along inside
    ``jax.shard_map`` (``lax.pcast(..., to="varying")``, jax 0.8 to 0.12): for a constant
    that must have the type of a value computed from `like` (the branches of a ``cond``)."""
    axes = varying_axes(like) - varying_axes(x)
    return jax.lax.pcast(x, tuple(sorted(axes)), to="varying") if axes else x


def sharding_group(x: Any) -> Any:
    """A key under which arrays can be combined element by element without moving data.

    Arrays of one shape with equal keys may be stacked or combined (`jaxmp.all_finite`
    reduces them together): ``None`` where that is always free (one device; or inside
    ``shard_map``, where values are per-device), the partition spec of the value's type
    where the mesh has ``Explicit`` axes (``jax.typeof(x).sharding``, jax 0.8 to 0.12;
    combining two specs there is an error), and ``id(x)``, never shared, where the
    compiler chooses the shardings (``Auto`` axes on several devices): there it could
    reshard a leaf to combine it with another, moving it between devices at every step.
    """
    if jax.device_count() == 1:
        return None
    explicit = explicit_sharding(x)
    if explicit is not None:
        return explicit.spec
    axis_types = _axis_types(x)
    if axis_types and all(t == jax.sharding.AxisType.Manual for t in axis_types):
        return None
    return id(x)


def _typed_mesh(x: Any) -> Any:
    """The mesh in the type of `x` (``jax.typeof(x).sharding.mesh``, jax 0.8 to 0.12; an
    empty one where it has none), or None where its type has no sharding."""
    return getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)


def _axis_types(x: Any) -> tuple[Any, ...]:
    return tuple(getattr(_typed_mesh(x), "axis_types", ()) or ())


def context_mesh() -> Any:
    """The context's abstract mesh (``jax.sharding.get_abstract_mesh``, jax 0.8 to 0.12)."""
    return jax.sharding.get_abstract_mesh()


def on_mesh(tree: Any, mesh: Any) -> Any:
    """The replicated arrays of `tree` typed on `mesh` (a ``reshard`` to ``P()`` under it, as
    ``jax.sharding.auto_axes`` returns its outputs), where typed on another mesh with the
    same axes; other leaves as they are."""

    def cast(x: Any) -> Any:
        own = _typed_mesh(x)
        if own is None or own == mesh or own.axis_names != mesh.axis_names or not own.axis_names:
            return x
        with jax.sharding.use_abstract_mesh(mesh):
            return jax.sharding.reshard(x, jax.sharding.PartitionSpec())

    return jax.tree.map(cast, tree)


@contextlib.contextmanager
def mesh_of(x: Any) -> Iterator[None]:
    """Traces under the mesh in the type of `x` (``jax.sharding.use_abstract_mesh``, jax 0.8
    to 0.12), not the context's: an equation traced under ``jax.sharding.auto_axes``
    re-binds under its own (``eqn_context``), and values of two meshes do not meet."""
    mesh = _typed_mesh(x)
    if mesh is None:
        yield
        return
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def _explicit_context() -> bool:
    """Whether the context mesh (``jax.set_mesh``) has ``Explicit`` axes
    (``jax.sharding.get_abstract_mesh``, jax 0.8 to 0.12)."""
    types = getattr(context_mesh(), "axis_types", ()) or ()
    return any(t == jax.sharding.AxisType.Explicit for t in types)


def explicit_sharding(x: Any) -> Any:
    """The sharding in the type of `x` where its mesh has ``Explicit`` axes, else None.

    ``jax.typeof(x).sharding`` (jax 0.8 to 0.12): with ``Explicit`` axes (``jax.set_mesh``)
    operands of one operation must agree on it, so values made to meet `x` take it too.
    """
    if not any(t == jax.sharding.AxisType.Explicit for t in _axis_types(x)):
        return None
    return jax.typeof(x).sharding


def summed(x: Any) -> Any:
    """`x` with its unsummed parts summed: a value whose type's partition spec has
    ``unreduced`` mesh axes (jax 0.8 to 0.12: each device along them holds a part of a sum,
    e.g. a dot with ``out_sharding=P(..., unreduced={...})``) resharded without them (one
    all-reduce, as the program's own reshard would do); one with ``reduced`` axes (whole
    on each device, marked for its gradient's sum) without the mark; any other `x` itself."""
    sharding = explicit_sharding(x)
    spec: Any = getattr(sharding, "spec", None)
    if not (getattr(spec, "unreduced", None) or getattr(spec, "reduced", None)):
        return x
    # `spec.partitions` in jax 0.10 to 0.12 (which refuse `*spec` here); 0.8 has none.
    partitions = spec.partitions if hasattr(spec, "partitions") else tuple(spec)
    return jax.sharding.reshard(x, jax.sharding.PartitionSpec(*partitions))


def per_shard(fn: Any, *args: Any) -> Any:
    """``fn(axes, *args)`` on each device's block of arguments sharded over ``Explicit`` mesh
    axes (``jax.shard_map``, jax 0.8 to 0.12, over those axes, each argument split as its
    type says), `axes` the mesh axes they are split over, for `fn` to reduce its outputs
    over: the outputs must be the same on every device. Without ``Explicit`` axes,
    ``fn((), *args)``.

    The arguments must share one sharding's mesh; each is read in its own sharding, so no
    value moves between devices.
    """
    leaves = [x for x in jax.tree.leaves(args) if explicit_sharding(x) is not None]
    if not leaves:
        if _explicit_context():
            # Values typed on the context's mesh with its axes made `Auto` (inside `jax.
            # sharding.auto_axes`, and jax.random's draws with an `out_sharding`): measured
            # under that mesh, the results replicated on the context's.
            measure = jax.sharding.auto_axes(
                lambda *a: fn((), *a), out_sharding=jax.sharding.PartitionSpec()
            )
            return measure(*args)
        return fn((), *args)
    mesh = jax.typeof(leaves[0]).sharding.mesh
    explicit = {
        n
        for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if t == jax.sharding.AxisType.Explicit
    }
    in_specs = jax.tree.map(lambda x: jax.typeof(x).sharding.spec, args)

    def blocks(*a: Any) -> Any:
        # The axes the blocks are split over: those they vary along (`varying_axes`).
        axes = frozenset().union(*(varying_axes(x) for x in jax.tree.leaves(a)))
        return fn(tuple(n for n in mesh.axis_names if n in axes), *a)

    body = jax.shard_map(
        blocks,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=jax.sharding.PartitionSpec(),
        axis_names=frozenset(explicit),
    )
    context = context_mesh()
    if mesh == context:
        return body(*args)
    # Values typed on another mesh than the context's (inside `jax.sharding.auto_axes` over
    # some axes, or `explicit_axes`): measured under theirs, the results typed on the context's.
    with jax.sharding.use_abstract_mesh(mesh):
        out = body(*args)
    return on_mesh(out, context)


def reshard(x: Any, sharding: Any) -> Any:
    """``jax.sharding.reshard`` (jax 0.8 to 0.12): `x` with the explicit `sharding`."""
    return jax.sharding.reshard(x, sharding)


def lowered_primitive_names() -> set[str]:
    """Names of every primitive with a lowering rule (shard_map and Pallas ones once imported)."""
    names = {p.name for p in resolve("mlir_lowerings")}
    for rules in resolve("mlir_platform_specific_lowerings").values():
        names.update(p.name for p in rules)
    return names


def primitives_in(module: Any) -> set[str]:
    """Names of the `Primitive` objects defined at the top level of `module`."""
    return {value.name for value in vars(module).values() if isinstance(value, Primitive)}


def known_primitive_names() -> set[str]:
    """Names of the primitives JAX knows now (call on use: later imports register more)."""
    names = primitives_in(resolve("primitives"))
    names |= primitives_in(jax.lax) | primitives_in(jax.lax.linalg)
    return names | lowered_primitive_names()
