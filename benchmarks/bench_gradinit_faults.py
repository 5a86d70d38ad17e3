"""GradInit's steps on CPU against a plain training step, by how the C heap is kept: time and page
faults.

A constraint step on ResNet-20 (CIFAR batch 128) frees and takes back several hundred MB per
step; glibc hands memory freed at the top of its heap back to the system and the next step faults
it in again. ``gradinit_`` keeps the heap for the length of its call
(:func:`initlab._core.heap.kept_heap`, ``keep_heap=True``, the default). Three heaps, each in a
fresh process:

* ``keep_heap=False``: glibc's defaults throughout (what ``gradinit_`` did before);
* ``keep_heap=True``: glibc's defaults for the plain step, the heap kept while GradInit runs
  (what a user gets: ``gradinit_`` and then training);
* ``GLIBC_TUNABLES``: the whole process started with a kept heap
  (``glibc.malloc.trim_threshold=1073741824:glibc.malloc.mmap_threshold=33554432``), the plain
  step included (``kept_heap`` then changes nothing: the user's settings stand).

Each process runs ``--rounds`` rounds after one warm-up round. A round runs, in blocks of
``--block`` calls whose first call is not timed: plain training steps (SGD with momentum, as
``bench_gradinit.py``); first-order objective steps and constraint steps (``_GradInitStep``, the
step ``gradinit_`` runs), each block inside ``kept_heap(keep_heap)`` as ``gradinit_``'s loop is;
and one ``gradinit_`` call of ``--block`` iterations with ``gamma=0`` (every iteration a
constraint step; its iterations timed between ``progress`` callbacks, the first not timed). Per
kind: the median process CPU time, its ratio to the plain step's, and the median minor page
faults (``getrusage``; 4 KiB pages).

Run: ``python benchmarks/bench_gradinit_faults.py [--model resnet20] [--width W] [--rounds 5]
[--batch 128] [--block 3] [--heaps ...]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _timing import cifar_batch, minor_faults
from initlab._core.heap import kept_heap
from initlab._core.rows import format_table
from initlab.methods._alpha import default_loss, evaluation_modes, nonzero, select_tensors
from initlab.methods._alpha import set_evaluation_modes as _set_evaluation_modes
from initlab.methods.gradinit import _GradInitStep, gradinit_, overlap_batch
from initlab.zoo import create_model

KEPT = "glibc.malloc.trim_threshold=1073741824:glibc.malloc.mmap_threshold=33554432"
HEAPS = {
    "keep_heap=False": ({}, False),
    "keep_heap=True": ({}, True),
    "GLIBC_TUNABLES": ({"GLIBC_TUNABLES": KEPT}, True),
}


def _timed_block(fn: Callable[[], None], block: int, out: list[tuple[float, int]]) -> None:
    """``block`` calls of ``fn``; all but the first timed into ``out``."""
    for i in range(block):
        f0, t0 = minor_faults(), time.process_time()
        fn()
        if i:
            out.append((time.process_time() - t0, minor_faults() - f0))


def measure(
    model_name: str, width: float | None, batch: int, rounds: int, block: int, keep: bool
) -> dict[str, Any]:
    """Median ms and minor faults per step kind, in this process."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = create_model(model_name) if width is None else create_model(model_name, width=width)
    gen = torch.Generator().manual_seed(0)
    s, nxt = (cifar_batch(batch, gen) for _ in range(2))
    s_tilde = overlap_batch(s, nxt, 0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    ts = select_tensors(model, "default", nonzero, "bench")
    alpha = torch.ones(len(ts.scaled), dtype=torch.float64)
    runs = {
        kind: _GradInitStep(
            model, default_loss, ts, eta=0.1, optimizer="sgd", exact=False, what=kind
        )
        for kind in ("objective", "constraint")
    }

    def plain() -> None:
        model.train()
        F.cross_entropy(model(s[0]), s[1]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def gradinit_step(kind: str) -> None:
        _set_evaluation_modes(model, batch_stats=True)
        runs[kind].last_kind = kind  # steady state: the previous step was of the same kind
        runs[kind](alpha, s, lambda: s_tilde, math.inf, 0, force=kind)

    def gradinit_loop(out: list[tuple[float, int]]) -> None:
        marks: list[tuple[float, int]] = []
        gradinit_(
            model, [s, nxt] * block, gamma=0.0, steps=block, keep_heap=keep,
            progress=lambda row: marks.append((time.process_time(), minor_faults())),
        )  # fmt: skip
        out.extend((t1 - t0, f1 - f0) for (t0, f0), (t1, f1) in itertools.pairwise(marks))

    seen: dict[str, list[tuple[float, int]]] = {
        k: [] for k in ("plain", "objective", "constraint", "gradinit_ loop (constraint)")
    }
    for r in range(rounds + 1):
        sink = {k: (v if r else []) for k, v in seen.items()}
        model.train()
        _timed_block(plain, block, sink["plain"])
        with evaluation_modes(model, batch_stats=True):
            for kind in ("objective", "constraint"):
                with kept_heap(keep):
                    _timed_block(lambda k=kind: gradinit_step(k), block, sink[kind])
        gradinit_loop(sink["gradinit_ loop (constraint)"])
    return {
        k: {
            "ms": 1e3 * statistics.median(t for t, _ in v),
            "faults": statistics.median(f for _, f in v),
        }
        for k, v in seen.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet20")
    parser.add_argument("--width", type=float, default=None, help="the zoo model's width")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block", type=int, default=3)
    parser.add_argument("--heaps", nargs="+", choices=list(HEAPS), default=list(HEAPS))
    parser.add_argument("--child", choices=list(HEAPS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        keep = HEAPS[args.child][1]
        run = (args.model, args.width, args.batch, args.rounds, args.block, keep)
        print(json.dumps(measure(*run)))
        return
    rows = []
    for heap in args.heaps:
        out = subprocess.run(
            [sys.executable, __file__, "--child", heap, "--model", args.model, "--batch",
             str(args.batch), "--rounds", str(args.rounds), "--block", str(args.block)]
            + ([] if args.width is None else ["--width", str(args.width)]),
            env={**os.environ, "OMP_NUM_THREADS": "1", **HEAPS[heap][0]},
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        result = json.loads(out.strip().splitlines()[-1])
        plain = result["plain"]["ms"]
        for kind, v in result.items():
            rows.append(
                {"heap": heap, "step": kind, "ms": v["ms"], "x_plain": v["ms"] / plain,
                 "minor_faults": v["faults"], "faulted_MB": v["faults"] * 4 / 1024}
            )  # fmt: skip
    width = "" if args.width is None else f" (width {args.width:g})"
    print(
        f"{args.model}{width}, batch {args.batch}, medians of {args.rounds} rounds x "
        f"{args.block - 1} timed calls (process CPU time, 1 thread)"
    )
    print(format_table(rows))


if __name__ == "__main__":
    main()
