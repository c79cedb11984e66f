"""How jaxmp's objects show themselves in a notebook (`jaxmp._src.display`): the quantization
plan, the FP8 matmul listing, `Policy`, the loss-scaling state and the inspector's `Report`.

Each display is an HTML table (`_repr_html_`, what Jupyter shows) with a plain-text form kept
(`repr` unchanged, `str` and IPython's plain-text display a table); user-provided names are
escaped; a large program's display stays bounded (the first or worst rows, with a note of how
many more)."""

import base64
import html.parser
import re

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxmp
from jaxmp._src import display


class _Cells(html.parser.HTMLParser):
    """The HTML's tables as lists of rows of cell texts, and its tags (to check well-formedness
    and find images)."""

    def __init__(self, text):
        super().__init__()
        self.tables, self.tags, self.images, self._cell = [], [], [], None
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = ""
        elif tag == "img":
            self.images.append(dict(attrs))

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.tables[-1][-1].append(self._cell)
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


def _mlp(p, x):
    return jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]


def _params():
    return {"b": jnp.zeros(4), "v": jnp.ones((4, 2)), "w": jnp.ones((8, 4))}


# --- The quantization plan ---------------------------------------------------------------------


def test_quantization_plan_shows_a_table_of_its_leaves():
    plan = jaxmp.quantization_plan(_mlp, _params(), jnp.ones((1, 8)), recipe="int8")
    parsed = _Cells(plan._repr_html_())
    (table,) = parsed.tables
    assert table[0] == ["leaf", "quantised", "why"]
    assert table[1:] == [
        [
            "b",
            "no",
            "not a matmul weight: added to another value (as a bias is; after broadcast_in_dim)",
        ],
        ["v", "yes", "matmul weight, contracted over axes (0,)"],
        ["w", "yes", "matmul weight, contracted over axes (0,)"],
    ]
    assert "2 of 3 floating leaves quantised" in plan._repr_html_()
    # Still the tuple it was: equal to one, its repr unchanged, a pytree like one.
    assert plan == tuple(plan) and repr(plan) == repr(tuple(plan))
    assert jax.tree.leaves(plan) == jax.tree.leaves(tuple(plan))
    assert jax.tree.map(lambda x: x, plan) == plan
    # Plain text: a table too.
    assert str(plan).splitlines()[0] == "jaxmp.quantization_plan: 2 of 3 floating leaves quantised"
    assert re.search(r"^b +no +not a matmul weight", str(plan), re.M)


def test_quantization_plan_escapes_the_paths():
    params = {"<script>alert(1)</script>": jnp.ones((8, 4)), "v&w": jnp.ones((4, 2))}

    def f(p, x):
        return x @ p["<script>alert(1)</script>"] @ p["v&w"]

    plan = jaxmp.quantization_plan(f, params, jnp.ones((1, 8)), recipe="int8")
    text = plan._repr_html_()
    assert "<script>" not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "v&amp;w" in text
    (table,) = _Cells(text).tables
    assert [row[0] for row in table[1:]] == ["<script>alert(1)</script>", "v&w"]


def test_quantization_plan_of_many_leaves_is_bounded():
    n = 500
    params = {f"layer_{i:03d}": jnp.ones((4, 4)) for i in range(n)}

    def f(p, x):
        for i in range(n):
            x = x @ p[f"layer_{i:03d}"]
        return x

    plan = jaxmp.quantization_plan(f, params, jnp.ones((1, 4)), recipe="int8")
    text = plan._repr_html_()
    (table,) = _Cells(text).tables
    assert len(table) == 1 + display.MAX_ROWS
    assert f"{display.MAX_ROWS} of {n} leaves shown" in text
    assert len(text) < 10_000
    assert len(str(plan).splitlines()) == 2 + n  # str lists every leaf


# --- The FP8 matmul listing --------------------------------------------------------------------


def test_fp8_matmuls_show_a_table():
    def model(w, x):
        with jax.named_scope("<body>"):
            h = jnp.tanh(x @ w)
        with jax.named_scope("head"):
            return h @ w

    f = jaxmp.autocast(
        model, "mixed_bfloat16", fp8=jaxmp.Float8CurrentScaling(), fp8_exclude="head"
    )
    matmuls = f.fp8_matmuls(jnp.ones((4, 4)), jnp.ones((2, 4)))
    text = matmuls._repr_html_()
    (table,) = _Cells(text).tables
    assert table == [
        ["name", "op", "FP8", "why"],
        ["<body>", "dot_general", "yes", "fp8"],
        ["head", "dot_general", "no", "excluded by 'head'"],
    ]
    assert "&lt;body&gt;" in text and "<body>" not in text
    assert "1 of 2 matmuls run in FP8" in text
    assert matmuls == tuple(matmuls) and repr(matmuls) == repr(tuple(matmuls))
    assert str(matmuls).splitlines()[1:] == [
        "name    op           FP8  why",
        "<body>  dot_general  yes  fp8",
        "head    dot_general  no   excluded by 'head'",
    ]


# --- Policy ------------------------------------------------------------------------------------


def test_policy_shows_its_dtypes():
    policy = jaxmp.get_policy("mixed_float16")
    (table,) = _Cells(policy._repr_html_()).tables
    assert table == [
        ["", "params", "compute", "output"],
        ["dtype", "float32", "float16", "float32"],
    ]
    assert "needs loss scaling" in policy._repr_html_()
    assert "no loss scaling" in jaxmp.get_policy("mixed_bfloat16")._repr_html_()
    assert repr(policy) == "Policy('p=f32,c=f16,o=f32')"  # the plain repr kept


# --- The loss-scaling state --------------------------------------------------------------------


def _skipped_state():
    """The state of `mixed_precision` after one finite step and one skipped one."""
    tx = jaxmp.mixed_precision(optax.adam(1e-3), "mixed_float16", jaxmp.DynamicLossScale(2.0**15))
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    _, state = update({"w": jnp.ones(3)}, state, params)
    _, state = update({"w": jnp.array([1.0, jnp.nan, 1.0])}, state, params)
    return state


def test_loss_scaling_state_shows_the_scale_and_the_skipped_steps():
    state = _skipped_state()
    text = state._repr_html_()
    (table,) = _Cells(text).tables
    assert table == [
        ["loss scale", "last step", "skipped steps", "skipped in a row"],
        ["2^14", "skipped (non-finite)", "1", "1"],
    ]
    assert "DynamicLossScale: x2 after 2000 finite steps in a row (0 so far)" in text
    assert "inner state: ScaleByAdamState, EmptyState (3 arrays)" in text
    assert repr(state).startswith("LossScalingState(inner_state=")  # the plain repr kept


def test_loss_scaling_state_of_replicas_and_traced_states():
    state = _skipped_state()
    stacked = jax.tree.map(lambda x: jnp.stack([x, x]), state)
    (table,) = _Cells(stacked._repr_html_()).tables
    assert table[1] == [
        "2^14 (each of 2)",
        "skipped (non-finite) (each of 2)",
        "1 (each of 2)",
        "1 (each of 2)",
    ]
    seen = []
    jax.jit(lambda s: seen.append(s._repr_html_()))(state)
    assert seen == [None]  # no value to show under a trace: Jupyter shows the repr


# --- The inspector's report --------------------------------------------------------------------


def _mlp_loss(params, x):
    h = x
    for i, w in enumerate(params):
        with jax.named_scope(f"layer_{i}"):
            h = jnp.tanh(h @ w)
    return jnp.mean(h**2)


@pytest.fixture(scope="module")
def mlp_report():
    params = [jnp.full((8, 8), 0.3), jnp.full((8, 4), 0.3)]
    inspected = jaxmp.inspect(jax.value_and_grad(_mlp_loss), "mixed_float16")
    _, report = inspected(params, jnp.ones((16, 8)))
    return report


def test_report_shows_its_header_worst_rows_and_figure(mlp_report):
    import matplotlib.pyplot as plt

    report = mlp_report
    open_before = set(plt.get_fignums())  # figures another test in this process left open
    text = report._repr_html_()
    parsed = _Cells(text)
    (table,) = parsed.tables
    header = table[0]
    assert header[:4] == ["#", "module", "op", "pass"] and "rel.err" in header
    worst = report.worst(display.MAX_ROWS)
    assert [int(row[0]) for row in table[1:]] == [r.index for r in worst]
    assert [row[1] for row in table[1:]] == [r.module or "(no module)" for r in worst]
    assert text.startswith('<div class="jaxmp-display">')
    assert f"jaxmp.inspect: {len(report)} ops" in text
    assert "first non-finite value: none (every value is finite)" in text
    suggestion = report.suggest_loss_scale()
    assert f"suggested loss scale: {display.power_of_two(suggestion.loss_scale)} " in text
    # The figure, inline: a PNG that decodes, and no figure left open for the inline backend.
    (image,) = parsed.images
    assert image["src"].startswith("data:image/png;base64,")
    png = base64.b64decode(image["src"].split(",", 1)[1])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert set(plt.get_fignums()) == open_before
    # The plain forms kept: repr, and the text table for str() and IPython's plain text.
    assert repr(report).startswith("<jaxmp.inspect Report:")
    printed = []
    report._repr_pretty_(type("P", (), {"text": lambda self, t: printed.append(t)})(), False)
    assert printed == [report.table()]


def test_report_html_names_the_first_nonfinite_value_and_escapes_modules():
    def attention(q, k):
        with jax.named_scope("<attn>&"):
            scores = jnp.exp(q @ k.T)
        return scores / scores.sum(axis=-1, keepdims=True)

    q = jnp.full((2, 8), 12.0)
    _, report = jaxmp.inspect(attention)(q, q)
    text = report._repr_html_(figure=False)
    assert "first non-finite value: exp (forward) at test_display.py:" in text
    assert "in &lt;attn&gt;&amp; (made by it)" in text and "<attn>" not in text
    assert "no backward pass: no loss scale to suggest" in text
    (table,) = _Cells(text).tables
    assert table[1][1:3] == ["<attn>&", "exp!"]  # made an inf from finite inputs
    assert not _Cells(text).images


def test_report_html_without_matplotlib_says_so(mlp_report, monkeypatch):
    from jaxmp._src.inspector import plot

    def missing():
        raise ImportError("jaxmp.Report.plot needs matplotlib, which jaxmp does not install")

    monkeypatch.setattr(plot, "_pyplot", missing)
    text = mlp_report._repr_html_()
    assert "figure: jaxmp.Report.plot needs matplotlib" in text
    assert not _Cells(text).images and _Cells(text).tables


def test_report_html_of_a_large_program_is_bounded():
    n_modules, per_module = 40, 1

    def many(x):
        for m in range(n_modules):
            with jax.named_scope(f"block_{m}"):
                for _ in range(per_module):
                    x = jnp.sin(x) * 1.5
        return x

    _, report = jaxmp.inspect(many)(jnp.ones((4, 4)))
    assert len(report) == 2 * n_modules * per_module
    text = report._repr_html_()
    (table,) = _Cells(text).tables
    assert len(table) == 1 + display.MAX_ROWS
    assert f"{display.MAX_ROWS} worst of {len(report)} rows shown" in text
    assert len(text) < 400_000  # the figure pools the modules past its 32


def test_abstract_values_show_no_table():
    # Shapes without values (`jax.eval_shape`) have nothing to show: Jupyter shows the repr.
    state = jax.eval_shape(lambda: _skipped_state())
    assert state._repr_html_() is None
    _, report = jax.eval_shape(jaxmp.inspect(jnp.sin), jax.ShapeDtypeStruct((3,), jnp.float32))
    assert report._repr_html_() is None
    printed = []
    report._repr_pretty_(type("P", (), {"text": lambda self, t: printed.append(t)})(), False)
    assert printed == [repr(report)]
