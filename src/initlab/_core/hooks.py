"""Hooks live inside context managers: registered on enter, every one removed on exit.

Two forms, one rule (every handle is removed when the block ends, also when it raised):

* :func:`hook_handles` for a hook site inside a function::

      with hook_handles() as handles:
          handles.add(module.register_forward_hook(fn))
          model(x)

* :class:`HookContext` for a measuring object that is itself a context manager (the moment probe,
  the linter's activation watch): subclasses register in :meth:`HookContext.register`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

__all__ = ["HookContext", "HookHandles", "hook_handles"]


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
