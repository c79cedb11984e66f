"""Every optax combinator and wrapper, inside `loss_scaling` and `mixed_precision`, attacked.

The promise (README, "Composition"; `loss_scaling` docstring): transformations inside
`loss_scaling` see unscaled float32 gradients, so a wrapped combinator computes what plain optax
computes on those gradients; a non-finite step returns zero updates, keeps the inner state
bit-identical and backs off the loss scale; the state is stable in structure and dtype, so a
jitted step traces once. One harness runs each combinator of optax 0.2.5 to 0.2.8 through
``jaxmp.loss_scaling(comb)`` (float32 params) and ``jaxmp.mixed_precision(comb, "p=f16,c=f16")``
(float16 params, FP32 master weights), under `jax.jit`, against plain optax on the float32
gradients. The last sections put combinators *around* `loss_scaling`, where that is meaningful.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest

import jaxmp
from tests.conftest import F16, F32, HALF_DTYPES, assert_close

# --- the combinators --------------------------------------------------------------------

LABELS = {"w": "adam", "b": "sgd"}


def _inject_stateful():
    # Deprecated in favour of `inject_hyperparams` (optax 0.2.5 to 0.2.8 warn) but still public.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "inject_stateful_hyperparams", DeprecationWarning)
        factory = optax.inject_stateful_hyperparams(optax.adam)
    return factory(learning_rate=optax.WrappedSchedule(optax.linear_schedule(0.1, 0.01, 4)))


@dataclasses.dataclass(frozen=True)
class Case:
    make: Callable[[], Any]  # a fresh combinator; called once for jaxmp, once for plain optax
    lookahead: bool = False  # params are `optax.LookaheadParams`
    value: bool = False  # the update takes the loss as ``value=``


COMBINATORS = {
    "chain(clip_by_global_norm, adam)": Case(
        lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(0.1))
    ),
    "named_chain": Case(
        lambda: optax.named_chain(("clip", optax.clip(0.25)), ("sgd", optax.sgd(0.1, 0.9)))
    ),
    "multi_transform": Case(
        lambda: optax.multi_transform({"adam": optax.adam(0.1), "sgd": optax.sgd(0.1)}, LABELS)
    ),
    "partition": Case(
        lambda: optax.partition(
            {"adam": optax.adam(0.1), "sgd": optax.set_to_zero()}, lambda p: LABELS
        )
    ),
    "masked": Case(lambda: optax.masked(optax.adam(0.1), {"w": True, "b": False})),
    "MultiSteps": Case(lambda: optax.MultiSteps(optax.adam(0.1), every_k_schedule=2)),
    "MultiSteps(skip_not_finite)": Case(
        lambda: optax.MultiSteps(
            optax.adam(0.1), every_k_schedule=2, should_skip_update_fn=optax.skip_not_finite
        )
    ),
    "inject_hyperparams": Case(
        lambda: optax.inject_hyperparams(optax.adam)(
            learning_rate=optax.linear_schedule(0.1, 0.01, 4), b1=0.8
        )
    ),
    "inject_stateful_hyperparams": Case(_inject_stateful),
    "apply_if_finite": Case(lambda: optax.apply_if_finite(optax.adam(0.1), 2)),
    "lookahead": Case(
        lambda: optax.lookahead(optax.adam(0.1), sync_period=2, slow_step_size=0.5),
        lookahead=True,
    ),
    "flatten": Case(lambda: optax.flatten(optax.adam(0.1))),
    "conditionally_mask": Case(
        lambda: optax.conditionally_mask(optax.adam(0.1), lambda step: step % 2 == 0)
    ),
    "conditionally_transform": Case(
        lambda: optax.conditionally_transform(optax.scale(-0.1), lambda step: step >= 1)
    ),
    "chain(adam, apply_every)": Case(lambda: optax.chain(optax.adam(0.1), optax.apply_every(2))),
    "chain(zero_nans, adam)": Case(lambda: optax.chain(optax.zero_nans(), optax.adam(0.1))),
    "with_extra_args_support": Case(lambda: optax.with_extra_args_support(optax.adam(0.1))),
    "reduce_on_plateau": Case(
        lambda: optax.chain(
            optax.adam(0.1), optax.contrib.reduce_on_plateau(patience=1, cooldown=0)
        ),
        value=True,
    ),
    "schedule_free_adamw": Case(lambda: optax.contrib.schedule_free_adamw(0.1, warmup_steps=2)),
    "sam": Case(
        lambda: optax.contrib.sam(
            optax.adam(0.1), optax.chain(optax.contrib.normalize(), optax.sgd(0.05))
        )
    ),
}
WRAPPERS = ("loss_scaling", "mixed_precision")


def _wrap(wrapper: str, inner: Any) -> Any:
    if wrapper == "loss_scaling":
        return jaxmp.loss_scaling(inner, jaxmp.DynamicLossScale(2.0**10))
    return jaxmp.mixed_precision(inner, "p=f16,c=f16")  # DynamicLossScale(2**15)


# --- params and gradients: every value exact in float16, times any power-of-two scale ---------

FULL = {
    "w": jnp.asarray(1.0 + np.arange(40).reshape(5, 8) / 8, F32),  # 40 elements: checked by rows
    "b": jnp.asarray([1.0, -1.5, 2.0, -2.5], F32),
}
# The finite steps' float32 gradients (multiples of 1/16): 3 steps.
GRADS = [
    jax.tree.map(
        lambda p, k=k: jnp.asarray((np.random.default_rng(k).integers(-8, 9, p.shape)) / 16, F32),
        FULL,
    )
    for k in range(3)
]
BAD = (np.inf, -np.inf, np.nan)


def _full(case: Case) -> Any:
    return optax.LookaheadParams.init_synced(FULL) if case.lookahead else FULL


def _fast(params: Any) -> Any:
    return params.fast if isinstance(params, optax.LookaheadParams) else params


def _poison(grads: Any, bad: float) -> Any:
    return {**grads, "w": grads["w"].at[2, 3].set(bad)}


def _step_fn(tx: Any, case: Case, traces: list):
    """One train step on the float32 gradients `grads`, scaled by the state's loss scale."""

    def step(params, state, grads, value):
        traces.append(None)
        scale = jaxmp.get_loss_scale(state).loss_scale
        fast = _fast(params)
        scaled = jax.tree.map(lambda g, p: (g * scale).astype(p.dtype), grads, fast)
        extra = {"value": value} if case.value else {}
        updates, state = tx.update(scaled, state, params, **extra)
        return optax.apply_updates(params, updates), updates, state

    return step


def _make_step(tx: Any, case: Case, traces: list):
    return jax.jit(_step_fn(tx, case, traces))


def _make_reference(tx: Any, case: Case, traces: list | None = None):
    def step(params, state, grads, value):
        if traces is not None:
            traces.append(None)
        extra = {"value": value} if case.value else {}
        updates, state = tx.update(grads, state, params, **extra)
        return optax.apply_updates(params, updates), updates, state

    return jax.jit(step)


def _loss(grads: Any) -> jax.Array:
    # A made-up loss for `value=` that plateaus: reduce_on_plateau sees it change.
    return jnp.asarray(1.0 + float(jnp.abs(grads["b"]).sum()), F32)


def _assert_values(actual: Any, expected: Any) -> None:
    """Same structure and dtypes, float values within the tolerance table's row of their dtype.

    Not bit-exact: XLA contracts a multiply and an add into one fused multiply-add or not
    depending on the surrounding graph, so Adam's moments differ from plain optax's in the
    last bit, although the arithmetic asked for is the same.
    """
    chex.assert_trees_all_equal_structs(actual, expected)
    chex.assert_trees_all_equal_dtypes(actual, expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        if jnp.issubdtype(a.dtype, jnp.floating):
            assert_close(a, e, a.dtype if a.dtype in HALF_DTYPES else F32)
        else:
            np.testing.assert_array_equal(a, e)


@functools.cache
def _reference(name: str) -> tuple[list, int]:
    """Plain optax's ``(params, updates, state)`` after each step on `GRADS`, for both
    wrappers, and how many times plain optax's jitted step was traced."""
    case = COMBINATORS[name]
    plain = case.make()
    traces: list = []
    step = _make_reference(plain, case, traces)
    params = _full(case)
    state, out = plain.init(params), []
    for grads in GRADS:
        params, updates, state = step(params, state, grads, _loss(grads))
        out.append((params, updates, state))
    return out, len(traces)


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("name", list(COMBINATORS))
def test_combinator_inside(name, wrapper):
    case = COMBINATORS[name]
    tx = _wrap(wrapper, case.make())
    full = _full(case)
    params = jaxmp.cast_tree(full, F16 if wrapper == "mixed_precision" else F32)
    state = init = tx.init(full)
    traces: list = []
    step = _make_step(tx, case, traces)

    def check_stable(state):
        chex.assert_trees_all_equal_structs(state, init)
        chex.assert_trees_all_equal_dtypes(state, init)

    def finite_step(params, state, k):
        params, updates, state = step(params, state, GRADS[k], _loss(GRADS[k]))
        ref_params, ref_updates, ref_state = _reference(name)[0][k]
        check_stable(state)
        assert bool(state.grads_finite)
        _assert_values(jaxmp.inner_state(state), ref_state)
        if wrapper == "loss_scaling":
            _assert_values(updates, ref_updates)
            _assert_values(params, ref_params)
        else:
            master = state.inner_state.master
            _assert_values(master, ref_params)
            # The float16 params are the rounded master copy (each step moves a param by
            # less than a factor of 2).
            chex.assert_trees_all_equal(params, jaxmp.cast_tree(master, F16))
        return params, state

    params, state = finite_step(params, state, 0)
    params, state = finite_step(params, state, 1)
    for bad in BAD:
        before = state
        new_params, updates, state = step(params, state, _poison(GRADS[2], bad), _loss(GRADS[2]))
        check_stable(state)
        for leaf in jax.tree.leaves(updates):
            assert not np.any(np.asarray(leaf)), (bad, leaf)
        chex.assert_trees_all_equal(new_params, params)
        chex.assert_trees_all_equal(state.inner_state, before.inner_state)
        assert float(state.loss_scale.loss_scale) == float(before.loss_scale.loss_scale) / 2
        assert int(state.skipped_steps) == int(before.skipped_steps) + 1
        assert not bool(state.grads_finite)
    assert int(state.skipped_steps) == 3
    # The skipped steps left no trace: the next finite step continues plain optax's run.
    finite_step(params, state, 2)
    # No retrace beyond plain optax's own (optax 0.2.5's reduce_on_plateau changes the weak
    # type of its state after the first step and retraces once by itself).
    assert len(traces) == _reference(name)[1]
    if name != "reduce_on_plateau":
        assert len(traces) == 1


# --- scan over steps, vmap over independent runs ------------------------------------------

SCAN_VMAP = ["chain(clip_by_global_norm, adam)", "MultiSteps", "inject_hyperparams"]
# Five steps: finite, NaN, finite, inf, finite; and the same without the poison.
POISONED = [GRADS[0], _poison(GRADS[1], np.nan), GRADS[1], _poison(GRADS[2], np.inf), GRADS[2]]
CLEAN = [GRADS[0], GRADS[1], GRADS[1], GRADS[2], GRADS[2]]


def _stack(trees: list) -> Any:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _unstack(tree: Any, i: int) -> Any:
    return jax.tree.map(lambda x: x[i], tree)


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("name", SCAN_VMAP)
def test_scan_and_vmap(name, wrapper):
    case = COMBINATORS[name]
    tx = _wrap(wrapper, case.make())
    params = jaxmp.cast_tree(FULL, F16 if wrapper == "mixed_precision" else F32)
    state = tx.init(FULL)
    traces: list = []
    fn = _step_fn(tx, case, traces)
    one = jnp.float32(1.0)

    def body(carry, grads):
        p, _, s = fn(*carry, grads, one)
        return (p, s), s.skipped_steps

    scan = jax.jit(lambda p, s, seq: jax.lax.scan(body, (p, s), seq))
    poisoned, skipped = scan(params, state, _stack(POISONED))
    assert skipped.tolist() == [0, 1, 1, 2, 2]
    clean, skipped = scan(params, state, _stack(CLEAN))
    assert skipped.tolist() == [0, 0, 0, 0, 0]
    chex.assert_trees_all_equal_structs(poisoned[1], state)
    chex.assert_trees_all_equal_dtypes(poisoned[1], state)

    # Two independent runs in one batch: run 0 sees clean gradients, run 1 the poisoned ones.
    vstep = jax.jit(jax.vmap(fn))
    batch_params, batch_state = _stack([params, params]), jax.vmap(tx.init)(_stack([FULL, FULL]))
    for c, p in zip(CLEAN, POISONED, strict=True):
        batch_params, _, batch_state = vstep(
            batch_params, batch_state, _stack([c, p]), jnp.stack([one, one])
        )
    assert batch_state.skipped_steps.tolist() == [0, 2]
    assert jaxmp.get_loss_scale(batch_state).loss_scale.tolist() == [
        float(jaxmp.get_loss_scale(clean[1]).loss_scale),
        float(jaxmp.get_loss_scale(poisoned[1]).loss_scale),
    ]
    _assert_values(_unstack((batch_params, batch_state), 0), clean)
    _assert_values(_unstack((batch_params, batch_state), 1), poisoned)
    assert len(traces) == 2  # the scan body and the vmapped step, once each


def test_large_gradients_back_the_scale_off_until_they_fit():
    # True gradients of 300 and 60000 (float16's range ends at 65504) and 1e-30: at any
    # scale above 1 the scaled float16 gradients overflow; each step is skipped and the scale
    # halves until they fit at 1, then the steps apply. Nothing non-finite reaches the params.
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))
    tx = _wrap("mixed_precision", inner)
    grads = {"w": jnp.full((5, 8), 300.0).at[0, 0].set(60000.0), "b": jnp.full(4, 1e-30)}
    fn = _step_fn(tx, Case(lambda: None), [])

    def body(carry, _):
        p, _, s = fn(*carry, grads, jnp.float32(1.0))
        metrics = jaxmp.loss_scale_metrics(s)
        return (p, s), (metrics["loss_scale"], metrics["skipped_steps"], jaxmp.all_finite(p))

    run = jax.jit(lambda p, s: jax.lax.scan(body, (p, s), length=17))
    (params, state), (scales, skipped, finite) = run(jaxmp.cast_tree(FULL, F16), tx.init(FULL))
    assert scales.tolist() == [2.0**k for k in range(14, -1, -1)] + [1.0, 1.0]
    assert skipped.tolist() == list(range(1, 16)) + [15, 15]
    assert bool(finite.all())
    ref = _run(inner, [jaxmp.cast_tree(jaxmp.cast_tree(grads, F16), F32)] * 2, "plain")
    _assert_values(state.inner_state.master, ref[-1][0])


# --- half-precision params without a master copy ----------------------------------------

HALF_PARAM_INNERS = {
    "adam": lambda: optax.adam(0.1),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "chain(adam, apply_every)": lambda: optax.chain(optax.adam(0.1), optax.apply_every(2)),
}


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("name", list(HALF_PARAM_INNERS))
def test_half_params_without_master_weights(name, dtype):
    # The inner optimizer receives float32 gradients; its state is float32 too, whatever
    # the dtype of the params given to `init` (Adam's second moment of a gradient of 1e4
    # would be inf in float16, that of 1e-3 zero). So it runs as plain optax with float32
    # params on the float32 gradients, and its updates are applied to the half-precision
    # params: only their rounding differs.
    tx = jaxmp.loss_scaling(HALF_PARAM_INNERS[name](), jaxmp.DynamicLossScale(2.0**10))
    plain = HALF_PARAM_INNERS[name]()
    params = ref_params = jaxmp.cast_tree(FULL, dtype)
    state, ref_state = tx.init(params), plain.init(FULL)
    chex.assert_trees_all_equal(tx.init(FULL), state)
    traces: list = []
    step = _make_step(tx, Case(lambda: None), traces)
    ref_step = _make_reference(plain, Case(lambda: None))
    for grads in (GRADS[0], _poison(GRADS[1], np.nan), GRADS[1], GRADS[2]):
        params, _, new_state = step(params, state, grads, _loss(grads))
        chex.assert_trees_all_equal_structs(new_state, state)
        chex.assert_trees_all_equal_dtypes(new_state, state)
        chex.assert_trees_all_equal_dtypes(params, ref_params)
        state = new_state
        if bool(state.grads_finite):
            ref_params, _, ref_state = ref_step(ref_params, ref_state, grads, 0.0)
        _assert_values(state.inner_state, ref_state)
        for a, e in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
            assert_close(a, e, dtype)
    assert int(state.skipped_steps) == 1 and len(traces) == 1


# --- combinators around loss_scaling ----------------------------------------------------
# `loss_scaling` must see the gradients first and decide every step. After it, a
# transformation of the updates works; the sections below show what goes wrong with each
# wrapper that sits around it instead (so the advice of docs/reference/semantics.md, put it
# outermost, stays true).


def _run(tx: Any, sequence: list, wrapper: str = "loss_scaling", lookahead: bool = False):
    """Runs the jitted step over float32 gradients; returns each step's (params, updates, state).

    `wrapper` names the params' dtype (float16 for "mixed_precision") and "plain" runs plain
    optax on the unscaled gradients.
    """
    full = optax.LookaheadParams.init_synced(FULL) if lookahead else FULL
    params = jaxmp.cast_tree(full, F16 if wrapper == "mixed_precision" else F32)
    state, out = tx.init(full), []
    make = _make_reference if wrapper == "plain" else functools.partial(_make_step, traces=[])
    step = make(tx, Case(lambda: None))
    for grads in sequence:
        params, updates, state = step(params, state, grads, jnp.float32(1.0))
        out.append((params, updates, state))
    return out


def test_update_transformation_after_loss_scaling():
    # chain(loss_scaling(adam), clip): the clip sees the updates, zero on a skipped step.
    tx = optax.chain(_wrap("loss_scaling", optax.adam(0.1)), optax.clip(0.05))
    out = _run(tx, [GRADS[0], _poison(GRADS[1], np.nan), GRADS[1]])
    ref = _run(optax.chain(optax.adam(0.1), optax.clip(0.05)), GRADS[:2], "plain")
    for (params, updates, _), (ref_params, ref_updates, _) in zip(out[::2], ref, strict=True):
        _assert_values((params, updates), (ref_params, ref_updates))
    (params, _, state), (skipped, updates, skipped_state) = out[0], out[1]
    chex.assert_trees_all_equal(skipped, params)
    assert not any(np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
    chex.assert_trees_all_equal(jaxmp.inner_state(skipped_state), jaxmp.inner_state(state))
    metrics = jaxmp.loss_scale_metrics(skipped_state)
    assert int(metrics["skipped_steps"]) == 1
    assert float(metrics["loss_scale"]) == float(jaxmp.get_loss_scale(state).loss_scale) / 2


def test_update_transformation_after_master_weights_never_reaches_the_master_copy():
    # chain(mixed_precision(adam, "p=f16,c=f16"), clip): the clip changes the float16 params'
    # updates, but the master copy, which every later update is computed from, takes adam's
    # unclipped step: the params fall behind it.
    tx = optax.chain(_wrap("mixed_precision", optax.adam(0.1)), optax.clip(0.05))
    out = _run(tx, GRADS[:2], "mixed_precision")
    ref = _run(optax.adam(0.1), GRADS[:2], "plain")
    for (params, _, state), (ref_params, _, _) in zip(out, ref, strict=True):
        _assert_values(state[0].inner_state.master, ref_params)
        assert not bool(jnp.all(params["b"] == ref_params["b"].astype(F16)))


def test_partition_around_loss_scaling_freezes_the_other_part():
    # A frozen partition next to a trained one: the scaler sees the trained part's gradients.
    labels = {"w": "train", "b": "frozen"}
    tx = optax.partition(
        {"train": _wrap("loss_scaling", optax.adam(0.1)), "frozen": optax.set_to_zero()},
        labels,
    )
    out = _run(tx, [GRADS[0], _poison(GRADS[1], np.nan)])
    plain = optax.partition({"train": optax.adam(0.1), "frozen": optax.set_to_zero()}, labels)
    ref = _run(plain, GRADS[:1], "plain")
    _assert_values(out[0][0], ref[0][0])
    chex.assert_trees_all_equal(out[1][0], out[0][0])
    assert int(jaxmp.loss_scale_metrics(out[1][2])["skipped_steps"]) == 1


def test_transformation_before_loss_scaling_sees_scaled_gradients():
    # chain(clip(1.0), loss_scaling(sgd)): the clip bounds the *scaled* gradients, so the
    # update is 1 / scale, and it turns an inf into 1.0: the step is not skipped.
    tx = optax.chain(optax.clip(1.0), _wrap("loss_scaling", optax.sgd(1.0)))
    out = _run(tx, [GRADS[0], _poison(GRADS[1], np.inf)])
    scale = 2.0**10
    np.testing.assert_array_equal(out[0][1]["b"], -np.clip(GRADS[0]["b"] * scale, -1, 1) / scale)
    assert int(jaxmp.loss_scale_metrics(out[1][2])["skipped_steps"]) == 0
    assert float(out[1][1]["w"][2, 3]) == -1.0 / scale


def test_masked_around_loss_scaling_passes_scaled_gradients_through():
    # optax.masked hands the masked-out leaves' gradients, scaled, back as updates.
    tx = optax.masked(_wrap("loss_scaling", optax.sgd(1.0)), {"w": True, "b": False})
    ((_, updates, _),) = _run(tx, GRADS[:1])
    np.testing.assert_array_equal(updates["b"], GRADS[0]["b"] * 2.0**10)
    np.testing.assert_array_equal(updates["w"], -GRADS[0]["w"])


@pytest.mark.parametrize(
    "outer",
    [
        lambda inner: optax.apply_if_finite(inner, max_consecutive_errors=5),
        lambda inner: optax.MultiSteps(inner, 1, should_skip_update_fn=optax.skip_not_finite),
        lambda inner: optax.conditionally_mask(inner, lambda step: step % 2 == 0),
    ],
    ids=["apply_if_finite", "MultiSteps(skip_not_finite)", "conditionally_mask"],
)
def test_wrappers_around_loss_scaling_hide_overflows_from_the_scaler(outer):
    # Each drops the overflowing step before (or instead of) loss_scaling's decision: the
    # params are safe, but the scale never backs off, so float16 keeps overflowing.
    tx = outer(_wrap("loss_scaling", optax.sgd(1.0)))
    out = _run(tx, [GRADS[0], _poison(GRADS[1], np.inf)])
    chex.assert_trees_all_equal(out[1][0], out[0][0])
    metrics = jaxmp.loss_scale_metrics(out[1][2])
    assert int(metrics["skipped_steps"]) == 0 and float(metrics["loss_scale"]) == 2.0**10


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_multisteps_around_loss_scaling(wrapper):
    # README: the scale changes only every k mini-batches and one overflow discards the
    # accumulation. Worse: optax's accumulator keeps the NaN (0 * NaN), so every later
    # accumulation is skipped too and the scale falls step after step.
    tx = optax.MultiSteps(_wrap(wrapper, optax.sgd(1.0)), every_k_schedule=2)
    sequence = [_poison(GRADS[0], np.nan)] + [GRADS[1]] * 5
    out = _run(tx, sequence, wrapper)
    scales = [float(jaxmp.get_loss_scale(s).loss_scale) for _, _, s in out]
    first = float(jaxmp.get_loss_scale(tx.init(FULL)).loss_scale)
    assert scales == [first, first / 2, first / 2, first / 4, first / 4, first / 8]
    assert [int(jaxmp.loss_scale_metrics(s)["skipped_steps"]) for _, _, s in out] == [
        0,
        1,
        1,
        2,
        2,
        3,
    ]
    params = jaxmp.cast_tree(FULL, F16 if wrapper == "mixed_precision" else F32)
    for p, _, _ in out:
        chex.assert_trees_all_equal(p, params)  # nothing is ever applied again


def test_multisteps_inside_loss_scaling_recovers():
    # The documented nesting: the overflowing mini-batch is dropped, the next ones train.
    tx = _wrap("loss_scaling", optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2))
    out = _run(tx, [_poison(GRADS[0], np.nan)] + [GRADS[1]] * 2)
    assert int(jaxmp.loss_scale_metrics(out[-1][2])["skipped_steps"]) == 1
    _assert_values(out[-1][1], jax.tree.map(lambda g: -g, GRADS[1]))


def test_inject_hyperparams_around_loss_scaling_advances_on_skipped_steps():
    # Its schedule's count lives outside loss_scaling: a skipped step moves the schedule on.
    make = optax.inject_hyperparams(
        lambda learning_rate: _wrap("loss_scaling", optax.sgd(learning_rate))
    )
    tx = make(learning_rate=optax.linear_schedule(1.0, 0.0, 4))
    out = _run(tx, [GRADS[0], _poison(GRADS[1], np.nan), GRADS[1]])
    assert int(jaxmp.loss_scale_metrics(out[1][2])["skipped_steps"]) == 1
    chex.assert_trees_all_equal(out[1][0], out[0][0])
    _assert_values(out[2][1], jax.tree.map(lambda g: -0.5 * g, GRADS[1]))  # lr of step 2


def test_lookahead_around_loss_scaling_syncs_on_skipped_steps():
    # Lookahead's synchronisation step moves the params even when loss_scaling skipped it.
    tx = optax.lookahead(_wrap("loss_scaling", optax.sgd(0.5)), sync_period=2, slow_step_size=0.5)
    out = _run(tx, [GRADS[0], _poison(GRADS[1], np.nan)], lookahead=True)
    assert int(jaxmp.loss_scale_metrics(out[1][2])["skipped_steps"]) == 1
    moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), out[1][0], out[0][0])
    assert any(jax.tree.leaves(moved))
