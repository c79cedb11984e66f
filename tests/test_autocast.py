"""Tests for `jaxmp.autocast`: op rules, models, control flow, numerics and training parity."""

from __future__ import annotations

import functools
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jax.extend import core as jcore

from jaxmp._src import compat
from jaxmp._src.autocast import (
    FLOAT32_OPS,
    LOW_PRECISION_OPS,
    autocast,
    autocast_jaxpr,
    float32_region,
)
from tests.conftest import BF16, F16, F32, HALF_DTYPES, TOLERANCE, all_eqns

POLICIES = {F16: "mixed_float16", BF16: "mixed_bfloat16"}


# ---------------------------------------------------------------------------------------------
# Helpers.


def eqns_named(jaxpr, name):
    return [e for e in all_eqns(jaxpr) if e.primitive.name == name]


def in_dtypes(eqn):
    return [jnp.dtype(v.aval.dtype) for v in eqn.invars]


def out_dtypes(eqn):
    return [jnp.dtype(v.aval.dtype) for v in eqn.outvars]


def assert_matmuls_in(jaxpr, dtype, *, at_least=1):
    dots = eqns_named(jaxpr, "dot_general")
    assert len(dots) >= at_least
    for eqn in dots:
        assert in_dtypes(eqn) == [dtype, dtype], eqn
        assert out_dtypes(eqn) == [dtype], eqn


def assert_float32_ops(jaxpr, names, *, at_least=1):
    for name in names:
        found = eqns_named(jaxpr, name)
        assert len(found) >= at_least, f"no {name} in the jaxpr"
        for eqn in found:
            assert set(in_dtypes(eqn)) <= {F32}, eqn
            assert out_dtypes(eqn) == [F32], eqn


def assert_close_to_scale(actual, expected, dtype):
    """Norm-wise relative error ||actual - expected|| / ||expected|| <= tol (central table).

    `actual` and `expected` are arrays or pytrees (a gradient tree is compared as one
    vector). The error is measured against the scale of the whole output, not element by
    element: an element near zero carries the rounding error of the larger terms it was
    computed from.
    """
    actual = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(actual)])
    expected = np.concatenate(
        [np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(expected)]
    )
    scale = max(float(np.linalg.norm(expected)), 1e-30)
    err = float(np.linalg.norm(actual - expected)) / scale
    assert err <= TOLERANCE[jnp.dtype(dtype)], f"relative error {err:.2e} for {dtype}"


def float64_reference(fun, *args):
    """`fun` evaluated in float64 (arguments upcast), as numpy arrays."""
    with jax.enable_x64(True):
        args64 = jax.tree.map(lambda x: jnp.asarray(np.asarray(x, np.float64)), args)
        out = fun(*args64)
        return jax.tree.map(lambda x: np.asarray(x, np.float64), out)


# ---------------------------------------------------------------------------------------------
# Models.


def jax_block(params, x):
    """Plain JAX: LayerNorm, single-head attention, GELU MLP, residuals."""
    mean = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    h = (x - mean) * lax.rsqrt(var + 1e-5) * params["ln_scale"] + params["ln_bias"]
    q, k, v = h @ params["wq"], h @ params["wk"], h @ params["wv"]
    scores = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
    attn = jax.nn.softmax(scores, axis=-1) @ v
    x = x + attn @ params["wo"]
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    return x + h @ params["w2"] + params["b2"]


@functools.partial(jax.jit, static_argnames=("d", "hidden"))  # one compile, not one per op
def jax_block_params(key, d=16, hidden=32):
    keys = jax.random.split(key, 8)

    def init(k, shape):
        return jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[0])

    return {
        "ln_scale": 1.0 + 0.1 * jax.random.normal(keys[0], (d,)),
        "ln_bias": 0.1 * jax.random.normal(keys[1], (d,)),
        "wq": init(keys[2], (d, d)),
        "wk": init(keys[3], (d, d)),
        "wv": init(keys[4], (d, d)),
        "wo": init(keys[5], (d, d)),
        "w1": init(keys[6], (d, hidden)),
        "b1": jnp.zeros((hidden,)),
        "w2": init(keys[7], (hidden, d)),
        "b2": jnp.zeros((d,)),
    }


class LinenBlock(nn.Module):
    """A pre-LayerNorm transformer block from stock Flax Linen modules."""

    features: int = 16
    heads: int = 2
    dtype: jnp.dtype | None = None

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        h = nn.LayerNorm(dtype=self.dtype)(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, dtype=self.dtype)(
            h, h, mask=mask
        )
        h = nn.LayerNorm(dtype=self.dtype)(x)
        h = nn.Dense(4 * self.features, dtype=self.dtype)(h)
        return x + nn.Dense(self.features, dtype=self.dtype)(nn.gelu(h))


class TinyLM(nn.Module):
    """A tiny causal transformer language model."""

    vocab: int = 16
    features: int = 32
    layers: int = 2
    heads: int = 2
    max_length: int = 16
    dtype: jnp.dtype | None = None

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.features, dtype=self.dtype)(tokens)
        pos = self.param("pos", nn.initializers.normal(0.02), (self.max_length, self.features))
        x = x + pos[: tokens.shape[1]].astype(x.dtype)
        for _ in range(self.layers):
            x = LinenBlock(self.features, self.heads, dtype=self.dtype)(x)
        x = nn.LayerNorm(dtype=self.dtype)(x)
        return nn.Dense(self.vocab, dtype=self.dtype)(x)


class NnxModel(nnx.Module):
    def __init__(self, rngs):
        self.linear1 = nnx.Linear(8, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.linear2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return jax.nn.log_softmax(self.linear2(jax.nn.relu(self.norm(self.linear1(x)))))


# ---------------------------------------------------------------------------------------------
# Models: the transformed jaxpr has the expected dtypes.


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_plain_jax_block_dtypes(dtype):
    params = jax_block_params(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 5, 16))
    jaxpr = autocast_jaxpr(jax_block, POLICIES[dtype])(params, x)
    assert_matmuls_in(jaxpr, dtype, at_least=8)
    # Softmax and the LayerNorm statistics run in float32.
    assert_float32_ops(jaxpr, ["exp", "reduce_max", "reduce_sum", "rsqrt"])
    assert [jnp.dtype(v.aval.dtype) for v in jaxpr.jaxpr.outvars] == [F32]


def upcasts_feeding_only_matmuls(jaxpr, dtype):
    """Converts `dtype` -> float32 whose results are used only by matmuls or down-casts."""
    if isinstance(jaxpr, jcore.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    consumers = {}
    for eqn in jaxpr.eqns:
        for var in eqn.invars:
            if not isinstance(var, jcore.Literal):
                consumers.setdefault(var, []).append(eqn)
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type" and in_dtypes(eqn) == [dtype]:
            users = consumers.get(eqn.outvars[0], [])
            if (
                out_dtypes(eqn) == [F32]
                and users
                and all(
                    u.primitive.name == "dot_general"
                    or (u.primitive.name == "convert_element_type" and out_dtypes(u) == [dtype])
                    for u in users
                )
            ):
                found.append(eqn)
        for sub in compat.jaxprs_in_params(eqn.params):
            found += upcasts_feeding_only_matmuls(sub, dtype)
    return found


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_plain_jax_block_activations_stay_low_between_matmuls(dtype):
    """Bias adds, residual adds and the GELU stay in the compute dtype (no bounce-back)."""
    params = jax_block_params(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 5, 16))
    jaxpr = autocast_jaxpr(jax_block, POLICIES[dtype])(params, x)
    for name in ("tanh", "integer_pow"):  # GELU's tanh approximation
        found = eqns_named(jaxpr, name)
        assert found and all(out_dtypes(e) == [dtype] for e in found), name
    adds = [e for e in eqns_named(jaxpr, "add") if len(e.outvars[0].aval.shape) == 3]
    assert [out_dtypes(e)[0] for e in adds].count(dtype) >= 4  # biases and residuals
    assert upcasts_feeding_only_matmuls(jaxpr, dtype) == []
    # Exactly one float32 tensor of activations is cast down per matmul input that comes
    # from a float32 op: the LayerNorm output and the softmax probabilities.
    down = [
        e
        for e in eqns_named(jaxpr, "convert_element_type")
        if in_dtypes(e) == [F32]
        and out_dtypes(e) == [dtype]
        and e.invars[0].aval.shape[:2] == x.shape[:2]
    ]
    assert len(down) == 3  # LayerNorm output, softmax probabilities, the residual input


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_flax_linen_block_dtypes(dtype):
    model = LinenBlock()
    x = jax.random.normal(jax.random.key(0), (2, 6, 16))
    variables = model.init(jax.random.key(1), x)
    # The op-by-op rules over the attention too (by default autocast dispatches Linen's
    # attention to `jaxmp.dot_product_attention`: tests/test_attention.py).
    jaxpr = autocast_jaxpr(model.apply, POLICIES[dtype], fused_attention=False)(variables, x)
    assert_matmuls_in(jaxpr, dtype, at_least=6)
    assert upcasts_feeding_only_matmuls(jaxpr, dtype) == []
    assert_float32_ops(jaxpr, ["exp", "reduce_max", "reduce_sum"])
    assert [jnp.dtype(v.aval.dtype) for v in jaxpr.jaxpr.outvars] == [F32]
    out = jax.jit(autocast(model.apply, POLICIES[dtype]))(variables, x)
    assert out.dtype == F32 and bool(jnp.all(jnp.isfinite(out)))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_flax_nnx_model_dtypes(dtype):
    graphdef, state = nnx.split(NnxModel(nnx.Rngs(0)))

    def forward(state, x):
        return nnx.merge(graphdef, state)(x)

    x = jax.random.normal(jax.random.key(0), (3, 8))
    jaxpr = autocast_jaxpr(forward, POLICIES[dtype])(state, x)
    assert_matmuls_in(jaxpr, dtype, at_least=2)
    # LayerNorm statistics and log-softmax in float32.
    assert_float32_ops(jaxpr, ["reduce_sum", "reduce_max", "exp", "log"])
    out = jax.jit(autocast(forward, POLICIES[dtype]))(state, x)
    assert out.dtype == F32
    ref = float64_reference(forward, state, x)
    assert_close_to_scale(out, ref, dtype)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_convolution_runs_in_compute_dtype(dtype):
    model = nn.Sequential([nn.Conv(4, (3, 3)), nn.relu, lambda h: h.mean((1, 2)), nn.Dense(2)])
    x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
    variables = model.init(jax.random.key(1), x)
    jaxpr = autocast_jaxpr(model.apply, POLICIES[dtype])(variables, x)
    (conv,) = eqns_named(jaxpr, "conv_general_dilated")
    assert in_dtypes(conv) == [dtype, dtype] and out_dtypes(conv) == [dtype]
    assert_float32_ops(jaxpr, ["reduce_sum"])  # the mean
    out = jax.jit(autocast(model.apply, POLICIES[dtype]))(variables, x)
    assert_close_to_scale(out, float64_reference(model.apply, variables, x), dtype)


def test_callbacks_receive_traced_dtypes():
    seen = []

    def host(x):
        seen.append(x.dtype)
        return x

    def f(w, x):
        h = x @ w
        return jax.pure_callback(host, jax.ShapeDtypeStruct(h.shape, h.dtype), h)

    out = jax.jit(autocast(f, "mixed_float16"))(jnp.eye(2), jnp.ones((1, 2)))
    assert seen == [np.dtype(np.float32)] and out.dtype == F32


def test_equinox_mlp_dtypes():
    eqx = pytest.importorskip("equinox", reason="equinox is an optional test dependency")
    model = eqx.nn.MLP(8, 4, 16, 2, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)

    def forward(params, x):
        return eqx.combine(params, static)(x)

    jaxpr = autocast_jaxpr(forward, "mixed_float16")(params, jnp.ones(8))
    assert_matmuls_in(jaxpr, F16, at_least=3)


# ---------------------------------------------------------------------------------------------
# Numerics against a float64 reference.


@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=str)
def test_block_output_matches_float64_reference(dtype):
    params = jax_block_params(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 5, 16))
    policy = {F32: "float32", **POLICIES}[dtype]
    out = jax.jit(autocast(jax_block, policy))(params, x)
    assert out.dtype == F32
    assert_close_to_scale(out, float64_reference(jax_block, params, x), dtype)


@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=str)
def test_block_gradients_match_float64_reference(dtype):
    params = jax_block_params(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 5, 16))
    policy = {F32: "float32", **POLICIES}[dtype]

    def loss(fn, params, x):
        return jnp.mean(fn(params, x) ** 2)

    grads = jax.jit(jax.grad(functools.partial(loss, autocast(jax_block, policy))))(params, x)
    ref = float64_reference(jax.grad(functools.partial(loss, jax_block)), params, x)
    assert all(g.dtype == F32 for g in jax.tree.leaves(grads))
    assert_close_to_scale(grads, ref, dtype)


def test_float32_policy_is_exact():
    params = jax_block_params(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 5, 16))
    out = jax.jit(autocast(jax_block, "float32"))(params, x)
    np.testing.assert_array_equal(out, jax.jit(jax_block)(params, x))


# ---------------------------------------------------------------------------------------------
# Op lists and the promotion rule.


def test_op_lists_are_public_frozensets():
    assert isinstance(LOW_PRECISION_OPS, frozenset) and isinstance(FLOAT32_OPS, frozenset)
    assert {"dot_general", "conv_general_dilated"} <= LOW_PRECISION_OPS
    assert {"exp", "log", "reduce_sum", "reduce_max", "cumsum", "erf"} <= FLOAT32_OPS
    assert not LOW_PRECISION_OPS & FLOAT32_OPS


def test_mixed_computed_inputs_promote_to_widest():
    def f(w, x):
        low = x @ w  # float16
        high = jnp.exp(x)  # float32
        return low + high, low * 2.0, low + w[0]

    jaxpr = autocast_jaxpr(f, "c=f16,o=f16")(jnp.ones((3, 3)), jnp.ones((2, 3)))
    # The float32 sum is not narrowed to the output dtype (see `test_output_dtypes`).
    assert [jnp.dtype(v.aval.dtype) for v in jaxpr.jaxpr.outvars] == [F32, F16, F16]
    adds = eqns_named(jaxpr, "add")
    # float16 + float32 computed: float32; float16 + float32 input row: float16.
    assert [out_dtypes(e)[0] for e in adds] == [F32, F16]
    muls = eqns_named(jaxpr, "mul")
    assert out_dtypes(muls[0]) == [F16]  # the literal 2.0 does not promote


def test_weak_inputs_promote_among_themselves():
    def f(a, b):
        return a + b

    out = autocast(f, "c=f16,o=f32")(jnp.ones(2, jnp.float16), jnp.ones(2, jnp.float32))
    assert out.dtype == F32
    jaxpr = autocast_jaxpr(f, "c=f16,o=f16")(jnp.ones(2, jnp.float16), jnp.ones(2))
    assert out_dtypes(eqns_named(jaxpr, "add")[0]) == [F32]


def test_scalar_computed_operand_does_not_promote():
    def f(w, x):
        scale = jnp.exp(w[0, 0])  # float32 0-d
        return (x @ w) * scale

    jaxpr = autocast_jaxpr(f, "c=f16,o=f16")(jnp.ones((3, 3)), jnp.ones((2, 3)))
    assert out_dtypes(eqns_named(jaxpr, "mul")[0]) == [F16]


def test_user_casts_are_kept():
    def f(w, x):
        return (x @ w).astype(jnp.bfloat16) + 1.0

    jaxpr = autocast_jaxpr(f, "c=f16,o=f16")(jnp.ones((3, 3)), jnp.ones((2, 3)))
    assert out_dtypes(eqns_named(jaxpr, "add")[0]) == [BF16]


def test_integer_bool_and_key_values_pass_through():
    def f(key, ids, flags, w):
        noise = jax.random.normal(key, (3,))
        return ids * 2, jnp.logical_not(flags), jax.random.split(key), noise @ w, ids.sum()

    key = jax.random.key(0)
    ids, flags, w = jnp.arange(3), jnp.array([True, False, True]), jnp.ones((3, 3))
    outs = jax.jit(autocast(f, "mixed_float16"))(key, ids, flags, w)
    expected = f(key, ids, flags, w)
    assert [o.dtype for o in outs] == [e.dtype for e in expected]
    np.testing.assert_array_equal(outs[0], expected[0])
    np.testing.assert_array_equal(outs[1], expected[1])
    np.testing.assert_array_equal(jax.random.key_data(outs[2]), jax.random.key_data(expected[2]))
    np.testing.assert_array_equal(outs[4], expected[4])


def test_op_sets_can_be_extended_and_overridden():
    def f(w, x):
        return jnp.tanh(x @ w)

    w, x = jnp.ones((3, 3)), jnp.ones((2, 3))
    jaxpr = autocast_jaxpr(f, "mixed_float16", float32_ops=FLOAT32_OPS | {lax.tanh_p})(w, x)
    assert out_dtypes(eqns_named(jaxpr, "tanh")[0]) == [F32]
    # Naming dot_general as a float32 op removes it from the default low-precision list.
    jaxpr = autocast_jaxpr(f, "mixed_float16", float32_ops={"dot_general"})(w, x)
    assert_matmuls_in(jaxpr, F32)
    jaxpr = autocast_jaxpr(f, "mixed_float16", low_precision_ops=set())(w, x)
    assert_matmuls_in(jaxpr, F32)
    ac = autocast(f, "mixed_float16", low_precision_ops=LOW_PRECISION_OPS - {"dot_general"})
    assert "dot_general" not in ac.low_precision_ops
    assert "reduce_sum" in ac.float32_ops


def test_policy_string_or_object():
    ac = autocast(jnp.sin, "mixed_bfloat16")
    assert ac.policy.compute_dtype == BF16
    import jaxmp

    assert autocast(jnp.sin, jaxmp.Policy(F32, F16, F16)).policy.output_dtype == F16


@pytest.mark.parametrize("policy", ["mixed_float16", "c=f16,o=f16", "c=bf16,o=bf16"])
def test_output_dtypes(policy):
    """Outputs go to the output dtype, except a value computed in the plain call's dtype is
    never narrowed: a float32 statistic or updated state keeps float32."""

    def f(w, x, running_var):
        h = x @ w
        var = jnp.var(h, axis=0)
        return h, var, 0.5 * running_var + 0.5 * var, x.astype(jnp.float16) @ w.astype(F16)

    w, x = jnp.eye(3), jnp.asarray([[400.0, 1.0, 2.0], [-400.0, 3.0, 4.0]])
    output_dtype = {"f16": F16, "bf16": BF16}.get(policy.split("o=")[-1], F32)
    h, var, new_var, h16 = jax.jit(autocast(f, policy))(w, x, jnp.ones(3))
    assert h.dtype == output_dtype  # computed in the compute dtype: the output dtype
    assert var.dtype == new_var.dtype == F32  # computed in float32 as in the plain call
    assert float(var[0]) == 160000.0  # inf in float16
    assert h16.dtype == output_dtype  # the plain call's float16 is widened to an output f32


def test_eager_calls_trace_once_per_signature():
    traces = []

    def f(w, x):
        traces.append(None)
        return x @ w

    ac = autocast(f, "mixed_float16")
    for _ in range(3):
        ac(jnp.ones((3, 3)), jnp.ones((2, 3)))
    assert len(traces) == 1
    ac(jnp.ones((3, 3)), jnp.ones((4, 3)))
    assert len(traces) == 2


def test_static_arguments():
    def f(w, x, *, deterministic, scale=2.0):
        y = x @ w
        return y if deterministic else y * scale

    ac = autocast(f, "mixed_float16")
    w, x = jnp.ones((3, 3)), jnp.ones((2, 3))
    np.testing.assert_array_equal(ac(w, x, deterministic=True), 3.0)
    np.testing.assert_array_equal(ac(w, x, deterministic=False, scale=3.0), 9.0)
    np.testing.assert_array_equal(jax.jit(lambda w, x: ac(w, x, deterministic=True))(w, x), 3.0)


# ---------------------------------------------------------------------------------------------
# Control flow, custom rules and transformations.


def test_scan_carry_keeps_its_dtype():
    def f(w, xs):
        def body(carry, x):
            h = jnp.tanh(x @ w + carry)
            return h, jnp.exp(h).sum()

        return lax.scan(body, jnp.zeros(4), xs)

    w, xs = jnp.eye(4) * 0.5, jax.random.normal(jax.random.key(0), (5, 4))
    jaxpr = autocast_jaxpr(f, "c=f16,o=f16")(w, xs)
    (scan,) = eqns_named(jaxpr, "scan")
    assert out_dtypes(scan) == [F32, F32]  # carry kept at its initial dtype; ys float32 (sum)
    assert_matmuls_in(jaxpr, F16)
    carry, ys = jax.jit(autocast(f, "mixed_float16"))(w, xs)
    ref_carry, ref_ys = float64_reference(f, w, xs)
    assert_close_to_scale(carry, ref_carry, F16)
    assert_close_to_scale(ys, ref_ys, F16)


def test_while_loop():
    def f(w, x):
        def body(c):
            i, h = c
            return i + 1, jnp.tanh(h @ w)

        return lax.while_loop(lambda c: c[0] < 3, body, (0, x))

    w, x = jnp.eye(4) * 0.9, jnp.ones((2, 4))
    jaxpr = autocast_jaxpr(f, "mixed_float16")(w, x)
    (loop,) = eqns_named(jaxpr, "while")
    assert out_dtypes(loop) == [jnp.dtype(jnp.int32), F32]
    assert_matmuls_in(jaxpr, F16)
    i, h = jax.jit(autocast(f, "mixed_float16"))(w, x)
    assert int(i) == 3
    assert_close_to_scale(h, float64_reference(f, w, x)[1], F16)


def test_cond_branches_agree_on_dtypes():
    def f(pred, w, x):
        return lax.cond(pred, lambda a: a @ w, lambda a: jnp.exp(a), x)

    w, x = jnp.eye(3), jnp.ones((2, 3))
    jaxpr = autocast_jaxpr(f, "c=f16,o=f16")(True, w, x)
    (cond,) = eqns_named(jaxpr, "cond")
    assert out_dtypes(cond) == [F32]  # float16 matmul and float32 exp: the widest
    ac = jax.jit(autocast(f, "mixed_float16"))
    np.testing.assert_allclose(ac(jnp.array(True), w, x), x)
    np.testing.assert_allclose(ac(jnp.array(False), w, x), np.exp(x), rtol=1e-6)


def test_nested_jit_is_rebound():
    @jax.jit
    def inner(w, x):
        return jax.nn.softmax(x @ w)

    def f(w, x):
        return inner(w, inner(w, x))

    w, x = jnp.eye(3), jnp.ones((2, 3))
    jaxpr = autocast_jaxpr(f, "mixed_float16")(w, x)
    assert len(eqns_named(jaxpr, "jit")) >= 2
    assert_matmuls_in(jaxpr, F16, at_least=2)
    assert_float32_ops(jaxpr, ["exp", "reduce_sum"])
    assert_close_to_scale(jax.jit(autocast(f, "mixed_float16"))(w, x), f(w, x), F16)


def test_remat_is_kept():
    def f(w, x):
        return jax.checkpoint(lambda a: jnp.sin(a @ w))(x).sum()

    w, x = jnp.eye(3), jnp.ones((2, 3))
    jaxpr = autocast_jaxpr(f, "mixed_float16")(w, x)
    assert len(eqns_named(jaxpr, "remat2")) == 1
    assert_matmuls_in(jaxpr, F16)
    g = jax.jit(jax.grad(autocast(f, "mixed_float16")))(w, x)
    assert_close_to_scale(g, jax.grad(f)(w, x), F16)


@jax.custom_jvp
def marked_square(x):
    return x * x


@marked_square.defjvp
def _marked_square_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return x * x, 42.0 * t  # a recognisable rule: not the true derivative


def test_custom_jvp_rule_is_kept():
    def f(w, x):
        return marked_square(x @ w).sum()

    w, x = jnp.eye(2), jnp.ones((1, 2))
    jaxpr = autocast_jaxpr(f, "mixed_float16")(w, x)
    (call,) = eqns_named(jaxpr, "custom_jvp_call")
    assert in_dtypes(call) == [F16]  # the function runs in the compute dtype
    for ac in (
        autocast(jax.grad(f, argnums=1), "mixed_float16"),
        jax.grad(autocast(f, "mixed_float16"), argnums=1),
    ):
        np.testing.assert_array_equal(jax.jit(ac)(w, x), np.full((1, 2), 42.0))


def test_relu_custom_jvp_runs_in_compute_dtype():
    def f(w, x):
        return jax.nn.relu(x @ w) @ w

    jaxpr = autocast_jaxpr(f, "mixed_float16")(jnp.eye(2), jnp.ones((1, 2)))
    (call,) = eqns_named(jaxpr, "custom_jvp_call")
    assert in_dtypes(call) == [F16] and out_dtypes(call) == [F16]
    assert len(eqns_named(jaxpr, "convert_element_type")) <= 3  # w, x, output


@jax.custom_vjp
def clipped_identity(x):
    return x


def _clip_fwd(x):
    return x, None


def _clip_bwd(_, g):
    return (jnp.clip(g, -0.5, 0.5),)


clipped_identity.defvjp(_clip_fwd, _clip_bwd)


def test_custom_vjp_rule_is_kept():
    def f(w, x):
        return (clipped_identity(x @ w) * 3.0).sum()

    w, x = jnp.eye(2), jnp.ones((1, 2))
    jaxpr = autocast_jaxpr(f, "mixed_float16")(w, x)
    (call,) = eqns_named(jaxpr, "custom_vjp_call")
    assert in_dtypes(call) == [F32]  # run as traced
    g = jax.jit(jax.grad(autocast(f, "mixed_float16")))(w, x)
    np.testing.assert_array_equal(g, np.full((2, 2), 0.5))
    g = jax.jit(autocast(jax.grad(f), "mixed_float16"))(w, x)
    np.testing.assert_array_equal(g, np.full((2, 2), 0.5))


class _ScanBody(nn.Module):
    @nn.compact
    def __call__(self, carry, _):
        return LinenBlock()(carry), None


class ScannedStack(nn.Module):
    """Layers under Flax's lifted `nn.scan` and `nn.remat`."""

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(
            nn.remat(_ScanBody),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=3,
        )
        return stack()(x, None)[0]


def test_flax_scan_over_remat_layers():
    model = ScannedStack()
    x = jax.random.normal(jax.random.key(0), (2, 6, 16))
    variables = model.init(jax.random.key(1), x)
    # The op-by-op rules (the dispatched attention: tests/test_attention.py).
    jaxpr = autocast_jaxpr(model.apply, "mixed_bfloat16", fused_attention=False)(variables, x)
    assert [e.primitive.name for e in jaxpr.jaxpr.eqns][0] == "scan"
    assert eqns_named(jaxpr, "remat2")
    assert_matmuls_in(jaxpr, BF16, at_least=6)

    def loss(fn, variables, x):
        return fn(variables, x).sum()

    grads = jax.jit(jax.grad(functools.partial(loss, autocast(model.apply, "mixed_bfloat16"))))(
        variables, x
    )
    ref = float64_reference(jax.grad(functools.partial(loss, model.apply)), variables, x)
    assert_close_to_scale(grads, ref, BF16)


def test_compositions_agree():
    params = jax_block_params(jax.random.key(0))
    xs = jax.random.normal(jax.random.key(1), (3, 2, 5, 16))

    def loss(params, x):
        return jnp.mean(jax_block(params, x) ** 2)

    policy = "mixed_bfloat16"
    ref = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0)))(params, xs)
    variants = {
        "grad(autocast)": jax.vmap(jax.grad(autocast(loss, policy)), in_axes=(None, 0)),
        "autocast(grad)": jax.vmap(autocast(jax.grad(loss), policy), in_axes=(None, 0)),
        "autocast(vmap(grad))": autocast(jax.vmap(jax.grad(loss), in_axes=(None, 0)), policy),
    }
    for name, fn in variants.items():
        out = jax.jit(fn)(params, xs)
        assert all(g.dtype == F32 for g in jax.tree.leaves(out)), name
        assert_close_to_scale(out, ref, BF16)


def test_grad_of_closure_over_traced_value():
    x = jnp.ones((2, 3))

    def outer(w):
        return autocast(lambda x: (x @ w).sum(), "mixed_float16")(x)

    np.testing.assert_array_equal(jax.grad(outer)(jnp.eye(3)), np.full((3, 3), 2.0))


# ---------------------------------------------------------------------------------------------
# float32_region.


def test_float32_region_decorator_and_context_manager():
    @float32_region
    def head(h, w):
        return h @ w

    def f(w, x):
        h = x @ w
        with float32_region():
            g = jnp.tanh(h @ w)
        return head(h, w) + g

    jaxpr = autocast_jaxpr(f, "c=f16,o=f16")(jnp.eye(3), jnp.ones((2, 3)))
    dots = eqns_named(jaxpr, "dot_general")
    assert [in_dtypes(e) for e in dots] == [[F16, F16], [F32, F32], [F32, F32]]
    assert out_dtypes(eqns_named(jaxpr, "tanh")[0]) == [F32]
    g = jax.jit(jax.grad(lambda w, x: autocast(f, "mixed_float16")(w, x).sum()))(
        jnp.eye(3), jnp.ones((2, 3))
    )
    assert g.dtype == F32
    # Outside autocast it changes nothing.
    np.testing.assert_array_equal(head(jnp.eye(2), jnp.ones((2, 2))), jnp.ones((2, 2)))


# ---------------------------------------------------------------------------------------------
# Errors.


def test_bad_arguments():
    with pytest.raises(TypeError, match="`fun` must be callable, got 3"):
        autocast(3, "mixed_float16")
    with pytest.raises(TypeError, match="`policy` must be a policy string"):
        autocast(jnp.sin, 16)
    with pytest.raises(ValueError, match="Unknown dtype or policy name 'mixed_float8' in `policy`"):
        autocast(jnp.sin, "mixed_float8")
    with pytest.raises(ValueError, match="unknown primitive 'dot_genral'.*'dot_general'"):
        autocast(jnp.sin, "mixed_float16", low_precision_ops={"dot_genral"})
    with pytest.raises(TypeError, match="`float32_ops` must be a collection"):
        autocast(jnp.sin, "mixed_float16", float32_ops="exp")
    with pytest.raises(TypeError, match="`float32_ops` entries must be"):
        autocast(jnp.sin, "mixed_float16", float32_ops={3})
    with pytest.raises(ValueError, match=r"must not overlap, got \['exp'\]"):
        autocast(jnp.sin, "mixed_float16", low_precision_ops={"exp"}, float32_ops={"exp"})
    with pytest.raises(TypeError, match="`fun` must be callable or omitted"):
        float32_region(3)


def _dummy_higher_order_primitive():
    prim = jcore.Primitive("dummy_higher_order")
    prim.multiple_results = True

    def impl(*args, jaxpr):
        return jcore.jaxpr_as_fun(jaxpr)(*args)

    prim.def_impl(impl)
    prim.def_abstract_eval(lambda *avals, jaxpr: jaxpr.out_avals)
    return prim


def test_unknown_higher_order_primitive_errors_with_the_way_out():
    prim = _dummy_higher_order_primitive()

    def f(x):
        inner = jax.make_jaxpr(jnp.sin)(x)
        return prim.bind(x, jaxpr=inner)[0]

    with pytest.raises(NotImplementedError, match="dummy_higher_order.*float32_region"):
        autocast_jaxpr(f, "mixed_float16")(jnp.ones(2))
    # The ways out: a float32 region, or the primitive object in `float32_ops`.
    jaxpr = autocast_jaxpr(float32_region(f), "mixed_float16")(jnp.ones(2))
    assert eqns_named(jaxpr, "dummy_higher_order")
    jaxpr = autocast_jaxpr(f, "mixed_float16", float32_ops=FLOAT32_OPS | {prim})(jnp.ones(2))
    assert eqns_named(jaxpr, "dummy_higher_order")
    with pytest.raises(NotImplementedError, match="cannot run the higher-order primitive"):
        autocast_jaxpr(f, "mixed_float16", low_precision_ops={prim})(jnp.ones(2))


# ---------------------------------------------------------------------------------------------
# Training parity: a tiny transformer under autocast and dynamic loss scaling.


def _markov_batches(steps, batch, length, vocab, seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(vocab, vocab)) * 2.0
    trans = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    tokens = np.zeros((steps, batch, length), np.int32)
    tokens[:, :, 0] = rng.integers(vocab, size=(steps, batch))
    for t in range(1, length):
        cum = trans[tokens[:, :, t - 1]].cumsum(-1)
        tokens[:, :, t] = (rng.random((steps, batch, 1)) < cum).argmax(-1)
    return jnp.asarray(tokens)


def _train(policy, steps=60):
    import jaxmp

    model = TinyLM(layers=1)
    data = _markov_batches(steps, 8, 16, model.vocab)
    params = jax.jit(model.init)(jax.random.key(0), data[0])["params"]

    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    if policy is None:
        tx = optax.adam(3e-3)
        grad_fn = jax.value_and_grad(loss_fn)
    else:
        tx = jaxmp.mixed_precision(optax.adam(3e-3), policy)
        grad_fn = jaxmp.value_and_grad(autocast(loss_fn, policy))

    @jax.jit
    def step(params, opt_state, tokens):
        if policy is None:
            loss, grads = grad_fn(params, tokens)
        else:
            loss, grads = grad_fn(jaxmp.get_loss_scale(opt_state), params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = jax.jit(tx.init)(params)
    losses = []
    for tokens in data:
        params, opt_state, loss = step(params, opt_state, tokens)
        losses.append(float(loss))
    return np.array(losses), params, opt_state


@pytest.mark.slow  # a training run (the rules are tested op by op above)
def test_training_parity_mixed_float16():
    import jaxmp

    ref_losses, ref_params, _ = _train(None)
    losses, params, opt_state = _train("mixed_float16")
    assert ref_losses[-10:].mean() < 0.8 * ref_losses[:5].mean()  # it learns
    final, ref_final = losses[-10:].mean(), ref_losses[-10:].mean()
    assert abs(final - ref_final) <= 0.02 * ref_final, (final, ref_final)
    assert all(x.dtype == F32 for x in jax.tree.leaves(params))
    assert float(jaxmp.get_loss_scale(opt_state).loss_scale) >= 1.0
    assert np.all(np.isfinite(losses))


@pytest.mark.slow  # a training run (the rules are tested op by op above)
def test_training_parity_on_the_main_job_model():
    """The main job's transformer (examples/lm, built float32; one block) trained on its own
    data: under autocast mixed_float16 the training and validation losses are within 2% of
    float32."""
    import sys

    import jaxmp

    examples = str(pathlib.Path(__file__).resolve().parents[1] / "examples")
    sys.path.insert(0, examples)
    try:
        from lm import data as data_lib
        from lm import model as model_lib
    finally:
        sys.path.remove(examples)

    dataset = data_lib.make_dataset(0.1)
    length, batch, steps = 32, 16, 150
    model = model_lib.TransformerLM(
        vocab_size=dataset.vocab_size,
        max_len=length,
        num_layers=1,
        num_heads=4,
        d_model=64,
        mlp_ratio=4,
    )
    params0 = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, length), jnp.int32))["params"]

    def loss_fn(params, inputs, targets):
        return model_lib.cross_entropy(model.apply({"params": params}, inputs), targets)

    batches = [data_lib.train_batch(dataset.train, 0, s, batch, length) for s in range(steps)]
    val_batches = data_lib.eval_batches(dataset.val, 4, 64, length)

    def train(policy):
        if policy is None:
            tx = optax.adam(3e-3)
            grad_fn = jax.value_and_grad(loss_fn)
        else:
            tx = jaxmp.mixed_precision(optax.adam(3e-3), policy)
            scaled_grad_fn = jaxmp.value_and_grad(autocast(loss_fn, policy))

            def grad_fn(params, inputs, targets, opt_state):
                scale = jaxmp.get_loss_scale(opt_state)
                return scaled_grad_fn(scale, params, inputs, targets)

        @jax.jit
        def step(params, opt_state, inputs, targets):
            if policy is None:
                loss, grads = grad_fn(params, inputs, targets)
            else:
                loss, grads = grad_fn(params, inputs, targets, opt_state)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        params, opt_state, losses = params0, jax.jit(tx.init)(params0), []
        for inputs, targets in batches:
            params, opt_state, loss = step(params, opt_state, inputs, targets)
            losses.append(float(loss))
        evaluate = jax.jit(loss_fn)
        val = np.mean([float(evaluate(params, x, y)) for x, y in val_batches])
        return np.asarray(losses), val, params

    ref_losses, ref_val, _ = train(None)
    losses, val, params = train("mixed_float16")
    assert np.all(np.isfinite(losses))
    assert ref_losses[-20:].mean() < 0.7 * ref_losses[:5].mean()  # it learns
    final, ref_final = losses[-20:].mean(), ref_losses[-20:].mean()
    assert abs(final - ref_final) <= 0.02 * ref_final, (final, ref_final)
    assert abs(val - ref_val) <= 0.02 * ref_val, (val, ref_val)
    assert all(x.dtype == F32 for x in jax.tree.leaves(params))


# ---------------------------------------------------------------------------------------------
# Cost: autocast against the same model written with explicit dtype arguments.


def test_cost_close_to_explicit_dtype_model():
    bench = pytest.importorskip("benchmarks.autocast_cost", reason="run from the repository root")
    result = bench.measure(
        batch=4, length=16, features=32, layers=1, time_it=False, variants=("explicit", "autocast")
    )
    ratio = result["autocast"]["bytes_accessed"] / result["explicit"]["bytes_accessed"]
    assert ratio <= 1.15, result


def test_runs_under_strict_dtype_promotion():
    """autocast's own promotions do not depend on the caller's promotion mode."""

    def f(w, x):
        return jax.nn.softmax(x @ w).sum()

    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    g = autocast(f, "mixed_float16")
    with jax.numpy_dtype_promotion("strict"):
        out = jax.jit(g)(w, x)
    assert out.dtype == F32 and float(out) == 2.0
