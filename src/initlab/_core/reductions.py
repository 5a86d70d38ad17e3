"""Accurate and fast sums of squares, the reduction every second moment in initlab rests on.

A float32 ``torch.linalg.vector_norm`` over a whole tensor accumulates naively on CPU: its relative
error grows with size (1.8e-5 at 1M elements, 1e-2 at 67M; so does a BLAS ``dot``).
``torch.sum(t * t)`` sums in cascades (~1e-8 at any size) but needs a temporary and a second pass
(3.5x slower). :func:`sum_of_squares` takes the norm of short rows (2048 elements, error ~1e-9)
and pools the rows' squares in float64: as fast as the naive norm, as accurate as the cascade.
:func:`sum_of_products` is the cheap one for many small tensors (one kernel each): a BLAS ``dot``
where it is still accurate, the cascade above that.
"""

from __future__ import annotations

import torch

__all__ = ["sum_of_products", "sum_of_squares"]

_ROW = 2048
_DOT = 1 << 17  # largest size summed with a BLAS dot (float32 error ~5e-8 there, 8e-7 at 1M)


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

    Relative error ~1e-7 of ``sum(|x * y|)`` in float32 at any size: one BLAS ``dot`` (no
    temporary) up to ``2**17`` entries, ``torch.sum(x * y)`` (cascade summation) above. The result
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
