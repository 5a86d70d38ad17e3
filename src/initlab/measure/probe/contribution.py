"""What a per-example computation gives for one parameter and one module call
(:class:`_Contribution`), the rank-one projection its consistency check reads (:func:`_project`),
and the two signals of :mod:`~initlab.measure.probe.per_example` (:class:`_Unavailable`: NaN with
a note; :class:`_Fallback`: take the generic path)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from initlab.measure.probe.factors import _work

if TYPE_CHECKING:
    from initlab.measure.probe.factors import _Outer, _Rows
    from initlab.measure.probe.state import _ParamState


class _Unavailable(Exception):
    """A per-example gradient that cannot be computed exactly (reported as NaN with a note)."""


class _Fallback(Exception):
    """The module's configuration is outside a shortcut: use the generic ``vmap`` path."""


class _Contribution:
    """Per-example gradients of one parameter from one module call (scaled to one example's loss).

    One of ``sqn`` (per-example squared norms, closed form), ``grads`` (materialized, ``(B,
    *shape)``) or ``factors`` (the gradients as sums of outer products,
    :class:`~initlab.measure.probe.factors._Outer` and
    :class:`~initlab.measure.probe.factors._Rows`, for a parameter used by several calls: the
    squared norm of the sum follows from inner products of the factors without materializing
    them); ``proj`` holds the per-example rank-one projections used for the consistency check.
    """

    __slots__ = ("factors", "grads", "proj", "sqn")

    def __init__(
        self,
        proj: torch.Tensor,
        sqn: torch.Tensor | None = None,
        grads: torch.Tensor | None = None,
        factors: list[_Outer | _Rows] | None = None,
    ) -> None:
        self.proj = proj
        self.sqn = sqn
        self.grads = grads
        self.factors = factors


def _project(grads: torch.Tensor, ps: _ParamState) -> torch.Tensor:
    """Per-example ``<r_0 x r_1 x ..., g_i>`` for ``grads`` of shape ``(B, *shape)`` (float64).

    Computed in the gradient's own precision: the projection only feeds the consistency check,
    whose tolerance is far above float32 rounding.
    """
    out = _work(grads)
    return _contract(out, ps.vecs_as(out.dtype)).to(torch.float64)


def _contract(t: torch.Tensor, vecs: list[torch.Tensor]) -> torch.Tensor:
    """``t`` contracted over its last ``len(vecs)`` dims with ``vecs`` (``mv``/``dot`` where the
    operand is 2-D/1-D: one op each)."""
    for v in reversed(vecs):
        if t.dim() == 1:
            t = torch.dot(t, v)
        elif t.dim() == 2:
            t = torch.mv(t, v)
        else:
            t = t @ v
    return t
