"""Small models for the tests of float16's range: ``Linear -> LayerNorm -> ReLU -> Linear`` with a
small first weight (GPT-2's std 0.02 in front of its LayerNorms), where torch's native
normalization double backwards overflow float16 (the LayerNorm's ``rstd`` in the tens); and one
whose backward gradients fall below float16's smallest subnormal (:func:`small_gradient_net`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class HandNorm(nn.Module):
    """A LayerNorm written with elementary operations, all in the input's dtype (no routing to
    float32 statistics applies to it: in float16 its double backward still overflows)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        c = h - h.mean(-1, keepdim=True)
        return c / (c.square().mean(-1, keepdim=True) + 1e-5).sqrt()


def ln_net(
    scale: float = 0.05, norm: nn.Module | None = None, affine_random: bool = False
) -> nn.Sequential:
    """``Linear(8, 16) -> norm -> ReLU -> Linear(16, 4)`` (``norm`` default ``LayerNorm(16)``),
    the first weight times ``scale`` and its bias 0 (no alpha), the norm's affine parameters drawn
    from U(0.5, 1.5) where ``affine_random``; float32 with float16-representable values (call
    ``.half()`` for the float16 model)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), norm or nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        net[0].weight.mul_(scale)
        net[0].bias.zero_()
        if affine_random:
            for p in net[1].parameters():
                p.uniform_(0.5, 1.5)
    return net.half().float()


def small_gradient_net() -> nn.Sequential:
    """Linear, LayerNorm, Linear, Tanh, Linear, the last two weights x0.02: under
    :func:`scaled_ce` the gradient at the first layer's output is ~1e-8 (float64), below float16's
    smallest subnormal 2^-24 = 5.96e-8, while the later layers' gradients are float16 numbers."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 16), nn.Tanh(),
                        nn.Linear(16, 3))  # fmt: skip
    with torch.no_grad():
        net[2].weight.mul_(0.02)
        net[4].weight.mul_(0.02)
    return net


def scaled_ce(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1]) * 1e-3


def small_gradient_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
