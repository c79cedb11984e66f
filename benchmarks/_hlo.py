"""Reading XLA's cost model and compiled HLO: bytes accessed, per-fusion breakdown, machine info.

Standard library, jax and numpy only (used by `gpu_benchmark.py` too).
"""

from __future__ import annotations

import collections
import os
import platform
import re
import statistics
import time
from typing import Any

import jax

_ITEMSIZE = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8,
}  # fmt: skip
_ARRAY = re.compile(r"\b(" + "|".join(_ITEMSIZE) + r")\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*?)\)(.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def real_compiles() -> None:
    """Turns JAX's persistent compilation cache off for this process, so that every compile
    timed is a compile: with ``JAX_COMPILATION_CACHE_DIR`` set, a repeated build would be
    loaded from disk. JAX reads the setting at the first compile; the scripts call this at
    the start."""
    jax.config.update("jax_enable_compilation_cache", False)


def cost(compiled: Any) -> dict[str, float]:
    """`compiled.cost_analysis()` as one flat dict (older jax returns a list of one dict)."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0]
    return dict(analysis)


def bytes_accessed(compiled: Any) -> float:
    return float(cost(compiled)["bytes accessed"])


def flops(compiled: Any) -> float:
    return float(cost(compiled).get("flops", 0.0))


def _nbytes(type_text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(type_text):
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        total += n * _ITEMSIZE[dtype]
    return total


def entry_instructions(hlo_text: str) -> list[dict[str, Any]]:
    """The instructions of the ENTRY computation with operand and output bytes.

    Each dict: name, opcode, out_bytes and operands, a list of ``(name, bytes, path)`` where
    `path` is the jit argument path of an entry parameter (its HLO ``op_name`` metadata) and
    None for an intermediate.
    Operand bytes count each distinct operand once, as XLA's cost model does for fusions.
    """
    lines = hlo_text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY"))
    sizes: dict[str, int] = {}
    param_names: dict[str, str] = {}
    out = []
    for line in lines[start + 1 :]:
        if line.startswith("}"):
            break
        m = _INSTR.match(line)
        if not m:
            continue
        name, type_text, opcode, args, rest = m.groups()
        sizes[name] = _nbytes(type_text.split("{")[0] if "(" not in type_text else type_text)
        if opcode == "parameter":
            op_name = _OP_NAME.search(rest)
            param_names[name] = op_name.group(1).replace("\\'", "'") if op_name else name
            continue
        operands = list(dict.fromkeys(re.findall(r"%([\w.\-]+)", args)))
        out.append(
            dict(
                name=name,
                opcode=opcode,
                out_bytes=sizes[name],
                # (operand, bytes, argument path or None for an intermediate)
                operands=[(o, sizes.get(o, 0), param_names.get(o)) for o in operands],
            )
        )
    return out


def _root_outputs(hlo_text: str) -> dict[str, list[int]]:
    """Instruction name -> indices of the entry's output tuple that it produces."""
    root = next(line for line in hlo_text.splitlines() if line.lstrip().startswith("ROOT %tuple"))
    args = root[root.index(" tuple(") + 7 : root.rindex(")")]
    outputs: dict[str, list[int]] = collections.defaultdict(list)
    for i, name in enumerate(re.findall(r"%([\w.\-]+)", args)):
        outputs[name].append(i)
    return outputs


def fusion_breakdown(
    compiled: Any, classify_input: Any, output_labels: list[str], unit: float
) -> list[tuple[str, str, float, float, int]]:
    """Groups the compiled program's instructions by what they read and write.

    Args:
      compiled: a `jax.stages.Compiled`.
      classify_input: maps an entry parameter's name (its argument path) to a label
        ("grads", "mu", ...).
      output_labels: a label for each leaf of the function's flattened output.
      unit: bytes per unit (for example the bytes of one float32 copy of the params).

    Returns:
      Rows ``(reads, writes, bytes read, bytes written, count)`` in units, largest first;
      ``reads`` lists the labels of the inputs read (``new <label>`` for an output read back,
      ``tmp`` for other intermediates) and
      ``writes`` the labels of the outputs written (``tmp`` when not a program output).
    """
    text = compiled.as_text()
    outputs = _root_outputs(text)
    groups: dict[tuple[str, str], list[float]] = {}
    for ins in entry_instructions(text):
        if ins["opcode"] in ("tuple", "get-tuple-element", "bitcast", "constant"):
            continue
        reads = set()
        read_bytes = 0
        for operand, nbytes, path in ins["operands"]:
            read_bytes += nbytes
            if nbytes <= 16:  # scalars (step counters, the loss scale, flags) are not listed
                continue
            if path is not None:
                reads.add(classify_input(path))
            elif operand in outputs:  # a new value that is also written out, read back
                reads.update(f"new {output_labels[i]}" for i in outputs[operand])
            else:
                reads.add("tmp")
        reads = sorted(reads)
        if ins["out_bytes"] <= 16 and read_bytes <= 64:
            continue
        writes = sorted({output_labels[i] for i in outputs.get(ins["name"], [])}) or ["tmp"]
        key = (",".join(reads) or "-", ",".join(writes))
        row = groups.setdefault(key, [0.0, 0.0, 0])
        row[0] += read_bytes / unit
        row[1] += ins["out_bytes"] / unit
        row[2] += 1
    rows = [(r, w, b[0], b[1], int(b[2])) for (r, w), b in groups.items()]
    rows.sort(key=lambda r: -(r[2] + r[3]))
    return rows


def error_line(e: BaseException, width: int = 80) -> str:
    """`e` on one line for a table cell: its type and the first line of its message (an
    exception without a message, ``MemoryError()``, is its type alone)."""
    first = (str(e).splitlines() or [""])[0][:width]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def median_time(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def machine() -> str:
    """CPU model, core count, accelerator and versions, on one line."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import jaxlib  # noqa: PLC0415

    devices = jax.devices()
    device = f"{devices[0].platform}:{getattr(devices[0], 'device_kind', '')}"
    return (
        f"{cpu}, {os.cpu_count()} cores; device {device} x{len(devices)}; "
        f"jax {jax.__version__}, jaxlib {jaxlib.__version__}; Python {platform.python_version()}"
    )


def table(header: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def fmt(row):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(cells[0]), sep] + [fmt(r) for r in cells[1:]])


# --------------------------------------------------------------------------------------------
# FP8 GEMMs in a lowered program (StableHLO text, `jax.jit(f).lower(...).as_text()`).

_SSA = re.compile(r"^\s*(%[\w#:]+)(?::\d+)? = (?:stablehlo\.)?([\w.]+)\b(.*)$")
_TENSOR = re.compile(r"tensor<((?:\d+x)*)(\w+)>")
_FP8_TYPES = ("f8E4M3FN", "f8E5M2")


def _tensor_types(signature: str) -> list[tuple[tuple[int, ...], str]]:
    """``(shape, element type)`` of each tensor type in `signature`, in order."""
    out = []
    for dims, dtype in _TENSOR.findall(signature):
        shape = tuple(int(d) for d in dims.split("x") if d) if dims else ()
        out.append((shape, dtype))
    return out


def _functions(text: str) -> list[dict[str, tuple[str, list[str], str]]]:
    """Per function of the module: SSA value -> (op, operand names, the rest of the line)."""
    functions: list[dict[str, tuple[str, list[str], str]]] = []
    for line in text.splitlines():
        if "func.func" in line:
            functions.append({})
            continue
        match = _SSA.match(line)
        if match and functions:
            name, op, rest = match.groups()
            operands = re.findall(r"%[\w#]+", rest.split(" : ")[0])
            functions[-1][name.split(":")[0]] = (op, operands, rest)
    return functions


def _dequantized_fp8(name: str, values: dict[str, tuple[str, list[str], str]]) -> str | None:
    """The FP8 type `name` is dequantised from (``convert(fp8) * scale``), or None."""
    op, operands, _ = values.get(name, ("", [], ""))
    if op != "multiply":
        return None
    for operand in operands:
        producer, _, rest = values.get(operand, ("", [], ""))
        types = _tensor_types(rest.split(" : ", 1)[1]) if " : " in rest else []
        if producer == "convert" and types and types[0][1] in _FP8_TYPES:
            return types[0][1]
    return None


def fp8_gemms(text: str) -> list[dict[str, Any]]:
    """The FP8 GEMMs of a lowered program: ``dot_general``s of two FP8 operands.

    An operand is FP8-typed, or dequantised from FP8 (``convert(fp8 value) *
    broadcast(scale)``: the pattern XLA's GPU compiler rewrites into a cuBLASLt FP8 GEMM with
    the scales as its arguments and the dot's result type as its output).
    Each entry: ``operands`` (the two FP8 types), ``result`` (the result's element type),
    ``contracting_minor`` (the contracted dimensions are the trailing ones of both operands,
    the batch dimensions the leading ones: cuBLASLt's "TN" layout, no transposition needed).
    """
    found = []
    for values in _functions(text):
        for op, operands, rest in values.values():
            if op != "dot_general" or len(operands) < 2:
                continue
            types = _tensor_types(rest.split(" : ", 1)[1])
            formats = [
                t[1] if t[1] in _FP8_TYPES else _dequantized_fp8(o, values)
                for o, t in zip(operands[:2], types[:2], strict=True)
            ]
            if None in formats:
                continue
            (lhs_shape, _), (rhs_shape, _), (_, result) = types[0], types[1], types[-1]
            contract = re.search(r"contracting_dims = \[([\d, ]*)\] x \[([\d, ]*)\]", rest)
            batch = re.search(r"batching_dims = \[([\d, ]*)\] x \[([\d, ]*)\]", rest)

            def dims(m: Any, i: int) -> list[int]:
                return [int(d) for d in m.group(i).split(",") if d.strip()] if m else []

            def minor(shape: tuple[int, ...], c: list[int], b: list[int]) -> bool:
                n = len(shape)
                return c == list(range(n - len(c), n)) and b == list(range(len(b)))

            found.append(
                {
                    "operands": tuple(formats),
                    "result": result,
                    "contracting_minor": minor(lhs_shape, dims(contract, 1), dims(batch, 1))
                    and minor(rhs_shape, dims(contract, 2), dims(batch, 2)),
                }
            )
    return found


def fp8_transposes(text: str) -> int:
    """How many ``transpose`` ops of the lowered program take an FP8 tensor."""
    count = 0
    for values in _functions(text):
        for op, _, rest in values.values():
            types = _tensor_types(rest.split(" : ", 1)[1]) if " : " in rest else []
            if op == "transpose" and types and types[0][1] in _FP8_TYPES:
                count += 1
    return count


# --------------------------------------------------------------------------------------------
# Integer and FP8 GEMMs (quantised inference).

_LOW_PRECISION_TYPES = ("i8", "ui8", *_FP8_TYPES)
_COMPILED_LOW_PRECISION = re.compile(r"\b(?:s8|u8|f8e4m3fn|f8e5m2)\[")


def quantized_gemms(text: str) -> list[dict[str, Any]]:
    """The ``dot_general``s of a lowered program whose two operands are both int8 or both FP8
    (``int8 x int8 -> int32``, ``E4M3 x E4M3 -> float32``): ``operands`` and ``result`` types."""
    found = []
    # Line by line: values in the regions of a `stablehlo.case` (`lax.platform_dependent`,
    # one per quantised matmul) reuse their names, which a table by name would merge.
    for line in text.splitlines():
        match = _SSA.match(line)
        if not match:
            continue
        _, op, rest = match.groups()
        if op != "dot_general" or " : " not in rest:
            continue
        types = _tensor_types(rest.split(" : ", 1)[1])
        if len(types) >= 3 and all(t[1] in _LOW_PRECISION_TYPES for t in types[:2]):
            found.append({"operands": (types[0][1], types[1][1]), "result": types[-1][1]})
    return found


def compiled_low_precision_gemms(hlo_text: str) -> int:
    """The GEMMs of a compiled program (HLO text) reading an int8, uint8 (packed int4) or FP8
    operand: ``dot`` instructions, and GEMM calls (cuBLAS custom calls, Triton or cuDNN GEMM
    fusions on a GPU). A weight-only int8 matmul counts where XLA fused the weight's
    conversion into its GEMM; where the weight is converted first, its GEMM reads bfloat16."""
    instructions = [m.groups() for m in map(_INSTR.match, hlo_text.splitlines()) if m]
    # Operands are printed with their types (older XLA) or by name alone (newer): by name, the
    # type is their definition's.
    types = {name: type_text for name, type_text, *_ in instructions}
    count = 0
    for _, _, op, operands, rest in instructions:
        gemm = op == "dot" or (
            op in ("custom-call", "fusion")
            and any(word in rest for word in ("gemm", "matmul", "cublas", "__cudnn$fusion"))
        )
        typed = operands + " ".join(types.get(n, "") for n in re.findall(r"%([\w.\-]+)", operands))
        if gemm and _COMPILED_LOW_PRECISION.search(typed):
            count += 1
    return count
