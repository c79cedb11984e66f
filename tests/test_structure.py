"""The shape of the code: imports point one way, modules stay small, the public API holds, and
the file paths the documentation names exist.

* Imports: every module of ``jaxmp/`` and ``examples/`` is read with `ast` (nothing is
  imported), its imports at the top and inside functions alike, and the graph of the imports
  between these modules must have no cycle (STYLE.md: "An import inside a function to dodge a
  cycle is a cycle"). Examples are named as they import each other, with ``examples/`` on
  ``sys.path`` (``train``, ``lm.loop``). A parent package that Python initialises before a
  submodule is not an edge: only the module an import names is.
* Size: no module of ``jaxmp/`` or ``examples/`` is over `MAX_LINES` lines.
* API: the public names of ``jaxmp``, ``jaxmp.linen``, ``jaxmp.nnx`` and ``examples/train.py``
  and their signatures (a class's, and its public methods') equal `EXPECTED_API`. A change to
  the API changes that list in the same commit, on purpose.
* Documentation: every path under a source folder that README.md, BENCHMARKS.md,
  examples/README.md or a page of docs/ names (``jaxmp/_src/interpret.py``,
  ``examples/lm/loop.py``, ``configs/bf16_*.yaml``) exists.
"""

from __future__ import annotations

import ast
import difflib
import inspect
import pathlib
import re
import sys
import typing
from collections.abc import Iterator

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
MAX_LINES = 1000
# The folders whose files the documentation names by path from the repository root.
SOURCE_FOLDERS = ("jaxmp", "examples", "benchmarks", "tests", "configs", "docs")


# --- Imports ---------------------------------------------------------------------------------


def _module_files() -> dict[str, pathlib.Path]:
    """Every module of jaxmp/ and examples/, by the name it is imported under."""
    modules = {}
    for base, folder in ((ROOT, ROOT / "jaxmp"), (EXAMPLES, EXAMPLES)):
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


class Import(typing.NamedTuple):
    target: str  # the module imported
    line: int
    in_function: bool


def _import_call_name(node: ast.Call) -> ast.expr | None:
    """The name argument of ``importlib.import_module(...)`` or ``__import__(...)``, if `node`
    is such a call."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name in ("import_module", "__import__") and node.args:
        return node.args[0]
    return None


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> list[Import]:
    """The imports in `path` (module `name`) of the modules in `modules`.

    Raises:
      AssertionError: for an ``importlib.import_module`` of one of `modules` whose name is not
        a literal string (the walk could not follow it).
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    roots = {m.split(".")[0] for m in modules}
    found: list[Import] = []

    def add(target: str, node: ast.AST, in_function: bool) -> None:
        if target in modules and target != name:
            found.append(Import(target, node.lineno, in_function))  # type: ignore[attr-defined]

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node, in_function)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                add(submodule if submodule in modules else base, node, in_function)
        elif isinstance(node, ast.Call) and (arg := _import_call_name(node)) is not None:
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                add(arg.value, node, in_function)
            else:
                text = ast.unparse(arg)
                prefix = re.match(r"f?[\"'](\w+)", text)
                assert not (prefix and prefix[1] in roots), (
                    f"{shown}:{node.lineno}: import {text} by a literal name, "
                    "so that the import walk sees it"
                )
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return found


def import_graph() -> dict[str, dict[str, Import]]:
    """``graph[a][b]``: the first import of module `b` in module `a`."""
    modules = _module_files()
    graph: dict[str, dict[str, Import]] = {}
    for name, path in modules.items():
        edges: dict[str, Import] = {}
        for imp in _imports(name, path, modules):
            edges.setdefault(imp.target, imp)
        graph[name] = edges
    return graph


def _strongly_connected(graph: dict[str, dict[str, Import]]) -> Iterator[list[str]]:
    """Tarjan's strongly connected components of `graph` with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()

    def connect(v: str) -> Iterator[list[str]]:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                yield from connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                yield sorted(component)

    for v in sorted(graph):
        if v not in index:
            yield from connect(v)


def _shortest_cycle(graph: dict[str, dict[str, Import]], start: str, within: set[str]) -> list[str]:
    """A shortest cycle through `start` among the modules `within` (breadth first)."""
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if w in within and w not in parents:
                    parents[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def describe_cycles(graph: dict[str, dict[str, Import]]) -> list[str]:
    """One line per import cycle: each import with the file and line that makes it."""
    files = {name: path.relative_to(ROOT) for name, path in _module_files().items()}
    lines = []
    for component in _strongly_connected(graph):
        cycle = _shortest_cycle(graph, component[0], set(component))
        text = cycle[0]
        for a, b in zip(cycle, cycle[1:], strict=False):
            imp = graph[a][b]
            where = f"{files[a]}:{imp.line}" + (", in a function" if imp.in_function else "")
            text += f" -> {b} ({where})"
        if len(component) > len(cycle) - 1:
            text += f"; all of {', '.join(component)} import each other in a ring"
        lines.append(text)
    return lines


def test_import_walk_sees_every_kind_of_import(tmp_path):
    """The walk itself: top-level, relative, in a function, and `importlib.import_module`."""
    (tmp_path / "pkg").mkdir()
    sources = {
        "pkg/__init__.py": "from pkg import a\n",
        "pkg/a.py": "from . import b\n",
        "pkg/b.py": "def f():\n    import importlib\n    return importlib.import_module('pkg.c')\n",
        "pkg/c.py": "def g():\n    from pkg.a import x\n",
        "pkg/d.py": "import os\nfrom pkg import b as _b, nothing\n",
    }
    for rel, text in sources.items():
        (tmp_path / rel).write_text(text)
    modules = {
        name: tmp_path / rel
        for name, rel in [
            ("pkg", "pkg/__init__.py"),
            ("pkg.a", "pkg/a.py"),
            ("pkg.b", "pkg/b.py"),
            ("pkg.c", "pkg/c.py"),
            ("pkg.d", "pkg/d.py"),
        ]
    }
    graph = {
        name: {i.target: i for i in _imports(name, path, modules)} for name, path in modules.items()
    }
    assert {name: sorted(edges) for name, edges in graph.items()} == {
        "pkg": ["pkg.a"],
        "pkg.a": ["pkg.b"],
        "pkg.b": ["pkg.c"],
        "pkg.c": ["pkg.a"],
        "pkg.d": ["pkg", "pkg.b"],  # `nothing` is not a module: an import of the package
    }
    assert graph["pkg.b"]["pkg.c"].in_function and not graph["pkg.a"]["pkg.b"].in_function
    assert [c for c in _strongly_connected(graph)] == [["pkg.a", "pkg.b", "pkg.c"]]
    # A name the walk cannot read is an error, not an import it skips.
    (tmp_path / "pkg" / "e.py").write_text(
        "import importlib\nimportlib.import_module(f'pkg.{x}')\n"
    )
    with pytest.raises(AssertionError, match=r"e.py:2: import f'pkg.\{x\}' by a literal name"):
        _imports("pkg.e", tmp_path / "pkg" / "e.py", modules)


def test_no_import_cycle():
    cycles = describe_cycles(import_graph())
    assert not cycles, "import cycles (an import inside a function is one too):\n" + "\n".join(
        cycles
    )


def test_the_core_imports_nothing_above_it():
    """`interpret` (the shared core) imports no rule set, no autocast and no Flax integration."""
    assert set(import_graph()["jaxmp._src.interpret"]) == {"jaxmp._src.compat"}


# --- Size ------------------------------------------------------------------------------------


def test_no_module_is_over_the_line_limit():
    sizes = {
        path.relative_to(ROOT): len(path.read_text().splitlines())
        for path in _module_files().values()
    }
    over = [f"{path}: {n} lines" for path, n in sorted(sizes.items()) if n > MAX_LINES]
    assert not over, f"modules over {MAX_LINES} lines (split them by idea):\n" + "\n".join(over)


# --- Public API ------------------------------------------------------------------------------


def _annotation(annotation: object) -> object:
    """An annotation as written: ``from __future__ import annotations`` strings as they are,
    forward references (a NamedTuple's) by their text. An evaluated annotation comes from a
    dependency (the fields `jaxmp.linen.TrainState` inherits from Flax's), whose text changes
    with its version (``jax.Array`` or ``jax.jaxlib._jax.Array``): it is left out."""
    if isinstance(annotation, typing.ForwardRef):
        return annotation.__forward_arg__
    if annotation is None or isinstance(annotation, str) or annotation is inspect.Parameter.empty:
        return annotation
    return inspect.Parameter.empty


def _signature(obj: object) -> str:
    try:
        signature = inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "(signature unavailable)"
    parameters = [
        p.replace(annotation=_annotation(p.annotation)) for p in signature.parameters.values()
    ]
    return str(
        signature.replace(
            parameters=parameters, return_annotation=_annotation(signature.return_annotation)
        )
    )


def _describe(prefix: str, module: object, names: typing.Iterable[str]) -> Iterator[str]:
    for name in names:
        obj = getattr(module, name)
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            yield f"{prefix}{name}: exception({obj.__mro__[1].__name__})"
        elif inspect.isclass(obj):
            yield f"{prefix}{name}: class{_signature(obj)}"
            for attr, member in sorted(vars(obj).items()):
                if attr.startswith("_"):
                    continue
                if isinstance(member, property):
                    yield f"{prefix}{name}.{attr}: property"
                elif isinstance(member, (staticmethod, classmethod)):
                    yield f"{prefix}{name}.{attr}: {_signature(member.__func__)}"
                elif inspect.isfunction(member):
                    yield f"{prefix}{name}.{attr}: {_signature(member)}"
        elif callable(obj):  # functions, and the jitted and cached ones
            yield f"{prefix}{name}: {_signature(obj)}"
        else:
            kind = "Path" if isinstance(obj, pathlib.PurePath) else type(obj).__name__
            yield f"{prefix}{name}: {kind}"


def public_api() -> list[str]:
    import jaxmp
    import jaxmp.linen
    import jaxmp.nnx

    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import train

    return [
        *_describe("jaxmp.", jaxmp, sorted(jaxmp.__all__)),
        *_describe("jaxmp.linen.", jaxmp.linen, sorted(jaxmp.linen.__all__)),
        *_describe("jaxmp.nnx.", jaxmp.nnx, sorted(jaxmp.nnx.__all__)),
        *_describe("train.", train, sorted(train.__all__)),
    ]


# The API as the code has it, printed by `python -m tests.test_structure`.
EXPECTED_API = """
jaxmp.Autocast: class(fun: 'Callable[..., Any]', policy: 'policy_lib.Policy', low_precision_ops: 'frozenset[str]', float32_ops: 'frozenset[str]', fused_attention: 'bool' = True)
jaxmp.Autocast.jaxpr: (self, *args: 'Any', **kwargs: 'Any') -> 'compat.ClosedJaxpr'
jaxmp.CompressStateState: class(key: 'jax.Array', inner_state: 'Any', compressed: 'tuple[CompressedLeaf, ...]')
jaxmp.CompressedLeaf: class(scales: 'jax.Array | None', index: 'int', format: 'str', dtype: 'np.dtype', second_moment: 'bool', block_size: 'int', spec: 'tuple[tuple[str, ...], ...] | None' = None) -> None
jaxmp.CompressedLeaf.decompress: (self, values: 'jax.Array') -> 'jax.Array'
jaxmp.DelayedScaling: class(history_len: 'int' = 1024, amax_compute: 'str' = 'max', margin: 'int' = 0, fwd_dtype: 'Any' = dtype(float8_e4m3fn), bwd_dtype: 'Any' = dtype(float8_e5m2), min_size: 'int' = 0) -> None
jaxmp.DynamicLossScale: class(loss_scale: 'ArrayLike', counter: 'ArrayLike' = <factory>, period: 'int' = 2000, factor: 'float' = 2, min_loss_scale: 'float' = 1.0, *, max_loss_scale: 'float' = 4294967296.0, backoff: 'float | None' = None, hysteresis: 'int' = 1, nonfinite_count: 'ArrayLike' = <factory>) -> None
jaxmp.DynamicLossScale.adjust: (self, grads_finite: 'ArrayLike') -> 'DynamicLossScale'
jaxmp.FLOAT32_OPS: frozenset
jaxmp.Float8Autocast: class(fun: 'Callable[..., Any]', policy: 'policy_lib.Policy', low_precision_ops: 'frozenset[str]', float32_ops: 'frozenset[str]', recipe: 'Any', exclude: 'tuple[re.Pattern[str], ...]', fused_attention: 'bool' = True)
jaxmp.Float8Autocast.fp8_init: (self, *args: 'Any', **kwargs: 'Any') -> 'fp8.Float8State'
jaxmp.Float8Autocast.fp8_matmuls: (self, *args: 'Any', **kwargs: 'Any') -> 'tuple[Float8Matmul, ...]'
jaxmp.Float8Autocast.with_fp8_state: (self, state: 'fp8.Float8State') -> 'Callable[..., Any]'
jaxmp.Float8BlockScaling: class(tile_size: 'int' = 128, weight_block_size: 'int' = 128, fwd_dtype: 'Any' = dtype(float8_e4m3fn), bwd_dtype: 'Any' = dtype(float8_e5m2), min_size: 'int' = 0) -> None
jaxmp.Float8CurrentScaling: class(fwd_dtype: 'Any' = dtype(float8_e4m3fn), bwd_dtype: 'Any' = dtype(float8_e5m2), min_size: 'int' = 0) -> None
jaxmp.Float8Matmul: class(name: 'str', primitive: 'str', fp8: 'bool', reason: 'str')
jaxmp.Float8Rowwise: class() -> None
jaxmp.Float8State: class(amax_history: 'dict[str, jax.Array]', scale: 'dict[str, jax.Array]', names: 'tuple[tuple[str, str], ...]' = ()) -> None
jaxmp.Inspect: class(fun: 'Callable[..., Any]', policy: 'policy_lib.Policy | None', formats: 'tuple[str, ...]', every: 'int' = 1, modules: 're.Pattern[str] | None' = None)
jaxmp.Int4WeightOnly: class(group_size: 'int' = 128) -> None
jaxmp.Int8DynamicActivations: class() -> None
jaxmp.Int8WeightOnly: class() -> None
jaxmp.KVCache: class(keys: 'jax.Array', values: 'jax.Array', key_scales: 'jax.Array | None', value_scales: 'jax.Array | None', format: 'str | None', dtype: 'Any', block_size: 'int') -> None
jaxmp.KVCache.attend: (self, query: 'jax.Array', pos: 'jax.typing.ArrayLike', *, scale: 'float | None' = None) -> 'jax.Array'
jaxmp.KVCache.create: (cls, shape: 'Sequence[int]', format: 'str | None', *, dtype: 'jax.typing.DTypeLike' = 'bfloat16', block_size: 'int | None' = None, sharding: 'jax.sharding.Sharding | None' = None) -> 'KVCache'
jaxmp.KVCache.nbytes: property
jaxmp.KVCache.read: (self) -> 'tuple[jax.Array, jax.Array]'
jaxmp.KVCache.shape: property
jaxmp.KVCache.update: (self, keys: 'jax.Array', values: 'jax.Array', pos: 'jax.typing.ArrayLike') -> 'KVCache'
jaxmp.KahanSummationState: class(compensation: 'Any', inner_state: 'Any')
jaxmp.LOW_PRECISION_OPS: frozenset
jaxmp.LossScale: class()
jaxmp.LossScale.adjust: (self, grads_finite: 'ArrayLike') -> 'LossScale'
jaxmp.LossScale.scale: (self, tree: 'T') -> 'T'
jaxmp.LossScale.unscale: (self, tree: 'T') -> 'T'
jaxmp.LossScaleSuggestion: class(loss_scale: 'float', underflow: 'float', current_underflow: 'float', max_abs: 'float', margin: 'float', format: 'str', rows: 'int', nonfinite: 'int' = 0, reference_nonfinite: 'int' = 0)
jaxmp.LossScalingState: class(inner_state: 'Any', loss_scale: 'loss_scale_lib.LossScale', grads_finite: 'jax.Array', skipped_steps: 'jax.Array', consecutive_skipped_steps: 'jax.Array')
jaxmp.MXFP8BlockScaling: class(block_size: 'int' = 32, fwd_dtype: 'Any' = dtype(float8_e4m3fn), bwd_dtype: 'Any' = dtype(float8_e5m2), min_size: 'int' = 0) -> None
jaxmp.MasterWeightsState: class(master: 'Any', inner_state: 'Any', saturated_steps: 'jax.Array')
jaxmp.NoOpLossScale: class() -> None
jaxmp.NoOpLossScale.adjust: (self, grads_finite: 'ArrayLike') -> 'NoOpLossScale'
jaxmp.NoOpLossScale.loss_scale: property
jaxmp.NoOpLossScale.scale: (self, tree: 'T') -> 'T'
jaxmp.NoOpLossScale.unscale: (self, tree: 'T') -> 'T'
jaxmp.OpStats: class(index: 'int', primitive: 'str', module: 'str', phase: 'str', file: 'str', line: 'int', function: 'str', shape: 'tuple[int, ...]', dtype: 'str', output: 'int', loops: 'tuple[str, ...]', calls: 'int', max_abs: 'float', min_abs: 'float | None', nan: 'int', inf: 'int', nonzero: 'int', flush: 'dict[str, float]', overflow: 'dict[str, float]', underflow: 'float | None', rel_error: 'float | None', ref_max_abs: 'float', created_nonfinite: 'bool', histogram: 'np.ndarray', library: 'str' = '', ref_nonfinite: 'int' = 0) -> None
jaxmp.OpStats.location: property
jaxmp.OpStats.op: property
jaxmp.OpStats.to_dict: (self) -> 'dict[str, Any]'
jaxmp.Policy: class(param_dtype: 'np.dtype', compute_dtype: 'np.dtype' = None, output_dtype: 'np.dtype' = None) -> None
jaxmp.Policy.cast_to_compute: (self, x: 'T') -> 'T'
jaxmp.Policy.cast_to_output: (self, x: 'T') -> 'T'
jaxmp.Policy.cast_to_param: (self, x: 'T') -> 'T'
jaxmp.Policy.is_half: property
jaxmp.Policy.needs_loss_scaling: property
jaxmp.Policy.with_compute_dtype: (self, compute_dtype: 'DTypeLike') -> 'Policy'
jaxmp.Policy.with_output_dtype: (self, output_dtype: 'DTypeLike') -> 'Policy'
jaxmp.Policy.with_param_dtype: (self, param_dtype: 'DTypeLike') -> 'Policy'
jaxmp.QuantizationAware: class(fun: 'Callable[..., Any]', recipe: 'Any', exclude: 'Any' = ())
jaxmp.QuantizationAware.quantize: (self, params: 'Any', *example_args: 'Any', **example_kwargs: 'Any') -> 'Any'
jaxmp.Quantized: class(fun: 'Callable[..., Any]')
jaxmp.Quantized.jaxpr: (self, *args: 'Any', **kwargs: 'Any') -> 'Any'
jaxmp.QuantizedArray: class(values: 'jax.Array', scales: 'jax.Array', recipe: 'Any', dtype: 'Any', contract: 'tuple[int, ...]', contract_shape: 'tuple[int, ...]', act_scale: 'Any' = None) -> None
jaxmp.QuantizedArray.dequantize: (self, dtype: 'Any' = None) -> 'jax.Array'
jaxmp.QuantizedArray.nbytes: property
jaxmp.QuantizedArray.ndim: property
jaxmp.QuantizedArray.shape: property
jaxmp.QuantizedLeaf: class(path: 'str', quantized: 'bool', reason: 'str')
jaxmp.Report: class(stats: 'Stats', metas: 'tuple[_Meta, ...]', formats: 'tuple[str, ...]', reference: 'bool', source_counts: 'Any' = <factory>, sources: 'tuple[_Origin, ...]' = (), sampling: 'str' = '', constants: 'tuple[tuple[str, int], ...]' = ()) -> None
jaxmp.Report.find: (self, primitive: 'str | None' = None, *, module: 'str | None' = None, phase: 'str | None' = None, line: 'int | None' = None) -> 'list[OpStats]'
jaxmp.Report.first_nonfinite: property
jaxmp.Report.nonfinite_sources: property
jaxmp.Report.plot: (self, path: 'str | os.PathLike[str] | None' = None, **kwargs: 'Any') -> 'Any'
jaxmp.Report.suggest_loss_scale: (self, loss_scale: 'ArrayLike | loss_scale_lib.LossScale' = 1.0, *, margin: 'float' = 2.0, format: 'str' = 'float16') -> 'LossScaleSuggestion'
jaxmp.Report.table: (self, limit: 'int | None' = 40) -> 'str'
jaxmp.Report.to_dict: (self) -> 'dict[str, Any]'
jaxmp.Report.to_json: (self, indent: 'int | None' = None) -> 'str'
jaxmp.Report.worst: (self, limit: 'int | None' = 20) -> 'list[OpStats]'
jaxmp.StaticLossScale: class(loss_scale: 'ArrayLike') -> None
jaxmp.StaticLossScale.adjust: (self, grads_finite: 'ArrayLike') -> 'StaticLossScale'
jaxmp.StochasticRoundingState: class(key: 'jax.Array', inner_state: 'Any')
jaxmp.all_finite: (tree: 'Any') -> 'jax.Array'
jaxmp.autocast: (fun: 'Callable[..., Any]', policy: 'policy_lib.Policy | str', *, low_precision_ops: 'Iterable[str | compat.Primitive] | None' = None, float32_ops: 'Iterable[str | compat.Primitive] | None' = None, fp8: 'Any' = None, fp8_exclude: 'str | Iterable[str] | None' = None, fused_attention: 'bool' = True) -> 'Autocast'
jaxmp.autocast_jaxpr: (fun: 'Callable[..., Any]', policy: 'policy_lib.Policy | str', **kwargs: 'Any') -> 'Callable[..., compat.ClosedJaxpr]'
jaxmp.calibrate: (fun: 'Callable[..., Any]', qparams: 'Any', batches: 'Iterable[Any]') -> 'Any'
jaxmp.cast_to_full: (tree: 'T') -> 'T'
jaxmp.cast_to_half: (tree: 'T') -> 'T'
jaxmp.cast_tree: (tree: 'T', dtype: 'DTypeLike') -> 'T'
jaxmp.compress_state: (inner: 'optax.GradientTransformation', first_moment: 'str' = 'bfloat16', second_moment: 'str | None' = None, *, block_size: 'int' = 256, moment_fields: 'Mapping[type, Mapping[str, str]] | None' = None, param_specs: 'Any' = None, seed: 'int' = 0) -> 'optax.GradientTransformationExtraArgs'
jaxmp.default_loss_scale: (policy: 'policy_lib.Policy | str') -> 'loss_scale_lib.LossScale'
jaxmp.dot_product_attention: (query: 'jax.typing.ArrayLike', key: 'jax.typing.ArrayLike', value: 'jax.typing.ArrayLike', bias: 'jax.typing.ArrayLike | None' = None, mask: 'jax.typing.ArrayLike | None' = None, *, scale: 'float | None' = None, is_causal: 'bool' = False, query_seq_lengths: 'jax.typing.ArrayLike | None' = None, key_value_seq_lengths: 'jax.typing.ArrayLike | None' = None, local_window_size: 'int | tuple[int, int] | None' = None, implementation: 'str | None' = None) -> 'jax.Array'
jaxmp.dtype_to_names: _DtypeNames
jaxmp.filter_value_and_grad: (fun: 'Callable[..., Any]', *, has_aux: 'bool' = False) -> 'Callable[..., tuple[Any, Any]]'
jaxmp.float32_region: (fun: 'Callable[..., Any] | None' = None) -> 'Any'
jaxmp.get_loss_scale: (opt_state: 'Any') -> 'loss_scale_lib.LossScale'
jaxmp.get_policy: (policy_name: 'str | Policy') -> 'Policy'
jaxmp.half_dtype: () -> 'Any'
jaxmp.inner_state: (opt_state: 'Any') -> 'Any'
jaxmp.inspect: (fun: 'Callable[..., Any]', policy: 'policy_lib.Policy | str | None' = None, *, formats: 'Sequence[str]' = ('float16', 'bfloat16', 'float8_e4m3fn', 'float8_e5m2'), every: 'int' = 1, modules: 'str | re.Pattern[str] | None' = None) -> 'Inspect'
jaxmp.kahan_summation: (inner: 'optax.GradientTransformation', dtype: 'DTypeLike | None' = None) -> 'optax.GradientTransformationExtraArgs'
jaxmp.loss_scale_metrics: (opt_state: 'Any') -> 'dict[str, jax.Array]'
jaxmp.loss_scaling: (inner: 'optax.GradientTransformation', loss_scale: 'loss_scale_lib.LossScale | None' = None, *, axis_name: 'Any' = None, check_outputs: 'bool' = False) -> 'optax.GradientTransformationExtraArgs'
jaxmp.master_weights: (inner: 'optax.GradientTransformation', dtype: 'DTypeLike' = <class 'jax.numpy.float32'>, *, count_saturated: 'bool' = False) -> 'optax.GradientTransformationExtraArgs'
jaxmp.mixed_precision: (inner: 'optax.GradientTransformation', policy: 'policy_lib.Policy | str', loss_scale: 'loss_scale_lib.LossScale | None' = None, *, axis_name: 'Any' = None, master_weights: 'bool | None' = None, rounding: 'str' = 'nearest', moments: 'str | tuple[str, str]' = 'float32', moment_fields: 'Mapping[type, Mapping[str, str]] | None' = None, param_specs: 'Any' = None, check_outputs: 'bool' = False, seed: 'int' = 0) -> 'optax.GradientTransformationExtraArgs'
jaxmp.plot_loss_scale: (metrics: 'Sequence[Mapping[str, Any]] | Mapping[str, Any]', path: 'str | os.PathLike[str] | None' = None, *, loss: 'ArrayLike | Sequence[float] | None' = None, steps: 'ArrayLike | Sequence[int] | None' = None, title: 'str | None' = None) -> 'Any'
jaxmp.pmean_in_float32: (tree: 'T', axis_name: 'Any') -> 'T'
jaxmp.psum_in_float32: (tree: 'T', axis_name: 'Any') -> 'T'
jaxmp.quantization_aware: (fun: 'Callable[..., Any]', *, recipe: 'Any', exclude: 'Any' = ()) -> 'QuantizationAware'
jaxmp.quantization_plan: (fun: 'Callable[..., Any]', params: 'Any', *example_args: 'Any', recipe: 'Any', exclude: 'Any' = (), **example_kwargs: 'Any') -> 'tuple[QuantizedLeaf, ...]'
jaxmp.quantize: (fun: 'Callable[..., Any]', params: 'Any', *example_args: 'Any', recipe: 'Any', exclude: 'Any' = (), **example_kwargs: 'Any') -> 'Any'
jaxmp.quantized: (fun: 'Callable[..., Any]') -> 'Quantized'
jaxmp.schedule_free_eval_params: (opt_state: 'Any', params: 'Any') -> 'Any'
jaxmp.select_tree: (pred: 'jax.typing.ArrayLike', a: 'T', b: 'T') -> 'T'
jaxmp.state_shardings: (tx: 'optax.GradientTransformation', params: 'Any', shardings: 'Any' = None) -> 'Any'
jaxmp.stochastic_round: (x: 'ArrayLike', dtype: 'DTypeLike', key: 'jax.Array') -> 'jax.Array'
jaxmp.stochastic_rounding: (inner: 'optax.GradientTransformation', *, seed: 'int' = 0, param_specs: 'Any' = None) -> 'optax.GradientTransformationExtraArgs'
jaxmp.value_and_grad: (fun: 'Callable[..., Any]', argnums: 'int | Sequence[int]' = 0, has_aux: 'bool' = False) -> 'Callable[..., tuple[Any, Any]]'
jaxmp.linen.FP8_STATE_KEY: str
jaxmp.linen.Float8Apply: class(autocast: 'Float8Autocast')
jaxmp.linen.Float8Apply.init: (self, variables: 'Mapping[str, Any]', *args: 'Any', **kwargs: 'Any') -> 'dict[str, Any]'
jaxmp.linen.TrainState: class(step, apply_fn, params, tx, opt_state, policy: 'policy_lib.Policy') -> None
jaxmp.linen.TrainState.apply_gradients: (self, *, grads: 'Any', **kwargs: 'Any') -> 'TrainState'
jaxmp.linen.TrainState.create: (cls, *, apply_fn: 'Callable[..., Any]', params: 'Any', tx: 'optax.GradientTransformation', policy: 'policy_lib.Policy | str', **kwargs: 'Any') -> 'TrainState'
jaxmp.linen.TrainState.loss_scale: property
jaxmp.linen.TrainState.metrics: (self) -> 'dict[str, jax.Array]'
jaxmp.linen.TrainState.replace: (self, **updates)
jaxmp.linen.fp8_apply: (apply_fn: 'Callable[..., Any] | nn.Module', policy: 'policy_lib.Policy | str', recipe: 'Any', *, exclude: 'str | Sequence[str] | None' = None) -> 'Float8Apply'
jaxmp.linen.policy_scope: (policy: 'policy_lib.Policy | str', overrides: 'Mapping[type | str, policy_lib.Policy | str] | None' = None) -> 'Iterator[policy_lib.Policy]'
jaxmp.nnx.Float8: class(model: 'Any', policy: 'policy_lib.Policy | str', recipe: 'Any', *example_args: 'Any', exclude: 'str | Sequence[str] | None' = None, **example_kwargs: 'Any')
jaxmp.nnx.Float8StateVariable: class(*args, **kwargs)
jaxmp.nnx.Optimizer: class(*args: 'Any', **kwargs: 'Any') -> 'Any'
jaxmp.nnx.Optimizer.loss_scale: property
jaxmp.nnx.Optimizer.metrics: (self) -> 'dict[str, jax.Array]'
jaxmp.nnx.Optimizer.update: (self, model: 'Any', grads: 'Any', /, **kwargs: 'Any') -> 'Any'
jaxmp.nnx.set_policy: (model: 'M', policy: 'policy_lib.Policy | str', overrides: 'Mapping[type | str, policy_lib.Policy | str] | None' = None) -> 'M'
jaxmp.nnx.value_and_grad: (fun: 'Callable[..., Any]', argnums: 'int | Sequence[int]' = 0, has_aux: 'bool' = False) -> 'Callable[..., tuple[Any, Any]]'
train.COLUMNS: tuple
train.COMPARE_ORDER: tuple
train.COMPARE_OUTPUTS: tuple
train.DEFAULT_CONFIG: str
train.MetricsWriter: class(workdir: 'pathlib.Path', history: 'list[dict[str, Any]]')
train.MetricsWriter.close: (self) -> 'None'
train.MetricsWriter.flush: (self) -> 'None'
train.MetricsWriter.write: (self, record: 'dict[str, Any]') -> 'None'
train.Programs: class(model: 'model_lib.TransformerLM', tx: 'optax.GradientTransformationExtraArgs', init: 'Any', train_step: 'Any', eval_step: 'Any', qat_train_step: 'Any' = None)
train.REPO_ROOT: Path
train.RUN_OUTPUTS: tuple
train.RunDirError: exception(ValueError)
train.RunResult: class(config: 'config_lib.Config', workdir: 'pathlib.Path', state: 'TrainState', history: 'list[dict[str, Any]]', final_val_loss: 'float', unigram_loss: 'float', peak_memory_bytes: 'int | None', sample: 'str') -> None
train.RunResult.bytes_per_param: property
train.RunResult.final_loss_scale: property
train.RunResult.median_step_time: property
train.RunResult.skipped_steps: property
train.STYLES: tuple
train.TrainState: class(step: 'jax.Array', params: 'Any', opt_state: 'Any', fp8_state: 'Any' = None)
train.check_mesh: (spec: 'str') -> 'None'
train.check_workdir: (workdir: 'pathlib.Path', *, resume: 'bool', overwrite: 'bool') -> 'list[int]'
train.checkpoint_steps: (workdir: 'pathlib.Path') -> 'list[int]'
train.compare: (configs: 'Sequence[config_lib.Config]', workdir: 'str | pathlib.Path', *, resume: 'bool' = False, overwrite: 'bool' = False, progress: 'bool' = True) -> 'tuple[list[RunResult], str]'
train.comparison_figure: (results: 'Sequence[RunResult]')
train.create_train_state: (config: 'config_lib.Config', rng: 'jax.Array', *, vocab_size: 'int | None' = None) -> 'TrainState'
train.evaluate: (eval_step, params: 'Any', batches: 'Sequence[tuple[np.ndarray, np.ndarray]]', fp8_state: 'Any' = None) -> 'float'
train.generate: (model: 'model_lib.TransformerLM', params: 'Any', dataset: 'data_lib.Dataset', prompt: 'str' = 'The ', length: 'int' = 80, seed: 'int' = 0, temperature: 'float' = 0.8) -> 'str'
train.get_dataset: (val_fraction: 'float') -> 'data_lib.Dataset'
train.gradient_underflow: (config: 'config_lib.Config', params: 'Any', batch: 'tuple[np.ndarray, np.ndarray]', loss_scale: 'float' = 1.0, *, vocab_size: 'int') -> 'float'
train.init_params: (model: 'model_lib.TransformerLM', rng: 'jax.Array') -> 'Any'
train.learning_rate_schedule: (config: 'config_lib.Config') -> 'optax.Schedule'
train.load_configs: (names: 'Sequence[str]', workdir: 'str | pathlib.Path', overrides: 'Sequence[str]' = (), *, resume: 'bool' = False) -> 'list[config_lib.Config]'
train.load_history: (workdir: 'pathlib.Path', upto: 'int') -> 'list[dict[str, Any]]'
train.load_inspections: (workdir: 'pathlib.Path', upto: 'int') -> 'list[dict[str, Any]]'
train.logit_gradient_underflow: (config: 'config_lib.Config', params: 'Any', batch: 'tuple[np.ndarray, np.ndarray]', loss_scale: 'float' = 1.0, *, vocab_size: 'int') -> 'float'
train.main: (argv: 'Sequence[str] | None' = None) -> 'None'
train.make_eval_step: (model: 'model_lib.TransformerLM', fp8: 'Any' = None, qat: 'Any' = None)
train.make_fp8_apply: (config: 'config_lib.Config', model: 'model_lib.TransformerLM')
train.make_init: (config: 'config_lib.Config', model: 'model_lib.TransformerLM', tx)
train.make_inspected_grad: (config: 'config_lib.Config', model: 'model_lib.TransformerLM')
train.make_loss_fn: (model: 'model_lib.TransformerLM', fp8: 'Any' = None, qat: 'Any' = None)
train.make_model: (config: 'config_lib.Config', vocab_size: 'int') -> 'model_lib.TransformerLM'
train.make_optimizer: (config: 'config_lib.Config') -> 'optax.GradientTransformationExtraArgs'
train.make_parser: () -> '_Parser'
train.make_qat_apply: (config: 'config_lib.Config', model: 'model_lib.TransformerLM')
train.make_train_step: (config: 'config_lib.Config', model: 'model_lib.TransformerLM', tx, quantization_aware: 'bool | None' = None)
train.parse_inspect_steps: (text: 'str', steps: 'int') -> 'tuple[int, ...]'
train.plot_comparison: (results: 'Sequence[RunResult]', path: 'pathlib.Path') -> 'None'
train.plot_run: (result: 'RunResult', path: 'pathlib.Path') -> 'None'
train.programs: (config: 'config_lib.Config', vocab_size: 'int') -> 'Programs'
train.remove_run_outputs: (workdir: 'pathlib.Path', names: 'Sequence[str]' = ('config.yaml', 'metrics.jsonl', 'metrics.csv', 'losses.png', 'checkpoints', 'inspect.json', 'inspect.png')) -> 'None'
train.restore_checkpoint: (workdir: 'pathlib.Path', steps: 'Sequence[int]', state: 'Any') -> 'TrainState'
train.run_figure: (result: 'RunResult')
train.show_path: (path: 'str | pathlib.Path') -> 'str'
train.signed_percent: (fraction: 'float') -> 'str'
train.stop_after_step_on_sigint: ()
train.summarize: (results: 'Sequence[RunResult]') -> 'str'
train.train_and_evaluate: (config: 'config_lib.Config', workdir: 'str | pathlib.Path', *, resume: 'bool' = False, overwrite: 'bool' = False, progress: 'bool' = True, verbose: 'bool' = True, stop_at: 'int | None' = None, sample_length: 'int' = 80, figure: 'bool' = True, inspect_steps: 'Sequence[int]' = ()) -> 'RunResult'
train.with_precision: (config: 'config_lib.Config', precision: 'str') -> 'config_lib.Config'
train.write_inspection: (workdir: 'pathlib.Path', config: 'config_lib.Config', step: 'int', loss_scale: 'float', report: 'jaxmp.Report', entries: 'list[dict[str, Any]]') -> 'dict[str, Any]'
"""  # noqa: E501


def test_public_api_is_unchanged():
    expected = EXPECTED_API.strip().splitlines()
    actual = public_api()
    diff = "\n".join(
        difflib.unified_diff(expected, actual, "EXPECTED_API", "the code", lineterm="")
    )
    assert actual == expected, (
        "the public API changed; if on purpose, update EXPECTED_API in tests/test_structure.py "
        "(and the CHANGELOG):\n" + diff
    )


# --- Documentation ---------------------------------------------------------------------------


def doc_pages() -> list[pathlib.Path]:
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", EXAMPLES / "README.md", *docs]


# A path: folders and a file name with an extension (or a glob), not inside a URL or another path.
_PATH = re.compile(r"(?<![\w./:-])((?:[\w-]+/)+[\w*.-]*\.[\w*]+)(?![\w/])")


def mentioned_paths(page: pathlib.Path) -> list[tuple[int, str, list[pathlib.Path]]]:
    """``(line, path, where it may be)`` for each path `page` names under a source folder (from
    the repository root) or under a folder next to `page` (``lm/model.py`` in examples/)."""
    found = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        for match in _PATH.finditer(line):
            text = match[1].rstrip(".")
            first = text.split("/")[0]
            bases = [ROOT] if first in SOURCE_FOLDERS else []
            if page.parent != ROOT and (page.parent / first).is_dir():
                bases.append(page.parent)
            if bases:
                found.append((number, text, bases))
    return found


def test_path_pattern_finds_source_paths_only(tmp_path):
    (tmp_path / "lm").mkdir()
    page = tmp_path / "README.md"
    page.write_text(
        "`jaxmp/_src/gone.py`, examples/lm/loop.py: and lm/model.py.\n"
        "https://github.com/google/jax/blob/main/jax/_src/core.py runs/compare/summary.md "
        "../docs/guides/fp8.md `jaxmp._src.autocast` configs/bf16_*.yaml\n"
    )
    found = [(line, text) for line, text, _ in mentioned_paths(page)]
    assert found == [
        (1, "jaxmp/_src/gone.py"),
        (1, "examples/lm/loop.py"),
        (1, "lm/model.py"),
        (2, "configs/bf16_*.yaml"),
    ]


def test_documented_paths_exist():
    missing = []
    count = 0
    for page in doc_pages():
        for line, text, bases in mentioned_paths(page):
            count += 1
            if not any(
                list(base.glob(text)) if "*" in text else (base / text).exists() for base in bases
            ):
                missing.append(f"{page.relative_to(ROOT)}:{line}: {text}")
    assert count > 50, count  # the pattern finds the paths at all
    assert not missing, "paths named in the documentation that do not exist:\n" + "\n".join(missing)


if __name__ == "__main__":
    print(*public_api(), sep="\n")
