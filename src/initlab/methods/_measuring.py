"""Helpers shared by the output-scaling, input-scaling and preconditioning methods.

The measurement passes of :mod:`initlab.methods.output_scale`, :mod:`initlab.methods.input_scale`
and :mod:`initlab.methods.precondition`: the output tensor of a model's output, buffers kept as
they were, the execution order of layers (temporary hooks), the tolerance of an "unchanged up to
rounding" check, and the checks of numeric options (their forked-RNG scopes:
:class:`~initlab._core.rng.Seeds`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from initlab._core.hooks import hook_handles, refuse_inside_vmap
from initlab._core.state import model_kept

__all__ = [
    "Forward",
    "check_positive",
    "execution_order",
    "keep_buffers",
    "kernel_taps",
    "rounding_tolerance",
]

Forward = Callable[[nn.Module, Any], Any]


def keep_buffers(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Put every buffer back as it was on exit (measurement passes must not move BN statistics):
    the core's :func:`~initlab._core.state.model_kept` for buffers only."""
    return model_kept(model, params="never", buffers="always")


def execution_order(
    model: nn.Module,
    names: Sequence[str],
    run: Callable[[], Any],
    reader: str | None = None,
    skip: str = "",
) -> tuple[list[str], dict[str, torch.Tensor], Any]:
    """Call ``run()`` with temporary forward hooks on the named modules.

    Returns the names in the order of their first call, each one's first input (detached), and
    what ``run`` returned. The hooks are removed even if ``run`` raises. ``reader``: the caller
    that reads the first module's input (called inside ``torch.func.vmap``, it shows one example
    of its input, so that raises :class:`~initlab._core.hooks.VmappedModuleError` naming
    ``reader``, with ``skip`` the advice's alternative).
    """
    modules = dict(model.named_modules())
    order: list[str] = []
    inputs: dict[str, torch.Tensor] = {}

    def make(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple) -> None:
            if reader is not None and not order:
                refuse_inside_vmap(name, reader, skip)
            if name not in inputs:
                order.append(name)
                first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                if first is not None:
                    inputs[name] = first.detach()

        return hook

    with hook_handles() as handles:
        for name in names:
            handles.add(modules[name].register_forward_pre_hook(make(name)))
        out = run()
    return order, inputs, out


def rounding_tolerance(t: torch.Tensor, floor: float) -> float:
    """Relative tolerance of an "unchanged up to rounding" check on ``t``'s dtype."""
    eps = torch.finfo(t.dtype).eps if t.is_floating_point() else 0.0
    return max(floor, 10 * eps)


def check_positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def kernel_taps(kernel_size: int | Sequence[int]) -> int:
    if isinstance(kernel_size, int) and not isinstance(kernel_size, bool):
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be >= 1, got {kernel_size}")
        return kernel_size * kernel_size
    sizes = list(kernel_size)
    if not sizes or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in sizes):
        raise ValueError(f"kernel_size must be a positive int or ints, got {kernel_size!r}")
    return math.prod(sizes)
