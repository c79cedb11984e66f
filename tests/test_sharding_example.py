"""examples/sharding.py: mesh specs, param and batch shardings (8-device parts in a subprocess)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

import jaxmp
from examples import sharding
from tests.conftest import F16, assert_close
from tests.test_distributed import run_script

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize(
    ("spec", "count", "expected"),
    [
        ("data=8", 8, {"data": 8}),
        ("data=4,model=2", 8, {"data": 4, "model": 2}),
        (" model = 2 , data = 4 ", 8, {"model": 2, "data": 4}),
        ("fsdp=2,model=2,data=2", 8, {"fsdp": 2, "model": 2, "data": 2}),
        ("data=1", None, {"data": 1}),  # default: jax.device_count(), 1 here
    ],
)
def test_parse_mesh(spec, count, expected):
    got = sharding.parse_mesh(spec, count)
    assert got == expected
    assert list(got) == list(expected)  # the order given is the mesh's axis order


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("data", r"`mesh` must be of the form NAME=SIZE\[,NAME=SIZE...\] with NAME in"),
        ("=8", "`mesh` must be of the form"),
        ("", "`mesh` must be of the form"),
        ("batch=8", r"unknown axis name 'batch'.*valid names are 'data', 'fsdp', 'model'"),
        ("data=4,data=2", "names axis 'data' twice"),
        ("data=0,model=8", "axis 'data' must have a positive integer size, got '0'"),
        ("data=-8", "axis 'data' must have a positive integer size, got '-8'"),
        ("data=2.5", "positive integer size, got '2.5'"),
        ("data=4", r"sizes must multiply to the device count \(8\), got 'data=4' \(product 4\)"),
    ],
)
def test_parse_mesh_errors_name_mesh_and_the_form(spec, match):
    with pytest.raises(ValueError, match=match):
        sharding.parse_mesh(spec, 8)


def test_parse_mesh_rejects_non_strings():
    with pytest.raises(TypeError, match="`mesh` must be a string of the form"):
        sharding.parse_mesh(8)  # type: ignore[arg-type]


def test_make_mesh_one_device():
    mesh = sharding.make_mesh("data=1")
    assert dict(mesh.shape) == {"data": 1}
    assert mesh.axis_types == (AxisType.Auto,)
    assert dict(sharding.make_mesh({"data": 1, "model": 1}).shape) == {"data": 1, "model": 1}
    with pytest.raises(ValueError, match=r"`mesh` sizes must multiply to the device count \(1\)"):
        sharding.make_mesh({"data": 2})


def _params():
    return {
        "embed": jax.ShapeDtypeStruct((32, 64), jnp.float16),
        "dense": {
            "kernel": jax.ShapeDtypeStruct((64, 256), jnp.float16),
            "bias": jax.ShapeDtypeStruct((256,), jnp.float16),
        },
        "attn": jax.ShapeDtypeStruct((64, 4, 16), jnp.float16),
        "odd": jax.ShapeDtypeStruct((1025, 3), jnp.float32),
    }


def _specs(shardings):
    return jax.tree.map(lambda s: s.spec, shardings)


def test_fsdp_shardings_split_the_largest_divisible_dimension():
    mesh = AbstractMesh((4, 2), ("data", "model"))
    specs = _specs(sharding.fsdp_shardings(_params(), mesh))
    assert specs == {
        "embed": P(None, "model"),
        "dense": {"kernel": P(None, "model"), "bias": P()},  # bias: too small to shard
        "attn": P("model", None, None),
        "odd": P(),  # no dimension divides by 2
    }
    assert _specs(sharding.param_shardings(_params(), mesh)) == specs


def test_fsdp_shardings_combine_fsdp_and_model_axes():
    mesh = AbstractMesh((2, 2, 2), ("data", "fsdp", "model"))
    specs = _specs(sharding.fsdp_shardings(_params(), mesh))
    assert specs["dense"]["kernel"] == P(None, ("fsdp", "model"))
    assert specs["attn"] == P(("fsdp", "model"), None, None)
    assert specs["odd"] == P()  # neither 1025 nor 3 divides by 4
    assert specs["embed"] == P(None, ("fsdp", "model"))


def test_data_parallel_mesh_replicates_params():
    mesh = AbstractMesh((8,), ("data",))
    specs = _specs(sharding.param_shardings(_params(), mesh))
    assert jax.tree.leaves(specs) == [P()] * 5
    assert sharding.batch_sharding(mesh).spec == P(("data",))
    assert sharding.batch_sharding(AbstractMesh((4, 2), ("data", "model"))).spec == P(
        ("data", "model")
    )


def test_shard_params_and_state_one_device():
    mesh = sharding.make_mesh("data=1")
    policy = jaxmp.get_policy("p=f16,c=f16")
    tx = jaxmp.mixed_precision(optax.adam(1e-3), policy)
    params_f32 = {"w": jnp.ones((64, 32)), "b": jnp.zeros((32,))}
    params, state, p_sh, s_sh = sharding.shard_params_and_state(
        tx, policy.cast_to_param(params_f32), tx.init(params_f32), mesh
    )
    assert params["w"].dtype == jnp.float16
    assert state.inner_state.master["w"].sharding == p_sh["w"]
    assert jax.tree.structure(s_sh) == jax.tree.structure(state)


def test_value_and_grad_reduced_in_float32_one_device():
    mesh = sharding.make_mesh("data=1")

    def loss_fn(w, batch):
        return jnp.mean((batch["x"].astype(jnp.float16) @ w).astype(jnp.float32) ** 2)

    w = jnp.full((3,), 0.5, jnp.float16)
    batch = {"x": jnp.arange(12.0).reshape(4, 3)}
    scale = jaxmp.StaticLossScale(8.0)
    loss, grads = jax.jit(sharding.value_and_grad_reduced_in_float32(loss_fn, mesh))(
        scale, w, batch
    )
    ref_loss, ref_grads = jaxmp.value_and_grad(loss_fn)(scale, w, batch)
    assert grads.dtype == jnp.float32
    assert loss == ref_loss
    assert (grads == ref_grads.astype(jnp.float32)).all()


@pytest.fixture(scope="module")
def eight_devices():
    return run_script("sharding_example.py", devices=8)


def test_make_mesh_and_shard_batch_on_eight_devices(eight_devices):
    out = eight_devices
    assert out["device_count"] == 8
    assert out["mesh"] == {"shape": {"data": 4, "model": 2}, "axis_types": ["Auto", "Auto"]}
    assert out["dict_mesh"] == {"model": 8}
    assert out["batch"] == {
        "spec": [["data", "model"]],
        "rows_per_device": [2],
        "values_kept": True,
    }
    assert "`batch` leaf ['x'] must have a leading dimension divisible by 8" in out["batch_error"]
    assert "got shape (12, 3)" in out["batch_error"]
    assert "`mesh` sizes must multiply to the device count (8)" in out["mesh_error"]


def _final_val_loss(stdout: str) -> float:
    match = re.search(r"final val loss ([0-9.]+) nats/char", stdout)
    assert match, stdout[-2000:]
    return float(match.group(1))


@pytest.mark.slow
def test_train_example_on_a_mesh_matches_one_device(tmp_path):
    train_py = EXAMPLES / "train.py"
    common = [
        sys.executable,
        str(train_py),
        "--no-progress",
        "--config",
        "mixed_float16",
        *("--set", "steps=3", "--set", "eval_interval=3", "--set", "checkpoint_interval=3"),
        *("--set", "eval_batches=1", "--set", "batch_size=16", "--set", "seq_len=16"),
        *("--set", "num_layers=1", "--set", "d_model=32"),
    ]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    losses = []
    for extra in ([], ["--mesh", "data=4,model=2"]):
        proc = subprocess.run(
            [*common, "--workdir", str(tmp_path / (extra[-1] if extra else "single")), *extra],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-5000:]
        assert "skipped steps 0" in proc.stdout
        losses.append(_final_val_loss(proc.stdout))
    # Printed with 4 decimals: equal within float16's tolerance.
    assert_close(losses[1], losses[0], F16)
