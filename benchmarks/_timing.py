"""Shared timing helpers for the benchmark scripts (not part of the package)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def interleaved_min(
    fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1
) -> dict[str, float]:
    """Run the candidates alternately ``repeats`` times; return each one's best wall time (s).

    Interleaving puts both candidates under the same machine state (frequency, cache, other load),
    so the ratio is fair even when absolute times drift.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            best[name] = min(best[name], time.perf_counter() - start)
    return best
