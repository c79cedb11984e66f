"""Tests of jaxmp.calibrate: static activation scales from calibration batches, what serving
computes with them (no amax, saturation, NaN and inf kept non-finite), each layer of a scanned
stack its own scale, layouts, transformations, orbax, and errors."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax import lax

import jaxmp
from jaxmp._src.quantization import recipes as q_lib
from tests.conftest import all_eqns

ACTIVATION_RECIPES = {"int8_dynamic": jaxmp.Int8DynamicActivations(), "fp8": jaxmp.Float8Rowwise()}
NAMES = list(ACTIVATION_RECIPES)
QMAX = {"int8_dynamic": 127.0, "fp8": 448.0}


def _two_inputs(p, x, z):
    """Two weights, each reading an input directly: their activations are the inputs."""
    return x @ p["w1"] + z @ p["w2"].T  # w2 stored (out, in): read transposed


def _params(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    return {
        "w1": jnp.asarray(rng.normal(size=(64, 16)) / 8, dtype),
        "w2": jnp.asarray(rng.normal(size=(16, 32)) / 6, dtype),
        "b": jnp.zeros(16, dtype),  # not a matmul weight: the same object back
    }


def _batches(dtype=jnp.float32, n=3):
    rng = np.random.default_rng(1)
    return [
        (
            jnp.asarray(rng.normal(size=(8, 64)) * (i + 1), dtype),
            jnp.asarray(rng.normal(size=(8, 32)) * 3 / (i + 1), dtype),
        )
        for i in range(n)
    ]


def _fun(p, x, z):
    return _two_inputs(p, x, z) + p["b"]


@pytest.mark.parametrize("name", NAMES)
def test_each_weight_gets_its_activations_amax_over_every_batch(name):
    p, batches = _params(), _batches()
    q = jaxmp.quantize(_fun, p, *batches[0], recipe=name)
    c = jaxmp.calibrate(_fun, q, batches)
    assert c["b"] is q["b"]
    for key, k in (("w1", 0), ("w2", 1)):
        amax = max(float(np.abs(np.asarray(b[k])).max()) for b in batches)
        act = np.asarray(c[key].act_scale)
        assert act.shape == np.shape(q[key].scales) and act.dtype == np.float32
        np.testing.assert_allclose(act, amax / QMAX[name], rtol=1e-6)
        # The weight itself is untouched.
        assert np.asarray(c[key].values).tobytes() == np.asarray(q[key].values).tobytes()
        assert np.asarray(c[key].scales).tobytes() == np.asarray(q[key].scales).tobytes()
    assert "calibrated" in repr(c["w1"]) and "calibrated" not in repr(q["w1"])
    assert c["w1"].nbytes == q["w1"].nbytes + 16 * 4


def _reductions(fun, *args):
    return [
        e.primitive.name
        for e in all_eqns(jax.make_jaxpr(fun)(*args))
        if e.primitive.name.startswith("reduce_max") or e.primitive.name == "argmax"
    ]


@pytest.mark.parametrize("name", NAMES)
def test_serving_takes_no_amax_and_is_the_static_kernel(name):
    p, batches = _params(), _batches()
    q = jaxmp.quantize(_fun, p, *batches[0], recipe=name)
    c = jaxmp.calibrate(_fun, q, batches)
    rng = np.random.default_rng(9)  # new inputs in the calibrated range
    x = jnp.asarray(rng.normal(size=(8, 64)) * 2, jnp.float32)
    z = jnp.asarray(rng.normal(size=(8, 32)) * 1.5, jnp.float32)
    serve = jaxmp.quantized(_fun)
    assert _reductions(serve, q, x, z)  # the dynamic rows' amaxes
    assert _reductions(serve, c, x, z) == []
    y = jax.jit(serve)(c, x, z)
    # The reference: each input rounded on the grid with its one static scale (saturating),
    # times the weight as served.
    recipe = ACTIVATION_RECIPES[name]
    expected = np.zeros((8, 16), np.float32)
    for key, a, transposed in (("w1", x, False), ("w2", z, True)):
        s = jnp.float32(np.asarray(c[key].act_scale).max())
        aq = q_lib.quantize_values(a, s, recipe).astype(jnp.float32) * s
        w = np.asarray(q[key].dequantize(), np.float32)
        expected += np.asarray(aq) @ (w.T if transposed else w)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=2e-5, atol=2e-5)
    # Static scales: close to the float function, as the dynamic ones are.
    ref = np.asarray(_fun(p, x, z))
    dynamic = np.asarray(serve(q, x, z))
    bound = {"int8_dynamic": 0.05, "fp8": 0.12}[name]
    for out in (dynamic, np.asarray(y)):
        assert np.abs(out - ref).max() / np.abs(ref).max() < bound


@pytest.mark.parametrize("name", NAMES)
def test_activations_beyond_the_calibrated_range_saturate(name):
    p, batches = _params(), _batches()
    c = jaxmp.calibrate(_fun, jaxmp.quantize(_fun, p, *batches[0], recipe=name), batches)
    x, z = batches[0]
    big = x * 100.0  # far beyond every calibration batch
    s = float(np.asarray(c["w1"].act_scale).max())
    clipped = jnp.clip(big, -QMAX[name] * s, QMAX[name] * s)
    serve = jax.jit(jaxmp.quantized(_fun))
    y_big, y_clipped = serve(c, big, z), serve(c, clipped, z)
    assert np.isfinite(np.asarray(y_big)).all()
    np.testing.assert_array_equal(np.asarray(y_big), np.asarray(y_clipped))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32], ids=str)
def test_nan_and_inf_rows_stay_nonfinite_and_extremes_stay_finite(name, dtype):
    p, batches = _params(dtype), _batches(dtype)
    with jax.numpy_dtype_promotion("strict"):
        q = jaxmp.quantize(_fun, p, *batches[0], recipe=name)
        c = jaxmp.calibrate(_fun, q, batches)
        x, z = batches[0]
        largest = float(jnp.finfo(dtype).max)
        bad = x.at[1, 3].set(jnp.nan).at[4, 0].set(jnp.inf).at[6, 2].set(-jnp.inf)
        bad = bad.at[7].set(largest)  # the dtype's largest finite value: saturates, finite
        y = jax.jit(jaxmp.quantized(_fun))(c, bad, z)
    assert y.dtype == dtype
    y = np.asarray(y, np.float32)
    assert np.isnan(y[[1, 4, 6]]).all()  # every output of those rows, never a finite number
    others = [0, 2, 3, 5, 7]
    assert np.isfinite(y[others]).all()
    clean = np.asarray(jaxmp.quantized(_fun)(c, x, z), np.float32)
    np.testing.assert_array_equal(y[[0, 2, 3, 5]], clean[[0, 2, 3, 5]])


def test_float64_scales_keep_their_range():
    with jax.enable_x64(True):
        p = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(32, 8)), jnp.float64)}
        x = jnp.asarray(np.random.default_rng(1).normal(size=(4, 32)) * 1e200, jnp.float64)

        def fun(p, x):
            return x @ p["w"]

        c = jaxmp.calibrate(fun, jaxmp.quantize(fun, p, x, recipe="int8_dynamic"), [x])
        assert c["w"].act_scale.dtype == jnp.float64
        y = jaxmp.quantized(fun)(c, x)
        ref = fun(p, x)
        assert np.isfinite(np.asarray(y)).all()
        assert float(jnp.abs(y - ref).max() / jnp.abs(ref).max()) < 0.05


def _stack(p, x):
    """A scan over a stack of 4 layers, layer i reading its input times k[i]."""

    def body(h, layer):
        w, k = layer
        return h + (x * k) @ w, None

    h, _ = lax.scan(body, jnp.zeros((x.shape[0], 16)), (p["w"], p["k"]))
    return h


@pytest.mark.parametrize("name", NAMES)
def test_each_layer_of_a_scanned_stack_gets_its_own_scale(name):
    rng = np.random.default_rng(2)
    p = {
        "w": jnp.asarray(rng.normal(size=(4, 32, 16)) / 6, jnp.float32),
        "k": jnp.asarray([1.0, 2.0, 5.0, 0.5], jnp.float32),
    }
    batches = [jnp.asarray(rng.normal(size=(8, 32)), jnp.float32) for _ in range(2)]
    q = jaxmp.quantize(_stack, p, batches[0], recipe=name)
    c = jaxmp.calibrate(_stack, q, batches)
    act = np.asarray(c["w"].act_scale)
    assert act.shape == (4, 1, 16)
    amax = max(float(np.abs(np.asarray(b)).max()) for b in batches)
    np.testing.assert_allclose(act[:, 0, 0], amax * np.asarray(p["k"]) / QMAX[name], rtol=1e-6)
    x = batches[0]
    ref = np.asarray(_stack(p, x))
    for y in (
        jax.jit(jaxmp.quantized(_stack))(c, x),
        jax.vmap(jaxmp.quantized(_stack), (None, 0))(c, x[:, None])[:, 0],
    ):
        assert np.abs(np.asarray(y) - ref).max() / np.abs(ref).max() < 0.12


def test_a_weight_the_batches_do_not_reach_stays_dynamic_and_other_recipes_untouched():
    def fun(p, x, use_second):
        y = x @ p["w1"]
        return y @ p["w2"] if use_second else y

    rng = np.random.default_rng(3)
    p = {"w1": jnp.asarray(rng.normal(size=(32, 32)), jnp.float32), "w2": jnp.ones((32, 8))}
    x = jnp.ones((2, 32))
    q = jaxmp.quantize(fun, p, x, True, recipe="int8_dynamic")
    c = jaxmp.calibrate(fun, q, [(x, False)])
    assert c["w1"].act_scale is not None and c["w2"].act_scale is None
    assert c["w2"] is q["w2"]


def test_errors_name_what_is_wrong():
    p, batches = _params(), _batches()
    q8 = jaxmp.quantize(_fun, p, *batches[0], recipe="int8")
    with pytest.raises(ValueError, match=r"no weight quantised with an activation recipe.*'int8'"):
        jaxmp.calibrate(_fun, q8, batches)
    q = jaxmp.quantize(_fun, p, *batches[0], recipe="fp8")
    with pytest.raises(ValueError, match="`batches` is empty"):
        jaxmp.calibrate(_fun, q, [])
    x, z = batches[0]
    with pytest.raises(ValueError, match=r"leaf 'w2' hold NaN or inf"):
        jaxmp.calibrate(_fun, q, [(x, z.at[0, 0].set(jnp.inf))])
    # Integer ids outside calibrate are no scales.
    bad = q_lib.QuantizedArray(
        q["w1"].values, q["w1"].scales, q["w1"].recipe, q["w1"].dtype, q["w1"].contract,
        q["w1"].contract_shape, jnp.zeros(np.shape(q["w1"].scales), jnp.int32),
    )  # fmt: skip
    with pytest.raises(ValueError, match="outside jaxmp.calibrate"):
        jaxmp.quantized(_fun)({**q, "w1": bad}, x, z)


def test_calibrated_params_round_trip_through_orbax(tmp_path):
    p, batches = _params(), _batches()
    c = jaxmp.calibrate(_fun, jaxmp.quantize(_fun, p, *batches[0], recipe="fp8"), batches)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "c", c)
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(tmp_path / "c", jax.eval_shape(lambda: c))
    assert jax.tree.structure(restored) == jax.tree.structure(c)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(c), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    x, z = batches[0]
    np.testing.assert_array_equal(
        np.asarray(jaxmp.quantized(_fun)(restored, x, z)),
        np.asarray(jaxmp.quantized(_fun)(c, x, z)),
    )


def _dense(p, x):
    return x @ p["w"]


@pytest.mark.parametrize("name", NAMES)
def test_weights_one_static_scale_cannot_fit_keep_dynamic_scales_and_say_so(name, caplog):
    rng = np.random.default_rng(4)
    w = jnp.asarray(rng.normal(size=(32, 16)) / 6, jnp.float32)
    x = jnp.asarray(rng.normal(size=(4, 32)), jnp.float32)

    def shared(p, x, far):  # one weight read by two matmuls, the second's input `far` times
        return x @ p["w"] + (far * x) @ p["w"]

    def masked(p, x):  # a branch the batches switch off
        return jnp.where(False, x, 0.0) @ p["w"]

    def partly(p, x):  # the last layer of the stack skipped
        def body(h, layer):
            i, w = layer
            return lax.cond(i < 3, lambda h: h @ w, lambda h: h, h), None

        return lax.scan(body, x, (jnp.arange(4), p["ws"]))[0]

    stack = {"ws": jnp.asarray(rng.normal(size=(4, 32, 32)) / 6, jnp.float32)}
    spread = (
        "it is read by 2 kernels whose activations differ by up to 100x (one static scale "
        "would round the smaller to few steps)"
    )
    cases = {
        "shared 100x": (shared, {"w": w}, (x, 100.0), spread),
        "all zero": (masked, {"w": w}, x, "its activations were all zero in the batches"),
        "reached in part": (partly, stack, x, "the batches reached 96 of its 128 scales only"),
        "no output channels": (_dense, {"w": jnp.ones((32, 0))}, x, "it has no output channels"),
    }
    for case, (fun, p, batch, why) in cases.items():
        args = batch if isinstance(batch, tuple) else (batch,)
        q = jaxmp.quantize(fun, p, *args, recipe=name)
        caplog.clear()
        with caplog.at_level("WARNING", logger="jaxmp.calibrate"):
            c = jaxmp.calibrate(fun, q, [batch])
        (key,) = p
        assert c[key].act_scale is None, case
        assert [r.getMessage() for r in caplog.records] == [
            f"jaxmp.calibrate: `qparams` leaf {key!r} keeps dynamic scales: {why}."
        ], case
        y = jax.jit(jaxmp.quantized(fun))(c, *args)  # served with dynamic scales
        np.testing.assert_array_equal(np.asarray(y), np.asarray(jaxmp.quantized(fun)(q, *args)))
    # A spread within 8x is one static scale: the larger one.
    q = jaxmp.quantize(shared, {"w": w}, x, 2.0, recipe=name)
    c = jaxmp.calibrate(shared, q, [(x, 2.0)])
    amax = 2 * float(np.abs(np.asarray(x)).max())
    np.testing.assert_allclose(np.asarray(c["w"].act_scale), amax / QMAX[name], rtol=1e-6)


def test_a_nan_in_a_stack_reached_in_part_is_still_an_error():
    rng = np.random.default_rng(5)

    def partly(p, x):
        def body(h, layer):
            i, w = layer
            return lax.cond(i < 3, lambda h: h @ w, lambda h: h, h), None

        return lax.scan(body, x, (jnp.arange(4), p["ws"]))[0]

    p = {"ws": jnp.asarray(rng.normal(size=(4, 16, 16)) / 4, jnp.float32)}
    x = jnp.asarray(rng.normal(size=(4, 16)), jnp.float32)
    q = jaxmp.quantize(partly, p, x, recipe="int8_dynamic")
    with pytest.raises(ValueError, match=r"leaf 'ws' hold NaN or inf"):
        jaxmp.calibrate(partly, q, [x.at[0, 0].set(jnp.nan)])


@pytest.mark.parametrize("name", NAMES)
def test_calibrated_serving_under_debug_nans_op_by_op(name):
    # The NaN of a non-finite row is made from that row: finite inputs make no NaN at all.
    p, batches = _params(), _batches()
    c = jaxmp.calibrate(_fun, jaxmp.quantize(_fun, p, *batches[0], recipe=name), batches)
    x, z = batches[1]
    expected = jax.jit(jaxmp.quantized(_fun))(c, x, z)
    with jax.debug_nans(True), jax.disable_jit():
        y = jaxmp.quantized(_fun)(c, x, z)
    np.testing.assert_allclose(np.asarray(y), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_calibrating_again_can_make_a_weight_dynamic():
    def shared(p, x, far):
        return x @ p["w"] + (far * x) @ p["w"]

    p = {"w": jnp.asarray(np.random.default_rng(6).normal(size=(32, 16)), jnp.float32)}
    x = jnp.ones((2, 32))
    q = jaxmp.quantize(shared, p, x, 1.0, recipe="fp8")
    once = jaxmp.calibrate(shared, q, [(x, 1.0)])
    assert once["w"].act_scale is not None
    again = jaxmp.calibrate(shared, once, [(x, 1000.0)])
    assert again["w"].act_scale is None
