"""The tensors of a probed module call: :func:`_flatten_call` lists its arguments' tensors with
their paths; :func:`_fresh_full_view` says where an output's gradient hook must also go on the
output's base (an in-place op on a view output rebases it and its own hook never fires)."""

from __future__ import annotations

import torch

from initlab._core.pytree import flatten_tensors


def _flatten_call(args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a module call's arguments with their paths (positions, then keywords):
    ``flatten_tensors(list(args)) + flatten_tensors(dict(kwargs))``, with a shortcut for the
    common call of tensors only."""
    if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
        return [(str(i), a) for i, a in enumerate(args)]
    return flatten_tensors(list(args)) + flatten_tensors(dict(kwargs))


def _fresh_full_view(t: torch.Tensor, base: torch.Tensor | None, inputs: set[int]) -> bool:
    """``t`` is a row-major view of all of ``base``, a non-leaf made by the module's forward."""
    return (
        base is not None
        and base.requires_grad
        and not base.is_leaf
        and id(base) not in inputs
        and base.numel() == t.numel()
        and base.is_contiguous()
        and t.is_contiguous()
        and t.storage_offset() == base.storage_offset()
    )
