"""Sequence batches: a ``PackedSequence`` input counts its sequences as the examples, and
GradInit's S~ takes whole sequences of it; the expected S~ and counts are built here by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_sequence, pad_packed_sequence

import initlab
from initlab._core.data import DataUse
from initlab.methods.gradinit import overlap_batch

D = torch.float64


def _packed(lengths: list[int], base: int, enforce_sorted: bool = False) -> tuple:
    """``(packed, targets)``: example ``k`` is a sequence of ``lengths[k]`` steps filled with its
    target ``base + k``."""
    seqs = [torch.full((n, 2), float(base + k), dtype=D) for k, n in enumerate(lengths)]
    return pack_sequence(seqs, enforce_sorted=enforce_sorted), torch.arange(base, base + len(seqs))


def _sequences(packed: PackedSequence) -> list[torch.Tensor]:
    """The sequences of ``packed`` in example order, read with torch's padding."""
    padded, lengths = pad_packed_sequence(packed, batch_first=True)
    return [padded[i, : int(n)] for i, n in enumerate(lengths)]


def test_overlap_batch_takes_whole_sequences_of_a_packed_batch() -> None:
    s, nxt = _packed([7, 5, 3, 6, 2], 0), _packed([4, 6, 1, 3, 5], 100)
    tilde = overlap_batch(s, nxt, 0.4)  # m = round(2.0) = 2 of S, 3 of the next batch
    assert isinstance(tilde[0], PackedSequence)
    assert tilde[1].tolist() == [0, 1, 100, 101, 102]
    got = _sequences(tilde[0])
    assert [len(q) for q in got] == [7, 5, 4, 6, 1]
    for q, target in zip(got, [0, 1, 100, 101, 102], strict=True):
        assert bool((q == target).all())
    # random subsets: each sequence whole, beside its own target
    length = {k: n for k, n in zip(range(5), [7, 5, 3, 6, 2], strict=True)}
    length |= {100 + k: n for k, n in enumerate([4, 6, 1, 3, 5])}
    for seed in range(4):
        drawn = overlap_batch(s, nxt, 0.4, generator=seed)
        targets = drawn[1].tolist()
        assert len(set(targets[:2])) == 2 and set(targets[:2]) <= set(range(5))
        assert len(set(targets[2:])) == 3 and set(targets[2:]) <= set(range(100, 105))
        for q, target in zip(_sequences(drawn[0]), targets, strict=True):
            assert len(q) == length[target] and bool((q == target).all())


@pytest.mark.parametrize("enforce_sorted", [False, True])
def test_a_model_reads_example_i_of_a_packed_s_tilde_at_output_i(enforce_sorted: bool) -> None:
    """The LSTM's last state ``i`` on S~ is its state on the ``i``-th chosen sequence alone."""
    torch.manual_seed(0)
    lengths_s, lengths_n = [7, 6, 4, 2], [5, 5, 3, 1]  # longest first: enforce_sorted allowed
    seqs_s = [torch.randn(n, 2, dtype=D) for n in lengths_s]
    seqs_n = [torch.randn(n, 2, dtype=D) for n in lengths_n]
    s = (pack_sequence(seqs_s, enforce_sorted=enforce_sorted), torch.arange(4))
    nxt = (pack_sequence(seqs_n, enforce_sorted=enforce_sorted), torch.arange(4, 8))
    rnn = nn.LSTM(2, 3, batch_first=True).double()
    tilde = overlap_batch(s, nxt, 0.5)  # S's first two, then the next batch's first two
    expected = [seqs_s[0], seqs_s[1], seqs_n[0], seqs_n[1]]  # lengths 7, 6, 5, 5
    with torch.no_grad():
        _, (h, _) = rnn(tilde[0])
        alone = torch.cat([rnn(q.unsqueeze(0))[1][0][-1] for q in expected])
    torch.testing.assert_close(h[-1], alone, rtol=1e-12, atol=1e-12)
    assert tilde[1].tolist() == [0, 1, 4, 5]
    # random picks: in some draws no longer longest first (packed with enforce_sorted=False)
    orders = set()
    for seed in range(6):
        drawn = overlap_batch(s, nxt, 0.5, generator=seed)
        picked = [(seqs_s + seqs_n)[t] for t in drawn[1].tolist()]
        orders.add([len(q) for q in picked] == sorted((len(q) for q in picked), reverse=True))
        with torch.no_grad():
            _, (h, _) = rnn(drawn[0])
            alone = torch.cat([rnn(q.unsqueeze(0))[1][0][-1] for q in picked])
        torch.testing.assert_close(h[-1], alone, rtol=1e-12, atol=1e-12)
    assert orders == {True, False}


class _PackedClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(2, 4, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, packed: PackedSequence) -> torch.Tensor:
        _, (h, _) = self.rnn(packed)
        return self.head(h[-1])


def _classifier() -> _PackedClassifier:
    torch.manual_seed(1)
    return _PackedClassifier()


def _packed_batch(seed: int) -> tuple[PackedSequence, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randn(n, 2, generator=g) for n in (7, 5, 3, 6, 2)]  # 5 sequences, 23 steps
    return pack_sequence(seqs, enforce_sorted=False), torch.randint(0, 3, (5,), generator=g)


def test_every_entry_point_counts_the_sequences_of_a_packed_batch() -> None:
    crit = nn.CrossEntropyLoss()
    three = [_packed_batch(k) for k in range(3)]
    # gradinit_ reads 3 batches for 2 steps (S~ from the next one); it raised IndexError
    report = initlab.gradinit_(_classifier(), three, crit, steps=2, generator=0)
    assert report.used == DataUse(3, 15)
    assert len(report.trace) == 2
    one = three[0]
    assert initlab.gradinit_(_classifier(), three, crit, overlap=1.0).used == DataUse(3, 15)
    assert initlab.metainit_(_classifier(), three, crit, steps=2).used == DataUse(2, 10)
    assert initlab.scale_output_(_classifier(), [one]).used == DataUse(1, 5)
    assert initlab.precondition_(_classifier(), [one], crit).used == DataUse(1, 5)
    assert initlab.measure_moments(_classifier(), one, crit).used == DataUse(1, 5)
    assert initlab.diagnose(_classifier(), one, crit).used == DataUse(1, 5)
    with pytest.warns(UserWarning, match="not scaled"):
        assert initlab.lsuv_(_classifier(), one, generator=0).used == DataUse(1, 5)
