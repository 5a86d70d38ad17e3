"""GradInit's per-layer effect without BatchNorm (Zhu et al. 2021, Figure 6), CPU-scaled.

The paper (seed text 002_*.txt, Figure 6 and Appendix) plots, for each linear layer ``i`` (every
convolution and the final fully connected layer, shallow to deep) of VGG-19 and ResNet-110
*without* BatchNorm on CIFAR-10, before and after GradInit:

* the averaged per-dimension weight magnitude ``||W_i|| / d_i`` (``d_i``: the number of entries of
  ``W_i``); the ratio after/before is the scale GradInit learned for the layer;
* the standard deviation of the gradient across minibatches of 128, ``sigma(g_i)``: for every entry
  of ``W_i`` the standard deviation of its gradient over ``K`` minibatches, averaged over the
  entries.

It reports that without BN "GradInit downscales the weights for all layers in both architectures"
and that the gradient variance falls (by about 10^6 on DenseNet-100 without BN, Figure 7).

This script measures the same two quantities with initlab's :func:`initlab.gradinit_` at the
paper's settings (overlap ``r = 0.5``, ``gamma = 1``, ``alpha_min = 0.01``, SGD as ``A``,
``eta = 0.1``, ``tau`` from the paper's list), starting from Kaiming (fan-in) init, on a
class-balanced subset of the CIFAR-10 JPEG copy normalized per channel. Departures from the paper
(for 2 CPU cores): fewer GradInit iterations than one epoch (``--steps``; the paper runs 390),
a subset of the training images, and ``K`` minibatches for ``sigma(g_i)``. Both models are at full
width.

Run (from the repository root; ``--data-dir`` or ``$INITLAB_DATA_DIR``, else ``../shared/data``)::

    python benchmarks/gradinit_layers.py                 # writes benchmarks/results/gradinit/
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import initlab
from initlab.data import load_dataset
from initlab.zoo import create_model

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results" / "gradinit"
LABEL = "CIFAR-10 (JPEG copy), CPU-scaled"
#: Per-channel mean and std of the CIFAR-10 training images (the usual normalization).
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
MODELS = {"vgg19": {}, "resnet110": {"norm": False}}


def load_cifar(
    data_dir: str | None, split: str, per_class: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (normalized per channel) and labels of the first ``per_class`` of each class."""
    data = load_dataset("cifar10", split, root=data_dir, limit_per_class=per_class)
    mean = torch.tensor(MEAN).view(1, 3, 1, 1)
    std = torch.tensor(STD).view(1, 3, 1, 1)
    return (data.x - mean) / std, data.y


def shuffled_batches(
    x: torch.Tensor, y: torch.Tensor, gen: torch.Generator, size: int = 128
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One shuffled epoch of full minibatches of ``size``."""
    order = torch.randperm(len(x), generator=gen)
    n = len(x) // size * size
    return [(x[i], y[i]) for i in order[:n].split(size)]


def cifar_batches(
    data_dir: str | None, per_class: int, batch: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Shuffled minibatches of the first ``per_class`` training images of each class."""
    x, y = load_cifar(data_dir, "train", per_class)
    return shuffled_batches(x, y, torch.Generator().manual_seed(seed), batch)


def linear_weights(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The weight of every convolution and linear layer, shallow to deep (definition order)."""
    return [
        (f"{name}.weight", m.weight)
        for name, m in model.named_modules()
        if isinstance(m, (nn.Conv2d, nn.Linear))
    ]


def layer_stats(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> list[dict[str, float]]:
    """Per layer: ``||W_i|| / d_i`` and ``sigma(g_i)`` over ``batches`` (float64 accumulation)."""
    weights = linear_weights(model)
    s1 = [torch.zeros_like(w, dtype=torch.float64) for _, w in weights]
    s2 = [torch.zeros_like(w, dtype=torch.float64) for _, w in weights]
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    for x, y in batches:
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
        for (_, w), a, b in zip(weights, s1, s2, strict=True):
            g = w.grad.double()
            a += g
            b += g * g
    k = len(batches)
    model.zero_grad(set_to_none=True)
    rows = []
    for (name, w), a, b in zip(weights, s1, s2, strict=True):
        var = (b - a * a / k).clamp_min(0) / (k - 1)  # unbiased, per entry
        rows.append(
            {
                "param": name,
                "d": w.numel(),
                "weight_per_dim": float(w.detach().double().norm()) / w.numel(),
                "grad_std": float(var.sqrt().mean()),
            }
        )
    rows[0]["mean_loss"] = sum(losses) / k
    return rows


def one_model(name: str, args: argparse.Namespace, data: list[Any]) -> dict[str, Any]:
    """Kaiming init, statistics, GradInit, statistics again; the learned alphas and the cost."""
    model = create_model(name, **MODELS[name])
    initlab.init_model(model, "fan_in", generator=args.seed, head="off", measure=False)
    probe = data[: args.k]
    train = data[args.k : args.k + args.steps + 1]
    before = layer_stats(model, probe)
    start = time.perf_counter()
    report = initlab.gradinit_(
        model,
        train,
        nn.CrossEntropyLoss(),
        steps=args.steps,
        lr=args.tau,
        eta=0.1,
        gamma=1.0,
        optimizer="sgd",
        overlap=0.5,
        alpha_min=0.01,
        generator=args.seed,
    )
    seconds = time.perf_counter() - start
    after = layer_stats(model, probe)
    alphas = {f"{r['layer']}.{r['param']}": r["alpha"] for r in report}
    layers = []
    for b, a in zip(before, after, strict=True):
        layers.append(
            {
                "param": b["param"],
                "d": b["d"],
                "alpha": alphas.get(b["param"], 1.0),
                "weight_per_dim_before": b["weight_per_dim"],
                "weight_per_dim_after": a["weight_per_dim"],
                "grad_std_before": b["grad_std"],
                "grad_std_after": a["grad_std"],
            }
        )
    trace = report.trace
    return {
        "model": name,
        "model_cfg": MODELS[name],
        "layers": layers,
        "loss_before": before[0]["mean_loss"],
        "loss_after": after[0]["mean_loss"],
        "gradinit_seconds": seconds,
        "forward_passes": report.forward_passes,
        "backward_passes": report.backward_passes,
        "info": {k: v for k, v in report.info.items() if isinstance(v, (int, float, str))},
        "trace": trace.to_rows() if trace is not None else [],
    }


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Figure 6's layout: per model, ``||W_i||/d_i`` and ``sigma(g_i)`` against the layer index."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 * len(results), figsize=(5 * len(results) * 2, 3.6))
    for j, res in enumerate(results):
        idx = range(1, len(res["layers"]) + 1)
        for k, (key, title) in enumerate(
            (("weight_per_dim", "||W_i|| / d_i"), ("grad_std", "sigma(g_i)"))
        ):
            ax = axes[2 * j + k]
            for when, style in (("before", "o-"), ("after", "s-")):
                label = "Kaiming" if when == "before" else "Kaiming + GradInit"
                ax.plot(idx, [r[f"{key}_{when}"] for r in res["layers"]], style, ms=3, label=label)
            ax.set_yscale("log")
            ax.set_xlabel("layer i (shallow to deep)")
            ax.set_title(f"{res['model']} w/o BN: {title}", fontsize=10)
            ax.legend(fontsize=8)
    fig.suptitle(f"GradInit per layer, {LABEL}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def markdown(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The summary table and per-model verdicts."""
    lines = [
        f"# GradInit per layer without BatchNorm (Figure 6), {LABEL}",
        "",
        f"Command: `python benchmarks/gradinit_layers.py --steps {args.steps} --tau {args.tau} "
        f"--per-class {args.per_class} --k {args.k} --seed {args.seed}`. Kaiming (fan-in) init, "
        f"then GradInit with SGD as A, eta 0.1, gamma 1, overlap 0.5, alpha_min 0.01, "
        f"tau {args.tau}, {args.steps} iterations of batch 128 (the paper: one epoch, 390); "
        f"sigma(g_i) over the same {args.k} minibatches of 128 before and after; "
        f"{args.per_class} training images per class.",
        "",
        "| model | layers | loss before → after | layers downscaled (alpha < 1) | alpha: min / "
        "geo-mean / max | sigma(g) after/before: min / geo-mean / max | GradInit time |",
        "|---|---|---|---|---|---|---|",
    ]
    for res in results:
        layers = res["layers"]
        alphas = [r["alpha"] for r in layers]
        ratios = [r["grad_std_after"] / r["grad_std_before"] for r in layers]
        down = sum(a < 1 for a in alphas)
        lines.append(
            f"| {res['model']} w/o BN | {len(layers)} | {res['loss_before']:.4g} → "
            f"{res['loss_after']:.4g} | {down} of {len(layers)} | {min(alphas):.3g} / "
            f"{_geomean(alphas):.3g} / {max(alphas):.3g} | {min(ratios):.3g} / "
            f"{_geomean(ratios):.3g} / {max(ratios):.3g} | {res['gradinit_seconds']:.0f} s |"
        )
    lines += ["", "## Verdicts", ""]
    for res in results:
        layers = res["layers"]
        alphas = [r["alpha"] for r in layers]
        ratios = [r["grad_std_after"] / r["grad_std_before"] for r in layers]
        all_down = all(a < 1 for a in alphas)
        n_down = sum(a < 1 for a in alphas)
        all_less = all(r < 1 for r in ratios)
        lines.append(
            f"- **{res['model']} w/o BN**: GradInit downscaled "
            f"{'every layer' if all_down else f'{n_down} of {len(alphas)} layers'}"
            f" (the paper: every layer) and "
            f"{'cut' if all_less else 'did not cut'} sigma(g_i) in every layer "
            f"(geometric mean factor {_geomean(ratios):.3g}, "
            f"{sum(r < 1 for r in ratios)} of {len(ratios)} layers lower)."
        )
    lines += ["", "![figure 6](figure6.png)", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=40, help="GradInit iterations")
    parser.add_argument("--tau", type=float, default=1e-2, help="GradInit's Adam lr on alpha")
    parser.add_argument("--per-class", type=int, default=800, help="training images per class")
    parser.add_argument("--k", type=int, default=10, help="minibatches for sigma(g_i)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    data = cifar_batches(args.data_dir, args.per_class, 128, args.seed)
    if len(data) < args.k + args.steps + 1:
        parser.error(
            f"--per-class {args.per_class} gives {len(data)} batches of 128; --k {args.k} and "
            f"--steps {args.steps} need {args.k + args.steps + 1}: raise --per-class"
        )
    torch.manual_seed(args.seed)
    results = [one_model(name, args, data) for name in args.models]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "figure6.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / "figure6.png")
    (args.out / "figure6.md").write_text(markdown(results, args))
    print(markdown(results, args))


if __name__ == "__main__":
    main()
