"""jmp's own test suite, run against jaxmp (`import jaxmp as jmp`).

The two test files of jmp 0.0.4 (``jmp/_src/policy_test.py`` and
``jmp/_src/loss_scale_test.py``, Copyright 2020 DeepMind Technologies Limited,
Apache License 2.0) are read from the installed jmp distribution at collection
time; the only change made to them is their import of jmp, which becomes
``import jaxmp as jmp``. Nothing else is edited: the test classes run as jmp
wrote them. The cases that contradict a jaxmp guarantee are marked as strict
expected failures, with the reason, in ``tests/jmp_suite/conftest.py``.
"""

import importlib.util
import pathlib
import sys
import types

import pytest

# (file in jmp/_src, the import line jmp's file has, the module name we run it as)
SUITE = (
    ("policy_test.py", "from jmp._src import policy as jmp"),
    ("loss_scale_test.py", "from jmp._src import loss_scale as jmp"),
)
REPLACEMENT = "import jaxmp as jmp"


def jmp_test_dir() -> pathlib.Path:
    """The directory of the installed jmp's test files (skips when jmp is absent)."""
    pytest.importorskip("absl.testing.parameterized", reason="jmp's tests need absl-py")
    spec = importlib.util.find_spec("jmp")
    if spec is None or spec.origin is None:
        pytest.skip("jmp is not installed (it is in the `test` extra)", allow_module_level=True)
    return pathlib.Path(spec.origin).parent / "_src"


def load_jmp_test_module(filename: str, import_line: str) -> types.ModuleType:
    """Executes one of jmp's test files with its jmp import replaced by jaxmp."""
    path = jmp_test_dir() / filename
    if not path.is_file():
        pytest.skip(f"the installed jmp does not ship {filename}", allow_module_level=True)
    source = path.read_text()
    if source.count(import_line) != 1:
        raise RuntimeError(f"{path} no longer has the line {import_line!r} exactly once")
    name = f"tests.jmp_suite.jmp_{filename[:-3]}"
    module = types.ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module
    code = compile(source.replace(import_line, REPLACEMENT), str(path), "exec")
    exec(code, module.__dict__)  # noqa: S102 (jmp's test file, read from its distribution)
    return module


def _test_classes() -> dict[str, type]:
    classes = {}
    for filename, import_line in SUITE:
        module = load_jmp_test_module(filename, import_line)
        for name, value in vars(module).items():
            if (
                isinstance(value, type)
                and name.endswith("Test")
                and value.__module__ == module.__name__
            ):
                classes[name] = value
    return classes


# PolicyTest and LossScaleTest, collected by pytest as unittest classes of this module.
globals().update(_test_classes())
