"""Fans of a weight: how many inputs feed one output unit, and how many outputs one input feeds.

Conventions follow :func:`torch.nn.init._calculate_fan_in_and_fan_out` for a plain weight of shape
``(n_out, n_in, *kernel)``: ``fan_in = n_in * prod(kernel)`` and ``fan_out = n_out * prod(kernel)``.
Two corrections torch does not make:

* grouped convolutions (``groups = g``): the weight is ``(n_out, n_in / g, *kernel)`` and each input
  channel feeds only ``n_out / g`` output channels, so ``fan_out = (n_out / g) * prod(kernel)``;
* transposed layouts (``ConvTranspose``: ``(n_in, n_out / g, *kernel)``; Hugging Face GPT-2's
  ``Conv1D``: ``(n_in, n_out)``): the first two dims are swapped before the rule above is applied.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Fans", "compute_fans"]


@dataclass(frozen=True)
class Fans:
    """Fans of one weight matrix (or one block of a fused weight, e.g. a q/k/v or gate block).

    Attributes:
        fan_in: inputs feeding one output unit, kernel included (``n_in * k``).
        fan_out: outputs fed by one input unit, kernel included (``n_out * k``).
        receptive_field: number of kernel taps ``k`` (``k_h * k_w`` for a 2-D conv; 1 for Linear).
    """

    fan_in: int
    fan_out: int
    receptive_field: int = 1

    def __post_init__(self) -> None:
        for field in ("fan_in", "fan_out", "receptive_field"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Fans.{field} must be a positive int, got {value!r}")

    @property
    def n_in(self) -> int:
        """Input channels/features seen by one output unit (``fan_in / k``)."""
        return self.fan_in // self.receptive_field

    @property
    def n_out(self) -> int:
        """Output channels/features fed by one input unit (``fan_out / k``)."""
        return self.fan_out // self.receptive_field


def compute_fans(
    tensor_or_shape: torch.Tensor | Sequence[int],
    *,
    groups: int = 1,
    transposed: bool = False,
) -> Fans:
    """Fans of a weight given as a tensor or a shape.

    Args:
        tensor_or_shape: a weight tensor or its shape, ``(n_out, n_in / groups, *kernel)``, or
            ``(n_in, n_out / groups, *kernel)`` when ``transposed``.
        groups: number of convolution groups.
        transposed: the first two dims are ``(in, out)`` (ConvTranspose, GPT-2 ``Conv1D``).

    Returns:
        :class:`Fans` with ``fan_in = (n_in / g) * k`` and ``fan_out = (n_out / g) * k``.

    Raises:
        ValueError: fewer than 2 dimensions, a zero-sized dimension, or bad ``groups``.

    Example:
        >>> compute_fans((64, 3, 3, 3))
        Fans(fan_in=27, fan_out=576, receptive_field=9)
        >>> compute_fans((32, 4, 3), groups=8).fan_out  # 32 / 8 outputs per input channel, k = 3
        12
    """
    shape = (
        tuple(tensor_or_shape.shape)
        if isinstance(tensor_or_shape, torch.Tensor)
        else tuple(int(s) for s in tensor_or_shape)
    )
    if len(shape) < 2:
        raise ValueError(
            f"fans need a weight with at least 2 dimensions (out, in, *kernel); got shape {shape}. "
            "Biases and norm scales are not initialized with a fan-based scheme."
        )
    if any(s <= 0 for s in shape):
        raise ValueError(f"fans are undefined for a tensor with a zero-sized dimension: {shape}")
    if not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups must be a positive int, got {groups!r}")
    first, second = shape[0], shape[1]
    if transposed:
        n_in_per_group, n_out_total = first // groups, second * groups
        if first % groups:
            raise ValueError(
                f"transposed weight dim 0 ({first}) is not divisible by groups={groups}"
            )
    else:
        n_in_per_group, n_out_total = second, first
        if first % groups:
            raise ValueError(f"weight dim 0 ({first}) is not divisible by groups={groups}")
    k = math.prod(shape[2:]) if len(shape) > 2 else 1
    fan_in = n_in_per_group * k
    fan_out = (n_out_total // groups) * k
    return Fans(fan_in=fan_in, fan_out=fan_out, receptive_field=k)
