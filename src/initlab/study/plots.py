"""Plots of a study (matplotlib, imported only when a plot is drawn).

- :func:`plot_interquartile`: per data set, the training loss after each epoch at each scheme's
  best learning rate: the median over seeds with the 25–75 % band (the paper's appendix LIBSVM
  plots), plus ``iqr_all.png``, a grid of all data sets' final losses with interquartile bars.
- :func:`plot_loss_curves`: per data set, the minibatch training loss at the best learning rate,
  smoothed by a trailing sliding window for each seed and then averaged over seeds (the paper's
  Figure 3 style; it used a 400-step window on CIFAR-10).
- :func:`plot_sensitivity`: the average normalized loss of every scheme with its bootstrap
  interval, one row per protocol variant (the sensitivity table as a figure).

Figures are drawn with :class:`matplotlib.figure.Figure` directly (no ``pyplot``), so plotting
never changes the caller's matplotlib backend or global figure state.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from initlab._core.figures import new_figure
from initlab._core.rows import Rows
from initlab.study._stats import quantile

__all__ = [
    "plot_interquartile",
    "plot_loss_curves",
    "plot_sensitivity",
    "plot_study",
    "sliding_mean",
]


def _figure(**kwargs: Any) -> Any:
    return new_figure(
        "initlab.study.plots",
        "report_study(..., plots=False) writes the tables without it",
        **kwargs,
    )


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def sliding_mean(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing moving average: entry ``i`` is the mean of ``values[i - window + 1 .. i]``
    (``len(values) - window + 1`` entries; the whole series' mean if it is shorter)."""
    x = np.asarray(values, dtype=np.float64)
    window = max(1, min(int(window), len(x)))
    if len(x) == 0:
        return x
    c = np.cumsum(np.concatenate([[0.0], x]))
    return (c[window:] - c[:-window]) / window


def _best_runs(
    records: Iterable[Mapping[str, Any]], per_dataset: Rows | Iterable[Mapping[str, Any]]
) -> dict[str, dict[str, list[Mapping[str, Any]]]]:
    """``{dataset: {scheme: [runs at the best learning rate]}}``."""
    best = {(r["dataset"], r["scheme"]): r["best_lr"] for r in per_dataset}
    out: dict[str, dict[str, list[Mapping[str, Any]]]] = {}
    for r in records:
        if best.get((r["dataset"], r["scheme"])) == float(r["lr"]):
            out.setdefault(r["dataset"], {}).setdefault(r["scheme"], []).append(r)
    return {d: dict(sorted(s.items())) for d, s in sorted(out.items())}


def _needs_curves(records: Sequence[Mapping[str, Any]]) -> None:
    if records and "epoch_train_loss" not in records[0]:
        raise ValueError("plots need the runs' curves: use Store.records(study, curves=True)")


def plot_interquartile(
    records: Sequence[Mapping[str, Any]],
    per_dataset: Rows | Sequence[Mapping[str, Any]],
    out_dir: str | Path,
) -> list[Path]:
    """Per data set, epoch training loss at the best learning rate: median and 25–75 % band.

    Args:
        records: runs with curves (``Store.records(curves=True)``).
        per_dataset: :func:`initlab.study.aggregate.per_dataset_table` of the same runs.
        out_dir: folder for ``iqr_<dataset>.png`` and ``iqr_all.png``.

    Returns:
        the files written.
    """
    _needs_curves(records)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    groups = _best_runs(records, per_dataset)
    for dataset, schemes in groups.items():
        from matplotlib.ticker import MaxNLocator

        fig = _figure(figsize=(5.0, 3.6))
        ax = fig.add_subplot()
        for scheme, runs in schemes.items():
            n_epochs = min(len(r["epoch_train_loss"]) for r in runs)
            # per epoch, over seeds; diverged (non-finite) counts as +inf, as in the aggregation
            columns = [
                [
                    v if math.isfinite(v) else math.inf
                    for v in (r["epoch_train_loss"][e] for r in runs)
                ]
                for e in range(n_epochs)
            ]
            q25, med, q75 = (np.array([quantile(c, q) for c in columns]) for q in (0.25, 0.5, 0.75))
            epochs = np.arange(1, n_epochs + 1)
            (line,) = ax.plot(epochs, _finite(med), marker="o", ms=3, label=f"{scheme}")
            ax.fill_between(epochs, _finite(q25), _finite(q75), color=line.get_color(), alpha=0.2)
        ax.set(xlabel="epoch", ylabel="training loss", title=f"{dataset}: median, 25–75 %")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        _finish_axes(ax)
        written.append(out / f"iqr_{_safe(dataset)}.png")
        fig.savefig(written[-1], dpi=110)
    if groups:
        written.append(_plot_iqr_grid(per_dataset, out / "iqr_all.png"))
    return written


def _finish_axes(ax: Any) -> None:
    """A legend, only where there is something to show (no matplotlib warnings), and a log scale
    where the losses span more than a factor of 5."""
    handles, _ = ax.get_legend_handles_labels()
    if not handles:
        return
    ys = np.concatenate([np.asarray(line.get_ydata(), dtype=np.float64) for line in ax.get_lines()])
    ys = ys[np.isfinite(ys) & (ys > 0)]
    if ys.size and ys.max() > 5 * ys.min():
        ax.set_yscale("log")
    ax.legend(fontsize="small")


def _finite(values: np.ndarray) -> np.ndarray:
    """``inf``/``nan`` → ``nan`` so matplotlib leaves a gap instead of warning."""
    v = np.array(values, dtype=np.float64)
    v[~np.isfinite(v)] = np.nan
    return v


def _plot_iqr_grid(per_dataset: Rows | Sequence[Mapping[str, Any]], path: Path) -> Path:
    rows = [dict(r) for r in per_dataset]
    datasets = sorted({r["dataset"] for r in rows})
    schemes = sorted({r["scheme"] for r in rows})
    cols = min(4, len(datasets))
    nrows = math.ceil(len(datasets) / cols)
    fig = _figure(figsize=(3.2 * cols, 2.4 * nrows))
    axes = fig.subplots(nrows, cols, squeeze=False)
    for ax, dataset in zip(axes.flat, datasets, strict=False):
        for i, scheme in enumerate(schemes):
            r = next((r for r in rows if r["dataset"] == dataset and r["scheme"] == scheme), None)
            if r is None or not math.isfinite(r["median_loss"]):
                continue
            lo = r["median_loss"] - r["q25"]
            hi = r["q75"] - r["median_loss"] if math.isfinite(r["q75"]) else 0.0
            ax.errorbar([i], [r["median_loss"]], yerr=[[lo], [hi]], fmt="o", capsize=3)
        ax.set_xticks(range(len(schemes)), schemes, rotation=30, fontsize="small")
        ax.set_title(dataset, fontsize="medium")
    for ax in list(axes.flat)[len(datasets) :]:
        ax.set_visible(False)
    fig.suptitle("final training loss at the best learning rate (median, 25–75 %)")
    fig.savefig(path, dpi=110)
    return path


def plot_loss_curves(
    records: Sequence[Mapping[str, Any]],
    per_dataset: Rows | Sequence[Mapping[str, Any]],
    out_dir: str | Path,
    *,
    window: int | None = None,
) -> list[Path]:
    """Per data set, smoothed minibatch training loss at the best learning rate, mean over seeds.

    Each seed's step losses are smoothed by a trailing window, then averaged over the seeds that
    did not diverge (the legend gives how many). ``window=None``: one tenth of a run's steps,
    capped at 400 (the paper's CIFAR-10 window), at least 1.

    Returns:
        the files written (``curves_<dataset>.png``).
    """
    _needs_curves(records)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for dataset, schemes in _best_runs(records, per_dataset).items():
        fig = _figure(figsize=(5.0, 3.6))
        ax = fig.add_subplot()
        used = 1
        for scheme, runs in schemes.items():
            curves = [np.asarray(r["step_loss"], dtype=np.float64) for r in runs]
            ok = [c for c in curves if len(c) and np.isfinite(c).all()]
            if not ok:
                continue
            n = min(len(c) for c in ok)
            used = window if window is not None else max(1, min(400, n // 10))
            mean = np.mean([sliding_mean(c[:n], used) for c in ok], axis=0)
            steps = np.arange(len(mean)) + min(used, n)
            ax.plot(steps, mean, label=f"{scheme} ({len(ok)}/{len(curves)} seeds)")
        ax.set(xlabel="step", ylabel="training loss", title=f"{dataset}: window {used} steps")
        _finish_axes(ax)
        written.append(out / f"curves_{_safe(dataset)}.png")
        fig.savefig(written[-1], dpi=110)
    return written


def plot_study(
    records: Sequence[Mapping[str, Any]],
    per_dataset: Rows | Sequence[Mapping[str, Any]],
    out_dir: str | Path,
    *,
    window: int | None = None,
) -> list[Path]:
    """All of a study's plots: :func:`plot_interquartile` and :func:`plot_loss_curves`."""
    return plot_interquartile(records, per_dataset, out_dir) + plot_loss_curves(
        records, per_dataset, out_dir, window=window
    )


def plot_sensitivity(rows: Rows | Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Average normalized loss and its interval per variant (rows) and scheme (markers).

    Args:
        rows: :func:`initlab.study.aggregate.sensitivity_table` rows (``variant, scheme,
            avg_normalized_loss, avg_lo, avg_hi``).
        path: the PNG to write.
    """
    rows = [dict(r) for r in rows]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    schemes = sorted({r["scheme"] for r in rows})
    fig = _figure(figsize=(6.4, 1.6 + 0.42 * len(variants)))
    ax = fig.add_subplot()
    offsets = np.linspace(-0.25, 0.25, len(schemes)) if len(schemes) > 1 else [0.0]
    for offset, scheme in zip(offsets, schemes, strict=True):
        mine = {r["variant"]: r for r in rows if r["scheme"] == scheme}
        ys = [i + offset for i, v in enumerate(variants) if v in mine]
        mid = np.array([mine[v]["avg_normalized_loss"] for v in variants if v in mine])
        lo = _finite(np.array([mine[v]["avg_lo"] for v in variants if v in mine], dtype=float))
        hi = _finite(np.array([mine[v]["avg_hi"] for v in variants if v in mine], dtype=float))
        err = np.nan_to_num(np.stack([mid - lo, hi - mid]), nan=0.0)
        ax.errorbar(mid, ys, xerr=err, fmt="o", ms=4, capsize=2, label=scheme)
    ax.set_yticks(range(len(variants)), variants, fontsize="small")
    ax.invert_yaxis()
    ax.set(xlabel="average normalized loss (bootstrap interval)", title="sensitivity to protocol")
    ax.legend(fontsize="small")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
