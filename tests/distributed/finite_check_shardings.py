"""The finiteness check of same-shape leaves sharded differently: no data moves, no error.

Usage: ``python finite_check_shardings.py`` with 8 simulated devices. Sixteen 256x256
leaves, half split by rows and half by columns over an 8-device "model" axis (as the query
and output projections of a tensor-parallel layer are), through a jitted
`jaxmp.loss_scaling(optax.adam)` update: once on a mesh whose axis the compiler shards
(``Auto``), once on an ``Explicit`` one (``jax.set_mesh``). Prints one JSON object: the
collectives of the compiled Auto update by kind; whether the Explicit update skipped a step
with one inf, kept the params then, moved every param on a finite step and kept their specs.
"""

from __future__ import annotations

import re

import common
import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmp

LEAVES = 16
COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "collective-permute", "reduce-scatter")


def tree(mesh):
    specs = {f"w{i}": P("model", None) if i % 2 == 0 else P(None, "model") for i in range(LEAVES)}
    params = {k: jnp.ones((256, 256)) for k in specs}
    return jax.device_put(params, {k: NamedSharding(mesh, s) for k, s in specs.items()})


def step(tx, grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def collectives_of_auto_update() -> dict[str, int]:
    mesh = jax.make_mesh((8,), ("model",), axis_types=(AxisType.Auto,))
    params = tree(mesh)
    tx = jaxmp.loss_scaling(optax.adam(1e-3))
    state = jax.jit(tx.init)(params)
    text = jax.jit(lambda g, s, p: step(tx, g, s, p)).lower(params, state, params).compile()
    text = text.as_text()
    return {op: len(re.findall(rf"\b{op}(-start)?\(", text)) for op in COLLECTIVES}


def explicit_update() -> dict[str, bool]:
    mesh = jax.make_mesh((8,), ("model",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        params = tree(mesh)
        tx = jaxmp.loss_scaling(optax.adam(1e-3))
        state = jax.jit(tx.init)(params)
        one = (jnp.arange(256)[:, None] == 5) & (jnp.arange(256)[None, :] == 7)
        grads = dict(params, w3=jnp.where(one, jnp.inf, params["w3"]))
        update = jax.jit(lambda g, s, p: step(tx, g, s, p))
        kept, state = update(grads, state, params)
        skipped = not bool(jaxmp.loss_scale_metrics(state)["grads_finite"])
        moved, state = update(params, state, params)
        return {
            "skipped": skipped,
            "params_kept": all(bool((kept[k] == params[k]).all()) for k in params),
            "finite_step_moved_every_leaf": all(
                bool((moved[k] != params[k]).all()) for k in params
            ),
            "specs_kept": all(moved[k].sharding.spec == params[k].sharding.spec for k in params),
        }


def main() -> None:
    common.emit({"auto": collectives_of_auto_update(), "explicit": explicit_update()})


if __name__ == "__main__":
    main()
