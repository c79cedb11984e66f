"""Sharded, shard_map and multi-process training; `psum_in_float32`, `state_shardings`.

The multi-device checks run the scripts in tests/distributed/ in processes of their own, with
simulated CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=N`` must be set before
jax is imported), and assert on the JSON they print and the arrays they save.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmp
from tests.conftest import (
    BF16,
    F16,
    F32,
    FLOAT_DTYPES,
    assert_close,
    environ_without_compilation_cache,
)

SCRIPTS = pathlib.Path(__file__).parent / "distributed"
TIMEOUT_S = 300


def _env(devices: int, extra_flags: str = "", cache: bool = True) -> dict[str, str]:
    """The environment of a script with `devices` simulated CPU devices; with the run's
    persistent compilation cache, or without it (`cache=False`)."""
    env = dict(os.environ) if cache else environ_without_compilation_cache()
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} {extra_flags}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def run_script(name: str, *args: str, devices: int = 8, extra_flags: str = "") -> dict:
    """Runs tests/distributed/<name> with `devices` simulated CPU devices; returns its JSON."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args],
        env=_env(devices, extra_flags),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(f"{name} exited with {proc.returncode}:\n{proc.stderr[-5000:]}")
    return _last_json(proc.stdout)


def _load(path: pathlib.Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return dict(data)


def _assert_trees_close(actual: pathlib.Path, expected: pathlib.Path, dtype) -> None:
    a, e = _load(actual), _load(expected)
    assert sorted(a) == sorted(e)
    for key in e:
        assert_close(a[key], e[key], dtype)


# --- In-process: one CPU device --------------------------------------------------------------


def _one_device_mesh(*names: str, axis_types=AxisType.Auto) -> Mesh:
    return jax.make_mesh((1,) * len(names), names, axis_types=(axis_types,) * len(names))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("mean", [False, True], ids=["psum", "pmean"])
def test_reduce_in_float32_widens_half_precision_leaves(dtype, mean):
    mesh = _one_device_mesh("data")
    reduce = jaxmp.pmean_in_float32 if mean else jaxmp.psum_in_float32
    tree = {"g": jnp.full((2, 3), 1.5, dtype), "n": jnp.arange(3, dtype=jnp.int32)}

    @jax.jit
    def f(t):
        with jax.numpy_dtype_promotion("strict"):
            return jax.shard_map(
                lambda x: reduce(x, "data"), mesh=mesh, in_specs=P("data"), out_specs=P()
            )(t)

    out = f(tree)
    assert out["g"].dtype == F32
    # Integers are left to jax.lax.psum / pmean: summed as int32, averaged into float32.
    assert out["n"].dtype == (F32 if mean else jnp.dtype(jnp.int32))
    np.testing.assert_array_equal(out["g"], np.full((2, 3), 1.5, np.float32))
    np.testing.assert_array_equal(out["n"], np.arange(3))


def _params():
    return {
        "dense": {"kernel": jnp.ones((4, 2), jnp.float16), "bias": jnp.ones((2,), jnp.float16)},
        "embed": jnp.ones((3, 4, 2), jnp.float16),
    }


def _shardings(mesh: Mesh):
    return {
        "dense": {"kernel": NamedSharding(mesh, P("model")), "bias": NamedSharding(mesh, P())},
        "embed": NamedSharding(mesh, P(None, "model", None)),
    }


@pytest.mark.parametrize("axis_types", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_state_shardings_follow_params(axis_types):
    mesh = _one_device_mesh("data", "model", axis_types=axis_types)
    params = jax.device_put(_params(), _shardings(mesh))
    tx = jaxmp.mixed_precision(optax.adam(1e-3), "p=f16,c=f16")
    out = jaxmp.state_shardings(tx, params)
    state = tx.init(params)
    assert jax.tree.structure(out) == jax.tree.structure(state)
    want = _shardings(mesh)
    # The master copy and both moments hold the params' own shardings (equal, not just
    # equivalent), everything else is replicated.
    assert out.inner_state.master == want
    assert out.inner_state.inner_state[0].mu == want
    assert out.inner_state.inner_state[0].nu == want
    rest = [out.loss_scale, out.skipped_steps, out.inner_state.inner_state[0].count]
    assert all(s == NamedSharding(mesh, P()) for s in jax.tree.leaves(rest))
    with jax.set_mesh(mesh):
        placed = jax.jit(tx.init, out_shardings=out)(params)
    assert placed.inner_state.master["embed"].sharding == want["embed"]


def test_state_shardings_from_shapes_and_a_shardings_tree():
    mesh = _one_device_mesh("model")
    shapes = jax.eval_shape(lambda: _params())
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        jaxmp.loss_scaling(optax.inject_hyperparams(optax.sgd)(0.1, momentum=0.9)),
    )
    out = jaxmp.state_shardings(tx, shapes, _shardings(mesh))
    inner = out[1].inner_state
    assert inner.inner_state[0].trace == _shardings(mesh)
    assert inner.hyperparams["learning_rate"] == NamedSharding(mesh, P())


def test_state_shardings_errors_name_the_leaf():
    mesh = _one_device_mesh("model")
    tx = jaxmp.loss_scaling(optax.sgd(0.1))
    params = {"a": jax.device_put(jnp.ones(2), NamedSharding(mesh, P())), "b": jnp.ones(2)}
    with pytest.raises(TypeError, match=r"`params` leaf \['b'\] must carry a NamedSharding"):
        jaxmp.state_shardings(tx, params)
    with pytest.raises(ValueError, match="`shardings` must have the tree structure of `params`"):
        jaxmp.state_shardings(tx, params, {"a": NamedSharding(mesh, P())})
    with pytest.raises(ValueError, match="`params` must hold at least one array"):
        jaxmp.state_shardings(tx, {})
    other = _one_device_mesh("data")
    mixed = {"a": NamedSharding(mesh, P()), "b": NamedSharding(other, P())}
    with pytest.raises(ValueError, match=r"must all be on one mesh.*\['b'\]"):
        jaxmp.state_shardings(tx, {"a": jnp.ones(2), "b": jnp.ones(2)}, mixed)


# --- Multi-device: 8 simulated CPU devices, in a process of their own ------------------------


@pytest.fixture(scope="module")
def sharded_jit(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("sharded_jit")
    return run_script("sharded_jit.py", str(outdir)), outdir


_POLICY_DTYPE = {"f32": F32, "mixed_bfloat16": BF16, "f16": F16}
_SHARDED_RUNS = [
    ("mlp", "f32", "data=8"),
    ("mlp", "f32", "data=4,model=2"),
    ("mlp", "mixed_bfloat16", "data=8"),
    ("mlp", "f16", "data=8"),
    ("mlp", "f16", "data=4,model=2"),
    ("mlp", "f16", "model=8"),
    ("transformer", "f16", "data=4,model=2"),
]


@pytest.mark.parametrize(("kind", "policy", "mesh"), _SHARDED_RUNS)
def test_sharded_jit_matches_single_device(sharded_jit, kind, policy, mesh):
    result, outdir = sharded_jit
    assert result["device_count"] == 8
    run = result["runs"][f"{kind}_{policy}_{mesh}"]
    ref = result["runs"][f"{kind}_{policy}_single"]
    dtype = _POLICY_DTYPE[policy]
    assert_close(run["losses"], ref["losses"], dtype)
    assert run["loss_scales"] == ref["loss_scales"]
    assert run["skipped_steps"] == ref["skipped_steps"] == 0
    assert run["param_dtypes"] == ref["param_dtypes"]
    _assert_trees_close(
        outdir / f"{kind}_{policy}_{mesh}.npz", outdir / f"{kind}_{policy}_single.npz", dtype
    )


@pytest.mark.parametrize(("kind", "policy", "mesh"), _SHARDED_RUNS)
def test_sharded_jit_state_follows_params(sharded_jit, kind, policy, mesh):
    run = sharded_jit[0]["runs"][f"{kind}_{policy}_{mesh}"]
    assert run["momentum_sharded_like_params"] is True
    assert run["master_sharded_like_params"] is (True if policy == "f16" else None)
    assert run["loss_scale_replicated"] is True
    assert (run["sharded_param_leaves"] > 0) == ("model" in mesh)


@pytest.mark.parametrize(("mesh", "at_most"), [("model=8", 1 / 6), ("data=4,model=2", 0.55)])
def test_fully_sharded_state_is_split_not_replicated(sharded_jit, mesh, at_most):
    runs = sharded_jit[0]["runs"]
    replicated, sharded = runs["mlp_f16_data=8"], runs[f"mlp_f16_{mesh}"]
    # Data parallel: every device holds the whole state.
    assert replicated["state_bytes_per_device"] == replicated["state_bytes_total"]
    # Fully sharded: about 1/N of it (biases stay replicated); the compiled step's per-device
    # arguments (params, state, batch) shrink the same way.
    assert sharded["state_bytes_per_device"] <= at_most * replicated["state_bytes_total"]
    assert sharded["argument_bytes"] <= at_most * replicated["argument_bytes"]


def test_nan_in_one_shard_skips_the_step_on_every_device(sharded_jit):
    nan = sharded_jit[0]["runs"]["transformer_f16_data=4,model=2"]["nan_in_one_shard"]
    assert nan == {
        "new_skipped_steps": 1,
        "grads_finite": False,
        "params_and_inner_state_unchanged": True,
        "loss_scale_ratio": 0.5,
        "loss_scale_distinct_values_over_devices": 1,
    }


def test_state_shardings_needed_on_auto_meshes_only(sharded_jit):
    prop = sharded_jit[0]["init_propagation"]
    # Explicit axes: sharding-in-types gives the state the params' shardings under plain jit.
    assert prop["explicit"]["jit_init_momentum_follows_params"] is True
    assert prop["explicit"]["jit_init_master_follows_params"] is True
    assert prop["explicit"]["state_shardings_follow_params"] is True
    assert prop["auto"]["state_shardings_follow_params"] is True


def test_finiteness_check_moves_no_leaf_between_devices():
    # Same-shape leaves split by rows and by columns (a tensor-parallel layer's projections):
    # checking them together would reshard one of them at every step (all-to-all under Auto
    # axes) or fail to trace (Explicit axes); each is reduced where it lives.
    result = run_script("finite_check_shardings.py")
    assert result["auto"] == {
        "all-gather": 0,
        "all-reduce": 1,  # the one decision, shared by every device
        "all-to-all": 0,
        "collective-permute": 0,
        "reduce-scatter": 0,
    }
    assert result["explicit"] == {
        "skipped": True,
        "params_kept": True,
        "finite_step_moved_every_leaf": True,
        "specs_kept": True,
    }


@pytest.fixture(scope="module")
def shard_map_steps(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("shard_map")
    dump = tmp_path_factory.mktemp("hlo_dump")
    flags = (
        f"--xla_dump_to={dump} --xla_dump_hlo_pass_re=spmd-partitioning "
        "--xla_dump_hlo_module_re=.*grads_.*"
    )
    return run_script("shard_map_steps.py", str(outdir), str(dump), extra_flags=flags), outdir


def test_shard_map_nan_on_one_device_skips_on_all(shard_map_steps):
    skip = shard_map_steps[0]["skip"]
    assert skip["axis_name"] == {
        "skipped_steps": [1] * 8,
        "loss_scales": [512.0] * 8,
        "counters": [0] * 8,
        "params_changed": [False] * 8,
    }
    assert skip["pmap"] == {
        "skipped_steps": [1] * 8,
        "loss_scales": [512.0] * 8,
        "params_changed": [False] * 8,
    }
    # Without axis_name each device decides alone: only device 3 skips, and the loss scales
    # part ways.
    assert skip["none"]["skipped_steps"] == [0, 0, 0, 1, 0, 0, 0, 0]
    assert skip["none"]["loss_scales"] == [1024.0] * 3 + [512.0] + [1024.0] * 4
    assert skip["none"]["params_changed"] == [True] * 3 + [False] + [True] * 4


def test_shard_map_check_vma_proves_replicated_loss_scale(shard_map_steps):
    vma = shard_map_steps[0]["vma"]
    assert vma["axis_name"] == "ok"
    # JAX's words differ between versions; each names the out_specs that need replication.
    assert "out_specs" in vma["none"] and "replicat" in vma["none"]


@pytest.mark.parametrize(("policy", "dtype"), [("f16", F16), ("mixed_bfloat16", BF16)])
def test_shard_map_data_parallel_matches_single_device(shard_map_steps, policy, dtype):
    result, outdir = shard_map_steps
    _assert_trees_close(outdir / f"dp_{policy}.npz", outdir / f"single_{policy}.npz", dtype)
    assert result["dp"][policy] == {"skipped_steps": 1, "params_unchanged_after_nan": True}


def _bytes(operands) -> int:
    return sum(n * {"f16": 2, "bf16": 2, "f32": 4}[dt] for dt, n in operands)


@pytest.mark.parametrize(
    ("policy", "half", "stage"),
    [
        ("mixed_float16", "f16", "compiled"),
        # The CPU compiler widens bf16 all-reduces to f32 after partitioning (GPU and TPU keep
        # them bf16), so bf16 is read from the partitioned HLO.
        ("mixed_bfloat16", "bf16", "partitioned"),
    ],
)
def test_gradient_all_reduce_dtypes(shard_map_steps, policy, half, stage):
    red = shard_map_steps[0]["reductions"]
    elements = red["grad_elements"]
    got = {pattern: r[stage] for pattern, r in red[policy].items()}
    # Plain jit and plain shard_map: the partitioner / backward pass sums in the compute dtype
    # (JAX issue #27496), even with float32 params (mixed_float16).
    for pattern in ("jit", "shard_map"):
        assert {dt for dt, _ in got[pattern]} == {half}, pattern
        assert sum(n for _, n in got[pattern]) == elements
    # Splitting the batch (jit) or pmean_in_float32 (shard_map): float32, twice the bytes.
    for pattern in ("jit_split_f32", "shard_map_pmean_in_float32"):
        assert {dt for dt, _ in got[pattern]} == {"f32"}, pattern
        assert _bytes(got[pattern]) == 2 * _bytes(got["jit"])


@pytest.mark.parametrize(("policy", "dtype"), [("mixed_float16", F16), ("mixed_bfloat16", BF16)])
@pytest.mark.parametrize("pattern", ["jit_split_f32", "shard_map", "shard_map_pmean_in_float32"])
def test_gradient_reduction_patterns_agree(shard_map_steps, policy, dtype, pattern):
    outdir = shard_map_steps[1]
    _assert_trees_close(
        outdir / f"grads_{policy}_{pattern}.npz", outdir / f"grads_{policy}_jit.npz", dtype
    )


# --- Two processes on localhost -------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_processes(
    name: str, *args: str, env: dict[str, str] | None = None, timeout: float = TIMEOUT_S
) -> list[dict]:
    """Runs tests/distributed/<name> as processes 0 and 1 of one `jax.distributed` job on
    localhost (``<name> PROCESS_ID PORT *args``), each with 4 simulated CPU devices; returns
    the JSON each printed last.

    Each process writes to files of its own, not pipes: a process that fills a pipe nobody
    reads while the other waits for it in a collective would hang both. Past `timeout`, both
    are killed and the test fails with what each printed. By default the scripts run without
    the test run's persistent compilation cache: on jaxlib 0.12.1 (0.12.0 and 0.8.2 are fine)
    two CPU processes hang in a collective where process 0 loads a program from the cache
    that process 1 compiles (``test_two_processes_with_a_persistent_compilation_cache``).
    """
    port = str(_free_port())
    with contextlib.ExitStack() as stack:
        logs = [
            [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(2)] for _ in range(2)
        ]
        procs = [
            subprocess.Popen(
                [sys.executable, str(SCRIPTS / name), str(i), port, *args],
                env=_env(4, cache=False) if env is None else env,
                stdout=logs[i][0],
                stderr=logs[i][1],
                text=True,
            )
            for i in range(2)
        ]
        deadline = time.monotonic() + timeout
        killed = set()
        try:
            for proc in procs:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            pass
        finally:
            for i, proc in enumerate(procs):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                    killed.add(i)
        printed = []
        for out, err in logs:
            out.seek(0)
            err.seek(0)
            printed.append((out.read(), err.read()))
    failed = [
        f"process {i} "
        + (f"killed after {timeout} s" if i in killed else f"exited with {proc.returncode}")
        + f":\n{err[-4000:]}"
        for i, (proc, (_, err)) in enumerate(zip(procs, printed, strict=True))
        if proc.returncode != 0
    ]
    if failed:
        pytest.fail(f"{name}: " + "\n".join(failed))
    return [_last_json(out) for out, _ in printed]


@pytest.mark.slow
@pytest.mark.parametrize("nan_process", [0, 1])
def test_two_processes_agree_and_skip_together(nan_process):
    outputs = run_two_processes("multiprocess_worker.py", str(nan_process))
    first, second = outputs
    assert [first["process_index"], second["process_index"]] == [0, 1]
    assert first["device_count"] == 8 and first["local_device_count"] == 4
    # Identical params, master weights, moments, loss scale and counters in both processes.
    assert first["state_digest"] == second["state_digest"]
    assert first["digest_after_nan_step"] == second["digest_after_nan_step"]
    assert first["losses"] == second["losses"]
    for out in outputs:
        # Only one process saw the NaN; both skipped, left everything but the scale unchanged.
        assert out["skipped_steps"] == 1
        assert out["grads_finite"] is False
        assert out["digest_after_nan_step"] == out["digest_before_nan_step"]
        assert out["loss_scale"] == out["loss_scale_before"] / 2
