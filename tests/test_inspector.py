"""Tests for `jaxmp.inspect`: statistics against numpy, fault injection, jit, figure, loss scale."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import re
import subprocess
import sys
import traceback

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import jaxmp
from jaxmp._src import inspector
from jaxmp._src.inspector import locations as inspector_locations
from jaxmp._src.inspector import rules as inspector_rules
from tests.conftest import BF16, F16, F32, TOLERANCE

FORMATS = inspector.DEFAULT_FORMATS


# ---------------------------------------------------------------------------------------------
# Statistics against numpy.


def known_values(dtype):
    """Values at every edge the statistics care about, exactly representable in `dtype`."""
    f16_tiny = 2.0**-24
    edges = [
        0.0,
        -0.0,
        1.0,
        -2.5,
        f16_tiny,  # float16's smallest subnormal: kept
        f16_tiny / 2,  # exactly half: rounds to zero (ties to even)
        f16_tiny * 0.75,  # above half: rounds up to the subnormal
        2.0**-10,  # float8_e4m3fn: half its smallest subnormal, flushes
        2.0**-9.5,
        2.0**-17,  # float8_e5m2: half its smallest subnormal
        65504.0,  # float16's max
        65519.0,  # rounds down to 65504
        65520.0,  # rounds to inf
        448.0,  # float8_e4m3fn's max
        464.0,  # halfway to 480: ties to even, 448
        465.0,  # NaN in float8_e4m3fn
        57344.0,
        61440.0,  # float8_e5m2: ties to even, inf
        3.0e38,
        np.inf,
        -np.inf,
        np.nan,
    ]
    if dtype == F32:
        edges += [1e-45, -3e-39, 2.0**-126, 1e-40]  # subnormals of float32 and bfloat16
    values = np.asarray(edges, np.float64)
    with np.errstate(over="ignore"):
        cast = values.astype(dtype)
    rng = np.random.default_rng(0)
    noise = rng.standard_normal(500) * np.exp2(rng.uniform(-40, 40, 500))
    with np.errstate(over="ignore"):
        noise = noise.astype(dtype)
    return np.concatenate([cast, noise]).astype(dtype)


def numpy_stats(x, formats=FORMATS):
    x = np.asarray(x).astype(np.float64)
    finite = np.isfinite(x)
    a = np.abs(x)
    nonzero = finite & (a > 0)
    out = {
        "nan": int(np.isnan(x).sum()),
        "inf": int(np.isinf(x).sum()),
        "max_abs": float(a[finite].max()) if finite.any() else 0.0,
        "min_abs": float(a[nonzero].min()) if nonzero.any() else None,
        "nonzero": int(nonzero.sum()),
        "flush": {},
        "overflow": {},
    }
    for fmt in formats:
        with np.errstate(over="ignore", invalid="ignore"):
            cast = x.astype(np.float32).astype(getattr(ml_dtypes, fmt, fmt)).astype(np.float64)
        out["flush"][fmt] = int((nonzero & (cast == 0)).sum()) / max(out["nonzero"], 1)
        out["overflow"][fmt] = int((finite & ~np.isfinite(cast)).sum()) / max(out["nonzero"], 1)
    _, exponent = np.frexp(a[nonzero])
    hist = np.zeros(inspector.EXPONENT_MAX - inspector.EXPONENT_MIN + 1, np.int64)
    np.add.at(hist, np.clip(exponent - 1, inspector.EXPONENT_MIN, None) - inspector.EXPONENT_MIN, 1)
    out["histogram"] = hist
    return out


def test_one_pass_reduction_agrees_with_separate_reductions():
    # Rows measured on one device are reduced in one variadic reduction (`one_pass`), sharded
    # ones by separate reductions: the same extremes and counts, the same norms to rounding,
    # on every kind of row a program makes.
    from jaxmp._src.inspector import stats as stats_lib

    rng = np.random.default_rng(0)
    n = 256
    tiny = np.float32(np.finfo(np.float32).tiny)
    base = np.clip(rng.normal(size=(14, n)), -4, 4).astype(np.float32)
    refs = base.copy()
    values = (base * (1 + 1e-3 * rng.normal(size=base.shape))).astype(np.float32)
    values[1, 3], values[2, 5], values[3, 7] = np.nan, np.inf, -np.inf
    refs[4, 9], refs[5, 11] = np.inf, np.nan  # non-finite references
    values[6] = refs[6] = 0.0  # an all-zero row
    values[7], refs[7] = values[7] * 1e20, refs[7] * 1e20  # squares beyond float32
    values[8], refs[8] = values[8] * 8e37, refs[8] * 8e37  # near float32's maximum
    values[9], refs[9] = values[9] * 1e-30, refs[9] * 1e-30
    values[10, :8] = tiny * np.arange(1, 9) / 16  # subnormal values, normal references
    values[11], refs[11] = values[11] * tiny * 4, refs[11] * tiny * 4  # near the smallest
    refs[11, :4] = tiny / np.arange(2, 6)  # subnormal references
    refs[12] = 0.0  # references all zero, values not: a finite error
    refs[13] = 0.0
    refs[13, :3] = tiny / np.arange(2, 5)  # references only subnormal
    for ref in (jnp.asarray(refs), None):
        one, separate = (
            jax.jit(lambda v, r, p=p: stats_lib._measure(v, r, FORMATS, one_pass=p))(
                jnp.asarray(values), ref
            )
            for p in (True, False)
        )
        np.testing.assert_array_equal(np.asarray(one.hist), np.asarray(separate.hist))
        for a, b in zip(one.maxima, separate.maxima, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert len(one.norms) == len(separate.norms) == (4 if ref is not None else 0)
        if ref is None:
            continue
        # numpy, in float64: the error and the reference over the finite reference values.
        r_finite = np.isfinite(refs)
        diff = np.where(r_finite, values.astype(np.float64) - np.where(r_finite, refs, 0), 0)
        diff = np.where(r_finite & ~np.isfinite(values), np.inf, np.abs(diff))
        size = np.where(r_finite, refs, 0).astype(np.float64)
        want = [np.linalg.norm(diff, axis=-1), np.linalg.norm(size, axis=-1)]
        for group in (one, separate):
            for k in (0, 1):  # the error's and the reference's norms, s * sqrt(q)
                s_, q = (np.asarray(group.norms[2 * k + i], np.float64) for i in (0, 1))
                got = s_ * np.sqrt(q)
                # Row 11's errors are subnormal numbers, which XLA on CPU flushes to zero:
                # within 10% there; the others to float32 rounding.
                # Row 13's references are subnormal: their norm is too (flushed on CPU).
                rows = [*range(11), 12, 13] if k == 0 else [*range(11), 12]
                np.testing.assert_allclose(got[rows], want[k][rows], rtol=1e-5)
                assert k == 0 or got[13] < tiny
                np.testing.assert_allclose(got[11], want[k][11], rtol=0.1)
        assert np.isinf(np.asarray(one.norms[0])[[2, 3]]).all()  # inf where the ref is finite
    # The subnormal extremes of the values and of the references are reduced together where
    # either holds some: rows with subnormal values only, references only, neither.
    for rows in ([0, 10], [0, 13], [0, 11], [0, 12]):
        v, r = jnp.asarray(values[rows]), jnp.asarray(refs[rows])
        one, separate = (
            jax.jit(lambda v, r, p=p: stats_lib._measure(v, r, FORMATS, one_pass=p))(v, r)
            for p in (True, False)
        )
        for a, b in zip(one.maxima, separate.maxima, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_one_pass_is_one_reduction_of_the_rows_in_the_compiled_program():
    # The promise of the one-pass statistics: XLA compiles the extremes and both norms of the
    # rows into one variadic reduction over them (five float32 outputs per row), where the
    # separate reductions are one reduction each; and the subnormal extremes of the values
    # and of the references into one conditional (a kernel set for XLA to compile), where the
    # separate reductions have one each.
    from jaxmp._src.inspector import stats as stats_lib

    values = jnp.ones((8, 4096))

    def float_reductions(one_pass):
        measure = jax.jit(lambda v, r: stats_lib._measure(v, r, FORMATS, one_pass=one_pass))
        text = measure.lower(values, values * 1.001).compile().as_text()
        single = re.findall(r"= f32\[8\]\{0\} reduce\(", text)
        fused = re.findall(r"= \((?:f32\[8\]\{0\}(?:, )?){5}\) reduce\(", text)
        conditionals = re.findall(r" conditional\(", text)
        return len(single), len(fused), len(conditionals)

    assert float_reductions(True) == (0, 1, 1)
    single, fused, conditionals = float_reductions(False)
    assert fused == 0 and single >= 3 and conditionals == 2


def test_an_inspected_train_step_keeps_the_loss_scaling_guarantees():
    # Inspecting a mixed_float16 step changes nothing it computes: an overflowing step is
    # skipped as the plain step skips it (params and optimizer state bit-identical to the plain
    # step's), a finite one updates as the plain step does, params keep their dtype.
    tx = jaxmp.mixed_precision(optax.adam(1e-2), "mixed_float16")
    params = {"w": jax.random.normal(jax.random.key(0), (16, 16)), "b": jnp.zeros((16,))}

    def loss_fn(p, x):
        h = jnp.tanh(
            x.astype(jnp.float16) @ p["w"].astype(jnp.float16) + p["b"].astype(jnp.float16)
        )
        return jnp.mean(h.astype(jnp.float32) ** 2)

    grad = jaxmp.value_and_grad(loss_fn)

    def plain(p, state, x):
        loss, g = grad(jaxmp.get_loss_scale(state), p, x)
        updates, state = tx.update(g, state, p)
        return optax.apply_updates(p, updates), state

    def inspected(p, state, x):
        (loss, g), report = jaxmp.inspect(grad)(jaxmp.get_loss_scale(state), p, x)
        updates, state = tx.update(g, state, p)
        return optax.apply_updates(p, updates), state, report

    state = tx.init(params)
    x = jax.random.normal(jax.random.key(1), (4, 16))
    for inputs in (x, x.at[0, 0].set(1e6)):  # finite, then a float16 overflow
        want_p, want_state = jax.jit(plain)(params, state, inputs)
        got_p, got_state, report = jax.jit(inspected)(params, state, inputs)
        got, want = jax.tree.leaves((got_p, got_state)), jax.tree.leaves((want_p, want_state))
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert all(got_p[k].dtype == params[k].dtype for k in params)
    # The overflowing step (as the plain one, above): skipped, the params as they were, the
    # scale halved; the report names where the overflow is.
    for a, b in zip(jax.tree.leaves(got_p), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert (
        float(jaxmp.get_loss_scale(got_state).loss_scale)
        == float(jaxmp.get_loss_scale(state).loss_scale) / 2
    )
    assert report.first_nonfinite is not None


def test_float64_norms_near_the_float64_maximum():
    from jaxmp._src.inspector import stats as stats_lib

    with jax.enable_x64(True):
        values = np.asarray([[1.0e308, 1.0, 0.0], [3.0, 4.0, 0.0]])
        refs = np.asarray([[1.1e308, 1.0, 0.0], [0.0, 0.0, 0.0]])
        group = jax.jit(lambda v, r: stats_lib._measure(v, r, FORMATS))(values, refs)
        norms = [np.asarray(x, np.float64) for x in group.norms]
    err, ref_norm = norms[0] * np.sqrt(norms[1]), norms[2] * np.sqrt(norms[3])
    np.testing.assert_allclose(err, [1.0e307, 5.0], rtol=1e-12)
    np.testing.assert_allclose(ref_norm, [1.1e308, 0.0], rtol=1e-12)


def test_errors_combined_over_iterations_stay_finite_where_a_reference_is_zero():
    # A row measured in a loop body: its iterations' norms combine. An iteration whose
    # reference is all zero has a finite error, which must not make the combined one inf.
    def g(a, b, c):
        return ((a + b) - a) - b + c

    a = jnp.full((4,), 1000.0, jnp.bfloat16)
    b = jnp.full((4,), 0.3, jnp.bfloat16)
    cs = jnp.asarray([[0.0] * 4, [1.0] * 4], jnp.bfloat16)

    def scanned(a, b, cs):
        return lax.scan(lambda carry, c: (carry, g(a, b, c)), 0.0, cs)[1]

    policy = "p=bf16,c=bf16"
    _, report = jax.jit(jaxmp.inspect(scanned, policy))(a, b, cs)
    _, vreport = jax.jit(jax.vmap(jaxmp.inspect(g, policy), in_axes=(None, None, 0)))(a, b, cs)
    for r in (report, vreport):
        adds = [row for row in r.rows if row.primitive == "add"]
        assert adds and all(np.isfinite(row.rel_error) for row in adds), adds


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
def test_statistics_match_numpy_exactly(dtype):
    x = known_values(dtype)
    (_,), report = jax.jit(jaxmp.inspect(lambda v: [-v]))(jnp.asarray(x))
    (row,) = report.rows
    want = numpy_stats(-x.astype(np.float64))
    assert (row.primitive, row.dtype, row.shape) == ("neg", dtype.name, x.shape)
    assert (row.nan, row.inf, row.nonzero) == (want["nan"], want["inf"], want["nonzero"])
    assert row.max_abs == want["max_abs"]
    assert row.min_abs == want["min_abs"]
    assert row.flush == want["flush"]
    assert row.overflow == want["overflow"]
    np.testing.assert_array_equal(row.histogram, want["histogram"])
    if dtype == F32:  # the edges are there: nonzero fractions in every format
        assert all(row.flush[f] > 0 and row.overflow[f] > 0 for f in ("float16", "float8_e4m3fn"))
    assert row.created_nonfinite is False  # the NaN and infs came in with the input
    assert report.reference is (dtype != F32)


def test_edges_of_each_format():
    x = np.array([2.0**-25, 2.0**-25 * 1.0001, 65519.0, 65520.0, 464.0, 465.0], np.float32)
    (_,), report = jaxmp.inspect(lambda v: [v * 1.0])(x)
    (row,) = report.rows
    assert row.flush["float16"] == 1 / 6  # exactly 2^-25 ties to zero, just above does not
    assert row.overflow["float16"] == 1 / 6  # 65520 overflows, 65519 rounds down
    assert row.overflow["float8_e4m3fn"] == 3 / 6  # 464 ties down to 448; 465 is NaN
    assert row.flush["bfloat16"] == 0 and row.overflow["bfloat16"] == 0


def test_relative_error_of_a_loop_whose_first_iteration_is_all_zero():
    # The iterations' norms are combined relative to the largest scale: an iteration with no
    # nonzero reference (scale 1) must not make a tiny later one underflow to zero.
    def f(xs):
        def body(c, x):
            return c, (x.astype(jnp.bfloat16) * jnp.bfloat16(3.0)).astype(jnp.float32)

        return jax.lax.scan(body, 0.0, xs)[1]

    xs = np.zeros((3, 64), np.float32)
    xs[1] = np.random.default_rng(0).normal(size=64) * 1e-20
    ys, report = jax.jit(jaxmp.inspect(f))(xs)
    out = report.rows[-1]  # the float32 output: its values are `ys`
    assert (out.primitive, out.dtype, out.calls) == ("convert_element_type", "float32", 3)
    reference = xs[1].astype(np.float64) * 3.0  # the program in float32: exact here
    value = np.asarray(ys[1], np.float64)
    err = np.linalg.norm(value - reference) / np.linalg.norm(reference)
    assert err > 1e-4
    np.testing.assert_allclose(out.rel_error, err, rtol=1e-5)


def test_relative_error_of_a_loop_keeps_an_iteration_far_below_the_largest():
    # An iteration whose scale is 2^-67 times the largest one's, with an error that dominates
    # the row's: its squares relative to the largest scale are q * 2^-134, a normal number
    # when q is large, but (2^-67)^2 alone is subnormal and flushed to zero on CPU.
    a = np.zeros((2, 64), np.float32)
    b = np.zeros((2, 64), np.float32)
    a[0, 0], a[0, 1] = 2.0**64, 1026.0  # exact in bfloat16 but for an error of 2
    a[1], b[1] = 2.0**20 + 2.0**12 + 0.125, 2.0**20 + 2.0**12  # 0.125 computed as 0 or 2^13

    def sub(x, y):
        return x.astype(jnp.bfloat16).astype(jnp.float32) - y.astype(jnp.bfloat16).astype(
            jnp.float32
        )

    def f(a, b):
        return jax.lax.scan(lambda c, xy: (c, sub(*xy)), 0.0, (a, b))[1]

    ys, report = jax.jit(jaxmp.inspect(f))(a, b)
    reference = a.astype(np.float64) - b
    err = np.linalg.norm(np.asarray(ys, np.float64) - reference) / np.linalg.norm(reference)
    assert err > 1e-15
    (row,) = report.find("sub")
    assert row.calls == 2
    np.testing.assert_allclose(row.rel_error, err, rtol=1e-5)


def test_relative_error_and_lost_values_against_numpy():
    x = np.concatenate([np.linspace(-3, 3, 101), [1e-9, -3e-8, 2.0**-25]], dtype=np.float64).astype(
        np.float32
    )

    def f(v):
        return (v.astype(jnp.float16) * jnp.float16(3.0)).astype(jnp.float32)

    out, report = jax.jit(jaxmp.inspect(f))(x)
    (mul,) = report.find("mul")
    value = x.astype(np.float16) * np.float16(3.0)
    reference = (x * np.float32(3.0)).astype(np.float64)  # the program evaluated in float32
    err = np.linalg.norm(value.astype(np.float64) - reference) / np.linalg.norm(reference)
    np.testing.assert_allclose(mul.rel_error, err, rtol=TOLERANCE[F32])
    lost = np.sum((reference != 0) & (value == 0)) / np.sum(reference != 0)
    assert mul.underflow == lost == 2 / 103  # 1e-9 and 2^-25; -3e-8 rounds to -2^-24
    # Of the float32 reference 3 * x, only 3e-9 is below float16's range: 3 * 2^-25 is not,
    # it was lost at the cast before the product.
    assert mul.flush["float16"] == np.mean(np.abs(reference[reference != 0]) <= 2.0**-25) == 1 / 103
    np.testing.assert_array_equal(out, value.astype(np.float32))
    (cast,) = report.find("convert_element_type", line=None)[:1]
    assert cast.dtype == "float16" and cast.underflow == 2 / 103


def test_scan_rows_aggregate_every_iteration():
    xs = np.random.default_rng(1).standard_normal((7, 5)).astype(np.float32) * 1e3

    def f(xs):
        def body(carry, x):
            y = jnp.exp(x / 100.0)
            return carry + y, y

        return lax.scan(body, jnp.zeros(5), xs)

    _, report = jax.jit(jaxmp.inspect(f))(xs)
    (exp,) = report.find("exp")
    assert exp.calls == 7 and exp.loops == ("scan (7 iterations)",)
    want = numpy_stats(np.exp(xs.astype(np.float32) / np.float32(100.0)))
    assert exp.nonzero == want["nonzero"] == 35
    assert exp.overflow == want["overflow"] and exp.flush == want["flush"]
    np.testing.assert_array_equal(exp.histogram, want["histogram"])
    np.testing.assert_allclose(exp.max_abs, want["max_abs"], rtol=TOLERANCE[F32])


def test_while_cond_remat_jit_and_custom_rules_have_rows():
    @jax.custom_vjp
    def clip_grad(x):
        return jnp.sin(x)

    clip_grad.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (jnp.clip(g * jnp.cos(x), -1, 1),))

    @jax.jit
    def inner(x):
        return jnp.tanh(x) * 2.0

    def f(x, pred):
        x = jax.checkpoint(lambda v: jnp.cos(v) + 1.0)(x)
        x = lax.cond(pred, lambda v: jnp.exp(v), lambda v: jnp.log1p(v), x)
        start = (0, lax.stop_gradient(x).sum())  # a while loop is not differentiable
        _, scale = lax.while_loop(lambda c: c[0] < 4, lambda c: (c[0] + 1, c[1] * 0.5), start)
        x = x * scale
        return jax.nn.relu(clip_grad(inner(x))).sum()

    x = jnp.linspace(0.0, 1.0, 4)
    (value, grad), report = jax.jit(jaxmp.inspect(jax.value_and_grad(f)))(x, True)
    np.testing.assert_array_equal(value, f(x, True))
    np.testing.assert_array_equal(grad, jax.grad(f)(x, True))
    names = {r.primitive for r in report.rows}
    assert {"cos", "exp", "log1p", "tanh", "sin", "min", "max"} <= names, names
    (exp,) = report.find("exp", phase="forward")
    (log1p,) = report.find("log1p", phase="forward")
    assert (exp.calls, log1p.calls) == (1, 0)  # the branch not taken ran no times
    assert log1p.loops == ("cond (branch 0 of 2)",)
    halving = [r for r in report.find("mul", phase="forward") if r.loops == ("while (body)",)]
    assert halving and halving[0].calls == 4
    assert report.find("min", phase="backward")  # the custom_vjp's backward rule (clip)
    assert all(r.phase == "backward" for r in report.find("min"))


def test_first_nonfinite_follows_execution_order_inside_loops():
    def f(xs):
        def body(carry, x):
            a = jnp.log(x)  # NaN in iteration 3 (x = -1)
            b = 1.0 / (x - 1.0)  # inf in iteration 1 (x = 1): earlier
            return carry + a + b, None

        return lax.scan(body, 0.0, xs)[0]

    xs = jnp.array([2.0, 1.0, 3.0, -1.0])
    _, report = jaxmp.inspect(f)(xs)
    first = report.first_nonfinite
    assert first.primitive == "div", first
    assert report.find("log")[0].created_nonfinite


@pytest.mark.slow
def test_policy_inspects_the_autocast_program():
    def mlp(w, x):
        return jax.nn.softmax(jnp.tanh(x @ w) @ w)

    w = jax.random.normal(jax.random.key(0), (16, 16)) / 4
    x = jax.random.normal(jax.random.key(1), (8, 16))
    out, report = jax.jit(jaxmp.inspect(mlp, "mixed_float16"))(w, x)
    np.testing.assert_array_equal(out, jax.jit(jaxmp.autocast(mlp, "mixed_float16"))(w, x))
    dots = report.find("dot_general")
    assert [r.dtype for r in dots] == ["float16", "float16"]
    assert all(0 < r.rel_error < 1e-2 for r in dots)
    assert report.reference and all(r.dtype == "float32" for r in report.find("exp"))


def test_outputs_are_the_functions_own():
    def f(w, x):
        h = (x.astype(jnp.float16) @ w.astype(jnp.float16)).astype(jnp.float32)
        return jnp.tanh(h).mean(), jnp.arange(3)

    w = jax.random.normal(jax.random.key(0), (8, 8))
    x = jax.random.normal(jax.random.key(1), (4, 8))
    (loss, ints), _ = jax.jit(jaxmp.inspect(jax.value_and_grad(f, has_aux=True)))(w, x)
    want = jax.jit(jax.value_and_grad(f, has_aux=True))(w, x)
    jax.tree.map(np.testing.assert_array_equal, (loss, ints), want)


def test_formats_and_arguments_are_checked():
    with pytest.raises(TypeError, match="`fun` must be callable"):
        jaxmp.inspect(3)
    with pytest.raises(ValueError, match="`formats` must name floating dtypes.*float16"):
        jaxmp.inspect(jnp.sin, formats=("int8",))
    with pytest.raises(TypeError, match="`formats` must be a sequence"):
        jaxmp.inspect(jnp.sin, formats="float16")
    with pytest.raises(ValueError, match="policy"):
        jaxmp.inspect(jnp.sin, "float17")
    _, report = jaxmp.inspect(jnp.sin, formats=("float8_e4m3fn",))(jnp.ones(3))
    assert report.formats == ("float8_e4m3fn",) and report.rows[0].flush == {"float8_e4m3fn": 0.0}
    with pytest.raises(ValueError, match="no backward pass"):
        report.suggest_loss_scale()


# ---------------------------------------------------------------------------------------------
# Fault injection: plain JAX, Flax Linen and Flax NNX models, each with a known fault.


def inject(h, fault):
    """Returns `h` after the fault; each fault's op is on its own line, named below."""
    if fault == "overflow":
        return jnp.exp(h.astype(jnp.float16) + 12.0).astype(jnp.float32)  # FAULT overflow
    if fault == "underflow":
        return h.astype(jnp.float16).astype(jnp.float32) * 1e-9  # FAULT underflow
    if fault == "log":
        return jnp.log(h - 100.0)  # FAULT log
    if fault == "zero_div":
        return (h - h) / (h - h)  # FAULT zero_div
    raise AssertionError(fault)


def fault_line(fault):
    source = pathlib.Path(__file__).read_text().splitlines()
    (line,) = [i + 1 for i, text in enumerate(source) if text.endswith(f"# FAULT {fault}")]
    return line


# The op that goes wrong, and the pass in which it does.
FAULT_OPS = {
    "overflow": ("exp", "forward"),
    # d(1e-9 * h)/dh is 1e-9, below float16's smallest subnormal: the backward pass's cast
    # to float16 (the transpose of `astype(float32)`) flushes it to zero.
    "underflow": ("convert_element_type", "backward"),
    "log": ("log", "forward"),
    "zero_div": ("div", "forward"),
}


def jax_model(fault):
    def loss(params, x):
        with jax.named_scope("encoder"), jax.named_scope("block"):
            h = jnp.tanh(x @ params["w"])
            h = inject(h, fault)
        return jnp.mean(h * params["v"])

    params = {"w": jnp.full((4, 4), 0.1), "v": jnp.ones(4)}
    return jax.value_and_grad(loss), (params, jnp.ones((2, 4))), "encoder/block"


class LinenBlock(nn.Module):
    fault: str

    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(4, name="proj")(x))
        return inject(h, self.fault)


class LinenModel(nn.Module):
    fault: str

    @nn.compact
    def __call__(self, x):
        return jnp.mean(LinenBlock(self.fault, name="block")(x))


def linen_model(fault):
    model = LinenModel(fault)
    x = jnp.ones((2, 4))
    variables = model.init(jax.random.key(0), x)
    return jax.value_and_grad(model.apply), (variables, x), "LinenModel/block"


class NNXBlock(nnx.Module):
    def __init__(self, fault, rngs):
        self.fault = fault
        self.proj = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return inject(jnp.tanh(self.proj(x)), self.fault)


class NNXModel(nnx.Module):
    def __init__(self, fault, rngs):
        self.block = NNXBlock(fault, rngs)

    def __call__(self, x):
        return jnp.mean(self.block(x))


def nnx_model(fault):
    model = NNXModel(fault, nnx.Rngs(0))

    def step(model, x):
        return nnx.value_and_grad(lambda m, x: m(x))(model, x)

    return step, (model, jnp.ones((2, 4))), "NNXModel/block"


def debug_check(fn, args, flag):
    """The primitive and the line of this file that ``jax_debug_nans`` (or infs) names."""
    try:
        with jax.debug_nans(flag == "nans"), jax.debug_infs(flag == "infs"):
            jax.block_until_ready(jax.jit(fn)(*args))
    except FloatingPointError as e:
        primitive = re.search(r"encountered in (\w+)", str(e))[1]
        lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == __file__]
        return primitive, lines[-1]
    return None


MODELS = {"jax": jax_model, "linen": linen_model, "nnx": nnx_model}
# One fault per model in the default run, every model with every fault in the slow one.
FAST = {("jax", "log"), ("linen", "overflow"), ("nnx", "underflow"), ("nnx", "zero_div")}
CASES = [
    pytest.param(m, f, marks=() if (m, f) in FAST else pytest.mark.slow, id=f"{m}-{f}")
    for m in MODELS
    for f in FAULT_OPS
]


@pytest.mark.parametrize(("model", "fault"), CASES)
def test_fault_is_named_with_module_and_line(model, fault, capsys):
    fn, args, module = MODELS[model](fault)
    _, report = jaxmp.inspect(fn)(*args)
    op, phase = FAULT_OPS[fault]
    line = fault_line(fault)
    if fault == "underflow":
        # The first row, in program order, to lose values to underflow.
        row = next(r for r in report.rows if r.underflow)
        assert row.underflow == 1.0 and row.flush["float16"] == 1.0
        assert report.first_nonfinite is None
        assert debug_check(fn, args, "nans") is None
    else:
        row = report.first_nonfinite
        assert row is not None and row.created_nonfinite
        # jax_debug_nans names NaN sources; an overflow to inf is jax_debug_infs' business.
        flag = "infs" if fault == "overflow" else "nans"
        assert debug_check(fn, args, flag) == (row.primitive, row.line)
    assert (row.primitive, row.phase, row.module, row.line) == (op, phase, module, line)
    assert row.file == __file__ and row.function == "inject"
    # The table names it too, first.
    text = str(report)
    first_row = next(t for t in text.splitlines() if t.startswith("  ") and t.split()[0].isdigit())
    assert f"test_inspector.py:{line}" in first_row and op in first_row
    assert f"module {module}" in text
    capsys.readouterr()


# ---------------------------------------------------------------------------------------------
# Where a non-finite value comes from: an op, an argument or a constant.


def masked_softmax(x):
    mask = jnp.array([[True, True], [False, False]])  # the second row entirely masked
    scores = jnp.where(mask, x, -jnp.inf)  # SOURCE masked
    return jax.nn.softmax(scores, axis=-1)


def test_first_nonfinite_of_an_entirely_masked_softmax_row():
    x = jnp.ones((2, 2))
    out, report = jax.jit(jaxmp.inspect(masked_softmax))(x)
    assert np.isnan(out[1]).all()
    first = report.first_nonfinite
    assert first is not None and first.created_nonfinite
    # -inf - -inf: the NaN jax_debug_nans names, made from inputs that hold no NaN.
    assert (
        debug_check(masked_softmax, (x,), "nans")
        == (first.primitive, first.line)
        == ("sub", first.line)
    )
    # The -inf came from a constant, not from an op: it is reported as the source.
    (source,) = report.nonfinite_sources
    assert (source.kind, source.nan, source.inf) == ("constant", 0, 1)
    assert source.line == fault_line_of("SOURCE masked") and source.file == __file__
    text = report.table()
    assert "first non-finite value: sub (forward)" in text
    assert f"test_inspector.py:{source.line}" in text.splitlines()[2]


def test_first_nonfinite_names_the_op_reading_a_nan_parameter():
    def loss(params, x):
        return jnp.tanh(x @ params["w"]).sum()

    params = {"w": jnp.ones((2, 2)).at[0, 0].set(jnp.nan)}
    x = jnp.ones((1, 2))
    _, report = jax.jit(jaxmp.inspect(loss))(params, x)
    assert sum(r.nan > 0 for r in report.rows) == 3
    first = report.first_nonfinite
    assert first is not None and not first.created_nonfinite  # it read the NaN, made none
    assert debug_check(loss, (params, x), "nans")[0] == first.primitive == "dot_general"
    (source,) = report.nonfinite_sources
    assert (source.kind, source.name, source.nan, source.inf) == ("argument", "args[0]['w']", 1, 0)
    assert "argument args[0]['w'] (1 NaN)" in report.table()
    assert report.to_dict()["nonfinite_sources"][0]["name"] == "args[0]['w']"


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # JAX's, 1e5
def test_a_literal_that_overflows_float16_is_a_nonfinite_source():
    def loss(w):
        return jnp.sum(w.astype(jnp.float16) * 1e5).astype(jnp.float32)  # SOURCE literal

    (value, grads), report = jax.jit(jaxmp.inspect(jax.value_and_grad(loss)))(jnp.ones(3))
    assert np.isinf(value) and not np.isfinite(grads).any()
    first = report.first_nonfinite
    assert (first.primitive, first.phase) == ("mul", "forward")
    assert first.line == fault_line_of("SOURCE literal") and not first.created_nonfinite
    # 1e5 is inf in float16 already when traced: the literal is where the inf comes from.
    (source,) = report.nonfinite_sources
    assert (source.kind, source.name, source.dtype, source.inf) == ("constant", "inf", "float16", 1)
    assert source.line == fault_line_of("SOURCE literal")
    assert "none (every value is finite)" not in report.table()
    (gradient,) = report.find("mul", phase="backward")
    assert gradient.inf == gradient.ref_nonfinite == 3 and gradient.dtype == "float16"
    # The suggestion says the gradients are inf, and inf in float32 too: no scale helps.
    suggestion = report.suggest_loss_scale()
    assert suggestion.nonfinite == suggestion.reference_nonfinite == 3
    assert "3 backward values were NaN or inf" in str(suggestion)


INF16 = np.full((3,), np.inf, np.float16)


def zero_row_times_inf(form):
    """``(function, args, expected source)``: an activation with a zero row times an inf
    (0 * inf makes the NaN, the inf is the source), the inf in each form it can take."""
    x = jnp.ones((2, 3)).at[1].set(0.0)

    def h(x):
        return jnp.tanh(x).astype(jnp.float16)

    if form == "literal":
        return (lambda x: h(x) * 1e5), (x,), ("constant", "inf", (), 1)
    if form == "closed-over":
        return (lambda x: h(x) * INF16), (x,), ("constant", "f16[3]", (3,), 3)
    if form == "argument":
        return (lambda x, c: h(x) * c), (x, INF16), ("argument", "args[1]", (3,), 3)
    assert form == "traced"  # closed over from an enclosing jit: known only on device
    return (lambda x, c: jaxmp.inspect(lambda x: h(x) * c)(x)), (x, INF16), None


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # JAX's, 1e5
@pytest.mark.parametrize("form", ["literal", "closed-over", "argument", "traced"])
def test_an_inf_constant_times_zero_is_a_nonfinite_source(form):
    fun, args, expected = zero_row_times_inf(form)
    if expected is None:  # the constant is counted on device, named by its first reader
        (out, report) = jax.jit(fun)(*args)
        expected = ("constant", "f16[3]", (3,), 3)
    else:
        out, report = jaxmp.inspect(fun)(*args)
    assert np.isinf(out[0]).all() and np.isnan(out[1]).all()
    # 0 * inf: the multiply makes the NaN (jax_debug_nans names it); the inf is an input.
    first = report.first_nonfinite
    assert (first.primitive, first.created_nonfinite) == ("mul", True)
    (source,) = report.nonfinite_sources
    assert (source.kind, source.name, source.shape, source.inf, source.nan) == (*expected, 0)
    if source.kind == "constant":  # named by its first reader (the multiply, a broadcast)
        assert (source.file, source.line) == (first.file, first.line)
    header = report.table().splitlines()[:3]
    assert f"non-finite inputs: {source}" in header


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_suggest_loss_scale_when_no_backward_value_is_finite():
    def loss(w):
        return jnp.sum(w * jnp.inf)

    _, report = jaxmp.inspect(jax.value_and_grad(loss))(jnp.ones(3))
    assert [r.inf for r in report.rows if r.phase == "backward"] == [3]
    # Not "every backward value is zero": they are inf.
    with pytest.raises(
        ValueError,
        match=r"None of the backward values is finite and nonzero \(3 are NaN or inf\).*"
        "first non-finite value: mul",
    ):
        report.suggest_loss_scale()


def test_first_nonfinite_is_none_only_when_every_measured_value_is_finite():
    _, report = jax.jit(jaxmp.inspect(lambda x: jnp.exp(x) * 2.0))(jnp.ones(3))
    assert report.first_nonfinite is None and report.nonfinite_sources == []
    assert "first non-finite value: none (every value is finite)" in report.table()


def fault_line_of(marker):
    source = pathlib.Path(__file__).read_text().splitlines()
    (line,) = [i + 1 for i, text in enumerate(source) if text.endswith(f"# {marker}")]
    return line


# ---------------------------------------------------------------------------------------------
# jaxmp's own ops are not the user's code.


def test_jaxmps_own_ops_point_at_the_users_call_and_rank_last(tmp_path):
    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2) + 2.0

    inspected = jaxmp.inspect(jaxmp.value_and_grad(loss), "mixed_float16")

    @jax.jit
    def step(loss_scale, w, x):
        return inspected(loss_scale, w, x)  # CALL jaxmp

    w = jax.random.normal(jax.random.key(0), (8, 8)) / 4
    x = jax.random.normal(jax.random.key(1), (4, 8))
    _, report = step(jaxmp.DynamicLossScale(2.0**16), w, x)
    jaxmp_dir = pathlib.Path(jaxmp.__file__).parent
    assert not [r for r in report.rows if pathlib.Path(r.file).is_relative_to(jaxmp_dir)]
    # The loss scale's multiplies (the scaled loss where JAX keeps it, the backward pass's
    # seed): 2^16 overflows float16, but they are float32 by design.
    own = [r for r in report.rows if r.library == "jaxmp"]
    scale_mul = [r for r in own if r.primitive == "mul"]
    assert scale_mul and all(r.overflow["float16"] == 1.0 for r in scale_mul)
    assert all((r.file, r.line) == (__file__, fault_line_of("CALL jaxmp")) for r in own)
    assert all(r.library == "" for r in report.rows if r not in own)
    ranked = report.worst(None)
    assert all(r.library == "" for r in ranked[: len(ranked) - len(own)])
    assert "mul [jaxmp]" in report.table(None) and "mul [jaxmp]" not in report.table(3)
    # Nor do they take part in the figure or the loss scale suggestion.
    fig = report.plot(tmp_path / "f.png")
    assert not [t.get_text() for ax in fig.axes for t in ax.texts if "overflow" in t.get_text()]
    suggestion = report.suggest_loss_scale(2.0**16)
    user = [r for r in report.rows if r.phase == "backward" and r.dtype == "float16"]
    user = [r for r in user if not r.library]
    assert suggestion.rows == len(user) and suggestion.max_abs == max(r.ref_max_abs for r in user)


def own_loss(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2) + 2.0


def own_step(loss_scale, w, x):
    value, grads = jaxmp.value_and_grad(own_loss)(loss_scale, w, x)  # CALL step
    return value, grads


def own_scan_body(w, x, loss_scale):
    value, grads = jaxmp.value_and_grad(own_loss)(loss_scale, w, x)  # CALL scan
    return w - grads, value


def own_call_forms(loss_scale):
    """``name -> (function of (w, x), the marker of the line its loss scale's ops point at)``:
    jaxmp.value_and_grad closed over a loss scale, called in the ways a user writes it."""
    grad = jaxmp.value_and_grad(own_loss)
    return {
        "lambda": (lambda w, x: grad(loss_scale, w, x), "CALL lambda"),  # CALL lambda
        "partial": (functools.partial(grad, loss_scale), "CALL inspect"),
        "nested jit": (lambda w, x: jax.jit(grad)(loss_scale, w, x), "CALL jit"),  # CALL jit
        "user's function": (functools.partial(own_step, loss_scale), "CALL step"),
        "scan": (
            lambda w, x: lax.scan(
                lambda c, xi: own_scan_body(c, xi, loss_scale), w, jnp.stack([x, x])
            ),
            "CALL scan",
        ),
    }


@pytest.mark.parametrize("form", list(own_call_forms(1.0)))
def test_jaxmps_own_ops_are_recognised_however_they_are_called(form, tmp_path):
    # The loss scale's multiplies (the scaled loss, the backward pass's seed) are jaxmp's
    # however the user's code reaches jaxmp.value_and_grad: 2^16 overflows float16, but they
    # are float32 by design. The loss's own ops stay the user's.
    fun, marker = own_call_forms(jaxmp.DynamicLossScale(2.0**16))[form]
    w = jax.random.normal(jax.random.key(0), (8, 8)) / 4
    x = jax.random.normal(jax.random.key(1), (4, 8))
    _, report = jaxmp.inspect(fun, "mixed_float16")(w, x)  # CALL inspect
    scaled = [r for r in report.rows if r.ref_max_abs >= 2.0**15]
    # The backward pass's seed, and the scaled loss where JAX keeps it (jax 0.8 prunes the
    # forward product, whose value jaxmp.value_and_grad does not return).
    found = {(r.primitive, r.phase) for r in scaled}
    assert ("mul", "backward") in found and found <= {("mul", "forward"), ("mul", "backward")}
    assert all(r.library == "jaxmp" and r.overflow["float16"] == 1.0 for r in scaled)
    assert all((r.file, r.line) == (__file__, fault_line_of(marker)) for r in scaled)
    users = [r for r in report.rows if r.function == "own_loss"]
    assert users and all(r.library == "" for r in users)
    ranked = report.worst(None)
    own = [r for r in ranked if r.library]
    assert all(not r.library for r in ranked[: len(ranked) - len(own)])
    fig = report.plot(tmp_path / "f.png")
    assert not [t.get_text() for ax in fig.axes for t in ax.texts if "overflow" in t.get_text()]


def _float16_train_step():
    """``(step, w, state, x)``: a user's train step with jaxmp.mixed_precision's loss scale
    (its functions ``step`` and ``loss``), its params, optimizer state and batch."""

    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    opt = jaxmp.mixed_precision(optax.sgd(0.1), "mixed_float16")

    def step(w, state, x):
        value, grads = jaxmp.value_and_grad(loss)(jaxmp.get_loss_scale(state), w, x)
        updates, state = opt.update(grads, state, w)
        return optax.apply_updates(w, updates), state, value

    w = jax.random.normal(jax.random.key(0), (8, 8)) / 4
    x = jax.random.normal(jax.random.key(1), (4, 8))
    state = opt.init(w)
    return step, w, state, x


def test_a_full_train_step_reports_no_loss_scale_as_the_users():
    # jaxmp.mixed_precision's loss scale (its update doubles 2^15 to 2^16, which overflows
    # float16) and value_and_grad's multiplies are jaxmp's, called from the user's step.
    step, w, state, x = _float16_train_step()
    state = state._replace(loss_scale=jaxmp.DynamicLossScale(2.0**15, period=1))
    _, report = jax.jit(jaxmp.inspect(step))(w, state, x)
    scale = [r for r in report.rows if r.ref_max_abs >= 2.0**14]
    assert scale and all(r.library == "jaxmp" for r in scale)
    assert any(r.overflow["float16"] == 1.0 for r in scale)
    users = [r for r in report.rows if r.function.endswith("loss")]
    assert users and all(r.library == "" for r in users)
    # The dataclass __init__ a loss scale has is no line of the user's.
    assert all(r.file == __file__ for r in report.rows)


def _first_trace(w, x):
    """A train step of its own, traced here first: the jitted helpers it calls (the loss
    scale's update's jnp.clip) are traced from these lines."""
    opt = jaxmp.mixed_precision(optax.sgd(0.1), "mixed_float16")

    def elsewhere(w, state, x):
        grads = jaxmp.value_and_grad(lambda w: jnp.sum(x @ w))(jaxmp.get_loss_scale(state), w)[1]
        return opt.update(grads, state, w)

    return jax.jit(elsewhere)(w, opt.init(w), x)


def test_ops_of_helpers_traced_before_point_at_this_call():
    # jax 0.8 keeps a jitted helper's trace with the traceback of the call that traced it
    # first: the loss scale's update's jnp.clip, traced by _first_trace, pointed there.
    step, w, state, x = _float16_train_step()
    _first_trace(w, x)
    _, report = jax.jit(jaxmp.inspect(step))(w, state, x)
    clipped = [r for r in report.rows if r.primitive in ("max", "min")]
    assert clipped and all(r.library == "jaxmp" for r in clipped)
    functions = {r.function.rsplit(".", 1)[-1] for r in report.rows}
    assert functions <= {"step", "loss"}, functions


def test_autocasts_casts_of_the_outputs_are_jaxmps_under_a_lambda():
    def f(x):
        return jnp.tanh(x @ x)

    policy = jaxmp.get_policy("mixed_float16")
    x = jnp.ones((4, 4))
    _, report = jaxmp.inspect(lambda x: jaxmp.autocast(f, policy)(x))(x)  # CALL autocast
    (cast,) = [r for r in report.rows if r.library]
    assert (cast.primitive, cast.dtype) == ("convert_element_type", "float32")
    assert (cast.file, cast.line) == (__file__, fault_line_of("CALL autocast"))
    assert all(r.function.endswith(".f") for r in report.rows if not r.library)


def test_jaxmps_machinery_modules_exist():
    # A module renamed or moved would silently make its ops the user's.
    own = pathlib.Path(inspector_locations._own_dir())
    assert [m for m in inspector_locations._MACHINERY if not (own / m).is_file()] == []


@pytest.mark.parametrize("form", ["direct", "lambda", "jit"])
def test_jaxmps_attention_computes_the_users_model(form):
    # jaxmp code that computes the user's model on its behalf (here the attention) is the
    # user's: its rows rank and plot with the model's, at the user's line calling it.
    q = jax.random.normal(jax.random.key(0), (1, 4, 2, 8))
    fun = {
        "direct": jaxmp.dot_product_attention,
        "lambda": lambda q: jaxmp.dot_product_attention(q, q, q),  # CALL attention lambda
        "jit": lambda q: jax.jit(jaxmp.dot_product_attention)(q, q, q),  # CALL attention jit
    }[form]
    args = (q, q, q) if form == "direct" else (q,)
    _, report = jaxmp.inspect(fun)(*args)  # CALL attention direct
    assert report.find("exp") and all(r.library == "" for r in report.rows)
    line = fault_line_of(f"CALL attention {form}")
    assert all((r.file, r.line) == (__file__, line) for r in report.rows)


def test_jaxmps_own_code_is_the_whole_package():
    # An op whose innermost frame is anywhere in jaxmp (jaxmp/nnx.py, jaxmp/linen.py, not only
    # jaxmp/_src) is jaxmp's own: `_own_dir` is the package's directory, wherever this module is.
    own = pathlib.Path(inspector_locations._own_dir())
    assert own == pathlib.Path(jaxmp.__file__).resolve().parent


# ---------------------------------------------------------------------------------------------
# Cost: no statistics of constants, one reduction per size, sampling.


def test_constants_are_computed_and_measured_once_while_tracing():
    def f(x):
        c = jnp.exp(jnp.float32(3.0)) * jnp.full(4, 1e-30)  # depends on no argument
        return jnp.sin(x) * c

    inspected = jaxmp.inspect(f)
    out, report = jax.jit(inspected)(jnp.ones(4))
    np.testing.assert_array_equal(out, f(jnp.ones(4)))
    assert [r.primitive for r in report.rows][-2:] == ["sin", "mul"]
    (exp,) = report.find("exp")
    assert exp.max_abs == float(np.exp(np.float32(3.0)))
    constant = report.rows[-3]  # exp(3) * 1e-30, measured with numpy
    assert (constant.primitive, constant.nonzero, constant.flush["float16"]) == ("mul", 4, 1.0)
    # Neither the constants nor their statistics are left for XLA to compute (or fold).
    text = jax.jit(inspected).lower(jnp.ones(4)).as_text()
    assert "stablehlo.exponential" not in text
    assert text.count('"stablehlo.scatter"(') == 1


def test_rows_of_one_size_are_measured_together():
    def f(x):
        values = []
        for k in range(30):
            values.append(jnp.sin(x))
            x = values[-1] * (1.0 + k)
            values.append(x)
        return values

    inspected = jaxmp.inspect(f)
    x = jnp.linspace(0.0, 1.0, 64)
    _, report = jax.jit(inspected)(x)
    assert len(report) == 60
    text = jax.jit(inspected).lower(x).as_text()
    # One scatter (the histograms) for all 60 rows, not one per row.
    assert text.count('"stablehlo.scatter"(') == 1
    # And the statistics are those of each row alone.
    values, report = jax.jit(inspected)(x)
    for row, value in zip(report.rows, values, strict=True):
        want = numpy_stats(value)
        assert (row.max_abs, row.min_abs, row.nonzero) == (want["max_abs"], want["min_abs"], 63)
        np.testing.assert_array_equal(row.histogram, want["histogram"])


def test_rows_of_nearby_sizes_are_measured_together_with_the_same_statistics(monkeypatch):
    # Rows of a shorter size join the group of a longer one (padded with zeros) while the
    # group's padding stays small: two scatters for rows of five sizes (the 128-value rows
    # would take the first group's padding past 2^20 values), where grouping only rows of one
    # size takes five; every statistic the same as with no padding, in a float16 program
    # (errors and lost values against its float32 reference) with NaN, inf and underflow.
    def f(x):
        outs = []
        for n in (128, 2048, 16384, 65536, 61440):
            v = x[-n:].astype(jnp.float16) * 3.0
            e = jnp.exp(v)  # inf in float16 above 11.1
            outs.append(jnp.log(e - 1.0) + (v * 1e-4) ** 4)  # NaN below 0; underflow
        return outs

    x = jnp.linspace(-4.0, 4.0, 65536)
    inspected = jaxmp.inspect(f)
    _, merged = jax.jit(inspected)(x)
    assert jax.jit(inspected).lower(x).as_text().count('"stablehlo.scatter"(') == 2
    monkeypatch.setattr(inspector_rules, "_PAD_VALUES", 0)  # only rows of one size together
    alone = jaxmp.inspect(f)
    assert jax.jit(alone).lower(x).as_text().count('"stablehlo.scatter"(') == 5
    _, apart = jax.jit(alone)(x)
    assert len(merged) == len(apart) >= 30
    assert any(r.nan for r in merged.rows) and any(r.inf for r in merged.rows)
    assert any(r.underflow for r in merged.rows)
    for a, b in zip(apart.rows, merged.rows, strict=True):
        da, db = a.to_dict(), b.to_dict()
        floats = {k for k, v in da.items() if isinstance(v, float)}
        assert {k: v for k, v in da.items() if k not in floats} == {
            k: v for k, v in db.items() if k not in floats
        }
        for k in floats:  # exact but for XLA's order of summation in the norms
            np.testing.assert_allclose(da[k], db[k], rtol=TOLERANCE[F32])


def test_size_groups_pad_at_most_their_bound(monkeypatch):
    # Each size joins the group before it only while the group's padding stays at most
    # `_PAD_VALUES` values or a thirty-second of its own; rows of one size are in one group.
    class Entry:
        def __init__(self, n):
            self.value = np.zeros(n, np.float32)

    monkeypatch.setattr(inspector_rules, "_PAD_VALUES", 1000)
    sizes = [4096, 4096, 4000, 3000, 2990, 100, 90, 10, 5000, 4096, 10**6, 990_000, 10**6]
    groups = inspector_rules._size_groups([Entry(n) for n in sizes])
    assert [[e.value.size for e in g] for g in groups] == [
        [10**6, 10**6, 990_000],  # pads 10,000: more than 1000, less than 2,990,000 / 32
        [5000],  # 4096 would pad 3 x 904: more than 1000 and than 17,288 / 32
        [4096, 4096, 4096, 4000],  # 4000 pads 96
        [3000, 2990],  # 3000 would pad 1096: more than 1000 and than 19,288 / 32
        [100, 90, 10],  # pad 10 and 90
    ]
    # Sharded rows are not padded (zeros would not share their sharding): one size a group.
    unpadded = inspector_rules._size_groups([Entry(n) for n in sizes], pad=False)
    assert sorted(len(g) for g in unpadded) == [1] * 8 + [2, 3]
    assert all(len({e.value.size for e in g}) == 1 for g in unpadded)
    # Whatever the sizes, a group's padding, all of its sizes together, is within the bound:
    # one row of 2^20 values and 64 short ones is not 64 x 2^20 values to measure.
    rng = np.random.default_rng(0)
    cases = [
        [1 << 20, *range(1, 65)],
        *(rng.integers(0, 6000, rng.integers(1, 40)) for _ in range(200)),
    ]
    for sizes in cases:
        groups = inspector_rules._size_groups([Entry(int(n)) for n in sizes])
        seen = [sorted({e.value.size for e in g}) for g in groups]
        assert sorted(n for g in seen for n in g) == sorted(set(int(n) for n in sizes))
        for g in groups:
            own = sum(e.value.size for e in g)
            padding = len(g) * max(e.value.size for e in g) - own
            assert padding <= max(own // 32, 1000), (sizes, seen)


def test_rows_measured_in_several_batches_are_the_same(monkeypatch):
    # Values wait to be measured together until their body ends or 256 MiB of them wait;
    # with a limit of one byte every row is a batch of its own, and reads the NaN and inf
    # flags of its inputs from earlier batches.
    def f(x):
        h = jnp.sin(x) * 3.0
        y = jnp.log(h - 1.0)  # NaN where sin(x) * 3 < 1
        return lax.scan(lambda c, v: (c + jnp.exp(v), None), jnp.zeros(()), y)[0] / h.sum()

    x = jnp.linspace(-1.0, 1.0, 8)
    _, together = jax.jit(jaxmp.inspect(f))(x)
    monkeypatch.setattr(inspector_rules, "_PENDING_BYTES", 1)
    _, apart = jax.jit(jaxmp.inspect(f))(x)
    assert [r.primitive for r in apart.rows] == [r.primitive for r in together.rows]
    for a, b in zip(apart.rows, together.rows, strict=True):
        # Exact but for the floats: XLA fuses the two programs differently (an ulp apart).
        floats = {"max_abs", "min_abs", "ref_max_abs", "rel_error"}
        da, db = a.to_dict(), b.to_dict()
        assert {k: v for k, v in da.items() if k not in floats} == {
            k: v for k, v in db.items() if k not in floats
        }
        for k in floats:
            np.testing.assert_allclose(
                np.asarray(da[k], float), np.asarray(db[k], float), rtol=TOLERANCE[F32]
            )
    assert together.first_nonfinite.primitive == apart.first_nonfinite.primitive == "log"


DAG_OPS = (
    lambda a, b, c: jnp.log(a - 0.5),
    lambda a, b, c: jnp.exp(a * 50.0),
    lambda a, b, c: a * a + b,
    lambda a, b, c: a - b + c,
    lambda a, b, c: jnp.where(jnp.isfinite(a), a, 0.0) + jnp.sin(b),
    lambda a, b, c: a / (b - c),
    lambda a, b, c: jnp.tanh(a) * c,
)


@pytest.mark.slow  # three compiles of a 31-op program: 13 s
def test_nonfinite_provenance_across_batches_of_several_rows(monkeypatch):
    # Rows read the NaN and inf flags of inputs measured in earlier batches (one gather per
    # earlier batch): with batches of several rows, inputs from several earlier batches, the
    # same earlier row read twice and a scan reading outer rows, each row's counts and whether
    # it made its NaN or inf are those of one batch for the whole program.
    rng = np.random.default_rng(2)
    ops = [(int(rng.integers(0, 7)), rng.integers(0, k + 1, size=3)) for k in range(30)]

    def f(x):
        nodes = [x]
        for kind, (i, j, k) in ops:
            nodes.append(DAG_OPS[kind](nodes[i], nodes[j], nodes[k]))
        outer = nodes[5:9]

        def step(carry, v):
            return carry + outer[0] * v + outer[1] - outer[2] / (outer[3] + v), None

        return nodes[1:] + [lax.scan(step, jnp.zeros_like(x), jnp.arange(3.0))[0]]

    x = jnp.linspace(-1.0, 2.0, 8)

    def rows():
        _, report = jax.jit(jaxmp.inspect(f))(x)
        got = [(r.primitive, r.nan, r.inf, r.created_nonfinite, r.loops) for r in report.rows]
        return got, report.first_nonfinite.index

    whole = rows()
    assert sum(r[3] for r in whole[0]) >= 3  # several rows make a NaN or inf
    for limit in (1, 70):  # one row a batch; a few
        monkeypatch.setattr(inspector_rules, "_PENDING_BYTES", limit)
        assert rows() == whole, limit


@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=str)
def test_rows_of_different_sizes_and_dtypes_measured_together(dtype):
    # Padded with zeros to the longest of their group: no statistic may see the padding.
    def f(a, b, c):
        return [jnp.abs(a), jnp.abs(b) * 2, jnp.abs(c).astype(dtype)]

    rng = np.random.default_rng(2)
    a = known_values(dtype)[:37]
    b = (rng.standard_normal(300) * 1e-3).astype(dtype)
    c = rng.standard_normal(5).astype(np.float32)
    outs, report = jax.jit(jaxmp.inspect(f))(a, b, c)
    rows = [
        r for r in report.rows if r.primitive != "convert_element_type" or r.dtype == dtype.name
    ]
    for out in outs:
        (row,) = [r for r in rows if r.shape == out.shape and r.dtype == out.dtype.name][-1:]
        want = numpy_stats(out)
        assert (row.nan, row.inf, row.nonzero) == (want["nan"], want["inf"], want["nonzero"])
        assert (row.max_abs, row.min_abs) == (want["max_abs"], want["min_abs"])
        assert row.flush == want["flush"] and row.overflow == want["overflow"]
        np.testing.assert_array_equal(row.histogram, want["histogram"])


SHARDED = """
import json, jax, jax.numpy as jnp, numpy as np, jaxmp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

mesh = Mesh(np.array(jax.devices()), ("b",))

def f(x, w):
    h = jnp.tanh(x @ w) * 3.0
    return jnp.log(h - 2.0).sum(), h[:, :4].mean()

x = jax.random.normal(jax.random.key(0), (8, 16)) * 2
w = jax.random.normal(jax.random.key(1), (16, 16))
inspected = jax.jit(jaxmp.inspect(f))
_, single = inspected(x, w)
xs = jax.device_put(x, NamedSharding(mesh, P("b")))
ws = jax.device_put(w, NamedSharding(mesh, P()))
_, sharded = inspected(xs, ws)
text = inspected.lower(xs, ws).compile().as_text()
moves = sum(text.count(op) for op in ("all-gather(", "collective-permute(", "all-to-all("))
rows = [
    (r.primitive, r.nan, r.inf, r.nonzero, r.flush, r.overflow, r.histogram.tolist())
    for r in (single, sharded) for r in r.rows
]
half = len(rows) // 2
print(json.dumps({
    "same": rows[:half] == rows[half:],
    "first": [r.first_nonfinite.primitive for r in (single, sharded)],
    "devices": len(jax.devices()),
    "moves": moves,
}))
"""


def on_four_devices(script):
    """The JSON line `script` prints last, run in a process of its own with 4 CPU devices."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_rows_on_several_devices_are_those_of_one():
    # Values of different shardings are not stacked together: that would move them between
    # devices (24 all-gathers here). The statistics are the same as on one device.
    result = on_four_devices(SHARDED)
    assert result == {"same": True, "first": ["log", "log"], "devices": 4, "moves": 0}


EXPLICIT = """
import json, jax, jax.numpy as jnp, numpy as np, jaxmp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

mesh = jax.make_mesh((2, 2), ("b", "m"), axis_types=(AxisType.Explicit,) * 2)

def f(x, w, v, s):
    h = jnp.tanh(x * 1.7) * 3.0  # [8@b, 32@m]: elementwise, the same values as on one device
    y = h.astype(jnp.float16) * jnp.float16(300.0)  # overflows float16
    z = jnp.log(h - 2.0)  # NaN
    u = jnp.exp(v * 40.0) * 1e-30  # [16@b, 4], another sharding; replicated below
    t = (jnp.sin(w * 1e-3), jnp.cos(w[:4]))  # rows of two sizes and one sharding

    def body(c, _):  # a loop body is traced with its carry's sharding
        c = jnp.tanh(c * 1.3) * 2.0 + 1e-39
        return c, (c * 1e5).astype(jnp.float16)

    def over(c, row):  # and with its slices' sharding
        return c, jnp.sin(row) * 2.0

    # The devices of b=1 hold zeros only, those of b=0 values near 1e-20: the norms of the
    # blocks combine to those of the whole row.
    tiny = (s.astype(jnp.bfloat16) * jnp.bfloat16(1.001)).astype(jnp.float32)
    return z, y, u, t, jax.lax.scan(body, h, None, length=3), jax.lax.scan(over, 0.0, w), tiny

x = jax.random.normal(jax.random.key(0), (8, 32)) * 2
w = jax.random.normal(jax.random.key(1), (16, 32))
v = jax.random.normal(jax.random.key(2), (16, 4))
s = np.zeros((8, 16), np.float32)
s[:4] = np.random.default_rng(0).normal(size=(4, 16)) * 1e-20
inspected = jax.jit(jaxmp.inspect(f))
_, single = inspected(x, w, v, s)
with jax.set_mesh(mesh):
    args = (
        jax.device_put(x, NamedSharding(mesh, P("b", "m"))),
        jax.device_put(w, NamedSharding(mesh, P(None, "m"))),
        jax.device_put(v, NamedSharding(mesh, P("b"))),
        jax.device_put(s, NamedSharding(mesh, P("b"))),
    )
    compiled = inspected.lower(*args).compile()
    _, sharded = compiled(*args)
    lowered = compiled.as_text()
    plain = jax.jit(f).lower(*args).compile().as_text()

def fields(r):
    return [r.primitive, r.shape, r.calls, r.nan, r.inf, r.nonzero, r.flush, r.overflow,
            r.histogram.tolist(), r.max_abs, r.min_abs, r.underflow, r.ref_max_abs,
            r.created_nonfinite, r.ref_nonfinite]

moves = ("all-gather(", "collective-permute(", "all-to-all(")
print(json.dumps({
    "rows": len(single.rows),
    "same": [fields(a) for a in single.rows] == [fields(b) for b in sharded.rows],
    "err": max(
        abs((a.rel_error or 0.0) - (b.rel_error or 0.0))
        for a, b in zip(single.rows, sharded.rows)
    ),
    "first": [r.first_nonfinite.primitive for r in (single, sharded)],
    "moves": [sum(text.count(op) for op in moves) for text in (plain, lowered)],
}))
"""


def test_rows_sharded_over_explicit_mesh_axes_are_those_of_one_device():
    # `jax.set_mesh` with `Explicit` axes: each device measures its blocks of the rows, and the
    # blocks' statistics are combined (no value moves between devices for them here).
    result = on_four_devices(EXPLICIT)
    assert result["rows"] > 15 and result["same"], result
    assert result["err"] < 1e-6
    assert result["first"] == ["log", "log"]
    assert result["moves"] == [0, 0]


EXPLICIT_EDGES = """
import json, jax, jax.numpy as jnp, numpy as np, jaxmp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

explicit = jax.make_mesh((2, 2), ("b", "m"), axis_types=(AxisType.Explicit,) * 2)
mixed = jax.make_mesh((2, 2), ("b", "m"), axis_types=(AxisType.Explicit, AxisType.Auto))

def bf16(v):
    return v.astype(jnp.bfloat16).astype(jnp.float32)

def norms(x, z, a, c):
    # Devices of b=0 hold references of 0 beside errors of about 3e19 (their own scale would
    # overflow the squares); those of b=1 a scale 2^-67 times the row's (their squares
    # relative to it underflow unless taken as (q * r) * r).
    return (bf16(x) - x) + z, bf16(a) - bf16(c)

def drawn(x, key, sharded):
    kw = {"out_sharding": P("b", "m")} if sharded else {}
    noise = jax.random.normal(key, x.shape, **kw)  # traced under the mesh made `Auto`
    def scaled(v):
        return jnp.tanh(v) * 1e-20

    if sharded:
        scaled = jax.sharding.auto_axes(scaled, out_sharding=P("b", "m"))
    return x + bf16(noise), scaled(x)

def contracted(x, w, unreduced):
    if not unreduced:  # summed by the dot (the same sums on the same mesh)
        return jnp.tanh(jnp.dot(x, w, out_sharding=P("b", None)) * 1e-3)
    y = jnp.dot(x, w, out_sharding=P("b", None, unreduced={"m"}))  # parts of a sum on m
    return jnp.tanh(jax.sharding.reshard(y, P("b", None)) * 1e-3)

def nested(x, key, sharded):
    # Typed on the mesh made `Auto` inside loop bodies, loops inside `auto_axes`, and
    # `auto_axes` over one of the two axes.
    kw = {"out_sharding": P("b", "m")} if sharded else {}

    def body(c, k):
        return c, c + bf16(jax.random.uniform(k, c.shape, **kw))

    ys = jax.lax.scan(body, x, jax.random.split(key, 3))[1]

    def looped(v):  # a loop in a loop
        def step(c, _):
            return jax.lax.fori_loop(0, 2, lambda i, d: jnp.sin(d) * 1.5, c), None

        return jax.lax.scan(step, v, None, length=2)[0]

    def half(v):
        return (v * 3.0 - 1.0) * 1e-20

    if sharded:
        looped = jax.sharding.auto_axes(looped, out_sharding=P("b", "m"))
        half = jax.sharding.auto_axes(half, axes="m", out_sharding=P("b", "m"))
    return ys, looped(x), half(x)

def marked(x, reduced):  # whole on each device, marked `reduced` (for its gradient's sum)
    if reduced:
        x = jax.sharding.reshard(x, P(None, None, reduced={"m"}))
    return jnp.sin(x) * x

def constrained(x, mesh):
    y = jnp.exp(x * 0.3)
    if mesh is not None:  # the compiler shards it over the `Auto` axis
        y = jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(None, "m")))
    return jnp.sin(y) * 3.0

x = np.full((8, 16), 1.2345678e22, np.float32)
z = np.zeros((8, 16), np.float32)
z[4:] = 1000.0
a = np.zeros((8, 16), np.float32)
c = np.zeros((8, 16), np.float32)
a[0, 0], a[0, 1] = 2.0**64, 1026.0
a[4:], c[4:] = 2.0**20 + 2.0**12 + 0.125, 2.0**20 + 2.0**12
u = np.asarray(jax.random.normal(jax.random.key(1), (8, 16)))
key = jax.random.key(2)

def fields(r):
    return [r.primitive, r.shape, r.calls, r.nan, r.inf, r.nonzero, r.flush, r.overflow,
            r.histogram.tolist(), r.max_abs, r.min_abs, r.underflow, r.ref_max_abs]

def rel(r):
    return -1.0 if r.rel_error is None else r.rel_error  # -1: no reference

cases = {
    "norms": (explicit, norms, norms, (x, z, a, c), [P("b", "m")] * 4),
    "drawn": (explicit, lambda x, k: drawn(x, k, True), lambda x, k: drawn(x, k, False),
              (u, key), [P("b", "m"), None]),
    "nested": (explicit, lambda x, k: nested(x, k, True), lambda x, k: nested(x, k, False),
               (u, key), [P("b", "m"), None]),
    "unreduced": (explicit, lambda x, w: contracted(x, w, True),
                  lambda x, w: contracted(x, w, False), (u, u.T * 1e3), [P("b", "m"), P("m")]),
    "mixed": (mixed, lambda x: constrained(x, mixed), lambda x: constrained(x, None), (u,),
              [P("b", None)]),
}
cases["reduced"] = (explicit, lambda x: marked(x, True), lambda x: marked(x, False), (u,), [P()])
out = {}
for name, (mesh, sharded_f, single_f, args, specs) in cases.items():
    with jax.set_mesh(mesh):
        put = [v if p is None else jax.device_put(v, NamedSharding(mesh, p))
               for v, p in zip(args, specs)]
        _, sharded = jax.jit(jaxmp.inspect(sharded_f))(*put)
        if name == "unreduced":  # against the same sums made by the dot itself
            _, single = jax.jit(jaxmp.inspect(single_f))(*put)
    if name != "unreduced":
        _, single = jax.jit(jaxmp.inspect(single_f))(*args)
    out[name] = {
        "rows": len(single.rows),
        "same": [fields(r) for r in single.rows] == [fields(r) for r in sharded.rows],
        "rel": [[rel(r) for r in rep.rows] for rep in (single, sharded)],
    }
with jax.set_mesh(explicit):
    put = [jax.device_put(v, NamedSharding(explicit, P("b", "m"))) for v in (x, z, a, c)]
    ys, report = jax.jit(jaxmp.inspect(norms))(*put)
references = (z.astype(np.float64), a.astype(np.float64) - c)
out["norms"]["numpy"] = [
    float(np.linalg.norm(np.asarray(y, np.float64) - r) / np.linalg.norm(r))
    for y, r in zip(ys, references)
]
out["norms"]["outputs"] = [
    [r for r in report.rows if r.primitive == p][-1].rel_error for p in ("add", "sub")
]
print(json.dumps(out))
"""


def test_explicit_mesh_axes_edges_are_those_of_one_device():
    # Norms whose blocks alone would overflow or underflow; values drawn by jax.random with an
    # `out_sharding` and computed inside `jax.sharding.auto_axes` (typed on the mesh made
    # `Auto`); a dot whose sum is left in parts on the devices (`unreduced`), measured as the
    # sum; a value marked `reduced`; a value the compiler shards over the `Auto` axis of a
    # mixed mesh.
    result = on_four_devices(EXPLICIT_EDGES)
    for name, case in result.items():
        assert case["rows"] > 1 and case["same"], (name, case)
        single, sharded = case["rel"]
        np.testing.assert_allclose(sharded, single, rtol=1e-5, err_msg=name)
    # Both norm rows' relative errors against numpy's (float64) of the values computed.
    expected, got = result["norms"]["numpy"], result["norms"]["outputs"]
    assert min(expected) > 1e-15
    np.testing.assert_allclose(got, expected, rtol=1e-5)


EXPLICIT_STEP = """
import json, jax, jax.numpy as jnp, numpy as np, optax, jaxmp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

mesh = jax.make_mesh((2, 2), ("b", "m"), axis_types=(AxisType.Explicit,) * 2)
tx = jaxmp.mixed_precision(optax.adam(1e-2), "mixed_float16")

def loss_fn(p, x):
    h = x.astype(jnp.float16) * p["w"].astype(jnp.float16) + p["b"].astype(jnp.float16)
    return jnp.mean(jnp.tanh(h).astype(jnp.float32) ** 2)

grad = jaxmp.value_and_grad(loss_fn)

def plain(p, state, x):
    loss, g = grad(jaxmp.get_loss_scale(state), p, x)
    updates, state = tx.update(g, state, p)
    return optax.apply_updates(p, updates), state

def inspected(p, state, x):
    (loss, g), report = jaxmp.inspect(grad)(jaxmp.get_loss_scale(state), p, x)
    updates, state = tx.update(g, state, p)
    return optax.apply_updates(p, updates), state, report

def equal(a, b):
    return all(
        np.array_equal(np.asarray(u), np.asarray(v))
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )

out = []
with jax.set_mesh(mesh):
    put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
    params = {"w": put(jax.random.normal(jax.random.key(0), (8, 16)), P("b", "m")),
              "b": put(jnp.zeros((16,)), P("m"))}
    state = tx.init(params)
    x = jax.random.normal(jax.random.key(1), (8, 16))
    for inputs in (x, x.at[0, 0].set(1e6)):  # finite, then a float16 overflow
        inputs = put(inputs, P("b", "m"))
        want_p, want_state = jax.jit(plain)(params, state, inputs)
        got_p, got_state, report = jax.jit(inspected)(params, state, inputs)
        out.append({
            "as_plain": equal((got_p, got_state), (want_p, want_state)),
            "dtypes": all(got_p[k].dtype == params[k].dtype for k in params),
            "params_kept": equal(got_p, params),
            "scale": [float(jaxmp.get_loss_scale(s).loss_scale) for s in (state, got_state)],
            "nonfinite": report.first_nonfinite is not None,
        })
print(json.dumps(out))
"""


def test_an_inspected_step_on_explicit_mesh_axes_keeps_the_loss_scaling_guarantees():
    # As on one device (`test_an_inspected_train_step_keeps_the_loss_scaling_guarantees`):
    # the same step as the plain one, bit for bit, params in their dtype; the float16
    # overflow skipped (params as they were, the scale halved) and named in the report.
    finite, overflow = on_four_devices(EXPLICIT_STEP)
    assert finite == {
        "as_plain": True, "dtypes": True, "params_kept": False,
        "scale": [32768.0, 32768.0], "nonfinite": False,
    }  # fmt: skip
    assert overflow == {
        "as_plain": True, "dtypes": True, "params_kept": True,
        "scale": [32768.0, 16384.0], "nonfinite": True,
    }  # fmt: skip


def test_every_and_modules_sample_the_rows():
    def f(x):
        with jax.named_scope("encoder"):
            x = jnp.sin(x) + 1.0
        with jax.named_scope("decoder"):
            x = jnp.cos(x) * 2.0
        return jnp.exp(x)

    x = jnp.ones(3)
    full = jaxmp.inspect(f)(x)[1]
    assert [r.primitive for r in full.rows] == ["sin", "add", "cos", "mul", "exp"]
    every = jaxmp.inspect(f, every=2)(x)[1]
    assert [r.primitive for r in every.rows] == ["sin", "cos", "exp"]
    decoder = jaxmp.inspect(f, modules="^dec")(x)[1]
    assert [r.primitive for r in decoder.rows] == ["cos", "mul"]
    assert "sampled" in decoder.table()
    with pytest.raises(ValueError, match="`every` must be a positive int, got 0"):
        jaxmp.inspect(f, every=0)
    with pytest.raises(ValueError, match="`modules` must be a regular expression.*'enc\\['"):
        jaxmp.inspect(f, modules="enc[")


def test_sampled_out_ops_still_tell_where_a_nan_came_from():
    def f(x):
        y = jnp.log(x)  # NaN for x < 0: sampled out
        return jnp.sin(y) + jnp.cos(y)

    _, report = jaxmp.inspect(f, every=2)(jnp.array([-1.0, 1.0]))
    assert [r.primitive for r in report.rows] == ["log", "cos"]
    assert report.first_nonfinite.primitive == "log"
    _, report = jaxmp.inspect(f, modules="nothing")(jnp.array([-1.0, 1.0]))
    assert len(report) == 0 and report.first_nonfinite is None


# ---------------------------------------------------------------------------------------------
# Under jax.vmap; finding rows.


def test_vmap_of_inspect_reads_over_the_whole_batch():
    def f(x):
        return jnp.exp(x) / 3.0

    xs = jnp.array([[1.0, 100.0], [0.5, -2.0], [3.0, 1e-30]])
    _, batched = jax.vmap(jaxmp.inspect(f))(xs)
    _, whole = jaxmp.inspect(jax.vmap(f))(xs)
    assert [r.primitive for r in batched.rows] == [r.primitive for r in whole.rows]
    for a, b in zip(batched.rows, whole.rows, strict=True):
        assert (a.nan, a.inf, a.nonzero, a.max_abs, a.min_abs) == (
            b.nan,
            b.inf,
            b.nonzero,
            b.max_abs,
            b.min_abs,
        )
        assert a.flush == b.flush and a.overflow == b.overflow
        np.testing.assert_array_equal(a.histogram, b.histogram)
        assert a.calls == 3 and a.shape == (2,)
    assert batched.first_nonfinite.primitive == whole.first_nonfinite.primitive == "exp"
    assert "exp" in str(batched)


def test_find_checks_its_arguments():
    _, report = jaxmp.inspect(jax.value_and_grad(lambda w: jnp.sum(jnp.tanh(w @ w))))(
        jnp.ones((2, 2))
    )
    assert report.find("dot_general") and report.find("exp") == []  # a primitive, not here
    with pytest.raises(
        ValueError,
        match="`primitive` must name a JAX primitive, got 'dot_generl'; did you mean 'dot_general'",
    ):
        report.find("dot_generl")
    with pytest.raises(
        ValueError,
        match="`phase` must be 'forward' or 'backward', got 'fwd'; did you mean 'forward'",
    ):
        report.find(phase="fwd")
    with pytest.raises(ValueError, match="`module` must be a module path of the report"):
        report.find(module="encoder")


# ---------------------------------------------------------------------------------------------
# Under jit, inside a train step.


def test_inside_a_jitted_train_step_traced_once():
    traces = []

    def loss(w, x):
        traces.append(1)
        h = (x.astype(jnp.float16) @ w.astype(jnp.float16)).astype(jnp.float32)
        return jnp.mean(h**2)

    grad_fn = jax.value_and_grad(loss)
    inspected = jaxmp.inspect(grad_fn)

    @jax.jit
    def step(w, x):
        loss, g = grad_fn(w, x)
        return w - 0.1 * g, loss

    @jax.jit
    def inspected_step(w, x):
        (loss, g), report = inspected(w, x)
        return w - 0.1 * g, loss, report

    w = jax.random.normal(jax.random.key(0), (8, 8))
    x = jax.random.normal(jax.random.key(1), (4, 8))
    reports = []
    for i in range(6):
        if i % 2 == 0:  # every other step
            new_w, value, report = inspected_step(w, x)
            reports.append(report)
            np.testing.assert_array_equal(new_w, step(w, x)[0])
        w, value = step(w, x)
    assert len(traces) == 2  # one trace per jitted function, none per step
    assert isinstance(reports[0], jaxmp.Report)
    maxima = [r.find("dot_general", phase="forward")[0].max_abs for r in reports]
    assert len(set(maxima)) == 3  # each step's own values: no two alike


def test_eager_call_compiles_once_per_signature():
    traces = []

    def f(x):
        traces.append(1)
        return jnp.exp(x)

    inspected = jaxmp.inspect(f)
    for _ in range(3):
        inspected(jnp.ones(3))
    inspected(jnp.ones(4))
    assert len(traces) == 2


# ---------------------------------------------------------------------------------------------
# Loss scale suggestion.


def test_suggest_loss_scale_against_numpy():
    grads = np.array([3.0e-9, 2.0e-7, 1e-5, 0.5, 40.0], np.float32)

    def f(w):
        # Each gradient element is `grads` (times the loss scale of 8 the program applies).
        return jnp.sum(w.astype(jnp.float16).astype(jnp.float32) * grads * 8.0)

    _, report = jaxmp.inspect(jax.grad(f))(jnp.ones(5, jnp.float32))
    suggestion = report.suggest_loss_scale(loss_scale=8.0)
    # Largest backward value stored in float16: 40 * 8 = 320; 320 * 2 * 2^k <= 65504.
    assert suggestion.loss_scale == 8.0 * 2.0**6
    assert suggestion.format == "float16" and suggestion.margin == 2.0
    scaled = grads.astype(np.float64) * 8.0 * 2.0**6
    assert suggestion.underflow == np.mean(scaled < 2.0**-25) == 0.0
    assert suggestion.current_underflow == np.mean(grads * 8.0 < 2.0**-25) == 1 / 5
    assert suggestion.loss_scale * 320 / 8.0 * 2 <= 65504 < suggestion.loss_scale * 320 / 8.0 * 4
    assert "2^9" in str(suggestion)
    # The loss scale objects `jaxmp.value_and_grad` takes are read as their current scale.
    for scale in (
        jaxmp.DynamicLossScale(8.0),
        jaxmp.StaticLossScale(8.0),
        jnp.float32(8.0),
        np.float16(8.0),
    ):
        assert report.suggest_loss_scale(scale) == suggestion
    with pytest.raises(ValueError, match="`loss_scale` must be a positive number or a loss scale"):
        report.suggest_loss_scale("8")
    with pytest.raises(ValueError, match="`loss_scale` must be a positive number or a loss scale"):
        report.suggest_loss_scale(jaxmp.NoOpLossScale().adjust(True).__class__)
    with pytest.raises(TypeError, match="concrete.*outside `jax.jit`"):
        jax.jit(lambda s: report.suggest_loss_scale(s).loss_scale)(jaxmp.DynamicLossScale(8.0))
    with pytest.raises(ValueError, match="`margin` must be a number of at least 1"):
        report.suggest_loss_scale(margin=0.5)


# ---------------------------------------------------------------------------------------------
# Reading the report: table, JSON, figure.


@pytest.fixture(scope="module")
def overflow_report():
    fn, args, _ = jax_model("overflow")
    return jaxmp.inspect(fn)(*args)[1]


def test_to_json_writes_every_row_and_the_table_lists_the_worst(overflow_report):
    report = overflow_report
    data = json.loads(report.to_json())
    assert data["formats"] == list(FORMATS)
    assert data["first_nonfinite"] == report.first_nonfinite.index
    row = data["rows"][report.first_nonfinite.index]
    assert row["primitive"] == "exp" and row["module"] == "encoder/block"
    assert row["histogram"]["exponent_min"] is not None
    assert len(data["rows"]) == len(report)
    table = report.table(limit=3)
    assert "3 worst of" in table and table.count("\n  ") >= 4
    assert "first non-finite value: exp (forward)" in table


def test_figure_is_labelled(overflow_report, tmp_path):
    report = overflow_report
    path = tmp_path / "inspect.png"
    fig = report.plot(path, title="a model")
    assert path.stat().st_size > 10_000
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert {"float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"} <= set(texts)
    assert any("overflow" in t for t in texts)
    labels = [t.get_text() for ax in fig.axes for t in ax.get_yticklabels()]
    assert "encoder/block" in labels
    assert all("log2 |x|" in ax.get_xlabel() for ax in fig.axes[1::2])
    assert "a model" in fig._suptitle.get_text()


def test_figure_without_matplotlib_says_what_to_install(monkeypatch):
    _, report = jaxmp.inspect(jnp.sin)(jnp.ones(3))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        report.plot()


# ---------------------------------------------------------------------------------------------
# The line a large program gets: how many values will be measured.


def test_a_large_program_says_how_many_values_it_measures(caplog):
    def big(x):
        return jnp.exp(jnp.sin(x)).sum()

    n = 1 << 22  # two rows of 4M values each: 8.4M, under the threshold
    with caplog.at_level("WARNING", logger="jaxmp.inspect"):
        jax.eval_shape(jaxmp.inspect(big), jax.ShapeDtypeStruct((n,), jnp.float32))
    assert caplog.records == []

    def scanned(x):
        with jax.named_scope("body"):
            x = lax.scan(lambda c, _: (jnp.sin(c), None), x, length=3)[0]
        with jax.named_scope("head"):
            return x[:8].sum()

    inspected = jaxmp.inspect(jax.value_and_grad(scanned), "mixed_float16")
    with caplog.at_level("WARNING", logger="jaxmp.inspect"):
        jax.eval_shape(inspected, jax.ShapeDtypeStruct((n,), jnp.float32))
        jax.eval_shape(inspected, jax.ShapeDtypeStruct((n,), jnp.float32))  # traced once
    (record,) = caplog.records
    rows = len(jax.eval_shape(inspected, jax.ShapeDtypeStruct((8,), jnp.float32))[1].metas)
    assert record.name == "jaxmp.inspect" and record.levelname == "WARNING"
    message = record.getMessage()
    assert "\n" not in message
    # The scan's rows count each of its 3 iterations.
    assert message.startswith(f"jaxmp.inspect(scanned): measuring {rows} op outputs, ")
    assert re.search(r", (\d+\.\d)M values a call", message)
    assert "every=16" in message and "modules=" in message
    assert "logging.getLogger('jaxmp.inspect').setLevel('ERROR')" in message
    # Sampling measures fewer: under the threshold, no line.
    caplog.clear()
    with caplog.at_level("WARNING", logger="jaxmp.inspect"):
        jax.eval_shape(
            jaxmp.inspect(jax.value_and_grad(scanned), "mixed_float16", modules="head"),
            jax.ShapeDtypeStruct((n,), jnp.float32),
        )
    assert caplog.records == []


def test_measured_values_count_scan_iterations_and_while_bodies_once():
    from jaxmp._src.inspector import api

    def loops(x):
        x = lax.scan(lambda c, _: (jnp.sin(c), None), x, length=5)[0]
        # A while loop (its iterations known when it runs): its body counted once.
        x = lax.while_loop(lambda c: c[0] < 7, lambda c: (c[0] + 1, jnp.cos(c[1])), (0, x))[1]
        return jnp.exp(x)

    _, report = jax.eval_shape(jaxmp.inspect(loops), jax.ShapeDtypeStruct((10,), jnp.float32))
    by_op = {m.primitive: m for m in report.metas}
    assert set(by_op) >= {"sin", "cos", "exp"}
    assert api._measured_values(report.metas) == sum(
        10 * (5 if m.primitive == "sin" else 1) for m in report.metas
    )
