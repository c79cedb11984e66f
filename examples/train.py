"""Trains a character-level transformer language model under a jaxmp precision policy.

The data is the documentation text shipped with Python (Python 3.11's `pydoc_data.topics`,
stored in ``examples/lm/corpus.txt.xz``), so nothing is downloaded. One run trains under one
config from ``configs/``; ``--compare`` trains several on the same data and seed and prints a
side-by-side summary.

Usage:
    python examples/train.py                              # configs/mixed_float16.yaml
    python examples/train.py --config fp32 --set steps=300
    python examples/train.py --resume                     # continue runs/mixed_float16
    python examples/train.py --overwrite                  # replace runs/mixed_float16
    python examples/train.py --compare                    # every config in configs/
    python examples/train.py --compare fp32,mixed_float16
    python examples/train.py --inspect 1,1500             # jaxmp.inspect at steps 1 and 1500

Each run writes to ``--workdir`` (default ``runs/<config name>``): ``metrics.jsonl`` and
``metrics.csv`` (one row per step), ``config.yaml`` (the resolved config), ``checkpoints/``
(orbax; ``--resume`` continues from the latest one, bit-identically) and ``losses.png``. A new
run refuses a directory that is not empty: nothing is replaced without ``--overwrite``.
``--inspect`` adds ``inspect.json`` (a `jaxmp.inspect` report of the step's forward and backward
pass at each chosen step) and ``inspect.png`` (the figure of the latest one).
Ctrl-C stops after the step in progress, with its metrics row and its checkpoint saved.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import functools
import json
import logging
import math
import os
import pathlib
import shutil
import signal
import statistics
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import sharding
from lm import config as config_lib
from lm import data as data_lib
from lm import model as model_lib
from loss_scale_tools import (
    LossScalingError,
    check_gradients_are_scaled,
    describe_scale,
    grad_norm,
)
from tqdm import tqdm

import jaxmp

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = "mixed_float16"
COMPARE_ORDER = (
    "fp32",
    "mixed_float16",
    "mixed_bfloat16",
    "float16_master_weights",
    "float16_no_loss_scale",
    "bf16_master_weights",
    "bf16_round_to_nearest",
    "bf16_stochastic_rounding",
    "bf16_kahan_summation",
    "bf16_8bit_states",
    "mixed_fp8",
    "mixed_fp8_delayed",
    "mixed_fp8_block",
)
COLUMNS = (
    "step",
    "train_loss",
    "val_loss",
    "loss_scale",
    "skipped",
    "skipped_total",
    "step_time_s",
)


class TrainState(NamedTuple):
    step: jax.Array  # shape=(), dtype=int32; optimizer steps taken, skipped ones included
    params: Any  # in policy.param_dtype
    opt_state: Any  # jaxmp.mixed_precision's state: loss scale, FP32 master weights if any
    fp8_state: Any = None  # jaxmp.Float8State with `fp8: delayed`, else None


@dataclasses.dataclass
class RunResult:
    """What one run produced; `history` holds one metrics record per step."""

    config: config_lib.Config
    workdir: pathlib.Path
    state: TrainState
    history: list[dict[str, Any]]
    final_val_loss: float
    unigram_loss: float
    peak_memory_bytes: int | None
    sample: str

    @property
    def skipped_steps(self) -> int:
        return self.history[-1]["skipped_total"] if self.history else 0

    @property
    def final_loss_scale(self) -> float:
        return float(jaxmp.get_loss_scale(self.state.opt_state).loss_scale)

    @property
    def bytes_per_param(self) -> float:
        """Bytes of the params and the optimizer state per parameter, read from the state."""
        params = jax.tree.leaves(self.state.params)
        stored = jax.tree.leaves((self.state.params, self.state.opt_state))
        return sum(x.nbytes for x in stored) / sum(x.size for x in params)

    @property
    def median_step_time(self) -> float:
        # The first step of a fresh run includes compilation-related warm-up: leave it out.
        times = [r["step_time_s"] for r in self.history[1:]] or [math.nan]
        return statistics.median(times)


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


def make_optimizer(config: config_lib.Config) -> optax.GradientTransformationExtraArgs:
    """AdamW with warmup and cosine decay, wrapped by `jaxmp.mixed_precision` for the policy.

    The inner optimizer sees unscaled float32 gradients (of the FP32 master weights when the
    params are half precision and the config keeps them); skipped steps leave its state, and so
    the schedule, untouched. The config's low-memory keys choose how half-precision params are
    updated without a master copy and how the moments are stored between steps.
    """
    decay_steps = max(config.steps, config.warmup_steps + 1)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.learning_rate, config.warmup_steps, decay_steps, config.learning_rate * 0.1
    )
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
    train_step: Any  # `make_train_step`'s, unjitted
    eval_step: Any  # `make_eval_step`'s, unjitted


@functools.lru_cache(maxsize=8)
def programs(config: config_lib.Config, vocab_size: int) -> Programs:
    """The model, optimizer and step functions of `config`, built once per process.

    Training the same config again in one process (a resumed run, the tests) then reuses what
    JAX has traced and compiled for these functions instead of tracing them again.
    """
    model = make_model(config, vocab_size)
    tx = make_optimizer(config)
    return Programs(
        model=model,
        tx=tx,
        init=make_init(config, model, tx),
        train_step=make_train_step(config, model, tx),
        eval_step=make_eval_step(model, make_fp8_apply(config, model)),
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


def make_loss_fn(model: model_lib.TransformerLM, fp8: Any = None):
    """``(params, inputs, targets, fp8_state=None) -> loss``; `fp8` from `make_fp8_apply`."""

    def loss_fn(params, inputs, targets, fp8_state=None):
        apply = model.apply if fp8 is None else fp8
        if fp8_state is not None:
            apply = fp8.with_fp8_state(fp8_state)
        return model_lib.cross_entropy(apply({"params": params}, inputs), targets)

    return loss_fn


def make_train_step(config: config_lib.Config, model: model_lib.TransformerLM, tx):
    """The (unjitted) train step ``(state, inputs, targets) -> (state, metrics)``.

    Gradients are of the loss times the current loss scale; ``tx.update`` unscales them in
    float32, skips the update when any is non-finite and adjusts the scale. ``grad_norm`` is
    the norm of the gradients passed to ``tx.update`` (scaled, so it follows the loss scale:
    `check_gradients_are_scaled` relies on that).
    """
    # With delayed FP8 scaling, the "gradient" of the FP8 state is the next state
    # (docs/guides/fp8.md); a skipped step keeps the old one.
    delayed = config.fp8 == "delayed"
    loss_fn = make_loss_fn(model, make_fp8_apply(config, model))
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


def make_eval_step(model: model_lib.TransformerLM, fp8: Any = None):
    """The (unjitted) eval step ``(params, inputs, targets, fp8_state=None) -> mean loss``."""
    return make_loss_fn(model, fp8)


def evaluate(
    eval_step,
    params: Any,
    batches: Sequence[tuple[np.ndarray, np.ndarray]],
    fp8_state: Any = None,
) -> float:
    """Mean loss (nats/char) over `batches` (all of the same size)."""
    losses = [eval_step(params, inputs, targets, fp8_state) for inputs, targets in batches]
    return float(np.mean(jax.device_get(losses)))


def generate(
    model: model_lib.TransformerLM,
    params: Any,
    dataset: data_lib.Dataset,
    prompt: str = "The ",
    length: int = 80,
    seed: int = 0,
    temperature: float = 0.8,
) -> str:
    """Samples `length` characters after `prompt` (fixed seed, so the text is reproducible)."""
    window_len = model.max_len

    @jax.jit
    def next_token(params, window, pos, key):
        logits = model.apply({"params": params}, window[None])[0, pos].astype(jnp.float32)
        return jax.random.categorical(key, logits / temperature)

    ids = [int(i) for i in dataset.encode(prompt)]
    key = jax.random.PRNGKey(seed)
    for _ in range(length):
        context = ids[-window_len:]
        window = np.zeros(window_len, np.int32)
        window[: len(context)] = context  # causal attention: the padding after it is unseen
        key, sub = jax.random.split(key)
        ids.append(int(next_token(params, window, len(context) - 1, sub)))
    return dataset.decode(ids[len(ids) - length :])


def with_precision(config: config_lib.Config, precision: str) -> config_lib.Config:
    """`config` with another precision, and the optimizer options every precision accepts."""
    defaults = config_lib.Config()
    return dataclasses.replace(
        config,
        precision=precision,
        master_weights=defaults.master_weights,
        rounding=defaults.rounding,
    )


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


def parse_inspect_steps(text: str, steps: int) -> tuple[int, ...]:
    """The steps ``--inspect`` names (``"1,100"``; ``""``: the first and the last step).

    Raises:
      ValueError: one line naming the value and the valid steps.
    """
    if not text:
        return tuple(sorted({1, steps}))
    try:
        chosen = [int(s) for s in text.split(",")]
    except ValueError:
        chosen = []
    if not chosen or not all(1 <= s <= steps for s in chosen):
        raise ValueError(
            f"--inspect expects comma-separated steps from 1 to {steps} (the config's steps), "
            f"got {text!r}."
        )
    return tuple(sorted(set(chosen)))


def make_inspected_grad(config: config_lib.Config, model: model_lib.TransformerLM):
    """The train step's loss and gradients under `jaxmp.inspect`, jitted.

    ``(loss_scale, params, inputs, targets, fp8_state) -> ((loss, grads), report)``: the
    model's forward and backward pass at the step's loss scale, as the train step computes
    them (FP8 included). The optimizer update is left out: it computes in float32, and its ops
    (a set per parameter) would make the inspected program several times slower to compile.
    """
    loss_fn = make_loss_fn(model, make_fp8_apply(config, model))
    argnums = (0, 3) if config.fp8 == "delayed" else 0
    return jax.jit(jaxmp.inspect(jaxmp.value_and_grad(loss_fn, argnums=argnums)))


def load_inspections(workdir: pathlib.Path, upto: int) -> list[dict[str, Any]]:
    """The entries of ``inspect.json`` up to step `upto` (a resumed run's checkpoint step)."""
    try:
        entries = json.loads((workdir / "inspect.json").read_text())["inspections"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [e for e in entries if isinstance(e, dict) and e.get("step", upto + 1) <= upto]


def write_inspection(
    workdir: pathlib.Path,
    config: config_lib.Config,
    step: int,
    loss_scale: float,
    report: jaxmp.Report,
    entries: list[dict[str, Any]],
) -> dict[str, Any]:
    """Adds `report` of `step` to `entries`; writes them to ``inspect.json``, its figure to
    ``inspect.png`` (each replaced atomically). Returns the new entry."""
    try:
        suggestion = report.suggest_loss_scale(loss_scale)
    except ValueError:  # no backward value to keep in range
        suggestion = None
    first = report.first_nonfinite
    entry = {
        "step": step,
        "loss_scale": loss_scale,
        "suggested_loss_scale": None if suggestion is None else suggestion.loss_scale,
        "suggestion": None if suggestion is None else str(suggestion),
        "first_nonfinite": None
        if first is None
        else f"{first.op} ({first.phase}) at {first.location} in {first.module or '(no module)'}",
        "report": report.to_dict(),
    }
    entries[:] = [e for e in entries if e["step"] != step] + [entry]
    data = {"config": config.name, "precision": str(config.policy), "inspections": entries}
    tmp = workdir / "inspect.json.tmp"
    tmp.write_text(json.dumps(data, allow_nan=False) + "\n")
    os.replace(tmp, workdir / "inspect.json")
    title = f"{config.name} ({config.policy}), step {step}, loss scale {describe_scale(loss_scale)}"
    fig = report.plot(workdir / "inspect.tmp.png", title=title)
    _pyplot().close(fig)
    os.replace(workdir / "inspect.tmp.png", workdir / "inspect.png")
    return entry


RUN_OUTPUTS = ("config.yaml", "metrics.jsonl", "metrics.csv", "losses.png", "checkpoints")
RUN_OUTPUTS += ("inspect.json", "inspect.png")
COMPARE_OUTPUTS = ("summary.md", "summary.json", "compare.png")


class RunDirError(ValueError):
    """The run directory does not fit the request; the one-line message says what to do.

    A new run into a directory that is not empty, ``--resume`` without a checkpoint, or a
    checkpoint that cannot be read. Raised before anything in the directory is changed.
    """


def show_path(path: str | pathlib.Path) -> str:
    """`path` relative to the working directory when it is inside it, for messages."""
    path = pathlib.Path(path).resolve()
    try:
        return str(path.relative_to(pathlib.Path.cwd().resolve())) or "."
    except ValueError:
        return str(path)


def _is_empty(path: pathlib.Path) -> bool:
    return not path.exists() or (path.is_dir() and not any(path.iterdir()))


def checkpoint_steps(workdir: pathlib.Path) -> list[int]:
    """The steps of the complete checkpoints in ``workdir/checkpoints``, ascending."""
    ckpt_dir = workdir / "checkpoints"
    if not ckpt_dir.is_dir():
        return []
    options = ocp.CheckpointManagerOptions(create=False)
    with ocp.CheckpointManager(ckpt_dir, options=options) as manager:
        return sorted(manager.all_steps())


def _describe_run(workdir: pathlib.Path) -> str:
    steps = checkpoint_steps(workdir)
    if steps:
        return f"a run (checkpoint at step {steps[-1]})"
    if any((workdir / name).exists() for name in RUN_OUTPUTS):
        return "a run (no checkpoint)"
    return "files"


def check_workdir(workdir: pathlib.Path, *, resume: bool, overwrite: bool) -> list[int]:
    """Checks that `workdir` fits the request; returns its checkpoint steps.

    A new run needs an empty (or missing) directory, ``resume`` needs a checkpoint in it, and
    ``overwrite`` accepts anything (it replaces only the run's own outputs, `RUN_OUTPUTS`).

    Raises:
      RunDirError: naming the directory and the options that apply.
    """
    if resume and overwrite:
        raise ValueError("`resume` and `overwrite` exclude each other.")
    where = show_path(workdir)
    if workdir.exists() and not workdir.is_dir():
        raise RunDirError(f"--workdir {where} is a file; choose a directory.")
    if resume:
        steps = checkpoint_steps(workdir)
        if not steps:
            found = "the directory does not exist" if not workdir.exists() else "none found"
            raise RunDirError(
                f"--resume: no checkpoint in {where}/checkpoints ({found}); check --workdir, "
                "or start a new run without --resume."
            )
        return steps
    if overwrite or _is_empty(workdir):
        return []
    raise RunDirError(
        f"{where} already holds {_describe_run(workdir)}; continue it with --resume, replace "
        "it with --overwrite, or choose another --workdir."
    )


def remove_run_outputs(workdir: pathlib.Path, names: Sequence[str] = RUN_OUTPUTS) -> None:
    """Deletes what a run (or a comparison, with `COMPARE_OUTPUTS`) wrote; other files stay."""
    for name in names:
        path = workdir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def _short_reason(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    text = text.split(" See full TensorStore details")[0]
    return text if len(text) <= 160 else text[:157] + "..."


def restore_checkpoint(workdir: pathlib.Path, steps: Sequence[int], state: Any) -> TrainState:
    """Restores the latest of `steps` as `state` (arrays or `jax.ShapeDtypeStruct`s) lays out.

    Raises:
      RunDirError: if the checkpoint cannot be read (truncated or corrupt files), naming it.
    """
    step = steps[-1]
    options = ocp.CheckpointManagerOptions(create=False)
    previous_hook = sys.unraisablehook
    sys.unraisablehook = functools.partial(_ignore_abandoned_reads, previous_hook)
    try:
        with ocp.CheckpointManager(workdir / "checkpoints", options=options) as manager:
            restored = manager.restore(step, args=ocp.args.StandardRestore(state))
    except Exception as e:  # orbax and tensorstore raise plain Exceptions for damaged files
        # Reads still in flight finish after this error is reported: their reports stay silenced.
        warnings.filterwarnings("ignore", r"coroutine '.*' was never awaited", RuntimeWarning)
        path = show_path(workdir / "checkpoints" / str(step))
        earlier = (
            f"delete it to resume from step {steps[-2]}, or"
            if len(steps) > 1
            else "there is no earlier one:"
        )
        raise RunDirError(
            f"--resume: cannot read checkpoint {path} ({type(e).__name__}: {_short_reason(e)}); "
            f"{earlier} start again with --overwrite."
        ) from None
    sys.unraisablehook = previous_hook
    return restored


def _ignore_abandoned_reads(previous: Any, unraisable: Any) -> None:
    """An unraisable-exception hook that drops the reports of a failed restore's leftover reads.

    When one read of a damaged checkpoint fails, orbax stops waiting and closes its event loop;
    tensorstore's threads then finish the other reads and try to post each result to that closed
    loop, and Python reports every attempt as a `RuntimeError: Event loop is closed` traceback.
    Those results are unwanted anyway (the coroutines that would have taken them are never awaited,
    a warning the caller silences too). Any other unraisable exception goes to `previous`.
    """
    error = unraisable.exc_value
    if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
        previous(unraisable)


def load_history(workdir: pathlib.Path, upto: int) -> list[dict[str, Any]]:
    """The metrics rows of steps 1 to `upto` (a resumed run's checkpoint step).

    Rows after `upto` (a run that crashed after its last checkpoint) are dropped: the resumed
    run computes them again, identically. A last line cut short by the crash is ignored.

    Raises:
      RunDirError: if a row before the checkpoint is missing.
    """
    path = workdir / "metrics.jsonl"
    rows: dict[int, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                if 1 <= row["step"] <= upto:
                    rows[row["step"]] = row
    missing = [step for step in range(1, upto + 1) if step not in rows]
    if missing:
        listed = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
        raise RunDirError(
            f"--resume: {show_path(path)} has no rows for steps {listed} (of 1 to {upto}, the "
            "checkpoint's step); start again with --overwrite."
        )
    return [rows[step] for step in range(1, upto + 1)]


class MetricsWriter:
    """Appends one record per step to ``metrics.jsonl`` and ``metrics.csv``.

    A resumed run starts both files again from the rows up to its checkpoint, replacing them
    atomically, so a crash at any point leaves complete files behind.
    """

    def __init__(self, workdir: pathlib.Path, history: list[dict[str, Any]]):
        jsonl, csv_path = workdir / "metrics.jsonl", workdir / "metrics.csv"
        with open(jsonl.with_suffix(".jsonl.tmp"), "w") as f:
            f.writelines(json.dumps(record) + "\n" for record in history)
        with open(csv_path.with_suffix(".csv.tmp"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(self._csv_row(record) for record in history)
        os.replace(jsonl.with_suffix(".jsonl.tmp"), jsonl)
        os.replace(csv_path.with_suffix(".csv.tmp"), csv_path)
        self._jsonl = open(jsonl, "a")
        self._csv_file = open(csv_path, "a", newline="")
        self._csv = csv.DictWriter(self._csv_file, fieldnames=COLUMNS)

    @staticmethod
    def _csv_row(record: dict[str, Any]) -> dict[str, Any]:
        return {k: ("" if record[k] is None else record[k]) for k in COLUMNS}

    def write(self, record: dict[str, Any]) -> None:
        self._jsonl.write(json.dumps(record) + "\n")
        self._csv.writerow(self._csv_row(record))

    def flush(self) -> None:
        self._jsonl.flush()
        self._csv_file.flush()

    def close(self) -> None:
        self._jsonl.close()
        self._csv_file.close()


@contextlib.contextmanager
def stop_after_step_on_sigint():
    """Turns the first Ctrl-C (SIGINT) into a request to stop after the step in progress.

    Yields a function that says whether a stop was requested. A second Ctrl-C interrupts at
    once (`KeyboardInterrupt`). Outside the main thread, where Python cannot install signal
    handlers, Ctrl-C always interrupts at once.
    """
    requested: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return

    def handler(signum, frame):
        del signum, frame
        if requested:
            raise KeyboardInterrupt
        requested.append(True)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: bool(requested)
    finally:
        signal.signal(signal.SIGINT, previous)


def train_and_evaluate(
    config: config_lib.Config,
    workdir: str | pathlib.Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    verbose: bool = True,
    stop_at: int | None = None,
    sample_length: int = 80,
    figure: bool = True,
    inspect_steps: Sequence[int] = (),
) -> RunResult:
    """Trains `config` in `workdir`; returns the final state, metrics and a text sample.

    Args:
        config: the run's config.
        workdir: where metrics, the resolved config, checkpoints and the figure go.
        resume: continue from the latest checkpoint in `workdir` (an error if there is none).
        overwrite: replace the outputs of a run already in `workdir`. They are deleted only
            once the new run has compiled, just before it writes its first output.
        progress: show a tqdm bar.
        verbose: print a line per evaluation, loss-scale change and skipped step.
        stop_at: stop (and checkpoint) after this step, as if interrupted; the schedule still
            runs to ``config.steps``.
        sample_length: characters of generated text in the result (0: none).
        figure: write ``losses.png`` (`run_figure`).
        inspect_steps: before these steps, inspect the step's forward and backward pass
            (`jaxmp.inspect`) and write ``inspect.json`` and ``inspect.png`` (see
            `write_inspection`); the training itself is unchanged.

    Raises:
        RunDirError: `workdir` is not empty (and neither `resume` nor `overwrite` is set),
            `resume` finds no readable checkpoint, or the metrics lack rows before it.
        LossScalingError: the train step's gradients do not follow the loss scale.
        KeyboardInterrupt: after Ctrl-C, once the step in progress, its metrics row and its
            checkpoint are saved (a second Ctrl-C interrupts at once; the checkpoint is then
            that of the last step whose metrics row was written).
    """
    workdir = pathlib.Path(workdir).resolve()
    steps_saved = check_workdir(workdir, resume=resume, overwrite=overwrite)
    if steps_saved and steps_saved[-1] > config.steps:
        raise RunDirError(
            f"--resume: the checkpoint in {show_path(workdir)} is at step {steps_saved[-1]}, "
            f"past the config's steps={config.steps}; raise it with --set steps=..."
        )
    dataset = get_dataset(config.val_fraction)
    built = programs(config, dataset.vocab_size)
    model, tx = built.model, built.tx
    rng = jax.random.PRNGKey(config.seed)
    mesh = sharding.make_mesh(config.mesh) if config.mesh else None
    jit_kwargs: dict[str, Any] = {}
    if mesh is not None:  # Params and optimizer state sharded FSDP-style, the batch over all.
        state = create_train_state(config, rng, vocab_size=dataset.vocab_size)
        state, state_shardings = sharding.shard_train_state(tx, state, mesh)
        jit_kwargs["out_shardings"] = (state_shardings, sharding.replicated(mesh))
    elif resume:  # Only the shapes and dtypes: the checkpoint holds the values.
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        state = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
            jax.eval_shape(built.init, rng),
        )
    else:
        # Committed to the device, as a restored checkpoint is: a new and a resumed run then
        # compile the same program (and share it through a persistent compilation cache).
        state = create_train_state(config, rng, vocab_size=dataset.vocab_size)
        state = jax.device_put(state, jax.local_devices()[0])

    def put(batch):
        return batch if mesh is None else sharding.shard_batch(batch, mesh)

    history: list[dict[str, Any]] = []
    if resume:
        state = restore_checkpoint(workdir, steps_saved, state)
        history = load_history(workdir, int(state.step))
    start = int(state.step)

    inputs, targets = put(
        data_lib.train_batch(dataset.train, config.seed, start, config.batch_size, config.seq_len)
    )
    train_step = jax.jit(built.train_step, **jit_kwargs)
    compiled = train_step.lower(state, inputs, targets).compile()
    memory = compiled.memory_analysis()
    peak = None
    if memory is not None:
        peak = int(memory.temp_size_in_bytes + memory.argument_size_in_bytes)
    stop = config.steps if stop_at is None else min(stop_at, config.steps)
    if start < stop:
        # The step's gradients must be those of the scaled loss (jaxmp.value_and_grad): with
        # jax.grad every update would be the loss scale times too small, silently.
        def grad_norm_at(opt_state):
            _, metrics = compiled(state._replace(opt_state=opt_state), inputs, targets)
            return metrics["grad_norm"]

        check_gradients_are_scaled(grad_norm_at, state.opt_state)
    eval_step = jax.jit(built.eval_step)
    val_batches = data_lib.eval_batches(
        dataset.val, config.eval_batches, config.batch_size, config.seq_len
    )

    # Everything is ready: only now replace an earlier run's outputs.
    if overwrite:
        remove_run_outputs(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.yaml").write_text(config_lib.dump(config))
    writer = MetricsWriter(workdir, history)
    manager = ocp.CheckpointManager(
        workdir / "checkpoints", options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    )

    log = tqdm.write if verbose else (lambda *a, **k: None)
    unigram = data_lib.unigram_entropy(dataset.train, dataset.val, dataset.vocab_size)
    log(
        f"{config.name}: policy {config.describe()}; "
        f"{len(dataset.train):,} train / {len(dataset.val):,} val chars, vocab "
        f"{dataset.vocab_size}; unigram baseline {unigram:.3f} nats/char"
        + (f"; resuming at step {start}" if resume else "")
    )

    scale = float(jaxmp.get_loss_scale(state.opt_state).loss_scale)
    skipped_total = history[-1]["skipped_total"] if history else 0
    val_loss = next((r["val_loss"] for r in reversed(history) if r["val_loss"] is not None), None)
    bar = tqdm(
        total=config.steps, initial=start, unit="step", desc=config.name, disable=not progress
    )
    saved_step = start if resume else None
    interrupted = False
    inspections = load_inspections(workdir, start) if inspect_steps else []
    inspected_grad = make_inspected_grad(config, model) if inspect_steps else None
    # `state` is always the state after the last step whose metrics row has been written, so
    # a checkpoint of it and metrics.jsonl agree whenever the loop stops.
    with stop_after_step_on_sigint() as stop_requested:
        try:
            for step in range(start + 1, stop + 1):
                inputs, targets = put(
                    data_lib.train_batch(
                        dataset.train, config.seed, step - 1, config.batch_size, config.seq_len
                    )
                )
                if inspected_grad is not None and step in inspect_steps:
                    loss_scale = jaxmp.get_loss_scale(state.opt_state)
                    args = (loss_scale, state.params, inputs, targets, state.fp8_state)
                    _, report = inspected_grad(*args)
                    entry = write_inspection(
                        workdir, config, step, float(loss_scale.loss_scale), report, inspections
                    )
                    log(
                        f"step {step}: inspected {len(report)} ops; first non-finite: "
                        f"{entry['first_nonfinite'] or 'none'}; {entry['suggestion'] or ''}"
                    )
                t0 = time.perf_counter()
                new_state, metrics = compiled(state, inputs, targets)
                metrics = jax.device_get(metrics)
                step_time = time.perf_counter() - t0
                new_scale = float(metrics["loss_scale"])
                skipped = not bool(metrics["grads_finite"])
                skipped_total = int(metrics["skipped_steps"])
                if skipped or new_scale != scale:
                    event = "non-finite gradients, update skipped; " if skipped else ""
                    log(
                        f"step {step}: {event}loss scale {describe_scale(scale)} -> "
                        f"{describe_scale(new_scale)} (skipped so far: {skipped_total})"
                    )
                scale = new_scale
                record_val = None
                if step % config.eval_interval == 0 or step == config.steps:
                    val_loss = record_val = evaluate(
                        eval_step, new_state.params, val_batches, new_state.fp8_state
                    )
                    log(
                        f"step {step}: train loss {float(metrics['loss']):.4f}, "
                        f"val loss {val_loss:.4f} nats/char"
                    )
                record = {
                    "step": step,
                    "train_loss": float(metrics["loss"]),
                    "val_loss": record_val,
                    "loss_scale": new_scale,
                    "skipped": skipped,
                    "skipped_total": skipped_total,
                    "step_time_s": step_time,
                }
                writer.write(record)
                history.append(record)
                state = new_state
                if step % config.checkpoint_interval == 0 or step == stop:
                    writer.flush()  # Rows first: a checkpoint never runs ahead of the metrics.
                    manager.save(step, args=ocp.args.StandardSave(state))
                    saved_step = step
                bar.set_postfix(
                    loss=f"{record['train_loss']:.3f}",
                    scale=describe_scale(new_scale),
                    skipped=skipped_total,
                    refresh=False,
                )
                bar.update(1)
                if stop_requested():
                    interrupted = True
                    break
        except KeyboardInterrupt:
            interrupted = True
        finally:
            bar.close()
            writer.flush()
            if int(state.step) != saved_step and int(state.step) > 0:
                manager.save(int(state.step), args=ocp.args.StandardSave(state), force=True)
            manager.wait_until_finished()
            manager.close()
            writer.close()
    if interrupted:
        tqdm.write(
            f"interrupted: stopped after step {int(state.step)}, its metrics and checkpoint "
            f"saved in {show_path(workdir)}; continue with --resume"
        )
        raise KeyboardInterrupt

    if val_loss is None or not history or history[-1]["val_loss"] is None:
        val_loss = evaluate(eval_step, state.params, val_batches, state.fp8_state)
    sample = ""
    if sample_length:
        sample = generate(model, state.params, dataset, length=sample_length, seed=config.seed)
    result = RunResult(
        config=config,
        workdir=workdir,
        state=state,
        history=history,
        final_val_loss=val_loss,
        unigram_loss=unigram,
        peak_memory_bytes=peak,
        sample=sample,
    )
    if figure and history:
        plot_run(result, workdir / "losses.png")
    return result


# One style per config, the same in every panel: colour, line style and marker all differ, so
# that curves lying on top of each other stay distinguishable.
STYLES = (
    ("C0", "-", "o"),
    ("C1", "--", "s"),
    ("C2", "-.", "^"),
    ("C4", ":", "D"),  # purple, not red: often on top of the orange of the second config
    ("C3", (0, (5, 1, 1, 1)), "v"),
    ("C5", (0, (1, 1)), "P"),
    ("C6", (0, (3, 1, 1, 1, 1, 1)), "X"),
)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _column(result: RunResult, key: str, dtype: Any = np.float64) -> np.ndarray:
    return np.array([r[key] for r in result.history], dtype=dtype)


def _val_curve(result: RunResult) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in result.history if r["val_loss"] is not None}


def _smooth(values: np.ndarray, window: int | None = None) -> np.ndarray:
    """Centred moving average (no lag); the window is a 60th of the run unless given."""
    values = np.asarray(values, dtype=np.float64)
    if window is None:
        window = max(len(values) // 60, 1)
    half = window // 2
    sums = np.concatenate([[0.0], np.cumsum(values)])
    lo = np.maximum(np.arange(len(values)) - half, 0)
    hi = np.minimum(np.arange(len(values)) + half + 1, len(values))
    return (sums[hi] - sums[lo]) / (hi - lo)


def _rolling_median(values: np.ndarray, window: int) -> np.ndarray:
    half = max(window // 2, 0)
    return np.array(
        [np.median(values[max(i - half, 0) : i + half + 1]) for i in range(len(values))]
    )


def _uses_loss_scaling(result: RunResult) -> bool:
    return bool(np.any(_column(result, "loss_scale") != 1.0)) or result.skipped_steps > 0


def run_figure(result: RunResult):
    """One run: loss, loss scale with its skipped steps, and throughput (a matplotlib Figure)."""
    plt = _pyplot()
    fig, (ax_loss, ax_scale, ax_speed) = plt.subplots(
        3, 1, figsize=(9, 9), sharex=True, height_ratios=(3, 2, 2)
    )
    steps = _column(result, "step", np.int64)
    train = _column(result, "train_loss")
    ax_loss.plot(steps, train, color="C0", alpha=0.25, lw=0.8, label="training loss")
    ax_loss.plot(steps, _smooth(train), color="C0", lw=1.5, label="training loss, smoothed")
    val = _val_curve(result)
    if val:
        ax_loss.plot(list(val), list(val.values()), "o-", color="C1", ms=4, label="validation")
    ax_loss.axhline(result.unigram_loss, color="gray", ls="--", lw=1, label="unigram baseline")
    ax_loss.set_ylabel("loss (nats/char)")
    ax_loss.set_title(
        f"{result.config.name} ({result.config.policy}): final validation loss "
        f"{result.final_val_loss:.4f}"
    )
    ax_loss.legend(fontsize=8)

    scales = _column(result, "loss_scale")
    skipped = _column(result, "skipped", bool)
    ax_scale.step(steps, scales, where="post", color="C2", label="loss scale")
    if skipped.any():
        ax_scale.plot(steps[skipped], scales[skipped], "x", color="C3", ms=7, label="skipped step")
        ax_scale.legend(fontsize=8)
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_ylabel("loss scale")
    if _uses_loss_scaling(result):
        ax_scale.set_title(
            f"loss scale (x: step skipped, non-finite gradients; {result.skipped_steps} in all)"
        )
    else:
        ax_scale.set_title("loss scale: none (1 throughout, no step skipped)")

    chars = result.config.batch_size * result.config.seq_len
    speed = chars / np.maximum(_column(result, "step_time_s"), 1e-9) / 1000
    ax_speed.plot(steps, speed, color="C4", alpha=0.25, lw=0.8)
    window = max(len(speed) // 30, 5)
    ax_speed.plot(steps, _rolling_median(speed, window), color="C4", lw=1.5)
    ax_speed.set_ylim(bottom=0)
    ax_speed.set_ylabel("thousand chars/s")
    ax_speed.set_xlabel("step")
    ax_speed.set_title(
        f"throughput (per step, and rolling median of {window}); median "
        f"{1000 * result.median_step_time:.1f} ms/step"
    )
    fig.tight_layout()
    return fig


def comparison_figure(results: Sequence[RunResult]):
    """Several runs: losses, their differences from the fp32 run, and the loss scales."""
    plt = _pyplot()
    fig, (ax_loss, ax_diff, ax_scale) = plt.subplots(
        3, 1, figsize=(9, 10), sharex=True, height_ratios=(3, 3, 2)
    )
    reference = _reference(results)
    ref_steps = _column(reference, "step", np.int64)
    ref_train = _column(reference, "train_loss")
    ref_val = _val_curve(reference)
    last_step = max(int(r.history[-1]["step"]) for r in results if r.history)
    # Validation markers of different configs side by side rather than on top of each other.
    nudge = 0.006 * last_step

    ax_loss.plot(
        ref_steps,
        _smooth(ref_train),
        color="gray",
        lw=1,
        label=f"{reference.config.name} training loss, smoothed",
    )
    ax_loss.axhline(results[0].unigram_loss, color="gray", ls="--", lw=1, label="unigram baseline")
    for i, result in enumerate(results):
        color, linestyle, marker = STYLES[i % len(STYLES)]
        offset = (i - (len(results) - 1) / 2) * nudge
        val = _val_curve(result)
        if val:
            ax_loss.plot(
                np.array(list(val)) + offset,
                list(val.values()),
                marker=marker,
                ls="none",
                color=color,
                ms=5,
                label=result.config.name,
            )
        if result is reference:
            continue
        steps = _column(result, "step", np.int64)
        common = np.intersect1d(steps, ref_steps)
        if len(common):
            mine = _column(result, "train_loss")[np.searchsorted(steps, common)]
            theirs = ref_train[np.searchsorted(ref_steps, common)]
            diff = _smooth(100 * (mine / theirs - 1))
            ax_diff.plot(common, diff, color=color, ls=linestyle, lw=1.5, label=result.config.name)
        both = [s for s in val if s in ref_val]
        if both:
            ax_diff.plot(
                both,
                [100 * (val[s] / ref_val[s] - 1) for s in both],
                marker=marker,
                ls="none",
                color=color,
                ms=6,
                mec="black",
                mew=0.5,
            )
    ax_loss.set_ylabel("loss (nats/char)")
    ax_loss.set_title(
        f"validation loss (markers); training loss of {reference.config.name} (line, smoothed)",
        fontsize=10,
    )
    ax_loss.legend(fontsize=8, ncol=2)
    ax_diff.axhline(0.0, color="gray", lw=1)
    ax_diff.set_ylabel(f"% vs {reference.config.name}")
    ax_diff.set_title(
        f"difference from {reference.config.name} (%): training loss on the same batches "
        "(lines, smoothed), validation loss (markers)",
        fontsize=10,
    )
    if ax_diff.get_legend_handles_labels()[0]:
        ax_diff.legend(fontsize=8, ncol=2)

    scaled = [r for r in results if _uses_loss_scaling(r)]
    for k, result in enumerate(scaled):
        color, linestyle, marker = STYLES[results.index(result) % len(STYLES)]
        # Equal trajectories (mixed_float16 and float16 master weights often are) would hide
        # each other: nudge each by a fraction of an octave.
        nudge_octaves = 0.08 * (k - (len(scaled) - 1) / 2)
        steps = _column(result, "step", np.int64)
        scales = _column(result, "loss_scale") * 2.0**nudge_octaves
        skipped = _column(result, "skipped", bool)
        ax_scale.step(
            steps, scales, where="post", color=color, ls=linestyle, lw=1.5, label=result.config.name
        )
        if skipped.any():
            ax_scale.plot(steps[skipped], scales[skipped], marker="x", ls="none", color=color, ms=7)
    unscaled = [r.config.name for r in results if not _uses_loss_scaling(r)]
    title = "loss scale (x: skipped step"
    if len(scaled) > 1:
        title += "; equal lines nudged apart, by up to 0.1 octave"
    title += ")"
    if unscaled:
        title += f"\nno loss scaling (scale 1): {', '.join(unscaled)}"
    ax_scale.set_title(title, fontsize=10)
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_ylabel("loss scale")
    ax_scale.set_xlabel("step")
    if scaled:
        ax_scale.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_run(result: RunResult, path: pathlib.Path) -> None:
    """Saves `run_figure(result)` to `path`."""
    _save(run_figure(result), path)


def plot_comparison(results: Sequence[RunResult], path: pathlib.Path) -> None:
    """Saves `comparison_figure(results)` to `path`."""
    _save(comparison_figure(results), path)


def _save(fig, path: pathlib.Path) -> None:
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)


def _reference(results: Sequence[RunResult]) -> RunResult:
    """The fp32 run if there is one, else the first."""
    f32 = jaxmp.get_policy("f32")
    return next((r for r in results if r.config.policy == f32), results[0])


def signed_percent(fraction: float) -> str:
    """``+1.23%``; a value that rounds to zero is ``+0.00%`` (never ``-0.00%``)."""
    text = f"{100 * fraction:+.2f}%"
    return "+0.00%" if text == "-0.00%" else text


def summarize(results: Sequence[RunResult]) -> str:
    """A Markdown table comparing `results` (against the fp32 run, if any), then text samples."""
    f32 = jaxmp.get_policy("f32")
    reference = next((r for r in results if r.config.policy == f32), None)
    ref_params = (reference or results[0]).state.params
    dataset = get_dataset(results[0].config.val_fraction)
    batch = data_lib.eval_batches(
        dataset.val, 1, results[0].config.batch_size, results[0].config.seq_len
    )[0]
    header = (
        "| config | precision | final val loss | vs fp32 | skipped | final scale "
        "| median step | peak memory | params + state | param grad underflow "
        "| logit grad underflow |"
    )
    lines = [header, "|" + "---|" * 11]
    for r in results:
        diff = "n/a"
        if reference is not None:
            diff = signed_percent(r.final_val_loss / reference.final_val_loss - 1)
        kwargs = dict(vocab_size=dataset.vocab_size)
        underflow = gradient_underflow(r.config, ref_params, batch, r.final_loss_scale, **kwargs)
        logit_underflow = logit_gradient_underflow(
            r.config, ref_params, batch, r.final_loss_scale, **kwargs
        )
        memory = "n/a" if r.peak_memory_bytes is None else f"{r.peak_memory_bytes / 2**20:.1f} MiB"
        lines.append(
            f"| {r.config.name} | {r.config.policy} | {r.final_val_loss:.4f} | {diff} "
            f"| {r.skipped_steps} | {describe_scale(r.final_loss_scale)} "
            f"| {1000 * r.median_step_time:.1f} ms | {memory} | {r.bytes_per_param:.2f} B/param "
            f"| {100 * underflow:.4f}% | {100 * logit_underflow:.2f}% |"
        )
    f16 = with_precision(results[0].config, "mixed_float16")
    kwargs = dict(vocab_size=dataset.vocab_size)
    f16_param = [gradient_underflow(f16, ref_params, batch, s, **kwargs) for s in (1.0, 2.0**15)]
    f16_logit = [
        logit_gradient_underflow(f16, ref_params, batch, s, **kwargs) for s in (1.0, 2.0**15)
    ]
    lines += [
        "",
        f"unigram baseline: {results[0].unigram_loss:.4f} nats/char. Peak memory: the compiled "
        "train step's arguments and temporaries. Params + state: bytes of the params and the "
        "optimizer state per parameter. Underflow: nonzero float32 "
        "gradient elements that are exactly zero under the config's policy and final loss "
        f"scale, at the {(reference or results[0]).config.name} run's final params, on one "
        "validation batch. Float16 compute without loss scaling flushes "
        f"{100 * f16_logit[0]:.2f}% of the logit gradients ({100 * f16_param[0]:.4f}% of the "
        f"param gradients); with a loss scale of 2^15, {100 * f16_logit[1]:.2f}% "
        f"({100 * f16_param[1]:.4f}%).",
        "",
        "samples (prompt 'The ', temperature 0.8, fixed seed):",
    ]
    lines += [f"  {r.config.name:>24}: {r.sample!r}" for r in results]
    return "\n".join(lines)


def load_configs(
    names: Sequence[str],
    workdir: str | pathlib.Path,
    overrides: Sequence[str] = (),
    *,
    resume: bool = False,
) -> list[config_lib.Config]:
    """The configs of a comparison; with `resume`, each started run's own ``config.yaml``.

    Raises:
      ValueError: one line naming the config (or file) and key, for an invalid config.
    """
    workdir = pathlib.Path(workdir)
    configs = []
    for name in names:
        saved = workdir / name / "config.yaml"
        configs.append(
            config_lib.load(str(saved) if resume and saved.is_file() else name, overrides)
        )
    seen = [c.name for c in configs]
    if len(set(seen)) != len(seen):
        raise ValueError(
            f"--compare needs configs with distinct names (each runs in <workdir>/<name>), "
            f"got {', '.join(seen)}; do not --set name."
        )
    for config in configs:
        if config.mesh:
            check_mesh(config.mesh)
    return configs


def check_mesh(spec: str) -> None:
    """`sharding.parse_mesh` of a config's ``mesh``; on a CPU, a mesh larger than the device
    count gets the way to simulate devices (the sharding guide's ``XLA_FLAGS``).

    Raises:
      ValueError: `sharding.parse_mesh`'s one line, with the hint where it applies.
    """
    try:
        sharding.parse_mesh(spec)
    except ValueError as e:
        if "device count" not in str(e) or jax.default_backend() != "cpu":
            raise
        # The form is valid here: the device count is the last thing parse_mesh checks.
        wanted = math.prod(int(part.partition("=")[2]) for part in spec.replace(" ", "").split(","))
        raise ValueError(
            f"{e} On a CPU, simulate {wanted} devices by starting the run with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={wanted} (set before JAX starts; "
            "see docs/guides/sharding.md)."
        ) from None


def compare(
    configs: Sequence[config_lib.Config],
    workdir: str | pathlib.Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> tuple[list[RunResult], str]:
    """Trains each config (same data and seed) in ``workdir/<name>``; returns the summary.

    Writes ``summary.md``, ``summary.json`` and ``compare.png`` to `workdir`. The same rules
    as for one run hold for the whole comparison: a new comparison needs an empty `workdir`;
    `resume` continues the runs that have started (a finished run is only evaluated again)
    and starts the others; `overwrite` replaces the outputs of these configs' runs and the
    summary, and leaves anything else in `workdir` alone.

    Raises:
      RunDirError: before any training, if `workdir` does not fit the request.
    """
    workdir = pathlib.Path(workdir).resolve()
    if resume and overwrite:
        raise ValueError("`resume` and `overwrite` exclude each other.")
    started = [c.name for c in configs if not _is_empty(workdir / c.name)]
    if resume:
        if not started:
            raise RunDirError(
                f"--resume: no runs of {', '.join(c.name for c in configs)} in "
                f"{show_path(workdir)}; check --workdir, or start without --resume."
            )
        for name in started:
            check_workdir(workdir / name, resume=True, overwrite=False)
    elif not overwrite and not _is_empty(workdir):
        runs = sorted(p.name for p in workdir.iterdir() if p.is_dir())
        held = f"runs ({', '.join(runs)})" if runs else "files"
        raise RunDirError(
            f"{show_path(workdir)} already holds {held}; continue them with --resume, replace "
            "them with --overwrite, or choose another --workdir."
        )
    if overwrite:
        remove_run_outputs(workdir, COMPARE_OUTPUTS)  # A stale summary must not outlive its runs.
    results = [
        train_and_evaluate(
            c,
            workdir / c.name,
            resume=c.name in started if resume else False,
            overwrite=overwrite,
            progress=progress,
        )
        for c in configs
    ]
    table = summarize(results)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "summary.md").write_text(table + "\n")
    summary = [
        {
            "config": r.config.name,
            "precision": str(r.config.policy),
            "final_val_loss": r.final_val_loss,
            "skipped_steps": r.skipped_steps,
            "final_loss_scale": r.final_loss_scale,
            "median_step_time_s": r.median_step_time,
            "peak_memory_bytes": r.peak_memory_bytes,
            "bytes_per_param": r.bytes_per_param,
            "sample": r.sample,
        }
        for r in results
    ]
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_comparison(results, workdir / "compare.png")
    return results, table


def _compare_order(name: str) -> tuple[int, str]:
    preferred = list(COMPARE_ORDER)
    return (preferred.index(name) if name in preferred else len(preferred), name)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (exit status 2)."""

    def fail(self, message: object, status: int = 2) -> None:
        self.exit(status, f"{self.prog}: error: {' '.join(str(message).split())}\n")

    def error(self, message: str) -> None:  # argparse's own errors: bad options
        self.fail(f"{message} (see --help)")


def _epilog() -> str:
    configs = config_lib.describe_configs()
    width = max(len(name) for name, _ in configs) if configs else 0
    lines = [
        "configs (--config NAME, a file name in configs/ or the path of a YAML file):",
        *(f"  {name:<{width}}  {text}" for name, text in configs),
        "",
        "config keys (--set KEY=VALUE, repeatable; shown with their defaults):",
        textwrap.fill(
            config_lib.describe_keys(),
            width=96,
            initial_indent="  ",
            subsequent_indent="  ",
            break_on_hyphens=False,
        ),
        "  precision: any string jaxmp.get_policy accepts (f32, mixed_float16, p=f16,c=f16,o=f32)",
        f"  loss_scale: one of {', '.join(config_lib.LOSS_SCALE_KINDS)}",
        "  master_weights: true (a float32 copy of float16/bfloat16 params) or false",
        f"  rounding (without a master copy): one of {', '.join(config_lib.ROUNDINGS)}",
        f"  first_moment, second_moment: one of {', '.join(config_lib.MOMENT_FORMATS)}",
        "",
        "A new run needs an empty --workdir: --resume continues the run in it from its latest "
        "checkpoint, --overwrite replaces that run's outputs (once the new run is ready to "
        "start). Ctrl-C stops after the step in progress with its metrics and checkpoint saved.",
    ]
    return "\n".join(lines[:-1] + [textwrap.fill(lines[-1], width=98)])


def make_parser() -> _Parser:
    parser = _Parser(
        prog="train.py",
        description=__doc__.split("\n\n")[0],
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        default=DEFAULT_CONFIG,
        help=f"config name, file name in configs/, or YAML path (default {DEFAULT_CONFIG})",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key"
    )
    parser.add_argument(
        "--workdir", help="run directory (default runs/<config name>, or runs/compare)"
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--resume", action="store_true", help="continue the run in --workdir from its checkpoint"
    )
    mode.add_argument(
        "--overwrite", action="store_true", help="replace the run in --workdir (default: refuse)"
    )
    parser.add_argument(
        "--compare",
        nargs="?",
        const="all",
        metavar="NAMES",
        help="train several configs (comma-separated names; default all) and compare them",
    )
    parser.add_argument(
        "--inspect",
        nargs="?",
        const="",
        metavar="STEPS",
        help="write inspect.json and inspect.png (jaxmp.inspect) at these steps, e.g. 1,100 "
        "(default: the first and the last)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--mesh", metavar="NAME=SIZE,...", help="shard over devices, e.g. data=4,model=2"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.mesh:
        args.set.append(f"mesh={args.mesh}")
    progress = not args.no_progress
    # Invalid input is reported before anything is trained or written.
    try:
        if args.compare is not None:
            names = args.compare.split(",")
            if args.compare == "all":
                names = sorted(config_lib.available(), key=_compare_order)
            workdir = pathlib.Path(args.workdir or REPO_ROOT / "runs" / "compare")
            configs = load_configs(names, workdir, args.set, resume=args.resume)
        else:
            config = config_lib.load(args.config, args.set)
            workdir = pathlib.Path(args.workdir or REPO_ROOT / "runs" / config.name)
            if args.resume and (workdir / "config.yaml").is_file():
                config = config_lib.load(str(workdir / "config.yaml"), args.set)
            if config.mesh:
                check_mesh(config.mesh)
        inspect_steps: tuple[int, ...] = ()
        if args.inspect is not None:
            if args.compare is not None:
                raise ValueError("--inspect inspects one run; it does not combine with --compare.")
            inspect_steps = parse_inspect_steps(args.inspect, config.steps)
    except ValueError as e:
        parser.fail(e)
    try:
        if args.compare is not None:
            _, table = compare(
                configs,
                workdir,
                resume=args.resume,
                overwrite=args.overwrite,
                progress=progress,
            )
            print(table)
            print(f"figure and summary: {show_path(workdir)}")
            return
        result = train_and_evaluate(
            config,
            workdir,
            resume=args.resume,
            overwrite=args.overwrite,
            progress=progress,
            inspect_steps=inspect_steps,
        )
    except RunDirError as e:
        # A damaged checkpoint leaves orbax's failed reads behind (asyncio tasks, coroutines);
        # at exit Python would print each as a traceback after the one-line error.
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        sys.unraisablehook = lambda unraisable: None
        parser.fail(e)
    except LossScalingError as e:
        parser.fail(e, status=1)
    except KeyboardInterrupt:
        sys.exit(130)
    print(
        f"{config.name}: final val loss {result.final_val_loss:.4f} nats/char "
        f"({data_lib.bits(result.final_val_loss):.3f} bits/char; unigram baseline "
        f"{result.unigram_loss:.4f}), skipped steps {result.skipped_steps}, final loss scale "
        f"{describe_scale(result.final_loss_scale)}, median step "
        f"{1000 * result.median_step_time:.1f} ms"
    )
    print(f"sample: {result.sample!r}")
    print(f"outputs: {show_path(workdir)}")


if __name__ == "__main__":
    main(sys.argv[1:])
