"""Where GradInit's first-order objective iteration spends its time, beside a plain training step.

The two alternate for ``--iterations`` rounds after two warm-ups, in process CPU time, one thread;
each phase is reported as its median over the rounds (ms):

* plain step: ``forward`` (model and cross-entropy), ``backward``, ``optimizer``
  (``SGD(lr=0.1, momentum=0.9, weight_decay=1e-4).step()`` and ``zero_grad``);
* objective iteration (``_GradInitStep`` as in ``gradinit_``'s loop, in its evaluation modes):
  ``theta_alpha`` (:func:`~initlab.methods._alpha.scaled_leaves`), ``L(S) forward`` and
  ``L(S) backward``, ``||g||`` (:func:`~initlab._core.reductions.total_sum_of_squares`), ``theta'``
  (the look-ahead), ``L(S~) forward`` and ``L(S~) backward``, ``dots`` (the alpha-gradients, one
  :func:`~initlab._core.reductions.sum_of_products` per scaled tensor), ``rest`` (the iteration's
  total minus its phases: rank means, scalars, the Adam step on alpha).

The phases are timed by wrapping the functions the step calls (``unittest.mock``), so the step
runs unchanged; the wrappers add ~1 us per call (50-66 calls for ``dots``).

The goal's figure, with its uncertainty: the ratio of each round's whole objective iteration to its
plain step (adjacent in time, so both see the same machine state), as the median over the rounds
with a distribution-free 95% interval (``_timing.median_interval``). Run-to-run changes of the
machine move single ratios by ~2%: judge the goal by the interval, not by one run.

``--keep-heap`` runs the whole loop, plain steps too, inside :func:`~initlab._core.heap.kept_heap`
(no page faults in either step: the two steps' own costs; ``gradinit_`` keeps its heap the same
way for its loop).

Run: ``python benchmarks/bench_gradinit_phases.py [--iterations 10] [--batch 128] [--keep-heap]``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).parent))
import initlab.methods.gradinit as gradinit_module
from _timing import cifar_batch, median_interval
from initlab._core.heap import kept_heap
from initlab._core.rows import format_table
from initlab.methods._alpha import AlphaAdam, default_loss, evaluation_modes, nonzero
from initlab.methods._alpha import select_tensors as _select
from initlab.methods._alpha import set_evaluation_modes as _set_evaluation_modes
from initlab.methods.gradinit import _GradInitStep, overlap_batch
from initlab.zoo import create_model

_PLAIN = ["forward", "backward", "optimizer"]
_OBJECTIVE = [
    "theta_alpha",
    "L(S) forward",
    "L(S) backward",
    "||g||",
    "theta'",
    "L(S~) forward",
    "L(S~) backward",
    "dots",
    "rest",
]


def _timed(fn: Callable[..., Any], names: list[str], acc: dict[str, float]) -> Callable[..., Any]:
    """``fn`` that adds its CPU time to ``acc[names[i]]`` on its i-th call (the last name after)."""
    calls = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[names[min(calls[0], len(names) - 1)]] += time.process_time() - start
            calls[0] += 1

    return wrapper


def phases(
    model: nn.Module, batch: int, iterations: int, keep_heap: bool = False
) -> tuple[list[dict[str, object]], list[float]]:
    """The phase rows (medians, ms) and each round's objective / plain ratio."""
    gen = torch.Generator().manual_seed(0)
    s, nxt = (cifar_batch(batch, gen) for _ in range(2))
    s_tilde = overlap_batch(s, nxt, 0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    ts = _select(model, "default", nonzero, "bench")
    alpha = torch.ones(len(ts.scaled), dtype=torch.float64)
    run = _GradInitStep(
        model, default_loss, ts, eta=0.1, optimizer="sgd", exact=False, what="bench"
    )
    plain: dict[str, list[float]] = defaultdict(list)
    objective: dict[str, list[float]] = defaultdict(list)
    ratios: list[float] = []

    def plain_step(record: bool) -> float:
        model.train()
        marks = [time.process_time()]
        loss = F.cross_entropy(model(s[0]), s[1])
        marks.append(time.process_time())
        loss.backward()
        marks.append(time.process_time())
        opt.step()
        opt.zero_grad(set_to_none=True)
        marks.append(time.process_time())
        for name, a, b in zip(_PLAIN, marks, marks[1:], strict=False):
            if record:
                plain[name].append(b - a)
        return marks[-1] - marks[0]

    def objective_step(record: bool) -> float:
        acc: dict[str, float] = defaultdict(float)
        m = gradinit_module
        with ExitStack() as stack:
            for target, attr, names in (
                (m, "scaled_leaves", ["theta_alpha"]),
                (m, "loss_at", ["L(S) forward", "L(S~) forward"]),
                (m, "grads_or_zeros", ["L(S) backward", "L(S~) backward"]),
                (m, "total_sum_of_squares", ["||g||"]),
                (m, "sum_of_products", ["dots"]),
                (_GradInitStep, "_look_ahead", ["theta'"]),
            ):
                # on the class, the wrapper of ``_look_ahead`` is bound like the method it wraps
                timed = _timed(getattr(target, attr), names, acc)
                stack.enter_context(mock.patch.object(target, attr, timed))
            _set_evaluation_modes(model, batch_stats=True)
            start = time.process_time()
            adam = AlphaAdam.zeros(len(ts.scaled), 1e-3)
            res = run(alpha, s, lambda: s_tilde, math.inf, 0, force="objective")
            adam.step(alpha.clone(), res.grad.clamp(-1, 1), 0.01)
            total = time.process_time() - start
        if record:
            for name in _OBJECTIVE[:-1]:
                objective[name].append(acc[name])
            objective["rest"].append(total - sum(acc.values()))
        return total

    # buffers put back at the end
    with evaluation_modes(model, batch_stats=True), kept_heap(keep_heap):
        for i in range(iterations + 2):
            p = plain_step(record=i >= 2)
            o = objective_step(record=i >= 2)
            if i >= 2:
                ratios.append(o / p)
    rows: list[dict[str, object]] = []
    for name in _PLAIN:
        rows.append({"step": "plain", "phase": name, "ms": 1e3 * statistics.median(plain[name])})
    for name in _OBJECTIVE:
        rows.append(
            {"step": "objective", "phase": name, "ms": 1e3 * statistics.median(objective[name])}
        )
    return rows, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--vgg-width", type=float, default=0.25)
    parser.add_argument(
        "--keep-heap",
        action="store_true",
        help="the whole run, plain steps too, in a kept C heap (no page faults in either)",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    models = {
        "resnet20": create_model("resnet20"),
        f"vgg19_bn (width {args.vgg_width:g})": create_model("vgg19_bn", width=args.vgg_width),
    }
    for name, model in models.items():
        rows, ratios = phases(model, args.batch, args.iterations, args.keep_heap)
        plain = sum(float(r["ms"]) for r in rows if r["step"] == "plain")  # type: ignore[arg-type]
        obj = sum(float(r["ms"]) for r in rows if r["step"] == "objective")  # type: ignore[arg-type]
        clock = "process CPU time, kept heap" if args.keep_heap else "process CPU time"
        print(f"\n{name}, batch {args.batch}, medians of {args.iterations} (ms, {clock})")
        print(format_table(rows))
        print(f"sum of medians: plain {plain:.1f}, objective {obj:.1f}, ratio {obj / plain:.3f}")
        lo, mid, hi = median_interval(ratios)
        print(
            f"objective / plain per round: median {mid:.3f}, 95% interval {lo:.3f}-{hi:.3f} "
            f"({len(ratios)} rounds; goal <= 2.0)"
        )


if __name__ == "__main__":
    main()
