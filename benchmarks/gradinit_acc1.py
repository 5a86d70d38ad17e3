"""First-epoch accuracy of VGG-19 without BN under six inits (GradInit, Tables 9-10), CPU-scaled.

GradInit (Zhu et al. 2021, seed text 002_*.txt) reports that on networks without BatchNorm its
initialization gives a higher and less variable first-epoch test accuracy ``Acc_1`` than Kaiming
init (4 seeds, mean and standard error; Table 10, and Table 9 for MetaInit's improved variant with
real data and Adam). This script compares, on a width-scaled VGG-19 without BN:

* ``kaiming``: fan-in init with ReLU's gain (:func:`initlab.init_model`, ``"fan_in"``);
* ``gradinit``: Kaiming, then :func:`initlab.gradinit_` (SGD as ``A``, ``eta`` = the training
  learning rate as in the paper's appendix, ``gamma = 1``, overlap 0.5, ``alpha_min = 0.01``);
* ``metainit``: Kaiming, then :func:`initlab.metainit_` with real data and Adam
  (``variant="gradinit"``, the paper's improved MetaInit);
* ``lsuv``: orthogonal pre-init and :func:`initlab.lsuv_` (Mishkin & Matas);
* ``geometric``: Defazio & Bottou's geometric-mean init;
* ``geometric+precondition``: geometric init, then :func:`initlab.precondition_` (GR scaling
  balanced across layers by per-layer learning rates, :func:`initlab.preconditioned_param_groups`).

Every init then trains one epoch with the same rule: SGD momentum 0.9, batch 128, learning rate
``--lr`` (weight decay 5e-4), no schedule; ``Acc_1`` is the test accuracy after that epoch. The
data-dependent inits read only the training split (their own batches from a generator seeded by
the run's seed). Each (init, seed) is one process with one thread; ``--workers`` run at once.

Departures from the paper (labelled "CIFAR-10 (JPEG copy), CPU-scaled"): the lossy JPEG copy; the
network's widths scaled by ``--width``; an epoch over a class-balanced subset of the training images
(``--train-per-class``) and accuracy on the first ``--test-per-class`` test images of each class; no
crops, flips or MixUp; GradInit and MetaInit run ``--init-steps`` iterations (the paper: one epoch).

Run (from the repository root; ``--data-dir`` or ``$INITLAB_DATA_DIR``, else ``../shared/data``)::

    python benchmarks/gradinit_acc1.py            # writes benchmarks/results/gradinit/acc1_lr<lr>.*
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

import initlab
from gradinit_layers import load_cifar, shuffled_batches  # the same folder: run as a script
from initlab.zoo import create_model

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results" / "gradinit"
LABEL = "CIFAR-10 (JPEG copy), CPU-scaled"
INITS = ("kaiming", "gradinit", "metainit", "lsuv", "geometric", "geometric+precondition")

Batch = tuple[torch.Tensor, torch.Tensor]


def initialize(
    name: str, model: nn.Module, train: list[Batch], seed: int, args: argparse.Namespace
) -> tuple[list[dict[str, Any]] | None, dict[str, Any]]:
    """Apply init ``name``; the optimizer's parameter groups (``None``: one group) and its cost."""
    ce = nn.CrossEntropyLoss()
    scheme = {"lsuv": "orthogonal", "geometric": "geometric", "geometric+precondition": "geometric"}
    initlab.init_model(model, scheme.get(name, "fan_in"), generator=seed, head="off", measure=False)
    groups = None
    report = None
    steps = args.init_steps
    if name == "gradinit":
        report = initlab.gradinit_(
            model, train[: steps + 1], ce, steps=steps, lr=args.tau, eta=args.lr, gamma=1.0,
            optimizer="sgd", overlap=0.5, alpha_min=0.01, generator=seed,
        )  # fmt: skip
    elif name == "metainit":
        report = initlab.metainit_(
            model, train[:steps], ce, variant="gradinit", steps=steps, lr=args.tau, generator=seed
        )
    elif name == "lsuv":
        report = initlab.lsuv_(model, train[:1], generator=seed)
    elif name == "geometric+precondition":
        report = initlab.precondition_(model, train[:4], ce, generator=seed)
        groups = initlab.preconditioned_param_groups(
            model, report, lr=args.lr, optimizer="sgd", weight_decay=args.weight_decay
        )
    cost = {"forward_passes": 0, "backward_passes": 0}
    if report is not None:
        cost = {"forward_passes": report.forward_passes, "backward_passes": report.backward_passes}
    return groups, cost


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    correct = sum(
        int((model(xb).argmax(1) == yb).sum())
        for xb, yb in zip(x.split(500), y.split(500), strict=True)
    )
    model.train()
    return correct / len(y)


def one_run(task: tuple[str, int, argparse.Namespace]) -> dict[str, Any]:
    """Init, one epoch of SGD, test accuracy."""
    name, seed, args = task
    torch.set_num_threads(1)
    x, y = load_cifar(args.data_dir, "train", args.train_per_class)
    xt, yt = load_cifar(args.data_dir, "test", args.test_per_class)
    model = create_model("vgg19", width=args.width)
    gen = torch.Generator().manual_seed(seed)
    init_data = shuffled_batches(x, y, gen)  # the init's own draw of the training split
    start = time.perf_counter()
    groups, cost = initialize(name, model, init_data, seed, args)
    init_s = time.perf_counter() - start
    params = groups if groups is not None else model.parameters()
    opt = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
    ce = nn.CrossEntropyLoss()
    losses = []
    start = time.perf_counter()
    for xb, yb in shuffled_batches(x, y, gen):
        loss = ce(model(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    train_s = time.perf_counter() - start
    acc = accuracy(model, xt, yt)
    finite = all(math.isfinite(v) for v in losses)
    return {
        "init": name, "seed": seed, "acc1": acc, "diverged": not finite,
        "first_loss": losses[0], "last_loss": losses[-1], "steps": len(losses),
        "init_s": init_s, "train_s": train_s, **cost,
    }  # fmt: skip


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for name in INITS:
        accs = [r["acc1"] * 100 for r in runs if r["init"] == name]
        if not accs:
            continue
        sd = statistics.stdev(accs) if len(accs) > 1 else float("nan")
        mine = [r for r in runs if r["init"] == name]
        rows.append(
            {
                "init": name, "n": len(accs), "mean": statistics.fmean(accs),
                "se": sd / math.sqrt(len(accs)), "sd": sd, "min": min(accs), "max": max(accs),
                "diverged": sum(r["diverged"] for r in mine),
                "init_s": statistics.fmean(r["init_s"] for r in mine),
                "train_s": statistics.fmean(r["train_s"] for r in mine),
                "passes": f"{mine[0]['forward_passes']}/{mine[0]['backward_passes']}",
            }
        )  # fmt: skip
    return rows


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace, wall: float) -> str:
    lines = [
        f"# First-epoch accuracy Acc_1, VGG-19 without BN, {LABEL}",
        "",
        f"Command: `python benchmarks/gradinit_acc1.py --width {args.width} --lr {args.lr} "
        f"--seeds {args.seeds} --train-per-class {args.train_per_class} --test-per-class "
        f"{args.test_per_class} --init-steps {args.init_steps} --tau {args.tau} --workers "
        f"{args.workers}`: one epoch of SGD (momentum 0.9, batch 128, lr {args.lr}, weight decay "
        f"{args.weight_decay}) after each init; Acc_1 on {args.test_per_class * 10} test images. "
        f"Whole study: {wall / 60:.1f} min wall on this machine ({args.workers} worker processes, "
        f"1 thread each).",
        "",
        "| init | seeds | Acc_1 % mean ± s.e. | sd | min – max | diverged | init s | "
        "epoch s | init passes F/B |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['init']} | {r['n']} | {r['mean']:.1f} ± {r['se']:.1f} | {r['sd']:.1f} | "
            f"{r['min']:.1f} – {r['max']:.1f} | {r['diverged']} | {r['init_s']:.1f} | "
            f"{r['train_s']:.0f} | {r['passes']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--inits", nargs="+", default=list(INITS), choices=list(INITS))
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--width", type=float, default=0.25)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--train-per-class", type=int, default=1000)
    parser.add_argument("--test-per-class", type=int, default=200)
    parser.add_argument("--init-steps", type=int, default=20, help="GradInit/MetaInit iterations")
    parser.add_argument("--tau", type=float, default=1e-2, help="GradInit/MetaInit Adam lr")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    tasks = [(name, seed, args) for seed in range(args.seeds) for name in args.inits]
    start = time.perf_counter()
    with ProcessPoolExecutor(args.workers) as pool:
        runs = list(pool.map(one_run, tasks))
    wall = time.perf_counter() - start
    rows = summarize(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"acc1_lr{args.lr:g}"
    (args.out / f"{stem}_runs.json").write_text(json.dumps(runs, indent=1))
    text = markdown(rows, args, wall)
    (args.out / f"{stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
