"""``--compare``: several configs trained on the same data and seed, side by side.

`load_configs` reads them (a resumed comparison, each run's own ``config.yaml``); `compare`
trains each in ``<workdir>/<name>`` under the run-directory rules of one run, then writes
``summary.md`` (`summarize`: final losses against the fp32 run, skipped steps, loss scales,
step times, memory, gradient underflow, text samples), ``summary.json`` and ``compare.png``.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

from loss_scale_tools import describe_scale

import jaxmp
from lm import config as config_lib
from lm import data as data_lib
from lm.figures import plot_comparison
from lm.loop import check_mesh, train_and_evaluate
from lm.metrics import RunResult
from lm.rundir import RunDirError, check_workdir, is_empty, remove_run_outputs, show_path
from lm.steps import get_dataset, with_precision
from lm.underflow import gradient_underflow, logit_gradient_underflow

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
    "int4_qat",
    "fp8_qat",
)


COMPARE_OUTPUTS = ("summary.md", "summary.json", "compare.png")


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
    started = [c.name for c in configs if not is_empty(workdir / c.name)]
    if resume:
        if not started:
            raise RunDirError(
                f"--resume: no runs of {', '.join(c.name for c in configs)} in "
                f"{show_path(workdir)}; check --workdir, or start without --resume."
            )
        for name in started:
            check_workdir(workdir / name, resume=True, overwrite=False)
    elif not overwrite and not is_empty(workdir):
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


def compare_order(name: str) -> tuple[int, str]:
    preferred = list(COMPARE_ORDER)
    return (preferred.index(name) if name in preferred else len(preferred), name)
