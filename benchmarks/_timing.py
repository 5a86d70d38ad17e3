"""Shared timing helpers for the benchmark scripts (not part of the package)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def interleaved_min(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Run the candidates alternately ``repeats`` times; return each one's best time (s).

    Interleaving puts both candidates under the same machine state (frequency, cache, other load),
    so the ratio is fair even when absolute times drift. ``clock=time.process_time`` measures this
    process's CPU time, which other processes on a loaded machine disturb much less than wall time.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            start = clock()
            fn()
            sync()
            best[name] = min(best[name], clock() - start)
    return best
