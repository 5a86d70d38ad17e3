"""Batches as the data-dependent procedures take them.

``data`` is one batch (a tensor, or a tuple/list/dict whose first element is the input) or an
iterable of batches (a ``DataLoader``, a list). ``loss_fn(model, batch) -> scalar`` computes the
loss for any batch structure; :func:`default_forward` is what forward-only procedures call.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["batch_size", "default_forward", "first_tensor", "is_single_batch", "take_batches"]


def is_single_batch(data: Any) -> bool:
    """A tensor, or a tuple/list/dict of tensors (one batch), rather than an iterable of batches."""
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, Mapping):
        return all(isinstance(v, torch.Tensor) for v in data.values())
    if isinstance(data, (tuple, list)):
        return len(data) > 0 and all(isinstance(v, torch.Tensor) for v in data)
    return False


def take_batches(
    data: Any, n: int | None = None, *, what: str = "this procedure", exact: bool = True
) -> list[Any]:
    """The first ``n`` batches of ``data`` (all of them when ``n`` is None).

    With ``exact=False`` fewer than ``n`` batches are fine (at most ``n`` are taken).

    Raises:
        ValueError: ``data`` is empty, or (``exact``) has fewer than ``n`` batches; the message
            says how many are needed.
    """
    if is_single_batch(data):
        batches = [data]
    else:
        if not isinstance(data, Iterable):
            raise TypeError(
                f"data must be a batch (tensor or tuple of tensors) or an iterable of batches, "
                f"got {type(data).__name__}"
            )
        it: Iterator[Any] = iter(data)
        batches = []
        for batch in it:
            batches.append(batch)
            if n is not None and len(batches) == n:
                break
    if exact and n is not None and len(batches) < n:
        raise ValueError(
            f"{what} needs {n} batches but the data gave {len(batches)}; pass a loader with at "
            f"least {n} batches (or lower the number of iterations/batches asked for)"
        )
    if not batches:
        raise ValueError(f"{what} got no batch: the data is empty")
    return batches


def first_tensor(batch: Any) -> torch.Tensor:
    """The batch itself (a tensor), or its first tensor (tuple, list or dict)."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        return next(v for v in batch.values() if isinstance(v, torch.Tensor))
    return next(v for v in batch if isinstance(v, torch.Tensor))


def default_forward(model: nn.Module, batch: Any) -> Any:
    """``model(x)`` for a tensor, ``model(batch[0])`` for a tuple/list, ``model(**batch)``."""
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    return model(batch[0])


def batch_size(batch: Any) -> int:
    """Size of dim 0 of the batch's first tensor."""
    return int(first_tensor(batch).shape[0])
