"""jaxmp.nnx: set_policy, value_and_grad and Optimizer, trained on scikit-learn's 8x8 digits."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from sklearn.datasets import load_digits

import jaxmp
import jaxmp.nnx

from .conftest import F16, F32, assert_close, primitive_dtypes

STEPS = 300
BATCH = 64
OVERRIDES = {nnx.LayerNorm: "float32"}
POLICIES = {
    "float32": "float32",
    "mixed_float16": "mixed_float16",
    "float16_params": "p=f16,c=f16,o=f32",
    # The same, in the usual order: set_policy first, then the optimizer.
    "float16_params_set_policy_first": "p=f16,c=f16,o=f32",
}


def digits():
    """Train/test split of the flattened 8x8 digits in [0, 1], fixed order."""
    x, y = load_digits(return_X_y=True)
    perm = np.random.default_rng(0).permutation(len(x))
    x = (x[perm] / 16.0).astype(np.float32)
    y = y[perm].astype(np.int32)
    return (x[:1437], y[:1437]), (x[1437:], y[1437:])


class MLP(nnx.Module):
    """A small MLP written in float32 (no dtype anywhere)."""

    def __init__(self, rngs):
        self.hidden = nnx.Linear(64, 128, rngs=rngs)
        self.norm = nnx.LayerNorm(128, rngs=rngs)
        self.out = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.norm(self.hidden(x))))


def make(
    policy, seed=0, loss_scale=None, optimizer_cls=jaxmp.nnx.Optimizer, set_policy_first=False
):
    """The model and optimizer. Created before `set_policy`, the optimizer's master copy
    starts from the float32 params; after it, from the params rounded to float16."""
    model = MLP(nnx.Rngs(seed))
    tx = jaxmp.mixed_precision(optax.adam(3e-3), policy, loss_scale)
    if set_policy_first:
        jaxmp.nnx.set_policy(model, policy, OVERRIDES)
        optimizer = optimizer_cls(model, tx, wrt=nnx.Param)
    else:
        optimizer = optimizer_cls(model, tx, wrt=nnx.Param)
        jaxmp.nnx.set_policy(model, policy, OVERRIDES)
    return model, optimizer


def loss_fn(model, x, y, policy):
    logits = jaxmp.get_policy(policy).cast_to_output(model(x))
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def train_step(model, optimizer, x, y, policy, poison=False):
    loss, grads = jaxmp.nnx.value_and_grad(loss_fn)(
        jaxmp.get_loss_scale(optimizer), model, x, y, policy
    )
    # `poison` (a traced bool) puts an inf into every gradient, as an overflow would.
    grads = jax.tree.map(lambda g: g.at[(0,) * g.ndim].add(jnp.where(poison, jnp.inf, 0)), grads)
    optimizer.update(model, grads)
    return loss, jaxmp.loss_scale_metrics(optimizer)


jit_train_step = nnx.jit(train_step, static_argnames="policy")


@nnx.jit(static_argnames="policy")
def accuracy(model, x, y, policy):
    logits = jaxmp.get_policy(policy).cast_to_output(model(x))
    return jnp.mean(jnp.argmax(logits, -1) == y)


@pytest.fixture(scope="module")
def trained():
    (x_train, y_train), (x_test, y_test) = digits()
    rng = np.random.default_rng(0)
    indices = [rng.choice(1437, BATCH, replace=False) for _ in range(STEPS)]
    out = {}
    for name, policy in POLICIES.items():
        model, optimizer = make(policy, set_policy_first=name.endswith("set_policy_first"))
        losses, skipped = [], 0
        for idx in indices:
            loss, metrics = jit_train_step(model, optimizer, x_train[idx], y_train[idx], policy)
            losses.append(loss)
        skipped = int(metrics["skipped_steps"])
        acc = float(accuracy(model, x_test, y_test, policy))
        out[name] = (model, optimizer, np.asarray(losses), skipped, acc)
    return out


@pytest.mark.slow  # trains a classifier per policy (the fixture)
@pytest.mark.parametrize(
    "name", ["mixed_float16", "float16_params", "float16_params_set_policy_first"]
)
def test_mixed_precision_matches_float32_accuracy(trained, name):
    acc32 = trained["float32"][4]
    acc = trained[name][4]
    assert acc32 > 0.9, acc32
    assert abs(acc - acc32) <= 0.01, (name, acc, acc32)


@pytest.mark.slow  # the same trained classifiers
@pytest.mark.parametrize("name", list(POLICIES))
def test_trained_model_dtypes_and_loss_scale(trained, name):
    model, optimizer, losses, skipped, _ = trained[name]
    policy = jaxmp.get_policy(POLICIES[name])
    params = nnx.state(model, nnx.Param)
    assert params["hidden"]["kernel"].get_value().dtype == policy.param_dtype
    assert params["out"]["kernel"].get_value().dtype == policy.param_dtype
    assert params["norm"]["scale"].get_value().dtype == F32  # the override
    assert np.all(np.isfinite(losses)) and losses[-20:].mean() < 0.25 * losses[:5].mean()
    assert int(optimizer.step[...]) == STEPS - skipped  # skipped steps do not count
    loss_scale = jaxmp.get_loss_scale(optimizer)
    if policy.compute_dtype == F16:
        assert isinstance(loss_scale, jaxmp.DynamicLossScale)
        assert float(loss_scale.loss_scale) == 2.0 ** (15 - skipped)
    else:
        assert isinstance(loss_scale, jaxmp.NoOpLossScale) and skipped == 0


@pytest.mark.parametrize(
    ("policy", "overrides"),
    [
        ("mixed_float16", OVERRIDES),
        ("p=f16,c=f16", OVERRIDES),
        ("p=f16,c=f16", {"/norm": "float32"}),
        ("p=f16,c=f16", {r".*/no.*": "float32"}),
    ],
    ids=["mixed-class", "f16-class", "f16-path", "f16-regex"],
)
def test_set_policy_dtypes_inside_the_model(policy, overrides):
    model = MLP(nnx.Rngs(0))
    assert jaxmp.nnx.set_policy(model, policy, overrides) is model
    param_dtype = jaxmp.get_policy(policy).param_dtype
    assert model.hidden.kernel.get_value().dtype == param_dtype
    assert model.hidden.bias.get_value().dtype == param_dtype
    assert model.norm.scale.get_value().dtype == F32 and model.norm.dtype == F32
    assert model.hidden.dtype == F16 and model.hidden.param_dtype == param_dtype

    graphdef, state = nnx.split(model)
    x = jnp.ones((2, 64))
    jaxpr = jax.make_jaxpr(lambda state, x: nnx.merge(graphdef, state)(x))(state, x).jaxpr
    matmuls = primitive_dtypes(jaxpr, {"dot_general"})
    assert len(matmuls) == 2 and {dtype for _, dtype in matmuls} == {F16}, matmuls
    reductions = primitive_dtypes(jaxpr, {"reduce_sum"})
    assert len(reductions) >= 2 and {dtype for _, dtype in reductions} == {F32}, reductions
    assert model(x).dtype == F16  # the last layer's compute dtype; cast_to_output for o=f32


def test_set_policy_keeps_batch_stats_float32():
    model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.BatchNorm(4, rngs=nnx.Rngs(0)))
    jaxmp.nnx.set_policy(model, "float16")
    bn = model.layers[1]
    assert bn.scale.get_value().dtype == F16
    assert bn.mean.get_value().dtype == F32 and bn.var.get_value().dtype == F32
    model(jnp.ones((5, 3)))
    assert bn.mean.get_value().dtype == F32


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((jnp.ones(2), "float16"), TypeError, "`model` must be an nnx.Module, got ArrayImpl"),
        ((MLP(nnx.Rngs(0)), "float12"), ValueError, "'float12' in `policy`"),
        ((MLP(nnx.Rngs(0)), "float16", {int: "float32"}), TypeError, "nnx.*Module subclasses"),
        ((MLP(nnx.Rngs(0)), "float16", {"/norm": "x"}), ValueError, r"`overrides\['/norm'\]`"),
    ],
)
def test_set_policy_errors(args, error, match):
    with pytest.raises(error, match=match):
        jaxmp.nnx.set_policy(*args)


def test_value_and_grad_scales_the_gradients():
    model = MLP(nnx.Rngs(0))
    x, y = jnp.ones((4, 64)), jnp.arange(4)
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y, "float32")

    def aux_loss(model, x, y):
        return loss_fn(model, x, y, "float32"), {"n": x.shape[0]}

    g = jaxmp.nnx.value_and_grad(aux_loss, has_aux=True)
    (loss2, aux), grads2 = g(jaxmp.StaticLossScale(1024.0), model, x, y)
    assert loss2 == loss and aux == {"n": 4}
    assert jax.tree.structure(grads) == jax.tree.structure(grads2)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads2), strict=True):
        assert_close(np.asarray(b) / 1024, a, F32)
    with pytest.raises(TypeError, match="must return a scalar loss, got shape"):
        jaxmp.nnx.value_and_grad(lambda m: m(x))(1.0, model)
    with pytest.raises(TypeError, match="must return a pair"):
        jaxmp.nnx.value_and_grad(lambda m: loss_fn(m, x, y, "float32"), has_aux=True)(1.0, model)


@pytest.mark.parametrize("optimizer_cls", [jaxmp.nnx.Optimizer, nnx.Optimizer])
@pytest.mark.parametrize("policy", ["mixed_float16", "p=f16,c=f16,o=f32"])
def test_skipped_step_changes_nothing_but_the_loss_scale(policy, optimizer_cls):
    (x_train, y_train), _ = digits()
    model, optimizer = make(policy, optimizer_cls=optimizer_cls)
    jit_train_step(model, optimizer, x_train[:BATCH], y_train[:BATCH], policy, False)
    before = jax.tree.map(np.asarray, nnx.state((model, optimizer)))
    scale = float(jaxmp.get_loss_scale(optimizer).loss_scale)
    _, metrics = jit_train_step(
        model, optimizer, x_train[BATCH : 2 * BATCH], y_train[BATCH : 2 * BATCH], policy, True
    )
    after = nnx.state((model, optimizer))
    with jax.numpy_dtype_promotion("strict"):
        model_before, model_after = before[0], after[0]
        for a, b in zip(jax.tree.leaves(model_before), jax.tree.leaves(model_after), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)
        inner_before = before[1]["opt_state"]["inner_state"]
        inner_after = after[1]["opt_state"]["inner_state"]
        for a, b in zip(jax.tree.leaves(inner_before), jax.tree.leaves(inner_after), strict=True):
            np.testing.assert_array_equal(a, b)
    assert int(metrics["skipped_steps"]) == 1 and not bool(metrics["grads_finite"])
    assert float(jaxmp.get_loss_scale(optimizer.opt_state).loss_scale) == scale / 2
    # jaxmp.nnx.Optimizer counts applied steps; nnx.Optimizer counts attempts.
    expected_step = 1 if optimizer_cls is jaxmp.nnx.Optimizer else 2
    assert int(optimizer.step[...]) == expected_step


def test_loss_scale_readers_accept_the_optimizer_and_its_state():
    model, optimizer = make("mixed_float16", loss_scale=jaxmp.DynamicLossScale(4.0))
    for holder in (optimizer, optimizer.opt_state):
        assert float(jaxmp.get_loss_scale(holder).loss_scale) == 4.0
        metrics = nnx.jit(jaxmp.loss_scale_metrics)(holder)
        assert float(metrics["loss_scale"]) == 4.0 and metrics["skipped_steps"].dtype == jnp.int32
    assert float(optimizer.loss_scale.loss_scale) == 4.0
    assert int(optimizer.metrics()["consecutive_skipped_steps"]) == 0


@pytest.mark.parametrize("set_policy_first", [False, True], ids=["optimizer_first", "natural"])
def test_master_copy_starts_from_the_params_the_optimizer_sees(set_policy_first):
    """Both orders work. The master copy starts from the params as they are when the
    optimizer is created: exactly the float32 init, or the init rounded to float16."""
    init = MLP(nnx.Rngs(0))
    init_kernel = np.asarray(init.hidden.kernel.get_value())
    model, optimizer = make("p=f16,c=f16,o=f32", set_policy_first=set_policy_first)
    assert model.hidden.kernel.get_value().dtype == F16
    master = optimizer.opt_state.inner_state.master["hidden"]["kernel"].get_value()
    assert master.dtype == F32
    expected = (
        init_kernel.astype(np.float16).astype(np.float32) if set_policy_first else init_kernel
    )
    np.testing.assert_array_equal(master, expected)
    assert not np.array_equal(init_kernel.astype(np.float16).astype(np.float32), init_kernel)


def test_outputs_have_the_last_layers_dtype_and_cast_to_output_gives_the_policys():
    """set_policy changes the modules, not the model's own code: the output has the dtype
    the last layer computes in; `policy.cast_to_output` gives the policy's output dtype."""
    policy = jaxmp.get_policy("mixed_float16")
    model = jaxmp.nnx.set_policy(MLP(nnx.Rngs(0)), policy, OVERRIDES)
    x = jnp.ones((2, 64))
    assert model(x).dtype == F16
    assert policy.cast_to_output(model(x)).dtype == F32
    # Overriding the last layer changes its compute dtype, so the output's.
    jaxmp.nnx.set_policy(model, policy, {**OVERRIDES, "/out": "float32"})
    assert model(x).dtype == F32


@pytest.mark.parametrize(
    ("first", "described"),
    [
        (lambda model, x: model, "an nnx.Module (Linear)"),
        (lambda model, x: x, "an array of shape (4, 2) and dtype float32"),
        (lambda model, x: nnx.state(model), "an nnx.State"),
        (lambda model, x: "mixed_float16", "a str"),
    ],
    ids=["module", "batch", "state", "string"],
)
def test_value_and_grad_without_the_loss_scale_says_so(first, described):
    """Forgetting the loss scale (``value_and_grad(loss_fn)(model, x)``) gives a short
    error naming the first argument as the loss scale, not the model's repr."""
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    x = jnp.ones((4, 2))

    @nnx.jit
    def step(model, x):
        loss_fn = lambda m, x: jnp.mean(m(x) ** 2)  # noqa: E731
        return jaxmp.nnx.value_and_grad(loss_fn)(first(model, x), model, x)

    with pytest.raises(TypeError) as info:
        step(model, x)
    message = str(info.value)
    assert message.startswith(
        "The first argument of the function that `jaxmp.nnx.value_and_grad` returns must be "
        f"the loss scale, got {described}."
    ), message
    assert "optimizer.loss_scale, model" in message
    assert "kernel" not in message and len(message) < 500, message


def test_float8_signature_is_its_constructors():
    """`inspect.signature` (and so the API page) shows the constructor's arguments, not the
    ``(*args, **kwargs)`` of NNX's metaclass; an instance's is that of its ``__call__``."""
    params = inspect.signature(jaxmp.nnx.Float8).parameters
    assert list(params) == [
        "model",
        "policy",
        "recipe",
        "example_args",
        "exclude",
        "example_kwargs",
    ]
    assert params["exclude"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["exclude"].default is None
    model = jaxmp.nnx.Float8(
        nnx.Linear(4, 4, rngs=nnx.Rngs(0)), "mixed_bfloat16", jaxmp.Float8CurrentScaling()
    )
    assert list(inspect.signature(model).parameters) == ["args", "kwargs"]
    assert nnx.graph.is_graph_node(model)
    y = nnx.jit(lambda m, x: m(x))(model, jnp.ones((2, 4)))
    assert y.shape == (2, 4)
