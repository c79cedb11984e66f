"""The one place jaxmp touches JAX internals, with one shim per difference between versions.

jaxmp re-interprets jaxprs (`jaxmp.autocast`, and the select-at-source update of
`jaxmp.loss_scaling`). That needs names from ``jax.extend.core``, the parameters of the
control-flow primitives and the way an equation is re-bound, all of which change between JAX
releases. Every such use goes through this module; nothing else in jaxmp imports
``jax._src`` or reads a primitive's parameters by a version-dependent key.

`INTERNAL_NAMES` lists every internal name used here; ``tests/test_compat.py`` checks that each
one exists on the installed JAX and names the one that is missing, so a new JAX release breaks
one clear test instead of autocast at a user's site.

Supported range: jax 0.7.2 (the floor tested in CI) to jax 0.12 (the newest tested).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from jax.custom_derivatives import SymbolicZero
from jax.extend import core as jcore
from jax.extend import source_info_util

__all__ = [
    "INTERNAL_NAMES",
    "ClosedJaxpr",
    "DropVar",
    "Jaxpr",
    "Literal",
    "Primitive",
    "SymbolicZero",
    "Tracer",
    "bind",
    "eqn_context",
    "has_subjaxprs",
    "custom_jvp_rule_jaxpr",
    "is_symbolic_zero",
    "is_tracer",
    "jaxpr_and_consts",
    "jaxprs_in_params",
    "known_primitive_names",
    "lowered_primitive_names",
    "name_stack_of",
    "missing_internal_names",
    "primitives_in",
    "scan_counts",
    "source_context",
]

ClosedJaxpr = jcore.ClosedJaxpr
DropVar = jcore.DropVar
Jaxpr = jcore.Jaxpr
Literal = jcore.Literal
Primitive = jcore.Primitive
Tracer = jax.core.Tracer
jaxprs_in_params = jcore.jaxprs_in_params

#: Every JAX name jaxmp relies on that is not part of JAX's stable public API, as
#: ``(module, attribute)``. Attributes of jaxpr objects and primitive parameters are listed
#: in ``tests/test_compat.py``, which traces the programs that produce them.
INTERNAL_NAMES: tuple[tuple[str, str], ...] = (
    ("jax.extend.core", "ClosedJaxpr"),
    ("jax.extend.core", "DropVar"),
    ("jax.extend.core", "Jaxpr"),
    ("jax.extend.core", "Literal"),
    ("jax.extend.core", "Primitive"),
    ("jax.extend.core", "jaxprs_in_params"),
    ("jax.extend.core", "primitives"),
    ("jax.extend.source_info_util", "current_name_stack"),
    ("jax.extend.source_info_util", "user_context"),
    ("jax.core", "Tracer"),
    ("jax.custom_derivatives", "SymbolicZero"),
    ("jax._src.interpreters.mlir", "_lowerings"),
    ("jax._src.interpreters.mlir", "_platform_specific_lowerings"),
)


def missing_internal_names() -> list[str]:
    """Returns ``"module.attribute"`` for each name of `INTERNAL_NAMES` the installed JAX lacks."""
    missing = []
    for module_name, attr in INTERNAL_NAMES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(f"{module_name}.{attr}")
            continue
        if not hasattr(module, attr):
            missing.append(f"{module_name}.{attr}")
    return missing


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
    Same in jax 0.7 to 0.12: ``jvp_jaxpr_fun`` is a wrapped function of the zero mask.
    """
    jaxpr, consts, out_zeros = params["jvp_jaxpr_fun"].call_wrapped(*zeros)
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    if not consts:  # jax 0.12 may attach the constants to the jaxpr itself
        consts = getattr(jaxpr, "consts", None) or ()
    return inner, consts, out_zeros


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

    jax < 0.7: ``get_bind_params`` returns ``(subfuns, params)``; later a dict.
    """
    params = eqn.params if params is None else params
    bind_params = eqn.primitive.get_bind_params(params)
    subfuns: Sequence[Any] = ()
    if isinstance(bind_params, tuple):  # pragma: no cover - jax < 0.7
        subfuns, bind_params = bind_params
    out = eqn.primitive.bind(*subfuns, *vals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


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


def lowered_primitive_names() -> set[str]:
    """Names of every primitive with a lowering rule (shard_map and Pallas ones once imported)."""
    names: set[str] = set()
    try:
        from jax._src.interpreters import mlir

        names.update(p.name for p in mlir._lowerings)
        for rules in mlir._platform_specific_lowerings.values():
            names.update(p.name for p in rules)
    except (ImportError, AttributeError):  # pragma: no cover - caught by tests/test_compat.py
        pass
    return names


def primitives_in(module: Any) -> set[str]:
    """Names of the `Primitive` objects defined at the top level of `module`."""
    return {value.name for value in vars(module).values() if isinstance(value, Primitive)}


def known_primitive_names() -> set[str]:
    """Names of the primitives JAX knows now (call on use: later imports register more)."""
    names = primitives_in(jcore.primitives) | primitives_in(jax.lax) | primitives_in(jax.lax.linalg)
    return names | lowered_primitive_names()
