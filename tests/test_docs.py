"""Every Python code block of README.md and docs/**/*.md runs as written.

A page's ```python blocks run in order in one fresh namespace, as a reader pastes them one
after the other; the blocks assert what the page claims (the loss falls, a dtype, a skipped
step counted). Three HTML comments change how a page or a block runs:

* ``<!-- excerpt: path/to/file.py -->`` right before a block: the block is an excerpt of that
  file, which must exist and contain every line of the block that is not blank, a comment or
  ``...`` (a trailing comment is the page's own); it is not run (the file's own test runs it).
* ``<!-- docs-test: devices=8 -->`` anywhere in a page: the page runs in a process of its own
  with that many simulated CPU devices (``python -m tests.test_docs PAGE``).
* ``<!-- docs-test: shows EXPR -->`` right before a ``<div class="jaxmp-display">`` block: a
  rendered example (what a notebook shows); once the page has run, ``EXPR`` evaluated in its
  namespace (``report._repr_html_(figure=False)``) must give that block exactly.

Fenced blocks in other languages (bash, text) are not run; every fence must name one of the
languages in `LANGUAGES`, so that no Python block goes unnoticed.
"""

from __future__ import annotations

import ast
import inspect
import os
import pathlib
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LANGUAGES = {"python", "bash", "text", "toml", "{eval-rst}", "{toctree}"}

_FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>\S*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ ]*$",
                    re.M | re.S)  # fmt: skip
_EXCERPT = re.compile(r"<!--\s*excerpt:\s*(?P<path>\S+)\s*-->\s*$")
_DEVICES = re.compile(r"<!--\s*docs-test:\s*devices=(?P<n>\d+)\s*-->")
_SHOWS = re.compile(r"<!--\s*docs-test:\s*shows\b")
_SHOWN = re.compile(
    r"<!--\s*docs-test:\s*shows\s+(?P<expr>[^\n]+?)\s*-->[ ]*\n"
    r"(?P<html><div class=\"jaxmp-display\">\n.*?\n</div>)$",
    re.M | re.S,
)


@dataclass(frozen=True)
class Block:
    page: pathlib.Path
    line: int  # 1-based line of the block's first code line in the page
    lang: str
    code: str
    excerpt_of: str | None


def pages() -> list[pathlib.Path]:
    docs = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)
    return [ROOT / "README.md", *docs]


def blocks(page: pathlib.Path) -> list[Block]:
    text = page.read_text()
    found = []
    for match in _FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        excerpt = _EXCERPT.search(before)
        indent = len(match["indent"])
        code = "\n".join(line[indent:] for line in match["body"].splitlines())
        line = text.count("\n", 0, match.start("body")) + 1
        path = excerpt["path"] if excerpt else None
        found.append(Block(page, line, match["lang"], code, path))
    return found


def run_page(page: pathlib.Path) -> dict:
    """Runs the page's Python blocks in order in one namespace; returns the namespace."""
    namespace: dict = {"__name__": f"docs:{page.name}"}
    for block in blocks(page):
        if block.lang != "python" or block.excerpt_of:
            continue
        # Pad with newlines so that tracebacks give the line of the page.
        source = "\n" * (block.line - 1) + block.code
        exec(compile(source, str(page), "exec"), namespace)
    return namespace


def check_shown(page: pathlib.Path, namespace: dict) -> None:
    """Each rendered example of the page (``<!-- docs-test: shows EXPR -->``) is what
    ``EXPR`` gives in the namespace the page's blocks ran in."""
    text = page.read_text()
    found = list(_SHOWN.finditer(text))
    assert len(found) == len(_SHOWS.findall(text)), (
        f"{_name(page)}: a `docs-test: shows` comment must be followed, on the next line, by "
        '`<div class="jaxmp-display">` and its lines up to a line `</div>`'
    )
    for match in found:
        line = text.count("\n", 0, match.start()) + 1
        actual = eval(match["expr"], namespace)
        assert actual == match["html"], (
            f"{_name(page)}:{line}: the HTML shown is not what `{match['expr']}` gives now; "
            f"paste it in its place:\n{actual}"
        )


def _name(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name


def _devices(page: pathlib.Path) -> int | None:
    match = _DEVICES.search(page.read_text())
    return int(match["n"]) if match else None


def _runnable(page: pathlib.Path) -> bool:
    return any(b.lang == "python" and not b.excerpt_of for b in blocks(page))


# The pages that take longest to run (each over 6 s on 2 cores: they compile inspected, FP8
# and multi-device programs) run with the tests marked slow; CI runs every page.
SLOW_PAGES = {
    "docs/guides/fp8.md",
    "docs/guides/inspector.md",
    "docs/guides/low_memory.md",
    "docs/guides/sharding.md",
    "docs/guides/troubleshooting.md",
}


def _page_param(page: pathlib.Path) -> object:
    marks = [pytest.mark.slow] if _name(page) in SLOW_PAGES else []
    return pytest.param(page, marks=marks, id=_name(page))


@pytest.mark.parametrize("page", [_page_param(p) for p in pages() if _runnable(p)])
def test_page_runs(page):
    devices = _devices(page)
    if devices is None:
        check_shown(page, run_page(page))
        return
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.test_docs", _name(page)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]


def _all_blocks() -> list[Block]:
    return [block for page in pages() for block in blocks(page)]


@pytest.mark.parametrize(
    "block",
    [b for b in _all_blocks() if b.excerpt_of],
    ids=lambda b: f"{_name(b.page)}:{b.line}",
)
def test_excerpt_matches_its_file(block):
    source = ROOT / block.excerpt_of
    assert source.is_file(), f"{_name(block.page)}:{block.line}: no file {block.excerpt_of}"
    text = {line.strip() for line in source.read_text().splitlines()}
    for line in block.code.splitlines():
        line = line.split("  # ", 1)[0].strip()  # a comment may be added to an excerpt's line
        if line and not line.startswith("#") and line != "...":
            assert line in text, f"{_name(block.page)}:{block.line}: {line!r} not in {source}"


def test_every_fence_names_a_known_language():
    unknown = [
        f"{_name(b.page)}:{b.line}: {b.lang!r}" for b in _all_blocks() if b.lang not in LANGUAGES
    ]
    assert not unknown, f"fences must name one of {sorted(LANGUAGES)}: {unknown}"


def test_excerpts_are_rare():
    python = [b for b in _all_blocks() if b.lang == "python"]
    excerpts = [b for b in python if b.excerpt_of]
    where = [f"{_name(b.page)}:{b.line}" for b in excerpts]
    assert len(excerpts) <= max(3, len(python) // 10), f"too many excerpts: {where}"


def test_every_public_name_has_an_api_entry():
    import jaxmp
    import jaxmp.linen
    import jaxmp.nnx

    api = "\n".join(p.read_text() for p in (DOCS / "api").glob("*.md"))
    documented = set(re.findall(r"^\.\. auto\w+:: (\S+)", api, flags=re.M))
    public = {f"jaxmp.{name}" for name in jaxmp.__all__}
    public |= {f"jaxmp.linen.{name}" for name in jaxmp.linen.__all__}
    public |= {f"jaxmp.nnx.{name}" for name in jaxmp.nnx.__all__}
    missing = sorted(public - documented)
    assert not missing, f"add an autodoc entry (`.. autofunction:: NAME`) to docs/api/: {missing}"
    stale = sorted(documented - public - {"jaxmp", "jaxmp.linen", "jaxmp.nnx"})
    assert not stale, f"docs/api/ documents names that are not public: {stale}"


# The "At a glance" table of docs/api/index.md: a call written there, ``name(a, b=1, *, c)``,
# lists the parameters of the real signature in order (defaults are not compared), or a
# prefix of them ended by ``...``; a name written without parentheses is not checked.
_GLANCE_CALL = re.compile(r"`(?P<name>(?:jaxmp\.(?:linen|nnx)\.)?\w+)\((?P<args>[^`]*)\)`")


def _glance_table() -> str:
    """The first column (the names) of the table's rows, one row a line."""
    text = (DOCS / "api" / "index.md").read_text()
    rows = [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| `")]
    return "\n".join(rows)


def _split_args(args: str) -> list[str]:
    """The top-level comma-separated parts of `args`, each without its default."""
    parts, depth, current = [], 0, ""
    for char in args:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [part.split("=", 1)[0].strip() for part in parts if part.strip()]


def _signature_parts(obj) -> list[str]:
    parts, star = [], False
    for param in inspect.signature(obj).parameters.values():
        if param.kind is param.VAR_POSITIONAL:
            parts.append(f"*{param.name}")
            star = True
        elif param.kind is param.VAR_KEYWORD:
            parts.append(f"**{param.name}")
        else:
            if param.kind is param.KEYWORD_ONLY and not star:
                parts.append("*")
                star = True
            parts.append(param.name)
    return parts


def _resolve(name: str):
    import jaxmp
    import jaxmp.linen
    import jaxmp.nnx

    module, _, attr = name.rpartition(".")
    return getattr({"": jaxmp, "jaxmp.linen": jaxmp.linen, "jaxmp.nnx": jaxmp.nnx}[module], attr)


def test_api_glance_signatures_match_the_code():
    calls = list(_GLANCE_CALL.finditer(_glance_table()))
    assert len(calls) >= 25, calls
    wrong = []
    for call in calls:
        written = _split_args(call["args"])
        actual = _signature_parts(_resolve(call["name"]))
        if written and written[-1] == "...":
            ok = written[:-1] == actual[: len(written) - 1] and len(actual) >= len(written)
        else:
            ok = written == actual
        if not ok:
            wrong.append(f"{call.group(0)}: the code has ({', '.join(actual)})")
    assert not wrong, "docs/api/index.md, At a glance:\n" + "\n".join(wrong)


def test_api_glance_names_every_public_function_and_recipe():
    """Every public function, and every class a user constructs, has a row."""
    import jaxmp
    import jaxmp.linen
    import jaxmp.nnx

    table = _glance_table()
    named = set(re.findall(r"`((?:jaxmp\.(?:linen|nnx)\.)?\w+)", table))
    expected = {name for name in jaxmp.__all__ if inspect.isfunction(getattr(jaxmp, name))}
    expected |= {
        f"jaxmp.{module.__name__.split('.')[-1]}.{name}"
        for module in (jaxmp.linen, jaxmp.nnx)
        for name in module.__all__
        if inspect.isfunction(getattr(module, name))
    }
    expected |= {
        "Policy",
        "NoOpLossScale",
        "StaticLossScale",
        "DynamicLossScale",
        "Float8CurrentScaling",
        "DelayedScaling",
        "Float8BlockScaling",
        "MXFP8BlockScaling",
        "Report",
        "jaxmp.linen.TrainState",
        "jaxmp.nnx.Optimizer",
        "jaxmp.nnx.Float8",
    }
    missing = sorted(expected - named)
    assert not missing, f"add a row to the At a glance table of docs/api/index.md: {missing}"


def test_a_rendered_example_is_checked(tmp_path):
    block = (
        "```python\n"
        "class Shown:\n"
        "    def _repr_html_(self):\n"
        "        return '<div class=\"jaxmp-display\">\\n<p>now</p>\\n</div>'\n"
        "shown = Shown()\n"
        "```\n\n"
        "<!-- docs-test: shows shown._repr_html_() -->\n"
    )
    page = tmp_path / "page.md"
    page.write_text(block + '<div class="jaxmp-display">\n<p>now</p>\n</div>\n')
    check_shown(page, run_page(page))
    page.write_text(block + '<div class="jaxmp-display">\n<p>before</p>\n</div>\n')
    with pytest.raises(AssertionError, match=r"page.md:8: the HTML shown is not what"):
        check_shown(page, run_page(page))
    page.write_text(block + "\n<p>now</p>\n")
    with pytest.raises(AssertionError, match=r"must be followed, on the next line"):
        check_shown(page, run_page(page))


def test_links_to_local_files_resolve():
    for page in pages():
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#", 1)[0]).resolve()
            assert path.exists(), f"{_name(page)}: link to missing {target}"


def test_examples_readme_lists_every_example():
    # The file table at the top of examples/README.md: a row names each example.
    text = (ROOT / "examples" / "README.md").read_text()
    table = text.split("| file | what it shows |", 1)[1].split("\n\n", 1)[0]
    named = {name for row in table.splitlines() for name in re.findall(r"`([^`]+)`", row[:60])}
    files = {p.name for p in (ROOT / "examples").glob("*.py")}
    assert sorted(files - named) == [], "add a row to the file table of examples/README.md"


def _docstrings():
    """(file:line, docstring) of every module, class and function of the package."""
    for path in sorted((ROOT / "jaxmp").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node, clean=True)
                if doc:
                    line = getattr(node, "lineno", 1)
                    yield f"{path.relative_to(ROOT)}:{line}", doc


def test_an_args_or_attributes_entry_names_one_thing():
    # The docs site's Google-style parser reads ``shape, dtype: ...`` as an entry ``dtype``
    # of type ``shape`` (and links ``shape`` to whatever else is called so).
    entry = re.compile(r"\s*\w+(?:, \w+)+: ")
    found = []
    for where, doc in _docstrings():
        section = None
        for line in doc.splitlines():
            if re.fullmatch(r"(Args|Arguments|Attributes|Keyword Args|Parameters):", line.strip()):
                section = len(line) - len(line.lstrip())
                continue
            if line.strip() and section is not None and len(line) - len(line.lstrip()) <= section:
                section = None
            if section is not None and entry.match(line):
                found.append(f"{where}: {line.strip()}")
    assert not found, "one name per entry:\n" + "\n".join(found)


if __name__ == "__main__":
    # `python -m tests.test_docs PAGE`: run one page here (test_page_runs uses it for pages
    # that need simulated devices, which must be set up before jax is imported).
    check_shown(ROOT / sys.argv[1], run_page(ROOT / sys.argv[1]))
