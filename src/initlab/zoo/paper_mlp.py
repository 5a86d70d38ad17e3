"""Reference models from the seed papers (our own definitions; no torchvision)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["PaperMLP"]


class PaperMLP(nn.Module):
    """Defazio & Bottou's MLP: ``inputs → 384 → 64 → classes`` with ReLU (Section 6, Table 2).

    Inputs are ``(B, n_in)``; an input with more dimensions (images ``(B, C, H, W)``) is
    flattened to ``(B, C·H·W)`` first.

    Args:
        n_in: input features (scalars per example).
        n_classes: output classes (logits, no final activation).
        widths: hidden widths (the paper: ``(384, 64)``).
        input_norm: apply ``LayerNorm(n_in)`` (without affine parameters) to the input, as in the
            paper's LIBSVM study.
        output_scale: a fixed scalar multiplying the logits (the paper sets it so the logits' std
            is 0.05 at init; :func:`initlab.scale_output_` sets it from data). ``None``: no
            scaling.
    """

    def __init__(
        self,
        n_in: int,
        n_classes: int,
        widths: Sequence[int] = (384, 64),
        *,
        input_norm: bool = False,
        output_scale: float | None = None,
    ) -> None:
        super().__init__()
        if n_in < 1 or n_classes < 1 or any(w < 1 for w in widths):
            raise ValueError(
                f"PaperMLP needs positive sizes, got n_in={n_in}, n_classes={n_classes}, "
                f"widths={tuple(widths)}"
            )
        self.input_norm = nn.LayerNorm(n_in, elementwise_affine=False) if input_norm else None
        sizes = [n_in, *widths, n_classes]
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(sizes)):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        self.layers = nn.Sequential(*layers)
        self.register_buffer(
            "output_scale", torch.tensor(1.0 if output_scale is None else float(output_scale))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # images (B, C, H, W): each example as a vector of n_in = C·H·W scalars; (B, n_in) as it
        # is. Unconditional, so that torch.fx traces the model (the scaling linter's walk)
        x = x.flatten(1)
        if self.input_norm is not None:
            x = self.input_norm(x)
        return self.layers(x) * self.output_scale
