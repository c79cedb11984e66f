"""The programs of a config: its model, optimizer, initial state, train and eval steps.

`programs` builds them once per process (`functools.lru_cache`), so training a config again
in one process (a resumed run, the tests) reuses what JAX has traced and compiled. Every
precision starts from the same float32 init (`create_train_state`); the train step takes the
gradients of the scaled loss (`jaxmp.value_and_grad`) and leaves unscaling, skipping and the
loss-scale update to the optimizer, `jaxmp.mixed_precision`. The loop that runs them is in
`lm.loop`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from loss_scale_tools import grad_norm

import jaxmp
from lm import config as config_lib
from lm import data as data_lib
from lm import model as model_lib


class TrainState(NamedTuple):
    step: jax.Array  # shape=(), dtype=int32; optimizer steps taken, skipped ones included
    params: Any  # in policy.param_dtype
    opt_state: Any  # jaxmp.mixed_precision's state: loss scale, FP32 master weights if any
    fp8_state: Any = None  # jaxmp.Float8State with `fp8: delayed`, else None


@functools.lru_cache(maxsize=4)
def get_dataset(val_fraction: float) -> data_lib.Dataset:
    return data_lib.make_dataset(val_fraction)


def make_model(config: config_lib.Config, vocab_size: int) -> model_lib.TransformerLM:
    """The model with the dtypes of `config.policy`."""
    policy = config.policy
    return model_lib.TransformerLM(
        vocab_size=vocab_size,
        max_len=config.seq_len,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        d_model=config.d_model,
        mlp_ratio=config.mlp_ratio,
        dtype=policy.compute_dtype,
        param_dtype=policy.param_dtype,
        output_dtype=policy.output_dtype,
    )


def learning_rate_schedule(config: config_lib.Config) -> optax.Schedule:
    """Warmup to `learning_rate`, then a cosine decay to a tenth of it at `steps`.

    With `qat` the rate ends at zero: quantization-aware steps move weights across the grid's
    rounding boundaries (and int4's choices of scale), and a rate annealed to zero lets them
    settle (docs/guides/quantized_inference.md measures it). A fine-tune (`qat_start`) keeps
    the schedule of the config without `qat` up to `qat_start`, then a cosine from the rate
    there to zero.
    """
    decay_steps = max(config.steps, config.warmup_steps + 1)
    qat = config.qat != "none"
    end = 0.0 if qat and not config.qat_start else config.learning_rate * 0.1
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.learning_rate, config.warmup_steps, decay_steps, end
    )
    if not (qat and config.qat_start):
        return schedule
    tail = optax.cosine_decay_schedule(
        float(schedule(config.qat_start)), config.steps - config.qat_start, 0.0
    )
    return optax.join_schedules([schedule, tail], [config.qat_start])


def make_optimizer(config: config_lib.Config) -> optax.GradientTransformationExtraArgs:
    """AdamW with `learning_rate_schedule`, wrapped by `jaxmp.mixed_precision` for the policy.

    The inner optimizer sees unscaled float32 gradients (of the FP32 master weights when the
    params are half precision and the config keeps them); skipped steps leave its state, and so
    the schedule, untouched. The config's low-memory keys choose how half-precision params are
    updated without a master copy and how the moments are stored between steps.
    """
    schedule = learning_rate_schedule(config)
    inner = optax.chain(
        optax.clip_by_global_norm(config.grad_clip) if config.grad_clip else optax.identity(),
        optax.adamw(schedule, b2=0.99, weight_decay=config.weight_decay),
    )
    return config.make_optimizer_wrapper(inner)


def create_train_state(
    config: config_lib.Config, rng: jax.Array, *, vocab_size: int | None = None
) -> TrainState:
    """Initial state: float32 init (the same values for every policy), stored in param dtype.

    The optimizer is initialised from the float32 params, so FP32 master weights start exact.
    """
    if vocab_size is None:
        vocab_size = get_dataset(config.val_fraction).vocab_size
    return programs(config, vocab_size).init(rng)


@functools.partial(jax.jit, static_argnums=0)
def init_params(model: model_lib.TransformerLM, rng: jax.Array) -> Any:
    """``model``'s initial params. One compile per model: `make_init` passes the float32 model,
    which every policy of the same shape shares."""
    return model.init(rng, jnp.zeros((1, model.max_len), jnp.int32))["params"]


def make_init(config: config_lib.Config, model: model_lib.TransformerLM, tx):
    """The ``rng -> TrainState`` of `create_train_state` for `model`: the params of its float32
    twin (`init_params`), then the state from them (one jitted program)."""
    init_model = make_model(with_precision(config, "f32"), model.vocab_size)
    fp8 = make_fp8_apply(config, model)

    @jax.jit
    def state_from(params_f32: Any) -> TrainState:
        opt_state = tx.init(params_f32)
        params = config.policy.cast_to_param(params_f32)
        fp8_state = None
        if config.fp8 == "delayed":
            tokens = jnp.zeros((1, config.seq_len), jnp.int32)
            fp8_state = fp8.fp8_init({"params": params}, tokens)
        return TrainState(jnp.zeros((), jnp.int32), params, opt_state, fp8_state)

    def init(rng: jax.Array) -> TrainState:
        return state_from(init_params(init_model, rng))

    return init


class Programs(NamedTuple):
    model: model_lib.TransformerLM
    tx: optax.GradientTransformationExtraArgs
    init: Any  # `make_init`'s
    train_step: Any  # `make_train_step`'s, unjitted (with `qat_start`, the steps up to it)
    eval_step: Any  # `make_eval_step`'s, unjitted
    qat_train_step: Any = None  # with `qat_start`: the quantization-aware steps after it


@functools.lru_cache(maxsize=8)
def programs(config: config_lib.Config, vocab_size: int) -> Programs:
    """The model, optimizer and step functions of `config`, built once per process.

    Training the same config again in one process (a resumed run, the tests) then reuses what
    JAX has traced and compiled for these functions instead of tracing them again.
    """
    model = make_model(config, vocab_size)
    tx = make_optimizer(config)
    # A quantization-aware fine-tune trains its first `qat_start` steps with the program of
    # the config without `qat` (so, bit for bit, as that run), then switches programs.
    fine_tune = config.qat != "none" and config.qat_start > 0
    return Programs(
        model=model,
        tx=tx,
        init=make_init(config, model, tx),
        train_step=make_train_step(config, model, tx),
        qat_train_step=make_train_step(config, model, tx, True) if fine_tune else None,
        eval_step=make_eval_step(
            model, make_fp8_apply(config, model), make_qat_apply(config, model)
        ),
    )


def make_fp8_apply(config: config_lib.Config, model: model_lib.TransformerLM):
    """``model.apply`` with the linear layers in FP8 (config key `fp8`); None without FP8.

    Only the matmuls change: everything else runs as the model writes it. The head and the
    attention's products of activations (einsums, named by their equation) stay out of FP8.
    """
    if config.fp8_recipe is None:
        return None
    return jaxmp.autocast(
        model.apply,
        config.policy,
        low_precision_ops=("dot_general",),
        float32_ops=(),
        fp8=config.fp8_recipe,
        fp8_exclude=("TransformerLM/head", r".*/attn/.*->.*"),
    )


def make_qat_apply(config: config_lib.Config, model: model_lib.TransformerLM):
    """``model.apply`` with the serving numerics of the `qat` recipe in the forward pass and
    straight-through gradients (`jaxmp.quantization_aware`); None without `qat`.

    Every matmul weight is quantised, as ``examples/serve.py`` quantises them (the
    embeddings, read by gather, stay float)."""
    if config.qat_recipe is None:
        return None
    return jaxmp.quantization_aware(model.apply, recipe=config.qat_recipe)


def make_loss_fn(model: model_lib.TransformerLM, fp8: Any = None, qat: Any = None):
    """``(params, inputs, targets, fp8_state=None) -> loss``; `fp8` from `make_fp8_apply`,
    `qat` from `make_qat_apply`."""

    def loss_fn(params, inputs, targets, fp8_state=None):
        apply = model.apply if fp8 is None else fp8
        if qat is not None:
            apply = qat
        if fp8_state is not None:
            apply = fp8.with_fp8_state(fp8_state)
        return model_lib.cross_entropy(apply({"params": params}, inputs), targets)

    return loss_fn


def make_train_step(
    config: config_lib.Config,
    model: model_lib.TransformerLM,
    tx,
    quantization_aware: bool | None = None,
):
    """The (unjitted) train step ``(state, inputs, targets) -> (state, metrics)``.

    `quantization_aware` (default: with `qat` from the start) runs the forward pass of
    `make_qat_apply`; a fine-tune's steps before `qat_start` run the step without it.

    Gradients are of the loss times the current loss scale; ``tx.update`` unscales them in
    float32, skips the update when any is non-finite and adjusts the scale. ``grad_norm`` is
    the norm of the gradients passed to ``tx.update`` (scaled, so it follows the loss scale:
    `check_gradients_are_scaled` relies on that).
    """
    if quantization_aware is None:
        quantization_aware = config.qat != "none" and not config.qat_start
    # With delayed FP8 scaling, the "gradient" of the FP8 state is the next state
    # (docs/guides/fp8.md); a skipped step keeps the old one.
    delayed = config.fp8 == "delayed"
    qat = make_qat_apply(config, model) if quantization_aware else None
    loss_fn = make_loss_fn(model, make_fp8_apply(config, model), qat)
    grad_fn = jaxmp.value_and_grad(loss_fn, argnums=(0, 3) if delayed else 0)

    def train_step(state: TrainState, inputs: jax.Array, targets: jax.Array):
        loss_scale = jaxmp.get_loss_scale(state.opt_state)
        loss, grads = grad_fn(loss_scale, state.params, inputs, targets, state.fp8_state)
        fp8_state = None
        if delayed:
            grads, fp8_state = grads
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm(grads),
            **jaxmp.loss_scale_metrics(opt_state),
        }
        if delayed:
            finite = metrics["grads_finite"]
            fp8_state = jax.tree.map(
                lambda new, old: jnp.where(finite, new, old), fp8_state, state.fp8_state
            )
        return TrainState(state.step + 1, params, opt_state, fp8_state), metrics

    return train_step


def make_eval_step(model: model_lib.TransformerLM, fp8: Any = None, qat: Any = None):
    """The (unjitted) eval step ``(params, inputs, targets, fp8_state=None) -> mean loss``;
    with `qat` (`make_qat_apply`), the loss of the model as served quantised."""
    return make_loss_fn(model, fp8, qat)


def with_precision(config: config_lib.Config, precision: str) -> config_lib.Config:
    """`config` with another precision, and the optimizer options every precision accepts."""
    defaults = config_lib.Config()
    return dataclasses.replace(
        config,
        precision=precision,
        master_weights=defaults.master_weights,
        rounding=defaults.rounding,
    )
