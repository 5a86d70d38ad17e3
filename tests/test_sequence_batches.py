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


# --------------------------------------------------------------------------------------------------
# Time-major (T, B) batches: batch_dim=1
# --------------------------------------------------------------------------------------------------

T, B, V = 7, 6, 11


def _time_major(base: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, y, z)``: ``x[t, b] = base + B t + b`` and per-token targets ``y = x`` of shape
    ``(T, B)``, per-sequence targets ``z[b] = base + b`` of shape ``(B,)``."""
    x = torch.tensor([[base + B * t + b for b in range(B)] for t in range(T)])
    return x, x.clone(), torch.tensor([base + b for b in range(B)])


def test_overlap_batch_takes_whole_time_major_sequences_along_batch_dim() -> None:
    s, nxt = _time_major(0), _time_major(1000)
    tilde = overlap_batch(s, nxt, 0.5, batch_dim=1)  # 3 sequences of S, 3 of the next batch
    columns = [(0, 0), (0, 1), (0, 2), (1000, 0), (1000, 1), (1000, 2)]  # (base, sequence)
    expected = [[base + B * t + b for base, b in columns] for t in range(T)]
    assert tilde[0].tolist() == expected and tilde[1].tolist() == expected
    assert tilde[2].tolist() == [base + b for base, b in columns]
    # random subsets: every column a whole sequence, beside its own target
    for seed in range(4):
        x, y, z = overlap_batch(s, nxt, 0.5, generator=seed, batch_dim=1)
        assert torch.equal(x, y) and x.shape == (T, B)
        for j in range(B):
            base, b = (0, int(z[j])) if int(z[j]) < 1000 else (1000, int(z[j]) - 1000)
            assert x[:, j].tolist() == [base + B * t + b for t in range(T)]
        assert len(set(z[:3].tolist())) == 3 and max(z[:3].tolist()) < 1000
        assert len(set(z[3:].tolist())) == 3 and min(z[3:].tolist()) >= 1000


def test_overlap_batch_refuses_a_tensor_without_the_examples_along_its_dim() -> None:
    x, y, z = _time_major(0)
    nxt = _time_major(1000)
    # dim 0 of a time-major batch is time: the per-sequence targets (B,) give it away
    with pytest.raises(
        ValueError, match=r"entry '2' holds 6 along dim 0.* 7 examples.*batch_dim=1"
    ):
        overlap_batch((x, y, z), nxt, 0.5)
    # batch-first targets (B, T) beside time-major inputs: not along batch_dim
    with pytest.raises(ValueError, match=r"entry '1' holds 7 along dim 1 \(shape \(6, 7\)\)"):
        overlap_batch((x, y.T, z), (nxt[0], nxt[1].T, nxt[2]), 0.5, batch_dim=1)
    for bad in (-1, 0.5, "1"):
        with pytest.raises(ValueError, match="batch_dim must be None or a non-negative int"):
            overlap_batch((x, y, z), nxt, 0.5, batch_dim=bad)  # type: ignore[arg-type]


class _TimeMajorLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 8)
        self.rnn = nn.LSTM(8, 8)  # batch_first=False: (T, B, F)
        self.head = nn.Linear(8, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.emb(x))[0])


def _lm() -> _TimeMajorLM:
    torch.manual_seed(1)
    return _TimeMajorLM().eval()


def _token_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten())


def _lm_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randint(0, V, (T, B), generator=g), torch.randint(0, V, (T, B), generator=g))
        for _ in range(n)
    ]


def test_gradinit_builds_s_tilde_from_whole_time_major_sequences() -> None:
    batches = _lm_batches(3)
    seen: list[torch.Tensor] = []

    def loss(model: nn.Module, batch: tuple) -> torch.Tensor:
        seen.append(batch[0].clone())
        return _token_loss(model, batch)

    report = initlab.gradinit_(_lm(), batches, loss, gamma=float("inf"), batch_dim=1)
    assert report.used == DataUse(3, 3 * B)  # it counted T = 7 per batch
    # objective steps only: L(S_t) then L(S~_t); S~_t = S_t's first 3 sequences + S_t+1's first 3
    for t in range(2):
        s, nxt = batches[t][0], batches[t + 1][0]
        tilde = torch.tensor([[*s[i, :3].tolist(), *nxt[i, :3].tolist()] for i in range(T)])
        assert torch.equal(seen[2 * t], s) and torch.equal(seen[2 * t + 1], tilde)
    with pytest.raises(ValueError, match="gradinit_: batch_dim must be None or a non-negative"):
        initlab.gradinit_(_lm(), batches, _token_loss, batch_dim=-1)


def test_entry_points_with_batch_dim_count_the_examples_along_it() -> None:
    batches = _lm_batches(3)
    one = batches[0]
    assert initlab.precondition_(_lm(), [one], _token_loss, batch_dim=1).used == DataUse(1, B)
    assert initlab.diagnose(_lm(), one, _token_loss, batch_dim=1).used == DataUse(1, B)
    assert initlab.measure_moments(_lm(), one, _token_loss, batch_dim=1).used == DataUse(1, B)
    assert initlab.gr_scaling(_lm(), one, _token_loss, batch_dim=1).used == DataUse(1, B)
    report = initlab.gradinit_(_lm(), batches, _token_loss, batch_dim=1, overlap=1.0)
    assert report.used == DataUse(3, 3 * B)
