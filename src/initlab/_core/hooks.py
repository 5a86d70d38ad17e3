"""Hooks live inside context managers: registered on enter, every one removed on exit.

Two forms, one rule (every handle is removed when the block ends, also when it raised):

* :func:`hook_handles` for a hook site inside a function::

      with hook_handles() as handles:
          handles.add(module.register_forward_hook(fn))
          model(x)

* :class:`HookContext` for a measuring object that is itself a context manager (the moment probe,
  the linter's activation watch): subclasses register in :meth:`HookContext.register`.

A module called inside ``torch.func.vmap`` (``vmap(lambda r: layer(r))(x)`` in a forward) shows
its hooks one example: its input ``x[i]`` of shape ``x.shape[1:]``, the batch dimension hidden
(:func:`is_vmapped` tells such a tensor). A hook whose statistics are taken over the batch calls
:func:`refuse_inside_vmap`, which raises :class:`VmappedModuleError` there. initlab's own re-runs
of a module (the moment probe's per-example replay under ``torch.func.vmap``) are no forward of
the user's: they run inside :func:`library_replay`, and a measuring hook of another tool skips
them (:func:`in_library_replay`) instead of refusing or counting them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol, TypeVar

import torch

__all__ = [
    "HookContext",
    "HookHandles",
    "VmappedModuleError",
    "hook_handles",
    "in_library_replay",
    "inside_vmap",
    "is_vmapped",
    "library_replay",
    "refuse_inside_vmap",
]


class _Removable(Protocol):
    def remove(self) -> None: ...


H = TypeVar("H", bound=_Removable)


class HookHandles:
    """The handles registered at one hook site; :meth:`remove_all` removes each once."""

    def __init__(self) -> None:
        self._handles: list[_Removable] = []

    def add(self, handle: H) -> H:
        """Keep ``handle`` (a ``RemovableHandle``) for removal; returns it."""
        self._handles.append(handle)
        return handle

    def remove_all(self) -> None:
        """Remove every kept handle (newest first); safe to call twice."""
        handles, self._handles = self._handles, []
        for h in reversed(handles):
            h.remove()

    def __len__(self) -> int:
        return len(self._handles)


@contextmanager
def hook_handles() -> Iterator[HookHandles]:
    """A :class:`HookHandles` whose hooks are all removed when the block exits, however it exits."""
    handles = HookHandles()
    try:
        yield handles
    finally:
        handles.remove_all()


class HookContext:
    """Base of a context manager that registers module hooks in :meth:`register`.

    Subclasses keep each handle with ``self._hooks.add(handle)`` inside :meth:`register`; every
    handle is removed on exit, also when the block (or a later registration) raised.
    """

    _hooks: HookHandles

    def register(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def __enter__(self) -> Any:
        self._hooks = HookHandles()
        try:
            self.register()
        except BaseException:
            self._hooks.remove_all()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.remove_all()


class VmappedModuleError(ValueError):
    """A hook that measures over the batch ran inside ``torch.func.vmap``."""


def inside_vmap() -> bool:
    """Whether the code runs inside ``torch.func.vmap`` (at any functorch level: also inside
    ``vmap(grad(f))``)."""
    functorch = torch._C._functorch
    if functorch.peek_interpreter_stack() is None:  # no transform at all: the common case
        return False
    vmap = functorch.TransformType.Vmap
    return any(level.key() == vmap for level in functorch.get_interpreter_stack())


def is_vmapped(t: object) -> bool:
    """Whether ``t`` is a tensor batched by ``torch.func.vmap``, at any functorch level (inside
    ``vmap(grad(f))`` the batched tensor is wrapped for ``grad``): a module hook sees one slice
    of it, of shape ``t.shape``, the vmapped dimension hidden."""
    if not isinstance(t, torch.Tensor):
        return False
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        if functorch.is_batchedtensor(t):
            return True
        t = functorch.get_unwrapped(t)
    return False


def refuse_inside_vmap(name: str, what: str, skip: str = "", kind: str = "module") -> None:
    """Raise :class:`VmappedModuleError` if a hook of the ``kind`` ``name`` runs inside
    ``torch.func.vmap`` (:func:`inside_vmap`). ``what``: the measurement (``"lsuv_"``);
    ``skip``: how to leave the module out, appended to the advice (``" (or pass modules=
    ...)"``)."""
    if inside_vmap():
        raise VmappedModuleError(
            f"{what}: {kind} {name or '<root>'!r} ran inside torch.func.vmap, so its hooks see "
            "one slice of the vmapped tensors at a time (one example, where vmap maps over the "
            "batch), not the whole batch its statistics are taken over. Call the layers on the "
            f"whole batch without vmap{skip}. Nothing was measured; the model is left as it was"
        )


_REPLAY: ContextVar[bool] = ContextVar("initlab_library_replay", default=False)


@contextmanager
def library_replay() -> Iterator[None]:
    """Mark the block as initlab re-running a module for a measurement of its own (the moment
    probe's per-example replay): see :func:`in_library_replay`."""
    token = _REPLAY.set(True)
    try:
        yield
    finally:
        _REPLAY.reset(token)


def in_library_replay() -> bool:
    """Whether a :func:`library_replay` is running: a measuring hook (the activation watch)
    skips the call, which is no forward of the user's (it would count a replayed module twice,
    and one example at a time under vmap)."""
    return _REPLAY.get()
