"""One process of a two-process data-parallel run of the example transformer LM on localhost.

Usage: ``python multiprocess_worker.py PROCESS_ID PORT NAN_PROCESS`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (4 CPU devices per process, 8 in all).
Both processes train `STEPS` steps on the same global batches (each feeds its own half), then
take one step where process NAN_PROCESS alone has a NaN in its half of the batch. Prints one
JSON object on a line of its own: digests of this process's own copies of the params and
optimizer state before and after that step, the loss scale and the skipped-step count.
"""

from __future__ import annotations

import json
import os
import sys

import common
import jax
import numpy as np

import jaxmp
from examples import sharding

STEPS = 2
NUM_PROCESSES = 2


def local_digest(tree) -> str:
    """Digest of this process's first local copy of every (replicated) leaf."""
    leaves = jax.tree.leaves(tree)
    for leaf in leaves:
        copies = {np.asarray(s.data).tobytes() for s in leaf.addressable_shards}
        if len(copies) != 1:
            raise AssertionError("the local copies of a replicated leaf differ")
    return common.tree_digest([np.asarray(leaf.addressable_shards[0].data) for leaf in leaves])


def emit_line(result: dict) -> None:
    """Prints `result` as one JSON line in a single write.

    Both processes usually share a terminal (``python ... 0 & python ... 1``): a line written
    in pieces could run into the other process's. One ``write`` of a whole line of at most
    ``PIPE_BUF`` bytes (4096 on Linux) is never interleaved with another.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(sys.stdout.fileno(), (json.dumps(result, sort_keys=True) + "\n").encode())


def main(process_id: int, port: int, nan_process: int) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=NUM_PROCESSES,
        process_id=process_id,
        initialization_timeout=60,
    )
    policy = jaxmp.get_policy("p=f16,c=f16,o=f32")
    model = common.make_model(policy, "transformer")
    tx = common.make_optimizer(policy)
    params, opt_state = common.init(policy, tx, "transformer")
    mesh = sharding.make_mesh("data=8")
    params, opt_state, p_sh, s_sh = sharding.shard_params_and_state(tx, params, opt_state, mesh)
    step = jax.jit(
        common.make_train_step(model, tx),
        in_shardings=(p_sh, s_sh, sharding.batch_sharding(mesh)),
        out_shardings=(p_sh, s_sh, None),
    )
    rows = common.BATCH // NUM_PROCESSES
    own = slice(process_id * rows, (process_id + 1) * rows)

    def local_batch(i: int) -> dict:
        return {k: v[own] for k, v in common.batch(i).items()}

    losses = []
    for i in range(STEPS):
        params, opt_state, metrics = step(
            params, opt_state, sharding.shard_batch(local_batch(i), mesh)
        )
        losses.append(float(np.asarray(metrics["loss"].addressable_shards[0].data)))
    before = local_digest((params, opt_state.inner_state))
    scale_before = float(np.asarray(opt_state.loss_scale.loss_scale.addressable_shards[0].data))
    batch = local_batch(STEPS)
    if process_id == nan_process:
        batch["weights"][1] = np.nan
    params, opt_state, metrics = step(params, opt_state, sharding.shard_batch(batch, mesh))

    def local(x) -> float:
        return np.asarray(x.addressable_shards[0].data).item()

    emit_line(
        {
            "process_index": jax.process_index(),
            "device_count": jax.device_count(),
            "local_device_count": jax.local_device_count(),
            "losses": losses,
            "digest_before_nan_step": before,
            "digest_after_nan_step": local_digest((params, opt_state.inner_state)),
            "state_digest": local_digest(opt_state),
            "loss_scale_before": scale_before,
            "loss_scale": local(opt_state.loss_scale.loss_scale),
            "skipped_steps": int(local(opt_state.skipped_steps)),
            "grads_finite": bool(local(opt_state.grads_finite)),
        }
    )
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
