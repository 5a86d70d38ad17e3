"""Accurate and fast sums of squares, the reduction every second moment in initlab rests on.

A float32 ``torch.linalg.vector_norm`` over a whole tensor accumulates naively on CPU: its relative
error grows with size (1.8e-5 at 1M elements, 1e-2 at 67M; so does a BLAS ``dot``).
``torch.sum(t * t)`` sums in cascades (~1e-8 at any size) but needs a temporary and a second pass
(3.5x slower). :func:`sum_of_squares` takes the norm of short rows (2048 elements, error ~1e-9)
and pools the rows' squares in float64: as fast as the naive norm, as accurate as the cascade.
:func:`sum_of_products` and :func:`squared_norms` are the cheap ones for many small tensors (one
kernel each, or one for all): a BLAS ``dot`` or a fused norm where they are still accurate, the
cascade or the rows above that.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["squared_norms", "sum_of_products", "sum_of_squares"]

_ROW = 2048
# Largest size reduced in one float32 pass (a BLAS dot or a fused norm): measured relative error
# <= 3e-7 up to 2**14 entries (a few times the float32 result's resolution), 1e-6 at 2**17.
_DOT = 1 << 14


def sum_of_squares(t: torch.Tensor, *, per_row: bool = False) -> torch.Tensor:
    """``sum(t**2)`` as a float64 tensor on ``t``'s device (no host sync).

    Args:
        t: a floating-point tensor (float16/bfloat16 are reduced in float32).
        per_row: reduce each ``t[i]`` separately (shape ``(t.shape[0],)``), e.g. per example.
    """
    d = t.detach()
    if d.dtype not in (torch.float32, torch.float64):
        d = d.float()
    d = d.reshape(d.shape[0] if per_row else 1, -1)
    rows, n = d.shape
    k = n // _ROW
    out = torch.zeros(rows, dtype=torch.float64, device=d.device)
    if k:
        main = torch.linalg.vector_norm(d[:, : k * _ROW].reshape(rows, k, _ROW), dim=2)
        out += main.to(torch.float64).square().sum(1)
    if k * _ROW < n:
        out += torch.linalg.vector_norm(d[:, k * _ROW :], dim=1).to(torch.float64).square()
    return out if per_row else out[0]


def sum_of_products(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``sum(x * y)`` over all entries, a 0-dim tensor on ``x``'s device (no host sync).

    Relative error <= 3e-7 of ``sum(|x * y|)`` in float32 at any size: one BLAS ``dot`` (no
    temporary) up to ``2**14`` entries, ``torch.sum(x * y)`` (cascade summation) above. The result
    has the inputs' dtype (float16/bfloat16 are multiplied and summed in float32).

    Args:
        x, y: floating-point tensors with the same number of entries (shapes may differ).
    """
    a, b = x.detach().reshape(-1), y.detach().reshape(-1)
    if a.dtype not in (torch.float32, torch.float64):
        a, b = a.float(), b.float()
    if a.numel() <= _DOT:
        return torch.dot(a, b)
    return (a * b).sum()


def squared_norms(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``sum(t**2)`` of each tensor, 0-dim tensors on their devices (no host sync).

    The float32/float64 tensors of up to ``2**14`` entries in one fused norm
    (``torch._foreach_norm``, relative error <= 3e-7), the others by :func:`sum_of_squares`
    (float64). One kernel launch instead of one per tensor for the many small tensors of a model.
    """
    out: list[torch.Tensor | None] = [None] * len(tensors)
    small = [
        i
        for i, t in enumerate(tensors)
        if t.dtype in (torch.float32, torch.float64) and t.numel() <= _DOT
    ]
    if small:
        norms = torch._foreach_norm([tensors[i].detach() for i in small])
        for i, n in zip(small, torch._foreach_mul(norms, norms), strict=True):
            out[i] = n
    return [sum_of_squares(t) if n is None else n for t, n in zip(tensors, out, strict=True)]
