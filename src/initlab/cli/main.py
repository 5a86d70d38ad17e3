"""The ``initlab`` command: ``schemes``, ``init``, ``diagnose``, ``doctor``, ``data``, ``bench``,
``demo``.

The options are parsed in :mod:`initlab.cli.parser` (and only there), the commands run in
:mod:`initlab.cli.commands` (each calls the library's public functions), their errors are
worded in :mod:`initlab.cli.errors`.

Errors: :func:`main` is the one place that handles them. Any exception a command raises is printed
as one line, ``initlab <command>: error: <message>``, without a traceback (the global ``--debug``
flag prints the traceback as well); the exit code is 2 for bad input (``ValueError``,
``TypeError``, ``ImportError``, ``LookupError``, ``OSError``, ``ArithmeticError``, and a model
that cannot run on the data: a shape or dtype mismatch) and 1 for anything else.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence

from initlab.cli._checks import command_name, note
from initlab.cli.errors import command_io, exit_code, message
from initlab.cli.parser import parse

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``initlab`` command; returns the exit code.

    Every error of a command is printed as ``initlab <command>: error: <message>`` on stderr (the
    traceback too with ``--debug``); see the module docstring for the exit codes. A closed
    stdout (``initlab init ... | head -1``) is not an error: the files are written and the rest
    of the output is dropped.
    """
    args = parse(argv)
    name = command_name(args)
    with command_io(args):
        for text in getattr(args, "deprecated", ()):
            note(args, text)
        try:
            return int(args.func(args))
        except KeyboardInterrupt:
            print(f"initlab {name}: interrupted", file=sys.stderr)
            return 130
        except Exception as err:
            if args.debug:
                traceback.print_exc()
            from initlab.cli.inputs import blame_loss

            # an error of the user's --loss function names it
            err = blame_loss(err, getattr(args, "loss", None), lambda e: message(e, args.command))
            print(f"initlab {name}: error: {message(err, args.command)}", file=sys.stderr)
            return exit_code(err)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
