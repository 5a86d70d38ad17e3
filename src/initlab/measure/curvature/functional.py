r"""Calling a model functionally (never mutating it), and resolving losses.

:func:`model_state` (detached parameters, cloned buffers; BatchNorm layers in train mode normalize
with the batch statistics and update no running statistics) and :func:`functional_forward` call a
model through ``torch.func.functional_call``; :func:`split_loss` splits a resolved loss
(:func:`initlab._core.loss.resolve_loss`, re-exported here) at the model's outputs;
:func:`quadratic_loss` is the random quadratic loss of Defazio & Bottou's Figure 2.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from initlab._core.data import default_forward, forward_args, keyword_error
from initlab._core.dtypes import data_error
from initlab._core.forward_loss import on_batches, target_kept
from initlab._core.functional import functional_call
from initlab._core.loss import (
    Loss,
    LossLike,
    NamedLoss,
    model_inputs,
    outputs_loss,
    resolve_loss,
)
from initlab._core.norms import may_float16, may_weight_norm, second_order_norms

__all__ = [
    "Forward",
    "LossFn",
    "canonical_names",
    "functional_forward",
    "model_state",
    "on_batches",
    "quadratic_loss",
    "resolve_loss",
    "split_loss",
    "tie_note",
    "tied_aliases",
]

LossFn = LossLike
"""Any loss :func:`initlab._core.loss.resolve_loss` accepts."""
Forward = Callable[[nn.Module, Any], Any]


class _Call(nn.Module):
    """``forward(model, batch)`` as a module, so ``functional_call`` can reparametrize it."""

    def __init__(self, model: nn.Module, forward: Forward) -> None:
        super().__init__()
        self.model = model
        self._fwd = forward

    def forward(self, batch: Any) -> Any:
        return self._fwd(self.model, batch)


def _batchnorms(model: nn.Module) -> list[tuple[str, nn.modules.batchnorm._BatchNorm]]:
    return [
        (n, m) for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
    ]


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Every name of every parameter (tied aliases included) → the tensor's first name in
    ``model.named_parameters()`` (the name every result lists it under)."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        out[n] = first.setdefault(id(p), n)
    return out


def tied_aliases(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """First name → the other names of the same tensor, for the tied parameters only
    (an embedding shared with the output head: ``{"emb.weight": ("head.weight",)}``)."""
    out: dict[str, list[str]] = {}
    for n, first in canonical_names(model).items():
        if n != first:
            out.setdefault(first, []).append(n)
    return {k: tuple(v) for k, v in out.items()}


def tie_note(name: str, aliases: tuple[str, ...]) -> str:
    """The note a result row of a tied tensor carries."""
    return (
        f"{name} is tied to {', '.join(aliases)}: one tensor, listed once under its first name; "
        "its gradient and curvature sum over every use"
    )


def model_state(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Detached parameters and cloned buffers for a functional call that cannot mutate ``model``.

    BatchNorm layers in train mode get ``running_mean = running_var = None``: they normalize with
    the batch statistics (as they would) and update nothing. A tensor tied under several names
    (a head sharing the embedding's weight) appears once, under its first name;
    ``functional_call`` ties the others to it.
    """
    state: dict[str, torch.Tensor | None] = {n: p.detach() for n, p in model.named_parameters()}
    for n, b in model.named_buffers():
        state[n] = b.clone()
    for name, bn in _batchnorms(model):
        if bn.training:
            prefix = f"{name}." if name else ""
            for buf in ("running_mean", "running_var"):
                if f"{prefix}{buf}" in state:
                    state[f"{prefix}{buf}"] = None
    return state


def functional_forward(
    model: nn.Module,
    state: Mapping[str, torch.Tensor | None],
    batch: Any,
    forward: Forward | None = None,
    weight_norm: bool | None = None,
    float16: bool | None = None,
) -> Any:
    """``forward(model, batch)`` with the model's tensors replaced by ``state`` (not mutated),
    twice differentiable where torch's kernels are not (:mod:`initlab._core.norms`):
    ``torch._weight_norm`` as elementary operations (its native second derivative is wrong), and
    in a float16 model the normalizations of float16 inputs on float32 statistics (their native
    double backwards overflow float16: NaN Hessian products). ``weight_norm``: whether the model
    can reach ``torch._weight_norm`` (:func:`~initlab._core.norms.may_weight_norm`, a walk of the
    model), ``float16``: whether it holds float16 tensors
    (:func:`~initlab._core.norms.may_float16`), for callers that run many passes and find them
    once; ``None``: found here."""
    routing = second_order_norms(
        weight_norm=may_weight_norm(model) if weight_norm is None else weight_norm,
        float16=may_float16(model) if float16 is None else float16,
    )
    with routing:
        return _functional_forward(model, state, batch, forward)


def _functional_forward(
    model: nn.Module,
    state: Mapping[str, torch.Tensor | None],
    batch: Any,
    forward: Forward | None,
) -> Any:
    if forward is None or forward in (default_forward, NamedLoss.forward):  # without a wrapper
        if forward is NamedLoss.forward:
            batch = model_inputs(model, batch)
        args, kwargs = forward_args(batch)  # the default forward's call: model(batch) for an object
        try:
            return functional_call(model, state, args, kwargs)
        except TypeError as err:  # the same messages as the default forward's
            clear = keyword_error(err, batch, "the default forward")
            if clear is None:
                raise
            raise clear from err
        except RuntimeError as err:
            clear = data_error(err, model, batch)
            if clear is None:
                raise
            raise clear from err
    wrapper = _Call(model, forward)
    return functional_call(wrapper, {f"model.{k}": v for k, v in state.items()}, (batch,))


def split_loss(
    loss: Loss, forward: Forward | None, *, what: str
) -> tuple[Forward, Callable[[Any, Any], torch.Tensor]]:
    """``(fwd, on_outputs)`` with ``loss(model, batch) == on_outputs(fwd(model, batch), batch)``.

    A loss on the model's outputs (``loss.splittable``: a criterion, a named loss,
    :func:`~initlab._core.loss.outputs_loss`) splits at the outputs, with ``forward`` (default the
    loss's own forward, :func:`~initlab._core.data.default_forward`), a ``forward`` checked not to
    pass the target ``batch[1]`` to the model (:func:`~initlab._core.forward_loss.target_kept`).
    Any other loss (``loss_fn(model, batch)``, the model's own loss) is its own "forward" and
    ``on_outputs`` is the identity: exact for loss values and the Hessian, not for the
    Gauss-Newton matrix.

    Raises:
        ValueError: ``forward`` given with a loss that runs the model itself.
    """
    if loss.splittable:
        if forward is None:
            return loss.forward, loss.on_outputs  # type: ignore[attr-defined]
        return target_kept(forward, loss, what), loss.on_outputs  # type: ignore[attr-defined]
    if forward is not None:
        raise ValueError(
            f"{what}: forward= applies to a loss on the model's outputs; the loss {loss.name!r} "
            "runs the model itself (loss_fn(model, batch)). Pass a criterion, a named loss or "
            "initlab.outputs_loss(fn) with forward=, or drop forward="
        )

    def whole(model: nn.Module, batch: Any) -> torch.Tensor:
        return loss(model, batch)

    return whole, _identity


def _identity(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return out


def quadratic_loss(R: torch.Tensor) -> Loss:
    r"""The random quadratic loss of Defazio & Bottou's Figure 2, ``ℓ = (1/B) Σ_b y_bᵀ R_b y_b``.

    ``R`` is ``k × k`` (one matrix shared by all examples, ``R_b = R``) or ``B × k × k`` (one
    matrix per example). The Hessian with respect to ``y_b`` is ``(R_b + R_bᵀ) / B``. Returns a
    loss on the outputs (:func:`initlab._core.loss.outputs_loss`) for outputs of shape ``(B, k)``;
    ``.on_outputs(outputs, batch)`` evaluates it on given outputs.
    """
    if R.dim() not in (2, 3) or R.shape[-1] != R.shape[-2]:
        raise ValueError(f"R must be k x k or B x k x k, got shape {tuple(R.shape)}")

    def loss(outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        y = outputs.reshape(outputs.shape[0], -1)
        if R.dim() == 2:
            return torch.einsum("bi,ij,bj->", y, R.to(y), y) / y.shape[0]
        if R.shape[0] != y.shape[0]:
            raise ValueError(f"R holds {R.shape[0]} matrices for a batch of {y.shape[0]}")
        return torch.einsum("bi,bij,bj->", y, R.to(y), y) / y.shape[0]

    return outputs_loss(loss, "quadratic")
