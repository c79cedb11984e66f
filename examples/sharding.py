"""Meshes and shardings for training the example models on several devices.

A mesh is written ``NAME=SIZE[,NAME=SIZE...]`` with sizes multiplying to the number of devices,
for example ``data=8`` (data parallel) or ``data=4,model=2``. The axis names mean:

* ``data``: the batch is split along it; params are replicated along it;
* ``model`` (or ``fsdp``): params, FP32 master weights and optimizer moments are split along it,
  ZeRO-3 / FSDP style (each param along its largest dimension that divides evenly; small
  params stay replicated), and XLA gathers each param where the forward and backward passes
  need it. The batch is split along it too, so every device works on its own examples.

So ``data=8`` is plain data parallelism, ``model=8`` fully sharded data parallelism, and
``data=4,model=2`` the hybrid: params sharded over pairs of devices, replicated over the four
pairs. The optimizer state follows the params through `jaxmp.state_shardings`.

Try it on a CPU, with 8 simulated devices::

    export XLA_FLAGS=--xla_force_host_platform_device_count=8
    python examples/train.py --mesh data=4,model=2
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import jaxmp

DATA_AXIS = "data"
#: Axes that params are sharded along (either name; both may be used together).
PARAM_AXES = ("fsdp", "model")
VALID_AXES = (DATA_AXIS, *PARAM_AXES)
#: Params with fewer elements than this stay replicated (biases, LayerNorm scales): sharding
#: them saves almost no memory and costs a collective each.
MIN_SHARDED_SIZE = 1024

_FORM = (
    "NAME=SIZE[,NAME=SIZE...] with NAME in {names} (each at most once), "
    "e.g. 'data=8' or 'data=4,model=2'"
)


def _form() -> str:
    return _FORM.format(names=", ".join(VALID_AXES))


def parse_mesh(spec: str, device_count: int | None = None) -> dict[str, int]:
    """Parses a mesh spec such as ``"data=4,model=2"`` into ``{"data": 4, "model": 2}``.

    Args:
        spec: ``NAME=SIZE[,NAME=SIZE...]``; spaces are ignored.
        device_count: the number of devices the sizes must multiply to; default
            ``jax.device_count()`` (all devices of all processes).

    Returns:
        The axis sizes, in the order given.

    Raises:
        ValueError: naming ``mesh`` and the valid form, for an unknown or repeated name, a
            size that is not a positive integer, or sizes whose product is not the device
            count.
    """
    if not isinstance(spec, str):
        raise TypeError(f"`mesh` must be a string of the form {_form()}, got {spec!r}.")
    if device_count is None:
        device_count = jax.device_count()
    axes: dict[str, int] = {}
    for part in spec.replace(" ", "").split(","):
        name, sep, size = part.partition("=")
        if not sep or not name:
            raise ValueError(f"`mesh` must be of the form {_form()}, got {spec!r}.")
        if name not in VALID_AXES:
            raise ValueError(
                f"`mesh` has unknown axis name {name!r} in {spec!r}; valid names are "
                f"{', '.join(repr(n) for n in VALID_AXES)}."
            )
        if name in axes:
            raise ValueError(f"`mesh` names axis {name!r} twice in {spec!r}; use each once.")
        if not re.fullmatch(r"[0-9]+", size) or int(size) < 1:
            raise ValueError(
                f"`mesh` axis {name!r} must have a positive integer size, got {size!r} in {spec!r}."
            )
        axes[name] = int(size)
    if math.prod(axes.values()) != device_count:
        raise ValueError(
            f"`mesh` sizes must multiply to the device count ({device_count}), got {spec!r} "
            f"(product {math.prod(axes.values())}); the form is {_form()}."
        )
    return axes


def make_mesh(spec: str | Mapping[str, int], devices: Sequence[Any] | None = None) -> Mesh:
    """A `Mesh` with automatic axes (XLA places the collectives) from a spec or a dict.

    Args:
        spec: a string for `parse_mesh`, or a dict of axis sizes.
        devices: the devices to use; default all (of every process).
    """
    devices = list(jax.devices() if devices is None else devices)
    axes = parse_mesh(spec, len(devices)) if isinstance(spec, str) else dict(spec)
    if isinstance(spec, Mapping):
        # Validate a dict through the same rules as a string.
        parse_mesh(",".join(f"{k}={v}" for k, v in axes.items()), len(devices))
    return jax.make_mesh(
        tuple(axes.values()),
        tuple(axes),
        axis_types=(AxisType.Auto,) * len(axes),
        devices=devices,
    )


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes the batch dimension is split along: every axis of the mesh."""
    return tuple(name for name in mesh.axis_names if name in VALID_AXES)


def param_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes params are split along (``fsdp``, ``model``), those of size > 1."""
    return tuple(name for name in PARAM_AXES if mesh.shape.get(name, 1) > 1)


def data_parallel_shardings(params: Any, mesh: Mesh) -> Any:
    """Every param replicated on every device of `mesh` (a tree of `NamedSharding`)."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda _: replicated, params)


def _fsdp_spec(shape: Sequence[int], axes: tuple[str, ...], shards: int, min_size: int):
    if not axes or math.prod(shape) < min_size:
        return PartitionSpec()
    # The largest dimension that splits evenly (the first of equal ones).
    candidates = [(size, -i) for i, size in enumerate(shape) if size % shards == 0]
    if not candidates:
        return PartitionSpec()
    dim = -max(candidates)[1]
    entries: list[Any] = [None] * len(shape)
    entries[dim] = axes[0] if len(axes) == 1 else axes
    return PartitionSpec(*entries)


def fsdp_shardings(params: Any, mesh: Mesh, min_size: int = MIN_SHARDED_SIZE) -> Any:
    """Params split along the mesh's ``fsdp``/``model`` axes, ZeRO-3 / FSDP style.

    Each param with at least `min_size` elements is split along its largest dimension that the
    number of shards divides; the others are replicated. With no such axis (``data=8``), this
    is `data_parallel_shardings`.

    Args:
        params: a pytree of arrays or `jax.ShapeDtypeStruct` (only shapes are read).
        mesh: the mesh.
        min_size: params smaller than this stay replicated.
    """
    axes = param_axes(mesh)
    shards = math.prod(mesh.shape[a] for a in axes)
    return jax.tree.map(
        lambda x: NamedSharding(mesh, _fsdp_spec(np.shape(x), axes, shards, min_size)), params
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension split over every axis of `mesh`, other dimensions whole."""
    return NamedSharding(mesh, PartitionSpec(batch_axes(mesh)))


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """Places a batch (a pytree of arrays) on `mesh`, split along the leading dimension.

    With several processes, each passes its own part of the global batch (its rows, in
    process order) and gets the global arrays back.

    Raises:
        ValueError: if a leaf's leading dimension does not divide evenly into the batch shards
            of this process.
    """
    sharding = batch_sharding(mesh)
    shards = math.prod(mesh.shape[a] for a in batch_axes(mesh))
    local_shards = shards // jax.process_count()

    def put(path: Any, x: Any) -> jax.Array:
        rows = np.shape(x)[0] if np.ndim(x) else None
        if rows is None or rows % local_shards:
            raise ValueError(
                f"`batch` leaf {jax.tree_util.keystr(path) or '<root>'} must have a leading "
                f"dimension divisible by {local_shards} (the batch shards of this process on "
                f"mesh {dict(mesh.shape)}), got shape {np.shape(x)}."
            )
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        return jax.make_array_from_process_local_data(sharding, np.asarray(x))

    return jax.tree_util.tree_map_with_path(put, batch)


def param_shardings(params: Any, mesh: Mesh) -> Any:
    """`fsdp_shardings` when the mesh has a param axis of size > 1, else data parallel."""
    if param_axes(mesh):
        return fsdp_shardings(params, mesh)
    return data_parallel_shardings(params, mesh)


def shard_params_and_state(
    tx: optax.GradientTransformation, params: Any, opt_state: Any, mesh: Mesh
) -> tuple[Any, Any, Any, Any]:
    """Moves params and optimizer state onto `mesh`; returns them and their shardings.

    The state's master weights and moments are sharded like their params
    (`jaxmp.state_shardings`); loss scale and counters are replicated.

    Returns:
        ``(params, opt_state, params_shardings, state_shardings)``.
    """
    p_shardings = param_shardings(params, mesh)
    s_shardings = jaxmp.state_shardings(tx, params, p_shardings)
    return put(params, p_shardings), put(opt_state, s_shardings), p_shardings, s_shardings


def put(tree: Any, shardings: Any) -> Any:
    """`jax.device_put` that also works across processes (each holding the whole `tree`)."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def one(x: Any, sharding: NamedSharding) -> jax.Array:
        value = np.asarray(x)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    return jax.tree.map(one, tree, shardings)


def value_and_grad_reduced_in_float32(fun: Any, mesh: Mesh) -> Any:
    """`jaxmp.value_and_grad` whose cross-device gradient sum runs in float32 under `jax.jit`.

    Under `jax.jit` with a sharded batch, XLA sums the per-device gradients where the backward
    pass produces them, in the compute dtype: a float16 or bfloat16 all-reduce (JAX issue
    #27496). Here the batch is split into one slice per batch shard, the gradients of each
    slice are computed separately (`jax.vmap`, each slice on its own devices, no reduction),
    cast to float32 and only then averaged, so the all-reduce runs in float32, at twice the
    bytes. `fun` must return the mean loss over its batch (the slices are equal in size, so
    the mean of their gradients is the gradient of the whole batch's mean).

    Args:
        fun: ``fun(params, batch) -> scalar mean loss``; `batch` is a pytree of arrays whose
            leading dimension is the batch.
        mesh: the mesh the batch is sharded on (`batch_sharding`).

    Returns:
        ``g(loss_scale, params, batch) -> (loss, grads)`` like ``jaxmp.value_and_grad(fun)``,
        with float32 gradients.
    """
    shards = math.prod(mesh.shape[a] for a in batch_axes(mesh))
    per_slice = jax.vmap(jaxmp.value_and_grad(fun), in_axes=(None, None, 0))
    split_sharding = NamedSharding(mesh, PartitionSpec(batch_axes(mesh)))

    def g(loss_scale: Any, params: Any, batch: Any) -> tuple[jax.Array, Any]:
        def split(x: jax.Array) -> jax.Array:
            x = x.reshape(shards, x.shape[0] // shards, *x.shape[1:])
            return jax.lax.with_sharding_constraint(x, split_sharding)

        losses, grads = per_slice(loss_scale, params, jax.tree.map(split, batch))
        grads = jax.tree.map(lambda x: x.astype(np.float32).mean(0), grads)
        return losses.mean(), grads

    return g


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding of a value every device holds whole (scalars, metrics)."""
    return NamedSharding(mesh, PartitionSpec())


def shard_train_state(tx: optax.GradientTransformation, state: Any, mesh: Mesh) -> tuple[Any, Any]:
    """Places a train state (a NamedTuple with ``params`` and ``opt_state``) on `mesh`.

    Params follow `param_shardings`, the optimizer state `jaxmp.state_shardings` (sharded like
    the params), every other field is replicated.

    Returns:
        ``(state, shardings)``; pass ``shardings`` as the state's ``out_shardings`` of the
        jitted train step so that every step returns the state laid out the same way.
    """
    params, opt_state, p_sh, s_sh = shard_params_and_state(tx, state.params, state.opt_state, mesh)
    rest = {name: replicated(mesh) for name in state._fields if name not in ("params", "opt_state")}
    shardings = state._replace(params=p_sh, opt_state=s_sh, **rest)
    placed = state._replace(
        params=params,
        opt_state=opt_state,
        **{name: put(getattr(state, name), s) for name, s in rest.items()},
    )
    return placed, shardings
