"""GradInit's ``S~`` (:func:`overlap_batch`): examples of ``S`` followed by examples of the next
batch, taken whole from every entry of the batch.

An example is a slice of every tensor along ``batch_dim`` (dim 0 by default; along dim 0 for a
tensor with ``batch_dim`` dims or fewer, such as the targets ``(B,)`` of a time-major ``(T, B)``
input: :func:`_example_dim`), an item of every list below the top whose length is the batch size
(ids, per-image target dicts, ragged tensors), and a sequence of every ``PackedSequence`` (its
``batch_sizes[0]`` sequences, read back in the order they were packed,
:func:`torch.nn.utils.rnn.unpack_sequence`; the chosen ones are packed again, :func:`_packed`).
A tensor or ``PackedSequence`` that does not hold the batch's examples there is refused by name
(:func:`_not_examples`): S~ would splice its entries (time steps of a time-major batch read along
dim 0) with no word. The test is the size alone: every tensor with more than ``batch_dim`` dims
must hold the examples at ``batch_dim``, since one that holds ``B`` of something else there (a
batch-major ``(B, T)`` mask beside a time-major ``(T, B)`` input, where ``T == B``) is taken as
examples.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence, pack_sequence, unpack_sequence

from initlab._core.data import batch_children, batch_rebuild, batch_size, batch_tensors
from initlab._core.knobs import check_batch_dim
from initlab._core.rng import as_generator
from initlab.methods._alpha import check_number

__all__ = ["overlap_batch"]


class _Column(list):
    """Per-example items chosen from a list of the batch's length (ids, per-image target dicts,
    ragged tensors): concatenated as items, never sliced inside."""


class _Sequences(list):
    """Sequences chosen from a ``PackedSequence``, in example order, with how it was packed
    (``enforce_sorted``: it had no ``sorted_indices``)."""

    def __init__(self, sequences: list[torch.Tensor], enforce_sorted: bool) -> None:
        super().__init__(sequences)
        self.enforce_sorted = enforce_sorted


def _packed(sequences: _Sequences) -> PackedSequence:
    """``sequences`` packed again, sequence ``i`` as example ``i``: with ``enforce_sorted=True``
    where their source was packed so and they are still longest first, else with
    ``enforce_sorted=False`` (which keeps their order for the model's outputs through
    ``unsorted_indices``)."""
    lengths = [len(s) for s in sequences]
    longest_first = lengths == sorted(lengths, reverse=True)
    return pack_sequence(list(sequences), enforce_sorted=sequences.enforce_sorted and longest_first)


def _example_dim(t: torch.Tensor, batch_dim: int) -> int:
    """The dim of ``t`` that holds the examples: ``batch_dim``, or 0 where ``t`` has no more
    dims than ``batch_dim`` (a per-example target ``(B,)`` beside time-major inputs)."""
    return batch_dim if t.dim() > batch_dim else 0


def _not_examples(batch: Any, node: Any, held: str, n: int, batch_dim: int) -> ValueError:
    """The error for an entry ``node`` of ``batch`` that holds ``held``, not the ``n`` examples
    the batch has along ``batch_dim`` (:func:`_example_dim`)."""
    where = next((f"entry {p!r}" for p, t in batch_tensors(batch) if t is node), "an entry")
    if isinstance(node, PackedSequence):
        where = "a PackedSequence"
    low = f" (along dim 0 for one with {batch_dim} dims or fewer)" if batch_dim else ""
    return ValueError(
        f"overlap_batch: {where} holds {held}, but the batch has {n} examples (its first tensor "
        f"along batch_dim={batch_dim}, or the sequences of a PackedSequence that comes first). S~ "
        f"takes whole examples from every tensor along batch_dim{low}: pass the batch_dim that "
        "holds the examples (batch_dim=1 for time-major (T, B) batches), give every tensor its "
        "examples there, or use overlap=1.0 (S~ = S)"
    )


def _rows_of(
    batch: Any, index: torch.Tensor | slice, n: int, dim: int, column: type = _Column
) -> Any:
    """The examples ``index`` of ``batch`` (of ``n`` examples): slices of every tensor with a
    dimension along its :func:`_example_dim`, sequences of every ``PackedSequence``, and items of
    every list below the top whose length is ``n`` (as ``column``: :class:`_Column` for
    :func:`_concat`, ``list`` for a batch as it is)."""
    picks = list(range(n)[index]) if isinstance(index, slice) else index.tolist()

    def visit(node: Any, top: bool) -> Any:
        if isinstance(node, PackedSequence):
            sequences = unpack_sequence(node)
            if len(sequences) != n:
                raise _not_examples(batch, node, f"{len(sequences)} sequences", n, dim)
            chosen = _Sequences([sequences[i] for i in picks], node.sorted_indices is None)
            return chosen if column is _Column else _packed(chosen)
        if isinstance(node, torch.Tensor):
            if node.dim() == 0:
                return node
            d = _example_dim(node, dim)
            if node.shape[d] != n:
                held = f"{node.shape[d]} along dim {d} (shape {tuple(node.shape)})"
                raise _not_examples(batch, node, held, n, dim)
            if isinstance(index, slice):
                return node[(slice(None),) * d + (index,)]
            return node.index_select(d, index.to(node.device))
        if isinstance(node, list) and not top and len(node) == n:
            return column(node[i] for i in picks)
        parts = batch_children(node)
        return node if parts is None else batch_rebuild(node, [visit(c, False) for c in parts])

    return visit(batch, True)


def _concat(a: Any, b: Any, dim: int) -> Any:
    """Two batches' examples (from :func:`_rows_of`) one after the other; other leaves from
    ``a``."""
    if isinstance(a, _Sequences) and isinstance(b, _Sequences):
        return _packed(_Sequences([*a, *b], a.enforce_sorted))
    if isinstance(a, torch.Tensor):
        return torch.cat([a, b], _example_dim(a, dim)) if a.dim() >= 1 else a
    if isinstance(a, _Column):
        return list(a) + list(b)
    parts = batch_children(a)
    if parts is None:
        return a
    others = batch_children(b)
    if others is None or type(b) is not type(a) or len(others) != len(parts):
        raise ValueError(
            f"overlap_batch: the two batches differ in structure ({type(a).__name__} of "
            f"{len(parts)} entries against {type(b).__name__}); give every batch the same "
            "entries"
        )
    return batch_rebuild(a, [_concat(x, y, dim) for x, y in zip(parts, others, strict=True)])


def overlap_batch(
    batch: Any,
    next_batch: Any,
    overlap: float = 0.5,
    *,
    generator: torch.Generator | int | None = None,
    batch_dim: int | None = None,
) -> Any:
    """GradInit's ``S~``: ``round(overlap * B)`` examples of ``S`` + the rest from the next batch.

    ``B`` is the size of ``batch`` (along ``batch_dim`` of its first tensor that has it, or the
    number of sequences of a ``PackedSequence`` that comes first:
    :func:`~initlab._core.data.batch_size`),
    ``m = round(overlap * B)`` (half up). The result holds the first ``m`` examples of ``batch``
    followed by the first ``B - m`` examples of ``next_batch`` (all of it if it is shorter); with
    ``generator`` both are random subsets (drawn with it) instead of the first ones.
    ``overlap = 1`` returns ``batch`` itself.
    Every tensor with at least one dimension, in a tensor, tuple, list, namedtuple, dict,
    dataclass or batch object (nested), is sliced and concatenated along ``batch_dim`` (``None``:
    dim 0; a tensor with ``batch_dim`` dims or fewer along dim 0: the targets ``(B,)`` of
    time-major ``(T, B)`` inputs), and must hold the batch's examples there: a tensor with more
    than ``batch_dim`` dims that holds them elsewhere (a batch-major ``(B, T)`` mask beside a
    time-major ``(T, B)`` input) is refused where that size differs from ``B``, but spliced
    along its time steps with no word where ``T == B``; every list
    inside the batch whose length is the batch size (ids, per-image target dicts, ragged
    tensors) is a list of examples: its items are chosen and concatenated; every
    ``PackedSequence`` gives its chosen sequences whole, packed again in the order chosen
    (``enforce_sorted=True`` only where it was packed so and they are still longest first, so
    output ``i`` of the model stays example ``i``); other leaves come from ``batch``.

    Raises:
        ValueError: ``overlap`` outside [0, 1] or a bad ``batch_dim``; a tensor that holds
            another number of examples along its dim, or a ``PackedSequence`` of another number
            of sequences (named, with the ways out); two batches of different structure.

    Example:
        >>> s, nxt = torch.arange(4), torch.arange(10, 14)
        >>> overlap_batch(s, nxt, 0.5).tolist()
        [0, 1, 10, 11]
    """
    overlap = check_number("overlap_batch", "overlap", overlap, strict=False)
    if overlap > 1:
        raise ValueError(f"overlap_batch: overlap must be in [0, 1], got {overlap}")
    dim = check_batch_dim("overlap_batch", batch_dim)
    b = batch_size(batch, dim)
    m = math.floor(overlap * b + 0.5)
    if m >= b:
        return batch
    b_next = batch_size(next_batch, dim)
    fresh = min(b - m, b_next)
    gen = as_generator(generator)
    idx_s: torch.Tensor | slice = slice(0, m)
    idx_n: torch.Tensor | slice = slice(0, fresh)
    if gen is not None:
        idx_s = torch.randperm(b, generator=gen, device=gen.device)[:m]
        idx_n = torch.randperm(b_next, generator=gen, device=gen.device)[:fresh]
    if not m:
        return _rows_of(next_batch, idx_n, b_next, dim, column=list)
    return _concat(_rows_of(batch, idx_s, b, dim), _rows_of(next_batch, idx_n, b_next, dim), dim)
