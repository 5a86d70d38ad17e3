"""Peak memory and wall time of MetaInit's steps vs a plain forward + backward (fresh processes).

Each candidate runs in its own Python process (none can reuse memory another freed): the model
and ``--steps`` batches are built, ``ru_maxrss`` is read, the candidate runs, and the growth of the
peak resident set is reported, in MiB and as a multiple of the parameters' bytes:

* ``plain``: ``model.train()``, forward + cross-entropy + backward, ``--steps`` times (gradients
  set to ``None`` between steps): the baseline;
* ``gradinit`` / ``paper``: ``metainit_(model, data, variant=..., steps=--steps)`` on the same
  batches (its third-order backward through ``H g``).

Model: ``--depth`` (default 25) ``Linear(--width, --width)`` layers (default 1024) with ``Tanh``
between them, float32 (26.2M parameters, 100 MiB); batch ``--batch`` (default 64) of ``N(0, 1)``
inputs and labels uniform over the ``--width`` outputs.

The gradient quotient was built from a chain of full-size elementwise tensors per parameter
(promotion, subtraction, sign, division, ``-1``, ``abs``), each kept by autograd for the
meta-gradient's backward; it is now one autograd Function that keeps ``g`` and ``H g`` only.
Measured on a loaded 2-core CPU (2026-11-27, four runs of each tree, alternating), growth of the
peak over 3 steps as a multiple of the parameter bytes: before, at 46a7b73 (HEAD when this script
was written, run with its ``src`` on ``PYTHONPATH``), ``gradinit`` 17.9-21.2x and ``paper``
19.3-22.4x (wall 7.2-12.3 s); after, ``gradinit`` 14.1-14.9x and ``paper`` 14.5-15.3x (wall
6.3-9.5 s); a plain forward + backward: 1.2x. The spread of one tree's runs is glibc's heap (which
blocks a step's freed tensors land in), not the tensors held. Then ``H g`` was taken as the
gradient of ``||g||^2 / 2``, whose backward made a copy of ``g`` that the third-order graph kept;
it is now ``grad(g, theta, grad_outputs=g)`` (the same bits): at 1e120a4 ``gradinit`` 14.2-14.3x
and ``paper`` 13.6-14.4x, after 11.2-11.9x and 11.3-11.6x (two alternating runs of each tree, a
loaded machine, 2026-11-27). The first ``grad`` with ``grad_outputs`` in a process imports
torch's symbolic-shapes module (sympy), about 1 s once.

Run: ``python benchmarks/bench_metainit_memory.py [--depth 25] [--width 1024] [--batch 64]
[--steps 3]``.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

from initlab import metainit_
from initlab._core.rows import format_table

KINDS = ("plain", "gradinit", "paper")


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _mlp(depth: int, width: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for k in range(depth):
        layers.append(nn.Linear(width, width))
        if k < depth - 1:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def child(kind: str, depth: int, width: int, batch: int, steps: int) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = _mlp(depth, width)
    gen = torch.Generator().manual_seed(0)
    data = [
        (torch.randn(batch, width, generator=gen), torch.randint(0, width, (batch,), generator=gen))
        for _ in range(steps)
    ]
    before = _peak_mib()
    start = time.perf_counter()
    if kind == "plain":
        model.train()
        for x, y in data:
            F.cross_entropy(model(x), y).backward()
            model.zero_grad(set_to_none=True)
    else:
        metainit_(model, data, variant=kind, steps=steps)
    wall = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    print(f"{params} {_peak_mib() - before:.1f} {wall:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=25)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = ["--depth", str(args.depth), "--width", str(args.width)]
    shape += ["--batch", str(args.batch), "--steps", str(args.steps)]
    if args.child:
        child(args.child, args.depth, args.width, args.batch, args.steps)
        return
    rows, plain, params = [], 0.0, 0
    for kind in KINDS:
        cmd = [sys.executable, __file__, "--child", kind, *shape]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()
        params, peak, wall = int(out[0]), float(out[1]), float(out[2])
        plain = plain or peak
        rows.append({
            "run": kind,
            "peak_mib": peak,
            "x_param_bytes": peak / (params * 4 / 2**20),
            "x_plain": peak / plain,
            "wall_s": wall,
        })  # fmt: skip
    print(
        f"torch {torch.__version__}, cpus {os.cpu_count()}, MLP {args.depth} x Linear"
        f"({args.width}, {args.width}) + Tanh, {params} parameters "
        f"({params * 4 / 2**20:.1f} MiB float32), batch {args.batch}, {args.steps} steps each"
    )
    print(format_table(rows))
    print(
        "\npeak_mib: growth of the peak resident set over the steps, above the model and the "
        "batches (each run in a fresh process); x_param_bytes: that over the parameters' bytes; "
        "x_plain: over the plain forward + backward's."
    )


if __name__ == "__main__":
    main()
