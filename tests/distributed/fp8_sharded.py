"""FP8 on 8 devices: every device takes the same scaling decision.

Usage: ``python fp8_sharded.py`` with 8 simulated devices. Two multi-device paths:

* ``jax.shard_map`` data parallel: each device holds 1/8 of the batch and calls the FP8
  function on it; the amaxes are reduced over the mesh axis the batch varies along, so the
  delayed-scaling state each device computes is the same, and its amaxes are those of the
  whole batch.
* ``jax.jit`` over a batch sharded on the mesh (the main job's path): the amax reductions are
  global, and outputs, gradients and the next state equal those of one device.

Prints one JSON object.
"""

from __future__ import annotations

import json
import pathlib
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxmp  # noqa: E402


def mlp(params, x):
    h = jax.nn.gelu(x @ params["w1"])
    return h @ params["w2"]


def main() -> None:
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.standard_normal((32, 64)) / 6, jnp.float32),
        "w2": jnp.asarray(rng.standard_normal((64, 16)) / 8, jnp.float32),
    }
    # Examples of very different magnitudes, so that each device's local amax differs.
    x = rng.standard_normal((8 * n, 32)) * np.repeat(2.0 ** np.arange(n), 8)[:, None]
    x = jnp.asarray(x, jnp.float32)
    c = jnp.asarray(rng.standard_normal((8 * n, 16)), jnp.float32)
    recipe = jaxmp.DelayedScaling(history_len=4)
    f = jaxmp.autocast(mlp, "mixed_bfloat16", fp8=recipe)
    state = f.fp8_init(params, x[:8])

    def local_loss(params, state, x, c):
        return jnp.sum(f.with_fp8_state(state)(params, x) * c)

    # shard_map, data parallel: the params and state replicated, the batch split.
    def per_device(params, state, x, c):
        params = jax.lax.pcast(params, "data", to="varying")
        _, new_state = jax.grad(local_loss, (0, 1))(params, state, x, c)
        # Stack each device's state to compare them outside.
        return jax.tree.map(lambda a: a[None], new_state)

    states = jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(P(), P(), P("data"), P("data")),
            out_specs=P("data"),
        )
    )(params, state, x, c)
    leaves = jax.tree.leaves(states)
    states_equal = all(bool(np.all(np.asarray(a) == np.asarray(a)[:1])) for a in leaves)
    first = list(states.amax_history)[0]
    amax_x = float(np.asarray(states.amax_history[first])[0, 0, -1])  # rolled to the end
    global_amax = float(jnp.max(jnp.abs(x.astype(jnp.bfloat16).astype(jnp.float32))))

    # jit over a sharded batch against one device.
    one = jax.jit(jax.value_and_grad(local_loss, (0, 1)))
    sharded_x = jax.device_put(x, NamedSharding(mesh, P("data")))
    sharded_c = jax.device_put(c, NamedSharding(mesh, P("data")))
    (loss_1, (_, state_1)) = one(params, state, x, c)
    (loss_n, (_, state_n)) = one(params, state, sharded_x, sharded_c)
    state_equal = all(
        bool(np.array_equal(a, b))
        for a, b in zip(jax.tree.leaves(state_1), jax.tree.leaves(state_n), strict=True)
    )
    # Current scaling computed in float32 (the products' dtype), so that XLA has no
    # half-precision rounding it may skip in one program and not the other: equal outputs
    # mean equal scales. The rows are scaled by 1.5**device, so that a scale from each
    # device's own amax would differ from the global one by more than a power of two.
    g = jaxmp.autocast(mlp, "float32", fp8=jaxmp.Float8CurrentScaling())
    rows = jnp.asarray(np.repeat(1.5 ** np.arange(n), 8)[:, None], jnp.float32)
    out_1 = jax.jit(g)(params, x * rows)
    out_n = jax.jit(g)(params, jax.device_put(x * rows, NamedSharding(mesh, P("data"))))
    print(
        json.dumps(
            {
                "devices": n,
                "shard_map_states_equal": states_equal,
                "shard_map_amax_is_global": amax_x == global_amax,
                "jit_state_equal_to_one_device": state_equal,
                "jit_loss_relative_diff": abs(float(loss_1) - float(loss_n))
                / max(abs(float(loss_1)), 1.0),
                "current_scaling_outputs_equal": bool(np.array_equal(out_1, out_n)),
            }
        )
    )


if __name__ == "__main__":
    main()
