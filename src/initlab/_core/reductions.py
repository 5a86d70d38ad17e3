"""Accurate and fast sums of squares, the reduction every second moment in initlab rests on.

A float32 ``torch.linalg.vector_norm`` over a whole tensor accumulates naively on CPU: its relative
error grows with size (1.8e-5 at 1M elements, 1e-2 at 67M; so does a BLAS ``dot``).
``torch.sum(t * t)`` sums in cascades (~1e-8 at any size) but needs a temporary and a second pass
(3.5x slower). :func:`sum_of_squares` takes the norm of short rows (2048 elements, error ~1e-9)
and pools the rows' squares in float64: as fast as the naive norm, as accurate as the cascade.
:func:`sum_of_products` and :func:`total_sum_of_squares` are the cheap ones for many small tensors
(one kernel each, or one for all): a BLAS ``dot`` or a fused norm where they are still accurate,
the cascade or the rows above that.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["sum_of_products", "sum_of_squares", "total_sum_of_squares"]

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


def total_sum_of_squares(tensors: Sequence[torch.Tensor]) -> float:
    """``sum over tensors of sum(t**2)`` (the squared norm of a list, e.g. a gradient), a float.

    Relative error <= 1e-6 (typically 3e-7) at any size and number of tensors: the tensors of up
    to ``2**14`` entries in one fused norm (``torch._foreach_norm``), each larger one in one kernel
    (the norms of its rows of 2048 entries, as :func:`sum_of_squares`), all pooled in float64;
    float16/bfloat16 reduced in float32. One host sync per device, not one per tensor.
    """
    on: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        d = t.detach()
        on.setdefault(d.device, []).append(
            d if d.dtype in (torch.float32, torch.float64) else d.float()
        )
    return sum(float(_pooled_squares(ts)) for ts in on.values())


def _pooled_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``total_sum_of_squares`` of float32/float64 tensors on one device (a 0-dim float64)."""
    small = [t for t in tensors if t.numel() <= _DOT]
    parts = [torch.stack(torch._foreach_norm(small)).to(torch.float64)] if small else []
    for t in tensors:
        n = t.numel()
        if n <= _DOT:
            continue
        flat, k = t.reshape(-1), n // _ROW
        parts.append(torch.linalg.vector_norm(flat[: k * _ROW].view(k, _ROW), dim=1).double())
        if k * _ROW < n:
            parts.append(torch.linalg.vector_norm(flat[k * _ROW :]).double().reshape(1))
    if not parts:
        return torch.zeros((), dtype=torch.float64, device="cpu")
    return torch.cat(parts).square().sum()
