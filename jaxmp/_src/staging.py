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
axes has no sharding in its type), and the moments would land on one device. So when the
params are spread over several devices, each output leaf is constrained to the sharding
`jaxmp.state_shardings` gives it: that of the param it is computed from (the data flow, traced
with explicit sharding types), replicated for the rest (counters, keys, the loss scale).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxmp._src import compat, distributed


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _spread(x: Any) -> bool:
    """Whether array `x` lives on several devices."""
    sharding = getattr(x, "sharding", None)
    return sharding is not None and len(sharding.device_set) > 1


def staged_init(init: Callable[[Any], Any], params: Any) -> Any:
    """``init(params)``, run as one compiled program when called outside a trace.

    Inside a trace (``jax.jit(tx.init)``, or one jaxmp wrapper's ``init`` calling the next),
    `init` is traced into the enclosing program as it is. Outside one, it is traced once
    with the params' arrays as arguments (their other leaves, Python floats of an Equinox
    module say, as constants), compiled, and run: no intermediate value is written unless
    XLA needs it. With params spread over several devices, each state leaf is placed as
    `jaxmp.state_shardings` says (see the module docs); params that are not all on one mesh
    as `NamedSharding`s are initialised op by op. Leaves of the state that are not arrays (a
    Python number, a numpy array built by `init`) are returned as `init` made them, and a
    param that `init` returns as it is (a float32 param as its own master copy) is that
    param, not a copy. An `init` that cannot be traced (one reading a param's value in
    Python) runs op by op, as it would without jaxmp.

    Args:
      init: the ``init`` of a transformation.
      params: its argument.

    Returns:
      ``init(params)``.
    """
    leaves, treedef = jax.tree.flatten(params)
    if any(compat.is_tracer(x) for x in leaves):
        return init(params)
    arrays = [i for i, x in enumerate(leaves) if _is_array(x)]
    if not arrays:
        return init(params)
    shardings = None
    if any(_spread(leaves[i]) for i in arrays):
        try:
            shardings = jax.tree.leaves(distributed.init_shardings(init, params))
        except (TypeError, ValueError):
            # Not every array on one mesh as a `NamedSharding`: op by op, each result placed
            # as JAX places it outside a trace.
            return init(params)
    kept: dict[str, Any] = {}

    def traced(*values: Any) -> list[Any]:
        full = list(leaves)
        for i, v in zip(arrays, values, strict=True):
            full[i] = v
        state = init(jax.tree.unflatten(treedef, full))
        state_leaves, state_def = jax.tree.flatten(state)
        given = {id(v): arrays[j] for j, v in enumerate(values)}
        outs, static = [], {}
        for k, x in enumerate(state_leaves):
            if id(x) in given and isinstance(leaves[given[id(x)]], jax.Array):
                # A param passed through (a float32 param as its own master copy): the
                # param itself, as outside a trace, not a copy of it.
                static[k] = leaves[given[id(x)]]
                continue
            if not (compat.is_tracer(x) or isinstance(x, jax.Array)):
                static[k] = x  # not computed from the params: returned as made
                continue
            if shardings is not None:
                x = jax.lax.with_sharding_constraint(x, shardings[k])
            outs.append(x)
        kept.update(treedef=state_def, static=static, count=len(state_leaves))
        return outs

    try:
        computed = jax.jit(traced)(*[leaves[i] for i in arrays])
    except (
        jax.errors.ConcretizationTypeError,
        jax.errors.TracerBoolConversionError,
        jax.errors.TracerIntegerConversionError,
        jax.errors.TracerArrayConversionError,
    ):
        return init(params)  # reads a value in Python: op by op
    it = iter(computed)
    out = [kept["static"][k] if k in kept["static"] else next(it) for k in range(kept["count"])]
    return jax.tree.unflatten(kept["treedef"], out)


def staged(init: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`init` that runs as `staged_init` does."""
    return functools.wraps(init)(functools.partial(staged_init, init))
