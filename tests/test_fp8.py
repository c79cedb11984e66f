"""FP8 recipes, quantisation and the FP8 ``dot_general`` (`jaxmp._src.fp8`).

References are numpy with ml_dtypes' FP8 types, written from the sources each recipe cites:
Transformer Engine's per-tensor scaling and its delayed-scaling update rule, DeepSeek-V3's
1x128 tiles and 128x128 blocks, and the OCP MX specification's shared E8M0 exponent. CPUs
run the FP8 types exactly, so quantised values are compared bit for bit.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import jaxmp
from jaxmp._src import fp8_dot, fp8_scaling

E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
NP_FORMATS = {E4M3: ml_dtypes.float8_e4m3fn, E5M2: ml_dtypes.float8_e5m2}

# The one tolerance table for FP8 values: the unit roundoff of each format (half its
# epsilon: 2**-4 for E4M3, 2**-3 for E5M2), the largest relative error of rounding one
# value in range. A product of an `a` and a `b` value carries at most u_a + u_b + u_a*u_b.
FP8_UNIT_ROUNDOFF = {d: float(ml_dtypes.finfo(NP_FORMATS[d]).eps) / 2 for d in (E4M3, E5M2)}


def product_tolerance(a, b):
    """Norm-wise relative tolerance of a sum of products of `a`- and `b`-format values."""
    ua, ub = FP8_UNIT_ROUNDOFF[jnp.dtype(a)], FP8_UNIT_ROUNDOFF[jnp.dtype(b)]
    return ua + ub + ua * ub


def rel_err(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def bits(q):
    return np.asarray(q).view(np.uint8)


# --- numpy references -----------------------------------------------------------------------


def np_max(fmt):
    return np.float32(ml_dtypes.finfo(NP_FORMATS[jnp.dtype(fmt)]).max)


def np_quantize(x, scale, fmt):
    """Scale in float32, saturate, round to nearest (Transformer Engine's cast)."""
    limit = np_max(fmt)
    scaled = np.asarray(x, np.float32) * np.float32(scale)
    return np.clip(scaled, -limit, limit).astype(NP_FORMATS[jnp.dtype(fmt)])


def np_pow2_scale(amax, fmt):
    """The largest power of two not above fp8_max / amax (1 for a zero amax)."""
    if amax == 0:
        return np.float32(1)
    exponent = int(np.floor(np.log2(np.float64(np_max(fmt)) / np.float64(amax))))
    while np.float64(amax) * 2.0 ** (exponent + 1) <= np_max(fmt):
        exponent += 1
    while np.float64(amax) * 2.0**exponent > np_max(fmt):
        exponent -= 1
    return np.float32(2.0**exponent)


def np_current(x, fmt):
    """Per-tensor current scaling: the largest power of two not above fp8_max / amax."""
    scale = np_pow2_scale(np.max(np.abs(x)), fmt)
    return np_quantize(x, scale, fmt), scale


def np_tiles(x, tile, fmt):
    """DeepSeek-V3's activation tiles: one scale per row and `tile` values along the columns."""
    rows, cols = x.shape
    q = np.empty(x.shape, NP_FORMATS[jnp.dtype(fmt)])
    scale_inv = np.empty((rows, -(-cols // tile)), np.float32)
    for r in range(rows):
        for j, c in enumerate(range(0, cols, tile)):
            block = x[r, c : c + tile]
            scale = np_max(fmt) / np.float32(np.max(np.abs(block)))
            q[r, c : c + tile] = np_quantize(block, scale, fmt)
            scale_inv[r, j] = np.float32(1) / scale
    return q, scale_inv


def np_weight_blocks(x, block, fmt):
    """DeepSeek-V3's weight blocks: one scale per `block` x `block` square."""
    rows, cols = x.shape
    q = np.empty(x.shape, NP_FORMATS[jnp.dtype(fmt)])
    scale_inv = np.empty((rows, -(-cols // block)), np.float32)
    for r in range(0, rows, block):
        for j, c in enumerate(range(0, cols, block)):
            square = x[r : r + block, c : c + block]
            scale = np_max(fmt) / np.float32(np.max(np.abs(square)))
            q[r : r + block, c : c + block] = np_quantize(square, scale, fmt)
            scale_inv[r : r + block, j] = np.float32(1) / scale
    return q, scale_inv


def np_mx(x, block, fmt):
    """MXFP8 (OCP MX v1.0 blocks, stored as E8M0) with Transformer Engine's rounding: the
    smallest X = 2**x with amax / X <= fp8_max (the OCP example's floor(log2(amax)) -
    emax_elem, plus one where that would saturate the block's maximum); 1 for a zero block."""
    emax = {E4M3: 8, E5M2: 15}[jnp.dtype(fmt)]
    rows, cols = x.shape
    q = np.empty(x.shape, NP_FORMATS[jnp.dtype(fmt)])
    scales = np.empty((rows, -(-cols // block)), ml_dtypes.float8_e8m0fnu)
    for r in range(rows):
        for j, c in enumerate(range(0, cols, block)):
            values = x[r, c : c + block].astype(np.float32)
            amax = np.max(np.abs(values))
            exponent = int(np.floor(np.log2(amax))) - emax if amax > 0 else 0
            if amax / np.float64(2.0) ** exponent > np_max(fmt):
                exponent += 1
            exponent = min(max(exponent, -126), 126)
            q[r, c : c + block] = np_quantize(values, np.ldexp(np.float32(1), -exponent), fmt)
            scales[r, j] = np.ldexp(np.float32(1), exponent)
    return q, scales


def dequantized(q, scale_inv, tile):
    return q.astype(np.float32) * np.repeat(scale_inv.astype(np.float32), tile, axis=1)


def known_arrays():
    """Gaussian values, and the same with a few large outliers (the block recipes' case)."""
    rng = np.random.default_rng(0)
    plain = rng.standard_normal((256, 512)).astype(np.float32)
    outliers = plain.copy()
    outliers[3, 17] = 3.0e5
    outliers[200, 300] = -2.0e5
    return {"gaussian": plain, "outliers": outliers}


# --- Recipes ---------------------------------------------------------------------------------


_FP8_CHOICES = "must be one of float8_e4m3fn, float8_e5m2"


@pytest.mark.parametrize(
    ("recipe", "kwargs", "message"),
    [
        (
            jaxmp.Float8CurrentScaling,
            {"fwd_dtype": jnp.bfloat16},
            f"`fwd_dtype` {_FP8_CHOICES}, got bfloat16.",
        ),
        (
            jaxmp.Float8CurrentScaling,
            {"bwd_dtype": "e5m2"},
            f"`bwd_dtype` {_FP8_CHOICES}, got 'e5m2'.",
        ),
        (jaxmp.DelayedScaling, {"history_len": 0}, "`history_len` must be an integer >= 1, got 0."),
        (
            jaxmp.DelayedScaling,
            {"history_len": 2.0},
            "`history_len` must be an integer >= 1, got 2.0.",
        ),
        (
            jaxmp.DelayedScaling,
            {"amax_compute": "avg"},
            "`amax_compute` must be one of 'max', 'most_recent', got 'avg'.",
        ),
        (jaxmp.DelayedScaling, {"margin": -1}, "`margin` must be an integer >= 0, got -1."),
        (
            jaxmp.Float8BlockScaling,
            {"tile_size": True},
            "`tile_size` must be an integer >= 1, got True.",
        ),
        (
            jaxmp.Float8BlockScaling,
            {"weight_block_size": 0},
            "`weight_block_size` must be an integer >= 1, got 0.",
        ),
        (
            jaxmp.MXFP8BlockScaling,
            {"block_size": -32},
            "`block_size` must be an integer >= 1, got -32.",
        ),
    ],
)
def test_recipe_arguments_are_validated_at_construction(recipe, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        recipe(**kwargs)


@pytest.mark.parametrize(
    "recipe",
    [
        jaxmp.Float8CurrentScaling(),
        jaxmp.DelayedScaling(history_len=16, amax_compute="most_recent", margin=1),
        jaxmp.Float8BlockScaling(),
        jaxmp.MXFP8BlockScaling(),
    ],
    ids=lambda r: type(r).__name__,
)
def test_recipes_are_frozen_hashable_values(recipe):
    twin = type(recipe)(**{f.name: getattr(recipe, f.name) for f in dataclasses.fields(recipe)})
    assert twin == recipe and hash(twin) == hash(recipe)
    assert recipe.fwd_dtype == E4M3 and recipe.bwd_dtype == E5M2  # normalised jnp.dtype
    with pytest.raises(AttributeError):
        recipe.fwd_dtype = E5M2
    # A static argument of jit: equal recipes share one compilation.
    f = jax.jit(lambda x, r: x * 2, static_argnums=1)
    assert float(f(jnp.ones(()), recipe)) == float(f(jnp.ones(()), twin)) == 2.0


def test_autocast_rejects_what_is_not_a_recipe():
    with pytest.raises(TypeError, match="`fp8` must be an FP8 recipe"):
        jaxmp.autocast(jnp.dot, "mixed_bfloat16", fp8="current")
    with pytest.raises(ValueError, match="`fp8_exclude` must hold valid regexes, got '\\('"):
        jaxmp.autocast(jnp.dot, "mixed_bfloat16", fp8=jaxmp.Float8CurrentScaling(), fp8_exclude="(")
    with pytest.raises(TypeError, match="`fp8_exclude` needs an FP8 recipe"):
        jaxmp.autocast(jnp.dot, "mixed_bfloat16", fp8_exclude="head")


# --- Quantisation against numpy --------------------------------------------------------------


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda d: d.name)
@pytest.mark.parametrize("name", ["gaussian", "outliers"])
def test_per_tensor_quantisation_matches_numpy(name, fmt):
    x = known_arrays()[name]
    q_ref, scale_ref = np_current(x, fmt)
    exponent = jax.jit(lambda x: fp8_scaling.tensor_exponent(x, fmt, jnp.float32))(x)
    scale = np.float32(2.0 ** int(exponent))
    q = jax.jit(fp8_scaling.quantize, static_argnums=2)(x, scale, fmt)
    assert q.dtype == fmt
    assert np.float32(scale) == scale_ref
    np.testing.assert_array_equal(bits(q), bits(q_ref))


@pytest.mark.parametrize("name", ["gaussian", "outliers"])
def test_block_quantisation_matches_numpy(name):
    x = known_arrays()[name]
    run = jax.jit(
        fp8_scaling.quantize_blocks, static_argnums=(1, 2, 3), static_argnames="power_of_two"
    )
    # Activation tiles: 1x128.
    q, scale_inv = run(x[None], E4M3, 128, 1)
    q_ref, s_ref = np_tiles(x, 128, E4M3)
    np.testing.assert_array_equal(bits(q.reshape(x.shape)), bits(q_ref))
    np.testing.assert_array_equal(np.asarray(scale_inv[0]), s_ref)
    # Weight blocks: 128x128.
    q, scale_inv = run(x[None], E4M3, 128, 128)
    q_ref, s_ref = np_weight_blocks(x, 128, E4M3)
    np.testing.assert_array_equal(bits(q.reshape(x.shape)), bits(q_ref))
    np.testing.assert_array_equal(np.asarray(scale_inv[0]), s_ref)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda d: d.name)
@pytest.mark.parametrize("name", ["gaussian", "outliers"])
def test_mx_quantisation_matches_the_rounded_up_ocp_rule(name, fmt):
    x = known_arrays()[name]
    x = x * np.float32(2.0**-20)  # far from 1: the shared exponents are not near zero
    run = jax.jit(
        fp8_scaling.quantize_blocks, static_argnums=(1, 2, 3), static_argnames="power_of_two"
    )
    q, scale_inv = run(x[None], fmt, 32, 1, power_of_two=True)
    q_ref, scales_ref = np_mx(x, 32, fmt)
    np.testing.assert_array_equal(bits(q.reshape(x.shape)), bits(q_ref))
    np.testing.assert_array_equal(np.asarray(scale_inv[0]), scales_ref.astype(np.float32))
    # Every scale is a power of two, exactly representable in E8M0.
    mantissa, _ = np.frexp(np.asarray(scale_inv))
    assert np.all(mantissa == 0.5)


def quantisation_errors(x):
    """Relative error of the dequantised ordinary values of x (|x| < 100), per recipe.

    The outliers themselves are left out of the measure: what matters is what they cost
    the other values. The delayed recipe quantises with the scale of last step's amax,
    taken as half of this one's (the tensor grew: its largest values saturate).
    """
    ordinary = np.abs(x) < 100
    e4m3 = E4M3

    def error(deq):
        return rel_err(np.asarray(deq)[ordinary], x[ordinary])

    q, scale = np_current(x, e4m3)
    errors = {"current": error(q.astype(np.float32) / scale)}
    scale = np_max(e4m3) / np.float32(np.max(np.abs(x)) * 0.5)
    errors["delayed"] = error(np_quantize(x, scale, e4m3).astype(np.float32) / scale)
    blocks = jax.jit(
        fp8_scaling.quantize_blocks, static_argnums=(1, 2, 3), static_argnames="power_of_two"
    )
    for name, tile, rows, pow2 in [
        ("block (1x128)", 128, 1, False),
        ("block (128x128)", 128, 128, False),
        ("mxfp8", 32, 1, True),
    ]:
        q, s = blocks(jnp.asarray(x)[None], e4m3, tile, rows, power_of_two=pow2)
        errors[name] = error(dequantized(np.asarray(q).reshape(x.shape), s[0], tile))
    return errors


def test_quantisation_error_per_recipe_and_the_outlier_case():
    arrays = known_arrays()
    plain = quantisation_errors(arrays["gaussian"])
    outliers = quantisation_errors(arrays["outliers"])
    print("relative quantisation error (E4M3):", {"gaussian": plain, "outliers": outliers})
    u = FP8_UNIT_ROUNDOFF[E4M3]
    # Gaussian values: every recipe keeps the values in E4M3's normal range, so the error
    # is that of rounding, below the unit roundoff (the delayed scale also saturates the
    # largest values).
    for recipe in ("current", "block (1x128)", "block (128x128)", "mxfp8"):
        assert plain[recipe] < u, (recipe, plain[recipe])
    assert plain["delayed"] < 2 * u
    # Outliers: one per-tensor scale pushes the other values into E4M3's subnormals...
    assert outliers["current"] > 4 * u
    # ...while 1x128 tiles and MX blocks confine them to their own 128 or 32 values: the
    # error stays that of rounding. A 128x128 weight block confines them to its block.
    for recipe in ("block (1x128)", "mxfp8"):
        assert outliers[recipe] < u, (recipe, outliers[recipe])
        assert outliers[recipe] < outliers["current"] / 10
    assert outliers["block (128x128)"] < outliers["current"] / 2


# --- The FP8 dot_general ---------------------------------------------------------------------

DIMS = (((1,), (0,)), ((), ()))
RECIPES = [
    jaxmp.Float8CurrentScaling(),
    jaxmp.Float8BlockScaling(),
    jaxmp.Float8BlockScaling(tile_size=64, weight_block_size=128),
    jaxmp.MXFP8BlockScaling(),
]
RECIPE_IDS = ["current", "block", "block-64-128", "mxfp8"]


def operands(seed=0, m=24, k=300, n=136):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    return x, w


def test_current_scaling_product_is_the_fp8_product():
    x, w = operands()
    y = jax.jit(lambda x, w: fp8_dot.fp8_dot_general(x, w, DIMS, RECIPES[0], jnp.float32))(x, w)
    qx, sx = np_current(x, E4M3)
    qw, sw = np_current(w, E4M3)
    expected = qx.astype(np.float64) @ qw.astype(np.float64) / (np.float64(sx) * np.float64(sw))
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5)


def test_block_scaling_product_is_the_tiled_fp8_product():
    x, w = operands(k=256)
    y = jax.jit(
        lambda x, w: fp8_dot.fp8_dot_general(
            x, w, DIMS, jaxmp.Float8BlockScaling(), jnp.float32, weights=(False, True)
        )
    )(x, w)
    qx, sx = np_tiles(x, 128, E4M3)
    qw_t, sw_t = np_weight_blocks(np.ascontiguousarray(w.T), 128, E4M3)  # blocks of (n, k)
    expected = np.zeros((x.shape[0], w.shape[1]))
    for j, c in enumerate(range(0, 256, 128)):
        partial = qx[:, c : c + 128].astype(np.float64) @ qw_t[:, c : c + 128].astype(np.float64).T
        expected += partial * sx[:, j : j + 1] * sw_t[:, j][None, :]
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_forward_and_backward_against_float32_within_the_formats_tolerance(recipe):
    x, w = operands()
    rng = np.random.default_rng(1)
    c = rng.standard_normal((x.shape[0], w.shape[1])).astype(np.float32)

    def loss(x, w, fn):
        return jnp.sum(fn(x, w) * c)  # the gradient reaching the product is `c` exactly

    fp8_fn = jax.jit(lambda x, w: fp8_dot.fp8_dot_general(x, w, DIMS, recipe, jnp.float32))
    f32_fn = jax.jit(lambda x, w: x @ w)
    assert rel_err(fp8_fn(x, w), f32_fn(x, w)) <= product_tolerance(E4M3, E4M3)
    grads = jax.jit(jax.grad(lambda x, w: loss(x, w, fp8_fn), (0, 1)))(x, w)
    expected = jax.grad(lambda x, w: loss(x, w, f32_fn), (0, 1))(x, w)
    for g, e in zip(grads, expected, strict=True):
        assert g.dtype == e.dtype == jnp.float32
        assert rel_err(g, e) <= product_tolerance(E5M2, E4M3), rel_err(g, e)


def test_the_backward_products_are_fp8_products_of_the_gradient():
    x, w = operands()
    c = np.random.default_rng(1).standard_normal((x.shape[0], w.shape[1])).astype(np.float32)
    recipe = RECIPES[0]
    dx, dw = jax.grad(
        lambda x, w: jnp.sum(fp8_dot.fp8_dot_general(x, w, DIMS, recipe, jnp.float32) * c), (0, 1)
    )(x, w)
    qg, sg = np_current(c, E5M2)
    qx, sx = np_current(x, E4M3)
    qw, sw = np_current(w, E4M3)
    g64 = qg.astype(np.float64) / np.float64(sg)
    np.testing.assert_allclose(
        dx, g64 @ (qw.astype(np.float64) / np.float64(sw)).T, rtol=1e-5, atol=1e-5
    )
    x64 = qx.astype(np.float64) / np.float64(sx)
    np.testing.assert_allclose(dw, x64.T @ g64, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe", RECIPES[:2], ids=RECIPE_IDS[:2])
@pytest.mark.parametrize(
    ("lhs_shape", "rhs_shape", "dims"),
    [
        ((2, 3, 5, 7), (2, 7, 3, 4), (((3,), (1,)), ((0, 1), (0, 2)))),  # attention-like
        ((4, 6, 5), (5, 6, 3), (((1, 2), (1, 0)), ((), ()))),  # two contracted dimensions
        ((3, 4), (5,), (((), ()), ((), ()))),  # an outer product: nothing contracted
    ],
)
def test_general_dimension_numbers_forward_and_backward(recipe, lhs_shape, rhs_shape, dims):
    rng = np.random.default_rng(2)
    a = rng.standard_normal(lhs_shape).astype(np.float32)
    b = rng.standard_normal(rhs_shape).astype(np.float32)
    ref = lax.dot_general(a, b, dims)
    c = rng.standard_normal(ref.shape).astype(np.float32)
    out = jax.jit(lambda a, b: fp8_dot.fp8_dot_general(a, b, dims, recipe, jnp.float32))(a, b)
    assert out.shape == ref.shape
    assert rel_err(out, ref) <= product_tolerance(E4M3, E4M3)

    def loss(a, b):
        return jnp.sum(fp8_dot.fp8_dot_general(a, b, dims, recipe, jnp.float32) * c)

    got = jax.jit(jax.grad(loss, (0, 1)))(a, b)
    want = jax.grad(lambda a, b: jnp.sum(lax.dot_general(a, b, dims) * c), (0, 1))(a, b)
    for g, e in zip(got, want, strict=True):
        assert g.shape == e.shape
        assert rel_err(g, e) <= product_tolerance(E5M2, E4M3)


def test_operands_keep_their_dtypes_and_the_output_has_the_compute_dtype():
    x, w = operands()
    x, w = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    y, vjp = jax.vjp(
        lambda x, w: fp8_dot.fp8_dot_general(x, w, DIMS, RECIPES[0], jnp.bfloat16), x, w
    )
    assert y.dtype == jnp.bfloat16
    dx, dw = vjp(jnp.ones_like(y))
    assert dx.dtype == dw.dtype == jnp.bfloat16


def test_amax_zero_and_non_finite_keep_a_usable_scale():
    scales = jax.jit(lambda a: fp8_scaling.scale_from_amax(a, E4M3))(
        jnp.asarray([0.0, jnp.inf, jnp.nan, 1e-45, 448.0], jnp.float32)
    )
    np.testing.assert_array_equal(
        np.asarray(scales)[:3], np.ones(3, np.float32)
    )  # nothing to scale by: 1
    assert np.isfinite(scales[3]) and scales[4] == 1.0
    y = fp8_dot.fp8_dot_general(jnp.zeros((2, 3)), jnp.ones((3, 2)), DIMS, RECIPES[0], jnp.float32)
    np.testing.assert_array_equal(y, 0.0)
