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
import importlib
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmp._src import dtypes, staging
from jaxmp._src.loss_scaling import as_transformation
from jaxmp._src.stochastic_rounding import (
    TAG_STATE,
    check_param_specs,
    check_seed,
    hash_bits,
    next_keys,
    normalize_spec,
    random_bits,
    round_with_bits,
    seed_key,
    shard_offsets,
    specs_of,
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
#: What a field of an optimizer's state holds (`compress_state`'s ``moment_fields``):
#: a first moment (signed: stored as it is), a second moment (non-negative and a divisor:
#: stored as its square root in 8 bits, never rounded to zero), a leaf to keep as it is, or
#: a nested optimizer state, classified by its own type.
FIRST, SECOND, KEEP, INNER = "first", "second", "keep", "inner"
ROLES = (FIRST, SECOND, KEEP, INNER)

# optax's state types, by module and name (the fields are the same in optax 0.2.5 to 0.2.8;
# `tests/test_compress_state.py` checks that every field of every type is listed). A type an
# installed optax lacks is left out. Leaves that only track the params or the gradients
# themselves (L-BFGS's memory, schedule-free's `z`, accumulated gradients) are kept: they are
# not moments, and rounding them is rounding the params.
_OPTAX_STATE_FIELDS: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("optax", "ScaleByAdamState", {"count": KEEP, "mu": FIRST, "nu": SECOND}),
    ("optax", "ScaleByAmsgradState", {"count": KEEP, "mu": FIRST, "nu": SECOND, "nu_max": SECOND}),
    ("optax", "ScaleByBeliefState", {"count": KEEP, "mu": FIRST, "nu": SECOND}),
    ("optax", "ScaleByLionState", {"count": KEEP, "mu": FIRST}),
    ("optax", "ScaleByRmsState", {"nu": SECOND}),
    ("optax._src.transform", "ScaleByRmsWithCountState", {"count": KEEP, "nu": SECOND}),
    ("optax", "ScaleByRStdDevState", {"mu": FIRST, "nu": SECOND}),
    (
        "optax._src.transform",
        "ScaleByRStdDevWithCountState",
        {"count": KEEP, "mu": FIRST, "nu": SECOND},
    ),
    ("optax", "ScaleByRssState", {"sum_of_squares": SECOND}),
    ("optax", "ScaleByAdaDeltaState", {"e_g": SECOND, "e_x": SECOND}),
    ("optax", "ScaleByAdanState", {"m": FIRST, "v": FIRST, "n": SECOND, "g": KEEP, "t": KEEP}),
    ("optax", "ScaleByNovogradState", {"count": KEEP, "mu": FIRST, "nu": SECOND}),
    ("optax", "ScaleBySM3State", {"mu": FIRST, "nu": SECOND}),
    # Adafactor: the factored second moment's rows and columns, or the whole one.
    ("optax", "FactoredState", {"count": KEEP, "v_row": SECOND, "v_col": SECOND, "v": SECOND}),
    ("optax", "TraceState", {"trace": FIRST}),
    ("optax", "EmaState", {"count": KEEP, "ema": FIRST}),
    ("optax", "ScaleByRpropState", {"step_sizes": KEEP, "prev_updates": KEEP}),
    ("optax", "ScaleByScheduleState", {"count": KEEP}),
    ("optax", "AddNoiseState", {"count": KEEP, "rng_key": KEEP}),
    ("optax", "ZeroNansState", {"found_nan": KEEP}),
    ("optax", "ApplyEvery", {"count": KEEP, "grad_acc": KEEP}),
    (
        "optax",
        "ScaleByLBFGSState",
        {
            "count": KEEP,
            "params": KEEP,
            "updates": KEEP,
            "diff_params_memory": KEEP,
            "diff_updates_memory": KEEP,
            "weights_memory": KEEP,
        },
    ),
    (
        "optax",
        "MultiStepsState",
        {
            "mini_step": KEEP,
            "gradient_step": KEEP,
            "inner_opt_state": INNER,
            "acc_grads": KEEP,
            "skip_state": INNER,
        },
    ),
    ("optax", "InjectHyperparamsState", {"count": KEEP, "hyperparams": KEEP, "inner_state": INNER}),
    (
        "optax",
        "InjectStatefulHyperparamsState",
        {"count": KEEP, "hyperparams": KEEP, "hyperparams_states": INNER, "inner_state": INNER},
    ),
    ("optax", "MaskedState", {"inner_state": INNER}),
    ("optax", "PartitionState", {"inner_states": INNER}),
    (
        "optax",
        "ApplyIfFiniteState",
        {
            "notfinite_count": KEEP,
            "last_finite": KEEP,
            "total_notfinite": KEEP,
            "inner_state": INNER,
        },
    ),
    ("optax", "ConditionallyMaskState", {"step": KEEP, "inner_state": INNER}),
    ("optax", "ConditionallyTransformState", {"inner_state": INNER, "step": KEEP}),
    ("optax", "LookaheadState", {"fast_state": INNER, "steps_since_sync": KEEP}),
    (
        "optax.contrib",
        "ScheduleFreeState",
        {
            "b1": KEEP,
            "weight_sum": KEEP,
            "step_count": KEEP,
            "max_lr": KEEP,
            "base_optimizer_state": INNER,
            "z": KEEP,
        },
    ),
    ("optax.contrib", "MuonState", {"count": KEEP, "mu": FIRST, "ns_coeffs": KEEP}),
    (
        "optax.contrib",
        "SophiaState",
        {"count": KEEP, "mu": FIRST, "nu": SECOND, "hessian_fn_state": INNER},
    ),
    (
        "optax.contrib",
        "ScaleByAdemamixState",
        {"count": KEEP, "count_m2": KEEP, "m1": FIRST, "m2": FIRST, "nu": SECOND},
    ),
)


def _optax_state_fields() -> dict[type, dict[str, str]]:
    table = {}
    for module_name, name, fields in _OPTAX_STATE_FIELDS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # pragma: no cover - every supported optax has these modules
            continue
        cls = getattr(module, name, None)
        if isinstance(cls, type):
            table[cls] = dict(fields)
    return table


#: The fields of optax's state types (first moments, second moments, kept leaves, nested
#: states), by type: how `compress_state` tells Adam's ``mu`` from its ``nu``, Adafactor's
#: ``v`` from a momentum. Extended or overridden by its ``moment_fields`` argument.
OPTAX_STATE_FIELDS: dict[type, dict[str, str]] = _optax_state_fields()


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


def _blocked_index(
    shape: tuple[int, ...],
    layout: tuple[tuple[int, ...], int, int, int],
    spec: tuple[tuple[str, ...], ...] | None,
) -> jax.Array:
    """The index in the whole leaf of each element of its blocks (uint32), for random bits.

    ``row * n + position in the row``, computed on the blocked shape (a padded position
    takes the index of the element after its row's end: its value, 0, rounds to 0 with any
    bits). Inside `jax.shard_map` with the leaf's `spec`, the row and the position are those
    in the whole leaf (`stochastic_rounding.element_index`), so that a sharded leaf draws
    the bits the unsharded one would.
    """
    rows, n, block, blocks = layout
    u32 = jnp.dtype(jnp.uint32)
    bshape = (*rows, blocks, block)
    position = jax.lax.broadcasted_iota(u32, bshape, len(rows)) * np.uint32(block)
    position = position + jax.lax.broadcasted_iota(u32, bshape, len(rows) + 1)
    inner_shape = shape[len(rows) :]
    row_length = n
    if spec is not None and any(spec):
        offsets, whole = shard_offsets(shape, spec)
        inner_spec, whole_inner = spec[len(rows) :], whole[len(rows) :]
        row_length = math.prod(whole_inner)
        if any(inner_spec):
            # The position's index along each dimension of the row, moved to the whole leaf.
            local, index, stride = position, jnp.zeros(bshape, u32), 1
            for dim in reversed(range(len(inner_shape))):
                size = np.uint32(inner_shape[dim])
                along = local % size + offsets[len(rows) + dim]
                index = index + along * np.uint32(stride % 2**32)
                local = local // size
                stride *= whole_inner[dim]
            position = index
        if rows:
            row = jax.lax.broadcasted_iota(u32, bshape, 0) + offsets[0]
            return row * np.uint32(row_length % 2**32) + position
        return position
    if rows:
        return jax.lax.broadcasted_iota(u32, bshape, 0) * np.uint32(row_length % 2**32) + position
    return position


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=("scales",),
    meta_fields=("index", "format", "dtype", "second_moment", "block_size", "spec"),
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
        ``(blocks,)`` for a vector and ``(rows, blocks)`` otherwise; None for
        bfloat16. Not finite for a block that held a value that was not.
      index: the leaf's position among the inner state's leaves (`jax.tree.leaves`).
      format: ``"bfloat16"``, ``"int8"`` or ``"fp8"``.
      dtype: the dtype it decompresses to.
      second_moment: whether the leaf is a second moment (the 8-bit values hold
        its signed square root; see `compress_state`).
      block_size: the number of elements per block (at most).
      spec: inside `jax.shard_map`, the mesh axes each dimension of the leaf is
        split over (from `compress_state`'s ``param_specs``); None: whole.
    """

    scales: jax.Array | None
    index: int
    format: str
    dtype: np.dtype
    second_moment: bool
    block_size: int
    spec: tuple[tuple[str, ...], ...] | None = None

    def decompress(self, values: jax.Array) -> jax.Array:
        """The leaf, in `dtype`, from its stored `values`.

        A block whose scale is not finite (it held a value that was not) decompresses
        to its scale for a second moment (inf: the moment overflowed; NaN if it held a
        NaN) and to NaN for a first moment, whose signs it no longer has.
        """
        if self.format == "bfloat16":
            return values.astype(self.dtype)
        shape = jnp.shape(values)
        layout = _layout(shape, self.block_size)
        assert self.scales is not None  # the 8-bit formats always have scales
        scales = self.scales[..., None]
        blocks = _blocked(values.astype(jnp.float32), layout) * scales
        if self.second_moment:
            blocks = blocks * jnp.abs(blocks)
            fill = scales
        else:
            fill = jnp.full_like(scales, np.nan)
        blocks = jnp.where(jnp.isfinite(scales), blocks, fill)
        return _unblocked(blocks, shape, layout).astype(self.dtype)


def compress(
    x: jax.Array,
    fmt: str,
    *,
    second_moment: bool,
    block_size: int,
    words: jax.Array,
    spec: tuple[tuple[str, ...], ...] | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """`x` stored in `fmt` ("bfloat16", "int8" or "fp8"): ``(values, scales)``.

    Rounded stochastically, with the random bits of two uint32 `words` (`random_bits`;
    `spec`: the leaf's, inside `jax.shard_map`). A value that is not finite stays so: in
    bfloat16 as itself, in 8 bits as its block's scale (inf or NaN), so that a finiteness
    check of the stored state (`loss_scaling`'s ``check_outputs``) sees it, and the block
    decompresses to values that are not finite (`CompressedLeaf.decompress`).
    """
    x = jnp.asarray(x).astype(jnp.float32)
    shape = jnp.shape(x)
    if fmt == "bfloat16":
        rounded = round_with_bits(x, jnp.bfloat16, random_bits(words, shape, spec))
        # `round_with_bits` saturates inf at bfloat16's largest value, as a param must; an
        # overflowed moment must stay inf, or the check of the step that made it passes.
        return jnp.where(jnp.isfinite(x), rounded, x.astype(jnp.bfloat16)), None
    layout = _layout(shape, block_size)
    blocks = _blocked(x, layout)
    absmax = _block_absmax(blocks)  # inf or NaN for a block holding such a value
    if second_moment:
        # Adam's second moment spans many decades within a block; its square root half
        # as many, which 8 bits resolve better (a block's largest value over 127 levels
        # keeps sqrt(nu) down to 1/127 of the largest, nu down to 1/16129 of it). The
        # square root is monotone: the blocks' maxima are taken first, on `x` itself.
        blocks = jnp.sign(blocks) * jnp.sqrt(jnp.abs(blocks))
        absmax = jnp.sqrt(absmax)
    level = np.float32(_LEVEL[fmt])
    scales = absmax / level
    finite = jnp.isfinite(absmax)[..., None]
    safe = jnp.where(absmax > 0, absmax, np.float32(1))
    # A block that is not finite is stored as zeros; its scale says what it held.
    t = jnp.where(finite, jnp.clip(blocks * (level / safe)[..., None], -level, level), 0)
    bits = hash_bits(words, _blocked_index(shape, layout, spec))
    if fmt == "int8":
        low = jnp.floor(t)
        uniform = (bits >> np.uint32(8)).astype(jnp.float32) * np.float32(2.0**-24)
        q = low + (uniform < t - low).astype(jnp.float32)
        if second_moment:
            # A second moment rounded to 0 would make Adam divide the first moment by
            # eps alone: the smallest nonzero value is kept instead (Li et al., 2023,
            # "Memory Efficient Optimizers with 4-bit States", arXiv 2309.01507).
            q = jnp.where((q == 0) & (blocks != 0) & finite, jnp.sign(blocks), q)
        stored = jnp.clip(q, -level, level).astype(jnp.int8)
    else:
        stored = round_with_bits(t, jnp.float8_e4m3fn, bits)
        if second_moment:
            tiny = float(jnp.finfo(jnp.float8_e4m3fn).smallest_subnormal)
            kept = (jnp.sign(blocks) * tiny).astype(stored.dtype)
            stored = jnp.where((stored == 0) & (blocks != 0) & finite, kept, stored)
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
            x,
            c.format,
            second_moment=c.second_moment,
            block_size=c.block_size,
            words=leaf_key,
            spec=c.spec,
        )
        values.append(v)
        scales.append(s)
    return key, values, scales


# `init` is often called outside `jax.jit`: compiled once, the compression costs one
# compilation instead of one per operation and leaf shape.
_compress_all_jit = jax.jit(_compress_all, static_argnums=2)


_CONTAINERS = (tuple, list, dict)


class _Leaf(NamedTuple):
    """What `_classify` found out about one leaf of an optimizer's state."""

    role: str | None  # FIRST, SECOND or KEEP; None: under no field of a known state type
    path: tuple[Any, ...]  # its path in the state
    owner: tuple[type, str] | None  # the innermost state type around it, and the field
    within: tuple[Any, ...]  # its path within that field: the path of its param


def _children(node: Any) -> list[tuple[tuple[Any, ...], Any]] | None:
    """The children of `node` with their keys, one level down; None for a leaf."""
    pairs = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
    if len(pairs) == 1 and pairs[0][0] == () and pairs[0][1] is node:
        return None
    return pairs


def _field_name(key: Any) -> Any:
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return key


def _classify(state: Any, table: Mapping[type, Mapping[str, str]]) -> list[_Leaf]:
    """The role of every leaf of `state`, in `jax.tree.leaves` order.

    A node whose type is in `table` is split by its fields: each leaf under a FIRST,
    SECOND or KEEP field takes that role; INNER fields, and fields the table does not
    list, are walked as nested states. Other nodes (chains' tuples, dicts of states,
    state types not in the table) are walked through; a leaf reached that way has no role.
    """
    out: list[_Leaf] = []

    def walk(node, path, owner, fields):
        children = _children(node)
        if children is None:
            out.append(_Leaf(None, path, owner, ()))
            return
        typed = type(node) not in _CONTAINERS
        for keys, child in children:
            name = _field_name(keys[0])
            role = fields.get(name, INNER) if fields is not None else INNER
            here = (type(node), name) if typed else owner
            if role == INNER:
                walk(child, path + keys, here, table.get(type(child)))
            else:
                for sub, _ in jax.tree_util.tree_flatten_with_path(child)[0]:
                    out.append(_Leaf(role, path + keys + sub, here, sub))

    walk(state, (), None, table.get(type(state)))
    return out


def _unknown_state_error(leaf: _Leaf) -> ValueError:
    where = jax.tree_util.keystr(leaf.path) or "<root>"
    roles = "'first', 'second', 'keep' or 'inner'"
    if leaf.owner is None:
        return ValueError(
            f"`inner`'s state holds a leaf shaped like a param at {where}, in no state type "
            "(only tuples, lists and dicts around it), so `compress_state` cannot tell whether "
            "it is a first moment, a second moment or something to keep: give the "
            "transformation's state a NamedTuple type and declare its fields with "
            f"`moment_fields={{YourState: {{'field': ...}}}}` ({roles})."
        )
    cls, field = leaf.owner
    return ValueError(
        f"`inner`'s state holds a leaf shaped like a param at {where}, in field {field!r} of "
        f"{cls.__module__}.{cls.__qualname__}, a state type `compress_state` does not know: "
        f"declare what its fields hold with `moment_fields={{{cls.__qualname__}: "
        f"{{{field!r}: 'first', ...}}}}` (per field, {roles}: a first moment, a second moment "
        "(non-negative, a divisor), a leaf not to compress, or a nested optimizer state)."
    )


def check_moment_fields(
    moment_fields: object, *, arg: str = "moment_fields"
) -> dict[type, dict[str, str]]:
    """`moment_fields` as ``{state type: {field name: role}}``; errors name `arg`."""
    if moment_fields is None:
        return {}
    if not isinstance(moment_fields, Mapping):
        raise TypeError(
            f"`{arg}` must be None or a dict {{state type: {{field name: role}}}}, "
            f"got {moment_fields!r}."
        )
    out = {}
    for cls, fields in moment_fields.items():
        if not isinstance(cls, type):
            raise TypeError(
                f"`{arg}` must map state types (classes, such as a NamedTuple) to fields, "
                f"got the key {cls!r}."
            )
        if not isinstance(fields, Mapping) or not all(isinstance(f, str) for f in fields):
            raise TypeError(
                f"`{arg}[{cls.__qualname__}]` must be a dict {{field name: role}}, got {fields!r}."
            )
        for field, role in fields.items():
            if role not in ROLES:
                raise ValueError(
                    f"`{arg}[{cls.__qualname__}][{field!r}]` must be one of "
                    f"{', '.join(map(repr, ROLES))}, got {role!r}."
                    f"{dtypes.did_you_mean(str(role).strip().lower(), ROLES)}"
                )
        known = getattr(cls, "_fields", None)
        if known is not None and set(fields) - set(known):
            raise ValueError(
                f"`{arg}[{cls.__qualname__}]` names fields {sorted(set(fields) - set(known))}, "
                f"which {cls.__qualname__} does not have (its fields: {', '.join(known)})."
            )
        out[cls] = dict(fields)
    return out


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
    moment_fields: Mapping[type, Mapping[str, str]] | None = None,
    param_specs: Any = None,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """Stores `inner`'s state in bfloat16 or 8 bits between steps.

    Every floating-point first or second moment of at least one dimension shaped
    like a param (Adam's ``mu`` and ``nu``, a momentum trace) is stored in a
    compressed format, and decompressed to float32 inside `update`, where `inner`
    runs as usual; scalars (counts, injected hyperparameters), leaves of other
    shapes and leaves that are not moments are kept as they are. Second moments
    take the `second_moment` format, first moments the `first_moment` one.

    Which fields of a state are first and which second moments comes from the
    state's type: `OPTAX_STATE_FIELDS` lists optax's (Adam's ``mu``/``nu``,
    AMSGrad's ``nu_max``, Adafactor's ``v_row``, ``v_col`` and ``v``, RMSProp's
    ``nu``, Adagrad's ``sum_of_squares``, Lion's ``mu``, a trace, ...), and wrappers
    (chains, `optax.inject_hyperparams`, `optax.masked`, `optax.multi_transform`,
    `optax.MultiSteps`) are looked through. A leaf shaped like a param in a state
    type that is not listed is an error at `init`, naming the type: declare its
    fields with `moment_fields`.

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

    A moment that is not finite (Adam's second moment of a gradient of 1e20 is
    inf) is never stored as a finite value: bfloat16 keeps the inf or NaN itself;
    in 8 bits, its block's scale is inf or NaN, and the whole block decompresses
    to inf (a second moment) or NaN (a first moment). So
    ``jaxmp.loss_scaling(..., check_outputs=True)`` (``jaxmp.mixed_precision(...,
    check_outputs=True)``) sees it in the new state and skips the step; without
    that check, an infinite second moment stays infinite, and the elements it
    covers (in 8 bits, its block) stop moving, as with float32 moments.

    The stored values stay in the inner state, in each leaf's place and shape
    (an int8 array where Adam's float32 moment was), so the state keeps optax's
    structure; the scales and formats are in `CompressStateState.compressed`.
    `jaxmp.inner_state` gives the decompressed optax state. The random key is in
    the state (`CompressStateState.key`) and split every step, like
    `jaxmp.stochastic_rounding`'s; each element's random bits are a hash of the key
    and its index in the whole leaf (inside `jax.shard_map`, with `param_specs`).

    Args:
      inner: the optax transformation whose state to store compressed.
      first_moment: the format of first moments.
      second_moment: the format of second moments; default: `first_moment`.
      block_size: elements per block of the 8-bit formats (at most: a row shorter
        than it is one block).
      moment_fields: what the fields of state types not in `OPTAX_STATE_FIELDS`
        hold (or, for one that is, replacing its entry): ``{StateType: {field:
        role}}``, each role ``"first"``, ``"second"``, ``"keep"`` (not compressed)
        or ``"inner"`` (a nested optimizer state); an unlisted field is ``"inner"``.
      param_specs: for an update inside `jax.shard_map` with params split over
        mesh axes: the params' `PartitionSpec` as given to ``in_specs`` (a prefix
        of the params' tree); each moment draws the random bits of its param's
        elements in the whole param. The 8-bit blocks are those of each device's
        block of a leaf. Default None: each leaf the update sees is whole.
      seed: the seed of the PRNG key.

    Returns:
      An `optax.GradientTransformationExtraArgs` with a `CompressStateState`.

    Raises:
      TypeError / ValueError: for a bad argument, naming it and the valid choices;
        ValueError from `init`, for a state type it cannot classify.

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
    table = {**OPTAX_STATE_FIELDS, **check_moment_fields(moment_fields)}
    param_specs = check_param_specs(param_specs)
    seed = check_seed(seed)
    compressing = (first, second) != ("float32", "float32")

    @staging.staged
    def init_fn(params):
        inner_state = inner.init(params)
        shapes = {
            jnp.shape(p)
            for p in jax.tree.leaves(params)
            if dtypes.is_floating(p) and jnp.ndim(p) >= 1
        }
        specs = {}
        if param_specs is not None:
            p_with_path = jax.tree_util.tree_flatten_with_path(params)[0]
            for (path, p), spec in zip(p_with_path, specs_of(param_specs, params), strict=True):
                arg = f"param_specs{jax.tree_util.keystr(path)}"
                specs[path] = normalize_spec(spec, jnp.ndim(p), arg=arg)
        leaves, treedef = jax.tree.flatten(inner_state)
        found = _classify(inner_state, table)
        assert len(found) == len(leaves)  # `_classify` walks the leaves in flatten order
        chosen = []
        for i, (x, leaf) in enumerate(zip(leaves, found, strict=True)):
            if not (dtypes.is_floating(x) and jnp.ndim(x) >= 1 and jnp.shape(x) in shapes):
                continue
            if leaf.role is None:
                if compressing:
                    raise _unknown_state_error(leaf)
                continue
            fmt = second if leaf.role == SECOND else first
            if leaf.role == KEEP or fmt == "float32":
                continue
            spec = specs.get(leaf.within)
            if param_specs is not None and spec is None:
                raise ValueError(
                    "`param_specs` must give the spec of the param of every compressed "
                    f"moment, got none for {jax.tree_util.keystr(leaf.path)} (a "
                    f"{leaf.role} moment of param {jax.tree_util.keystr(leaf.within)!r}, "
                    "which `params` does not have)."
                )
            chosen.append(
                CompressedLeaf(
                    None,
                    i,
                    fmt,
                    dtypes.compute_dtype_of(x),
                    leaf.role == SECOND,
                    block_size,
                    None if spec is None or not any(spec) else spec,
                )
            )
        # `init` runs on whole arrays (or on zeros, which round alike with any bits).
        whole = tuple(dataclasses.replace(c, spec=None) for c in chosen)
        # Times a 1 that XLA cannot see through: traced (`staging.staged_init`, or
        # `jax.jit(tx.init)`), an optimizer's zeros are constants, and XLA would compress
        # them while compiling (44 s for one 1024 x 16384 int8 moment on a CPU).
        one = jax.lax.optimization_barrier(np.float32(1))
        xs = [leaves[c.index] * one.astype(leaves[c.index].dtype) for c in chosen]
        key, values, scales = _compress_all_jit(seed_key(seed, TAG_STATE), xs, whole)
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
