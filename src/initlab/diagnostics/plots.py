"""Plots of diagnosis reports (matplotlib, the ``plot`` extra, imported only when a plot is drawn).

Every function returns a :class:`matplotlib.figure.Figure` built without ``pyplot``, so plotting
never changes the caller's backend or global figure state; save it with ``fig.savefig(path)``.

* :func:`plot_gamma_nu`: ``gamma`` and ``nu`` per weight on a log axis, several reports (schemes)
  side by side;
* :func:`plot_moments`: forward (``E[x^2]``, ``E[y^2]``) and backward (``E[dy^2]``, ``E[dx^2]``)
  second moments through depth, with the cumulative gains;
* :func:`plot_weight_grad`: weight magnitude ``||W||_1 / d`` and gradient std across minibatches
  per layer (GradInit, Figures 4-10), several reports side by side;
* :func:`plot_curvature`: the Hessian block heat map (Defazio & Bottou, Figure 1) from
  ``initlab.measure.curvature.block_curvature`` rows;
* :func:`plot_theory_vs_actual`: the histogram of theory / actual (their Figure 2);
* :func:`plot_landscape`: contours of a loss landscape (``Landscape`` or its rows).
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from initlab._core.figures import new_figure
from initlab._core.rows import Rows

__all__ = [
    "figure_png",
    "plot_curvature",
    "plot_gamma_nu",
    "plot_landscape",
    "plot_moments",
    "plot_theory_vs_actual",
    "plot_weight_grad",
]

_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
_VERDICT_COLORS = {"ok": "#2ca02c", "warn": "#ff9f0e", "bad": "#d62728"}


def _figure(**kwargs: Any) -> Any:
    return new_figure(
        "initlab.diagnostics.plots",
        "Report.save_html(path, plots=False) writes the tables without it",
        **kwargs,
    )


def figure_png(fig: Any, dpi: int = 110) -> bytes:
    """The figure as PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def _labelled(reports: Any, labels: Sequence[str] | None) -> list[tuple[str, Any]]:
    if isinstance(reports, Mapping):
        return [(str(k), v) for k, v in reports.items()]
    reports = list(reports)
    if labels is None:
        labels = [r.meta.get("scheme") or r.meta.get("model", f"report {i}") for i, r in
                  enumerate(reports)]  # fmt: skip
        if len(set(labels)) < len(labels):
            labels = [f"{lab} ({i})" for i, lab in enumerate(labels)]
    return list(zip(labels, reports, strict=True))


def _weight_layers(report: Any) -> list[tuple[str, str]]:
    """``(layer, weight param)`` of the weights compared across layers, in layer order."""
    found: dict[str, str] = {}
    for quantities in (("gamma_rel_median", "nu_rel_median"), ("W_abs_mean",)):
        for r in report.rows:
            if r["quantity"] in quantities and r["param"]:
                found.setdefault(r["layer"], r["param"])
        if found:
            break
    return [(r["layer"], found[r["layer"]]) for r in report.layers if r["layer"] in found]


def _values(report: Any, quantity: str, layers: Sequence[tuple[str, str]]) -> list[float]:
    table = {(r["layer"], r["param"]): r["value"] for r in report.rows if r["quantity"] == quantity}
    return [table.get(key, math.nan) for key in layers]


def _positive(values: Iterable[float]) -> np.ndarray:
    a = np.asarray(list(values), dtype=float)
    return np.where(a > 0, a, np.nan)


def _xticks(ax: Any, layers: Sequence[Any]) -> None:
    names = [n[0] if isinstance(n, tuple) else n for n in layers]
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([n or "<root>" for n in names], rotation=60, ha="right", fontsize=7)


def plot_gamma_nu(
    reports: Sequence[Any] | Mapping[str, Any], labels: Sequence[str] | None = None
) -> Any:
    """``gamma`` (GR scaling) and ``nu`` (weight-to-gradient ratio) per weight, log axis.

    Args:
        reports: one or more reports (a mapping ``{scheme: report}`` labels them); the layers of
            the first report set the x axis; several reports are drawn side by side (offset).
        labels: legend labels (default: the mapping's keys, else ``meta["scheme"]`` or the model).
    """
    items = _labelled(reports, labels)
    layers = _weight_layers(items[0][1])
    fig = _figure(figsize=(max(6.0, 0.45 * len(layers) + 3), 6.2))
    axes = fig.subplots(2, 1, sharex=True)
    width = 0.24 / max(len(items), 1)
    for ax, (quantity, title) in zip(
        axes,
        (("gamma", "γ: GR scaling of each weight (Prop. 3); balanced = flat"),
         ("nu", "ν = E[dW²]/E[W²] (per-example; minibatch where undefined)")),
        strict=True,
    ):  # fmt: skip
        for i, (label, rep) in enumerate(items):
            vals = _values(rep, quantity, layers)
            if quantity == "nu":
                mb = _values(rep, "nu_minibatch", layers)
                vals = [v if v > 0 else m for v, m in zip(vals, mb, strict=True)]
            x = np.arange(len(layers)) - 0.12 + width * (i + 0.5)
            ax.plot(x, _positive(vals), "o-", ms=5, lw=1, color=_COLORS[i % len(_COLORS)],
                    label=label)  # fmt: skip
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        if len(items) > 1 or quantity == "gamma":
            ax.legend(fontsize=8)
    _xticks(axes[-1], layers)
    return fig


def plot_moments(report: Any) -> Any:
    """Forward and backward second moments through depth (probed modules in execution order).

    The dashed lines are the probe's cumulative gains (products of per-module gains); they are
    drawn only for models without residual blocks, where they follow the signal path.
    """
    probe = [r for r in report.tables["probe"] if r["order"] is not None]
    probe.sort(key=lambda r: r["order"])
    layers = [r["layer"] for r in probe]
    chain = not report.meta.get("residual_blocks")
    fig = _figure(figsize=(max(6.0, 0.4 * len(layers) + 3), 6.2))
    axes = fig.subplots(2, 1, sharex=True)
    x = np.arange(len(layers))
    for ax, pairs, title in (
        (axes[0], (("E_x2", "E[x²] in"), ("E_y2", "E[y²] out"), ("cum_gain_fwd", "cum. gain")),
         "forward: second moments of inputs and outputs"),
        (axes[1], (("E_dy2", "E[dy²] at output"), ("E_dx2", "E[dx²] at input"),
                   ("cum_gain_bwd", "cum. gain")),
         "backward: second moments of gradients (one example's loss)"),
    ):  # fmt: skip
        for i, (key, label) in enumerate(pairs):
            if key.startswith("cum") and not chain:
                continue
            style = "--" if key.startswith("cum") else "o-"
            ax.plot(x, _positive(r[key] for r in probe), style, ms=4, lw=1,
                    color=_COLORS[i], label=label)  # fmt: skip
        ax.set_yscale("log")
        ax.axhspan(1e-3, 1e3, color="#2ca02c", alpha=0.04)
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    _xticks(axes[-1], layers)
    return fig


def plot_weight_grad(
    reports: Any, labels: Sequence[str] | None = None, *, quantity: str = "W_abs_mean"
) -> Any:
    """Weight magnitude ``||W||_1 / d`` (or ``quantity="W_norm"``) and gradient std across
    minibatches per weight layer, several reports side by side (GradInit, Figures 4-10)."""
    items = _labelled([reports] if hasattr(reports, "rows") else reports, labels)
    layers = _weight_layers(items[0][1])
    fig = _figure(figsize=(max(6.0, 0.45 * len(layers) + 3), 6.2))
    axes = fig.subplots(2, 1, sharex=True)
    titles = {
        "W_abs_mean": "weight magnitude ||W||₁ / d",
        "W_norm": "weight norm ||W||_F",
    }
    for ax, q, title in (
        (axes[0], quantity, titles.get(quantity, quantity)),
        (axes[1], "grad_std", "σ(g): per-entry std of the gradient across minibatches"),
    ):
        for i, (label, rep) in enumerate(items):
            ax.plot(np.arange(len(layers)), _positive(_values(rep, q, layers)), "s-",
                    ms=4, lw=1, color=_COLORS[i % len(_COLORS)], label=label)  # fmt: skip
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        if len(items) > 1:
            ax.legend(fontsize=8)
    _xticks(axes[-1], layers)
    return fig


def _rows(obj: Any) -> list[dict[str, Any]]:
    if isinstance(obj, Rows):
        return obj.to_rows()
    to_rows = getattr(obj, "to_rows", None)
    if callable(to_rows):
        got = to_rows()
        return got.to_rows() if isinstance(got, Rows) else [dict(r) for r in got]
    return [dict(r) for r in obj]


def plot_curvature(rows: Any, *, value: str = "value") -> Any:
    """Heat map of the average singular value of each Hessian block (Defazio & Bottou, Fig. 1).

    ``rows`` from ``initlab.measure.curvature.block_curvature`` (``block_row``, ``block_col``,
    ``value``); the color is ``log10 |value|``.
    """
    from matplotlib.colors import LogNorm

    data = _rows(rows)
    names = list(dict.fromkeys([*(str(r["block_row"]) for r in data),
                                *(str(r["block_col"]) for r in data)]))  # fmt: skip
    pos = {n: i for i, n in enumerate(names)}
    grid = np.full((len(names), len(names)), np.nan)
    for r in data:
        v = r.get(value)
        if v is not None and math.isfinite(v) and v != 0:
            grid[pos[str(r["block_row"])], pos[str(r["block_col"])]] = abs(v)
    fig = _figure(figsize=(max(5.0, 0.35 * len(names) + 3), max(4.0, 0.35 * len(names) + 2)))
    ax = fig.subplots()
    finite = grid[np.isfinite(grid)]
    norm = LogNorm(vmin=finite.min(), vmax=finite.max()) if finite.size else None
    im = ax.imshow(grid, cmap="viridis", norm=norm)
    fig.colorbar(im, ax=ax, label=f"|{value}|")
    ax.set_xticks(range(len(names)))
    ax.set_yticks(range(len(names)))
    ax.set_xticklabels(names, rotation=60, ha="right", fontsize=7)
    ax.set_yticklabels(names, fontsize=7)
    ax.set_title("Hessian blocks: average squared singular value", fontsize=10)
    return fig


def plot_theory_vs_actual(rows: Any, *, ratio: str | None = None, bins: int = 30) -> Any:
    """Histogram of theory / actual on a log axis (Defazio & Bottou, Figure 2).

    Uses the column ``ratio`` (default: ``"ratio"`` if present, else ``theory / actual``).
    """
    data = _rows(rows)
    if not data:
        raise ValueError("no rows to plot")
    if ratio is None and "ratio" in data[0]:
        ratio = "ratio"
    if ratio is not None:
        vals = [r[ratio] for r in data]
    elif "theory" in data[0] and "actual" in data[0]:
        vals = [r["theory"] / r["actual"] if r["actual"] else math.nan for r in data]
    else:
        raise ValueError(f"cannot find a ratio column in {sorted(data[0])}; pass ratio='<column>'")
    v = np.asarray([x for x in vals if x is not None and math.isfinite(x) and x > 0])
    fig = _figure(figsize=(6, 4))
    ax = fig.subplots()
    if v.size:
        lo, hi = np.log10(v.min()), np.log10(v.max())
        span = max(hi - lo, 0.2)
        edges = np.logspace(lo - 0.05 * span, hi + 0.05 * span, bins + 1)
        ax.hist(v, bins=edges, color=_COLORS[0], alpha=0.8)
        ax.set_xscale("log")
        ax.set_title(f"theory / actual: median {np.median(v):.3g} over {v.size}", fontsize=10)
    ax.axvline(1.0, color="k", lw=1, ls="--")
    ax.set_xlabel("theory / actual")
    ax.set_ylabel("count")
    return fig


def plot_landscape(
    landscape: Any, *, x: str | None = None, y: str | None = None, z: str | None = None
) -> Any:
    """Filled contours of a loss landscape (a ``Landscape``, its rows, or any rows with two
    coordinate columns and a loss column; names are guessed unless given)."""
    data = _rows(landscape)
    if not data:
        raise ValueError("no landscape rows to plot")
    numeric = [k for k, v in data[0].items() if isinstance(v, (int, float)) and
               not isinstance(v, bool)]  # fmt: skip
    if z is None:
        z = next((k for k in ("loss", "value", "z") if k in numeric), None)
    coords = [k for k in numeric if k != z and len({r[k] for r in data}) > 1]
    if x is None or y is None:
        preferred = [k for k in ("t1", "t2", "alpha", "beta", "x", "y") if k in coords]
        pick = preferred[:2] if len(preferred) >= 2 else coords[:2]
        if len(pick) < 2:
            raise ValueError(f"cannot find two coordinate columns in {sorted(data[0])}")
        x, y = x or pick[0], y or pick[1]
    if z is None:
        raise ValueError(f"cannot find the loss column in {sorted(data[0])}; pass z='<column>'")
    xs, ys = sorted({r[x] for r in data}), sorted({r[y] for r in data})
    fig = _figure(figsize=(5.5, 4.5))
    ax = fig.subplots()
    if len(xs) * len(ys) == len(data):
        grid = np.full((len(ys), len(xs)), np.nan)
        ix, iy = {v: i for i, v in enumerate(xs)}, {v: i for i, v in enumerate(ys)}
        for r in data:
            grid[iy[r[y]], ix[r[x]]] = r[z]
        cs = ax.contourf(xs, ys, grid, levels=20, cmap="viridis")
        ax.contour(xs, ys, grid, levels=20, colors="k", linewidths=0.3)
    else:
        cs = ax.tricontourf([r[x] for r in data], [r[y] for r in data], [r[z] for r in data],
                            levels=20, cmap="viridis")  # fmt: skip
    fig.colorbar(cs, ax=ax, label=z)
    ax.plot([0], [0], "r*", ms=10)
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title("loss landscape", fontsize=10)
    return fig
