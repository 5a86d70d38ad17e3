"""GradInit cost per iteration vs one plain training step, on CIFAR-shaped nets (CPU by default).

Candidates, run alternately for ``--repeats`` turns after one warm-up
(``_timing.interleaved_times``), each turn ``--block`` calls in a row, the first one untimed, so
that each candidate is timed in its own steady state as in ``gradinit_``'s loop of it; a
candidate's time is the median of its timed calls (``--stat median``, what a loop of it costs) or
the best (``--stat min``). On CPU with glibc's allocator the heap, and with it the page faults a
call pays, depends on the calls before: a step timed right after a hungrier one finds memory its
own loop would have handed back and faulted in again, and the best call of a loop can be one that
missed the faults most of its calls pay (ResNet-20's constraint step in a process whose heap glibc
trims: best 2.5x, median 2.9-3.4x a plain step; ``benchmarks/results/README.md``). Each GradInit
candidate's turn runs inside :func:`~initlab._core.heap.kept_heap`, as ``gradinit_`` runs its
loop (``--no-keep-heap``: without it); the plain step runs in the heap as glibc leaves it:

* ``plain``: one training step, ``model.train()``, forward + cross-entropy + backward +
  ``SGD(lr=0.1, momentum=0.9, weight_decay=1e-4).step()`` + ``zero_grad`` (the paper's training);
* ``objective (1st order)``: one GradInit objective iteration, the default mode: L(S) forward and
  backward, look-ahead ``theta - eta g``, L(S~) forward, backward to the alphas, Adam on alpha;
* ``constraint``: one constraint iteration (``||g||_2 > gamma``) after a constraint iteration:
  forward, backward with graph, double backward to the alphas, Adam on alpha (after an
  objective iteration it costs one more backward);
* ``objective (exact)``: one objective iteration with ``exact=True`` (SGD);
* ``autograd_2nd``: the constraint iteration with autograd's own double backward of convolutions
  and batch norms (the code before :func:`~initlab.methods._second_order.written_out_second_order`),
  side by side with the current one;
* ``all_weights_2nd``: the constraint iteration with the second derivatives written out but no
  tensor passed as ``scaled`` (every weight gradient of the last backward computed in full).

An iteration is the body of ``gradinit_``'s loop (``_GradInitStep`` + the Adam update, in the
same train/eval modes; the buffers are saved once and put back after all the runs, as
``gradinit_`` does around its loop); ``setup`` is the one-off cost of a ``gradinit_`` call around
it (tensor selection, snapshots for restore-on-failure and of the buffers, folding, report),
measured as ``gradinit_(steps=1)`` minus one objective iteration. Goal: first-order objective
<= 2.0x plain (the GradInit reference implementation measures 2.4x and 3.6x on CPU).

Models: zoo ``resnet20`` (full width) and ``vgg19_bn`` at ``--vgg-width`` (default 0.25: 16
convs of 16..128 channels; full width costs ~16x more per step on CPU), CIFAR 32x32 inputs,
batch ``--batch`` (default 128; S and S~ both have this size).

CPU threads: ``--threads`` (default 1: on a shared machine more threads than idle cores make
every timing several times slower and erratic; the ratios are what matter). ``--cpu-time`` times
by this process's CPU time, which other processes on a loaded machine disturb much less.

Goals: first-order objective <= 2.0x, constraint step <= 3.0x a plain step (the reference
implementation measures 3.6x). The constraint step differentiates through ``g`` with the
convolutions and batch norms of :func:`~initlab.methods._second_order.written_out_second_order`.

Run: ``python benchmarks/bench_gradinit.py [--batch 64] [--repeats 3] [--block 3] [--threads 1]
[--cpu-time] [--no-keep-heap]``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).parent))
import initlab.methods.gradinit as gradinit_module
from _timing import cifar_batch, interleaved_times
from initlab._core.heap import kept_heap
from initlab._core.rows import format_table
from initlab.methods._alpha import AlphaAdam as _Adam
from initlab.methods._alpha import default_loss as _default_loss
from initlab.methods._alpha import evaluation_modes as _evaluation_modes
from initlab.methods._alpha import nonzero as _nonzero
from initlab.methods._alpha import select_tensors as _select
from initlab.methods._alpha import set_evaluation_modes as _set_evaluation_modes
from initlab.methods._second_order import written_out_second_order as _written_out_second_order
from initlab.methods.gradinit import _GradInitStep, gradinit_, overlap_batch
from initlab.zoo import create_model


def bench(
    name: str,
    model: nn.Module,
    batch: int,
    repeats: int,
    device: torch.device,
    clock: Callable[[], float] = time.perf_counter,
    block: int = 1,
    stat: Callable[[list[float]], float] = min,
    keep_heap: bool = True,
) -> dict[str, object]:
    gen = torch.Generator().manual_seed(0)
    model.to(device)
    s, nxt = (tuple(t.to(device) for t in cifar_batch(batch, gen)) for _ in range(2))
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
    runs: dict[tuple[str, bool], _GradInitStep] = {}

    def iteration(kind: str, exact: bool) -> None:
        # One step object per kind, as in gradinit_'s loop: its one-off check of the graph of g
        # (for a cut second derivative) runs at the warm-up, not in every timed iteration.
        if (kind, exact) not in runs:
            runs[kind, exact] = _GradInitStep(
                model, _default_loss, ts, eta=0.1, optimizer="sgd", exact=exact, what="bench"
            )
        run = runs[kind, exact]
        run.last_kind = kind  # steady state: the previous step was of the same kind
        adam = _Adam.zeros(len(ts.scaled), 1e-3)
        res = run(alpha, s, lambda: s_tilde, math.inf, 0, force=kind)
        adam.step(alpha, res.grad.clamp(-1, 1), 0.01)

    def in_modes(kind: str, exact: bool, second: str = "") -> Callable[[], None]:
        # second: "" (as gradinit_), "autograd" (autograd's own double backward of convolutions
        # and batch norms) or "all_weights" (written out, every weight gradient in full)
        stand_in = {
            "autograd": nullcontext,
            "all_weights": lambda scaled: _written_out_second_order(),
        }

        def fn() -> None:
            patch = (
                mock.patch.object(gradinit_module, "written_out_second_order", stand_in[second])
                if second
                else nullcontext()
            )
            # gradinit_'s modes, set as the plain step sets model.train(); gradinit_ saves the
            # buffers and puts them back once around its loop (counted in ``setup``)
            _set_evaluation_modes(model, batch_stats=True)
            with patch:
                iteration(kind, exact)

        return fn

    with _evaluation_modes(model, batch_stats=True):  # buffers put back after all the runs
        calls = interleaved_times(
            {
                "plain": plain,
                "objective": in_modes("objective", False),
                "constraint": in_modes("constraint", False),
                "constraint_autograd": in_modes("constraint", False, "autograd"),
                "constraint_all_weights": in_modes("constraint", False, "all_weights"),
                "exact": in_modes("objective", True),
            },
            repeats=repeats,
            clock=clock,
            block=block,
            # each GradInit candidate's block in a kept heap, as gradinit_ runs its loop
            around=lambda name: kept_heap(keep_heap and name != "plain"),
        )
    times = {name: stat(t) for name, t in calls.items()}
    start = time.perf_counter()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    gradinit_(model, [s, nxt], steps=1, gamma=math.inf, keep_heap=keep_heap)
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
        "autograd_2nd_x": times["constraint_autograd"] / p,
        "all_weights_2nd_x": times["constraint_all_weights"] / p,
        "exact_s": times["exact"],
        "exact_x": times["exact"] / p,
        "setup_s": max(full - times["objective"], 0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--block", type=int, default=3, help="calls in a row per turn, the first untimed (1: none)"
    )
    parser.add_argument("--stat", choices=["median", "min"], default="median")
    parser.add_argument("--vgg-width", type=float, default=0.25)
    parser.add_argument("--device", default="cpu", help="the documented target is CPU")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1: stable on a shared machine)"
    )
    parser.add_argument(
        "--cpu-time", action="store_true", help="time by process CPU time (CPU, loaded machine)"
    )
    parser.add_argument(
        "--no-keep-heap",
        dest="keep_heap",
        action="store_false",
        help="GradInit's blocks without gradinit_'s kept C heap (glibc's trimming heap throughout)",
    )
    args = parser.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
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
        stat = statistics.median if args.stat == "median" else min
        run = (name, model, args.batch, args.repeats, device, clock, args.block, stat)
        rows.append(bench(*run, keep_heap=args.keep_heap))
        print(format_table(rows[-1:]), flush=True)
    print()
    print(format_table(rows))
    load = os.getloadavg()
    print(
        "\n*_x: time of one GradInit iteration / one plain training step (same batch size; "
        f"{'process CPU time' if args.cpu_time else 'wall time'}, {args.stat} of "
        f"{args.repeats} turns of {args.block} calls, the first untimed; GradInit's blocks "
        f"{'in a kept C heap, as gradinit_ runs them' if args.keep_heap else 'with --no-keep-heap'}"
        "). Goals: objective_x <= 2.0 (first-order, default), constraint_x <= 3.0. "
        f"Load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )


if __name__ == "__main__":
    main()
