"""Which of torch's criteria a loss function is, and what it declares: the class criteria
(cross-entropy, NLL: modules, functions, ``functools.partial`` of them) with their
``ignore_index`` and class weights, the elementwise ones (MSE, L1, Huber), the reduction a
criterion says it applies, and torch's errors that are about a criterion's own weights
(:func:`weight_error`), not the targets. Read by :mod:`initlab._core.loss` (how a criterion
pairs outputs and targets) and :mod:`initlab._core.loss_counts` (what a mean-reduced loss
divides by)."""

from __future__ import annotations

import functools
import inspect
import re
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
    "weight_error",
]


def class_options(fn: Any) -> tuple[int, torch.Tensor | None]:
    """``(ignore_index, weight)`` of torch's cross-entropy/NLL criterion ``fn``."""
    return int(_setting(fn, "ignore_index", -100)), _setting(fn, "weight", None)


def _setting(fn: Any, key: str, default: Any) -> Any:
    """The option ``key`` of torch's criterion ``fn``: a module's attribute, or a
    ``functools.partial``'s keyword over its function's; ``default`` where unset."""
    if isinstance(fn, functools.partial):
        return fn.keywords.get(key, _setting(fn.func, key, default))
    return getattr(fn, key, default) if isinstance(fn, nn.Module) else default


def counted(fn: Any, y: torch.Tensor) -> float:
    """The targets of ``y`` a class criterion counts: not ``ignore_index``, weighted by class
    (unweighted where a label has no weight: the criterion then refuses its weight= or the
    label itself, :func:`weight_error`)."""
    ignore, weight = class_options(fn)
    valid = y != ignore
    labels = y[valid].long()
    if weight is None or weight.dim() != 1 or bool(((labels < 0) | (labels >= len(weight))).any()):
        return float(valid.sum())
    return float(weight.to(y.device)[labels].sum(dtype=torch.float64))


#: torch's text for a class criterion's weight= of another length than the classes (the number
#: where it gives one): cross-entropy and NLL, multi-margin
_WEIGHT_LENGTH = re.compile(
    r"weight tensor should be defined either for all (?:(\d+) )?(?:or no )?classes"
    r"|inconsistent weight size, expected (\d+)"
)
#: torch's names of dtypes in "expected scalar type Float but found Long"
_SCALAR_TYPES = {"Float": torch.float32, "Double": torch.float64, "Half": torch.float16}
_SCALAR_TYPES |= {"BFloat16": torch.bfloat16, "Long": torch.int64, "Int": torch.int32}


def weight_error(fn: Any, out: torch.Tensor, err: Exception, name: str) -> ValueError | None:
    """A ``ValueError`` where torch's error ``err`` from criterion ``fn`` (named ``name``) on the
    model's output ``out`` is about the criterion's own ``weight=``/``pos_weight=``, not the
    targets; else ``None`` (also for ``fn`` ``None``: no criterion). A class criterion's
    ``weight`` holds one weight per class, ``C`` of them (torch's number, else ``out``'s dim 1),
    in the output's dtype; a binary cross-entropy's ``weight`` and ``pos_weight`` (one per class,
    along the last dim) broadcast against ``out``."""
    text, weight = str(err), _option(fn, "weight")
    found = _WEIGHT_LENGTH.search(text)
    if found and weight is not None:
        n = int(found.group(1) or found.group(2) or out.shape[1 if out.dim() >= 2 else 0])
        return ValueError(
            f"the loss {name!r} has a weight= of the wrong length for the model's {n} classes "
            f"(shape {tuple(weight.shape)}): a class criterion takes one weight per class, of "
            f"shape ({n},). Fix the criterion's weight= (torch: {text.rstrip('.')})"
        )
    scalar = re.search(r"expected scalar type \w+ but found (\w+)", text)
    wrong = weight is not None and weight.dtype != out.dtype and takes_class_indices(fn)
    if wrong and scalar and _SCALAR_TYPES.get(scalar.group(1)) == weight.dtype:
        return ValueError(
            f"the loss {name!r} has a weight= of dtype {weight.dtype}, and the model's output is "
            f"{out.dtype}: pass the class weights in the output's dtype (weight.to({out.dtype}))"
        )
    if not is_one_of(fn, BINARY_CRITERIA):
        return None
    for key, per in (("weight", "per element or per class"), ("pos_weight", "per class")):
        w = _option(fn, key)
        if w is None:
            continue
        try:
            torch.broadcast_shapes(out.shape, w.shape)
        except RuntimeError:
            return ValueError(
                f"the loss {name!r} has a {key}= of shape {tuple(w.shape)}, which does not "
                f"broadcast against the model's output of shape {tuple(out.shape)} "
                f"({out.shape[-1]} classes along its last dim): pass one {per}, e.g. of "
                f"shape ({out.shape[-1]},). Fix the criterion's {key}="
            )
    return None


def _option(fn: Any, key: str) -> torch.Tensor | None:
    """The tensor option ``key`` (``weight``, ``pos_weight``) of torch's criterion ``fn``
    (:func:`_setting`); ``None`` where unset."""
    value = _setting(fn, key, None)
    return value if isinstance(value, torch.Tensor) else None


CLASS_CRITERIA = (nn.CrossEntropyLoss, nn.NLLLoss, F.cross_entropy, F.nll_loss)
ELEMENTWISE_CRITERIA = (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, F.mse_loss)
ELEMENTWISE_CRITERIA += (F.l1_loss, F.smooth_l1_loss, F.huber_loss)
BINARY_CRITERIA = (nn.BCELoss, nn.BCEWithLogitsLoss, F.binary_cross_entropy)
BINARY_CRITERIA += (F.binary_cross_entropy_with_logits,)


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
