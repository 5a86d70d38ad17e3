"""Which of torch's criteria a loss function is, and what it declares: the class criteria
(cross-entropy, NLL: modules, functions, ``functools.partial`` of them) with their
``ignore_index`` and class weights, the elementwise ones (MSE, L1, Huber), the reduction a
criterion says it applies. Read by :mod:`initlab._core.loss` (how a criterion pairs outputs and
targets) and :mod:`initlab._core.loss_counts` (what a mean-reduced loss divides by)."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "CLASS_CRITERIA",
    "ELEMENTWISE_CRITERIA",
    "class_options",
    "counted",
    "declared_reduction",
    "is_one_of",
    "takes_class_indices",
]


def class_options(fn: Any) -> tuple[int, torch.Tensor | None]:
    """``(ignore_index, weight)`` of torch's cross-entropy/NLL criterion ``fn``."""
    if isinstance(fn, functools.partial):
        ignore, weight = class_options(fn.func)
        return fn.keywords.get("ignore_index", ignore), fn.keywords.get("weight", weight)
    if isinstance(fn, nn.Module):
        return int(getattr(fn, "ignore_index", -100)), getattr(fn, "weight", None)
    return -100, None


def counted(fn: Any, y: torch.Tensor) -> float:
    """The targets of ``y`` a class criterion counts: not ``ignore_index``, weighted by class."""
    ignore, weight = class_options(fn)
    valid = y != ignore
    if weight is None:
        return float(valid.sum())
    return float(weight.to(y.device)[y[valid].long()].sum(dtype=torch.float64))


CLASS_CRITERIA = (nn.CrossEntropyLoss, nn.NLLLoss, F.cross_entropy, F.nll_loss)
ELEMENTWISE_CRITERIA = (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, F.mse_loss)
ELEMENTWISE_CRITERIA += (F.l1_loss, F.smooth_l1_loss, F.huber_loss)


def takes_class_indices(fn: Any) -> bool:
    """torch's cross-entropy and NLL criteria (modules, functions, partials of them)."""
    return is_one_of(fn, CLASS_CRITERIA)


def is_one_of(fn: Any, criteria: tuple[Any, ...]) -> bool:
    """Whether ``fn`` is one of torch's ``criteria``: an instance of a class, a function, or a
    ``functools.partial`` of either."""
    inner = fn.func if isinstance(fn, functools.partial) else fn
    return any(inner is c or (isinstance(c, type) and isinstance(inner, c)) for c in criteria)


def declared_reduction(fn: Any) -> str | None:
    """``"mean"``/``"sum"`` where a criterion says how it reduces (``nn.CrossEntropyLoss
    (reduction="sum")``, ``partial(F.mse_loss, reduction="sum")``; torch's functional losses
    default to the mean), else ``None``."""
    if isinstance(fn, functools.partial):
        value = fn.keywords.get("reduction")
        if value is None:
            return declared_reduction(fn.func)
    elif isinstance(fn, nn.Module):
        value = getattr(fn, "reduction", None)
    elif (getattr(fn, "__module__", "") or "").startswith("torch.nn.functional"):
        try:
            default = inspect.signature(fn).parameters.get("reduction")
        except (TypeError, ValueError):  # a builtin without a signature
            default = None
        value = None if default is None else default.default
    else:
        value = None
    return value if value in ("mean", "sum") else None
