"""A ``torch.compile``'d model is run through the module it wraps.

``torch.compile(model)`` returns an ``OptimizedModule`` that holds the user's module as
``_orig_mod`` and shares its parameters and buffers. initlab's procedures hook layers, swap
parameter entries and differentiate twice; inside a compiled graph each of these makes dynamo
break the graph or recompile (an LSUV or a moment probe of a small MLP took seconds instead of
milliseconds, and ended at dynamo's recompile limit). Every entry point that takes a model
therefore runs on the wrapped module: the same parameters (a change in place shows through the
compiled model), the same values (eager), the layers named as in the user's own module (``"0"``,
not ``"_orig_mod.0"``). The compiled model itself is left as it was, compiled.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

__all__ = ["takes_compiled", "uncompiled"]

F = TypeVar("F", bound=Callable[..., Any])


def uncompiled(model: Any) -> Any:
    """The module a ``torch.compile``'d model wraps (unwrapped again if that is compiled too);
    anything else as it is."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # loaded by any torch.compile
    if eval_frame is None:
        return model
    while isinstance(model, eval_frame.OptimizedModule):
        model = model._orig_mod
    return model


def takes_compiled(fn: F) -> F:
    """Run ``fn`` with its model (the first positional argument or ``model=``) uncompiled."""

    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], nn.Module):
            args = (uncompiled(args[0]), *args[1:])
        if isinstance(kwargs.get("model"), nn.Module):
            kwargs["model"] = uncompiled(kwargs["model"])
        return fn(*args, **kwargs)

    return inner  # type: ignore[return-value]
