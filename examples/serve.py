"""Serves a model trained by ``examples/train.py`` in bfloat16 and with each quantisation recipe.

Loads the latest checkpoint of a run directory, casts the params to bfloat16 (the baseline),
quantises the matmul weights with `jaxmp.quantize` for each recipe, and measures, for each:
the validation loss (the run's own validation batches), the bytes of the params (all of them,
and those of the matmul weights alone) and greedy generation's tokens per second (jitted,
the median of ``--runs`` runs). The model function is unmodified: `jaxmp.quantized` runs it.

Usage:
    python examples/train.py && python examples/serve.py  # train.py's default run (a few minutes)
    python examples/train.py --workdir runs/q            # or a run directory of your own
    python examples/serve.py --workdir runs/q
    python examples/serve.py --workdir runs/q --recipes int8,fp8 --batch 64 --tokens 32
    python examples/serve.py --workdir runs/q --step 1400  # an earlier checkpoint of the run
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import pathlib
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxmp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import train  # noqa: E402  (its default run is serve.py's)
from lm import config as config_lib  # noqa: E402
from lm import data as data_lib  # noqa: E402
from lm import model as model_lib  # noqa: E402
from lm.rundir import (  # noqa: E402
    UnreadableCheckpoint,
    checkpoint_steps,
    restore_checkpoint,
    show_path,
    silence_abandoned_reads,
)
from lm.steps import get_dataset, make_model, programs, with_precision  # noqa: E402

__all__ = [
    "Row",
    "evaluate",
    "format_table",
    "generation_speed",
    "load_run",
    "param_bytes",
    "serve",
]

RECIPE_NAMES = ("int8", "int8_dynamic", "fp8", "int4")
BASELINE = "p=bf16,c=bf16,o=f32"  # the bfloat16 model every recipe is compared with


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table: a recipe (or ``"bf16"``) and what was measured."""

    recipe: str
    val_loss: float
    param_bytes: int
    weight_bytes: int  # the matmul weights alone (those the recipe quantises)
    tokens_per_s: float


def default_workdir() -> pathlib.Path:
    """The run ``python examples/train.py`` writes with no flags."""
    return train.REPO_ROOT / "runs" / train.DEFAULT_CONFIG


def load_run(
    workdir: pathlib.Path, step: int | None = None
) -> tuple[config_lib.Config, data_lib.Dataset, Any]:
    """The run's config, dataset and the params of its checkpoint at `step` (default: the
    latest), float32 or the run's param dtype. `workdir` may be relative.

    Raises:
      ValueError: naming the directory, when it holds no run, no checkpoint (at `step`), or
        one that cannot be read (and the earlier one to serve instead, if it can be).
    """
    workdir = pathlib.Path(workdir)
    where = show_path(workdir)
    config_file = workdir / "config.yaml"
    if not config_file.is_file():
        flag = "" if workdir.resolve() == default_workdir().resolve() else f" --workdir {where}"
        raise ValueError(
            f"--workdir: {where} holds no run (no config.yaml); train one with "
            f"python examples/train.py{flag}"
        )
    config = config_lib.load(str(config_file))
    steps = checkpoint_steps(workdir)
    if not steps:
        raise ValueError(f"--workdir: no checkpoint in {where}/checkpoints.")
    if step is not None:
        if step not in steps:
            raise ValueError(
                f"--step: no checkpoint at step {step} in {where}/checkpoints; its checkpoints "
                f"are at steps {', '.join(map(str, steps))}."
            )
        steps = [s for s in steps if s <= step]
    dataset = get_dataset(config.val_fraction)
    built = programs(config, dataset.vocab_size)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    structs = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
        jax.eval_shape(built.init, jax.random.PRNGKey(config.seed)),
    )
    try:
        state = restore_checkpoint(workdir, steps, structs)
    except UnreadableCheckpoint as e:
        message = f"--workdir: cannot read checkpoint {e.path} ({e.reason})"
        if e.fallback is not None:
            message += (
                f"; the one at step {e.fallback} can be read: serve it with --step {e.fallback}"
            )
        elif e.earlier:
            message += f", nor the one at step {e.earlier[0]}"
        raise ValueError(message + ".") from None
    return config, dataset, state.params


def param_bytes(params: Any) -> int:
    """Bytes stored: arrays, and the values and scales of each `jaxmp.QuantizedArray`."""
    return sum(int(x.nbytes) for x in jax.tree.leaves(params))


def evaluate(apply: Any, params: Any, batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> float:
    """Mean validation loss (nats/char) of ``apply(params, inputs)``'s logits."""
    loss = jax.jit(lambda p, x, y: model_lib.cross_entropy(apply(p, x), y))
    return float(np.mean([float(loss(params, x, y)) for x, y in batches]))


def generation_speed(apply: Any, params: Any, prompt: np.ndarray, tokens: int, runs: int) -> float:
    """Greedy decoding of `tokens` tokens after `prompt` (``(batch, length)``): tokens per
    second, the median of `runs` runs of one jitted program (compiled first).

    The context window is the model's length; each token runs the whole window (no cache).
    """
    batch, start = prompt.shape

    def decode(p: Any, window: jax.Array) -> jax.Array:
        def step(pos: jax.Array, window: jax.Array) -> jax.Array:
            logits = apply(p, window)
            nxt = jnp.argmax(lax.dynamic_index_in_dim(logits, pos, 1, keepdims=False), -1)
            return lax.dynamic_update_index_in_dim(window, nxt.astype(window.dtype), pos + 1, 1)

        return lax.fori_loop(start - 1, start - 1 + tokens, step, window)

    length = start + tokens
    window = np.zeros((batch, length), np.int32)
    window[:, :start] = prompt
    run = jax.jit(decode)
    jax.block_until_ready(run(params, window))  # compile
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(run(params, window))
        times.append(time.perf_counter() - t0)
    return batch * tokens / statistics.median(times)


def serve(
    workdir: pathlib.Path,
    recipes: Sequence[str] = RECIPE_NAMES,
    *,
    exclude: Sequence[str] = (),
    group_size: int = 128,
    batch: int = 1,
    tokens: int = 32,
    runs: int = 3,
    step: int | None = None,
) -> list[Row]:
    """The table's rows: bfloat16 first, then each recipe (see the module docs), for the
    checkpoint at `step` (default: the latest)."""
    config, dataset, params = load_run(workdir, step)
    if tokens < 1 or tokens >= config.seq_len:
        raise ValueError(
            f"--tokens must be in [1, {config.seq_len - 1}] (the window), got {tokens}."
        )
    model = make_model(with_precision(config, BASELINE), dataset.vocab_size)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)

    def apply(p: Any, tokens: jax.Array) -> jax.Array:
        return model.apply({"params": p}, tokens)

    batches = data_lib.eval_batches(
        dataset.val, config.eval_batches, config.batch_size, config.seq_len
    )
    prompt = np.tile(dataset.encode("The ")[None], (batch, 1))
    example = jnp.zeros((1, config.seq_len), jnp.int32)
    # The matmul weights (the leaves every recipe but int4's group size finds alike).
    plan = jaxmp.quantization_plan(apply, params, example, recipe="int8", exclude=exclude)
    weight_paths = {leaf.path for leaf in plan if leaf.quantized}
    rows = []
    for name in ("bf16", *recipes):
        if name == "bf16":
            p, run_apply = params, apply
        else:
            recipe = jaxmp.Int4WeightOnly(group_size) if name == "int4" else name
            p = jaxmp.quantize(apply, params, example, recipe=recipe, exclude=exclude)
            run_apply = jaxmp.quantized(apply)
        speed = generation_speed(run_apply, p, prompt, tokens, runs)
        loss = evaluate(run_apply, p, batches)
        rows.append(Row(name, loss, param_bytes(p), _bytes_at(p, weight_paths), speed))
    return rows


def _bytes_at(params: Any, paths: set[str]) -> int:
    """Bytes of the leaves at `paths` (keys joined by ``/``, as in `jaxmp.quantization_plan`)."""
    leaves = jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, jaxmp.QuantizedArray)
    )[0]
    return sum(
        int(leaf.nbytes)
        for path, leaf in leaves
        if "/".join(str(getattr(k, "key", k)) for k in path) in paths
    )


def format_table(rows: Sequence[Row]) -> str:
    """The rows as a Markdown table, each measure also relative to the first (bf16) row."""
    base = rows[0]
    lines = [
        "| recipe | val loss | vs bf16 | param bytes | vs bf16 | matmul weight bytes | vs bf16 "
        "| tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.recipe} | {r.val_loss:.4f} | {100 * (r.val_loss / base.val_loss - 1):+.2f}% "
            f"| {r.param_bytes:,} | {r.param_bytes / base.param_bytes:.3f}x "
            f"| {r.weight_bytes:,} | {r.weight_bytes / base.weight_bytes:.3f}x "
            f"| {r.tokens_per_s:,.0f} |"
        )
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (exit status 2)."""

    def fail(self, message: object, status: int = 2) -> NoReturn:
        self.exit(status, f"{self.prog}: error: {' '.join(str(message).split())}\n")

    def error(self, message: str) -> NoReturn:
        self.fail(f"{message} (see --help)")


def main(argv: Sequence[str] | None = None) -> None:
    parser = _Parser(
        prog="serve.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workdir",
        help=f"a run directory of examples/train.py (default runs/{train.DEFAULT_CONFIG}, the run "
        "train.py writes with no flags)",
    )
    parser.add_argument(
        "--step", type=int, help="serve the checkpoint of this step (default: the latest)"
    )
    parser.add_argument(
        "--recipes",
        default=",".join(RECIPE_NAMES),
        help=f"comma-separated, of {', '.join(RECIPE_NAMES)} (default: all)",
    )
    parser.add_argument(
        "--exclude", action="append", default=[], help="regex of param paths kept unquantised"
    )
    parser.add_argument("--group-size", type=int, default=128, help="int4's group size")
    parser.add_argument("--batch", type=int, default=1, help="sequences generated at once")
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per sequence")
    parser.add_argument("--runs", type=int, default=3, help="timed generations (median)")
    args = parser.parse_args(argv)
    recipes = [r for r in args.recipes.split(",") if r]
    try:
        for name in recipes:
            if name not in RECIPE_NAMES:
                close = difflib.get_close_matches(name, RECIPE_NAMES, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"--recipes must be names of {', '.join(RECIPE_NAMES)}, got {name!r}.{hint}"
                )
        if args.batch < 1 or args.runs < 1:
            raise ValueError(f"--batch and --runs must be positive, got {args.batch}, {args.runs}.")
        if args.step is not None and args.step < 1:
            raise ValueError(f"--step must be positive, got {args.step}.")
        rows = serve(
            pathlib.Path(args.workdir) if args.workdir else default_workdir(),
            recipes,
            exclude=args.exclude,
            group_size=args.group_size,
            batch=args.batch,
            tokens=args.tokens,
            runs=args.runs,
            step=args.step,
        )
    except (ValueError, TypeError) as e:
        silence_abandoned_reads()  # after a checkpoint that could not be read
        parser.fail(str(e).replace("`exclude`", "--exclude"))
    print(format_table(rows))


if __name__ == "__main__":
    main()
