"""How jaxmp's objects show themselves in a notebook (`jaxmp._src.display`): the quantization
plan, the FP8 matmul listing, `Policy`, the loss-scaling state and the inspector's `Report`.

Each display is an HTML table (`_repr_html_`, what Jupyter shows) with a plain-text form kept
(`repr` unchanged, `str` and IPython's plain-text display a table); user-provided names are
escaped; a large program's display stays bounded (the first or worst rows, with a note of how
many more)."""

import html.parser
import re

import jax
import jax.numpy as jnp

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
        ["b", "no", "not a matmul weight (used by broadcast_in_dim)"],
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
