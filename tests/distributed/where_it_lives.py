"""Optimizer state built, and weights quantised, where sharded params live.

Usage: ``python where_it_lives.py`` with 8 simulated devices (one process), or
``python where_it_lives.py PROCESS_ID PORT`` in each of two processes with 4 devices each (8
in all, on localhost). The params are sharded over a ``data=4, model=2`` mesh of automatic
axes. For each low-memory configuration of `jaxmp.mixed_precision`, ``tx.init(params)`` is
called outside `jax.jit`; for each quantisation recipe, `jaxmp.quantize`; and a weight holding
one NaN is quantised to see the error. Prints one JSON object: per case, whether every output
leaf has the sharding it should (`jaxmp.state_shardings` for the state; the weight's own,
without the contraction axes for the scales, for quantised weights), whether each of this
process's shards equals the same block of the single-device result (computed in this
process), the number of all-gathers in the quantisation's compiled program, and the error.
"""

from __future__ import annotations

import json
import os
import sys

import common  # noqa: F401  (puts the repository on sys.path)
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmp
from jaxmp._src.quantization import leaf as leaf_lib

CONFIGS = {
    "master weights": dict(),
    "stochastic int8": dict(master_weights=False, rounding="stochastic", moments="int8"),
    "kahan fp8": dict(master_weights=False, rounding="kahan", moments="fp8"),
    "nearest bf16": dict(master_weights=False, moments="bfloat16"),
}
RECIPES = ("int8", "int8_dynamic", "fp8", "int4")
SPECS = {"w": P("data", "model"), "v": P("model", None), "b": P("model")}


def host_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w": (rng.normal(size=(1024, 512)) / 32).astype(jnp.bfloat16),
        "v": (rng.normal(size=(512, 128)) / 16).astype(jnp.bfloat16),
        "b": np.zeros(512, jnp.bfloat16),
    }


def model(p, x):
    return jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]


def place(tree: dict[str, np.ndarray], mesh) -> dict[str, jax.Array]:
    """The global arrays of `tree`, each process holding its own blocks (no transfer)."""
    out = {}
    for name, value in tree.items():
        sharding = NamedSharding(mesh, SPECS[name])
        out[name] = jax.make_array_from_callback(value.shape, sharding, lambda i, v=value: v[i])
    return out


def shards_match(actual, expected) -> bool:
    """Whether each of this process's shards of `actual` equals that block of `expected`."""
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        e = np.asarray(e)
        for shard in a.addressable_shards:
            if not np.array_equal(np.asarray(shard.data), e[shard.index], equal_nan=True):
                return False
    return True


def placed_as(arrays, shardings) -> bool:
    """Whether each of `arrays` has the (equivalent) sharding of `shardings`."""
    pairs = zip(jax.tree.leaves(arrays), jax.tree.leaves(shardings), strict=True)
    return all(a.sharding.is_equivalent_to(s, a.ndim) for a, s in pairs)


def main() -> dict:
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    host = host_params()
    params = place(host, mesh)
    one_device = jax.tree.map(jnp.asarray, host)
    x = jnp.ones((4, 1024), jnp.bfloat16)
    out: dict = {"process_count": jax.process_count(), "device_count": jax.device_count()}

    for name, kwargs in CONFIGS.items():
        tx = jaxmp.mixed_precision(optax.adam(1e-3), "p=bf16,c=bf16", **kwargs)
        state = tx.init(params)
        expected = jaxmp.state_shardings(tx, params)
        out[f"init {name}"] = {
            "placed": placed_as(state, expected),
            "values": shards_match(state, tx.init(one_device)),
        }

    for recipe in RECIPES:
        q = jaxmp.quantize(model, params, x, recipe=recipe)
        ref = jaxmp.quantize(model, one_device, x, recipe=recipe)
        w, v = q["w"], q["v"]
        shardings = leaf_lib._output_shardings(params["w"], (0,), w.recipe)
        compiled = leaf_lib.program(params["w"], (0,), w.recipe).lower(params["w"]).compile()
        out[f"quantize {recipe}"] = {
            "placed": placed_as((w.values, w.scales), shardings),
            "values": shards_match((w, v), (ref["w"], ref["v"])),
            "all_gathers": compiled.as_text().count("all-gather"),
        }

    bad = dict(host)
    bad["w"] = host["w"].copy()
    bad["w"][200, 300] = np.nan
    try:
        jaxmp.quantize(model, place(bad, mesh), x, recipe="int8")
        out["nan error"] = None
    except ValueError as e:
        out["nan error"] = str(e)
    return out


def placements() -> dict:
    """One process of 8 devices: params placed in the other ways users place them, each
    `init` placed where its params are (or as op by op places it), its values the
    one-device init's."""
    devices = jax.devices()
    out = {}
    host = host_params()
    one_device = jax.tree.map(jnp.asarray, host)
    tx = jaxmp.mixed_precision(
        optax.adam(1e-3), "p=bf16,c=bf16", master_weights=False, moments="int8"
    )
    expected = tx.init(one_device)

    def check(name, params, where, tx=tx, expected=expected):
        state = tx.init(params)
        out[name] = {
            "values": shards_match(state, expected),
            "placed": all(where(x.sharding) for x in jax.tree.leaves(state) if x.ndim),
        }

    # A mesh of explicit axes (jax.make_mesh's default), the init called outside set_mesh.
    explicit = jax.make_mesh((8,), ("model",), axis_types=(AxisType.Explicit,))
    params = jax.device_put(host, NamedSharding(explicit, P("model")))
    master = jaxmp.mixed_precision(optax.adam(1e-3), "p=bf16,c=bf16")
    check(
        "explicit mesh",
        params,
        lambda s: len(s.device_set) == 8,
        master,
        master.init(one_device),
    )
    # Every param on device 3.
    params = jax.device_put(host, devices[3])
    check("device 3", params, lambda s: s.device_set == {devices[3]})
    # The same 8 devices in another order: two meshes.
    a = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    b = jax.sharding.Mesh(np.asarray(devices[::-1]), ("x",))
    params = {
        "w": jax.device_put(host["w"], NamedSharding(a, P("x"))),
        "v": jax.device_put(host["v"], NamedSharding(b, P("x"))),
        "b": jax.device_put(host["b"], NamedSharding(a, P("x"))),
    }
    check("two meshes", params, lambda s: len(s.device_set) == 8, master, master.init(one_device))
    # A small leaf split 8 ways (a 512-value bias: one 8-bit block of 256 per 2 devices).
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    params = jax.device_put(host, NamedSharding(mesh, P("x")))
    check("small leaf split 8 ways", params, lambda s: len(s.device_set) == 8)
    return out


if __name__ == "__main__":
    if len(sys.argv) == 3:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{sys.argv[2]}",
            num_processes=2,
            process_id=int(sys.argv[1]),
            initialization_timeout=60,
        )
    result = main()
    if len(sys.argv) != 3:
        result["placements"] = placements()
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (json.dumps(result, sort_keys=True) + "\n").encode())
    if len(sys.argv) == 3:
        jax.distributed.shutdown()
