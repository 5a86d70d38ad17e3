"""``input_scale`` and ``input_scale_for`` under ``torch.distributed`` (2 gloo CPU ranks).

Each rank read and checked its batches outside any agreement, then entered a bare all-reduce: a
rank whose data failed raised its own error while the other got gloo's "Connection closed by
peer" (or, had the failed rank carried on, waited in the all-reduce until the process group's
timeout). Now every rank raises the same ``RankMismatchError``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from initlab import Batches
from initlab.methods.input_scale import input_scale, input_scale_for

from .ddp_util import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(rank: int, n: int) -> Batches:
    gen = torch.Generator().manual_seed(10 + rank)
    return Batches(
        [torch.randn(16, 8, generator=gen, dtype=torch.float64) * (1 + i) for i in range(n)]
    )


def _outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        scaling = call()
    except Exception as err:
        return type(err).__name__, str(err)
    return "ok", (scaling.factor, scaling.measured, scaling.n_in)


def _failing_worker(rank: int, world: int) -> dict[str, tuple[str, Any]]:
    x = _inputs(rank, 2)
    nan = Batches([t.clone() for t in x])
    nan.items[1][0, 0] = float("nan")
    mlp = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    cases: dict[str, Callable[[], Any]] = {
        "integer inputs on rank 1": lambda: input_scale(
            Batches([t.long() for t in x]) if rank == 1 else x
        ),
        "NaN on rank 1": lambda: input_scale(nan if rank == 1 else x),
        "no batch on rank 1": lambda: input_scale([] if rank == 1 else x),
        "input_scale_for, rank 1's batch too wide": lambda: input_scale_for(
            mlp, torch.randn(16, 9, dtype=torch.float64) if rank == 1 else x.items[0]
        ),
        "then 2 and 3 batches": lambda: input_scale(_inputs(rank, 2 + rank)),
    }
    return {name: _outcome(call) for name, call in cases.items()}


def test_a_failure_on_one_rank_raises_the_same_error_on_every_rank() -> None:
    r0, r1 = run_ranks(_failing_worker, 2, timeout_s=120)
    failed = {
        "integer inputs on rank 1": "TypeError: input_scale needs floating-point inputs",
        "NaN on rank 1": "ValueError: ",
        "no batch on rank 1": "ValueError: input_scale got no batch",
        "input_scale_for, rank 1's batch too wide": "RuntimeError: ",
    }
    for name, error in failed.items():
        assert r0[name] == r1[name], name
        kind, message = r0[name]
        assert kind == "RankMismatchError", (name, message)
        what = name.split(",")[0] if name.startswith("input_scale_for") else "input_scale"
        assert message.startswith(f"{what} stopped on every rank because 1 of 2 rank(s) failed")
        assert f"rank 1: {error}" in message, (name, message)
    # the ranks are still in step: uneven batch counts pool the union (float64, by hand)
    union = torch.cat([t.reshape(-1) for r in range(2) for t in _inputs(r, 2 + r).items])
    measured = float(union.square().mean())
    for got in (r0, r1):
        kind, (factor, seen, n_in) = got["then 2 and 3 batches"]
        assert kind == "ok" and n_in == 8
        assert seen == pytest.approx(measured, rel=1e-12)
        assert factor == pytest.approx((8**-0.5 / measured) ** 0.5, rel=1e-12)


def _widths_worker(rank: int, world: int) -> dict[str, tuple[str, Any]]:
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(32, 8 if rank == 0 else 3, generator=gen, dtype=torch.float64)
    return {
        "widths 8 and 3": _outcome(lambda: input_scale(x)),
        "n_in= 8 and 3": _outcome(lambda: input_scale(x[:, :3], n_in=8 if rank == 0 else 3)),
        "then the same n_in": _outcome(lambda: input_scale(x[:, :3], n_in=3)),
    }


def test_ranks_whose_inputs_differ_in_width_raise_naming_both() -> None:
    """Each rank used its own n_in with the pooled E[x^2]: different factors, and no error."""
    r0, r1 = run_ranks(_widths_worker, 2, timeout_s=120)
    for name in ("widths 8 and 3", "n_in= 8 and 3"):
        assert r0[name] == r1[name]
        kind, message = r0[name]
        assert kind == "RankMismatchError"
        assert "n_in (3 on some ranks, 8 on others)" in message
        assert "kernel taps" not in message and "same number of features" in message
    assert r0["then the same n_in"][0] == r1["then the same n_in"][0] == "ok"
    assert r0["then the same n_in"] == r1["then the same n_in"]
