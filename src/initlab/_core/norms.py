"""Normalization that differentiates as often as a method needs, selected inside those methods.

PyTorch's native ``batch_norm`` (batch statistics), ``layer_norm`` and ``instance_norm`` kernels
have a double backward written with the saved mean and inverse standard deviation as constants:
their Hessians are right, but a third derivative through them is silently wrong
(``torch.autograd.gradcheck`` of a Hessian-vector product fails for them, passes for
``group_norm``, ``rms_norm`` and the same functions written with elementary operations; torch 2.4
to 2.13). MetaInit's meta-gradient differentiates a Hessian-vector product, so through a native
BatchNorm it pointed the wrong way (a weight's derivative -2.64 where finite differences give
+3.38). ``torch._weight_norm`` (``weight_norm`` parametrizations and hooks) is wrong one order
earlier: its second derivative fails ``gradgradcheck``, so Hessians through it were off (an
eigenvalue 0.9053 for 0.9173).

:func:`composite_norms` computes all of these with elementary differentiable operations for the
duration of a call (the same values up to rounding, running statistics updated and arguments
checked as the native kernels do); :func:`exact_weight_norm` only ``torch._weight_norm``, for
the second-order tools. Code that calls the kernels below Python (``torch.jit.script``, the
``torch.native_*`` ops) is not routed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["composite_norms", "exact_weight_norm", "may_weight_norm"]

_LOW = (torch.float16, torch.bfloat16)


def _stats_dtype(x: torch.Tensor) -> torch.dtype:
    """The native kernels' statistics dtype: float32 for half inputs, else the input's."""
    return torch.float32 if x.dtype in _LOW else x.dtype


def _affine(
    out: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, shape: list[int]
) -> torch.Tensor:
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return out


def _update(running: torch.Tensor | None, value: torch.Tensor, momentum: float) -> None:
    if running is not None:
        with torch.no_grad():
            running.mul_(1.0 - momentum).add_(value.detach().to(running.dtype), alpha=momentum)


def _batch_norm(
    input: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``F.batch_norm`` with elementary operations (batch statistics: biased variance for the
    output, unbiased for the running variance, as the native kernel)."""
    x = input.to(_stats_dtype(input))
    dims = [0, *range(2, x.dim())]
    shape = [1, -1] + [1] * (x.dim() - 2)
    if training:
        F._verify_batch_size(input.size())
        mean = x.mean(dims)
        var = (x - mean.reshape(shape)).square().mean(dims)
        n = x.numel() // x.shape[1]
        if n:  # an empty batch leaves the running statistics as they are (as the native kernel)
            _update(running_mean, mean, momentum)
            _update(running_var, var * n / max(n - 1, 1), momentum)
    else:
        if running_mean is None or running_var is None:
            raise ValueError(
                "batch_norm: running_mean and running_var are needed when not training"
            )
        mean, var = running_mean.to(x.dtype), running_var.to(x.dtype)
    out = (x - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + eps)
    return _affine(out, weight, bias, shape).to(input.dtype)


def _layer_norm(
    input: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``F.layer_norm`` with elementary operations (the native shape check kept)."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or tuple(input.shape[input.dim() - len(shape) :]) != shape:
        raise RuntimeError(
            f"Given normalized_shape={list(shape)}, expected input with shape [*, "
            f"{', '.join(map(str, shape))}], but got input of size{list(input.shape)}"
        )
    normalized_shape = shape
    x = input.to(_stats_dtype(input))
    dims = list(range(x.dim() - len(tuple(normalized_shape)), x.dim()))
    mean = x.mean(dims, keepdim=True)
    var = (x - mean).square().mean(dims, keepdim=True)
    out = (x - mean) * torch.rsqrt(var + eps)
    shape = list(normalized_shape)
    return _affine(out, weight, bias, shape).to(input.dtype)


def _instance_norm(
    input: torch.Tensor,
    running_mean: torch.Tensor | None = None,
    running_var: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``F.instance_norm`` with elementary operations (statistics per example and channel; the
    running statistics, where tracked, move by the batch's average, as the native kernel)."""
    x = input.to(_stats_dtype(input))
    shape = [1, -1] + [1] * (x.dim() - 2)
    if use_input_stats:
        F._verify_spatial_size(input.size())
        dims = list(range(2, x.dim()))
        mean = x.mean(dims, keepdim=True)
        var = (x - mean).square().mean(dims, keepdim=True)
        n = x[0, 0].numel()
        _update(running_mean, mean.mean(0).flatten(), momentum)
        _update(running_var, (var * n / max(n - 1, 1)).mean(0).flatten(), momentum)
    else:
        if running_mean is None or running_var is None:
            raise ValueError("instance_norm: running statistics are needed without input stats")
        mean, var = running_mean.to(x.dtype).reshape(shape), running_var.to(x.dtype).reshape(shape)
    out = (x - mean) * torch.rsqrt(var + eps)
    return _affine(out, weight, bias, shape).to(input.dtype)


def _torch_batch_norm(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    cudnn_enabled: bool = True,
) -> torch.Tensor:
    """``torch.batch_norm``'s argument order."""
    return _batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)


def _torch_layer_norm(
    input: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    cudnn_enable: bool = True,
) -> torch.Tensor:
    """``torch.layer_norm``'s arguments."""
    return _layer_norm(input, normalized_shape, weight, bias, eps)


def _torch_instance_norm(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    use_input_stats: bool,
    momentum: float,
    eps: float,
    cudnn_enabled: bool = True,
) -> torch.Tensor:
    """``torch.instance_norm``'s argument order."""
    return _instance_norm(
        input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps
    )


def _weight_norm(v: torch.Tensor, g: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``torch._weight_norm``: ``g * v / ||v||``, the norm over every dimension but ``dim`` (over
    all of them for ``dim=-1``), with elementary operations."""
    if dim == -1:
        return v * (g / torch.linalg.vector_norm(v))
    keep = dim % v.dim()
    dims = [d for d in range(v.dim()) if d != keep]
    return v * (g / torch.linalg.vector_norm(v, dim=dims, keepdim=True))


_WEIGHT_NORM: dict[Callable[..., Any], Callable[..., torch.Tensor]] = {
    torch._weight_norm: _weight_norm,
}

_COMPOSITES: dict[Callable[..., Any], Callable[..., torch.Tensor]] = {
    **_WEIGHT_NORM,
    F.batch_norm: _batch_norm,
    F.layer_norm: _layer_norm,
    F.instance_norm: _instance_norm,
    torch.batch_norm: _torch_batch_norm,
    torch.layer_norm: _torch_layer_norm,
    torch.instance_norm: _torch_instance_norm,
}


class _Routed(TorchFunctionMode):
    """Routes the functions of ``table`` to their elementary versions."""

    def __init__(self, table: dict[Callable[..., Any], Callable[..., torch.Tensor]]) -> None:
        super().__init__()
        self.table = table

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        composite = self.table.get(func)
        if composite is not None:
            return composite(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


@contextmanager
def composite_norms() -> Iterator[None]:
    """Inside the block, ``F.batch_norm``, ``F.layer_norm``, ``F.instance_norm``, their
    ``torch.*`` forms and ``torch._weight_norm`` (and so ``nn.BatchNorm*d``, ``nn.LayerNorm``,
    ``nn.InstanceNorm*d``, weight norm) run as elementary operations, whose third derivatives
    are right (module docstring). A backward that recomputes a forward (activation
    checkpointing) runs it with the native kernels: the mode is off while ``torch.autograd.grad``
    runs (a ``TorchFunctionMode`` is popped inside its own handler), and torch's checkpoint then
    sees other saved tensors and raises ``CheckpointError``."""
    with _Routed(_COMPOSITES):
        yield


def may_weight_norm(model: torch.nn.Module) -> bool:
    """Whether running ``model`` may call ``torch._weight_norm``: a ``weight_norm``
    parametrization or hook, or a module whose ``forward`` names ``_weight_norm``. For the hot
    paths that enter :func:`exact_weight_norm` only then (the mode costs ~0.5% of a ResNet-20
    step: a Python call per operation)."""
    for m in model.modules():
        if any(type(h).__name__ == "WeightNorm" for h in m._forward_pre_hooks.values()):
            return True
        for plist in getattr(m, "parametrizations", {}).values():
            if any(type(p).__name__ == "_WeightNorm" for p in plist):
                return True
        code = getattr(type(m).forward, "__code__", None)
        if code is not None and "_weight_norm" in code.co_names:
            return True
    return False


@contextmanager
def exact_weight_norm() -> Iterator[None]:
    """Inside the block, ``torch._weight_norm`` runs as elementary operations, whose second
    derivative is right (the native one's is not: module docstring)."""
    with _Routed(_WEIGHT_NORM):
        yield
