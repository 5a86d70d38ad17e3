"""The model's outputs for :func:`~initlab.diagnostics.doctor.doctor`'s output checks.

:func:`output_pass` runs one no-grad forward of every batch and returns what the initial-loss and
logit-std checks read: the logits' std, the targets' kind (classification or regression), the
number of classes. The forward is the one the caller gives, else, for a ``loss_fn(model, batch)``
(which calls the model its own way, e.g. ``model(a, b)``), the model's first call inside the loss
(:func:`loss_forward`), else the default forward (:func:`~initlab._core.data.default_forward`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from initlab._core.data import (
    default_forward,
    find_target,
    masks_positions,
    output_tensor,
    real_positions,
)
from initlab._core.hooks import hook_handles
from initlab._core.loss import Loss, NamedLoss, classes_dim, model_loss
from initlab._core.rng import peeked
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
    when given, else the model's call inside a ``loss_fn(model, batch)``, else the loss's own
    forward for a loss on the outputs (a criterion, a named loss: a Hugging Face model runs
    without the batch's labels, :func:`~initlab._core.loss.model_inputs`, as in every other entry
    point), else ``None`` (the default forward: the model's own loss reads the labels)."""
    if forward is not None:
        return forward
    if loss.form == "model_batch":
        return loss_forward(loss)
    return loss.forward if isinstance(loss, NamedLoss) else None


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
    """One no-grad forward of every batch (state kept): the logits' std (over the real tokens
    of a batch with an ``attention_mask``, as ``scale_output_`` and the loss read them) and the
    targets.

    ``forward``: as :func:`fixes_forward` returns it. Where the loss gives no outputs to read
    (:class:`NoOutputs`), ``logit_std`` is NaN and ``missing`` says why (the checks on the
    outputs are then ``n/a``); any other error is raised.
    """
    run = forward or default_forward
    s1 = s2 = n = 0.0
    targets: list[torch.Tensor] = []
    out: dict[str, Any] = {"own_loss": False, "classes": 0, "missing": ""}
    own_ce = True  # every own loss seen is the cross-entropy of the logits on the labels
    with preserved_state(model), torch.no_grad():
        for batch in batches:
            try:
                raw = run(model, batch)
            except NoOutputs as err:
                out["missing"] = str(err)
                break
            logits = output_tensor(raw).detach()
            if logits.dim() == 0:  # one number per batch: the model returned its loss
                out["missing"] = "the model's output is a scalar (its loss): it returns no logits"
                break
            # padded positions left out, as the loss does (an encoder-decoder's: counted)
            real = real_positions(logits, batch) if masks_positions(model) else logits
            s1 += float(real.sum(dtype=torch.float64))  # float64 sums, no float64 copy
            s2 += float(torch.linalg.vector_norm(real, dtype=torch.float64)) ** 2
            n += real.numel()
            own = model_loss(raw)
            out["own_loss"] = out["own_loss"] or own is not None
            y = _target(batch)
            if y is not None:
                targets.append(y.detach())
                out["classes"] = _class_count(logits, y, batch)
                own_ce = own_ce and (own is None or _is_cross_entropy(own, logits, y))
    if out["missing"]:
        targets, out["classes"], n = [], 0, 0.0
    out["logit_std"] = math.sqrt(max(s2 / n - (s1 / n) ** 2, 0.0)) if n > 1 else math.nan
    problem = getattr(getattr(model, "config", None), "problem_type", None)
    own_ce = own_ce or loss.form not in ("auto", "model_output")  # the loss is not the model's
    out["kind"] = _loss_kind(loss, targets, out["classes"], out["own_loss"] and not own_ce, problem)
    out["own_other"] = bool(targets) and out["own_loss"] and not own_ce
    if out["kind"] == "regression":
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in targets])
        out["target_sq"], out["target_std"] = float(flat.square().mean()), float(flat.std())
    return out


def _is_cross_entropy(own: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether the model's own loss ``own`` is the mean cross-entropy (ignore index -100) of its
    ``logits`` on the integer labels ``y``: classes last, position by position or shifted by one
    (a causal language model's), or classes in dim 1 (dense ``(B, C, *S)`` logits); within 1%.
    A loss of another kind (a CTC loss, a sequence NLL summed over a batch) is not, so the
    ``ln C`` reference does not apply to it."""
    if y.is_floating_point() or own.numel() != 1 or logits.dim() < 2:
        return False
    value = float(own.detach().to(torch.float64))
    pairs = [(logits.flatten(0, -2), y.flatten())] if logits.shape[:-1] == y.shape else []
    if logits.dim() >= 3 and y.dim() >= 2 and logits.shape[:-1] == y.shape:
        pairs.append((logits[:, :-1].flatten(0, -2), y[:, 1:].flatten()))
    if logits.shape[:1] + logits.shape[2:] == y.shape and logits.dim() >= 3:
        pairs.append((logits, y))
    for lg, t in pairs:
        if not bool((t != -100).any()):
            continue
        ce = float(F.cross_entropy(lg.to(torch.float64), t.long(), ignore_index=-100))
        if math.isclose(ce, value, rel_tol=1e-2, abs_tol=1e-6):
            return True
    return False


def _loss_kind(
    loss: Loss, targets: list[torch.Tensor], classes: int, own_loss: bool, problem: Any
) -> str:
    """``"classification"`` (cross-entropy on integer targets), ``"regression"`` (MSE on float
    targets) or ``""`` (no reference). The default loss on float targets is MSE unless the model
    returns its own loss, whose kind float targets do not tell (a multi-label head's is binary
    cross-entropy): then only a Hugging Face ``config.problem_type == "regression"`` says MSE.
    ``own_loss``: the model returns a loss that is not a cross-entropy of its logits on
    the labels (:func:`_is_cross_entropy`); on integer targets that has no reference either."""
    if not targets:
        return ""
    name = loss.name.lower()
    if all(not t.is_floating_point() for t in targets):
        ce = (name in _CE_NAMES or "cross" in name) and not own_loss
        return "classification" if ce and classes > 1 else ""
    if own_loss and loss.form in ("auto", "model_output"):
        mse = problem == "regression"
    else:
        mse = name in ("auto", "mse") or "mse" in name
    return "regression" if mse and all(t.is_floating_point() for t in targets) else ""


def init_logit_std(
    model: nn.Module,
    batches: list[Any],
    loss: Loss,
    forward: Forward | None,
    generator: torch.Generator | None,
) -> tuple[float, str]:
    """The logits' std right after ``doctor``'s ``"init"`` fix (``init_model(model,
    "geometric")``), measured on the model and put back (parameters, buffers, RNGs; the
    generator peeked at, so the fix's own draws stay as they were), and ``""``; or NaN and the
    first line of the error where the init or the pass after it raises. Costs one copy of the
    state and one no-grad pass over the batches."""
    from initlab.init.model import init_model

    try:
        with preserved_state(model), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fix's own warnings are caught when it runs
            init_model(model, "geometric", generator=peeked(generator))
            return float(output_pass(model, batches, loss, forward)["logit_std"]), ""
    except (ValueError, TypeError, RuntimeError) as err:
        return math.nan, f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:160]}"


def unchanged(model: nn.Module, kept: list[torch.Tensor]) -> bool:
    """Whether the model's state is bit for bit ``kept`` (its ``state_dict`` values before)."""
    now = list(model.state_dict().values())
    return len(now) == len(kept) and all(
        a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
        for a, b in zip(now, kept, strict=True)
    )
