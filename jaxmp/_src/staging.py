"""State built in one compiled program, where the params live: `staged_init`.

An optimizer's ``init`` is most often called outside `jax.jit`. Run op by op, each wrapper
materialises what it hands to the next: `loss_scaling` the params widened to float32, optax
the float32 moments that `compress_state` then compresses to 8 bits. With bfloat16 params
and int8 moments the state is 2 bytes a parameter, but the call went through 14 (6x its
state on a 4096 x 32768 leaf, `benchmarks/memory_at_scale.py`). Traced as one program
instead, the widened params and the float32 zeros are never written: XLA fuses each into the
computation that reads it, and the call takes what it returns and little more.

`jax.jit` alone would put the outputs where XLA likes: optax's ``zeros_like`` of a param
carries the param's sharding only outside a trace (under one, a param sharded over `Auto` mesh
axes has no sharding in its type), and the moments would land on one device. So the program's
outputs are placed where the params are: on their device and memory, or, for params spread
over one mesh, each leaf with the sharding `jaxmp.state_shardings` gives it (that of the param
it is computed from: the data flow, traced with explicit sharding types), replicated for the
rest (counters, keys, the loss scale). Params placed otherwise (devices not on one mesh, host
memory) keep op by op, whose placement follows each operand. Each transform keeps its compiled
programs, by the params' structure, shapes, dtypes and placement, for later calls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxmp._src import compat, distributed, interpret


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


class _OpByOp(Exception):
    """The params are placed in a way `staged_init` does not reproduce: run op by op."""


def _placement(arrays: list[Any]) -> Any:
    """How the state is placed: None (the params are numpy or uncommitted: where JAX puts
    it), a `Sharding` for every state leaf (the params' one device and memory), or
    "state_shardings" (the params spread over one mesh's devices)."""
    shardings = [x.sharding for x in arrays if isinstance(x, jax.Array)]
    if not shardings:
        return None
    kinds = {s.memory_kind for s in shardings}
    devices = {frozenset(s.device_set) for s in shardings}
    if len(kinds) > 1 or len(devices) > 1:
        raise _OpByOp  # several memories or device sets: each leaf's own placement
    (kind,) = kinds
    (device_set,) = devices
    if len(device_set) == 1:
        (device,) = device_set
        if all(not getattr(x, "committed", True) for x in arrays if isinstance(x, jax.Array)):
            return None
        return jax.sharding.SingleDeviceSharding(device, memory_kind=kind)
    default = next(iter(device_set)).default_memory().kind  # type: ignore[attr-defined]
    if kind is not None and kind != default:
        raise _OpByOp  # host-offloaded params: op by op keeps their memory
    meshes = {s.mesh if isinstance(s, jax.sharding.NamedSharding) else None for s in shardings}
    if len(meshes) > 1 or None in meshes:
        raise _OpByOp  # not one mesh (the same devices in another order, say)
    return "state_shardings"


def staged(init: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`init` that runs as `staged_init` does, its compiled programs kept for later calls
    with params of the same structure, shapes, dtypes and placement."""
    cache: dict[Any, Any] = {}

    @functools.wraps(init)
    def run(params: Any) -> Any:
        return staged_init(init, params, cache)

    return run


def staged_init(
    init: Callable[[Any], Any], params: Any, cache: dict[Any, Any] | None = None
) -> Any:
    """``init(params)``, run as one compiled program when called outside a trace.

    Inside a trace (``jax.jit(tx.init)``, or one jaxmp wrapper's ``init`` calling the next),
    `init` is traced into the enclosing program as it is. Outside one, it is traced once
    with the params' arrays as arguments (their other leaves, Python floats of an Equinox
    module say, as constants), compiled, and run: no intermediate value is written unless
    XLA needs it. The state is placed where the params are: on their device (and memory), or,
    spread over a mesh's devices, each leaf as `jaxmp.state_shardings` says (see the module
    docs). Leaves of the state that are not arrays (a Python number, a numpy array built by
    `init`) are returned as `init` made them, and a param that `init` returns as it is (a
    float32 param as its own master copy) is that param, not a copy. Params placed otherwise
    (several devices not on one mesh, host memory), and an `init` that cannot be traced (one
    reading a param's value in Python, or its placement), run op by op, as without jaxmp.

    Args:
      init: the ``init`` of a transformation.
      params: its argument.
      cache: compiled programs by the params' structure, shapes, dtypes and placement.

    Returns:
      ``init(params)``.
    """
    leaves, treedef = jax.tree.flatten(params)
    if any(compat.is_tracer(x) for x in leaves):
        return init(params)
    arrays = [i for i, x in enumerate(leaves) if _is_array(x)]
    if not arrays:
        return init(params)
    values = [leaves[i] for i in arrays]
    try:
        placement = _placement(values)
    except _OpByOp:
        return init(params)
    key = _key(treedef, leaves, arrays, placement)
    program = None if cache is None or key is None else cache.get(key)
    if program is None:
        try:
            program = _compile(init, params, leaves, treedef, arrays, placement)
        except Exception:  # noqa: BLE001
            # An init that cannot be traced (a Python decision on a value, a param's
            # placement read), or state shardings that cannot be traced with explicit types:
            # op by op, as without jaxmp; a genuine error is raised there again.
            return init(params)
        if cache is not None and key is not None:
            cache[key] = program
    jitted, static, passed, state_def, count = program
    computed = iter(jitted(*values))
    out = []
    for k in range(count):
        if k in static:
            out.append(static[k])
        elif k in passed:
            out.append(leaves[passed[k]])
        else:
            out.append(next(computed))
    return jax.tree.unflatten(state_def, out)


def _key(treedef: Any, leaves: list[Any], arrays: list[int], placement: Any) -> Any:
    """The cache key of a call: None when the params' other leaves are not hashable."""
    statics = tuple((i, x) for i, x in enumerate(leaves) if i not in set(arrays))
    avals = tuple(
        (
            np.shape(leaves[i]),
            np.dtype(leaves[i].dtype).name,
            bool(getattr(leaves[i], "weak_type", False)),
            type(leaves[i]).__name__,
        )
        for i in arrays
    )
    shardings = tuple(getattr(leaves[i], "sharding", None) for i in arrays)
    try:
        hash(statics)
        hash(shardings)
    except TypeError:
        return None
    return (treedef, statics, avals, shardings, placement if placement != "state_shardings" else 1)


def _compile(
    init: Callable[[Any], Any],
    params: Any,
    leaves: list[Any],
    treedef: Any,
    arrays: list[int],
    placement: Any,
) -> tuple[Any, dict[int, Any], dict[int, int], Any, int]:
    """``(jitted, static, passed, state treedef, leaf count)`` of `init`'s program: the
    state leaves that are not computed (`static`: as `init` made them; `passed`: a param
    returned as it is, by its index among the params' leaves) and a compiled function of
    the params' arrays returning the others."""
    kept: dict[str, Any] = {}
    # The params' other leaves only: the program is kept for later calls, and must not keep
    # this call's arrays alive.
    others = [None if i in set(arrays) else x for i, x in enumerate(leaves)]
    kinds = {i: isinstance(leaves[i], jax.Array) for i in arrays}

    def traced(*values: Any) -> list[Any]:
        full = list(others)
        for i, v in zip(arrays, values, strict=True):
            full[i] = v
        state = init(jax.tree.unflatten(treedef, full))
        state_leaves, state_def = jax.tree.flatten(state)
        given = {id(v): arrays[j] for j, v in enumerate(values)}
        outs, static, passed = [], {}, {}
        for k, x in enumerate(state_leaves):
            if id(x) in given and kinds[given[id(x)]]:
                # A param returned as it is (a float32 param as its own master copy): the
                # param itself, as outside a trace, not a copy of it.
                passed[k] = given[id(x)]
            elif not (compat.is_tracer(x) or isinstance(x, jax.Array)):
                static[k] = x  # not computed from the params: returned as made
            else:
                outs.append(x)
        kept.update(static=static, passed=passed, treedef=state_def, count=len(state_leaves))
        return outs

    structs = [interpret.shape_struct(leaves[i]) for i in arrays]
    jax.eval_shape(traced, *structs)  # the structure, and which leaves are computed
    static, passed, count = kept["static"], kept["passed"], kept["count"]
    computed = [k for k in range(count) if k not in static and k not in passed]
    if placement == "state_shardings":
        every = jax.tree.leaves(distributed.init_shardings(init, params))
        out_shardings: Any = [every[k] for k in computed]
    else:
        out_shardings = None if placement is None else [placement] * len(computed)
    # `keep_unused`: an init that reads no param value still runs where the params are.
    jitted = jax.jit(traced, out_shardings=out_shardings, keep_unused=True)
    return jitted, static, passed, kept["treedef"], count
