"""restore_on_failure, the batch helpers and the gloo helper itself."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from initlab._core.data import batch_size, default_forward, take_batches
from initlab._core.distributed import all_reduce_sum, is_distributed
from initlab._core.state import restore_on_failure

from .ddp_util import run_ranks


def test_restore_on_failure_restores_weights_buffers_modes_and_ties() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4))
    model[2].weight = model[0].weight
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="midway"), restore_on_failure(model):
        model.train()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        model(torch.randn(8, 4))  # updates BatchNorm running stats
        raise RuntimeError("midway")
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not any(m.training for m in model.modules())
    assert model[2].weight is model[0].weight


def test_restore_on_failure_keeps_success() -> None:
    model = nn.Linear(2, 2)
    with restore_on_failure(model), torch.no_grad():
        model.weight.zero_()
    assert torch.count_nonzero(model.weight) == 0


def test_take_batches_and_forward() -> None:
    x, y = torch.randn(6, 3), torch.arange(6)
    assert len(take_batches((x, y))) == 1
    loader = [(x[:3], y[:3]), (x[3:], y[3:])]
    assert len(take_batches(loader, 2)) == 2
    with pytest.raises(ValueError, match="needs 3 batches but the data gave 2"):
        take_batches(loader, 3)
    with pytest.raises(ValueError, match="empty"):
        take_batches([])
    lin = nn.Linear(3, 2)
    assert default_forward(lin, (x, y)).shape == (6, 2)
    assert default_forward(lin, x).shape == (6, 2)
    assert batch_size({"input": x}) == 6


def _sum_ranks(rank: int, world_size: int) -> list[float]:
    t = torch.tensor([float(rank + 1), 10.0 * rank])
    assert is_distributed()
    all_reduce_sum([t])
    return t.tolist()


def test_all_reduce_sum_on_two_gloo_ranks() -> None:
    assert run_ranks(_sum_ranks, 2) == [[3.0, 10.0], [3.0, 10.0]]
