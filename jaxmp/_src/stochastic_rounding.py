"""`stochastic_rounding`: half-precision params updated without a master copy, unbiased.

Round-to-nearest drops every update smaller than half the spacing of the param's dtype
around it: a bfloat16 weight of 1.0 ignores any step below 2**-8 (0.0039), however often it
is taken. Rounding up or down at random, with the probability of each in proportion to how
close the exact value is, keeps the expected value exact (Gupta et al., 2015, "Deep Learning
with Limited Numerical Precision"; Zamirai et al., 2020, "Revisiting BFloat16 Training",
arXiv 2010.06192), so many small steps add up to the right sum on average.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec
from jax.typing import ArrayLike, DTypeLike

from jaxmp._src import dtypes, staging
from jaxmp._src import tree as tree_lib
from jaxmp._src.loss_scaling import as_transformation

_IMPL = "threefry2x32"
# Folded into the seed, so that transforms seeded alike draw different numbers.
TAG_PARAMS = 0x5A
TAG_STATE = 0x57
#: The dtypes `stochastic_round` rounds to.
ROUNDED_DTYPES: tuple[np.dtype, ...] = (
    jnp.dtype(jnp.bfloat16),
    jnp.dtype(jnp.float16),
    jnp.dtype(jnp.float8_e4m3fn),
)


class StochasticRoundingState(NamedTuple):
    """State of `stochastic_rounding`.

    Attributes:
      key: the PRNG key of the next step, as raw threefry key data (so that it is
        an ordinary array: checkpointed, sharded and replicated like any other);
        ``jax.random.wrap_key_data(key, impl="threefry2x32")`` makes a key of it.
      inner_state: the wrapped transformation's state.
    """

    key: jax.Array  # shape=(2,), dtype=uint32
    inner_state: Any


def check_seed(seed: object, *, arg: str = "seed") -> int:
    """`seed` as an int; a TypeError naming `arg` unless it is an integer (not a bool)."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"`{arg}` must be an int, got {seed!r}.")
    return int(seed)


def seed_key(seed: int, tag: int) -> jax.Array:
    """Raw threefry key data for `seed`, with `tag` folded in: shape (2,), uint32."""
    key = jax.random.fold_in(jax.random.key(seed, impl=_IMPL), tag)
    return jax.random.key_data(key)


def next_keys(key_data: jax.Array, count: int) -> tuple[jax.Array, list[jax.Array]]:
    """Splits the state's key: the key data for the next step, and `count` for this one.

    One threefry split per step; each of the `count` keys' data (two uint32 words) seeds
    `random_bits` of one leaf.
    """
    key = jax.random.wrap_key_data(key_data, impl=_IMPL)
    data = jax.random.key_data(jax.random.split(key, count + 1))
    return data[0], [data[i + 1] for i in range(count)]


def _mix(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: a bijection, each output bit depending on every input bit."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def normalize_spec(spec: Any, ndim: int, *, arg: str) -> tuple[tuple[str, ...], ...]:
    """`spec` (a `PartitionSpec`, or a tuple like one) as one tuple of mesh axis names per
    dimension of an array of `ndim` dimensions (empty: not sharded)."""
    entries = tuple(spec) if isinstance(spec, (PartitionSpec, tuple)) else None
    if entries is None or len(entries) > ndim:
        raise ValueError(
            f"`{arg}` must be a PartitionSpec of at most {ndim} entries (one per dimension), "
            f"got {spec!r}."
        )
    out = []
    for entry in (*entries, *(None,) * (ndim - len(entries))):
        names = () if entry is None else (entry,) if isinstance(entry, str) else entry
        if not (isinstance(names, tuple) and all(isinstance(n, str) for n in names)):
            raise ValueError(f"`{arg}` must be a PartitionSpec of mesh axis names, got {spec!r}.")
        out.append(names)
    return tuple(out)


def shard_offsets(
    shape: tuple[int, ...], spec: tuple[tuple[str, ...], ...]
) -> tuple[list[Any], tuple[int, ...]]:
    """Inside `jax.shard_map`: where the local block of `shape` starts in the whole array.

    `spec` is the array's spec as `normalize_spec` gives it: for each dimension, the mesh
    axes it is split over, major first (as `shard_map` splits it). Returns, per dimension,
    the offset of this device's block (a uint32 scalar, or 0) and the whole array's shape.
    """
    u32 = jnp.dtype(jnp.uint32)
    offsets: list[Any] = []
    whole = []
    for size, names in zip(shape, spec, strict=True):
        if not names:
            offsets.append(0)
            whole.append(size)
            continue
        count = math.prod(jax.lax.axis_size(n) for n in names)
        index = jax.lax.axis_index(names if len(names) > 1 else names[0])
        offsets.append(index.astype(u32) * np.uint32(size))
        whole.append(size * count)
    return offsets, tuple(whole)


def element_index(
    shape: tuple[int, ...], spec: tuple[tuple[str, ...], ...] | None = None
) -> jax.Array:
    """The row-major index of each element of an array of `shape` in the whole array (uint32).

    Without `spec`, the array is the whole array. With it (inside `jax.shard_map`, the
    array's spec as `normalize_spec` gives it), the index of each element of this device's
    block in the array `shard_map` split: from the device's position along the mesh axes
    and the block's shape.
    """
    u32 = jnp.dtype(jnp.uint32)
    if spec is None or not any(spec):
        return jax.lax.iota(u32, math.prod(shape)).reshape(shape)
    offsets, whole = shard_offsets(shape, spec)
    index = jnp.zeros(shape, u32)
    stride = 1
    for dim in reversed(range(len(shape))):
        position = jax.lax.broadcasted_iota(u32, shape, dim) + offsets[dim]
        index = index + position * np.uint32(stride % 2**32)
        stride *= whole[dim]
    return index


def hash_bits(words: jax.Array, index: jax.Array) -> jax.Array:
    """Random uint32 bits for each uint32 `index`, from two random uint32 `words`."""
    return _mix(_mix(index ^ words[0]) + words[1])


def random_bits(
    words: jax.Array, shape: tuple[int, ...], spec: tuple[tuple[str, ...], ...] | None = None
) -> jax.Array:
    """Random uint32 bits of `shape` from two random uint32 `words` (a threefry key's data).

    Each element's bits are MurmurHash3's finaliser applied twice to its row-major index
    mixed with the two words: plain integer operations, which XLA fuses into the update that
    uses them. `jax.random.bits` runs threefry as a loop of its own on CPU and writes its
    bits to memory for the update to read (adding them to a float32 array accesses 16 times
    the array's bytes, against 2 this way). The index is that of the whole array: under
    `jax.jit`, a sharded array is the whole array; inside `jax.shard_map`, where each device
    sees only its block, `spec` (the array's spec, `normalize_spec`) gives each element its
    index in the whole array (`element_index`). So a sharded array draws the bits the
    unsharded one would.
    """
    return hash_bits(words, element_index(shape, spec))


def round_with_bits(x: jax.Array, dtype: Any, bits: jax.Array) -> jax.Array:
    """Rounds float32 `x` to `dtype` up or down at random, using uint32 `bits` of x's shape.

    Values beyond the finite range of `dtype` are clipped to its largest finite value (never
    rounded to inf); NaN stays NaN. Each element is rounded to one of the two neighbours of
    `dtype` around it, the upper one with probability ``(x - lower) / (upper - lower)``.
    """
    dtype = jnp.dtype(dtype)
    fi = jnp.finfo(dtype)
    limit = np.float32(fi.max)
    x = jnp.clip(x, -limit, limit)
    u32 = jnp.dtype(jnp.uint32)
    if dtype == jnp.dtype(jnp.bfloat16):
        # bfloat16 is float32 without its low 16 bits: adding 16 random bits to the
        # magnitude and truncating rounds it up with probability (low bits) / 2**16,
        # exactly. The clip keeps the carry out of the exponent's top value (inf).
        i = jax.lax.bitcast_convert_type(x, u32)
        i = (i + (bits >> np.uint32(16))) & np.uint32(0xFFFF0000)
        rounded = jax.lax.bitcast_convert_type(i, jnp.float32)
        # A NaN's payload bits could carry into an inf: keep the NaN.
        return jnp.where(jnp.isnan(x), x, rounded).astype(dtype)
    # float16 and float8: the spacing of `dtype` around x is 2**k, k the exponent of x (no
    # less than the smallest normal one) minus the mantissa bits; x / 2**k is exact, and
    # its fraction is the probability of rounding up.
    exponent = (jax.lax.bitcast_convert_type(x, u32) >> np.uint32(23)) & np.uint32(0xFF)
    k = jnp.maximum(exponent.astype(jnp.int32) - 127, fi.minexp) - fi.nmant
    spacing = jax.lax.bitcast_convert_type(((k + 127) << 23).astype(u32), jnp.float32)
    inverse = jax.lax.bitcast_convert_type(((127 - k) << 23).astype(u32), jnp.float32)
    t = x * inverse
    low = jnp.floor(t)
    uniform = (bits >> np.uint32(8)).astype(jnp.float32) * np.float32(2.0**-24)
    up = (uniform < t - low).astype(jnp.float32)
    return ((low + up) * spacing).astype(dtype)


def _rounded_dtype(dtype: Any, *, arg: str) -> np.dtype:
    try:
        normalised = jnp.dtype(dtype)
    except TypeError:
        normalised = None
    if normalised is None or normalised not in ROUNDED_DTYPES:
        names = ", ".join(d.name for d in ROUNDED_DTYPES)
        raise ValueError(f"`{arg}` must be one of {names}, got {dtype!r}.")
    return normalised


def stochastic_round(x: ArrayLike, dtype: DTypeLike, key: jax.Array) -> jax.Array:
    """Rounds `x` to `dtype` stochastically: unbiased, ``E[result] == x``.

    Each element becomes one of the two values of `dtype` around it (computed from
    `x` in float32), the upper one with probability ``(x - lower) / (upper -
    lower)``. So the mean of many roundings tends to `x`, where round-to-nearest
    always gives the same, biased, value. Values beyond the finite range of `dtype`
    become its largest finite value (never inf); NaN stays NaN.

    Args:
      x: a floating-point array.
      dtype: bfloat16, float16 or float8_e4m3fn.
      key: a PRNG key (typed, or raw key data as `jax.random.PRNGKey` makes).

    Returns:
      An array of `dtype` with the shape of `x`.

    Raises:
      ValueError: for another `dtype`.
      TypeError: if `x` is not a floating-point array.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmp
      >>> x = jnp.full(10_000, 1 + 2.0**-9)  # a quarter of the way from 1 to 1 + 2**-7
      >>> r = jaxmp.stochastic_round(x, jnp.bfloat16, jax.random.key(0))
      >>> sorted(set(r.tolist())), round(float(r.astype(jnp.float32).mean()), 3)
      ([1.0, 1.0078125], 1.002)
      >>> x.astype(jnp.bfloat16)[0]  # round-to-nearest
      Array(1, dtype=bfloat16)
    """
    dtype = _rounded_dtype(dtype, arg="dtype")
    x = jnp.asarray(x)
    if not dtypes.is_floating(x):
        raise TypeError(f"`x` must be a floating-point array, got dtype {x.dtype}.")
    words = jax.random.bits(key, (2,), jnp.uint32)
    return round_with_bits(x.astype(jnp.float32), dtype, random_bits(words, jnp.shape(x)))


def is_rounded_param(x: Any) -> bool:
    """A float16 or bfloat16 array: a param that the update must round."""
    return dtypes.is_floating(x) and jnp.dtype(x.dtype) in dtypes.HALF_DTYPES


def widen_floats(tree: Any) -> Any:
    """Floating array leaves of less than 32 bits as float32; other leaves as they are."""
    return jax.tree.map(
        lambda x: x.astype(dtypes.compute_dtype_of(x)) if dtypes.is_floating(x) else x, tree
    )


def other_update(update: Any, param: Any) -> Any:
    """The update of a param that is not rounded here: in its dtype, zeros if not trained.

    Float32 and wider params take the inner update in their own dtype; complex ones too;
    Python float leaves (an Equinox module's fields) take it as it is; integer and boolean
    params are not trained (zeros of their dtype); other leaves get None.
    """
    if update is None:
        return None
    if isinstance(param, (float, complex)) and not isinstance(param, bool):
        return update
    if dtypes.is_floating(param) or tree_lib.is_complex(param):
        return jnp.asarray(update).astype(param.dtype)
    if isinstance(param, (jax.Array, np.ndarray, np.generic, int)):
        return jnp.zeros_like(param)
    return None


def require_params(params: Any, name: str) -> None:
    if params is None:
        raise ValueError(
            f"`params` must be passed to the update of jaxmp.{name} (and of "
            "jaxmp.mixed_precision with half-precision params): "
            "call `tx.update(grads, opt_state, params)`."
        )


def check_param_specs(param_specs: Any, *, arg: str = "param_specs") -> Any:
    """`param_specs` if it is None or a pytree of `PartitionSpec` leaves; else a TypeError."""
    if param_specs is None:
        return None
    leaves = jax.tree.leaves(param_specs, is_leaf=_is_spec)
    bad = [x for x in leaves if not isinstance(x, PartitionSpec)]
    if bad:
        raise TypeError(
            f"`{arg}` must be None or a pytree of jax.sharding.PartitionSpec (the params' "
            f"`in_specs` of jax.shard_map, a prefix of the params' tree), got a leaf {bad[0]!r}."
        )
    return param_specs


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def specs_of(param_specs: Any, params: Any, *, arg: str = "param_specs") -> list[Any]:
    """One `PartitionSpec` (or None) per leaf of `params`, from a prefix tree of specs."""
    leaves, treedef = jax.tree.flatten(params)
    if param_specs is None:
        return [None] * len(leaves)
    try:
        full = jax.tree.map(
            lambda spec, sub: jax.tree.map(lambda _: spec, sub),
            param_specs,
            params,
            is_leaf=_is_spec,
        )
    except ValueError as e:
        raise ValueError(
            f"`{arg}` must be a prefix of the params' tree (one PartitionSpec for a whole "
            f"subtree), got {jax.tree.structure(param_specs, is_leaf=_is_spec)} "
            f"for params {treedef}."
        ) from e
    return treedef.flatten_up_to(full)  # type: ignore[attr-defined]


def bits_for(
    words: jax.Array, x: Any, spec: Any, path: str, *, arg: str = "param_specs"
) -> jax.Array:
    """`random_bits` for the array `x` with its `PartitionSpec` (None: `x` is whole)."""
    shape = jnp.shape(x)
    if spec is None:
        return random_bits(words, shape)
    normalized = normalize_spec(spec, len(shape), arg=f"{arg}{path}")
    try:
        return random_bits(words, shape, normalized)
    except NameError as e:  # jax.lax.axis_index outside shard_map: "unbound axis name"
        raise ValueError(
            f"`{arg}{path}` is {spec!r}, for an update inside jax.shard_map over those mesh "
            f"axes, but this update is not: {e}. Outside shard_map, leave `{arg}` unset "
            "(under jax.jit a sharded array is whole)."
        ) from None


def stochastic_rounding(
    inner: optax.GradientTransformation, *, seed: int = 0, param_specs: Any = None
) -> optax.GradientTransformationExtraArgs:
    """Runs `inner` in float32 and rounds the new half-precision params stochastically.

    For params stored in bfloat16 or float16 and no master copy: each step, the new
    value ``param + update`` is computed in float32 and rounded to the param's dtype
    up or down at random (`stochastic_round`), so that it is right on average.
    Round-to-nearest loses every update below half a unit in the last place (a
    bfloat16 weight of 1.0 ignores steps below 0.002); stochastic rounding moves it
    by a whole unit with the matching probability, and many small steps add up.
    Params then take 2 bytes each instead of the 2 + 4 of a float32 master copy.

    The returned updates are in each param's dtype, such that
    ``optax.apply_updates(params, updates)`` (or ``equinox.apply_updates``) gives
    the rounded value exactly whenever it is within a factor of 2 of the param
    (`tree.update_to`: any step that moves a param by less than half its
    magnitude), and never inf. Float32 and wider params are updated as `inner` says.

    The PRNG key is in the state (`StochasticRoundingState.key`, raw key data):
    split every step, checkpointed with the state, and the same on every device
    (it is replicated). The random bits of each element are a hash of the key and
    the element's index in the whole param, so replicas of a param round alike and
    a sharded param rounds as the unsharded one would: under `jax.jit` a sharded
    param is whole; inside `jax.shard_map`, where each device sees its block of a
    param split over mesh axes, pass `param_specs` (the params' ``in_specs``) so
    that each element's index is its index in the whole param. A step that
    `jaxmp.loss_scaling` skips keeps the key, as it keeps the rest of the state.

    `inner` is initialised with the params widened to float32 (its moments are then
    float32, like the updates it computes; see `jaxmp.compress_state` to store them
    in fewer bytes).

    Args:
      inner: the optax transformation computing the updates.
      seed: the seed of the PRNG key.
      param_specs: for an update inside `jax.shard_map` with params split over
        mesh axes: the params' `PartitionSpec` as given to `shard_map`'s
        ``in_specs`` (a prefix of the params' tree). Default None: each param
        the update sees is whole (outside `shard_map`, or replicated in it).

    Returns:
      An `optax.GradientTransformationExtraArgs` with a `StochasticRoundingState`.
      `update` requires `params`.

    Raises:
      TypeError: for a bad `inner`, `seed` or `param_specs`; ValueError at trace
        time, if `update` is called without `params`, or with `param_specs`
        outside `shard_map` over their axes.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxmp
      >>> tx = jaxmp.stochastic_rounding(optax.sgd(1e-4))
      >>> params = {"w": jnp.ones(1000, jnp.bfloat16)}
      >>> state = tx.init(params)
      >>> step = jax.jit(lambda p, s: tx.update({"w": jnp.ones(1000, jnp.bfloat16)}, s, p))
      >>> for _ in range(100):
      ...     updates, state = step(params, state)
      ...     params = optax.apply_updates(params, updates)
      >>> round(float(params["w"].astype(jnp.float32).mean()), 2)  # 1 - 100 * 1e-4
      0.99
    """
    inner = as_transformation(inner)
    seed = check_seed(seed)
    param_specs = check_param_specs(param_specs)

    @staging.staged
    def init_fn(params):
        return StochasticRoundingState(
            key=seed_key(seed, TAG_PARAMS), inner_state=inner.init(widen_floats(params))
        )

    def update_fn(updates, state, params=None, **extra_args):
        require_params(params, "stochastic_rounding")
        updates = widen_floats(updates)
        inner_updates, inner_state = inner.update(
            updates, state.inner_state, widen_floats(params), **extra_args
        )
        p_with_path, p_def = jax.tree_util.tree_flatten_with_path(params)
        p_leaves = [p for _, p in p_with_path]
        u_leaves = p_def.flatten_up_to(inner_updates)  # a None update covers its subtree
        specs = specs_of(param_specs, params)
        rounded = [i for i, p in enumerate(p_leaves) if is_rounded_param(p)]
        key, keys = next_keys(state.key, len(rounded))
        out = [other_update(u, p) for u, p in zip(u_leaves, p_leaves, strict=True)]
        for i, leaf_key in zip(rounded, keys, strict=True):
            param, update = p_leaves[i], u_leaves[i]
            if update is None:
                continue
            new = param.astype(jnp.float32) + jnp.asarray(update).astype(jnp.float32)
            path = jax.tree_util.keystr(p_with_path[i][0])
            bits = bits_for(leaf_key, param, specs[i], path)
            target = round_with_bits(new, param.dtype, bits)
            out[i] = tree_lib.update_to(target.astype(jnp.float32), param)[1]
        return jax.tree.unflatten(p_def, out), StochasticRoundingState(
            key=key, inner_state=inner_state
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
