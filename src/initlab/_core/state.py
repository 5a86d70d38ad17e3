"""Leave a model as it was if a procedure fails: weights, buffers and train/eval modes.

Every data-dependent procedure (LSUV, GradInit, MetaInit, output scaling, preconditioning) runs
inside :func:`restore_on_failure`: on an exception, every parameter and buffer gets its saved
value back (in place, so references and ties the user holds stay valid), every module its
``training`` flag, and the exception propagates. On success nothing is copied back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["model_modes", "restore_modes", "restore_on_failure"]


def model_modes(model: nn.Module) -> dict[str, bool]:
    """The ``training`` flag of every submodule, by qualified name."""
    return {name: m.training for name, m in model.named_modules(remove_duplicate=False)}


def restore_modes(model: nn.Module, modes: dict[str, bool]) -> None:
    """Set every submodule's ``training`` flag back to ``modes`` (from :func:`model_modes`)."""
    for name, m in model.named_modules(remove_duplicate=False):
        if name in modes:
            m.training = modes[name]


@contextmanager
def restore_on_failure(model: nn.Module) -> Iterator[None]:
    """Snapshot ``model``'s tensors and modes; put them back if the block raises.

    The snapshot is a copy of every distinct parameter and buffer on its own device (memory: one
    model's worth). Restoring copies in place under ``no_grad``, so tied tensors stay tied and the
    model never moves.

    Example:
        >>> net = nn.Linear(2, 2)
        >>> before = net.weight.detach().clone()
        >>> try:
        ...     with restore_on_failure(net):
        ...         net.weight.data.mul_(0)
        ...         raise RuntimeError("midway")
        ... except RuntimeError:
        ...     pass
        >>> torch.equal(net.weight, before)
        True
    """
    tensors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in tensors:
            tensors[id(t)] = (t, t.detach().clone())
    modes = model_modes(model)
    try:
        yield
    except BaseException:
        with torch.no_grad():
            for t, saved in tensors.values():
                t.copy_(saved)
        restore_modes(model, modes)
        raise
