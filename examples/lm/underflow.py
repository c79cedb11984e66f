"""Gradient underflow: what loss scaling prevents, measured against a float32 reference.

Two fractions of nonzero float32 gradient elements that are exactly zero under a config's
policy and loss scale, at given params on one batch: of the param gradients
(`gradient_underflow`) and of the gradients with respect to the logits, where the backward pass
enters the model (`logit_gradient_underflow`). `lm.compare` puts both in its table.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxmp
from lm import config as config_lib
from lm import model as model_lib
from lm.steps import make_loss_fn, make_model, with_precision


def gradient_underflow(
    config: config_lib.Config,
    params: Any,
    batch: tuple[np.ndarray, np.ndarray],
    loss_scale: float = 1.0,
    *,
    vocab_size: int,
) -> float:
    """Fraction of nonzero float32 gradient elements that are exactly zero under `config`.

    The reference is the gradient of the same loss computed entirely in float32 at `params`;
    the test gradient is computed under `config.policy` (params cast to its param dtype) with
    the loss multiplied by `loss_scale`. In float16 without loss scaling, gradient values below
    float16's smallest subnormal (6e-8) flush to zero: the updates loss scaling preserves.
    """
    params_f32 = jaxmp.cast_tree(params, jnp.float32)
    reference = make_model(with_precision(config, "f32"), vocab_size)
    model = make_model(config, vocab_size)

    @jax.jit
    def count(params_f32):
        ref_fn = jaxmp.value_and_grad(make_loss_fn(reference))
        _, ref = ref_fn(jaxmp.NoOpLossScale(), params_f32, *batch)
        scale = jaxmp.NoOpLossScale() if loss_scale == 1.0 else jaxmp.StaticLossScale(loss_scale)
        test_fn = jaxmp.value_and_grad(make_loss_fn(model))
        _, test = test_fn(scale, config.policy.cast_to_param(params_f32), *batch)
        nonzero = sum(jnp.sum(r != 0) for r in jax.tree.leaves(ref))
        flushed = sum(
            jnp.sum((r != 0) & (t == 0))
            for r, t in zip(jax.tree.leaves(ref), jax.tree.leaves(test), strict=True)
        )
        return flushed / jnp.maximum(nonzero, 1)

    return float(count(params_f32))


def logit_gradient_underflow(
    config: config_lib.Config,
    params: Any,
    batch: tuple[np.ndarray, np.ndarray],
    loss_scale: float = 1.0,
    *,
    vocab_size: int,
) -> float:
    """Fraction of nonzero float32 gradients w.r.t. the logits that round to zero under `config`.

    The backward pass enters the model through the logits: their float32 gradient (times
    `loss_scale`) is cast to the output and then the compute dtype. For a mean loss over
    ``batch * seq_len`` characters each element is ``(p - onehot) / (batch * seq_len)``, so
    the gradients of improbable characters are far below float16's smallest subnormal.
    """
    reference = make_model(with_precision(config, "f32"), vocab_size)
    policy = config.policy
    inputs, targets = batch

    @jax.jit
    def fraction(params_f32):
        logits = reference.apply({"params": params_f32}, inputs)
        grads = jax.grad(model_lib.cross_entropy)(logits, targets) * loss_scale
        cast = grads.astype(policy.output_dtype).astype(policy.compute_dtype)
        nonzero = grads != 0
        return jnp.sum(nonzero & (cast == 0)) / jnp.maximum(jnp.sum(nonzero), 1)

    return float(fraction(jaxmp.cast_tree(params, jnp.float32)))
