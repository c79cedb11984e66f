"""`compress_state`: moments stored in bfloat16 or 8 bits, second moments' small values kept."""

from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
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
    assert compress_lib.parse_format(jnp.bfloat16, arg="x") == "bfloat16"
    assert compress_lib.parse_format("FP8", arg="x") == "fp8"


# --- Non-finite moments: never stored as finite values (the check_outputs guarantee) ----------

MOMENTS = ("float32", *FORMATS)


def _compress_round_trip(x, fmt, second, block_size=8):
    def run(x):
        values, scales = compress_lib.compress(
            x, fmt, second_moment=second, block_size=block_size, words=jnp.asarray([3, 4], "uint32")
        )
        leaf = jaxmp.CompressedLeaf(scales, 0, fmt, F32, second, block_size)
        return values, scales, leaf.decompress(values)

    return jax.jit(run)(x)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    ("second", "bad"),
    # A second moment is never negative: no -inf there.
    [(False, np.inf), (False, -np.inf), (False, np.nan), (True, np.inf), (True, np.nan)],
    ids=["first-inf", "first--inf", "first-nan", "second-inf", "second-nan"],
)
def test_a_non_finite_moment_is_never_stored_as_a_finite_one(fmt, second, bad):
    x = jnp.asarray(np.linspace(0.1, 2.0, 32), F32).at[3].set(bad)  # blocks of 8: the first
    with jax.numpy_dtype_promotion("strict"):
        values, scales, out = _compress_round_trip(x, fmt, second)
    # What a finiteness check of the stored state (check_outputs) reads is not all finite.
    assert not bool(jaxmp.all_finite((values, scales)))
    out = np.asarray(out)
    assert not np.isfinite(out[3])
    if bad == np.inf and (second or fmt == "bfloat16"):
        assert out[3] == np.inf  # an overflowed second moment decompresses as inf
    if fmt == "bfloat16":
        assert np.all(np.isfinite(np.delete(out, 3)))  # element by element
        if not np.isnan(bad):
            assert out[3] == bad
    else:
        assert not np.any(np.isfinite(out[:8]))  # the block of the bad value, and no other
        assert np.all(np.isfinite(out[8:]))
        if second and bad == np.inf:
            assert np.all(out[:8] == np.inf)


@pytest.mark.parametrize("fmt", FORMATS)
def test_finite_moments_near_float32s_largest_stay_finite(fmt):
    x = jnp.asarray([3.3e38, 1.0, 2.0, 3.0], F32)
    values, scales, out = _compress_round_trip(x, fmt, False, block_size=4)
    assert bool(jaxmp.all_finite((values, scales))) and np.all(np.isfinite(np.asarray(out)))


def _adam(fmt):
    adam = optax.adam(1e-3)
    return adam if fmt == "float32" else jaxmp.compress_state(adam, fmt, block_size=8)


HUGE_GRADS = {"w": jnp.full((4, 16), 1e-3).at[1, 2].set(1e20)}  # 1e40 overflows float32


@pytest.mark.parametrize("fmt", MOMENTS)
def test_check_outputs_skips_an_overflowing_second_moment_in_every_format(fmt):
    # The README's guarantee: with check_outputs=True a step whose own update overflows on
    # finite gradients is skipped, and no NaN or inf reaches params or optimizer state.
    tx = jaxmp.loss_scaling(_adam(fmt), jaxmp.NoOpLossScale(), check_outputs=True)
    params = {"w": jnp.ones((4, 16))}
    state = jax.jit(tx.init)(params)
    step = jax.jit(tx.update)
    updates, new_state = step({"w": jnp.full((4, 16), 1e-3)}, state, params)
    assert bool(new_state.grads_finite)  # an ordinary step is taken
    params = optax.apply_updates(params, updates)
    updates, skipped = step(HUGE_GRADS, new_state, params)
    assert not bool(skipped.grads_finite) and int(skipped.skipped_steps) == 1
    np.testing.assert_array_equal(updates["w"], 0)
    chex.assert_trees_all_equal(skipped.inner_state, new_state.inner_state)
    assert bool(jaxmp.all_finite((params, skipped.inner_state)))
    assert bool(jaxmp.all_finite(jaxmp.inner_state(skipped)))


@pytest.mark.parametrize("fmt", MOMENTS)
def test_without_the_check_an_overflowed_second_moment_freezes_params_as_float32_does(fmt):
    # No check: the step is applied, the second moment is inf; its params stop moving, and
    # every param stays finite (8-bit formats: the whole block of the inf stops).
    tx = _adam(fmt)
    params = {"w": jnp.ones((4, 16))}
    state = jax.jit(tx.init)(params)
    step = jax.jit(tx.update)
    small = {"w": jnp.full((4, 16), 1e-3)}
    for grads in (HUGE_GRADS, small, small):
        updates, state = step(grads, state, params)
        params = optax.apply_updates(params, updates)
        assert bool(jaxmp.all_finite(params)), fmt
    adam = compress_lib.decompressed(state)[0] if fmt != "float32" else state[0]
    assert np.asarray(adam.nu["w"])[1, 2] == np.inf
    moved = np.asarray(params["w"]) != 1
    assert not moved[1, 2] and moved[3].all()


# --- Which leaves are first and second moments: from the state's type -----------------------


def _described(tx, params):
    state = jax.jit(tx.init)(params)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(
        state.inner_state)]  # fmt: skip
    return {paths[c.index]: "second" if c.second_moment else "first" for c in state.compressed}


@pytest.mark.parametrize(
    ("optimizer", "expected"),
    [
        (optax.adam(1e-3), {"[0].mu['w']": "first", "[0].nu['w']": "second"}),
        (optax.adamw(1e-3), {"[0].mu['w']": "first", "[0].nu['w']": "second"}),
        (optax.amsgrad(1e-3),
         {"[0].mu['w']": "first", "[0].nu['w']": "second", "[0].nu_max['w']": "second"}),
        (optax.adabelief(1e-3), {"[0].mu['w']": "first", "[0].nu['w']": "second"}),
        (optax.lion(1e-3), {"[0].mu['w']": "first"}),
        (optax.rmsprop(1e-3), {"[0].nu['w']": "second"}),
        (optax.rmsprop(1e-3, centered=True), {"[0].mu['w']": "first", "[0].nu['w']": "second"}),
        (optax.rmsprop(1e-3, bias_correction=True), {"[0].nu['w']": "second"}),
        (optax.adagrad(1e-3), {"[0].sum_of_squares['w']": "second"}),
        (optax.adadelta(1e-3), {"[1].e_g['w']": "second", "[1].e_x['w']": "second"}),
        # Adafactor on a param too small to factor: its whole second moment is `v`.
        (optax.adafactor(1e-3), {"[0].v['w']": "second"}),
        (optax.sgd(1e-3, momentum=0.9), {"[0].trace['w']": "first"}),
        # Muon: a 2-D param's momentum in muon's own state (its Adam for the rest is masked).
        (optax.contrib.muon(1e-3), {".inner_states['muon'].inner_state[0].mu['w']": "first"}),
        # Wrappers are looked through; schedule-free's `z` (an iterate, not a moment) is kept.
        (optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
         {".inner_state[0].mu['w']": "first", ".inner_state[0].nu['w']": "second"}),
        # Schedule-free's base Adam has b1=0 (no first moment in optax's state).
        (optax.contrib.schedule_free_adamw(1e-3), {".base_optimizer_state[0].nu['w']": "second"}),
        (optax.MultiSteps(optax.adam(1e-3), 2).gradient_transformation(),
         {".inner_opt_state[0].mu['w']": "first", ".inner_opt_state[0].nu['w']": "second"}),
    ],
    ids=["adam", "adamw", "amsgrad", "adabelief", "lion", "rmsprop", "rmsprop_centered",
         "rmsprop_bias_correction", "adagrad", "adadelta", "adafactor", "sgd_momentum", "muon",
         "inject_hyperparams", "schedule_free", "multi_steps"],
)  # fmt: skip
def test_moments_are_classified_by_the_state_type(optimizer, expected):
    params = {"w": jnp.ones((8, 16))}
    described = _described(jaxmp.compress_state(optimizer, "int8"), params)
    for path, role in expected.items():
        assert described.get(path) == role, (path, described)
    assert set(described) == set(expected), described


def test_adafactors_second_moment_is_never_rounded_to_zero():
    # Adafactor's unfactored `v`, compressed as a first moment (linear int8), stored 11% of a
    # spread-out second moment as exactly 0; as a second moment, none.
    params = {"w": jnp.ones((4, 64))}
    grads = {"w": jnp.asarray(np.logspace(-4, 1, 256).reshape(4, 64), F32)}
    tx = jaxmp.compress_state(optax.adafactor(1e-3), "int8")
    state = jax.jit(tx.init)(params)
    _, state = jax.jit(tx.update)(grads, state, params)
    (leaf,) = state.compressed
    assert leaf.second_moment
    v = np.asarray(compress_lib.decompressed(state)[0].v["w"])
    assert np.all(v > 0)


def test_every_field_of_every_listed_state_type_is_classified():
    # The table is checked against the installed optax: a renamed or added field fails here.
    for cls, fields in compress_lib.OPTAX_STATE_FIELDS.items():
        assert set(fields) == set(cls._fields), cls
        assert set(fields.values()) <= set(compress_lib.ROLES), cls
    names = {cls.__name__ for cls in compress_lib.OPTAX_STATE_FIELDS}
    for name in (
        "ScaleByAdamState",
        "FactoredState",
        "ScaleByLionState",
        "ScaleByAmsgradState",
        "ScaleByBeliefState",
        "ScaleByRmsState",
        "ScaleByRssState",
        "TraceState",
    ):
        assert name in names  # fmt: skip


class _MyState(NamedTuple):
    count: jax.Array  # shape=(), dtype=int32
    m: Any
    v: Any


def _my_optimizer():
    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return _MyState(jnp.zeros((), jnp.int32), zeros, zeros)

    def update(updates, state, params=None):
        m = jax.tree.map(lambda a, g: 0.9 * a + 0.1 * g, state.m, updates)
        v = jax.tree.map(lambda a, g: 0.99 * a + 0.01 * g * g, state.v, updates)
        out = jax.tree.map(lambda a, b: -1e-3 * a / (jnp.sqrt(b) + 1e-8), m, v)
        return out, _MyState(state.count + 1, m, v)

    return optax.GradientTransformation(init, update)


def test_an_unknown_state_type_is_an_error_naming_it_and_the_fix():
    params = {"w": jnp.ones((4, 16))}
    tx = jaxmp.compress_state(_my_optimizer(), "int8")
    with pytest.raises(ValueError, match=r"in field 'm' of .*_MyState, a state type "
                       r"`compress_state` does not know: declare what its fields hold with "
                       r"`moment_fields=\{_MyState: \{'m': 'first', \.\.\.\}\}`"):  # fmt: skip
        tx.init(params)
    # Through mixed_precision too, and in a plain dict state (no type to declare).
    with pytest.raises(ValueError, match=r"in field 'm' of .*_MyState"):
        jaxmp.mixed_precision(_my_optimizer(), "f32", moments="bf16").init(params)
    plain = optax.GradientTransformation(lambda p: {"m": p}, lambda u, s, p=None: (u, s))
    with pytest.raises(ValueError, match=r"at \['m'\]\['w'\], in no state type"):
        jaxmp.compress_state(plain, "bf16").init(params)
    # Float32 moments compress nothing: any state is fine.
    jaxmp.compress_state(_my_optimizer(), "float32").init(params)


def test_moment_fields_declares_an_unknown_state():
    params = {"w": jnp.ones((4, 16))}
    fields = {_MyState: {"m": "first", "v": "second"}}
    described = _described(jaxmp.compress_state(_my_optimizer(), "int8", moment_fields=fields),
                           params)  # fmt: skip
    assert described == {".m['w']": "first", ".v['w']": "second"}
    tx = jaxmp.mixed_precision(_my_optimizer(), "f32", moments="int8", moment_fields=fields)
    state = jax.jit(tx.init)(params)
    compressed = state.inner_state
    assert [c.second_moment for c in compressed.compressed] == [False, True]
    # An entry replaces optax's own: Adam's `nu` kept in float32.
    keep_nu = {optax.ScaleByAdamState: {"count": "keep", "mu": "first", "nu": "keep"}}
    described = _described(jaxmp.compress_state(optax.adam(1e-3), "bf16",
                                                moment_fields=keep_nu), params)  # fmt: skip
    assert described == {"[0].mu['w']": "first"}


@pytest.mark.parametrize(
    ("moment_fields", "error", "match"),
    [
        ("nu", TypeError, r"`moment_fields` must be None or a dict \{state type:"),
        ({"ScaleByAdamState": {}}, TypeError, r"`moment_fields` must map state types .*got the "
                                              r"key 'ScaleByAdamState'"),
        ({_MyState: ["m"]}, TypeError, r"`moment_fields\[_MyState\]` must be a dict"),
        ({_MyState: {"m": "frist"}}, ValueError,
         r"`moment_fields\[_MyState\]\['m'\]` must be one of 'first', 'second', 'keep', 'inner', "
         r"got 'frist'\. Did you mean 'first'\?"),
        ({_MyState: {"mu": "first"}}, ValueError,
         r"`moment_fields\[_MyState\]` names fields \['mu'\], which _MyState does not have "
         r"\(its fields: count, m, v\)"),
    ],
)  # fmt: skip
def test_bad_moment_fields_fail_at_construction(moment_fields, error, match):
    with pytest.raises(error, match=match):
        jaxmp.compress_state(optax.adam(1e-3), "int8", moment_fields=moment_fields)
    with pytest.raises(error, match=match):
        jaxmp.mixed_precision(optax.adam(1e-3), "bf16", moment_fields=moment_fields)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    ("spec", "second"), [((("a",), ()), False), (((), ("a",)), True)], ids=["rows", "columns"]
)
def test_a_split_leaf_compresses_as_the_whole_one_with_its_spec(fmt, spec, second):
    # vmap over a named axis stands for shard_map's devices. Each device's part of a row is a
    # whole number of blocks (24 columns in 4 parts of 6, blocks of 6): values and scales are
    # the whole leaf's, bit for bit, the random bits drawn from each element's index in it.
    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 24)) ** (1 + second), F32)
    words = jnp.asarray([5, 6], jnp.uint32)

    def run(x, spec=None):
        return compress_lib.compress(
            x, fmt, second_moment=second, block_size=6, words=words, spec=spec
        )

    whole = jax.jit(run)(x)
    dim = 0 if spec[0] else 1
    parts = jnp.stack(jnp.split(x, 4, axis=dim))
    with jax.numpy_dtype_promotion("strict"):
        split = jax.jit(jax.vmap(lambda p: run(p, spec), axis_name="a"))(parts)
    joined = [None if s is None else jnp.concatenate(list(s), axis=dim) for s in split]
    chex.assert_trees_all_equal(joined, list(whole))
    # Without the spec, each part draws the bits of the first part: the values differ.
    local = jax.jit(jax.vmap(run, axis_name="a"))(parts)
    assert not np.array_equal(jnp.concatenate(list(local[0]), axis=dim), whole[0])
