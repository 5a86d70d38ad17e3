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

Which "final training loss" (``loss=``): ``"full_pass"``, the mean cross-entropy of a full pass
over the training split after the last epoch (``final_train_loss``), or
``"last_epoch_minibatch"``, the mean of the last epoch's minibatch losses
(``last_epoch_minibatch_loss``); the paper does not say which it used.

Confidence intervals, paired comparisons against geometric and the sensitivity table over protocol
variants: :mod:`initlab.study.bootstrap` and :func:`sensitivity_table`; the report with all of
them, per variant: :func:`report_study`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from initlab._core.rows import Rows
from initlab.study._stats import quantile
from initlab.study.config import LOSS_MEASURES

__all__ = [
    "INIT_COST_COLUMNS",
    "LR_COLUMNS",
    "PAPER_N_DATASETS",
    "PAPER_TABLE2",
    "PER_DATASET_COLUMNS",
    "SENSITIVITY_COLUMNS",
    "TABLE2_COLUMNS",
    "grid_edges",
    "init_cost_table",
    "init_cost_text",
    "lr_table",
    "per_dataset_table",
    "quantile",
    "run_loss",
    "sensitivity_table",
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
    "n_lrs",
    "lr_at_grid_edge",
    "grid_edge",
)
TABLE2_COLUMNS = ("scheme", "avg_normalized_loss", "worst_in", "best_in", "n_datasets")
#: :func:`init_cost_table`: per scheme (an init), the mean over its runs of what the init cost.
INIT_COST_COLUMNS = (
    "scheme",
    "n_runs",
    "init_wall_s",
    "init_forward_passes",
    "init_backward_passes",
    "init_examples",
)
SENSITIVITY_COLUMNS = (
    "variant",
    "scheme",
    "avg_normalized_loss",
    "avg_lo",
    "avg_hi",
    "rank",
    "p_first",
    "worst_in",
    "best_in",
    "n_datasets",
)


def _loss_column(loss: str) -> str:
    if loss not in LOSS_MEASURES:
        raise ValueError(f"loss must be one of {tuple(LOSS_MEASURES)}, got {loss!r}")
    return LOSS_MEASURES[loss]


def run_loss(record: Mapping[str, Any], loss: str = "full_pass") -> float:
    """A run's loss for the aggregation: its ``final_train_loss`` (``loss="full_pass"``) or
    ``last_epoch_minibatch_loss``, or ``+inf`` if it diverged or is not finite."""
    value = record.get(_loss_column(loss))
    if record.get("diverged") or value is None or not math.isfinite(float(value)):
        return math.inf
    return float(value)


def lr_table(records: Iterable[Mapping[str, Any]], loss: str = "full_pass") -> Rows:
    """Per data set, scheme and learning rate: the median and quartiles over seeds of the loss.

    Args:
        records: runs with ``dataset, scheme, lr, diverged`` and the loss column (e.g.
            :meth:`initlab.study.store.Store.records`).
        loss: which training loss (module docstring).

    Returns:
        :class:`~initlab.Rows` with :data:`LR_COLUMNS`, sorted by data set, scheme, rate.
    """
    column = _loss_column(loss)
    cells: dict[tuple[str, str, float], list[float]] = {}
    for r in records:
        if column not in r:
            raise ValueError(f"a run's record has no {column!r} (loss={loss!r}): use Store.records")
        cells.setdefault((r["dataset"], r["scheme"], float(r["lr"])), []).append(run_loss(r, loss))
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


def per_dataset_table(records: Iterable[Mapping[str, Any]], loss: str = "full_pass") -> Rows:
    """Per data set and scheme: the best learning rate, its median/quartile loss, normalized loss.

    ``normalized`` is ``None`` on data sets where some scheme of the study has no results, or
    where every scheme diverged at every rate (:func:`diverged_everywhere`; tied at 1 they would
    read as equally good).
    ``lr_at_grid_edge`` flags a best rate at the smallest or largest of the ``n_lrs`` rates tried
    for that data set and scheme (the grid may be too narrow there); ``grid_edge`` says which:
    ``"top"``, ``"bottom"`` or ``""``.

    Returns:
        :class:`~initlab.Rows` with :data:`PER_DATASET_COLUMNS`, sorted by data set, scheme.
    """
    by_lr = lr_table(records, loss).to_rows()
    cells: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in by_lr:
        cells.setdefault((row["dataset"], row["scheme"]), []).append(row)
    schemes = sorted({s for _, s in cells})
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for key, rows in cells.items():
        # lowest median; ties → the smaller learning rate (rows are sorted by lr)
        choice = min(rows, key=lambda row: row["median_loss"])
        lrs = [row["lr"] for row in rows]
        edge = ""
        if len(lrs) > 1 and choice["lr"] in (min(lrs), max(lrs)):
            edge = "top" if choice["lr"] == max(lrs) else "bottom"
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
            "n_lrs": len(lrs),
            "lr_at_grid_edge": bool(edge),
            "grid_edge": edge,
        }
    for dataset in sorted({d for d, _ in cells}):
        if not all((dataset, s) in best for s in schemes):
            continue
        losses = {s: best[dataset, s]["median_loss"] for s in schemes}
        if all(math.isinf(v) for v in losses.values()):
            continue  # every scheme diverged at every rate: no comparison (left out)
        worst = max(losses.values())
        for s, loss in losses.items():
            best[dataset, s]["normalized"] = _normalize(loss, worst)
    rows = [best[key] for key in sorted(best)]
    return Rows(rows, PER_DATASET_COLUMNS, title="best learning rate per data set and scheme")


def diverged_everywhere(per_dataset: Rows | Iterable[Mapping[str, Any]]) -> list[str]:
    """The data sets on which every scheme diverged (or ended non-finite) at every rate tried:
    left out of Table 2, as nothing there tells the schemes apart (smaller rates would)."""
    losses: dict[str, list[float]] = {}
    for r in per_dataset:
        losses.setdefault(r["dataset"], []).append(r["median_loss"])
    return sorted(d for d, values in losses.items() if all(math.isinf(v) for v in values))


def grid_edges(per_dataset: Rows | Iterable[Mapping[str, Any]]) -> list[tuple[str, str, str]]:
    """``(dataset, scheme, "top" | "bottom")`` of every best learning rate at the grid's edge."""
    return [(r["dataset"], r["scheme"], r["grid_edge"]) for r in per_dataset if r["grid_edge"]]


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
    diverged = diverged_everywhere(per_dataset)
    incomplete = sorted(
        {r["dataset"] for r in per_dataset if r["normalized"] is None} - set(diverged)
    )
    if incomplete:
        lines += ["", f"Left out (not every scheme has results): {', '.join(incomplete)}."]
    if diverged:
        lines += [
            "",
            "Left out (every scheme diverged at every learning rate, in at least half its "
            f"seeds: an infinite median; try smaller rates): "
            f"{', '.join(diverged)}.",
        ]
    lines += [f"\n{note}" for note in notes]
    lines += ["", "## Per data set", "", per_dataset.to_markdown()]
    return "\n".join(lines) + "\n"


def init_cost_table(records: Iterable[Mapping[str, Any]]) -> Rows:
    """Per scheme (an init, :mod:`initlab.study.pipelines`): the mean over its runs of the init's
    wall time, forward and backward passes and examples read (the ``init_*`` record columns).

    A data-free init has no data cost: its row holds 0 passes and examples and ``None`` for the
    wall time (not measured: a draw of the weights, negligible next to training).

    Returns:
        :class:`~initlab.Rows` with :data:`INIT_COST_COLUMNS`, sorted by scheme.
    """
    runs: dict[str, list[Mapping[str, Any]]] = {}
    for r in records:
        runs.setdefault(r["scheme"], []).append(r)
    rows = []
    for scheme, rs in sorted(runs.items()):
        row: dict[str, Any] = {"scheme": scheme, "n_runs": len(rs)}
        for column in INIT_COST_COLUMNS[2:]:
            values = [float(r[column]) for r in rs if r.get(column) is not None]
            if values:
                row[column] = math.fsum(values) / len(values)
            else:
                row[column] = None if column == "init_wall_s" else 0.0
        rows.append(row)
    return Rows(rows, INIT_COST_COLUMNS, title="init cost per run (mean over runs)")


def init_cost_text(row: Mapping[str, Any] | None) -> str:
    """A cost row as ``"1.23 s, 12 fwd / 10 bwd"``; ``"data-free"`` without data passes."""
    if row is None or row.get("init_wall_s") is None:
        return "data-free"
    return (
        f"{row['init_wall_s']:.3g} s, {row['init_forward_passes']:.3g} fwd / "
        f"{row['init_backward_passes']:.3g} bwd"
    )


def sensitivity_table(tables: Mapping[str, Rows | Iterable[Mapping[str, Any]]]) -> Rows:
    """Variant × scheme: the average normalized loss with its interval, and the rank.

    Args:
        tables: ``{variant: Table 2 with intervals}``
            (:func:`initlab.study.bootstrap.table2_intervals` of each variant's runs).

    Returns:
        :class:`~initlab.Rows` with :data:`SENSITIVITY_COLUMNS`, by variant (in the given order),
        then rank.
    """
    rows = []
    for variant, table in tables.items():
        for r in sorted(table, key=lambda r: (r["rank"], r["scheme"])):
            rows.append({"variant": variant, **{c: r[c] for c in SENSITIVITY_COLUMNS[1:]}})
    return Rows(rows, SENSITIVITY_COLUMNS, title="sensitivity: average normalized loss per variant")


def __getattr__(name: str) -> Any:
    # report_study lives in initlab.study.report (it imports this module); the old import path
    # `initlab.study.aggregate.report_study` still works.
    if name == "report_study":
        from initlab.study.report import report_study

        return report_study
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
