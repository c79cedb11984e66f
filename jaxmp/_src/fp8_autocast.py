"""FP8 under `jaxmp.autocast`: a rule set over the shared re-interpretation core.

``jaxmp.autocast(fun, policy, fp8=recipe)`` evaluates `fun`'s jaxpr with autocast's rules
(`jaxmp._src.autocast`), except that every ``dot_general`` (and, with a per-tensor recipe,
every ``conv_general_dilated``) whose operands are floating runs in FP8
(`jaxmp._src.fp8_dot.fp8_dot_general`), its result in the policy's compute dtype. Matmuls whose
name stack matches ``fp8_exclude``, or inside `jaxmp.float32_region`, follow the policy.

The state of `jaxmp.DelayedScaling` is one entry per FP8 matmul of the program, keyed by the
matmul's position (the indices of the equations it is nested in). Inside a ``scan`` the
entries have the loop's length as leading axis and each iteration gets its own slice
(`interpret.Rules.loop_inputs`), so that a scanned stack of layers keeps one history per
layer and the backward pass of each layer returns its own. ``jit`` equations are evaluated
in place (two calls of one jitted function are two matmuls with two states). Matmuls inside
a ``while_loop`` or a ``custom_jvp`` function have no state of their own (a loop of unknown
length; a custom rule cannot differentiate with respect to a closed-over state) and use
current scaling.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import math
import re
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxmp._src import autocast as autocast_lib
from jaxmp._src import compat, display, fp8, fp8_dot, interpret
from jaxmp._src import policy as policy_lib
from jaxmp._src.patterns import compile_exclude

#: Primitives run in FP8 (convolutions with a per-tensor recipe only).
FP8_OPS = frozenset({"dot_general", "conv_general_dilated"})

# Ops through which a value stays "a function argument" for `Float8BlockScaling`'s weights:
# a parameter cast to the compute dtype or reshaped is still a weight.
_LAYOUT_OPS = frozenset(
    {"convert_element_type", "reshape", "transpose", "squeeze", "expand_dims", "copy", "copy_p"}
)
# Primitives whose sub-jaxprs get no delayed-scaling state (see the module docs).
_STATELESS_REGIONS = frozenset({"while", "custom_jvp_call"})


class Float8Matmul(NamedTuple):
    """One matmul of a program under FP8 autocast (`Float8Autocast.fp8_matmuls`).

    Attributes:
      name: its name stack, the string `fp8_exclude` patterns must match whole (the
        ``jax.named_scope`` names around it: in Flax Linen the module path, in Flax NNX the
        attribute path, ``"TransformerLM/blocks/mlp/fc1"``).
      primitive: ``"dot_general"`` or ``"conv_general_dilated"``.
      fp8: whether it runs in FP8.
      reason: why it does or does not (``"fp8"``, ``"excluded by '.*/head'"``, ...).
    """

    name: str
    primitive: str
    fp8: bool
    reason: str


class _Trace:
    """Marks a call that only traces the program: to find the stateful FP8 matmuls
    (`Float8Autocast.fp8_init`) or to list every matmul (`Float8Autocast.fp8_matmuls`)."""

    def __init__(self, listing: bool = False) -> None:
        self.listing = listing
        self.rules: _Fp8Rules | None = None


@dataclasses.dataclass
class _Level:
    """A higher-order equation being recursed into: its key prefix, its sub-jaxprs."""

    prefix: str
    length: int  # a scan's length, else 0
    jaxprs: dict[int, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Frame:
    """Autocast's frame of one jaxpr, and the keys of the FP8 matmuls in it."""

    autocast: Any
    prefix: str
    count: int = 0


class _Fp8Rules(autocast_lib._AutocastRules):
    """Autocast's rules, with FP8 for the matmuls (see the module docs)."""

    def __init__(
        self,
        ctx: Any,
        recipe: Any,
        exclude: tuple[re.Pattern[str], ...],
        state: fp8.Float8State | None,
        discover: bool,
        listing: bool = False,
    ):
        super().__init__(ctx)
        self.recipe = recipe
        self.exclude = exclude
        self.discover = discover
        self.listing = listing
        # Entries of the state visible here: (amax_history, scale) per key.
        self._view: dict[str, tuple[Any, Any]] = {}
        self._names: dict[str, str] = {}  # the name stack each entry was made for
        if state is not None:
            self._view = {k: (state.amax_history[k], state.scale[k]) for k in state.amax_history}
            self._names = dict(state.names)
        self._visited: set[str] = set()  # the state's entries this program used
        self._matched: set[int] = set()  # the `exclude` patterns that matched a matmul
        #: Every matmul, in program order (`Float8Autocast.fp8_matmuls`).
        self.matmuls: list[Float8Matmul] = []
        # Keys: one component per nesting level, "<sub-jaxpr>_<position>", the position
        # counting only the matmuls and higher-order equations of the jaxpr (so that
        # equations a context adds, such as shard_map's `pvary`, do not move the keys),
        # the sub-jaxpr numbering the jaxprs of one equation (the branches of a `cond`).
        self._levels: list[_Level] = []  # the higher-order equations being recursed into
        self._no_state = 0  # depth of `_STATELESS_REGIONS`
        self._weights: dict[int, Any] = {}  # values derived from arguments by layout ops
        #: With `discover`: ``(key, loop lengths, name)`` of each stateful FP8 matmul.
        self.sites: list[tuple[str, tuple[int, ...], str]] = []

    # -- Control flow: keys, per-iteration state.

    def start(self, jaxpr: Any) -> Any:
        if self._levels:
            level = self._levels[-1]
            ordinal = level.jaxprs.setdefault(id(jaxpr), len(level.jaxprs))
            prefix = f"{level.prefix}_{ordinal}_"
        else:
            prefix = ""
        return _Frame(super().start(jaxpr), prefix)

    def loop_inputs(self, eqn: Any) -> Any:
        if not self.recipe.stateful or self.discover or self._no_state:
            return None
        prefix = "s" + self._levels[-1].prefix + "_"
        inside = {k: v for k, v in self._view.items() if k.startswith(prefix)}
        length = int(eqn.params["length"])
        for key, (history, _) in inside.items():
            if history.shape[0] != length:
                raise ValueError(
                    f"the FP8 state's entry {key!r} holds {history.shape[0]} histories, one "
                    f"per iteration, but this program's scan runs {length} times: the state "
                    "was made for another program. Create it with `fp8_init` for this "
                    "function and these argument shapes."
                )
        return inside or None

    @contextlib.contextmanager
    def in_iteration(self, inputs: Any) -> Iterator[None]:
        saved = self._view
        if inputs:
            self._view = {**saved, **inputs}
        try:
            yield
        finally:
            self._view = saved

    def apply(
        self, frame: Any, index: int, eqn: Any, vals: list[Any], interp: Any
    ) -> list[Any] | None:
        name = eqn.primitive.name
        inner = frame.autocast
        region = inner.regions[index]
        higher = compat.has_subjaxprs(eqn.params)
        if name in FP8_OPS or higher:
            position = f"{frame.prefix}{frame.count}"
            frame.count += 1
        if name in FP8_OPS:
            outs = self._matmul(position, eqn, vals, interp, region)
            if outs is not None:
                return outs
        if not higher:
            outs = super().apply(inner, index, eqn, vals, interp)
            if name in _LAYOUT_OPS and outs is not None:
                self._track_weights(vals, outs)
            return outs
        marked = self.marked_attention(eqn)
        if (marked or name == "custom_vjp_call") and not region:
            # Their matmuls are not re-interpreted: listed, never in FP8.
            reason = (
                "in a fused attention (jaxmp.dot_product_attention)"
                if marked
                else "inside a custom_vjp function (run as traced)"
            )
            self._record_inner_matmuls(eqn, interp, reason)
        length = int(eqn.params["length"]) if name == "scan" else 0
        self._levels.append(_Level(position, length))
        stateless = name in _STATELESS_REGIONS
        self._no_state += stateless
        try:
            if self.recipe.stateful and name in ("jit", "pjit") and not region and not marked:
                return interp.inline(eqn, vals)
            return super().apply(inner, index, eqn, vals, interp)
        finally:
            self._levels.pop()
            self._no_state -= stateless

    # -- FP8 matmuls.

    def _is_weight(self, v: Any) -> bool:
        return bool(v.weak) or id(v.value) in self._weights

    def _track_weights(self, vals: list[Any], outs: list[Any]) -> None:
        floats = [v for v in vals if autocast_lib._is_float(v.value)]
        if floats and all(self._is_weight(v) for v in floats):
            for out in outs:
                self._weights[id(out.value)] = out.value  # kept alive: ids stay unique

    def _matmul(
        self, position: str, eqn: Any, vals: list[Any], interp: Any, region: bool
    ) -> list[Any] | None:
        """The outputs of a matmul run in FP8, or None (it follows the policy)."""
        name = eqn.primitive.name
        location = interp.location(eqn)
        where = "/".join(part for kind, part in location.name_stack if kind == "scope")
        reason = self._reason(eqn, vals, region, where)
        self.matmuls.append(Float8Matmul(where, name, reason == "fp8", reason))
        if reason != "fp8":
            return None
        dtype = self.ctx.compute_dtype
        lhs, rhs = vals[0], vals[1]
        x = autocast_lib._cast(lhs.value, dtype)
        w = autocast_lib._cast(rhs.value, dtype)
        site = self._site(position, where)
        if name == "dot_general":
            out = fp8_dot.fp8_dot_general(
                x,
                w,
                eqn.params["dimension_numbers"],
                self.recipe,
                dtype,
                weights=(self._is_weight(lhs), self._is_weight(rhs)),
                site=site,
            )
        else:

            def conv(a: Any, b: Any, out: Any) -> Any:
                params = {**eqn.params, "preferred_element_type": jnp.dtype(out)}
                return compat.bind(eqn, [a, b], params)[0]

            out = fp8_dot.fp8_conv(x, w, conv, self.recipe, dtype, site=site)
        return [autocast_lib._Value(out, False)]

    def _excluded(self, where: str) -> str | None:
        """The `exclude` pattern matching the name stack `where` (recorded as matched)."""
        matched = [i for i, p in enumerate(self.exclude) if p.fullmatch(where)]
        self._matched.update(matched)
        return self.exclude[matched[0]].pattern if matched else None

    def _reason(self, eqn: Any, vals: list[Any], region: bool, where: str) -> str:
        """Why a matmul runs in FP8 ("fp8") or does not."""
        excluded = self._excluded(where)
        if region:
            return "in jaxmp.float32_region"
        if eqn.primitive.name not in self.ctx.low_ops:
            return "not in low_precision_ops"
        if len(vals) != 2 or not all(autocast_lib._is_float(v.value) for v in vals):
            return "operands not floating"
        if eqn.primitive.name == "conv_general_dilated" and not self.recipe.per_tensor:
            return "a convolution: block scaling applies to matmuls only"
        if excluded is not None:
            return f"excluded by {excluded!r}"
        if eqn.primitive.name == "dot_general" and self.recipe.min_size:
            smallest = min(_gemm_sizes(eqn))
            if smallest < self.recipe.min_size:
                return f"smaller than min_size ({smallest} < {self.recipe.min_size})"
        return "fp8"

    def _record_inner_matmuls(self, eqn: Any, interp: Any, reason: str) -> None:
        """Lists the matmuls of `eqn`'s sub-jaxprs, which autocast runs without its rules."""
        outer = [part for kind, part in interp.location(eqn).name_stack if kind == "scope"]

        def walk(jaxpr: Any, scopes: list[str]) -> None:
            for inner in getattr(jaxpr, "jaxpr", jaxpr).eqns:
                here = scopes + [p for k, p in compat.name_stack_parts(inner) if k == "scope"]
                if inner.primitive.name in FP8_OPS:
                    where = "/".join(here)
                    self._excluded(where)
                    self.matmuls.append(Float8Matmul(where, inner.primitive.name, False, reason))
                for sub in compat.jaxprs_in_params(inner.params):
                    walk(sub, here)

        for sub in compat.jaxprs_in_params(eqn.params):
            walk(sub, outer)

    def finish(self) -> None:
        if self.listing:
            return
        unmatched = [p.pattern for i, p in enumerate(self.exclude) if i not in self._matched]
        if unmatched:
            raise ValueError(_unmatched_message(unmatched, [m.name for m in self.matmuls]))
        unused = sorted(set(self._view) - self._visited)
        if unused and not self.discover:
            raise ValueError(
                f"the FP8 state has entries for matmuls this program does not have: {unused} "
                f"({', '.join(repr(self._names.get(k, '')) for k in unused)}); it was made for "
                "another program: create the state with `fp8_init` for this function and "
                "these argument shapes."
            )

    def _site(self, position: str, where: str) -> tuple[Any, Any] | None:
        """The delayed-scaling state of the matmul at `position`, or None (stateless)."""
        if not self.recipe.stateful or self._no_state:
            return None
        key = "s" + position
        length = self.recipe.history_len
        if self.discover:
            self.sites.append((key, tuple(v.length for v in self._levels if v.length), where))
            return fp8.initial_site_state((), length)
        if key not in self._view:
            raise ValueError(
                f"the FP8 state has no entry {key!r} for the matmul at {where or '<top>'!r}: "
                "create the state with `fp8_init` for this function and these argument "
                "shapes (the program differs from the one it was made for)."
            )
        made_for = self._names.get(key, where)
        if made_for != where:
            raise ValueError(
                f"the FP8 state's entry {key!r} was made for the matmul at {made_for!r}, but "
                f"this program has the matmul at {where!r} there: the state was made for "
                "another program. Create it with `fp8_init` for this function and these "
                "argument shapes."
            )
        self._visited.add(key)
        history, scale = self._view[key]
        if tuple(history.shape) != (fp8.NUM_ROLES, length):
            raise ValueError(
                f"the FP8 state's entry {key!r} has an amax history of shape "
                f"{tuple(history.shape)} here, expected {(fp8.NUM_ROLES, length)} "
                f"(history_len={length}); create the state with `fp8_init` of this recipe."
            )
        return history, scale


def _gemm_sizes(eqn: Any) -> tuple[int, int, int]:
    """``(M, N, K)`` of a ``dot_general``: its rows, columns and contraction, batch aside."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = (v.aval.shape for v in eqn.invars)
    k = math.prod(lhs[d] for d in lc)
    m = math.prod(s for d, s in enumerate(lhs) if d not in lc and d not in lb)
    n = math.prod(s for d, s in enumerate(rhs) if d not in rc and d not in rb)
    return m, n, k


def _unmatched_message(patterns: list[str], names: list[str]) -> str:
    """The error for `fp8_exclude` patterns that match no matmul: the names there are."""
    listed = ", ".join(repr(n) for n in dict.fromkeys(names)) or "none"
    hints = []
    for pattern in patterns:
        tails = [n for n in names if n.endswith("/" + pattern)]
        if tails:
            hints.append(f"{'.*/' + pattern!r} matches {tails[0]!r}")
            continue
        close = difflib.get_close_matches(pattern, list(dict.fromkeys(names)), n=1)
        if close:
            hints.append(f"did you mean {close[0]!r}?")
    hint = f" ({'; '.join(hints)})" if hints else ""
    quoted = ", ".join(repr(p) for p in patterns)
    return (
        f"`fp8_exclude` pattern {quoted} matches no matmul of this program: a pattern must "
        f"match a matmul's whole name stack{hint}. The matmuls are named: {listed} "
        "(`fp8_matmuls(*args)` lists them)."
    )


def _split_abstract(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[interpret.ArgSpec, list[Any]]:
    """`interpret.split_args`, with `jax.ShapeDtypeStruct` leaves dynamic like arrays."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    abstract = [interpret._is_dynamic(x) or isinstance(x, jax.ShapeDtypeStruct) for x in leaves]
    static = tuple((i, x) for i, x in enumerate(leaves) if not abstract[i])
    dynamic = [x for i, x in enumerate(leaves) if abstract[i]]
    return interpret.ArgSpec(treedef, static, len(leaves)), dynamic


# A delayed-scaling state's next value comes back as its gradient, and JAX adds up the
# gradients of a value used twice: `_used_once` makes a second use within one
# differentiation an error. The state's first leaf is then a tracer of that
# differentiation, the same object at each use (held weakly here).
_DIFFERENTIATED_USES: dict[int, Any] = {}

_USED_TWICE = (
    "this delayed-scaling FP8 state is used twice in one differentiated call: its next "
    "value comes back as its gradient, and the gradients of two uses would add up (twice "
    "the amaxes and scales). Run the model once per step on all the inputs (concatenate "
    "them, or `jax.vmap` over them: under vmap the state records the amax of the whole "
    "batch), or give each call its own state. Calls in both branches of one `lax.cond` count "
    "as two uses: call the model outside the `cond`."
)


def _used_once(state: fp8.Float8State) -> fp8.Float8State:
    """`state`, whose first entry refuses a second use within one differentiation.

    The check runs only where the state is differentiated: JAX calls the JVP rule of
    `mark` only for an argument with a tangent.
    """
    leaves, treedef = jax.tree.flatten(state)
    if not leaves:
        return state
    leaf = leaves[0]

    @jax.custom_jvp
    def mark(x: jax.Array) -> jax.Array:
        return x

    @mark.defjvp
    def mark_jvp(primals: Any, tangents: Any) -> Any:
        seen = _DIFFERENTIATED_USES.get(id(leaf))
        if seen is not None and seen() is leaf:
            raise ValueError(_USED_TWICE)
        key = id(leaf)

        def forget(ref: Any) -> None:
            if _DIFFERENTIATED_USES.get(key) is ref:
                del _DIFFERENTIATED_USES[key]

        _DIFFERENTIATED_USES[key] = weakref.ref(leaf, forget)
        return primals[0], tangents[0]

    return jax.tree.unflatten(treedef, [mark(leaf), *leaves[1:]])


class Float8Autocast(autocast_lib.Autocast):
    """The function `jaxmp.autocast` returns with an FP8 recipe.

    Call it like the wrapped function; with a stateful recipe (`jaxmp.DelayedScaling`) call
    ``with_fp8_state(state)`` instead, after creating the state with `fp8_init`.

    Attributes:
      fp8: the recipe.
      fp8_exclude: the compiled regexes of the name stacks kept out of FP8.
    """

    def __init__(
        self,
        fun: Callable[..., Any],
        policy: policy_lib.Policy,
        low_precision_ops: frozenset[str],
        float32_ops: frozenset[str],
        recipe: Any,
        exclude: tuple[re.Pattern[str], ...],
        fused_attention: bool = True,
    ):
        super().__init__(fun, policy, low_precision_ops, float32_ops, fused_attention)
        self.fp8 = recipe
        self.fp8_exclude = exclude

    def _rules(self, ctx: Any, extra: Any) -> interpret.Rules:
        if isinstance(extra, _Trace):
            extra.rules = _Fp8Rules(
                ctx, self.fp8, self.fp8_exclude, None, discover=True, listing=extra.listing
            )
            return extra.rules
        return _Fp8Rules(ctx, self.fp8, self.fp8_exclude, extra, discover=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.fp8.stateful:
            raise TypeError(
                f"{self!r} uses a stateful FP8 recipe ({type(self.fp8).__name__}): create its "
                "state with `fp8_init(*args)` and call `with_fp8_state(state)(*args)`."
            )
        return super().__call__(*args, **kwargs)

    def with_fp8_state(self, state: fp8.Float8State) -> Callable[..., Any]:
        """The function, quantising with `state` (a `jaxmp.Float8State` from `fp8_init`).

        Differentiate the result with respect to `state` too: its gradient is the state of
        the next step (see `jaxmp.Float8State`).

        Args:
          state: the `jaxmp.Float8State` of this step.

        Returns:
          A function with the signature of the wrapped one.

        Raises:
          TypeError: if `state` is not a `jaxmp.Float8State`.
        """
        if not isinstance(state, fp8.Float8State):
            raise TypeError(
                "`state` must be a jaxmp.Float8State (from `fp8_init`), got "
                f"{type(state).__name__}."
            )

        @functools.wraps(self._fun)
        def call(*args: Any, **kwargs: Any) -> Any:
            return self._call_with(_used_once(state), args, kwargs)

        return call

    def _trace(self, marker: _Trace, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Fp8Rules:
        """Traces a call with arguments shaped like these (nothing is computed)."""
        graph = interpret.split_graph_nodes((args, kwargs))
        if graph is not None:
            nodes, others, nnx_state, _ = graph
            args, kwargs = (nodes, others, nnx_state), {}
        spec, dynamic = _split_abstract(args, kwargs)
        jax.eval_shape(functools.partial(self._run, graph is not None, spec, marker), *dynamic)
        if marker.rules is None:  # pragma: no cover - `_run` always makes the rules
            raise RuntimeError("the FP8 rules were not made.")
        return marker.rules

    def fp8_init(self, *args: Any, **kwargs: Any) -> fp8.Float8State:
        """The initial `jaxmp.Float8State` for calls with arguments shaped like these.

        Traces the function (nothing is computed) to find its FP8 matmuls; each gets a zero
        amax history and scales of 1. Stateless recipes get an empty state.

        Args:
          *args: arguments as for the wrapped function (arrays or `jax.ShapeDtypeStruct`).
          **kwargs: keyword arguments as for the wrapped function.

        Returns:
          The state.

        Raises:
          ValueError: if an `fp8_exclude` pattern matches no matmul of the program.
        """
        sites = self._trace(_Trace(), args, kwargs).sites
        history, scale = {}, {}
        for key, lengths, _ in sites:
            history[key], scale[key] = fp8.initial_site_state(lengths, self.fp8.history_len)
        return fp8.Float8State(
            amax_history=history, scale=scale, names=tuple((k, w) for k, _, w in sites)
        )

    def fp8_matmuls(self, *args: Any, **kwargs: Any) -> tuple[Float8Matmul, ...]:
        """Every matmul of the program for arguments shaped like these, in program order.

        Each with the name `fp8_exclude` patterns match, and whether and why it runs in FP8:
        the way to aim `fp8_exclude`. Traces the function; nothing is computed.

        Args:
          *args: arguments as for the wrapped function (arrays or `jax.ShapeDtypeStruct`).
          **kwargs: keyword arguments as for the wrapped function.

        Returns:
          A tuple of `jaxmp.Float8Matmul` (in a notebook, a table of them).

        Example:
          >>> import jax, jax.numpy as jnp, jaxmp
          >>> def model(w, x):
          ...   with jax.named_scope("head"):
          ...     return jnp.tanh(x @ w) @ w
          >>> f = jaxmp.autocast(model, "mixed_bfloat16", fp8=jaxmp.Float8CurrentScaling())
          >>> [(m.name, m.fp8) for m in f.fp8_matmuls(jnp.ones((4, 4)), jnp.ones((2, 4)))]
          [('head', True), ('head', True)]
        """
        return display.Float8Matmuls(self._trace(_Trace(listing=True), args, kwargs).matmuls)

    def __repr__(self) -> str:
        name = getattr(self._fun, "__name__", repr(self._fun))
        return f"jaxmp.autocast({name}, {self.policy!r}, fp8={self.fp8!r})"


def _build(
    fun: Callable[..., Any],
    policy: policy_lib.Policy,
    low_precision_ops: frozenset[str],
    float32_ops: frozenset[str],
    recipe: Any,
    exclude: Any,
    fused_attention: bool,
) -> Float8Autocast:
    """`jaxmp.autocast` with an FP8 recipe (registered with `autocast_lib.register_fp8`)."""
    return Float8Autocast(
        fun,
        policy,
        low_precision_ops,
        float32_ops,
        fp8.check_recipe(recipe),
        compile_exclude(exclude),
        fused_attention=fused_attention,
    )


autocast_lib.register_fp8(_build)


def fp8_autocast(
    fun: Callable[..., Any],
    policy: policy_lib.Policy | str,
    recipe: Any,
    exclude: str | Sequence[str] | None = None,
) -> Float8Autocast:
    """``jaxmp.autocast(fun, policy, fp8=recipe, fp8_exclude=exclude)``, typed as such."""
    out = autocast_lib.autocast(fun, policy, fp8=recipe, fp8_exclude=exclude)
    if not isinstance(out, Float8Autocast):  # pragma: no cover - autocast's own contract
        raise TypeError(f"expected a Float8Autocast, got {type(out).__name__}.")
    return out
