"""The C heap kept while GradInit runs (``initlab._core.heap``): the mallopt calls and their order,
nesting, failure, the user's own settings, the effect on page faults in a fresh process (glibc
only), and the ``keep_heap`` of ``gradinit_``, ``metainit_`` and ``lsuv_``."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from initlab._core import heap
from initlab.methods.gradinit import gradinit_
from initlab.methods.lsuv import lsuv_
from initlab.methods.metainit import metainit_

INT_MAX = 2**31 - 1


class FakeLibc:
    """Records ``mallopt(param, value)`` calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1


@pytest.fixture
def fake(monkeypatch):
    libc = FakeLibc()
    monkeypatch.setattr(heap, "_glibc", lambda: libc)
    for name in (*heap._TUNED_ENV, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    return libc


ENTER = [(heap.M_MMAP_MAX, 0), (heap.M_TRIM_THRESHOLD, INT_MAX)]


def _leave() -> list[tuple[int, int]]:
    mmap, trim = heap.dynamic_caps()
    return [(heap.M_MMAP_MAX, 65536), (heap.M_MMAP_THRESHOLD, mmap), (heap.M_TRIM_THRESHOLD, trim)]


def test_caps_are_glibcs_dynamic_maximum():
    # DEFAULT_MMAP_THRESHOLD_MAX = 4 MiB * sizeof(long) on 64-bit, the trim threshold twice it
    if ctypes.sizeof(ctypes.c_long) == 8:
        assert heap.dynamic_caps() == (32 * 2**20, 64 * 2**20)
    else:
        assert heap.dynamic_caps() == (512 * 2**10, 2**20)


def test_keeps_then_leaves_glibcs_capped_thresholds(fake):
    with heap.kept_heap() as applied:
        assert applied is True
        assert fake.calls == ENTER
    assert fake.calls == ENTER + _leave()


def test_nested_blocks_set_and_restore_once(fake):
    with heap.kept_heap():
        with heap.kept_heap() as inner:
            assert inner is True
            assert fake.calls == ENTER
        assert fake.calls == ENTER  # the outer block still keeps the heap
    assert fake.calls == ENTER + _leave()
    assert heap._KEEPER.depth == 0


def test_restored_when_the_block_raises(fake):
    with pytest.raises(KeyError, match="boom"), heap.kept_heap():
        raise KeyError("boom")
    assert fake.calls == ENTER + _leave()
    assert heap._KEEPER.depth == 0


def test_disabled_changes_nothing(fake):
    with heap.kept_heap(enabled=False) as applied:
        assert applied is False
    assert fake.calls == []


@pytest.mark.parametrize(
    "env",
    [
        {"MALLOC_TRIM_THRESHOLD_": "1000000"},
        {"MALLOC_MMAP_THRESHOLD_": "1000000"},
        {"MALLOC_MMAP_MAX_": "0"},
        {"MALLOC_TOP_PAD_": "0"},
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1073741824"},
        {"GLIBC_TUNABLES": "glibc.pthread.rseq=0:glibc.malloc.mmap_threshold=33554432"},
    ],
)
def test_the_users_own_settings_stand(fake, monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert heap.user_tuned()
    with heap.kept_heap() as applied:
        assert applied is False
    assert fake.calls == []


def test_unrelated_tunables_are_not_the_users_heap_settings():
    assert not heap.user_tuned({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert not heap.user_tuned({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"})
    assert not heap.user_tuned({})


def test_nothing_without_glibc(monkeypatch):
    monkeypatch.setattr(heap, "_glibc", lambda: None)
    with heap.kept_heap() as applied:
        assert applied is False


# A fresh process (its heap untouched by the test session): 64 MiB taken, written, freed and taken
# again. Above the mmap threshold's cap, glibc maps such a block on its own and unmaps it when
# freed, so every retake faults all its pages; inside kept_heap() the heap keeps it.
_FAULTS = textwrap.dedent(
    """
    import resource, torch
    from initlab._core.heap import kept_heap

    def retake():
        for _ in range(3):  # the heap's layout settles (a small block may land above the first)
            torch.empty(16 * 2**20).fill_(1.0)  # 64 MiB, freed at once
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(16 * 2**20).fill_(2.0)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    outside = retake()
    with kept_heap() as applied:
        inside = retake()
    print(applied, outside, inside)
    """
)


def _huge_pages() -> bool:
    """Transparent huge pages for every mapping (one fault per 2 MiB: faults do not count pages)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            always = "[always]" in f.read()
    except OSError:
        always = False
    return always or bool(os.environ.get("THP_MEM_ALLOC_ENABLE"))


@pytest.mark.skipif(heap._glibc() is None or heap.user_tuned(), reason="glibc's own heap only")
@pytest.mark.skipif(_huge_pages(), reason="page faults count 4 KiB pages only without huge pages")
def test_kept_heap_removes_the_page_faults_of_memory_taken_again():
    out = subprocess.run(
        [sys.executable, "-c", _FAULTS], capture_output=True, text=True, check=True
    ).stdout.split()
    applied, outside, inside = out[0] == "True", int(out[1]), int(out[2])
    pages = 64 * 2**20 // 4096
    assert applied
    assert outside > pages // 2  # mapped anew and faulted in: the cost kept_heap removes
    assert inside < pages // 20


# --------------------------------------------------------------------------------------------------
# gradinit_(keep_heap=...)


def _net_and_batches():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    batches = [(torch.randn(16, 4), torch.randint(0, 3, (16,))) for _ in range(4)]
    return net, batches


@pytest.mark.parametrize("keep", [True, False])
def test_gradinit_keeps_the_heap_for_its_iterations_only(fake, keep):
    net, batches = _net_and_batches()
    depths: list[int] = []
    gradinit_(net, batches, progress=lambda row: depths.append(heap._KEEPER.depth), keep_heap=keep)
    assert depths == [1 if keep else 0] * 3
    assert fake.calls == (ENTER + _leave() if keep else [])
    assert heap._KEEPER.depth == 0


def test_gradinit_gives_the_heap_back_when_it_fails(fake):
    net, batches = _net_and_batches()

    def loss(model, batch):
        if len(fake.calls) == 2:  # inside the kept block
            raise RuntimeError("loss failed")
        return F.cross_entropy(model(batch[0]), batch[1])

    with pytest.raises(RuntimeError, match="loss failed"):
        gradinit_(net, batches, loss)
    assert fake.calls == ENTER + _leave()
    assert heap._KEEPER.depth == 0


@pytest.mark.parametrize("keep", [True, False])
def test_metainit_keeps_the_heap_for_its_steps_only(fake, keep):
    net, batches = _net_and_batches()
    depths: list[int] = []
    metainit_(
        net, batches, steps=3, progress=lambda r: depths.append(heap._KEEPER.depth), keep_heap=keep
    )
    assert depths == [1 if keep else 0] * 3
    assert fake.calls == (ENTER + _leave() if keep else [])


@pytest.mark.parametrize("keep", [True, False])
def test_lsuv_keeps_the_heap_for_its_sweeps_only(fake, keep):
    net, batches = _net_and_batches()
    depths: list[int] = []

    def forward(model, batch):
        depths.append(heap._KEEPER.depth)
        return model(batch[0])

    lsuv_(net, batches[0], forward=forward, keep_heap=keep)
    assert depths and set(depths) == {1 if keep else 0}
    assert fake.calls == (ENTER + _leave() if keep else [])
