"""`compress_state`: moments stored in bfloat16 or 8 bits, second moments' small values kept."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from jaxmp._src import compress_state as compress_lib
from tests.conftest import BF16, F32

FORMATS = ("bfloat16", "int8", "fp8")
STORED = {"bfloat16": BF16, "int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn)}


def test_which_leaves_are_compressed():
    params = {"w": jnp.ones((4, 64)), "b": jnp.ones(64), "s": jnp.ones(())}
    inner = optax.chain(
        optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
        optax.sgd(0.1, momentum=0.9),
    )
    state = jax.jit(jaxmp.compress_state(inner, "bf16", "int8", block_size=32).init)(params)
    adam = state.inner_state[0].inner_state[0]
    trace = state.inner_state[1][0].trace
    assert int(adam.count) == 0 and adam.count.dtype == jnp.int32
    # Scalars are kept: the scalar param's moments and the injected learning rate.
    assert adam.mu["s"].dtype == F32 and adam.nu["s"].dtype == F32
    assert state.inner_state[0].hyperparams["learning_rate"].dtype == F32
    # The stored values in each leaf's place, the formats and scales beside them.
    for name, shape in (("w", (4, 64)), ("b", (64,))):
        assert adam.mu[name].dtype == trace[name].dtype == BF16
        assert adam.nu[name].dtype == jnp.int8
        assert adam.mu[name].shape == adam.nu[name].shape == shape
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(
        state.inner_state)]  # fmt: skip
    described = {
        paths[c.index]: (c.format, c.second_moment, None if c.scales is None else c.scales.shape)
        for c in state.compressed
    }
    assert described == {
        "[0].inner_state[0].mu['b']": ("bfloat16", False, None),
        "[0].inner_state[0].mu['w']": ("bfloat16", False, None),
        # One float32 scale per block of 32 elements of a row (all but the first dimension).
        "[0].inner_state[0].nu['b']": ("int8", True, (2,)),
        "[0].inner_state[0].nu['w']": ("int8", True, (4, 2)),
        "[1][0].trace['b']": ("bfloat16", False, None),
        "[1][0].trace['w']": ("bfloat16", False, None),
    }


def test_amsgrad_max_is_a_second_moment():
    state = jax.jit(jaxmp.compress_state(optax.amsgrad(1e-3), "int8").init)({"w": jnp.ones(8)})
    assert [c.second_moment for c in state.compressed] == [False, True, True]  # mu, nu, nu_max


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("second", [False, True], ids=["first", "second"])
def test_round_trip(fmt, second):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 300)).astype(np.float32)  # 300: the last block is padded
    if second:
        x = x**2 * np.exp(rng.normal(size=x.shape) * 2).astype(np.float32)
    keys = jax.random.key_data(jax.random.split(jax.random.key(0), 256))

    def round_trip(key):
        values, scales = compress_lib.compress(
            jnp.asarray(x), fmt, second_moment=second, block_size=128, words=key
        )
        leaf = jaxmp.CompressedLeaf(scales, 0, fmt, F32, second, 128)
        return values, leaf.decompress(values)

    values, out = jax.jit(jax.vmap(round_trip))(keys)
    assert values.dtype == STORED[fmt] and values.shape[1:] == x.shape and out.dtype == F32
    out = np.asarray(out, np.float64)
    error = np.abs(out - x)
    if fmt == "bfloat16":
        assert np.all(error <= np.abs(x) * 2.0**-7)
    elif fmt == "fp8" and not second:
        # Three bits of mantissa: relative to the value, except in float8's subnormal range.
        assert np.median(error / np.abs(x)) <= 2.0**-3
    elif not second:
        # int8: at most one level (the block's largest magnitude over 127) away.
        blocks = np.pad(np.abs(x), [(0, 0), (0, 84)]).reshape(16, 3, 128).max(-1)
        level = np.repeat(blocks / 127, 128, axis=-1)[:, :300]
        assert np.all(error <= level * (1 + 1e-6))
    # Unbiased: the mean over 256 keys is off from x by about its standard error, no more
    # (the second moment, never rounded to zero, is biased up where it rounds to the
    # smallest level).
    if not second:
        spread = out.std(0) / np.sqrt(256)
        rounded = spread > 0
        assert rounded.mean() > 0.9  # a deterministic rounding would not be tested here
        z = ((out.mean(0) - x) / np.where(rounded, spread, 1))[rounded]
        assert abs(z.mean()) <= 5 / np.sqrt(z.size) and np.mean(z**2) <= 1.3
    else:
        assert np.all(out > 0)  # a positive second moment stays positive
        assert np.median(np.abs(out.mean(0) - x) / x) <= 0.05


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_small_second_moments_are_never_zero(fmt):
    # One block spanning 14 decades: int8 on nu itself would round all but the largest
    # values to 0, and Adam would then divide the first moment by eps alone.
    nu = jnp.asarray(np.logspace(-14, 0, 256), F32)
    values, scales = compress_lib.compress(
        nu, fmt, second_moment=True, block_size=256, words=jnp.asarray([1, 2], jnp.uint32)
    )
    out = np.asarray(jaxmp.CompressedLeaf(scales, 0, fmt, F32, True, 256).decompress(values))
    assert np.all(out > 0)
    assert np.all(out[nu > 1e-4] <= 2 * np.asarray(nu)[nu > 1e-4])


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_8bit_adam_updates_stay_bounded(fmt):
    # A block with one large gradient and tiny ones: Adam's update is about the learning
    # rate for every element; a second moment rounded to 0 would make it 100x that.
    lr = 1e-3
    grads = {"w": jnp.full((1, 256), 1e-6).at[0, 0].set(1.0)}
    params = {"w": jnp.zeros((1, 256))}
    tx = jaxmp.compress_state(optax.adam(lr), fmt)
    state = jax.jit(tx.init)(params)
    step = jax.jit(tx.update)
    for _ in range(20):
        updates, state = step(grads, state, params)
        assert float(jnp.max(jnp.abs(updates["w"]))) <= 2 * lr


@pytest.mark.parametrize("fmt", FORMATS)
def test_compressed_adam_follows_float32_adam(fmt):
    # Least squares with Adam: the compressed run's loss stays within a few percent of the
    # float32 run's at every step (bfloat16 within 1%).
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(64, 32)), F32)
    target = jnp.asarray(rng.normal(size=(64, 16)), F32)

    def loss(w):
        return jnp.mean((a @ w - target) ** 2)

    def train(tx):
        w = jnp.zeros((32, 16))
        state = jax.jit(tx.init)(w)

        @jax.jit
        def step(w, state):
            value, grad = jax.value_and_grad(loss)(w)
            updates, state = tx.update(grad, state, w)
            return optax.apply_updates(w, updates), state, value

        values = []
        for _ in range(100):
            w, state, value = step(w, state)
            values.append(float(value))
        return np.array(values)

    reference = train(optax.adam(3e-2))
    compressed = train(jaxmp.compress_state(optax.adam(3e-2), fmt, block_size=64))
    assert reference[-1] < 0.7 * reference[0]
    tolerance = 0.01 if fmt == "bfloat16" else 0.05
    np.testing.assert_allclose(compressed, reference, rtol=tolerance)


def test_key_moves_and_state_is_stable():
    tx = jaxmp.compress_state(optax.adam(1e-2), "int8", "fp8", seed=5)
    params = {"w": jnp.ones((8, 40))}
    state = jax.jit(tx.init)(params)
    updates, new_state = jax.jit(tx.update)({"w": jnp.ones((8, 40))}, state, params)
    chex.assert_trees_all_equal_structs(new_state, state)
    chex.assert_trees_all_equal_dtypes(new_state, state)
    assert new_state.key.dtype == jnp.uint32 and not np.array_equal(new_state.key, state.key)
    decompressed = jaxmp.inner_state(new_state)[0]
    assert isinstance(decompressed, optax.ScaleByAdamState)
    assert decompressed.nu["w"].dtype == F32 and int(decompressed.count) == 1
    np.testing.assert_allclose(decompressed.nu["w"], 0.001, rtol=0.02)  # (1 - b2) * 1**2


def test_bad_arguments():
    adam = optax.adam(1e-3)
    with pytest.raises(ValueError, match=r"`first_moment` must be one of .* Did you mean 'int8'\?"):
        jaxmp.compress_state(adam, "int9")
    with pytest.raises(ValueError, match=r"`second_moment` must be one of .*got 'bf61'"):
        jaxmp.compress_state(adam, "bf16", "bf61")
    with pytest.raises(TypeError, match="`first_moment` must be a storage format name"):
        jaxmp.compress_state(adam, object())
    with pytest.raises(ValueError, match="`block_size` must be a positive int, got 0"):
        jaxmp.compress_state(adam, block_size=0)
    with pytest.raises(TypeError, match="`second_moment_names` must be a sequence"):
        jaxmp.compress_state(adam, second_moment_names="nu")
    assert compress_lib.parse_format(jnp.bfloat16, arg="x") == "bfloat16"
    assert compress_lib.parse_format("FP8", arg="x") == "fp8"
