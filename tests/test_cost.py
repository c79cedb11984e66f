"""Memory-traffic regressions (XLA's cost model, deterministic) and retracing.

Figures are bytes accessed of one jitted optimizer update plus `optax.apply_updates`, from
``jax.jit(f).lower(...).compile().cost_analysis()``. They are exact for a given jax/jaxlib and
backend, so these tests check ratios, never times. `benchmarks/update_cost.py` prints the same
figures with a breakdown by fusion.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from tests.conftest import BF16, F16, F32, HALF_DTYPES

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="the byte figures are XLA:CPU's cost model"
)

# A moderately sized tree with the leaf shapes of a small transformer layer (345k params).
SHAPES = {
    "embed": (64, 256),
    "attn": {"kernel": (256, 256), "bias": (256,)},
    "mlp": {"fc": (256, 512), "proj": (512, 256), "bias": (512,)},
    "ln": {"scale": (256,), "bias": (256,)},
}
# The finiteness check writes one bool per row of up to 512 elements (`jaxmp.all_finite`):
# the bytes beyond one read of the gradients, as a fraction of that read, stay below this.
CHECK_SLACK = 0.002


def _tree(dtype):
    return jax.tree.map(
        lambda s: jnp.zeros(s, dtype), SHAPES, is_leaf=lambda s: isinstance(s, tuple)
    )


def _nbytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _update_bytes(tx, params, grads):
    opt_state = jax.eval_shape(tx.init, jax.tree.map(lambda p: p.astype(F32), params))

    def step(grads, opt_state, params):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    compiled = jax.jit(step).lower(grads, opt_state, params).compile()
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0]
    return analysis["bytes accessed"]


@pytest.mark.parametrize(
    "inner", [optax.adam(1e-3), optax.sgd(1e-2, momentum=0.9)], ids=["adam", "sgd_momentum"]
)
def test_loss_scaling_costs_one_read_of_the_grads(inner):
    params = _tree(F32)
    plain = _update_bytes(inner, params, params)
    wrapped = _update_bytes(jaxmp.loss_scaling(inner), params, params)
    assert wrapped - plain <= _nbytes(params) * (1 + CHECK_SLACK)


def test_loss_scaling_around_global_norm_clipping():
    # The norm is a reduction, which XLA:CPU runs as a library call that takes its input
    # from memory: the unscaled gradients are written out for it and read back (two more
    # float32 copies than without loss scaling, where it reads the gradients directly).
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    params = _tree(F32)
    plain = _update_bytes(inner, params, params)
    wrapped = _update_bytes(jaxmp.loss_scaling(inner), params, params)
    assert wrapped - plain <= _nbytes(params) * (3 + CHECK_SLACK)


def test_loss_scaling_adam_within_1_10x():
    params = _tree(F32)
    adam = _update_bytes(optax.adam(1e-3), params, params)
    wrapped = _update_bytes(jaxmp.loss_scaling(optax.adam(1e-3)), params, params)
    # Adam reads and writes 10 float32 copies of the params; the check reads the gradients
    # once more: exactly 1.10x, plus the check's per-row booleans.
    assert wrapped <= 1.10 * adam + CHECK_SLACK * _nbytes(params)


def test_count_saturated_costs_one_read_of_the_master_copy():
    # The opt-in count reads the written float32 master copy once more (BENCHMARKS.md).
    params = _tree(F16)
    plain = _update_bytes(
        jaxmp.loss_scaling(jaxmp.master_weights(optax.adam(1e-3))), params, params
    )
    counted = jaxmp.loss_scaling(jaxmp.master_weights(optax.adam(1e-3), count_saturated=True))
    extra = _update_bytes(counted, params, params) - plain
    assert extra <= _nbytes(_tree(F32)) * (1 + CHECK_SLACK)


def test_check_outputs_within_2_31x():
    # The opt-in output check cannot select at source: 2.30x of Adam (BENCHMARKS.md).
    params = _tree(F32)
    adam = _update_bytes(optax.adam(1e-3), params, params)
    checked = _update_bytes(
        jaxmp.loss_scaling(optax.adam(1e-3), check_outputs=True), params, params
    )
    assert checked <= 2.31 * adam


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
def test_mixed_precision_half_params_within_1_20x_of_float32_adam(dtype):
    adam = _update_bytes(optax.adam(1e-3), _tree(F32), _tree(F32))
    policy = f"p={jnp.dtype(dtype).name},c={jnp.dtype(dtype).name}"
    tx = jaxmp.mixed_precision(optax.adam(1e-3), policy)
    mixed = _update_bytes(tx, _tree(dtype), _tree(dtype))
    assert mixed <= 1.20 * adam


@pytest.mark.parametrize("shape", [(512, 1024), (1000, 777), (2048, 512), (4096,), (8, 4)])
@pytest.mark.parametrize("dtype", [F16, F32], ids=lambda d: d.name)
def test_all_finite_reads_each_leaf_once(shape, dtype):
    x = jnp.zeros(shape, dtype)
    analysis = jax.jit(jaxmp.all_finite).lower(x).compile().cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0]
    # One read, plus one bool per row of 28 to 512 elements and the reduction's tail.
    assert analysis["bytes accessed"] <= x.nbytes * 1.04 + 64


@pytest.mark.parametrize("shape", [(512, 1024), (1000, 777), (3, 1031), (33,), (8, 4), (0, 3)])
@pytest.mark.parametrize("dtype", [F16, F32], ids=lambda d: d.name)
def test_all_finite_row_check_finds_every_position(shape, dtype):
    check = jax.jit(jaxmp.all_finite)
    n = int(np.prod(shape))
    assert bool(check(jnp.ones(shape, dtype)))
    for position in sorted({0, n // 3, n - 1}) if n else []:
        for bad in (np.nan, np.inf, -np.inf):
            y = np.ones(n, dtype)
            y[position] = bad
            assert not bool(check(jnp.asarray(y.reshape(shape))))


@pytest.mark.parametrize("policy", ["mixed_float16", "p=f16,c=f16", "mixed_bfloat16"])
def test_train_step_traces_once(policy):
    """A full train step (loss scale read from the state) is traced once, skips included."""
    traces = []
    param_dtype = jaxmp.get_policy(policy).param_dtype
    compute = jaxmp.get_policy(policy).compute_dtype
    tx = jaxmp.mixed_precision(optax.adam(1e-3), policy)

    def loss_fn(params, x):
        h = jnp.tanh(x.astype(compute) @ params["w1"].astype(compute))
        return jnp.mean((h @ params["w2"].astype(compute)).astype(F32) ** 2)

    @jax.jit
    def train_step(params, opt_state, x):
        traces.append(1)
        loss_scale = jaxmp.get_loss_scale(opt_state)
        loss, grads = jaxmp.value_and_grad(loss_fn)(loss_scale, params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        metrics = jaxmp.loss_scale_metrics(opt_state)
        return optax.apply_updates(params, updates), opt_state, loss, metrics

    full = {"w1": jnp.full((8, 16), 0.1, F32), "w2": jnp.full((16, 4), 0.1, F32)}
    opt_state = tx.init(full)
    params = jaxmp.cast_tree(full, param_dtype)
    x = jnp.ones((4, 8), F32)
    skipped = []
    for step in range(4):
        batch = x * (1e6 if step == 1 else 1.0)  # step 1 overflows float16
        params, opt_state, _, metrics = train_step(params, opt_state, batch)
        skipped.append(int(metrics["skipped_steps"]))
        assert all(p.dtype == param_dtype for p in jax.tree.leaves(params))
    assert len(traces) == 1
    assert skipped[-1] == (1 if policy != "mixed_bfloat16" else 0)


# --- Low-memory modes (bfloat16 params, no master copy) ---------------------------------------


def _low_memory_bytes(**kwargs):
    tx = jaxmp.mixed_precision(optax.adam(1e-3), "bf16", master_weights=False, **kwargs)
    return _update_bytes(tx, _tree(BF16), _tree(BF16))


def test_stochastic_rounding_costs_what_round_to_nearest_does():
    # The random bits are a hash of each element's index, fused into the update: nothing is
    # written or read for them (jax.random.bits would add 14 float32 copies of the params).
    nearest = _low_memory_bytes()
    stochastic = _low_memory_bytes(rounding="stochastic")
    assert stochastic <= nearest + CHECK_SLACK * _nbytes(_tree(F32))


@pytest.mark.parametrize(("moments", "at_most"), [("bf16", 0.61), ("int8", 0.63), ("fp8", 0.63)])
def test_compressed_moments_cost_less_than_float32_adam(moments, at_most):
    # bfloat16 moments and params: 6.0 float32 copies of the params against Adam's 10; 8-bit
    # moments 6.1 with jax 0.10, 6.2 with jax 0.12 (their block maxima, each compared as int32
    # 32 at a time, fuse with the moments' computation: a float or wider reduction would write
    # the moments out).
    adam = _update_bytes(optax.adam(1e-3), _tree(F32), _tree(F32))
    assert _low_memory_bytes(rounding="stochastic", moments=moments) <= at_most * adam


def test_kahan_summation_within_1_56x_of_float32_adam():
    # The compensated update is needed by both the params and the buffer: XLA writes it out
    # (15.5 float32 copies of the params against Adam's 10, BENCHMARKS.md).
    adam = _update_bytes(optax.adam(1e-3), _tree(F32), _tree(F32))
    assert _low_memory_bytes(rounding="kahan") <= 1.56 * adam
