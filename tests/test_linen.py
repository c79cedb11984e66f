"""jaxmp.linen: policy_scope and TrainState, trained on scikit-learn's 8x8 digits."""

import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import jax_utils
from flax import linen as nn
from flax.linen import fp8_ops
from sklearn.datasets import load_digits

import jaxmp
import jaxmp.linen

from .conftest import F16, F32, primitive_dtypes

STEPS = 100
BATCH = 64
NORM_OVERRIDES = {nn.LayerNorm: "float32", nn.BatchNorm: "float32"}
POLICIES = {
    "float32": "float32",
    "mixed_float16": "mixed_float16",
    "float16_params": "p=f16,c=f16,o=f32",
}


def digits():
    """Train/test split of the 8x8 digits (NHWC images in [0, 1]), fixed order."""
    x, y = load_digits(return_X_y=True)
    perm = np.random.default_rng(0).permutation(len(x))
    x = (x[perm] / 16.0).reshape(-1, 8, 8, 1).astype(np.float32)
    y = y[perm].astype(np.int32)
    return (x[:1437], y[:1437]), (x[1437:], y[1437:])


class CNN(nn.Module):
    """A small CNN written in float32 (no dtype anywhere)."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(16, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.relu(x)
        x = nn.Conv(32, (3, 3), strides=(2, 2))(x)
        x = nn.relu(x).reshape(x.shape[0], -1)
        x = nn.Dense(64)(x)
        x = nn.relu(nn.LayerNorm()(x))
        return nn.Dense(10)(x)


class TrainState(jaxmp.linen.TrainState):
    batch_stats: dict


def create_state(policy, tx=None, loss_scale=None, seed=0):
    if tx is None:
        tx = jaxmp.mixed_precision(optax.adam(3e-3), policy, loss_scale)
    return _create_state(policy, tx, _init_variables(jax.random.key(seed)))


# The float32 init: one compile for every policy and optimizer (not one per operation).
@jax.jit
def _init_variables(key):
    return CNN().init(key, jnp.zeros((1, 8, 8, 1)), train=False)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _create_state(policy, tx, variables):
    return TrainState.create(
        apply_fn=CNN().apply,
        params=variables["params"],
        batch_stats=variables["batch_stats"],
        tx=tx,
        policy=policy,
    )


def loss_fn(params, state, x, y):
    with jaxmp.linen.policy_scope(state.policy, NORM_OVERRIDES):
        logits, updates = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats}, x, mutable=["batch_stats"]
        )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, updates["batch_stats"]


def train_step(state, x, y, poison=False):
    grad_fn = jaxmp.value_and_grad(loss_fn, has_aux=True)
    (loss, batch_stats), grads = grad_fn(state.loss_scale, state.params, state, x, y)
    # `poison` (a traced bool) puts an inf into every gradient, as an overflow would.
    grads = jax.tree.map(lambda g: g.at[(0,) * g.ndim].add(jnp.where(poison, jnp.inf, 0)), grads)
    state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
    return state, loss, state.metrics()


def batch_indices(steps=STEPS, seed=0):
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(1437, BATCH, replace=False) for _ in range(steps)])


@jax.jit
def train(state, x_train, y_train, indices):
    def body(state, idx):
        state, loss, metrics = train_step(state, x_train[idx], y_train[idx])
        return state, (loss, metrics)

    return jax.lax.scan(body, state, indices)


@jax.jit
def accuracy(state, x, y):
    with jaxmp.linen.policy_scope(state.policy, NORM_OVERRIDES):
        logits = state.apply_fn(
            {"params": state.params, "batch_stats": state.batch_stats}, x, train=False
        )
    return jnp.mean(jnp.argmax(logits, -1) == y)


@pytest.fixture(scope="module")
def trained():
    (x_train, y_train), (x_test, y_test) = digits()
    indices = batch_indices()
    out = {}
    for name, policy in POLICIES.items():
        state, (losses, metrics) = train(create_state(policy), x_train, y_train, indices)
        out[name] = (state, losses, metrics, float(accuracy(state, x_test, y_test)))
    return out


def test_import_jaxmp_does_not_import_flax():
    code = (
        "import sys, jaxmp; assert 'flax' not in sys.modules, 'flax imported'; "
        "import jaxmp.linen, jaxmp.nnx; assert 'flax' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow  # trains a classifier per policy (the fixture)
@pytest.mark.parametrize("name", ["mixed_float16", "float16_params"])
def test_mixed_precision_matches_float32_accuracy(trained, name):
    acc32 = trained["float32"][3]
    acc = trained[name][3]
    assert acc32 > 0.9, acc32
    assert abs(acc - acc32) <= 0.01, (name, acc, acc32)


@pytest.mark.slow  # the same trained classifiers
@pytest.mark.parametrize("name", list(POLICIES))
def test_trained_state_dtypes_and_loss_scale(trained, name):
    state, losses, metrics, _ = trained[name]
    policy = jaxmp.get_policy(POLICIES[name])
    assert {leaf.dtype for leaf in jax.tree.leaves(state.params)} == {policy.param_dtype}
    assert {leaf.dtype for leaf in jax.tree.leaves(state.batch_stats)} == {F32}
    assert np.all(np.isfinite(losses)) and losses[-20:].mean() < 0.25 * losses[:5].mean()
    # Every skipped step halves the dynamic scale; none advances `step`.
    skipped = int(metrics["skipped_steps"][-1])
    assert int(state.step) == STEPS - skipped
    if policy.compute_dtype == F16:
        assert isinstance(state.loss_scale, jaxmp.DynamicLossScale)
        assert float(state.loss_scale.loss_scale) == 2.0 ** (15 - skipped)
    else:
        assert isinstance(state.loss_scale, jaxmp.NoOpLossScale) and skipped == 0


@pytest.mark.parametrize(
    "overrides",
    [NORM_OVERRIDES, {r".*/LayerNorm_\d+": "float32", r".*/BatchNorm_\d+": "float32"}],
    ids=["classes", "regexes"],
)
def test_policy_scope_dtypes_inside_the_model(overrides):
    model = CNN()
    x = jnp.ones((2, 8, 8, 1))
    variables = model.init(jax.random.key(0), x)

    def apply(variables, x):
        with jaxmp.linen.policy_scope("mixed_float16", overrides):
            return model.apply(
                variables, x, mutable=["batch_stats", "intermediates"], capture_intermediates=True
            )

    (logits, state) = jax.jit(apply)(variables, x)
    calls = {
        k: v["__call__"][0].dtype for k, v in state["intermediates"].items() if k != "__call__"
    }
    assert calls == {
        "Conv_0": F16,
        "BatchNorm_0": F32,
        "Conv_1": F16,
        "Dense_0": F16,
        "LayerNorm_0": F32,
        "Dense_1": F16,
    }
    assert logits.dtype == F32  # the policy's output dtype
    assert {leaf.dtype for leaf in jax.tree.leaves(state["batch_stats"])} == {F32}
    jaxpr = jax.make_jaxpr(apply)(variables, x).jaxpr
    matmuls = primitive_dtypes(jaxpr, {"dot_general", "conv_general_dilated"})
    assert len(matmuls) == 4 and {dtype for _, dtype in matmuls} == {F16}, matmuls
    # Normalisation statistics (BatchNorm and LayerNorm means and variances).
    reductions = primitive_dtypes(jaxpr, {"reduce_sum"})
    assert len(reductions) >= 4 and {dtype for _, dtype in reductions} == {F32}, reductions


def test_policy_scope_does_not_leak():
    model = nn.Dense(3)
    x = jnp.ones((1, 2))
    variables = model.init(jax.random.key(0), x)
    bound = model.bind(variables)
    with jaxmp.linen.policy_scope("float16"):
        assert model.apply(variables, x).dtype == F16
        assert bound(x).dtype == F16
    assert model.apply(variables, x).dtype == F32
    assert bound(x).dtype == F32 and bound.dtype is None and model.dtype is None


def test_policy_scope_init_creates_params_in_param_dtype():
    model = CNN()

    @jax.jit
    def init(key):
        with jaxmp.linen.policy_scope("float16", {"/LayerNorm_0": "float32"}):
            return model.init(key, jnp.zeros((1, 8, 8, 1)))

    variables = init(jax.random.key(0))
    dtypes = jax.tree.map(lambda a: a.dtype, variables["params"])
    assert dtypes["Dense_0"] == {"kernel": F16, "bias": F16}
    assert dtypes["LayerNorm_0"] == {"scale": F32, "bias": F32}
    assert {leaf.dtype for leaf in jax.tree.leaves(variables["batch_stats"])} == {F32}


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({nn.Dense: "f12"}, ValueError, r"`overrides\[<class 'flax.linen.linear.Dense'>\]`"),
        ({int: "float32"}, TypeError, "keys must be flax.linen.module.Module subclasses"),
        ({"(": "float32"}, ValueError, "must be a valid regular expression"),
        ([nn.Dense], TypeError, "`overrides` must be a mapping"),
    ],
)
def test_policy_scope_bad_overrides(overrides, error, match):
    with pytest.raises(error, match=match):
        with jaxmp.linen.policy_scope("float16", overrides):
            pass


def test_create_initialises_master_copy_from_full_precision_params():
    state = create_state("p=f16,c=f16")
    kernel = state.params["Dense_0"]["kernel"]
    master = state.opt_state.inner_state.master["Dense_0"]["kernel"]
    assert kernel.dtype == F16 and master.dtype == F32
    model = CNN()
    full = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)), train=False)["params"]
    np.testing.assert_array_equal(master, full["Dense_0"]["kernel"])  # exact, not rounded


@pytest.mark.parametrize(
    ("tx", "state_type"),
    [
        (optax.adam(1e-3), jaxmp.MasterWeightsState),
        (jaxmp.master_weights(optax.adam(1e-3)), jaxmp.MasterWeightsState),
        (jaxmp.mixed_precision(optax.adam(1e-3), "float16"), jaxmp.MasterWeightsState),
    ],
    ids=["plain", "master_weights", "mixed_precision"],
)
def test_create_wraps_a_plain_optimizer(tx, state_type):
    state = create_state("float16", tx=tx)
    assert isinstance(state.opt_state, jaxmp.LossScalingState)
    # Exactly one master copy, whichever way the optimizer was given.
    assert isinstance(state.opt_state.inner_state, state_type)
    assert not isinstance(state.opt_state.inner_state.inner_state, jaxmp.MasterWeightsState)
    assert float(state.loss_scale.loss_scale) == 2.0**15


@pytest.mark.parametrize("policy", ["mixed_float16", "p=f16,c=f16"])
def test_skipped_step_changes_nothing_but_the_loss_scale(policy):
    (x_train, y_train), _ = digits()
    state = create_state(policy)
    step = jax.jit(train_step)
    state, _, _ = step(state, x_train[:BATCH], y_train[:BATCH], False)
    new, _, metrics = step(state, x_train[BATCH : 2 * BATCH], y_train[BATCH : 2 * BATCH], True)
    with jax.numpy_dtype_promotion("strict"):
        leaves = jax.tree.leaves((state.params, state.batch_stats, state.step))
        for old_leaf, new_leaf in zip(
            leaves, jax.tree.leaves((new.params, new.batch_stats, new.step)), strict=True
        ):
            assert old_leaf.dtype == new_leaf.dtype
            np.testing.assert_array_equal(old_leaf, new_leaf)
        for old_leaf, new_leaf in zip(
            jax.tree.leaves(state.opt_state.inner_state),
            jax.tree.leaves(new.opt_state.inner_state),
            strict=True,
        ):
            np.testing.assert_array_equal(old_leaf, new_leaf)
    assert int(metrics["skipped_steps"]) == 1 and not bool(metrics["grads_finite"])
    assert float(new.loss_scale.loss_scale) == float(state.loss_scale.loss_scale) / 2


def test_grads_structure_must_match_fp8_collection():
    state = create_state("mixed_float16")
    grads = {"params": state.params, fp8_ops.OVERWRITE_WITH_GRADIENT: {}}
    with pytest.raises(ValueError, match="only one of them has the '_overwrite_with_gradient'"):
        state.apply_gradients(grads=grads, batch_stats=state.batch_stats)


class Fp8MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16, dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp)(x)
        return nn.Dense(1)(nn.relu(x))


def _fp8_run(loss_scale, steps):
    model = Fp8MLP()
    x = jax.random.normal(jax.random.key(1), (8, 4))
    variables = model.init(jax.random.key(0), x)
    tx = jaxmp.loss_scaling(optax.sgd(0.01), jaxmp.StaticLossScale(loss_scale))
    state = jaxmp.linen.TrainState.create(
        apply_fn=model.apply, params=variables, tx=tx, policy="float32"
    )

    @jax.jit
    def step(state):
        loss = lambda v: jnp.mean(state.apply_fn(v, x) ** 2)  # noqa: E731
        _, grads = jaxmp.value_and_grad(loss)(state.loss_scale, state.params)
        return state.apply_gradients(grads=grads)

    for _ in range(steps):
        state = step(state)
    return state, float(jnp.max(jnp.abs(x)))


def test_fp8_overwrite_with_gradient_variables_are_not_unscaled():
    state, amax = _fp8_run(1024.0, steps=1)
    fp8 = state.params[fp8_ops.OVERWRITE_WITH_GRADIENT]["Dense_0"]["Fp8DirectDotGeneralOp_0"]
    # Unscaling would have divided them by 1024 (Flax's DynamicScale gives ~0.001).
    assert float(fp8["input_scale"][0]) == 1.0 and float(fp8["kernel_scale"][0]) == 1.0
    assert float(fp8["input_amax_history"][0]) == amax
    # Same FP8 input/kernel meta and params as with no loss scaling, several steps on.
    scaled, _ = _fp8_run(1024.0, steps=3)
    plain, _ = _fp8_run(1.0, steps=3)
    key = "Fp8DirectDotGeneralOp_0"
    for name in ("input_scale", "kernel_scale", "input_amax_history", "kernel_amax_history"):
        a = scaled.params[fp8_ops.OVERWRITE_WITH_GRADIENT]["Dense_0"][key][name]
        b = plain.params[fp8_ops.OVERWRITE_WITH_GRADIENT]["Dense_0"][key][name]
        np.testing.assert_array_equal(a, b)
    assert (
        float(scaled.params[fp8_ops.OVERWRITE_WITH_GRADIENT]["Dense_0"][key]["input_scale"][0])
        != 1.0
    )
    assert int(scaled.step) == 3


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, carry=None):
        return nn.LayerNorm()(nn.Dense(8)(x)), None


class _Lifted(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.remat(_Block)()(x)[0]
        scan = nn.scan(_Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        x, _ = scan()(x, None)
        x = nn.jit(_Block)()(x)[0]
        return nn.Dense(2)(x)


def test_policy_scope_reaches_into_lifted_transforms():
    model = _Lifted()
    x = jnp.ones((2, 8))
    variables = model.init(jax.random.key(0), x)

    def apply(variables, x):
        with jaxmp.linen.policy_scope("mixed_float16", NORM_OVERRIDES):
            return model.apply(variables, x)

    jaxpr = jax.make_jaxpr(apply)(variables, x).jaxpr
    matmuls = primitive_dtypes(jaxpr, {"dot_general"})
    assert len(matmuls) == 4 and {dtype for _, dtype in matmuls} == {F16}, matmuls
    assert apply(variables, x).dtype == F32


def test_nested_policy_scopes_innermost_wins():
    model = nn.Sequential([nn.Dense(3), nn.Dense(2)])
    x = jnp.ones((1, 2))
    variables = model.init(jax.random.key(0), x)
    with jaxmp.linen.policy_scope("float16"):
        with jaxmp.linen.policy_scope("p=f32,c=bf16,o=f32", {"/layers_1": "float16"}):
            y, state = model.apply(variables, x, capture_intermediates=True)
        assert model.apply(variables, x).dtype == F16
    calls = state["intermediates"]
    assert calls["layers_0"]["__call__"][0].dtype == jnp.bfloat16
    assert calls["layers_1"]["__call__"][0].dtype == F16
    assert y.dtype == F32


@pytest.mark.parametrize(
    "tx",
    [optax.adam(1e-3), jaxmp.master_weights(optax.adam(1e-3))],
    ids=["plain", "master_weights"],
)
def test_create_twice_gives_the_same_tree(tx):
    """Flax's lm1b creates the state under `jax.eval_shape`, then under `jax.jit` with
    `out_shardings` built from the abstract state: both must have the same tree."""
    model = nn.Dense(2)
    x = jnp.ones((1, 3))

    def create():
        params = model.init(jax.random.key(0), x)["params"]
        return jaxmp.linen.TrainState.create(
            apply_fn=model.apply, params=params, tx=tx, policy="mixed_float16"
        )

    abstract = jax.eval_shape(lambda: create())
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: sharding, abstract)
    state = jax.jit(lambda: create(), out_shardings=shardings)()
    assert jax.tree.structure(state) == jax.tree.structure(abstract)
    assert state.tx == create().tx


# ---------------------------------------------------------------------------------------------
# policy_scope and a module's explicit dtype: the module's own `dtype=` / `param_dtype=` wins
# over the scope's policy; an `overrides` entry matching the module wins over both.


class Configured(nn.Module):
    """Layers given their dtypes explicitly, as Flax's examples do (``dtype=config.dtype``)."""

    layer_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4, dtype=self.layer_dtype, name="explicit")(x)
        x = nn.Dense(4, name="implicit")(x)
        return nn.Dense(2, param_dtype=jnp.bfloat16, name="explicit_params")(x)


def _call_dtypes(overrides=None, policy="mixed_float16"):
    model = Configured()
    x = jnp.ones((1, 3))
    variables = model.init(jax.random.key(0), x)

    def apply(variables, x):
        with jaxmp.linen.policy_scope(policy, overrides):
            return model.apply(variables, x, capture_intermediates=True)

    y, state = jax.jit(apply)(variables, x)
    calls = state["intermediates"]
    return y, {name: calls[name]["__call__"][0].dtype for name in calls if name != "__call__"}


def test_policy_scope_keeps_an_explicit_module_dtype():
    y, calls = _call_dtypes()
    assert calls == {"explicit": F32, "implicit": F16, "explicit_params": F16}
    assert y.dtype == F32


def test_policy_scope_override_wins_over_an_explicit_module_dtype():
    _, calls = _call_dtypes({"/explicit": "float16"})
    assert calls == {"explicit": F16, "implicit": F16, "explicit_params": F16}
    _, calls = _call_dtypes({nn.Dense: "float32"})
    assert calls == {"explicit": F32, "implicit": F32, "explicit_params": F32}


def test_policy_scope_keeps_an_explicit_param_dtype_at_init():
    model = Configured()

    @jax.jit
    def init(key):
        with jaxmp.linen.policy_scope("float16"):
            return model.init(key, jnp.ones((1, 3)))

    dtypes = jax.tree.map(lambda a: a.dtype, init(jax.random.key(0))["params"])
    assert dtypes["explicit"] == {"kernel": F16, "bias": F16}  # only `dtype` was given
    assert dtypes["implicit"] == {"kernel": F16, "bias": F16}
    assert dtypes["explicit_params"] == {"kernel": jnp.bfloat16, "bias": jnp.bfloat16}


class PassesDown(nn.Module):
    """A block that passes its own ``dtype`` (default None) down to its layers."""

    dtype: jnp.dtype | None = None

    @nn.compact
    def __call__(self, x):
        return nn.LayerNorm(dtype=self.dtype)(nn.Dense(4, dtype=self.dtype)(x))


class Outer(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(PassesDown(name="block")(x))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (None, {"block": F16, "dense": F16, "norm": F16, "head": F16}),
        ({"/block": "float32"}, {"block": F32, "dense": F32, "norm": F32, "head": F16}),
        ({nn.LayerNorm: "float32"}, {"block": F32, "dense": F16, "norm": F32, "head": F16}),
    ],
    ids=["default", "parent-path", "child-class"],
)
def test_policy_scope_fills_in_a_dtype_passed_down_from_a_default(overrides, expected):
    """A block whose ``dtype`` is left at its default gets the policy's and passes it down;
    a path override on the block reaches the layers it gives its dtype to."""
    model = Outer()
    x = jnp.ones((1, 3))
    variables = model.init(jax.random.key(0), x)
    with jaxmp.linen.policy_scope("mixed_float16", overrides):
        _, state = model.apply(variables, x, capture_intermediates=True)
    calls = state["intermediates"]
    block = calls["block"]
    dtypes = {
        "block": block["__call__"][0].dtype,
        "dense": block["Dense_0"]["__call__"][0].dtype,
        "norm": block["LayerNorm_0"]["__call__"][0].dtype,
        "head": calls["Dense_0"]["__call__"][0].dtype,
    }
    assert dtypes == expected


# Older Flax's `replicate` calls `jax.device_put_replicated`, which newer jax deprecates.
@pytest.mark.filterwarnings("ignore:jax.device_put_replicated is deprecated:DeprecationWarning")
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16", "float32"])
def test_replicated_state_metrics_have_the_device_axis(policy):
    """`flax.jax_utils.replicate` (Flax's pmap examples) gives every metric the device
    axis, whatever the loss scale: Flax's wmt logs ``metrics["loss_scale"][0]``."""
    model = nn.Dense(2)
    params = model.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
    state = jaxmp.linen.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.sgd(0.1), policy=policy
    )
    replicated = jax_utils.replicate(state)
    metrics = replicated.metrics()
    n = jax.local_device_count()
    assert {k: v.shape for k, v in metrics.items()} == dict.fromkeys(metrics, (n,))
    assert float(metrics["loss_scale"][0]) == float(state.loss_scale.loss_scale)


# ---------------------------------------------------------------------------------------------
# A scope that changes no module: every module keeps an explicit dtype other than the policy's
# (Flax's lm1b passes `dtype=config.dtype`, float32, to every module), so a "float16" run would
# train entirely in float32 under a float16 loss scale. It is an error at trace time.


class AllExplicit(nn.Module):
    """Every layer given ``dtype=config.dtype`` as in Flax's lm1b (whose top module has a
    config, not a ``dtype`` of its own)."""

    layer_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4, dtype=self.layer_dtype, name="hidden")(x)
        x = nn.LayerNorm(dtype=self.layer_dtype, name="norm")(x)
        return nn.Dense(2, dtype=self.layer_dtype, name="head")(x)


def _apply_under(policy, overrides=None, model=None, method="apply"):
    model = AllExplicit() if model is None else model
    x = jnp.ones((1, 3))
    variables = model.init(jax.random.key(0), x)

    @jax.jit
    def run(variables, x):
        with jaxmp.linen.policy_scope(policy, overrides):
            if method == "init":
                return model.init(jax.random.key(0), x)
            return model.apply(variables, x)

    return run(variables, x)


@pytest.mark.parametrize("method", ["apply", "init"])
def test_policy_scope_that_changes_no_module_is_an_error(method):
    with pytest.raises(ValueError) as info:
        _apply_under("float16", method=method)
    message = str(info.value)
    assert message.startswith(
        "`policy_scope(p=f16,c=f16,o=f16)` changed no module: the 3 modules called in it with "
        "a `dtype` all keep their own (/hidden: float32, /norm: float32, /head: float32)"
    ), message
    assert "`dtype=None`" in message
    assert "overrides={nn.LayerNorm: 'float32', nn.Module: 'p=f16,c=f16,o=f16'}" in message


def test_policy_scope_way_out_from_the_error_works():
    # The way out the message gives: an override for every module, the norm kept float32.
    y = _apply_under("float16", {nn.LayerNorm: "float32", nn.Module: "float16"})
    assert y.dtype == F16
    # Or the modules given the policy's dtype: then they follow it.
    assert _apply_under("float16", model=AllExplicit(layer_dtype=jnp.float16)).dtype == F16


@pytest.mark.parametrize(
    "policy",
    ["float32", "mixed_float16"],
    ids=["same-dtype", "one-module-follows"],
)
def test_policy_scope_that_changes_some_module_is_not_an_error(policy):
    if policy == "float32":  # every module already computes in the policy's dtype
        assert _apply_under(policy).dtype == F32
    else:  # `Configured`: one explicit float32 layer, the others follow the scope
        assert _apply_under(policy, model=Configured()).dtype == F32


def test_policy_scope_without_modules_or_with_an_error_inside_keeps_quiet():
    with jaxmp.linen.policy_scope("float16"):
        pass
    with pytest.raises(ZeroDivisionError):
        with jaxmp.linen.policy_scope("float16"):
            AllExplicit().init(jax.random.key(0), jnp.ones((1, 3)))
            _ = 1 / 0
