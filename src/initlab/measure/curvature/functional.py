r"""Calling a model functionally (never mutating it), and resolving losses.

:func:`model_state` (detached parameters, cloned buffers; BatchNorm layers in train mode normalize
with the batch statistics and update no running statistics) and :func:`functional_forward` call a
model through ``torch.func.functional_call``; :func:`resolve_loss` turns a callable, a
``NamedLoss`` or a loss name into ``loss_fn(outputs, batch)``; :func:`quadratic_loss` is the random
quadratic loss of Defazio & Bottou's Figure 2.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from initlab._core.data import default_forward
from initlab._core.loss import NamedLoss, make_loss

__all__ = [
    "Forward",
    "LossFn",
    "functional_forward",
    "model_state",
    "quadratic_loss",
    "resolve_loss",
]

LossFn = Callable[[Any, Any], torch.Tensor] | str
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


def model_state(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Detached parameters and cloned buffers for a functional call that cannot mutate ``model``.

    BatchNorm layers in train mode get ``running_mean = running_var = None``: they normalize with
    the batch statistics (as they would) and update nothing.
    """
    state: dict[str, torch.Tensor | None] = {
        n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)
    }
    for n, b in model.named_buffers(remove_duplicate=False):
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
) -> Any:
    """``forward(model, batch)`` with the model's tensors replaced by ``state`` (not mutated)."""
    if forward is None or forward is default_forward:  # the common case, without a wrapper
        if isinstance(batch, torch.Tensor):
            return torch.func.functional_call(model, state, (batch,))
        if isinstance(batch, Mapping):
            return torch.func.functional_call(model, state, (), dict(batch))
        return torch.func.functional_call(model, state, (batch[0],))
    wrapper = _Call(model, forward)
    return torch.func.functional_call(
        wrapper, {f"model.{k}": v for k, v in state.items()}, (batch,)
    )


def resolve_loss(loss_fn: LossFn) -> Callable[[Any, Any], torch.Tensor]:
    """``loss_fn(outputs, batch) -> scalar`` from a callable, a ``NamedLoss``
    (its ``outputs_loss``) or a name :func:`initlab._core.loss.make_loss` knows (``"auto"``,
    ``"cross_entropy"``, ``"mse"``, ``"random_quadratic"``; targets ``batch[1]``)."""
    if isinstance(loss_fn, str):
        return make_loss(loss_fn).outputs_loss
    if isinstance(loss_fn, NamedLoss):
        return loss_fn.outputs_loss
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a callable or a name, got {type(loss_fn).__name__}")
    return loss_fn


def quadratic_loss(R: torch.Tensor) -> Callable[[Any, Any], torch.Tensor]:
    r"""The random quadratic loss of Defazio & Bottou's Figure 2, ``ℓ = (1/B) Σ_b y_bᵀ R_b y_b``.

    ``R`` is ``k × k`` (one matrix shared by all examples, ``R_b = R``) or ``B × k × k`` (one
    matrix per example). The Hessian with respect to ``y_b`` is ``(R_b + R_bᵀ) / B``. Returns a
    ``loss_fn(outputs, batch)`` for outputs of shape ``(B, k)``.
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

    return loss
