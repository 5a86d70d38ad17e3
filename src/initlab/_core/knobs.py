"""One name per concept across every method and the command line, and the old names' grace period.

The names (each means one thing everywhere):

* ``data``: what the method reads (one batch or many, :mod:`initlab._core.data`);
* ``loss_fn``: the loss, in any form :func:`initlab._core.loss.resolve_loss` accepts;
* ``steps``: optimization steps of an iterative method (GradInit, MetaInit);
* ``max_iter``: at most this many corrections of a fixed-point method (LSUV, preconditioning);
* ``max_batches``: at most this many batches of ``data`` are read (``None``: all);
* ``generator``: an int seed or a ``torch.Generator`` (``None``: the global generator);
* ``strategy`` (LSUV: layers, residual branches or the residual stream) and ``ad_mode``
  (curvature: reverse-over-reverse or forward-over-reverse) where ``mode`` used to mean both.

Old names keep working for one release: :func:`renamed_kwargs` maps them to the new ones with a
``DeprecationWarning`` that names the new one.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["renamed_kwargs", "user_stacklevel"]

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

F = TypeVar("F", bound=Callable[..., Any])


def renamed_kwargs(**old_to_new: str) -> Callable[[F], F]:
    """Accept ``old=value`` as ``new=value`` with a ``DeprecationWarning`` naming ``new``.

    Passing both names is a ``TypeError``.

    Example:
        >>> @renamed_kwargs(iterations="steps")
        ... def f(*, steps=1):
        ...     return steps
        >>> import warnings
        >>> with warnings.catch_warnings(record=True):
        ...     warnings.simplefilter("always")
        ...     f(iterations=3)
        3
    """

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            for old, new in old_to_new.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(
                            f"{fn.__name__}() got both {old}= (deprecated) and {new}=; pass {new}="
                        )
                    warnings.warn(
                        f"{fn.__name__}(): {old}= is deprecated and will be removed in the next "
                        f"release; use {new}=",
                        DeprecationWarning,
                        stacklevel=user_stacklevel(),
                    )
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        inner.__deprecated_kwargs__ = dict(old_to_new)  # type: ignore[attr-defined]
        return inner  # type: ignore[return-value]

    return wrap


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning point at the user's line: the first frame outside
    initlab, counted from the caller of this function (decorators and helpers in between do not
    shift it).

    Example: ``warnings.warn("...", UserWarning, stacklevel=user_stacklevel())``.
    """
    frame = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
        level += 1
    return level
