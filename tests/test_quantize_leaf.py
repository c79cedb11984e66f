"""Quantising one leaf at a real model's sizes (`jaxmp._src.quantization.leaf`).

In slices where it is large (the same values as quantising it whole), with temporaries a
fraction of the leaf (compiled `memory_analysis()`; whole, the int4 scale search held 20x the
leaf), NaN and inf found on the device, a sharded leaf quantised where it lives (8 simulated
devices, and two processes: tests/distributed/where_it_lives.py). At real sizes:
`benchmarks/memory_at_scale.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from jaxmp._src import compat
from jaxmp._src.quantization import leaf as leaf_lib
from jaxmp._src.quantization.recipes import get_recipe

RECIPES = ("int8", "int8_dynamic", "fp8", "int4")


def _weight(shape, dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=shape) / np.sqrt(shape[0])
    w.reshape(-1)[::97] *= 30  # outliers, so that the int4 search picks different scales
    return jnp.asarray(w, dtype)


def _assert_same(a, b):
    assert (a.recipe, a.dtype, a.contract, a.contract_shape) == (
        b.recipe,
        b.dtype,
        b.contract,
        b.contract_shape,
    )
    for x, y in ((a.values, b.values), (a.scales, b.scales)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --- Slices ----------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(
    ("shape", "contract"),
    [
        ((256, 96), (0,)),  # a kernel: slices of output channels, 96 = 5 * 17 + 11
        ((96, 256), (1,)),  # contracted over its last axis
        ((3, 256, 40), (1,)),  # layers stacked for a scan
        ((256, 4, 30), (0,)),  # two output-channel axes
    ],
)
def test_a_leaf_quantised_in_slices_equals_it_quantised_whole(monkeypatch, recipe, shape, contract):
    w, r = _weight(shape), get_recipe(recipe)
    whole = leaf_lib.quantize_array(w, contract, r)
    assert leaf_lib._slices(shape, contract, frozenset()) == (None, 0)
    # Slices of 7 positions of the longest output-channel axis, and a shorter last one.
    longest = max((i for i in range(len(shape)) if i not in contract), key=lambda i: shape[i])
    monkeypatch.setattr(leaf_lib, "CHUNK_VALUES", 7 * np.prod(shape) // shape[longest])
    monkeypatch.setattr(leaf_lib, "SLICES", 1)
    monkeypatch.setattr(leaf_lib, "MIN_SLICE_VALUES", 1)
    assert leaf_lib._slices(shape, contract, frozenset()) == (longest, 7)
    assert shape[longest] % 7
    sliced = leaf_lib.quantize_array(w, contract, r)
    _assert_same(sliced, whole)
    traced = jax.jit(lambda w: leaf_lib.quantize_array(w, contract, r))(w)
    _assert_same(traced, whole)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=str)
@pytest.mark.parametrize("recipe", RECIPES)
def test_quantising_takes_a_fraction_of_the_leaf_in_temporaries(recipe, dtype):
    # 8M values: quantised whole, the int4 search held 20x the leaf in float32 temporaries
    # and int8 2x; in slices of 1/16, the temporaries (what the call takes beyond what it
    # returns) stay under 2x the leaf, and under 0.75x where XLA does not copy a bfloat16
    # leaf read in a loop (jaxlib >= 0.12).
    shape = (1024, 8192)
    w = jax.ShapeDtypeStruct(shape, dtype)
    r = get_recipe(recipe)
    axis, size = leaf_lib._slices(shape, (0,), frozenset())
    memory = leaf_lib._compiled((0,), r, axis, size, None).lower(w).compile().memory_analysis()
    leaf_bytes = jnp.dtype(dtype).itemsize * np.prod(shape)
    assert memory.temp_size_in_bytes < 2 * leaf_bytes
    copied = compat.LOOPS_WIDEN_BFLOAT16_ON_CPU and dtype == jnp.bfloat16
    if not copied:
        assert memory.temp_size_in_bytes < 0.75 * leaf_bytes


def test_slices_are_a_sixteenth_of_a_large_leaf_and_none_of_a_small_one():
    assert leaf_lib._slices((64, 64), (0,), frozenset()) == (None, 0)
    axis, size = leaf_lib._slices((4096, 65536), (0,), frozenset())
    assert axis == 1 and size * 4096 <= leaf_lib.CHUNK_VALUES
    axis, size = leaf_lib._slices((1024, 8192), (0,), frozenset())
    assert axis == 1 and size == 8192 // 16
    # A sharded axis is never cut: the slices would gather it.
    assert leaf_lib._slices((4096, 65536), (0,), frozenset({1})) == (None, 0)


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_zero_size_contraction_is_quantised(recipe):
    def layer(p, x):
        return x @ p["w"]

    p = {"w": jnp.zeros((0, 8), jnp.float32)}
    x = jnp.zeros((2, 0), jnp.float32)
    q = jaxmp.quantize(layer, p, x, recipe=recipe)
    y = jaxmp.quantized(layer)(q, x)
    np.testing.assert_array_equal(np.asarray(y), np.zeros((2, 8), np.float32))


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_weight_with_no_output_channels_is_quantised(recipe):
    def layer(p, x):
        return x @ p["w"]

    p = {"w": jnp.ones((256, 0), jnp.float32)}
    x = jnp.ones((2, 256), jnp.float32)
    q = jaxmp.quantize(layer, p, x, recipe=recipe)
    assert q["w"].shape == (256, 0) and q["w"].dequantize().shape == (256, 0)
    for y in (jaxmp.quantized(layer)(q, x), jax.jit(jaxmp.quantized(layer))(q, x)):
        assert y.shape == (2, 0) and y.dtype == jnp.float32


# --- NaN and inf, on the device --------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [(0, 0), (255, 1023), (131, 7)])
def test_a_nonfinite_weight_is_found_on_the_device(recipe, bad, where):
    # 256 rows: XLA:CPU's float maximum over many rows skips a NaN; the scales are taken as
    # integers, so that one NaN anywhere makes its channel's (or group's) scale NaN.
    def layer(p, x):
        return x @ p["w"]

    w = np.array(_weight((256, 1024), jnp.float32))
    w[where] = bad
    x = jnp.ones((1, 256))
    with pytest.raises(ValueError) as e:
        jaxmp.quantize(layer, {"w": jnp.asarray(w)}, x, recipe=recipe)
    assert str(e.value).startswith(
        f"`params` leaf 'w' holds NaN or inf (1 of 262144 values, the first at index {where}: "
        f"{float(bad)})"
    )
    with pytest.raises(ValueError, match=r"the first at index"):
        jaxmp.quantization_plan(layer, {"w": jnp.asarray(w)}, x, recipe=recipe)


@pytest.mark.parametrize("recipe", ["int8_dynamic", "fp8"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_nonfinite_activation_among_many_rows_stays_nonfinite(recipe, bad):
    # The activations' row scales are taken as integers too: with a float maximum, a NaN in
    # one of 64 rows was skipped by XLA:CPU and int8 x int8 gave that row finite outputs.
    def layer(p, x):
        return x @ p["w"]

    p = {"w": _weight((256, 64), jnp.float32)}
    x = jnp.ones((64, 256)).at[5, 7].set(bad)
    y = jaxmp.quantized(layer)(jaxmp.quantize(layer, p, x, recipe=recipe), x)
    assert not np.isfinite(np.asarray(y[5])).any()
    assert np.isfinite(np.asarray(jnp.delete(y, 5, axis=0))).all()


def test_the_error_counts_every_nonfinite_value_and_names_the_first():
    w = np.ones((300, 70), np.float32)
    w[250:, 3] = np.nan
    w[10, 60] = np.inf
    err = leaf_lib.nonfinite_error("w", jnp.asarray(w))
    assert "(51 of 21000 values, the first at index (10, 60): inf)" in str(err)
    err = leaf_lib.nonfinite_error("v", jnp.asarray(np.r_[np.ones(9), np.nan]))
    assert "(1 of 10 values, the first at index (9,): nan)" in str(err)


def test_a_finite_leaf_is_read_for_its_scales_only():
    w = _weight((256, 256))
    q = leaf_lib.quantize_array(w, (0,), get_recipe("int8"))
    leaf_lib.check_finite("w", w, q)  # no error
    traced = jax.jit(lambda w: leaf_lib.check_finite("w", w) or w)
    traced(w.at[0, 0].set(jnp.nan))  # inside a trace the values are not known: no check
