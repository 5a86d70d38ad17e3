"""Defazio & Bottou's Figure 3, CPU-scaled: the strided AlexNet on CIFAR-10 (JPEG copy).

The paper (seed text 000_*.txt, §8.1 and App. F) trains a strided AlexNet (max pooling replaced
by striding, circular padding) on CIFAR-10 for 300 epochs with SGD momentum 0.9, logits scaled to
std 0.05 after the first minibatch, a power-of-two learning-rate sweep and 10 seeds per scheme,
and plots each scheme's training loss, smoothed over a sliding window of 400 steps and averaged
over the seeds: fan-in, fan-out, arithmetic, geometric, and geometric with conditioning
multipliers for the kernel sizes ("preconditioned"), which comes out first by a small margin.

This script runs ``benchmarks/studies/figure3.yaml`` (a CPU-scaled version: a narrower network, a
class-balanced subset of the training images, a few epochs, 3 seeds; see the spec's comments) and
reports it:

* **window**: 400 steps of batch 128 on 50,000 images are one epoch (1.02); scaled, the window is
  one epoch of the subset (``steps_per_epoch`` steps), the trailing mean of the step losses;
* **best learning rate** per method: the lowest median over seeds of the final windowed loss (a
  diverged seed counts as ``+inf``), the criterion of the study's grid extension (the final
  windowed loss is the last epoch's minibatch mean, the spec's ``loss: last_epoch_minibatch``);
* **figure**: per method at its best rate, the seeds' mean windowed loss against the epoch, with
  the band from the lowest to the highest seed; beside it the final windowed loss against the
  learning rate (mean and seed range);
* **table** (``figure3.md``): per method its best rate, final windowed loss (mean, std, min-max
  over seeds), rank, and whether the first method's lead exceeds the seed spread.

Run (from the repository root)::

    nice -n 10 python benchmarks/figure3.py run      # trains into results/figure3.sqlite
    python benchmarks/figure3.py report              # writes benchmarks/results/figure3/

Data: the spec's ``data_root`` (default ``$INITLAB_DATA_DIR``, else ``../shared/data``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "benchmarks" / "studies" / "figure3.yaml"
STORE = REPO / "results" / "figure3.sqlite"
OUT = REPO / "benchmarks" / "results" / "figure3"
LABEL = "CIFAR-10 (JPEG copy), CPU-scaled"
#: Display order; "preconditioned" is geometric init with the kernel-size multipliers.
METHODS = ("fan_in", "fan_out", "arithmetic", "geometric", "preconditioned")


def method(record: dict[str, Any]) -> str:
    """A run's method: its scheme, or ``"preconditioned"`` for geometric with multipliers."""
    cfg = record["model_cfg"]
    cfg = json.loads(cfg) if isinstance(cfg, str) else cfg
    if cfg.get("conditioning"):
        return "preconditioned" if record["scheme"] == "geometric" else f"{record['scheme']}+cm"
    return record["scheme"]


def windowed(step_loss: list[float], window: int) -> np.ndarray:
    """Trailing mean of the step losses over ``window`` steps (fewer at the start); a non-finite
    loss (divergence) makes every later value ``+inf``."""
    losses = np.asarray(step_loss, dtype=np.float64)
    bad = ~np.isfinite(losses)
    losses = np.where(bad, 0.0, losses)
    sums = np.cumsum(losses)
    ends = np.arange(1, len(losses) + 1)
    starts = np.maximum(ends - window, 0)
    out = (sums - np.concatenate([[0.0], sums])[starts]) / (ends - starts)
    if bad.any():
        out[int(np.argmax(bad)) :] = np.inf
    return out


def _finite_or_nan(values: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(values), values, np.nan)


def summarize(records: list[dict[str, Any]], window: int) -> dict[str, Any]:
    """Per method and learning rate: the seeds' windowed curves and final windowed losses."""
    curves: dict[str, dict[float, list[np.ndarray]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        curves[method(r)][float(r["lr"])].append(windowed(r["step_loss"], window))
    best: dict[str, dict[str, Any]] = {}
    sweep: dict[str, dict[float, list[float]]] = {}
    for name, by_lr in curves.items():
        finals = {lr: [float(c[-1]) for c in cs] for lr, cs in by_lr.items()}
        sweep[name] = finals
        median = {lr: statistics.median(v) for lr, v in finals.items()}  # inf: diverged
        lr = min(median, key=lambda k: (median[k], k))
        best[name] = {"lr": lr, "finals": finals[lr], "curves": np.stack(by_lr[lr])}
    return {"best": best, "sweep": sweep}


def table(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per method, best first."""
    rows = []
    for name, b in summary["best"].items():
        f = b["finals"]
        finite = all(map(math.isfinite, f))
        rows.append(
            {
                "method": name,
                "best_lr": b["lr"],
                "median": statistics.median(f),
                "mean": statistics.fmean(f) if finite else math.inf,
                "std": statistics.stdev(f) if finite and len(f) > 1 else math.nan,
                "min": min(f),
                "max": max(f),
                "seeds": len(f),
            }
        )
    rows.sort(key=lambda r: (r["median"], r["mean"]))
    for rank, row in enumerate(rows, 1):
        row["rank"] = rank
    return rows


def plot(summary: dict[str, Any], steps_per_epoch: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_lr) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = [m for m in METHODS if m in summary["best"]]
    names += sorted(set(summary["best"]) - set(names))
    for name in names:
        b = summary["best"][name]
        c = _finite_or_nan(b["curves"])
        epochs = np.arange(1, c.shape[1] + 1) / steps_per_epoch
        extra = name not in METHODS  # multipliers with another scheme: dashed, beside the paper's
        (line,) = ax.plot(
            epochs,
            np.nanmean(c, axis=0),
            label=f"{name} (lr 2^{math.log2(b['lr']):g})",
            linestyle="--" if extra else "-",
            linewidth=1.0 if extra else 1.6,
        )
        ax.fill_between(
            epochs, np.nanmin(c, axis=0), np.nanmax(c, axis=0), color=line.get_color(), alpha=0.2
        )
        lrs = sorted(summary["sweep"][name])
        finals = [_finite_or_nan(np.asarray(summary["sweep"][name][lr])) for lr in lrs]
        ax_lr.errorbar(
            np.log2(lrs),
            [np.nanmean(f) if np.isfinite(f).any() else np.nan for f in finals],
            yerr=None,
            marker="o",
            ms=3,
            color=line.get_color(),
            linestyle="--" if extra else "-",
            label=name,
        )
        for x, f in zip(np.log2(lrs), finals, strict=True):
            if np.isfinite(f).any():
                ax_lr.vlines(x, np.nanmin(f), np.nanmax(f), color=line.get_color(), alpha=0.5)
    ax.set(
        xlabel="epoch",
        ylabel=f"training loss, window {steps_per_epoch} steps (1 epoch)",
        title=f"{title}: seed mean, min-max band",
    )
    ax.legend(fontsize="small")
    ax_lr.set(
        xlabel="log2 learning rate",
        ylabel="final windowed training loss",
        title="learning-rate sweep (seed mean, min-max)",
    )
    ax_lr.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt(v: float) -> str:
    return "inf" if math.isinf(v) else f"{v:.4f}"


def _verdict(rows: list[dict[str, Any]]) -> list[str]:
    """Who is first by the median and by the mean over seeds, whether its lead exceeds the seed
    spread, and whether it is preconditioning."""
    by_median = rows  # the table's order
    by_mean = sorted(rows, key=lambda r: r["mean"])
    lines = []
    for stat, order in (("median", by_median), ("mean", by_mean)):
        first, second = order[0], order[1]
        separated = first["max"] < second["min"]
        lines.append(
            f"- By the {stat} over seeds: **{first['method']}** first ({_fmt(first[stat])}), "
            f"{second['method']} second ({_fmt(second[stat])}); their seed ranges "
            + ("do not overlap." if separated else "overlap (the order is within the seed spread).")
        )
    precond = {
        stat: order[0]["method"] == "preconditioned"
        for stat, order in (("median", by_median), ("mean", by_mean))
    }
    rank = next(r["rank"] for r in rows if r["method"] == "preconditioned")
    answer = (
        "yes"
        if all(precond.values())
        else "no"
        if not any(precond.values())
        else "by the mean only"
    )
    lines.append(
        f"- Preconditioning comes out first: **{answer}** (rank {rank} of {len(rows)} by the "
        "median). Gaps between methods are smaller than the spread between seeds of one method."
    )
    return lines


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"# Figure 3, {LABEL}",
        "",
        meta["protocol"],
        "",
        f"Sliding window: {meta['window']} steps (one epoch of the subset; the paper's 400 steps "
        "at batch 128 are 1.02 epochs of CIFAR-10). Final windowed loss = the mean step loss "
        f"over the last epoch. {meta['wall']}",
        "",
        "| rank | method | best lr | final windowed loss: median | mean | std | min | max "
        "| seeds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rank']} | {r['method']} | 2^{math.log2(r['best_lr']):g} "
            f"| {_fmt(r['median'])} | {_fmt(r['mean'])} | {_fmt(r['std'])} | {_fmt(r['min'])} "
            f"| {_fmt(r['max'])} | {r['seeds']} |"
        )
    lines += ["", *_verdict(rows), "", "![figure 3](figure3.png)", ""]
    return "\n".join(lines)


def report(store_path: Path, out: Path, timing: str = "") -> list[dict[str, Any]]:
    from initlab.study.spec import StudySpec
    from initlab.study.store import Store

    spec = StudySpec.from_yaml(SPEC)
    with Store(store_path) as store:
        records = store.records(curves=True)
    records = [r for r in records if r["dataset"] in spec.datasets]
    if not records:
        raise SystemExit(f"{store_path}: no runs of {SPEC.name}; run the study first")
    n_steps = len(records[0]["step_loss"])
    steps_per_epoch = n_steps // int(spec.epochs)
    summary = summarize(records, steps_per_epoch)
    rows = table(summary)
    out.mkdir(parents=True, exist_ok=True)
    plot(summary, steps_per_epoch, out / "figure3.png", LABEL)
    lrs = sorted({float(r["lr"]) for r in records}, reverse=True)
    variants = " and ".join(f"`{dict(v.model_cfg)}`" for v in spec.variant_specs().values())
    meta = {
        "window": steps_per_epoch,
        "wall": timing,
        "protocol": (
            f"Strided AlexNet, model_cfg {variants}, data set `{spec.datasets[0]}`, "
            f"{spec.epochs} epochs of {steps_per_epoch} steps (batch {spec.batch_size}), SGD "
            f"momentum {spec.momentum}, weight decay {spec.weight_decay}, logits scaled to std "
            f"{spec.output_std} after the first minibatch, learning rates "
            f"{', '.join(f'2^{math.log2(lr):g}' for lr in lrs)} (the grid after extension), "
            f"seeds {list(spec.seeds)}; "
            f"{len(records)} runs. No augmentation, no learning-rate drops (the paper: flips, "
            "crops, drops at epochs 150 and 225, 300 epochs, 10 seeds)."
        ),
    }
    (out / "figure3.md").write_text(markdown(rows, meta), encoding="utf-8")
    runs = []
    for r in records:
        final = float(windowed(r["step_loss"], steps_per_epoch)[-1])
        keep = {k: r[k] for k in ("scheme", "seed", "lr", "diverged")}
        runs.append({**keep, "method": method(r), "final_windowed_loss": final})
    with open(out / "figure3_runs.json", "w", encoding="utf-8") as f:
        json.dump(runs, f, indent=1, allow_nan=True)
    return rows


def run(store_path: Path, workers: int) -> None:
    from initlab.study.runner import run_study

    store_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    summary = run_study(SPEC, store_path, workers=workers, chunk_size=8)
    print(summary, f"\nwall {time.perf_counter() - start:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["run", "report"])
    parser.add_argument("--store", type=Path, default=STORE)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--workers", type=int, default=2, help="processes (1 thread each)")
    parser.add_argument("--timing", default="", help="report: how long the study took (text)")
    args = parser.parse_args()
    if args.command == "run":
        run(args.store, args.workers)
    else:
        for row in report(args.store, args.out, args.timing):
            print(row)


if __name__ == "__main__":
    sys.exit(main())
