"""The op lists of `jaxmp.autocast`: which primitives run in low precision, which in float32.

Primitives are named by their JAX name (``jax.extend.core.Primitive.name``). The lists follow
the spirit of ``torch.autocast``'s CUDA lists, translated to JAX primitives:

* `LOW_PRECISION_OPS` run in the policy's compute dtype: the matrix products, which
  dominate the FLOPs and the memory traffic and which tensor cores accelerate.
* `FLOAT32_OPS` run in float32 (or wider): the ops whose range or rounding error makes
  float16/bfloat16 unsafe. ``exp``/``log`` and friends overflow or lose the small
  differences softmax and cross-entropy need; sums and products accumulate rounding error
  (softmax denominators, means and variances of normalisation layers, losses); ``pow``,
  ``rsqrt`` and the special functions lose precision at the ends of their range; and the
  linear-algebra and FFT primitives have no float16 kernels on most backends.
* Everything else follows its inputs (see `jaxmp.autocast` for the promotion rule).

Decisions where torch's lists do not translate one to one:

* ``logistic`` (``jax.nn.sigmoid``) follows its input: its output lies in (0, 1) and it
  cannot overflow, and keeping it in the compute dtype keeps SiLU/Swish activations there.
* ``reduce_max``/``reduce_min`` run in float32 although a maximum is exact in any dtype:
  softmax and logsumexp subtract the maximum, and a float32 maximum makes the whole
  softmax path float32 with no extra rounding.
* ``rsqrt`` runs in float32 (torch's list); ``sqrt``, ``square``, ``integer_pow`` and
  ``tanh`` follow their input, which keeps GELU's tanh approximation in the compute dtype.
* ``erf`` runs in float32, so the exact (erf-based) GELU runs in float32.
"""

from __future__ import annotations

#: Primitives that run in the policy's compute dtype (float16 or bfloat16).
LOW_PRECISION_OPS: frozenset[str] = frozenset(
    {
        "dot_general",
        "conv_general_dilated",
        "ragged_dot_general",
    }
)

#: Primitives that run in float32 (float64 inputs stay float64).
FLOAT32_OPS: frozenset[str] = frozenset(
    {
        # Exponentials and logarithms: softmax, log-softmax, logsumexp, cross-entropy.
        "exp",
        "exp2",
        "expm1",
        "log",
        "log1p",
        # Powers and roots that amplify relative error.
        "pow",
        "rsqrt",
        # Hyperbolic and inverse trigonometric functions (torch's list).
        "tan",
        "sinh",
        "cosh",
        "asin",
        "acos",
        "asinh",
        "acosh",
        "atanh",
        # Special functions.
        "erf",
        "erfc",
        "erf_inv",
        "lgamma",
        "digamma",
        "polygamma",
        "zeta",
        "igamma",
        "igammac",
        "igamma_grad_a",
        "random_gamma_grad",
        "regularized_incomplete_beta",
        "bessel_i0e",
        "bessel_i1e",
        # Reductions: softmax denominators, means and variances, losses.
        "reduce_sum",
        "reduce_prod",
        "reduce_max",
        "reduce_min",
        "reduce_window_sum",
        "cumsum",
        "cumprod",
        "cumlogsumexp",
        # Linear algebra and FFTs: no float16 kernels on most backends.
        "cholesky",
        "triangular_solve",
        "lu",
        "qr",
        "svd",
        "eig",
        "eigh",
        "schur",
        "hessenberg",
        "householder_product",
        "tridiagonal",
        "tridiagonal_solve",
        "fft",
    }
)

# Primitives re-bound exactly as traced, with their floating operands cast back to the dtypes
# they were traced with: their parameters encode the operand dtype (the scatter combiner
# jaxprs, bit casts) or they carry sub-jaxprs that need no rewriting.
AS_TRACED_OPS: frozenset[str] = frozenset(
    {
        "scatter",
        "scatter-add",
        "scatter-mul",
        "scatter-min",
        "scatter-max",
        "scatter_add",
        "scatter_mul",
        "scatter_min",
        "scatter_max",
        "bitcast_convert_type",
        "reduce",
        "reduce_window",
        "select_and_scatter",
        "custom_linear_solve",
        "custom_vjp_call",
        "rng_bit_generator",
        # Host callbacks that return values receive the dtypes the program was written for.
        "pure_callback",
        "io_callback",
    }
)

# Primitives whose operands are independent of one another (no promotion between them):
# each output keeps the dtype of its operand.
INDEPENDENT_OPERAND_OPS: frozenset[str] = frozenset(
    {
        "optimization_barrier",
        "device_put",
        "sort",
        "psum",
        "pmax",
        "pmin",
        "ppermute",
        "all_gather",
        "all_to_all",
        "pvary",
        "name",
        # Debug output shows the values autocast computes, in their dtypes.
        "debug_print",
        "debug_callback",
    }
)

#: Primitives that move values without computing new ones (layout).
LAYOUT_OPS: frozenset[str] = frozenset(
    {
        "broadcast_in_dim",
        "reshape",
        "squeeze",
        "expand_dims",
        "transpose",
        "rev",
        "slice",
        "dynamic_slice",
        "dynamic_update_slice",
        "gather",
        "concatenate",
        "pad",
    }
)

#: Elementwise and layout primitives through which the operands of a float32 op are
#: recomputed in float32. A value that exists only to feed a float32 op through these
#: (``x * x`` feeding the mean of an RMSNorm, ``jnp.square`` in LayerNorm's fast variance,
#: ``pred - target`` feeding a squared-error loss) is computed in float32 from its
#: compute-dtype inputs: in float16, ``300.0 ** 2`` is already inf. Values that other ops
#: also read (the activations) stay in the compute dtype and are widened where they meet
#: the float32 path.
FLOAT32_PATH_OPS: frozenset[str] = (
    frozenset(
        {
            # Arithmetic.
            "add",
            "sub",
            "mul",
            "div",
            "rem",
            "neg",
            "abs",
            "sign",
            "square",
            "integer_pow",
            "pow",
            "sqrt",
            "rsqrt",
            "cbrt",
            "max",
            "min",
            "clamp",
            "select_n",
            "atan2",
            "floor",
            "ceil",
            "round",
            "exp",
            "exp2",
            "expm1",
            "log",
            "log1p",
            "tanh",
            "logistic",
            "sin",
            "cos",
            "real",
            "imag",
            "conj",
            "complex",
            "convert_element_type",
            "copy",
            "copy_p",
            "reduce_precision",
        }
    )
    | LAYOUT_OPS
)
