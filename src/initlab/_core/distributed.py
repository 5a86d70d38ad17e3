"""Make data-dependent statistics identical on every rank of a ``torch.distributed`` job.

When a process group is initialized, every statistic a data-dependent init measures (LSUV
variances, GradInit gradients and objectives, the output std) is summed over ranks before it is
used, and random draws are taken on rank 0 and broadcast, so all ranks end with bit-identical
weights. Without a process group every function here is the identity.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["all_reduce_sum", "broadcast_model", "is_distributed", "world_size"]


def is_distributed() -> bool:
    """Whether a ``torch.distributed`` process group is initialized with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    """Number of ranks (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def all_reduce_sum(tensors: Iterable[torch.Tensor]) -> None:
    """Sum each tensor over ranks, in place (one flattened collective for all of them)."""
    tensors = list(tensors)
    if not tensors or not is_distributed():
        return
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def broadcast_model(model: nn.Module, src: int = 0) -> None:
    """Copy every parameter and buffer of rank ``src`` to all ranks (in place)."""
    if not is_distributed():
        return
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=src)
