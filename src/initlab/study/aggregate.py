"""Defazio & Bottou's aggregation (Section 8, Table 2) of a study's runs, and the study report.

For every data set and scheme:

1. per learning rate, the **median over seeds** of the final training loss (after the last epoch);
   a diverged run, or one with a non-finite loss, counts as ``+inf`` (it still takes part in the
   median, so a rate where most seeds diverge has an infinite median);
2. the **best learning rate** is the one with the lowest median (ties: the smaller rate);
3. the scheme's loss on the data set is that median; its **normalized loss** is that loss divided
   by the worst scheme's loss on the same data set (so the worst scheme scores 1).

Table 2 is then, per scheme: the average normalized loss over data sets, on how many data sets it
is the worst ("worst in #") and the best ("best in #"). A tie counts for every tied scheme, so the
counts may sum to more than the number of data sets. Only data sets on which every scheme of the
study has results enter Table 2. Degenerate cases: when the worst loss is ``+inf`` (a scheme
diverged at every rate), finite losses normalize to 0 and infinite ones to 1; when it is 0, all
normalize to 1.

Quantiles (``q25``, ``q75``, the median) interpolate linearly between order statistics, like
``numpy.quantile``'s default, with ``+inf`` handled exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from initlab._core.rows import Rows
from initlab.study._stats import quantile

__all__ = [
    "LR_COLUMNS",
    "PAPER_N_DATASETS",
    "PAPER_TABLE2",
    "PER_DATASET_COLUMNS",
    "TABLE2_COLUMNS",
    "lr_table",
    "per_dataset_table",
    "quantile",
    "report_study",
    "run_loss",
    "table2",
    "table2_markdown",
]

#: Table 2 of Defazio & Bottou (26 LIBSVM data sets): average normalized loss (±0.01),
#: worst in #, best in #.
PAPER_TABLE2: dict[str, tuple[float, int, int]] = {
    "arithmetic": (0.90, 14, 3),
    "fan_in": (0.84, 3, 5),
    "fan_out": (0.88, 9, 12),
    "geometric": (0.81, 0, 6),
}
PAPER_N_DATASETS = 26

LR_COLUMNS = ("dataset", "scheme", "lr", "median_loss", "q25", "q75", "n_seeds", "n_diverged")
PER_DATASET_COLUMNS = (
    "dataset",
    "scheme",
    "best_lr",
    "median_loss",
    "q25",
    "q75",
    "normalized",
    "n_seeds",
    "n_diverged",
    "lr_at_grid_edge",
)
TABLE2_COLUMNS = ("scheme", "avg_normalized_loss", "worst_in", "best_in", "n_datasets")


def run_loss(record: Mapping[str, Any]) -> float:
    """A run's loss for the aggregation: ``final_train_loss``, or ``+inf`` if it diverged or is
    not finite."""
    loss = record.get("final_train_loss")
    if record.get("diverged") or loss is None or not math.isfinite(float(loss)):
        return math.inf
    return float(loss)


def lr_table(records: Iterable[Mapping[str, Any]]) -> Rows:
    """Per data set, scheme and learning rate: the median and quartiles over seeds of the loss.

    Args:
        records: runs with ``dataset, scheme, lr, final_train_loss, diverged`` (e.g.
            :meth:`initlab.study.store.Store.records`).

    Returns:
        :class:`~initlab.Rows` with :data:`LR_COLUMNS`, sorted by data set, scheme, rate.
    """
    cells: dict[tuple[str, str, float], list[float]] = {}
    for r in records:
        cells.setdefault((r["dataset"], r["scheme"], float(r["lr"])), []).append(run_loss(r))
    rows = []
    for (dataset, scheme, lr), losses in sorted(cells.items()):
        rows.append(
            {
                "dataset": dataset,
                "scheme": scheme,
                "lr": lr,
                "median_loss": quantile(losses, 0.5),
                "q25": quantile(losses, 0.25),
                "q75": quantile(losses, 0.75),
                "n_seeds": len(losses),
                "n_diverged": sum(math.isinf(x) for x in losses),
            }
        )
    return Rows(rows, LR_COLUMNS, title="median final training loss over seeds, per learning rate")


def per_dataset_table(records: Iterable[Mapping[str, Any]]) -> Rows:
    """Per data set and scheme: the best learning rate, its median/quartile loss, normalized loss.

    ``normalized`` is ``None`` on data sets where some scheme of the study has no results.
    ``lr_at_grid_edge`` flags a best rate at the smallest or largest rate tried for that data set
    and scheme (the grid may be too narrow there).

    Returns:
        :class:`~initlab.Rows` with :data:`PER_DATASET_COLUMNS`, sorted by data set, scheme.
    """
    by_lr = lr_table(records).to_rows()
    cells: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in by_lr:
        cells.setdefault((row["dataset"], row["scheme"]), []).append(row)
    schemes = sorted({s for _, s in cells})
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for key, rows in cells.items():
        # lowest median; ties → the smaller learning rate (rows are sorted by lr)
        choice = min(rows, key=lambda row: row["median_loss"])
        lrs = [row["lr"] for row in rows]
        best[key] = {
            "dataset": key[0],
            "scheme": key[1],
            "best_lr": choice["lr"],
            "median_loss": choice["median_loss"],
            "q25": choice["q25"],
            "q75": choice["q75"],
            "normalized": None,
            "n_seeds": choice["n_seeds"],
            "n_diverged": choice["n_diverged"],
            "lr_at_grid_edge": len(lrs) > 1 and choice["lr"] in (min(lrs), max(lrs)),
        }
    for dataset in sorted({d for d, _ in cells}):
        if not all((dataset, s) in best for s in schemes):
            continue
        losses = {s: best[dataset, s]["median_loss"] for s in schemes}
        worst = max(losses.values())
        for s, loss in losses.items():
            best[dataset, s]["normalized"] = _normalize(loss, worst)
    rows = [best[key] for key in sorted(best)]
    return Rows(rows, PER_DATASET_COLUMNS, title="best learning rate per data set and scheme")


def _normalize(loss: float, worst: float) -> float:
    if math.isinf(worst):
        return 1.0 if math.isinf(loss) else 0.0
    if worst == 0.0:
        return 1.0
    return loss / worst


def table2(per_dataset: Rows | Iterable[Mapping[str, Any]]) -> Rows:
    """Table 2: per scheme, the average normalized loss and the worst-in / best-in counts.

    Args:
        per_dataset: the output of :func:`per_dataset_table` (rows without a normalized loss,
            i.e. incomplete data sets, are left out).

    Returns:
        :class:`~initlab.Rows` with :data:`TABLE2_COLUMNS`, one row per scheme (sorted).
    """
    rows = [dict(r) for r in per_dataset if r.get("normalized") is not None]
    by_dataset: dict[str, dict[str, float]] = {}
    normalized: dict[str, list[float]] = {}
    for r in rows:
        by_dataset.setdefault(r["dataset"], {})[r["scheme"]] = r["median_loss"]
        normalized.setdefault(r["scheme"], []).append(r["normalized"])
    worst_in = dict.fromkeys(normalized, 0)
    best_in = dict.fromkeys(normalized, 0)
    for losses in by_dataset.values():
        hi, lo = max(losses.values()), min(losses.values())
        for scheme, loss in losses.items():
            worst_in[scheme] += loss == hi
            best_in[scheme] += loss == lo
    out = [
        {
            "scheme": scheme,
            "avg_normalized_loss": sum(values) / len(values),
            "worst_in": worst_in[scheme],
            "best_in": best_in[scheme],
            "n_datasets": len(values),
        }
        for scheme, values in sorted(normalized.items())
    ]
    return Rows(out, TABLE2_COLUMNS, title=f"Table 2 ({len(by_dataset)} data sets)")


def table2_markdown(
    table: Rows,
    per_dataset: Rows,
    *,
    title: str = "Table 2: average normalized loss / worst in # / best in #",
    notes: Sequence[str] = (),
) -> str:
    """Markdown of :func:`table2` with the paper's numbers (26 LIBSVM data sets) beside ours."""
    n = len({r["dataset"] for r in per_dataset if r["normalized"] is not None})
    lines = [
        f"# {title}",
        "",
        f"| scheme | avg normalized loss | worst in # | best in # | data sets | paper "
        f"({PAPER_N_DATASETS} sets): avg / worst / best |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        paper = PAPER_TABLE2.get(r["scheme"])
        paper_text = f"{paper[0]:.2f} / {paper[1]} / {paper[2]}" if paper else "-"
        lines.append(
            f"| {r['scheme']} | {r['avg_normalized_loss']:.3f} | {r['worst_in']} | "
            f"{r['best_in']} | {r['n_datasets']} | {paper_text} |"
        )
    lines += [
        "",
        f"Ours: {n} data sets; the paper: {PAPER_N_DATASETS} (its list is not in the seed text), "
        "so this is a partial reproduction. Loss: median over seeds of the final training loss at "
        "the best learning rate per data set and scheme (diverged runs count as +inf); normalized "
        "by the worst scheme's loss on each data set; ties count for every tied scheme.",
    ]
    edges = [f"{r['dataset']}/{r['scheme']}" for r in per_dataset if r["lr_at_grid_edge"]]
    if edges:
        lines += ["", f"Best learning rate at the edge of the grid: {', '.join(edges)}."]
    incomplete = sorted({r["dataset"] for r in per_dataset if r["normalized"] is None})
    if incomplete:
        lines += ["", f"Left out (not every scheme has results): {', '.join(incomplete)}."]
    lines += [f"\n{note}" for note in notes]
    lines += ["", "## Per data set", "", per_dataset.to_markdown()]
    return "\n".join(lines) + "\n"


def report_study(
    store_path: str | Path,
    out_dir: str | Path,
    *,
    study: str | None = None,
    plots: bool = True,
    window: int | None = None,
) -> Rows:
    """Write a study's report and return its Table 2 rows.

    Files written to ``out_dir``: ``table2.md`` (ours beside the paper's), ``per_dataset.csv``,
    ``per_lr.csv``, ``runs.csv`` (one row per run) and, with ``plots``, the PNGs of
    :func:`initlab.study.plots.plot_study` under ``out_dir/plots``.

    Args:
        store_path: the study store.
        out_dir: output folder (created).
        study: the study's name; ``None``: the only study in the store (or all runs if there are
            several or none registered).
        plots: draw the plots (needs matplotlib).
        window: sliding-window length for the training-loss curves (default: see
            :func:`initlab.study.plots.plot_loss_curves`).
    """
    from initlab.study.store import Store

    if not Path(store_path).is_file():
        raise FileNotFoundError(f"no study store at {store_path}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with Store(store_path) as store:
        studies = store.studies()
        if study is None and len(studies) == 1:
            study = next(iter(studies))
        if study is not None and study not in studies:
            raise ValueError(f"no study {study!r} in {store_path}; it has: {sorted(studies)}")
        records = store.records(study, curves=plots)
        n_expected = len(store.study_keys(study)) if study is not None else len(records)
        store.to_csv(out / "runs.csv", study)
    if not records:
        raise ValueError(
            f"{store_path} holds no finished runs" + (f" of {study!r}" if study else "")
        )
    per_lr = lr_table(records)
    per_dataset = per_dataset_table(records)
    table = table2(per_dataset)
    _write_csv(out / "per_lr.csv", per_lr)
    _write_csv(out / "per_dataset.csv", per_dataset)
    notes = []
    if len(records) < n_expected:
        notes.append(
            f"Incomplete study: {len(records)} of {n_expected} runs finished; numbers will change."
        )
    name = f" — study {study!r}" if study else ""
    text = table2_markdown(
        table,
        per_dataset,
        title=f"Table 2: average normalized loss / worst in # / best in #{name}",
        notes=notes,
    )
    (out / "table2.md").write_text(text, encoding="utf-8")
    if plots:
        from initlab.study.plots import plot_study

        plot_study(records, per_dataset, out / "plots", window=window)
    return table


def _write_csv(path: Path, rows: Rows) -> None:
    import csv

    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=rows.columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})
