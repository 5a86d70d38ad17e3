"""What evaluating a model at other tensors costs over calling it (GradInit's, MetaInit's forward).

``loss_at`` (``initlab.methods._alpha``) runs ``loss_fn`` on a stand-in that evaluates the model
at ``theta``. Three candidates, alternating, no gradient, batch 1 (so the fixed cost shows):

* ``plain``: ``F.cross_entropy(model(x), y)``, the model's own parameters;
* ``functional_call``: ``torch.func.functional_call`` (it walks the model on every call to untie
  and swap the entries), as ``loss_at`` evaluated the model before;
* ``slots``: ``loss_at`` (the entries swapped directly, from the slots ``select_tensors``
  recorded once).

Printed: the time of each (ms, process CPU time, best of ``--repeats`` blocks of ``--calls``) and
the overhead over ``plain``. Run: ``OMP_NUM_THREADS=1 python benchmarks/bench_at_params.py``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.func import functional_call
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _timing import interleaved_min
from initlab._core.rows import format_table
from initlab.methods._alpha import default_loss, loss_at, nonzero, scaled_leaves
from initlab.methods._alpha import select_tensors as _select
from initlab.zoo import create_model


def _measure(name: str, model: torch.nn.Module, calls: int, repeats: int) -> dict[str, object]:
    model.train()
    ts = _select(model, "default", nonzero, "bench")
    theta = scaled_leaves(ts, torch.ones(len(ts.scaled), dtype=torch.float64))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(1, 3, 32, 32, generator=g), torch.randint(0, 10, (1,), generator=g)
    tensors = dict(zip(ts.names, theta, strict=True))

    def repeat(fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                for _ in range(calls):
                    fn()

        return run

    best = interleaved_min(
        {
            "plain": repeat(lambda: F.cross_entropy(model(x), y)),
            "functional_call": repeat(
                lambda: F.cross_entropy(functional_call(model, tensors, (x,)), y)
            ),
            "slots": repeat(lambda: loss_at(model, default_loss, ts, theta, (x, y))),
        },
        repeats,
        clock=time.process_time,
    )
    ms = {k: 1e3 * v / calls for k, v in best.items()}
    return {
        "model": name,
        "tensors": len(ts.tensors),
        "plain_ms": round(ms["plain"], 3),
        "functional_call_ms": round(ms["functional_call"], 3),
        "slots_ms": round(ms["slots"], 3),
        "functional_call_over_ms": round(ms["functional_call"] - ms["plain"], 3),
        "slots_over_ms": round(ms["slots"] - ms["plain"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [
        _measure("resnet20", create_model("resnet20"), args.calls, args.repeats),
        _measure(
            "vgg19_bn (width 0.25)",
            create_model("vgg19_bn", width=0.25),
            args.calls,
            args.repeats,
        ),
    ]
    print(f"torch {torch.__version__}, 1 thread, batch 1, {args.calls} calls per block")
    print(format_table(rows))


if __name__ == "__main__":
    main()
