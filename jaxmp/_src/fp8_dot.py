"""The FP8 ``dot_general`` and convolution, forward and backward (a ``jax.custom_vjp``).

Per-tensor recipes: each operand is quantised with a power-of-two scale in the layout its
product contracts it in (`quantize_tensor`: the contracted dimensions minor, so no FP8 tensor
is transposed), dequantised in the compute dtype (exact) and multiplied by one ``dot_general``
whose result is the compute dtype: the pattern XLA's GPU compiler rewrites into a cuBLASLt FP8
GEMM with the two inverse scales as its scale arguments. The block recipes lower to one FP8
``dot_general`` batched over the blocks of the contracted dimension, each block's partial sum
scaled in float32 and summed (DeepSeek-V3's "promotion to CUDA cores"). CPUs have no FP8
arithmetic; XLA runs the FP8 types exactly, by emulation, so every result here is the one an
FP8 GEMM gives, up to the summation order.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmp._src.fp8 import ROLE_GRAD, ROLE_LHS, ROLE_RHS, MXFP8BlockScaling
from jaxmp._src.fp8_scaling import (
    delayed_update,
    finite_limit,
    observed_amax,
    quantize,
    quantize_blocks,
    state_exponent,
    tensor_exponent,
)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q", "exponent"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Quantized:
    """An operand quantised per tensor, in the layout one product contracts it in.

    Attributes:
      q: the FP8 values, dimensions ordered (batch, free, contracted).
      exponent: the scale's exponent (int32 scalar): ``x * 2**exponent`` was quantised.
    """

    q: jax.Array
    exponent: jax.Array


def quantize_tensor(
    x: jax.Array,
    exponent: jax.Array,
    dtype: Any,
    contract: Sequence[int],
    batch: Sequence[int],
    dequant_dtypes: Sequence[Any],
) -> Quantized:
    """`x` laid out (batch, free, contracted) and quantised with the scale ``2**exponent``,
    finite values saturating where they stay finite dequantised in `dequant_dtypes`.

    The transposition happens before the quantisation, in `x`'s own dtype, so no FP8 tensor
    is ever transposed: the FP8 GEMM reads both operands with the contracted dimensions
    minor (cuBLASLt's "TN" layout on Hopper) and XLA fuses the transposition into the
    quantisation.
    """
    free = _remaining(x.ndim, contract, batch)
    laid_out = jnp.transpose(x, (*batch, *free, *contract))
    scale = jnp.ldexp(jnp.float32(1.0), exponent)
    limit = finite_limit(exponent, dtype, *dequant_dtypes)
    return Quantized(quantize(laid_out, scale, dtype, limit), exponent)


def dequantize(x: Quantized, dtype: Any) -> jax.Array:
    """`x`'s values in `dtype`: ``q.astype(dtype) * 2**-exponent`` (exact)."""
    inverse = jnp.ldexp(jnp.float32(1.0), -x.exponent).astype(dtype)
    return x.q.astype(dtype) * inverse


def dequantized_dot(
    a: Quantized, b: Quantized, nbatch: int, ncontract: int, out_dtype: Any
) -> jax.Array:
    """The product of two operands from `quantize_tensor`, in `out_dtype`.

    Each operand is dequantised in `out_dtype` (``q.astype(out_dtype) * 2**-exponent``,
    exact), and one ``dot_general`` contracting their trailing `ncontract` dimensions (their
    leading `nbatch` are batch dimensions) writes the result in `out_dtype` directly: the
    pattern XLA's GPU compiler rewrites into a cuBLASLt FP8 GEMM whose scale arguments are
    the two inverse scales and whose output is `out_dtype` (float32 accumulation), with no
    float32 product written in between.
    """
    out_dtype = jnp.dtype(out_dtype)
    batch = tuple(range(nbatch))
    dims = (
        (
            tuple(range(a.q.ndim - ncontract, a.q.ndim)),
            tuple(range(b.q.ndim - ncontract, b.q.ndim)),
        ),
        (batch, batch),
    )
    return lax.dot_general(
        dequantize(a, out_dtype), dequantize(b, out_dtype), dims, preferred_element_type=out_dtype
    )


# --------------------------------------------------------------------------------------------
# The block recipes' product.


@dataclasses.dataclass(frozen=True)
class Operand:
    """How one operand of a block-scaled product is quantised.

    Attributes:
      dtype: the FP8 format.
      weight: whether the operand is a weight (square blocks under `Float8BlockScaling`).
    """

    dtype: Any
    weight: bool = False


def _canonical(x: jax.Array, contract: Sequence[int], batch: Sequence[int]) -> jax.Array:
    """`x` as ``(batch, free, contracted)``, each group of dimensions flattened into one."""
    free = _remaining(x.ndim, contract, batch)
    x = jnp.transpose(x, (*batch, *free, *contract))
    b = math.prod(x.shape[: len(batch)])
    f = math.prod(x.shape[len(batch) : len(batch) + len(free)])
    k = math.prod(x.shape[len(batch) + len(free) :])
    return x.reshape(b, f, k)


def _block_layout(recipe: Any, op: Operand) -> tuple[int, int, bool]:
    """``(tile, rows, power_of_two)`` of an operand under a block recipe."""
    if isinstance(recipe, MXFP8BlockScaling):
        return recipe.block_size, 1, True
    if op.weight:
        return recipe.weight_block_size, recipe.weight_block_size, False
    return recipe.tile_size, 1, False


def block_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    lhs_op: Operand,
    rhs_op: Operand,
    recipe: Any,
    out_dtype: Any,
) -> jax.Array:
    """The product of `lhs` and `rhs` under a block recipe, in `out_dtype`.

    The contracted dimensions are flattened and cut into blocks, one ``dot_general`` batched
    over the blocks gives each block's float32 partial sum, which is scaled by its two
    inverse scales and summed (DeepSeek-V3's "promotion to CUDA cores"). On Hopper this is
    an emulation: one small FP8 GEMM per block, not a block-scaled GEMM kernel. Every
    operand's dequantised values are finite in `out_dtype` (`quantize_blocks`).
    """
    (lc, rc), (lb, rb) = dimension_numbers
    out_shape = (
        *[lhs.shape[d] for d in lb],
        *[lhs.shape[d] for d in range(lhs.ndim) if d not in lc and d not in lb],
        *[rhs.shape[d] for d in range(rhs.ndim) if d not in rc and d not in rb],
    )
    # Both operands are cut at the same points of the contraction: padded with zeros to a
    # multiple of both block lengths, and each block split into pieces of their gcd.
    tiles = (_block_layout(recipe, lhs_op)[0], _block_layout(recipe, rhs_op)[0])
    k = math.prod(lhs.shape[d] for d in lc)
    padded_k = -(-k // math.lcm(*tiles)) * math.lcm(*tiles)
    piece = math.gcd(*tiles)
    out_dtype = jnp.dtype(out_dtype)
    lq, ls = _quantize_operand(lhs, lc, lb, lhs_op, recipe, padded_k, piece, out_dtype)
    rq, rs = _quantize_operand(rhs, rc, rb, rhs_op, recipe, padded_k, piece, out_dtype)
    # (b, m, kb, t) x (b, n, kb, t) -> (b, kb, m, n): one float32 partial sum per block.
    partial = lax.dot_general(
        lq, rq, (((3,), (3,)), ((0, 2), (0, 2))), preferred_element_type=jnp.float32
    )
    scaled = _scale_partial(
        partial, jnp.swapaxes(ls, 1, 2)[:, :, :, None], jnp.swapaxes(rs, 1, 2)[:, :, None]
    )
    return jnp.sum(scaled, axis=1).reshape(out_shape).astype(out_dtype)


def _scale_partial(partial: jax.Array, ls: jax.Array, rs: jax.Array) -> jax.Array:
    """``partial * ls * rs`` in float32, with no overflow or underflow on the way.

    The two scales are multiplied first: a partial sum times one scale alone overflows
    float32 where the product is finite (a block near bfloat16's largest value, 255 * 2**120,
    times a block of ones: 240 * 256 * 2**120 before the other scale's 2**-8). Where the
    scales' product is itself outside float32's normal range (operands near float32's
    largest or smallest values), they are applied one at a time: the smaller first when
    their product is large, the larger first when it is small.
    """
    both = ls * rs
    low, high = jnp.minimum(ls, rs), jnp.maximum(ls, rs)
    normal = jnp.isfinite(both) & (both >= jnp.finfo(jnp.float32).tiny)
    apart = jnp.where(both > 1, partial * low * high, partial * high * low)
    return jnp.where(normal, partial * both, apart)


def _quantize_operand(
    x: jax.Array,
    contract: Sequence[int],
    batch: Sequence[int],
    op: Operand,
    recipe: Any,
    padded_k: int,
    piece: int,
    dequant_dtype: Any,
) -> tuple[jax.Array, jax.Array]:
    """`x` as ``(b, f, padded_k // piece, piece)`` FP8 blocks and their inverse scales, its
    dequantised values finite in `dequant_dtype`."""
    x3 = _canonical(x, contract, batch)
    x3 = jnp.pad(x3, ((0, 0), (0, 0), (0, padded_k - x3.shape[2])))
    tile, rows, power_of_two = _block_layout(recipe, op)
    q, scale_inv = quantize_blocks(
        x3, op.dtype, tile, rows, power_of_two=power_of_two, dequant_dtypes=(dequant_dtype,)
    )
    b, f, kb, t = q.shape
    if t == piece:
        return q, scale_inv
    return q.reshape(b, f, kb * (t // piece), piece), jnp.repeat(scale_inv, t // piece, axis=2)


# --------------------------------------------------------------------------------------------
# The products of a dot_general's backward pass.


def _remaining(n: int, *removed: Sequence[int]) -> list[int]:
    gone = set(itertools.chain(*removed))
    return [i for i in range(n) if i not in gone]


def _ranges_like(*groups: Sequence[int]) -> list[tuple[int, ...]]:
    out, start = [], 0
    for group in groups:
        out.append(tuple(range(start, start + len(group))))
        start += len(group)
    return out


def transpose_lhs(
    dimension_numbers: Any, x_ndim: int, y_ndim: int, *, swap_ans: bool = False
) -> tuple[Any, tuple[int, ...]]:
    """The product giving the gradient of a ``dot_general``'s left operand from its output's.

    Returns the dimension numbers of ``dot_general(g, y)`` and the permutation taking its
    result to the layout of ``x``: JAX's own transpose rule of ``dot_general``
    (``_dot_general_transpose_lhs``), so that the FP8 backward computes exactly the products
    JAX would. With `swap_ans` (and swapped dimension numbers) it gives the right operand's.
    """
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    x_kept = _remaining(x_ndim, x_contract, x_batch)
    y_kept = _remaining(y_ndim, y_contract, y_batch)
    if swap_ans:
        ans_batch, ans_y, _ = _ranges_like(x_batch, y_kept, x_kept)
    else:
        ans_batch, _, ans_y = _ranges_like(x_batch, x_kept, y_kept)
    dims = ((ans_y, tuple(y_kept)), (ans_batch, tuple(y_batch)))
    order = np.argsort(np.asarray(y_contract, dtype=np.int64))
    x_contract_sorted_by_y = [int(x_contract[i]) for i in order]
    out_axes = np.argsort(np.asarray([*x_batch, *x_kept, *x_contract_sorted_by_y], np.int64))
    return dims, tuple(int(a) for a in out_axes)


def transpose_rhs(dimension_numbers: Any, x_ndim: int, y_ndim: int) -> tuple[Any, tuple[int, ...]]:
    """As `transpose_lhs`, for the right operand (``dot_general(g, x)``)."""
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    swapped = ((y_contract, x_contract), (y_batch, x_batch))
    return transpose_lhs(swapped, y_ndim, x_ndim, swap_ans=True)


def rhs_gradient_product(
    dimension_numbers: Any, x_ndim: int, y_ndim: int
) -> tuple[Any, tuple[int, ...]]:
    """The product giving the right operand's gradient as ``dot_general(x, g)``.

    ``x`` first: the result's layout is (batch, x's contracted dimensions, y's free
    dimensions), which is ``y``'s own layout for the usual ``x @ w`` (no transposition of
    the result). Returns the dimension numbers and the permutation to ``y``'s layout.
    """
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    x_kept = _remaining(x_ndim, x_contract, x_batch)
    y_kept = _remaining(y_ndim, y_contract, y_batch)
    ans_batch, ans_x, ans_y = _ranges_like(x_batch, x_kept, y_kept)
    dims = ((tuple(x_kept), ans_x), (tuple(x_batch), ans_batch))
    # The result's middle dimensions are x's contracted ones in x's order; each stands for
    # the y dimension it is contracted with.
    x_order = np.argsort(np.asarray(x_contract, dtype=np.int64))
    y_contract_by_x = [int(y_contract[i]) for i in x_order]
    out_axes = np.argsort(np.asarray([*y_batch, *y_contract_by_x, *y_kept], np.int64))
    return dims, tuple(int(a) for a in out_axes)


# --------------------------------------------------------------------------------------------
# The FP8 dot_general.


def _exponents(
    site: Any,
    roles: Sequence[int],
    formats: Sequence[Any],
    tensors: Sequence[jax.Array],
    dtypes: Sequence[Any],
) -> list[jax.Array]:
    """The scale exponents of `tensors` (in `roles`, quantised to `formats`) for products
    dequantised in each of `dtypes`: current scaling's, or the delayed-scaling `site`'s."""
    if site is None:
        return [tensor_exponent(x, f, *dtypes) for x, f in zip(tensors, formats, strict=True)]
    return [state_exponent(site[1][r], f, *dtypes) for r, f in zip(roles, formats, strict=True)]


def _updated_site(site: Any, amaxes: Any, g: jax.Array, recipe: Any) -> Any:
    """The next ``(amax_history, scale)`` of `site` from this step's amaxes; None without one."""
    if site is None:
        return None
    observed = jnp.stack([amaxes[0], amaxes[1], observed_amax(g, site[0])])
    return delayed_update(site[0], site[1], observed, recipe)


@jax.custom_jvp
def _first_order_only(x: Any) -> Any:
    """The identity, which refuses to be differentiated: see `_with_fp8_vjp`."""
    return x


@_first_order_only.defjvp
def _first_order_only_jvp(primals: Any, tangents: Any) -> Any:
    del primals, tangents
    raise NotImplementedError(
        "an FP8 matmul's backward pass is not differentiable: higher derivatives (jax.hessian, "
        "a Hessian-vector product, jax.grad of jax.grad) through an FP8 matmul are not "
        "defined. Keep the matmul out of FP8 (`fp8_exclude`, `jaxmp.float32_region`) or "
        "compute them without the `fp8` recipe."
    )


def _with_fp8_vjp(
    forward: Callable[..., Any], backward: Callable[..., Any], lhs: Any, rhs: Any, site: Any
) -> jax.Array:
    """``forward(lhs, rhs, site)[0]``, differentiated by `backward` (a `jax.custom_vjp`).

    The forward and backward passes round values to FP8, which has no derivative: their own
    inputs pass `_first_order_only`, so that differentiating them (a second derivative) is a
    clear error instead of NaN. A first derivative never differentiates them.
    """

    def guarded_forward(lhs: Any, rhs: Any, site: Any) -> Any:
        return forward(*_first_order_only((lhs, rhs, site)))

    def guarded_backward(res: Any, g: jax.Array) -> Any:
        return backward(*_first_order_only((res, g)))

    @jax.custom_vjp
    def run(lhs: jax.Array, rhs: jax.Array, site: Any) -> jax.Array:
        return guarded_forward(lhs, rhs, site)[0]

    run.defvjp(guarded_forward, guarded_backward)
    return run(lhs, rhs, site)


def _dims(dimension_numbers: Any) -> Any:
    return tuple(tuple(tuple(int(d) for d in ds) for ds in pair) for pair in dimension_numbers)


def fp8_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    recipe: Any,
    out_dtype: Any,
    *,
    weights: tuple[bool, bool] = (False, False),
    site: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """``lax.dot_general(lhs, rhs, dimension_numbers)`` in FP8, forward and backward.

    The result is in `out_dtype`. The backward pass (a ``jax.custom_vjp``) quantises the
    incoming gradient in ``recipe.bwd_dtype`` and the operands as in the forward pass, and
    returns the gradients in the operands' dtypes. With `DelayedScaling`, `site` is the
    matmul's ``(amax_history, scale)`` (shapes ``(3, L)`` and ``(3,)``) and its gradient is
    the updated pair (`Float8State`).

    Per-tensor recipes quantise each operand once per product it enters, in the layout that
    product contracts it in (`quantize_tensor`), and save the FP8 operands of the backward
    products as residuals (one byte per value instead of the compute dtype's two).
    """
    dims = _dims(dimension_numbers)
    out_dtype = jnp.dtype(out_dtype)
    if recipe.per_tensor:
        passes = _per_tensor_passes(dims, recipe, out_dtype, lhs, rhs)
    else:
        passes = _block_passes(dims, recipe, out_dtype, weights)
    return _with_fp8_vjp(*passes, lhs, rhs, site)


def _per_tensor_passes(
    dims: Any, recipe: Any, out_dtype: np.dtype, lhs: Any, rhs: Any
) -> tuple[Any, Any]:
    """The forward and backward passes of a per-tensor recipe's FP8 ``dot_general``.

    Every scale is a power of two that stays exact in each dtype the operand is dequantised
    in: the forward product's `out_dtype` and the backward product's operand dtypes.
    """
    (lc, rc), (lb, rb) = dims
    fwd, bwd = recipe.fwd_dtype, recipe.bwd_dtype
    lhs_dtype, rhs_dtype = jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype)
    lhs_ndim, rhs_ndim = lhs.ndim, rhs.ndim
    dequant = (out_dtype, lhs_dtype, rhs_dtype)
    dims_l, axes_l = transpose_lhs(dims, lhs_ndim, rhs_ndim)  # d_lhs = dot_general(g, rhs)
    dims_r, axes_r = rhs_gradient_product(dims, lhs_ndim, rhs_ndim)  # d_rhs = (lhs, g)

    def forward(lhs: jax.Array, rhs: jax.Array, site: Any) -> tuple[jax.Array, Any]:
        el, er = _exponents(site, (ROLE_LHS, ROLE_RHS), (fwd, fwd), (lhs, rhs), dequant)
        out = dequantized_dot(
            quantize_tensor(lhs, el, fwd, lc, lb, dequant),
            quantize_tensor(rhs, er, fwd, rc, rb, dequant),
            len(lb),
            len(lc),
            out_dtype,
        )
        # The operands as the backward products contract them, saved in FP8.
        rhs_q = quantize_tensor(rhs, er, fwd, dims_l[0][1], dims_l[1][1], dequant)
        lhs_q = quantize_tensor(lhs, el, fwd, dims_r[0][0], dims_r[1][0], dequant)
        amaxes = None
        if site is not None:
            amaxes = (observed_amax(lhs, site[0]), observed_amax(rhs, site[0]))
        return out, (rhs_q, lhs_q, amaxes, site)

    def backward(res: Any, g: jax.Array) -> tuple[Any, Any, Any]:
        rhs_q, lhs_q, amaxes, site = res
        (eg,) = _exponents(site, (ROLE_GRAD,), (bwd,), (g,), (lhs_dtype, rhs_dtype))
        g_l = quantize_tensor(g, eg, bwd, dims_l[0][0], dims_l[1][0], (lhs_dtype, rhs_dtype))
        d_lhs = dequantized_dot(g_l, rhs_q, len(dims_l[1][0]), len(dims_l[0][0]), lhs_dtype)
        g_r = quantize_tensor(g, eg, bwd, dims_r[0][1], dims_r[1][1], (lhs_dtype, rhs_dtype))
        d_rhs = dequantized_dot(lhs_q, g_r, len(dims_r[1][0]), len(dims_r[0][0]), rhs_dtype)
        new_site = _updated_site(site, amaxes, g, recipe)
        return jnp.transpose(d_lhs, axes_l), jnp.transpose(d_rhs, axes_r), new_site

    return forward, backward


def _block_passes(
    dims: Any, recipe: Any, out_dtype: np.dtype, weights: tuple[bool, bool]
) -> tuple[Any, Any]:
    """The forward and backward passes of a block recipe's FP8 ``dot_general``.

    Each product quantises its operands so that their dequantised values are finite in the
    dtype it returns: the forward product's `out_dtype`, each gradient's operand dtype.
    """
    lhs_op = Operand(recipe.fwd_dtype, weights[0])
    rhs_op = Operand(recipe.fwd_dtype, weights[1])
    g_op = Operand(recipe.bwd_dtype)

    def forward(lhs: jax.Array, rhs: jax.Array, site: Any) -> tuple[jax.Array, Any]:
        out = block_dot_general(lhs, rhs, dims, lhs_op, rhs_op, recipe, out_dtype)
        return out, (lhs, rhs)

    def backward(res: Any, g: jax.Array) -> tuple[Any, Any, Any]:
        lhs, rhs = res
        dims_l, axes_l = transpose_lhs(dims, lhs.ndim, rhs.ndim)
        d_lhs = block_dot_general(g, rhs, dims_l, g_op, rhs_op, recipe, lhs.dtype)
        d_lhs = jnp.transpose(d_lhs, axes_l)
        dims_r, axes_r = transpose_rhs(dims, lhs.ndim, rhs.ndim)
        d_rhs = block_dot_general(g, lhs, dims_r, g_op, lhs_op, recipe, rhs.dtype)
        d_rhs = jnp.transpose(d_rhs, axes_r)
        return d_lhs, d_rhs, None

    return forward, backward


def fp8_conv(
    lhs: jax.Array,
    rhs: jax.Array,
    conv: Callable[..., Any],
    recipe: Any,
    out_dtype: Any,
    *,
    site: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """A convolution in FP8 with a per-tensor recipe, forward and backward.

    `conv(lhs, rhs, dtype)` binds the convolution with its result in `dtype`. The forward
    pass runs it on the operands dequantised in `out_dtype` (``q.astype(out_dtype) *
    2**-exponent``, the pattern of an FP8 convolution), its result in `out_dtype`; the
    backward pass quantises the gradient and takes the convolution's own transposes
    (``jax.vjp``) at the dequantised FP8 values, in the operands' dtypes.
    """
    out_dtype = jnp.dtype(out_dtype)
    fwd, bwd = recipe.fwd_dtype, recipe.bwd_dtype
    lhs_dtype, rhs_dtype = lhs.dtype, rhs.dtype

    def quantized(x: jax.Array, exponent: jax.Array, fmt: Any) -> Quantized:
        # In its own layout (no dimension contracted by a dot), dequantised in `out_dtype`
        # (the gradient's dtype too: a cotangent has its primal's dtype).
        return quantize_tensor(x, exponent, fmt, (), (), (out_dtype,))

    def forward(lhs: jax.Array, rhs: jax.Array, site: Any) -> tuple[jax.Array, Any]:
        dtypes = (out_dtype, lhs.dtype, rhs.dtype)
        el, er = _exponents(site, (ROLE_LHS, ROLE_RHS), (fwd, fwd), (lhs, rhs), dtypes)
        lq, rq = quantized(lhs, el, fwd), quantized(rhs, er, fwd)
        out = conv(dequantize(lq, out_dtype), dequantize(rq, out_dtype), out_dtype)
        amaxes = None
        if site is not None:
            amaxes = (observed_amax(lhs, site[0]), observed_amax(rhs, site[0]))
        return out, (lq, rq, amaxes, site)  # the operands saved in FP8

    def backward(res: Any, g: jax.Array) -> tuple[Any, Any, Any]:
        lq, rq, amaxes, site = res
        (eg,) = _exponents(site, (ROLE_GRAD,), (bwd,), (g,), (g.dtype,))
        gd = dequantize(quantized(g, eg, bwd), g.dtype)
        ld, rd = dequantize(lq, g.dtype), dequantize(rq, g.dtype)
        _, vjp = jax.vjp(lambda a, b: conv(a, b, g.dtype), ld, rd)
        d_lhs, d_rhs = vjp(gd)
        new_site = _updated_site(site, amaxes, g, recipe)
        return d_lhs.astype(lhs_dtype), d_rhs.astype(rhs_dtype), new_site

    return _with_fp8_vjp(forward, backward, lhs, rhs, site)
