"""GradInit's steps on CPU, glibc's default heap vs one that is kept: time and page faults.

A constraint step on ResNet-20 (CIFAR batch 128) frees and takes back several hundred MB per
step; glibc hands memory freed at the top of its heap back to the system and the next step faults
it in again. This runs the same loop twice, each in a fresh process: with the defaults, and with
``GLIBC_TUNABLES=glibc.malloc.trim_threshold=1073741824:glibc.malloc.mmap_threshold=33554432``
(the setting the ``gradinit`` module docstring gives). Each process alternates a plain training
step (SGD with momentum, as ``bench_gradinit.py``), a first-order objective step and a constraint
step for ``--rounds`` rounds after one warm-up, and reports per step kind the median process CPU
time and the median number of minor page faults (``getrusage``; 4 KiB pages).

Run: ``python benchmarks/bench_gradinit_faults.py [--model resnet20] [--rounds 5] [--batch 128]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
from torch.nn import functional as F

from initlab._core.rows import format_table
from initlab.methods._alpha import default_loss, evaluation_modes, nonzero, select_tensors
from initlab.methods._alpha import set_evaluation_modes as _set_evaluation_modes
from initlab.methods.gradinit import _GradInitStep, overlap_batch
from initlab.zoo import create_model

KEPT = "glibc.malloc.trim_threshold=1073741824:glibc.malloc.mmap_threshold=33554432"


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _batch(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 32, 32, generator=gen), torch.randint(0, 10, (n,), generator=gen)


def measure(model_name: str, batch: int, rounds: int) -> dict[str, dict[str, float]]:
    """Median ms and minor faults per step kind, in this process."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = create_model(model_name)
    gen = torch.Generator().manual_seed(0)
    s, nxt = (_batch(batch, gen) for _ in range(2))
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

    steps = {
        "plain": plain,
        "objective": lambda: gradinit_step("objective"),
        "constraint": lambda: gradinit_step("constraint"),
    }
    seen: dict[str, list[tuple[float, int]]] = {k: [] for k in steps}
    with evaluation_modes(model, batch_stats=True):
        for r in range(rounds + 1):
            for kind, fn in steps.items():
                f0, t0 = _faults(), time.process_time()
                fn()
                if r:
                    seen[kind].append((time.process_time() - t0, _faults() - f0))
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
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.model, args.batch, args.rounds)))
        return
    rows = []
    for heap, env in (("glibc defaults", {}), ("kept (GLIBC_TUNABLES)", {"GLIBC_TUNABLES": KEPT})):
        out = subprocess.run(
            [sys.executable, __file__, "--child", "--model", args.model, "--batch",
             str(args.batch), "--rounds", str(args.rounds)],
            env={**os.environ, "OMP_NUM_THREADS": "1", **env},
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        result = json.loads(out.strip().splitlines()[-1])
        plain = result["plain"]["ms"]
        for kind, v in result.items():
            rows.append(
                {"heap": heap, "step": kind, "ms": v["ms"], "x_plain": v["ms"] / plain,
                 "minor_faults": v["faults"], "faulted_MB": v["faults"] * 4 / 1024}
            )  # fmt: skip
    print(f"{args.model}, batch {args.batch}, medians of {args.rounds} rounds (process CPU time)")
    print(format_table(rows))


if __name__ == "__main__":
    main()
