"""Randomness is passed in, never global: the one helper that turns a seed into a generator."""

from __future__ import annotations

import torch

__all__ = ["as_generator"]


def as_generator(generator: torch.Generator | int | None) -> torch.Generator | None:
    """``None`` and generators pass through; an int seeds a new CPU ``torch.Generator``.

    Raises:
        TypeError: anything else (a bool, a float, a string).
    """
    if generator is None or isinstance(generator, torch.Generator):
        return generator
    if isinstance(generator, int) and not isinstance(generator, bool):
        return torch.Generator().manual_seed(generator)
    raise TypeError(f"generator must be a torch.Generator, an int seed or None, got {generator!r}")
