"""Attacks on the loss-scale promises: every bad value is rejected when the object is built,
with an error naming the argument and the value; traced values are clamped, never NaN, 0 or inf.
"""

import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from tests.conftest import BF16, F16, F32

INT32_MAX = 2**31 - 1


def _case_id(value) -> str:
    """A test id that is the same in every process (no object addresses)."""
    return re.sub(r" at 0x[0-9a-f]+", "", repr(value))[:30]


# (constructor arguments, error type, fragments of the message). Each message names the
# argument and the value given.
BAD_STATIC = [
    ((jnp.float32(0),), ValueError, ["`loss_scale`", "got 0.0"]),
    ((np.float32(np.inf),), ValueError, ["`loss_scale`", "got inf"]),
    ((jnp.array(jnp.nan),), ValueError, ["`loss_scale`", "got nan"]),
    ((1e-45,), ValueError, ["`loss_scale`", "1e-45", "1.1754944e-38"]),
    ((-2.0,), ValueError, ["`loss_scale`", "got -2.0"]),
    ((0,), ValueError, ["`loss_scale`", "got 0"]),
    ((10**400,), ValueError, ["`loss_scale`", "1000000000"]),
    ((1e40,), ValueError, ["`loss_scale`", "1e+40"]),
    ((jnp.float16(0),), ValueError, ["`loss_scale`", "float16"]),
    (("2",), TypeError, ["`loss_scale`", "'2'"]),
    ((None,), TypeError, ["`loss_scale`", "None"]),
    (([2.0],), TypeError, ["`loss_scale`", "[2.0]"]),
    ((object(),), TypeError, ["`loss_scale`", "object"]),
    ((2 + 0j,), TypeError, ["`loss_scale`", "(2+0j)"]),
    ((jnp.complex64(2),), TypeError, ["`loss_scale`", "complex64"]),
    ((True,), TypeError, ["`loss_scale`", "True"]),
    ((jnp.bool_(True),), TypeError, ["`loss_scale`", "bool"]),
    ((jnp.ones(2),), TypeError, ["`loss_scale`", "shape (2,)"]),
]


@pytest.mark.parametrize("args, error, fragments", BAD_STATIC, ids=_case_id)
@pytest.mark.parametrize("cls", [jaxmp.StaticLossScale, jaxmp.DynamicLossScale])
def test_bad_loss_scale_rejected_at_construction(cls, args, error, fragments):
    with pytest.raises(error) as info:
        cls(*args)
    for fragment in fragments:
        assert fragment in str(info.value)


BAD_DYNAMIC = [
    ({"factor": "3"}, TypeError, ["`factor`", "'3'"]),
    ({"factor": None}, TypeError, ["`factor`", "None"]),
    ({"factor": 2 + 0j}, TypeError, ["`factor`"]),
    ({"factor": 1e39}, ValueError, ["`factor`", "1e+39"]),
    ({"factor": math.nan}, ValueError, ["`factor`", "nan"]),
    ({"min_loss_scale": "1"}, TypeError, ["`min_loss_scale`", "'1'"]),
    ({"min_loss_scale": -1.0}, ValueError, ["`min_loss_scale`", "-1.0"]),
    ({"min_loss_scale": math.nan}, ValueError, ["`min_loss_scale`", "nan"]),
    ({"max_loss_scale": "1e5"}, TypeError, ["`max_loss_scale`", "'1e5'"]),
    ({"max_loss_scale": 0.0, "min_loss_scale": 0.0}, ValueError, ["`max_loss_scale`", "0.0"]),
    ({"backoff": "0.5"}, TypeError, ["`backoff`", "'0.5'"]),
    ({"backoff": 1e-50}, ValueError, ["`backoff`", "1e-50"]),
    ({"counter": 1.5}, TypeError, ["`counter`", "1.5"]),
    ({"counter": -5}, ValueError, ["`counter`", "-5", "[0, 1999]"]),
    ({"counter": 2000}, ValueError, ["`counter`", "2000", "[0, 1999]"]),
    ({"counter": jnp.int32(-1)}, ValueError, ["`counter`", "-1"]),
    ({"counter": "0"}, TypeError, ["`counter`", "'0'"]),
    ({"counter": True}, TypeError, ["`counter`", "True"]),
    ({"period": 2**31}, ValueError, ["`period`", "2147483648", "2**31 - 1"]),
    ({"period": 2.5}, TypeError, ["`period`", "2.5"]),
    ({"period": "5"}, TypeError, ["`period`", "'5'"]),
    ({"period": 0}, ValueError, ["`period`", "got 0"]),
    ({"hysteresis": 2**31}, ValueError, ["`hysteresis`", "2147483648"]),
    ({"hysteresis": 0}, ValueError, ["`hysteresis`", "got 0"]),
    ({"hysteresis": 2, "nonfinite_count": 2}, ValueError, ["`nonfinite_count`", "[0, 1]"]),
    ({"nonfinite_count": 1}, ValueError, ["`nonfinite_count`", "[0, 0]"]),
    # An initial scale outside [min_loss_scale, max_loss_scale] is an error, not used unclamped.
    ({"loss_scale": 2.0**40}, ValueError, ["`loss_scale`", "1099511627776.0", "max_loss_scale"]),
    ({"max_loss_scale": 1.0}, ValueError, ["`loss_scale`", "32768.0", "[1.0, 1.0]"]),
    ({"loss_scale": 0.5}, ValueError, ["`loss_scale`", "0.5", "min_loss_scale"]),
]


@pytest.mark.parametrize("kwargs, error, fragments", BAD_DYNAMIC, ids=lambda v: repr(v)[:40])
def test_bad_dynamic_argument_rejected_at_construction(kwargs, error, fragments):
    kwargs = {"loss_scale": 2.0**15, **kwargs}
    with pytest.raises(error) as info:
        jaxmp.DynamicLossScale(**kwargs)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_largest_period_and_hysteresis_run_under_jit():
    ls = jaxmp.DynamicLossScale(2.0, period=INT32_MAX, hysteresis=INT32_MAX)
    out = jax.jit(lambda s: s.adjust(jnp.array(False)))(ls)
    assert float(out.loss_scale) == 2.0 and int(out.nonfinite_count) == 1


def test_integral_float_period_is_accepted_as_int():
    ls = jaxmp.DynamicLossScale(2.0, period=5.0)
    assert ls.period == 5 and type(ls.period) is int


@pytest.mark.parametrize("value", [np.int32(8), jnp.asarray(8, jnp.int32), np.int64(8)])
def test_int_array_loss_scale_warns_and_becomes_float32(value):
    with pytest.warns(UserWarning, match="Expected floating type for loss_scale"):
        ls = jaxmp.DynamicLossScale(value)
    assert ls.loss_scale.dtype == F32 and float(ls.loss_scale) == 8.0


def test_python_int_loss_scale_is_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        static, dynamic = jaxmp.StaticLossScale(2), jaxmp.DynamicLossScale(4)
    assert static.loss_scale.dtype == F32 and float(static.loss_scale) == 2.0
    assert dynamic.loss_scale.dtype == F32 and float(dynamic.loss_scale) == 4.0


def test_int_min_loss_scale_warns():
    with pytest.warns(UserWarning, match="Expected floating type for min_loss_scale"):
        ls = jaxmp.DynamicLossScale(2.0, min_loss_scale=jnp.asarray(1, jnp.int32))
    assert ls.min_loss_scale == 1.0


def test_zero_min_loss_scale_means_no_floor_but_never_zero():
    ls = jaxmp.DynamicLossScale(1.0, min_loss_scale=0.0, period=1)
    step = jax.jit(lambda s: s.adjust(jnp.array(False)))
    for _ in range(300):
        ls = step(ls)
    assert float(ls.loss_scale) == float(np.finfo(np.float32).tiny)  # 2**-126, not 0


@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=lambda d: d.name)
def test_scale_dtype_bounds_at_construction(dtype):
    tiny = float(jnp.finfo(dtype).tiny)
    assert float(jaxmp.StaticLossScale(jnp.asarray(tiny, dtype)).loss_scale) == tiny
    with pytest.raises(ValueError, match=f"`loss_scale`.*{dtype.name}"):
        jaxmp.StaticLossScale(jnp.asarray(tiny, dtype) / 2)


# Traced values cannot be checked when the object is built: they are sanitised instead.
# NaN becomes 1 (then clamped into the bounds), out-of-range values are clamped.
TRACED_SCALES = [
    (jnp.nan, 1.0),
    (jnp.inf, 2.0**32),
    (-jnp.inf, 1.0),
    (0.0, 1.0),
    (-3.0, 1.0),
    (2.0**40, 2.0**32),
    (8.0, 8.0),
]


@pytest.mark.parametrize("value, expected", TRACED_SCALES)
def test_traced_dynamic_scale_is_clamped_into_bounds(value, expected):
    make = jax.jit(lambda s: jaxmp.DynamicLossScale(s))
    ls = make(jnp.float32(value))
    assert float(ls.loss_scale) == expected and ls.loss_scale.dtype == F32
    assert float(jax.jit(lambda s: s.adjust(jnp.array(True)))(ls).loss_scale) == expected


@pytest.mark.parametrize(
    "value, expected",
    [(jnp.nan, 1.0), (jnp.inf, float(np.finfo(np.float32).max)), (0.0, 2.0**-126), (8.0, 8.0)],
)
def test_traced_static_scale_is_sanitised(value, expected):
    out = jax.jit(lambda s: jaxmp.StaticLossScale(s).loss_scale)(jnp.float32(value))
    assert float(out) == expected and out.dtype == F32


def test_traced_counters_are_clamped():
    make = jax.jit(
        lambda c, n: jaxmp.DynamicLossScale(2.0, c, period=4, hysteresis=3, nonfinite_count=n)
    )
    ls = make(jnp.int32(-7), jnp.int32(99))
    assert int(ls.counter) == 0 and int(ls.nonfinite_count) == 2
    ls = make(jnp.int32(99), jnp.int32(-1))
    assert int(ls.counter) == 3 and int(ls.nonfinite_count) == 0
    assert ls.counter.dtype == jnp.int32 and ls.nonfinite_count.dtype == jnp.int32


def test_nan_scale_put_in_by_a_tree_map_recovers():
    ls = jaxmp.DynamicLossScale(2.0**4, period=1)
    poisoned = jax.tree.map(lambda x: x * jnp.nan if x.dtype == F32 else x, ls)
    assert math.isnan(float(poisoned.loss_scale))
    step = jax.jit(lambda s, f: s.adjust(f))
    assert float(step(poisoned, jnp.array(True)).loss_scale) == 2.0
    assert float(step(poisoned, jnp.array(False)).loss_scale) == 1.0


def test_float16_traced_scale_stays_below_float16_inf():
    ls = jax.jit(lambda s: jaxmp.DynamicLossScale(s))(jnp.float16(jnp.inf))
    assert ls.loss_scale.dtype == F16 and float(ls.loss_scale) == 2.0**15


def test_static_loss_scale_is_a_static_jit_argument():
    traces = []

    @jax.jit
    def f(ls, x):
        traces.append(1)
        return ls.scale(x)

    static = jax.jit(lambda ls, x: f(ls, x), static_argnums=0)
    x = jnp.ones(2)
    assert static(jaxmp.StaticLossScale(4.0), x).tolist() == [4.0, 4.0]
    assert static(jaxmp.StaticLossScale(4.0), x).tolist() == [4.0, 4.0]
    assert hash(jaxmp.StaticLossScale(4.0)) == hash(jaxmp.StaticLossScale(4))
    assert jax.tree.leaves(jaxmp.StaticLossScale(4.0)) == []
    assert len(traces) == 1


def test_traced_static_scale_is_a_leaf():
    ls = jax.jit(lambda s: jaxmp.StaticLossScale(s))(jnp.float32(4.0))
    assert jax.tree.leaves(ls)[0].dtype == F32
    assert float(jax.jit(lambda s: s.scale(jnp.float32(2.0)))(ls)) == 8.0


@pytest.mark.parametrize("hysteresis, leaves", [(1, 2), (3, 3)])
def test_dynamic_leaves_are_loss_scale_and_counter(hysteresis, leaves):
    ls = jaxmp.DynamicLossScale(8.0, hysteresis=hysteresis)
    assert len(jax.tree.leaves(ls)) == leaves
    assert jax.tree.leaves(ls)[:2] == [ls.loss_scale, ls.counter]


@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=lambda d: d.name)
@pytest.mark.parametrize(
    "ls",
    [jaxmp.StaticLossScale(2.0**30), jaxmp.DynamicLossScale(2.0**30)],
    ids=["static", "dynamic"],
)
def test_unscale_keeps_each_leaf_dtype_and_computes_in_float32(ls, dtype):
    # jmp's behaviour: each leaf keeps its dtype. The product is computed in float32:
    # in float16, 1 / 2**30 is 0 and 2**10 / 2**30 would be 0 instead of 2**-20.
    x = jnp.asarray([2.0**10, 3.0], dtype)
    with jax.numpy_dtype_promotion("strict"):
        out = jax.jit(ls.unscale)({"g": x, "i": jnp.arange(2)})
    assert out["g"].dtype == dtype and out["i"].dtype == jnp.int32
    expected = (x.astype(jnp.float32) * 2.0**-30).astype(dtype)
    assert float(out["g"][0]) == 2.0**-20
    np.testing.assert_array_equal(
        np.asarray(out["g"], np.float32), np.asarray(expected, np.float32)
    )


def test_noop_unscale_is_identity():
    tree = {"a": jnp.ones((), jnp.float16)}
    assert jaxmp.NoOpLossScale().unscale(tree) is tree
    assert jaxmp.NoOpLossScale().scale(tree) is tree
