"""Plain training steps on CPU with glibc's heap as it is vs kept (``initlab._core.heap``).

A study trains every chunk inside :func:`initlab._core.heap.kept_heap`. This times what that
changes for a training loop: each candidate in a fresh process, ``--steps`` steps of SGD with
momentum on CIFAR-shaped batches (4 batches in turn), each step followed by an evaluation forward
under ``no_grad`` (as a study's epoch end interleaves them), the first two steps untimed; the
median process CPU time and minor page faults (4 KiB) per step. ``kept`` runs the loop inside
``kept_heap()``, ``trimmed`` without it. The two alternate for ``--rounds`` processes each.

Run: ``python benchmarks/bench_heap_training.py [--models strided_alexnet resnet20]
[--batch 128] [--steps 12] [--rounds 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _timing import cifar_batch, minor_faults
from initlab._core.heap import kept_heap
from initlab._core.rows import format_table
from initlab.zoo import create_model


def measure(name: str, batch: int, steps: int, keep: bool) -> dict[str, float]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = create_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    xs, ys = zip(*(cifar_batch(batch, gen) for _ in range(4)), strict=True)
    times, faults = [], []
    with kept_heap(keep):
        for i in range(steps):
            f0, t0 = minor_faults(), time.process_time()
            x, y = xs[i % 4], ys[i % 4]
            model.train()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            model.eval()
            with torch.no_grad():
                model(x)
            if i >= 2:
                times.append(time.process_time() - t0)
                faults.append(minor_faults() - f0)
    return {"ms": 1e3 * statistics.median(times), "faults": statistics.median(faults)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["strided_alexnet", "resnet20"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "HEAP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, heap = args.child
        print(json.dumps(measure(name, args.batch, args.steps, heap == "kept")))
        return
    rows = []
    for name in args.models:
        seen: dict[str, list[dict[str, float]]] = {"trimmed": [], "kept": []}
        for _ in range(args.rounds):
            for heap in seen:
                out = subprocess.run(
                    [sys.executable, __file__, "--child", name, heap, "--batch", str(args.batch),
                     "--steps", str(args.steps)],
                    env={**os.environ, "OMP_NUM_THREADS": "1"},
                    capture_output=True, text=True, check=True,
                ).stdout  # fmt: skip
                seen[heap].append(json.loads(out.strip().splitlines()[-1]))
        ms = {heap: statistics.median(r["ms"] for r in v) for heap, v in seen.items()}
        for heap, v in seen.items():
            rows.append(
                {"model": name, "heap": heap, "ms": ms[heap],
                 "x_trimmed": ms[heap] / ms["trimmed"],
                 "faulted_MB": statistics.median(r["faults"] for r in v) * 4 / 1024}
            )  # fmt: skip
    print(
        f"batch {args.batch}, {args.steps - 2} timed steps per process, median over "
        f"{args.rounds} processes per heap (process CPU time, 1 thread; a step = train + eval)"
    )
    print(format_table(rows))


if __name__ == "__main__":
    main()
