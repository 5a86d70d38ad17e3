"""GradInit cost per iteration vs one plain training step, on CIFAR-shaped nets (CPU by default).

Candidates, run alternately (best of ``--repeats`` after one warm-up, ``_timing.interleaved_min``):

* ``plain``: one training step, ``model.train()``, forward + cross-entropy + backward +
  ``SGD(lr=0.1, momentum=0.9, weight_decay=1e-4).step()`` + ``zero_grad`` (the paper's training);
* ``objective (1st order)``: one GradInit objective iteration, the default mode: L(S) forward and
  backward, look-ahead ``theta - eta g``, L(S~) forward, backward to the alphas, Adam on alpha;
* ``constraint``: one constraint iteration (``||g||_2 > gamma``) after a constraint iteration:
  forward, backward with graph, double backward to the alphas, Adam on alpha (after an
  objective iteration it costs one more backward);
* ``objective (exact)``: one objective iteration with ``exact=True`` (SGD).

An iteration is the body of ``gradinit_``'s loop (``_GradInitStep`` + the Adam update, inside
the same train/eval-mode and buffer handling); ``setup`` is the one-off cost of a ``gradinit_``
call around it (tensor selection, snapshots for restore-on-failure, folding, report), measured as
``gradinit_(steps=1)`` minus one objective iteration. Goal: first-order objective <= 2.0x
plain (the GradInit reference implementation measures 2.4x and 3.6x on CPU).

Models: zoo ``resnet20`` (full width) and ``vgg19_bn`` at ``--vgg-width`` (default 0.25: 16
convs of 16..128 channels; full width costs ~16x more per step on CPU), CIFAR 32x32 inputs,
batch ``--batch`` (default 128; S and S~ both have this size).

CPU threads: ``--threads`` (default 1: on a shared machine more threads than idle cores make
every timing several times slower and erratic; the ratios are what matter).

Run: ``python benchmarks/bench_gradinit.py [--batch 64] [--repeats 3] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _timing import interleaved_min
from initlab._core.rows import format_table
from initlab.methods._alpha import AlphaAdam as _Adam
from initlab.methods._alpha import default_loss as _default_loss
from initlab.methods._alpha import evaluation_modes as _evaluation_modes
from initlab.methods._alpha import nonzero as _nonzero
from initlab.methods._alpha import select_tensors as _select
from initlab.methods.gradinit import _GradInitStep, gradinit_, overlap_batch
from initlab.zoo import create_model


def _batch(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 32, 32, generator=gen), torch.randint(0, 10, (n,), generator=gen)


def bench(
    name: str, model: nn.Module, batch: int, repeats: int, device: torch.device
) -> dict[str, object]:
    gen = torch.Generator().manual_seed(0)
    model.to(device)
    s, nxt = (tuple(t.to(device) for t in _batch(batch, gen)) for _ in range(2))
    s_tilde = overlap_batch(s, nxt, 0.5)

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)

    def plain() -> None:
        model.train()
        loss = F.cross_entropy(model(s[0]), s[1])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    ts = _select(model, "default", _nonzero, "bench")
    alpha = torch.ones(len(ts.scaled), dtype=torch.float64)

    def iteration(kind: str, exact: bool) -> None:
        run = _GradInitStep(
            model, _default_loss, ts, eta=0.1, optimizer="sgd", exact=exact, what="bench"
        )
        run.last_kind = kind  # steady state: the previous step was of the same kind
        adam = _Adam.zeros(len(ts.scaled), 1e-3)
        res = run(alpha, s, lambda: s_tilde, math.inf, 0, force=kind)
        adam.step(alpha, res.grad.clamp(-1, 1), 0.01)

    def in_modes(kind: str, exact: bool):
        def fn() -> None:
            with _evaluation_modes(model, batch_stats=True):
                iteration(kind, exact)

        return fn

    times = interleaved_min(
        {
            "plain": plain,
            "objective": in_modes("objective", False),
            "constraint": in_modes("constraint", False),
            "exact": in_modes("objective", True),
        },
        repeats=repeats,
    )
    start = time.perf_counter()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    gradinit_(model, [s, nxt], steps=1, gamma=math.inf)
    full = time.perf_counter() - start
    model.load_state_dict(state)
    p = times["plain"]
    return {
        "model": name,
        "params": sum(q.numel() for q in model.parameters()),
        "batch": batch,
        "plain_s": p,
        "objective_s": times["objective"],
        "objective_x": times["objective"] / p,
        "constraint_s": times["constraint"],
        "constraint_x": times["constraint"] / p,
        "exact_s": times["exact"],
        "exact_x": times["exact"] / p,
        "setup_s": max(full - times["objective"], 0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vgg-width", type=float, default=0.25)
    parser.add_argument("--device", default="cpu", help="the documented target is CPU")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1: stable on a shared machine)"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    uptime = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout
    print(
        f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
        f"cpus {os.cpu_count()}; uptime: {uptime.strip()}"
    )
    models = {
        "resnet20": create_model("resnet20"),
        f"vgg19_bn (width {args.vgg_width:g})": create_model("vgg19_bn", width=args.vgg_width),
    }
    rows = []
    for name, model in models.items():
        rows.append(bench(name, model, args.batch, args.repeats, device))
        print(format_table(rows[-1:]), flush=True)
    print()
    print(format_table(rows))
    print(
        "\n*_x: time of one GradInit iteration / one plain training step (same batch size). "
        "Goal: objective_x <= 2.0 (first-order, default)."
    )


if __name__ == "__main__":
    main()
