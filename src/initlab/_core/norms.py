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

The native double backwards of ``layer_norm``, ``batch_norm`` (batch statistics), ``group_norm``
and ``rms_norm`` on a float16 input work in float16: on the small activations in front of a
normalization (``rstd = 1 / sigma`` in the hundreds, a GPT-2-style init) a product like
``rstd^3 * sum(dy * x)`` passes float16's largest value 65504, and a Hessian-vector product or
the gradient of ``||g||`` is NaN while the loss and ``g`` are finite. :func:`float16_norms`
computes these norms on float16 inputs with elementary operations on float32 statistics (the
forward the native kernels compute, up to rounding), for every pass that is differentiated twice;
other dtypes run the native kernels, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

__all__ = [
    "composite_norms",
    "exact_weight_norm",
    "float16_norms",
    "may_float16",
    "may_weight_norm",
    "second_order_norms",
]

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


def _normalized(input: torch.Tensor, normalized_shape: int | Sequence[int]) -> tuple[int, ...]:
    """``normalized_shape`` as a tuple, checked against ``input``'s trailing dimensions (the
    native kernels' check and message)."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or tuple(input.shape[input.dim() - len(shape) :]) != shape:
        raise RuntimeError(
            f"Given normalized_shape={list(shape)}, expected input with shape [*, "
            f"{', '.join(map(str, shape))}], but got input of size{list(input.shape)}"
        )
    return shape


def _layer_norm(
    input: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``F.layer_norm`` with elementary operations (the native shape check kept)."""
    normalized_shape = _normalized(input, normalized_shape)
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


def _group_norm(
    input: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``F.group_norm`` with elementary operations: per example, the ``C / G`` channels of a group
    (and every spatial position) normalized by their mean and biased variance, then the
    per-channel affine (the native checks and messages kept)."""
    if input.dim() < 2:
        raise RuntimeError(
            f"Expected at least 2 dimensions for input tensor but received {input.dim()}"
        )
    n, c = input.shape[0], input.shape[1]
    if c % num_groups:
        raise RuntimeError(
            "Expected number of channels in input to be divisible by num_groups, but got input "
            f"of shape {list(input.shape)} and num_groups={num_groups}"
        )
    F._verify_batch_size([n * c // num_groups, num_groups, *input.shape[2:]])
    group = math.prod(input.shape[1:]) // num_groups  # values per group and example
    x = input.to(_stats_dtype(input)).reshape(n, num_groups, group)
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).square().mean(-1, keepdim=True)
    out = ((x - mean) * torch.rsqrt(var + eps)).reshape(input.shape)
    return _affine(out, weight, bias, [1, -1] + [1] * (input.dim() - 2)).to(input.dtype)


def _rms_norm(
    input: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    """``F.rms_norm``, ``x / sqrt(mean(x^2) + eps) * weight``, with elementary operations (``eps``
    None: the statistics dtype's machine epsilon, float32's for a float16 input, as the native
    kernel)."""
    shape = _normalized(input, normalized_shape)
    x = input.to(_stats_dtype(input))
    dims = list(range(x.dim() - len(shape), x.dim()))
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    out = x * torch.rsqrt(x.square().mean(dims, keepdim=True) + eps)
    if weight is not None:
        out = out * weight
    return out.to(input.dtype)


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


def _torch_group_norm(
    input: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    cudnn_enabled: bool = True,
) -> torch.Tensor:
    """``torch.group_norm``'s arguments."""
    return _group_norm(input, num_groups, weight, bias, eps)


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


_FLOAT16: dict[Callable[..., Any], Callable[..., torch.Tensor]] = {
    F.batch_norm: _batch_norm,
    F.layer_norm: _layer_norm,
    F.instance_norm: _instance_norm,
    F.group_norm: _group_norm,
    F.rms_norm: _rms_norm,
    torch.batch_norm: _torch_batch_norm,
    torch.layer_norm: _torch_layer_norm,
    torch.instance_norm: _torch_instance_norm,
    torch.group_norm: _torch_group_norm,
    torch.rms_norm: _rms_norm,
}
"""The normalizations routed for a float16 input (:func:`float16_norms`)."""

_Table = dict[Callable[..., Any], Callable[..., torch.Tensor]]


def _float16_input(args: Sequence[Any], kwargs: dict[str, Any] | None) -> bool:
    x = args[0] if args else (kwargs or {}).get("input")
    return isinstance(x, torch.Tensor) and x.dtype == torch.float16


class _Routed(TorchFunctionMode):
    """Routes the functions of ``table`` to their elementary versions, and those of ``float16``
    where their input is a float16 tensor."""

    def __init__(self, table: _Table, float16: _Table | None = None) -> None:
        super().__init__()
        self.table = table
        self.float16 = float16 or {}

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        composite = self.table.get(func)
        if composite is None and func in self.float16 and _float16_input(args, kwargs):
            composite = self.float16[func]
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


def may_float16(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds a float16 parameter or buffer (its normalizations may then see
    float16 inputs): the passes that are differentiated twice enter :func:`float16_norms`."""
    tensors = (*model.parameters(), *model.buffers())
    return any(t.dtype == torch.float16 for t in tensors)


@contextmanager
def float16_norms() -> Iterator[None]:
    """Inside the block, ``F.batch_norm``, ``F.layer_norm``, ``F.instance_norm``,
    ``F.group_norm``, ``F.rms_norm`` and their ``torch.*`` forms run, on a float16 input, as
    elementary operations with float32 statistics: ``(x - mu) / sqrt(sigma^2 + eps)`` (RMS:
    ``x / sqrt(mean(x^2) + eps)``) and the affine in float32, the result rounded once to
    float16. Their derivatives of every order are then float32 down to the float16 input, where
    the native double backwards overflow float16 (module docstring). Any other input runs the
    native kernel, bit for bit."""
    with _Routed({}, _FLOAT16):
        yield


def second_order_norms(*, weight_norm: bool, float16: bool) -> AbstractContextManager[None]:
    """The routing a pass that is differentiated twice needs, in one mode:
    ``torch._weight_norm`` as elementary operations where ``weight_norm``
    (:func:`may_weight_norm`), the normalizations of float16 inputs as in :func:`float16_norms`
    where ``float16`` (:func:`may_float16`); no mode (the native speed) for neither."""
    if not (weight_norm or float16):
        return nullcontext()
    return _Routed(_WEIGHT_NORM if weight_norm else {}, _FLOAT16 if float16 else {})
