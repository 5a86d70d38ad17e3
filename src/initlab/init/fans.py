"""Fans of a weight: how many inputs feed one output unit, and how many outputs one input feeds.

Conventions follow :func:`torch.nn.init._calculate_fan_in_and_fan_out` for a plain weight of shape
``(n_out, n_in, *kernel)``: ``fan_in = n_in * prod(kernel)`` and ``fan_out = n_out * prod(kernel)``.
Two corrections torch does not make:

* grouped convolutions (``groups = g``): the weight is ``(n_out, n_in / g, *kernel)`` and each input
  channel feeds only ``n_out / g`` output channels, so ``fan_out = (n_out / g) * prod(kernel)``;
* transposed layouts (``ConvTranspose``: ``(n_in, n_out / g, *kernel)``; Hugging Face GPT-2's
  ``Conv1D``: ``(n_in, n_out)``): the first two dims are swapped before the rule above is applied
  (torch does not swap them: its ``fan_in`` of a ``ConvTranspose`` weight is ``(n_out / g) * k``);
* strided transposed convolutions (``stride = s``, per spatial dim): ``fan_in = (n_in / g) * k /
  prod(s)``, below.

**Fans of a strided transposed convolution.** A fan is a count of terms in a sum: ``fan_in`` is
the number of inputs one output sums over, ``fan_out`` the number of outputs one input is added
into (the terms of the backward sum), each times ``E[w²]`` giving the forward and backward
second-moment gains (He et al., 2015, Eqs. 7 and 13). A transposed convolution scatters each
input position through the whole kernel: input ``x[j]`` is added into outputs
``y[s·j + t]`` for the ``k`` taps ``t`` (per dim), so one input feeds ``(n_out / g) * k`` outputs,
whatever the stride: ``fan_out = (n_out / g) * k``. Conversely output ``y[i]`` receives the taps
``t ≡ i (mod s)`` only, ``ceil`` or ``floor`` of ``k / s`` of them per dim depending on the phase
of ``i``; averaged over output positions (each phase equally often) that is exactly ``k / s`` per
dim, so ``fan_in = (n_in / g) * prod(k) / prod(s)`` (not an integer in general: ``k = 3, s = 2``
gives ``1.5`` taps per dim, and ``fan_in`` is then a float). With ``fan_in = (n_in / g) * k``
(initlab before this correction) a fan-in scheme comes out ``prod(s)`` times too small in
variance: ``E[y²] / E[x²] = 1 / s^d`` for LeCun init instead of 1; torch's own
``(n_out / g) * k`` is off by ``n_out / n_in`` at stride 1 and by ``prod(s)`` more when strided.
When ``k < s`` some outputs receive no tap at all; the average over positions is still
``k / s``, so the mean second moment is kept (the outputs that do receive a tap get ``s / k``
times more). By the same count, an ordinary convolution of stride ``s`` (the adjoint of a
transposed one) has ``fan_out = (n_out / g) * k / prod(s)`` on average. initlab does not apply
that correction to ordinary convolutions: ``fan_out = (n_out / g) * k`` there, as in torch
(``kaiming_normal_(mode="fan_out")`` in ResNet's strided convolutions), so ``"fan_out"`` on a
strided ``Conv`` keeps torch's values.
Dilation and padding change neither count (away from the borders).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real

import torch

__all__ = ["Fans", "compute_fans"]


@dataclass(frozen=True)
class Fans:
    """Fans of one weight matrix (or one block of a fused weight, e.g. a q/k/v or gate block).

    Attributes:
        fan_in: inputs feeding one output unit, kernel included (``n_in * k``; ``n_in * k / s``
            for a transposed convolution of total stride ``s``, then possibly a float).
        fan_out: outputs fed by one input unit, kernel included (``n_out * k``).
        receptive_field: number of kernel taps ``k`` (``k_h * k_w`` for a 2-D conv; 1 for Linear).
        stride: ``prod(stride)`` of a transposed convolution, by which ``fan_in`` is divided
            (module docstring); 1 for everything else.
    """

    fan_in: int | float
    fan_out: int | float
    receptive_field: int = 1
    stride: int = 1

    def __post_init__(self) -> None:
        for field in ("fan_in", "fan_out"):
            value = getattr(self, field)
            if (
                not isinstance(value, Real)
                or isinstance(value, bool)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(f"Fans.{field} must be a positive finite number, got {value!r}")
        for field in ("receptive_field", "stride"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Fans.{field} must be a positive int, got {value!r}")

    def __repr__(self) -> str:
        stride = f", stride={self.stride}" if self.stride != 1 else ""
        return (
            f"Fans(fan_in={self.fan_in!r}, fan_out={self.fan_out!r}, "
            f"receptive_field={self.receptive_field!r}{stride})"
        )

    @property
    def n_in(self) -> int:
        """Input channels/features seen by one output unit (``fan_in * stride / k``)."""
        return round(self.fan_in * self.stride) // self.receptive_field

    @property
    def cols(self) -> int:
        """Columns of the reshaped kernel matrix, ``n_out x (n_in * k)``: ``fan_in * stride``
        (``fan_in`` itself except for a strided transposed convolution)."""
        return self.n_in * self.receptive_field

    @property
    def n_out(self) -> int:
        """Output channels/features fed by one input unit (``fan_out / k``)."""
        return round(self.fan_out) // self.receptive_field


def compute_fans(
    tensor_or_shape: torch.Tensor | Sequence[int],
    *,
    groups: int = 1,
    transposed: bool = False,
    stride: int | Sequence[int] = 1,
) -> Fans:
    """Fans of a weight given as a tensor or a shape.

    Args:
        tensor_or_shape: a weight tensor or its shape, ``(n_out, n_in / groups, *kernel)``, or
            ``(n_in, n_out / groups, *kernel)`` when ``transposed``.
        groups: number of convolution groups.
        transposed: the first two dims are ``(in, out)`` (ConvTranspose, GPT-2 ``Conv1D``).
        stride: a transposed convolution's stride (an int, or one per spatial dim): each output
            sums ``(n_in / g) * k / prod(stride)`` inputs on average (module docstring). Only
            with ``transposed``: an ordinary convolution's stride does not change its ``fan_in``.

    Returns:
        :class:`Fans` with ``fan_in = (n_in / g) * k / prod(stride)`` (an int when exact, else a
        float) and ``fan_out = (n_out / g) * k``.

    Raises:
        ValueError: fewer than 2 dimensions, a zero-sized dimension, bad ``groups``, or a bad
            ``stride`` (not positive, not one per spatial dim, or given without ``transposed``).

    Example:
        >>> compute_fans((64, 3, 3, 3))
        Fans(fan_in=27, fan_out=576, receptive_field=9)
        >>> compute_fans((32, 4, 3), groups=8).fan_out  # 32 / 8 outputs per input channel, k = 3
        12
        >>> compute_fans((64, 64, 4, 4), transposed=True, stride=2)  # 16 taps / 4 per output
        Fans(fan_in=256, fan_out=1024, receptive_field=16, stride=4)
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
    s = _stride_product(stride, len(shape) - 2, transposed)
    taps = n_in_per_group * k
    fan_in = taps // s if taps % s == 0 else taps / s
    fan_out = (n_out_total // groups) * k
    return Fans(fan_in=fan_in, fan_out=fan_out, receptive_field=k, stride=s)


def _stride_product(stride: int | Sequence[int], spatial: int, transposed: bool) -> int:
    """``prod(stride)``, validated (see :func:`compute_fans`)."""
    strides = (stride,) if isinstance(stride, int) else tuple(stride)
    if not strides or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in strides):
        raise ValueError(f"stride must be a positive int or a sequence of them, got {stride!r}")
    if len(strides) > 1 and len(strides) != spatial:
        raise ValueError(
            f"stride {tuple(strides)} has {len(strides)} entries but the weight has {spatial} "
            "spatial dims; pass one stride per spatial dim or a single int"
        )
    s = strides[0] ** spatial if len(strides) == 1 else math.prod(strides)
    if s != 1 and not transposed:
        raise ValueError(
            f"stride={stride!r} changes the fans of a transposed convolution only "
            "(transposed=True); an ordinary convolution's outputs each sum (n_in / g) * k inputs "
            "whatever its stride, so leave stride at 1"
        )
    return s
