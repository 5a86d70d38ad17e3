"""A loss on the model's outputs run with a ``forward=`` of the user's.

``loss(model, batch) = on_outputs(forward(model, batch), batch)``: the entry points that take
both a loss and a ``forward=`` (``block_curvature``, ``loss_landscape``, ``theory_vs_actual``,
``doctor``) run the model with ``forward`` and score its output with the loss, whose target is
read from the batch (:func:`~initlab._core.data.find_target`: ``batch[1]`` of ``(x, y, ...)``).

A ``forward`` that passes ``batch[1]`` to the model as an input (``model(batch[0], batch[1])``
on a batch ``(x, z, y)``) would have the loss score the output against an input, silently:
:func:`target_kept` raises :class:`~initlab._core.loss.TargetError` there instead.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from initlab._core.data import TARGET_KEYS
from initlab._core.loss import Loss, TargetError, default_loss

__all__ = ["Forward", "on_batches", "target_kept", "with_forward"]

Forward = Callable[[nn.Module, Any], Any]

#: The two ways out the error of :func:`target_kept` names.
TARGET_WAYS = (
    "Keep the target at batch[1]: (x, y, z, ...) batches with forward=lambda model, batch: "
    "model(batch[0], *batch[2:]); or pass, without forward=, a loss_fn(model, batch) that calls "
    "the model and names the target, e.g. loss_fn=lambda model, batch: "
    "F.cross_entropy(model(batch[0], batch[1]), batch[2]) for (x, z, y) batches"
)


def on_batches(loss: Loss, batches: list[Any]) -> Loss:
    """``loss`` for these batches: the default (``None``) is :data:`~initlab._core.loss.
    default_loss` (a loss on the outputs) when no batch is a dict, as the resolver reads it."""
    if loss.form == "auto" and not any(isinstance(b, Mapping) for b in batches):
        return default_loss
    return loss


def target_kept(forward: Forward, name: str, what: str) -> Forward:
    """``forward``, checked on every tuple or list batch of 3 or more entries whose ``batch[1]``
    (the target the loss ``name`` reads) is a tensor found nowhere else in the batch: where
    ``forward`` passes that tensor to the model's own call as an input (a positional argument,
    or a keyword not named like a target, :data:`~initlab._core.data.TARGET_KEYS`, as a model
    trained with teacher forcing takes ``labels=``), it raises.

    Raises:
        TargetError: ``forward`` gave ``batch[1]`` to the model; the message gives both ways
            out (:data:`TARGET_WAYS`).
    """

    def checked(model: nn.Module, batch: Any) -> Any:
        y = _lone_target(batch)
        if y is None or not isinstance(model, nn.Module):
            return forward(model, batch)
        given: list[bool] = []

        def see(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            named = (v for k, v in kwargs.items() if k not in TARGET_KEYS)
            given.append(any(a is y for a in args) or any(v is y for v in named))

        handle = model.register_forward_pre_hook(see, with_kwargs=True)
        try:
            out = forward(model, batch)
        finally:
            handle.remove()
        if any(given):
            raise TargetError(
                f"{what}: forward= passes batch[1] to the model as an input, and the loss "
                f"{name!r} reads the target of an (x, y, ...) batch at batch[1]: it would score "
                f"the output against an input of shape {tuple(y.shape)}. {TARGET_WAYS}"
            )
        return out

    return checked


def _lone_target(batch: Any) -> torch.Tensor | None:
    """``batch[1]`` of a tuple or list batch of 3+ entries, where it is a tensor that is no other
    entry (``(ids, ids, mask)``: the input is the target too); else ``None``."""
    if not isinstance(batch, (tuple, list)) or len(batch) < 3:
        return None
    y = batch[1]
    if not isinstance(y, torch.Tensor) or any(b is y for i, b in enumerate(batch) if i != 1):
        return None
    return y


def with_forward(loss: Loss, forward: Forward, batches: list[Any], what: str) -> Loss:
    """``loss`` with the model run by ``forward``: for a loss on the outputs on these batches
    (:func:`on_batches`: a criterion, a named loss, the default loss on ``(x, y, ...)``
    batches), a copy whose forward is ``forward`` checked by :func:`target_kept`, so that
    ``loss(model, batch) = on_outputs(forward(model, batch), batch)``; any other loss (a
    ``loss_fn(model, batch)``, the model's own loss) calls the model itself: ``loss`` as it is."""
    base = on_batches(loss, batches)
    if not base.splittable:
        return loss
    out = copy.copy(base)
    out.forward = target_kept(forward, base.name, what)  # type: ignore[attr-defined]
    return out
