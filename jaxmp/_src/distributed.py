"""Sharded and multi-device training: float32 gradient reduction and optimizer-state shardings.

jaxmp's transforms are plain JAX functions, so they run unchanged under `jax.jit` with
sharded arrays, under `jax.shard_map` and across processes. Two things need help:

* In `shard_map` code, a gradient all-reduce runs in the gradients' own dtype. With float16 or
  bfloat16 compute that is a half-precision sum (JAX issue #27496). `psum_in_float32` and
  `pmean_in_float32` reduce in float32 instead, at twice the bytes on the wire.
* With a mesh of automatic axes (``jax.sharding.Mesh``, or ``jax.make_mesh(...,
  axis_types=(AxisType.Auto, ...))``), ``jax.jit(tx.init)(params)`` lets XLA place the state,
  and it replicates the optimizer's moments, which hold no data dependence on the params.
  `state_shardings` gives every state leaf the sharding of the param it belongs to.
"""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from jax.tree_util import keystr

from jaxmp._src import casting

T = TypeVar("T")


def psum_in_float32(tree: T, axis_name: Any) -> T:
    """All-reduces (sums) `tree` over `axis_name` in float32, for `shard_map` / `pmap` code.

    Float16 and bfloat16 leaves are cast to float32 *before* the `jax.lax.psum`, so the sum
    is accumulated and sent in float32; the result stays float32 (`jaxmp.loss_scaling`
    consumes float32 gradients anyway, and casting back would round the sum again). Float32
    and float64 leaves are summed in their own dtype; integer leaves are summed as they are.

    The all-reduce moves twice the bytes of a float16/bfloat16 one.

    Under ``shard_map(check_vma=True)`` (the default), differentiating with respect to params
    that are invariant over ``axis_name`` already sums their gradients over it, in the
    gradients' dtype, inside the backward pass. Make the params device-varying before
    differentiating, so that each device's gradient stays its own until this call::

        local = jax.lax.pcast(params, "data", to="varying")
        loss, grads = jaxmp.value_and_grad(loss_fn)(loss_scale, local, batch)
        grads = jaxmp.pmean_in_float32(grads, "data")

    Args:
        tree: a pytree of arrays, typically per-device gradients.
        axis_name: the mapped axis name (or tuple of names) to reduce over.

    Returns:
        The summed tree; half-precision floating leaves become float32.

    Example:
        >>> import jax, jax.numpy as jnp, jaxmp
        >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
        >>> f = jax.shard_map(lambda g: jaxmp.psum_in_float32(g, "data"), mesh=mesh,
        ...                   in_specs=jax.P("data"), out_specs=jax.P())
        >>> f(jnp.ones(2, jnp.float16))
        Array([1., 1.], dtype=float32)
    """
    return jax.lax.psum(casting.widen_to_float32(tree), axis_name)


def pmean_in_float32(tree: T, axis_name: Any) -> T:
    """All-reduces (averages) `tree` over `axis_name` in float32, for `shard_map` / `pmap` code.

    Like `psum_in_float32`, then divided by the number of devices along `axis_name`: the data
    parallel gradient of a mean loss. Integer leaves are averaged as `jax.lax.pmean` does
    (into float32). See `psum_in_float32` for making params device-varying first under
    ``shard_map(check_vma=True)``.

    Args:
        tree: a pytree of arrays, typically per-device gradients.
        axis_name: the mapped axis name (or tuple of names) to average over.

    Returns:
        The averaged tree; half-precision leaves become float32.

    Example:
        >>> import jax, jax.numpy as jnp, jaxmp
        >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
        >>> f = jax.shard_map(lambda g: jaxmp.pmean_in_float32(g, "data"), mesh=mesh,
        ...                   in_specs=jax.P("data"), out_specs=jax.P())
        >>> f({"w": jnp.full(2, 3.0, jnp.bfloat16)})
        {'w': Array([3., 3.], dtype=float32)}
    """
    return jax.lax.pmean(casting.widen_to_float32(tree), axis_name)


def _named_sharding(path: Any, leaf: Any, sharding: Any) -> NamedSharding:
    if sharding is None:
        sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        raise TypeError(
            f"`params` leaf {keystr(path) or '<root>'} must carry a NamedSharding (place it with "
            "jax.device_put(x, NamedSharding(mesh, spec)), or pass `shardings`), got "
            f"{type(sharding).__name__ if sharding is not None else None}."
        )
    return sharding


def _strip(spec: PartitionSpec) -> tuple[Any, ...]:
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


def state_shardings(tx: optax.GradientTransformation, params: Any, shardings: Any = None) -> Any:
    """The shardings of ``tx.init(params)``: each state leaf sharded like its param.

    Master weights, optimizer moments and any other state leaf computed from a param get that
    param's `PartitionSpec` (ZeRO / FSDP style: the state is split like the params, not
    replicated); everything else (loss scale, counters, step counts) is replicated. Use it to
    initialise the state where it belongs::

        opt_state = jax.jit(tx.init, out_shardings=jaxmp.state_shardings(tx, params))(params)

    and as ``out_shardings`` of the train step. It is needed on meshes with automatic axes
    (``jax.sharding.Mesh``), where ``jax.jit(tx.init)(params)`` replicates the optimizer
    moments; on meshes with explicit axes (the default of `jax.make_mesh`, used under
    `jax.set_mesh`), ``jax.jit(tx.init)(params)`` already shards them the same way.

    The shardings are found by tracing ``tx.init`` abstractly (no computation, no memory)
    with explicit sharding types, so they follow the data flow rather than shapes or names.

    Args:
        tx: the optax transformation (for example `jaxmp.mixed_precision(...)`).
        params: the params: arrays or `jax.ShapeDtypeStruct` leaves (shapes and dtypes are
            what matter), each carrying a `NamedSharding` on one mesh unless `shardings` is
            given.
        shardings: optional pytree of `NamedSharding` with the structure of `params`, used
            instead of the leaves' own shardings.

    Returns:
        A pytree of `NamedSharding` with the structure of ``tx.init(params)``.

    Raises:
        TypeError: if a param has no `NamedSharding` (the message names the leaf path).
        ValueError: if the params are on different meshes, or `shardings` does not match
            the structure of `params`.

    Example:
        >>> import jax, jax.numpy as jnp, optax, jaxmp
        >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
        >>> mesh = jax.make_mesh((1,), ("model",), axis_types=(AxisType.Auto,))
        >>> params = jax.device_put({"w": jnp.ones((4, 2))}, NamedSharding(mesh, P("model")))
        >>> tx = jaxmp.mixed_precision(optax.adam(1e-3), "mixed_float16")
        >>> out = jaxmp.state_shardings(tx, params)
        >>> tuple(out.inner_state[0].mu["w"].spec), tuple(out.loss_scale.loss_scale.spec)
        (('model',), ())
    """
    return init_shardings(tx.init, params, shardings)


def init_shardings(init: Any, params: Any, shardings: Any = None) -> Any:
    """`state_shardings` of an ``init`` function (`state_shardings` documents the rest)."""
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
    if shardings is None:
        sharding_leaves = [None] * len(leaves_with_path)
    else:
        sharding_leaves, sharding_def = jax.tree_util.tree_flatten(
            shardings, is_leaf=lambda x: isinstance(x, NamedSharding)
        )
        if sharding_def != treedef:  # type: ignore[operator]
            raise ValueError(
                "`shardings` must have the tree structure of `params`, got "
                f"{sharding_def} and {treedef}."
            )
    named = [
        _named_sharding(path, leaf, s)
        for (path, leaf), s in zip(leaves_with_path, sharding_leaves, strict=True)
    ]
    if not named:
        raise ValueError("`params` must hold at least one array, got an empty tree.")
    mesh = named[0].mesh
    for (path, _), s in zip(leaves_with_path, named, strict=True):
        if s.mesh.shape_tuple != mesh.shape_tuple:
            raise ValueError(
                f"`params` must all be on one mesh, got {dict(mesh.shape)} and "
                f"{dict(s.mesh.shape)} at {keystr(path)}."
            )
    # Trace `init` on an abstract copy of the mesh whose axes are all explicit: JAX then
    # carries each array's sharding in its type through every op of `init`.
    explicit = jax.sharding.AbstractMesh(
        tuple(mesh.axis_sizes),
        tuple(mesh.axis_names),
        axis_types=(AxisType.Explicit,) * len(mesh.axis_names),
    )
    abstract = jax.tree.unflatten(
        treedef,
        [
            jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(explicit, s.spec))
            for (_, leaf), s in zip(leaves_with_path, named, strict=True)
        ],
    )
    with jax.sharding.use_abstract_mesh(explicit):
        out = jax.eval_shape(init, abstract)

    # Traced specs spell out trailing unsharded dimensions (P("model", None)); give a leaf
    # sharded like a param that param's own spec object, so that shardings compare equal.
    param_specs: dict[tuple[int, tuple[Any, ...]], PartitionSpec] = {}
    for (_, leaf), s in zip(leaves_with_path, named, strict=True):
        param_specs.setdefault((len(leaf.shape), _strip(s.spec)), s.spec)

    def to_concrete(x: Any) -> NamedSharding:
        sharding = getattr(x, "sharding", None)
        spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
        key = (len(x.shape), _strip(spec))
        return NamedSharding(mesh, param_specs.get(key, PartitionSpec(*key[1])))

    return jax.tree.map(to_concrete, out)
