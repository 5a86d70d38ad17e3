"""The folder a study report is written to (:func:`report_folder`): a report is written whole or
not at all.

The report's files are written into a new folder inside ``out`` (``.initlab-report-*``, hidden)
and moved to their places in ``out`` only once every one of them is written. A report that fails
(a bad option, a store it cannot read, matplotlib missing, ``Ctrl-C``) leaves ``out`` as it found
it: a folder it made is removed, an earlier report there is left whole.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["report_folder"]


@contextmanager
def report_folder(out: Path) -> Iterator[Path]:
    """A new, empty folder to write a report into; its files move into ``out`` (made, with its
    parents, where missing) when the block ends without an error.

    On an error, nothing is left: the new folder is removed, and so are the folders made for
    ``out``; files already in ``out`` are untouched.
    """
    made = [p for p in (out, *out.parents) if not p.exists()]  # innermost first
    out.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".initlab-report-", dir=out))
    try:
        yield stage
        _move_in(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        for folder in made:
            try:
                folder.rmdir()
            except OSError:  # not empty: not only ours
                break
        raise


def _move_in(stage: Path, out: Path) -> None:
    """Move every file under ``stage`` to the same place under ``out``, then remove ``stage``."""
    for path in sorted(p for p in stage.rglob("*") if not p.is_dir()):
        target = out / path.relative_to(stage)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
    shutil.rmtree(stage)
