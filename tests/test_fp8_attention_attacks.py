"""Attacks on FP8 and autocast's fused attention, across the two features and their edges.

Every test here failed against the first version of the features, except the last section's
(both features against the library's own guarantees, which held); each states the promise it
holds the code to.

FP8 (`jaxmp._src.fp8*`):

* A finite operand in the top of the compute dtype's range (float16 values above about 63,500)
  is rounded up by the per-tensor quantisation, and dequantising it in the compute dtype
  overflows: the FP8 product is inf where the plain product is finite, forward, backward and
  for convolutions. Loss scaling then skips steps that would not overflow without FP8.
* `fp8_matmuls` leaves out the matmuls of a ``custom_vjp`` function and those of an attention
  that autocast dispatched. An `fp8_exclude` pattern naming those matmuls, or naming a matmul in
  a `jaxmp.float32_region`, is rejected as matching nothing.
* A delayed-scaling state from a ``scan`` of another length fails with JAX's scan error, which
  does not say that the state is at fault.

Fused attention (`jaxmp._src.attention`, `jaxmp.linen`):

* Nested autocast crashes whenever ``flax.linen`` is imported. With Linen attention inside, the
  nested trace recurses until Python's recursion limit.
* When two threads trace autocast functions at the same time, ``jax.nn.dot_product_attention``
  stays patched and Flax Linen's attention is left broken (a NameError on every later call).
* A bias built from a large negative constant (``-1e9``, ``finfo(float32).min``) is cast to the
  compute dtype and becomes ``-inf``. A fully masked row is then NaN, in its output and in every
  gradient. The op-by-op path gives float32's answer, as the autocast guide promises.
* Masks and biases that Linen accepts crash once they are dispatched: a mask or bias of shape
  ``(T, S)``, and a rank-5 call whose mask broadcasts over a batch dimension. A float mask's
  small nonzero entries are rounded to zero, which masks those positions out.
* Attention inside a ``jax.jit`` whose trace is already cached, or bound by ``from jax.nn
  import dot_product_attention``, is not dispatched. The guide promises the fused path there
  and does not mention either limit.
"""

from __future__ import annotations

import threading
from pathlib import Path

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.nn import dot_product_attention as bound_attention

import jaxmp
import jaxmp.linen  # noqa: F401 (registers Linen's attention marking)
from tests.conftest import TOLERANCE
from tests.test_attention import dispatched, qkv, rel_err

F16, BF16 = jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)
B, T, N, H = 2, 16, 4, 32


@pytest.fixture(autouse=True)
def restore_jax_and_flax():
    """Undoes what a failing attack leaves patched, so the other tests see clean libraries."""
    target = nn.attention.dot_product_attention
    jax_attention, code = jax.nn.dot_product_attention, target.__code__
    yield
    jax.nn.dot_product_attention = jax_attention
    target.__code__ = code
    target.__globals__.pop("_jaxmp_attention_hook", None)
    target.__dict__.pop("__signature__", None)


def matmul(x, w):
    return x @ w


# --- FP8: finite operands near the compute dtype's maximum --------------------------------------


def _warm_delayed_state(f, x, w):
    """The state after one step, so that its scales are those of these operands."""
    state = f.fp8_init(x, w)
    _, state = jax.jit(
        jax.grad(lambda x, s: jnp.sum(f.with_fp8_state(s)(x, w).astype(jnp.float32)), (0, 1))
    )(x, state)
    return state


@pytest.mark.parametrize(
    "recipe", [jaxmp.Float8CurrentScaling(), jaxmp.DelayedScaling(history_len=4)],
    ids=["current", "delayed"],
)  # fmt: skip
@pytest.mark.parametrize(
    "policy, big",
    [
        ("mixed_float16", 65000.0),  # float16's largest value is 65504
        ("mixed_bfloat16", float(jnp.finfo(jnp.bfloat16).max)),
    ],
)
def test_fp8_a_finite_operand_near_the_compute_maximum_gives_a_finite_product(recipe, policy, big):
    # The plain product is finite, about 63.5. The per-tensor scale maps 65000 into E4M3's top
    # binade, where it rounds up to 256 * 2**8 = 65536, and dequantising that in float16 gives
    # inf. The promise is non-finite FP8 products exactly where the plain product is non-finite.
    x = jnp.full((4, 8), 0.5, jnp.float32).at[1, 3].set(big)
    w = jnp.full((8, 4), 1.0 / 1024 if policy == "mixed_float16" else 2.0**-100, jnp.float32)
    f = jaxmp.autocast(matmul, policy, fp8=recipe)
    plain = jax.jit(jaxmp.autocast(matmul, policy))(x, w)
    if recipe.stateful:
        out = jax.jit(f.with_fp8_state(_warm_delayed_state(f, x, w)))(x, w)
    else:
        out = jax.jit(f)(x, w)
    assert np.all(np.isfinite(plain))
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(plain))


def test_fp8_a_finite_float16_gradient_near_the_maximum_gives_finite_operand_gradients():
    # The incoming gradient 65000 is finite in float16. E5M2 with a power-of-two scale rounds it
    # to 32768 * 2 = 65536, so the dequantised gradient overflows.
    f = jaxmp.autocast(matmul, "mixed_float16", fp8=jaxmp.Float8CurrentScaling())
    plain = jaxmp.autocast(matmul, "mixed_float16")
    x = jnp.full((4, 8), 1.0 / 1024)
    w = jnp.full((8, 4), 1.0 / 1024)
    c = jnp.zeros((4, 4)).at[0, 0].set(65000.0)

    def grads(fn):
        return jax.jit(jax.grad(lambda x, w: jnp.sum(fn(x, w) * c), (0, 1)))(x, w)

    for got, want in zip(grads(f), grads(plain), strict=True):
        assert np.all(np.isfinite(want))
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))


def test_fp8_a_convolution_of_a_finite_float16_operand_near_the_maximum_is_finite():
    def conv(x, k):
        return lax.conv_general_dilated(x, k, (1, 1), "SAME")

    x = jnp.full((1, 1, 4, 4), 0.5).at[0, 0, 1, 1].set(65000.0)
    k = jnp.full((1, 1, 1, 1), 1.0 / 1024)
    plain = jax.jit(jaxmp.autocast(conv, "mixed_float16"))(x, k)
    out = jax.jit(jaxmp.autocast(conv, "mixed_float16", fp8=jaxmp.Float8CurrentScaling()))(x, k)
    assert np.all(np.isfinite(plain))
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(plain))


# --- FP8: listing and excluding matmuls --------------------------------------------------------


def test_fp8_matmuls_lists_the_matmul_of_a_custom_vjp_function():
    # `fp8_matmuls` promises "every matmul of the program". The matmul inside a custom_vjp
    # function is run as traced (not in FP8), and it is not listed at all.
    @jax.custom_vjp
    def layer(x, w):
        return x @ w

    layer.defvjp(lambda x, w: (x @ w, (x, w)), lambda res, g: (g @ res[1].T, res[0].T @ g))

    def model(x, w):
        return layer(x, w) @ w

    x, w = jnp.ones((8, 16)), jnp.ones((16, 16))
    f = jaxmp.autocast(model, "mixed_bfloat16", fp8=jaxmp.Float8CurrentScaling())
    assert len(f.fp8_matmuls(x, w)) == 2


def test_fp8_exclude_naming_a_matmul_in_a_float32_region_is_not_unmatched():
    # The error says the pattern "matches no matmul" and then lists 'head/jaxmp_float32_region',
    # a name the pattern does match.
    def model(x, w):
        h = x @ w
        with jax.named_scope("head"), jaxmp.float32_region():
            return h @ w

    x, w = jnp.ones((8, 16)), jnp.ones((16, 16))
    f = jaxmp.autocast(
        model, "mixed_bfloat16", fp8=jaxmp.Float8CurrentScaling(), fp8_exclude=".*head.*"
    )
    assert jax.jit(f)(x, w).shape == (8, 16)


def _attention_model(q, w):
    h = q @ w
    with jax.named_scope("attn"):
        return jax.nn.dot_product_attention(h, h, h, is_causal=True)


def test_fp8_matmuls_lists_the_products_of_a_dispatched_attention():
    # With fused_attention=False (the behaviour before the feature) the attention's two
    # products are listed and run in FP8. With the default they vanish from the listing.
    q, w = qkv()[0], jnp.eye(H)
    f = jaxmp.autocast(_attention_model, "mixed_bfloat16", fp8=jaxmp.Float8CurrentScaling())
    names = [m.name for m in f.fp8_matmuls(q, w)]
    assert len(names) == 3, names


def test_fp8_exclude_naming_the_attention_products_still_matches_with_fused_attention():
    q, w = qkv()[0], jnp.eye(H)
    excluded = jaxmp.autocast(
        _attention_model, "mixed_bfloat16", fp8=jaxmp.Float8CurrentScaling(),
        fp8_exclude="attn/.*",
    )  # fmt: skip
    assert jax.jit(excluded)(q, w).shape == q.shape  # a ValueError: "matches no matmul"


def test_fp8_a_state_from_a_scan_of_another_length_is_refused_as_such():
    # Cosmetic: JAX's "scan got `length` argument of 8 ..." does not say that the FP8 state
    # was made for another program.
    def layers(ws, x):
        return lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, ws)[0]

    f = jaxmp.autocast(layers, "mixed_bfloat16", fp8=jaxmp.DelayedScaling(history_len=2))
    x, w = jnp.ones((8, 16)), jnp.eye(16)
    state = f.fp8_init(jnp.stack([w] * 4), x)
    with pytest.raises(ValueError, match="FP8 state"):
        f.with_fp8_state(state)(jnp.stack([w] * 8), x)


# --- Attention: tracing leaves jax and flax as they were ---------------------------------------


def test_nested_autocast_runs_when_flax_linen_is_imported():
    # No attention at all: the inner trace re-enters Linen's interceptor, deletes
    # `__signature__`, and the outer one's `del target.__signature__` raises AttributeError.
    x = jnp.ones((4, 4))
    inner = jaxmp.autocast(lambda x: jnp.sin(x @ x), "mixed_bfloat16")
    outer = jaxmp.autocast(lambda x: inner(x) * 2, "mixed_bfloat16")
    assert jax.jit(outer)(x).dtype == jnp.float32


def test_nested_autocast_of_linen_attention_does_not_recurse():
    # The inner interceptor copies the outer one's trampoline as "the original", so the
    # marked body calls the hook again, without end (RecursionError).
    q = qkv()[0]
    inner = jaxmp.autocast(lambda q: nn.dot_product_attention(q, q, q), "mixed_bfloat16")
    outer = jaxmp.autocast(lambda q: inner(q) * 2, "mixed_bfloat16")
    out = jax.jit(outer)(q)
    assert rel_err(out, 2 * nn.dot_product_attention(q, q, q)) <= TOLERANCE[BF16]


def test_concurrent_traces_leave_jax_and_flax_as_they_were():
    original_jax = jax.nn.dot_product_attention
    original_code = nn.attention.dot_product_attention.__code__
    a_inside, b_inside, a_done = threading.Event(), threading.Event(), threading.Event()
    errors = []

    def first(x):  # traced while the second trace starts, returns before it ends
        a_inside.set()
        b_inside.wait(30)
        return x * 2

    def second(x):
        b_inside.set()
        a_done.wait(30)
        return x * 3

    def run_first():
        try:
            jaxmp.autocast(first, "mixed_bfloat16")(jnp.ones(3))
        except Exception as e:  # reported below, not lost in the thread
            errors.append(e)
        finally:
            a_done.set()

    def run_second():
        a_inside.wait(30)
        try:
            jaxmp.autocast(second, "mixed_bfloat16")(jnp.ones(3))
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=run_first), threading.Thread(target=run_second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    q = qkv()[0]
    try:
        linen_after = nn.dot_product_attention(q, q, q).shape
    except NameError as e:  # Linen's code left swapped, its hook gone
        linen_after = e
    left = (
        [repr(e) for e in errors],
        jax.nn.dot_product_attention is original_jax,
        nn.attention.dot_product_attention.__code__ is original_code,
        str(linen_after),
    )
    assert left == ([], True, True, str(q.shape))


# --- Attention: numerics of the dispatched call ------------------------------------------------


def _padding(valid):
    return valid[:, None, :, None] & valid[:, None, None, :]


@pytest.mark.parametrize(
    "policy, negative",
    [("mixed_float16", -1e9), ("mixed_bfloat16", float(jnp.finfo(jnp.float32).min))],
)
def test_a_large_negative_mask_bias_gives_float32_answers_not_nan(policy, negative):
    # The autocast guide: a constant beyond the compute dtype's range "is not cast down to -inf
    # ... a fully masked row gives float32's uniform answer instead of NaN". The dispatched
    # attention casts the bias to the compute dtype: -inf, NaN rows, and NaN gradients even
    # where the loss ignores the padded rows (every step skipped).
    q = qkv()[0]
    valid = jnp.ones((B, T), bool).at[1, -2:].set(False)

    def attend(q, valid):
        bias = jnp.where(_padding(valid), 0.0, negative)
        return jax.nn.dot_product_attention(q, q, q, bias=bias)

    f = jaxmp.autocast(attend, policy)
    out = jax.jit(f)(q, valid)
    assert np.all(np.isfinite(out))
    assert rel_err(out, attend(q, valid)) <= TOLERANCE[jaxmp.get_policy(policy).compute_dtype]

    def loss(q):
        return jnp.sum(jnp.where(valid[:, :, None, None], f(q, valid), 0.0))

    assert np.all(np.isfinite(jax.jit(jax.grad(loss))(q)))


@pytest.mark.parametrize("which", ["mask", "bias"])
def test_linen_attention_with_a_two_dimensional_mask_or_bias_is_dispatched(which):
    # Linen broadcasts a (T, S) mask or bias. The dispatcher broadcasts it to (B, T, S), which
    # jax.nn reads as (N, T, S), so it fails on an assertion inside JAX.
    q, k, v = qkv()
    causal = jnp.tril(jnp.ones((T, T), bool))
    arg = causal if which == "mask" else jnp.where(causal, 0.0, -30.0)

    def attend(q, k, v, arg):
        return nn.dot_product_attention(q, k, v, **{which: arg})

    f = jaxmp.autocast(attend, "mixed_bfloat16")
    assert len(dispatched(f.jaxpr(q, k, v, arg))[0]) == 2
    assert rel_err(jax.jit(f)(q, k, v, arg), attend(q, k, v, arg)) <= TOLERANCE[BF16]


def linen_attention(q, k, v, mask):
    return nn.dot_product_attention(q, k, v, mask=mask)


def test_linen_rank5_attention_with_a_mask_broadcast_over_a_batch_dimension():
    # Linen accepts a (2, 1, N, T, S) mask for (2, 3, T, N, H) operands. The dispatcher reshapes
    # the mask to (2, N, T, S) against a batch of 6 and fails ("incompatible shapes").
    q, k, v = (x.reshape(1, B, T, N, H).repeat(3, axis=0).transpose(1, 0, 2, 3, 4) for x in qkv())
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, 1, N, T, T))

    out = jax.jit(jaxmp.autocast(linen_attention, "mixed_bfloat16"))(q, k, v, mask)
    assert rel_err(out, linen_attention(q, k, v, mask)) <= TOLERANCE[BF16]


def test_linen_float_mask_keeps_its_small_nonzero_entries():
    # Low severity. Linen attends wherever a float mask is nonzero. The dispatcher casts the
    # mask to float16 before comparing it with zero, so 1e-8 becomes 0 and is masked out.
    q, k, v = qkv()
    mask = jnp.broadcast_to(jnp.where(jnp.tril(jnp.ones((T, T), bool)), 1e-8, 0.0), (B, N, T, T))

    out = jax.jit(jaxmp.autocast(linen_attention, "mixed_float16"))(q, k, v, mask)
    assert rel_err(out, linen_attention(q, k, v, mask)) <= TOLERANCE[F16]


# --- Attention: what is dispatched ------------------------------------------------------------


def test_attention_inside_a_jit_traced_before_keeps_that_trace_as_documented():
    # Marks are made while the function is traced: a jit whose trace JAX has cached (an
    # evaluation call before training, say) keeps the float32 attention, re-interpreted op
    # by op (correct, not fused), as the guide says; after `jax.clear_caches()` it is
    # dispatched.
    q, k, v = qkv()

    @jax.jit
    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    reference = attend(q, k, v)
    f = jaxmp.autocast(attend, "mixed_bfloat16")
    assert dispatched(f.jaxpr(q, k, v))[0] == []
    out = jax.jit(f)(q, k, v)
    assert float(jnp.linalg.norm(out - reference) / jnp.linalg.norm(reference)) < 1e-2
    guide = (Path(__file__).parent.parent / "docs" / "guides" / "autocast.md").read_text()
    assert "traced before, outside autocast" in guide
    jax.clear_caches()
    assert len(dispatched(f.jaxpr(q, k, v))[0]) == 2


def test_attention_bound_by_from_import_is_dispatched_or_documented():
    # `from jax.nn import dot_product_attention` binds the function before autocast patches
    # `jax.nn`. Such a call is not dispatched, and the guide's Attention section does not say so.
    q, k, v = qkv()
    f = jaxmp.autocast(lambda q, k, v: bound_attention(q, k, v, is_causal=True), "mixed_bfloat16")
    guide = (Path(__file__).parent.parent / "docs" / "guides" / "autocast.md").read_text()
    assert len(dispatched(f.jaxpr(q, k, v))[0]) == 2 or "from jax.nn import" in guide


# --- Both features against the library's guarantees --------------------------------------------
# A step whose gradients or loss are not finite changes nothing but the loss-scaling state;
# with `check_outputs=True` neither does a step whose own update overflows on finite gradients;
# params keep their dtype. The model's matmuls run in FP8 and its attention is dispatched.


def attention_model(params, x):
    b, t, _ = x.shape
    q, k, v = (x @ params[name] for name in ("wq", "wk", "wv"))
    heads = [y.reshape(b, t, 2, 8) for y in (q, k, v)]
    return jax.nn.dot_product_attention(*heads, is_causal=True).reshape(b, t, 16) @ params["wo"]


def attention_params(dtype):
    keys = jax.random.split(jax.random.key(5), 4)
    return {
        name: (jax.random.normal(key, (16, 16)) / 4).astype(dtype)
        for name, key in zip(("wq", "wk", "wv", "wo"), keys, strict=True)
    }


def _train_step(policy, params_dtype, fp8, tx):
    f = jaxmp.autocast(attention_model, policy, fp8=fp8)
    x = jnp.ones((2, 8, 16))
    inside, _ = dispatched(jax.make_jaxpr(f)(attention_params(params_dtype), x))
    assert inside  # the attention's products run on the dispatched path

    @jax.jit
    def step(params, opt_state, x, scale):
        loss_fn = lambda p, x: jnp.mean(f(p, x).astype(jnp.float32) ** 2) * scale  # noqa: E731
        loss, grads = jaxmp.value_and_grad(loss_fn)(jaxmp.get_loss_scale(opt_state), params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


@pytest.mark.parametrize(
    "fp8", [None, jaxmp.Float8CurrentScaling(), jaxmp.MXFP8BlockScaling()],
    ids=["attention", "attention-fp8-current", "attention-mxfp8"],
)  # fmt: skip
def test_an_overflowing_step_through_fp8_and_fused_attention_is_skipped(fp8):
    tx = jaxmp.mixed_precision(optax.adam(1e-2), "mixed_float16")
    params = attention_params(jnp.float32)
    opt_state = tx.init(params)
    step = _train_step("mixed_float16", jnp.float32, fp8, tx)
    x = jax.random.normal(jax.random.key(6), (2, 8, 16))
    # 1e5 is inf in float16: the loss is not finite, the step is skipped.
    new_params, new_state, loss = step(params, opt_state, x.at[1, 3, 5].set(1e5), 1.0)
    assert not np.isfinite(float(loss))
    metrics = jaxmp.loss_scale_metrics(new_state)
    assert not bool(metrics["grads_finite"]) and int(metrics["skipped_steps"]) == 1
    chex.assert_trees_all_equal(new_params, params)
    chex.assert_trees_all_equal(jaxmp.inner_state(new_state), jaxmp.inner_state(opt_state))
    # A finite step moves every param, each keeping its dtype.
    new_params, _, loss = step(params, opt_state, x, 1.0)
    assert np.isfinite(float(loss))
    for old, new in zip(jax.tree.leaves(params), jax.tree.leaves(new_params), strict=True):
        assert new.dtype == old.dtype and not np.array_equal(new, old)


@pytest.mark.parametrize(
    "fp8", [None, jaxmp.Float8CurrentScaling()], ids=["attention", "attention-fp8-current"]
)
def test_check_outputs_skips_an_fp8_attention_step_whose_update_overflows(fp8):
    # bfloat16 params without a master copy: a loss scaled by 1e24 gives finite bfloat16 gradients,
    # whose square (Adam's second moment) is inf in float32.
    tx = jaxmp.mixed_precision(optax.adam(1e-2), "bf16", master_weights=False, check_outputs=True)
    params = attention_params(BF16)
    opt_state = tx.init(params)
    step = _train_step("bf16", BF16, fp8, tx)
    x = jax.random.normal(jax.random.key(6), (2, 8, 16))
    params, opt_state, _ = step(params, opt_state, x, 1.0)
    assert int(jaxmp.loss_scale_metrics(opt_state)["skipped_steps"]) == 0
    new_params, new_state, loss = step(params, opt_state, x, 1e24)
    assert np.isfinite(float(loss))
    assert int(new_state.skipped_steps) == 1 and not bool(new_state.grads_finite)
    chex.assert_trees_all_equal(new_params, params)
    chex.assert_trees_all_equal(new_state.inner_state, opt_state.inner_state)
    assert all(p.dtype == BF16 for p in jax.tree.leaves(new_params))
    assert bool(jaxmp.all_finite((new_params, jaxmp.inner_state(new_state))))


# --- Attention: the options as users write them -------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"scale": 1 / np.sqrt(H)},  # np.float64: its repr is not a Python literal
        {"scale": np.float32(0.25)},
        {"is_causal": np.bool_(True)},
        {"return_residual": False},
    ],
    ids=["np-float64-scale", "np-float32-scale", "np-bool", "return-residual-false"],
)
def test_numpy_scalar_options_and_explicit_defaults_are_dispatched(options):
    q, k, v = qkv()

    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, **options)

    f = jaxmp.autocast(attend, "mixed_bfloat16")
    inside, _ = dispatched(jax.make_jaxpr(f)(q, k, v))
    assert inside  # marked and dispatched, not left to the op-by-op path
    assert rel_err(jax.jit(f)(q, k, v), attend(q, k, v)) <= TOLERANCE[BF16]
