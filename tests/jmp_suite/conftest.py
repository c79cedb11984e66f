"""Expected failures of jmp's own tests under jaxmp: each contradicts a jaxmp guarantee."""

import pytest

# "Class::test id" -> why jaxmp fails it on purpose. Strict: if one starts passing, the run fails.
XFAIL = {
    "LossScaleTest::test_static_empty_trees_StaticLossScale": (
        "jmp builds StaticLossScale(0); jaxmp's loss scale is never 0 (a zero scale zeroes "
        "every gradient and its inverse is inf), so the constructor rejects 0 with a "
        "ValueError naming `loss_scale`"
    ),
}


def pytest_collection_modifyitems(config, items):
    del config
    for item in items:
        if "jmp_suite" not in str(item.path):
            continue
        # jmp's tests compute `np.float32(10) / 3**100` for a bound of their own, which
        # overflows in NumPy's cast with a RuntimeWarning; jmp's test runner shows it, the
        # project's pytest configuration turns warnings into errors.
        item.add_marker(pytest.mark.filterwarnings("ignore:overflow encountered in cast"))
        key = f"{item.parent.name}::{item.name}" if item.parent is not None else item.name
        if key in XFAIL:
            item.add_marker(pytest.mark.xfail(reason=XFAIL[key], strict=True))
