"""One entry to matplotlib for every plot in initlab (imported lazily; it is an optional extra)."""

from __future__ import annotations

from typing import Any

__all__ = ["new_figure"]


def new_figure(user: str, without: str, **kwargs: Any) -> Any:
    """A ``matplotlib.figure.Figure`` (no pyplot, constrained layout).

    Args:
        user: what needs the plot, for the error message (e.g. ``"initlab.study.plots"``).
        without: how to get the results without matplotlib, for the error message.
        **kwargs: passed to ``Figure``.

    Raises:
        ImportError: matplotlib is not installed (says how to install it, and ``without``).
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"{user} needs matplotlib: pip install 'initlab[plot]' (or matplotlib); {without}"
        ) from err
    return Figure(layout="constrained", **kwargs)
