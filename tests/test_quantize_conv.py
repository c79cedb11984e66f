"""Tests of jaxmp.quantize and jaxmp.quantized on convolutions: which kernels the plan finds
(Linen, NNX, plain lax), each recipe's kernel against its reference, non-finite and extreme
values, every float dtype, transformations, and a CNN on scikit-learn's digits served with
every recipe."""

import equinox as eqx
import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from sklearn.datasets import load_digits

import jaxmp
from jaxmp._src import compat
from jaxmp._src.quantization import plan as plan_lib
from jaxmp._src.quantization import recipes as q_lib
from tests.conftest import all_eqns, diagonal_cases

RECIPES = {
    "int8": jaxmp.Int8WeightOnly(),
    "int8_dynamic": jaxmp.Int8DynamicActivations(),
    "fp8": jaxmp.Float8Rowwise(),
    "int4": jaxmp.Int4WeightOnly(group_size=16),
}
NAMES = list(RECIPES)
# The largest difference from the float convolution over its largest output, per recipe (as
# tests/test_quantize.py's MODEL_TOLERANCE for matmuls).
TOLERANCE = {"int8": 0.03, "int8_dynamic": 0.05, "fp8": 0.12, "int4": 0.3}
DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32]
DTYPE_IDS = ["float16", "bfloat16", "float32"]
NHWC = ("NHWC", "HWIO", "NHWC")


def _rel_err(y, ref):
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(y - ref).max() / np.abs(ref).max())


def _kernel(shape, seed=0, out_axis=-1):
    """A normal kernel (fan-in scaled) with an outlier output feature (2) and an all-zero one
    (3) along `out_axis`."""
    w = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    w = np.moveaxis(w, out_axis, -1) / np.sqrt(np.prod(shape) / shape[out_axis])
    w[..., 2] *= 50.0
    w[..., 3] = 0.0
    return np.moveaxis(w, -1, out_axis)


def _x(shape, dtype=jnp.float32, seed=1):
    return jax.random.normal(jax.random.key(seed), shape).astype(dtype)


# The convolutions the kernels are checked on: (x shape, kernel shape, its output axis,
# conv keyword arguments). Every contraction is a multiple of int4's group size (16).
CASES = {
    "nhwc": ((4, 8, 8, 16), (3, 3, 16, 32), -1, {"dimension_numbers": NHWC}),
    "nchw strided dilated": (
        (4, 16, 9, 9),
        (32, 16, 3, 3),
        0,
        {"window_strides": (2, 2), "padding": ((2, 2), (2, 2)), "rhs_dilation": (2, 2)},
    ),
    "grouped": ((4, 8, 8, 16), (4, 4, 4, 32), -1, {"dimension_numbers": NHWC, "groups": 4}),
    "depthwise": ((4, 8, 8, 16), (4, 4, 1, 32), -1, {"dimension_numbers": NHWC, "groups": 16}),
    "transposed": (
        (4, 8, 8, 16),
        (3, 3, 16, 32),
        -1,
        {"dimension_numbers": NHWC, "padding": ((2, 1), (2, 1)), "lhs_dilation": (2, 2)},
    ),
    "1d": ((4, 16, 16), (3, 16, 32), -1, {"dimension_numbers": ("NWC", "WIO", "NWC")}),
}


def _conv_fun(kwargs):
    rest = dict(kwargs)
    groups = rest.pop("groups", 1)
    rest.setdefault("padding", "SAME")

    def fun(p, x):
        strides = rest.get("window_strides", (1,) * (x.ndim - 2))
        others = {k: v for k, v in rest.items() if k != "window_strides"}
        return lax.conv_general_dilated(x, p["w"], strides, feature_group_count=groups, **others)

    return fun


def _case(name, dtype=jnp.float32):
    x_shape, w_shape, out_axis, kwargs = CASES[name]
    fun = _conv_fun(kwargs)
    p = {"w": jnp.asarray(_kernel(w_shape, out_axis=out_axis), dtype)}
    return fun, p, _x(x_shape, dtype)


def _random_variables(model, x, seed=0):
    """A Linen model's variables, normal and fan-in scaled, made without running its
    initialisers (compiling a truncated normal per shape costs seconds on CPU)."""
    shapes = jax.eval_shape(model.init, jax.random.key(0), x)
    rng = np.random.default_rng(seed)

    def normal(s):
        fan_in = np.prod(s.shape[:-1]) if len(s.shape) > 1 else 1
        return jnp.asarray(rng.normal(size=s.shape) / np.sqrt(fan_in), s.dtype)

    return jax.tree.map(normal, shapes)


# --------------------------------------------------------------------------------------------
# Which kernels the plan finds, and what it says.


class _LinenConvs(linen.Module):
    """A convolution, a grouped and a depthwise one, two transposed ones and a dense head."""

    @linen.compact
    def __call__(self, x):  # (batch, 8, 8, 16)
        h = jax.nn.relu(linen.Conv(16, (3, 3), name="conv")(x))
        h = jax.nn.relu(linen.Conv(16, (4, 4), feature_group_count=4, name="grouped")(h))
        h = jax.nn.relu(linen.Conv(16, (4, 4), feature_group_count=16, name="depthwise")(h))
        h = linen.ConvTranspose(16, (3, 3), strides=(2, 2), name="up")(h)
        h = linen.ConvTranspose(8, (3, 3), strides=(2, 2), transpose_kernel=True, name="up_t")(h)
        return linen.Dense(10, name="head")(h.mean((1, 2)))


def _reasons(plan):
    return {leaf.path: (leaf.quantized, leaf.reason) for leaf in plan}


def test_plan_finds_the_kernels_of_linen_convolutions():
    model = _LinenConvs()
    x = _x((2, 8, 8, 16))
    variables = _random_variables(model, x)
    plan = _reasons(jaxmp.quantization_plan(model.apply, variables, x, recipe="int8"))
    kernel = (True, "convolution kernel, contracted over axes (0, 1, 2)")
    assert plan["params/conv/kernel"] == kernel
    assert plan["params/grouped/kernel"] == kernel
    assert plan["params/depthwise/kernel"] == kernel
    assert plan["params/up/kernel"] == kernel  # lhs dilation: the same kernel axes
    # transpose_kernel: the kernel's spatial axes reversed and its feature axes swapped.
    assert plan["params/up_t/kernel"] == (
        True,
        "convolution kernel, contracted over axes (0, 1, 3)",
    )
    assert plan["params/head/kernel"] == (True, "matmul weight, contracted over axes (0,)")
    for layer in ("conv", "grouped", "depthwise", "up", "up_t", "head"):
        quantized, reason = plan[f"params/{layer}/bias"]
        assert not quantized and "a bias" in reason


class _NnxConvs(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(16, 16, (3, 3), rngs=rngs)
        self.grouped = nnx.Conv(16, 16, (4, 4), feature_group_count=4, rngs=rngs)
        self.up = nnx.ConvTranspose(16, 16, (3, 3), strides=2, rngs=rngs)
        self.head = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.relu(self.conv(x))
        h = self.up(jax.nn.relu(self.grouped(h)))
        return self.head(h.mean((1, 2)))


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=[] if n == "int8_dynamic" else [pytest.mark.slow]) for n in NAMES],
)
def test_plan_finds_the_kernels_of_nnx_convolutions_and_serves_them(name):
    # As the guide says: split the module, quantise its state through nnx.merge.
    graphdef, state = nnx.split(_NnxConvs(nnx.Rngs(0)))
    x = _x((2, 8, 8, 16))

    def fun(s, x):
        return nnx.merge(graphdef, s)(x)

    recipe = RECIPES[name]
    plan = _reasons(jaxmp.quantization_plan(fun, state, x, recipe=recipe))
    kernel = (True, "convolution kernel, contracted over axes (0, 1, 2)")
    for layer in ("conv", "grouped", "up"):
        assert plan[f"{layer}/kernel/value"] == kernel
        assert not plan[f"{layer}/bias/value"][0]
    assert plan["head/kernel/value"] == (True, "matmul weight, contracted over axes (0,)")
    q = jaxmp.quantize(fun, state, x, recipe=recipe)
    flat = jax.tree_util.tree_flatten_with_path(q, is_leaf=q_lib.is_quantized)[0]
    quantised = {plan_lib.path_string(k) for k, v in flat if q_lib.is_quantized(v)}
    assert quantised == {p for p, (yes, _) in plan.items() if yes}
    y = jax.jit(jaxmp.quantized(fun))(q, x)
    assert y.dtype == jnp.float32
    assert _rel_err(y, fun(state, x)) < TOLERANCE[name]


@pytest.mark.parametrize(
    ("fun", "w_shape", "x_shape", "contract"),
    [
        (lambda p, x: lax.conv(x, p["w"], (1, 1), "SAME"), (8, 4, 3, 3), (2, 4, 8, 8), (1, 2, 3)),
        (
            lambda p, x: lax.conv_general_dilated(
                x, p["w"], (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")
            ),
            (3, 4, 8),
            (2, 16, 4),
            (0, 1),
        ),
        (
            lambda p, x: lax.conv_general_dilated(
                x, p["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "OHWI", "NHWC")
            ),
            (8, 3, 3, 4),
            (2, 8, 8, 4),
            (1, 2, 3),
        ),
        (
            lambda p, x: lax.conv_transpose(
                x, p["w"], (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
            ),
            (3, 3, 4, 8),
            (2, 8, 8, 4),
            (0, 1, 2),
        ),
    ],
    ids=["lax.conv", "1d", "OHWI", "lax.conv_transpose"],
)
def test_plan_reads_the_contraction_axes_from_the_dimension_numbers(
    fun, w_shape, x_shape, contract
):
    p = {"w": jnp.asarray(_kernel(w_shape, out_axis=-1 if w_shape[-1] == 8 else 0))}
    x = _x(x_shape)
    (leaf,) = jaxmp.quantization_plan(fun, p, x, recipe="int8")
    assert leaf == ("w", True, f"convolution kernel, contracted over axes {contract}")
    q = jaxmp.quantize(fun, p, x, recipe="int8")
    assert q["w"].contract == tuple(c - len(w_shape) for c in contract)
    assert _rel_err(jaxmp.quantized(fun)(q, x), fun(p, x)) < TOLERANCE["int8"]


def test_plan_says_why_a_convolution_operand_is_left_alone():
    w = jnp.asarray(_kernel((3, 3, 3, 8)))  # a contraction of 27: no int4 group divides it

    def conv(x, w, **kwargs):
        return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=NHWC, **kwargs)

    def fun(p, x):
        h = conv(x, p["w"])
        h = h + conv(p["image"], p["w2"])  # a param convolved as the image
        h = h + conv(x, p["flat"].reshape(3, 3, 3, 8))  # a kernel reshaped before its conv
        # batch groups: how JAX writes the kernel gradient of a convolution, not a layer.
        h = h + conv(x, p["batched"], batch_group_count=2).repeat(2, axis=0)
        return h + conv(x, p["biased"]) + p["biased"].sum()

    p = {
        "w": w,
        "w2": w,
        "image": _x((2, 8, 8, 3)),
        "flat": w.reshape(-1),
        "batched": jnp.asarray(_kernel((3, 3, 3, 8))),
        "biased": w,
    }
    x = _x((2, 8, 8, 3))
    plan = _reasons(jaxmp.quantization_plan(fun, p, x, recipe="int8"))
    assert plan["w"] == (True, "convolution kernel, contracted over axes (0, 1, 2)")
    assert plan["w2"] == (True, "convolution kernel, contracted over axes (0, 1, 2)")
    assert plan["image"] == (
        False,
        "not a matmul weight: the input of a convolution, not its kernel",
    )
    assert plan["flat"] == (
        False,
        "not a matmul weight: reshaped, sliced or broadcast before its convolution (reshape)",
    )
    assert plan["batched"] == (
        False,
        "not a matmul weight: the kernel of a convolution with batch_group_count > 1",
    )
    assert plan["biased"][0] is False
    assert plan["biased"][1].startswith("a convolution kernel also used by reduce_sum")
    int4 = _reasons(jaxmp.quantization_plan(fun, p, x, recipe=RECIPES["int4"]))
    assert int4["w"] == (False, "contraction size 27 is not a multiple of group_size 16")
    q = jaxmp.quantize(fun, p, x, recipe=RECIPES["int4"])
    assert q["w"] is p["w"]
    y = jaxmp.quantized(fun)(jaxmp.quantize(fun, p, x, recipe="int8"), x)
    assert _rel_err(y, fun(p, x)) < TOLERANCE["int8"]


# --------------------------------------------------------------------------------------------
# Each recipe's kernel against its reference.


def _activations(x, recipe, batch_axis=0):
    """The dynamic recipes' activations: one absmax scale per batch element (the axes a
    convolution does not contract), the values rounded on the recipe's grid."""
    axes = tuple(a for a in range(x.ndim) if a != batch_axis)
    scale = q_lib.absmax_scale(x, axes, recipe.qmax)
    return q_lib.quantize_values(x, scale, recipe), scale


def _float64_conv(fun, w, x):
    with jax.enable_x64(True):
        return np.asarray(
            fun(
                {"w": jnp.asarray(np.asarray(w, np.float64))},
                jnp.asarray(np.asarray(x, np.float64)),
            )
        )


@pytest.mark.parametrize(("name", "case"), diagonal_cases(NAMES, list(CASES), NAMES, list(CASES)))
def test_each_recipe_is_its_kernel(name, case):
    fun, p, x = _case(case)
    recipe = RECIPES[name]
    q = jaxmp.quantize(fun, p, x, recipe=recipe)["w"]
    assert isinstance(q, jaxmp.QuantizedArray)
    y = np.asarray(jax.jit(jaxmp.quantized(fun))({"w": q}, x))
    ref = np.asarray(fun(p, x))
    assert y.dtype == ref.dtype and y.shape == ref.shape
    assert _rel_err(y, ref) < TOLERANCE[name]
    if name == "int4":  # the kernel dequantised into the convolution's dtype, as it reads it
        w_read = np.asarray(q.dequantize(), np.float64)
    else:  # its values times its scales, exactly (a float32 dequantised copy rounds)
        w_read = np.asarray(q.values, np.float64) * np.asarray(q.scales, np.float64)
    if name in ("int8", "int4"):
        # The activations as they are, the kernel dequantised: float32 accumulation.
        exact = _float64_conv(fun, w_read, x)
        assert _rel_err(y, exact) < 1e-5
        return
    xq, scale = _activations(x, recipe)
    x_read = np.asarray(xq, np.float64) * np.asarray(scale, np.float64)
    exact = _float64_conv(fun, w_read, x_read)
    if name == "int8_dynamic":
        # int8 x int8 summed in int32 is exact: only the two float32 rescales round.
        # (atol: the float64 reference's own rounding where the integer sum is 0.)
        np.testing.assert_allclose(y, exact, rtol=2.0**-22, atol=1e-12 * np.abs(exact).max())
    else:
        # E4M3 products are exact in float32; their float32 sum rounds.
        assert _rel_err(y, exact) < 1e-5
    assert not np.array_equal(x_read, np.asarray(x, np.float64))  # the activations rounded


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bfloat16", "float32"])
def test_int4_is_the_dequantised_kernel_convolved_with_float32_accumulation(dtype):
    fun, p, x = _case("nhwc", dtype)
    q = jaxmp.quantize(fun, p, x, recipe=RECIPES["int4"])
    y = jax.jit(jaxmp.quantized(fun))(q, x)
    w = q["w"].dequantize()  # in the kernel's dtype
    expected = lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=NHWC, preferred_element_type=jnp.float32
    ).astype(dtype)
    assert y.dtype == dtype
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(expected, np.float32))


@pytest.mark.parametrize(
    ("name", "dtype"),
    diagonal_cases(["int8", "int4"], DTYPES[:2], ["int8", "int4"], DTYPE_IDS[:2]),
)
@pytest.mark.parametrize("form", ["quantized", "quantization_aware"])
def test_the_activations_gradient_of_a_half_precision_convolution(form, name, dtype):
    # A weight-only kernel accumulates in float32: its derivative with respect to the
    # activations is the float convolution's transpose with the kernel it read (jax < 0.10
    # cannot transpose a float16 x float16 -> float32 convolution: jaxmp converts first).
    fun, p, x = _case("nhwc", dtype)
    recipe = RECIPES[name]
    q = jaxmp.quantize(fun, p, x, recipe=recipe)
    if form == "quantized":
        served = jaxmp.quantized(fun)

        def loss(x):
            return jnp.sum(served(q, x).astype(jnp.float32) ** 2)
    else:
        aware = jaxmp.quantization_aware(fun, recipe=recipe)

        def loss(x):
            return jnp.sum(aware(p, x).astype(jnp.float32) ** 2)

    dx = jax.jit(jax.grad(loss))(x)
    w = {"w": q["w"].dequantize().astype(jnp.float32)}
    y = jaxmp.quantized(fun)(q, x).astype(jnp.float32)  # the served output
    _, vjp = jax.vjp(lambda x: fun(w, x), x.astype(jnp.float32))
    (expected,) = vjp(2 * y)
    assert dx.dtype == dtype and dx.shape == x.shape
    assert _rel_err(dx, expected) < 1e-2


def _convs(closed):
    return [e for e in all_eqns(closed) if e.primitive.name == "conv_general_dilated"]


def test_the_program_runs_the_recipes_convolutions():
    fun, p, x = _case("nhwc", jnp.bfloat16)

    def program(name):
        q = jaxmp.quantize(fun, p, x, recipe=RECIPES[name])
        closed = jaxmp.quantized(fun).jaxpr(q, x)
        return closed, [
            ([jnp.dtype(v.aval.dtype) for v in e.invars], jnp.dtype(e.outvars[0].aval.dtype))
            for e in _convs(closed)
        ]

    # Weight-only int8: the int8 kernel enters the program and is converted to the
    # convolution's dtype, its output float32 (scaled per output feature). (On jax < 0.10 the
    # weight-only convolutions read their operands in float32: the same products, and a
    # derivative that jax can transpose.)
    read = jnp.float32 if compat.CONV_TRANSPOSE_NEEDS_ONE_DTYPE else jnp.bfloat16
    closed, convs = program("int8")
    assert convs == [([read, read], jnp.float32)]
    assert [v.aval.shape for v in closed.jaxpr.invars if v.aval.dtype == jnp.int8] == [
        (3, 3, 16, 32)
    ]
    assert not [
        v
        for v in closed.jaxpr.invars
        if v.aval.shape == (3, 3, 16, 32) and v.aval.dtype != jnp.int8
    ]
    _, convs = program("int8_dynamic")
    assert convs == [([jnp.int8, jnp.int8], jnp.int32)]
    # FP8: E4M3 x E4M3 -> float32 where the backend has it; on CPU (a branch of
    # lax.platform_dependent) the same values as bfloat16.
    _, convs = program("fp8")
    e4m3 = jnp.dtype(jnp.float8_e4m3fn)
    assert sorted(convs, key=str) == sorted(
        [([e4m3, e4m3], jnp.float32), ([jnp.bfloat16, jnp.bfloat16], jnp.float32)], key=str
    )
    # int4: the kernel dequantised into the convolution's dtype, float32 accumulation.
    _, convs = program("int4")
    assert convs == [([read, read], jnp.float32)]


# --------------------------------------------------------------------------------------------
# Attacks: non-finite and extreme values, every float dtype, strict promotion.


@pytest.mark.parametrize(("name", "dtype"), diagonal_cases(NAMES, DTYPES, NAMES, DTYPE_IDS))
def test_nonfinite_activations_stay_nonfinite(name, dtype):
    fun, p, x = _case("nhwc", dtype)
    x = x.at[0, 4, 4, 5].set(jnp.nan).at[1, 0, 0, 0].set(jnp.inf).at[2, 7, 7, 15].set(-jnp.inf)
    q = jaxmp.quantize(fun, p, x, recipe=RECIPES[name])
    assert isinstance(q["w"], jaxmp.QuantizedArray)
    y = np.asarray(jax.jit(jaxmp.quantized(fun))(q, x), np.float32)
    ref = np.asarray(fun(p, x), np.float32)
    bad, bad_ref = ~np.isfinite(y), ~np.isfinite(ref)
    assert np.isnan(y[0][np.isnan(ref[0])]).all()  # NaN stays NaN
    if name in ("int8", "int4"):
        np.testing.assert_array_equal(bad, bad_ref)  # exactly where the float conv's are
    else:
        # One scale per image: a NaN or inf anywhere makes that image's scale, hence its whole
        # output, non-finite; the other images are untouched.
        assert bad[:3].all() and np.isnan(y[0]).all()
        alone = jax.jit(jaxmp.quantized(fun))(q, x[3:])
        np.testing.assert_array_equal(y[3], np.asarray(alone, np.float32)[0])
    assert np.isfinite(y[3]).all()


@pytest.mark.parametrize(("name", "dtype"), diagonal_cases(NAMES, DTYPES, NAMES, DTYPE_IDS))
def test_extreme_images_and_a_zero_image_under_strict_promotion(name, dtype):
    fun, p, x = _case("nhwc", dtype)
    # float16: 1e20 is inf, 1e-30 is 0; the fifth image is large but its outputs are finite
    # well inside the dtype's range (an output within the quantisation error of float16's
    # largest value may round either way).
    large = 1e2 if dtype == jnp.float16 else 1e30
    magnitudes = np.array([1.0, 1e20, 1e-30, 0.0, large, 1e-45]).reshape(6, 1, 1, 1)
    x = jnp.asarray(np.asarray(_x((6, 8, 8, 16)), np.float32) * magnitudes).astype(dtype)
    with jax.numpy_dtype_promotion("strict"):
        q = jaxmp.quantize(fun, p, x, recipe=RECIPES[name])
        y = np.asarray(jax.jit(jaxmp.quantized(fun))(q, x), np.float32)
    ref = np.asarray(fun(p, x), np.float32)
    assert isinstance(q["w"], jaxmp.QuantizedArray)
    assert jaxmp.quantized(fun)(q, x).dtype == dtype
    np.testing.assert_array_equal(np.isfinite(y), np.isfinite(ref))
    assert not np.isnan(y[2:]).any()  # tiny and zero images: no 0 / 0 in a scale
    np.testing.assert_array_equal(y[3], 0.0)
    for i in (0, 1, 2, 4):
        if np.isfinite(ref[i]).all() and np.abs(ref[i]).max() > 0:
            assert _rel_err(y[i], ref[i]) < TOLERANCE[name], i


def test_float64_keeps_its_range():
    with jax.enable_x64(True):
        fun, p, x = _case("nhwc", jnp.float64)
        for name, recipe in RECIPES.items():
            for w_scale, x_scale in ((1e300, 1e-300), (1e-300, 1e300)):
                pw = {"w": p["w"] * w_scale}
                q = jaxmp.quantize(fun, pw, x, recipe=recipe)
                assert q["w"].scales.dtype == jnp.float64
                with jax.numpy_dtype_promotion("strict"):
                    y = jax.jit(jaxmp.quantized(fun))(q, x * x_scale)
                ref = fun(pw, x * x_scale)
                assert y.dtype == ref.dtype == jnp.float64
                assert np.isfinite(np.asarray(y)).all()
                assert _rel_err(y, ref) < TOLERANCE[name], (name, w_scale)


def test_a_nonfinite_kernel_is_an_error_naming_its_path():
    fun, p, x = _case("nhwc")
    p = {"w": p["w"].at[1, 2, 3, 4].set(jnp.nan)}
    with pytest.raises(ValueError, match=r"`params` leaf 'w' holds NaN or inf \(1 of 4608 values"):
        jaxmp.quantize(fun, p, x, recipe="int8")


# --------------------------------------------------------------------------------------------
# Transformations: jit, vmap, a scan over a stack of convolution layers.


def _layer(w, h):
    return jnp.tanh(lax.conv_general_dilated(h, w, (1, 1), "SAME", dimension_numbers=NHWC))


def _stack(p, h):
    return lax.scan(lambda c, w: (_layer(w, c), None), h, p["w"])[0]


@pytest.mark.parametrize("name", NAMES)
def test_a_scanned_stack_of_convolutions_under_jit_and_vmap(name):
    # No outlier feature here: an outlier's quantisation error near tanh's zero crossing is
    # the error of the layers after it.
    w = np.random.default_rng(4).normal(size=(3, 3, 3, 16, 16)) / 12
    p, x = {"w": jnp.asarray(w, jnp.float32)}, _x((4, 8, 8, 16))
    recipe = RECIPES[name]
    (leaf,) = jaxmp.quantization_plan(_stack, p, x, recipe=recipe)
    assert leaf.reason == "convolution kernel, contracted over axes (1, 2, 3)"
    q = jaxmp.quantize(_stack, p, x, recipe=recipe)
    assert q["w"].scales.shape[0] == 3  # each layer its own scales
    run = jaxmp.quantized(_stack)
    y = jax.jit(run)(q, x)
    assert _rel_err(y, _stack(p, x)) < TOLERANCE[name]
    per_image = jax.jit(jax.vmap(run, in_axes=(None, 0)))(q, x[:, None])[:, 0]
    np.testing.assert_allclose(np.asarray(per_image), np.asarray(y), rtol=1e-5, atol=1e-5)
    run_layer = jaxmp.quantized(lambda p, h: _layer(p["w"], h))
    by_caller = lax.scan(lambda c, w: (run_layer({"w": w}, c), None), x, q["w"])[0]
    np.testing.assert_allclose(np.asarray(by_caller), np.asarray(y), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# A CNN on scikit-learn's digits, trained in bfloat16, served with every recipe.


class DigitsCNN(linen.Module):
    """8x8x1 images: two convolutions (a contraction of 16 and of 144: int4 groups of 16 fit
    both) and a dense head over the 4x4x32 features (512), computing in bfloat16."""

    @linen.compact
    def __call__(self, x):
        x = x.astype(jnp.bfloat16)
        x = jax.nn.relu(linen.Conv(16, (4, 4), dtype=jnp.bfloat16, name="conv1")(x))
        x = jax.nn.relu(linen.Conv(32, (3, 3), strides=2, dtype=jnp.bfloat16, name="conv2")(x))
        return linen.Dense(10, dtype=jnp.bfloat16, name="head")(x.reshape(x.shape[0], -1))


def digits_accuracies(steps=300, seed=0):
    """Trains `DigitsCNN` (float32 params, bfloat16 compute, Adam, batches of 64) on 1000 of
    the 1797 digits. Returns, for the bfloat16 model (its params cast to bfloat16) and for
    that model quantised with each recipe, the test accuracy (%) on the other 797 and how
    many of their predictions differ from the bfloat16 model's."""
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).reshape(-1, 8, 8, 1).astype(np.float32)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(x))
    x, y = x[order], y[order]
    x_train, y_train, x_test, y_test = x[:1000], y[:1000], x[1000:], y[1000:]
    model = DigitsCNN()
    params = model.init(jax.random.key(seed), x_train[:1])
    tx = optax.adam(3e-3)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, xb, yb):
        def loss(params):
            logits = model.apply(params, xb).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

        grads = jax.grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for _ in range(steps):
        batch = rng.integers(0, len(x_train), 64)
        params, opt_state = step(params, opt_state, x_train[batch], y_train[batch])

    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    bf16_logits = jax.jit(model.apply)(bf16, x_test)
    predictions = {"bf16": np.argmax(bf16_logits, -1)}
    for name, recipe in RECIPES.items():
        plan = jaxmp.quantization_plan(model.apply, bf16, x_test, recipe=recipe)
        assert {leaf.path for leaf in plan if leaf.quantized} == {
            "params/conv1/kernel",
            "params/conv2/kernel",
            "params/head/kernel",
        }, name
        q = jaxmp.quantize(model.apply, bf16, x_test, recipe=recipe)
        logits = jaxmp.quantized(model.apply)(q, x_test)
        assert not np.array_equal(np.asarray(logits), np.asarray(bf16_logits)), name
        predictions[name] = np.argmax(logits, -1)
        if name in ("int8_dynamic", "fp8"):  # static activation scales from 4 training batches
            c = jaxmp.calibrate(model.apply, q, [x_train[i : i + 64] for i in range(0, 256, 64)])
            assert all(c["params"][k]["kernel"].act_scale is not None for k in c["params"])
            logits = jaxmp.quantized(model.apply)(c, x_test)
            predictions[f"{name} calibrated"] = np.argmax(logits, -1)
    return {
        name: (float(np.mean(p == y_test)) * 100, int(np.sum(p != predictions["bf16"])))
        for name, p in predictions.items()
    }


def test_a_digits_cnn_served_with_every_recipe_within_half_a_point_of_bfloat16():
    # Reproduces the quantized-inference guide's table (printed with -s).
    results = digits_accuracies()
    base = results["bf16"][0]
    print("\n| served as | test accuracy | vs bf16 | predictions not bf16's |\n|---|---|---|---|")
    for name, (accuracy, changed) in results.items():
        print(f"| {name} | {accuracy:.2f}% | {accuracy - base:+.2f} | {changed} of 797 |")
    assert base > 95
    assert len(results) == 1 + len(RECIPES) + 2  # bf16, each recipe, two calibrated
    for name in results:
        assert abs(results[name][0] - base) <= 0.5, (name, results)


def test_exclude_keeps_a_convolution_kernel_by_its_path():
    model = DigitsCNN()
    x = jnp.ones((1, 8, 8, 1))
    variables = _random_variables(model, x)
    q = jaxmp.quantize(model.apply, variables, x, recipe="int8", exclude="conv1")
    flat = jax.tree_util.tree_flatten_with_path(q, is_leaf=q_lib.is_quantized)[0]
    quantised = {plan_lib.path_string(k) for k, v in flat if q_lib.is_quantized(v)}
    assert quantised == {"params/conv2/kernel", "params/head/kernel"}


class _EqxConvs(eqx.Module):
    conv: eqx.nn.Conv2d
    grouped: eqx.nn.Conv2d
    up: eqx.nn.ConvTranspose2d
    head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.conv = eqx.nn.Conv2d(16, 16, 3, padding=1, key=k[0])
        self.grouped = eqx.nn.Conv2d(16, 16, 4, padding="SAME", groups=4, key=k[1])
        self.up = eqx.nn.ConvTranspose2d(16, 16, 3, stride=2, key=k[2])
        self.head = eqx.nn.Linear(16, 10, key=k[3])

    def __call__(self, x):  # one (channels, height, width) image
        h = self.up(jax.nn.relu(self.grouped(jax.nn.relu(self.conv(x)))))
        return self.head(h.mean((1, 2)))


@pytest.mark.parametrize("name", NAMES)
def test_equinox_convolutions_vmapped_over_images(name):
    # Equinox convolves one image; the batch comes from jax.vmap around the module.
    model = _EqxConvs(jax.random.key(0))
    x = _x((2, 16, 8, 8))

    def fun(m, x):
        return jax.vmap(m)(x)

    recipe = RECIPES[name]
    plan = jaxmp.quantization_plan(fun, model, x, recipe=recipe)
    assert {leaf.path for leaf in plan if leaf.quantized} == {
        "conv/weight",
        "grouped/weight",
        "up/weight",
        "head/weight",
    }
    reasons = {leaf.path: leaf.reason for leaf in plan}
    assert reasons["conv/weight"] == "convolution kernel, contracted over axes (1, 2, 3)"
    q = jaxmp.quantize(fun, model, x, recipe=recipe)
    y = jax.jit(jaxmp.quantized(fun))(q, x)
    assert y.dtype == jnp.float32
    assert _rel_err(y, fun(model, x)) < TOLERANCE[name]
