"""Attacks on FP8's promises, and on the library's guarantees with FP8 on.

* A non-finite operand value (an overflow of the compute dtype, a NaN) is never hidden by
  quantisation: the FP8 product is non-finite where the plain product is, forward and
  backward, for every recipe, so loss scaling skips the step; a delayed amax history never
  records it.
* A finite value at the compute dtype's largest, in an operand or the incoming gradient,
  gives a finite product and finite gradients with every recipe, under float16 and bfloat16.
* MXFP8 is exact for all-zero blocks and does not saturate a block's largest value below the
  compute dtype's largest.
* A delayed-scaling state is correct under ``jax.vmap`` and refused when one differentiated
  call uses it twice; it is checked against the program it was made for.
* Differentiating an FP8 matmul's backward pass (Hessians) is a clear error.
* ``fp8_exclude`` patterns that match nothing are errors naming the matmuls that exist.
"""

from __future__ import annotations

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
import jaxmp.linen
import jaxmp.nnx
from jaxmp._src import fp8, fp8_dot, fp8_scaling
from tests.conftest import diagonal_cases
from tests.test_fp8 import E4M3, E5M2, np_max, product_tolerance

DIMS = (((1,), (0,)), ((), ()))
ALL = [
    jaxmp.Float8CurrentScaling(),
    jaxmp.DelayedScaling(history_len=4),
    jaxmp.Float8BlockScaling(tile_size=16, weight_block_size=16),
    jaxmp.MXFP8BlockScaling(),
]
ALL_IDS = ["current", "delayed", "block", "mxfp8"]
STATELESS = [r for r in ALL if not r.stateful]
STATELESS_IDS = [i for r, i in zip(ALL, ALL_IDS, strict=True) if not r.stateful]


def mlp(params, x):
    h = jax.nn.relu(x @ params["w1"])
    return h @ params["w2"]


def mlp_params(d_in=32, d_hidden=64, d_out=8, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "w1": jax.random.normal(k1, (d_in, d_hidden)) / np.sqrt(d_in),
        "w2": jax.random.normal(k2, (d_hidden, d_out)) / np.sqrt(d_hidden),
    }


def call(f, state):
    """`f` as a plain function: with its FP8 state for a stateful recipe."""
    return f if state is None else f.with_fp8_state(state)


def init_state(f, *args):
    return f.fp8_init(*args) if f.fp8.stateful else None


# --- 1. Non-finite values are never hidden ----------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "recipe"),
    diagonal_cases([np.inf, -np.inf, np.nan], ALL, ["inf", "-inf", "nan"], ALL_IDS),
)
def test_a_non_finite_operand_gives_a_non_finite_product_where_the_plain_one_does(recipe, bad):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 48)).astype(np.float32)
    w = rng.standard_normal((48, 24)).astype(np.float32)
    x[2, 5] = bad
    site = fp8.initial_site_state((), recipe.history_len) if recipe.stateful else None
    out = jax.jit(
        lambda x, w, site: fp8_dot.fp8_dot_general(x, w, DIMS, recipe, jnp.float32, site=site)
    )(x, w, site)
    plain = x @ w
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(plain))
    assert not np.isfinite(out[2]).any()
    # The other rows are the FP8 product of the finite values, not garbage from a scale
    # that the non-finite value spoilt.
    others = np.delete(np.arange(8), 2)
    reference = fp8_dot.fp8_dot_general(x[others], w, DIMS, recipe, jnp.float32, site=site)
    np.testing.assert_allclose(out[others], reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("recipe", ALL, ids=ALL_IDS)
def test_a_non_finite_gradient_gives_non_finite_operand_gradients(recipe):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 48)).astype(np.float32)
    w = rng.standard_normal((48, 24)).astype(np.float32)
    c = rng.standard_normal((8, 24)).astype(np.float32)
    c[3, 7] = np.inf
    site = fp8.initial_site_state((), recipe.history_len) if recipe.stateful else None

    def loss(x, w, site):
        return jnp.sum(fp8_dot.fp8_dot_general(x, w, DIMS, recipe, jnp.float32, site=site) * c)

    dx, dw, new_site = jax.jit(jax.grad(loss, (0, 1, 2)))(x, w, site)
    plain_dx, plain_dw = jax.grad(lambda x, w: jnp.sum((x @ w) * c), (0, 1))(x, w)
    np.testing.assert_array_equal(np.isfinite(dx), np.isfinite(plain_dx))
    np.testing.assert_array_equal(np.isfinite(dw), np.isfinite(plain_dw))
    assert not np.all(np.isfinite(dx)) and not np.all(np.isfinite(dw))
    if recipe.stateful:  # the history never records a non-finite amax
        history, scale = new_site
        assert np.all(np.isfinite(history)) and np.all(np.isfinite(scale))
        assert float(history[fp8.ROLE_GRAD, -1]) == float(np.abs(c[np.isfinite(c)]).max())


# --- 1b. A finite value at the compute dtype's largest stays finite ---------------------------

# The two largest values of each compute dtype, and one below where the formats round up: a
# block scale of 2**8 takes 64992 to 253.875, which E4M3 rounds to 256 (256 * 2**8 is inf in
# float16), and 2**-1 takes it to 32496, which E5M2 rounds to 2**15.
NEAR_MAX = [
    pytest.param("mixed_float16", 65504.0, id="float16-max"),
    pytest.param("mixed_float16", 64992.0, id="float16-64992"),
    pytest.param("mixed_bfloat16", 255 * 2.0**120, id="bfloat16-max"),
    pytest.param("mixed_bfloat16", 254 * 2.0**120, id="bfloat16-below-max"),
]


def matmul(x, w):
    return x @ w


def _product_and_grads(recipe, policy, x, w, c):
    """``x @ w`` under `policy` (FP8 with `recipe`, plain with None) and the gradients of
    ``sum((x @ w) * c)``; a delayed state first takes one step of the same call, so that its
    scales are those of these operands."""
    f = jaxmp.autocast(matmul, policy, fp8=recipe)

    def loss(x, w, state):
        out = call(f, state)(x, w)
        return jnp.sum(out.astype(jnp.float32) * c), out

    argnums = (0, 1, 2) if recipe is not None and recipe.stateful else (0, 1)
    run = jax.jit(jax.grad(loss, argnums, has_aux=True))
    state = init_state(f, x, w) if recipe is not None else None
    with jax.numpy_dtype_promotion("strict"):
        if state is not None:
            (_, _, state), _ = run(x, w, state)
        grads, out = run(x, w, state)
    return np.asarray(out, np.float64), [np.asarray(g, np.float64) for g in grads[:2]]


def test_near_max_values_are_the_compute_dtypes_largest():
    assert NEAR_MAX[0].values[1] == float(jnp.finfo(jnp.float16).max)
    assert NEAR_MAX[2].values[1] == float(jnp.finfo(jnp.bfloat16).max)
    below = jnp.nextafter(jnp.finfo(jnp.bfloat16).max, jnp.bfloat16(0))
    assert NEAR_MAX[3].values[1] == float(below)


@pytest.mark.parametrize("recipe", ALL, ids=ALL_IDS)
@pytest.mark.parametrize(("policy", "big"), NEAR_MAX)
def test_a_finite_operand_at_the_compute_maximum_gives_a_finite_product(recipe, policy, big):
    # The plain product is `big` itself. FP8 may saturate it (to the largest FP8 value whose
    # dequantised value is finite in the compute dtype), never round it up to inf.
    x = jnp.zeros((4, 64), jnp.float32).at[1, 3].set(big)
    w = jnp.ones((64, 8), jnp.float32)
    c = jnp.zeros((4, 8), jnp.float32)
    plain, _ = _product_and_grads(None, policy, x, w, c)
    out, _ = _product_and_grads(recipe, policy, x, w, c)
    np.testing.assert_array_equal(plain[1], big)
    assert np.all(np.isfinite(out)), out[1]
    np.testing.assert_allclose(out[1], big, rtol=float(jnp.finfo(recipe.fwd_dtype).eps))
    np.testing.assert_array_equal(np.delete(out, 1, axis=0), 0.0)


@pytest.mark.parametrize("recipe", ALL, ids=ALL_IDS)
@pytest.mark.parametrize(("policy", "big"), NEAR_MAX)
def test_a_finite_gradient_at_the_compute_maximum_gives_finite_operand_gradients(
    recipe, policy, big
):
    # The incoming gradient is `big` at one entry: each operand's gradient is `big` in one row
    # (x's) or column (w's), finite in the plain program; E5M2 may saturate it, never round
    # it up to inf.
    x = jnp.ones((4, 64), jnp.float32)
    w = jnp.ones((64, 8), jnp.float32)
    c = jnp.zeros((4, 8), jnp.float32).at[0, 0].set(big)
    _, (plain_dx, plain_dw) = _product_and_grads(None, policy, x, w, c)
    _, (dx, dw) = _product_and_grads(recipe, policy, x, w, c)
    np.testing.assert_array_equal(plain_dx[0], big)
    np.testing.assert_array_equal(plain_dw[:, 0], big)
    assert np.all(np.isfinite(dx)) and np.all(np.isfinite(dw)), (dx[0], dw[:, 0])
    rtol = float(jnp.finfo(recipe.bwd_dtype).eps)
    np.testing.assert_allclose(dx[0], big, rtol=rtol)
    np.testing.assert_allclose(dw[:, 0], big, rtol=rtol)
    np.testing.assert_array_equal(dx[1:], 0.0)
    np.testing.assert_array_equal(dw[:, 1:], 0.0)


def test_a_block_partial_sum_is_scaled_without_an_intermediate_overflow():
    # (partial sum, lhs inverse scale, rhs inverse scale): each product is a finite, normal
    # float32 value that one order of the two multiplications overflows or flushes to zero.
    cases = [
        (240.0 * 256.0, 2.0**120, 2.0**-8),  # a bfloat16-max block times ones: 240 * 2**120
        (2.0**-18, 2.0**120, 2.0**10),  # the scales' product overflows: 2**112
        (2.0**20, 2.0**-120, 2.0**-20),  # the scales' product is subnormal: 2**-120
        (0.0, 2.0**120, 2.0**10),  # zero, not 0 * inf
        (-3.0, 2.0**-100, 2.0**90),  # an ordinary case
    ]
    partial, ls, rs = (jnp.asarray(column, jnp.float32) for column in zip(*cases, strict=True))
    with jax.numpy_dtype_promotion("strict"):
        scaled = jax.jit(fp8_dot._scale_partial)(partial, ls, rs)
    expected = [p * a * b for p, a, b in cases]  # exact: powers of two in float64
    np.testing.assert_array_equal(np.asarray(scaled, np.float64), expected)
    bad = jnp.asarray([np.inf, -np.inf, np.nan], jnp.float32)
    ones = jnp.ones(3, jnp.float32)
    with jax.numpy_dtype_promotion("strict"):
        kept = jax.jit(fp8_dot._scale_partial)(bad, ones * 2.0**120, ones * 2.0**10)
    np.testing.assert_array_equal(np.asarray(kept), bad)


def _float16_overflow_step(recipe, policy):
    """One `mixed_precision` step of an FP8 model whose input overflows the compute dtype."""
    params = mlp_params()
    f = jaxmp.autocast(mlp, policy, fp8=recipe)
    tx = jaxmp.mixed_precision(optax.sgd(0.1), policy)
    opt_state = tx.init(params)
    x = jnp.full((4, 32), 0.01).at[1, 3].set(1e5 if policy == "mixed_float16" else np.inf)
    state = init_state(f, params, x)

    @jax.jit
    def step(params, opt_state, state):
        def loss_fn(params, state):
            return jnp.mean(call(f, state)(params, x) ** 2)

        loss_scale = jaxmp.get_loss_scale(opt_state)
        if state is None:
            loss, grads = jaxmp.value_and_grad(loss_fn)(loss_scale, params, None)
            new_state = None
        else:
            loss, (grads, new_state) = jaxmp.value_and_grad(loss_fn, argnums=(0, 1))(
                loss_scale, params, state
            )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, new_state

    new_params, new_opt_state, loss, new_state = step(params, opt_state, state)
    return params, new_params, new_opt_state, loss, new_state


# Every recipe under mixed_float16 by default (where loss scaling skips); under
# mixed_bfloat16 with the tests marked slow.
@pytest.mark.parametrize(
    ("policy", "recipe"),
    [
        pytest.param(policy, recipe, id=f"{policy}-{name}", marks=marks)
        for policy, marks in (("mixed_float16", []), ("mixed_bfloat16", [pytest.mark.slow]))
        for recipe, name in zip(ALL, ALL_IDS, strict=True)
    ],
)
def test_an_overflowing_input_is_a_skipped_step_with_every_recipe(recipe, policy):
    # 1e5 is inf in float16 (in bfloat16, with float32's range: inf itself): the plain model's
    # loss is not finite and the step is skipped; quantisation must not turn the inf into
    # FP8's largest value.
    params, new_params, opt_state, loss, new_state = _float16_overflow_step(recipe, policy)
    assert not np.isfinite(loss)
    metrics = jaxmp.loss_scale_metrics(opt_state)
    assert not bool(metrics["grads_finite"]) and int(metrics["skipped_steps"]) == 1
    for old, new in zip(jax.tree.leaves(params), jax.tree.leaves(new_params), strict=True):
        np.testing.assert_array_equal(old, new)
    if new_state is not None:
        for history in new_state.amax_history.values():
            assert np.all(np.isfinite(history))


def test_mxfp8_backward_overflow_backs_the_loss_scale_off():
    # A float16 gradient that overflows at a loss scale of 2**30 must make the step
    # non-finite, so that the dynamic loss scale backs off instead of staying at 2**30.
    params = mlp_params()
    f = jaxmp.autocast(mlp, "mixed_float16", fp8=jaxmp.MXFP8BlockScaling())
    tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(loss_scale=jnp.float32(2.0**30)))
    opt_state = tx.init(params)
    x = jax.random.normal(jax.random.key(2), (16, 32))

    @jax.jit
    def step(params, opt_state):
        loss_fn = lambda p: jnp.mean(f(p, x).astype(jnp.float32) ** 2)  # noqa: E731
        _, grads = jaxmp.value_and_grad(loss_fn)(jaxmp.get_loss_scale(opt_state), params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    new_params, opt_state = step(params, opt_state)
    metrics = jaxmp.loss_scale_metrics(opt_state)
    assert not bool(metrics["grads_finite"])
    assert float(metrics["loss_scale"]) == 2.0**29
    np.testing.assert_array_equal(new_params["w1"], params["w1"])


def test_linen_delayed_scaling_skips_an_overflowing_step_and_keeps_its_history():
    model = nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(4)])
    x = jax.random.normal(jax.random.key(0), (8, 16))
    apply = jaxmp.linen.fp8_apply(model.apply, "mixed_float16", jaxmp.DelayedScaling(history_len=3))
    variables = apply.init(model.init(jax.random.key(1), x), x)
    state = jaxmp.linen.TrainState.create(
        apply_fn=apply, params=variables, tx=optax.adam(1e-2), policy="mixed_float16"
    )

    @jax.jit
    def step(state, x):
        def loss_fn(v):
            return jnp.mean(state.apply_fn(v, x).astype(jnp.float32) ** 2)

        _, grads = jaxmp.value_and_grad(loss_fn)(state.loss_scale, state.params)
        return state.apply_gradients(grads=grads), grads

    state, _ = step(state, x)
    skipped, grads = step(state, x.at[0, 0].set(1e5))
    assert not bool(skipped.metrics()["grads_finite"])
    next_fp8 = grads["_overwrite_with_gradient"]["jaxmp_fp8"]
    for history in next_fp8.amax_history.values():
        assert np.all(np.isfinite(history))
    for a, b in zip(jax.tree.leaves(skipped.params), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_array_equal(a, b)


# --- 2 and 5. MXFP8 blocks ----------------------------------------------------------------


@pytest.mark.parametrize("recipe", ALL, ids=ALL_IDS)
def test_all_zero_blocks_are_exact(recipe):
    x = np.zeros((4, 96), np.float32)
    x[1, 40:50] = np.arange(1, 11)  # one block with values, the others zero
    w = np.ones((96, 8), np.float32)
    site = fp8.initial_site_state((), recipe.history_len) if recipe.stateful else None

    def product(x, w, site):
        return fp8_dot.fp8_dot_general(x, w, DIMS, recipe, jnp.float32, site=site)

    out = jax.jit(product)(x, w, site)
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(np.delete(np.asarray(out), 1, axis=0), 0.0)
    np.testing.assert_allclose(out[1], 55.0, rtol=product_tolerance(E4M3, E4M3))
    # An all-zero operand; with delayed scaling under the initial state (scales of 1) and
    # under the state the product above leaves (x's scale 2**5, from its amax of 10).
    sites = [site]
    if recipe.stateful:
        next_site = jax.jit(jax.grad(lambda x, w, site: jnp.sum(product(x, w, site)), 2))(
            x, w, site
        )
        assert float(next_site[1][fp8.ROLE_LHS]) == 2.0**5
        sites.append(next_site)
    for s in sites:
        np.testing.assert_array_equal(jax.jit(product)(jnp.zeros((4, 96)), w, s), 0.0)


def test_relu_mlp_with_a_zero_initialised_head_trains_in_mxfp8():
    params = mlp_params()
    params["w2"] = jnp.zeros_like(params["w2"])
    x = jax.random.normal(jax.random.key(3), (32, 32))
    y = jax.random.normal(jax.random.key(4), (32, 8))
    f = jaxmp.autocast(mlp, "mixed_bfloat16", fp8=jaxmp.MXFP8BlockScaling())
    tx = jaxmp.mixed_precision(optax.adam(1e-2), "mixed_bfloat16")
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        loss_fn = lambda p: jnp.mean((f(p, x) - y) ** 2)  # noqa: E731
        loss, grads = jaxmp.value_and_grad(loss_fn)(jaxmp.get_loss_scale(opt_state), params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(10):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert int(jaxmp.loss_scale_metrics(opt_state)["skipped_steps"]) == 0


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda d: d.name)
def test_mx_block_maxima_never_saturate(fmt):
    # Block maxima with every mantissa: floor(log2(amax)) - emax would clip those above
    # 1.75 * 2**k to fp8_max; the exponent is rounded up instead, as Transformer Engine does.
    rng = np.random.default_rng(5)
    maxima = np.exp2(rng.uniform(-20, 20, 64)).astype(np.float32)
    x = (rng.uniform(-0.5, 0.5, (64, 32)) * maxima[:, None]).astype(np.float32)
    x[:, 0] = maxima
    q, scale_inv = jax.jit(
        lambda x: fp8_scaling.quantize_blocks(x[None], fmt, 32, power_of_two=True)
    )(jnp.asarray(x))
    dequantized = np.asarray(q[0, :, 0, :], np.float32) * np.asarray(scale_inv[0])
    # The block's maximum is within the format's rounding of its value, never clipped.
    unit = (
        float(
            ml_dtypes.finfo(ml_dtypes.float8_e4m3fn if fmt == E4M3 else ml_dtypes.float8_e5m2).eps
        )
        / 2
    )
    rel = np.abs(dequantized[:, 0] - maxima) / maxima
    assert rel.max() <= unit, rel.max()
    assert np.all(np.abs(q[0, :, 0, 0].astype(np.float32)) <= np_max(fmt))
    # The shared scale is a power of two stored exactly as E8M0.
    mantissa, _ = np.frexp(np.asarray(scale_inv))
    np.testing.assert_array_equal(mantissa, 0.5)


def test_mx_exponent_is_the_smallest_that_holds_the_block_maximum():
    amax = jnp.asarray([448.0, 448.5, 449.0, 896.0, 1.0, 1.8, 2.0**-120, 0.0], jnp.float32)
    exponent = np.asarray(jax.jit(lambda a: fp8_scaling.mx_exponent(a, E4M3))(amax))
    for a, e in zip(np.asarray(amax), exponent, strict=True):
        if a == 0:
            continue
        assert a / 2.0**e <= 448.0  # never saturates
        assert a / 2.0 ** (e - 1) > 448.0 or e == -126  # the smallest such exponent
    assert exponent[-1] == 0  # an all-zero block: scale 1, exact


# --- 3. A delayed state used twice, or under vmap ---------------------------------------------


def _delayed():
    params = mlp_params()
    f = jaxmp.autocast(mlp, "mixed_bfloat16", fp8=jaxmp.DelayedScaling(history_len=4))
    x = jax.random.normal(jax.random.key(6), (16, 32)) * jnp.linspace(0.1, 4.0, 16)[:, None]
    return f, params, x, f.fp8_init(params, x[:1])


def test_a_delayed_state_used_twice_in_one_differentiated_call_is_refused():
    f, params, x, state = _delayed()

    def loss(params, state):
        a = f.with_fp8_state(state)(params, x[:8])
        b = f.with_fp8_state(state)(params, x[8:])
        return jnp.sum(a) + jnp.sum(b)

    with pytest.raises(ValueError, match="used twice"):
        jax.grad(loss, (0, 1))(params, state)
    # Used twice without differentiating it (an evaluation of two batches) is fine.
    jax.jit(lambda p, s: (f.with_fp8_state(s)(p, x[:8]), f.with_fp8_state(s)(p, x[8:])))(
        params, state
    )
    # And once per differentiated call, twice in one program (two losses), too.
    jax.jit(
        lambda p, s: (
            jax.grad(loss_once, (0, 1))(p, s, f, x),
            jax.grad(loss_once, (0, 1))(p, s, f, x),
        )
    )(params, state)


def test_a_delayed_state_in_both_branches_of_a_cond_is_refused_as_documented():
    # Only one branch runs, but the check runs while both are traced: the guide and the error
    # say so and tell the user to call the model outside the `cond`.
    f, params, x, state = _delayed()

    def loss(params, state, pred):
        g = f.with_fp8_state(state)
        return jnp.sum(lax.cond(pred, lambda: g(params, x), lambda: g(params, 2 * x)))

    with pytest.raises(ValueError, match="both branches of one `lax.cond`"):
        jax.grad(loss, (0, 1))(params, state, True)


def loss_once(params, state, f, x):
    return jnp.sum(f.with_fp8_state(state)(params, x))


def test_a_delayed_state_under_vmap_is_the_state_of_the_whole_batch():
    f, params, x, state = _delayed()

    def per_example(params, state, x):
        return jnp.sum(f.with_fp8_state(state)(params, x[None]))

    def batched_loss(params, state):
        return jnp.sum(jax.vmap(per_example, (None, None, 0))(params, state, x))

    _, vmapped = jax.jit(jax.grad(batched_loss, (0, 1)))(params, state)
    _, whole = jax.jit(jax.grad(lambda p, s: loss_once(p, s, f, x), (0, 1)))(params, state)
    for key in state.amax_history:
        np.testing.assert_array_equal(vmapped.amax_history[key], whole.amax_history[key])
        np.testing.assert_array_equal(vmapped.scale[key], whole.scale[key])


def test_linen_loss_running_the_model_twice_is_refused():
    model = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(4)])
    x = jax.random.normal(jax.random.key(0), (8, 16))
    apply = jaxmp.linen.fp8_apply(model.apply, "mixed_bfloat16", jaxmp.DelayedScaling())
    variables = apply.init(model.init(jax.random.key(1), x), x)

    def loss_fn(v):
        return jnp.sum(apply(v, x)) + jnp.sum(apply(v, 2 * x))

    with pytest.raises(ValueError, match="used twice"):
        jax.grad(loss_fn)(variables)


# --- 4. A state made for another program ------------------------------------------------------


def test_a_state_made_for_another_program_is_refused():
    class Two(nn.Module):
        swap: bool = False

        @nn.compact
        def __call__(self, x):
            a, b = nn.Dense(32, name="a"), nn.Dense(32, name="b")
            if self.swap:
                a, b = b, a
            return b(nn.relu(a(x)))

    x = jnp.ones((4, 32))
    recipe = jaxmp.DelayedScaling(history_len=2)
    variables = Two().init(jax.random.key(0), x)
    state = jaxmp.linen.fp8_apply(Two().apply, "mixed_bfloat16", recipe).init(variables, x)
    swapped = jaxmp.linen.fp8_apply(Two(swap=True).apply, "mixed_bfloat16", recipe)
    with pytest.raises(ValueError, match=r"'Two/b'.*'Two/a'|made for another program"):
        swapped(state, x)
    # A state with entries this program does not have is refused too.
    one = jaxmp.autocast(lambda w, x: x @ w, "mixed_bfloat16", fp8=recipe)
    two = jaxmp.autocast(lambda w, x: (x @ w) @ w, "mixed_bfloat16", fp8=recipe)
    w = jnp.ones((32, 32))
    with pytest.raises(ValueError, match="'s1'"):
        one.with_fp8_state(two.fp8_init(w, x))(w, x)


# --- 6. Higher derivatives ----------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ALL, ids=ALL_IDS)
def test_differentiating_the_backward_pass_is_a_clear_error(recipe):
    params = mlp_params()
    x = jax.random.normal(jax.random.key(7), (4, 32))
    f = jaxmp.autocast(mlp, "float32", fp8=recipe)
    state = init_state(f, params, x)
    loss = lambda p: jnp.sum(call(f, state)(p, x) ** 2)  # noqa: E731
    with pytest.raises(NotImplementedError, match="FP8 matmul"):
        jax.hessian(loss)(params)
    with pytest.raises(NotImplementedError, match="FP8 matmul"):
        jax.jvp(jax.grad(loss), (params,), (params,))


# --- 7. fp8_exclude patterns and matmul names ---------------------------------------------------


def test_an_exclude_pattern_that_matches_nothing_names_the_matmuls():
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, name="head")(nn.relu(nn.Dense(16, name="fc")(x)))

    x = jnp.ones((2, 8))
    variables = MLP().init(jax.random.key(0), x)
    f = jaxmp.linen.fp8_apply(
        MLP().apply, "mixed_bfloat16", jaxmp.Float8CurrentScaling(), exclude="head"
    )
    with pytest.raises(ValueError, match="'head' matches no matmul") as error:
        f(variables, x)
    message = str(error.value)
    assert "'MLP/fc', 'MLP/head'" in message  # the names there are
    assert "'.*/head' matches 'MLP/head'" in message  # and the fix
    f = jaxmp.linen.fp8_apply(
        MLP().apply, "mixed_bfloat16", jaxmp.Float8CurrentScaling(), exclude=".*/haed"
    )
    with pytest.raises(ValueError, match=r"'\.\*/haed' matches no matmul"):
        f(variables, x)
    ok = jaxmp.linen.fp8_apply(
        MLP().apply, "mixed_bfloat16", jaxmp.Float8CurrentScaling(), exclude=".*/head"
    )
    assert ok(variables, x).shape == (2, 4)


def test_every_matmul_is_listed_with_its_name_for_every_recipe():
    def model(params, x):
        with jax.named_scope("body"):
            h = jax.nn.relu(x @ params["w1"])
        with jax.named_scope("head"):
            return h @ params["w2"]

    params, x = mlp_params(), jnp.ones((4, 32))
    for recipe in ALL:
        f = jaxmp.autocast(model, "mixed_bfloat16", fp8=recipe, fp8_exclude="head")
        matmuls = f.fp8_matmuls(params, x)
        assert [(m.name, m.fp8) for m in matmuls] == [("body", True), ("head", False)]
        assert matmuls[1].reason == "excluded by 'head'"


def test_nnx_layers_are_addressable_by_path():
    x = jnp.ones((4, 16))
    inner = nnx.Sequential(
        nnx.Linear(16, 32, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(32, 4, rngs=nnx.Rngs(1))
    )
    model = jaxmp.nnx.Float8(inner, "mixed_bfloat16", jaxmp.Float8CurrentScaling())
    names = [m.name for m in model.autocast.fp8_matmuls(inner, x)]
    assert names == ["Sequential/0", "Sequential/2"]
    excluded = jaxmp.nnx.Float8(
        inner, "mixed_bfloat16", jaxmp.Float8CurrentScaling(), exclude=".*/2"
    )
    assert [m.fp8 for m in excluded.autocast.fp8_matmuls(inner, x)] == [True, False]
    assert excluded(x).shape == (4, 4)
    _, report = jaxmp.inspect(lambda m, x: m(x), "mixed_bfloat16")(inner, x)
    inspected = {row.module for row in report.find("dot_general")}
    assert set(names) <= inspected, inspected


# --- 8. The delayed state and the loss scale ------------------------------------------------


def test_the_loss_scale_reaches_the_gradient_amax_and_never_the_state_itself():
    # jaxmp.value_and_grad multiplies the loss by the loss scale: the gradient the backward
    # GEMMs quantise is the scaled one, so its recorded amax is scaled too (what E5M2 holds
    # must fit); the operands' amaxes are not, and the state's "gradient" is its next value,
    # never multiplied or divided by the loss scale.
    f, params, x, state = _delayed()
    x = x[:4]

    def loss_fn(params, state):
        return jnp.mean(f.with_fp8_state(state)(params, x) ** 2)

    def next_state(scale):
        grad = jaxmp.value_and_grad(loss_fn, argnums=(0, 1))
        return jax.jit(grad)(jaxmp.StaticLossScale(scale), params, state)[1][1]

    one, big = next_state(1.0), next_state(2.0**10)
    for key in state.amax_history:
        h1, h2 = one.amax_history[key], big.amax_history[key]
        np.testing.assert_array_equal(h1[fp8.ROLE_LHS], h2[fp8.ROLE_LHS])
        np.testing.assert_array_equal(h1[fp8.ROLE_RHS], h2[fp8.ROLE_RHS])
        np.testing.assert_array_equal(h2[fp8.ROLE_GRAD, -1], h1[fp8.ROLE_GRAD, -1] * 2.0**10)
        np.testing.assert_array_equal(
            big.scale[key][fp8.ROLE_GRAD], one.scale[key][fp8.ROLE_GRAD] / 2.0**10
        )
        np.testing.assert_array_equal(
            big.scale[key][: fp8.ROLE_GRAD], one.scale[key][: fp8.ROLE_GRAD]
        )


# --- The size gate ------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe_type", [type(r) for r in ALL], ids=ALL_IDS)
def test_matmuls_below_min_size_stay_in_the_compute_dtype(recipe_type):
    params, x = mlp_params(d_in=32, d_hidden=64, d_out=8), jnp.ones((16, 32))
    # (16 x 32) @ (32 x 64): smallest size 16; (16 x 64) @ (64 x 8): smallest size 8.
    f = jaxmp.autocast(mlp, "mixed_bfloat16", fp8=recipe_type(min_size=12))
    matmuls = f.fp8_matmuls(params, x)
    assert [m.fp8 for m in matmuls] == [True, False]
    assert matmuls[1].reason == "smaller than min_size (8 < 12)"
    everything = jaxmp.autocast(mlp, "mixed_bfloat16", fp8=recipe_type())
    assert [m.fp8 for m in everything.fp8_matmuls(params, x)] == [True, True]
    with pytest.raises(ValueError, match=r"`min_size` must be an integer >= 0, got -1"):
        recipe_type(min_size=-1)
