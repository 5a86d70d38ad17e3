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
from initlab._core.pytree import flatten_tensors

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


def target_kept(forward: Forward, loss: Loss, what: str) -> Forward:
    """``forward``, checked where ``loss`` reads the target at ``batch[1]`` (a criterion, a named
    loss but ``"random_quadratic"``, the default loss; not :func:`~initlab._core.loss.
    outputs_loss`, which reads the entries it names), on the first tuple or list batch of 2 or
    more entries whose ``batch[1]`` is a tensor no other entry equals (``(ids, ids, mask)``: the
    input is the target too): where ``forward`` passes ``batch[1]`` to the model's own call as an
    input, it raises. An input is ``batch[1]`` when it is that tensor, a view of it of its shape,
    or a copy of its shape and values after conversion (``batch[1].float()``,
    ``batch[1].to(device)``; not for a constant ``batch[1]``, which a fresh ``torch.zeros`` would
    equal), positional or by a keyword not named like a target
    (:data:`~initlab._core.data.TARGET_KEYS`: ``labels=batch[1]`` is teacher forcing, its
    target the labels; ``mask=batch[1]`` is not, the loss would score against the mask). A part
    of it (``batch[1][:, :-1]``, a shifted decoder input) is not flagged. Dict batches are not
    checked (the target is read by its key).

    Raises:
        TargetError: ``forward`` gave ``batch[1]`` to the model; the message gives the ways
            out (:data:`TARGET_WAYS`), and for a 2-entry batch says that no target is left.
    """
    if not _reads_target(loss):
        return forward
    done = False  # one batch passed is enough: the same forward runs on every batch

    def checked(model: nn.Module, batch: Any) -> Any:
        nonlocal done
        y = None if done else _lone_target(batch)
        if y is None or not isinstance(model, nn.Module):
            return forward(model, batch)
        given: list[bool] = []

        def see(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            named = [v for k, v in kwargs.items() if k not in TARGET_KEYS]
            given.append(any(_is_target(a, y) for _, a in flatten_tensors((args, named))))

        handle = model.register_forward_pre_hook(see, with_kwargs=True)
        try:
            out = forward(model, batch)
        finally:
            handle.remove()
        if any(given):  # raised on every call (a caller may catch the first)
            raise TargetError(_target_given(what, loss, y, len(batch)))
        done = True
        return out

    return checked


def _reads_target(loss: Loss) -> bool:
    """Whether ``loss`` reads its target at ``batch[1]`` (:func:`~initlab._core.data.
    find_target`): a criterion, or a named loss that takes targets."""
    return loss.form == "criterion" or (loss.form == "named" and loss.name != "random_quadratic")


def _target_given(what: str, loss: Loss, y: torch.Tensor, entries: int) -> str:
    """The message of :func:`target_kept`'s error."""
    name = (
        "the default loss (cross-entropy for integer targets, MSE for float ones)"
        if loss.name == "auto"
        else f"the loss {loss.name!r}"
    )
    head = f"{what}: forward= passes batch[1] to the model as an input, and {name} reads the "
    scored = f"it would score the output against an input of shape {tuple(y.shape)}"
    teacher = (
        "If batch[1] is the target and an input too (teacher forcing), pass it by a target's "
        "keyword (model(batch[0], labels=batch[1])) or pass, without forward=, a "
        "loss_fn(model, batch) that calls the model"
    )
    if entries == 2:
        return (
            f"{head}target at batch[1], and this batch has 2 entries: no target is left ({scored})."
            " Give the batches their targets, (x, y, z) with forward=lambda model, batch: "
            "model(batch[0], *batch[2:]); or, for data without targets, pass a loss that reads "
            f"none (initlab.outputs_loss(fn), 'random_quadratic'). {teacher}"
        )
    return f"{head}target of an (x, y, ...) batch at batch[1]: {scored}. {TARGET_WAYS}. {teacher}"


def _is_target(a: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether the model's input ``a`` is the target ``y``: ``y`` itself, a view of it of its
    shape, or (``y`` not constant) of its shape with its values once converted to ``a``'s dtype
    and device."""
    if a is y:
        return True
    if a.shape != y.shape:
        return False
    try:
        if a.device == y.device and a.data_ptr() == y.data_ptr() and a.stride() == y.stride():
            return True
        return not _constant(y) and bool(torch.equal(a, y.to(a.device, a.dtype)))
    except RuntimeError:  # no storage to read (a meta tensor, a transform's)
        return False


def _constant(t: torch.Tensor) -> bool:
    return t.numel() < 2 or bool((t == t.reshape(-1)[0]).all())


def _lone_target(batch: Any) -> torch.Tensor | None:
    """``batch[1]`` of a tuple or list batch of 2+ entries, where it is a tensor no other entry
    is or equals (``(ids, ids, mask)``, ``(ids, ids.clone())``: the input is the target too);
    else ``None``."""
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        return None
    y = batch[1]
    if not isinstance(y, torch.Tensor) or any(
        isinstance(b, torch.Tensor) and _is_target(b, y) for i, b in enumerate(batch) if i != 1
    ):
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
    out.forward = target_kept(forward, base, what)  # type: ignore[attr-defined]
    return out
