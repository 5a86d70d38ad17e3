"""The HTML page of ``initlab bench report``: one self-contained file (inline CSS, plots embedded
as base64 PNGs, as ``initlab diagnose``'s report does) built from small pieces."""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from initlab._core.rows import Rows

__all__ = ["ci_text", "html_image", "html_page", "html_table"]

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em;color:#222;
max-width:80em}
h1{font-size:1.5em}h2{font-size:1.25em;margin-top:1.8em;border-bottom:1px solid #ddd}
h3{font-size:1.05em;margin-top:1.2em}
table{border-collapse:collapse;font-size:0.82em;margin:0.5em 0}
th,td{border:1px solid #ccc;padding:2px 6px;text-align:right}
th{background:#f0f0f0}td.s{text-align:left}td.first{background:#e3f4e3}td.edge{background:#fff1cc}
p.note{font-size:0.9em;color:#444}pre{background:#f7f7f7;padding:0.8em;overflow-x:auto}
img{max-width:100%;border:1px solid #ddd;margin:0.5em 0}
"""


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if value != 0 and not 1e-3 <= abs(value) < 1e5:
            return f"{value:.{digits - 1}e}"
        return f"{value:.{digits}f}" if abs(value) < 10 else f"{value:.4g}"
    return str(value)


def ci_text(value: Any, lo: Any, hi: Any, digits: int = 3) -> str:
    """``"0.885 [0.763, 0.931]"``; a count (an ``int`` value) as ``"3 [1, 7]"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value} [{lo:g}, {hi:g}]"
    return f"{_num(value, digits)} [{_num(lo, digits)}, {_num(hi, digits)}]"


def html_table(
    rows: Rows | Sequence[Mapping[str, Any]],
    columns: Sequence[str] | None = None,
    *,
    cell_class: Callable[[Mapping[str, Any], str], str] | None = None,
) -> str:
    """An HTML table of ``rows`` (text left-aligned, numbers right-aligned, 3 decimals)."""
    rows = [dict(r) for r in rows]
    if not rows:
        return "<p>(none)</p>"
    cols = list(columns or (rows[0].keys()))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = []
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            cls = "s" if isinstance(v, str) else ""
            if cell_class is not None:
                cls = f"{cls} {cell_class(r, c)}".strip()
            cells.append(f'<td class="{cls}">{html.escape(_num(v))}</td>')
        body.append(f"<tr>{''.join(cells)}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def html_image(path: str | Path, alt: str) -> str:
    """An ``<img>`` with the PNG at ``path`` embedded (``data:`` URL)."""
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{html.escape(alt)}">'


def html_page(title: str, parts: Iterable[str]) -> str:
    """A complete HTML document: ``title`` as ``<title>`` and ``<h1>``, then the parts."""
    head = (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>"
    )
    return "\n".join([head, *parts, "</body></html>"])
