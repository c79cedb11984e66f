"""Trains a character-level transformer language model under a jaxmp precision policy.

The data is the documentation text shipped with Python (`pydoc_data.topics`), so nothing is
downloaded. One run trains under one config from ``configs/``; ``--compare`` trains several on
the same data and seed and prints a side-by-side summary.

Usage:
    python examples/train.py                              # configs/mixed_float16.yaml
    python examples/train.py --config fp32 --set steps=300
    python examples/train.py --resume                     # continue runs/mixed_float16
    python examples/train.py --compare                    # every config in configs/
    python examples/train.py --compare fp32,mixed_float16

Each run writes to ``--workdir`` (default ``runs/<config name>``): ``metrics.jsonl`` and
``metrics.csv`` (one row per step), ``config.yaml`` (the resolved config), ``checkpoints/``
(orbax; ``--resume`` continues from the latest one, bit-identically) and ``losses.png``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import json
import math
import pathlib
import shutil
import statistics
import sys
import time
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
    def median_step_time(self) -> float:
        # The first step of a fresh run includes compilation-related warm-up: leave it out.
        times = [r["step_time_s"] for r in self.history[1:]] or [math.nan]
        return statistics.median(times)


@functools.lru_cache(maxsize=4)
def get_dataset(val_fraction: float) -> data_lib.Dataset:
    return data_lib.make_dataset(val_fraction)


def make_model(
    config: config_lib.Config, vocab_size: int, *, param_dtype: Any = None
) -> model_lib.TransformerLM:
    """The model with the dtypes of `config.policy` (`param_dtype` overrides the policy's)."""
    policy = config.policy
    return model_lib.TransformerLM(
        vocab_size=vocab_size,
        max_len=config.seq_len,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        d_model=config.d_model,
        mlp_ratio=config.mlp_ratio,
        dtype=policy.compute_dtype,
        param_dtype=policy.param_dtype if param_dtype is None else param_dtype,
        output_dtype=policy.output_dtype,
    )


def make_optimizer(config: config_lib.Config) -> optax.GradientTransformationExtraArgs:
    """AdamW with warmup and cosine decay, wrapped by `jaxmp.mixed_precision` for the policy.

    The inner optimizer sees unscaled float32 gradients (of the FP32 master weights when the
    params are half precision); skipped steps leave its state, and so the schedule, untouched.
    """
    decay_steps = max(config.steps, config.warmup_steps + 1)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.learning_rate, config.warmup_steps, decay_steps, config.learning_rate * 0.1
    )
    inner = optax.chain(
        optax.clip_by_global_norm(config.grad_clip) if config.grad_clip else optax.identity(),
        optax.adamw(schedule, b2=0.99, weight_decay=config.weight_decay),
    )
    return jaxmp.mixed_precision(inner, config.policy, config.make_loss_scale())


def create_train_state(
    config: config_lib.Config, rng: jax.Array, *, vocab_size: int | None = None
) -> TrainState:
    """Initial state: float32 init (the same values for every policy), stored in param dtype.

    The optimizer is initialised from the float32 params, so FP32 master weights start exact.
    """
    if vocab_size is None:
        vocab_size = get_dataset(config.val_fraction).vocab_size
    init_model = make_model(config, vocab_size, param_dtype=jnp.float32)
    tokens = jnp.zeros((1, config.seq_len), jnp.int32)
    params_f32 = jax.jit(init_model.init)(rng, tokens)["params"]
    opt_state = make_optimizer(config).init(params_f32)
    params = config.policy.cast_to_param(params_f32)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state)


def make_loss_fn(model: model_lib.TransformerLM):
    def loss_fn(params, inputs, targets):
        return model_lib.cross_entropy(model.apply({"params": params}, inputs), targets)

    return loss_fn


def make_train_step(config: config_lib.Config, model: model_lib.TransformerLM, tx):
    """The (unjitted) train step ``(state, inputs, targets) -> (state, metrics)``.

    Gradients are of the loss times the current loss scale; ``tx.update`` unscales them in
    float32, skips the update when any is non-finite and adjusts the scale.
    """
    del config  # The step depends on the config only through `model` and `tx`.
    grad_fn = jaxmp.value_and_grad(make_loss_fn(model))

    def train_step(state: TrainState, inputs: jax.Array, targets: jax.Array):
        loss_scale = jaxmp.get_loss_scale(state.opt_state)
        loss, grads = grad_fn(loss_scale, state.params, inputs, targets)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, **jaxmp.loss_scale_metrics(opt_state)}
        return TrainState(state.step + 1, params, opt_state), metrics

    return train_step


def make_eval_step(model: model_lib.TransformerLM):
    """The (unjitted) eval step ``(params, inputs, targets) -> mean loss``."""
    return make_loss_fn(model)


def evaluate(eval_step, params: Any, batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> float:
    """Mean loss (nats/char) over `batches` (all of the same size)."""
    losses = [eval_step(params, inputs, targets) for inputs, targets in batches]
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
    reference = make_model(dataclasses.replace(config, precision="f32"), vocab_size)
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
    reference = make_model(dataclasses.replace(config, precision="f32"), vocab_size)
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


def _load_history(workdir: pathlib.Path, upto: int) -> list[dict[str, Any]]:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r["step"] <= upto]


class MetricsWriter:
    """Appends one record per step to ``metrics.jsonl`` and ``metrics.csv``."""

    def __init__(self, workdir: pathlib.Path, history: list[dict[str, Any]]):
        self._jsonl = open(workdir / "metrics.jsonl", "w")
        self._csv_file = open(workdir / "metrics.csv", "w", newline="")
        self._csv = csv.DictWriter(self._csv_file, fieldnames=COLUMNS)
        self._csv.writeheader()
        for record in history:  # A resumed run rewrites the rows up to its checkpoint.
            self.write(record)

    def write(self, record: dict[str, Any]) -> None:
        self._jsonl.write(json.dumps(record) + "\n")
        row = {k: ("" if record[k] is None else record[k]) for k in COLUMNS}
        self._csv.writerow(row)

    def flush(self) -> None:
        self._jsonl.flush()
        self._csv_file.flush()

    def close(self) -> None:
        self._jsonl.close()
        self._csv_file.close()


def _describe_scale(scale: float) -> str:
    exponent = math.log2(scale) if scale > 0 else math.nan
    return f"2^{exponent:g}" if exponent.is_integer() else f"{scale:g}"


def train_and_evaluate(
    config: config_lib.Config,
    workdir: str | pathlib.Path,
    *,
    resume: bool = False,
    progress: bool = True,
    verbose: bool = True,
    stop_at: int | None = None,
    sample_length: int = 80,
) -> RunResult:
    """Trains `config` in `workdir`; returns the final state, metrics and a text sample.

    Args:
        config: the run's config.
        workdir: where metrics, the resolved config, checkpoints and the figure go.
        resume: continue from the latest checkpoint in `workdir` (start fresh if none).
        progress: show a tqdm bar.
        verbose: print a line per evaluation, loss-scale change and skipped step.
        stop_at: stop (and checkpoint) after this step, as if interrupted; the schedule still
            runs to ``config.steps``.
        sample_length: characters of generated text in the result (0: none).
    """
    workdir = pathlib.Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    dataset = get_dataset(config.val_fraction)
    model = make_model(config, dataset.vocab_size)
    tx = make_optimizer(config)
    state = create_train_state(
        config, jax.random.PRNGKey(config.seed), vocab_size=dataset.vocab_size
    )
    mesh = sharding.make_mesh(config.mesh) if config.mesh else None
    jit_kwargs: dict[str, Any] = {}
    if mesh is not None:  # Params and optimizer state sharded FSDP-style, the batch over all.
        state, state_shardings = sharding.shard_train_state(tx, state, mesh)
        jit_kwargs["out_shardings"] = (state_shardings, sharding.replicated(mesh))

    def put(batch):
        return batch if mesh is None else sharding.shard_batch(batch, mesh)

    ckpt_dir = workdir / "checkpoints"
    if not resume and ckpt_dir.exists():
        shutil.rmtree(ckpt_dir)  # A fresh run must not mix with an older run's checkpoints.
    manager = ocp.CheckpointManager(
        ckpt_dir, options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    )
    latest = manager.latest_step() if resume else None
    if latest is not None:
        state = manager.restore(latest, args=ocp.args.StandardRestore(state))
    start = int(state.step)
    history = _load_history(workdir, start) if latest is not None else []
    (workdir / "config.yaml").write_text(config_lib.dump(config))
    writer = MetricsWriter(workdir, history)

    log = tqdm.write if verbose else (lambda *a, **k: None)
    unigram = data_lib.unigram_entropy(dataset.train, dataset.val, dataset.vocab_size)
    log(
        f"{config.name}: policy {config.policy}, loss scale {config.loss_scale}; "
        f"{len(dataset.train):,} train / {len(dataset.val):,} val chars, vocab "
        f"{dataset.vocab_size}; unigram baseline {unigram:.3f} nats/char"
        + (f"; resuming at step {start}" if latest is not None else "")
    )

    inputs, targets = put(
        data_lib.train_batch(dataset.train, config.seed, 0, config.batch_size, config.seq_len)
    )
    train_step = jax.jit(make_train_step(config, model, tx), **jit_kwargs)
    compiled = train_step.lower(state, inputs, targets).compile()
    memory = compiled.memory_analysis()
    peak = None
    if memory is not None:
        peak = int(memory.temp_size_in_bytes + memory.argument_size_in_bytes)
    eval_step = jax.jit(make_eval_step(model))
    val_batches = data_lib.eval_batches(
        dataset.val, config.eval_batches, config.batch_size, config.seq_len
    )

    stop = config.steps if stop_at is None else min(stop_at, config.steps)
    scale = float(jaxmp.get_loss_scale(state.opt_state).loss_scale)
    skipped_total = history[-1]["skipped_total"] if history else 0
    val_loss = next((r["val_loss"] for r in reversed(history) if r["val_loss"] is not None), None)
    bar = tqdm(
        total=config.steps, initial=start, unit="step", desc=config.name, disable=not progress
    )
    try:
        for step in range(start + 1, stop + 1):
            inputs, targets = put(
                data_lib.train_batch(
                    dataset.train, config.seed, step - 1, config.batch_size, config.seq_len
                )
            )
            t0 = time.perf_counter()
            state, metrics = compiled(state, inputs, targets)
            metrics = jax.device_get(metrics)
            step_time = time.perf_counter() - t0
            new_scale = float(metrics["loss_scale"])
            skipped = not bool(metrics["grads_finite"])
            skipped_total = int(metrics["skipped_steps"])
            if skipped or new_scale != scale:
                event = "non-finite gradients, update skipped; " if skipped else ""
                log(
                    f"step {step}: {event}loss scale {_describe_scale(scale)} -> "
                    f"{_describe_scale(new_scale)} (skipped so far: {skipped_total})"
                )
            scale = new_scale
            record_val = None
            if step % config.eval_interval == 0 or step == config.steps:
                val_loss = record_val = evaluate(eval_step, state.params, val_batches)
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
            history.append(record)
            writer.write(record)
            if step % config.checkpoint_interval == 0:
                manager.save(step, args=ocp.args.StandardSave(state))
                writer.flush()
            bar.set_postfix(
                loss=f"{record['train_loss']:.3f}",
                scale=_describe_scale(new_scale),
                skipped=skipped_total,
                refresh=False,
            )
            bar.update(1)
    except KeyboardInterrupt:
        log(f"interrupted at step {int(state.step)}; saving a checkpoint (continue with --resume)")
        raise
    finally:
        bar.close()
        if int(state.step) not in manager.all_steps() and int(state.step) > 0:
            manager.save(int(state.step), args=ocp.args.StandardSave(state), force=True)
        manager.wait_until_finished()
        manager.close()
        writer.close()

    if val_loss is None or history[-1]["val_loss"] is None:
        val_loss = evaluate(eval_step, state.params, val_batches)
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
    if history:
        plot_runs([result], workdir / "losses.png")
    return result


def plot_runs(results: Sequence[RunResult], path: pathlib.Path) -> None:
    """Loss curves, validation loss relative to the first run, and loss-scale trajectories."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_diff, ax_scale) = plt.subplots(
        3, 1, figsize=(9, 9), sharex=True, height_ratios=(3, 2, 2)
    )
    reference = _val_curve(results[0]) if results else {}
    for i, result in enumerate(results):
        color = f"C{i}"
        name = result.config.name
        steps = np.array([r["step"] for r in result.history])
        train = np.array([r["train_loss"] for r in result.history])
        ax_loss.plot(steps, _ema(train, 0.9), color=color, alpha=0.5, lw=1)
        val = _val_curve(result)
        if val:
            ax_loss.plot(list(val), list(val.values()), color=color, marker="o", ms=3, label=name)
        common = [s for s in val if s in reference]
        if common:
            diff = [100 * (val[s] / reference[s] - 1) for s in common]
            ax_diff.plot(common, diff, color=color, marker="o", ms=3, label=name)
        scales = np.array([r["loss_scale"] for r in result.history])
        ax_scale.step(steps, scales, where="post", color=color, label=name)
        skipped = np.array([r["skipped"] for r in result.history], dtype=bool)
        if skipped.any():
            ax_scale.plot(steps[skipped], scales[skipped], "x", color=color, ms=7)
    if results:
        ax_loss.axhline(
            results[0].unigram_loss, color="gray", ls="--", lw=1, label="unigram baseline"
        )
        ax_diff.set_title(f"validation loss relative to {results[0].config.name} (%)")
    ax_loss.set_ylabel("loss (nats/char)")
    ax_loss.set_title("training loss (thin, smoothed) and validation loss (markers)")
    ax_loss.legend(fontsize=8)
    ax_diff.axhline(0.0, color="gray", lw=1)
    ax_diff.set_ylabel("%")
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_ylabel("loss scale")
    ax_scale.set_xlabel("step")
    ax_scale.set_title("loss scale (x: skipped step)")
    ax_scale.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _val_curve(result: RunResult) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in result.history if r["val_loss"] is not None}


def _ema(values: np.ndarray, decay: float) -> np.ndarray:
    out = np.empty_like(values, dtype=np.float64)
    acc = values[0] if len(values) else 0.0
    for i, v in enumerate(values):
        acc = decay * acc + (1 - decay) * v
        out[i] = acc
    return out


def summarize(results: Sequence[RunResult]) -> str:
    """A Markdown table comparing `results` (against the fp32 run, if any), then text samples."""
    reference = next((r for r in results if r.config.policy == jaxmp.get_policy("f32")), None)
    ref_params = (reference or results[0]).state.params
    dataset = get_dataset(results[0].config.val_fraction)
    batch = data_lib.eval_batches(
        dataset.val, 1, results[0].config.batch_size, results[0].config.seq_len
    )[0]
    header = (
        "| config | precision | final val loss | vs fp32 | skipped | final scale "
        "| median step | peak memory | param grad underflow | logit grad underflow |"
    )
    lines = [header, "|" + "---|" * 10]
    for r in results:
        diff = "n/a"
        if reference is not None:
            diff = f"{100 * (r.final_val_loss / reference.final_val_loss - 1):+.2f}%"
        kwargs = dict(vocab_size=dataset.vocab_size)
        underflow = gradient_underflow(r.config, ref_params, batch, r.final_loss_scale, **kwargs)
        logit_underflow = logit_gradient_underflow(
            r.config, ref_params, batch, r.final_loss_scale, **kwargs
        )
        memory = "n/a" if r.peak_memory_bytes is None else f"{r.peak_memory_bytes / 2**20:.1f} MiB"
        lines.append(
            f"| {r.config.name} | {r.config.policy} | {r.final_val_loss:.4f} | {diff} "
            f"| {r.skipped_steps} | {_describe_scale(r.final_loss_scale)} "
            f"| {1000 * r.median_step_time:.1f} ms | {memory} "
            f"| {100 * underflow:.4f}% | {100 * logit_underflow:.2f}% |"
        )
    f16 = dataclasses.replace(results[0].config, precision="mixed_float16")
    kwargs = dict(vocab_size=dataset.vocab_size)
    f16_param = [gradient_underflow(f16, ref_params, batch, s, **kwargs) for s in (1.0, 2.0**15)]
    f16_logit = [
        logit_gradient_underflow(f16, ref_params, batch, s, **kwargs) for s in (1.0, 2.0**15)
    ]
    lines += [
        "",
        f"unigram baseline: {results[0].unigram_loss:.4f} nats/char. Underflow: nonzero float32 "
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


def compare(
    names: Sequence[str],
    workdir: str | pathlib.Path,
    overrides: Sequence[str] = (),
    *,
    progress: bool = True,
) -> tuple[list[RunResult], str]:
    """Trains each named config (same data and seed) in ``workdir/<name>``; returns the summary.

    Writes ``summary.md``, ``summary.json`` and ``compare.png`` to `workdir`.
    """
    workdir = pathlib.Path(workdir)
    configs = [config_lib.load(name, overrides) for name in names]  # Fail before training.
    results = [train_and_evaluate(c, workdir / c.name, progress=progress) for c in configs]
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
            "sample": r.sample,
        }
        for r in results
    ]
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_runs(results, workdir / "compare.png")
    return results, table


def _compare_order(name: str) -> tuple[int, str]:
    preferred = list(COMPARE_ORDER)
    return (preferred.index(name) if name in preferred else len(preferred), name)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config",
        default=DEFAULT_CONFIG,
        help=f"config name in configs/ or a YAML path (default {DEFAULT_CONFIG})",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key"
    )
    parser.add_argument("--workdir", help="output directory (default runs/<config name>)")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint")
    parser.add_argument(
        "--compare",
        nargs="?",
        const="all",
        metavar="NAMES",
        help="train several configs (comma-separated names; default all) and compare them",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--mesh", metavar="NAME=SIZE,...", help="shard over devices, e.g. data=4,model=2"
    )
    args = parser.parse_args(argv)
    if args.mesh:
        args.set.append(f"mesh={args.mesh}")
    progress = not args.no_progress
    try:
        if args.compare is not None:
            names = args.compare.split(",")
            if args.compare == "all":
                names = sorted(config_lib.available(), key=_compare_order)
            workdir = args.workdir or REPO_ROOT / "runs" / "compare"
            _, table = compare(names, workdir, args.set, progress=progress)
            print(table)
            print(f"figure and summary: {workdir}")
            return
        config = config_lib.load(args.config, args.set)
        workdir = pathlib.Path(args.workdir or REPO_ROOT / "runs" / config.name)
        if args.resume and (workdir / "config.yaml").exists():
            config = config_lib.load(str(workdir / "config.yaml"), args.set)
        if config.mesh:
            sharding.parse_mesh(config.mesh)
    except ValueError as e:
        parser.error(str(e))
    try:
        result = train_and_evaluate(config, workdir, resume=args.resume, progress=progress)
    except KeyboardInterrupt:
        sys.exit(130)
    print(
        f"{config.name}: final val loss {result.final_val_loss:.4f} nats/char "
        f"({data_lib.bits(result.final_val_loss):.3f} bits/char; unigram baseline "
        f"{result.unigram_loss:.4f}), skipped steps {result.skipped_steps}, final loss scale "
        f"{_describe_scale(result.final_loss_scale)}, median step "
        f"{1000 * result.median_step_time:.1f} ms"
    )
    print(f"sample: {result.sample!r}")
    print(f"outputs: {workdir}")


if __name__ == "__main__":
    main(sys.argv[1:])
