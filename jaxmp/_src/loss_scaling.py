"""`loss_scaling`: an optax wrapper that unscales, checks, skips and adjusts the loss scale."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmp._src import compat, display, dtypes, staging
from jaxmp._src import loss_scale as loss_scale_lib
from jaxmp._src import tree as tree_lib


class LossScalingState(NamedTuple):
    """State of `loss_scaling`.

    Attributes:
      inner_state: the wrapped transformation's state; bit-identical after a
        skipped step.
      loss_scale: the `LossScale` (a pytree of arrays) for the next step.
      grads_finite: whether the last step was finite: its gradients, its
        ``value`` and ``grad`` extra arguments and, with ``check_outputs=True``,
        the inner update's outputs (False: the step was skipped).
      skipped_steps: total number of skipped (non-finite) steps.
      consecutive_skipped_steps: skipped steps in a row up to the last step.
    """

    inner_state: Any
    loss_scale: loss_scale_lib.LossScale
    grads_finite: jax.Array  # shape=(), dtype=bool
    skipped_steps: jax.Array  # shape=(), dtype=int32
    consecutive_skipped_steps: jax.Array  # shape=(), dtype=int32

    def _repr_html_(self) -> str | None:
        """The state in a notebook: the loss scale and the skipped steps, as a table (None
        under a trace or of shapes alone, where there are no values to show)."""
        return _state_html(self)


def _state_html(state: LossScalingState) -> str | None:
    scale = state.loss_scale
    if not display.concrete((scale, state.grads_finite, state.skipped_steps)):
        return None

    def step(finite: bool) -> str:
        return "finite" if finite else "skipped (non-finite)"

    row = [
        display.each(scale.loss_scale, display.power_of_two),
        display.each(state.grads_finite, step),
        display.each(state.skipped_steps, str),
        display.each(state.consecutive_skipped_steps, str),
    ]
    name = type(scale).__name__
    if isinstance(scale, loss_scale_lib.DynamicLossScale):
        backoff = (
            "a non-finite step"
            if scale.hysteresis == 1
            else (f"{scale.hysteresis} non-finite steps in a row")
        )
        rule = (
            f"{name}: x{scale.factor:g} after {scale.period} finite steps in a row "
            f"({display.each(scale.counter, str)} so far), x{scale.backoff:g} after {backoff}"
        )
    elif isinstance(scale, loss_scale_lib.NoOpLossScale):
        rule = f"{name}: no loss scaling"
    else:
        rule = f"{name}: fixed"
    inner = state.inner_state
    parts = inner if type(inner) is tuple else (inner,)
    arrays = sum(hasattr(x, "dtype") for x in jax.tree.leaves(inner))
    names = ", ".join(type(p).__name__ for p in parts)
    return display.html_table(
        ["loss scale", "last step", "skipped steps", "skipped in a row"],
        [row],
        title="jaxmp.LossScalingState",
        after=[rule, f"inner state: {names} ({arrays} arrays)"],
    )


def as_transformation(inner: Any, *, arg: str = "inner") -> optax.GradientTransformationExtraArgs:
    """Checks that `inner` is an optax transformation and adds extra-args support."""
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        raise TypeError(
            f"`{arg}` must be an optax.GradientTransformation (with init and update), "
            f"got {inner!r}."
        )
    return optax.with_extra_args_support(inner)


def check_axis_name(axis_name: Any, *, arg: str = "axis_name") -> Any:
    """`axis_name` if it is None, a string or a non-empty tuple of strings; else a TypeError."""
    if axis_name is None or isinstance(axis_name, str):
        return axis_name
    if (
        isinstance(axis_name, (tuple, list))
        and axis_name
        and all(isinstance(n, str) for n in axis_name)
    ):
        return tuple(axis_name)
    raise TypeError(
        f"`{arg}` must be None, a mapped axis name (a string, as given to `shard_map`'s mesh "
        f"or `pmap`) or a tuple of them, got {axis_name!r}."
    )


def _finite_across(finite: jax.Array, axis_name: Any) -> jax.Array:
    if axis_name is None:
        return finite
    # The minimum over devices of 1/0: every device sees the same decision.
    return jax.lax.pmin(finite.astype(jnp.int32), axis_name) > 0


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _is_number(x: Any) -> bool:
    return _is_array(x) or isinstance(x, (int, float, complex))


class _Broadcasts:
    """Scalars broadcast to the leaves' shapes, once per shape and dtype, and shared.

    A scalar combined with an array is broadcast to the array's shape by each operation
    of the lowered program. Over a tree of many leaves of a few shapes (the layers of a
    model) that is one broadcast per leaf and operation, five per leaf in a loss-scaled
    update, all of which XLA simplifies and fuses one by one: its compile time grows with
    the instructions it is given. Shared, they cost one instruction per shape.
    """

    def __init__(self, **scalars: jax.Array):
        self._scalars = scalars
        self._made: dict[tuple[str, tuple[int, ...], Any, Any], jax.Array] = {}

    def __call__(self, name: str, like: Any, dtype: Any = None) -> jax.Array:
        """Scalar `name` broadcast to the shape (and explicit sharding) of the array `like`."""
        shape, sharding = jnp.shape(like), compat.explicit_sharding(like)
        key = (name, shape, dtype, sharding)
        made = self._made.get(key)
        if made is None:
            value = self._scalars[name] if name != "zero" else jnp.zeros((), dtype)
            if dtype is not None and jnp.dtype(value.dtype) != dtype:
                value = value.astype(dtype)
            made = value if shape == () else jax.lax.broadcast(value, shape)
            if sharding is not None and shape != ():
                made = compat.reshard(made, sharding)  # a local slice of a replicated scalar
            self._made[key] = made
        return made


def _is_numeric_array(x: Any) -> bool:
    """A JAX array of a numeric or boolean dtype (not a PRNG key)."""
    return isinstance(x, jax.Array) and (
        jnp.issubdtype(x.dtype, jnp.number) or jnp.issubdtype(x.dtype, jnp.bool_)
    )


def _unscale(loss_scale: loss_scale_lib.LossScale, tree: Any) -> Any:
    """Widens floating leaves to at least float32 (complex: complex64) and divides by the scale.

    Never narrows: float64 and complex128 leaves keep their dtype (a float64 gradient of
    1e300 or an update of 1e-12 survives). Complex leaves are unscaled like real ones, and
    Python floats and complex numbers (an Equinox module's float field) like arrays of
    them. Other leaves pass through.
    """
    inv = 1.0 / jnp.asarray(loss_scale.loss_scale).astype(jnp.float32)
    noop = isinstance(loss_scale, loss_scale_lib.NoOpLossScale)
    broadcasts = _Broadcasts(inv=inv)

    def leaf(x):
        if isinstance(x, (float, complex)):  # not bool or int: those are not trained
            x = jnp.asarray(x, jnp.complex64 if isinstance(x, complex) else jnp.float32)
        if dtypes.is_floating(x):
            dtype = dtypes.compute_dtype_of(x)
        elif tree_lib.is_complex(x):
            dtype = jnp.dtype(jnp.complex128 if x.dtype.itemsize >= 16 else jnp.complex64)
        else:
            return x
        x = x if jnp.dtype(x.dtype) == dtype else x.astype(dtype)
        if noop:
            return x
        if isinstance(x, jax.Array):
            return jax.lax.mul(x, broadcasts("inv", x, dtype))
        return x * inv.astype(dtype)

    return jax.tree.map(leaf, tree)


def _widen(params: Any) -> Any:
    """Floating array leaves of less than 32 bits as float32; other leaves as they are.

    `inner` is initialised with these: its state (Adam's moments) is then float32 like
    the gradients it receives, whatever the dtype of the params given to `init` (in
    float16, the second moment of a gradient of 1e4 is inf and that of 1e-3 is 0).
    """
    return jax.tree.map(
        lambda x: x.astype(dtypes.compute_dtype_of(x)) if dtypes.is_floating(x) else x, params
    )


def _zero_unless(finite: jax.Array | _Broadcasts, tree: Any) -> Any:
    """``where(finite, x, 0)`` for every array leaf; other leaves pass through.

    Applied to the gradients before the inner update as well as to its updates: on a
    skipped step the inner update then runs on zeros, so no NaN or inf reaches it from the
    gradients (the gradient of a skipped step with respect to a hyperparameter is 0, not
    ``0 * NaN``, and `jax_debug_nans` does not fire inside an update that is discarded,
    unless the inner update makes a NaN of zero gradients itself, as
    `optax.clip_by_global_norm`'s discarded branch does: 0 / 0). `finite` may be given as
    its `_Broadcasts` (``finite=...``), shared with the other selects of the update.
    """
    broadcasts = finite if isinstance(finite, _Broadcasts) else _Broadcasts(finite=finite)

    def leaf(x):
        if _is_numeric_array(x):
            dtype = jnp.dtype(x.dtype)
            return jax.lax.select(broadcasts("finite", x), x, broadcasts("zero", x, dtype))
        if not _is_number(x):
            return x
        return jnp.where(broadcasts("finite", jnp.float32(0)), x, jnp.zeros_like(x))

    return jax.tree.map(leaf, tree)


def _keep_state_dtypes(new: Any, old: Any) -> Any:
    """Casts new inner state leaves back to the dtype of the old leaves they replace.

    optax starts a state leaf in its param's dtype (``zeros_like(param)``), and the
    inner update computes it from the widened gradients: Adam's moments of a float16
    or bfloat16 param turn into float32, those of an integer or boolean param (not
    trained) into float32. Each keeps the dtype it started with, as plain optax on
    gradients of the param's dtype keeps it, so that the state is stable in dtype (and
    a jitted step traces once). Only floating to floating, complex to complex, and
    anything to an integer or boolean leaf is cast; any other change is reported by the
    caller.
    """

    def kind(dtype: Any) -> str:
        if jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_):
            return "int"
        if jnp.issubdtype(dtype, jnp.complexfloating):
            return "complex"
        return "float" if jnp.issubdtype(dtype, jnp.floating) else "other"

    def leaf(n, o):
        if not (_is_array(n) and _is_array(o)) or jnp.dtype(n.dtype) == jnp.dtype(o.dtype):
            return n
        if jnp.shape(n) != jnp.shape(o):
            return n
        old_kind = kind(o.dtype)
        if old_kind == "int" or (old_kind in ("float", "complex") and kind(n.dtype) == old_kind):
            return n.astype(o.dtype)
        return n

    try:
        return jax.tree.map(leaf, new, old)
    except ValueError:  # different structures: reported by the caller
        return new


def _select_state(finite: jax.Array, new: Any, old: Any) -> Any:
    return tree_lib.select(finite, new, old, names=("new inner state", "old inner state"))


def _is_traced(tree: Any) -> bool:
    return any(compat.is_tracer(x) for x in jax.tree.leaves(tree))


def _applied(params: Any, updates: Any) -> Any:
    """``params + updates`` in each param's dtype, as `optax.apply_updates` computes it."""

    def leaf(u, p):
        if u is None or not (_is_number(u) and _is_number(p)):
            return None
        p, u = jnp.asarray(p), jnp.asarray(u)
        wide = max(jnp.dtype(p.dtype), jnp.dtype(u.dtype), key=lambda d: d.itemsize)
        return (p.astype(wide) + u.astype(wide)).astype(p.dtype)

    return jax.tree.map(leaf, updates, params, is_leaf=lambda x: x is None)


def _in_param_dtypes(updates: Any, params: Any) -> Any:
    """Each floating update in its floating param's dtype (others as they are).

    A wider update (float32, from the float32 gradients, for a float16 or bfloat16
    param) becomes the update that takes the param to ``param + update`` rounded to the
    param's dtype, saturated at its largest finite value (`tree.update_to`): what
    `optax.apply_updates` computes, exact within a factor of 2, never inf, and kept in
    the param's dtype by `equinox.apply_updates` and under strict promotion too.
    """
    if params is None:
        return updates

    def leaf(u, p):
        if not (_is_array(u) and dtypes.is_floating(u) and dtypes.is_floating(p)):
            return u
        u_dtype, p_dtype = jnp.dtype(u.dtype), jnp.dtype(p.dtype)
        if u_dtype == p_dtype:
            return u
        if u_dtype.itemsize < p_dtype.itemsize:
            return u.astype(p_dtype)
        p = jnp.asarray(p)
        return tree_lib.update_to(p.astype(u_dtype) + u, p)[1]

    try:
        return jax.tree.map(leaf, updates, params, is_leaf=lambda x: x is None)
    except (ValueError, TypeError):  # structures differ: nothing to match the updates to
        return updates


def _guarded_update(
    inner: optax.GradientTransformationExtraArgs,
    finite: jax.Array,
    grads: Any,
    inner_state: Any,
    params: Any,
    extra_args: dict[str, Any],
    *,
    check_outputs: bool = False,
    axis_name: Any = None,
    shared: _Broadcasts | None = None,
) -> tuple[Any, Any, jax.Array]:
    """`inner.update`, then zero updates and the old inner state unless the step is finite.

    Returns the updates, the inner state and whether the step was finite (`finite`,
    and with `check_outputs` whether the updates, the new inner state and
    ``params + updates`` are finite). Under a trace and without `check_outputs`, the
    selects are placed where `inner` computes each new state leaf
    (`_update_selecting_at_source`); otherwise after the update. `shared` holds the
    broadcasts of `finite` already made for the gradients.
    """
    if not check_outputs and _is_traced((grads, inner_state)):
        shared = shared if shared is not None else _Broadcasts(finite=finite)
        try:
            updates, state = _update_selecting_at_source(
                inner, shared, grads, inner_state, params, extra_args
            )
            return _in_param_dtypes(updates, params), state, finite
        except (jax.errors.JAXTypeError, NotImplementedError):
            # What `inner` cannot do as a jaxpr of (grads, state) (Python control
            # flow on a state leaf that is concrete, say) takes the plain path
            # below, which raises the same error if the update itself is at fault.
            pass
    raw_updates, new_inner = inner.update(grads, inner_state, params, **extra_args)
    new_updates = _in_param_dtypes(raw_updates, params)
    new_inner = _keep_state_dtypes(new_inner, inner_state)
    if check_outputs:
        # With finite params, ``params + updates`` is finite only if the updates are.
        # An update put in its param's dtype saturates: the one `inner` made is checked too.
        converted = [
            raw
            for raw, new in zip(
                jax.tree.leaves(raw_updates), jax.tree.leaves(new_updates), strict=True
            )
            if raw is not new
        ]
        outputs = (
            new_inner,
            new_updates if params is None else _applied(params, new_updates),
            converted,
        )
        finite = _finite_across(finite & tree_lib.all_finite(outputs), axis_name)
    return (
        _zero_unless(finite, new_updates),
        _select_state(finite, new_inner, inner_state),
        finite,
    )


def _update_selecting_at_source(
    inner: optax.GradientTransformationExtraArgs,
    shared: _Broadcasts,
    grads: Any,
    inner_state: Any,
    params: Any,
    extra_args: dict[str, Any],
) -> tuple[Any, Any]:
    """`_guarded_update` with each new state leaf selected where it is computed.

    Selecting the new state after the update leaves the unselected new state
    (Adam's new moments, say) needed by two consumers: the selected state and the
    updates computed from it. XLA then recomputes it inside the updates' fusion,
    reading the gradients and the old state once more (a quarter more memory
    traffic for Adam). Here the update runs as a jaxpr in which every new state
    value is replaced by ``select(finite, new, old)`` as soon as it is computed,
    so later computations, the updates included, read the selected state that is
    written anyway. Where `finite` is true every value is unchanged; where it is
    false the updates are garbage and zeroed as before. `shared` is `finite` and its
    broadcasts to the leaves' shapes (`_Broadcasts`).
    """
    g_all, g_def = jax.tree.flatten(grads)
    s_all, s_def = jax.tree.flatten(inner_state)
    if not all(map(_is_array, g_all + s_all)):
        # Leaves that are not arrays (an Equinox module's functions, Python numbers) cannot
        # be jaxpr inputs: the plain path handles them.
        raise NotImplementedError("non-array leaves")
    g_leaves, s_leaves = g_all, s_all

    def run(g, s):
        new_updates, new_state = inner.update(
            jax.tree.unflatten(g_def, g), jax.tree.unflatten(s_def, s), params, **extra_args
        )
        return new_updates, _keep_state_dtypes(new_state, inner_state)

    closed, (u_shape, s_shape) = jax.make_jaxpr(run, return_shape=True)(g_leaves, s_leaves)
    tree_lib.check_same_structure(
        s_shape, inner_state, names=("new inner state", "old inner state"), check_dtypes=True
    )
    jaxpr = closed.jaxpr
    n_updates = len(jax.tree.leaves(u_shape))
    state_vars = jaxpr.outvars[n_updates:]
    inputs = set(jaxpr.invars) | set(jaxpr.constvars)
    old_of: dict[Any, Any] = {}  # new state var -> old value; None: select at the end
    old_input: dict[Any, Any] = {}  # new state var -> the input variable of its old value
    state_inputs = jaxpr.invars[len(g_leaves) :]
    for var, old, old_var in zip(state_vars, s_leaves, state_inputs, strict=True):
        if not isinstance(var, compat.Literal) and var not in inputs:
            # Scalars (Adam's count) are selected at the end: selecting them costs no
            # memory traffic, and the computations after them then see the new value,
            # not the old one (a count of 0 would make Adam's bias correction divide 0 by 0
            # in the discarded update of a skipped first step, and its hypergradient NaN).
            scalar = jnp.ndim(old) == 0
            old_of[var] = None if (var in old_of or scalar) else old
            old_input[var] = old_var

    # Under jit (the usual case), the equations are copied into the trace with the selects
    # placed among them; elsewhere (under vmap, say) they are bound again one by one.
    copied = compat.inline_with_selects(
        closed,
        g_leaves + s_leaves,
        {
            var: (old_input[var], shared("finite", old))
            for var, old in old_of.items()
            if old is not None
        },
    )
    if copied is not None:
        return _selected_outputs(shared, copied, u_shape, s_shape, state_vars, s_leaves, old_of)

    env: dict[Any, Any] = {}

    def read(var):
        return var.val if isinstance(var, compat.Literal) else env[var]

    def write(var, value):
        old = old_of.get(var)
        if old is None:
            env[var] = value
            return
        selected = jax.lax.select(shared("finite", value), value, old)
        if jax.typeof(selected) != jax.typeof(value):
            # The select changed the value's type: under `shard_map(check_vma=True)`, a
            # device-varying `finite` makes an invariant value (Adam's count) varying,
            # which the equations after it were not traced for. Select it at the end.
            old_of[var] = None
            env[var] = value
            return
        env[var] = selected

    for var, value in zip(jaxpr.constvars, closed.consts, strict=True):
        env[var] = value
    for var, value in zip(jaxpr.invars, g_leaves + s_leaves, strict=True):
        env[var] = value
    for eqn in jaxpr.eqns:
        with compat.eqn_context(eqn):
            out = compat.bind(eqn, [read(v) for v in eqn.invars])
        for var, value in zip(eqn.outvars, out, strict=True):
            write(var, value)

    outs = [read(var) for var in jaxpr.outvars]
    return _selected_outputs(shared, outs, u_shape, s_shape, state_vars, s_leaves, old_of)


def _selected_outputs(
    shared: _Broadcasts,
    outs: list[Any],
    u_shape: Any,
    s_shape: Any,
    state_vars: list[Any],
    s_leaves: list[Any],
    old_of: dict[Any, Any],
) -> tuple[Any, Any]:
    """The zeroed updates and the new state, each state leaf not selected where it was
    computed (``old_of[var] is None``) selected now."""
    n_updates = len(outs) - len(state_vars)
    new_updates = jax.tree.unflatten(jax.tree.structure(u_shape), outs[:n_updates])
    new_state = []
    for var, value, old in zip(state_vars, outs[n_updates:], s_leaves, strict=True):
        done = not isinstance(var, compat.Literal) and old_of.get(var) is not None
        value = jnp.asarray(value)
        new_state.append(value if done else jax.lax.select(shared("finite", value), value, old))
    return (
        _zero_unless(shared, new_updates),
        jax.tree.unflatten(jax.tree.structure(s_shape), new_state),
    )


def _find_loss_scaling_states(tree: Any) -> list[str]:
    leaves = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, LossScalingState)
    )[0]
    return [
        jax.tree_util.keystr(path) or "<root>"
        for path, leaf in leaves
        if isinstance(leaf, LossScalingState)
    ]


def _check_grads_match_params(grads: Any, params: Any) -> None:
    """Raises naming the leaf unless `grads` has the structure of `params`.

    A None gradient stands for a whole subtree of `params` (Equinox's filtered
    gradients of an unfiltered module), and `optax.lookahead`'s params are checked
    by their fast part, the one the gradients are for.
    """
    if isinstance(params, optax.LookaheadParams):
        params = params.fast
    treedef = jax.tree.structure(grads, is_leaf=lambda x: x is None)
    try:
        treedef.flatten_up_to(params)  # type: ignore[attr-defined]
    except (ValueError, TypeError):
        tree_lib.check_same_structure(grads, params, names=("grads", "params"))
        raise


def loss_scaling(
    inner: optax.GradientTransformation,
    loss_scale: loss_scale_lib.LossScale | None = None,
    *,
    axis_name: Any = None,
    check_outputs: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Wraps `inner` so that it receives unscaled, finite gradients of at least float32.

    ``update(grads, state, params=None, **extra)`` takes the gradients of the
    *scaled* loss (in any floating dtype, for example those of
    `jaxmp.value_and_grad`). It widens them to float32 (float64 and complex
    gradients keep their dtype, complex64 at least; nothing is narrowed), divides
    them by the loss scale that produced them (the one in `state`, see
    `jaxmp.get_loss_scale`), and checks that every element is finite (across
    `axis_name` when given). If so, `inner` runs on the unscaled gradients. If
    not, the step is skipped: the updates are all zero and the inner state is
    kept bit-identical. Either way, the loss scale is then adjusted
    (`LossScale.adjust`).

    What is checked, and so what the skip guarantees:

    * the unscaled gradients, real and complex;
    * the extra arguments ``value`` (the loss, as `jaxmp.value_and_grad` returns
      it, unscaled: a NaN ``value`` for `optax.contrib.reduce_on_plateau` skips
      the step) and ``grad`` (which `optax.lbfgs`'s line search takes: it is
      unscaled like the gradients). Other extra arguments reach `inner` as given;
    * with ``check_outputs=True``, also the inner update's outputs: the updates
      (as `inner` makes them, before they are put in each param's dtype, where
      they would saturate), the new inner state and ``params + updates`` in each
      param's dtype. Finite gradients can still make these non-finite (a
      gradient of 1e20 makes Adam's second moment inf; ``adam(eps=0)`` with zero
      gradients divides 0 by 0; SGD on a float32 param of 3e38 overflows). The
      check reads the new state and ``params + updates`` once more, and the skip
      can no longer be selected where each state leaf is computed (below): Adam's
      update then moves 2.3x the bytes of plain `optax.adam`, against 1.10x
      without it (BENCHMARKS.md).

    So a skipped step never lets a non-finite value into params or the inner
    state; without ``check_outputs``, an update whose own arithmetic overflows
    on finite inputs is applied.

    Unlike `optax.apply_if_finite`, it never gives up and applies a non-finite
    update, however many steps in a row are skipped. On a skipped step `inner`
    runs on zeros (its result is discarded), so that no NaN reaches it from the
    gradients: the gradient of a skipped step's updates with respect to a
    hyperparameter is 0. (An inner update that makes a NaN of zero gradients by
    itself, as `optax.clip_by_global_norm` does in a branch it discards, still
    trips `jax_debug_nans` outside `jax.jit`, as it does in plain optax.)

    The skip is a select fused into the inner update (the inner update is
    computed and discarded on a skipped step): under `jax.jit`, each new state
    leaf is selected where `inner` computes it, so the updates are computed from
    the selected state that is written anyway. Wrapping Adam then costs one extra
    read of the gradients, for the finiteness check, and nothing more (see
    BENCHMARKS.md).

    `inner` is initialised with float16 and bfloat16 params widened to float32,
    so that its state is float32 like the gradients it receives: with
    half-precision params and no `master_weights`, Adam's moments are float32
    (as under `mixed_precision`, without the master copy), whatever the dtype of
    the params given to `init`. Every inner state leaf keeps the dtype it was
    initialised with: integer and boolean params are not trained by optax, and
    their moments stay in their dtype. Each update has its param's dtype (when
    `params` is passed): ``params + updates`` is ``params + inner's update``
    rounded to each param's dtype, exactly when a step leaves a param within a
    factor of 2 of its value, and saturated at the dtype's largest value instead
    of inf, with `optax.apply_updates` and `equinox.apply_updates`, under standard
    and strict promotion.

    Args:
      inner: the optax transformation to wrap (an optimizer or a chain). It must
        not itself contain `loss_scaling` (or `mixed_precision`): `init` raises.
      loss_scale: a `NoOpLossScale`, `StaticLossScale` or `DynamicLossScale`
        (jmp's are converted). Default: ``DynamicLossScale(2**15)``.
      axis_name: for `shard_map` / `pmap` code where each device holds its own
        gradients: the mapped axis name (or tuple of names) over which the
        finiteness decision is made, so that a NaN on one device skips the step on
        all of them. Not needed under `jax.jit` with sharded arrays, where the
        check already covers the global array.
      check_outputs: also skip the step when the inner update's outputs are not
        finite (see above). Off by default.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a
      `LossScalingState`.

    Raises:
      TypeError: if `inner` is not an optax transformation, `loss_scale` is not
        a loss scale or `axis_name` is not a string or tuple of strings.
      ValueError: from `init`, if `inner`'s state already holds a
        `LossScalingState` (the gradients would be unscaled twice).

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxmp
      >>> tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(2.0**10))
      >>> params = {"w": jnp.ones(2)}
      >>> state = tx.init(params)
      >>> grads = {"w": jnp.array([2.0**10, jnp.inf])}  # overflowed scaled gradients
      >>> updates, state = jax.jit(tx.update)(grads, state, params)
      >>> updates["w"], state.loss_scale.loss_scale, state.skipped_steps
      (Array([0., 0.], dtype=float32), Array(512., dtype=float32), Array(1, dtype=int32))
    """
    inner = as_transformation(inner)
    scale0 = (
        loss_scale_lib.DynamicLossScale(2.0**15)
        if loss_scale is None
        else loss_scale_lib.as_loss_scale(loss_scale)
    )
    if not isinstance(check_outputs, bool):
        raise TypeError(f"`check_outputs` must be a bool, got {check_outputs!r}.")
    axis_name = check_axis_name(axis_name)

    @staging.staged
    def init_fn(params):
        # `inner` receives float32 gradients: its state starts from float32 params too.
        inner_state = inner.init(_widen(params))
        nested = _find_loss_scaling_states(inner_state)
        if nested:
            raise ValueError(
                "`inner` must not contain jaxmp.loss_scaling (or jaxmp.mixed_precision), "
                f"got one whose state is at {', '.join(nested)}: the gradients would be "
                "unscaled twice. Wrap the optimizer once."
            )
        return LossScalingState(
            inner_state=inner_state,
            loss_scale=jax.tree.map(jnp.asarray, scale0),
            grads_finite=jnp.array(True),
            skipped_steps=jnp.zeros((), jnp.int32),
            consecutive_skipped_steps=jnp.zeros((), jnp.int32),
        )

    def update_fn(updates, state, params=None, **extra_args):
        if not isinstance(state, LossScalingState):
            raise TypeError(
                f"`state` must be the LossScalingState made by this transformation's init, "
                f"got {type(state).__name__}."
            )
        if params is not None:
            _check_grads_match_params(updates, params)
        scale = state.loss_scale
        grads = _unscale(scale, updates)
        checked: tuple[Any, ...] = (grads,)
        if "grad" in extra_args:
            extra_args = {**extra_args, "grad": _unscale(scale, extra_args["grad"])}
            checked += (extra_args["grad"],)
        if "value" in extra_args:
            checked += (extra_args["value"],)
        finite = _finite_across(tree_lib.all_finite(checked), axis_name)
        shared = _Broadcasts(finite=finite)
        grads = _zero_unless(shared, grads)
        if "grad" in extra_args:
            extra_args["grad"] = _zero_unless(shared, extra_args["grad"])
        new_updates, inner_state, finite = _guarded_update(
            inner,
            finite,
            grads,
            state.inner_state,
            params,
            extra_args,
            check_outputs=check_outputs,
            axis_name=axis_name,
            shared=shared,
        )
        skipped = (~finite).astype(jnp.int32)
        new_state = LossScalingState(
            inner_state=inner_state,
            loss_scale=scale.adjust(finite),
            grads_finite=finite,
            skipped_steps=state.skipped_steps + skipped,
            consecutive_skipped_steps=(state.consecutive_skipped_steps + skipped) * skipped,
        )
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
