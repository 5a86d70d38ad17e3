"""What a data-dependent init method did: :class:`MethodReport`.

Every method (``lsuv_``, ``gradinit_``, ``metainit_``, ``scale_output_``, ``precondition_``)
returns one: per-layer rows (schema documented by the method), the passes it spent and its wall
time, and, for iterative methods, a per-iteration ``trace``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from initlab._core.data import DataUse
from initlab._core.rows import Rows

__all__ = ["MethodReport"]


class MethodReport(Rows):
    """Per-layer rows of a data-dependent method, with its cost.

    Attributes:
        method: the method's name.
        forward_passes: full forward passes of the model spent.
        backward_passes: backward passes spent.
        wall_s: wall time of the call.
        trace: per-iteration rows (iterative methods), or ``None``.
        info: method-specific scalars (e.g. the fitted output scale).
        used: the data it read: ``used.batches`` batches, ``used.examples`` examples.
    """

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        columns: Sequence[str],
        *,
        method: str,
        forward_passes: int,
        backward_passes: int,
        wall_s: float,
        trace: Rows | None = None,
        info: Mapping[str, Any] | None = None,
        used: DataUse | None = None,
    ) -> None:
        super().__init__(rows, columns, title=method, used=used)
        self.method = method
        self.forward_passes = forward_passes
        self.backward_passes = backward_passes
        self.wall_s = wall_s
        self.trace = trace
        self.info = dict(info or {})

    def __str__(self) -> str:
        cost = (
            f"{self.forward_passes} forward / {self.backward_passes} backward passes, "
            f"{self.wall_s:.2f} s"
        )
        shown = (_info_text(k, v) for k, v in self.info.items())
        extra = "".join(f", {text}" for text in shown if text)
        return f"{super().__str__()}\n{self.method}: {cost}{extra}"


_PLAIN = (str, int, float, bool, type(None))


def _info_text(key: str, value: Any, shown: int = 4) -> str:
    """``key=value`` for the summary line: numbers to 4 digits, a mapping or a sequence as
    ``a: 1.33, b: 2`` (the first ``shown``, then how many more), in plain words rather than
    Python's reprs; ``""`` for an empty one and for an object (a hook's handle)."""
    if isinstance(value, float):
        return f"{key}={value:.4g}"
    if isinstance(value, _PLAIN):
        return f"{key}={value}" if value != "" else ""
    if isinstance(value, Mapping):
        items = [f"{k}: {_info_text('', v, 0)[1:] or '-'}" for k, v in value.items()]
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = [_info_text("", v, 0)[1:] or "-" for v in value]
    else:
        return ""
    if not items or not shown:
        return f"{key}=({len(items)})" if items else ""
    more = f", and {len(items) - shown} more" if len(items) > shown else ""
    return f"{key}=({', '.join(items[:shown])}{more})"
