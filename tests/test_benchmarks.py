"""Smoke tests of the benchmark scripts (tiny configurations; numbers are not checked here,
except that they exist and the byte ratios keep their order)."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")


@pytest.fixture
def benchmarks_on_path(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)


def run_script(script, *args, timeout, **env):
    """Runs ``benchmarks/<script> ARGS`` on the CPU (`env` added to the environment); its
    stdout, after checking that it succeeded."""
    proc = subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, script), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow  # half a minute on 2 CPU cores: two compiles of a tiny main-job step each
@pytest.mark.parametrize(
    "extra",
    [(), ("--no-statistics",), ("--no-statistics", "--no-reference")],
    ids=["statistics", "none", "no-reference"],
)
def test_inspect_cost_quick_runs_and_traces_each_step_once(extra):
    out = run_script("inspect_cost.py", "--quick", *extra, timeout=600)
    ratio = re.search(r"^\| inspected \| [\d.]+ +\| (\d+\.\d\d) +\|$", out, re.M)
    assert ratio and float(ratio.group(1)) > 0, out
    assert "{'plain': 1, 'inspected': 1}" in out
    # The rows' own statistics are timed only when the step measured them.
    assert ("row statistics" in out) == (not extra), out
    compared = "no float32 reference" if "--no-reference" in extra else "with a float32 reference"
    assert compared in out, out


def test_memory_at_scale_measures_a_call_in_a_process_of_its_own(tmp_path):
    # Two rows of a small leaf: each measured in its own process, its bound judged, the rows
    # written as JSON and printed again from it without measuring.
    rows = tmp_path / "rows.json"
    only = ("--only", "head|quantize int8|eager")
    out = run_script(
        "memory_at_scale.py",
        "--rows",
        "256",
        "--cols",
        "2048",
        "--no-stack",
        *only,
        "--json",
        str(rows),
        timeout=300,
    )
    line = "| head | quantize int8 | eager | 0.001 GB |"
    assert line in out and "over what it returns: yes |" in out, out
    (row,) = json.loads(rows.read_text())
    assert row["kind"] == "quantize" and row["leaf_bytes"] == 256 * 2048 * 2
    assert row["returned"] == 256 * 2048 + 2048 * 4  # int8 values and a float32 scale each
    assert 0 < row["first_extra"] and 0 <= row["warm_extra"]
    again = run_script("memory_at_scale.py", "--table", str(rows), timeout=120)
    assert line in again


@pytest.mark.slow  # two minutes on 2 CPU cores: every row of the GPU script, compiled
def test_gpu_benchmark_tiny_runs_on_cpu():
    out = run_script("gpu_benchmark.py", "--tiny", timeout=600)
    fp8 = [f"mixed_bfloat16 + FP8 {r}, jaxmp" for r in ("current", "delayed", "block")]
    for label in ("float32, optax.adam", "mixed_float16, jaxmp", "mixed_bfloat16, jaxmp", *fp8):
        row = next(line for line in out.splitlines() if line.startswith(f"| {label} "))
        tokens_per_s = row.split("|")[2].strip()
        assert re.fullmatch(r"[\d,]+", tokens_per_s), row  # measured, not skipped
    for label in fp8:
        assert re.search(
            rf"^{re.escape(label)}: \d+\.\d\dx the tokens/s of mixed_bfloat16", out, re.M
        )
    for recipe in ("current", "delayed"):  # the hidden-4096 model, against its own bf16 row
        label = f"h4096: mixed_bfloat16 + FP8 {recipe}, jaxmp"
        assert re.search(
            rf"^{re.escape(label)}: \d+\.\d\dx the tokens/s of h4096: mixed_bfloat16", out, re.M
        ), out
        row = next(line for line in out.splitlines() if line.startswith(f"| {label} "))
        # The FP8 GEMMs of the lowered step: the block's qkv, output, fc and proj matmuls,
        # forward and backward (4 x 3: the head and the fused attention have none); none
        # compiled into cuBLASLt calls on a CPU.
        assert row.split("|")[-2].strip() == "12 / 0", row
    low = re.search(
        r"^low memory: [^:]*: params \+ optimizer state \+ batch [\d.]+ GB, ([\d.]+)x "
        r"mixed_bfloat16, jaxmp's",
        out,
        re.M,
    )
    assert low and float(low[1]) < 0.7, out  # 6 bytes per parameter against 2 + 12
    # The generation table: every recipe and KV cache at both batches measured, each with its
    # ratio lines.
    for recipe in ("bf16", "int8", "int8_dynamic", "fp8", "int4", "int8 KV", "fp8 KV"):
        for batch in (1, 64):
            row = re.search(rf"^\| {recipe} +\| {batch} +\| ([\d,]+) +\|", out, re.M)
            assert row, (recipe, batch, out[-3000:])
    assert re.search(r"^int8, batch 1: \d+\.\d\dx bfloat16's decode tokens/s", out, re.M)
    assert re.search(r"^int8 KV, batch 64: \d+\.\d\dx bfloat16's decode tokens/s", out, re.M)
    assert re.search(r"^fp8, batch 64: \d+\.\d\dx bfloat16's prefill tokens/s", out, re.M)
    ratio = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) == 6 and cells[1].startswith(("optax.adam", "jaxmp.loss_scaling", "naive")):
            ratio[cells[1].split(" ")[0]] = float(cells[4])
    assert ratio["jaxmp.loss_scaling(adam)"] < ratio["naive"]


@pytest.mark.slow  # trains the tiny model; the scripts run whole with the slow tests
def test_train_step_benchmark_functions(benchmarks_on_path):
    import _model
    import train_step

    config = _model.CONFIGS["tiny"]
    tokens = _model.batch(config)
    mem = train_step.memory(config, tokens, ["mixed_float16"], ["jaxmp", "manual"])
    assert all(m["temp"] > 0 for m in mem.values())
    compiled = {a: (mem[a, "mixed_float16"]["compiled"], mem[a, "mixed_float16"]["carry"])
                for a in ("jaxmp", "manual")}  # fmt: skip
    times = train_step.step_times(compiled, tokens, rounds=2)
    assert set(times) == {"jaxmp", "manual"} and all(t > 0 for t in times.values())
    lower_s, compile_s, total_s = train_step.compile_times(
        config, tokens, ["jaxmp"], "mixed_float16", repeats=1
    )["jaxmp"]
    assert 0 < lower_s < total_s and 0 < compile_s < total_s


# The approaches built on other libraries' glue (jmp, optax.apply_if_finite) with the slow ones.
@pytest.mark.parametrize(
    "approach",
    [
        "manual",
        pytest.param("jmp", marks=pytest.mark.slow),
        pytest.param("apply_if_finite", marks=pytest.mark.slow),
        "flax",
    ],
)
def test_every_approach_skips_an_overflowing_float16_step(benchmarks_on_path, approach):
    """The hand-written steps and peers skip a float16 overflow (jaxmp's is tested elsewhere)."""
    import _model
    import jax
    import jax.numpy as jnp
    import numpy as np

    config = _model.CONFIGS["tiny"]
    init, step = _model.make_step(approach, "mixed_float16", config)
    carry = init(0)
    # A loss scale of 2**15 on top of a huge loss overflows float16 in the backward pass.
    big = jax.tree.map(lambda x: x * 1e4 if x.dtype == jnp.float32 and x.ndim == 2 else x, carry[0])
    new, loss = jax.jit(step)((big, *carry[1:]), _model.batch(config))
    same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), new[0], big)
    assert all(jax.tree.leaves(same)), approach


def test_scripts_time_real_compiles_under_a_persistent_cache(tmp_path):
    """With JAX_COMPILATION_CACHE_DIR set, the repeated builds that compile times are the median
    of would be loads from that cache: the scripts turn it off (nothing is written there)."""
    cache = tmp_path / "jax_cache"
    cache.mkdir()
    args = ["--only", "update", "--leaves", "3", "--repeats", "2", "--approaches", "optax.adam"]
    out = run_script(
        "compile_cost.py",
        *args,
        timeout=300,
        JAX_COMPILATION_CACHE_DIR=str(cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    assert "| 3 " in out
    assert list(cache.iterdir()) == []


def test_compile_cost_update_and_step_time_sections(benchmarks_on_path, capsys):
    import compile_cost

    names = ["optax.adam", "jaxmp.loss_scaling(adam)", "hand-written loss scaling (select after)"]
    compile_cost.main(
        ["--only", "update", "--leaves", "3", "--repeats", "1", "--approaches", *names]
    )
    out = capsys.readouterr().out
    rows = {
        line.split("|")[2].strip(): line for line in out.splitlines() if line.startswith("| 3 ")
    }
    assert set(rows) == set(names)
    instructions = {name: int(row.split("|")[-2].replace(",", "")) for name, row in rows.items()}
    assert instructions["optax.adam"] < instructions["jaxmp.loss_scaling(adam)"]
    compile_cost.main(["--only", "steptime", "--steptime-leaves", "2", "--rounds", "2"])
    out = capsys.readouterr().out
    times = [
        line for line in out.splitlines() if line.startswith("| ") and "ms / update" not in line
    ]
    assert len(times) == len(compile_cost.STEP_APPROACHES), out


def test_compile_cost_breakdown_rows(benchmarks_on_path):
    import compile_cost

    rows = {row[0]: row for row in compile_cost.breakdown_rows(n=4)}
    assert list(rows) == [name for name, _, _ in compile_cost.UPDATE_APPROACHES[:3]]
    header = ["update", "per leaf", "fusions", *compile_cost.BREAKDOWN_OPCODES, "other"]
    selects = header.index("select")
    for row in rows.values():
        assert len(row) == len(header)
        # The opcode columns add up to the instructions per leaf.
        assert abs(sum(map(float, row[2:])) - float(row[1])) < 0.1, row
    # Plain Adam has no selects; loss scaling adds at least the four per leaf (the gradient,
    # the two moments and the update).
    assert float(rows["optax.adam"][selects]) < 1
    assert float(rows["jaxmp.loss_scaling(adam)"][selects]) >= 4


@pytest.mark.slow  # trains both steps for a while
def test_gpu_benchmark_low_memory_step_tracks_mixed_bfloat16(benchmarks_on_path):
    import _model
    import gpu_benchmark

    config = _model.CONFIGS["tiny"]
    tokens = _model.batch(config)
    runs = {
        "low": gpu_benchmark.make_lowmem_step(config),
        "bf16": _model.make_step("jaxmp", "mixed_bfloat16", config),
    }
    losses, carries = {}, {}
    for name, (init, step) in runs.items():
        # Donated, as `gpu_benchmark.run_row` compiles it: the next test loads this program.
        carry, step = init(0), jax.jit(step, donate_argnums=0)
        losses[name] = []
        for _ in range(6):
            carry, loss = step(carry, tokens)
            losses[name].append(float(loss))
        carries[name] = carry
    # The same start (the float32 init, rounded) and the same data: the same losses within
    # bfloat16's rounding of the params, and learning.
    np.testing.assert_allclose(losses["low"], losses["bf16"], rtol=0.01)
    assert losses["low"][-1] < losses["low"][0] - 0.3
    params, state = carries["low"]
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    n = sum(x.size for x in jax.tree.leaves(params))
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    assert state_bytes <= 4.1 * n  # two bfloat16 moments (and scalars), no master copy


@pytest.mark.slow  # compiles a train step
def test_gpu_benchmark_row_times_steps_after_a_compile_past_its_deadline(benchmarks_on_path):
    """A row whose compile outlasts its share of the budget still reports a measured time."""
    import _model
    import gpu_benchmark

    config = _model.CONFIGS["tiny"]
    row = gpu_benchmark.run_row("lowmem", None, config, _model.batch(config), 5, deadline=0.0)
    assert row["steps"] == gpu_benchmark.MIN_TIMED_STEPS == 3
    assert np.isfinite(row["step_s"]) and row["step_s"] > 0


def test_gpu_benchmark_gemm_rows_count_the_fp8_gemms(benchmarks_on_path, capsys):
    import gpu_benchmark

    gpu_benchmark.main(["--tiny", "--no-update-table", "--only", "GEMM"])
    out = capsys.readouterr().out
    rows = {
        cells[1]: cells
        for cells in ([c.strip() for c in line.split("|")] for line in out.splitlines())
        if len(cells) > 2 and cells[1].startswith("GEMM: ")
    }
    assert set(rows) == {
        f"GEMM: {r}" for r in ("bfloat16", "FP8 current", "FP8 delayed", "FP8 block")
    }
    # One FP8 GEMM pattern in each FP8 program (the block recipe's is one product batched over
    # the blocks), none in the bfloat16 one; no cuBLASLt call on a CPU.
    assert rows["GEMM: bfloat16"][5] == "0 / 0"
    for recipe in ("current", "delayed", "block"):
        assert rows[f"GEMM: FP8 {recipe}"][5] == "1 / 0", rows
        assert float(rows[f"GEMM: FP8 {recipe}"][2]) > 0  # timed


@pytest.mark.slow  # compiles a train step
def test_gpu_benchmark_only_selects_rows_and_names_them_when_none_match(benchmarks_on_path, capsys):
    import gpu_benchmark

    gpu_benchmark.main(["--tiny", "--no-update-table", "--only", "low memory"])
    out, err = capsys.readouterr()
    # Each row's start and result go to stderr as they happen, so that a run stopped from
    # outside still shows what it measured and which row it was in.
    label = re.escape("low memory: bfloat16 params + moments, stochastic rounding")
    assert re.search(rf"^\[ *\d+ s\] {label}: compiling and timing$", err, re.M), err
    assert re.search(
        rf"^\[ *\d+ s\] {label}: compile [\d.]+ s, [\d.]+ ms/step \(3 steps\)", err, re.M
    )
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")]
    assert rows == [
        "precision, approach",
        "low memory: bfloat16 params + moments, stochastic rounding",
    ]
    assert "no mixed_bfloat16, jaxmp row to compare with" in out
    # The ratios are to the first row run, named above the table.
    assert "the first row run of each group: low memory: bfloat16 params + moments" in out
    with pytest.raises(SystemExit) as exit_info:
        gpu_benchmark.main(["--tiny", "--only", "fp9"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--only ['fp9']: no row's label contains it" in err and "FP8 delayed" in err


def run_attention_lowering():
    return subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, "attention_lowering.py")],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=600,
    )


CUDA_PLUGIN = importlib.util.find_spec("jax_cuda12_plugin") is not None
# CI's CUDA-lowering stage sets this, so that a missing plugin fails there instead of skipping
# (docs/reference/development.md).
REQUIRE_CUDA_PLUGIN = "JAXMP_TEST_REQUIRE_CUDA_PLUGIN"


def test_attention_lowering_without_the_cuda_plugin_says_so():
    if CUDA_PLUGIN:
        pytest.skip("JAX's CUDA plugin is installed: the next test lowers for CUDA")
    proc = run_attention_lowering()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "CUDA plugin is not installed" in proc.stdout


def test_attention_lowering_counts_cudnn_calls_where_the_cuda_plugin_is():
    # Lowering for the GPU needs JAX's CUDA plugin and cuDNN (no GPU): every attention form
    # under autocast with a half-precision policy lowers to cuDNN's fused attention, forward
    # and backward, and none with the switch off or in float32.
    if not CUDA_PLUGIN:
        reason = (
            "JAX's CUDA plugin is not installed (jax-cuda12-plugin and nvidia-cudnn-cu12; "
            "see docs/reference/development.md)"
        )
        if os.environ.get(REQUIRE_CUDA_PLUGIN) == "1":
            pytest.fail(f"{REQUIRE_CUDA_PLUGIN}=1 but {reason}")
        pytest.skip(reason)
    proc = run_attention_lowering()
    assert proc.returncode == 0, proc.stderr[-3000:]
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in proc.stdout.splitlines()]
    forms = [c for c in cells if len(c) == 5 and c[1] in ("0", "1", "2")]
    assert len(forms) == 6
    for name, bf16, f16, off, f32 in forms:
        assert (bf16, f16, off, f32) == ("2", "2", "0", "0"), (name, proc.stdout)
    steps = {c[0]: c[1] for c in cells if len(c) == 2 and c[1].isdigit()}
    assert steps == {
        "optax, float32": "0",
        "jaxmp, mixed_bfloat16": "2",
        "jaxmp, mixed_float16": "2",
        "autocast, mixed_bfloat16": "2",
    }


@pytest.mark.slow  # compiles two rows; every row: the slow --tiny run
def test_quantized_generation_rows_measure_each_recipe(benchmarks_on_path):
    import quantized_generation as qg

    config = qg.Config(d_model=32, layers=1, heads=2, vocab=64, prompt=4, new_tokens=3)
    # One recipe and one cache here (each recipe's GEMMs: the --lower test; every row: the
    # slow --tiny run).
    recipes = ("int8_dynamic",)
    results = qg.measure(config, recipes=recipes, batches=(1,), repeats=1, kv_caches=("int8",))
    assert list(results) == [(name, 1) for name in ("bf16", *recipes, "int8 KV")]
    base = results["bf16", 1]
    for (name, _), row in results.items():
        assert row is not None and "error" not in row, (name, row)
        assert row["tokens"].shape == (1, config.new_tokens)
        assert 0 <= int(row["tokens"].min()) and int(row["tokens"].max()) < config.vocab
        assert row["decode_tps"] > 0 and row["prefill_tps"] > 0
        # int8 x int8 dots: the six matmuls of the scanned layer and the head.
        expected = 7 if name == "int8_dynamic" else 0
        assert row["gemms_lowered"] == expected, name
    # Params: the embedding stays bfloat16, every matmul weight shrinks.
    assert results["int8_dynamic", 1]["param_bytes"] < 0.7 * base["param_bytes"]
    # The int8 cache: one byte a value and a bfloat16 scale per head and position (head_dim 16);
    # the weights are bfloat16's.
    kv = results["int8 KV", 1]
    assert kv["cache_bytes"] / base["cache_bytes"] == (16 + 2) / 32
    assert kv["param_bytes"] == base["param_bytes"]
    assert results["int8_dynamic", 1]["cache_bytes"] == base["cache_bytes"]
    text = qg.report(config, results)
    assert re.search(r"^\| int8_dynamic +\| 1 +\| [\d,]+ +\| \d+\.\d\d +\|", text, re.M)
    # The rows skipped past the deadline are reported as such.
    skipped = qg.measure(config, recipes=("int8",), batches=(1,), deadline=0.0)
    names = ("bf16", "int8", "int8 KV", "fp8 KV")  # the KV rows: int8 and FP8 by default
    assert skipped == {(name, 1): None for name in names}
    assert "skipped (time budget)" in qg.report(config, skipped)


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_quantized_generation_lowers_without_running(benchmarks_on_path, capsys, platform):
    # The decode step's int8 and FP8 GEMMs, counted in the program lowered for each platform
    # (no GPU needed: lowering for CUDA takes JAX's CUDA plugin). CPU has no FP8 GEMM: there
    # the FP8 recipe multiplies its E4M3 values as bfloat16 (the same products), so that the
    # weight is not widened to float32.
    if platform == "cuda" and not CUDA_PLUGIN:
        reason = (
            "JAX's CUDA plugin is not installed (jax-cuda12-plugin and nvidia-cudnn-cu12; "
            "see docs/reference/development.md)"
        )
        if os.environ.get(REQUIRE_CUDA_PLUGIN) == "1":
            pytest.fail(f"{REQUIRE_CUDA_PLUGIN}=1 but {reason}")
        pytest.skip(reason)
    import quantized_generation as qg

    with pytest.MonkeyPatch.context() as patch:  # a smaller decoder than --tiny's
        small = qg.Config(d_model=32, layers=1, heads=2, vocab=64, prompt=4, new_tokens=3)
        patch.setitem(qg.CONFIGS, "tiny", small)
        qg.main(["--tiny", "--lower", platform])
    out = capsys.readouterr().out
    assert "int8_dynamic: 7 int8/FP8 GEMMs per decode step ['i8 x i8 -> i32']" in out
    fp8 = "7 int8/FP8 GEMMs per decode step ['f8E4M3FN x f8E4M3FN -> f32']"
    assert f"fp8: {fp8 if platform == 'cuda' else '0 int8/FP8 GEMMs per decode step []'}" in out
    assert "bf16: 0 " in out and "int4: 0 " in out


@pytest.mark.slow  # the recipes' accuracy: tests/test_quantize.py
def test_quantized_generation_model_runs_quantized_close_to_bfloat16(benchmarks_on_path):
    import quantized_generation as qg

    import jaxmp

    config = qg.CONFIGS["tiny"]
    params = qg.init_params(config)
    step = qg.make_step(config)
    cache = qg.empty_cache(config, 2)
    prompt = jax.random.randint(jax.random.key(3), (2, config.prompt), 0, config.vocab)
    pos = jnp.zeros((), jnp.int32)
    ref, ref_cache = step(params, cache, prompt, pos)
    for recipe, tolerance in (("int8", 0.03), ("int8_dynamic", 0.05), ("fp8", 0.1), ("int4", 0.2)):
        q = jaxmp.quantize(step, params, cache, prompt[:, :1], pos, recipe=recipe)
        assert q["embed"] is params["embed"]  # a lookup, not a matmul
        assert isinstance(q["head"], jaxmp.QuantizedArray)
        assert isinstance(q["layers"]["w1"], jaxmp.QuantizedArray)
        out, out_cache = jax.jit(jaxmp.quantized(step))(q, cache, prompt, pos)
        err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
        assert err < tolerance, (recipe, err)
        assert out_cache.keys.dtype == jnp.bfloat16 and out_cache.format is None
    # The quantised caches: the same model, close to the bfloat16 cache's logits.
    for kv_cache, tolerance in (("int8", 0.03), ("fp8", 0.1)):
        out, out_cache = jax.jit(step)(params, qg.empty_cache(config, 2, kv_cache), prompt, pos)
        err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
        assert err < tolerance, (kv_cache, err)
        assert out_cache.format == kv_cache and out_cache.shape == ref_cache.shape


def test_quantized_generation_report_gives_each_target_ratio(benchmarks_on_path):
    # The ratios the GPU targets are about, printed with their targets wherever the rows were
    # measured: int8 weight-only decode at batch 1 (1.5x), the int8 cache's decode at batch
    # 64 (1.2x), int8 dynamic and FP8 prefill at batch 64 (1.3x).
    import quantized_generation as qg

    def row(decode, prefill, cache_bytes=4e6):
        return dict(
            decode_tps=decode, prefill_tps=prefill, param_bytes=2e9, cache_bytes=cache_bytes,
            temp=1e8, gemms_lowered=0, gemms_compiled=0, compile_s=1.0,
        )  # fmt: skip

    results = {
        ("bf16", 1): row(100.0, 1000.0),
        ("int8", 1): row(160.0, 1000.0),
        ("bf16", 64): row(1000.0, 10000.0),
        ("int8_dynamic", 64): row(1000.0, 14000.0),
        ("fp8", 64): row(1000.0, 12000.0),
        ("int8 KV", 64): row(1250.0, 10000.0, cache_bytes=2.125e6),
    }
    text = qg.report(qg.CONFIGS["default"], results)
    assert "int8, batch 1: 1.60x bfloat16's decode tokens/s (target on a GPU: 1.5x)" in text
    assert "int8 KV, batch 64: 1.25x bfloat16's decode tokens/s (target on a GPU: 1.2x)" in text
    assert (
        "int8_dynamic, batch 64: 1.40x bfloat16's prefill tokens/s (target on a GPU: 1.3x)" in text
    )
    assert "fp8, batch 64: 1.20x bfloat16's prefill tokens/s (target on a GPU: 1.3x)" in text
    kv = next(line for line in text.splitlines() if line.startswith("| int8 KV "))
    assert "| 2.125 " in kv and "| 0.53 " in kv  # the cache's MB and its ratio to bfloat16's


def test_an_error_without_a_message_is_its_type(benchmarks_on_path):
    import _hlo
    import quantized_generation as qg

    assert _hlo.error_line(MemoryError()) == "MemoryError"
    assert _hlo.error_line(ValueError("first\nsecond"), 3) == "ValueError: fir"

    def fail(*args, **kwargs):
        raise MemoryError

    config = qg.Config(d_model=32, layers=1, heads=2, vocab=64, prompt=4, new_tokens=3)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(qg, "measure_row", fail)
        results = qg.measure(config, recipes=("int8",), batches=(1,), kv_caches=())
    assert results == {("bf16", 1): {"error": "MemoryError"}, ("int8", 1): {"error": "MemoryError"}}
    assert "| MemoryError" in qg.report(config, results)


def test_compiled_low_precision_gemms_reads_typed_and_named_operands(benchmarks_on_path):
    import _hlo

    typed = "  %dot.1 = s32[8,8]{1,0} dot(s8[8,16]{1,0} %p0, s8[16,8]{1,0} %p1), lhs_c={1}"
    named = "\n".join(
        [
            "  %w = s8[16,8]{1,0} parameter(1)",
            "  %x = bf16[8,16]{1,0} parameter(0)",
            "  %gemm = bf16[8,8]{1,0} fusion(%x, %w), kind=kCustom, calls=%c, "
            'backend_config={"kind":"__triton_gemm"}',
            "  %cc = (f32[8,8]{1,0}, s8[0]{0}) custom-call(%x, %x), "
            'custom_call_target="__cublas$gemm"',
            "  %cvt = bf16[16,8]{1,0} convert(%w)",
        ]
    )
    assert _hlo.compiled_low_precision_gemms(typed) == 1
    # The Triton GEMM reads the int8 weight; the cuBLAS call reads bfloat16 (its tuple result
    # holds an s8 workspace, not an operand); a convert is no GEMM.
    assert _hlo.compiled_low_precision_gemms(named) == 1
    f = lambda a, b: jax.lax.dot_general(  # noqa: E731
        a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32
    )
    a = jnp.ones((8, 16), jnp.int8)
    lowered = jax.jit(f).lower(a, a.T)
    assert _hlo.quantized_gemms(lowered.as_text()) == [{"operands": ("i8", "i8"), "result": "i32"}]
    assert _hlo.compiled_low_precision_gemms(lowered.compile().as_text()) == 1
