"""LIBSVM text format: ``label idx:value idx:value ...`` with 1-based, sparse feature indices.

Rules (those of LIBSVM's own reader, plus what real files need):

* one example per line; a label (an integer, possibly negative; ``+1`` and ``2.0`` are accepted)
  followed by ``index:value`` pairs; missing indices (including trailing ones) are zeros;
* text from ``#`` to the end of a line is a comment; blank lines are skipped; ``\\r\\n`` line ends
  and a last line without a newline are fine; lines ending in ``\\r`` alone (classic Mac OS) and
  compressed files (gzip, bzip2, xz, zip, zstd: told by their first bytes) are errors that say so;
* an index is an integer ``>= 1`` and appears at most once per line; ``n_features`` defaults to the
  largest index in the file, so pass it explicitly when train and test files must agree; without
  ``n_features`` an index above :data:`MAX_FEATURE_INDEX` is an error (a typo such as
  ``1000000000000:1`` would otherwise ask for terabytes);
* the dense ``float32`` matrix may take at most :data:`MAX_DENSE_BYTES`; a larger one is refused
  with its size, before it is allocated;
* a value is a finite number that ``float32`` holds: ``nan``, ``inf`` and values beyond
  ``±3.4e38`` are errors (NumPy and ``float()`` would read the first two silently); Python's
  digit separators (``1_000``, in a label, index or value) are errors, as in LIBSVM's reader;
* a label fits in a signed 64-bit integer;
* labels become class indices by sorted order (``-3, -1, 2`` → ``0, 1, 2``) and
  :attr:`Dataset.label_map` keeps the originals; pass the training split's ``label_map`` when
  loading a test split so both use the same classes.

Any violation raises ``ValueError("<file>:<line>: <what>")``.

Parsing is vectorized: Python only splits each line into its label and the rest; all ``idx:value``
text is joined and converted by NumPy in one call, and the matrix is filled with one scatter. A
file the fast path rejects is parsed again token by token (the reference parser) to name the
offending line.
"""

from __future__ import annotations

import hashlib
import os
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from initlab.data.cache import CacheDir, cached
from initlab.data.dataset import Dataset

__all__ = ["MAX_DENSE_BYTES", "MAX_FEATURE_INDEX", "load_libsvm"]

#: The largest feature index read without an explicit ``n_features`` (2**24: more than any
#: LIBSVM set that fits a dense matrix); pass ``n_features`` for a wider file.
MAX_FEATURE_INDEX = 2**24

#: The largest dense matrix :func:`load_libsvm` builds, in bytes (8 GiB); raise it for a bigger
#: data set that fits in memory.
MAX_DENSE_BYTES = 8 * 2**30

#: First bytes of compressed files -> the compression's name.
_COMPRESSED = {
    b"\x1f\x8b": "gzip",
    b"BZh": "bzip2",
    b"\xfd7zXZ\x00": "xz",
    b"PK\x03\x04": "zip",
    b"\x28\xb5\x2f\xfd": "zstd",
}

_INT64 = np.iinfo(np.int64)

# A token with two colons or more.
_DOUBLE_COLON = re.compile(r":[^\s:]*:")

_FLOAT32_MAX = float(np.finfo(np.float32).max)

#: The rules' revision, part of the cache key: an entry decoded under rules that read a file this
#: loader now refuses is not served (2: Python's digit separators, ``1_000``, refused).
_RULES = 2


class _Parsed(NamedTuple):
    x: np.ndarray  # (N, n_features) float32
    labels: np.ndarray  # (N,) int64, as stored
    lines: np.ndarray  # (N,) int64, 1-based line number of each example


def _number(text: str) -> float | None:
    """``text`` as a number, as C's ``strtod`` (LIBSVM's reader) and NumPy read it, or None:
    Python's ``float()``, but not its digit separators (``1_000``), which they refuse."""
    if "_" in text:
        return None
    try:
        return float(text)
    except ValueError:
        return None


def _integer(text: str) -> int | None:
    """``text`` as an integer (``"+3"``, ``"3.0"``, ``"3e0"`` too, as NumPy reads them), or None
    (also for Python's digit separators, ``1_0``: :func:`_number`)."""
    if "_" in text:
        return None
    try:
        return int(text)
    except ValueError:
        pass
    value = _number(text)
    return int(value) if value is not None and value.is_integer() else None


def _label(token: str, source: str, lineno: int) -> int:
    label = _integer(token)
    if label is None:
        raise ValueError(f"{source}:{lineno}: bad label {token!r} (labels must be integers)")
    if not _INT64.min <= label <= _INT64.max:
        raise ValueError(
            f"{source}:{lineno}: label {token!r} is out of range (labels must fit in a signed "
            "64-bit integer)"
        )
    return label


def _check_dense(n_rows: int, width: int, source: str) -> None:
    """Refuse a dense matrix larger than :data:`MAX_DENSE_BYTES`, saying how big it would be."""
    size = n_rows * width * 4
    if size > MAX_DENSE_BYTES:
        raise ValueError(
            f"{source}: {n_rows:,} examples x {width:,} features make a dense float32 matrix of "
            f"{size / 2**30:,.1f} GiB, more than initlab.data.libsvm.MAX_DENSE_BYTES "
            f"({MAX_DENSE_BYTES / 2**30:g} GiB); this loader builds dense matrices: check "
            "n_features and the file's largest index, or raise the limit if it fits in memory"
        )


def _check_bytes(data: bytes, source: str) -> None:
    """Errors a parse would report obscurely: compressed files, ``\\r``-only line ends."""
    for magic, kind in _COMPRESSED.items():
        if data.startswith(magic):
            raise ValueError(f"{source}: a {kind}-compressed file; decompress it first")
    if b"\n" not in data and b"\r" in data.strip():
        raise ValueError(
            f"{source}: lines end in '\\r' alone (classic Mac OS line ends); convert them to "
            "'\\n' first (e.g. tr '\\r' '\\n')"
        )


def _why(token: str, line: str) -> str:
    """What a bad feature token most likely is, for the parse error (``""`` where unknown)."""
    if token.startswith("qid:"):
        return (
            " (a query id of the ranking format, which this loader does not read: drop the "
            "qid:N tokens, e.g. sed -E 's/ qid:[^ ]+//')"
        )
    if "\r" in line.rstrip("\r"):  # not a CRLF line's own end
        return (
            " (the line holds a '\\r' inside it, a line end of another system: two examples "
            "may have run together; convert line ends to '\\n' first, e.g. tr '\\r' '\\n')"
        )
    return ""


def _content_lines(text: str) -> list[tuple[int, str]]:
    """(line number, text without comment) for each line; blank ones included."""
    has_comments = "#" in text
    return [
        (lineno, line.split("#", 1)[0] if has_comments else line)
        for lineno, line in enumerate(text.split("\n"), 1)
    ]


def _parse_reference(text: str, source: str, n_features: int | None) -> _Parsed:
    """Token-by-token parser: slow, obviously right, and the one that names the bad line."""
    labels: list[int] = []
    lines: list[int] = []
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for lineno, line in _content_lines(text):
        parts = line.split()
        if not parts:
            continue
        row = len(labels)
        labels.append(_label(parts[0], source, lineno))
        lines.append(lineno)
        seen: set[int] = set()
        for token in parts[1:]:
            index_text, colon, value_text = token.partition(":")
            index = _integer(index_text)
            value = _number(value_text)
            if index is None or value is None or index < 1 or not colon or ":" in value_text:
                raise ValueError(f"{source}:{lineno}: bad feature {token!r}{_why(token, line)}")
            if not abs(value) <= _FLOAT32_MAX:
                raise ValueError(
                    f"{source}:{lineno}: feature {index} has the value {value_text!r}; values must "
                    "be finite numbers within float32's range (clean or drop this example)"
                )
            if n_features is not None and index > n_features:
                raise ValueError(
                    f"{source}:{lineno}: feature index {index} exceeds n_features={n_features}"
                )
            if n_features is None and index > MAX_FEATURE_INDEX:
                raise ValueError(
                    f"{source}:{lineno}: feature index {index_text} is above "
                    f"{MAX_FEATURE_INDEX:,}, the largest read without n_features= (a typo? pass "
                    "n_features if the file really is that wide)"
                )
            if index in seen:
                raise ValueError(f"{source}:{lineno}: feature index {index} appears twice")
            seen.add(index)
            rows.append(row)
            cols.append(index - 1)
            vals.append(value)
    if not labels:
        raise ValueError(f"{source}: no examples")
    width = n_features if n_features is not None else max(cols, default=-1) + 1
    _check_dense(len(labels), width, source)
    x = np.zeros((len(labels), width), dtype=np.float32)
    x[rows, cols] = vals
    return _Parsed(x, np.array(labels, dtype=np.int64), np.array(lines, dtype=np.int64))


class _Reject(Exception):
    """The fast path cannot handle this file; the reference parser will say why."""


def _parse_fast(text: str, n_features: int | None, source: str = "<text>") -> _Parsed:
    labels: list[str] = []
    lines: list[int] = []
    counts: list[int] = []
    rests: list[str] = []
    for lineno, line in _content_lines(text):
        parts = line.split(None, 1)
        if not parts:
            continue
        labels.append(parts[0])
        lines.append(lineno)
        if len(parts) == 2:
            rests.append(parts[1])
            counts.append(parts[1].count(":"))
        else:
            counts.append(0)
    if not labels:
        raise _Reject
    joined = " ".join(rests)
    if "_" in joined or any("_" in label for label in labels):  # int() reads 1_0 as 10
        raise _Reject
    n_pairs = sum(counts)
    # Each token must hold exactly one colon: none holds two, and there are as many as tokens.
    if n_pairs != len(joined.split()) or _DOUBLE_COLON.search(joined):
        raise _Reject
    try:
        y = np.array(labels, dtype=np.int64)
        if n_pairs:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # older NumPy only warns on unparsable text
                numbers = np.fromstring(joined.replace(":", " "), dtype=np.float64, sep=" ")
        else:
            numbers = np.zeros(0)
    except (ValueError, OverflowError, DeprecationWarning) as err:
        raise _Reject from err
    if numbers.size != 2 * n_pairs:  # an empty index or value: "3:" or ":0.5"
        raise _Reject
    index, values = numbers[0::2], numbers[1::2]
    if not np.all(np.abs(values) <= _FLOAT32_MAX):  # nan, inf, or inf once stored as float32
        raise _Reject
    limit = MAX_FEATURE_INDEX if n_features is None else n_features
    # ``index <= limit`` is false for nan; the reference parser names the offending line.
    if n_pairs and not (
        np.all((index >= 1) & (index <= limit)) and np.array_equal(index, np.floor(index))
    ):
        raise _Reject
    max_index = int(index.max(initial=0))
    width = max_index if n_features is None else n_features
    _check_dense(len(labels), width, source)
    rows = np.repeat(np.arange(len(labels)), counts)
    cols = index.astype(np.int64) - 1
    # Indices ascend within each line in every real file; only otherwise look for repeats.
    if np.any((np.diff(cols) <= 0) & (np.diff(rows) == 0)):
        keys = np.sort(rows * width + cols)
        if np.any(np.diff(keys) == 0):
            raise _Reject
    x = np.zeros((len(labels), width), dtype=np.float32)
    x[rows, cols] = values
    return _Parsed(x, y, np.array(lines, dtype=np.int64))


def _parse(data: bytes, source: str, n_features: int | None) -> _Parsed:
    """Parse LIBSVM bytes; ``source`` names the file in error messages."""
    # never fails; stray bytes then fail as bad tokens. A UTF-8 byte-order mark (an editor's) is
    # no part of the first label.
    text = data.removeprefix(b"\xef\xbb\xbf").decode("latin-1")
    try:
        return _parse_fast(text, n_features, source)
    except _Reject:
        return _parse_reference(text, source, n_features)


def _map_labels(
    labels: np.ndarray, lines: np.ndarray, label_map: Sequence[int] | None, source: str
) -> tuple[np.ndarray, tuple[int, ...]]:
    if label_map is None:
        classes = np.unique(labels)
        return np.searchsorted(classes, labels).astype(np.int64), tuple(int(c) for c in classes)
    known = tuple(label_map)
    if not known:
        raise ValueError(f"{source}: label_map is empty")
    if not all(isinstance(c, (int, np.integer)) for c in known):
        raise TypeError(f"{source}: label_map must hold the integer labels, got {known!r}")
    classes = np.array(known, dtype=np.int64)
    if len(np.unique(classes)) != len(classes):
        raise ValueError(f"{source}: label_map has repeated labels: {known!r}")
    order = np.argsort(classes, kind="stable")
    pos = np.searchsorted(classes[order], labels).clip(max=len(classes) - 1)
    unseen = classes[order][pos] != labels
    if unseen.any():
        row = int(np.argmax(unseen))
        raise ValueError(
            f"{source}:{lines[row]}: label {labels[row]} is not in the label map "
            f"{tuple(int(c) for c in known)} (a class absent from the training split?)"
        )
    return order[pos].astype(np.int64), tuple(int(c) for c in known)


def load_libsvm(
    path: str | os.PathLike[str],
    *,
    n_features: int | None = None,
    label_map: Sequence[int] | None = None,
    name: str | None = None,
    split: str | None = None,
    cache_dir: CacheDir = None,
) -> Dataset:
    """Load a LIBSVM text file as a dense ``float32`` :class:`Dataset` (format in module doc).

    Args:
        path: the file.
        n_features: columns of ``x``, a positive int; default the largest index in the file (at
            most :data:`MAX_FEATURE_INDEX`). A larger index in the file is an error.
        label_map: the original labels in class-index order, usually ``train.label_map``; a label
            outside it is an error. Default: the sorted distinct labels of this file.
        name: display name; default the file name.
        split: recorded in :attr:`Dataset.split`.
        cache_dir: where decoded arrays are cached (see :mod:`initlab.data.cache`); ``False``
            disables the cache.

    Example (a test split sharing the training split's columns and classes)::

        train = load_libsvm("letter.scale", n_features=16)
        test = load_libsvm("letter.scale.t", n_features=16, label_map=train.label_map)
    """
    path = Path(path)
    source = str(path)
    if n_features is not None and (
        isinstance(n_features, bool)
        or not isinstance(n_features, (int, np.integer))
        or n_features < 1
    ):
        raise ValueError(f"n_features must be a positive int, got {n_features!r}")
    if n_features is not None:
        n_features = int(n_features)
    if path.is_dir():
        raise IsADirectoryError(f"{source} is a folder; pass the LIBSVM file itself")
    data = path.read_bytes()
    _check_bytes(data, source)

    def build() -> tuple[dict[str, np.ndarray], dict[str, object]]:
        parsed = _parse(data, source, n_features)
        return parsed._asdict(), {}

    key = {"sha256": hashlib.sha256(data).hexdigest(), "n_features": n_features, "rules": _RULES}
    arrays, _ = cached(cache_dir, "libsvm", path.name, key, build)
    if not np.isfinite(arrays["x"]).all():  # a cache written before values were checked
        _parse_reference(data.decode("latin-1"), source, n_features)  # raises, naming the line
    y, classes = _map_labels(arrays["labels"], arrays["lines"], label_map, source)
    x = torch.from_numpy(arrays["x"])
    return Dataset(
        x=x,
        y=torch.from_numpy(y),
        name=name if name is not None else path.name,
        n_features=x.shape[1],
        n_classes=len(classes),
        label_map=classes,
        split=split,
    )
