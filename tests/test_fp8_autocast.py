"""FP8 under `jaxmp.autocast` (`jaxmp._src.fp8_autocast`): models, transformations, state.

Unmodified plain-JAX, Linen, NNX and Equinox models run their matmuls in FP8; the results
compose with grad, jit, vmap, scan and remat; the delayed recipe's state follows Transformer
Engine's rule step by step and resumes bit-identically from an orbax checkpoint; the lowered
program keeps the FP8 GEMM pattern. Multi-device runs are in their own process
(tests/distributed/fp8_sharded.py).
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax import lax

import jaxmp
import jaxmp.linen
import jaxmp.nnx
from benchmarks import _hlo
from tests.conftest import FP8_DTYPES, TOLERANCE, all_eqns, fp8_dots, plain_dots
from tests.test_fp8 import (
    E4M3,
    E5M2,
    np_current,
    np_max,
    np_pow2_scale,
    np_quantize,
    product_tolerance,
    rel_err,
)

CURRENT = jaxmp.Float8CurrentScaling()
STATELESS = [CURRENT, jaxmp.Float8BlockScaling(), jaxmp.MXFP8BlockScaling()]
STATELESS_IDS = ["current", "block", "mxfp8"]


def mlp(params, x):
    for i, (w, b) in enumerate(params):
        x = x @ w + b
        if i < len(params) - 1:
            x = jax.nn.gelu(x)
    return x


def mlp_params(seed=0, sizes=(16, 64, 64, 8)):
    keys = jax.random.split(jax.random.key(seed), len(sizes) - 1)
    return [
        (jax.random.normal(k, (a, b)) / np.sqrt(a), jnp.zeros(b))
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def batch(seed=1, n=32, d=16):
    return jax.random.normal(jax.random.key(seed), (n, d))


# --- Plain JAX: what runs in FP8 ----------------------------------------------------------


@pytest.mark.parametrize("recipe", STATELESS, ids=STATELESS_IDS)
def test_every_matmul_runs_in_fp8_and_the_output_follows_the_policy(recipe):
    params, x = mlp_params(), batch()
    f = jaxmp.autocast(mlp, "mixed_bfloat16", fp8=recipe)
    jaxpr = f.jaxpr(params, x)
    assert len(fp8_dots(jaxpr)) == 3 and plain_dots(jaxpr) == []
    # Per-tensor scales: the product is written in the compute dtype directly (the FP8
    # GEMM's output); block scales: one float32 partial sum per block, scaled and summed.
    accumulated = jnp.bfloat16 if recipe.per_tensor else jnp.float32
    for eqn in fp8_dots(jaxpr):
        assert jnp.dtype(eqn.outvars[0].aval.dtype) == accumulated
        assert eqn.params["preferred_element_type"] == accumulated
    if recipe is CURRENT:  # the values (every recipe's numerics: tests/test_fp8.py)
        y = f(params, x)
        assert y.dtype == jnp.float32  # mixed_bfloat16's output dtype
        assert rel_err(y, mlp(params, x)) <= 3 * product_tolerance(E4M3, E4M3)


def test_excluded_matmuls_follow_the_policy():
    def model(params, x):
        with jax.named_scope("first"):
            x = jax.nn.relu(x @ params[0][0])
        with jax.named_scope("body"):
            x = jax.nn.relu(x @ params[1][0])
        with jax.named_scope("last"):
            return x @ params[2][0]

    params, x = mlp_params(), batch()
    f = jaxmp.autocast(model, "mixed_bfloat16", fp8=CURRENT, fp8_exclude=["first", "last"])
    jaxpr = f.jaxpr(params, x)
    assert len(fp8_dots(jaxpr)) == 1
    kept = plain_dots(jaxpr)
    assert len(kept) == 2
    for eqn in kept:  # the policy's compute dtype, as autocast without FP8
        assert [jnp.dtype(v.aval.dtype) for v in eqn.invars] == [jnp.bfloat16] * 2
    # The regex must match the whole name stack: "bod" matches no matmul, an error.
    f = jaxmp.autocast(model, "mixed_bfloat16", fp8=CURRENT, fp8_exclude="bod")
    with pytest.raises(ValueError, match="'bod' matches no matmul.*did you mean 'body'"):
        f.jaxpr(params, x)


def test_float32_region_is_left_out_of_fp8():
    params, x = mlp_params(), batch()

    def model(params, x):
        h = jax.nn.relu(x @ params[0][0])
        return jaxmp.float32_region(lambda h: h @ params[1][0])(h)

    jaxpr = jaxmp.autocast(model, "mixed_bfloat16", fp8=CURRENT).jaxpr(params, x)
    assert len(fp8_dots(jaxpr)) == 1
    assert [jnp.dtype(v.aval.dtype) for v in plain_dots(jaxpr)[0].invars] == [jnp.float32] * 2


def conv(w, x):
    return lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def conv_operands():
    w = jax.random.normal(jax.random.key(0), (3, 3, 4, 8)) * 0.2
    x = jax.random.normal(jax.random.key(1), (2, 8, 8, 4))
    return w, x


def test_convolutions_run_in_fp8_with_per_tensor_recipes_only():
    w, x = conv_operands()
    f = jaxmp.autocast(conv, "mixed_bfloat16", fp8=CURRENT)
    assert len(fp8_dots(f.jaxpr(w, x), "conv_general_dilated")) == 1
    # Block recipes leave convolutions to the policy (bfloat16 here).
    f = jaxmp.autocast(conv, "mixed_bfloat16", fp8=jaxmp.Float8BlockScaling())
    convs = [e for e in all_eqns(f.jaxpr(w, x)) if e.primitive.name == "conv_general_dilated"]
    assert [jnp.dtype(v.aval.dtype) for v in convs[0].invars] == [jnp.bfloat16] * 2


@pytest.mark.slow
def test_fp8_convolution_forward_and_backward_against_float32():
    w, x = conv_operands()
    f = jaxmp.autocast(conv, "mixed_bfloat16", fp8=CURRENT)
    c = jax.random.normal(jax.random.key(2), (2, 8, 8, 8))

    def both(fn):
        return lambda w, x: (fn(w, x), jax.grad(lambda w, x: jnp.sum(fn(w, x) * c), (0, 1))(w, x))

    (y, got), (y_ref, want) = jax.jit(both(f))(w, x), both(conv)(w, x)
    assert rel_err(y, y_ref) <= product_tolerance(E4M3, E4M3)
    for g, e in zip(got, want, strict=True):
        assert rel_err(g, e) <= product_tolerance(E5M2, E4M3)


@pytest.mark.parametrize("op", ["matmul", "conv"])
def test_the_backward_pass_keeps_the_operands_in_fp8(op):
    # What a differentiated FP8 product saves for its backward pass: the operands quantised
    # (one byte a value), not in the compute dtype.
    if op == "conv":
        fun, (w, x) = conv, conv_operands()
    else:
        fun = lambda w, x: x @ w  # noqa: E731
        w, x = jax.random.normal(jax.random.key(0), (32, 16)), jnp.ones((8, 32))
    f = jaxmp.autocast(fun, "mixed_bfloat16", fp8=CURRENT)
    _, backward = jax.vjp(f, w, x)
    saved = [r for r in jax.tree.leaves(backward) if np.size(r) >= min(w.size, x.size)]
    assert saved and {jnp.dtype(r.dtype) for r in saved} <= set(FP8_DTYPES), [
        (r.dtype, r.shape) for r in saved
    ]


# --- Transformations compose --------------------------------------------------------------


def scanned_mlp(stacked, x, dtype=jnp.bfloat16):
    """Linear layers in a scan (XLA may fuse elementwise bfloat16 code in a loop body
    differently from unrolled code: the layers hold only the matmuls compared here)."""

    def layer(h, w):
        return (h @ w).astype(dtype), None

    h, _ = lax.scan(layer, x.astype(dtype), stacked[0])
    return jnp.sum(jnp.tanh(h.astype(jnp.float32)) ** 2)


def stacked_params(n=3, d=32):
    ws = jax.random.normal(jax.random.key(3), (n, d, d)) / np.sqrt(d)
    return ws, jnp.zeros((n, d))


def test_grad_jit_vmap_scan_and_remat_compose():
    # float16: XLA:CPU in jax 0.8 computes a bfloat16 matmul in a loop body and the same
    # matmul outside one to different roundings (without FP8 too), which FP8's scales amplify.
    mlp = functools.partial(scanned_mlp, dtype=jnp.float16)
    f = jaxmp.autocast(mlp, "mixed_float16", fp8=CURRENT)
    params, x = stacked_params(), jax.random.normal(jax.random.key(4), (8, 32))

    # scan: the scanned layers are the unrolled layers.
    def unrolled(stacked, x):
        h = x.astype(jnp.float16)
        for w in stacked[0]:
            h = (h @ w).astype(jnp.float16)
        return jnp.sum(jnp.tanh(h.astype(jnp.float32)) ** 2)

    g = jaxmp.autocast(unrolled, "mixed_float16", fp8=CURRENT)
    np.testing.assert_allclose(f(params, x), g(params, x), rtol=1e-6)
    grad = jax.jit(jax.grad(f))
    grads = grad(params, x)
    # remat: the same gradients, recomputing the forward pass.
    remat = jax.jit(jax.grad(jax.checkpoint(f)))(params, x)
    np.testing.assert_allclose(remat[0], grads[0], rtol=1e-6, atol=1e-7)
    # vmap: each example scaled on its own, as a loop over the examples.
    xs = x.reshape(4, 2, 32)
    per_example = jax.jit(jax.vmap(jax.grad(f), in_axes=(None, 0)))(params, xs)[0]
    looped = jnp.stack([grad(params, xi)[0] for xi in xs])
    np.testing.assert_allclose(per_example, looped, rtol=1e-5, atol=1e-6)
    # And the gradients are those of float32 within the formats' tolerance.
    exact = jax.grad(mlp)(params, x)[0]
    assert rel_err(grads[0], exact) <= product_tolerance(E5M2, E4M3)


# --- The delayed recipe against Transformer Engine's rule ------------------------------------


class DelayedScalingReference:
    """Transformer Engine's delayed scaling, from its documentation, with power-of-two scales.

    The amax of each tensor seen in a step is written to entry 0 of its history. At the end
    of the step (``nvte_delayed_scaling_recipe_amax_and_scale_update``): the amax is the
    history's maximum ("max") or its entry 0 ("most_recent"); the new scale is the largest
    power of two not above ``fp8_max / amax``, divided by ``2**margin`` (Transformer
    Engine's ``(fp8_max / amax) / 2**margin`` rounded down to a power of two), the old one
    where the amax is zero; the history is rotated by -1 and its first entry zeroed. The
    next step quantises with the new scale.
    """

    def __init__(self, history_len, amax_compute, margin):
        self.history = np.zeros((3, history_len), np.float32)
        self.scale = np.ones(3, np.float32)
        self.amax_compute, self.margin = amax_compute, margin

    def step(self, amaxes):
        self.history[:, 0] = amaxes
        if self.amax_compute == "max":
            amax = self.history.max(axis=1)
        else:
            amax = self.history[:, 0].copy()
        scale = [
            np_pow2_scale(a, fmt) / np.float32(2.0**self.margin) if a > 0 else old
            for a, fmt, old in zip(amax, (E4M3, E4M3, E5M2), self.scale, strict=True)
        ]
        self.scale = np.asarray(scale, np.float32)
        self.history = np.roll(self.history, -1, axis=1)
        self.history[:, 0] = 0.0


@pytest.mark.parametrize(
    ("history_len", "amax_compute", "margin"),
    [(1, "max", 0), (3, "max", 1), (4, "most_recent", 0)],
)
def test_delayed_scaling_follows_transformer_engines_rule_step_by_step(
    history_len, amax_compute, margin
):
    recipe = jaxmp.DelayedScaling(history_len=history_len, amax_compute=amax_compute, margin=margin)
    f = jaxmp.autocast(lambda w, x: x @ w, "float32", fp8=recipe)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((24, 16)).astype(np.float32)
    state = f.fp8_init(w, jax.ShapeDtypeStruct((8, 24), jnp.float32))
    (key,) = state.amax_history
    assert state.names == ((key, ""),)
    reference = DelayedScalingReference(history_len, amax_compute, margin)

    @jax.jit
    def step(w, x, c, state):
        def loss(w, state):
            return jnp.sum(f.with_fp8_state(state)(w, x) * c)

        y = f.with_fp8_state(state)(w, x)
        gw, new_state = jax.grad(loss, (0, 1))(w, state)
        return y, gw, new_state

    # Growing, shrinking, spiking and vanishing magnitudes: "max" and "most_recent" differ.
    for x_scale, c_scale in [(1, 1), (4, 0.5), (0.25, 2), (16, 1), (1, 0), (2, 8)]:
        x = (rng.standard_normal((8, 24)) * x_scale).astype(np.float32)
        c = (rng.standard_normal((8, 16)) * c_scale).astype(np.float32)
        used = reference.scale.copy()
        y, gw, state = step(w, x, c, state)
        amaxes = np.asarray([np.abs(x).max(), np.abs(w).max(), np.abs(c).max()], np.float32)
        reference.step(amaxes)
        np.testing.assert_array_equal(state.amax_history[key], reference.history)
        np.testing.assert_array_equal(state.scale[key], reference.scale)
        # The step quantised with the scales of the previous one.
        qx, qw = np_quantize(x, used[0], E4M3), np_quantize(w, used[1], E4M3)
        expected = (qx.astype(np.float64) / used[0]) @ (qw.astype(np.float64) / used[1])
        np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
        qc = np_quantize(c, used[2], E5M2).astype(np.float64) / used[2]
        expected_gw = (qx.astype(np.float64) / used[0]).T @ qc
        np.testing.assert_allclose(gw, expected_gw, rtol=1e-5, atol=1e-5)


def test_delayed_state_is_required_and_must_fit_the_program():
    recipe = jaxmp.DelayedScaling(history_len=2)
    f = jaxmp.autocast(lambda w, x: x @ w, "mixed_bfloat16", fp8=recipe)
    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    with pytest.raises(TypeError, match="create its state with `fp8_init"):
        f(w, x)
    with pytest.raises(TypeError, match="`state` must be a jaxmp.Float8State"):
        f.with_fp8_state({"s0": 1.0})
    other = jaxmp.autocast(lambda w, x: (x @ w) @ w, "mixed_bfloat16", fp8=recipe)
    with pytest.raises(ValueError, match="the FP8 state has no entry 's1'"):
        other.with_fp8_state(f.fp8_init(w, x))(w, x)
    longer = jaxmp.autocast(
        lambda w, x: x @ w, "mixed_bfloat16", fp8=jaxmp.DelayedScaling(history_len=3)
    )
    with pytest.raises(ValueError, match=r"history of shape \(3, 2\).*history_len=3"):
        longer.with_fp8_state(f.fp8_init(w, x))(w, x)
    assert jaxmp.autocast(jnp.dot, "mixed_bfloat16", fp8=CURRENT).fp8_init(w, w).amax_history == {}


def test_scanned_layers_keep_one_history_per_layer():
    recipe = jaxmp.DelayedScaling(history_len=2)
    f = jaxmp.autocast(scanned_mlp, "mixed_bfloat16", fp8=recipe)
    params, x = stacked_params(), jax.random.normal(jax.random.key(4), (8, 32))
    # Layers of very different magnitudes: each must get its own scales.
    params = (params[0] * jnp.asarray([1.0, 8.0, 0.125])[:, None, None], params[1])
    state = f.fp8_init(params, x)
    (key,) = state.amax_history
    assert state.amax_history[key].shape == (3, 3, 2) and state.scale[key].shape == (3, 3)
    _, new = jax.jit(jax.grad(lambda p, s: f.with_fp8_state(s)(p, x), (0, 1)))(params, state)
    weight_amax = jnp.max(jnp.abs(params[0].astype(jnp.bfloat16).astype(jnp.float32)), (1, 2))
    np.testing.assert_array_equal(new.amax_history[key][:, 1, -1], weight_amax)
    expected = [np_pow2_scale(a, E4M3) for a in np.asarray(weight_amax)]
    np.testing.assert_array_equal(new.scale[key][:, 1], expected)


def test_a_jitted_function_called_twice_is_two_matmuls_with_two_states():
    layer = jax.jit(lambda w, h: jnp.tanh(h @ w))
    f = jaxmp.autocast(
        lambda w, x: layer(w, layer(w, x) * 100.0),
        "mixed_bfloat16",
        fp8=jaxmp.DelayedScaling(history_len=1),
    )
    w, x = jnp.eye(8) * 0.5, jnp.ones((2, 8))
    state = f.fp8_init(w, x)
    assert len(state.amax_history) == 2
    new = jax.grad(lambda s: jnp.sum(f.with_fp8_state(s)(w, x)))(state)
    first, second = (new.scale[k][0] for k in sorted(new.scale))
    assert first != second  # inputs 1 and 100 * tanh(0.5): two amaxes, two scales


def test_matmuls_in_a_while_loop_use_current_scaling():
    def body(w, x):
        return lax.while_loop(lambda c: c[1] < 3, lambda c: (jnp.tanh(c[0] @ w), c[1] + 1), (x, 0))[
            0
        ]

    f = jaxmp.autocast(body, "mixed_bfloat16", fp8=jaxmp.DelayedScaling())
    w, x = jnp.eye(8), jnp.ones((2, 8))
    state = f.fp8_init(w, x)
    assert state.amax_history == {}
    assert len(fp8_dots(jax.make_jaxpr(f.with_fp8_state(state))(w, x))) >= 1


# --- The lowered program -------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16", "float32"])
@pytest.mark.parametrize(
    ("lhs_shape", "rhs_shape", "dims"),
    [
        ((8, 32), (32, 16), (((1,), (0,)), ((), ()))),  # x @ w
        ((8, 32), (16, 32), (((1,), (1,)), ((), ()))),  # x @ w.T
        ((2, 8, 32), (32, 16), (((2,), (0,)), ((), ()))),  # a batch of sequences @ w
        ((4, 5, 8), (4, 8, 6), (((2,), (1,)), ((0,), (0,)))),  # batched, attention-like
        ((32, 8), (32, 16), (((0,), (0,)), ((), ()))),  # x.T @ w
    ],
)
def test_lowered_program_is_fp8_gemms_in_the_compute_dtype_without_fp8_transposes(
    policy, lhs_shape, rhs_shape, dims
):
    # The pattern XLA's GPU compiler rewrites into a cuBLASLt FP8 GEMM that writes the
    # compute dtype directly (no float32 product converted afterwards), with the contracted
    # dimensions minor on both operands (no transposition of an FP8 tensor), forward and
    # backward.
    f = jaxmp.autocast(lambda x, w: jax.lax.dot_general(x, w, dims), policy, fp8=CURRENT)
    x, w = jnp.ones(lhs_shape), jnp.ones(rhs_shape)
    loss = lambda x, w: jnp.sum(jnp.tanh(f(x, w)))  # noqa: E731 (the output feeds the grad)
    text = jax.jit(jax.grad(loss, (0, 1))).lower(x, w).as_text()
    gemms = _hlo.fp8_gemms(text)
    compute = {"mixed_bfloat16": "bf16", "mixed_float16": "f16", "float32": "f32"}[policy]
    # Forward: E4M3 x E4M3; backward: the E5M2 gradient with each E4M3 operand.
    assert sorted(g["operands"] for g in gemms) == sorted(
        [("f8E4M3FN", "f8E4M3FN"), ("f8E5M2", "f8E4M3FN"), ("f8E4M3FN", "f8E5M2")]
    ), text
    assert [g["result"] for g in gemms] == [compute] * 3
    assert all(g["contracting_minor"] for g in gemms), gemms
    assert _hlo.fp8_transposes(text) == 0
    # No float32 product anywhere: every dot of the program is one of the FP8 GEMMs.
    assert text.count("stablehlo.dot_general") == 3


# --- Flax Linen, NNX and Equinox ------------------------------------------------------------


class LinenLM(nn.Module):
    """Embedding, a scanned stack of residual MLP blocks, and a head."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(32, 32, name="embed")(tokens)

        class Block(nn.Module):
            @nn.compact
            def __call__(self, h, _):
                return h + nn.Dense(32, name="fc")(nn.gelu(nn.LayerNorm()(h))), None

        x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)(
            name="blocks"
        )(x, None)
        return nn.Dense(32, name="head")(x)


@pytest.mark.slow
def test_linen_model_trains_with_delayed_scaling_through_the_train_state():
    model = LinenLM()
    tokens = jax.random.randint(jax.random.key(0), (4, 8), 0, 32)
    apply = jaxmp.linen.fp8_apply(
        model.apply, "mixed_bfloat16", jaxmp.DelayedScaling(history_len=4), exclude=".*/head"
    )
    variables = apply.init(model.init(jax.random.key(1), tokens), tokens)
    fp8_state = variables["_overwrite_with_gradient"]["jaxmp_fp8"]
    assert [name for _, name in fp8_state.names] == ["LinenLM/blocks/fc"]
    assert jax.tree.map(jnp.shape, fp8_state.scale) == {fp8_state.names[0][0]: (2, 3)}
    state = jaxmp.linen.TrainState.create(
        apply_fn=apply, params=variables, tx=optax.adam(1e-2), policy="mixed_bfloat16"
    )

    @jax.jit
    def step(state):
        def loss_fn(v):
            logits = state.apply_fn(v, tokens)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

        loss, grads = jaxmp.value_and_grad(loss_fn)(state.loss_scale, state.params)
        return state.apply_gradients(grads=grads), loss

    losses = []
    for _ in range(8):
        state, loss = step(state)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    history = state.params["_overwrite_with_gradient"]["jaxmp_fp8"].amax_history
    (hist,) = history.values()
    assert np.all(np.asarray(hist)[:, :, 1:] > 0)  # 3 amaxes of 4 slots recorded per layer
    assert state.params["params"]["head"]["kernel"].dtype == jnp.float32


@pytest.mark.slow
def test_nnx_model_trains_with_delayed_scaling_through_the_optimizer():
    x = jax.random.normal(jax.random.key(0), (16, 8))
    y = jnp.sum(x, axis=1, keepdims=True)
    inner = nnx.Sequential(
        nnx.Linear(8, 32, rngs=nnx.Rngs(0)), nnx.gelu, nnx.Linear(32, 1, rngs=nnx.Rngs(1))
    )
    model = jaxmp.nnx.Float8(inner, "mixed_bfloat16", jaxmp.DelayedScaling(history_len=2), x)
    tx = jaxmp.mixed_precision(optax.adam(1e-2), "mixed_bfloat16")
    optimizer = jaxmp.nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        def loss_fn(m):
            return jnp.mean((m(x).astype(jnp.float32) - y) ** 2)

        loss, grads = jaxmp.nnx.value_and_grad(loss_fn)(optimizer.loss_scale, model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer)) for _ in range(10)]
    assert losses[-1] < losses[0] / 2
    state = model.fp8_state.get_value()
    assert len(state.scale) == 2
    first = state.scale[min(state.scale, key=lambda k: int(k[1:].split("_")[0]))]
    assert float(first[0]) == np_pow2_scale(float(jnp.abs(x.astype(jnp.bfloat16)).max()), E4M3)
    # The optimizer never saw the FP8 state: its state mirrors the params only.
    paths = [
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_leaves_with_path(nnx.state(optimizer))
    ]
    assert any("kernel" in p for p in paths) and not any("fp8_state" in p for p in paths)


def _assert_trees_equal(actual, expected):
    a = jax.tree_util.tree_leaves_with_path(actual)
    b = jax.tree_util.tree_leaves_with_path(expected)
    assert [p for p, _ in a] == [p for p, _ in b]
    for (path, x), (_, y) in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


def _differs(actual, expected):
    pairs = zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)
    return any(not np.array_equal(x, y) for x, y in pairs)


def test_linen_skipped_step_keeps_the_fp8_state():
    model = nn.Sequential([nn.Dense(32), nn.gelu, nn.Dense(4)])
    x = jax.random.normal(jax.random.key(0), (8, 16))
    apply = jaxmp.linen.fp8_apply(
        model.apply, "mixed_bfloat16", jaxmp.DelayedScaling(history_len=3)
    )
    variables = apply.init(model.init(jax.random.key(1), x), x)
    state = jaxmp.linen.TrainState.create(
        apply_fn=apply, params=variables, tx=optax.adam(1e-2), policy="mixed_bfloat16"
    )

    @jax.jit
    def step(state, factor):
        def loss_fn(v):
            return jnp.mean(state.apply_fn(v, x).astype(jnp.float32) ** 2) * factor

        _, grads = jaxmp.value_and_grad(loss_fn)(state.loss_scale, state.params)
        return state.apply_gradients(grads=grads), grads

    state, _ = step(state, 1.0)
    skipped, grads = step(state, jnp.nan)
    assert int(skipped.step) == 1 and not bool(skipped.metrics()["grads_finite"])
    fp8 = lambda tree: tree["_overwrite_with_gradient"]["jaxmp_fp8"]  # noqa: E731
    # The step computed a next FP8 state (rolled history, new amaxes) and did not keep it.
    assert _differs(fp8(grads), fp8(state.params))
    _assert_trees_equal(fp8(skipped.params), fp8(state.params))
    _assert_trees_equal(skipped.params, state.params)
    # Without a loss scale to adjust, the skipped step changed nothing: the next step is the
    # step that would have followed.
    _assert_trees_equal(step(skipped, 1.0)[0].params, step(state, 1.0)[0].params)


def test_nnx_skipped_step_keeps_the_fp8_state():
    x = jax.random.normal(jax.random.key(0), (8, 16))
    inner = nnx.Sequential(
        nnx.Linear(16, 32, rngs=nnx.Rngs(0)), nnx.gelu, nnx.Linear(32, 4, rngs=nnx.Rngs(1))
    )
    model = jaxmp.nnx.Float8(inner, "mixed_bfloat16", jaxmp.DelayedScaling(history_len=3), x)
    tx = jaxmp.mixed_precision(optax.adam(1e-2), "mixed_bfloat16")
    optimizer = jaxmp.nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, factor):
        def loss_fn(m):
            return jnp.mean(m(x).astype(jnp.float32) ** 2) * factor

        _, grads = jaxmp.nnx.value_and_grad(loss_fn)(optimizer.loss_scale, model)
        optimizer.update(model, grads)
        return nnx.state(grads, jaxmp.nnx.Float8StateVariable)

    step(model, optimizer, 1.0)
    before = jax.tree.map(np.asarray, nnx.state(model))
    next_fp8 = step(model, optimizer, jnp.nan)
    assert int(optimizer.step[...]) == 1
    assert not bool(optimizer.metrics()["grads_finite"])
    assert _differs(next_fp8, nnx.state(model, jaxmp.nnx.Float8StateVariable))
    _assert_trees_equal(nnx.state(model), before)


def test_equinox_model_runs_in_fp8():
    eqx = pytest.importorskip("equinox", reason="equinox is an optional test dependency")
    model = eqx.nn.MLP(8, 4, 32, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (16, 8))
    f = jaxmp.autocast(lambda model, x: jax.vmap(model)(x), "mixed_bfloat16", fp8=CURRENT)
    assert len(fp8_dots(f.jaxpr(model, x))) == 3


@pytest.mark.slow
def test_equinox_model_trains_with_delayed_scaling():
    eqx = pytest.importorskip("equinox", reason="equinox is an optional test dependency")
    model = eqx.nn.MLP(8, 1, 32, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (16, 8))
    y = jnp.sum(x, axis=1, keepdims=True)
    f = jaxmp.autocast(
        lambda m, x: jax.vmap(m)(x), "mixed_bfloat16", fp8=jaxmp.DelayedScaling(history_len=2)
    )
    state = f.fp8_init(model, x)
    tx = jaxmp.mixed_precision(optax.adam(1e-2), "mixed_bfloat16")
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))

    def loss(model_and_state, x):
        model, state = model_and_state
        out = f.with_fp8_state(state)(model, x).astype(jnp.float32)
        return jnp.mean((out - y) ** 2)

    @eqx.filter_jit
    def step(model, state, opt_state):
        scale = jaxmp.get_loss_scale(opt_state)
        value, (grads, new_state) = jaxmp.filter_value_and_grad(loss)(scale, (model, state), x)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), new_state, opt_state, value

    losses = []
    for _ in range(10):
        model, state, opt_state, value = step(model, state, opt_state)
        losses.append(float(value))
    assert losses[-1] < losses[0] / 2
    assert len(state.amax_history) == 3
    assert all(float(h[0, -1]) > 0 for h in state.amax_history.values())


# --- Checkpoint and resume ------------------------------------------------------------------


@pytest.mark.slow
def test_delayed_state_resumes_bit_identically_from_an_orbax_checkpoint(tmp_path):
    model = LinenLM()
    tokens = jax.random.randint(jax.random.key(0), (4, 8), 0, 32)
    apply = jaxmp.linen.fp8_apply(
        model.apply, "mixed_bfloat16", jaxmp.DelayedScaling(history_len=3)
    )
    tx = optax.adam(1e-2)

    def create():
        variables = apply.init(model.init(jax.random.key(1), tokens), tokens)
        return jaxmp.linen.TrainState.create(
            apply_fn=apply, params=variables, tx=tx, policy="mixed_bfloat16"
        )

    @jax.jit
    def step(state, i):
        def loss_fn(v):
            logits = state.apply_fn(v, (tokens + i) % 32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

        _, grads = jaxmp.value_and_grad(loss_fn)(state.loss_scale, state.params)
        return state.apply_gradients(grads=grads)

    def steps(state, start, stop):
        for i in range(start, stop):
            state = step(state, i)
        return state

    straight = steps(create(), 0, 6)
    first = steps(create(), 0, 3)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "fp8", first)
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(tmp_path / "fp8", jax.eval_shape(create))
    resumed = steps(restored, 3, 6)
    a = jax.tree_util.tree_leaves_with_path(straight)
    b = jax.tree_util.tree_leaves_with_path(resumed)
    assert [p for p, _ in a] == [p for p, _ in b]
    assert any("jaxmp_fp8" in jax.tree_util.keystr(p) for p, _ in a)
    for (path, x), (_, y) in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


# --- Sharded runs ----------------------------------------------------------------------------

SCRIPT = pathlib.Path(__file__).parent / "distributed" / "fp8_sharded.py"


@pytest.mark.slow
def test_eight_devices_take_the_same_scaling_decision():
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["devices"] == 8
    # shard_map: every device computed the same next state, from the global amaxes.
    assert result["shard_map_states_equal"] and result["shard_map_amax_is_global"]
    # jit over a sharded batch: the same numbers as on one device.
    assert result["jit_state_equal_to_one_device"]
    # The products are bfloat16 (the FP8 GEMM's output): sums in another order on 8 devices
    # round some values to the neighbouring bfloat16.
    assert result["jit_loss_relative_diff"] <= TOLERANCE[jnp.dtype(jnp.bfloat16)]
    assert result["current_scaling_outputs_equal"]


def test_np_reference_helpers_agree_with_ml_dtypes():
    # The references the tests above rely on: E4M3's largest value and its saturation.
    assert np_max(E4M3) == 448 and np_max(E5M2) == 57344
    q, scale = np_current(np.asarray([0.5, -1.0, 2.0], np.float32), E4M3)
    assert scale == np.float32(128) and q.dtype == ml_dtypes.float8_e4m3fn  # 2**7 <= 448 / 2
    assert np_pow2_scale(np.float32(448), E4M3) == 1 and np_pow2_scale(449, E4M3) == 0.5
    assert float(np_quantize(np.asarray([1e6], np.float32), 1.0, E4M3)[0]) == 448.0
