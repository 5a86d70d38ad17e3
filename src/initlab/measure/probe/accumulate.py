r"""Accumulating moments inside hooks: float64 sums on the tensor's device, pooled exactly.

A hooked tensor ``t`` contributes ``[sum(t^2), sum(t)]`` (:func:`_sums`) and its element count to
an accumulator ``[sum t^2, sum t, n, batches, nonfinite]`` (:func:`_new_acc`, :func:`_accumulate`;
a batch-call whose sums are NaN/inf is counted in ``nonfinite`` instead, without a host sync);
:class:`_Ledger` does the same for every tensor a probe's hooks see, in one batch;
:func:`_moments` turns an accumulator into ``sq_mean``, ``mean``, ``var``, ``numel``, ``batches``
and ``nonfinite``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from initlab._core.reductions import sum_of_squares

_NAN = float("nan")


class _Consts:
    """Small constant tensors, made once per device (hooks stay at a handful of tiny ops)."""

    def __init__(self) -> None:
        self._cache: dict[tuple, torch.Tensor] = {}

    def get(self, device: torch.device, values: tuple[float, ...]) -> torch.Tensor:
        key = (device, values)
        t = self._cache.get(key)
        if t is None:
            if len(self._cache) > 4096:  # many distinct element counts: start over
                self._cache.clear()
            t = self._cache[key] = torch.tensor(values, dtype=torch.float64, device=device)
        return t


_BAD = (0.0, 0.0, 0.0, 0.0, 1.0)


def _distinct(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` detached, in float32 or float64, and how often each of its elements repeats.

    An expanded tensor (the gradient of a mean or of a broadcast) repeats its distinct elements;
    they are reduced once (reductions over stride-0 dims take a slow path). A complex tensor (a
    frozen complex parameter: a trainable one is refused) is read as its modulus, so its second
    moment is ``E[|z|^2]``.
    """
    d = t.detach()
    if d.is_complex():
        d = d.abs()
    if d.dtype not in (torch.float32, torch.float64):
        d = d.float()
    multiplicity = 1
    if d.numel() > 1 and 0 in d.stride():
        d = d[tuple(slice(0, 1) if st == 0 else slice(None) for st in d.stride())]
        multiplicity = t.numel() // d.numel()
    return d, multiplicity


def _sums(t: torch.Tensor, scale: float = 1.0, consts: _Consts | None = None) -> torch.Tensor:
    """``[sum(t^2), sum(t)] * [scale^2, scale]`` as float64 on ``t``'s device (no sync).

    The reductions run in the tensor's own precision (float16/bfloat16: float32) with relative
    error ~1e-8 at any size (:func:`initlab._core.reductions.sum_of_squares`); casting every hooked
    tensor to float64 first costs ~8x more, as much as the layer's own forward. Batch-calls are
    then pooled in float64.
    """
    consts = consts or _Consts()
    d, multiplicity = _distinct(t)
    rows = _rows(d)
    if rows is not None:
        # one pass per statistic over short rows, the rows pooled in float64 (as accurate as
        # sum_of_squares, with a third of its small ops: hooks run this on every tensor)
        v = torch.stack((torch.linalg.vector_norm(rows, dim=1), rows.sum(1))).to(torch.float64)
        v[0].square_()
        v = v.sum(1)
    else:
        # both accurate at any size: see initlab._core.reductions; torch.sum reduces in cascades
        v = torch.stack((sum_of_squares(d), torch.sum(d).to(torch.float64)))
    w2, w1 = multiplicity * scale * scale, multiplicity * scale
    if w2 != 1.0 or w1 != 1.0:
        v = v * consts.get(v.device, (w2, w1))
    return v


class _Partial:
    """A tensor's row norms and row sums (``_rows``), pooled into ``[s2, s1]`` by
    :meth:`_Ledger.flush` with the weights ``w2``, ``w1`` (scale and multiplicity)."""

    __slots__ = ("norms", "sums", "w1", "w2")

    def __init__(self, norms: torch.Tensor, sums: torch.Tensor, w2: float, w1: float) -> None:
        self.norms, self.sums, self.w2, self.w1 = norms, sums, w2, w1


_ROW = 2048  # elements per row of _rows: float32 norms and sums of 2048 elements err ~1e-9


def _rows(d: torch.Tensor) -> torch.Tensor | None:
    """``d`` viewed as rows of at most ``_ROW`` elements (no copy), or ``None``.

    Rows of ``_ROW`` where the size allows, else rows along the last dim when it holds 64 to
    ``_ROW`` elements; ``None`` for other shapes and for non-contiguous tensors.
    """
    if not d.is_contiguous():
        return None
    n = d.numel()
    if n % _ROW == 0 and n:
        return d.view(-1, _ROW)
    if d.dim() and 64 <= d.shape[-1] <= _ROW:
        return d.view(-1, d.shape[-1])
    return None


def _new_acc(device: torch.device) -> torch.Tensor:
    # [sum t^2, sum t, n, batches, nonfinite]
    return torch.zeros(5, dtype=torch.float64, device=device)


def _accumulate(
    acc: torch.Tensor, sums: torch.Tensor, n: int, consts: _Consts | None = None
) -> None:
    """Add one batch-call's sums unless they are NaN/inf, in which case count it as non-finite.

    One ``where`` adds either ``[s2, s1, n, 1, 0]`` or ``[0, 0, 0, 0, 1]`` (no host sync).
    """
    consts = consts or _Consts()
    if sums.device != acc.device:
        sums = sums.to(acc.device)
    ok = torch.isfinite(sums).all()
    good = torch.cat((sums, consts.get(acc.device, (float(n), 1.0, 0.0))))
    acc.add_(torch.where(ok, good, consts.get(acc.device, _BAD)))


class _Ledger:
    """Additions to accumulators, kept in the hooks and applied in one batch.

    A hook reduces its tensor (:meth:`reduce`: the norm and the sum of each row, two ops; the
    float64 pooling is left to the batch) and :meth:`add` keeps ``(acc, sums, n)`` (``sums``:
    that reduction, a ``[s2, s1]`` tensor, or ``s2`` alone, 0-dim, for ``s1 = 0``); :meth:`flush`
    (before any result is read, and every ``_FLUSH_EVERY`` additions) pools all rows in float64,
    checks all pending sums for NaN/inf at once and adds ``[s2, s1, n, 1, 0]``, or
    ``[0, 0, 0, 0, 1]`` for non-finite sums, to each accumulator: a handful of ops per device
    instead of a dozen per hooked tensor, the same float64 sums as :func:`_sums` and
    :func:`_accumulate` (no host sync).
    """

    _FLUSH_EVERY = 4096
    _BLOCK = 256  # accumulators per allocation

    def __init__(self) -> None:
        self._pending: list[tuple[torch.Tensor, torch.Tensor | _Partial, int]] = []
        self._free: dict[torch.device, list[torch.Tensor]] = {}

    def new_acc(self, device: torch.device) -> torch.Tensor:
        """A zero accumulator (:func:`_new_acc`), a row of a block allocated for many."""
        free = self._free.get(device)
        if not free:
            block = torch.zeros(self._BLOCK, 5, dtype=torch.float64, device=device)
            free = self._free[device] = list(block.unbind(0))[::-1]
        return free.pop()

    def reduce(
        self, t: torch.Tensor, scale: float = 1.0, consts: _Consts | None = None
    ) -> torch.Tensor | _Partial:
        """What :meth:`add` takes for ``t`` (its sums scaled by ``[scale^2, scale]``)."""
        d, multiplicity = _distinct(t)
        rows = _rows(d)
        if rows is None:
            return _sums(t, scale, consts)
        w2, w1 = multiplicity * scale * scale, multiplicity * scale
        return _Partial(torch.linalg.vector_norm(rows, dim=1), rows.sum(1), w2, w1)

    def add(self, acc: torch.Tensor, sums: torch.Tensor | _Partial, n: int) -> None:
        self._pending.append((acc, sums, n))
        if len(self._pending) >= self._FLUSH_EVERY:
            self.flush()

    def clear(self) -> None:
        self._pending = []
        self._free = {}

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor | _Partial, int]]] = {}
        for item in pending:
            by_device.setdefault(item[0].device, []).append(item)
        for device, items in by_device.items():
            self._apply(device, items)

    @staticmethod
    def _apply(
        device: torch.device, items: list[tuple[torch.Tensor, torch.Tensor | _Partial, int]]
    ) -> None:
        sums = _pool([s for _, s, _ in items], device)
        slots: dict[int, int] = {}
        accs: list[torch.Tensor] = []
        index = []
        for acc, _, _ in items:
            j = slots.get(id(acc))
            if j is None:
                j = slots[id(acc)] = len(accs)
                accs.append(acc)
            index.append(j)
        meta = torch.tensor(
            [(float(n), 1.0, 0.0) for _, _, n in items], dtype=torch.float64, device=device
        )
        good = torch.cat((sums, meta), 1)
        bad = torch.tensor(_BAD, dtype=torch.float64, device=device)
        vals = torch.where(torch.isfinite(sums).all(1, keepdim=True), good, bad)
        total = vals.new_zeros(len(accs), 5)
        total.index_add_(0, torch.tensor(index, device=device), vals)
        torch._foreach_add_(accs, list(total.unbind(0)))


def _pool(reductions: Sequence[torch.Tensor | _Partial], device: torch.device) -> torch.Tensor:
    """``[s2, s1]`` (float64, one row per item, on ``device``) of :meth:`_Ledger.reduce` results:
    a :class:`_Partial`'s rows pooled in float64 and weighted, a ``[s2, s1]`` tensor as it is, a
    0-dim ``s2`` with ``s1 = 0``. Each distinct reduction is pooled once (a few ops in all)."""
    rows_of: dict[int, int] = {}
    partials: dict[torch.dtype, list[_Partial]] = {}
    pairs: list[torch.Tensor] = []  # [s2, s1]
    singles: list[torch.Tensor] = []  # s2 (s1 = 0)
    order: list[Any] = []  # the reductions in the order of the rows of `every`
    for s in reductions:
        if id(s) in rows_of:
            continue
        rows_of[id(s)] = -1
        if isinstance(s, _Partial):
            partials.setdefault(s.norms.dtype, []).append(s)
        elif s.dim():
            pairs.append(s)
        else:
            singles.append(s)
    blocks: list[torch.Tensor] = []
    for group in partials.values():
        lengths = torch.tensor([p.norms.shape[0] for p in group], device=device)
        seg = torch.repeat_interleave(torch.arange(len(group), device=device), lengths)
        norms = torch.cat([p.norms for p in group]).to(torch.float64)
        row_sums = torch.cat([p.sums for p in group]).to(torch.float64)
        pooled = norms.new_zeros(len(group), 2)
        pooled.index_add_(0, seg, torch.stack((norms.square(), row_sums), 1))
        weights = torch.tensor([(p.w2, p.w1) for p in group], dtype=torch.float64, device=device)
        blocks.append(pooled * weights)
        order += group
    if pairs:
        blocks.append(torch.stack([s if s.device == device else s.to(device) for s in pairs]))
        order += pairs
    if singles:
        s2 = torch.stack([s if s.device == device else s.to(device) for s in singles])
        blocks.append(torch.stack((s2, torch.zeros_like(s2)), 1))
        order += singles
    for j, s in enumerate(order):
        rows_of[id(s)] = j
    every = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
    return every[torch.tensor([rows_of[id(s)] for s in reductions], device=device)]


def _moments(values: Sequence[float]) -> dict[str, float]:
    s2, s1, n, batches, nonfinite = values
    if n > 0:
        sq_mean, mean = s2 / n, s1 / n
        var = max(sq_mean - mean * mean, 0.0) if n >= 2 else _NAN
    else:
        sq_mean = mean = var = _NAN
    return {
        "sq_mean": sq_mean,
        "mean": mean,
        "var": var,
        "numel": float(n),
        "batches": float(batches),
        "nonfinite": float(nonfinite),
    }
