"""Hooks live inside context managers: registered on enter, every one removed on exit."""

from __future__ import annotations

from typing import Any

__all__ = ["HookContext"]


class HookContext:
    """Base of a context manager that registers module hooks in :meth:`register`.

    Subclasses append each handle to ``self._handles`` inside :meth:`register`; every handle is
    removed on exit, also when the block (or a later registration) raised.
    """

    _handles: list[Any]

    def register(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def __enter__(self) -> Any:
        self._handles = []
        try:
            self.register()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        handles, self._handles = self._handles, []
        for h in handles:
            h.remove()
