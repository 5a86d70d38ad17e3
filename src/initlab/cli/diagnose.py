"""What ``initlab diagnose`` runs (:func:`diagnose_command`) and the demo's per-scheme diagnosis
(:func:`diagnose_demo`, :func:`compare_reports`): model and data specs from the command line,
then :func:`initlab.diagnose`."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from initlab._core.knobs import renamed_kwargs
from initlab._core.loss import make_loss
from initlab._core.rows import Rows
from initlab.cli.inputs import (
    has_targets,
    load_data_spec,
    load_loss,
    load_model_spec,
    load_named_data,
)
from initlab.diagnostics.diagnose import Progress, diagnose
from initlab.diagnostics.report import Report

__all__ = ["compare_reports", "diagnose_command", "diagnose_demo"]


@renamed_kwargs(batches="max_batches")
def diagnose_command(
    model_spec: str,
    data: str | None = None,
    loss: str | None = None,
    out: str | Path | None = None,
    *,
    model_kwargs: str | Mapping[str, Any] | None = None,
    init: str | None = None,
    batch_size: int = 64,
    max_batches: int = 4,
    seed: int = 0,
    data_dir: str | None = None,
    curvature: bool = False,
    plots: bool = True,
    progress: Progress | None = None,
    note: Callable[[str], None] | None = None,
    **options: Any,
) -> Report:
    """What ``initlab diagnose --model ... [--data ...] [--loss ...] [--out DIR]`` runs.

    Args:
        model_spec: ``"pkg.module:factory"``, ``"path/file.py:factory"`` or ``"zoo:NAME"`` (a
            model of :mod:`initlab.zoo`, whose input shape is then known; on a data set that
            ``initlab data`` lists, it takes its ``n_in``, ``in_channels`` and ``n_classes``
            from it, as in a study, unless ``model_kwargs`` gives them).
        data: ``None``/``"random"`` (standard normal inputs of the zoo model's input shape),
            ``"random:3x32x32"`` (that shape per example), ``"digits"`` (scikit-learn's digits,
            standardized), a data set that ``initlab data`` lists (``"libsvm:letter"`` or
            ``"letter"``, ``"mnist"``, ``"sklearn:iris"``; ``batch_size`` examples per batch
            drawn with ``seed``), a ``.pt`` file (a batch, a tuple ``(x, y)``, or a list of
            batches; a big batch is split into ``batch_size`` pieces), or ``"pkg.module:fn"``
            returning a batch or an iterable of batches.
        loss: a name of :data:`LOSSES` or ``"pkg.module:fn"`` (``fn(model, batch) -> scalar``);
            default ``"auto"`` for data with targets, ``"random_quadratic"`` without.
        out: a folder: ``report.html`` (self-contained), ``report.json``, ``report.md``,
            ``summary.txt`` are written there.
        model_kwargs: keyword arguments of the factory (a dict or a JSON object string).
        init: initialize first with this scheme (``initlab.init_model(model, init,
            generator=seed)``); default: keep the factory's initialization.
        batch_size: examples per batch (random data, digits, a big ``.pt`` batch).
        max_batches: at most this many batches of the data.
        seed: seeds the model's construction, the data, the init and the random loss.
        data_dir: the data root of the named data sets (default: see
            :func:`initlab.data.data_root`).
        curvature: also compute Hessian blocks and theory vs actual.
        plots: embed plots in the HTML (needs matplotlib).
        progress: called with a short message at each stage.
        note: called with a warning when ``batch_size`` is not used (the data is already
            batched).
        **options: passed to :func:`diagnose`.

    Returns:
        the report (also written to ``out``).
    """
    say = progress or (lambda _msg: None)
    named = None
    if model_spec.startswith("zoo:"):  # sized from a named data set, as in a study
        named = load_named_data(
            data, batch_size=batch_size, batches=max_batches, seed=seed, data_dir=data_dir
        )
    say(f"building the model {model_spec}" + (f" for {named.name}" if named else ""))
    model, shape = load_model_spec(model_spec, model_kwargs, seed=seed, data=named)
    if init is not None:
        from initlab.init.model import init_model

        say(f"initializing with {init!r} (seed {seed})")
        init_model(model, init, generator=seed)
    if named is not None:
        data_batches = named.batches
    else:
        say("loading data")
        data_batches = load_data_spec(
            data, shape, batch_size=batch_size, batches=max_batches, seed=seed,
            data_dir=data_dir, note=note,
        )  # fmt: skip
    targets = has_targets(data_batches[0])
    loss_name = loss or ("auto" if targets else "random_quadratic")
    loss_fn = load_loss(loss_name, seed=seed, targets=targets)
    name = model_spec[4:] if model_spec.startswith("zoo:") else model_spec
    report = diagnose(
        model,
        data_batches,
        loss_fn,
        max_batches=max_batches,
        curvature=curvature,
        name=name,
        progress=say,
        **options,
    )
    report.meta["command"] = {
        "model": model_spec, "data": data or "random", "loss": loss_name, "init": init,
        "batch_size": batch_size, "max_batches": max_batches, "seed": seed,
    }  # fmt: skip
    if out is not None:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        say(f"writing {folder}/report.html, report.json, report.md, summary.txt")
        report.save_html(folder / "report.html", plots=plots)
        (folder / "report.json").write_text(report.to_json(indent=1), encoding="utf-8")
        (folder / "report.md").write_text(report.to_markdown(), encoding="utf-8")
        (folder / "summary.txt").write_text(report.summary() + "\n", encoding="utf-8")
    return report


def compare_reports(reports: Mapping[str, Report]) -> Rows:
    """One row per report: γ and ν max/min over weights and the verdict counts.

    Columns: ``scheme, gamma_max_over_min, nu_max_over_min, ok, warn, bad, worst_layer`` (the
    layer the diagnosis judges worst: a ``bad`` one before a ``warn`` one, then the γ farthest
    from the median; ``""`` when every layer is ``ok``).
    """
    out = []
    for label, rep in reports.items():
        imb = rep.meta.get("imbalance", {})
        counts = {v: sum(1 for r in rep.layers if r["verdict"] == v) for v in ("ok", "warn", "bad")}
        out.append(
            {
                "scheme": label,
                "gamma_max_over_min": imb.get("gamma_max_over_min", math.nan),
                "nu_max_over_min": imb.get("nu_max_over_min", math.nan),
                **counts,
                "worst_layer": _worst_layer(rep),
            }
        )
    return Rows(out, title="conditioning by scheme (max/min over weights; 1 = balanced)")


def _worst_layer(rep: Report) -> str:
    """The layer with the worst verdict (the γ farthest from the median among equals), ``""``
    when none is ``warn`` or ``bad`` (the layer of the largest γ was shown, flagged or not)."""
    rank = {"bad": 2, "warn": 1}
    flagged = [r for r in rep.layers if r["verdict"] in rank]

    def distance(r: Mapping[str, Any]) -> float:
        rel = r.get("gamma_rel_median")
        ok = isinstance(rel, float) and math.isfinite(rel) and rel > 0
        return abs(math.log(rel)) if ok else 0.0

    if not flagged:
        return ""
    return str(max(flagged, key=lambda r: (rank[r["verdict"]], distance(r)))["layer"])


def diagnose_demo(
    schemes: Sequence[str] = ("fan_in", "fan_out", "arithmetic", "geometric"),
    *,
    seed: int = 0,
    batch_size: int = 256,
    batches: int = 4,
    out: str | Path | None = None,
    progress: Progress | None = None,
) -> tuple[dict[str, Report], Rows]:
    """``initlab demo``'s diagnosis part: the paper MLP on digits, one report per scheme.

    Builds Defazio & Bottou's MLP (64 → 384 → 64 → 10, ReLU), initializes it with each scheme
    (``generator=seed``), and diagnoses it on ``batches`` batches of scikit-learn's digits with a
    cross-entropy loss. With ``out``: ``<scheme>.html`` per scheme and ``gamma_nu.png``, the
    schemes' γ and ν side by side.

    Returns:
        ``({scheme: report}, compare_reports(...))``.
    """
    from initlab.cli.demo import load_digits_tensors
    from initlab.init.model import init_model
    from initlab.zoo.paper_mlp import PaperMLP

    say = progress or (lambda _msg: None)
    x, y = load_digits_tensors()
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(x), generator=gen)
    data = [
        (x[perm[i : i + batch_size]], y[perm[i : i + batch_size]])
        for i in range(0, min(len(x), batch_size * batches), batch_size)
    ]
    reports: dict[str, Report] = {}
    for scheme in schemes:
        say(f"diagnosing the paper MLP initialized with {scheme!r}")
        model = PaperMLP(x.shape[1], 10)
        init_model(model, scheme, generator=seed)
        rep = diagnose(model, data, make_loss("cross_entropy"), max_batches=batches,
                       name=f"PaperMLP ({scheme})")  # fmt: skip
        rep.meta["scheme"] = scheme
        reports[scheme] = rep
    table = compare_reports(reports)
    if out is not None:
        from initlab.diagnostics.plots import plot_gamma_nu

        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        for scheme, rep in reports.items():
            rep.save_html(folder / f"{scheme}.html")
        plot_gamma_nu(reports).savefig(folder / "gamma_nu.png", dpi=110)
    return reports, table
