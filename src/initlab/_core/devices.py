"""Data on another device than the model: named, never moved.

initlab moves neither a model nor its data across devices: a copy made behind the user's back
costs memory and time nobody planned, and a model spread over several devices has no one device
to move the data to. Where the model's forward or the loss fails because a tensor of the batch is
on another device than the model (torch: "Expected all tensors to be on the same device, but got
mat1 is on cpu, different from other tensors on cuda:0"; a convolution's "Input type
(torch.FloatTensor) and weight type (torch.cuda.FloatTensor) should be the same"), the error
names that tensor, both devices, and how to move the data. ``nn.DataParallel`` moves the inputs
of its forward itself, but not the targets the loss reads: there the output is on the GPU and
the targets are named.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch

from initlab._core.batch_shape import find_target
from initlab._core.pytree import flatten_tensors

__all__ = ["DataDeviceError", "device_error", "target_device_error"]

_DEVICE_WORDS = re.compile(
    r"same device|different devices?|Input type \(torch\.\w+\) and weight type \(torch\.cuda\."
    r"|Input type \(torch\.cuda\.\w+\) and weight type \(torch\.\w+\)"
)


class DataDeviceError(RuntimeError):
    """A tensor of the batch is on another device than the model (or its output)."""


def _one_device(tensors: Iterable[torch.Tensor]) -> torch.device | None:
    """The one device of ``tensors``; ``None`` when there is none or several."""
    devices = {t.device for t in tensors}
    return devices.pop() if len(devices) == 1 else None


def device_error(err: Exception, model: Any, batch: Any) -> DataDeviceError | None:
    """A clear error for torch's device mismatch in a forward on ``batch``, where the model's
    parameters are all on one device and a tensor of the batch is on another; ``None`` for any
    other error (a model spread over devices: torch's own message stands)."""
    if not isinstance(err, RuntimeError) or not _DEVICE_WORDS.search(str(err)):
        return None
    params = model.parameters() if callable(getattr(model, "parameters", None)) else ()
    device = _one_device(params)
    return None if device is None else _away(batch, device, "the model's parameters", err)


def target_device_error(out: torch.Tensor, batch: Any, err: Exception) -> DataDeviceError | None:
    """A clear error for torch's device mismatch in a loss on the model's output ``out``: the
    batch's target (else its first tensor) on another device than ``out``; ``None`` otherwise."""
    if not _DEVICE_WORDS.search(str(err)):
        return None
    return _away(batch, out.device, "the model's output", err, first=find_target(batch))


def _kept_on_cpu(t: torch.Tensor) -> bool:
    """Whether ``t`` may be on the CPU on purpose beside data on the device: 1-D integers, as the
    ``lengths`` that ``pack_padded_sequence`` takes on the CPU only."""
    return t.device.type == "cpu" and t.dim() <= 1 and not t.is_floating_point()


def _away(
    batch: Any,
    device: torch.device,
    what: str,
    err: Exception,
    first: tuple[str, Any] | None = None,
) -> DataDeviceError | None:
    tensors = flatten_tensors(batch)
    away = [(path, t) for path, t in tensors if t.device != device]
    target = first is not None and isinstance(first[1], torch.Tensor)
    if target and first[1].device != device:  # the loss's own target: named first
        path, t = first
    elif not away or (len(away) < len(tensors) and all(_kept_on_cpu(t) for _, t in away)):
        return None  # the batch is on the device but for lengths-like tensors: not the data
    else:  # an input of the forward: a floating-point one before indices
        path, t = next((a for a in away if a[1].is_floating_point()), away[0])
    where = "the batch" if isinstance(batch, torch.Tensor) else f"the batch's entry {path!r}"
    return DataDeviceError(
        f"{where} is on {t.device} and {what} on {device} ({err}). initlab moves no data "
        f"between devices: move the batches to {device} where they are made "
        f"(x.to({str(device)!r}) in the loop that yields them, or in a collate_fn)"
    )
