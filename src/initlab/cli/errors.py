"""How a command's errors and output reach the user: one line per error (its exit code 2 for bad
input, 1 for anything else), warnings as notes, and a stdout whose reader went away."""

from __future__ import annotations

import argparse
import io
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from initlab.cli._checks import note, translate

__all__ = ["command_io", "exit_code", "message"]


#: Exceptions that report bad input (exit code 2); any other exception exits with 1.
_INPUT_ERRORS = (ValueError, TypeError, ImportError, LookupError, OSError, ArithmeticError)

_SHAPE_ERRORS = (
    "shapes cannot be multiplied",
    "size of tensor",
    "expected input",
    "input of size",
    "channels, but got",
)


_DTYPE_ERRORS = ("same dtype", "expected scalar type", "should be the same")


def _mismatch_hint(err: BaseException, command: str) -> str | None:
    """What to check when the model could not run on the data (a shape or dtype mismatch torch
    raised: bad input), else ``None``."""
    if not isinstance(err, RuntimeError):
        return None
    text = str(err).lower()
    if any(s in text for s in _DTYPE_ERRORS):
        return (
            "its dtype is not the model's; convert the data before saving it, e.g. x.float() "
            "for float64 or uint8 inputs of a float32 model, y.long() for class labels"
        )
    if not any(s in text for s in _SHAPE_ERRORS):
        return None
    if command == "init":
        return "do --data, --input-shape and the model's input agree?"
    return (
        "do --data (e.g. random:3x32x32 for that shape per example) and the model's input "
        "agree? A factory's input size may be set with --model-kwargs"
    )


def exit_code(err: BaseException) -> int:
    """2 for bad input (see the module docstring), 1 for any other failure."""
    return 2 if isinstance(err, _INPUT_ERRORS) or _mismatch_hint(err, "") else 1


def message(err: BaseException, command: str = "init") -> str:
    """The one-line text of an error: its message, with the type where the message alone is
    unclear, a hint for a model that cannot run on the data, and the library's Python wording
    (``root=``, ``policy='warn'``) said with the command's flags."""
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        return f"{err.strerror}: {err.filename}"
    text = str(err).strip() or type(err).__name__
    if not isinstance(err, (ValueError, TypeError, ImportError, ArithmeticError, OSError)):
        text = f"{type(err).__name__}: {text}"
    hint = _mismatch_hint(err, command)
    if hint is not None:
        text += f" (the model could not run on the data: {hint})"
    return translate(text)


class _QuietStdout(io.TextIOBase):
    """``sys.stdout`` during a command: a reader that went away (``| head -1``) silences the
    output instead of failing the command, so every file it writes is still written.

    As Python's documentation recommends for SIGPIPE, the process's stdout is pointed at
    ``os.devnull`` once the pipe is broken, so the interpreter's final flush is quiet too.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.broken = False

    def _silence(self) -> None:
        self.broken = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):  # not a file (a test's capture)
            pass

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return int(self._stream.write(text))
            except BrokenPipeError:
                self._silence()
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._silence()

    def isatty(self) -> bool:
        return bool(self._stream.isatty())

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return str(getattr(self._stream, "encoding", "utf-8"))


@contextmanager
def command_io(args: argparse.Namespace) -> Iterator[_QuietStdout]:
    """A broken-pipe-proof stdout, and warnings printed as ``initlab <cmd>: warning: ...``."""
    quiet = _QuietStdout(sys.stdout)

    def show(message: Any, category: Any, *_args: Any, **_kwargs: Any) -> None:
        note(args, translate(" ".join(str(message).split())))

    saved = sys.stdout
    sys.stdout = quiet  # type: ignore[assignment]
    try:
        with warnings.catch_warnings():
            warnings.showwarning = show
            yield quiet
    finally:
        quiet.flush()
        sys.stdout = saved
