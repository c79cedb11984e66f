"""The one jaxpr re-interpretation core: `jaxmp.autocast` and `jaxmp.inspect` are rule sets over it.

A function is traced to a jaxpr (`trace_call`) and evaluated again by an `Interpreter`,
equation by equation, each equation handed to a `Rules` object that decides what to do with it
(autocast casts its operands; the inspector measures its output). What every rule set needs
alike lives here, once:

* **Values.** The rules decide what stands for a jaxpr value (autocast: the array and whether
  it is weak; the inspector: the array and its float32 reference). It is a pytree whose array
  leaves cross every traced boundary and whose static part (autocast's weak flag) is kept.
* **Control flow.** ``jit``/``pjit``, ``closed_call``, ``checkpoint`` (remat), ``scan``,
  ``while``, ``cond``/``switch``, ``custom_jvp_call`` and ``custom_vjp_call`` are re-bound
  through JAX's public functions (`jax.jit`, `jax.checkpoint`, `lax.scan`, ...) with their
  sub-jaxprs evaluated under the same rules, so the result composes with grad, vmap and jit.
  Loop carries and the outputs of ``cond`` branches are made to agree by `Rules.fix` and
  `Rules.join`.
* **Source context.** Each equation is re-bound under its traceback and name stack
  (`compat.source_context`), so errors and the new jaxpr point at the user's code;
  `Interpreter.location` gives an equation's whole name stack, that of the equations it is
  nested in included, and the user's frames.
* **Side outputs.** A rule set may add values to the program (`Interpreter.emit`: the
  inspector's statistics, one record per op). They leave every sub-jaxpr as extra outputs;
  over the iterations of ``scan`` and ``while`` they are combined by the rules' monoid
  (`Rules.combine`, identity `Rules.empty`), and a ``cond`` branch not taken contributes the
  identity. A clock, an int32 counting records and threaded through every loop and branch,
  gives each record its position in the program's execution order. Loop bodies and branches
  of such a rule set are traced once (`jax.make_jaxpr`), to learn the records' structure, and
  that trace is replayed inside the loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmp._src import compat

__all__ = [
    "ArgSpec",
    "Interpreter",
    "Location",
    "Rules",
    "eval_plain",
    "literal_value",
    "shape_struct",
    "split_args",
    "trace_call",
]


# --------------------------------------------------------------------------------------------
# Rules.


class Rules:
    """What to do with each equation: the part of a re-interpretation that differs.

    Subclasses implement `literal` and `apply`; the other methods have defaults that suit a
    rule set whose values are plain arrays and whose loops keep their types.
    """

    #: Whether `apply` adds records with `Interpreter.emit` (then loops carry their monoid).
    emits: bool = False
    #: Whether ``custom_jvp`` functions keep their rule (re-bound with `jax.custom_jvp`, the
    #: function and the rule both evaluated under these rules) or are evaluated inline. A rule
    #: set that emits evaluates them inline: its records are not differentiable outputs.
    keep_custom_rules: bool = True

    def literal(self, value: Any) -> Any:
        """The value standing for a jaxpr literal (a numpy value)."""
        raise NotImplementedError

    def const(self, value: Any) -> Any:
        """The value standing for a constant of the jaxpr (a closed-over array)."""
        return self.literal(value)

    def value(self, v: Any) -> Any:
        """The program's own array in `v` (its first leaf)."""
        return jax.tree.leaves(v)[0]

    def wrap(self, x: Any) -> Any:
        """The value standing for an array computed outside the rules (a tangent)."""
        raise NotImplementedError

    def start(self, jaxpr: Any) -> Any:
        """Per-jaxpr state (an analysis of the whole jaxpr) handed to every `apply`."""
        del jaxpr
        return None

    def apply(
        self, frame: Any, index: int, eqn: Any, vals: list[Any], interp: Interpreter
    ) -> list[Any] | None:
        """Evaluates `eqn` (the `index`-th of its jaxpr) on `vals`; returns its outputs.

        None leaves the outputs unset (no later equation reads them). For a higher-order
        equation, ``interp.higher_order(eqn, vals)`` evaluates its sub-jaxprs under these
        rules (or returns NotImplemented for a primitive the core does not know).
        """
        raise NotImplementedError

    def fix(self, vals: list[Any], like: list[Any]) -> list[Any]:
        """`vals` given the types of `like` (structures): a loop carry, a branch output."""
        del like
        return vals

    def join(self, branches: list[list[Any]]) -> list[Any]:
        """The output structures all branches of a ``cond`` are fixed to (`fix`)."""
        return branches[0]

    def empty(self, struct: Any) -> Any:
        """The identity of the records' monoid, for records of structure `struct`."""
        raise NotImplementedError

    def combine(self, a: Any, b: Any) -> Any:
        """Two records of the same op combined (two iterations of a loop)."""
        raise NotImplementedError

    def in_loop(self, meta: Any, kind: str, detail: str) -> Any:
        """The static part of a record leaving a loop or branch (`kind` is scan/while/cond)."""
        del kind, detail
        return meta

    def loop_inputs(self, eqn: Any) -> Any:
        """Arrays the rules hand to each iteration of the ``scan`` `eqn`, or None.

        A pytree whose leaves have the loop's length as leading axis; the core scans over
        them with the loop's own inputs, and `in_iteration` receives each iteration's slice
        (FP8's per-iteration delayed-scaling state: one history per layer of a scanned
        stack, each receiving its own gradient instead of their sum).
        """
        del eqn
        return None

    def in_iteration(self, inputs: Any) -> contextlib.AbstractContextManager[Any]:
        """Entered around the body of a ``scan`` with its slice of `loop_inputs`."""
        del inputs
        return contextlib.nullcontext()

    def body(self, interp: Interpreter) -> contextlib.AbstractContextManager[Any]:
        """Entered around each body whose records are collected on their own.

        A loop body or condition, a ``cond`` branch, a ``jit`` or ``checkpoint`` body. Records
        a rule set adds with `Interpreter.emit` before the context exits are the body's: one
        that measures its values together (the inspector) emits them there.
        """
        del interp
        return contextlib.nullcontext()

    def finish(self) -> None:
        """Called once the whole program is evaluated: checks that need all of it."""


# --------------------------------------------------------------------------------------------
# Helpers.


def literal_value(var: Any) -> Any:
    """The value of a jaxpr literal as a numpy value of its dtype."""
    try:
        return np.asarray(var.val, dtype=var.aval.dtype)
    except TypeError:
        return var.val


def shape_struct(x: Any, sliced: bool = False) -> jax.ShapeDtypeStruct:
    """`x`'s shape, dtype and weak type, for tracing a function of it, and its sharding where
    that is part of its type (``Explicit`` mesh axes). With `sliced`, those of ``x[i]`` (a
    loop's slice of `x`)."""
    shape = np.shape(x)[1:] if sliced else np.shape(x)
    if not _is_jax_value(x):
        return jax.ShapeDtypeStruct(shape, x.dtype)
    weak = bool(getattr(jax.typeof(x), "weak_type", False))
    sharding = compat.explicit_sharding(x)
    if sharding is not None and sliced:
        spec = jax.sharding.PartitionSpec(*tuple(sharding.spec)[1:])
        sharding = jax.sharding.NamedSharding(sharding.mesh, spec)
    return jax.ShapeDtypeStruct(shape, x.dtype, weak_type=weak, sharding=sharding)


def _is_jax_value(x: Any) -> bool:
    return isinstance(x, (jax.Array, compat.Tracer))


def _structs(tree: Any) -> Any:
    return jax.tree.map(shape_struct, tree)


def _avals_key(leaves: Sequence[Any]) -> tuple[Any, ...]:
    return tuple((np.shape(x), str(x.dtype)) for x in leaves)


def _cast_like(x: Any, struct: Any) -> Any:
    """`x` cast to `struct`'s floating dtype (non-floating values are left alone)."""
    if _is_float_dtype(x.dtype) and _is_float_dtype(struct.dtype):
        if jnp.dtype(x.dtype) != jnp.dtype(struct.dtype):
            return lax.convert_element_type(x, struct.dtype)
    return x


def _is_float_dtype(dtype: Any) -> bool:
    try:
        return bool(jnp.issubdtype(dtype, jnp.floating))
    except TypeError:  # extended dtypes such as PRNG keys
        return False


def eval_plain(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """Evaluates an open jaxpr by re-binding each equation as traced, in its source context."""
    env: dict[Any, Any] = {}

    def read(var: Any) -> Any:
        return literal_value(var) if isinstance(var, compat.Literal) else env[var]

    for var, value in zip(jaxpr.constvars, consts, strict=True):
        env[var] = value
    for var, value in zip(jaxpr.invars, args, strict=True):
        env[var] = value
    for eqn in jaxpr.eqns:
        with compat.source_context(eqn):
            outs = compat.bind(eqn, [read(v) for v in eqn.invars])
        for var, value in zip(eqn.outvars, outs, strict=True):
            if not isinstance(var, compat.DropVar):
                env[var] = value
    return [read(v) for v in jaxpr.outvars]


def _trace_once(fn: Callable[..., Any], *structs: Any) -> tuple[Callable[..., Any], Any]:
    """Traces `fn` once; returns a function replaying that trace, and the output structure.

    The records a rule set emits in a loop body have a structure known only once the body
    is traced; the loop then runs the replay, with the records' accumulators as carries.
    """
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*structs)
    out_tree = jax.tree.structure(out_shape)

    def replay(*args: Any) -> Any:
        outs = eval_plain(closed.jaxpr, closed.consts, jax.tree.leaves(args))
        return jax.tree.unflatten(out_tree, outs)

    return replay, out_shape


@dataclasses.dataclass
class _Body:
    """The records and final clock of one traced body (filled when the body ends)."""

    metas: list[Any] = dataclasses.field(default_factory=list)
    arrays: list[Any] = dataclasses.field(default_factory=list)
    clock: Any = None


@dataclasses.dataclass(frozen=True)
class Location:
    """Where an equation comes from.

    Attributes:
      name_stack: ``(kind, name)`` pairs, outermost first, of the equation's whole name stack
        (the equations it is nested in included): kind ``"scope"`` for a `jax.named_scope`
        or a Flax module, ``"transform"`` for ``jvp``, ``transpose``, ``vmap``...
      frames: ``(file, line, function)`` of the user's frames, innermost first (frames in
        JAX and the Python standard library left out), through the calls the equation is
        nested in (a nested ``jit``, a loop body) up to the traced function's caller.
    """

    name_stack: tuple[tuple[str, str], ...]
    frames: tuple[tuple[str, int, str], ...]


# --------------------------------------------------------------------------------------------
# The interpreter.


class Interpreter:
    """Evaluates jaxprs under one `Rules` object (one interpretation of one traced call)."""

    def __init__(self, rules: Rules):
        self.rules = rules
        self._outer: list[Any] = []  # the equations being recursed into, outermost first
        self._metas: list[Any] = []  # records of the body being traced
        self._arrays: list[Any] = []
        self._clock: Any = 0 if rules.emits else None
        self._ticks = 0
        self._jit_cache: dict[Any, Any] = {}
        self._mesh = compat.context_mesh()  # where the records are returned

    # -- Records.

    def tick(self) -> Any:
        """The clock for the next record: its position in the program's execution order."""
        if self._clock is None:
            raise RuntimeError("Interpreter.tick needs rules with `emits = True`.")
        value = _advanced(self._clock, self._ticks)
        self._ticks += 1
        return value

    def emit(self, meta: Any, arrays: Any) -> None:
        """Adds a record: `meta` is static (hashable), `arrays` a pytree of arrays."""
        self._metas.append(meta)
        self._arrays.append(arrays)

    @property
    def records(self) -> list[tuple[Any, Any]]:
        """The ``(meta, arrays)`` records of the top-level jaxpr, in program order."""
        return list(zip(self._metas, self._arrays, strict=True))

    def _now(self) -> Any:
        """The clock as an array (None for rules that do not emit)."""
        if self._clock is None:
            return None
        value = _advanced(self._clock, self._ticks)
        self._clock, self._ticks = value, 0
        return value

    def _resume(self, clock: Any, metas: Iterable[Any], arrays: Iterable[Any]) -> None:
        """Continues after a traced body: its final clock, and its records re-emitted here."""
        # A body traced under `jax.sharding.auto_axes` returns them typed on its mesh.
        clock, arrays = compat.on_mesh((clock, list(arrays)), self._mesh)
        if self._clock is not None:
            self._clock, self._ticks = clock, 0
        for meta, value in zip(metas, arrays, strict=True):
            self.emit(meta, value)

    @contextlib.contextmanager
    def _body(self, clock: Any) -> Iterator[_Body]:
        """Collects the records of a sub-jaxpr traced as its own function."""
        saved = (self._metas, self._arrays, self._clock, self._ticks)
        self._metas, self._arrays, self._clock, self._ticks = [], [], clock, 0
        body = _Body()
        try:
            with self.rules.body(self):
                yield body
            body.metas, body.arrays, body.clock = self._metas, self._arrays, self._now()
        finally:
            self._metas, self._arrays, self._clock, self._ticks = saved

    # -- Locations.

    @contextlib.contextmanager
    def _nested(self, eqn: Any) -> Iterator[None]:
        self._outer.append(eqn)
        try:
            yield
        finally:
            self._outer.pop()

    def location(self, eqn: Any) -> Location:
        """`eqn`'s whole name stack and user frames (see `Location`)."""
        stack: list[tuple[str, str]] = []
        for outer in self._outer:
            stack += compat.name_stack_parts(outer)
        stack += compat.name_stack_parts(eqn)
        # A traceback inside a nested jit or loop body ends at the function JAX traced (jax >=
        # 0.9); the frames that called it are those of the equation it is nested in (an
        # equation JAX made has none of its own).
        frames = compat.user_frames(eqn, _TRACED)
        for outer in reversed(self._outer):
            # jax 0.8 goes on past the nested function, through the frames of the call that
            # traced it first (a cached trace: another call's, from another line): the
            # function's own frames are kept, and the caller's are `outer`'s.
            frames = _inside(frames, compat.traced_functions(outer))
            frames += compat.user_frames(outer, _TRACED)
        return Location(tuple(stack), tuple(frames))

    # -- Evaluation.

    def eval_jaxpr(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        """Evaluates an open jaxpr on `args` (rule values); returns its outputs."""
        rules = self.rules
        env: dict[Any, Any] = {}

        def read(var: Any) -> Any:
            if isinstance(var, compat.Literal):
                return rules.literal(literal_value(var))
            return env[var]

        for var, value in zip(jaxpr.constvars, consts, strict=True):
            env[var] = rules.const(value)
        for var, value in zip(jaxpr.invars, args, strict=True):
            env[var] = value
        frame = rules.start(jaxpr)
        for index, eqn in enumerate(jaxpr.eqns):
            vals = [read(v) for v in eqn.invars]
            with compat.source_context(eqn):
                outs = rules.apply(frame, index, eqn, vals, self)
            if outs is None:
                continue
            for var, out in zip(eqn.outvars, outs, strict=True):
                if not isinstance(var, compat.DropVar):
                    env[var] = out
        return [read(v) for v in jaxpr.outvars]

    def inline(self, eqn: Any, vals: list[Any], param: str = "jaxpr") -> list[Any]:
        """Evaluates the sub-jaxpr of a call-like equation (``jit``, ``remat``) in place.

        Unlike `higher_order`, no new ``jit`` or ``checkpoint`` boundary is made: the body is
        traced again for each equation, even where two equations share one sub-jaxpr.
        """
        sub, sub_consts = compat.jaxpr_and_consts(eqn.params[param])
        with self._nested(eqn):
            return self.eval_jaxpr(sub, sub_consts, vals)

    def higher_order(self, eqn: Any, vals: list[Any]) -> list[Any] | Any:
        """Evaluates a control-flow equation, its sub-jaxprs under the rules.

        Returns NotImplemented for a primitive the core has no rule for.
        """
        handler = _HANDLERS.get(eqn.primitive.name)
        if handler is None:
            return NotImplemented
        with self._nested(eqn):
            return handler(self, eqn, vals)


# --------------------------------------------------------------------------------------------
# Control flow.

_HANDLERS: dict[str, Callable[[Interpreter, Any, list[Any]], Any]] = {}


def _handles(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        for name in names:
            _HANDLERS[name] = fn
        return fn

    return register


@_handles("jit", "pjit")
def _jit(interp: Interpreter, eqn: Any, vals: list[Any]) -> list[Any]:
    params = eqn.params
    closed = params["jaxpr"]
    sub, sub_consts = compat.jaxpr_and_consts(closed)
    leaves, tree = jax.tree.flatten(vals)
    key = (id(closed), tree, _avals_key(leaves))
    entry = interp._jit_cache.get(key)
    if entry is None:
        holder: list[Any] = []

        def inner(clock, *args):
            with interp._body(clock) as body:
                outs = interp.eval_jaxpr(sub, sub_consts, jax.tree.unflatten(tree, args))
            out_leaves, out_tree = jax.tree.flatten(outs)
            holder[:] = [(out_tree, body.metas)]
            return out_leaves, body.arrays, body.clock

        inner.__name__ = inner.__qualname__ = str(params.get("name", "jit"))
        jitted = jax.jit(
            inner,
            inline=bool(params.get("inline", False)),
            keep_unused=bool(params.get("keep_unused", False)),
        )
        # `closed` is kept alive so that its id is not reused while the entry exists.
        entry = interp._jit_cache[key] = (jitted, holder, closed)
    jitted, holder, _ = entry
    out_leaves, arrays, clock = jitted(interp._now(), *leaves)
    out_tree, metas = holder[0]
    interp._resume(clock, metas, arrays)
    return jax.tree.unflatten(out_tree, out_leaves)


@_handles("closed_call", "core_call", "call")
def _call(interp: Interpreter, eqn: Any, vals: list[Any]) -> list[Any]:
    sub, sub_consts = compat.jaxpr_and_consts(eqn.params["call_jaxpr"])
    return interp.eval_jaxpr(sub, sub_consts, vals)


@_handles("remat2", "checkpoint", "remat")
def _remat(interp: Interpreter, eqn: Any, vals: list[Any]) -> list[Any]:
    sub, sub_consts = compat.jaxpr_and_consts(eqn.params["jaxpr"])
    leaves, tree = jax.tree.flatten(vals)
    holder: list[Any] = []

    def inner(clock, *args):
        with interp._body(clock) as body:
            outs = interp.eval_jaxpr(sub, sub_consts, jax.tree.unflatten(tree, args))
        out_leaves, out_tree = jax.tree.flatten(outs)
        holder[:] = [(out_tree, body.metas)]
        return out_leaves, body.arrays, body.clock

    out_leaves, arrays, clock = jax.checkpoint(
        inner,
        prevent_cse=eqn.params.get("prevent_cse", True),
        policy=eqn.params.get("policy"),
    )(interp._now(), *leaves)
    out_tree, metas = holder[0]
    interp._resume(clock, metas, arrays)
    return jax.tree.unflatten(out_tree, out_leaves)


def _combine_all(rules: Rules, acc: list[Any], new: list[Any]) -> list[Any]:
    # Under the records' own mesh (the context's, `Interpreter._resume`), not the loop's
    # (a loop traced under `jax.sharding.auto_axes` re-binds under that mesh).
    out = []
    for a, b in zip(acc, new, strict=True):
        traced = [x for x in jax.tree.leaves(a) if not isinstance(x, np.ndarray)]
        with compat.mesh_of(traced[0]) if traced else contextlib.nullcontext():
            out.append(rules.combine(a, b))
    return out


@_handles("scan")
def _scan(interp: Interpreter, eqn: Any, vals: list[Any]) -> list[Any]:
    rules, params = interp.rules, eqn.params
    sub, sub_consts = compat.jaxpr_and_consts(params["jaxpr"])
    n_consts, n_carry = compat.scan_counts(params)
    consts, init, xs = (
        vals[:n_consts],
        vals[n_consts : n_consts + n_carry],
        vals[n_consts + n_carry :],
    )
    c_leaves, c_tree = jax.tree.flatten(consts)
    i_leaves, i_tree = jax.tree.flatten(init)
    x_leaves, x_tree = jax.tree.flatten(xs)
    n_xs = len(x_leaves)
    side_leaves, side_tree = jax.tree.flatten(rules.loop_inputs(eqn))
    x_leaves = x_leaves + side_leaves  # the rules' per-iteration inputs follow the loop's
    init_structs = _structs(init)
    holder: list[Any] = []

    def body(clock, c_args, carry, x):
        x, side = x[:n_xs], jax.tree.unflatten(side_tree, x[n_xs:])
        with interp._body(clock) as b, rules.in_iteration(side):
            args = [
                *jax.tree.unflatten(c_tree, c_args),
                *jax.tree.unflatten(i_tree, carry),
                *jax.tree.unflatten(x_tree, x),
            ]
            outs = interp.eval_jaxpr(sub, sub_consts, args)
        # Loop carries keep the types of their initial value.
        new_carry = jax.tree.leaves(rules.fix(outs[:n_carry], init_structs))
        y_leaves, y_tree = jax.tree.flatten(outs[n_carry:])
        holder[:] = [(y_tree, b.metas)]
        return new_carry, y_leaves, b.arrays, b.clock

    scan_kwargs = dict(length=params["length"], reverse=params["reverse"], unroll=params["unroll"])
    if not rules.emits:
        carry, ys = lax.scan(
            lambda carry, x: body(None, c_leaves, carry, x)[:2],
            i_leaves,
            x_leaves,
            **scan_kwargs,
        )
        y_tree, _ = holder[0]
        return [*jax.tree.unflatten(i_tree, carry), *jax.tree.unflatten(y_tree, ys)]

    x_structs = [shape_struct(x, sliced=True) for x in x_leaves]
    replay, out_shape = _trace_once(
        body, _clock_struct(), _structs(c_leaves), _structs(i_leaves), x_structs
    )
    y_tree, metas = holder[0]
    acc0 = compat.on_mesh([rules.empty(s) for s in out_shape[2]], interp._mesh)

    def step(state, x):
        carry, acc, clock = state
        carry, ys, arrays, clock = replay(clock, c_leaves, carry, x)
        arrays = compat.on_mesh(arrays, interp._mesh)
        return (carry, _combine_all(rules, acc, arrays), clock), ys

    (carry, acc, clock), ys = lax.scan(
        step, (i_leaves, acc0, interp._now()), x_leaves, **scan_kwargs
    )
    detail = f"{params['length']} iterations"
    metas = [rules.in_loop(m, "scan", detail) for m in metas]
    interp._resume(clock, metas, acc)
    return [*jax.tree.unflatten(i_tree, carry), *jax.tree.unflatten(y_tree, ys)]


def _advanced(clock: Any, ticks: int) -> Any:
    """`clock` plus `ticks` as an int32: a known one as a numpy scalar, typed by no mesh, a
    traced one typed as `clock` is (an equation traced under `jax.sharding.auto_axes`
    re-binds under that mesh, where the clock is not)."""
    if isinstance(clock, (int, np.integer)):
        return np.int32(clock + ticks)
    with compat.mesh_of(clock):
        return (clock + np.int32(ticks) if ticks else clock).astype(jnp.int32)


def _clock_struct() -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((), jnp.int32)


@_handles("while")
def _while(interp: Interpreter, eqn: Any, vals: list[Any]) -> list[Any]:
    rules, params = interp.rules, eqn.params
    cond_jaxpr, cond_sub_consts = compat.jaxpr_and_consts(params["cond_jaxpr"])
    body_jaxpr, body_sub_consts = compat.jaxpr_and_consts(params["body_jaxpr"])
    n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
    cond_consts, body_consts = vals[:n_cond], vals[n_cond : n_cond + n_body]
    init = vals[n_cond + n_body :]
    cc_leaves, cc_tree = jax.tree.flatten(cond_consts)
    bc_leaves, bc_tree = jax.tree.flatten(body_consts)
    i_leaves, i_tree = jax.tree.flatten(init)
    init_structs = _structs(init)
    holders: dict[str, list[Any]] = {"cond": [], "body": []}

    def cond_fn(clock, cc, carry):
        with interp._body(clock) as b:
            args = [*jax.tree.unflatten(cc_tree, cc), *jax.tree.unflatten(i_tree, carry)]
            outs = interp.eval_jaxpr(cond_jaxpr, cond_sub_consts, args)
        holders["cond"][:] = [b.metas]
        return rules.value(outs[0]), b.arrays, b.clock

    def body_fn(clock, bc, carry):
        with interp._body(clock) as b:
            args = [*jax.tree.unflatten(bc_tree, bc), *jax.tree.unflatten(i_tree, carry)]
            outs = interp.eval_jaxpr(body_jaxpr, body_sub_consts, args)
        holders["body"][:] = [b.metas]
        return jax.tree.leaves(rules.fix(outs, init_structs)), b.arrays, b.clock

    if not rules.emits:
        out = lax.while_loop(
            lambda carry: cond_fn(None, cc_leaves, carry)[0],
            lambda carry: body_fn(None, bc_leaves, carry)[0],
            i_leaves,
        )
        return jax.tree.unflatten(i_tree, out)

    # The condition's records leave it through the carry: the condition is evaluated once
    # before the loop and at the end of each iteration, and the loop tests the carried result.
    cond_replay, cond_shape = _trace_once(
        cond_fn, _clock_struct(), _structs(cc_leaves), _structs(i_leaves)
    )
    body_replay, body_shape = _trace_once(
        body_fn, _clock_struct(), _structs(bc_leaves), _structs(i_leaves)
    )
    pred, cond_acc, clock = cond_replay(interp._now(), cc_leaves, i_leaves)
    cond_acc = compat.on_mesh(cond_acc, interp._mesh)
    body_acc = compat.on_mesh([rules.empty(s) for s in body_shape[1]], interp._mesh)

    def loop_body(state):
        carry, _, cond_acc, body_acc, clock = state
        carry, arrays, clock = body_replay(clock, bc_leaves, carry)
        arrays = compat.on_mesh(arrays, interp._mesh)
        body_acc = _combine_all(rules, body_acc, arrays)
        pred, arrays, clock = cond_replay(clock, cc_leaves, carry)
        arrays = compat.on_mesh(arrays, interp._mesh)
        return carry, pred, _combine_all(rules, cond_acc, arrays), body_acc, clock

    carry, _, cond_acc, body_acc, clock = lax.while_loop(
        lambda state: state[1], loop_body, (i_leaves, pred, cond_acc, body_acc, clock)
    )
    metas = [rules.in_loop(m, "while", "condition") for m in holders["cond"][0]]
    metas += [rules.in_loop(m, "while", "body") for m in holders["body"][0]]
    interp._resume(clock, metas, [*cond_acc, *body_acc])
    return jax.tree.unflatten(i_tree, carry)


@_handles("cond")
def _cond(interp: Interpreter, eqn: Any, vals: list[Any]) -> list[Any]:
    rules = interp.rules
    index, operands = rules.value(vals[0]), vals[1:]
    o_leaves, o_tree = jax.tree.flatten(operands)
    branches = eqn.params["branches"]
    holders: list[list[Any]] = [[] for _ in branches]

    def make_branch(closed: Any, holder: list[Any]) -> Callable[..., Any]:
        sub, sub_consts = compat.jaxpr_and_consts(closed)

        def branch(clock, *args):
            with interp._body(clock) as b:
                outs = interp.eval_jaxpr(sub, sub_consts, jax.tree.unflatten(o_tree, args))
            holder[:] = [b.metas]
            return outs, b.arrays, b.clock

        return branch

    clock_struct = _clock_struct() if rules.emits else None
    traced = [
        _trace_once(make_branch(closed, holder), clock_struct, *_structs(o_leaves))
        for closed, holder in zip(branches, holders, strict=True)
    ]
    # Branches may give different types (autocast): all return those `join` chooses.
    targets = rules.join([shape[0] for _, shape in traced])
    record_shapes = [shape[1] for _, shape in traced]

    def fixed(k: int) -> Callable[..., Any]:
        replay = traced[k][0]

        def branch(clock: Any, *args: Any) -> Any:
            outs, arrays, clock = replay(clock, *args)
            # Records of the branches not taken: the monoid's identity.
            every: list[Any] = []
            for j, shapes in enumerate(record_shapes):
                every += list(arrays) if j == k else [rules.empty(s) for s in shapes]
            return jax.tree.leaves(rules.fix(outs, targets)), every, clock

        return branch

    platforms = compat.branches_platforms(eqn.params)
    if platforms is None:
        out_leaves, arrays, clock = lax.switch(
            index, [fixed(k) for k in range(len(branches))], interp._now(), *o_leaves
        )
    else:
        # `lax.platform_dependent`: each platform's branch, so that the program lowered for
        # one platform holds its own branch only (another's may not lower there: cuDNN's
        # attention on a CPU).
        per_platform: dict[str, Callable[..., Any]] = {}
        default = None
        for k, names in enumerate(platforms):
            if names is None:
                default = fixed(k)
            else:
                per_platform.update((name, fixed(k)) for name in names)
        out_leaves, arrays, clock = lax.platform_dependent(
            interp._now(), *o_leaves, default=default, **per_platform
        )
    metas = [
        rules.in_loop(m, "cond", f"branch {k} of {len(branches)}")
        for k, holder in enumerate(holders)
        for m in holder[0]
    ]
    interp._resume(clock, metas, arrays)
    return jax.tree.unflatten(jax.tree.structure(targets), out_leaves)


@_handles("custom_jvp_call")
def _custom_jvp(interp: Interpreter, eqn: Any, vals: list[Any]) -> list[Any]:
    rules, params = interp.rules, eqn.params
    call, call_consts = compat.jaxpr_and_consts(params["call_jaxpr"])
    if not rules.keep_custom_rules:
        return interp.eval_jaxpr(call, call_consts, vals)
    num_consts = params["num_consts"]
    symbolic_zeros = params["symbolic_zeros"]
    leaves, tree = jax.tree.flatten(vals)
    if len(leaves) != len(vals):  # pragma: no cover - a rule set error, not a user's
        raise NotImplementedError("custom rules are kept only for one array per value.")
    holder: list[Any] = []

    def primal(*args):
        outs = interp.eval_jaxpr(call, call_consts, jax.tree.unflatten(tree, args))
        out_leaves, out_tree = jax.tree.flatten(outs)
        holder[:] = [out_tree]
        return out_leaves

    out_structs = jax.eval_shape(primal, *[shape_struct(x) for x in leaves])
    fn = jax.custom_jvp(primal)

    def jvp(primals, tangents):
        tans = list(tangents[num_consts:])
        zeros = [compat.is_symbolic_zero(t) if symbolic_zeros else False for t in tans]
        jvp_jaxpr, jvp_consts, out_zeros = compat.custom_jvp_rule_jaxpr(params, zeros)
        nonzero = [t for t, z in zip(tans, zeros, strict=True) if not z]
        args = jax.tree.unflatten(tree, list(primals))[num_consts:]
        outs = interp.eval_jaxpr(jvp_jaxpr, jvp_consts, [*args, *map(rules.wrap, nonzero)])
        outs = [rules.value(o) for o in outs]
        n = len(out_zeros)
        out_primals = [_cast_like(x, s) for x, s in zip(outs[:n], out_structs, strict=True)]
        nonzero_out = iter(outs[n:])
        out_tangents = []
        for struct, is_zero in zip(out_structs, out_zeros, strict=True):
            if is_zero:
                dtype = struct.dtype if _is_float_dtype(struct.dtype) else jax.dtypes.float0
                out_tangents.append(
                    np.zeros(struct.shape, dtype)
                    if dtype == jax.dtypes.float0
                    else jnp.zeros(struct.shape, dtype)
                )
            else:
                out_tangents.append(_cast_like(next(nonzero_out), struct))
        return out_primals, out_tangents

    fn.defjvp(jvp, symbolic_zeros=symbolic_zeros)
    outs = fn(*leaves)
    return jax.tree.unflatten(holder[0], list(outs))


@_handles("custom_vjp_call")
def _custom_vjp(interp: Interpreter, eqn: Any, vals: list[Any]) -> list[Any] | Any:
    if interp.rules.keep_custom_rules:
        return NotImplemented  # such rules re-bind it themselves (autocast: as traced)
    call, call_consts = compat.jaxpr_and_consts(eqn.params["call_jaxpr"])
    return interp.eval_jaxpr(call, call_consts, vals)


# --------------------------------------------------------------------------------------------
# Tracing the user's call.


def _is_dynamic(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


@dataclasses.dataclass(frozen=True)
class ArgSpec:
    """The static part of a call: the argument tree and its non-array leaves."""

    treedef: Any
    static: tuple[tuple[int, Any], ...]
    num_leaves: int

    def merge(self, dynamic: Iterable[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        leaves: list[Any] = [None] * self.num_leaves
        static = dict(self.static)
        it = iter(dynamic)
        for i in range(self.num_leaves):
            leaves[i] = static[i] if i in static else next(it)
        return jax.tree.unflatten(self.treedef, leaves)

    def hashable(self) -> bool:
        try:
            hash(self)
        except TypeError:
            return False
        return True


def split_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[ArgSpec, list[Any]]:
    """Splits a call's arguments into the static `ArgSpec` and the array leaves."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    static = tuple((i, x) for i, x in enumerate(leaves) if not _is_dynamic(x))
    dynamic = [x for x in leaves if _is_dynamic(x)]
    return ArgSpec(treedef, static, len(leaves)), dynamic


# The split of graph nodes (Flax NNX modules) out of a call's arguments. The core knows no
# graph library: the integration above it registers the split (`jaxmp.nnx` when imported).
_graph_splitter: Callable[[Any], Any] | None = None


def register_graph_splitter(splitter: Callable[[Any], Any] | None) -> None:
    """Makes `split_graph_nodes` call `splitter`, in place of the one registered before.

    `splitter` takes a call's ``(args, kwargs)`` and returns None when they hold no graph
    nodes, else ``(nodes, others, state, write_back)`` (see `trace_call`); None unregisters.
    """
    global _graph_splitter
    _graph_splitter = splitter


def split_graph_nodes(tree: Any) -> Any:
    """The registered splitter's split of the graph nodes in `tree`; None without one."""
    return None if _graph_splitter is None else _graph_splitter(tree)


@dataclasses.dataclass(frozen=True)
class TracedCall:
    """A traced call: its jaxpr, the tree of its outputs, and how many are the function's.

    With NNX graph nodes among the arguments the jaxpr's outputs are the function's outputs
    followed by the state leaves the call changed (``num_out`` is the count of the former).
    """

    closed: Any
    out_tree: Any
    num_out: int


# The function `trace_call` traces: an op's frames end there (see `compat.user_frames`).
_TRACED = (__file__, "flat_fun")


def _inside(
    frames: list[tuple[str, int, str]], functions: Sequence[tuple[str, str]]
) -> list[tuple[str, int, str]]:
    """`frames` (innermost first) up to that of the first of `functions` (``(file, name)``,
    the functions a nested equation traced) they hold; none of them if the functions are
    JAX's own (their frames are left out of tracebacks: every frame is a caller's); all of
    them if no function is known."""
    for i, (file, _, function) in enumerate(frames):
        if any(file == f and function.rsplit(".", 1)[-1] == n for f, n in functions):
            return frames[: i + 1]
    if functions and all(_is_jax_file(f) for f, _ in functions):
        return []
    return frames


@functools.cache
def _is_jax_file(path: str) -> bool:
    jax_dir = os.path.join(os.path.realpath(os.path.dirname(str(jax.__file__))), "")
    return os.path.realpath(path).startswith(jax_dir)


def trace_call(
    fun: Callable[..., Any],
    graph: bool,
    spec: ArgSpec,
    dynamic: Sequence[Any],
) -> TracedCall:
    """Traces ``fun(*args, **kwargs)`` (`spec` merged with `dynamic`) to a jaxpr.

    With `graph`, the arguments are ``(nodes, others, state)`` of `split_graph_nodes`: the
    NNX modules are merged inside the trace and the state leaves the call changes become
    outputs (None for those unchanged).
    """
    out_tree: list[Any] = []
    num_out: list[int] = []

    def flat_fun(*values):
        call_args, call_kwargs = spec.merge(values)
        if graph:
            nodes, others, state = call_args
            call_args, call_kwargs, read_state = nodes.merge(others, state)
            before = jax.tree.leaves(state)
            out = fun(*call_args, **call_kwargs)
            after = jax.tree.leaves(read_state())
            new_leaves = [
                None if new is old else new for new, old in zip(after, before, strict=True)
            ]
            result = (out, new_leaves)
        else:
            result = fun(*call_args, **call_kwargs)
        out_leaves, tree = jax.tree.flatten(result)
        out_tree.append(tree)
        num_out.append(len(jax.tree.leaves(result[0])) if graph else len(out_leaves))
        return out_leaves

    closed = jax.make_jaxpr(flat_fun)(*dynamic)
    return TracedCall(closed, out_tree[0], num_out[0])
