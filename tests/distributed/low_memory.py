"""Low-memory training on a mesh: replicas round alike, compressed state sharded like params.

Usage: ``python low_memory.py`` with 8 simulated devices. For each low-memory mode (bfloat16
params without a master copy: stochastic rounding with bfloat16 or 8-bit moments, Kahan
summation), trains `STEPS` steps of the MLP language model on one device and under `jax.jit` on
two meshes (data parallel, and data=4,model=2 with the params and the state split), with the
state placed by `jaxmp.state_shardings`; then a data-parallel `shard_map` step. Prints one
JSON object: per run, the losses, whether every replica of every param is bit-identical across
devices, whether every state leaf shaped like a param is sharded like it, whether the PRNG key
is replicated, and the largest difference of the params from the single-device run and the
fraction of params that differ from it at all.

``python low_memory.py sharded_updates`` runs `shard_map_update_follows_one_device` alone, for
each of `SHARDED_UPDATES`: updates inside `shard_map`, each device holding a block of every
param, against one device's, with and without `param_specs`.
"""

from __future__ import annotations

import functools
import sys

import common
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmp
from examples import sharding

STEPS = 3
POLICY = jaxmp.get_policy("p=bf16,c=bf16,o=f32")
MODES = {
    "stochastic_bf16": dict(rounding="stochastic", moments="bf16"),
    "stochastic_8bit": dict(rounding="stochastic", moments=("int8", "fp8")),
    "kahan": dict(rounding="kahan", moments="bf16"),
}
MESHES = (None, "data=8", "data=4,model=2")


def make_optimizer(mode: str) -> optax.GradientTransformationExtraArgs:
    return jaxmp.mixed_precision(optax.adam(1e-2), POLICY, master_weights=False, **MODES[mode])


def replicas_agree(tree) -> bool:
    """Whether every device's copy of each part of every array is bit-identical."""
    for leaf in jax.tree.leaves(tree):
        by_index: dict[str, np.ndarray] = {}
        for shard in leaf.addressable_shards:
            data = np.asarray(shard.data)
            key = str(shard.index)
            if key in by_index and not np.array_equal(by_index[key], data, equal_nan=True):
                return False
            by_index.setdefault(key, data)
    return True


def state_follows_params(params, p_shardings, s_shardings, opt_state) -> bool:
    """Every state leaf with a param's shape (other than a scalar) has that param's spec."""
    specs = {}
    for p, s in zip(jax.tree.leaves(params), jax.tree.leaves(p_shardings), strict=True):
        specs.setdefault(np.shape(p), set()).add(s.spec)
    ok = True
    for leaf, sh in zip(jax.tree.leaves(opt_state), jax.tree.leaves(s_shardings), strict=True):
        if np.ndim(leaf) and np.shape(leaf) in specs:
            ok &= len(specs[np.shape(leaf)]) != 1 or sh.spec in specs[np.shape(leaf)]
            ok &= leaf.sharding.spec == sh.spec
    return bool(ok)


def run(mode: str, mesh_spec: str | None) -> dict:
    model = common.make_model(POLICY, "mlp")
    tx = make_optimizer(mode)
    params, opt_state = common.init(POLICY, tx, "mlp")
    step = common.make_train_step(model, tx)
    out: dict = {}
    if mesh_spec is None:
        step_fn = jax.jit(step)

        def put_batch(b):
            return b
    else:
        mesh = sharding.make_mesh(mesh_spec)
        params, opt_state, p_sh, s_sh = sharding.shard_params_and_state(tx, params, opt_state, mesh)
        step_fn = jax.jit(
            step,
            in_shardings=(p_sh, s_sh, sharding.batch_sharding(mesh)),
            out_shardings=(p_sh, s_sh, NamedSharding(mesh, P())),
        )
        out["state_follows_params"] = state_follows_params(params, p_sh, s_sh, opt_state)
        keys = [
            leaf.sharding.spec
            for leaf in jax.tree.leaves(opt_state)
            if leaf.dtype == jnp.uint32 and leaf.shape == (2,)
        ]
        out["keys_replicated"] = bool(keys) and all(spec == P() for spec in keys)

        def put_batch(b):
            return sharding.shard_batch(b, mesh)

    losses = []
    for i in range(STEPS):
        params, opt_state, metrics = step_fn(params, opt_state, put_batch(common.batch(i)))
        losses.append(float(metrics["loss"]))
    out["losses"] = losses
    out["replicas_agree"] = replicas_agree((params, opt_state))
    out["param_dtypes"] = sorted({str(x.dtype) for x in jax.tree.leaves(params)})
    out["params"] = jax.tree.map(lambda x: np.asarray(jax.device_get(x), np.float64), params)
    return out


def shard_map_data_parallel(mode: str) -> dict:
    """Per-device gradients averaged in float32; each device updates its own copy."""
    mesh = sharding.make_mesh("data=8")
    model = common.make_model(POLICY, "mlp")
    tx = jaxmp.mixed_precision(
        optax.adam(1e-2), POLICY, master_weights=False, axis_name="data", **MODES[mode]
    )
    params, opt_state = common.init(POLICY, tx, "mlp")
    loss_fn = common.make_loss_fn(model)
    stack = functools.partial(jax.tree.map, lambda x: x[None])

    # check_vma=False so that each device's copy can be gathered and compared.
    @jax.jit
    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P(), P(), P("data")),
        out_specs=(P("data"), P("data")),
        check_vma=False,
    )
    def step(params, opt_state, batch):
        scale = jaxmp.get_loss_scale(opt_state)
        _, grads = jaxmp.value_and_grad(loss_fn)(scale, params, batch)
        grads = jaxmp.pmean_in_float32(grads, "data")
        updates, opt_state = tx.update(grads, opt_state, params)
        return stack(optax.apply_updates(params, updates)), stack(opt_state)

    per_device, states = step(params, opt_state, common.batch(0))
    leaves = jax.tree.leaves((per_device, states))
    same = all(np.array_equal(x[0], x[i], equal_nan=True) for x in leaves for i in range(8))
    moved = any(
        not np.array_equal(np.asarray(a[0]), np.asarray(b))
        for a, b in zip(jax.tree.leaves(per_device), jax.tree.leaves(params), strict=True)
    )
    return {"devices_agree": bool(same), "params_moved": bool(moved)}


def rounding_follows_one_device(mesh_spec: str) -> bool:
    """Whether stochastic rounding of a sharded array draws the single-device bits."""
    x = jax.random.normal(jax.random.key(0), (64, 48), jnp.float32) * 3.0
    key = jax.random.key(7)
    single = jax.jit(lambda v, k: jaxmp.stochastic_round(v, jnp.bfloat16, k))(x, key)
    mesh = sharding.make_mesh(mesh_spec)
    spec = P(*mesh.axis_names)
    sharded = jax.jit(
        lambda v, k: jaxmp.stochastic_round(v, jnp.bfloat16, k),
        out_shardings=NamedSharding(mesh, spec),
    )(jax.device_put(x, NamedSharding(mesh, spec)), key)
    return bool(np.array_equal(np.asarray(single), np.asarray(sharded)))


# Inside shard_map, params split over the mesh: (mesh, the params' spec, moment formats).
SHARDED_UPDATES = {
    "data=8|rows|int8": ("data=8", P("data"), ("int8", "fp8")),
    "data=4,model=2|both|bf16": ("data=4,model=2", P("data", "model"), "bf16"),
    "data=4,model=2|columns|bf16": ("data=4,model=2", P(None, ("data", "model")), "bf16"),
}


def shard_map_update_follows_one_device(name: str) -> dict:
    """Whether an update inside `shard_map`, each device holding a block of every param, gives
    the params and compressed moments of the same update on one device, bit for bit.

    Stochastic rounding of the params and of the moments, with `param_specs` (each element's
    random bits from its index in the whole param) and without (from its index in the block:
    every block rounds alike, the result differs).
    """
    mesh_spec, spec, moments = SHARDED_UPDATES[name]
    mesh = sharding.make_mesh(mesh_spec)
    rng = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rng.normal(size=(64, 48)), jnp.bfloat16),
        "b": jnp.asarray(rng.normal(size=(64,)), jnp.bfloat16),
    }
    # A vector split over the mesh: its 8-bit blocks are reshaped along the split dimension,
    # which `jaxmp.state_shardings` cannot trace on an explicit mesh; such a vector is kept whole.
    specs = {"w": spec, "b": P(spec[0]) if moments == "bf16" else P()}
    grads = [
        jax.tree.map(lambda p, i=i: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
        for i in range(3)
    ]

    def run(tx, sharded: bool):
        state = jax.jit(tx.init)(params)

        def step(params, state, grads):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        if sharded:
            state_specs = jax.tree.map(
                lambda s: s.spec,
                jaxmp.state_shardings(
                    tx, params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
                ),
            )
            step = jax.shard_map(
                step,
                mesh=mesh,
                in_specs=(specs, state_specs, specs),
                out_specs=(specs, state_specs),
                check_vma=False,
            )
        step = jax.jit(step)
        p = params
        for g in grads:
            p, state = step(p, state, g)
        return jax.device_get((p, state))

    def make(param_specs):
        return jaxmp.mixed_precision(
            optax.adam(1e-2), POLICY, master_weights=False, rounding="stochastic",
            moments=moments, param_specs=param_specs,
        )  # fmt: skip

    single = run(make(None), sharded=False)

    def same(out) -> bool:
        pairs = zip(jax.tree.leaves(out), jax.tree.leaves(single), strict=True)
        return all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs)

    with_specs = run(make(specs), sharded=True)
    without = run(make(None), sharded=True)
    return {
        "with_param_specs": same(with_specs),
        "without_param_specs": same(without),
        "params_moved": not np.array_equal(
            np.asarray(with_specs[0]["w"], np.float32), np.asarray(params["w"], np.float32)
        ),
    }


def main() -> None:
    if sys.argv[1:] == ["sharded_updates"]:
        common.emit({name: shard_map_update_follows_one_device(name) for name in SHARDED_UPDATES})
        return
    result: dict = {"device_count": jax.device_count(), "runs": {}, "shard_map": {}}
    result["rounding_follows_one_device"] = {
        spec: rounding_follows_one_device(spec) for spec in MESHES if spec is not None
    }
    for mode in MODES:
        single = None
        for mesh_spec in MESHES:
            out = run(mode, mesh_spec)
            params = out.pop("params")
            if mesh_spec is None:
                single = params
            else:
                a = np.concatenate(
                    [np.ravel(x).astype(np.float32) for x in jax.tree.leaves(params)]
                )
                b = np.concatenate(
                    [np.ravel(x).astype(np.float32) for x in jax.tree.leaves(single)]
                )
                out["max_param_difference"] = float(np.max(np.abs(a - b)))
                out["fraction_of_params_differing"] = float(np.mean(a != b))
            result["runs"][f"{mode}_{mesh_spec or 'single'}"] = out
        result["shard_map"][mode] = shard_map_data_parallel(mode)
    common.emit(result)


if __name__ == "__main__":
    main()
