"""Tidy rows: the one container every initlab report and diagnostic returns.

A table is a list of flat ``dict`` rows sharing one documented schema (the schema lives with the
producer: :data:`initlab.INIT_REPORT_COLUMNS`, :data:`initlab.PROBE_COLUMNS`, ...).
:class:`Rows` gives every producer the same exits: ``to_rows()`` (plain dicts), ``to_pandas()``
(pandas is optional), ``to_markdown()`` and a fixed-width ``str``.

Row keys
--------
Every row about one layer names it the same way, whichever report produced it:

* ``layer``: the module's qualified name, as in ``model.named_modules()`` (``""`` for the root
  module itself);
* ``param``: for rows about one tensor, the parameter's local name on that module (``"weight"``,
  ``"bias"``, ``"in_proj_weight"``); the full name is ``join_name(layer, param)``
  (:func:`split_name` is the inverse). Rows about a layer as a whole have no ``param`` column, or
  ``param == ""`` in long tables that mix both.

So ``init_model`` reports ``layer, param, module_type, role, ...``; ``MomentProbe.rows()``
``layer, module_type, order, call, quantity, index, param, stat, value``; ``.table()`` one row per
``layer``; ``.param_table()`` one per ``(layer, param)``; ``gr_scaling`` and
``precondition_`` one per ``layer``; ``lsuv_`` and ``scale_output_`` one per scaled ``layer``;
``gradinit_``/``metainit_`` one per scaled ``(layer, param)``; ``theory_vs_actual`` one per
``(layer, param)`` (plus its curvature ``block`` name); the diagnostics (``diagnose`` long rows,
per-layer table and findings, ``gradient_stats``, ``layer_spectra``, activations) use the same
two keys. :func:`~initlab.measure.curvature.block_curvature` rows are about *pairs* of blocks and
name them ``block_row``/``block_col`` (a parameter's full name, a module's name, or a user-given
block name). A tied tensor is reported under the name the report uses for it (``init_model``:
one row per alias, with ``tied_to``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, overload

if TYPE_CHECKING:  # data's modules list names with shown(): no import of data at run time
    from initlab._core.data import DataUse

__all__ = ["Rows", "format_table", "join_name", "shown", "split_name"]


def split_name(qualified: str) -> tuple[str, str]:
    """``(layer, param)`` of a full parameter name, split at the last dot.

    >>> split_name("mlp.2.weight"), split_name("scale")
    (('mlp.2', 'weight'), ('', 'scale'))
    """
    layer, _, param = qualified.rpartition(".")
    return layer, param


def join_name(layer: str, param: str) -> str:
    """The full parameter name of ``param`` on module ``layer`` (``""`` = the root module).

    >>> join_name("mlp.2", "weight"), join_name("", "scale"), join_name("0", "")
    ('mlp.2.weight', 'scale', '0')
    """
    if not param:
        return layer
    return f"{layer}.{param}" if layer else param


def shown(names: Sequence[str], most: int) -> str:
    """The first ``most`` of ``names`` joined by ``", "``, then ``" and N more"`` for the
    ``N = len(names) - most`` left out (nothing when none is): the one way a message lists names.

    >>> shown(["a", "b", "c"], 2), shown(["a", "b"], 2)
    ('a, b and 1 more', 'a, b')
    """
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if value == 0.0:
            return "0"
        if 1e-3 <= abs(value) < 1e5:
            return f"{value:.4g}"
        return f"{value:.3e}"
    if isinstance(value, tuple):
        return (
            "x".join(str(v) for v in value)
            if all(isinstance(v, int) for v in value)
            else str(value)
        )
    return str(value)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Render rows as a fixed-width text table (numbers right-aligned, 4 significant digits)."""
    if not rows:
        return "(no rows)"
    cols = list(columns) if columns is not None else list(rows[0].keys())
    cells = [[_fmt(row.get(c)) for c in cols] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
    numeric = [
        all(isinstance(row.get(c), (int, float)) or row.get(c) is None for row in rows)
        for c in cols
    ]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ).rstrip()

    out = [line(cols), line(["-" * w for w in widths])]
    out.extend(line(r) for r in cells)
    return "\n".join(out)


class Rows:
    """An ordered list of tidy rows with one schema.

    Args:
        rows: the rows (dicts with the same keys).
        columns: column order; defaults to the keys of the first row.
        title: optional heading used by ``str`` and ``to_markdown``.
        used: how much data produced the rows (``used.batches``, ``used.examples``), for rows
            measured on data; ``None`` otherwise.
    """

    def __init__(
        self,
        rows: Iterable[Mapping[str, Any]],
        columns: Sequence[str] | None = None,
        title: str | None = None,
        *,
        used: DataUse | None = None,
    ) -> None:
        self._rows = [dict(r) for r in rows]
        self.columns: list[str] = (
            list(columns)
            if columns is not None
            else (list(self._rows[0].keys()) if self._rows else [])
        )
        self.title = title
        self.used = used

    @classmethod
    def _adopt(
        cls, rows: list[dict[str, Any]], columns: Sequence[str], title: str | None = None
    ) -> Rows:
        """Rows made of ``rows`` itself, without the copy ``Rows(...)`` makes: for a producer
        that built the dicts for this object alone (thousands of rows in a hook's read-out)."""
        out = cls([], columns, title)
        out._rows = rows
        return out

    def to_rows(self) -> list[dict[str, Any]]:
        """The rows as a list of new plain dicts."""
        return [dict(r) for r in self._rows]

    def to_pandas(self) -> Any:
        """The rows as a ``pandas.DataFrame`` (needs pandas: ``pip install pandas``)."""
        try:
            import pandas as pd
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError(
                "to_pandas() needs pandas; install it with `pip install pandas` "
                "or use to_rows() for plain dicts"
            ) from err
        return pd.DataFrame(self._rows, columns=self.columns or None)

    def to_markdown(self, columns: Sequence[str] | None = None) -> str:
        """The rows as a GitHub-flavoured markdown table."""
        cols = list(columns) if columns is not None else self.columns
        head = f"### {self.title}\n\n" if self.title else ""
        if not self._rows:
            return head + "(no rows)\n"
        lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
        lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in self._rows]
        return head + "\n".join(lines) + "\n"

    def filter(self, **equal: Any) -> Rows:
        """Rows whose fields equal the given values, e.g. ``rows.filter(stat="sq_mean")``."""
        keep = [r for r in self._rows if all(r.get(k) == v for k, v in equal.items())]
        return Rows(keep, self.columns, self.title, used=self.used)

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.to_rows())

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, index: slice) -> Rows: ...
    def __getitem__(self, index: int | slice) -> dict[str, Any] | Rows:
        """One row (a copy), or a slice of them as :class:`Rows` (columns and title kept)."""
        if isinstance(index, slice):
            return Rows(self._rows[index], self.columns, self.title, used=self.used)
        return dict(self._rows[index])

    def __str__(self) -> str:
        table = format_table(self._rows, self.columns)
        title = self.title or ""
        if self.used is not None:
            b, e = self.used.batches, self.used.examples
            title += f" ({b} batch{'es' if b != 1 else ''}, {e} example{'s' if e != 1 else ''})"
        return f"{title.strip()}\n{table}" if title else table

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self._rows)} rows, columns={self.columns})"
