"""The lecture's 1-D regression nets: :class:`LectureMLP` (plain or residual)."""

from __future__ import annotations

import torch
from torch import nn

from initlab.zoo._common import _positive_int

# --------------------------------------------------------------------------------------------------
# The lecture's 1-D regression nets
# --------------------------------------------------------------------------------------------------


class LectureMLP(nn.Module):
    """The lecture's LeakyReLU MLP for 1-D regression, plain or residual ("widths N×5, 1, 1").

    ``depth = N + 2`` linear layers: ``input`` (``n_in → width``) and ``N - 1`` ``hidden`` layers
    (``width → width``), each followed by LeakyReLU ``s``; ``bottleneck`` (``width → n_out``) with
    ``s``; ``output`` (``n_out → n_out``) without activation. Residual version: each hidden layer is
    ``z_{j+1} = z_j + s(W_j z_j + b_j)``. With ``width = 5``, ``n_in = n_out = 1`` depths 5, 7, 12,
    17, 47 have 78, 138, 288, 438, 1,338 parameters, the lecture's counts.

    Args:
        depth: number of linear layers, at least 3 (the lecture: 5 to 47).
        width: hidden width (5).
        alpha: LeakyReLU negative slope.
        n_in: input dimension (1); inputs with more than two dimensions (images) are
            flattened to ``(B, n_in)``.
        n_out: output dimension (1).
        residual: residual hidden layers.
    """

    def __init__(
        self,
        depth: int = 5,
        width: int = 5,
        *,
        alpha: float = 0.01,
        n_in: int = 1,
        n_out: int = 1,
        residual: bool = False,
    ) -> None:
        super().__init__()
        name = "LectureMLP"
        if _positive_int(name, "depth", depth) < 3:
            raise ValueError(f"{name}: depth must be at least 3, got {depth}")
        _positive_int(name, "width", width)
        _positive_int(name, "n_in", n_in)
        _positive_int(name, "n_out", n_out)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise ValueError(f"{name}: alpha must be a number, got {alpha!r}")
        self.residual = residual
        self.act = nn.LeakyReLU(float(alpha))
        self.input = nn.Linear(n_in, width)
        self.hidden = nn.ModuleList(nn.Linear(width, width) for _ in range(depth - 3))
        self.bottleneck = nn.Linear(width, n_out)
        self.output = nn.Linear(n_out, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # images (B, C, H, W): each example as a vector of n_in = C·H·W scalars; (B, n_in) as it
        # is. Unconditional, so that torch.fx traces the model (the scaling linter's walk)
        x = x.flatten(1)
        z = self.act(self.input(x))
        for layer in self.hidden:
            z = z + self.act(layer(z)) if self.residual else self.act(layer(z))
        return self.output(self.act(self.bottleneck(z)))
