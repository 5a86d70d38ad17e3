"""The model's outputs for :func:`~initlab.diagnostics.doctor.doctor`'s output checks.

:func:`output_pass` runs one no-grad forward of every batch and returns what the initial-loss and
logit-std checks read: the logits' std, the targets' kind (classification or regression), the
number of classes. The forward is the one the caller gives, else, for a ``loss_fn(model, batch)``
(which calls the model its own way, e.g. ``model(a, b)``), the model's first call inside the loss
(:func:`loss_forward`), else the default forward (:func:`~initlab._core.data.default_forward`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from initlab._core.data import default_forward, find_target, output_tensor
from initlab._core.hooks import hook_handles
from initlab._core.loss import Loss, classes_dim, model_loss
from initlab._core.state import preserved_state

Forward = Callable[[nn.Module, Any], Any]

_CE_NAMES = ("auto", "model", "cross_entropy")


class NoOutputs(TypeError):
    """The model's outputs could not be read through the loss (it never calls the model)."""


def loss_forward(loss: Loss) -> Forward:
    """``forward(model, batch)``: the output of the model's first call inside ``loss(model,
    batch)`` (a forward hook on the model, removed afterwards).

    Raises:
        NoOutputs: the loss never called the model as a whole (e.g. only its submodules).
    """

    def forward(model: nn.Module, batch: Any) -> Any:
        seen: list[Any] = []

        def keep(_module: nn.Module, _args: Any, output: Any) -> None:
            if not seen:
                seen.append(output)

        with hook_handles() as handles:
            handles.add(model.register_forward_hook(keep))
            loss(model, batch)
        if not seen:
            raise NoOutputs(
                f"the loss {loss.name!r} does not call the model itself, so its outputs cannot "
                "be read; pass doctor(..., forward=lambda model, batch: ...) returning the "
                "model's outputs on a batch"
            )
        return seen[0]

    return forward


def fixes_forward(loss: Loss, forward: Forward | None) -> Forward | None:
    """The forward the fixes (``lsuv_``, ``scale_output_``) and the output pass use: ``forward``
    when given, else the model's call inside a ``loss_fn(model, batch)``, else ``None`` (the
    default forward)."""
    if forward is not None:
        return forward
    return loss_forward(loss) if loss.form == "model_batch" else None


def _target(batch: Any) -> torch.Tensor | None:
    found = find_target(batch)
    return found[1] if found is not None and isinstance(found[1], torch.Tensor) else None


def _class_count(logits: torch.Tensor, y: torch.Tensor, batch: Any) -> int:
    """``C``: dim 1 of dense ``(B, C, *S)`` logits with ``(B, *S)`` targets, else the last dim
    (:func:`~initlab._core.loss.classes_dim`)."""
    if logits.dim() < 1:
        return 0
    return int(logits.shape[classes_dim(logits, y, batch, warn=False)])


def output_pass(
    model: nn.Module, batches: list[Any], loss: Loss, forward: Forward | None = None
) -> dict[str, Any]:
    """One no-grad forward of every batch (state kept): the logits' std and the targets.

    ``forward``: as :func:`fixes_forward` returns it. Where the loss gives no outputs to read
    (:class:`NoOutputs`), ``logit_std`` is NaN and ``missing`` says why (the checks on the
    outputs are then ``n/a``); any other error is raised.
    """
    run = forward or default_forward
    s1 = s2 = n = 0.0
    targets: list[torch.Tensor] = []
    out: dict[str, Any] = {"own_loss": False, "classes": 0, "finite_outputs": [], "missing": ""}
    with preserved_state(model), torch.no_grad():
        for batch in batches:
            try:
                raw = run(model, batch)
            except NoOutputs as err:
                out["missing"] = str(err)
                break
            logits = output_tensor(raw).detach()
            out["finite_outputs"].append(bool(logits.isfinite().all()))
            s1 += float(logits.sum(dtype=torch.float64))  # float64 sums, no float64 copy
            s2 += float(torch.linalg.vector_norm(logits, dtype=torch.float64)) ** 2
            n += logits.numel()
            out["own_loss"] = out["own_loss"] or model_loss(raw) is not None
            y = _target(batch)
            if y is not None:
                targets.append(y.detach())
                out["classes"] = _class_count(logits, y, batch)
    if out["missing"]:
        targets, out["classes"], out["finite_outputs"], n = [], 0, [], 0.0
    out["logit_std"] = math.sqrt(max(s2 / n - (s1 / n) ** 2, 0.0)) if n > 1 else math.nan
    problem = getattr(getattr(model, "config", None), "problem_type", None)
    out["kind"] = _loss_kind(loss, targets, out["classes"], out["own_loss"], problem)
    if out["kind"] == "regression":
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in targets])
        out["target_sq"], out["target_std"] = float(flat.square().mean()), float(flat.std())
    return out


def _loss_kind(
    loss: Loss, targets: list[torch.Tensor], classes: int, own_loss: bool, problem: Any
) -> str:
    """``"classification"`` (cross-entropy on integer targets), ``"regression"`` (MSE on float
    targets) or ``""`` (no reference). The default loss on float targets is MSE unless the model
    returns its own loss, whose kind float targets do not tell (a multi-label head's is binary
    cross-entropy): then only a Hugging Face ``config.problem_type == "regression"`` says MSE."""
    if not targets:
        return ""
    name = loss.name.lower()
    if all(not t.is_floating_point() for t in targets):
        ce = name in _CE_NAMES or "cross" in name
        return "classification" if ce and classes > 1 else ""
    if own_loss and loss.form in ("auto", "model_output"):
        mse = problem == "regression"
    else:
        mse = name in ("auto", "mse") or "mse" in name
    return "regression" if mse and all(t.is_floating_point() for t in targets) else ""
