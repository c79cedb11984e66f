"""`compress_state`: an optimizer's moments stored in bfloat16 or 8 bits between steps.

Adam keeps two float32 moments per parameter: 8 of the 12 bytes of float32 training. Stored
in bfloat16 they take 4; block-quantised to 8 bits with one float32 scale per block, about 2
(Dettmers et al., 2022, "8-bit Optimizers via Block-wise Quantization", arXiv 2110.02861).
Each step decompresses them to float32, runs the optimizer, and compresses the new ones,
rounding stochastically so that the small changes an exponential moving average makes
(``0.001 * g**2`` for Adam's second moment) are not rounded away.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmp._src import dtypes
from jaxmp._src.loss_scaling import as_transformation
from jaxmp._src.stochastic_rounding import (
    TAG_STATE,
    check_seed,
    next_keys,
    random_bits,
    round_with_bits,
    seed_key,
)

#: The storage formats, by canonical name.
FORMATS = ("float32", "bfloat16", "int8", "fp8")
_FORMAT_NAMES = {
    "float32": "float32",
    "f32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "int8": "int8",
    "fp8": "fp8",
    "float8_e4m3fn": "fp8",
    "e4m3": "fp8",
}
_STORED_DTYPE = {
    "bfloat16": jnp.dtype(jnp.bfloat16),
    "int8": jnp.dtype(jnp.int8),
    "fp8": jnp.dtype(jnp.float8_e4m3fn),
}
# The largest stored magnitude: a block's largest value is scaled to it.
_LEVEL = {"int8": 127.0, "fp8": float(jnp.finfo(jnp.float8_e4m3fn).max)}
#: The names of state fields that hold second moments in optax's states: Adam's, AdamW's,
#: Lion's absence of one, AMSGrad's ``nu_max``, RMSProp's ``nu``, Adagrad's
#: ``sum_of_squares``, AdaDelta's ``e_g`` and ``e_x``.
SECOND_MOMENT_NAMES: tuple[str, ...] = ("nu", "nu_max", "sum_of_squares", "e_g", "e_x")


def parse_format(value: Any, *, arg: str) -> str:
    """The canonical name of a storage format (a name or a dtype); errors name `arg`."""
    if not isinstance(value, str):
        try:
            value = jnp.dtype(value).name
        except TypeError:
            raise TypeError(
                f"`{arg}` must be a storage format name ({', '.join(map(repr, FORMATS))}), "
                f"got {value!r}."
            ) from None
    token = value.strip().lower()
    if token in _FORMAT_NAMES:
        return _FORMAT_NAMES[token]
    raise ValueError(
        f"`{arg}` must be one of {', '.join(map(repr, FORMATS))} (or "
        f"{', '.join(repr(n) for n in _FORMAT_NAMES if n not in FORMATS)}), got {value!r}."
        f"{dtypes.did_you_mean(token, _FORMAT_NAMES)}"
    )


def _layout(shape: tuple[int, ...], block_size: int) -> tuple[tuple[int, ...], int, int, int]:
    """``(rows, n, block, blocks)``: how a leaf of `shape` is cut into blocks.

    A leaf of two or more dimensions is a row per index of its first dimension, each of
    the ``n`` elements of the others; a vector or scalar is one row. Each row is cut into
    ``blocks`` blocks of ``block`` elements (``block_size``, or ``n`` if smaller), the last
    zero-padded. The first dimension, the one sharded most often, is never reshaped.
    """
    rows: tuple[int, ...] = ()
    n = math.prod(shape)
    if len(shape) >= 2:
        rows, n = (shape[0],), math.prod(shape[1:])
    block = max(1, min(block_size, n))
    return rows, n, block, -(-n // block)


def _blocked(x: jax.Array, layout: tuple[tuple[int, ...], int, int, int]) -> jax.Array:
    rows, n, block, blocks = layout
    x = jnp.reshape(x, (*rows, n))
    if blocks * block != n:
        x = jnp.pad(x, [(0, 0)] * len(rows) + [(0, blocks * block - n)])
    return jnp.reshape(x, (*rows, blocks, block))


def _unblocked(
    x: jax.Array, shape: tuple[int, ...], layout: tuple[tuple[int, ...], int, int, int]
) -> jax.Array:
    rows, n, block, blocks = layout
    x = jnp.reshape(x, (*rows, blocks * block))
    if blocks * block != n:
        x = x[..., :n]
    return jnp.reshape(x, shape)


def _block_absmax(blocks: jax.Array) -> jax.Array:
    """The largest magnitude of each block (the last axis), reading the blocks once.

    The magnitudes are compared as int32 (the bits of non-negative floats order like the
    floats; NaN above inf above the rest), at most 32 at a time: XLA:CPU runs a float
    reduction, or one over more than 32 elements, as a separate step whose input, the
    whole new float32 state, is written out and read back (3.8 float32 copies of the state
    for a quantised moment, against 1.8 this way). The barrier keeps XLA from merging the
    two steps back into one.
    """
    i32 = jnp.dtype(jnp.int32)
    bits = jax.lax.bitcast_convert_type(jnp.abs(blocks), i32)
    size = blocks.shape[-1]
    if size > 32:
        row = max(d for d in range(1, 33) if size % d == 0)
        bits = jnp.max(jnp.reshape(bits, (*blocks.shape[:-1], size // row, row)), axis=-1)
        bits = jax.lax.optimization_barrier(bits)
    return jax.lax.bitcast_convert_type(jnp.max(bits, axis=-1), jnp.float32)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=("scales",),
    meta_fields=("index", "format", "dtype", "second_moment", "block_size"),
)
@dataclasses.dataclass(frozen=True)
class CompressedLeaf:
    """How one leaf of the inner state is stored between steps (`compress_state`).

    The stored values themselves stay in the inner state, in the leaf's place and
    shape (bfloat16, int8 or float8_e4m3fn); this holds the rest: the scales, as
    data, and the format, static.

    Attributes:
      scales: for the 8-bit formats, one float32 scale per block (the block's
        largest magnitude over 127 for int8, over 448 for fp8), of shape
        ``(blocks,)`` for a vector and ``(rows, blocks)`` otherwise; None for bfloat16.
      index: the leaf's position among the inner state's leaves (`jax.tree.leaves`).
      format: ``"bfloat16"``, ``"int8"`` or ``"fp8"``.
      dtype: the dtype it decompresses to.
      second_moment: whether the 8-bit values hold the signed square root of the
        leaf (see `compress_state`).
      block_size: the number of elements per block (at most).
    """

    scales: jax.Array | None
    index: int
    format: str
    dtype: np.dtype
    second_moment: bool
    block_size: int

    def decompress(self, values: jax.Array) -> jax.Array:
        """The leaf, in `dtype`, from its stored `values`."""
        if self.format == "bfloat16":
            return values.astype(self.dtype)
        shape = jnp.shape(values)
        layout = _layout(shape, self.block_size)
        assert self.scales is not None  # the 8-bit formats always have scales
        blocks = _blocked(values.astype(jnp.float32), layout) * self.scales[..., None]
        x = _unblocked(blocks, shape, layout)
        if self.second_moment:
            x = x * jnp.abs(x)
        return x.astype(self.dtype)


def compress(
    x: jax.Array,
    fmt: str,
    *,
    second_moment: bool,
    block_size: int,
    words: jax.Array,
) -> tuple[jax.Array, jax.Array | None]:
    """`x` stored in `fmt` ("bfloat16", "int8" or "fp8"): ``(values, scales)``.

    Rounded stochastically, with the random bits of two uint32 `words` (`random_bits`).
    """
    x = jnp.asarray(x).astype(jnp.float32)
    shape = jnp.shape(x)
    if fmt == "bfloat16":
        return round_with_bits(x, jnp.bfloat16, random_bits(words, shape)), None
    layout = _layout(shape, block_size)
    blocks = _blocked(x, layout)
    absmax = _block_absmax(blocks)
    if second_moment:
        # Adam's second moment spans many decades within a block; its square root half
        # as many, which 8 bits resolve better (a block's largest value over 127 levels
        # keeps sqrt(nu) down to 1/127 of the largest, nu down to 1/16129 of it). The
        # square root is monotone: the blocks' maxima are taken first, on `x` itself.
        blocks = jnp.sign(blocks) * jnp.sqrt(jnp.abs(blocks))
        absmax = jnp.sqrt(absmax)
    level = np.float32(_LEVEL[fmt])
    scales = absmax / level
    safe = jnp.where(absmax > 0, absmax, np.float32(1))
    t = jnp.clip(blocks * (level / safe)[..., None], -level, level)
    bits = random_bits(words, blocks.shape)
    if fmt == "int8":
        low = jnp.floor(t)
        uniform = (bits >> np.uint32(8)).astype(jnp.float32) * np.float32(2.0**-24)
        q = low + (uniform < t - low).astype(jnp.float32)
        if second_moment:
            # A second moment rounded to 0 would make Adam divide the first moment by
            # eps alone: the smallest nonzero value is kept instead (Li et al., 2023,
            # "Memory Efficient Optimizers with 4-bit States", arXiv 2309.01507).
            q = jnp.where((q == 0) & (blocks != 0), jnp.sign(blocks), q)
        stored = jnp.clip(q, -level, level).astype(jnp.int8)
    else:
        stored = round_with_bits(t, jnp.float8_e4m3fn, bits)
        if second_moment:
            tiny = float(jnp.finfo(jnp.float8_e4m3fn).smallest_subnormal)
            kept = (jnp.sign(blocks) * tiny).astype(stored.dtype)
            stored = jnp.where((stored == 0) & (blocks != 0), kept, stored)
    return _unblocked(stored, shape, layout), scales


class CompressStateState(NamedTuple):
    """State of `compress_state`.

    Attributes:
      key: the PRNG key of the next step's rounding, as raw threefry key data.
      inner_state: the wrapped transformation's state, each compressed leaf holding
        its stored values (bfloat16, int8 or float8_e4m3fn, in its own shape).
      compressed: a `CompressedLeaf` per compressed leaf: its scales and format.
    """

    key: jax.Array  # shape=(2,), dtype=uint32
    inner_state: Any
    compressed: tuple[CompressedLeaf, ...]


def decompressed(state: CompressStateState) -> Any:
    """The inner state of `state` with every compressed leaf decompressed: optax's own."""
    leaves, treedef = jax.tree.flatten(state.inner_state)
    for leaf in state.compressed:
        leaves[leaf.index] = leaf.decompress(leaves[leaf.index])
    return jax.tree.unflatten(treedef, leaves)


def _compress_leaves(
    key_data: jax.Array, leaves: list[Any], chosen: Sequence[CompressedLeaf]
) -> tuple[jax.Array, tuple[CompressedLeaf, ...]]:
    """Compresses ``leaves[c.index]`` in place for each of `chosen`; the next key and scales."""
    key, values, scales = _compress_all(key_data, [leaves[c.index] for c in chosen], chosen)
    for c, v in zip(chosen, values, strict=True):
        leaves[c.index] = v
    return key, tuple(dataclasses.replace(c, scales=s) for c, s in zip(chosen, scales, strict=True))


def _compress_all(
    key_data: jax.Array, xs: list[jax.Array], chosen: Sequence[CompressedLeaf]
) -> tuple[jax.Array, list[jax.Array], list[jax.Array | None]]:
    key, keys = next_keys(key_data, len(chosen))
    values, scales = [], []
    for x, c, leaf_key in zip(xs, chosen, keys, strict=True):
        v, s = compress(
            x, c.format, second_moment=c.second_moment, block_size=c.block_size, words=leaf_key
        )
        values.append(v)
        scales.append(s)
    return key, values, scales


# `init` is often called outside `jax.jit`: compiled once, the compression costs one
# compilation instead of one per operation and leaf shape.
_compress_all_jit = jax.jit(_compress_all, static_argnums=2)


def _names(path: Sequence[Any]) -> set[str]:
    names = set()
    for key in path:
        for attr in ("name", "key"):
            value = getattr(key, attr, None)
            if isinstance(value, str):
                names.add(value)
    return names


def _check_names(names: object) -> tuple[str, ...]:
    if isinstance(names, str) or not (
        isinstance(names, Sequence) and all(isinstance(n, str) for n in names)
    ):
        raise TypeError(
            f"`second_moment_names` must be a sequence of field names (strings), got {names!r}."
        )
    return tuple(names)


def _check_block_size(block_size: object) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise TypeError(f"`block_size` must be a positive int, got {block_size!r}.")
    if block_size < 1:
        raise ValueError(f"`block_size` must be a positive int, got {block_size!r}.")
    return int(block_size)


def compress_state(
    inner: optax.GradientTransformation,
    first_moment: str = "bfloat16",
    second_moment: str | None = None,
    *,
    block_size: int = 256,
    second_moment_names: Sequence[str] = SECOND_MOMENT_NAMES,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """Stores `inner`'s state in bfloat16 or 8 bits between steps.

    Every floating-point state leaf of at least one dimension shaped like a param
    (Adam's moments, a momentum trace) is stored in a compressed format, and
    decompressed to float32 inside `update`, where `inner` runs as usual; scalars
    (counts, injected hyperparameters) and leaves of other shapes are kept as they
    are. Second moments (leaves under a field named in `second_moment_names`:
    optax's ``nu``, ``nu_max``, ``sum_of_squares``, ``e_g``, ``e_x``) take the
    `second_moment` format, every other compressed leaf the `first_moment` one.

    Formats:

    * ``"float32"``: kept as `inner` makes it (no compression).
    * ``"bfloat16"``: 2 bytes, rounded stochastically (`jaxmp.stochastic_round`):
      an Adam second moment moving by 0.1% a step, far below bfloat16's 0.4%
      spacing, would never move with round-to-nearest.
    * ``"int8"``: 1 byte and one float32 scale per block of `block_size`
      elements of a row (the row being all but the first dimension); values are
      rounded stochastically to 255 levels between minus and plus the block's
      largest magnitude.
    * ``"fp8"``: 1 byte as float8_e4m3fn, the block's largest magnitude scaled to
      448, rounded stochastically: relative rather than absolute resolution.

    In the 8-bit formats, second moments are stored as their signed square root,
    which halves their span of magnitudes, and never rounded to zero when they are
    not (Adam would divide by eps alone): 8-bit Adam's reason for a dynamic code.

    The stored values stay in the inner state, in each leaf's place and shape
    (an int8 array where Adam's float32 moment was), so the state keeps optax's
    structure; the scales and formats are in `CompressStateState.compressed`.
    `jaxmp.inner_state` gives the decompressed optax state. The random key is in
    the state (`CompressStateState.key`) and split every step, like
    `jaxmp.stochastic_rounding`'s.

    Args:
      inner: the optax transformation whose state to store compressed.
      first_moment: the format of first moments and every other compressed leaf.
      second_moment: the format of second moments; default: `first_moment`.
      block_size: elements per block of the 8-bit formats (at most: a row shorter
        than it is one block).
      second_moment_names: the state field names (attribute or dict key anywhere on
        a leaf's path) that mark a second moment.
      seed: the seed of the PRNG key.

    Returns:
      An `optax.GradientTransformationExtraArgs` with a `CompressStateState`.

    Raises:
      TypeError / ValueError: for a bad argument, naming it and the valid choices.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxmp
      >>> tx = jaxmp.compress_state(optax.adam(1e-3), "bfloat16", "int8")
      >>> state = tx.init({"w": jnp.ones((4, 512))})
      >>> adam = state.inner_state[0]
      >>> adam.mu["w"].dtype, adam.nu["w"].dtype, state.compressed[1].scales.shape
      (dtype(bfloat16), dtype('int8'), (4, 2))
      >>> updates, state = jax.jit(tx.update)({"w": jnp.ones((4, 512))}, state)
      >>> jaxmp.inner_state(state)[0].nu["w"][0, 0]  # 0.001 * 1**2, decompressed
      Array(0.001, dtype=float32)
    """
    inner = as_transformation(inner)
    first = parse_format(first_moment, arg="first_moment")
    second = first if second_moment is None else parse_format(second_moment, arg="second_moment")
    block_size = _check_block_size(block_size)
    names = set(_check_names(second_moment_names))
    seed = check_seed(seed)

    def init_fn(params):
        inner_state = inner.init(params)
        shapes = {
            jnp.shape(p)
            for p in jax.tree.leaves(params)
            if dtypes.is_floating(p) and jnp.ndim(p) >= 1
        }
        with_path, treedef = jax.tree_util.tree_flatten_with_path(inner_state)
        chosen = []
        for i, (path, x) in enumerate(with_path):
            if dtypes.is_floating(x) and jnp.ndim(x) >= 1 and jnp.shape(x) in shapes:
                is_second = bool(_names(path) & names)
                fmt = second if is_second else first
                if fmt != "float32":
                    chosen.append(
                        CompressedLeaf(
                            None, i, fmt, dtypes.compute_dtype_of(x), is_second, block_size
                        )
                    )
        leaves = [x for _, x in with_path]
        xs = [leaves[c.index] for c in chosen]
        key, values, scales = _compress_all_jit(seed_key(seed, TAG_STATE), xs, tuple(chosen))
        compressed = []
        for c, v, s in zip(chosen, values, scales, strict=True):
            leaves[c.index] = v
            compressed.append(dataclasses.replace(c, scales=s))
        return CompressStateState(
            key=key, inner_state=jax.tree.unflatten(treedef, leaves), compressed=tuple(compressed)
        )

    def update_fn(updates, state, params=None, **extra_args):
        new_updates, new_inner = inner.update(updates, decompressed(state), params, **extra_args)
        treedef = jax.tree.structure(state.inner_state)
        leaves, new_def = jax.tree.flatten(new_inner)
        if new_def != treedef:
            raise ValueError(
                "`inner`'s update must return a state of the structure its init made, got "
                f"{new_def} for {treedef}."
            )
        key, compressed = _compress_leaves(state.key, leaves, state.compressed)
        return new_updates, CompressStateState(
            key=key, inner_state=jax.tree.unflatten(treedef, leaves), compressed=compressed
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
