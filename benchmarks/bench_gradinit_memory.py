"""Peak memory of GradInit iterations vs plain training steps (CPU, each in a fresh process).

Each candidate runs in its own Python process (so one cannot reuse memory the other freed): the
model and a batch are built, ``ru_maxrss`` is read, then ``--steps`` iterations run and the growth
of the peak resident set is reported ("peak above the model", MiB):

* ``plain``: ``model.train()``, forward + cross-entropy + backward + ``SGD(lr=0.1, momentum=0.9,
  weight_decay=1e-4).step()`` + ``zero_grad`` (momentum buffers included);
* ``objective``: GradInit's first-order objective iteration (``_GradInitStep``, as in
  ``gradinit_``'s loop, in its evaluation modes).

Model: zoo ``vgg19_bn`` at ``--width`` (default 1: 20M parameters, 76 MiB), CIFAR 32x32 inputs,
batch ``--batch`` (default 8: small activations, so the copies of the parameters show).

Run: ``python benchmarks/bench_gradinit_memory.py [--width 1] [--batch 8] [--steps 3]``.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import subprocess
import sys

import torch
from torch.nn import functional as F

from initlab._core.rows import format_table
from initlab.methods._alpha import default_loss, evaluation_modes, nonzero, select_tensors
from initlab.methods.gradinit import _GradInitStep
from initlab.zoo import create_model


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def child(kind: str, width: float, batch: int, steps: int) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = create_model("vgg19_bn", width=width)
    gen = torch.Generator().manual_seed(0)
    s = (
        torch.randn(batch, 3, 32, 32, generator=gen),
        torch.randint(0, 10, (batch,), generator=gen),
    )
    before = _peak_mib()
    if kind == "plain":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        model.train()
        for _ in range(steps):
            F.cross_entropy(model(s[0]), s[1]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        ts = select_tensors(model, "default", nonzero, "bench")
        alpha = torch.ones(len(ts.scaled), dtype=torch.float64)
        run = _GradInitStep(
            model, default_loss, ts, eta=0.1, optimizer="sgd", exact=False, what="bench"
        )
        with evaluation_modes(model, batch_stats=True):
            for _ in range(steps):
                run(alpha, s, lambda: s, math.inf, 0, force="objective")
    params = sum(p.numel() for p in model.parameters())
    print(f"{params} {_peak_mib() - before:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--child", choices=["plain", "objective"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.width, args.batch, args.steps)
        return
    peaks = {}
    for kind in ("plain", "objective"):
        cmd = [sys.executable, __file__, "--child", kind, "--width", str(args.width)]
        cmd += ["--batch", str(args.batch), "--steps", str(args.steps)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()
        params, peaks[kind] = int(out[0]), float(out[1])
    row = {
        "model": f"vgg19_bn (width {args.width:g})",
        "params": params,
        "params_mib": round(params * 4 / 2**20, 1),
        "batch": args.batch,
        "plain_peak_mib": peaks["plain"],
        "objective_peak_mib": peaks["objective"],
        "objective_x": peaks["objective"] / peaks["plain"],
    }
    print(f"torch {torch.__version__}, cpus {os.cpu_count()}, {args.steps} steps each")
    print(format_table([row]))
    print(
        "\n*_peak_mib: growth of the peak resident set over the steps, above the model and the "
        "batch (each candidate in a fresh process)."
    )


if __name__ == "__main__":
    main()
