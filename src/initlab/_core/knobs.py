"""One name per concept across every method and the command line, and the old names' grace period.

The names (each means one thing everywhere):

* ``data``: what the method reads (one batch or many, :mod:`initlab._core.data`);
* ``loss_fn``: the loss, in any form :func:`initlab._core.loss.resolve_loss` accepts;
* ``steps``: optimization steps of an iterative method (GradInit, MetaInit);
* ``max_iter``: at most this many corrections of a fixed-point method (LSUV, preconditioning);
* ``max_batches``: at most this many batches of ``data`` are read (``None``: all);
* ``batch_dim``: the dim of the batch's tensors that holds the examples (``None``: dim 0);
* ``generator``: an int seed or a ``torch.Generator`` (``None``: the global generator);
* ``strategy`` (LSUV: layers, residual branches or the residual stream) and ``ad_mode``
  (curvature: reverse-over-reverse or forward-over-reverse) where ``mode`` used to mean both.

Old names keep working for one release: :func:`renamed_kwargs` maps them to the new ones with a
``DeprecationWarning`` that names the new one.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import operator
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

__all__ = [
    "check_batch_dim",
    "check_callback",
    "check_count",
    "check_flags",
    "check_kwargs",
    "errors_named",
    "integer_of",
    "parameter_names",
    "renamed_kwargs",
    "user_stacklevel",
]

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

F = TypeVar("F", bound=Callable[..., Any])


def renamed_kwargs(**old_to_new: str) -> Callable[[F], F]:
    """Accept ``old=value`` as ``new=value`` with a ``DeprecationWarning`` naming ``new``.

    Passing both names is a ``TypeError``; so is a keyword the function does not take (where it
    takes no ``**kwargs``), with initlab's name for it (:func:`check_kwargs`).

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
        order = list(inspect.signature(fn).parameters)
        accepted = accepted_keywords(fn, deprecated=old_to_new)

        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            check_keywords(fn.__name__, kwargs, accepted)
            for old, new in old_to_new.items():
                if old in kwargs:
                    positional = new in order and order.index(new) < len(args)
                    if new in kwargs or positional:
                        hint = (
                            " (a number of batches is max_batches=)"
                            if new == "data" and isinstance(kwargs[old], int)
                            else ""
                        )
                        raise TypeError(
                            f"{fn.__name__}() got both {old}= (deprecated) and {new}"
                            f"{' (positionally)' if positional else '='}; pass {new} once{hint}"
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


#: Names users try for the concepts above (PyTorch's, other libraries'), and initlab's names
#: for them, in order of preference (the first one the function takes is suggested).
GUESSED_NAMES: dict[str, tuple[str, ...]] = {
    "loss": ("loss_fn",),
    "criterion": ("loss_fn",),
    "loss_func": ("loss_fn",),
    "loss_function": ("loss_fn",),
    "lossfn": ("loss_fn",),
    "dataloader": ("data",),
    "loader": ("data",),
    "dataset": ("data",),
    "max_batch": ("max_batches",),
    "batches": ("max_batches", "data"),
    "num_batches": ("max_batches",),
    "n_batches": ("max_batches",),
    "iterations": ("steps", "max_iter"),
    "num_steps": ("steps", "max_iter"),
    "n_steps": ("steps", "max_iter"),
    "max_iters": ("max_iter", "steps"),
    "seed": ("generator",),
    "rng": ("generator",),
    # the contract's knobs themselves, where an entry point does not take one: said so, not
    # answered with the closest spelling (max_batches= is not max_probes=)
    "max_batches": ("max_batches",),
    "generator": ("generator",),
    "steps": ("steps", "max_iter"),
}


def parameter_names(fn: Callable[..., Any]) -> list[str]:
    """The names ``fn`` takes as arguments (not its ``*args``/``**kwargs`` catch-alls)."""
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [n for n, p in inspect.signature(fn).parameters.items() if p.kind not in variadic]


def check_kwargs(
    what: str, given: dict[str, Any], accepted: set[str], own: Iterable[str] = ()
) -> None:
    """Raise a ``TypeError`` naming ``what`` for keywords of ``given`` outside ``accepted``, with
    initlab's name for a guessed one (``loss=`` → ``loss_fn=``) or the closest name among
    ``accepted`` and ``own`` (the function's own parameters, e.g. ``max_batches``).

    Example:
        >>> check_kwargs("f", {"loss": 1}, {"per_example"}, own=["loss_fn", "data"])
        Traceback (most recent call last):
        ...
        TypeError: f() got an unexpected keyword argument 'loss'; did you mean loss_fn=?
    """
    names = set(accepted) | set(own)
    for name in given:
        if name in accepted:
            continue
        concept = GUESSED_NAMES.get(name.lower(), ())
        guesses = [g for g in concept if g in names]
        if not concept:  # a name of no known concept: the closest spelling
            guesses += difflib.get_close_matches(name, sorted(names), n=1)
        hint = f"did you mean {guesses[0]}=?" if guesses else ""
        if not guesses:
            takes_none = f"{what} takes no {concept[0]}=; " if concept else ""
            hint = f"{takes_none}accepted: {', '.join(sorted(names))}"
        raise TypeError(f"{what}() got an unexpected keyword argument {name!r}; {hint}")


def accepted_keywords(
    fn: Callable[..., Any], deprecated: Iterable[str] = ()
) -> tuple[set[str], set[str]] | None:
    """The keywords ``fn`` takes and its deprecated ones (``deprecated`` and its
    ``__deprecated_kwargs__``); ``None`` if it takes any (``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    names = {p.name for p in params if p.kind is not inspect.Parameter.VAR_POSITIONAL}
    return names, {*deprecated, *getattr(fn, "__deprecated_kwargs__", {})}


def check_keywords(
    what: str, kwargs: dict[str, Any], accepted: tuple[set[str], set[str]] | None
) -> None:
    """:func:`check_kwargs` for the keywords of a call outside ``accepted``
    (:func:`accepted_keywords`; ``None``: any is taken), suggesting among the current names."""
    if accepted is not None:
        names, deprecated = accepted
        unknown = {k: v for k, v in kwargs.items() if k not in names | deprecated}
        check_kwargs(what, unknown, set(), own=names)


def check_flags(what: str, **flags: object) -> None:
    """Raise ``TypeError`` for an on/off option that is not ``True`` or ``False`` (``"no"`` would
    read as true)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{what}: {name} must be True or False, got {value!r}")


def check_batch_dim(what: str, batch_dim: int | None) -> int:
    """``batch_dim`` (``None``: 0), checked as :class:`~initlab.MomentProbe` checks it (the
    examples' dim: :func:`~initlab._core.data.batch_size`).

    Raises:
        ValueError: ``batch_dim`` is neither ``None`` nor a non-negative int.
    """
    if batch_dim is not None and (not isinstance(batch_dim, int) or batch_dim < 0):
        raise ValueError(f"{what}: batch_dim must be None or a non-negative int, got {batch_dim!r}")
    return int(batch_dim or 0)


def integer_of(value: object) -> int | None:
    """``value`` as a Python int where ``operator.index`` takes it (an int, a NumPy integer, an
    integer tensor of one element), else ``None``: a float, a string, and a bool (Python's or a
    bool tensor; NumPy's has no ``__index__``), which is a flag, not a number.

    Example:
        >>> import numpy as np
        >>> integer_of(np.int64(16)), integer_of(torch.tensor(16)), integer_of(16.0)
        (16, 16, None)
        >>> integer_of(True), integer_of(torch.tensor(True)), integer_of("16")
        (None, None, None)
    """
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def check_count(what: str, name: str, value: object, meaning: str, default: str) -> int | None:
    """``value`` as a count: a positive integer (:func:`integer_of`: a NumPy integer or a 0-d
    integer tensor too, returned as an int), or ``None`` (the entry point's ``default``).

    ``meaning`` says what the count is and ``default`` what ``None`` does; both go into the
    message, with the value given (``True`` is refused: it is an int to Python, not a count;
    ``16.0`` too: a float is no count).

    Raises:
        ValueError: ``value`` is neither ``None`` nor an integer ``>= 1``.

    Example:
        >>> check_count("f", "n", 0, "how many", "all")
        Traceback (most recent call last):
        ...
        ValueError: f: n must be a positive int (how many) or None (all), got 0
    """
    count = integer_of(value)
    if value is None or (count is not None and count >= 1):
        return count
    raise ValueError(
        f"{what}: {name} must be a positive int ({meaning}) or None ({default}), got {value!r}"
    )


def check_callback(what: str, name: str, fn: object) -> None:
    """Raise ``TypeError`` at entry for a callback that cannot be called (it would fail at its
    first call, after the first step)."""
    if fn is not None and not callable(fn):
        raise TypeError(
            f"{what}: {name} must be a function (called with each trace row) or None, got {fn!r}"
        )


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


@contextmanager
def errors_named(what: str, *inner: str) -> Iterator[None]:
    """The block's errors named by the entry point ``what`` the user called, not by the entry
    point ``inner`` it runs (``gr_scaling`` runs ``measure_moments``): a ``TypeError`` or
    ``ValueError`` whose message starts with ``"inner:"`` or ``"inner "`` is raised again with
    ``what`` in its place, chained from it. Subclasses (``TargetError``, an error another rank
    raised) and other messages pass as they are."""
    try:
        yield
    except (TypeError, ValueError) as err:
        text = str(err)
        name = next((n for n in inner if text.startswith((f"{n}:", f"{n} "))), None)
        if name is None or type(err) not in (TypeError, ValueError):
            raise
        raise type(err)(what + text.removeprefix(name)) from err
