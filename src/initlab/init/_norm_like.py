"""Normalization layers of other libraries, recognized by what they do.

Hugging Face models define their own normalization classes, one per model family
(``LlamaRMSNorm``, ``MistralRMSNorm``, ``Qwen2RMSNorm``, ``T5LayerNorm``, ``GemmaRMSNorm``...),
which no registry keyed by class can list. A module is taken for one when its class name says
``Norm``, it has no submodules and no buffers, and its only direct parameters are a 1-D ``weight``
and, optionally, a ``bias`` of the same shape. Two forwards on a fixed input with the bias at 0
and the weight at 0, then at 1, tell how the weight scales the output:

* ``out(w=0) == 0`` and ``out(w=1) != 0``: the output is ``w * n(x)`` (Llama, Mistral, Qwen, T5):
  the scale is the identity at ``w = 1``;
* ``out(w=1) == 2 * out(w=0) != 0``: the output is ``(1 + w) * n(x)`` (Gemma): the identity is at
  ``w = 0``, and a weight filled with ones would double every output.

A gated norm, ``forward(x, gate)`` (Qwen3-Next's, Mamba-2's ``RMSNormGated``), gets a gate of ones:
its output stays linear in ``w`` (or ``1 + w``). Anything else is not recognized, and its
parameters stay unclaimed. The forwards run without the
module's hooks, without autocast or a graph, on tensors swapped in for the weight and bias (the
module's own are put back, never written: their autograd versions do not change).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from initlab._core.autocast import autocast_off

__all__ = ["is_norm_like", "norm_identity"]


def is_norm_like(module: nn.Module) -> bool:
    """The structure of a normalization layer (see the module docstring); says nothing of what
    its weight does (:func:`norm_identity` does)."""
    if "norm" not in type(module).__name__.lower():
        return False
    params = dict(module.named_parameters(recurse=False))
    weight, bias = params.get("weight"), params.get("bias")
    if weight is None or set(params) - {"weight", "bias"} or weight.dim() != 1:
        return False
    if bias is not None and bias.shape != weight.shape:
        return False
    return next(module.children(), None) is None and next(module.buffers(False), None) is None


def norm_identity(module: nn.Module) -> float | None:
    """The value of ``weight`` at which a normalization layer's scale is the identity: ``1.0``
    for ``w * n(x)``, ``0.0`` for ``(1 + w) * n(x)``; ``None`` when ``module`` is not
    :func:`is_norm_like`, its weight is not materialized, or its forward shows neither."""
    if not is_norm_like(module):
        return None
    weight, bias = module.weight, module._parameters.get("bias")
    if weight.is_meta or not weight.dtype.is_floating_point:
        return None
    shape = (2, 3, weight.shape[0])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen, dtype=torch.float64, device="cpu")
    x = x.to(weight.device, weight.dtype)
    inputs = [x] + [torch.ones_like(x)] * (_required_inputs(module) - 1)  # a gate: ones
    kept = dict(module._parameters)  # swapped, not written: the user's tensors stay untouched
    try:
        with torch.no_grad(), autocast_off():
            if bias is not None:
                module._parameters["bias"] = torch.zeros_like(bias)
            module._parameters["weight"] = torch.zeros_like(weight)
            at_zero = module.forward(*inputs)
            module._parameters["weight"] = torch.ones_like(weight)
            at_one = module.forward(*inputs)
    except Exception:  # a forward that takes something else: not recognized
        return None
    finally:
        module._parameters.update(kept)
    return _identity_from(at_zero, at_one, shape)


def _required_inputs(module: nn.Module) -> int:
    """How many positional arguments ``module.forward`` requires (at least 1): a gated norm
    (``forward(x, gate)``, Qwen3-Next's and Mamba-2's ``RMSNormGated``) takes a second."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return 1
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return max(1, sum(p.kind in kinds and p.default is inspect.Parameter.empty for p in params))


def _identity_from(at_zero: object, at_one: object, shape: tuple[int, ...]) -> float | None:
    if not all(isinstance(t, torch.Tensor) and t.shape == shape for t in (at_zero, at_one)):
        return None
    zero, one = at_zero.double(), at_one.double()  # type: ignore[union-attr]
    scale = float(one.abs().max())
    if not (torch.isfinite(zero).all() and torch.isfinite(one).all()) or scale == 0.0:
        return None
    rtol = 16 * torch.finfo(at_one.dtype).eps  # type: ignore[union-attr]
    if float(zero.abs().max()) <= rtol * scale:
        return 1.0
    if float((one - 2 * zero).abs().max()) <= rtol * scale:
        return 0.0
    return None
