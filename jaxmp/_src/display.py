"""How jaxmp's objects show themselves in a notebook: HTML tables of bounded size.

Jupyter shows an object by its ``_repr_html_`` when it has one, and IPython's plain-text
display by its ``_repr_pretty_``; `repr` itself stays the object's own. This module holds the
pieces the displays share: escaping (every name a user chose, a module path or a param path,
is text, never markup), an HTML table and its plain-text twin, at most `MAX_ROWS` rows with a
note of how many more, a matplotlib figure inlined as a PNG, and the tuples that jaxmp's
listings return (`QuantizationPlan`, `Float8Matmuls`). It imports nothing of jaxmp but
`compat`: each module that displays an object imports it.
"""

from __future__ import annotations

import base64
import html
import io
import math
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import jax
import numpy as np

from jaxmp._src import compat

# Rows a display shows at most; the rest are counted in a note.
MAX_ROWS = 20


def concrete(tree: Any) -> bool:
    """Whether every leaf of `tree` holds values to show: not traced, not a shape alone
    (`jax.eval_shape`'s ``ShapeDtypeStruct``). A display of other leaves returns None, and
    Jupyter shows the object's repr."""
    return all(
        isinstance(x, (np.ndarray, np.generic, int, float, bool))
        or (isinstance(x, jax.Array) and not isinstance(x, compat.Tracer))
        for x in jax.tree.leaves(tree)
    )


def escape(value: Any) -> str:
    """`value` as HTML text: ``<``, ``>``, ``&`` and quotes escaped."""
    return html.escape(str(value), quote=True)


def html_table(
    header: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    title: str = "",
    notes: Sequence[str] = (),
    after: Sequence[str] = (),
) -> str:
    """An HTML table: `title`, then a paragraph per line of `notes`, the table, and a
    paragraph per line of `after`; all plain text (escaped), as every cell."""
    parts = ['<div class="jaxmp-display">']
    if title:
        parts.append(f"<p><b>{escape(title)}</b></p>")
    parts += [f"<p>{escape(note)}</p>" for note in notes]
    parts.append('<table style="text-align: left">')
    parts.append("<tr>" + "".join(f"<th>{escape(h)}</th>" for h in header) + "</tr>")
    for row in rows:
        parts.append("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>")
    parts.append("</table>")
    parts += [f"<p>{escape(line)}</p>" for line in after if line]
    parts.append("</div>")
    return "\n".join(parts)


def text_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """The lines of a plain-text table, columns padded to their widest cell."""
    cells = [[str(h) for h in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]


def shown(count: int, total: int, what: str, how: str) -> str:
    """The note of a bounded display: ``"20 of 506 rows shown; <how> lists all"``."""
    return f"{count} of {total} {what} shown; {how} lists all" if total > count else ""


def power_of_two(x: float) -> str:
    """``"2^15"`` for a power of two, else the number (``"3e+04"``)."""
    exponent = math.log2(x) if x > 0 and math.isfinite(x) else math.nan
    if exponent == 0:
        return "1"
    if math.isfinite(exponent) and exponent == int(exponent):
        return f"2^{int(exponent)}"
    return f"{x:.4g}"


def each(value: Any, show: Callable[[Any], str]) -> str:
    """A concrete value as `show` writes one element: one of a scalar; of a stacked value
    (replicas, a vmapped state) ``"<v> (each of N)"`` when its elements are equal, else the
    smallest and the largest (``"<lo> to <hi> over N"``)."""
    array = np.asarray(value)
    if array.size == 1:
        return show(array.reshape(()).item())
    flat = array.reshape(-1)
    if (flat == flat[0]).all():
        return f"{show(flat[0].item())} (each of {flat.size})"
    return f"{show(flat.min().item())} to {show(flat.max().item())} over {flat.size}"


def pyplot(who: str) -> Any:
    """``matplotlib.pyplot``, imported on first use (matplotlib is not a dependency of jaxmp).

    A script that has chosen no backend draws with Agg, off screen; a backend already chosen
    is kept: pyplot imported by the user, or the one a Jupyter kernel names in
    ``MPLBACKEND`` (its inline backend, which shows the figures in the notebook).

    Raises:
      ImportError: if matplotlib is not installed, naming `who` and what to install.
    """
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            f"{who} needs matplotlib, which jaxmp does not install: `pip install matplotlib` "
            "(or `pip install jaxmp[examples]`)."
        ) from None
    if "matplotlib.pyplot" not in sys.modules and not os.environ.get("MPLBACKEND"):
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def figure_html(fig: Any, *, alt: str, dpi: int = 80) -> str:
    """The matplotlib Figure `fig` as an inline PNG ``<img>``; `fig` is closed (so that
    Jupyter's inline backend does not show it a second time)."""
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=dpi)
    finally:
        import matplotlib.pyplot as plt  # `fig` exists: matplotlib is installed

        plt.close(fig)
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{escape(alt)}"/>'


def pretty(text: Callable[[Any], str]) -> Callable[[Any, Any, bool], None]:
    """A ``_repr_pretty_`` method printing ``text(self)``: IPython's plain-text display (the
    repr where the object's ``_concrete()`` says it holds no values)."""

    def _repr_pretty_(self: Any, printer: Any, cycle: bool) -> None:
        shown = not cycle and getattr(self, "_concrete", lambda: True)()
        printer.text(text(self) if shown else repr(self))

    return _repr_pretty_


class Listing(tuple):  # type: ignore[type-arg]
    """A tuple of NamedTuple rows that shows itself as a table (the first `MAX_ROWS` rows in
    HTML, every row in `str`). Equal to the plain tuple, with its `repr`; a pytree as a tuple.

    Subclasses set `columns`: ``(header, attribute, {value: shown})`` per column.
    """

    columns: ClassVar[tuple[tuple[str, str, dict[Any, str]], ...]] = ()
    what: ClassVar[str] = "rows"

    def title(self) -> str:
        raise NotImplementedError

    def _cells(self, rows: Iterable[Any]) -> list[list[str]]:
        return [
            [
                names.get(getattr(row, attr), str(getattr(row, attr)))
                for _, attr, names in self.columns
            ]
            for row in rows
        ]

    def _repr_html_(self) -> str:
        header = [h for h, _, _ in self.columns]
        return html_table(
            header,
            self._cells(self[:MAX_ROWS]),
            title=self.title(),
            after=[shown(min(len(self), MAX_ROWS), len(self), self.what, "str() of it")],
        )

    def __str__(self) -> str:
        header = [h for h, _, _ in self.columns]
        return "\n".join([self.title(), *text_table(header, self._cells(self))])

    _repr_pretty_ = pretty(__str__)

    def __repr__(self) -> str:
        return tuple.__repr__(self)


_YES_NO = {True: "yes", False: "no"}


class QuantizationPlan(Listing):
    """What `jaxmp.quantization_plan` returns: its `jaxmp.QuantizedLeaf` rows."""

    columns = (("leaf", "path", {}), ("quantised", "quantized", _YES_NO), ("why", "reason", {}))
    what = "leaves"

    def title(self) -> str:
        quantised = sum(leaf.quantized for leaf in self)
        return f"jaxmp.quantization_plan: {quantised} of {len(self)} floating leaves quantised"


class Float8Matmuls(Listing):
    """What `jaxmp.Float8Autocast.fp8_matmuls` returns: its `jaxmp.Float8Matmul` rows."""

    columns = (
        ("name", "name", {"": "(no name)"}),
        ("op", "primitive", {}),
        ("FP8", "fp8", _YES_NO),
        ("why", "reason", {}),
    )
    what = "matmuls"

    def title(self) -> str:
        fp8 = sum(m.fp8 for m in self)
        return f"jaxmp fp8_matmuls: {fp8} of {len(self)} matmuls run in FP8"


for _cls in (QuantizationPlan, Float8Matmuls):
    jax.tree_util.register_pytree_node(
        _cls,
        lambda rows: (tuple(rows), None),
        lambda _, rows, cls=_cls: cls(rows),  # type: ignore[misc]
    )
