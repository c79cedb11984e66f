import dataclasses
import math

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxmp
from tests.conftest import BF16, F16, F32


@jax.jit
def _jitted_adjust(ls, finite):
    return ls.adjust(finite)


def _adjust(ls, finite):
    return _jitted_adjust(ls, jnp.asarray(finite))


def reference_rule(
    scale, counter, nonfinite, finite, *, period, factor, backoff, lo, hi, hysteresis
):
    """A plain-Python model of the documented rule."""
    if finite:
        counter += 1
        nonfinite = 0
        if counter >= period:
            scale, counter = scale * factor, 0
    else:
        # The count saturates at hysteresis - 1: from there on, every non-finite step
        # in the run backs off.
        counter = 0
        if nonfinite + 1 >= hysteresis:
            scale = scale * backoff
        nonfinite = min(nonfinite + 1, hysteresis - 1)
    return min(max(scale, lo), hi), counter, nonfinite


@settings(max_examples=25, deadline=None)
@given(
    steps=st.lists(st.booleans(), min_size=1, max_size=60),
    period=st.integers(1, 5),
    factor=st.sampled_from([2, 4, 1.5]),
    hysteresis=st.integers(1, 3),
    log_init=st.integers(-3, 18),
)
def test_rule_matches_reference(steps, period, factor, hysteresis, log_init):
    lo, hi = 2.0**-3, 2.0**18
    ls = jaxmp.DynamicLossScale(
        2.0**log_init,
        period=period,
        factor=factor,
        min_loss_scale=lo,
        max_loss_scale=hi,
        hysteresis=hysteresis,
    )
    scale, counter, nonfinite = min(max(2.0**log_init, lo), hi), 0, 0
    step = jax.jit(lambda ls_, f: ls_.adjust(f))
    for finite in steps:
        ls = step(ls, jnp.asarray(finite))
        scale, counter, nonfinite = reference_rule(
            scale,
            counter,
            nonfinite,
            finite,
            period=period,
            factor=factor,
            backoff=1 / factor,
            lo=lo,
            hi=hi,
            hysteresis=hysteresis,
        )
        np.testing.assert_allclose(float(ls.loss_scale), scale, rtol=1e-6)
        assert int(ls.counter) == counter and int(ls.nonfinite_count) == nonfinite
        assert ls.loss_scale.dtype == F32 and ls.counter.dtype == jnp.int32


@settings(max_examples=15, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=200))
def test_scale_never_zero_or_inf(steps):
    ls = jaxmp.DynamicLossScale(2.0**30, period=1, min_loss_scale=2.0**-10)
    step = jax.jit(lambda ls_, f: ls_.adjust(f))
    for finite in steps:
        ls = step(ls, jnp.asarray(finite))
        value = float(ls.loss_scale)
        assert math.isfinite(value) and 2.0**-10 <= value <= 2.0**32


def test_pytorch_growth_tracker_rule():
    ls = jaxmp.DynamicLossScale(2.0**15, period=3)
    values = []
    for finite in [True, True, True, True, False, True, True, True]:
        ls = _adjust(ls, finite)
        values.append(float(ls.loss_scale))
    assert values == [2.0**15, 2.0**15, 2.0**16, 2.0**16, 2.0**15, 2.0**15, 2.0**15, 2.0**16]


def test_all_overflow_stops_at_min_and_never_reaches_zero():
    ls = jaxmp.DynamicLossScale(1.0, min_loss_scale=1.0)
    for _ in range(200):
        ls = _adjust(ls, False)
    assert float(ls.loss_scale) == 1.0


def test_all_finite_stops_at_max_and_never_reaches_inf():
    ls = jaxmp.DynamicLossScale(2.0**30, period=1)
    for _ in range(300):
        ls = _adjust(ls, True)
    assert float(ls.loss_scale) == 2.0**32


def test_float16_loss_scale_stays_finite():
    # jmp issue 47: a float16 loss scale crashed; growth past 2**15 is inf in float16.
    ls = jaxmp.DynamicLossScale(jnp.float16(2**14), period=1)
    for _ in range(5):
        ls = _adjust(ls, True)
    assert ls.loss_scale.dtype == F16
    assert float(ls.loss_scale) == 2.0**15
    ls = _adjust(ls, False)
    assert float(ls.loss_scale) == 2.0**14 and ls.loss_scale.dtype == F16


def test_bfloat16_loss_scale():
    ls = jaxmp.DynamicLossScale(jnp.bfloat16(4.0), period=1)
    ls = _adjust(ls, True)
    assert ls.loss_scale.dtype == BF16 and float(ls.loss_scale) == 8.0


def test_hysteresis_needs_consecutive_overflows():
    ls = jaxmp.DynamicLossScale(2.0**10, hysteresis=2)
    ls = _adjust(ls, False)
    assert float(ls.loss_scale) == 2.0**10  # first overflow tolerated
    ls = _adjust(ls, True)  # a finite step resets the run
    ls = _adjust(ls, False)
    assert float(ls.loss_scale) == 2.0**10
    ls = _adjust(ls, False)
    assert float(ls.loss_scale) == 2.0**9
    ls = _adjust(ls, False)  # still in a run of overflows: keeps backing off
    assert float(ls.loss_scale) == 2.0**8


def test_custom_backoff():
    ls = jaxmp.DynamicLossScale(2.0**10, factor=2, backoff=0.25)
    assert float(_adjust(ls, False).loss_scale) == 2.0**8


def test_every_field_survives_tree_round_trips():
    ls = jaxmp.DynamicLossScale(
        8.0,
        3,
        period=7,
        factor=4,
        min_loss_scale=2.0,
        max_loss_scale=64.0,
        backoff=0.125,
        hysteresis=3,
    )
    leaves, treedef = jax.tree.flatten(ls)
    assert len(leaves) == 3
    for rebuilt in [
        jax.tree.unflatten(treedef, leaves),
        jax.tree.map(lambda x: x, ls),
        jax.jit(lambda ls_: ls_)(ls),
        jax.tree.map(jnp.asarray, ls),
    ]:
        assert type(rebuilt) is jaxmp.DynamicLossScale
        for field in dataclasses.fields(ls):
            a, b = getattr(ls, field.name), getattr(rebuilt, field.name)
            assert np.asarray(a) == np.asarray(b), field.name
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(ls)[0]]
    assert paths == [".loss_scale", ".counter", ".nonfinite_count"]


def test_jmp_drops_min_loss_scale_but_we_do_not():
    theirs = jmp.DynamicLossScale(jnp.float32(8.0), min_loss_scale=jnp.float32(4.0))
    assert float(jax.tree.map(lambda x: x, theirs).min_loss_scale) == 1.0  # jmp's bug
    ours = jaxmp.DynamicLossScale(8.0, min_loss_scale=4.0)
    assert jax.tree.map(lambda x: x, ours).min_loss_scale == 4.0


def test_lower_works_and_no_retrace():
    traces = []

    def step(ls, finite):
        traces.append(1)
        return ls.adjust(finite)

    jitted = jax.jit(step)
    ls = jaxmp.DynamicLossScale(2.0**15)
    assert jitted.lower(ls, jnp.array(True)).compile() is not None
    for finite in [True, False, True]:
        ls = jitted(ls, jnp.array(finite))
    assert len(traces) == 1


def test_vmap_and_scan_keep_structure_and_dtypes():
    ls = jaxmp.DynamicLossScale(2.0**4, period=2)
    stacked = jax.tree.map(lambda x: jnp.stack([x, x]), ls)
    out = jax.vmap(lambda ls_, f: ls_.adjust(f))(stacked, jnp.array([True, False]))
    assert out.loss_scale.tolist() == [16.0, 8.0] and out.period == 2

    def body(carry, f):
        carry = carry.adjust(f)
        return carry, carry.loss_scale

    final, history = jax.lax.scan(body, ls, jnp.array([True, True, False, True]))
    assert history.tolist() == [16.0, 32.0, 16.0, 16.0]
    assert jax.tree.structure(final) == jax.tree.structure(ls)
    assert final.loss_scale.dtype == F32 and final.counter.dtype == jnp.int32


@pytest.mark.parametrize("ls_cls", [jaxmp.StaticLossScale, jaxmp.DynamicLossScale])
def test_scale_and_unscale_compute_in_float32(ls_cls):
    ls = ls_cls(2.0**20)
    tree = {"g": jnp.full(3, 2.0**-20, jnp.float16), "i": jnp.arange(2)}
    scaled = ls.scale(tree)
    assert scaled["g"].dtype == F32 and scaled["i"].dtype == jnp.int32
    np.testing.assert_array_equal(scaled["g"], 1.0)
    # unscale keeps the leaf dtype (jmp's behaviour) but computes in float32: in float16
    # arithmetic 1 / 2**20 is already 0.
    unscaled = ls.unscale({"g": jnp.ones(2, jnp.float16)})["g"]
    assert unscaled.dtype == F16
    np.testing.assert_array_equal(unscaled.astype(F32), 2.0**-20)


def test_noop_loss_scale():
    ls = jaxmp.NoOpLossScale()
    x = jnp.ones(2, jnp.bfloat16)
    assert ls.scale(x) is x
    assert ls.unscale(x) is x
    assert ls.adjust(jnp.array(False)) is ls
    assert float(ls.loss_scale) == 1.0 and jax.tree.leaves(ls) == []


def test_static_loss_scale_is_static_metadata():
    ls = jaxmp.StaticLossScale(4.0)
    assert jax.tree.leaves(ls) == [] and ls.loss_scale.dtype == F32
    assert float(ls.adjust(jnp.array(False)).loss_scale) == 4.0
    assert jax.tree.map(lambda x: x, ls) == ls


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        ({"period": 0}, ValueError, "`period` must be an int in [1, 2**31 - 1], got 0"),
        ({"period": 2.5}, TypeError, "`period` must be an int in [1, 2**31 - 1], got 2.5"),
        ({"factor": 1}, ValueError, "`factor` must be a finite number in (1, "),
        ({"factor": 0.5}, ValueError, "`factor`"),
        ({"min_loss_scale": -1.0}, ValueError, "`min_loss_scale` must be a finite number >= 0"),
        ({"max_loss_scale": float("inf")}, ValueError, "`max_loss_scale` must be a finite"),
        ({"min_loss_scale": 8.0, "max_loss_scale": 4.0}, ValueError, "`max_loss_scale`"),
        ({"backoff": 1.0}, ValueError, "`backoff` must be a number in ["),
        ({"hysteresis": 0}, ValueError, "`hysteresis` must be an int in [1, 2**31 - 1], got 0"),
        ({"loss_scale": 0.0}, ValueError, "`loss_scale` must be a finite number in"),
        ({"loss_scale": float("inf")}, ValueError, "`loss_scale` must be a finite number in"),
        ({"loss_scale": 1e40}, ValueError, "got 1e+40"),
        ({"loss_scale": jnp.ones(2)}, TypeError, "shape (2,)"),
        ({"counter": jnp.float32(0)}, TypeError, "`counter` must be an int in [0, 1999]"),
        ({"loss_scale": True}, TypeError, "`loss_scale`"),
    ],
)
def test_dynamic_loss_scale_bad_input(kwargs, error, fragment):
    kwargs = {"loss_scale": 2.0**15, **kwargs}
    with pytest.raises(error) as info:
        jaxmp.DynamicLossScale(**kwargs)
    assert fragment in str(info.value)


def test_adjust_needs_scalar_bool():
    with pytest.raises(ValueError, match="`grads_finite` must be a scalar boolean"):
        jaxmp.DynamicLossScale(2.0).adjust(jnp.array([True, False]))
    with pytest.raises(ValueError, match="`grads_finite` must be a scalar boolean"):
        jaxmp.DynamicLossScale(2.0).adjust(jnp.float32(1.0))


def test_static_loss_scale_bad_input():
    with pytest.raises(ValueError, match="`loss_scale` must be a finite number in .*, got 0"):
        jaxmp.StaticLossScale(0)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["float16", "bfloat16"])
def test_scale_and_unscale_are_strict_promotion_clean(dtype):
    x = jnp.full(2, 0.5, dtype)
    with jax.numpy_dtype_promotion("strict"):
        for ls in (jaxmp.StaticLossScale(8.0), jaxmp.DynamicLossScale(8.0), jaxmp.NoOpLossScale()):
            scaled = jax.jit(ls.scale)(x)
            unscaled = jax.jit(ls.unscale)(x)
            assert unscaled.dtype == dtype
            np.testing.assert_array_equal(unscaled.astype(F32), 0.5 / float(ls.loss_scale))
            np.testing.assert_array_equal(scaled, 0.5 * float(ls.loss_scale))
