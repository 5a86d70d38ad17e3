"""The folder a study report is written to (:func:`report_folder`): a report is written whole or
not at all, and one report never leaves files of another beside its own.

The report's files are written into a new folder inside ``out`` (``.initlab-report-*``, hidden)
and moved to their places in ``out`` only once every one of them is written. A report that fails
(a bad option, a store it cannot read, matplotlib missing, ``Ctrl-C``) leaves ``out`` as it found
it: a folder it made is removed, an earlier report there is left whole.

A report lists the files it wrote in ``out/.initlab-report.json`` (:data:`MANIFEST`). The next
report into the same folder removes the files of that list it does not write again (the plots of
an earlier report, after ``plots=False`` or with other variants or data sets), and the folders
under ``out`` they leave empty. Nothing else in ``out`` is touched: a file the user put there is
in no list. A report an initlab without the list wrote is recognized by its ``report.html`` (an
``initlab bench report`` page) and its files by the names a report gives them
(:data:`REPORT_FILE`).

The staging folder's name carries the writing process's id and machine (:func:`_stage_prefix`):
a report removes the staging folders a killed report left (``SIGKILL``, a power cut), those of
this machine whose process is gone, never one of a report still writing
(:func:`_remove_dead_stages`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from initlab.study.claims import machine_id, process_is_gone

__all__ = ["MANIFEST", "REPORT_FILE", "report_folder"]

#: The list of the files the last report into a folder wrote (JSON, paths relative to it).
MANIFEST = ".initlab-report.json"

#: The paths (relative to the report folder) of the files a report writes: what is removed of an
#: earlier report that has no :data:`MANIFEST`.
REPORT_FILE = re.compile(
    r"report\.html|table2\.md|(runs|sensitivity|table2|paired|per_dataset|per_lr|init_cost)\.csv"
    r"|plots/sensitivity\.png|plots/[A-Za-z0-9_.=-]+/(iqr|curves)_[^/]+\.png"
)


@contextmanager
def report_folder(out: Path) -> Iterator[Path]:
    """A new, empty folder to write a report into; its files move into ``out`` (made, with its
    parents, where missing) when the block ends without an error, and the files of the earlier
    report there that this one did not write are removed (module docstring).

    On an error, nothing is left: the new folder is removed, and so are the folders made for
    ``out``; files already in ``out`` are untouched.
    """
    made = [p for p in (out, *out.parents) if not p.exists()]  # innermost first
    out.mkdir(parents=True, exist_ok=True)
    _remove_dead_stages(out)
    stage = Path(tempfile.mkdtemp(prefix=_stage_prefix(), dir=out))
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


#: A staging folder's name (:func:`_stage_prefix`, then ``tempfile.mkdtemp``'s 8 characters):
#: the writer's process id and machine.
_STAGE = re.compile(r"\.initlab-report-(\d{1,12})@(.+)-[a-z0-9_]{8}")


def _machine_slug() -> str:
    """This machine's id (:func:`~initlab.study.claims.machine_id`: its host name and process-id
    namespace) in the characters a file name takes."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", machine_id())


def _stage_prefix() -> str:
    """``.initlab-report-<pid>@<machine>-``: the start of this process's staging folder's name."""
    return f".initlab-report-{os.getpid()}@{_machine_slug()}-"


def _remove_dead_stages(out: Path) -> None:
    """Remove the staging folders in ``out`` of reports that were killed while writing: those
    whose name (:data:`_STAGE`) carries this machine and a process id no process has now. The
    folder of a report still writing is kept (its process runs), so is one of another machine
    (``out`` on a shared disk: its process cannot be looked up here) and one an older initlab
    made (no process id in its name)."""
    here = _machine_slug()
    for path in out.glob(".initlab-report-*"):
        found = _STAGE.fullmatch(path.name)
        if found is None or found[2] != here or path.is_symlink() or not path.is_dir():
            continue
        if process_is_gone(int(found[1])):
            shutil.rmtree(path, ignore_errors=True)


def _move_in(stage: Path, out: Path) -> None:
    """Move every file under ``stage`` to the same place under ``out``, remove the earlier
    report's other files, write the new list, then remove ``stage``."""
    earlier = _earlier_files(out)
    written = sorted(p.relative_to(stage).as_posix() for p in stage.rglob("*") if p.is_file())
    for name in written:
        target = out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(stage / name, target)
    for name in sorted(set(earlier) - set(written)):
        _remove(out, name)
    listing = stage / MANIFEST
    listing.write_text(json.dumps({"written_by": "initlab bench report", "files": written}))
    os.replace(listing, out / MANIFEST)
    shutil.rmtree(stage)


def _earlier_files(out: Path) -> list[str]:
    """The files the earlier report in ``out`` wrote: its :data:`MANIFEST`'s list, or without one
    (an older initlab's report), the report's file names there beside its ``report.html``."""
    try:
        listed = json.loads((out / MANIFEST).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, TypeError, KeyError):
        listed = None
    if isinstance(listed, list) and all(isinstance(name, str) for name in listed):
        return [name for name in listed if _inside(name)]
    try:
        page = (out / "report.html").read_text(encoding="utf-8", errors="replace")[:2000]
    except OSError:
        return []
    if "<title>initlab bench report" not in page:
        return []  # no report of ours: nothing here is
    found = (p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    return [name for name in found if REPORT_FILE.fullmatch(name)]


def _inside(name: str) -> bool:
    """``name`` is a path relative to the report folder that stays inside it."""
    parts = Path(name).parts
    return bool(parts) and not Path(name).is_absolute() and ".." not in parts


def _remove(out: Path, name: str) -> None:
    """Remove the file ``out/name`` (not a folder) and the folders above it, up to ``out``, that
    it leaves empty."""
    path = out / name
    if path.is_dir() and not path.is_symlink():
        return
    try:
        path.unlink()
    except FileNotFoundError:
        return
    for folder in path.parents:
        if folder == out or out not in folder.parents:
            return
        try:
            folder.rmdir()
        except OSError:  # not empty
            return
