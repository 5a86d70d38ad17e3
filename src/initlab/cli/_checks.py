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
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "check_device",
    "check_distinct",
    "check_not_empty",
    "check_out_dir",
    "check_out_file",
    "check_store",
    "data_root_note",
    "fraction",
    "make_parent",
    "number_type",
    "positive_float",
    "positive_int",
    "seed_int",
    "split_names",
    "store_schemes",
    "translate",
    "translate_strings",
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


def check_not_empty(flag: str, value: str | None, example: str) -> None:
    """Refuse ``--flag ''`` (which would otherwise read as "not given")."""
    if value is not None and not str(value).strip():
        raise ValueError(f"{flag} is empty; give {example}, or leave {flag} out")


def split_names(flag: str, text: str, what: str, example: str) -> list[str]:
    """The comma-separated names of ``flag text``, stripped; a value that names no ``what``
    (``''``, ``,``) is refused, where it would otherwise read as an empty choice."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ValueError(f"{flag} {text!r} names no {what}; give e.g. {example}")
    return names


def _follow_link(flag: str, path: Path) -> Path:
    """The path a symbolic link leads to (``path`` itself if it is not a link); a loop of links,
    or a link to a place whose folder does not exist, is refused."""
    if not path.is_symlink():
        return path
    try:
        target = path.resolve()
    except (OSError, RuntimeError):  # a loop of links
        raise ValueError(
            f"{flag} {path} is a symbolic link that leads back to itself (a loop of links); "
            "give another path"
        ) from None
    if not target.exists() and not target.parent.is_dir():
        raise ValueError(
            f"{flag} {path} is a symbolic link to {target}, whose folder does not exist; create "
            "that folder or give another path"
        )
    return target


def _existing_above(flag: str, folder: Path, target: Path | None = None) -> Path:
    """The nearest existing folder at or above ``folder``, where the missing ones will be made."""
    for above in (folder, *folder.parents):
        if above.exists():
            if not above.is_dir():
                raise ValueError(
                    f"{flag} {target or folder}: {above} is a file, and a folder is needed "
                    "there; give another path"
                )
            return above
        if above.is_symlink():  # a link that leads nowhere
            raise ValueError(
                f"{flag} {target or folder}: {above} is a symbolic link to "
                f"{os.readlink(above)}, which does not exist; create it or give another path"
            )
    return Path(".")


def _probe_writable(flag: str, folder: Path, target: Path | None = None, what: str = "") -> None:
    """Write and remove a uniquely named small file in ``folder`` (``os.access`` says yes to
    root, and to /proc); ``target`` itself is never touched, so a store another process is
    creating at that path at the same time is safe."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".initlab-write-test-"):
            pass
    except OSError as err:
        if not what:
            what = "cannot write this file" if target is not None else "cannot write in this folder"
        raise _refuse(flag, target or folder, err, what) from None


def _check_folder(flag: str, folder: Path, target: Path | None = None) -> None:
    """``folder`` can be written, or made where it is missing (it is not made now: a command
    that stops on a later check leaves nothing behind; the writer makes it)."""
    above = _existing_above(flag, folder, target)
    if above == folder:
        _probe_writable(flag, folder, target)
    elif target is None:
        _probe_writable(flag, above, folder, "cannot create the folder")
    else:
        _probe_writable(flag, above, target, f"cannot create its folder {folder}")


def _check_writable_file(flag: str, path: Path, shown: Path) -> None:
    """An existing file: a regular file (or the null device) that opens for writing; it is not
    changed now."""
    if os.path.realpath(path) == os.devnull:
        return
    if not path.is_file():
        raise ValueError(
            f"{flag} {shown} is not a regular file (a device, a pipe or a socket), so the "
            "output cannot be written there; give a file path"
        )
    try:
        with open(path, "r+b"):
            pass
    except OSError as err:
        raise _refuse(flag, shown, err, "cannot write this file") from None


def check_out_file(flag: str, value: str | os.PathLike[str]) -> Path:
    """A file the command will write: not empty, not a folder, not ``-``, not a device; its
    folder writable (a missing one can be made; it is made when the file is written).

    Returns the path. An existing file is opened for writing (not truncated) and left as it
    is; it is overwritten at the end. A symbolic link is followed (the file it leads to is
    written).
    """
    if not str(value).strip():
        raise ValueError(f"{flag} is empty; give a file path, e.g. {flag} out.pt")
    if str(value) == "-":
        raise ValueError(
            f"{flag} -: the output cannot go to stdout (it is a binary or JSON file); give a "
            "file path (./- for a file named '-')"
        )
    shown = Path(value)
    path = _follow_link(flag, shown)
    if path.is_dir():
        raise ValueError(f"{flag} {shown} is a folder; give a file path, e.g. {shown / 'out.pt'}")
    if path.exists():
        _check_writable_file(flag, path, shown)
    else:
        _check_folder(flag, path.parent, shown)
    return shown


def make_parent(path: Path) -> Path:
    """Make the folder ``path`` is written in (checked before by :func:`check_out_file`)."""
    Path(os.path.realpath(path)).parent.mkdir(parents=True, exist_ok=True)
    return path


def check_out_dir(flag: str, value: str | os.PathLike[str]) -> Path:
    """A folder the command will write files into: writable, or one that can be made (the writer
    makes it). Returns the path."""
    if not str(value).strip():
        raise ValueError(f"{flag} is empty; give a folder, e.g. {flag} report")
    shown = Path(value)
    path = _follow_link(flag, shown)
    if path.exists() and not path.is_dir():
        _existing_above(flag, path)  # the message for a file
    _check_folder(flag, path)
    return shown


def check_distinct(*named: tuple[str, str | os.PathLike[str] | None]) -> None:
    """Refuse two of the command's paths (``(flag, path)`` pairs; ``None``: not given) that are
    the same file: one would overwrite the other."""
    seen: dict[str, str] = {}
    for flag, value in named:
        if value is None or not str(value).strip():
            continue
        real = os.path.realpath(value)
        if real in seen:
            raise ValueError(
                f"{flag} {value} is the same file as {seen[real]}, which {flag} would "
                "overwrite; give another path"
            )
        seen[real] = f"{flag} {value}"


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
    """A SQLite store path: an existing initlab store (or, unless ``must_exist``, an empty file,
    or a new file whose folder can be written). Another application's SQLite database is refused,
    unchanged: a store is never made inside it.

    A store to write (``initlab bench run``) and its write-ahead log (``<store>-wal``,
    ``<store>-shm``) beside it need the file and its folder writable; a store to report
    (``must_exist``) is only read, and must be an initlab store, not any SQLite file."""
    if not str(value).strip():
        raise ValueError(f"{flag} is empty; give a store file, e.g. results/study.sqlite")
    shown = Path(value)
    path = _follow_link(flag, shown)
    if path.is_dir():
        raise ValueError(
            f"{flag} {shown} is a folder; a store is one SQLite file: give a file path such as "
            f"{shown / 'study.sqlite'}"
        )
    wrote = "the store `initlab bench run` wrote"
    if not path.exists():
        if must_exist:
            raise ValueError(f"{flag} {shown} does not exist; give {wrote}")
        return check_out_file(flag, shown)
    if not path.is_file():
        raise ValueError(f"{flag} {shown} is not a regular file; give {wrote}")
    try:
        with open(path, "rb") as fh:
            head = fh.read(len(_SQLITE_HEADER))
    except OSError as err:
        raise _refuse(flag, shown, err, "cannot read the store") from None
    if head and head != _SQLITE_HEADER:
        raise ValueError(
            f"{flag} {shown} is not a SQLite store (it is another kind of file); give {wrote}"
            + ("" if must_exist else ", or a new path")
        )
    if must_exist and not head:
        raise ValueError(f"{flag} {shown} is empty (0 bytes), not a store; give {wrote}")
    if head:
        _check_is_store(flag, path, shown, f"give {wrote}" if must_exist else "")
    if not must_exist:  # a report opens the store read-only (Store(read_only=True))
        _check_store_writable(flag, path, shown)
    if must_exist and not _has_runs_table(path):
        raise ValueError(
            f"{flag} {shown} is a SQLite file but not an initlab store (it has no runs table); "
            f"give {wrote}"
        )
    return shown


def _check_is_store(flag: str, path: Path, shown: Path, advice: str) -> None:
    """Refuse an existing, non-empty SQLite file that is not an initlab store (another
    application's database: a mistyped ``--store`` must not change it), read only."""
    from initlab.study.store import not_a_store

    reason = not_a_store(path)
    if reason is not None:
        advice = advice or (
            f"initlab changes nothing in it: give another {flag} path (a new file is made there)"
        )
        raise ValueError(f"{flag} {shown} {reason}; {advice}")


def _check_store_writable(flag: str, path: Path, shown: Path) -> None:
    """The store file opens for writing, and its write-ahead log can be written beside it."""
    advice = "give a store in a writable folder (or copy it to one)"
    try:
        with open(path, "r+b"):
            pass
    except OSError as err:
        reason = err.strerror or str(err)
        raise ValueError(f"{flag} {shown}: cannot write the store ({reason}); {advice}") from None
    logs = [path.with_name(path.name + suffix) for suffix in ("-wal", "-shm")]
    try:
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".initlab-write-test-"):
            return
    except OSError as err:
        if all(_opens_for_writing(log) for log in logs):
            return  # SQLite uses the logs there
        reason = err.strerror or str(err)
        raise ValueError(
            f"{flag} {shown}: cannot write in its folder {path.parent} ({reason}); {advice}"
        ) from None


def _opens_for_writing(path: Path) -> bool:
    try:
        with open(path, "r+b"):
            return True
    except OSError:
        return False


def _has_runs_table(path: Path) -> bool:
    from initlab.study.store import reading

    try:
        with reading(path) as conn:  # sees a running driver's tables, still in its WAL
            row = conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'runs'"
            ).fetchone()
    except sqlite3.Error:
        return False
    return row is not None


def store_schemes(path: Path, study: str | None = None) -> set[str]:
    """The schemes of the runs a store holds (of ``study``, if given), read-only."""
    from initlab.study.store import reading

    query = "SELECT DISTINCT scheme FROM runs"
    params: tuple[str, ...] = ()
    if study is not None:
        query, params = (
            "SELECT DISTINCT r.scheme FROM runs r JOIN study_runs s ON r.key = s.key "
            "WHERE s.study = ?",
            (study,),
        )
    try:
        with reading(path) as conn:
            rows = conn.execute(query, params).fetchall()
    except sqlite3.Error:
        return set()
    return {str(r[0]) for r in rows}


def data_root_note(root: Path, how: str) -> str | None:
    """What ``initlab data`` warns of a data root ``root`` (chosen ``how``) that is no folder
    or does not look like one (``None`` where it is one)."""
    if root.is_dir():
        from initlab.data.catalogue import misplaced_root

        misplaced = misplaced_root(root)
        if misplaced is None:
            return None
        return f"{misplaced}; the named sets under {root} show as not available"
    what = "is not a folder" if root.exists() else "does not exist"
    return (
        f"the data root {root} ({how}) {what}; only the bundled scikit-learn sets are available: "
        "put the named sets there (libsvm/, mnist/, ...), or pass --data-dir (or set "
        "INITLAB_DATA_DIR) with the folder that holds them"
    )


#: The command that writes precondition's per-layer learning rates (``lr_scale_sgd``, ...).
_PRECONDITION_LRS = "`initlab init --method precondition --how lr --report FILE`"
#: What to do about a lazy layer (``nn.LazyLinear``) the command line cannot initialize.
_LAZY = (
    "make the --model factory run one forward pass on a dummy batch before it returns the model "
    "(a lazy layer takes its shape from its first input)"
)


#: The library's Python wording -> the command line's: (pattern, replacement) pairs applied to
#: the message of every error and warning the CLI prints.
_WORDING: tuple[tuple[str, str | Callable[[re.Match[str]], str]], ...] = (
    (
        r"point root= or the INITLAB_DATA_DIR environment variable at",
        "pass --data-dir (or set the INITLAB_DATA_DIR environment variable) with",
    ),
    (r"\(data root (\S+), from root=\)", r"(data root \1, from --data-dir)"),
    (  # _core.dtypes.dtype_error: the data comes from a file here, the model from a factory
        r"convert it \(x\.to\(([\w.]+)\)((?:, x\.\w+\(\))?), in the dataset or a collate_fn\), "
        r"or the model \(model\.to\(([\w.]+)\)\)",
        r"convert the data before saving it (x.to(\1)\2), or have the factory build the model "
        r"in \3",
    ),
    (  # the same, for integer or bool inputs (the model cannot be built in their dtype)
        r"convert it \(x\.to\(([\w.]+)\)((?:, x\.\w+\(\))?), in the dataset or a collate_fn\)",
        r"convert the data before saving it (x.to(\1)\2)",
    ),
    (r"pass policy='warn' or 'skip'", "pass --policy warn or --policy skip"),
    (  # doctor's summary: the command keeps no model to undo the hook on
        r"; report\.reports\['output_scale'\]\.info\['handle'\]\.remove\(\) undoes it",
        "; the command does not save the model (in Python, the report's handle removes it)",
    ),
    (r"\bpolicy='(\w+)'", r"--policy \1"),
    (r"\(or True\)", "(or --fix alone for the recommended ones)"),
    (r"use modules='leaves' or 'all' to probe it", "give a model with parameters"),
    (
        r"forward=lambda model, batch: \.\.\. with a loss on the outputs, or a "
        r"loss_fn\(model, batch\) that calls the model itself",
        "or --loss pkg.module:fn, a function fn(model, batch) that calls the model itself",
    ),
    (
        r"Pass dict batches of its keyword arguments, a loss_fn\(model, batch\) that calls the "
        r"model itself and names the target \(e\.g\. .*? for \(x, z, y\) batches\), or, where "
        r"the function takes one, a forward= that leaves the target at batch\[1\], .*? \(model"
        r"\(\*batch\) where no loss reads a target\)",
        "Make --data give dict batches of its keyword arguments, or pass --loss pkg.module:fn, a "
        "function fn(model, batch) that calls the model itself",
    ),
    (
        r"initlab\.Batches\(\[\.\.\.\]\) for (\d+) batches, or a tuple \(x, y, \.\.\.\) for "
        r"one batch",
        r"save a list of (x, y) tuples for \1 batches, or a tuple (x, y, ...) for one batch",
    ),
    (  # DATA_FORMS: the last form in a list of them
        r", a list of \(x, y\) tuples, or initlab\.Batches\(\[\.\.\.\]\)",
        ", or a list of (x, y) tuples (in a --data .pt file saved with torch.save, or returned by "
        "a --data function)",
    ),
    (
        r"\bthe loss '([^']+)' returned (\w+), not a tensor",
        r"the --loss function '\1' returned \2, not a tensor",
    ),
    (r"\bpass study= with one of these names", "pass --study with one of these names"),
    (
        r"\bor run them as studies \(initlab\.study\.run_study\)",
        "or run them as studies (`initlab bench run SPEC`, one spec per protocol)",
    ),
    (r"\bn_boot must be >= 1", "--n-boot must be >= 1"),
    (r"\blevel must be in \(0, ?1\)", "--level must be in (0, 1)"),
    (r"\bstale_after must be positive", "--stale-after must be positive"),
    (
        r"\bstale_after \((.+?)\) must be longer than heartbeat_s \((.+?)\)",
        r"--stale-after (\1) must be longer than --heartbeat (\2)",
    ),
    # doctor's fixes, as its checks name them (the ``fix`` column, the reasons given); before
    # the how= below
    (r"\binit_model\(model, 'geometric'\)", "the geometric init (--fix init)"),
    (r"\blsuv_\(model, data\)", "--fix lsuv"),
    (
        r"\bscale_output_\(model, data, target=sqrt\(0\.2 ln C\) / 2, how='hook'\)",
        "--fix output_scale (the logits' std to sqrt(0.2 ln C) / 2)",
    ),
    (
        r"\bprecondition_\(model, data, how='lr'\) → preconditioned_param_groups",
        f"--fix precondition (per-layer learning rates, which {_PRECONDITION_LRS} writes)",
    ),
    (
        r"use how='lr' or how='parametrize'",
        "use --how lr (the weights unchanged, per-layer learning-rate scales)",
    ),
    (r"\bhow='(\w+)'", r"--how \1"),
    (
        r"\bpass a loss_fn\(model, batch\) that",
        "pass --loss pkg.module:fn, a function fn(model, batch) that",
    ),
    (
        r"MomentProbe\(modules='\w+'\) selects no module: the model has no parameters; give a "
        r"model with parameters",
        "the --model has no parameters, so there is nothing to measure; give a model with "
        "parameters",
    ),
    (  # _core.backward.check_trainable
        r"\bthe model has no parameters, so there is nothing to",
        "the --model has no parameters, so there is nothing to",
    ),
    (  # gradinit's DoubleBackwardError: the command line has no --gamma (it runs gamma=1)
        r"\braise gamma above the gradient norms of the trace so that no constraint step is taken "
        r"\(the objective steps of exact=False are first-order\)",
        "use --method lsuv or --method scale_output, which need no derivative (the command line "
        "runs gradinit with gamma 1, so it takes a constraint step wherever the gradient norm "
        "exceeds 1)",
    ),
    (r"\bbatch_size must be in", "--batch-size must be in"),
    (
        r"drop short batches \(a DataLoader's last batch: DataLoader\(\.\.\., drop_last=True\)\)",
        "use --batch-size 2 or more, one that leaves no last batch of a single example (or lower "
        "--max-batches); data that is already batched must leave out its batches of one example",
    ),
    (
        r"\(filter them out, or use a DataLoader with drop_last=True\)",
        "(leave them out of the --data file or function)",
    ),
    (r"\(fix=False\)", "(no --fix)"),
    (r"\bdoctor\(model, data, fix='(\w+)'\)", r"the same command with --fix \1"),
    (r"\bdoctor\(model, data, fix=True\)", "the same command with --fix"),
    (r"\bblock_curvature\(model, data\)", "initlab diagnose --curvature"),
    (r"\bblock_curvature measures\b", "initlab diagnose --curvature measures"),
    (
        r"\bprecondition_: train with report\.param_groups\(model, lr=\.\.\.\)",
        f"precondition: train with its per-layer learning rates, which {_PRECONDITION_LRS} writes",
    ),
    (
        r"\bwith report\.param_groups\(model, lr=\.\.\.\):",
        f"with precondition's per-layer learning rates (which {_PRECONDITION_LRS} writes):",
    ),
    (
        r"\breport\.param_groups\(model, lr=\.\.\.\) multiplies",
        f"precondition's per-layer learning rates (which {_PRECONDITION_LRS} writes) multiply",
    ),
    (
        r"\bwhen training with report\.param_groups\(model, lr=\.\.\.\) \(the learning rates of "
        r"precondition_'s multipliers;",
        f"when training with precondition's per-layer learning rates (which {_PRECONDITION_LRS} "
        "writes;",
    ),
    (r"\bunchanged by precondition_\b", "unchanged by precondition"),
    (
        r"\brun a forward pass \(or materialize the module\) before asking for its fans",
        _LAZY,
    ),
    (
        r"\brun the model once on a batch \(model\(x\)\) so that they take their shapes, then "
        r"call \w+ again",
        _LAZY,
    ),
    (
        r" with a dummy batch to initialize the parameters before calling torch functions",
        " with a dummy batch to initialize the parameters; the --model factory must do that "
        "before it returns the model (a lazy layer takes its shape from its first input)",
    ),
)


#: batches of --method's data when neither --max-batches nor --steps says
DEFAULT_INIT_BATCHES = 8


def _batches_needed(args: argparse.Namespace) -> int:
    """The batches gradinit and metainit read: gradinit batch t and t+1 per step, metainit one
    batch per step (``--steps``; without it, one step at least)."""
    steps = args.steps if args.steps is not None else 1
    return steps + 1 if args.method == "gradinit" else steps


def max_batches_for(args: argparse.Namespace) -> int:
    """``--max-batches``, or its default raised to what ``--steps`` needs."""
    if args.max_batches is not None:
        return int(args.max_batches)
    if args.steps is not None and args.method in ("gradinit", "metainit"):
        return max(DEFAULT_INIT_BATCHES, _batches_needed(args))
    return DEFAULT_INIT_BATCHES


def _either(options: list[str]) -> str:
    """``"a, b or c"``."""
    return " or ".join([", ".join(options[:-1]), options[-1]] if len(options) > 1 else options)


def check_batch_count(args: argparse.Namespace, data: list[Any], batched: bool) -> None:
    """gradinit and metainit: refuse data with fewer batches than their steps read, saying which
    of --max-batches, --batch-size, --data or --steps to change."""
    if args.method not in ("gradinit", "metainit"):
        return
    extra = 1 if args.method == "gradinit" else 0
    need = _batches_needed(args)
    if len(data) >= need:
        return
    limit = max_batches_for(args)
    fixes = [f"pass --max-batches {need} or more"] if limit < need else []
    if len(data) < min(limit, need):  # the data itself has too few
        more = "give --data with more batches" if batched else "give more data"
        fixes += [more] if batched else [f"lower --batch-size (now {args.batch_size})", more]
    if args.steps is not None and len(data) > extra:
        fixes.append(f"lower --steps to {len(data) - extra}")
    steps = f" --steps {args.steps}" if args.steps is not None else ""
    reads = " (each step reads batch t and t+1)" if extra else " (one per step)"
    raise ValueError(
        f"--method {args.method}{steps} needs {need} batches{reads}, but --data "
        f"{args.data or 'random'} gave only {len(data)} (--max-batches is {limit}); "
        f"{_either(fixes)}"
    )


def command_name(args: argparse.Namespace) -> str:
    """``"init"``, ``"bench run"``: the command as the user typed it."""
    sub = getattr(args, "bench_command", None)
    return f"{args.command} {sub}" if sub else str(args.command)


def note(args: argparse.Namespace, text: str) -> None:
    """A one-line warning on stderr: ``initlab <cmd>: warning: <text>``."""
    print(f"initlab {command_name(args)}: warning: {text}", file=sys.stderr, flush=True)


#: Code quoted in a message (`initlab.precondition_(model, data, how='parametrize')`).
_CODE = re.compile(r"(`[^`\n]*`)")


def translate_strings(obj: Any) -> Any:
    """``obj`` (what ``json.loads`` returns) with :func:`translate` applied to every string in it
    (the keys kept as they are): a saved report says what the command line printed."""
    if isinstance(obj, str):
        return translate(obj)
    if isinstance(obj, list):
        return [translate_strings(v) for v in obj]
    if isinstance(obj, dict):
        return {k: translate_strings(v) for k, v in obj.items()}
    return obj


def translate(message: str) -> str:
    """``message`` with the library's Python wording replaced by the command line's flags; code
    between backticks is Python (or a shell command) and is kept as written."""
    parts = _CODE.split(message)
    for i in range(0, len(parts), 2):  # the odd parts are the code
        for pattern, repl in _WORDING:
            parts[i] = re.sub(pattern, repl, parts[i])
    return "".join(parts)
