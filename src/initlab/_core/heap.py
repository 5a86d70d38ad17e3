r"""The C heap kept while an iterative method runs (glibc's allocator, Linux).

glibc's ``malloc`` gives memory back to the system in two ways: a block larger than its mmap
threshold is mapped on its own and unmapped when freed, and once more than its trim threshold is
free at the top of the heap, that top is handed back. Both thresholds start at 128 KiB and grow
with the largest separately mapped block freed so far, up to 32 MiB and 64 MiB on 64-bit systems
(``mallopt(3)``). Memory handed back costs a page fault per 4 KiB page when it is taken again.
A GradInit constraint step on a CIFAR ResNet (batch 128) frees and takes back about 800 MB in and
between its steps, so in a process whose heap is trimmed every step pays for all of it again:
2.8-3.2x a plain training step instead of 2.4-2.5x (``benchmarks/bench_gradinit_faults.py``).

:func:`kept_heap` keeps the heap for the length of a block: nothing is trimmed and nothing is
mapped on its own (``M_TRIM_THRESHOLD`` at its largest value, ``M_MMAP_MAX = 0``), so every step
after the first reuses the memory the first one took, and the resident memory stays at the step's
peak until the block ends. On leaving, glibc's thresholds are set where its own rule takes them at
most, which it never moves them from again (mmap threshold 32 MiB, trim threshold 64 MiB; 512 KiB
and 1 MiB on 32-bit systems), and separate mappings are allowed again (65536, glibc's default):
the memory kept goes back to the system at the next ``free`` that leaves more than 64 MiB free at
the top, as glibc does (it is not trimmed at once, ``malloc_trim``, so that a method called again
finds it: LSUV's calls on a 56-layer CNN lost their gain that way; measured after ``gradinit_``
on ResNet-20, batch 128: 812 MB resident, 552 MB after the next forward, against 748 MB and
748 MB with ``keep_heap=False``). Setting a threshold switches glibc's rule off for the rest of
the process; these values are the ones that rule converges to, so a process behaves afterwards as
one whose rule has met a block of 32 MiB (the difference from an untouched process is at most
64 MiB kept at the top).

Nothing is changed where it would not apply or was chosen by the user: outside Linux, under
another C library (musl), and in a process started with malloc's parameters in its environment
(``GLIBC_TUNABLES`` naming one of them, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_MMAP_MAX_``, ``MALLOC_TOP_PAD_``): their settings stand. An allocator preloaded in place
of glibc's (jemalloc, tcmalloc) does not read these settings. Nested and concurrent blocks (two
methods, two threads) count: only the outermost one sets and restores. The setting is the
process's: other threads allocate under it while a block is open, and a process forked inside the
block (a ``DataLoader`` worker started by the method's first batch) keeps it for its life.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["kept_heap"]

# mallopt(3) parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1
_DEFAULT_MMAP_MAX = 65536
_TUNED_ENV = (
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_MMAP_MAX_",
    "MALLOC_TOP_PAD_",
)
_TUNED_TUNABLES = ("trim_threshold", "mmap_threshold", "mmap_max", "top_pad")


def dynamic_caps() -> tuple[int, int]:
    """glibc's largest dynamic ``(mmap threshold, trim threshold)``: ``DEFAULT_MMAP_THRESHOLD_MAX``
    (``4 MiB * sizeof(long)`` on 64-bit, 512 KiB on 32-bit) and twice that."""
    mmap = 4 * 1024 * 1024 * 8 if ctypes.sizeof(ctypes.c_long) == 8 else 512 * 1024
    return mmap, 2 * mmap


@functools.cache
def _glibc() -> Any | None:
    """The process's C library if it is glibc (it has ``gnu_get_libc_version`` and ``mallopt``)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


def user_tuned(environ: Any = None) -> bool:
    """Whether the process was started with malloc's thresholds in its environment."""
    env = os.environ if environ is None else environ
    if any(name in env for name in _TUNED_ENV):
        return True
    tunables = env.get("GLIBC_TUNABLES", "")
    return any(f"glibc.malloc.{name}" in tunables for name in _TUNED_TUNABLES)


class _Keeper:
    """How many :func:`kept_heap` blocks are open (the allocator is one per process)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0

    def enter(self, libc: Any) -> None:
        with self.lock:
            if self.depth == 0:
                libc.mallopt(M_MMAP_MAX, 0)
                libc.mallopt(M_TRIM_THRESHOLD, _INT_MAX)
            self.depth += 1

    def leave(self, libc: Any) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth == 0:
                mmap, trim = dynamic_caps()
                libc.mallopt(M_MMAP_MAX, _DEFAULT_MMAP_MAX)
                libc.mallopt(M_MMAP_THRESHOLD, mmap)
                libc.mallopt(M_TRIM_THRESHOLD, trim)


_KEEPER = _Keeper()


@contextmanager
def kept_heap(enabled: bool = True) -> Iterator[bool]:
    """Inside the block glibc neither trims its heap nor maps blocks on their own (module
    docstring); yields whether it applies (``False``: nothing was changed). ``enabled=False``
    changes nothing."""
    libc = _glibc() if enabled and not user_tuned() else None
    if libc is None:
        yield False
        return
    _KEEPER.enter(libc)
    try:
        yield True
    finally:
        _KEEPER.leave(libc)
