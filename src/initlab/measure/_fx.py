"""``torch.fx`` helpers shared by the scaling linter's modules: tracing a model
(:func:`trace_model`), where a graph node lives (its module path), function names and sets.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn
from torch.nn import functional as F

__all__ = ["trace_model"]


def _fns(*names: str, module: Any = F) -> set[Any]:
    return {getattr(module, n) for n in names if hasattr(module, n)}


def trace_model(model: nn.Module) -> tuple[Any, str]:
    """``(GraphModule, "")`` from ``torch.fx.symbolic_trace``, or ``(None, error)``. The model's
    buffers are as before after (tracing runs the forward's Python: ``self.steps += 1`` on a
    buffer changed it)."""
    import torch.fx

    from initlab._core.state import preserved_state

    try:
        with warnings.catch_warnings(), preserved_state(model, params=False):
            warnings.simplefilter("ignore")
            return torch.fx.symbolic_trace(model), ""
    except Exception as err:  # any tracing failure means "fall back to module types"
        return None, f"{type(err).__name__}: {err}".splitlines()[0][:300]


def _node_module_path(node: Any) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1]
    return path[0] if isinstance(path, tuple) else str(path)


def _fn_name(target: Any) -> str:
    name = getattr(target, "__name__", None) or str(target)
    return "max_pool" if name == "fn" else name
