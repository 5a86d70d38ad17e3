"""A model's submodules by name, second names included.

A submodule registered under two names (``model.alias = model.a``; a block reused in a
``ModuleList``; T5's ``encoder.embed_tokens`` in transformers 4.x, which is ``shared``) appears
once in ``named_modules()``, under its first name, and every result lists it there. A user may
name it either way: :func:`first_names` maps any name to the first one.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from torch import nn

__all__ = ["first_names", "inference_tensors", "nearest_names", "with_first_names"]


def first_names(model: nn.Module) -> dict[str, str]:
    """Every name of every submodule (second names included) → its first name in
    ``model.named_modules()``."""
    first: dict[int, str] = {}
    return {n: first.setdefault(id(m), n) for n, m in model.named_modules(remove_duplicate=False)}


def with_first_names(model: nn.Module, wanted: Iterable[str]) -> list[str]:
    """``wanted`` with every second name replaced by the first (unknown names kept as given)."""
    names = first_names(model)
    return [names.get(n, n) for n in wanted]


def nearest_names(name: str, names: Iterable[str], n: int = 3) -> str:
    """``" (nearest: 'a', 'b', 'c')"``: the names in ``names`` closest to an unknown ``name``
    (for an error message; ``""`` where there are none)."""
    near = difflib.get_close_matches(name, [k for k in names if k], n=n, cutoff=0.0)
    return f" (nearest: {', '.join(map(repr, near))})" if near else ""


def inference_tensors(
    model: nn.Module, buffers: bool = True, *, params: bool = True, training: bool = False
) -> str:
    """The names of ``model``'s parameters and buffers made under ``torch.inference_mode()``
    (inference tensors), at most three then ``...``, comma-separated; ``""`` for none. With
    ``buffers=False`` only the buffers of the norm layers with running statistics (BatchNorm,
    InstanceNorm: what a forward in train mode updates) count, with ``training`` only those of
    such layers in train mode; ``params=False`` leaves the parameters out."""
    norms = (nn.modules.batchnorm._NormBase,)
    tensors = [*model.named_parameters()] if params else []
    for name, module in model.named_modules():
        if buffers or (isinstance(module, norms) and (module.training or not training)):
            prefix = f"{name}." if name else ""
            tensors += [(prefix + b, t) for b, t in module.named_buffers(recurse=False)]
    names = [n for n, t in tensors if t.is_inference()]
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
