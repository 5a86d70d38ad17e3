"""Checks the command line runs before any work: output paths, devices, stores, numbers; and the
translation of the library's Python wording (``root=``, ``policy='warn'``) into the flags.

Every check raises ``ValueError`` (exit code 2) with a message naming the flag, the value and
what to do.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sqlite3
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "check_device",
    "check_out_dir",
    "check_out_file",
    "check_store",
    "fraction",
    "number_type",
    "positive_float",
    "positive_int",
    "seed_int",
    "store_schemes",
    "translate",
]

_SQLITE_HEADER = b"SQLite format 3\x00"


def number_type(
    convert: Callable[[str], Any], ok: Callable[[Any], bool], what: str
) -> Callable[[str], Any]:
    """An argparse type: ``convert(text)`` when ``ok`` of it, else "``what``, got 'text'"."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{what}, got {text!r}")
        return value

    return parse


#: An integer >= 1.
positive_int = number_type(int, lambda v: v >= 1, "must be a positive integer")
#: A finite number > 0 (seconds).
positive_float = number_type(
    float, lambda v: math.isfinite(v) and v > 0, "must be a finite number > 0 (seconds)"
)
#: A number strictly between 0 and 1 (an interval's coverage).
fraction = number_type(float, lambda v: 0 < v < 1, "must be in (0, 1), e.g. 0.95")


def seed_int(text: str) -> int:
    """An argparse type: a seed ``torch.Generator.manual_seed`` takes (-2**63 <= s < 2**64)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not -(2**63) <= value < 2**64:
        raise argparse.ArgumentTypeError(
            f"must fit in 64 bits (-2**63 <= seed < 2**64), got {text}"
        )
    return value


def _refuse(flag: str, path: Path, err: OSError, what: str) -> ValueError:
    reason = err.strerror or str(err)
    return ValueError(f"{reason}: {path} ({flag}: {what}; give another path)")


def _make_folder(flag: str, folder: Path, target: Path | None = None) -> None:
    """Create ``folder`` (and its parents) or raise a message naming ``flag`` (and ``target``,
    the file to be written in it)."""
    for above in (folder, *folder.parents):
        if above.exists():
            if not above.is_dir():
                raise ValueError(
                    f"{flag} {target or folder}: {above} is a file, and a folder is needed "
                    "there; give another path"
                )
            break
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        what = (
            "cannot create the folder" if target is None else f"cannot create its folder {folder}"
        )
        raise _refuse(flag, target or folder, err, what) from None


def _probe_writable(flag: str, folder: Path, target: Path | None = None) -> None:
    """Write and remove a uniquely named small file in ``folder`` (``os.access`` says yes to
    root, and to /proc); ``target`` itself is never touched, so a store another process is
    creating at that path at the same time is safe."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".initlab-write-test-"):
            pass
    except OSError as err:
        what = "cannot write this file" if target is not None else "cannot write in this folder"
        raise _refuse(flag, target or folder, err, what) from None


def check_out_file(flag: str, value: str | os.PathLike[str]) -> Path:
    """A file the command will write: not empty, not a folder, its folder created and writable.

    Returns the path. An existing file is opened for appending (not truncated) and left as it
    is; it is overwritten at the end.
    """
    if not str(value).strip():
        raise ValueError(f"{flag} is empty; give a file path, e.g. {flag} out.pt")
    path = Path(value)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder; give a file path, e.g. {path / 'out.pt'}")
    _make_folder(flag, path.parent, path)
    if path.exists():
        try:
            with open(path, "ab"):
                pass
        except OSError as err:
            raise _refuse(flag, path, err, "cannot write this file") from None
    else:
        _probe_writable(flag, path.parent, path)
    return path


def check_out_dir(flag: str, value: str | os.PathLike[str]) -> Path:
    """A folder the command will write files into: created now, writable. Returns the path."""
    if not str(value).strip():
        raise ValueError(f"{flag} is empty; give a folder, e.g. {flag} report")
    path = Path(value)
    _make_folder(flag, path)
    _probe_writable(flag, path)
    return path


def check_device(value: str, flag: str = "--device") -> str:
    """A device torch has here: ``cpu``, ``cuda``, ``cuda:1``, ``mps``; else ``ValueError``."""
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise ValueError(
            f"{flag} {value!r} is not a device; give cpu, cuda, cuda:N or mps"
        ) from None
    if device.type == "cpu":
        return value
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{flag} {value}: CUDA is not available here (torch {torch.__version__}, "
                f"built {'with' if torch.version.cuda else 'without'} CUDA); use {flag} cpu"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"{flag} {value}: this machine has {count} CUDA device(s) "
                f"(cuda:0 to cuda:{count - 1})"
            )
        return value
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"{flag} {value}: MPS is not available here; use {flag} cpu")
        return value
    raise ValueError(f"{flag} {value!r}: initlab runs on cpu, cuda, cuda:N or mps")


def check_store(value: str, *, flag: str, must_exist: bool) -> Path:
    """A SQLite store path: an existing SQLite file (or an empty one), or, unless ``must_exist``,
    a new file whose folder can be written."""
    if not str(value).strip():
        raise ValueError(f"{flag} is empty; give a store file, e.g. results/study.sqlite")
    path = Path(value)
    if path.is_dir():
        raise ValueError(
            f"{flag} {path} is a folder; a store is one SQLite file: give a file path such as "
            f"{path / 'study.sqlite'}"
        )
    if path.exists():
        try:
            with open(path, "rb") as fh:
                head = fh.read(len(_SQLITE_HEADER))
        except OSError as err:
            raise _refuse(flag, path, err, "cannot read the store") from None
        if head and head != _SQLITE_HEADER:
            raise ValueError(
                f"{flag} {path} is not a SQLite store (it is another kind of file); give the "
                "store `initlab bench run` wrote, or a new path"
            )
        return path
    if must_exist:
        raise ValueError(f"{flag} {path} does not exist; give the store `initlab bench run` wrote")
    return check_out_file(flag, path)


def store_schemes(path: Path, study: str | None = None) -> set[str]:
    """The schemes of the runs a store holds (of ``study``, if given), read-only."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        if study is None:
            rows = conn.execute("SELECT DISTINCT scheme FROM runs").fetchall()
        else:
            rows = conn.execute(
                "SELECT DISTINCT r.scheme FROM runs r JOIN study_runs s ON r.key = s.key "
                "WHERE s.study = ?",
                (study,),
            ).fetchall()
    except sqlite3.Error:
        return set()
    finally:
        conn.close()
    return {str(r[0]) for r in rows}


#: The library's Python wording -> the command line's: (pattern, replacement) pairs applied to
#: the message of every error and warning the CLI prints.
_WORDING: tuple[tuple[str, str | Callable[[re.Match[str]], str]], ...] = (
    (
        r"point root= or the INITLAB_DATA_DIR environment variable at",
        "pass --data-dir (or set the INITLAB_DATA_DIR environment variable) with",
    ),
    (r"\(data root (\S+), from root=\)", r"(data root \1, from --data-dir)"),
    (r"pass policy='warn' or 'skip'", "pass --policy warn or --policy skip"),
    (r"\bpolicy='(\w+)'", r"--policy \1"),
    (r"\(or True\)", "(or --fix alone for the recommended ones)"),
    (r"use modules='leaves' or 'all' to probe it", "give a model with parameters"),
    (
        r"forward=lambda model, batch: \.\.\. with a loss on the outputs, or a "
        r"loss_fn\(model, batch\) that calls the model itself",
        "or --loss pkg.module:fn, a function fn(model, batch) that calls the model itself",
    ),
    (
        r"initlab\.Batches\(\[\.\.\.\]\) for (\d+) batches, or a tuple \(x, y, \.\.\.\) for "
        r"one batch",
        r"save a list of (x, y) tuples for \1 batches, or a tuple (x, y, ...) for one batch",
    ),
    (r"or initlab\.Batches\(\[\.\.\.\]\)", "(save them with torch.save)"),
    (r"\bn_boot must be >= 1", "--n-boot must be >= 1"),
    (r"\blevel must be in \(0, ?1\)", "--level must be in (0, 1)"),
    (
        r"pass a loader with at least (\d+) batches or lower steps",
        r"pass --max-batches \1 or more (with --data that has that many batches of "
        r"--batch-size), or a lower --steps",
    ),
    (r"\bstale_after must be positive", "--stale-after must be positive"),
    (r"\bbatch_size must be in", "--batch-size must be in"),
)


def translate(message: str) -> str:
    """``message`` with the library's Python wording replaced by the command line's flags."""
    for pattern, repl in _WORDING:
        message = re.sub(pattern, repl, message)
    return message
