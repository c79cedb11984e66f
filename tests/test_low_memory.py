"""Low-memory training through `mixed_precision`: bytes per parameter, options, Flax, orbax.

Digits parity: every low-memory mode trains the 8x8 digits to within one point of accuracy of
bfloat16 params with a float32 master copy.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import orbax.checkpoint as ocp
import pytest
from flax import linen as nn
from flax import nnx

import jaxmp
import jaxmp.linen
import jaxmp.nnx
from tests.conftest import BF16, F16, F32, diagonal_cases
from tests.test_cost import SHAPES
from tests.test_nnx import digits

LOW_MEMORY = {
    "round_to_nearest": dict(master_weights=False),
    "stochastic": dict(master_weights=False, rounding="stochastic"),
    "kahan": dict(master_weights=False, rounding="kahan"),
    "stochastic_bf16_moments": dict(master_weights=False, rounding="stochastic", moments="bf16"),
    "stochastic_8bit_moments": dict(master_weights=False, rounding="stochastic", moments="int8"),
}


def _bytes_per_param(tx, dtype):
    params = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, dtype), SHAPES, is_leaf=lambda s: isinstance(s, tuple)
    )
    state = jax.eval_shape(tx.init, params)

    def nbytes(tree):
        return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))

    return (nbytes(params) + nbytes(state)) / sum(x.size for x in jax.tree.leaves(params))


def test_bytes_per_parameter():
    adam = optax.adam(1e-3)
    table = {
        "float32": _bytes_per_param(jaxmp.mixed_precision(adam, "f32"), F32),
        "float16_master": _bytes_per_param(jaxmp.mixed_precision(adam, "f16"), F16),
        **{
            name: _bytes_per_param(jaxmp.mixed_precision(adam, "bf16", **kwargs), BF16)
            for name, kwargs in LOW_MEMORY.items()
        },
    }
    # Read from the state pytrees (plus a few bytes of counters, keys and loss scale).
    expected = {
        "float32": 12,  # params 4, mu 4, nu 4
        "float16_master": 14,  # params 2, master 4, mu 4, nu 4
        "round_to_nearest": 10,
        "stochastic": 10,
        "kahan": 12,  # params 2, compensation 2, mu 4, nu 4
        "stochastic_bf16_moments": 6,  # params 2, mu 2, nu 2
    }
    for name, value in expected.items():
        assert value <= table[name] < value + 0.001, (name, table[name])
    # 8-bit moments: 2 + 1 + 1 bytes, and a float32 scale per block of at most 256 values.
    assert 4 < table["stochastic_8bit_moments"] < 4.1


def test_composition_and_state_helpers():
    tx = jaxmp.mixed_precision(
        optax.adam(1e-3), "p=f16,c=f16", master_weights=False, rounding="stochastic",
        moments=("bf16", "int8"),
    )  # fmt: skip
    state = jax.jit(tx.init)({"w": jnp.ones((8, 32))})
    rounding = state.inner_state
    assert isinstance(state, jaxmp.LossScalingState)
    assert isinstance(rounding, jaxmp.StochasticRoundingState)
    assert isinstance(rounding.inner_state, jaxmp.CompressStateState)
    assert float(jaxmp.get_loss_scale(state).loss_scale) == 2.0**15  # float16 compute
    adam = jaxmp.inner_state(state)[0]
    assert isinstance(adam, optax.ScaleByAdamState) and adam.mu["w"].dtype == F32
    # Moments may be compressed under a master copy too.
    tx = jaxmp.mixed_precision(optax.adam(1e-3), "bf16", moments="bf16")
    assert isinstance(tx.init({"w": jnp.ones(4)}).inner_state.inner_state, jaxmp.CompressStateState)


@pytest.mark.parametrize(
    ("policy", "kwargs", "error", "match"),
    [
        ("bf16", dict(rounding="stochastc"), ValueError,
         r"`rounding` must be one of 'nearest', 'stochastic', 'kahan', got 'stochastc'\. "
         r"Did you mean 'stochastic'\?"),
        ("bf16", dict(rounding="stochastic"), ValueError,
         r"`rounding='stochastic'` is for params updated without a master copy: pass "
         r"`master_weights=False`"),
        ("mixed_bfloat16", dict(master_weights=False, rounding="kahan"), ValueError,
         r"`rounding='kahan'` rounds float16 or bfloat16 params, but the policy "
         r"'p=f32,c=bf16,o=f32' stores params in float32"),
        ("f32", dict(master_weights=True), ValueError,
         r"`master_weights=True` keeps a float32 copy of float16 or bfloat16 params"),
        ("bf16", dict(master_weights="no"), TypeError,
         r"`master_weights` must be None, True or False, got 'no'"),
        ("bf16", dict(moments="int4"), ValueError,
         r"`moments` must be one of 'float32', 'bfloat16', 'int8', 'fp8' .*got 'int4'\. "
         r"Did you mean 'int8'\?"),
        ("bf16", dict(moments=("bf16", "fp9")), ValueError, r"`moments\[1\]` must be one of"),
        ("bf16", dict(moments=("bf16",)), ValueError, r"`moments` must be a storage format or"),
        ("bf16", dict(seed=1.5), TypeError, r"`seed` must be an int, got 1.5"),
        ("bf16", dict(check_outputs="yes"), TypeError, r"`check_outputs` must be a bool, got 'y"),
        ("bf16", dict(param_specs={"w": ("data",)}), TypeError,
         r"`param_specs` must be None or a pytree of jax.sharding.PartitionSpec .*got a leaf "
         r"'data'"),
        ("bf16", dict(moments="int8", moment_fields={"nu": "second"}), TypeError,
         r"`moment_fields` must map state types"),
    ],
)  # fmt: skip
def test_options_are_validated_at_construction(policy, kwargs, error, match):
    with pytest.raises(error, match=match):
        jaxmp.mixed_precision(optax.adam(1e-3), policy, **kwargs)


# --- check_outputs: a step that overflows on finite gradients is skipped, in every mode ------

CHECKED_MODES = {
    "master_weights": dict(),
    "round_to_nearest": dict(master_weights=False),
    "stochastic": dict(master_weights=False, rounding="stochastic"),
    "kahan": dict(master_weights=False, rounding="kahan"),
}


CHECKED_MOMENTS = ["float32", "bfloat16", "int8", "fp8", ("bf16", "int8")]


@pytest.mark.parametrize(
    ("mode", "moments"),
    diagonal_cases(
        list(CHECKED_MODES),
        CHECKED_MOMENTS,
        list(CHECKED_MODES),
        [m if isinstance(m, str) else "+".join(m) for m in CHECKED_MOMENTS],
    ),
)
def test_check_outputs_through_mixed_precision_in_every_moment_format(mode, moments):
    # The README's check_outputs guarantee, through mixed_precision: Adam's second moment of
    # a gradient of 1e20 is inf; the step is skipped, nothing non-finite reaches the params
    # or the optimizer state, and the state is the one before the step, bit for bit.
    tx = jaxmp.mixed_precision(
        optax.adam(1e-2), "bf16", moments=moments, check_outputs=True, **CHECKED_MODES[mode]
    )
    params = {"w": jnp.ones((4, 32), BF16)}
    state = jax.jit(tx.init)(params)

    @jax.jit
    def step(params, state, grads):  # (optax's adam is not strict-promotion clean)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params, state = step(params, state, {"w": jnp.full((4, 32), 0.5, BF16)})
    assert int(state.skipped_steps) == 0
    huge = {"w": jnp.full((4, 32), 0.5, BF16).at[2, 3].set(1e20)}
    new_params, new_state = step(params, state, huge)
    assert int(new_state.skipped_steps) == 1 and not bool(new_state.grads_finite)
    chex.assert_trees_all_equal(new_params, params)
    chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
    assert bool(jaxmp.all_finite((new_params, new_state)))
    assert bool(jaxmp.all_finite(jaxmp.inner_state(new_state)))


def test_check_outputs_is_off_by_default_and_compressed_moments_then_stay_infinite():
    # Without the check, the overflowing step is applied as with float32 moments: the
    # infinite second moment stays infinite (not saturated to bfloat16's largest value), the
    # param it divides stops moving, and every param stays finite.
    tx = jaxmp.mixed_precision(optax.adam(1e-2), "f32", moments="bfloat16")
    params = {"w": jnp.ones((4, 32))}
    state = jax.jit(tx.init)(params)
    step = jax.jit(tx.update)
    updates, state = step({"w": jnp.full((4, 32), 0.5).at[2, 3].set(1e20)}, state, params)
    assert int(state.skipped_steps) == 0
    params = optax.apply_updates(params, updates)
    for _ in range(2):
        updates, state = step({"w": jnp.full((4, 32), 0.5)}, state, params)
        params = optax.apply_updates(params, updates)
    assert bool(jaxmp.all_finite(params))
    assert float(jaxmp.inner_state(state)[0].nu["w"][2, 3]) == np.inf


def test_linen_train_state_wraps_a_rounding_transform_in_loss_scaling_only():
    # A transformation that already rounds half-precision params gets no master copy.
    model = nn.Dense(3)
    params = model.init(jax.random.key(0), jnp.ones((1, 4)))["params"]
    tx = jaxmp.stochastic_rounding(optax.adam(1e-3))
    state = jaxmp.linen.TrainState.create(apply_fn=model.apply, params=params, tx=tx, policy="bf16")
    assert isinstance(state.opt_state, jaxmp.LossScalingState)
    assert isinstance(state.opt_state.inner_state, jaxmp.StochasticRoundingState)
    assert state.params["kernel"].dtype == BF16


def test_equinox_module_with_stochastic_rounding():
    import equinox as eqx  # noqa: PLC0415

    policy = jaxmp.get_policy("p=bf16,c=bf16,o=f32")
    model = eqx.nn.MLP(8, 2, 16, 1, key=jax.random.key(0))
    tx = jaxmp.mixed_precision(
        optax.adam(1e-2), policy, master_weights=False, rounding="stochastic", moments="bf16"
    )
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    model = policy.cast_to_param(model)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(32, 8)), F32)
    y = jnp.sin(x[:, :2])

    @eqx.filter_jit
    def step(model, opt_state):
        def loss_fn(model):
            pred = policy.cast_to_output(jax.vmap(model)(policy.cast_to_compute(x)))
            return jnp.mean((pred - y) ** 2)

        loss, grads = jaxmp.filter_value_and_grad(loss_fn)(jaxmp.get_loss_scale(opt_state), model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    losses = []
    for _ in range(30):
        model, opt_state, loss = step(model, opt_state)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
    assert {p.dtype for p in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))} == {BF16}
    assert model.activation is jax.nn.relu


def test_schedule_free_eval_params_through_stochastic_rounding():
    tx = jaxmp.mixed_precision(
        optax.contrib.schedule_free_sgd(1.0), "bf16", master_weights=False, rounding="stochastic"
    )
    params = {"w": jnp.ones(4, BF16)}
    state = tx.init(params)
    _, state = jax.jit(tx.update)({"w": jnp.ones(4, BF16)}, state, params)
    assert jaxmp.schedule_free_eval_params(state, params)["w"].dtype == BF16


# --- Digits parity (Linen TrainState), an NNX Optimizer, orbax checkpoints -------------------

STEPS, BATCH = 300, 64


class MLP(nn.Module):
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        x = nn.relu(nn.Dense(128, **kw)(x))
        return nn.Dense(10, **kw)(x).astype(jnp.float32)


def _linen_state(tx, seed=0):
    init = MLP().init(jax.random.key(seed), jnp.zeros((1, 64)))["params"]
    model = MLP(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    return jaxmp.linen.TrainState.create(apply_fn=model.apply, params=init, tx=tx, policy="bf16")


def _train_step(state, x, y):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    loss, grads = jaxmp.value_and_grad(loss_fn)(state.loss_scale, state.params)
    return state.apply_gradients(grads=grads), loss


@jax.jit
def _train(state, x, y, indices):
    return jax.lax.scan(lambda s, idx: _train_step(s, x[idx], y[idx]), state, indices)


@jax.jit
def _accuracy(state, x, y):
    return jnp.mean(jnp.argmax(state.apply_fn({"params": state.params}, x), -1) == y)


@pytest.fixture(scope="module")
def digits_accuracy():
    (x_train, y_train), (x_test, y_test) = digits()
    rng = np.random.default_rng(0)
    indices = np.stack([rng.choice(len(x_train), BATCH, replace=False) for _ in range(STEPS)])
    modes = {"float32_master": {}, **LOW_MEMORY}
    out = {}
    for name, kwargs in modes.items():
        tx = jaxmp.mixed_precision(optax.adam(3e-3), "bf16", **kwargs)
        state, losses = _train(_linen_state(tx), x_train, y_train, indices)
        assert {p.dtype for p in jax.tree.leaves(state.params)} == {BF16}, name
        assert np.all(np.isfinite(losses)) and losses[-20:].mean() < 0.25 * losses[:5].mean()
        out[name] = float(_accuracy(state, x_test, y_test))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LOW_MEMORY))
def test_digits_accuracy_within_one_point_of_the_master_copy(digits_accuracy, name):
    reference = digits_accuracy["float32_master"]
    assert reference > 0.9, reference
    assert abs(digits_accuracy[name] - reference) <= 0.01, digits_accuracy


def test_nnx_optimizer_with_stochastic_rounding():
    (x, y), _ = digits()
    model = nnx.Linear(64, 10, rngs=nnx.Rngs(0))
    tx = jaxmp.mixed_precision(
        optax.adam(1e-2), "bf16", master_weights=False, rounding="stochastic", moments="int8"
    )
    optimizer = jaxmp.nnx.Optimizer(model, tx, wrt=nnx.Param)
    jaxmp.nnx.set_policy(model, "bf16")

    @nnx.jit
    def step(model, optimizer, x, y):
        def loss_fn(model, x, y):
            logits = model(x.astype(jnp.bfloat16)).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jaxmp.nnx.value_and_grad(loss_fn)(
            jaxmp.get_loss_scale(optimizer), model, x, y
        )
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer, x[:256], y[:256])) for _ in range(20)]
    assert losses[-1] < 0.7 * losses[0]
    assert model.kernel.get_value().dtype == BF16
    assert int(optimizer.step[...]) == 20


def test_orbax_checkpoint_resumes_bit_identically(tmp_path):
    (x, y), _ = digits()
    tx = jaxmp.mixed_precision(
        optax.adam(3e-3), "bf16", master_weights=False, rounding="stochastic",
        moments=("int8", "fp8"),
    )  # fmt: skip
    create = jax.jit(lambda: _linen_state(tx))
    rng = np.random.default_rng(1)
    indices = np.stack([rng.choice(len(x), BATCH, replace=False) for _ in range(6)])
    first, _ = _train(create(), x, y, indices[:3])
    straight, _ = _train(first, x, y, indices[3:])
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "state", first)
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(tmp_path / "state", jax.eval_shape(create))
    resumed, _ = _train(restored, x, y, indices[3:])
    a, b = (
        jax.tree_util.tree_leaves_with_path(resumed),
        jax.tree_util.tree_leaves_with_path(straight),
    )
    assert [p for p, _ in a] == [p for p, _ in b]
    for (path, u), (_, v) in zip(a, b, strict=True):
        assert u.dtype == v.dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(u, v, err_msg=jax.tree_util.keystr(path))
    dtypes = {x.dtype for x in jax.tree.leaves(resumed.opt_state)}
    assert {jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.uint32)} <= dtypes


# --- On a mesh (8 simulated devices, in a process of their own) -----------------------------


MESH_LEARNING_RATE, MESH_STEPS = 1e-2, 3  # as tests/distributed/low_memory.py trains


@pytest.fixture(scope="module")
def on_a_mesh():
    from tests.test_distributed import run_script

    return run_script("low_memory.py")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["stochastic_bf16", "stochastic_8bit", "kahan"])
@pytest.mark.parametrize("mesh", ["data=8", "data=4,model=2"])
def test_sharded_runs_agree_across_replicas_and_follow_one_device(on_a_mesh, mode, mesh):
    assert on_a_mesh["device_count"] == 8
    run, single = on_a_mesh["runs"][f"{mode}_{mesh}"], on_a_mesh["runs"][f"{mode}_single"]
    # Every device holding a copy of a param (or of a state leaf) holds the same bits: the
    # random bits are the same on every device, drawn from the replicated key.
    assert run["replicas_agree"] and run["keys_replicated"]
    assert run["state_follows_params"]
    assert run["param_dtypes"] == ["bfloat16"]
    # The random bits do not depend on the sharding (checked on their own below); what differs
    # is the order in which the devices' gradients are summed. Adam divides a gradient by its
    # own size, so a near-zero gradient's sign can flip between the two orders, and a param can
    # move by up to the learning rate the other way at each step (and then round apart).
    np.testing.assert_allclose(run["losses"], single["losses"], rtol=1e-3)
    assert run["max_param_difference"] <= 2 * MESH_LEARNING_RATE * MESH_STEPS
    assert run["fraction_of_params_differing"] < 0.5


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["data=8", "data=4,model=2"])
def test_stochastic_rounding_draws_the_same_bits_on_any_sharding(on_a_mesh, mesh):
    assert on_a_mesh["rounding_follows_one_device"][mesh] is True


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["stochastic_bf16", "stochastic_8bit", "kahan"])
def test_shard_map_devices_update_alike(on_a_mesh, mode):
    assert on_a_mesh["shard_map"][mode] == {"devices_agree": True, "params_moved": True}


@pytest.fixture(scope="module")
def sharded_updates():
    from tests.test_distributed import run_script

    return run_script("low_memory.py", "sharded_updates")


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["data=8|rows|int8", "data=4,model=2|both|bf16", "data=4,model=2|columns|bf16"]
)
def test_shard_map_with_split_params_rounds_as_one_device_with_param_specs(sharded_updates, name):
    # Each device updates its block of every param inside shard_map: with `param_specs`, the
    # params and the compressed moments after 3 steps are bit-identical to one device's;
    # without, every block draws the bits of the first block and the result differs.
    assert sharded_updates[name] == {
        "with_param_specs": True,
        "without_param_specs": False,
        "params_moved": True,
    }


# --- Parity on the main job's transformer (examples/train.py) --------------------------------

LM_STEPS = ("steps=300", "eval_interval=300", "checkpoint_interval=300")


@pytest.fixture(scope="module")
def lm_runs(tmp_path_factory):
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
    import train  # noqa: PLC0415
    from lm import config as config_lib  # noqa: PLC0415

    names = [
        "bf16_master_weights",
        "bf16_round_to_nearest",
        "bf16_stochastic_rounding",
        "bf16_kahan_summation",
        "bf16_8bit_states",
    ]
    out = {}
    for name in names:
        result = train.train_and_evaluate(
            config_lib.load(name, LM_STEPS),
            tmp_path_factory.mktemp(name),
            progress=False,
            verbose=False,
            sample_length=0,
            figure=False,
        )
        out[name] = (result.final_val_loss, result.bytes_per_param)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "bytes_per_param"),
    [("bf16_stochastic_rounding", 6), ("bf16_kahan_summation", 8), ("bf16_8bit_states", 4)],
)
def test_lm_validation_loss_within_1_percent_of_the_master_copy(lm_runs, name, bytes_per_param):
    reference, reference_bytes = lm_runs["bf16_master_weights"]
    loss, stored = lm_runs[name]
    assert reference_bytes == pytest.approx(14, abs=0.01)
    assert bytes_per_param <= stored < bytes_per_param + 0.1
    assert abs(loss / reference - 1) <= 0.01, lm_runs
    # Round-to-nearest without a master copy trains too (10 bytes per parameter).
    assert lm_runs["bf16_round_to_nearest"][1] == pytest.approx(10, abs=0.01)
