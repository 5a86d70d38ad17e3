r"""Per-example gradients held as factors, and squared norms of sums of outer products.

The closed forms of :mod:`~initlab.measure.probe.per_example` give a linear layer's per-example
weight gradient as ``sum_t dy_it x_it^T`` and an embedding's as ``sum_t e_{tok_it} dy_it^T``.
This module computes their squared norms without always materializing them:

* :func:`_outer_sq_norms`: ``||sum_t dy_it x_it^T||^2`` per example, by the per-example outer
  products (:func:`_bmm_sq_norms`) or, where fewer multiplications, their Gram form
  ``sum_ts (dy_t.dy_s)(x_t.x_s)`` (:func:`_gram_sq_norms`, guarded against cancellation);
* :func:`_rows_sq_norms`: ``sum_v ||sum_{t: tok_it = v} g_it||^2`` per example (embedding rows);
* :class:`_Outer` and :class:`_Rows`: such gradients kept as factors, for a parameter used by
  several module calls (e.g. an output head tied to its embedding): :func:`_factored_sq_norms`
  gives the squared norm of their sum from the factors' pairwise inner products (:func:`_inner`,
  :func:`_gram_inner`), :func:`_materialize` the gradients a factor stands for.

Also the small helpers both modules use: :func:`_work` (the working precision),
:func:`_sq_norms` (per-example squared norms of materialized gradients) and :func:`_chunks`
(batch chunks bounded by ``_CHUNK_ELEMENTS``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from initlab._core.reductions import sum_of_squares

_CHUNK_ELEMENTS = 1 << 24  # bound on per-example gradient elements materialized at once


class _Outer:
    """Per-example ``s * sum_t a_it b_it^T`` (``a (B, T, m)``, ``b (B, T, n)``) in rows
    ``off .. off + m`` of a 2-D parameter (a linear layer's weight, or a block of its rows)."""

    __slots__ = ("a", "b", "off", "s")

    def __init__(self, a: torch.Tensor, b: torch.Tensor, s: float, off: int = 0) -> None:
        self.a, self.b, self.s, self.off = a, b, s, off


class _Rows:
    """Per-example ``s * sum_t e_{tok_it} g_it^T`` (``tok (B, T)``, ``g (B, T, n)``): rows of an
    embedding table of ``n_rows`` rows (rows of ``padding_idx`` already zeroed in ``g``)."""

    __slots__ = ("g", "n_rows", "s", "tok")

    def __init__(self, tok: torch.Tensor, g: torch.Tensor, s: float, n_rows: int) -> None:
        self.tok, self.g, self.s, self.n_rows = tok, g, s, n_rows


def _work(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 or float64 (half precisions computed in float32)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _sq_norms(grads: torch.Tensor) -> torch.Tensor:
    """Per-example squared norms as float64 (reduced in the gradient's precision, cascaded)."""
    g = _work(grads)
    if g.dim() == 2 and g.shape[1] <= 2048:  # short rows (biases, norms): one norm per row
        return torch.linalg.vector_norm(g, dim=1).to(torch.float64).square()
    return sum_of_squares(g, per_row=True)


def _chunks(total: int, per_item: int) -> Iterable[tuple[int, int]]:
    step = max(1, _CHUNK_ELEMENTS // max(per_item, 1))
    for lo in range(0, total, step):
        yield lo, min(total, lo + step)


# ----------------------------------------------------------------------------- outer products


def _outer_sq_norms(dy3: torch.Tensor, x3: torch.Tensor) -> torch.Tensor:
    """``||sum_t dy_it x_it^T||^2`` per example for ``dy3 (B, T, out)``, ``x3 (B, T, in)``.

    Whichever costs fewer multiplications: the per-example outer products (``bmm``, ``T in out``
    per example) or their Gram form ``sum_ts (dy_t.dy_s)(x_t.x_s)`` (``T^2 (in + out)``, 3/4 of
    that from ``_SPLIT`` steps on: the symmetric half), see :func:`_gram_sq_norms`.
    """
    steps, n_in, n_out = x3.shape[1], x3.shape[-1], dy3.shape[-1]
    if steps == 1:
        return _sq_norms(dy3) * _sq_norms(x3)
    share = 3 if steps >= _SPLIT else 4  # quarters of the full Gram form's multiplications
    if share * steps * (n_in + n_out) < 4 * n_in * n_out:
        return _gram_sq_norms(dy3, x3)
    return _bmm_sq_norms(dy3, x3)


def _bmm_sq_norms(dy3: torch.Tensor, x3: torch.Tensor) -> torch.Tensor:
    """``||dy3_i^T x3_i||^2`` per example from the per-example outer products (chunked)."""
    n_in, n_out = x3.shape[-1], dy3.shape[-1]
    parts = [
        _sq_norms(torch.bmm(dy3[lo:hi].mT, x3[lo:hi]))
        for lo, hi in _chunks(x3.shape[0], n_in * n_out)
    ]
    return torch.cat(parts)


# relative rounding error of the Gram form accepted before an example is recomputed by bmm
_GRAM_TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
_SPLIT = 4  # from this many steps the Gram form computes the blocks of its symmetric half


def _gram_sq_norms(dy3: torch.Tensor, x3: torch.Tensor) -> torch.Tensor:
    """``sum_ts (dy_t.dy_s)(x_t.x_s)`` per example, guarded against cancellation.

    The Gram matrices and their products are computed in the inputs' precision, each row of
    ``T`` products summed in that precision and the rows in float64. Each Gram entry carries a
    rounding error of about ``u sqrt(n) |a_t||a_s|`` (``u`` the unit roundoff, ``n = in + out``)
    and the row sums one of ``u sqrt(T)`` relative, so the sum is off by about
    ``u sqrt(n + T) sum_t |dy_t|^2 |x_t|^2`` (the diagonal). That is small against the result
    unless the terms cancel (``||sum_t dy_t x_t^T||^2`` far below ``sum_t |dy_t|^2 |x_t|^2``):
    examples whose estimated relative error exceeds ``_GRAM_TOL`` (1e-5 in float32) are
    recomputed by :func:`_bmm_sq_norms`, whose error is of first order only. On CPU the check
    reads one flag (no cost); on other devices it would synchronise inside the hook, so there
    the Gram form is taken in float64 only, where it is cheaper even so (as exact as ``bmm``).
    From ``_SPLIT`` steps on, only the symmetric half is computed: with ``h = T // 2``, the
    diagonal blocks ``[:h, :h]`` and ``[h:, h:]`` (one ``bmm`` of the halves where the layout
    allows) and twice the block ``[:h, h:]``, 3/4 of the multiplications, rows of at most ``T``
    terms as before (the doubling is exact).
    """
    batch, steps, n_in, n_out = x3.shape[0], x3.shape[1], x3.shape[-1], dy3.shape[-1]
    cpu = x3.device.type == "cpu" and x3.dtype in _GRAM_TOL and dy3.dtype == x3.dtype
    if not cpu:
        if 3 * steps * (n_in + n_out) > n_in * n_out:
            return _bmm_sq_norms(dy3, x3)
        x3, dy3 = x3.to(torch.float64), dy3.to(torch.float64)
    parts, diags = [], []
    for lo, hi in _chunks(batch, steps * (steps + n_in + n_out)):
        x, dy = x3[lo:hi], dy3[lo:hi]
        if steps < _SPLIT:
            blocks = [(x, x, dy, dy, 1.0)]
        else:  # symmetric: the blocks [:h, :h], [h:, h:] and twice [:h, h:] (3/4 of the work)
            h = steps // 2
            a, b, c, d = x[:, :h], x[:, h:], dy[:, :h], dy[:, h:]
            both = _halves(x, dy, h)  # both diagonal blocks in one bmm where the layout allows
            on = [both] if both is not None else [(a, a, c, c, 1.0), (b, b, d, d, 1.0)]
            blocks = [*on, (a, b, c, d, 2.0)]
        part = diag = None
        for p, q, r, s, w in blocks:
            prod = (p @ q.mT).mul_(r @ s.mT)
            # rows of at most T terms in the inputs' precision, the rows pooled in float64
            v = prod.sum(2).to(torch.float64).view(hi - lo, -1).sum(1)
            part = v * w if part is None else part + v * w
            if cpu and w == 1.0:  # the diagonal: |x_t|^2 |dy_t|^2
                g = prod.diagonal(0, 1, 2).to(torch.float64).reshape(hi - lo, -1).sum(1)
                diag = g if diag is None else diag + g
        parts.append(part)
        diags.append(diag)
    out = torch.cat(parts)
    if not cpu:
        return out
    unit = torch.finfo(x3.dtype).eps / 2
    risky = torch.cat(diags) * (unit * (n_in + n_out + steps) ** 0.5) > _GRAM_TOL[x3.dtype] * out
    idx = risky.nonzero().flatten()
    if idx.numel():
        out[idx] = _bmm_sq_norms(dy3[idx], x3[idx])
    return out


def _halves(x: torch.Tensor, dy: torch.Tensor, h: int) -> tuple | None:
    """``x`` and ``dy`` (``(B, 2h, n)``) viewed as ``(2B, h, n)`` (their halves as examples of
    their own, for one ``bmm`` of both diagonal blocks), or ``None`` where that needs a copy."""
    if x.shape[1] != 2 * h:
        return None
    try:
        xx, dd = x.view(-1, h, x.shape[-1]), dy.view(-1, h, dy.shape[-1])
    except RuntimeError:
        return None
    return (xx, xx, dd, dd, 1.0)


def _rows_sq_norms(tok2: torch.Tensor, g3: torch.Tensor, n_rows: int) -> torch.Tensor:
    """``sum_v ||sum_{t: tok_it = v} g_it||^2`` per example: the (example, token) keys sorted,
    the rows of equal keys summed by ``index_add`` (memory and time ~ ``g``)."""
    batch, dim = g3.shape[0], g3.shape[-1]
    keys = (tok2 + n_rows * torch.arange(batch, device=tok2.device).unsqueeze(1)).reshape(-1)
    rows = g3.reshape(-1, dim)
    keys, order = torch.sort(keys)
    new = torch.ones_like(keys, dtype=torch.bool)
    new[1:] = keys[1:] != keys[:-1]
    seg = torch.cumsum(new, 0) - 1  # segment id of each sorted row
    sums = rows.new_zeros(rows.shape).index_add_(0, seg, rows[order])
    example = torch.zeros_like(keys).scatter_(0, seg, keys // n_rows)
    sqn = torch.zeros(batch, dtype=torch.float64, device=rows.device)
    return sqn.index_add_(0, example, _sq_norms(sums))


# ----------------------------------------------------------------------------- factored sums


def _materialize(f: _Outer | _Rows, shape: tuple[int, ...]) -> torch.Tensor:
    """The per-example gradients ``(B, *shape)`` a factor stands for."""
    if isinstance(f, _Rows):
        batch, dim = f.g.shape[0], f.g.shape[-1]
        keys = (f.tok + f.n_rows * torch.arange(batch, device=f.tok.device).unsqueeze(1)).reshape(
            -1
        )
        dense = f.g.new_zeros(batch * f.n_rows, dim).index_add_(0, keys, f.g.reshape(-1, dim))
        return dense.view(batch, f.n_rows, dim) * f.s
    block = torch.bmm(f.a.mT, f.b) * f.s
    if f.off == 0 and block.shape[1:] == shape:
        return block
    out = block.new_zeros(block.shape[0], *shape)
    out[:, f.off : f.off + block.shape[1]] = block
    return out


def _factored_sq_norms(factors: list[_Outer | _Rows]) -> torch.Tensor:
    """``||sum_k F_k||^2`` per example = ``sum_k ||F_k||^2 + 2 sum_{k<l} <F_k, F_l>``.

    Squares by the closed forms (:func:`_outer_sq_norms`, :func:`_rows_sq_norms`); inner products
    in float64 by :func:`_inner` (``T T'`` terms per example instead of a materialized gradient,
    e.g. an output head tied to its embedding: ``sum_ts a_t[tok_s] (b_t . g_s)``).
    """
    total = None
    for k, f in enumerate(factors):
        if isinstance(f, _Rows):
            part = _rows_sq_norms(f.tok, f.g, f.n_rows) * (f.s * f.s)
        else:
            part = _outer_sq_norms(f.a, f.b) * (f.s * f.s)
        for other in factors[k + 1 :]:
            part = part + 2.0 * _inner(f, other)
        total = part if total is None else total + part
    assert total is not None
    return total


def _inner(f: _Outer | _Rows, h: _Outer | _Rows) -> torch.Tensor:
    """Per-example Frobenius inner product ``<F, H>`` of two factors (float64)."""
    if isinstance(f, _Rows) and isinstance(h, _Outer):
        f, h = h, f
    s = f.s * h.s
    if isinstance(f, _Outer) and isinstance(h, _Outer):
        m = f.a.shape[-1]
        if f.off >= h.off + h.a.shape[-1] or h.off >= f.off + m:
            return f.a.new_zeros(f.a.shape[0], dtype=torch.float64)  # disjoint rows
        if f.off == h.off and m == h.a.shape[-1]:
            # sum_ts (a_t . a'_s)(b_t . b'_s)
            return _gram_inner(f.a, h.a, f.b, h.b) * s
    elif isinstance(f, _Outer) and isinstance(h, _Rows):
        if f.off == 0 and f.a.shape[-1] == h.n_rows:
            # sum_ts a_t[tok_s] (b_t . g_s)
            return _gram_inner(f.a, h.tok, f.b, h.g, gather=True) * s
    elif isinstance(f, _Rows) and isinstance(h, _Rows):
        # sum_ts [tok_t == tok'_s] (g_t . g'_s)
        return _gram_inner(f.tok, h.tok, f.g, h.g, match=True) * s
    # partly overlapping blocks: materialize both
    shape = (max(_rows_of(f), _rows_of(h)), _width(f))
    a = _materialize(f, shape).to(torch.float64)
    b = _materialize(h, shape).to(torch.float64)
    return (a * b).flatten(1).sum(1)


def _rows_of(f: _Outer | _Rows) -> int:
    return f.n_rows if isinstance(f, _Rows) else f.off + f.a.shape[-1]


def _width(f: _Outer | _Rows) -> int:
    return f.g.shape[-1] if isinstance(f, _Rows) else f.b.shape[-1]


def _gram_inner(
    p: torch.Tensor,
    q: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    gather: bool = False,
    match: bool = False,
) -> torch.Tensor:
    """``sum_ts P_ts (b_t . c_s)`` per example in float64, chunked over the batch, with ``P_ts``
    ``p_t . q_s`` (default), ``p_t[q_s]`` (``gather``: ``q`` holds row indices) or
    ``[p_t == q_s]`` (``match``: both hold row indices)."""
    batch, steps_t, steps_s = b.shape[0], b.shape[1], c.shape[1]
    per = steps_t * steps_s + (steps_t + steps_s) * (
        b.shape[-1] + (p.shape[-1] if p.dim() > 2 else 1)
    )
    parts = []
    for lo, hi in _chunks(batch, per):
        bc = b[lo:hi].to(torch.float64) @ c[lo:hi].to(torch.float64).mT
        if match:
            pq = p[lo:hi].unsqueeze(2) == q[lo:hi].unsqueeze(1)
        elif gather:
            idx = q[lo:hi].long().unsqueeze(1).expand(-1, steps_t, -1)
            pq = torch.gather(p[lo:hi], 2, idx).to(torch.float64)
        else:
            pq = p[lo:hi].to(torch.float64) @ q[lo:hi].to(torch.float64).mT
        parts.append((bc * pq).sum((1, 2)))
    return torch.cat(parts)
