"""initlab's own arithmetic runs without autocast, whatever the user's code around it enables.

Under ``torch.autocast`` every matrix product runs in the autocast dtype (bfloat16 or float16),
also the ones inside a hook or a statistic: a ``torch.mv`` that reduces a per-example gradient
would silently lose all but three digits on CUDA, and on the CPU it raises on mixed dtypes. The
model's own forward and backward keep the user's autocast; initlab's hooks and the arithmetic the
methods do on their results run inside :func:`autocast_off` and compute in the tensors' dtypes
(upcasting half precisions where they reduce).

Autocast also caches the low-precision copy of each parameter it casts, until the outermost
autocast block ends. A method that changes a weight in place and runs the model again would run
the stale copy (LSUV would rescale a layer whose output never changes; a folded output scale would
not show), and so would the user's next forward after the method. Every entry point runs inside
:func:`autocast_uncached` (through :func:`~initlab._core.state.model_kept`): the user's autocast
without the cache, and the cache cleared on exit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, TypeVar

import torch

__all__ = ["autocast_off", "autocast_uncached", "refuse_autocast_inside", "without_autocast"]

_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu")

F = TypeVar("F", bound=Callable[..., Any])


@contextmanager
def autocast_off() -> Iterator[None]:
    """Inside the block: autocast off on every device type it is on for; as before after."""
    on = _enabled()
    if not on:
        yield
        return
    with ExitStack() as stack:
        for device_type in on:
            stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


@contextmanager
def refuse_autocast_inside(model: torch.nn.Module, what: str, why: str) -> Iterator[None]:
    """Inside the block (which runs with :func:`autocast_off`), a call of ``model`` with autocast
    on raises ``ValueError``: the user's loss function turned it on again around the model, out of
    the caller's reach. ``why``: what autocast would do to ``what``'s result."""

    def check(module: torch.nn.Module, args: Any) -> None:
        if _any_enabled():
            on = ", ".join(f"{d} ({torch.get_autocast_dtype(d)})" for d in _enabled())
            raise ValueError(
                f"{what}: the model ran under torch.autocast ({on}), turned on inside the loss "
                f"function ({what} turns it off around its own passes): {why}. Pass a loss "
                "function without autocast"
            )

    handle = model.register_forward_pre_hook(check)
    try:
        yield
    finally:
        handle.remove()


def _enabled() -> list[str]:
    return [d for d in _DEVICE_TYPES if _enabled_for(d)]


def _enabled_for(device_type: str) -> bool:
    """``torch.is_autocast_enabled(device_type)``; ``False`` for a device type this torch's
    autocast does not know (torch 2.4 raises for ``"mps"``)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return False


def _any_enabled() -> bool:
    """Is autocast on for any device type (0.06 us where torch has the one C check, a hook's
    common case; the per-type checks otherwise)?"""
    check = getattr(torch._C, "_is_any_autocast_enabled", None)
    return check() if check is not None else bool(_enabled())


@contextmanager
def autocast_uncached() -> Iterator[None]:
    """Inside the block: the user's autocast (same devices and dtypes) with its cast cache off;
    the cache cleared on exit, also after an exception."""
    on = _enabled()
    if not on:
        yield
        return
    try:
        with ExitStack() as stack:
            for device_type in on:
                dtype = torch.get_autocast_dtype(device_type)
                stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=False))
            yield
    finally:
        torch.clear_autocast_cache()


def without_autocast(fn: F) -> F:
    """``fn`` run inside :func:`autocast_off` (for hooks: they fire inside the user's autocast)."""

    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        if not _any_enabled():  # the common case, without a context manager (hooks run often)
            return fn(*args, **kwargs)
        with autocast_off():
            return fn(*args, **kwargs)

    return inner  # type: ignore[return-value]
