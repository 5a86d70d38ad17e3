"""What the moment probe cannot measure: a model it refuses, a module call it reports.

:func:`refuse_parametrized` raises the error every method that writes weights raises for
``torch.nn.utils.parametrize`` parametrizations (``weight_norm``, ``spectral_norm``,
``orthogonal``...; :func:`initlab.init.registry._refuse_parametrized`); the probe raises it
inside such a method only (:func:`~initlab._core.parametrized.refuse_computed`), elsewhere it
measures the computed tensors. :func:`refuse_norm_hooks` refuses, always, the older hook-based
``torch.nn.utils.weight_norm`` and ``spectral_norm``, and ``torch.nn.utils.prune``
(:func:`~initlab.init.registry._refuse_norm_hooks`), whose weight is no parameter (the
per-example gradients of ``weight_g``/``weight_v`` failed; a pruned layer's rows were those of
``weight_orig``, not of the ``weight_orig * weight_mask`` its forward uses).
:func:`packed_note` is the per-example note of a call on a ``PackedSequence``.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.rnn import PackedSequence

from initlab._core.parametrized import trainable
from initlab.init.registry import _refuse_norm_hooks, _refuse_parametrized

PACKED = (
    "PackedSequence inputs are not supported for per-example gradients (the examples are "
    "interleaved in its data); call the module on a padded tensor to get them"
)


def refuse_norm_hooks(model: nn.Module) -> None:
    """Raise ``ValueError`` if a module of ``model`` has a weight recomputed by a hook-based
    ``weight_norm``/``spectral_norm`` or by pruning (``torch.nn.utils.prune``)."""
    for name, module in model.named_modules():
        _refuse_norm_hooks(module, None, where=name)


def refuse_parametrized(model: nn.Module) -> None:
    """Raise ``ValueError`` if a module of ``model`` has trainable parametrized tensors (the probe
    does so inside a method that writes weights, which leaves a frozen one as it is:
    :func:`~initlab._core.parametrized.writing_layers`), or
    a weight recomputed by a hook-based ``weight_norm``/``spectral_norm``."""
    for name, module in model.named_modules():
        _refuse_norm_hooks(module, None, where=name)
        if parametrize.is_parametrized(module):  # a writer writes no frozen tensor
            names = [n for n in module.parametrizations if trainable(module, n)]
            _refuse_parametrized(module, names, where=name)


def packed_note(inputs: tuple[tuple, dict[str, Any]]) -> str | None:
    """:data:`PACKED` if a module call's ``(args, kwargs)`` hold a ``PackedSequence``."""
    args, kwargs = inputs
    return PACKED if any(isinstance(a, PackedSequence) for a in (*args, *kwargs.values())) else None
