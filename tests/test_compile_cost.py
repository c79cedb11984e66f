"""Compile-cost regressions as the leaf count grows: deterministic counts, never times.

XLA:CPU's compile time grows with the number of instructions of the program it compiles
(fused computations included), and a reduction costs several times an elementwise fusion.
What jaxmp adds to an optimizer's update is therefore measured here per leaf, as the
difference between a tree of 16 leaves and one of 64, against plain `optax.adam`'s: HLO
instructions, fusions and reductions of the compiled update, and the operations of the
lowered program. `benchmarks/compile_cost.py` measures the times (BENCHMARKS.md).
"""

import collections
import functools
import re

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxmp
from tests.conftest import F16, F32

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="the counts are of XLA:CPU's compiled programs"
)

SHAPE = (8, 40)  # 320 elements: checked row by row, like a model's leaves
SMALL, LARGE = 16, 64
_OPCODE = re.compile(r"= \S+ ([a-z][\w\-]*)\(")
_STABLEHLO_OP = re.compile(r"= (?:\"?)(stablehlo\.[a-z_]+|chlo\.[a-z_]+|call)\b")


def _tree(n, dtype, shape=SHAPE):
    return {f"p{i:04d}": jnp.zeros(shape, dtype) for i in range(n)}


def _lowered_update(tx, n, dtype):
    params = _tree(n, dtype)
    opt_state = jax.eval_shape(tx.init, jax.tree.map(lambda p: p.astype(F32), params))

    def step(grads, opt_state, params):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(step).lower(params, opt_state, params)


def _compiled_ops(lowered):
    return collections.Counter(_OPCODE.findall(lowered.compile().as_text()))


def _per_leaf(counts_small, counts_large, key=None):
    """Growth per leaf between the two trees, of one opcode or (key None) of all of them."""

    def total(c):
        return c[key] if key is not None else sum(c.values())

    return (total(counts_large) - total(counts_small)) / (LARGE - SMALL)


UPDATES = {
    "optax.adam": (lambda: optax.adam(1e-3), F32),
    "loss_scaling(adam)": (lambda: jaxmp.loss_scaling(optax.adam(1e-3)), F32),
    "mixed_precision(adam, 'p=f16,c=f16')": (
        lambda: jaxmp.mixed_precision(optax.adam(1e-3), "p=f16,c=f16"),
        F16,
    ),
}


@pytest.fixture(scope="module")
def counts():
    """Per update: (lowered operation counts, compiled opcode counts) at `SMALL` and `LARGE`
    leaves, each program lowered and compiled once for the module."""
    out = {}
    for name, (make, dtype) in UPDATES.items():
        lowered = [_lowered_update(make(), n, dtype) for n in (SMALL, LARGE)]
        out[name] = (
            tuple(collections.Counter(_STABLEHLO_OP.findall(lo.as_text())) for lo in lowered),
            tuple(_compiled_ops(lo) for lo in lowered),
        )
    return out


def test_update_instructions_per_leaf_grow_like_optax(counts):
    compiled_counts = {name: c[1] for name, c in counts.items()}
    # Per leaf, plain Adam compiles to 47 instructions (three fusions); loss scaling adds the
    # unscale and the skip selects inside each (74, 1.58x); float16 params with an FP32
    # master copy add the master step and the update in the param's dtype (110, 2.34x).
    # Before the finiteness check was grouped these were 88 and 149 (1.9x and 3.2x), and
    # the 2,000-leaf update compiled 3.7x slower than Adam's.
    adam = _per_leaf(*compiled_counts["optax.adam"])
    assert _per_leaf(*compiled_counts["loss_scaling(adam)"]) <= 1.65 * adam
    assert _per_leaf(*compiled_counts["mixed_precision(adam, 'p=f16,c=f16')"]) <= 2.45 * adam


def test_update_fusions_and_reductions_per_leaf(counts):
    compiled_counts = {name: c[1] for name, c in counts.items()}
    adam = compiled_counts["optax.adam"]
    scaled = compiled_counts["loss_scaling(adam)"]
    mixed = compiled_counts["mixed_precision(adam, 'p=f16,c=f16')"]
    # The same three fusions per leaf as Adam (the selects are fused into them), plus one
    # finiteness fusion per 32 leaves of a shape; the master copy adds one.
    assert _per_leaf(*scaled, "fusion") <= _per_leaf(*adam, "fusion") + 1 / 32
    assert _per_leaf(*mixed, "fusion") <= _per_leaf(*adam, "fusion") + 1 + 1 / 32
    # Two reductions (rows, then the row flags) per 32 leaves, not per leaf.
    assert _per_leaf(*scaled, "reduce") <= 2 / 32
    assert _per_leaf(*mixed, "reduce") <= 2 / 32


def test_lowered_operations_per_leaf_grow_like_optax(counts):
    # What tracing emits, before XLA: the unscale, four selects and the finiteness mask
    # per leaf (38 operations against Adam's 31), each broadcast shared by all the leaves
    # of a shape; with the master copy, 68.
    adam = _per_leaf(*counts["optax.adam"][0])
    assert _per_leaf(*counts["loss_scaling(adam)"][0]) <= 1.35 * adam
    assert _per_leaf(*counts["mixed_precision(adam, 'p=f16,c=f16')"][0]) <= 2.4 * adam


@pytest.mark.parametrize(
    "shapes", [[SHAPE], [SHAPE, (40, 8), (320,), (3, 7)], [()]], ids=["one", "mixed", "scalars"]
)
def test_all_finite_reduces_once_per_32_leaves_of_a_shape(shapes):
    tree = [jnp.zeros(shapes[i % len(shapes)], F32) for i in range(LARGE)]
    reductions = _compiled_ops(jax.jit(jaxmp.all_finite).lower(tree))["reduce"]
    # At most two reductions (rows, then their flags) per group of up to 32 leaves of one
    # shape, not one per leaf (before: 2 per leaf of more than 32 elements, 1 per smaller).
    chunks = len(shapes) * -(-LARGE // len(shapes) // 32)
    assert reductions <= 2 * chunks


def test_inner_update_is_traced_once():
    """The select-at-source update traces `inner` once per trace of the step, and the step
    is traced once over steps that skip and steps that do not."""
    traces = {"inner": 0, "step": 0}
    adam = optax.adam(1e-3)

    def counted_update(updates, state, params=None):
        traces["inner"] += 1
        return adam.update(updates, state, params)

    inner = optax.GradientTransformation(adam.init, counted_update)
    tx = jaxmp.mixed_precision(inner, "p=f16,c=f16")
    params = _tree(SMALL, F16)
    opt_state = tx.init(jax.tree.map(lambda p: p.astype(F32), params))

    @jax.jit
    def step(grads, opt_state, params):
        traces["step"] += 1
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for value in (1.0, jnp.inf, 1.0):
        grads = jax.tree.map(functools.partial(jnp.full_like, fill_value=value), params)
        params, opt_state = step(grads, opt_state, params)
    assert traces == {"inner": 1, "step": 1}
    assert int(jaxmp.loss_scale_metrics(opt_state)["skipped_steps"]) == 1


def test_select_at_source_copies_the_inner_update_instead_of_binding_it_again(monkeypatch):
    """Under jit, the traced inner update is copied into the step's trace with the selects
    among its equations; binding every equation again would trace the update a second time
    (it did: the lowering of `loss_scaling(adam)` took twice Adam's). The program is the one
    the equation-by-equation path (kept for vmap and shard_map) builds."""
    from jaxmp._src import compat

    tx = jaxmp.loss_scaling(optax.adam(1e-3))
    params = _tree(SMALL, F32)
    opt_state = tx.init(params)

    def step(grads, opt_state, params):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    binds = []
    bind = compat.bind
    monkeypatch.setattr(compat, "bind", lambda *a, **k: binds.append(1) or bind(*a, **k))
    copied = jax.jit(lambda *a: step(*a)).lower(params, opt_state, params)
    assert binds == []
    monkeypatch.setattr(compat, "inline_with_selects", lambda *a, **k: None)
    rebound = jax.jit(lambda *a: step(*a)).lower(params, opt_state, params)
    assert len(binds) > 10 * SMALL
    ops = [collections.Counter(_STABLEHLO_OP.findall(lo.as_text())) for lo in (copied, rebound)]
    assert ops[0] == ops[1]
    costs = [lo.compile().cost_analysis() for lo in (copied, rebound)]
    costs = [c[0] if isinstance(c, list) else c for c in costs]
    assert costs[0]["bytes accessed"] == costs[1]["bytes accessed"]
    grads = jax.tree.map(lambda p: p + 0.5, params)
    grads["p0003"] = grads["p0003"].at[1, 2].set(jnp.inf)
    for args in ((params, opt_state, params), (grads, opt_state, params)):
        out = [lo.compile()(*args) for lo in (copied, rebound)]
        assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), *out))
