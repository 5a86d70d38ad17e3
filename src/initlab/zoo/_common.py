"""Validation and layer helpers shared by the zoo's model families."""

from __future__ import annotations

from torch import nn

# --------------------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------------------


def _positive_int(owner: str, key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {key} must be a positive int, got {value!r}")
    return value


def _positive_float(owner: str, key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{owner}: {key} must be a positive number, got {value!r}")
    return float(value)


def _scaled(channels: int, width: float) -> int:
    """``channels`` times the width multiplier, rounded, at least 1."""
    return max(1, round(channels * width))


def _cifar_depth(owner: str, depth: object) -> int:
    """Blocks per stage ``n = (depth - 2) / 6`` of a CIFAR ResNet (He et al. 2016, §4.2)."""
    depth = _positive_int(owner, "depth", depth)
    if depth < 8 or (depth - 2) % 6:
        raise ValueError(
            f"{owner}: depth must be 6n + 2 with n >= 1 (8, 14, 20, 56, ...), got {depth}"
        )
    return (depth - 2) // 6


def _conv3x3(c_in: int, c_out: int, stride: int = 1, *, bias: bool) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=bias)
