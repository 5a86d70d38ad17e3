"""The study report (``initlab bench report``): :func:`report_study`.

Per protocol variant of the study (:mod:`initlab.study.variants`; a study without variants is the
one variant ``"base"``), from that variant's runs and its ``loss`` measure:

- Table 2 (:mod:`initlab.study.aggregate`) with two-level bootstrap intervals, the rank and the
  share of replicates in which each scheme comes first (:func:`~initlab.study.bootstrap.
  table2_intervals`);
- every scheme paired against the reference scheme (geometric), by data set and seed: the
  reference's win rate and the mean difference of normalized losses, with intervals
  (:func:`~initlab.study.bootstrap.paired_comparisons`);
- the best learning rates at the edge of the grid (``top``/``bottom``);
- what each init cost per run (:func:`~initlab.study.aggregate.init_cost_table`: wall time,
  forward/backward passes of a data-dependent init), in a column beside its loss;

and across variants the **sensitivity table**: variant × scheme → average normalized loss
[interval] and rank (:func:`~initlab.study.aggregate.sensitivity_table`).

Files written to ``out_dir``:

``report.html``
    everything above on one self-contained page, with the plots embedded;
``table2.md``
    the same as Markdown (the paper's numbers beside ours);
``sensitivity.csv``, ``table2.csv``, ``paired.csv``, ``per_dataset.csv``, ``per_lr.csv``,
``init_cost.csv``
    the tables, each with a ``variant`` column;
``runs.csv``
    one row per stored run of the study;
``plots/sensitivity.png``, ``plots/<variant>/*.png``
    the sensitivity figure, and per variant :func:`initlab.study.plots.plot_study`'s plots;
``.initlab-report.json``
    the list of these files. A report replaces an earlier one in the same folder: the files of
    that one's list it does not write again (its plots, after ``plots=False``, or those of
    other variants) are removed; other files in the folder are left as they are
    (:mod:`initlab.study.report_files`).
"""

from __future__ import annotations

import csv
import html
import math
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from initlab._core.knobs import user_stacklevel
from initlab._core.rows import Rows
from initlab.study.aggregate import (
    PAPER_N_DATASETS,
    PAPER_TABLE2,
    diverged_everywhere,
    grid_edges,
    init_cost_table,
    init_cost_text,
    lr_table,
    per_dataset_table,
    sensitivity_table,
    table2,
)
from initlab.study.bootstrap import (
    check_bootstrap,
    loss_cubes,
    paired_comparisons,
    table2_intervals,
)
from initlab.study.report_files import report_folder
from initlab.study.report_html import ci_text, html_image, html_page, html_table
from initlab.study.spec import StudySpec
from initlab.study.store import BASE_VARIANT, Store

__all__ = ["VariantReport", "analyze_variant", "report_study", "study_to_report"]

#: Protocol keys shown for each variant.
_PROTOCOL_KEYS = ("optimizer", "momentum", "batch_size", "weight_decay", "epochs", "input_norm",
                  "output_scale", "model_cfg")  # fmt: skip


@dataclass
class VariantReport:
    """One variant's analysis (see the module docstring).

    Attributes:
        name: the variant.
        loss: the loss measure compared (``full_pass`` or ``last_epoch_minibatch``).
        protocol: the variant's protocol keys (from the registered spec; empty without one).
        n_finished: runs stored; ``n_expected``: runs registered for the variant.
        per_lr, per_dataset, table: :func:`~initlab.study.aggregate.lr_table`,
            :func:`~initlab.study.aggregate.per_dataset_table`, :func:`~initlab.study.aggregate.
            table2`.
        intervals: :func:`~initlab.study.bootstrap.table2_intervals`.
        paired: :func:`~initlab.study.bootstrap.paired_comparisons` (``None`` without the
            reference scheme).
        edges: :func:`~initlab.study.aggregate.grid_edges`.
        diverged: :func:`~initlab.study.aggregate.diverged_everywhere` (data sets left out).
        init_cost: :func:`~initlab.study.aggregate.init_cost_table`.
        paper_setting: every run is the paper's MLP (``paper_mlp``) on a LIBSVM data set, the
            setting of Defazio & Bottou's Table 2: only then do the reports set its figures
            beside the study's.
    """

    name: str
    loss: str
    protocol: dict[str, Any]
    n_finished: int
    n_expected: int
    per_lr: Rows
    per_dataset: Rows
    table: Rows
    intervals: Rows
    paired: Rows | None
    edges: list[tuple[str, str, str]] = field(default_factory=list)
    diverged: list[str] = field(default_factory=list)
    paper_setting: bool = False
    init_cost: Rows | None = None

    def cost_text(self, scheme: str) -> str:
        """The scheme's init cost per run, as :func:`~initlab.study.aggregate.init_cost_text`."""
        rows = list(self.init_cost.filter(scheme=scheme)) if self.init_cost is not None else []
        return init_cost_text(rows[0] if rows else None)


def analyze_variant(
    name: str,
    records: Sequence[dict[str, Any]],
    *,
    loss: str = "full_pass",
    protocol: dict[str, Any] | None = None,
    n_expected: int | None = None,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
    reference: str = "geometric",
) -> VariantReport:
    """All of one variant's tables from its runs' records (``Store.records``)."""
    per_dataset = per_dataset_table(records, loss)
    cubes = loss_cubes(records, loss)
    schemes = cubes[0].schemes if cubes else ()
    paired = None
    if reference in schemes:
        paired = paired_comparisons(
            cubes, reference=reference, n_boot=n_boot, seed=seed, level=level
        )
    return VariantReport(
        name=name,
        loss=loss,
        protocol=dict(protocol or {}),
        n_finished=len(records),
        n_expected=len(records) if n_expected is None else n_expected,
        per_lr=lr_table(records, loss),
        per_dataset=per_dataset,
        table=table2(per_dataset),
        intervals=table2_intervals(cubes, n_boot=n_boot, seed=seed, level=level),
        paired=paired,
        edges=grid_edges(per_dataset),
        diverged=diverged_everywhere(per_dataset),
        init_cost=init_cost_table(records),
        paper_setting=bool(records) and all(_paper_run(r) for r in records),
    )


def _paper_run(record: Mapping[str, Any]) -> bool:
    """Whether a run is in Table 2's setting: the paper's MLP on a LIBSVM data set."""
    return record.get("model") == "paper_mlp" and str(record.get("dataset", "")).startswith(
        "libsvm:"
    )


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", name)


def _variants(store: Store, study: str | None, loss: str | None) -> list[tuple[str, str, dict]]:
    """``(variant, loss, protocol)`` of each variant of the study, in registration order; the
    protocol's ``lrs`` is the spec's grid (a tuple; :func:`_lrs_of` says it with the records)."""
    if study is None:
        return [(BASE_VARIANT, loss or "full_pass", {})]
    try:
        flat = StudySpec.from_dict(store.studies()[study]).variant_specs()
    except (ValueError, TypeError):  # a spec this version cannot read: report without it
        flat = {}
    out = []
    for name in store.variants(study):
        spec = flat.get(name)
        protocol = {k: v for k, v in spec.to_dict().items() if k in _PROTOCOL_KEYS} if spec else {}
        if spec is not None:
            protocol["lrs"] = tuple(spec.lrs)
        out.append((name, loss or (spec.loss if spec else "full_pass"), protocol))
    return out


def _lrs_of(protocol: dict[str, Any], records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``protocol`` with its ``lrs`` (the spec's grid) as text, followed by the rates that grid
    extension added (``--extend-grid``), so that every best rate shown is in the stated grid."""
    if "lrs" not in protocol:
        return protocol
    grid = protocol["lrs"]
    added = sorted({float(r["lr"]) for r in records} - {float(lr) for lr in grid}, reverse=True)
    text = _lrs_text(grid)
    if added:
        rates = ", ".join(f"{lr:g}" for lr in added)
        text += f" (the spec's) + {rates} (added by grid extension, where a best rate sat at the "
        text += "grid's edge)"
    return {**protocol, "lrs": text}


def _lrs_text(lrs: Sequence[float]) -> str:
    exps = [math.log2(lr) for lr in lrs]
    if all(e.is_integer() for e in exps) and len(lrs) > 2:
        return f"2^{int(max(exps))} .. 2^{int(min(exps))} ({len(lrs)} rates)"
    return ", ".join(f"{lr:g}" for lr in lrs)


def study_to_report(store_path: str | Path, study: str | None = None) -> str | None:
    """The study a report of ``store_path`` covers: ``study`` if the store has it, else the
    store's only study; ``None`` for a store whose runs belong to no registered study (they are
    reported as one variant, when they share one protocol).

    Raises:
        FileNotFoundError: no store at ``store_path``.
        ValueError: no study ``study`` in the store; or ``study`` is ``None`` and the store holds
            several studies (each with its own protocol: a report never pools them as if their
            runs were seeds of one), or unregistered runs of several protocols.
    """
    if not Path(store_path).is_file():
        raise FileNotFoundError(f"no study store at {store_path}")
    with Store(store_path, read_only=True) as store:
        return _study_of(store, study, store_path)


#: The run-config fields that are not the study's grid (data set, scheme, seed, learning rate):
#: runs that differ in one of them follow different protocols.
_PROTOCOL_COLUMNS = ("model", "model_cfg", "optimizer", "momentum", "weight_decay", "epochs",
                     "batch_size", "output_std", "input_norm")  # fmt: skip


def _study_of(store: Store, study: str | None, store_path: str | Path) -> str | None:
    """:func:`study_to_report` on an open store."""
    studies = store.studies()
    if study is not None:
        if study not in studies:
            names = ", ".join(map(repr, studies)) if studies else "none"
            raise ValueError(f"no study {study!r} in {store_path}; its studies: {names}")
        return study
    if len(studies) == 1:
        return next(iter(studies))
    if studies:
        names = ", ".join(map(repr, studies))
        raise ValueError(
            f"{store_path} holds {len(studies)} studies ({names}), each with its own protocol; "
            "a report covers one study, so that runs of different protocols are never pooled "
            "as seeds of one: pass study= with one of these names"
        )
    protocols = {tuple(r[c] for c in _PROTOCOL_COLUMNS) for r in store.records()}
    if len(protocols) > 1:
        raise ValueError(
            f"{store_path} holds runs of {len(protocols)} protocols (they differ in "
            f"{', '.join(_differing(protocols))}) and no registered study to tell them apart; "
            "a report pools the runs of one protocol only: store each protocol's runs in its "
            "own store, or run them as studies (initlab.study.run_study)"
        )
    return None


def _differing(protocols: set[tuple[Any, ...]]) -> list[str]:
    """The protocol columns on which ``protocols`` disagree."""
    return [c for i, c in enumerate(_PROTOCOL_COLUMNS) if len({p[i] for p in protocols}) > 1]


def report_study(
    store_path: str | Path,
    out_dir: str | Path,
    *,
    study: str | None = None,
    plots: bool = True,
    window: int | None = None,
    loss: str | None = None,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
    reference: str = "geometric",
) -> Rows:
    """Write a study's report (module docstring) and return its sensitivity table.

    Args:
        store_path: the study store.
        out_dir: output folder (created). The report is written whole or not at all
            (:func:`~initlab.study.report_files.report_folder`): one that fails leaves the
            folder as it found it; one that succeeds removes the files an earlier report there
            wrote and it does not (module docstring), and no other file.
        study: the study's name; ``None``: the only study in the store, or all its runs as one
            variant when none is registered and they share one protocol
            (:func:`study_to_report`: a store of several studies needs ``study``).
        plots: draw the plots (needs matplotlib); the HTML page is written either way.
        window: sliding-window length for the training-loss curves (default: see
            :func:`initlab.study.plots.plot_loss_curves`).
        loss: compare this loss in every variant instead of each variant's own ``loss``.
        n_boot, seed, level: the bootstrap's replicates (>= 1), seed (an integer >= 0, for
            ``numpy.random.default_rng``) and interval coverage (in (0, 1)).
        reference: the scheme the others are paired against.

    Returns:
        :func:`~initlab.study.aggregate.sensitivity_table` rows: per variant and scheme, the
        average normalized loss, its interval, rank, worst/best counts.

    Raises:
        ValueError: ``study`` is not given and the store holds several studies (or unregistered
            runs of several protocols): :func:`study_to_report`; or ``n_boot``, ``seed`` or
            ``level`` out of range (:func:`~initlab.study.bootstrap.check_bootstrap`), checked
            before anything is written.

    Warns:
        UserWarning: a variant has unfinished runs, or data sets were left out because every
            scheme diverged at every rate there (the report's text says so too).
    """
    check_bootstrap(n_boot=n_boot, seed=seed, level=level)  # before any file is written
    if not Path(store_path).is_file():
        raise FileNotFoundError(f"no study store at {store_path}")
    boot = {"n_boot": n_boot, "seed": seed, "level": level, "reference": reference}
    with Store(store_path, read_only=True) as store:  # a report writes nothing to the store
        study = _study_of(store, study, store_path)
        if not store.keys(study):  # before the folder is made
            raise ValueError(
                f"{store_path} holds no finished runs" + (f" of {study!r}" if study else "")
            )
        with report_folder(Path(out_dir)) as out:  # a failed report writes nothing
            store.to_csv(out / "runs.csv", study)
            reports, plot_files = _analyze(store, study, out, loss, boot, plots, window)
            if not reports:  # finished runs, none in a variant's protocol
                raise ValueError(
                    f"{store_path} holds no finished runs" + (f" of {study!r}" if study else "")
                )
            return _write_report(out, study, reports, boot, (plots, plot_files))


def _analyze(
    store: Store,
    study: str | None,
    out: Path,
    loss: str | None,
    boot: dict[str, Any],
    plots: bool,
    window: int | None,
) -> tuple[list[VariantReport], dict[str, list[Path]]]:
    """Every variant's :class:`VariantReport` and, with ``plots``, the files of its plots."""
    reports: list[VariantReport] = []
    plot_files: dict[str, list[Path]] = {}
    keys = store.variants(study) if study is not None else {}
    for name, measure, protocol in _variants(store, study, loss):
        records = store.records(study, variant=name if study else None, curves=plots)
        if not records:
            continue
        reports.append(analyze_variant(
            name, records, loss=measure, protocol=_lrs_of(protocol, records),
            n_expected=len(keys.get(name, records)), **boot,
        ))  # fmt: skip
        if plots:
            from initlab.study.plots import plot_study

            plot_files[name] = plot_study(
                records, reports[-1].per_dataset, out / "plots" / _safe(name), window=window
            )
    return reports, plot_files


def _write_report(
    out: Path,
    study: str | None,
    reports: list[VariantReport],
    boot: dict[str, Any],
    plotted: tuple[bool, dict[str, list[Path]]],
) -> Rows:
    """Warn of what the tables stand on, write the tables, the sensitivity figure, the Markdown
    and the HTML page; return the sensitivity table."""
    plots, plot_files = plotted
    reference = boot["reference"]
    _warn_partial(reports)
    schemes = _schemes(reports)
    if reference not in schemes:
        warnings.warn(
            f"no runs of the reference scheme {reference!r} in the study, so no paired "
            f"comparisons; pass reference= one of {', '.join(schemes)}",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    sensitivity = sensitivity_table({r.name: r.intervals for r in reports})
    _write_tables(out, reports, sensitivity)
    sens_plots = []
    if plots and len(sensitivity):
        from initlab.study.plots import plot_sensitivity

        sens_plots.append(plot_sensitivity(sensitivity, out / "plots" / "sensitivity.png"))
    setting = (f"{boot['n_boot']} two-level bootstrap replicates (seed {boot['seed']}), "
               f"{boot['level']:.0%} intervals")  # fmt: skip
    (out / "table2.md").write_text(
        _markdown(study, reports, sensitivity, setting, reference), encoding="utf-8"
    )
    (out / "report.html").write_text(
        _html(study, reports, sensitivity, setting, reference, (sens_plots, plot_files), out),
        encoding="utf-8",
    )
    return sensitivity


def _warn_partial(reports: Sequence[VariantReport]) -> None:
    """Warn where the tables stand on less than they seem to: a variant with unfinished runs, and
    data sets left out because every scheme diverged at every rate (their schemes all tie)."""
    for r in reports:
        where = f"variant {r.name!r}: " if len(reports) > 1 else ""
        if r.n_finished < r.n_expected:
            warnings.warn(
                f"{where}incomplete: {r.n_finished} of {r.n_expected} runs finished; the tables "
                "cover the finished ones (run the study again to finish it)",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        if r.diverged:
            warnings.warn(
                f"{where}left out {', '.join(r.diverged)}: every scheme diverged at every learning "
                "rate there (its median loss was infinite: at least half its seeds diverged), so "
                "nothing tells them apart (add smaller rates)",
                UserWarning,
                stacklevel=user_stacklevel(),
            )


# -- files --------------------------------------------------------------------------------------


def _write_csv(path: Path, rows: Rows | list[dict[str, Any]], columns: Sequence[str]) -> None:
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(columns))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})


def _with_variant(reports: Sequence[VariantReport], attr: str) -> tuple[list[dict], list[str]]:
    rows, columns = [], ["variant"]
    for r in reports:
        table = getattr(r, attr)
        if table is None:
            continue
        columns = ["variant", *table.columns]
        rows += [{"variant": r.name, **row} for row in table]
    return rows, columns


def _write_tables(out: Path, reports: Sequence[VariantReport], sensitivity: Rows) -> None:
    _write_csv(out / "sensitivity.csv", sensitivity, sensitivity.columns)
    for name, attr in (("table2", "intervals"), ("paired", "paired"),
                       ("per_dataset", "per_dataset"), ("per_lr", "per_lr"),
                       ("init_cost", "init_cost")):  # fmt: skip
        rows, columns = _with_variant(reports, attr)
        _write_csv(out / f"{name}.csv", rows, columns)


# -- Markdown -----------------------------------------------------------------------------------


def _wide_sensitivity(sensitivity: Rows) -> tuple[list[str], list[list[str]]]:
    """Variant rows × scheme columns of ``"avg [lo, hi] #rank"`` cells."""
    schemes = sorted({r["scheme"] for r in sensitivity})
    cells: dict[str, dict[str, str]] = {}
    for r in sensitivity:
        text = ci_text(r["avg_normalized_loss"], r["avg_lo"], r["avg_hi"])
        cells.setdefault(r["variant"], {})[r["scheme"]] = f"{text} #{r['rank']}"
    body = [[v, *(row.get(s, "-") for s in schemes)] for v, row in cells.items()]
    return ["variant", *schemes], body


def _summary_lines(r: VariantReport, reference: str) -> list[str]:
    """Plain statements read off the tables: who ranks first, where the reference stands, which
    paired differences exclude 0."""
    rows = list(r.intervals)
    left = (
        [
            f"Left out {', '.join(r.diverged)}: every scheme diverged at every learning rate there "
            "(its median loss was infinite: at least half its seeds diverged)."
        ]
        if r.diverged
        else []
    )
    if not rows:
        return [*left, "No data set compares every scheme yet."]
    first = [x["scheme"] for x in rows if x["rank"] == 1]
    lines = [f"Lowest average normalized loss: {', '.join(first)}."]
    ref = next((x for x in rows if x["scheme"] == reference), None)
    if ref is not None:
        worst = _count_text(ref["worst_in"], ref["worst_lo"], ref["worst_hi"])
        best = _count_text(ref["best_in"], ref["best_lo"], ref["best_hi"])
        lines.append(
            f"{reference}: rank {ref['rank']} of {len(rows)}, worst in {worst} and best in {best} "
            f"of {ref['n_datasets']} data sets; first in {ref['p_first']:.0%} of the bootstrap "
            "replicates."
        )
    for p in r.paired.filter(dataset="all") if r.paired is not None else []:
        lo, hi = p["diff_lo"], p["diff_hi"]
        wins = ci_text(p["ref_win_rate"], p["win_lo"], p["win_hi"])
        lines.append(
            f"{p['scheme']} − {reference}: mean normalized difference "
            f"{ci_text(p['mean_diff'], lo, hi)}, {reference} wins {wins} of pairs: "
            f"{_paired_verdict(p, reference)}."
        )
    return lines + left


def _count_text(count: int, lo: float, hi: float) -> str:
    """``"2 [0, 5]"``: a worst-in or best-in count with its interval (the count alone where the
    interval is missing)."""
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (lo, hi)):
        return str(count)
    return f"{count} [{lo:.0f}, {hi:.0f}]"


def _paired_verdict(p: Mapping[str, Any], reference: str) -> str:
    """What the two intervals of a paired row say together: the mean difference's (positive:
    ``reference`` better) and the win rate's (above 0.5: ``reference`` wins more pairs)."""
    lo, hi, win_lo, win_hi = p["diff_lo"], p["diff_hi"], p["win_lo"], p["win_hi"]
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return (
            f"undefined ({p['n_left_out']} of {p['n_pairs']} pairs left out: a loss that is "
            "infinite or missing in both, or too few bootstrap replicates with a finite difference)"
        )
    by_mean = reference if lo > 0 else p["scheme"] if hi < 0 else None
    by_wins = reference if win_lo > 0.5 else p["scheme"] if win_hi < 0.5 else None
    if by_mean is not None and by_wins is not None and by_mean != by_wins:
        return (
            f"mixed ({by_mean} better on the mean difference, {by_wins} wins more pairs, both "
            "beyond their intervals)"
        )
    if by_mean is not None:
        return f"{by_mean} better" + ("" if by_wins else " (the win rate within its interval)")
    if by_wins is not None:
        return (
            f"{by_wins} wins more pairs (beyond the win rate's interval; the mean difference "
            "within its own)"
        )
    return "no difference beyond either interval"


def _paper_cell(paper: tuple[float, int, int] | None) -> str:
    return f"{paper[0]:.2f} / {paper[1]} / {paper[2]}" if paper else "-"


def _variant_markdown(r: VariantReport, reference: str) -> list[str]:
    lines = [f"## Variant `{r.name}`", ""]
    if r.protocol:
        lines += [f"Protocol: {_protocol_text(r.protocol)}.", ""]
    lines += [f"Loss compared: `{r.loss}`.", ""]
    if r.n_finished < r.n_expected:
        lines += [f"Incomplete: {r.n_finished} of {r.n_expected} runs finished.", ""]
    lines += [
        "| scheme | avg normalized loss [CI] | init cost per run | rank | P(first) "
        "| worst in # [CI] | best in # [CI] | data sets |"
        + (f" paper ({PAPER_N_DATASETS} sets): avg / worst / best |" if r.paper_setting else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if r.paper_setting else ""),
    ]
    for x in r.intervals:
        paper = PAPER_TABLE2.get(x["scheme"])
        lines.append(
            f"| {x['scheme']} | {ci_text(x['avg_normalized_loss'], x['avg_lo'], x['avg_hi'])} | "
            f"{r.cost_text(x['scheme'])} | {x['rank']} | {x['p_first']:.2f} | "
            f"{ci_text(x['worst_in'], x['worst_lo'], x['worst_hi'])} | "
            f"{ci_text(x['best_in'], x['best_lo'], x['best_hi'])} | {x['n_datasets']} |"
            + ("" if not r.paper_setting else f" {_paper_cell(paper)} |")
        )
    lines += ["", *(f"- {line}" for line in _summary_lines(r, reference)), ""]
    if r.edges:
        cells = ", ".join(f"{d}/{s} ({e})" for d, s, e in r.edges)
        lines += [f"Best learning rate at the edge of the grid: {cells}.", ""]
    if r.paired is not None:
        lines += [r.paired.to_markdown(), ""]
    lines += [r.per_dataset.to_markdown(), ""]  # its own title: a heading of its own
    return lines


#: How a protocol key reads in a report (the spec's ``input_norm`` is the data's, beside a
#: model's own ``input_norm`` in its ``model_cfg``).
_PROTOCOL_LABELS = {"input_norm": "data input_norm"}


def _protocol_text(protocol: Mapping[str, Any]) -> str:
    """``key value; ...`` with values in YAML's flow style (``{widths: [384, 64]}``,
    ``true``), not Python's reprs."""
    return "; ".join(f"{_PROTOCOL_LABELS.get(k, k)} {_flow(v)}" for k, v in protocol.items())


def _flow(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return "none" if value is None else str(value)


def _schemes(reports: Sequence[VariantReport]) -> list[str]:
    return sorted({row["scheme"] for r in reports for row in r.per_dataset})


def _paper_text(reports: Sequence[VariantReport]) -> str:
    """How the study stands to Defazio & Bottou's Table 2."""
    if reports and all(r.paper_setting for r in reports):
        return (
            f"The paper used {PAPER_N_DATASETS} LIBSVM data sets (it does not list them): a "
            "partial reproduction."
        )
    return (
        "Not Table 2's setting in every variant (the paper's MLP, paper_mlp, on LIBSVM data "
        "sets): its figures are set beside a variant's only where every run is in that setting."
    )


def _paired_text(reports: Sequence[VariantReport], reference: str) -> str:
    if reference in _schemes(reports):
        return f"Paired comparisons against {reference}."
    return f"No paired comparisons (no runs of the reference scheme {reference})."


#: What the intervals' level means at a study's size (:mod:`initlab.study.bootstrap`).
_COVERAGE = (
    "Their coverage is about nominal from some 6 data sets x 5 seeds, conservative above and too "
    "narrow below (78-96% at 2 x 2 to 3 x 3 data sets x seeds in a simulation): read a tiny "
    "study's intervals as rough."
)


def _markdown(
    study: str | None,
    reports: Sequence[VariantReport],
    sensitivity: Rows,
    setting: str,
    reference: str,
) -> str:
    head, body = _wide_sensitivity(sensitivity)
    lines = [
        f"# Table 2 per protocol variant — study {study!r}" if study else "# Table 2",
        "",
        f"Loss: median over seeds of the final training loss at each scheme's best learning rate, "
        "normalized by the worst scheme's on each data set (diverged runs count as +inf); "
        f"ties count for every tied scheme. Intervals: {setting} (data sets, then seeds within "
        f"each). {_COVERAGE} {_paired_text(reports, reference)} {_paper_text(reports)}",
        "",
        "## Sensitivity: average normalized loss [interval] #rank",
        "",
        "| " + " | ".join(head) + " |",
        "|---|" + "---:|" * (len(head) - 1),
        *("| " + " | ".join(row) + " |" for row in body),
        "",
    ]
    for r in reports:
        lines += _variant_markdown(r, reference)
    return "\n".join(lines)


# -- HTML ---------------------------------------------------------------------------------------


def _html_sensitivity(sensitivity: Rows) -> str:
    head, body = _wide_sensitivity(sensitivity)
    rows = [dict(zip(head, row, strict=True)) for row in body]

    def first(row: Any, col: str) -> str:
        return "first" if str(row.get(col, "")).endswith("#1") else ""

    return html_table(rows, head, cell_class=first)


def _html_variant(r: VariantReport, reference: str, images: Sequence[Path], out: Path) -> list[str]:
    esc = html.escape
    parts = [f"<h2 id='{esc(_safe(r.name))}'>Variant {esc(r.name)}</h2>"]
    if r.protocol:
        parts.append(f"<p class='note'>Protocol: {esc(_protocol_text(r.protocol))}.</p>")
    parts.append(f"<p class='note'>Loss compared: <b>{esc(r.loss)}</b>.</p>")
    if r.n_finished < r.n_expected:
        parts.append(f"<p><b>Incomplete</b>: {r.n_finished} of {r.n_expected} runs finished.</p>")
    rows = [
        {
            "scheme": x["scheme"],
            "avg normalized loss [CI]": ci_text(x["avg_normalized_loss"], x["avg_lo"], x["avg_hi"]),
            "init cost per run": r.cost_text(x["scheme"]),
            "rank": x["rank"],
            "P(first)": x["p_first"],
            "worst in # [CI]": ci_text(x["worst_in"], x["worst_lo"], x["worst_hi"]),
            "best in # [CI]": ci_text(x["best_in"], x["best_lo"], x["best_hi"]),
            "data sets": x["n_datasets"],
            **({"paper": _paper_cell(PAPER_TABLE2.get(x["scheme"]))} if r.paper_setting else {}),
        }
        for x in r.intervals
    ]
    parts.append(html_table(rows, cell_class=lambda row, c: "first" if row["rank"] == 1 else ""))
    parts.append("<ul>" + "".join(f"<li>{esc(s)}</li>" for s in _summary_lines(r, reference)))
    parts.append("</ul>")
    if r.edges:
        cells = ", ".join(f"{d}/{s} ({e})" for d, s, e in r.edges)
        parts.append(f"<p class='note'>Best learning rate at the grid's edge: {esc(cells)}.</p>")
    if r.paired is not None:
        parts.append(f"<h3>Paired against {esc(reference)}</h3>")
        parts.append(html_table(r.paired.filter(dataset="all")))
        parts.append("<details><summary>per data set</summary>")
        parts.append(html_table(r.paired) + "</details>")
    edge = lambda row, c: "edge" if c == "grid_edge" and row[c] else ""  # noqa: E731
    parts.append("<details><summary>per data set and scheme (best learning rate)</summary>")
    parts.append(html_table(r.per_dataset, cell_class=edge) + "</details>")
    parts.append("<details><summary>per learning rate</summary>")
    parts.append(html_table(r.per_lr) + "</details>")
    grid = [p for p in images if p.name == "iqr_all.png"]
    parts += [html_image(p, f"{r.name}: final losses") for p in grid]
    others = [p for p in images if p.name != "iqr_all.png"]
    if others:
        links = " ".join(
            f"<a href='{esc(p.relative_to(out).as_posix())}'>{esc(p.stem)}</a>" for p in others
        )
        parts.append(f"<p class='note'>Per data set plots: {links}</p>")
    return parts


def _html(
    study: str | None,
    reports: Sequence[VariantReport],
    sensitivity: Rows,
    setting: str,
    reference: str,
    plots: tuple[list[Path], dict[str, list[Path]]],
    out: Path,
) -> str:
    esc = html.escape
    sens_plots, plot_files = plots
    toc = " · ".join(f"<a href='#{esc(_safe(r.name))}'>{esc(r.name)}</a>" for r in reports)
    parts = [
        f"<p class='note'>Intervals: {esc(setting)}, resampling data sets and the seeds within "
        f"each. {esc(_COVERAGE)} {esc(_paired_text(reports, reference))} "
        f"{esc(_paper_text(reports))}</p>",
        f"<p>Variants: {toc}</p>",
        "<h2>Sensitivity: average normalized loss [interval] #rank</h2>",
        _html_sensitivity(sensitivity),
    ]
    parts += [html_image(p, "sensitivity") for p in sens_plots]
    for r in reports:
        parts += _html_variant(r, reference, plot_files.get(r.name, []), out)
    title = f"initlab bench report: study {study}" if study else "initlab bench report"
    return html_page(title, parts)
