"""`stochastic_round` and `stochastic_rounding`: unbiased, small updates kept, never inf."""

import functools

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from tests.conftest import BF16, F16, F32, HALF_DTYPES

FP8 = jnp.dtype(jnp.float8_e4m3fn)
ROUNDED = (BF16, F16, FP8)
SAMPLES = 4096


def _neighbours(x, dtype):
    """The values of `dtype` just below and just above float32 `x` (equal when exact)."""
    bits = {1: np.uint8, 2: np.uint16}[jnp.dtype(dtype).itemsize]
    every = np.arange(2 ** (8 * np.dtype(bits).itemsize)).astype(bits).view(dtype)
    with np.errstate(invalid="ignore"):  # the NaN codes
        every = every.astype(np.float64)
    every = np.unique(every[np.isfinite(every)])
    x = np.asarray(x, np.float64)
    lower = every[np.searchsorted(every, x, side="right") - 1]
    upper = every[np.searchsorted(every, x, side="left")]
    return lower, upper


def _values(dtype):
    rng = np.random.default_rng(0)
    # The subnormal range of float16 and float8 (that of bfloat16 is float32's, whose
    # subnormals the CPU backend flushes to zero).
    tiny = float(jnp.finfo(dtype).smallest_normal) if dtype != BF16 else 1e-30
    x = np.concatenate(
        [
            rng.normal(size=24) * 3,
            rng.uniform(-1, 1, size=4) * tiny,
            [1 + 2.0**-12, -(1 + 2.0**-12), 0.0],
        ]
    )
    return jnp.asarray(x, F32)


@pytest.mark.parametrize("dtype", ROUNDED, ids=lambda d: d.name)
def test_stochastic_round_is_unbiased(dtype):
    x = _values(dtype)
    lower, upper = _neighbours(x, dtype)
    samples = jax.jit(
        lambda k: jaxmp.stochastic_round(jnp.broadcast_to(x, (SAMPLES, x.size)), dtype, k)
    )(jax.random.key(1))
    assert samples.dtype == dtype
    values = np.asarray(samples.astype(F32), np.float64)
    # Every sample is one of the two neighbours.
    assert np.all((values == lower) | (values == upper))
    # Each rounding has a variance of at most (upper - lower)**2 / 4: the mean of SAMPLES of
    # them is within 5 standard deviations of x (a test that a bias of 1/20 of a spacing fails).
    bound = 5 * (upper - lower) / (2 * np.sqrt(SAMPLES))
    error = np.abs(values.mean(0) - np.asarray(x, np.float64))
    assert np.all(error <= bound + 1e-30), np.max(error / np.maximum(bound, 1e-30))
    # Round-to-nearest fails the same bound: it is biased wherever x is inexact.
    nearest = np.asarray(x.astype(dtype).astype(F32), np.float64)
    inexact = upper > lower
    assert np.any(np.abs(nearest - np.asarray(x, np.float64))[inexact] > bound[inexact])


@pytest.mark.parametrize("dtype", ROUNDED, ids=lambda d: d.name)
def test_stochastic_round_never_makes_inf(dtype):
    big = float(jnp.finfo(dtype).max)
    beyond = [big * 1.001, -big * 1.001, 3.4e38, -3.4e38, np.inf, -np.inf]
    x = jnp.asarray([big, -big, *beyond], F32)
    x = jnp.broadcast_to(x, (256, x.size))
    out = jaxmp.stochastic_round(x, dtype, jax.random.key(0)).astype(F32)
    np.testing.assert_array_equal(np.abs(out), big)
    nan = jaxmp.stochastic_round(jnp.full(64, jnp.nan), dtype, jax.random.key(0))
    assert bool(jnp.isnan(nan.astype(F32)).all())


def test_stochastic_round_bad_arguments():
    with pytest.raises(ValueError, match="`dtype` must be one of bfloat16, float16"):
        jaxmp.stochastic_round(jnp.ones(2), jnp.int8, jax.random.key(0))
    with pytest.raises(TypeError, match="`x` must be a floating-point array, got dtype int32"):
        jaxmp.stochastic_round(jnp.ones(2, jnp.int32), jnp.bfloat16, jax.random.key(0))
    with pytest.raises(TypeError, match="`seed` must be an int, got 0.5"):
        jaxmp.stochastic_rounding(optax.sgd(0.1), seed=0.5)


def _train(tx, params, grads, steps):
    state = tx.init(jaxmp.cast_tree(params, F32))

    @jax.jit
    def step(params, state):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(steps):
        params, state = step(params, state)
    return params, state


@pytest.mark.parametrize("rounding", ["nearest", "stochastic", "kahan"])
def test_768_weights_small_sgd_steps(rounding):
    # 768 bfloat16 weights between 1 and 2 (spacing 2**-7 = 0.0078), 100 SGD steps of at most
    # 0.001, below half the spacing: round-to-nearest moves none of them (as reported for
    # plain bfloat16 training); stochastic rounding moves most, Kahan summation all, and both
    # end near where float32 SGD does.
    rng = np.random.default_rng(0)
    w = jnp.asarray(1 + rng.uniform(0, 1, 768), F32).astype(BF16)
    g = jnp.asarray(rng.uniform(0.3, 1.0, 768), F32)
    exact = np.asarray(w, np.float64) - 100 * 1e-3 * np.asarray(g, np.float64)
    tx = jaxmp.mixed_precision(optax.sgd(1e-3), "bf16", master_weights=False, rounding=rounding)
    params, _ = _train(tx, {"w": w}, {"w": g.astype(BF16)}, 100)
    new = np.asarray(params["w"].astype(F32), np.float64)
    moved = int(np.sum(new != np.asarray(w.astype(F32))))
    error = np.abs(new - exact) / 2.0**-7  # in units of the spacing
    if rounding == "nearest":
        assert moved == 0
    elif rounding == "stochastic":
        assert moved >= 0.9 * 768, moved
        # Each weight is off by a sum of 100 independent rounding errors of mean 0 and
        # variance at most (spacing / 2)**2: a root mean square of at most 5 spacings, and a
        # mean over the 768 within 5 standard deviations of 0 (round-to-nearest is 8 off).
        assert np.sqrt(np.mean(error**2)) <= 5
        assert abs(np.mean(new - exact)) / 2.0**-7 <= 5 * 5 / np.sqrt(768)
    else:
        assert moved == 768 and error.max() <= 1


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
def test_apply_updates_gives_the_rounded_value(dtype):
    # Params of magnitude 0.5 to 2 and steps of at most 0.05: the new value is within a
    # factor of 2 of the param, where ``param + update`` is exact.
    rng = np.random.default_rng(1)
    magnitude = rng.uniform(0.5, 2, size=(64, 32)) * rng.choice([-1, 1], size=(64, 32))
    params = {"w": jnp.asarray(magnitude, dtype)}
    tx = jaxmp.stochastic_rounding(optax.sgd(0.01), seed=3)
    state = tx.init(params)
    grads = {"w": jnp.asarray(rng.uniform(-5, 5, size=(64, 32)), F32)}
    updates, new_state = jax.jit(tx.update)(grads, state, params)
    assert updates["w"].dtype == dtype
    new = optax.apply_updates(params, updates)["w"]
    assert new.dtype == dtype
    chex.assert_trees_all_equal(eqx.apply_updates(params, updates)["w"], new)
    # The result is one of the two neighbours of the float32 sum.
    exact = params["w"].astype(F32) - 0.01 * grads["w"]
    lower, upper = _neighbours(exact, dtype)
    got = np.asarray(new.astype(F32))
    assert np.all((got == lower) | (got == upper))
    assert np.any(got != np.asarray(exact.astype(dtype).astype(F32)))  # not round-to-nearest
    # The key moves on; the same seed and state give the same rounding.
    assert new_state.key.dtype == jnp.uint32 and new_state.key.shape == (2,)
    assert not np.array_equal(new_state.key, state.key)
    again, _ = jax.jit(tx.update)(grads, state, params)
    chex.assert_trees_all_equal(again, updates)
    other, _ = jaxmp.stochastic_rounding(optax.sgd(0.01), seed=4).update(
        grads, jaxmp.stochastic_rounding(optax.sgd(0.01), seed=4).init(params), params
    )
    assert not np.array_equal(other["w"], updates["w"])


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
def test_params_saturate_at_the_largest_value(dtype):
    big = float(jnp.finfo(dtype).max)
    params = {"w": jnp.asarray([big, -big, big / 2], dtype)}
    tx = jaxmp.stochastic_rounding(optax.sgd(1.0))
    state = tx.init(params)
    grads = {"w": jnp.asarray([-big, big, -big], F32)}
    for _ in range(3):
        updates, state = jax.jit(tx.update)(grads, state, params)
        params = optax.apply_updates(params, updates)
        assert bool(jnp.isfinite(params["w"]).all())
    np.testing.assert_array_equal(params["w"].astype(F32), [big, -big, big])


def test_other_leaves_pass_through():
    params = {
        "w": jnp.ones(4, BF16),
        "f32": jnp.ones(3, F32),
        "step": jnp.int32(3),
        "z": jnp.ones(2, jnp.complex64),
    }
    tx = jaxmp.stochastic_rounding(optax.sgd(0.5))
    state = tx.init(params)
    grads = {"w": jnp.ones(4, BF16), "f32": jnp.ones(3, F32), "step": jnp.int32(0),
             "z": jnp.ones(2, jnp.complex64)}  # fmt: skip
    updates, _ = jax.jit(tx.update)(grads, state, params)
    assert jax.tree.map(lambda u: u.dtype, updates) == jax.tree.map(lambda p: p.dtype, params)
    np.testing.assert_array_equal(updates["f32"], -0.5)
    assert int(updates["step"]) == 0
    np.testing.assert_array_equal(optax.apply_updates(params, updates)["w"].astype(F32), 0.5)


def test_update_requires_params():
    tx = jaxmp.stochastic_rounding(optax.sgd(0.1))
    with pytest.raises(ValueError, match="`params` must be passed"):
        tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
def test_update_is_strict_promotion_clean(dtype):
    tx = jaxmp.stochastic_rounding(optax.sgd(0.1))  # optax.adam is not strict-clean itself
    params = {"w": jnp.ones(8, dtype)}
    state = tx.init(params)
    with jax.numpy_dtype_promotion("strict"):
        updates, state = jax.jit(tx.update)({"w": jnp.ones(8, dtype)}, state, params)
        new = optax.apply_updates(params, updates)
    assert updates["w"].dtype == new["w"].dtype == dtype
    # With param_specs, inside a mapped axis (shard_map's devices) too.
    tx = jaxmp.stochastic_rounding(optax.sgd(0.1), param_specs={"w": jax.P("data")})
    with jax.numpy_dtype_promotion("strict"):
        update = jax.vmap(lambda g, p: tx.update(g, state, p)[0], axis_name="data")
        updates = jax.jit(update)({"w": jnp.ones((4, 2), dtype)}, {"w": jnp.ones((4, 2), dtype)})
    assert updates["w"].dtype == dtype


def test_state_is_stable_under_scan():
    tx = jaxmp.mixed_precision(
        optax.adam(1e-2), "bf16", master_weights=False, rounding="stochastic", moments="int8"
    )
    params = {"w": jnp.ones((4, 64), BF16)}
    state = tx.init(params)

    def body(carry, _):
        params, state = carry
        updates, state = tx.update({"w": jnp.ones((4, 64), BF16)}, state, params)
        return (optax.apply_updates(params, updates), state), None

    (new_params, new_state), _ = jax.jit(lambda c: jax.lax.scan(body, c, None, length=5))(
        (params, state)
    )
    chex.assert_trees_all_equal_structs(new_state, state)
    chex.assert_trees_all_equal_dtypes(new_state, state)
    assert new_params["w"].dtype == BF16
    assert float(new_params["w"].astype(F32).mean()) < 1.0


# --- A split param draws the bits of the whole one -------------------------------------------
# Inside `jax.shard_map` each device sees its block of a param; `vmap` over the blocks with the
# same axis names runs the same code on one device (`jax.lax.axis_index` is the block's
# position). tests/distributed/low_memory.py checks it under `shard_map` on 8 devices.


# Each spec below is split over a 4 x 2 grid of mapped axes "a" and "b".
SPLITS = {
    "rows_and_columns": (("a",), ("b",)),
    "rows_over_two_axes": (("a", "b"), ()),
    "columns_minor_first": ((), ("b", "a")),
}


def _cut(x, spec):
    """`x` (2-D) cut as shard_map cuts it over the grid: shape ``(4, 2, *block)``.

    Each dimension is split over its axes, the first named axis major.
    """
    parts = [4 * 2 if len(n) == 2 else {"a": 4, "b": 2}[n[0]] if n else 1 for n in spec]
    block = (x.shape[0] // parts[0], x.shape[1] // parts[1])
    out = np.empty((4, 2, *block), x.dtype)
    for a in range(4):
        for b in range(2):
            at = {(): 0, ("a",): a, ("b",): b, ("a", "b"): a * 2 + b, ("b", "a"): b * 4 + a}
            r, c = at[spec[0]], at[spec[1]]
            out[a, b] = x[r * block[0] : (r + 1) * block[0], c * block[1] : (c + 1) * block[1]]
    return out


def _on_grid(fn):
    """`fn` of the block at each position of the 4 x 2 grid of mapped axes "a" and "b"."""
    return jax.jit(jax.vmap(jax.vmap(fn, axis_name="b"), axis_name="a"))


@pytest.mark.parametrize("spec", list(SPLITS.values()), ids=list(SPLITS))
def test_element_index_of_a_block_is_its_index_in_the_whole_array(spec):
    from jaxmp._src import stochastic_rounding as sr  # noqa: PLC0415

    whole = np.arange(16 * 24, dtype=np.uint32).reshape(16, 24)
    blocks = _cut(whole, spec)
    with jax.numpy_dtype_promotion("strict"):
        index = _on_grid(lambda x: sr.element_index(x.shape, spec))(blocks)
    np.testing.assert_array_equal(index, blocks)


@pytest.mark.parametrize(
    ("moments", "split"),
    [("float32", "rows_and_columns"), ("bf16", "rows_and_columns"),
     ("bf16", "columns_minor_first"), ("int8", "rows_over_two_axes")],
)  # fmt: skip
def test_a_split_param_rounds_as_the_whole_one_with_param_specs(moments, split):
    spec = SPLITS[split]
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(16, 24)), BF16)}
    grads = {"w": jnp.asarray(rng.normal(size=(16, 24)), F32)}

    def make(param_specs):
        return jaxmp.mixed_precision(
            optax.adam(1e-2), "bf16", master_weights=False, rounding="stochastic",
            moments=moments, param_specs=param_specs,
        )  # fmt: skip

    def step(tx, params, grads):
        state = tx.init(params)
        updates, state = tx.update(grads, state, params)
        adam = jaxmp.inner_state(state)[0]  # decompressed
        return optax.apply_updates(params, updates), {"mu": adam.mu, "nu": adam.nu}

    whole = jax.jit(functools.partial(step, make(None)))(params, grads)
    cut = jax.tree.map(lambda x: _cut(np.asarray(x), spec), (params, grads, whole))
    # With the params' spec, each block's params and moments are those of the whole update.
    split_specs = {"w": jax.P(*(n or None for n in spec))}
    out = _on_grid(functools.partial(step, make(split_specs)))(*cut[:2])
    chex.assert_trees_all_equal(out, cut[2])
    assert not np.array_equal(out[0]["w"], cut[0]["w"])  # the params moved
    # Without it, every block draws the bits of the whole param's first block: the result
    # differs (the moments and the float32 moments' params alike).
    out = _on_grid(functools.partial(step, make(None)))(*cut[:2])
    assert not np.array_equal(out[0]["w"], cut[2][0]["w"])


def test_param_specs_outside_shard_map_is_an_error_naming_it():
    tx = jaxmp.stochastic_rounding(optax.sgd(1e-3), param_specs={"w": jax.P("data")})
    params = {"w": jnp.ones(8, BF16)}
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"`param_specs\['w'\]` is P.*\('data',\), "
                       r"for an update inside jax.shard_map over those mesh axes"):  # fmt: skip
        jax.jit(tx.update)(params, state, params)
    with pytest.raises(ValueError, match=r"`param_specs\['w'\]` must be a PartitionSpec of at "
                       r"most 1 entries"):  # fmt: skip
        jaxmp.stochastic_rounding(optax.sgd(1e-3), param_specs={"w": jax.P("a", "b")}).update(
            params, state, params
        )
    with pytest.raises(TypeError, match=r"`param_specs` must be None or a pytree of"):
        jaxmp.stochastic_rounding(optax.sgd(1e-3), param_specs=["data"])
