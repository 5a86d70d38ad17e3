"""Named losses ``loss_fn(model, batch)`` for the command line, the diagnostics and the demo.

A :class:`NamedLoss` keeps the split ``loss(model, batch) = outputs_loss(forward(model, batch),
batch)`` so curvature code can take the Gauss-Newton matrix (it needs the loss as a function of the
model's outputs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["LOSSES", "NamedLoss", "default_loss", "make_loss"]


class NamedLoss:
    """A ``loss_fn(model, batch)`` that is ``outputs_loss(forward(model, batch), batch)``.

    Keeping the split lets curvature take the Gauss-Newton matrix (which needs the loss as a
    function of the outputs); ``forward`` is ``model(x)`` for ``x = batch[0]`` (or ``batch``).
    """

    def __init__(self, name: str, outputs_loss: Callable[[torch.Tensor, Any], torch.Tensor]):
        self.name = name
        self.outputs_loss = outputs_loss

    @staticmethod
    def forward(model: nn.Module, batch: Any) -> torch.Tensor:
        """``model(batch[0])`` for a tuple/list batch, else ``model(batch)``."""
        return model(batch[0] if isinstance(batch, (tuple, list)) else batch)

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return self.outputs_loss(self.forward(model, batch), batch)

    def __repr__(self) -> str:
        return f"NamedLoss({self.name!r})"


def _targets(batch: Any, what: str) -> torch.Tensor:
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        raise ValueError(
            f"the {what} loss needs (x, y) batches; for a batch without targets pass loss_fn, "
            "e.g. initlab.diagnostics.make_loss('random_quadratic') (the paper's random loss "
            "y^T R y)"
        )
    return batch[1]


def _cross_entropy(out: torch.Tensor, batch: Any) -> torch.Tensor:
    y = _targets(batch, "cross-entropy")
    if out.dim() >= 3 and tuple(y.shape) == (out.shape[0], *out.shape[2:]):
        return F.cross_entropy(out, y)  # dense logits (B, C, *S), targets (B, *S)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _mse(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.mse_loss(out, _targets(batch, "mse"))


def _auto(out: torch.Tensor, batch: Any) -> torch.Tensor:
    y = _targets(batch, "default")
    return _mse(out, batch) if y.is_floating_point() else _cross_entropy(out, batch)


def _random_quadratic(seed: int) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    cache: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}

    def loss(out: torch.Tensor, batch: Any) -> torch.Tensor:
        flat = out.reshape(out.shape[0], -1)
        key = (flat.shape[1], flat.device, flat.dtype)
        if key not in cache:
            gen = torch.Generator().manual_seed(seed)
            d = flat.shape[1]
            r = torch.randn(d, d, generator=gen, dtype=torch.float64) / d
            cache[key] = r.to(flat.device, flat.dtype)
        return ((flat @ cache[key]) * flat).sum(1).mean()

    return loss


default_loss = NamedLoss("auto", _auto)
"""Cross-entropy for integer targets, mean squared error for float targets, on ``(x, y, ...)``
batches: logits ``(B, C)`` with targets ``(B,)``, ``(B, T, C)`` with ``(B, T)``, or dense
``(B, C, *S)`` with ``(B, *S)``. A batch without targets raises ``ValueError``."""

LOSSES = ("auto", "cross_entropy", "mse", "random_quadratic")
"""Loss names :func:`make_loss` knows."""


def make_loss(name: str = "auto", *, seed: int = 0) -> NamedLoss:
    """A ``loss_fn(model, batch)`` by name (a :class:`NamedLoss`).

    * ``"auto"``: :data:`default_loss` (cross-entropy or MSE from the targets' dtype);
    * ``"cross_entropy"``/``"mse"``: on ``(x, y)`` batches, mean-reduced;
    * ``"random_quadratic"``: Defazio & Bottou's random loss ``y^T R y / d`` per example (``y`` the
      flattened output, ``R`` i.i.d. normal, fixed by ``seed``), averaged over the batch; needs no
      targets (their Figure 2 setup).
    """
    if name == "auto":
        return default_loss
    if name == "random_quadratic":
        return NamedLoss(name, _random_quadratic(seed))
    if name == "cross_entropy":
        return NamedLoss(name, _cross_entropy)
    if name == "mse":
        return NamedLoss(name, _mse)
    raise ValueError(f"unknown loss {name!r}; valid: {', '.join(LOSSES)} or 'pkg.module:fn'")
