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

The logic lives in ``lm/``, one idea a module, each importable on its own: ``config.py``,
``data.py`` and ``model.py`` (what is trained), ``steps.py`` (the model, optimizer and step
functions of a config), ``loop.py`` (`train_and_evaluate`, the train loop), ``rundir.py`` (the
run directory's rules and its checkpoints), ``metrics.py`` (the per-step rows and a run's
result), ``interrupt.py`` (Ctrl-C), ``inspection.py`` (``--inspect``), ``figures.py``,
``compare.py`` (``--compare`` and its table) and ``underflow.py`` (the table's gradient
underflow). This file is the command line; it re-exports their public names.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import textwrap
from collections.abc import Sequence
from typing import NoReturn

from lm import config as config_lib
from lm import data as data_lib
from lm.compare import (
    COMPARE_ORDER,
    COMPARE_OUTPUTS,
    compare,
    compare_order,
    load_configs,
    signed_percent,
    summarize,
)
from lm.figures import STYLES, comparison_figure, plot_comparison, plot_run, run_figure
from lm.inspection import (
    load_inspections,
    make_inspected_grad,
    parse_inspect_steps,
    write_inspection,
)
from lm.interrupt import stop_after_step_on_sigint
from lm.loop import check_mesh, evaluate, generate, train_and_evaluate
from lm.metrics import COLUMNS, MetricsWriter, RunResult, load_history
from lm.rundir import (
    RUN_OUTPUTS,
    RunDirError,
    check_workdir,
    checkpoint_steps,
    remove_run_outputs,
    restore_checkpoint,
    show_path,
    silence_abandoned_reads,
)
from lm.steps import (
    Programs,
    TrainState,
    create_train_state,
    get_dataset,
    init_params,
    learning_rate_schedule,
    make_eval_step,
    make_fp8_apply,
    make_init,
    make_loss_fn,
    make_model,
    make_optimizer,
    make_qat_apply,
    make_train_step,
    programs,
    with_precision,
)
from lm.underflow import gradient_underflow, logit_gradient_underflow
from loss_scale_tools import LossScalingError, describe_scale

__all__ = (
    "REPO_ROOT",
    "DEFAULT_CONFIG",
    "COMPARE_ORDER",
    "COMPARE_OUTPUTS",
    "compare",
    "load_configs",
    "signed_percent",
    "summarize",
    "STYLES",
    "comparison_figure",
    "plot_comparison",
    "plot_run",
    "run_figure",
    "load_inspections",
    "make_inspected_grad",
    "parse_inspect_steps",
    "write_inspection",
    "stop_after_step_on_sigint",
    "check_mesh",
    "evaluate",
    "generate",
    "train_and_evaluate",
    "COLUMNS",
    "MetricsWriter",
    "RunResult",
    "load_history",
    "RUN_OUTPUTS",
    "RunDirError",
    "check_workdir",
    "checkpoint_steps",
    "remove_run_outputs",
    "restore_checkpoint",
    "show_path",
    "Programs",
    "TrainState",
    "create_train_state",
    "get_dataset",
    "init_params",
    "learning_rate_schedule",
    "make_eval_step",
    "make_fp8_apply",
    "make_qat_apply",
    "make_init",
    "make_loss_fn",
    "make_model",
    "make_optimizer",
    "make_train_step",
    "programs",
    "with_precision",
    "gradient_underflow",
    "logit_gradient_underflow",
    "make_parser",
    "main",
)

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = "mixed_float16"


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (exit status 2)."""

    def fail(self, message: object, status: int = 2) -> NoReturn:
        self.exit(status, f"{self.prog}: error: {' '.join(str(message).split())}\n")

    def error(self, message: str) -> NoReturn:  # argparse's own errors: bad options
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
        f"  qat (quantization-aware training): one of {', '.join(config_lib.QAT_RECIPES)}",
        "  qat_start: the steps trained without qat first (0: from the start)",
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
                names = sorted(config_lib.available(), key=compare_order)
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
        silence_abandoned_reads()
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
