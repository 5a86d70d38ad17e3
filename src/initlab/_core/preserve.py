"""Measure a model without changing it: parameters, buffers, modes, ``.grad`` and the RNG."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from initlab._core.state import model_modes, restore_modes

__all__ = ["preserved_state"]


@contextmanager
def preserved_state(model: nn.Module, *, params: bool = True) -> Iterator[None]:
    """Run the block and put the model back exactly as it was, also when the block raises.

    Restored: every buffer (BatchNorm running statistics and ``num_batches_tracked`` change in a
    train-mode forward) and, with ``params=True``, every parameter, copied back in place (tied
    tensors stay tied, nothing moves); each submodule's ``training`` flag; each parameter's
    ``.grad`` (the same tensor object, or ``None``); the CPU and CUDA random number generators
    (dropout draws from them). Memory: one copy of the buffers (and parameters).
    """
    tensors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    chosen = [*model.buffers(), *(model.parameters() if params else ())]
    for t in chosen:
        if id(t) not in tensors:
            tensors[id(t)] = (t, t.detach().clone())
    all_params = list(model.parameters())
    grads = [p.grad for p in all_params]
    modes = model_modes(model)
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for t, saved in tensors.values():
                if t.shape != saved.shape or not torch.equal(t, saved):
                    t.copy_(saved)
        for p, g in zip(all_params, grads, strict=True):
            p.grad = g
        restore_modes(model, modes)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
