"""Casting the floating-point leaves of a pytree, and nothing else."""

from __future__ import annotations

from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jaxmp._src import dtypes

T = TypeVar("T")


def _cast_leaf(x, dtype: np.dtype):
    if not dtypes.is_floating(x) or jnp.dtype(x.dtype) == dtype:
        return x
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
    return x.astype(dtype)


def cast_tree(tree: T, dtype: DTypeLike) -> T:
    """Casts the floating-point array leaves of `tree` to `dtype`.

    Integer, boolean and complex arrays, PRNG keys, ``None``, Python scalars,
    strings and any other leaves pass through unchanged, and so does a leaf that
    already has `dtype` (no copy is made). The tree structure is preserved. NumPy
    leaves stay NumPy arrays; `jax.ShapeDtypeStruct` leaves get the new dtype, so
    the function works on `jax.eval_shape` outputs too.

    Args:
      tree: any pytree.
      dtype: the target floating-point dtype (a dtype or a name like ``"bf16"``).

    Returns:
      A tree of the same structure with floating-point leaves cast to `dtype`.

    Raises:
      ValueError / TypeError: if `dtype` is not a supported floating-point dtype.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> tree = {"w": jnp.ones(2), "step": jnp.int32(3), "name": "dense"}
      >>> out = jaxmp.cast_tree(tree, jnp.bfloat16)
      >>> out["w"].dtype, out["step"].dtype, out["name"]
      (dtype(bfloat16), dtype('int32'), 'dense')
    """
    dtype = dtypes.as_float_dtype(dtype, arg="dtype")
    return jax.tree.map(lambda x: _cast_leaf(x, dtype), tree)


def cast_to_full(tree: T) -> T:
    """Casts floating-point leaves of `tree` to float32 (jmp's name).

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> jaxmp.cast_to_full(jnp.ones(2, jnp.float16)).dtype
      dtype('float32')
    """
    return cast_tree(tree, jnp.float32)


def cast_to_half(tree: T) -> T:
    """Casts floating-point leaves of `tree` to `half_dtype()` (jmp's name).

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> jaxmp.cast_to_half(jnp.ones(2)).dtype  # float16 on CPU and GPU
      dtype('float16')
    """
    return cast_tree(tree, dtypes.half_dtype())


def widen_to_float32(tree: T) -> T:
    """Casts floating-point leaves narrower than float32 to float32; wider ones stay.

    jaxmp unscales and reduces gradients this way: float16 and bfloat16 would
    flush or round away the small values, float64 needs no narrowing.
    """

    def widen(x):
        if not dtypes.is_floating(x):
            return x
        dtype = dtypes.compute_dtype_of(x)
        return x if jnp.dtype(x.dtype) == dtype else x.astype(dtype)

    return jax.tree.map(widen, tree)
