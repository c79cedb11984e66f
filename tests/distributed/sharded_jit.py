"""`jax.jit` with a mesh: data parallel and fully sharded training match one device.

Usage: ``python sharded_jit.py OUTDIR`` with 8 simulated devices. Each run trains `STEPS`
steps with the same global batches, on one device or on a mesh, saves its final params as
``OUTDIR/<model>_<policy>_<mesh>.npz`` and reports its losses, loss scales, skipped steps,
whether every state leaf is sharded like its param, the per-device optimizer-state bytes and
the compiled step's argument bytes. The fully sharded transformer run then takes a step with a
NaN in one example (on one device). Prints one JSON object.
"""

from __future__ import annotations

import pathlib
import sys

import common
import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import jaxmp
from examples import sharding

STEPS = 3
POLICIES = {"f32": "f32", "mixed_bfloat16": "mixed_bfloat16", "f16": "p=f16,c=f16,o=f32"}
# (model, policy, mesh); mesh None is the single-device reference.
RUNS = [
    *(
        ("mlp", policy, mesh)
        for policy in POLICIES
        for mesh in (None, "data=8", "data=4,model=2")
        if (policy, mesh) != ("mixed_bfloat16", "data=4,model=2")
    ),
    ("mlp", "f16", "model=8"),
    ("transformer", "f16", None),
    ("transformer", "f16", "data=4,model=2"),
]


def strip(spec: PartitionSpec) -> tuple:
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


def run(kind: str, policy_name: str, mesh_spec: str | None, outdir: pathlib.Path) -> dict:
    policy = jaxmp.get_policy(POLICIES[policy_name])
    model = common.make_model(policy, kind)
    tx = common.make_optimizer(policy)
    params, opt_state = common.init(policy, tx, kind)
    step = common.make_train_step(model, tx)
    if mesh_spec is None:
        device = jax.devices()[0]
        params, opt_state = jax.device_put((params, opt_state), device)
        step_fn = jax.jit(step, donate_argnums=(0, 1))

        def put_batch(b):
            return jax.device_put(b, device)
    else:
        mesh = sharding.make_mesh(mesh_spec)
        params, opt_state, p_sh, s_sh = sharding.shard_params_and_state(tx, params, opt_state, mesh)
        step_fn = jax.jit(
            step,
            in_shardings=(p_sh, s_sh, sharding.batch_sharding(mesh)),
            out_shardings=(p_sh, s_sh, NamedSharding(mesh, PartitionSpec())),
            donate_argnums=(0, 1),
        )

        def put_batch(b):
            return sharding.shard_batch(b, mesh)

    compiled = step_fn.lower(params, opt_state, put_batch(common.batch(0))).compile()
    analysis = compiled.memory_analysis()
    out = {
        "state_bytes_per_device": common.per_device_bytes(opt_state),
        "state_bytes_total": sum(x.nbytes for x in jax.tree.leaves(opt_state)),
        "argument_bytes": None if analysis is None else analysis.argument_size_in_bytes,
    }
    losses, scales = [], []
    for i in range(STEPS):
        params, opt_state, metrics = compiled(params, opt_state, put_batch(common.batch(i)))
        losses.append(float(metrics["loss"]))
        scales.append(float(metrics["loss_scale"]))
    common.save_tree(outdir / f"{kind}_{policy_name}_{mesh_spec or 'single'}.npz", params)
    out.update(
        losses=losses,
        loss_scales=scales,
        skipped_steps=int(jaxmp.loss_scale_metrics(opt_state)["skipped_steps"]),
        param_dtypes=sorted({str(x.dtype) for x in jax.tree.leaves(params)}),
    )
    if mesh_spec is not None:
        out.update(check_state_sharding(params, opt_state))
    if mesh_spec is not None and kind == "transformer":
        out["nan_in_one_shard"] = nan_step(compiled, params, opt_state, put_batch)
    return out


def check_state_sharding(params, opt_state) -> dict:
    """Whether master weights and momentum are sharded exactly like the params."""
    inner = opt_state.inner_state
    master = inner.master if isinstance(inner, jaxmp.MasterWeightsState) else None
    sgd_state = inner.inner_state if master is not None else inner
    trace = sgd_state[0].trace  # optax.sgd(momentum=...) is chain(trace, scale)
    p_sh = [x.sharding for x in jax.tree.leaves(params)]

    def same(tree):
        return all(a == x.sharding for a, x in zip(p_sh, jax.tree.leaves(tree), strict=True))

    return {
        "momentum_sharded_like_params": same(trace),
        "master_sharded_like_params": None if master is None else same(master),
        "sharded_param_leaves": sum(bool(strip(s.spec)) for s in p_sh),
        "loss_scale_replicated": opt_state.loss_scale.loss_scale.sharding.is_fully_replicated,
    }


def nan_step(compiled, params, opt_state, put_batch) -> dict:
    """A NaN in one example of the global batch (so on one device) skips the whole step."""
    before = common.tree_digest((params, opt_state.inner_state))
    scale_before = float(opt_state.loss_scale.loss_scale)
    skipped_before = int(opt_state.skipped_steps)
    batch = common.batch(STEPS)
    batch["weights"][5] = float("nan")
    params, opt_state, metrics = compiled(params, opt_state, put_batch(batch))
    scale = opt_state.loss_scale.loss_scale
    return {
        "new_skipped_steps": int(metrics["skipped_steps"]) - skipped_before,
        "grads_finite": bool(metrics["grads_finite"]),
        "params_and_inner_state_unchanged": common.tree_digest((params, opt_state.inner_state))
        == before,
        "loss_scale_ratio": float(scale) / scale_before,
        "loss_scale_distinct_values_over_devices": len(
            {float(s.data) for s in scale.addressable_shards}
        ),
    }


def init_propagation() -> dict:
    """Whether plain `jax.jit(tx.init)(sharded params)` shards the state like the params."""
    policy = jaxmp.get_policy(POLICIES["f16"])
    tx = common.make_optimizer(policy)
    params, _ = common.init(policy, tx, "mlp")
    out = {}
    for kind in ("auto", "explicit"):
        axis_type = AxisType.Auto if kind == "auto" else AxisType.Explicit
        mesh = jax.make_mesh((8,), ("model",), axis_types=(axis_type,))
        p_sh = sharding.fsdp_shardings(params, mesh)
        want = [strip(s.spec) for s in jax.tree.leaves(p_sh)]
        with jax.set_mesh(mesh):
            state = jax.jit(tx.init)(jax.device_put(params, p_sh))
        helper = jaxmp.state_shardings(tx, jax.device_put(params, p_sh))

        def specs(tree):
            return [
                strip(x.spec if isinstance(x, NamedSharding) else x.sharding.spec)
                for x in jax.tree.leaves(tree)
            ]

        out[kind] = {
            "jit_init_master_follows_params": specs(state.inner_state.master) == want,
            "jit_init_momentum_follows_params": specs(state.inner_state.inner_state[0].trace)
            == want,
            "state_shardings_follow_params": specs(helper.inner_state.master) == want
            and specs(helper.inner_state.inner_state[0].trace) == want,
        }
    return out


def main(outdir: str) -> None:
    out_path = pathlib.Path(outdir)
    result: dict = {"device_count": jax.device_count(), "runs": {}}
    for kind, policy_name, mesh_spec in RUNS:
        key = f"{kind}_{policy_name}_{mesh_spec or 'single'}"
        result["runs"][key] = run(kind, policy_name, mesh_spec, out_path)
    result["init_propagation"] = init_propagation()
    common.emit(result)


if __name__ == "__main__":
    main(sys.argv[1])
