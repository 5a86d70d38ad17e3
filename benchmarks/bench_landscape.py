"""Benchmark: loss-landscape grid throughput, vmapped vs looped (prints a table; not a test).

For an ``n × n`` grid of ``(t1, t2)`` and three models, points per second of

* ``vmap``: :func:`initlab.loss_landscape` with ``batched=True`` (chunks of grid points
  in one ``torch.func.vmap`` over stacked parameter sets, functional calls, the model untouched);
* ``functional loop``: the same with ``batched=False`` (one functional call per point);
* ``mutating loop``: the naive way: a deep copy of the model whose parameters are overwritten
  with ``θ + t1 d1 + t2 d2`` (``copy_``) before each forward.

All three evaluate the same directions and the same BatchNorm policy (eval) and their values
agree (checked). Times are the best of interleaved repeats (``_timing.interleaved_min``).

Run: ``python benchmarks/bench_landscape.py [--quick] [--threads N]`` (default 1 thread).
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleaved_min
from initlab.measure.landscape import loss_landscape
from initlab.zoo import create_model


def setup(name: str) -> tuple[nn.Module, tuple, str]:
    torch.manual_seed(0)
    if name == "lecture_mlp(12)":
        model = create_model("lecture_mlp", depth=12)
        x = torch.linspace(-2, 2, 256)[:, None]
        return model, (x, torch.sin(3 * x)), "mse"
    if name == "lecture_resnet_mlp(12)":
        model = create_model("lecture_resnet_mlp", depth=12)
        x = torch.linspace(-2, 2, 256)[:, None]
        return model, (x, torch.sin(3 * x)), "mse"
    if name == "paper_mlp":
        model = create_model("paper_mlp", n_in=64)
        return model, (torch.randn(512, 64), torch.randint(0, 10, (512,))), "cross_entropy"
    model = create_model("strided_lenet")
    return model, (torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))), "cross_entropy"


def mutating_loop(model: nn.Module, batch: tuple, loss: str, land: object, t1, t2) -> torch.Tensor:
    """Overwrite a deep copy's parameters point by point (the naive landscape)."""
    twin = copy.deepcopy(model).eval()
    d1, d2 = land.directions  # type: ignore[attr-defined]
    theta = {n: p.detach().clone() for n, p in twin.named_parameters()}
    fn = F.mse_loss if loss == "mse" else F.cross_entropy
    out = torch.empty(len(t1), len(t2), dtype=torch.float64)
    with torch.no_grad():
        for i, a in enumerate(t1.tolist()):
            for j, b in enumerate(t2.tolist()):
                for n, p in twin.named_parameters():
                    p.copy_(theta[n] + a * d1[n] + b * d2[n])
                out[i, j] = float(fn(twin(batch[0]), batch[1]))
    return out


def interleaved_min_cpu(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """:func:`_timing.interleaved_min` on the process's CPU time."""
    return interleaved_min(fns, repeats, clock=time.process_time)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = 7 if args.quick else 15
    repeats = 2 if args.quick else 5
    names = ["lecture_mlp(12)", "lecture_resnet_mlp(12)", "paper_mlp", "strided_lenet"]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, grid {n}x{n}, "
          f"best of {repeats} interleaved repeats")  # fmt: skip
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print(f"\n{'model':24} {'batch':>5} {'params':>7}  {'vmap':>11} {'functional':>11} "
          f"{'mutating':>11}  {'vmap/mut':>8}")  # fmt: skip
    print(f"{'':24} {'':>5} {'':>7}  {'points/s':>11} {'loop pts/s':>11} {'loop pts/s':>11}")
    t = torch.linspace(-1, 1, n)
    rows_cpu: list[tuple[str, dict[str, float]]] = []
    choices: list[str] = []
    for name in names:
        model, batch, loss = setup(name)
        land = loss_landscape(model, batch, loss, grid=(t, t), generator=0)
        looped = loss_landscape(model, batch, loss, grid=(t, t), generator=0, batched=False)
        slow = mutating_loop(model, batch, loss, land, t, t)
        assert land.method == "vmap", land.notes
        assert torch.allclose(land.values, looped.values, rtol=1e-4, atol=1e-6)
        assert torch.allclose(land.values, slow, rtol=1e-4, atol=1e-6)
        fns = {
            "vmap": lambda m=model, b=batch, lo=loss: loss_landscape(
                m, b, lo, grid=(t, t), generator=0
            ),
            "loop": lambda m=model, b=batch, lo=loss: loss_landscape(
                m, b, lo, grid=(t, t), generator=0, batched=False
            ),
            "mutating": lambda m=model, b=batch, lo=loss, la=land: mutating_loop(
                m, b, lo, la, t, t
            ),
        }
        best = interleaved_min(fns, repeats=repeats)
        cpu = interleaved_min_cpu(fns, repeats=repeats)
        pts = n * n
        n_params = sum(p.numel() for p in model.parameters())
        rows_cpu.append((name, {k: pts / v for k, v in cpu.items()}))
        auto = loss_landscape(model, batch, loss, grid=(t, t), generator=0, batched="auto")
        choices.append(f"{name}: {auto.notes[-1]}")
        print(f"{name:24} {batch[0].shape[0]:>5} {n_params:>7}  {pts / best['vmap']:>11.0f} "
              f"{pts / best['loop']:>11.0f} {pts / best['mutating']:>11.0f}  "
              f"{best['mutating'] / best['vmap']:>7.1f}x")  # fmt: skip
    print("\nthe same, points per CPU-second (time.process_time, best of interleaved repeats):")
    for name, r in rows_cpu:
        print(f"{name:24} {'':>5} {'':>7}  {r['vmap']:>11.0f} {r['loop']:>11.0f} "
              f"{r['mutating']:>11.0f}  {r['vmap'] / r['mutating']:>7.1f}x")  # fmt: skip
    print("\nwhat batched='auto' picks:")
    for c in choices:
        print("  " + c)
    print("\n(values of the three methods agree; the model is never mutated by loss_landscape)")
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
