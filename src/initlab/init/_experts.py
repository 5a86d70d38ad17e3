"""Mixture-of-experts layers: a bank of expert MLPs stored as 3-D tensors, and its router.

Hugging Face's MoE models (Mixtral, Qwen2/3-MoE, DeepSeek, GPT-OSS, OLMoE, ... in transformers
5) keep their experts in one module with ``gate_up_proj`` (or ``up_proj`` alone, or ``gate_proj``
and ``up_proj``) and ``down_proj`` of shape ``(E, out, in)``, or ``(E, in, out)`` where the module
says ``is_transposed = True``, and optional ``<name>_bias`` of shape ``(E, out)``. Each of the
``E`` slices is one expert's matrix: :func:`~initlab.init.model.init_model` draws it as its own
weight, with the fans of one expert (a fan-in draw of the whole ``(E, 2I, H)`` tensor as a
convolution would take ``2I * H`` for its fan-in). ``gate_up_proj`` holds the gate and its input
one after the other (``is_concatenated``, the default) or interleaved row by row (GPT-OSS): either
way cut into two blocks, contiguous or of every second row (``Block.step``), the input
:attr:`~initlab.init.specs.Block.gated` (gain 1 where the gate gets its activation's).

A module is read as a bank of experts only where its layout is declared: an ``is_transposed``
attribute (set by transformers' ``use_experts_implementation``; Llama 4's, read from its code,
in ``_UNDECLARED``), a ``down_proj`` and, for every
weight, ``E`` slices of matching shapes (``down_proj``'s input is the gate's output), and no
other parameter. A router is a module whose class name holds ``Router`` with a ``weight`` of
shape ``(num_experts, hidden)`` (and optionally a ``bias`` of ``num_experts``): a linear map from
the hidden state to one logit per expert.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["ExpertLayout", "expert_layout", "inline_activation", "router_experts"]

_WEIGHTS = ("gate_up_proj", "gate_proj", "up_proj", "down_proj")
#: Banks that do not declare their layout, read from their model's code: class name ->
#: ``is_transposed`` (Llama 4's text experts multiply ``x @ W`` with ``torch.bmm``; gate first).
_UNDECLARED = {"Llama4TextExperts": True}
_ACTIVATED = ("gate_up_proj", "gate_proj")  # what feeds the activation (else ``up_proj``)


@dataclass(frozen=True)
class ExpertLayout:
    """How a bank of experts stores its matrices.

    Attributes:
        transposed: each slice is ``(in, out)`` rather than ``(out, in)``.
        concatenated: ``gate_up_proj`` is ``[gate; up]`` (``False``: interleaved rows).
        weights: the 3-D weights, in the order above.
        biases: their biases (``<weight>_bias``, ``(E, out)``).
    """

    transposed: bool
    concatenated: bool
    weights: tuple[str, ...]
    biases: tuple[str, ...]

    def matrix(self, param: Tensor) -> tuple[int, int]:
        """``(out, in)`` of one expert's slice of ``param``."""
        a, b = (int(d) for d in param.shape[1:])
        return (b, a) if self.transposed else (a, b)

    def activated(self) -> str:
        """The weight whose output goes through the activation."""
        return next((w for w in _ACTIVATED if w in self.weights), "up_proj")


def expert_layout(module: nn.Module) -> ExpertLayout | None:
    """The declared layout of a bank of experts (see the module docstring), or ``None``."""
    transposed = getattr(module, "is_transposed", _UNDECLARED.get(type(module).__name__))
    if not isinstance(transposed, bool):
        return None
    params = {n: p for n, p in module._parameters.items() if p is not None}
    weights = tuple(n for n in _WEIGHTS if n in params and params[n].dim() == 3)
    if "down_proj" not in weights or len(weights) < 2:
        return None
    experts = int(params[weights[0]].shape[0])
    declared = getattr(module, "num_experts", experts)
    if declared != experts or any(params[w].shape[0] != experts for w in weights):
        return None
    biases = tuple(f"{w}_bias" for w in weights if f"{w}_bias" in params)
    if set(params) != set(weights) | set(biases):
        return None  # a parameter of its own this reading does not know
    layout = ExpertLayout(transposed, _concatenated(module), weights, biases)
    down_out, down_in = layout.matrix(params["down_proj"])
    for w in weights[:-1]:
        out, inp = layout.matrix(params[w])
        if inp != down_out or out not in (down_in, 2 * down_in):
            return None
        if out == 2 * down_in and w != "gate_up_proj":
            return None
    for b in biases:
        out = layout.matrix(params[b[: -len("_bias")]])[0]
        if tuple(params[b].shape) != (experts, out):
            return None
    return layout


def _concatenated(module: nn.Module) -> bool:
    """``is_concatenated`` as the module declares it (``True`` where it does not)."""
    return getattr(module, "is_concatenated", True) is not False


def router_experts(module: nn.Module) -> int | None:
    """The number of experts a router chooses from (see the module docstring), or ``None``."""
    if "router" not in type(module).__name__.lower():
        return None
    weight = module._parameters.get("weight")
    experts = getattr(module, "num_experts", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2 or not isinstance(experts, int):
        return None
    return experts if weight.shape[0] == experts else None


def inline_activation(module: nn.Module) -> tuple[Callable[[Tensor], Tensor], str] | None:
    """The gate's activation of a bank of experts that writes it in its forward (no ``act_fn``),
    read from its model's code, as a function for :func:`~initlab.init.gains.calculate_gain` with
    a description; ``None`` where none is known. GPT-OSS: ``g * sigmoid(alpha * g)`` of the gate
    clamped at ``limit`` (its input half enters as ``1 + up``, clamped: the product's second
    moment is that of the gate's activation times ``1 + Var(up)``, which no gain of ``up`` can
    bring to one)."""
    if type(module).__name__ != "GptOssExperts":
        return None
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    if not isinstance(alpha, int | float) or not isinstance(limit, int | float):
        return None
    text = (f"g * sigmoid({alpha:g} g), g clamped at {limit:g}: GPT-OSS's experts' activation "
            "(in their forward)")  # fmt: skip
    return _clamped_swish(float(alpha), float(limit)), text


@functools.cache
def _clamped_swish(alpha: float, limit: float) -> Callable[[Tensor], Tensor]:
    """``g * sigmoid(alpha * g)`` with ``g = min(z, limit)``, one function per ``(alpha,
    limit)`` (:func:`~initlab.init.gains.calculate_gain` caches by the function)."""

    def act(z: Tensor) -> Tensor:
        g = z.clamp(max=limit)
        return g * torch.sigmoid(alpha * g)

    return act
