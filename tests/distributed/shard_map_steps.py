"""`shard_map` training: one skip decision and one loss scale on every device; f32 reductions.

Usage: ``python shard_map_steps.py OUTDIR [DUMPDIR]`` with 8 simulated devices (DUMPDIR: where
XLA_FLAGS sends the HLO after SPMD partitioning, ``--xla_dump_hlo_pass_re=spmd-partitioning``).
Prints one JSON object:

* ``skip``: per-device gradients of sharded params with a NaN on one device only, updated by
  ``loss_scaling(..., axis_name="data")`` and, as a control, without `axis_name`: per-device
  skipped-step counts, loss scales and whether each device's params changed.
* ``vma``: whether ``shard_map(check_vma=True)`` accepts a replicated loss-scale output.
* ``dp``: a data-parallel `shard_map` train step (per-device gradients, `pmean_in_float32`),
  its params saved as ``OUTDIR/dp_<policy>.npz`` next to the single-device ``single_<policy>``.
* ``reductions``: the all-reduce operands (dtype, elements) of the gradient reduction in each
  pattern, from the compiled HLO (float16) and from the partitioned HLO (bfloat16, which the
  CPU compiler later widens to float32 on its own).
"""

from __future__ import annotations

import functools
import pathlib
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

N = 8
POLICIES = {"f16": "p=f16,c=f16,o=f32", "mixed_bfloat16": "mixed_bfloat16"}


def skip_decision(axis_name: str | None) -> dict:
    """Each device owns one row of the params and its gradient; device 3's gradient is NaN."""
    mesh = sharding.make_mesh(f"data={N}")
    tx = jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**10), axis_name=axis_name)
    params = jnp.ones((N, 4), jnp.float32)
    state = tx.init(params)
    specs = jax.tree.map(lambda x: P("data") if jnp.ndim(x) else P(), state)
    per_device = jax.tree.map(lambda _: P("data"), state)

    # check_vma=False so the per-device copies of replicated leaves can be gathered and
    # compared (out_specs P("data") on a leading axis of length 1 per device).
    @jax.jit
    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P("data"), specs, P("data")),
        out_specs=(P("data"), per_device),
        check_vma=False,
    )
    def step(p, s, g):
        updates, s = tx.update(g, s, p)
        s = jax.tree.map(lambda x: x if jnp.ndim(x) else x[None], s)
        return optax.apply_updates(p, updates), s

    grads = jnp.full((N, 4), 2.0**10).at[3, 1].set(jnp.nan)
    new_params, new_state = step(params, state, grads)
    changed = np.asarray(jnp.any(new_params != params, axis=1)).tolist()
    return {
        "skipped_steps": np.asarray(new_state.skipped_steps).tolist(),
        "loss_scales": np.asarray(new_state.loss_scale.loss_scale).tolist(),
        "counters": np.asarray(new_state.loss_scale.counter).tolist(),
        "params_changed": changed,
    }


def pmap_skip_decision() -> dict:
    """`skip_decision` with `jax.pmap` (one row of params and gradients per device)."""
    tx = jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**10), axis_name="data")
    params = jnp.ones((N, 4), jnp.float32)
    state = jax.vmap(tx.init)(params)  # one copy of the state per device

    @functools.partial(jax.pmap, axis_name="data")
    def step(p, s, g):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    grads = jnp.full((N, 4), 2.0**10).at[3, 1].set(jnp.nan)
    new_params, new_state = step(params, state, grads)
    return {
        "skipped_steps": np.asarray(new_state.skipped_steps).tolist(),
        "loss_scales": np.asarray(new_state.loss_scale.loss_scale).tolist(),
        "params_changed": np.asarray(jnp.any(new_params != params, axis=1)).tolist(),
    }


def vma_check(axis_name: str | None) -> str:
    """'ok', or the error `shard_map(check_vma=True)` raises for a P() loss-scale output."""
    mesh = sharding.make_mesh(f"data={N}")
    tx = jaxmp.loss_scaling(optax.sgd(0.1), axis_name=axis_name)
    params = jnp.ones((N, 4), jnp.float32)
    state = tx.init(params)
    specs = jax.tree.map(lambda x: P("data") if jnp.ndim(x) else P(), state)
    step = jax.shard_map(
        lambda p, s, g: tx.update(g, s, p)[1],
        mesh=mesh,
        in_specs=(P("data"), specs, P("data")),
        out_specs=specs,
    )
    try:
        jax.jit(step).lower(params, state, params)
    except ValueError as e:
        return str(e)
    return "ok"


def dp_step(model, tx, mesh):
    """A data-parallel step in `shard_map`: each device differentiates its slice of the batch."""
    grad_fn = jaxmp.value_and_grad(common.make_loss_fn(model))
    p_rep, b_spec = P(), P("data")

    @functools.partial(
        jax.shard_map, mesh=mesh, in_specs=(p_rep, p_rep, b_spec), out_specs=(p_rep, p_rep, P())
    )
    def step(params, opt_state, batch):
        loss_scale = jaxmp.get_loss_scale(opt_state)
        # Device-varying params: the backward pass leaves each device's gradients its own,
        # and the reduction happens here, in float32.
        local = jax.lax.pcast(params, "data", to="varying")
        loss, grads = grad_fn(loss_scale, local, batch)
        grads = jaxmp.pmean_in_float32(grads, "data")
        loss = jax.lax.pmean(loss, "data")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def data_parallel(outdir: pathlib.Path) -> dict:
    out = {}
    mesh = sharding.make_mesh(f"data={N}")
    for name, spec in POLICIES.items():
        policy = jaxmp.get_policy(spec)
        model = common.make_model(policy, "mlp")
        tx = common.make_optimizer(policy)
        params, opt_state = common.init(policy, tx, "mlp")
        single = jax.jit(common.make_train_step(model, tx))
        sp, ss = params, opt_state
        for i in range(3):
            sp, ss, _ = single(sp, ss, common.batch(i))
        common.save_tree(outdir / f"single_{name}.npz", sp)
        step = jax.jit(dp_step(model, tx, mesh))
        for i in range(3):
            params, opt_state, _ = step(
                params, opt_state, sharding.shard_batch(common.batch(i), mesh)
            )
        common.save_tree(outdir / f"dp_{name}.npz", params)
        bad = common.batch(3)
        bad["weights"][2] = np.nan  # one example, on device 1
        before = common.tree_digest(params)
        params, opt_state, _ = step(params, opt_state, sharding.shard_batch(bad, mesh))
        out[name] = {
            "skipped_steps": int(opt_state.skipped_steps),
            "params_unchanged_after_nan": common.tree_digest(params) == before,
        }
    return out


def gradient_reductions(outdir: pathlib.Path, dump_dir: str | None) -> dict:
    """All-reduce operands of each gradient-reduction pattern (grads of the MLP, batch 16)."""
    mesh = sharding.make_mesh(f"data={N}")
    out: dict = {}
    for name in ("mixed_float16", "mixed_bfloat16"):
        policy = jaxmp.get_policy(name)
        model = common.make_model(policy, "mlp")
        tx = common.make_optimizer(policy)
        params, opt_state = common.init(policy, tx, "mlp")
        loss_fn = common.make_loss_fn(model)
        batch = sharding.shard_batch(common.batch(0), mesh)
        rep = NamedSharding(mesh, P())
        params, opt_state = jax.device_put((params, opt_state), rep)
        scale = jaxmp.get_loss_scale(opt_state)

        def grads_jit(p, b):
            return jaxmp.value_and_grad(loss_fn)(scale, p, b)[1]  # noqa: B023

        def grads_jit_f32(p, b):
            return sharding.value_and_grad_reduced_in_float32(loss_fn, mesh)(scale, p, b)[1]  # noqa: B023

        def in_shard_map(f32: bool):
            def f(p, b):
                if f32:
                    p = jax.lax.pcast(p, "data", to="varying")
                g = jaxmp.value_and_grad(loss_fn)(scale, p, b)[1]  # noqa: B023
                if f32:
                    return jaxmp.pmean_in_float32(g, "data")
                return jax.tree.map(lambda x: x / N, g)  # already summed, in its own dtype

            return jax.shard_map(f, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())

        patterns = {
            "jit": grads_jit,
            "jit_split_f32": grads_jit_f32,
            "shard_map": in_shard_map(False),
            "shard_map_pmean_in_float32": in_shard_map(True),
        }
        result = {}
        for pattern, fn in patterns.items():
            fn.__name__ = f"grads_{name}_{pattern}"
            compiled = jax.jit(fn).lower(params, batch).compile()
            grads = scale.unscale(compiled(params, batch))
            common.save_tree(outdir / f"grads_{name}_{pattern}.npz", grads)
            result[pattern] = {"compiled": common.all_reduce_operands(compiled.as_text())}
            if dump_dir is not None:
                files = sorted(
                    pathlib.Path(dump_dir).glob(f"*{fn.__name__}*after_spmd-partitioning*")
                )
                if files:
                    text = files[-1].read_text()
                    result[pattern]["partitioned"] = common.all_reduce_operands(text)
        out[name] = result
    out["grad_elements"] = sum(x.size for x in jax.tree.leaves(params))
    return out


def main(outdir: str, dump_dir: str | None = None) -> None:
    out_path = pathlib.Path(outdir)
    common.emit(
        {
            "device_count": jax.device_count(),
            "skip": {
                "axis_name": skip_decision("data"),
                "none": skip_decision(None),
                "pmap": pmap_skip_decision(),
            },
            "vma": {"axis_name": vma_check("data"), "none": vma_check(None)},
            "dp": data_parallel(out_path),
            "reductions": gradient_reductions(out_path, dump_dir),
        }
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
