"""Shared timing helpers for the benchmark scripts (not part of the package)."""

from __future__ import annotations

import math
import resource
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch


def minor_faults() -> int:
    """This process's minor page faults so far (``getrusage``; 4 KiB pages on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def cifar_batch(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A CIFAR-shaped batch: ``n`` standard normal 3x32x32 images and labels in 0..9."""
    return torch.randn(n, 3, 32, 32, generator=gen), torch.randint(0, 10, (n,), generator=gen)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def interleaved_times(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
    block: int = 1,
    around: Callable[[str], AbstractContextManager[object]] | None = None,
) -> dict[str, list[float]]:
    """Run the candidates alternately ``repeats`` times; return each one's times (s).

    Interleaving puts both candidates under the same machine state (frequency, cache, other load),
    so the ratio is fair even when absolute times drift. ``clock=time.process_time`` measures this
    process's CPU time, which other processes on a loaded machine disturb much less than wall time.

    ``block > 1``: each turn runs a candidate ``block`` times in a row and times only the calls
    after the first, so that each is measured in its own steady state, as in a loop of it (on CPU
    the allocator's heap, and with it the page faults a call pays, depends on the call before:
    a candidate measured right after a hungrier one finds memory that its own loop would have
    handed back to the system and faulted in again).

    ``around(name)``: a context each turn of that candidate runs in (its block of calls, and its
    warm-up call), e.g. the kept heap of the loop the candidate is the body of.
    """
    around = around or (lambda name: nullcontext())
    for _ in range(warmup):
        for name, fn in fns.items():
            with around(name):
                fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            with around(name):
                for call in range(block):
                    sync()
                    start = clock()
                    fn()
                    sync()
                    if call or block == 1:
                        times[name].append(clock() - start)
    return times


def interleaved_min(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Each candidate's best time (s) of :func:`interleaved_times` (one call a turn)."""
    times = interleaved_times(fns, repeats, warmup, clock)
    return {name: min(t) for name, t in times.items()}


def median_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """``(low, median, high)``: the median and a distribution-free confidence interval for it.

    The interval runs between the order statistics ``x_(j)`` and ``x_(n+1-j)`` with the largest
    ``j`` whose binomial coverage ``P(j <= Binomial(n, 1/2) <= n - j)`` is at least ``level``
    (exact for any continuous distribution of independent rounds; no normality assumed). Below 6
    values even the range covers less than 95% (``1 - 2**(1 - n)``); it is returned then.
    """
    x = sorted(values)
    n = len(x)
    if not n:
        raise ValueError("median_interval: no values")

    def coverage(j: int) -> float:  # of [x_(j+1), x_(n-j)] (1-based order statistics)
        return sum(math.comb(n, i) for i in range(j + 1, n - j)) / 2**n

    j = 0
    while j + 1 < n - j - 2 and coverage(j + 1) >= level:
        j += 1
    mid = (x[(n - 1) // 2] + x[n // 2]) / 2
    return x[j], mid, x[n - 1 - j]
