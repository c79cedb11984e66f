"""The train loop: `train_and_evaluate` trains one config in its run directory.

It checks the directory (`lm.rundir`), builds and compiles the config's programs
(`lm.steps`), checks on the first step that the gradients follow the loss scale, then runs the
steps: a metrics row each (`lm.metrics`), an evaluation and a checkpoint at their intervals,
``--inspect`` reports at the chosen steps (`lm.inspection`), and after Ctrl-C a clean stop
(`lm.interrupt`). At the end: the validation loss, a text sample (`generate`) and
``losses.png`` (`lm.figures`).
"""

from __future__ import annotations

import math
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import sharding
from loss_scale_tools import check_gradients_are_scaled, describe_scale
from tqdm import tqdm

import jaxmp
from lm import config as config_lib
from lm import data as data_lib
from lm import model as model_lib
from lm.figures import plot_run
from lm.inspection import load_inspections, make_inspected_grad, write_inspection
from lm.interrupt import stop_after_step_on_sigint
from lm.metrics import MetricsWriter, RunResult, load_history
from lm.rundir import (
    RunDirError,
    check_workdir,
    remove_run_outputs,
    restore_checkpoint,
    show_path,
)
from lm.steps import create_train_state, get_dataset, programs


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


def _changes_of_the_run(workdir: pathlib.Path, config: config_lib.Config) -> str:
    """What `config` changes of the config the run in `workdir` was trained with ("" if
    nothing, or if its ``config.yaml`` cannot be read)."""
    try:
        return config_lib.describe_changes(config_lib.load(str(workdir / "config.yaml")), config)
    except ValueError:
        return ""


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
            If `config` differs from the run's ``config.yaml`` (``--set steps=...`` extends
            a run), one line says what changed, and ``config.yaml`` takes `config`.
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
    stop = config.steps if stop_at is None else min(stop_at, config.steps)
    # A quantization-aware fine-tune (`qat_start`) runs the steps after `qat_start` with
    # their own program (`Programs.qat_train_step`).
    programs_to_run = [built.train_step]
    if built.qat_train_step is not None and stop > config.qat_start:
        programs_to_run.append(built.qat_train_step)
    compiled_steps = [
        jax.jit(step_fn, **jit_kwargs).lower(state, inputs, targets).compile()
        for step_fn in programs_to_run
    ]

    def program(step: int) -> Any:
        """The compiled train step of step `step` (1 for the first)."""
        after = len(compiled_steps) > 1 and step > config.qat_start
        return compiled_steps[1 if after else 0]

    peak = None
    for compiled in compiled_steps:
        memory = compiled.memory_analysis()
        if memory is not None:
            used = int(memory.temp_size_in_bytes + memory.argument_size_in_bytes)
            peak = used if peak is None else max(peak, used)
    compiled = program(start + 1)
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
    changes = _changes_of_the_run(workdir, config) if resume else ""
    (workdir / "config.yaml").write_text(config_lib.dump(config))
    if changes:  # legitimate (--resume --set steps=...), but never silent
        tqdm.write(f"{config.name}: {changes} (config.yaml updated)")
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
                new_state, metrics = program(step)(state, inputs, targets)
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
