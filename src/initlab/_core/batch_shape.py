"""Where a batch's target is, whether a batch is one example without its batch dimension (the
checks of :func:`initlab._core.data.check_batch` on a batch's shape), and which of a dict batch's
keys the model's forward takes (:func:`target_taken`: a target it cannot take is left out)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from initlab._core.compiled import uncompiled

__all__ = ["TARGET_KEYS", "check_batched", "find_target", "forward_params", "target_taken"]

#: Keys of a dict batch that hold the target, in the order they are looked up.
TARGET_KEYS = ("labels", "label", "targets", "target", "y")


def find_target(batch: Any) -> tuple[str, Any] | None:
    """``(key, target)``: ``("1", batch[1])`` of an ``(x, y, ...)`` batch, or the first
    :data:`TARGET_KEYS` entry of a dict batch that is a tensor; ``None`` when there is none."""
    if isinstance(batch, Mapping):
        key = next((k for k in TARGET_KEYS if isinstance(batch.get(k), torch.Tensor)), None)
        return None if key is None else (key, batch[key])
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return "1", batch[1]
    return None


def check_batched(batch: Any, *, what: str, which: str) -> None:
    """Raise if ``batch`` is one example without its batch dimension, as a
    ``DataLoader(dataset, batch_size=None)`` yields them (read as a batch, ``x`` of shape ``(d,)``
    would count as ``d`` examples): the target (``y`` of ``(x, y, ...)``, a dict's ``labels``) is
    a scalar, or ``x`` is one feature vector ``(d,)`` with a target of shape ``(1,)`` or, for
    floating ``x``, a target whose first dim is not ``d``; or a dict's ``input_ids`` is one
    sequence (1-d: an un-collated row). Other entries may be scalars."""
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        x, y, key = batch[0], batch[1], "1"
    elif isinstance(batch, Mapping):
        key, y = find_target(batch) or (None, None)
        inputs = [v for k, v in batch.items() if k != key and isinstance(v, torch.Tensor)]
        x = batch.get("input_ids", next((v for v in inputs if v.dim() >= 1), None))
        if "input_ids" in batch and isinstance(x, torch.Tensor) and x.dim() == 1:
            raise ValueError(
                f"{what}: {which} holds one un-collated example ('input_ids' of shape "
                f"{tuple(x.shape)}): batch the rows (a DataLoader with a collator such as "
                "transformers.DataCollatorWithPadding), or add the batch dimension"
            )
    else:
        return
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor) or x.dim() == 0:
        return
    # a scalar target, or a feature vector x (d,) with a target (1,), or a float one with a
    # target (k,), (k, m)...: a TensorDataset row (examples along dim 0 would disagree: d of them
    # in x, k in y). Integer ids (d,) with k targets are an EmbeddingBag's flat input of k bags.
    one = x.dim() == 1 and tuple(y.shape) == (1,) and x.shape[0] != 1
    features = x.dim() == 1 and x.is_floating_point() and y.dim() >= 1
    if y.dim() == 0 or one or (features and y.shape[0] != x.shape[0]):
        shape = "a scalar (0-d)" if y.dim() == 0 else f"of shape {tuple(y.shape)}"
        raise ValueError(
            f"{what}: {which} looks like one example without a batch dimension: its target "
            f"(entry {key!r}) is {shape} while its input has shape {tuple(x.shape)}, which would "
            f"count as {x.shape[0]} examples. A DataLoader with batch_size=None yields single "
            "examples: give it a batch_size, or add the batch dimension (x.unsqueeze(0), "
            "y.unsqueeze(0))"
        )


def forward_params(model: Any, depth: int = 4) -> Mapping[str, inspect.Parameter]:
    """The parameters ``model``'s forward names (none where unreadable); for a wrapper's forward
    of only ``*args, **kwargs``, those of the model it wraps (DDP's ``module``, ``_orig_mod``)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (AttributeError, TypeError, ValueError):
        return {}
    variadic = all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values())
    inner = next((getattr(model, k) for k in ("module", "_orig_mod") if hasattr(model, k)), model)
    if depth and params and variadic and inner is not model:
        return forward_params(inner, depth - 1)
    return params


def target_taken(model: Any, batch: Mapping[str, Any]) -> Mapping[str, Any]:
    """The dict batch without its target (:func:`find_target`) where the model's forward neither
    names it nor takes ``**kwargs``, so that ``model(**batch)`` would refuse it (a
    ``forward(self, x)`` given ``{'x', 'y'}``; transformers before 5: BERT given the GLUE column
    ``label``, CLIP given ``labels``): every loss on the outputs reads it from the batch. Else
    the batch as it is. The forward read is the model's own, or that of the module a
    pass-through wrapper hands its arguments to (DDP, ``DataParallel``, ``torch.compile``); a
    wrapper of one's own taking ``**kwargs`` may read the target (a model-and-loss wrapper)."""
    found = find_target(batch)
    if found is None:
        return batch
    try:
        params = inspect.signature(_passed_to(model).forward).parameters
    except (AttributeError, TypeError, ValueError):
        return batch
    if not params or found[0] in params:
        return batch
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return batch
    return {k: v for k, v in batch.items() if k != found[0]}


def _passed_to(model: Any) -> Any:
    """The module a pass-through wrapper (DDP, ``DataParallel``, a ``torch.compile``'d model:
    :func:`~initlab._core.compiled.uncompiled`) hands its arguments to, unwrapped; any other
    model as it is."""
    for _ in range(8):
        inner = model.module if isinstance(model, _PARALLEL) else uncompiled(model)
        if inner is model:
            break
        model = inner
    return model


_PARALLEL = (nn.parallel.DistributedDataParallel, nn.DataParallel)
