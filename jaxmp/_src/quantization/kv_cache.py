"""A key/value cache for decoding, stored in int8 or FP8 (E4M3) with a scale per head and
position: half the bytes of a bfloat16 cache, for more sequences or longer ones.

Layout and scales follow MaxText's quantised KV cache (``kv_quant_axis="dkv"``: keys and values
``(batch, length, heads, head_dim)``, one bfloat16 scale per batch, position and head, applied
outside the attention's products) and, for FP8, the OCP MX formats (an E8M0 power-of-two scale:
one byte, and exact to apply). Serving stacks with per-tensor FP8 scales (vLLM's and
TensorRT-LLM's FP8 KV caches, whose default scale is 1) need calibration data and saturate what
exceeds the scale; a scale per head and position is computed as each position is written, from
that position alone, so nothing saturates and nothing needs calibrating.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmp._src import fp8_scaling
from jaxmp._src.quantization import recipes as q_lib

_E4M3 = jnp.dtype(jnp.float8_e4m3fn)
_E8M0 = jnp.dtype(jnp.float8_e8m0fnu)
_BF16 = jnp.dtype(jnp.bfloat16)
_F32 = jnp.dtype(jnp.float32)
_INT8_MAX = 127.0

_U8 = jnp.dtype(jnp.uint8)

#: Each quantised format: the dtypes its values and scales are stored in, and what they are.
#: FP8's E4M3 values and E8M0 scales are stored as their bits (uint8): XLA:CPU writes a slice
#: of an FP8 array into place 100x slower than one of bytes (a decode step of the main job
#: ran 5x slower than with int8); a bitcast reads them back at no cost on every backend.
FORMATS: dict[str, tuple[Any, Any]] = {
    "int8": (jnp.dtype(jnp.int8), _BF16),
    "fp8": (_U8, _U8),
}
_MEANING = {"int8": (jnp.dtype(jnp.int8), _BF16), "fp8": (_E4M3, _E8M0)}


def _check_format(format: Any) -> None:
    if format is None or (isinstance(format, str) and format in FORMATS):
        return
    choices = " or ".join([", ".join(repr(f) for f in FORMATS), "None (unquantised)"])
    hint = ""
    if isinstance(format, str):
        lower = {f.lower(): f for f in FORMATS}
        close = difflib.get_close_matches(format.lower(), list(lower), n=1)
        hint = f" Did you mean {lower[close[0]]!r}?" if close else ""
    raise ValueError(f"`format` must be one of {choices}, got {format!r}.{hint}")


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["keys", "values", "key_scales", "value_scales"],
    meta_fields=["format", "dtype", "block_size"],
)
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The keys and values of a decode loop's attention, quantised as they are written.

    A pytree of up to four arrays (the format, the compute dtype and the block size are
    static): it goes through ``jit``, ``lax.scan`` (a stack of per-layer caches, scanned over
    with the layers' params), ``vmap`` (a position per sequence) and donation (`update` writes
    with ``lax.dynamic_update_slice``, in place when the cache is donated), and keeps the
    sharding of its batch and heads axes.

    Formats:

    * ``"int8"``: values ``round(x / s)`` in [-127, 127]; ``s = amax / 127`` (``amax`` the
      vector's largest finite magnitude), rounded to bfloat16 (float32's range, half its
      bytes). Error at most half a step, ``amax / 254`` (times ``1 + 2**-8``, the scale's
      rounding).
    * ``"fp8"``: E4M3 values ``x / 2**e``; ``2**e`` the smallest power of two with ``amax /
      2**e <= 448``, stored as an E8M0 exponent (one byte). Error at most half an E4M3 ulp, a
      sixteenth of the value (values below ``2**-6`` of the scale are subnormal).
    * ``None``: the keys and values as they are, in `dtype` (the baseline).

    One scale per head and position (of ``head_dim`` values), or with `block_size` one per
    block of that many values along ``head_dim``. Bytes against a bfloat16 cache:
    ``(head_dim + 2) / (2 * head_dim)`` for int8 (0.531 at head_dim 32, 0.508 at 128),
    ``(head_dim + 1) / (2 * head_dim)`` for FP8 (0.516 and 0.504); per block, ``block_size``
    in place of ``head_dim``.

    What is guaranteed: the scale of a (position, head) vector comes from its finite values
    alone; a NaN or inf in it makes its scale NaN, so the vector (its block) reads back as
    NaN and a query that sees its position gets NaN from that head, while every other
    position, head and sequence reads back exactly as without it. An all-zero vector reads
    back as zeros. A finite value stays finite read back in `dtype`, also at the dtype's
    largest values (there a value that would round past the largest saturates below it).

    Attributes:
      keys: ``(*batch, max_len, heads, head_dim)``: int8, the bits of E4M3 values (uint8),
        or `dtype` (format None).
      values: as `keys`.
      key_scales: ``(*batch, max_len, heads, head_dim // block_size)``: bfloat16 (int8), the
        bits of E8M0 exponents (uint8: ``e + 127``, 255 for NaN) for FP8; None for format
        None.
      value_scales: as `key_scales`.
      format: ``"int8"``, ``"fp8"`` or None.
      dtype: the compute dtype: keys and values are read back, and attention computed, in it.
      block_size: values per scale along ``head_dim``.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmp
      >>> cache = jaxmp.KVCache.create((2, 128, 4, 64), "int8", dtype=jnp.bfloat16)
      >>> k = v = jnp.ones((2, 5, 4, 64), jnp.bfloat16)  # a prompt of 5 positions
      >>> cache = cache.update(k, v, 0)
      >>> q = jnp.ones((2, 1, 4, 64), jnp.bfloat16)
      >>> cache.attend(q, 4).shape  # the query at position 4 sees positions 0 to 4
      (2, 1, 4, 64)
      >>> cache.nbytes / jaxmp.KVCache.create((2, 128, 4, 64), None).nbytes
      0.515625
    """

    keys: jax.Array
    values: jax.Array
    key_scales: jax.Array | None
    value_scales: jax.Array | None
    format: str | None
    dtype: Any
    block_size: int

    def __post_init__(self) -> None:
        _check_format(self.format)

    @classmethod
    def create(
        cls,
        shape: Sequence[int],
        format: str | None,
        *,
        dtype: jax.typing.DTypeLike = "bfloat16",
        block_size: int | None = None,
        sharding: jax.sharding.Sharding | None = None,
    ) -> KVCache:
        """An empty cache (zeros: every scale 1) of `shape`.

        Args:
          shape: ``(*batch, max_len, heads, head_dim)``: any leading axes (a batch, or layers
            and a batch, for a cache scanned over with the layers).
          format: ``"int8"``, ``"fp8"``, or None (keys and values stored in `dtype`).
          dtype: the compute dtype, float16, bfloat16 or float32.
          block_size: values per scale along ``head_dim`` (a divisor of it); default
            ``head_dim``, one scale per head and position.
          sharding: where to place every array (a ``NamedSharding`` over the batch and heads
            axes; the scales have the keys' rank and axes, ``head_dim // block_size`` last).

        Raises:
          ValueError: a misspelt format (listing the formats), a dtype that is not floating,
            a block size that does not divide ``head_dim``, a shape of fewer than 3 axes.
        """
        _check_format(format)
        try:
            dims = tuple(operator.index(d) for d in shape)
        except TypeError:
            dims = ()
        if len(dims) < 3 or min(dims) < 1:
            raise ValueError(
                f"`shape` must be (*batch, max_len, heads, head_dim) of positive sizes, "
                f"got {tuple(shape)!r}."
            )
        dt: np.dtype | None
        try:
            dt = jnp.dtype(dtype)
        except TypeError:
            dt = None
        if dt is None or not jnp.issubdtype(dt, jnp.floating) or dt.itemsize < 2:
            raise ValueError(
                f"`dtype` must be a floating dtype (float16, bfloat16, float32), got {dtype!r}."
            )
        head_dim = dims[-1]
        if format is None:
            if block_size is not None:
                raise ValueError(
                    "`block_size` applies to the quantised formats ('int8', 'fp8'), not to "
                    "format None."
                )
            keys = jnp.zeros(dims, dt, device=sharding)
            values = jnp.zeros(dims, dt, device=sharding)
            return cls(keys, values, None, None, None, dt, head_dim)
        size = head_dim if block_size is None else block_size
        try:
            size = -1 if isinstance(size, bool) else operator.index(size)
        except TypeError:
            size = -1
        if size < 1 or head_dim % size:
            raise ValueError(
                f"`block_size` must be a positive divisor of head_dim {head_dim}, got "
                f"{block_size!r}."
            )
        values_dtype, scales_dtype = FORMATS[format]
        scales_shape = (*dims[:-1], head_dim // size)
        # A scale of 1 as stored: bfloat16's 1, or E8M0's exponent 0 (bits 127).
        one = _store(jnp.ones((), _MEANING[format][1]), scales_dtype)

        def zeros(shape: tuple[int, ...], kind: Any) -> jax.Array:
            return jnp.zeros(shape, kind, device=sharding)

        def ones(shape: tuple[int, ...]) -> jax.Array:
            return jnp.full(shape, one, scales_dtype, device=sharding)

        return cls(
            zeros(dims, values_dtype),
            zeros(dims, values_dtype),
            ones(scales_shape),
            ones(scales_shape),
            format,
            dt,
            size,
        )

    @property
    def shape(self) -> tuple[int, ...]:
        """``(*batch, max_len, heads, head_dim)``."""
        return tuple(self.keys.shape)

    @property
    def nbytes(self) -> int:
        """Bytes stored: keys, values and their scales."""
        return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(self))

    def update(self, keys: jax.Array, values: jax.Array, pos: jax.typing.ArrayLike) -> KVCache:
        """The cache with `keys` and `values` written at positions ``pos, pos + 1, ...``.

        Each (position, head) vector is quantised alone, so writing a prompt at once or one
        position at a time stores the same bits.

        Args:
          keys: ``(*batch, L, heads, head_dim)``, floating (any dtype: quantised from float32,
            or for format None converted to the cache's dtype).
          values: the same shape.
          pos: the first position written, an integer scalar (traced or not). As with
            ``lax.dynamic_update_slice``, a write past ``max_len`` is moved back to end at
            ``max_len``: keep ``pos + L <= max_len``. For a position per sequence, map over
            the batch: ``jax.vmap(lambda c, k, v, p: c.update(k, v, p))``.

        Returns:
          The new cache (the same structure, shapes and dtypes).

        Raises:
          ValueError: shapes that do not match the cache's; a `pos` that is not a scalar.
          TypeError: keys or values that are not floating.
        """
        *batch, max_len, heads, head_dim = self.shape
        for name, x in (("keys", keys), ("values", values)):
            if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
                raise TypeError(f"`{name}` must be floating, got {jnp.result_type(x)}.")
        k_shape, v_shape = tuple(np.shape(keys)), tuple(np.shape(values))
        if len(k_shape) != len(self.shape) or (
            k_shape[:-3] != tuple(batch) or k_shape[-2:] != (heads, head_dim)
        ):
            expected = ", ".join(str(d) for d in (*batch, "L", heads, head_dim))
            raise ValueError(f"`keys` must have shape ({expected}), got {k_shape}.")
        if v_shape != k_shape:
            raise ValueError(f"`values` must have the shape of `keys`, {k_shape}, got {v_shape}.")
        if k_shape[-3] > max_len:
            raise ValueError(
                f"`keys` and `values` hold at most max_len {max_len} positions, got {k_shape[-3]}."
            )
        if np.ndim(pos) != 0:
            raise ValueError(
                f"`pos` must be a scalar, got shape {np.shape(pos)}; for a position per "
                "sequence, map over the batch with jax.vmap."
            )
        pos = jnp.asarray(pos, jnp.int32)
        axis = len(batch)

        def write(cache: jax.Array, new: jax.Array) -> jax.Array:
            return lax.dynamic_update_slice_in_dim(cache, new, pos, axis)

        if self.format is None:
            return dataclasses.replace(
                self,
                keys=write(self.keys, jnp.asarray(keys).astype(self.dtype)),
                values=write(self.values, jnp.asarray(values).astype(self.dtype)),
            )
        assert self.key_scales is not None and self.value_scales is not None
        kq, ks = self._quantize(jnp.asarray(keys))
        vq, vs = self._quantize(jnp.asarray(values))
        return dataclasses.replace(
            self,
            keys=write(self.keys, kq),
            values=write(self.values, vq),
            key_scales=write(self.key_scales, ks),
            value_scales=write(self.value_scales, vs),
        )

    def read(self) -> tuple[jax.Array, jax.Array]:
        """``(keys, values)`` dequantised in `dtype`, ``(*batch, max_len, heads, head_dim)``.

        Each value times its scale in float32 (exact: an int8 value times a bfloat16 scale,
        an E4M3 value times a power of two), rounded once to `dtype`. To attend without
        these full-size copies, use `attend`.
        """
        if self.format is None:
            return self.keys, self.values
        assert self.key_scales is not None and self.value_scales is not None
        return (
            self._dequantize(self.keys, self.key_scales),
            self._dequantize(self.values, self.value_scales),
        )

    def attend(
        self, query: jax.Array, pos: jax.typing.ArrayLike, *, scale: float | None = None
    ) -> jax.Array:
        """Causal attention of `query` over the cache.

        Query row ``i`` sits at position ``pos + i`` and sees the cached positions up to
        it. The products are computed in `dtype` with float32 accumulation on the stored
        values, the scales applied outside them (to the scores, and to the probabilities
        before the product with the values), so no dequantised copy of the cache is made;
        scores and softmax are float32.

        Args:
          query: ``(*batch, L, query_heads, head_dim)``; ``query_heads`` a multiple of the
            cache's heads (grouped-query attention: consecutive query heads share one
            key/value head).
          pos: the position of the first query row, an integer scalar (traced or not).
          scale: of the scores; default ``1 / sqrt(head_dim)``.

        Returns:
          ``(*batch, L, query_heads, head_dim)`` in `dtype`.

        Raises:
          ValueError: a query whose batch axes, heads or head_dim do not match the cache's.
        """
        *batch, max_len, heads, head_dim = self.shape
        q_shape = tuple(np.shape(query))
        if len(q_shape) != len(self.shape) or q_shape[:-3] != tuple(batch):
            raise ValueError(
                f"`query` must have shape ({', '.join(map(str, batch))}, L, query_heads, "
                f"{head_dim}), got {q_shape}."
            )
        length, q_heads, q_dim = q_shape[-3:]
        if q_dim != head_dim or q_heads % heads:
            raise ValueError(
                f"`query` must have a multiple of the cache's {heads} heads and head_dim "
                f"{head_dim}, got {q_heads} heads of {q_dim}."
            )
        if np.ndim(pos) != 0:
            raise ValueError(f"`pos` must be a scalar, got shape {np.shape(pos)}.")
        groups = q_heads // heads
        blocks = head_dim // self.block_size
        dtype = self.dtype
        q = jnp.asarray(query).astype(dtype)
        q = q.reshape(*batch, length, heads, groups, blocks, self.block_size)
        keys = self.keys.reshape(*batch, max_len, heads, blocks, self.block_size)
        values = self.values.reshape(*batch, max_len, heads, blocks, self.block_size)
        # Scores per block: (*batch, heads, groups, L, max_len, blocks), float32.
        scores = jnp.einsum(
            "...qhgbd,...khbd->...hgqkb",
            q,
            self._values(keys).astype(dtype),
            preferred_element_type=_F32,
        )
        if self.key_scales is not None:
            scores = scores * _by_head(self._scales(self.key_scales))
        scores = jnp.sum(scores, axis=-1)
        scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        scores = scores * jnp.asarray(scale, _F32)
        positions = jnp.asarray(pos, jnp.int32) + jnp.arange(length, dtype=jnp.int32)
        visible = jnp.arange(max_len, dtype=jnp.int32)[None, :] <= positions[:, None]
        scores = jnp.where(visible, scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)  # (*batch, heads, groups, L, max_len)
        if self.value_scales is None:
            weights = probs[..., None]
            top = None
        else:
            # The value scales folded into the probabilities, each query row then divided by
            # its largest weight, so that the weights cast to `dtype` are at most 1 and never
            # underflow (a float16 scale of a small value, times a probability, would); the
            # row is multiplied back in float32. A masked position weighs 0 even when its
            # scale is NaN.
            weights = probs[..., None] * _by_head(self._scales(self.value_scales))
            weights = jnp.where(visible[..., None], weights, jnp.zeros((), _F32))
            top = jnp.max(weights, axis=(-2, -1), keepdims=True)
            weights = weights / jnp.where(top > 0, top, jnp.ones((), _F32))
        out = jnp.einsum(
            "...hgqkb,...khbd->...qhgbd",
            weights.astype(dtype),
            self._values(values).astype(dtype),
            preferred_element_type=_F32,
        )
        if top is not None:
            # (*batch, heads, groups, L, 1, 1) -> (*batch, L, heads, groups, 1, 1)
            top = jnp.moveaxis(top[..., 0], -2, len(batch))[..., None]
            out = out * jnp.where(top > 0, top, jnp.ones((), _F32))
        return out.reshape(*batch, length, q_heads, head_dim).astype(dtype)

    def __repr__(self) -> str:
        fmt = "None" if self.format is None else repr(self.format)
        return (
            f"KVCache({fmt}, shape={self.shape}, dtype={jnp.dtype(self.dtype).name}, "
            f"block_size={self.block_size})"
        )

    # --- quantisation ------------------------------------------------------------------------

    def _quantize(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`x` (``(..., head_dim)``) as the format's values and one scale per block."""
        blocks = x.shape[-1] // self.block_size
        x = x.astype(_F32).reshape(*x.shape[:-1], blocks, self.block_size)
        finite = jnp.isfinite(x)
        x = jnp.where(finite, x, jnp.zeros((), _F32))
        # No NaN reaches the maximum: XLA:CPU's vectorised float maximum may skip one.
        amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
        bad = jnp.logical_not(jnp.all(finite, axis=-1, keepdims=True))
        largest = float(jnp.finfo(self.dtype).max)
        if self.format == "int8":
            stored = q_lib.over_qmax(amax, _INT8_MAX).astype(_BF16)
            # At least bfloat16's smallest normal number (an amax of 0, or below 1e-36).
            stored = jnp.maximum(stored, jnp.asarray(jnp.finfo(_BF16).tiny, _BF16))
            scale = stored.astype(_F32)
            # Saturate where 127 steps would pass the dtype's largest value (float16's 65504
            # with a scale of 516): a finite value stays finite.
            limit = jnp.minimum(jnp.floor(jnp.float32(largest) / scale), _INT8_MAX)
            q = jnp.clip(jnp.round(x / scale), -limit, limit).astype(jnp.int8)
            nan = jnp.asarray(jnp.nan, _BF16)
            return _merge(q), _merge(jnp.where(bad, nan, stored))
        exponent = fp8_scaling.mx_exponent(amax, _E4M3)  # amax / 2**exponent <= 448
        limit = fp8_scaling.finite_limit(-exponent, _E4M3, _F32, self.dtype)
        y = jnp.clip(jnp.ldexp(x, -exponent), -limit, limit)
        stored = jnp.ldexp(jnp.float32(1.0), exponent)
        stored = jnp.where(bad, jnp.float32(jnp.nan), stored).astype(_E8M0)
        return _merge(_store(y.astype(_E4M3), _U8)), _merge(_store(stored, _U8))

    def _values(self, stored: jax.Array) -> jax.Array:
        """Stored values as what they are: int8, E4M3 (from their bits), or `dtype`."""
        if self.format is None:
            return stored
        return _store(stored, _MEANING[self.format][0])

    def _scales(self, stored: jax.Array) -> jax.Array:
        """Stored scales in float32 (bfloat16, or E8M0 from its bits)."""
        assert self.format is not None
        return _store(stored, _MEANING[self.format][1]).astype(_F32)

    def _dequantize(self, q: jax.Array, scales: jax.Array) -> jax.Array:
        blocks = scales.shape[-1]
        q = self._values(q).reshape(*q.shape[:-1], blocks, self.block_size)
        x = q.astype(_F32) * self._scales(scales)[..., None]
        return _merge(x).astype(self.dtype)


def _store(x: jax.Array, dtype: Any) -> jax.Array:
    """`x` reinterpreted as `dtype` of the same width (FP8 as its bits and back), or `x`."""
    return x if x.dtype == dtype else lax.bitcast_convert_type(x, dtype)


def _merge(x: jax.Array) -> jax.Array:
    """The last axis of `x` merged into the one before it (blocks back into ``head_dim``), or
    for scales of shape ``(..., blocks, 1)``, that axis dropped."""
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def _by_head(scales: jax.Array) -> jax.Array:
    """Scales ``(*batch, max_len, heads, blocks)`` laid out to multiply the scores
    ``(*batch, heads, groups, L, max_len, blocks)``."""
    moved = jnp.moveaxis(scales, -2, -3)  # (*batch, heads, max_len, blocks)
    return moved[..., None, None, :, :]
