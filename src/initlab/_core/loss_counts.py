"""What a loss averages over on a batch, for the moment probe's per-example scaling and the
per-target losses of the doctor and the loss landscape: :func:`example_count` (the examples a
mean-reduced class criterion divides by, where not the batch size), :func:`target_count` (the
targets it averages over) and :func:`batch_reduction` (how the probe scales gradients)."""

from __future__ import annotations

from typing import Any

import torch

from initlab._core.criteria import counted
from initlab._core.loss import Loss, TargetError, _class_criterion, _target

__all__ = ["batch_reduction", "example_count", "target_count"]


def example_count(loss: Loss, batch: Any) -> float | None:
    """The number of examples a mean-reduced loss divides by on ``batch``, where it is not the
    batch size: torch's cross-entropy and NLL criteria (and initlab's ``"cross_entropy"`` and
    ``"auto"``, and a model's own loss by the Hugging Face convention) on class targets of shape
    ``(B,)`` divide by the targets not equal to ``ignore_index``, each counted by its class
    weight. The moment probe scales gradients by it
    instead of ``B``, so a per-example gradient is that of the example's own (weighted) loss, as
    with ``reduction="sum"``, and an ignored example's is zero. ``None``: the batch size (no target
    ignored, no class weights), or unknown (any other loss).
    """
    fn = _class_criterion(loss)
    if fn is None or loss.reduction not in ("mean", None):
        return None
    try:
        y = _target(batch, None)
    except TargetError:
        return None
    if not isinstance(y, torch.Tensor) or y.dim() != 1 or y.is_floating_point():
        return None  # a target that is no tensor: the forward's error names the batch
    count = counted(fn, y)
    return None if count == y.shape[0] else count


def target_count(loss: Loss, batch: Any) -> float | None:
    """What the loss averages over on ``batch`` (or sums, for ``reduction="sum"``): for torch's
    cross-entropy/NLL criteria and initlab's ``"cross_entropy"``, the target positions not equal
    to ``ignore_index``, each counted by its class weight (every token of ``(B, T)`` targets);
    for another loss on targets, their number of elements (MSE's mean); ``None`` for a loss
    without targets."""
    try:
        y = _target(batch, None)
    except TargetError:
        return None
    fn = _class_criterion(loss)
    if fn is None or y.is_floating_point():
        return float(y.numel())
    return counted(fn, y)


def batch_reduction(loss: Loss | None, loss_reduction: str | None, what: str) -> str:
    """How the probe scales gradients to per-example ones (``loss_reduction`` of
    :class:`~initlab.MomentProbe`): the one given, else the one the loss declares, else
    ``"mean"``. Raises ValueError where the given one contradicts the loss's own (a criterion
    with ``reduction="sum"`` read as a mean puts every per-example moment off by ``B**2``)."""
    if loss is None or loss.reduction is None:
        return loss_reduction or "mean"
    if loss_reduction in (None, loss.reduction):
        return loss.reduction
    raise ValueError(
        f"{what}: loss_reduction={loss_reduction!r}, but the loss {loss.name!r} reduces over the "
        f"batch by {loss.reduction!r}: pass loss_reduction={loss.reduction!r}, or leave it out (it "
        "is read from the loss)"
    )
