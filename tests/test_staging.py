"""Optimizer state built in one compiled program, where the params live (`staging`).

The state-building calls of jaxmp's transforms (`mixed_precision`, `loss_scaling`,
`master_weights`, `stochastic_rounding`, `kahan_summation`, `compress_state`) called outside
`jax.jit` trace the whole ``init`` once and run it compiled: the float32 widened params and
moments that the low-memory path exists to avoid are never written (they were: 6x the state
of a bfloat16 model with int8 moments). Memory is checked with the compiled program's
`memory_analysis()`; at real sizes by `benchmarks/memory_at_scale.py`. Sharded params: see
``test_state_is_built_where_sharded_params_live`` and tests/distributed/where_it_lives.py.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from jaxmp._src import compat, staging
from tests.conftest import JAXLIB_VERSION
from tests.test_distributed import TIMEOUT_S, _env, run_script, run_two_processes

BF16 = jnp.bfloat16

#: `mixed_precision`'s configurations for bfloat16 params, by name.
CONFIGS = {
    "master weights": dict(),
    "nearest": dict(master_weights=False),
    "stochastic bf16": dict(master_weights=False, rounding="stochastic", moments="bfloat16"),
    "stochastic int8": dict(master_weights=False, rounding="stochastic", moments="int8"),
    "nearest int8": dict(master_weights=False, moments="int8"),
    "kahan fp8": dict(master_weights=False, rounding="kahan", moments="fp8"),
    "kahan int8/fp8": dict(master_weights=False, rounding="kahan", moments=("int8", "fp8")),
}


def _params(rows: int = 64, cols: int = 512) -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    return {
        "w": jnp.asarray(rng.normal(size=(rows, cols)) / 8, BF16),
        "b": jnp.zeros((cols,), BF16),
        "step": jnp.zeros((), jnp.int32),
    }


def _tx(name: str) -> optax.GradientTransformation:
    return jaxmp.mixed_precision(optax.adam(1e-3), "p=bf16,c=bf16", **CONFIGS[name])


class _SpyState(NamedTuple):
    mu: Any


def _spy(seen: list[Any]) -> optax.GradientTransformation:
    """Adam's first moment, recording what its `init` is given."""

    def init(params):
        seen.extend(jax.tree.leaves(params))
        return _SpyState(mu=jax.tree.map(jnp.zeros_like, params))

    def update(updates, state, params=None):
        return updates, state

    return optax.GradientTransformation(init, update)


# --- One program -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "wrap",
    [
        lambda inner: jaxmp.mixed_precision(inner, "p=bf16,c=bf16", master_weights=False),
        lambda inner: jaxmp.loss_scaling(inner),
        lambda inner: jaxmp.stochastic_rounding(inner),
        lambda inner: jaxmp.kahan_summation(inner),
        lambda inner: jaxmp.master_weights(inner),
        lambda inner: jaxmp.compress_state(
            inner, "int8", moment_fields={_SpyState: {"mu": "first"}}
        ),
    ],
    ids=["mixed_precision", "loss_scaling", "stochastic", "kahan", "master_weights", "compress"],
)
def test_an_eager_init_is_traced_whole(wrap):
    # The optimizer's own init runs inside the trace of the wrapper's: what it is handed (the
    # params widened to float32) is a traced value, never an array written out.
    seen: list[Any] = []
    state = wrap(_spy(seen)).init(_params())
    assert seen and all(compat.is_tracer(x) for x in seen)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(state))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_init_program_writes_nothing_but_its_state(name):
    # The program an eager init runs (the same as `jax.jit(tx.init)`): its temporaries are a
    # sliver of the state it returns. Op by op, 8-bit moments went through float32 moments
    # and a float32 copy of the params (6x the state).
    params = _params(256, 4096)
    compiled = jax.jit(_tx(name).init).lower(params).compile()
    memory = compiled.memory_analysis()
    assert memory.temp_size_in_bytes <= 0.05 * memory.output_size_in_bytes


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_state_equals_the_op_by_op_one(name):
    tx, params = _tx(name), _params()
    with jax.disable_jit():
        expected = tx.init(params)
    state = tx.init(params)
    assert jax.tree.structure(state) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(state), jax.tree.leaves(expected), strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def test_state_leaves_that_are_not_arrays_are_kept_as_made():
    def init(params):
        return {"count": 0, "table": np.arange(3), "none": None, "mu": jnp.zeros_like(params)}

    state = staging.staged_init(init, jnp.ones(4))
    assert state["count"] == 0 and type(state["count"]) is int
    assert isinstance(state["table"], np.ndarray) and state["none"] is None
    assert isinstance(state["mu"], jax.Array)


def test_an_init_reading_a_value_runs_op_by_op():
    def init(params):
        # A Python decision on a value: cannot be traced.
        return {"scale": jnp.asarray(2.0 if float(params["w"][0]) > 0 else 1.0)}

    assert float(staging.staged_init(init, {"w": jnp.ones(3)})["scale"]) == 2.0
    tx = jaxmp.mixed_precision(
        optax.GradientTransformation(init, lambda u, s, p=None: (u, s)), "mixed_bfloat16"
    )
    assert float(tx.init({"w": jnp.ones(3)}).inner_state["scale"]) == 2.0


def test_python_float_and_none_params_are_constants_of_the_program():
    # An Equinox module's fields: a Python float is trained as a float32 param, None skipped.
    tx = jaxmp.mixed_precision(optax.adam(1e-3), "p=bf16,c=bf16")
    state = tx.init({"w": jnp.ones(3, BF16), "alpha": 0.5, "act": None})
    master = state.inner_state.master
    assert master["alpha"].dtype == jnp.float32 and float(master["alpha"]) == 0.5
    assert master["act"] is None


def test_inside_a_trace_init_is_traced_as_it_is():
    tx = _tx("stochastic int8")
    seen = jax.eval_shape(tx.init, _params())
    jitted = jax.jit(tx.init)(_params())
    assert jax.tree.map(lambda x: (x.shape, x.dtype), seen) == jax.tree.map(
        lambda x: (x.shape, x.dtype), jitted
    )


def test_a_param_returned_as_it_is_is_that_param_not_a_copy():
    # The README's pattern: `tx.init(full)` with the float32 params, kept afterwards. The
    # master copy of a float32 param is the param itself (as op by op), not a second
    # float32 copy of the model.
    full = {"w": jnp.ones((8, 8)), "b": jnp.zeros(8)}
    state = jaxmp.mixed_precision(optax.adam(1e-3), "p=f16,c=f16").init(full)
    assert all(state.inner_state.master[k] is full[k] for k in full)
    state = jaxmp.master_weights(optax.sgd(1e-3)).init(full)
    assert state.master["w"] is full["w"]


def test_an_init_reading_its_params_placement_is_run_op_by_op():
    # Placing state next to its param, or waiting for it: what a tracer does not have.
    def init(params):
        jax.block_until_ready(params)
        return {"mu": jax.tree.map(lambda p: jax.device_put(jnp.zeros_like(p), p.sharding), params)}

    tx = jaxmp.mixed_precision(
        optax.GradientTransformation(init, lambda u, s, p=None: (u, s)),
        "p=bf16,c=bf16",
        master_weights=False,
    )
    state = tx.init({"w": jnp.ones(3, BF16)})
    assert state.inner_state["mu"]["w"].dtype == jnp.float32


def test_a_second_init_of_the_same_shapes_is_not_traced_again():
    traced: list[int] = []

    def init(params):
        traced.append(1)
        return {"mu": jax.tree.map(jnp.zeros_like, params)}

    tx = jaxmp.loss_scaling(optax.GradientTransformation(init, lambda u, s, p=None: (u, s)))
    first = tx.init(_params())
    calls = len(traced)
    again = tx.init(_params())
    assert calls >= 1 and len(traced) == calls  # compiled once, run twice
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tx.init(_params(32, 512))  # other shapes: traced again
    assert len(traced) > calls


def test_the_kept_program_does_not_keep_the_params_alive():
    # The compiled program is kept for later calls; the arrays it was first called with are
    # not (a model's float32 params, deleted once cast, would stay in memory).
    tx = jaxmp.mixed_precision(optax.adam(1e-3), "p=bf16,c=bf16", master_weights=False)
    params = _params()
    tx.init(params)
    alive = weakref.ref(params["w"])
    del params
    gc.collect()
    assert alive() is None


def test_each_init_call_builds_new_state():
    # The program is traced per call: a second init after the params changed sees them.
    tx = jaxmp.mixed_precision(optax.adam(1e-3), "p=bf16,c=bf16")
    first = tx.init({"w": jnp.ones(3, BF16)})
    second = tx.init({"w": jnp.full(3, 2.0, BF16)})
    assert float(first.inner_state.master["w"][0]) == 1.0
    assert float(second.inner_state.master["w"][0]) == 2.0


# --- Sharded params (8 simulated devices, a process of their own) -----------------------------


@pytest.fixture(scope="module")
def where_it_lives():
    return run_script("where_it_lives.py")


@pytest.mark.parametrize("name", ["master weights", "stochastic int8", "kahan fp8", "nearest bf16"])
def test_state_is_built_where_sharded_params_live(where_it_lives, name):
    # Each state leaf as `jaxmp.state_shardings` places it (moments and scales split like
    # their param, not on one device), each device's block equal to the one-device state's.
    assert where_it_lives[f"init {name}"] == {"placed": True, "values": True}


@pytest.mark.parametrize(
    "case", ["explicit mesh", "device 3", "two meshes", "small leaf split 8 ways"]
)
def test_state_is_built_where_params_placed_otherwise_live(where_it_lives, case):
    # A mesh of explicit axes outside jax.set_mesh (a sharding constraint failed there), every
    # param on one device but the first (the state went to device 0), the same devices in two
    # orders (incompatible devices), a 512-value bias split 8 ways with 8-bit moments (the
    # state shardings cannot be traced: run op by op, as before).
    assert where_it_lives["placements"][case] == {"placed": True, "values": True}


def _assert_built_and_quantised_where_they_live(outputs: list[dict]) -> None:
    for out in outputs:
        assert out["process_count"] == 2 and out["device_count"] == 8
        for name in ("master weights", "stochastic int8", "kahan fp8", "nearest bf16"):
            assert out[f"init {name}"] == {"placed": True, "values": True}, name
        for recipe in ("int8", "int8_dynamic", "fp8", "int4"):
            expected = {"placed": True, "values": True, "all_gathers": 0}
            assert out[f"quantize {recipe}"] == expected, recipe
    assert outputs[0]["nan error"] == outputs[1]["nan error"]
    assert "(1 of 524288 values, the first at index (200, 300): nan)" in outputs[0]["nan error"]


@pytest.mark.slow
def test_two_processes_build_the_state_and_quantise_where_their_shards_live():
    # Two processes of 4 devices each, params made from each process's own blocks: every
    # state leaf and quantised weight placed as on one process of 8 devices, each process's
    # blocks equal to the one-device result, the same NaN error raised by both.
    _assert_built_and_quantised_where_they_live(run_two_processes("where_it_lives.py"))


_CACHE_HANGS = JAXLIB_VERSION == (0, 12, 1)


@pytest.mark.slow
@pytest.mark.xfail(
    _CACHE_HANGS,
    reason="jaxlib 0.12.1: two CPU processes (gloo) hang in an all-reduce over a mesh axis "
    "that spans both when process 0 loads the program from JAX's persistent compilation cache "
    "and process 1 compiles it (here int8_dynamic's quantisation, the same program as int8's)",
    strict=True,
)
def test_two_processes_with_a_persistent_compilation_cache(tmp_path):
    # The same job with a persistent compilation cache of its own, empty at the start: process
    # 0 writes the programs it compiles and loads them when they come again; process 1's cache
    # keys differ, so it compiles them.
    env = _env(4, cache=False)
    env.update(
        JAX_COMPILATION_CACHE_DIR=str(tmp_path),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    timeout = 120 if _CACHE_HANGS else TIMEOUT_S
    outputs = run_two_processes("where_it_lives.py", env=env, timeout=timeout)
    _assert_built_and_quantised_where_they_live(outputs)
    assert any(tmp_path.iterdir())


# --- jaxmp.quantize of sharded leaves, in the same process of 8 simulated devices ------------


@pytest.mark.parametrize("recipe", ["int8", "int8_dynamic", "fp8", "int4"])
def test_a_sharded_leaf_is_quantised_where_it_lives(where_it_lives, recipe):
    # Values and scales split like the weight (its contraction axis too, in int4, where each
    # device's block holds whole groups), each device's block equal to one device's result,
    # and no all-gather in the compiled program.
    assert where_it_lives[f"quantize {recipe}"] == {
        "placed": True,
        "values": True,
        "all_gathers": 0,
    }


def test_a_nan_in_a_sharded_leaf_is_named(where_it_lives):
    assert where_it_lives["nan error"].startswith(
        "`params` leaf 'w' holds NaN or inf (1 of 524288 values, the first at index (200, 300)"
    )
