"""Vectorized trainer vs a plain PyTorch loop: the paper MLP on LIBSVM dna and letter.

The workload is one LR sweep of Defazio & Bottou's LIBSVM study (Section 6): ``PaperMLP`` 384/64
with input LayerNorm, geometric init, logits scaled to std 0.05 after the first minibatch, SGD with
momentum 0.9 and weight decay 1e-5, **batch size 64**, 10 seeds x 8 learning rates
(``2^-2 .. 2^-9``) = 80 runs, 1 epoch by default (``--epochs``), with the trainer's evaluation of
the train and test splits after every epoch.

* **vectorized**: one ``initlab.study.train_runs`` call for all 80 runs.
* **plain loop**: ``initlab.study.train_one`` per run: ``nn.Module``, ``torch.optim.SGD``,
  minibatches by indexing (no DataLoader), the same evaluation. To keep the benchmark short it
  times ``--plain-runs`` runs (default 8: seed 0 at every learning rate) and extrapolates
  linearly to all runs; the table says so.

Both candidates are timed alternately ``--repeats`` times (best of), so they see the same
machine state. GFLOP/s counts matmul FLOPs as ``6·P·n_train·epochs`` (forward + backward) plus
``2·P·(n_train + n_test)·epochs`` (evaluation forwards) per run, ``P`` = parameters; the peak is the
best of ``--peak-repeats`` ``torch.mm`` of two 4096 x 4096 fp32 matrices, measured in the same
process before and after. On a shared machine the load average is printed: compare timings only
at similar load.

Run: ``python benchmarks/bench_trainer.py [--datasets dna letter] [--epochs 1]``.
Data: ``--data-dir``, else ``$INITLAB_DATA_DIR`` (the ``libsvm`` folder or its parent), else
``../shared/data/libsvm`` relative to the repository root.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

from initlab.study import RunConfig, train_one, train_runs
from initlab.zoo.paper_mlp import PaperMLP

REPO = Path(__file__).resolve().parents[1]

#: name → (train file, test file, features)
FILES = {
    "dna": ("dna.scale", "dna.scale.t", 180),
    "letter": ("letter.scale", "letter.scale.t", 16),
    "satimage": ("satimage.scale", "satimage.scale.t", 36),
    "pendigits": ("pendigits", "pendigits.t", 16),
}


def data_dir(arg: str | None) -> Path:
    """The LIBSVM folder: ``--data-dir``, ``$INITLAB_DATA_DIR`` (or its ``libsvm``), default."""
    root = Path(arg or os.environ.get("INITLAB_DATA_DIR") or REPO.parent / "shared/data/libsvm")
    return root / "libsvm" if (root / "libsvm").is_dir() else root


def _parse_libsvm(path: Path, n_features: int) -> tuple[torch.Tensor, list[int]]:
    """Minimal LIBSVM reader (fallback when ``initlab.data`` is not available)."""
    rows, labels = [], []
    for line in path.read_text().splitlines():
        parts = line.split("#")[0].split()
        if not parts:
            continue
        labels.append(int(float(parts[0])))
        row = [0.0] * n_features
        for token in parts[1:]:
            i, v = token.split(":")
            row[int(i) - 1] = float(v)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float32), labels


def load(name: str, root: Path) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple, int]:
    """``(train, test, n_classes)`` as float32 / int64 tensors."""
    train_file, test_file, n_features = FILES[name]
    try:
        from initlab.data.libsvm import load_libsvm
    except ImportError:
        x, labels = _parse_libsvm(root / train_file, n_features)
        tx, tlabels = _parse_libsvm(root / test_file, n_features)
        classes = sorted(set(labels))
        index = {c: k for k, c in enumerate(classes)}
        y = torch.tensor([index[c] for c in labels])
        ty = torch.tensor([index[c] for c in tlabels])
        return (x, y), (tx, ty), len(classes)
    tr = load_libsvm(root / train_file, n_features=n_features, cache_dir=False)
    te = load_libsvm(
        root / test_file, n_features=n_features, label_map=tr.label_map, cache_dir=False
    )
    return (tr.x, tr.y), (te.x, te.y), tr.n_classes


def matmul_peak(repeats: int, n: int = 4096) -> float:
    """Best fp32 ``torch.mm`` GFLOP/s of two ``n x n`` matrices."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def fmt_row(cells: list[str], widths: list[int]) -> str:
    return "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=["dna", "letter"], choices=sorted(FILES))
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--plain-runs", type=int, default=8, help="runs timed in the plain loop")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    root = data_dir(args.data_dir)

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f}; data {root}"
    )
    peak = matmul_peak(args.peak_repeats)
    lrs = [2.0**-k for k in range(2, 10)]
    if args.optimizer == "adam":
        lrs = [lr / 64 for lr in lrs]
    header = [
        "dataset",
        "n_train",
        "P",
        "runs",
        "vectorized s",
        "plain s (extrap.)",
        "speed-up",
        "vec GFLOP/s",
        "% of peak",
        "plain GFLOP/s",
        "diverged",
    ]
    rows = []
    for name in args.datasets:
        train, test, n_classes = load(name, root)
        n_in = train[0].shape[1]

        def factory(config: RunConfig, n_in: int = n_in, n_classes: int = n_classes) -> PaperMLP:
            return PaperMLP(n_in, n_classes, **config.model_kwargs)

        configs = [
            RunConfig.make(
                name,
                model_cfg={"input_norm": True, "widths": (384, 64)},
                scheme="geometric",
                seed=seed,
                lr=lr,
                optimizer=args.optimizer,
                momentum=0.9 if args.optimizer == "sgd" else 0.0,
                weight_decay=1e-5,
                epochs=args.epochs,
                batch_size=64,
                output_std=0.05,
            )
            for seed in range(args.seeds)
            for lr in lrs
        ]
        plain = configs[: args.plain_runs]
        train_one(plain[0], train, test, model_factory=factory)  # warm-up (lazy imports)

        best_vec = best_plain = math.inf
        results = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            results = train_runs(configs, train, test, model_factory=factory)
            best_vec = min(best_vec, time.perf_counter() - start)
            start = time.perf_counter()
            for config in plain:
                train_one(config, train, test, model_factory=factory)
            best_plain = min(best_plain, time.perf_counter() - start)
        plain_all = best_plain / len(plain) * len(configs)
        n_params = sum(p.numel() for p in factory(configs[0]).parameters())
        n_train, n_test = train[0].shape[0], test[0].shape[0]
        flops_run = (6 * n_train + 2 * (n_train + n_test)) * n_params * args.epochs
        vec_gflops = flops_run * len(configs) / best_vec / 1e9
        rows.append(
            [
                name,
                str(n_train),
                str(n_params),
                str(len(configs)),
                f"{best_vec:.2f}",
                f"{plain_all:.2f} ({len(plain)} runs x {len(configs) / len(plain):g})",
                f"{plain_all / best_vec:.1f}x",
                f"{vec_gflops:.0f}",
                vec_gflops,  # type: ignore[list-item]  # → % of peak, once the peak is final
                f"{flops_run * len(configs) / plain_all / 1e9:.0f}",
                str(sum(r.diverged for r in results)),
            ]
        )
    peak = max(peak, matmul_peak(args.peak_repeats))
    for row in rows:
        row[8] = f"{100 * float(row[8]) / peak:.0f}%"

    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print()
    print(fmt_row(header, widths))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print(fmt_row(row, widths))
    print(
        f"\nfp32 matmul peak (best torch.mm 4096^3): {peak:.0f} GFLOP/s; load average now "
        f"{os.getloadavg()[0]:.2f}. {args.optimizer.upper()}, batch size 64, {args.epochs} "
        f"epoch(s), train+test evaluation after each epoch; times are best of {args.repeats}. "
        f"FLOPs per run = (6·n_train + 2·(n_train + n_test))·P·epochs."
    )


if __name__ == "__main__":
    sys.exit(main())
