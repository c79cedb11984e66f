"""Tests of jaxmp.KVCache: the int8 and FP8 key/value cache of a decode loop.

Its promises, attacked: the bytes (values and scales, against a bfloat16 cache), the error of
each format, NaN and inf kept non-finite and kept where they are, all-zero keys, values beyond
E4M3's range and at each dtype's largest, float16/bfloat16/float32, jit, scan, vmap, donation,
sharding (in a process of its own), and the errors.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxmp
from tests.conftest import BF16, F16, F32, FLOAT_DTYPES, TOLERANCE, assert_close, diagonal_cases

FORMATS = ("int8", "fp8")
SHAPE = (2, 16, 4, 32)  # (batch, max_len, heads, head_dim)

# The largest error of a value read back, per format: int8 rounds to a grid of amax / 127 per
# (position, head) (half a step, relative to that amax); E4M3 keeps 3 mantissa bits (half an
# ulp, relative to the value itself; values below 2**-6 of the scale are subnormal, where the
# step is 2**-9 of the scale).
INT8_STEP = 1 / 254
E4M3_ULP = 2.0**-4
# The largest error of an attention over a quantised cache (relative to the largest output),
# about twice the largest of five draws of normal queries, keys and values (int8 0.5% to 1.1%,
# FP8 3.2% to 6.6%), on top of the compute dtype's own.
ATTENTION_ERROR = {"int8": 0.02, "fp8": 0.12, None: 0.0}


# Called through jit: one compiled program per cache type and shape.
_read = jax.jit(lambda cache: cache.read())
_attend = jax.jit(lambda cache, q, pos: cache.attend(q, pos))


def _data(shape=SHAPE, seed=0, spread=True):
    """Normal keys, each (position, head) vector scaled by its own power of ten (1e-3 to 1e3):
    a cache holds values of very different sizes."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shape).astype(np.float32)
    if spread:
        x *= 10.0 ** rng.integers(-3, 4, size=(*shape[:-1], 1))
    return x


def _reference_attention(q, k, v, pos):
    """Causal attention in float64: query row i sits at position ``pos + i`` and sees the
    keys at positions up to it; grouped heads share a key/value head."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    *_, length, q_heads, head_dim = q.shape
    heads = k.shape[-2]
    k = np.repeat(k, q_heads // heads, axis=-2)
    v = np.repeat(v, q_heads // heads, axis=-2)
    scores = np.einsum("...qhd,...khd->...hqk", q, k) / np.sqrt(head_dim)
    visible = np.arange(k.shape[-3])[None, :] <= (pos + np.arange(length))[:, None]
    scores = np.where(visible, scores, -np.inf)
    scores -= scores.max(-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("...hqk,...khd->...qhd", p, v)


# --- Bytes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "head_dim", "block_size", "ratio"),
    [
        # int8: one byte a value and a bfloat16 scale per (position, head): (D + 2) / 2D.
        ("int8", 32, None, 34 / 64),
        ("int8", 128, None, 130 / 256),
        # FP8: one byte a value and an E8M0 exponent per (position, head): (D + 1) / 2D.
        ("fp8", 32, None, 33 / 64),
        ("fp8", 128, None, 129 / 256),
        # Scales per block of 16 along head_dim: one scale per 16 values.
        ("int8", 128, 16, 18 / 32),
        ("fp8", 128, 16, 17 / 32),
    ],
)
def test_bytes_are_half_of_bfloat16_plus_the_scales(fmt, head_dim, block_size, ratio):
    shape = (8, 256, 4, head_dim)
    base = jaxmp.KVCache.create(shape, None, dtype=jnp.bfloat16)
    cache = jaxmp.KVCache.create(shape, fmt, dtype=jnp.bfloat16, block_size=block_size)
    assert base.nbytes == 2 * 2 * np.prod(shape)  # keys and values, two bytes each
    assert cache.nbytes / base.nbytes == ratio
    assert cache.nbytes == sum(x.nbytes for x in jax.tree.leaves(cache))
    # The ratio is the cache's, whatever the dtype it reads back in.
    f32 = jaxmp.KVCache.create(shape, fmt, dtype=jnp.float32, block_size=block_size)
    assert f32.nbytes == cache.nbytes


# --- Values read back ------------------------------------------------------------------------


def _written(fmt, x, dtype=F32, block_size=None, pos=0):
    cache = jaxmp.KVCache.create(
        (*x.shape[:-3], SHAPE[1], *x.shape[-2:]), fmt, dtype=dtype, block_size=block_size
    )
    x = jnp.asarray(x, dtype)
    with jax.numpy_dtype_promotion("strict"):
        return jax.jit(lambda c, k, v: c.update(k, v, pos))(cache, x, -x)


@pytest.mark.parametrize("fmt", FORMATS)
def test_read_back_error_is_the_formats(fmt):
    x = _data()
    cache = _written(fmt, x)
    with jax.numpy_dtype_promotion("strict"):
        keys, values = _read(cache)
    assert keys.dtype == values.dtype == F32
    np.testing.assert_array_equal(values, -keys)  # symmetric rounding
    keys = np.asarray(keys)
    err = np.abs(keys - x)
    amax = np.abs(x).max(-1, keepdims=True)
    if fmt == "int8":
        # The scale, amax / 127 rounded to bfloat16, is within 2**-9 of it: amax / scale is at
        # most 127.5, and 128 is clipped to 127 (half a step from 127.5).
        assert (err <= INT8_STEP * amax * (1 + 2.0**-8)).all()
    else:
        scale = np.exp2(np.ceil(np.log2(amax / 448)))
        assert (err <= np.maximum(E4M3_ULP * np.abs(x), 2.0**-10 * scale) * (1 + 1e-6)).all()
    # Not more than the format's error: the grid is used (amax reaches its top).
    assert err.max() > 0.1 * (INT8_STEP if fmt == "int8" else E4M3_ULP) * np.abs(x).max()


@pytest.mark.parametrize("fmt", FORMATS)
def test_scales_are_per_head_and_position_or_per_block(fmt):
    x = _data()
    for block_size, blocks in ((None, 1), (8, 4)):
        cache = _written(fmt, x, block_size=block_size)
        assert cache.key_scales.shape == (*SHAPE[:-1], blocks)
        # int8 and bfloat16; FP8 as the bits of E4M3 values and E8M0 exponents.
        assert cache.key_scales.dtype == (BF16 if fmt == "int8" else jnp.uint8)
        assert cache.keys.dtype == (jnp.int8 if fmt == "int8" else jnp.uint8)
        keys, _ = _read(cache)
        by_block = x.reshape(*SHAPE[:-1], blocks, -1)
        err = np.abs(np.asarray(keys).reshape(by_block.shape) - by_block)
        amax = np.abs(by_block).max(-1, keepdims=True)
        bound = INT8_STEP * (1 + 2.0**-8) * amax if fmt == "int8" else E4M3_ULP * amax
        assert (err <= bound * (1 + 1e-6)).all()
    # Per block of 8: no larger error than per vector of 32 (each block's own amax).
    per_vector = np.abs(np.asarray(_read(_written(fmt, x))[0]) - x).mean()
    per_block = np.abs(np.asarray(_read(_written(fmt, x, block_size=8))[0]) - x).mean()
    assert per_block <= per_vector


@pytest.mark.parametrize("fmt", FORMATS)
def test_all_zero_keys_read_back_as_zeros(fmt):
    x = _data()
    x[0, 3] = 0.0  # every head of one position
    x[1, :, 2] = 0.0  # one head at every position
    x[1, 5, 1, :16] = 0.0  # half a vector: one block of 16
    cache = _written(fmt, x, block_size=16)
    keys, values = (np.asarray(a) for a in _read(cache))
    assert np.isfinite(keys).all() and np.isfinite(values).all()
    assert (keys[x == 0] == 0).all() and (values[x == 0] == 0).all()
    empty = jaxmp.KVCache.create(SHAPE, fmt, dtype=F32)
    assert not np.asarray(_read(empty)[0]).any()
    # Attention over zero keys is uniform; over zero values, zero.
    q = jnp.ones((1, 1, 4, 32), F32)
    out = _attend(jaxmp.KVCache.create((1, 8, 4, 32), fmt, dtype=F32), q, 5)
    assert not np.asarray(out).any() and np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_nonfinite_values_stay_nonfinite_and_stay_in_their_vector(fmt):
    x = _data()
    bad = {(0, 3, 1, 5): np.nan, (1, 4, 2, 0): np.inf, (0, 9, 0, 31): -np.inf}
    dirty = x.copy()
    for index, value in bad.items():
        dirty[index] = value
    clean_keys = np.asarray(_read(_written(fmt, x))[0])
    keys = np.asarray(_read(_written(fmt, dirty))[0])
    # The (position, head) vector holding a NaN or inf reads back as NaN (it shares one scale);
    # every other value, other heads and positions included, is what it is without them.
    poisoned = np.zeros(SHAPE[:-1], bool)
    for b, t, h, _ in bad:
        poisoned[b, t, h] = True
    assert np.isnan(keys[poisoned]).all()
    np.testing.assert_array_equal(keys[~poisoned], clean_keys[~poisoned])
    # With blocks of 8, only the block holding it.
    keys = np.asarray(_read(_written(fmt, dirty, block_size=8))[0]).reshape(*SHAPE[:-1], 4, 8)
    for b, t, h, d in bad:
        assert np.isnan(keys[b, t, h, d // 8]).all()
        assert np.isfinite(np.delete(keys[b, t, h], d // 8, axis=0)).all()
    assert np.isnan(keys).sum() == 3 * 8


@pytest.mark.parametrize("fmt", [*FORMATS, None])
def test_attention_sees_a_nonfinite_key_only_from_the_positions_after_it(fmt):
    # A NaN key at position 6 of head 1: bfloat16's attention is NaN for head 1 from position
    # 6 on. Earlier positions and the other heads are unaffected (the same bits as without it).
    k, v = _data((1, 16, 4, 32), 1, spread=False), _data((1, 16, 4, 32), 2, spread=False)
    q = _data((1, 10, 8, 32), 3, spread=False)  # two query heads per key/value head
    dirty_k, dirty_v = k.copy(), v.copy()
    dirty_k[0, 6, 1, 3] = np.nan
    dirty_v[0, 12, 2, 0] = np.inf  # a value no query sees: written past the last query
    outs = []
    for keys, values in ((k, v), (dirty_k, dirty_v)):
        cache = jaxmp.KVCache.create((1, 16, 4, 32), fmt, dtype=F32)
        cache = cache.update(jnp.asarray(keys), jnp.asarray(values), 0)
        outs.append(np.asarray(_attend(cache, jnp.asarray(q), 0)))
    clean, dirty = outs
    nan = np.isnan(dirty)
    assert nan[0, 6:, 2:4].all()  # query heads 2 and 3 read key/value head 1
    if fmt is not None:
        assert nan.sum() == nan[0, 6:, 2:4].size
        np.testing.assert_array_equal(dirty[~nan], clean[~nan])
    else:
        # Unquantised: a plain attention, where a masked inf value still reaches the other
        # queries of its head as 0 * inf.
        assert np.isfinite(dirty[0, :, [0, 1, 6, 7]]).all()


@pytest.mark.parametrize(
    ("fmt", "dtype"), diagonal_cases(FORMATS, FLOAT_DTYPES, FORMATS, [d.name for d in FLOAT_DTYPES])
)
def test_values_beyond_e4m3s_range_and_at_the_dtypes_largest(fmt, dtype):
    largest = float(jnp.finfo(dtype).max)
    x = _data(spread=False)
    x[0, 0, 0] *= 1e3  # beyond E4M3's 448
    x[0, 1, 0, 0] = largest
    x[0, 1, 0, 1] = -largest
    x[0, 2, 1] = largest  # a whole vector at the largest value
    x[0, 3, 1, 0] = float(jnp.finfo(dtype).tiny)  # beside the others, rounds to zero
    x = np.asarray(jnp.asarray(x, dtype).astype(F32))
    cache = _written(fmt, x, dtype=dtype)
    keys, values = (np.asarray(a.astype(F32)) for a in _read(cache))
    assert np.isfinite(keys).all() and np.isfinite(values).all()
    rel = np.abs(keys - x) / np.abs(x).max(-1, keepdims=True)
    # Half a step, but a value that would round past the dtype's largest saturates at the
    # largest value the format reaches below it: at most one step (int8's scale is a bfloat16
    # number, FP8's a power of two whose top binade has steps of an eighth).
    edge = np.zeros(rel.shape, bool)
    edge[0, 1, 0] = edge[0, 2, 1] = True
    bound = INT8_STEP * (1 + 2.0**-8) if fmt == "int8" else E4M3_ULP
    saturated = 1 / 127 if fmt == "int8" else 2 * E4M3_ULP
    assert rel[~edge].max() <= bound + TOLERANCE[dtype]
    assert rel[edge].max() <= saturated + TOLERANCE[dtype]
    # Attention over values at the dtype's largest stays finite (the keys are moderate: a
    # key at float32's largest overflows the scores of any attention).
    cache = jaxmp.KVCache.create(SHAPE, fmt, dtype=dtype)
    cache = cache.update(jnp.ones(x.shape, dtype), jnp.asarray(x, dtype), 0)
    q = jnp.asarray(_data((2, 4, 4, 32), 5, spread=False), dtype)
    out = _attend(cache, q, 3)
    assert out.dtype == dtype and np.isfinite(np.asarray(out.astype(F32))).all()
    assert np.abs(np.asarray(out.astype(F32))).max() > 0.2 * largest


@pytest.mark.parametrize(
    ("fmt", "dtype"),
    diagonal_cases(
        [*FORMATS, None], FLOAT_DTYPES, [*FORMATS, "none"], [d.name for d in FLOAT_DTYPES]
    ),
)
def test_attention_in_each_compute_dtype_is_close_to_float64(fmt, dtype):
    batch, length, heads, head_dim = 2, 16, 4, 32
    k = _data((batch, length, heads, head_dim), 1, spread=False)
    v = _data((batch, length, heads, head_dim), 2, spread=False)
    q = _data((batch, 5, heads, head_dim), 3, spread=False)
    cache = jaxmp.KVCache.create((batch, 32, heads, head_dim), fmt, dtype=dtype)
    with jax.numpy_dtype_promotion("strict"):
        # Keys and values in another dtype than the cache's: converted on the way in.
        cache = jax.jit(lambda c, k, v: c.update(k, v, 0))(cache, jnp.asarray(k), jnp.asarray(v))
        out = _attend(cache, jnp.asarray(q, dtype), 11)
        keys, values = _read(cache)
    assert out.dtype == keys.dtype == values.dtype == dtype
    assert cache.keys.shape == (batch, 32, heads, head_dim)
    expected = _reference_attention(q, k, v, 11)
    err = np.abs(np.asarray(out, np.float64) - expected).max() / np.abs(expected).max()
    assert err <= ATTENTION_ERROR[fmt] + 2 * TOLERANCE[dtype], err


def test_unquantised_attention_is_dot_product_attention():
    k, v = _data((2, 16, 4, 32), 1, spread=False), _data((2, 16, 4, 32), 2, spread=False)
    q = _data((2, 16, 4, 32), 3, spread=False)
    cache = jaxmp.KVCache.create((2, 16, 4, 32), None, dtype=F32).update(k, v, 0)
    out = _attend(cache, jnp.asarray(q), 0)
    expected = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    assert_close(out, expected, F32)
    assert_close(out, _reference_attention(q, k, v, 0), F32)


def test_grouped_query_heads_share_their_key_value_head():
    k, v = _data((1, 8, 2, 16), 1, spread=False), _data((1, 8, 2, 16), 2, spread=False)
    q = _data((1, 3, 6, 16), 3, spread=False)
    cache = jaxmp.KVCache.create((1, 8, 2, 16), None, dtype=F32).update(k, v, 0)
    assert_close(_attend(cache, jnp.asarray(q), 4), _reference_attention(q, k, v, 4), F32)
    with pytest.raises(ValueError, match=r"`query` must have a multiple of the cache's 2 heads"):
        cache.attend(jnp.ones((1, 1, 3, 16), F32), 0)


# --- Transformations -------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_appending_one_position_at_a_time_under_scan_is_writing_them_at_once(fmt):
    x = jnp.asarray(_data())
    at_once = _written(fmt, np.asarray(x))
    empty = jaxmp.KVCache.create(SHAPE, fmt, dtype=F32)

    def step(cache, pos):
        kv = lax.dynamic_slice_in_dim(x, pos, 1, axis=1)
        cache = cache.update(kv, -kv, pos)
        return cache, cache.attend(kv, pos)

    with jax.numpy_dtype_promotion("strict"):
        one_by_one, outs = jax.jit(lambda c: lax.scan(step, c, jnp.arange(SHAPE[1])))(empty)
    # The same pytree, the same dtypes, the same bits: each position is quantised alone.
    assert jax.tree.structure(one_by_one) == jax.tree.structure(at_once)
    for a, b in zip(jax.tree.leaves(one_by_one), jax.tree.leaves(at_once), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # Decoding one query at a time is the prefill's attention.
    prefill = np.asarray(_attend(at_once, x, 0))
    decoded = np.moveaxis(np.asarray(outs)[:, :, 0], 0, 1)
    atol = TOLERANCE[F32] * np.abs(prefill).max()  # the values span 1e-3 to 1e3
    np.testing.assert_allclose(decoded, prefill, rtol=TOLERANCE[F32], atol=atol)


@pytest.mark.parametrize("fmt", [*FORMATS, None])
def test_vmap_over_sequences_writes_each_at_its_own_position(fmt):
    x = jnp.asarray(_data((3, 2, 4, 32)))
    pos = jnp.array([0, 5, 14])
    cache = jaxmp.KVCache.create((3, 16, 4, 32), fmt, dtype=F32)
    update = jax.jit(lambda c, k, p: c.update(k, k, p))
    batched = jax.jit(jax.vmap(update))(cache, x, pos)
    for i in range(3):
        one = update(jaxmp.KVCache.create((16, 4, 32), fmt, dtype=F32), x[i], pos[i])
        for a, b in zip(jax.tree.leaves(batched), jax.tree.leaves(one), strict=True):
            np.testing.assert_array_equal(np.asarray(a[i], np.float32), np.asarray(b, np.float32))
    # And attention per sequence, each at its own position.
    q = jnp.ones((3, 1, 4, 32), F32)
    out = jax.vmap(lambda c, q, p: c.attend(q, p))(batched, q, pos + 1)
    assert out.shape == (3, 1, 4, 32) and np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_stack_of_layer_caches_is_scanned_over(fmt):
    # One cache for every layer, ``(layers, batch, max_len, heads, head_dim)``: a scan over the
    # layers reads and writes each layer's slice.
    cache = jaxmp.KVCache.create((3, *SHAPE), fmt, dtype=BF16)
    x = jnp.asarray(_data((3, 2, 1, 4, 32)), BF16)

    def layer(carry, inputs):
        layer_cache, kv = inputs
        layer_cache = layer_cache.update(kv, kv, 7)
        return carry, layer_cache

    _, new = jax.jit(lambda c: lax.scan(layer, 0, (c, x)))(cache)
    assert jax.tree.structure(new) == jax.tree.structure(cache)
    assert new.keys.shape == cache.keys.shape and new.keys.dtype == cache.keys.dtype
    keys = np.asarray(_read(new)[0].astype(F32))
    expected = np.asarray(x[:, :, 0].astype(F32))
    amax = np.abs(expected).max(-1, keepdims=True)
    bound = INT8_STEP * (1 + 2.0**-8) if fmt == "int8" else E4M3_ULP
    assert (np.abs(keys[:, :, 7] - expected) <= (bound + TOLERANCE[BF16]) * amax).all()
    assert not keys[:, :, :7].any() and not keys[:, :, 8:].any()


@pytest.mark.parametrize("fmt", [*FORMATS, None])
def test_a_donated_cache_is_updated_in_place(fmt):
    cache = jaxmp.KVCache.create(SHAPE, fmt, dtype=BF16)
    kv = jnp.ones((2, 1, 4, 32), BF16)
    update = jax.jit(lambda c, k, v, p: c.update(k, v, p), donate_argnums=0)
    compiled = update.lower(cache, kv, kv, 3).compile()
    # Every buffer of the cache is aliased to the output: no copy of the cache is made.
    aliases = compiled.as_text().split("input_output_alias={", 1)[1].split("\n", 1)[0]
    assert aliases.count("may-alias") + aliases.count("must-alias") == len(jax.tree.leaves(cache))
    new = update(cache, kv, kv, 3)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(cache))
    assert float(_read(new)[0][0, 3, 0, 0].astype(F32)) == 1.0


def test_fp8_is_written_in_place_as_its_bits():
    # XLA:CPU writes a slice of an FP8 array by converting the whole array to float16 and back
    # (each decode step rewrote the cache): the update writes the bits of the E4M3 values and
    # E8M0 scales into uint8 arrays, in place.
    cache = jaxmp.KVCache.create(SHAPE, "fp8", dtype=BF16)
    kv = jnp.ones((2, 1, 4, 32), BF16)
    text = jax.jit(lambda c, k, p: c.update(k, k, p)).lower(cache, kv, 3).compile().as_text()
    writes = [line for line in text.splitlines() if "dynamic-update-slice(" in line]
    assert len(writes) == 4 and all("= u8[" in line for line in writes), writes


def test_a_pytree_of_its_arrays_with_its_format_static():
    cache = jaxmp.KVCache.create(SHAPE, "fp8", dtype=F16, block_size=8)
    leaves, treedef = jax.tree.flatten(cache)
    assert len(leaves) == 4
    again = jax.tree.unflatten(treedef, leaves)
    assert (again.format, again.dtype, again.block_size) == ("fp8", F16, 8)
    assert jaxmp.KVCache.create(SHAPE, None, dtype=F16).key_scales is None
    assert len(jax.tree.leaves(jaxmp.KVCache.create(SHAPE, None, dtype=F16))) == 2
    out = jax.jit(lambda c: c)(cache)
    assert (out.format, out.dtype, out.block_size) == ("fp8", F16, 8)


# --- Errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"format": "int9"},
            ValueError,
            "`format` must be one of 'int8', 'fp8' or None (unquantised), got 'int9'. "
            "Did you mean 'int8'?",
        ),
        (
            {"format": "FP8"},
            ValueError,
            "`format` must be one of 'int8', 'fp8' or None (unquantised), got 'FP8'. "
            "Did you mean 'fp8'?",
        ),
        ({"dtype": jnp.int8}, ValueError, "`dtype` must be a floating dtype"),
        ({"block_size": 12}, ValueError, "`block_size` must be a positive divisor of head_dim 32"),
        ({"shape": (16, 32)}, ValueError, "`shape` must be (*batch, max_len, heads, head_dim)"),
        (
            {"format": None, "block_size": 8},
            ValueError,
            "`block_size` applies to the quantised formats",
        ),
    ],
)
def test_bad_arguments_are_errors_at_construction(kwargs, error, message):
    args = {"shape": SHAPE, "format": "int8", **kwargs}
    with pytest.raises(error) as info:
        jaxmp.KVCache.create(args.pop("shape"), args.pop("format"), **args)
    assert message in str(info.value)


def test_writes_of_the_wrong_shape_are_errors_naming_the_argument():
    cache = jaxmp.KVCache.create(SHAPE, "int8")
    kv = jnp.ones((2, 1, 4, 32), BF16)
    with pytest.raises(
        ValueError, match=r"`keys` must have shape \(2, L, 4, 32\).*\(2, 1, 4, 16\)"
    ):
        cache.update(jnp.ones((2, 1, 4, 16), BF16), kv, 0)
    with pytest.raises(ValueError, match=r"`values` must have the shape of `keys`"):
        cache.update(kv, jnp.ones((2, 2, 4, 32), BF16), 0)
    with pytest.raises(ValueError, match=r"at most max_len 16 positions, got 17"):
        cache.update(jnp.ones((2, 17, 4, 32), BF16), jnp.ones((2, 17, 4, 32), BF16), 0)
    with pytest.raises(ValueError, match=r"`pos` must be a scalar.*jax.vmap"):
        cache.update(kv, kv, jnp.zeros(2, jnp.int32))
    with pytest.raises(TypeError, match=r"`keys` must be floating"):
        cache.update(kv.astype(jnp.int32), kv, 0)


# --- Sharding (its own process: simulated devices are set before jax starts) ------------------

SHARDED = """
import json, jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxmp
mesh = jax.make_mesh((2, 2), ("data", "model"))
spec = NamedSharding(mesh, P("data", None, "model", None))
out = {}
for fmt in ("int8", "fp8", None):
    x = jax.random.normal(jax.random.key(0), (4, 8, 4, 16), jnp.float32)
    plain = jaxmp.KVCache.create((4, 8, 4, 16), fmt).update(x, -x, 0)
    cache = jaxmp.KVCache.create((4, 8, 4, 16), fmt, sharding=spec)
    placed = [leaf.sharding.spec for leaf in jax.tree.leaves(cache)]
    step = jax.jit(lambda c, k, v: c.update(k, v, 0), donate_argnums=0)
    cache = step(cache, jax.device_put(x, spec), jax.device_put(-x, spec))
    kept = [leaf.sharding.spec for leaf in jax.tree.leaves(cache)]
    att = jax.jit(lambda c, q: c.attend(q, 2))(cache, jax.device_put(x[:, :3], spec))
    same = all(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
               for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(plain)))
    out[str(fmt)] = {"placed": [str(s) for s in placed], "kept": [str(s) for s in kept],
                     "attention": str(att.sharding.spec), "same": same,
                     "close": float(np.abs(np.asarray(att, np.float32)
                                - np.asarray(plain.attend(x[:, :3], 2), np.float32)).max())}
print(json.dumps(out))
"""


@pytest.mark.slow  # a process of its own: 10 s on 2 CPU cores
def test_a_cache_sharded_over_batch_and_heads_stays_where_it_lives():
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.run(
        [sys.executable, "-c", SHARDED],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=pathlib.Path(__file__).parent.parent,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    spec = str(P("data", None, "model", None))
    for fmt, r in out.items():
        leaves = 2 if fmt == "None" else 4
        assert r["placed"] == r["kept"] == [spec] * leaves, (fmt, r)
        assert r["same"], fmt
        assert r["attention"] == spec and r["close"] < TOLERANCE[BF16], (fmt, r)


def test_scales_decode_as_documented():
    # The int8 scale is bfloat16 (float32's range), the FP8 scale an E8M0 power of two.
    x = np.zeros((1, 1, 1, 32), np.float32)
    x[..., 0] = 1000.0
    int8 = _written("int8", x)
    assert int8.key_scales[0, 0, 0, 0] == ml_dtypes.bfloat16(1000.0 / 127)  # nearest
    scale = float(ml_dtypes.bfloat16(1000.0 / 127))
    assert float(_read(int8)[0][0, 0, 0, 0]) == round(1000.0 / scale) * scale
    fp8 = _written("fp8", x)
    # 1000 / 4 = 250 <= 448: the E8M0 exponent 2, stored as 2 + 127; 250 rounds to E4M3's 256.
    assert int(fp8.key_scales[0, 0, 0, 0]) == 129
    scale = lax.bitcast_convert_type(fp8.key_scales[0, 0, 0, 0], jnp.float8_e8m0fnu)
    assert float(scale.astype(F32)) == 4.0
    value = lax.bitcast_convert_type(fp8.keys[0, 0, 0, 0], jnp.float8_e4m3fn)
    assert float(value.astype(F32)) == 256.0
    assert float(_read(fp8)[0][0, 0, 0, 0]) == 1024.0
    # A NaN's scale: E8M0's NaN, 255.
    x[0, 0, 0, 1] = np.nan
    assert int(_written("fp8", x).key_scales[0, 0, 0, 0]) == 255
    x[0, 0, 0, 1] = 0.0
    # An empty cache's scales are 1.
    empty = jaxmp.KVCache.create(SHAPE, "fp8")
    assert (np.asarray(empty.key_scales) == 127).all()
    assert (np.asarray(jaxmp.KVCache.create(SHAPE, "int8").key_scales, np.float32) == 1).all()
    # In float16, 65504 saturates below the largest: 65504 / 516 = 126.9, read back 126 * 516
    # (127 * 516 would be inf).
    x[..., 0] = 65504.0
    assert int8.key_scales.dtype == BF16 and ml_dtypes.bfloat16(65504.0 / 127) == 516.0
    read = _read(_written("int8", x, dtype=F16))[0][0, 0, 0, 0]
    assert read == np.float16(126 * 516.0)
