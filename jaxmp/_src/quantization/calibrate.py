"""Static activation scales from calibration batches: `calibrate`.

The activation recipes (`Int8DynamicActivations`, `Float8Rowwise`) quantise the activations a
weight's matmul reads with one scale per row, each the row's amax taken at run time: a pass
over the activations before the one that quantises them. `calibrate` runs the quantised
function on a few batches instead and stores, for each such weight, one scale for its
activations (the largest magnitude they reached over every batch, over the grid's largest
value) in its `QuantizedArray.act_scale`; `jaxmp.quantized` then quantises those activations
with it, in one pass, taking no amax.

How the amaxes are found: each weight to calibrate gets, in place of its ``act_scale``, an
array of integer ids (the shape of its scales, distinct across weights); the kernels of
`jaxmp._src.quantization.rules` report, for the ids they see, the amax of the activations
they quantise (`rules.observing`, a host callback). A stacked weight scanned over layers is
sliced with its ids, so each layer reports its own amax and keeps its own scale.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src.quantization import plan as plan_lib
from jaxmp._src.quantization import recipes as q_lib
from jaxmp._src.quantization import rules as rules_lib

__all__ = ["calibrate"]

_ACTIVATION_RECIPES = (q_lib.Int8DynamicActivations, q_lib.Float8Rowwise)
_LOG = logging.getLogger("jaxmp.calibrate")


def calibrate(fun: Callable[..., Any], qparams: Any, batches: Iterable[Any]) -> Any:
    """Static activation scales for `qparams` from calibration batches.

    Runs ``jaxmp.quantized(fun)(qparams, *batch)`` (compiled) on each batch and records, for
    each weight quantised with an activation recipe (``"int8_dynamic"``, ``"fp8"``), the
    largest magnitude of the activations its matmul or convolution reads, over every batch
    (a stacked weight scanned over layers: each layer's own). Returns `qparams` with those
    weights' `QuantizedArray.act_scale` set to ``amax / qmax`` (127 for int8, 448 for E4M3):
    `jaxmp.quantized` then quantises their activations with that one static scale, taking no
    amax at run time. Activations beyond the calibrated range saturate at the grid's largest
    value; a row holding NaN or inf still gives NaN outputs. Every other leaf is returned as
    it is (the same object).

    A weight keeps dynamic scales, said in a WARNING line of the ``jaxmp.calibrate`` logger,
    where one static scale would not fit it: the batches never reached it as a matmul or
    convolution operand, or reached only some layers of a stacked weight; its activations
    were all zero; or it is read by several matmuls whose activations differ by more than
    `SPREAD` (8x: a weight shared by two layers, one reading much smaller values).

    Keyword arguments of `fun` are bound first: ``functools.partial(model.apply,
    deterministic=True)``.

    Args:
      fun: the function `qparams` were quantised for (``jaxmp.quantize(fun, ...)``).
      qparams: `jaxmp.quantize`'s result (or one of `calibrate`'s, calibrated again).
      batches: an iterable of calibration inputs: each a tuple of `fun`'s arguments after
        the params, or a single argument (anything but a tuple). A few batches like the ones
        served: the scales are their largest values.

    Returns:
      `qparams`, its activation-recipe weights with static activation scales.

    Raises:
      ValueError: if `qparams` hold no weight quantised with an activation recipe, if
        `batches` is empty, or if the activations of a weight hold NaN or inf (naming it).
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(qparams, is_leaf=q_lib.is_quantized)
    targets = [
        i
        for i, (_, leaf) in enumerate(flat)
        if q_lib.is_quantized(leaf) and isinstance(leaf.recipe, _ACTIVATION_RECIPES)
    ]
    if not targets:
        recipes = sorted({leaf.recipe.name for _, leaf in flat if q_lib.is_quantized(leaf)})
        raise ValueError(
            "`qparams` hold no weight quantised with an activation recipe ('int8_dynamic' or "
            f"'fp8'): nothing to calibrate (recipes found: {recipes or 'none'}). The "
            "weight-only recipes quantise no activations."
        )
    # Each target's ids: one per value of its scales, distinct across targets.
    offsets, observed, k = {}, [leaf for _, leaf in flat], 0
    for i in targets:
        leaf = flat[i][1]
        n = int(np.prod(np.shape(leaf.scales)))
        ids = jnp.arange(k, k + n, dtype=jnp.int32).reshape(np.shape(leaf.scales))
        observed[i] = _with_act_scale(leaf, ids)
        offsets[i] = (k, n)
        k += n
    starts = np.array([offsets[i][0] for i in targets])
    # Per (site: a kernel traced, target) reporting: the amax per id of that target's ids.
    amax: dict[tuple[int, int], np.ndarray] = {}

    def record(site: int, ids: np.ndarray, value: np.ndarray) -> None:
        ids = np.asarray(ids).ravel()
        if ids.size == 0:
            return
        i = targets[int(np.searchsorted(starts, ids[0], side="right")) - 1]
        start, n = offsets[i]
        seen = amax.setdefault((site, i), np.full(n, -np.inf))
        with np.errstate(invalid="ignore"):  # a NaN is kept, and reported below
            np.maximum.at(seen, ids - start, float(value))

    run = rules_lib.quantized(fun)  # compiled once per argument signature
    observed_params = jax.tree.unflatten(treedef, observed)
    count = 0
    with rules_lib.observing(record):
        for batch in batches:
            args = batch if isinstance(batch, tuple) else (batch,)
            jax.block_until_ready(run(observed_params, *args))
            count += 1
        jax.effects_barrier()
    if count == 0:
        raise ValueError("`batches` is empty: calibrate needs at least one batch.")

    out = [leaf for _, leaf in flat]
    for i in targets:
        leaf, path = flat[i][1], plan_lib.path_string(flat[i][0])
        sites = [a for (_, target), a in amax.items() if target == i]
        scale = _static_scale(path, leaf, sites, offsets[i][1])
        if scale is not None:
            out[i] = _with_act_scale(leaf, jnp.asarray(scale.reshape(np.shape(leaf.scales))))
        elif leaf.act_scale is not None:  # calibrated before: dynamic now
            out[i] = _with_act_scale(leaf, None)
    return jax.tree.unflatten(treedef, out)


#: A weight whose kernels' activations differ by more than this factor keeps dynamic scales:
#: one static scale would leave the smaller few grid steps (int8: 127 / 8, about 16).
SPREAD = 8.0


def _static_scale(
    path: str, leaf: q_lib.QuantizedArray, sites: list[np.ndarray], n: int
) -> np.ndarray | None:
    """The static activation scales of `leaf` (`path`) from the amaxes its kernels (`sites`:
    one array of its `n` ids each, -inf where unseen) recorded; None, said in a log line,
    where it keeps dynamic scales."""
    if any(np.isnan(a).any() or np.isposinf(a).any() for a in sites):
        raise ValueError(
            f"the activations of `qparams` leaf {path!r} hold NaN or inf in the calibration "
            "batches; calibrate with finite ones."
        )
    seen = np.max(sites, axis=0) if sites else np.full(n, -np.inf)
    why = None
    if n == 0:
        why = "it has no output channels"
    elif np.isneginf(seen).all():
        why = "the batches never reached it as a matmul or convolution operand"
    elif np.isneginf(seen).any():
        why = f"the batches reached {np.sum(~np.isneginf(seen))} of its {n} scales only"
    elif (seen == 0).any():
        why = "its activations were all zero in the batches"
    else:
        spread = _spread(sites)
        if spread > SPREAD:
            why = (
                f"it is read by {len(sites)} kernels whose activations differ by up to "
                f"{spread:.3g}x (one static scale would round the smaller to few steps)"
            )
    if why is not None:
        _LOG.warning("jaxmp.calibrate: `qparams` leaf %r keeps dynamic scales: %s.", path, why)
        return None
    dtype = q_lib.scale_dtype(leaf.dtype)
    scale = q_lib.over_qmax(np.asarray(seen, dtype), leaf.recipe.qmax)
    return np.maximum(scale, np.finfo(dtype).tiny).astype(dtype)


def _spread(sites: list[np.ndarray]) -> float:
    """The largest ratio, over the ids two or more kernels read, of the largest amax they
    recorded to the smallest (1 where no id is read twice)."""
    stacked = np.stack(sites)  # (kernels, ids), -inf where a kernel did not see an id
    reached = ~np.isneginf(stacked)
    twice = reached.sum(axis=0) > 1
    if not twice.any():
        return 1.0
    high = stacked.max(axis=0)[twice]
    low = np.where(reached, stacked, np.inf).min(axis=0)[twice]
    with np.errstate(divide="ignore"):
        return float(np.max(high / low))


def _with_act_scale(leaf: q_lib.QuantizedArray, act_scale: Any) -> q_lib.QuantizedArray:
    return q_lib.QuantizedArray(
        leaf.values, leaf.scales, leaf.recipe, leaf.dtype, leaf.contract,
        leaf.contract_shape, act_scale,
    )  # fmt: skip
