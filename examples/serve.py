"""Serves a model trained by ``examples/train.py`` in bfloat16 and with each quantisation recipe
and key/value cache format.

Loads the latest checkpoint of a run directory, casts the params to bfloat16 (the baseline),
quantises the matmul weights with `jaxmp.quantize` for each recipe, and measures, for each:
the validation loss (the run's own validation batches, the full-sequence forward), the same
through the key/value cache (each validation sequence written into the cache and attended
over, as decoding reads it), the bytes of the params (all of them, and those of the matmul
weights alone) and of the cache, and greedy generation's tokens per second (a prefill and
one-token steps against the cache, jitted, the median of ``--runs`` runs). The model function
is unmodified: `jaxmp.quantized` runs it.

``--recipes`` also takes ``int8_calibrated`` and ``fp8_calibrated``: int8_dynamic and FP8 with
static activation scales, `jaxmp.calibrate`'s from 8 batches of the training text.

The rows: bf16 first, then each recipe, with the first cache of ``--kv-cache`` (``bf16``: the
compute dtype); then the bfloat16 weights with each further cache (``int8``, ``fp8``: a
`jaxmp.KVCache` with one scale per head and position; ``f32``). The table is also written to
``serve.json`` in the run directory: a list of rows ``{"recipe", "val_loss", "param_bytes",
"tokens_per_s", "kv_cache", "cached_val_loss", "weight_bytes", "kv_cache_bytes"}``.

``--agreement TOKENS`` instead decodes TOKENS tokens greedily after ``--prompts`` prompts of
the validation text with the bfloat16 cache and each other cache, and prints how often they
choose the same token and the error of their logits (`kv_agreement`).

Usage:
    python examples/train.py && python examples/serve.py  # train.py's default run (a few minutes)
    python examples/train.py --workdir runs/q            # or a run directory of your own
    python examples/serve.py --workdir runs/q
    python examples/serve.py --workdir runs/q --recipes int8,fp8 --batch 64 --tokens 32
    python examples/serve.py --workdir runs/q --recipes fp8,fp8_calibrated  # static FP8 scales
    python examples/serve.py --workdir runs/q --kv-cache int8  # every recipe with an int8 cache
    python examples/serve.py --workdir runs/q --step 1400  # an earlier checkpoint of the run
    python examples/serve.py --workdir runs/q --agreement 256  # int8 and FP8 caches vs bf16
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import math
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
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
    "cached_evaluate",
    "evaluate",
    "format_agreement",
    "format_table",
    "generation_speed",
    "kv_agreement",
    "load_run",
    "param_bytes",
    "serve",
    "write_rows",
]

RECIPE_NAMES = ("int8", "int8_dynamic", "fp8", "int4")
# Rows of an activation recipe with static activation scales (`jaxmp.calibrate` on
# `CALIBRATION_BATCHES` batches of the training text): ``--recipes int8_calibrated,...``.
CALIBRATED = {"int8_calibrated": "int8_dynamic", "fp8_calibrated": "fp8"}
CALIBRATION_BATCHES = 8
BASELINE = "p=bf16,c=bf16,o=f32"  # the bfloat16 model every recipe is compared with
# The key/value caches: `jaxmp.KVCache`'s format and the dtype it stores unquantised values in
# (None: the compute dtype, bfloat16).
KV_CACHES: dict[str, tuple[str | None, Any]] = {
    "bf16": (None, None),
    "f32": (None, jnp.float32),
    "int8": ("int8", None),
    "fp8": ("fp8", None),
}
PROMPT = "The "  # the generation's prompt


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table: a recipe (or ``"bf16"``), a key/value cache, what was measured."""

    recipe: str
    val_loss: float  # the full-sequence forward's
    param_bytes: int
    weight_bytes: int  # the matmul weights alone (those the recipe quantises)
    tokens_per_s: float
    kv_cache: str = "bf16"
    kv_cache_bytes: int = 0  # the generation's cache: every layer, --batch sequences
    cached_val_loss: float = math.nan  # through the cache


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


def cached_evaluate(
    decode: Any,
    params: Any,
    batches: Sequence[tuple[np.ndarray, np.ndarray]],
    caches: Callable[[int], Any],
) -> float:
    """Mean validation loss (nats/char) through a key/value cache: each batch of sequences
    written at once into ``caches(batch)`` (empty) by ``decode(params, caches, inputs, 0)``,
    every position attending over the cached (quantised) keys and values before it."""
    loss = jax.jit(
        lambda p, x, y: model_lib.cross_entropy(decode(p, caches(x.shape[0]), x, 0)[0], y)
    )
    return float(np.mean([float(loss(params, x, y)) for x, y in batches]))


def generation_speed(
    decode: Any,
    params: Any,
    caches: Callable[[int], Any],
    prompt: np.ndarray,
    tokens: int,
    runs: int,
) -> float:
    """Greedy decoding of `tokens` tokens after `prompt` (``(batch, length)``) with a key/value
    cache: tokens per second, the median of `runs` runs of one jitted program (compiled first).

    The program makes an empty cache (``caches(batch)``), writes the prompt (one call of
    ``decode(params, caches, tokens, pos)``, whose logits give the first token), then runs
    ``tokens - 1`` steps of one token each in a ``lax.fori_loop``, every step reading the
    cache instead of recomputing the window.
    """
    batch, start = prompt.shape

    def generate(p: Any, prompt: jax.Array) -> jax.Array:
        logits, cache = decode(p, caches(batch), prompt, 0)
        out = jnp.zeros((batch, tokens), jnp.int32)
        out = out.at[:, 0].set(jnp.argmax(logits[:, -1], -1).astype(jnp.int32))

        def step(i: jax.Array, carry: Any) -> Any:
            cache, out = carry
            token = lax.dynamic_slice_in_dim(out, i, 1, axis=1)
            logits, cache = decode(p, cache, token, start + i)
            nxt = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
            return cache, lax.dynamic_update_index_in_dim(out, nxt, i + 1, 1)

        return lax.fori_loop(0, tokens - 1, step, (cache, out))[1]

    run = jax.jit(generate)
    prompt = jnp.asarray(prompt, jnp.int32)
    jax.block_until_ready(run(params, prompt))  # compile
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(run(params, prompt))
        times.append(time.perf_counter() - t0)
    return batch * tokens / statistics.median(times)


def _cache_bytes(caches: Callable[[int], Any], batch: int) -> int:
    """Bytes of ``caches(batch)`` (not made: their shapes)."""
    return sum(c.nbytes for c in jax.eval_shape(lambda: caches(batch)))


def _cache_maker(
    model: model_lib.TransformerLM, name: str, block_size: int | None = None
) -> Callable[[int], Any]:
    """``batch -> caches`` of the cache named `name` (`KV_CACHES`), a quantised one with a
    scale per `block_size` values (default: per head and position)."""
    fmt, dtype = KV_CACHES[name]
    block_size = None if fmt is None else block_size
    return functools.partial(
        model_lib.init_cache, model, format=fmt, dtype=dtype, block_size=block_size
    )


def serve(
    workdir: pathlib.Path,
    recipes: Sequence[str] = RECIPE_NAMES,
    *,
    kv_caches: Sequence[str] = ("bf16", "int8", "fp8"),
    kv_block_size: int | None = None,
    exclude: Sequence[str] = (),
    group_size: int = 128,
    batch: int = 1,
    tokens: int = 32,
    runs: int = 3,
    step: int | None = None,
) -> list[Row]:
    """The table's rows: bfloat16 first, then each recipe, with the first of `kv_caches`; then
    bfloat16 with each further cache (see the module docs), for the checkpoint at `step`
    (default: the latest). The int8 and FP8 caches have a scale per `kv_block_size` values
    (default: per head and position)."""
    config, dataset, params = load_run(workdir, step)
    prompt = np.tile(dataset.encode(PROMPT)[None], (batch, 1)).astype(np.int32)
    most = config.seq_len - prompt.shape[1] + 1
    if not 1 <= tokens <= most:
        raise ValueError(
            f"--tokens must be in [1, {most}] (the model's {config.seq_len} positions after the "
            f"{prompt.shape[1]}-character prompt, the last one generated), got {tokens}."
        )
    model = make_model(with_precision(config, BASELINE), dataset.vocab_size)
    trained, params = params, served_params(None, params, None, None)

    def apply(p: Any, tokens: jax.Array) -> jax.Array:
        return model.apply({"params": p}, tokens)

    decode = functools.partial(model_lib.decode, model)
    batches = data_lib.eval_batches(
        dataset.val, config.eval_batches, config.batch_size, config.seq_len
    )
    example = jnp.zeros((1, config.seq_len), jnp.int32)
    # The matmul weights (the leaves every recipe but int4's group size finds alike).
    plan = jaxmp.quantization_plan(apply, params, example, recipe="int8", exclude=exclude)
    weight_paths = {leaf.path for leaf in plan if leaf.quantized}
    # The caches (their errors before anything is measured) and their bytes.
    makers = {kv: _cache_maker(model, kv, kv_block_size) for kv in kv_caches}
    cache_bytes = {kv: _cache_bytes(make, batch) for kv, make in makers.items()}
    first, *others = kv_caches
    rows = []
    for name, kv in [*((n, first) for n in ("bf16", *recipes)), *(("bf16", k) for k in others)]:
        if name == "bf16":
            p, run_apply, run_decode = params, apply, decode
        else:
            recipe = jaxmp.Int4WeightOnly(group_size) if name == "int4" else name
            p = served_params(apply, trained, example, CALIBRATED.get(recipe, recipe), exclude)
            if name in CALIBRATED:
                text = data_lib.eval_batches(
                    dataset.train, CALIBRATION_BATCHES, config.batch_size, config.seq_len
                )
                p = jaxmp.calibrate(apply, p, [x for x, _ in text])
            run_apply, run_decode = jaxmp.quantized(apply), jaxmp.quantized(decode)
        caches = makers[kv]
        rows.append(
            Row(
                recipe=name,
                val_loss=evaluate(run_apply, p, batches),
                param_bytes=param_bytes(p),
                weight_bytes=_bytes_at(p, weight_paths),
                tokens_per_s=generation_speed(run_decode, p, caches, prompt, tokens, runs),
                kv_cache=kv,
                kv_cache_bytes=cache_bytes[kv],
                cached_val_loss=cached_evaluate(run_decode, p, batches, caches),
            )
        )
    return rows


def served_params(
    apply: Any, params: Any, example: Any, recipe: Any, exclude: Sequence[str] = ()
) -> Any:
    """The params of the bfloat16 model: with `recipe`, the matmul weights quantised by
    `jaxmp.quantize` from `params` as trained (float32 master weights: the values a run with
    the config key ``qat`` trained with, rounded to the same grid points), every other leaf
    cast to bfloat16; without (None), every leaf cast to bfloat16."""
    if recipe is not None:
        params = jaxmp.quantize(apply, params, example, recipe=recipe, exclude=exclude)
    return jax.tree.map(
        lambda x: x if isinstance(x, jaxmp.QuantizedArray) else x.astype(jnp.bfloat16),
        params,
        is_leaf=lambda x: isinstance(x, jaxmp.QuantizedArray),
    )


def write_rows(rows: Sequence[Row], workdir: pathlib.Path) -> pathlib.Path:
    """Writes the rows to ``workdir/serve.json`` (a list of objects; a number that is not
    finite as null) whole or not at all: to a temporary file in `workdir`, renamed over
    ``serve.json`` once written, so that an interrupted or failed write leaves the earlier
    ``serve.json`` as it was (and no other file)."""
    keys = ("recipe", "val_loss", "param_bytes", "tokens_per_s", "kv_cache", "cached_val_loss")
    keys += ("weight_bytes", "kv_cache_bytes")

    def value(x: Any) -> Any:
        return None if isinstance(x, float) and not math.isfinite(x) else x

    data = [{k: value(getattr(r, k)) for k in keys} for r in rows]
    path = pathlib.Path(workdir) / "serve.json"
    tmp = path.with_name(f".serve.json.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def kv_agreement(
    workdir: pathlib.Path,
    kv_caches: Sequence[str] = ("int8", "fp8"),
    *,
    tokens: int = 256,
    prompts: int = 32,
    prompt_length: int = 16,
    seed: int = 0,
    block_size: int | None = None,
    step: int | None = None,
) -> list[dict[str, Any]]:
    """Greedy decoding with each of `kv_caches` against the bfloat16 cache, bfloat16 weights.

    `prompts` prompts of `prompt_length` characters of the validation text (at offsets drawn
    with `seed`), `tokens` tokens each (past the model's window, the last half of it is
    written again from position 0: `model.generate`). For each cache:

    * ``same_forced``: the fraction of positions where it chooses the bfloat16 cache's token,
      each step reading the bfloat16 run's tokens before it (teacher forcing: every position
      compared at the same context);
    * ``same_free``: the fraction of positions where its own greedy text has the bfloat16 run's
      token (free-running: after the first difference the two texts differ in their context);
      ``first_divergence``: per prompt, the first position that differs (`tokens` if none);
      ``same_text``: the fraction of prompts whose `tokens` tokens all agree;
    * ``logits_max_abs``, ``logits_max_rel`` (over the largest bfloat16 logit) and
      ``logits_rms_rel`` (the root mean square error over that of the logits): the error of
      its logits at the bfloat16 run's tokens;
    * ``bytes_ratio``: its bytes over the bfloat16 cache's.

    The int8 and FP8 caches have a scale per `block_size` values (default: per head and
    position).
    """
    config, dataset, params = load_run(workdir, step)
    model = make_model(with_precision(config, BASELINE), dataset.vocab_size)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    length = min(prompt_length, config.seq_len)
    offsets = np.random.default_rng(seed).integers(0, len(dataset.val) - length, size=prompts)
    prompt = np.stack([dataset.val[o : o + length] for o in offsets]).astype(np.int32)

    def generate(name: str, forced: Any = None) -> tuple[np.ndarray, np.ndarray]:
        fmt, dtype = KV_CACHES[name]
        return model_lib.generate(
            model,
            params,
            prompt,
            tokens,
            fmt,
            cache_dtype=dtype,
            block_size=None if fmt is None else block_size,
            forced=forced,
        )

    base_bytes = _cache_bytes(_cache_maker(model, "bf16"), 1)
    ratios = {
        k: _cache_bytes(_cache_maker(model, k, block_size), 1) / base_bytes for k in kv_caches
    }
    ref_tokens, ref_logits = generate("bf16")
    rows = []
    for name in kv_caches:
        free, _ = generate(name)
        _, logits = generate(name, forced=ref_tokens)
        same = free == ref_tokens
        err = np.abs(logits.astype(np.float64) - ref_logits)
        rows.append(
            {
                "kv_cache": name,
                "bytes_ratio": ratios[name],
                "same_forced": float(np.mean(np.argmax(logits, -1) == ref_tokens)),
                "same_free": float(same.mean()),
                "first_divergence": [int(np.argmin(r)) if not r.all() else tokens for r in same],
                "same_text": float(np.mean(same.all(axis=1))),
                "logits_max_abs": float(err.max()),
                "logits_max_rel": float(err.max() / np.abs(ref_logits).max()),
                "logits_rms_rel": float(
                    np.sqrt(np.mean(err**2) / np.mean(ref_logits.astype(np.float64) ** 2))
                ),
            }
        )
    return rows


def format_agreement(rows: Sequence[dict[str, Any]], tokens: int, prompts: int) -> str:
    """`kv_agreement`'s rows as a Markdown table."""
    lines = [
        f"Greedy decoding of {tokens} tokens after {prompts} prompts, each cache against the "
        "bf16 cache (bfloat16 weights):",
        "",
        "| kv cache | same token (forced) | same token (free-running) | same text | first "
        "divergence (median) | logits max abs err | max rel err | rms rel err | bytes vs bf16 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kv_cache']} | {100 * r['same_forced']:.2f}% | {100 * r['same_free']:.2f}% "
            f"| {100 * r['same_text']:.0f}% "
            f"| {statistics.median(r['first_divergence']):g} | {r['logits_max_abs']:.4f} "
            f"| {100 * r['logits_max_rel']:.2f}% | {100 * r['logits_rms_rel']:.2f}% "
            f"| {r['bytes_ratio']:.3f}x |"
        )
    return "\n".join(lines)


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

    def rel(value: float, to: float) -> str:
        return f"{100 * (value / to - 1):+.2f}%"

    lines = [
        "| recipe | kv cache | val loss | vs bf16 | cached val loss | vs bf16 | param bytes "
        "| vs bf16 | matmul weight bytes | vs bf16 | kv cache bytes | vs bf16 | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.recipe} | {r.kv_cache} | {r.val_loss:.4f} | {rel(r.val_loss, base.val_loss)} "
            f"| {r.cached_val_loss:.4f} | {rel(r.cached_val_loss, base.cached_val_loss)} "
            f"| {r.param_bytes:,} | {r.param_bytes / base.param_bytes:.3f}x "
            f"| {r.weight_bytes:,} | {r.weight_bytes / base.weight_bytes:.3f}x "
            f"| {r.kv_cache_bytes:,} | {r.kv_cache_bytes / base.kv_cache_bytes:.3f}x "
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
        help=f"comma-separated, of {', '.join((*RECIPE_NAMES, *CALIBRATED))} (default: "
        f"{', '.join(RECIPE_NAMES)})",
    )
    parser.add_argument(
        "--kv-cache",
        default="bf16,int8,fp8",
        help=f"comma-separated key/value caches, of {', '.join(KV_CACHES)}: every recipe with "
        "the first, bf16 weights with the others (default bf16,int8,fp8)",
    )
    parser.add_argument(
        "--kv-block-size",
        type=int,
        help="values per scale of the int8 and fp8 caches (default: head_dim, one scale per "
        "head and position)",
    )
    parser.add_argument(
        "--exclude", action="append", default=[], help="regex of param paths kept unquantised"
    )
    parser.add_argument("--group-size", type=int, default=128, help="int4's group size")
    parser.add_argument("--batch", type=int, default=1, help="sequences generated at once")
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per sequence")
    parser.add_argument("--runs", type=int, default=3, help="timed generations (median)")
    parser.add_argument(
        "--agreement",
        type=int,
        metavar="TOKENS",
        help="instead of the table: decode TOKENS tokens greedily with each --kv-cache but bf16 "
        "and with the bf16 cache, and compare their tokens and logits",
    )
    parser.add_argument(
        "--prompts", type=int, default=32, help="--agreement's prompts (validation text)"
    )
    args = parser.parse_args(argv)
    recipes = [r for r in args.recipes.split(",") if r]
    kv_caches = [k for k in args.kv_cache.split(",") if k]
    workdir = pathlib.Path(args.workdir) if args.workdir else default_workdir()
    try:
        for flag, names, choices in (
            ("--recipes", recipes, (*RECIPE_NAMES, *CALIBRATED)),
            ("--kv-cache", kv_caches, tuple(KV_CACHES)),
        ):
            for name in names:
                if name not in choices:
                    close = difflib.get_close_matches(name, choices, n=1)
                    hint = f" Did you mean {close[0]!r}?" if close else ""
                    raise ValueError(
                        f"{flag} must be names of {', '.join(choices)}, got {name!r}.{hint}"
                    )
        if not kv_caches:
            raise ValueError("--kv-cache must name at least one cache.")
        if args.batch < 1 or args.runs < 1:
            raise ValueError(f"--batch and --runs must be positive, got {args.batch}, {args.runs}.")
        if args.step is not None and args.step < 1:
            raise ValueError(f"--step must be positive, got {args.step}.")
        if args.agreement is not None:
            compared = [k for k in kv_caches if k != "bf16"]
            if not compared:
                others = ", ".join(k for k in KV_CACHES if k != "bf16")
                raise ValueError(
                    "--agreement compares caches with the bf16 cache: --kv-cache must name "
                    f"another ({others}), got {args.kv_cache}."
                )
            if args.agreement < 1 or args.prompts < 1:
                raise ValueError(
                    f"--agreement and --prompts must be positive, got {args.agreement}, "
                    f"{args.prompts}."
                )
            agreement = kv_agreement(
                workdir,
                compared,
                tokens=args.agreement,
                prompts=args.prompts,
                block_size=args.kv_block_size,
                step=args.step,
            )
        else:
            rows = serve(
                workdir,
                recipes,
                kv_caches=kv_caches,
                kv_block_size=args.kv_block_size,
                exclude=args.exclude,
                group_size=args.group_size,
                batch=args.batch,
                tokens=args.tokens,
                runs=args.runs,
                step=args.step,
            )
    except (ValueError, TypeError) as e:
        silence_abandoned_reads()  # after a checkpoint that could not be read
        message = str(e).replace("`exclude`", "--exclude")
        parser.fail(message.replace("`block_size`", "--kv-block-size"))
    if args.agreement is not None:
        print(format_agreement(agreement, args.agreement, args.prompts))
        return
    print(format_table(rows))
    path = write_rows(rows, workdir)
    print(f"\nThe rows are in {show_path(path)}.")


if __name__ == "__main__":
    main()
