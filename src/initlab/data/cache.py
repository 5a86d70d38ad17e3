"""On-disk cache of decoded arrays, keyed by the content of the source files.

A cache entry is one uncompressed ``.npz`` file (no pickled objects) under the cache directory:
``cache_dir=`` if given, else ``$INITLAB_CACHE_DIR``, else ``~/.cache/initlab``. Its name is
``<kind>-<source name>-<key>.npz`` where ``key`` is a SHA-256 over

* the loader kind and :data:`CACHE_VERSION` (bumped when a decoder's output changes),
* the loader's options that change the arrays (``n_features``, ``limit_per_class``, ...),
* a fingerprint of every source file: the SHA-256 of its bytes for single files (a few ms for the
  MNIST or LIBSVM files), and for image-folder trees the sorted relative paths with their sizes
  and modification times (hashing 60,000 JPEGs' bytes would cost as much as decoding them).

Editing a file therefore gives a new key and a fresh decode; old entries are never read again
(delete the directory to reclaim space). Entries are written to a temporary file in the same
directory and moved into place with :func:`os.replace`, so a reader never sees half an entry and
concurrent writers of one entry are harmless. A cache that cannot be written is skipped with a
warning; one that cannot be read is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import warnings
import zipfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np

from initlab._core.knobs import user_stacklevel

__all__ = [
    "CACHE_VERSION",
    "CacheDir",
    "cached",
    "default_cache_dir",
    "file_digest",
    "resolve_cache_dir",
    "tree_fingerprint",
]

#: Bump to invalidate every entry when a decoder's output changes.
CACHE_VERSION = 1

#: ``None`` (the default directory), a directory, or ``False`` for no cache at all.
CacheDir = str | os.PathLike[str] | Literal[False] | None

_CHUNK = 1 << 20


def default_cache_dir() -> Path:
    """``$INITLAB_CACHE_DIR`` if set and non-empty, else ``~/.cache/initlab``."""
    env = os.environ.get("INITLAB_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "initlab"


def resolve_cache_dir(cache_dir: CacheDir) -> Path | None:
    """The directory a loader caches into, or ``None`` when caching is off (``cache_dir=False``)."""
    if cache_dir is False:
        return None
    if cache_dir is None:
        return default_cache_dir()
    return Path(cache_dir).expanduser()


def file_digest(path: str | os.PathLike[str]) -> str:
    """SHA-256 (hex) of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def tree_fingerprint(records: Iterable[tuple[str, int, int]]) -> str:
    """SHA-256 over sorted ``(relative path, size, mtime in ns)`` records of a tree's files.

    Cheap (one ``stat`` per file, done by the caller) where hashing the bytes is not; a file
    rewritten with the same size within the file system's timestamp resolution goes unnoticed.
    """
    h = hashlib.sha256()
    for rel, size, mtime_ns in sorted(records):
        h.update(f"{rel}\0{size}\0{mtime_ns}\n".encode())
    return h.hexdigest()


def _entry_path(directory: Path, kind: str, label: str, key: Mapping[str, Any]) -> Path:
    blob = json.dumps({"kind": kind, "version": CACHE_VERSION, **key}, sort_keys=True, default=str)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:24]
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", label)[:60]
    return directory / f"{kind}-{safe}-{digest}.npz"


def _read(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    with np.load(path, allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files if k != "__meta__"}
        meta = json.loads(str(npz["__meta__"]))
    return arrays, meta


def _write(path: Path, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # A fresh name in the same directory (so os.replace is atomic), created with the umask's
    # permissions (unlike tempfile.mkstemp's 0600).
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            np.savez(f, __meta__=np.array(json.dumps(dict(meta))), **arrays)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


Built = tuple[dict[str, np.ndarray], dict[str, Any]]


def cached(
    cache_dir: CacheDir,
    kind: str,
    label: str,
    key: Mapping[str, Any],
    build: Callable[[], Built],
) -> Built:
    """Return ``build()``'s arrays and JSON metadata, from the cache entry for ``key`` if present.

    Args:
        cache_dir: see :func:`resolve_cache_dir`.
        kind: loader kind, e.g. ``"libsvm"``; part of the key and of the file name.
        label: human-readable part of the file name (usually the source file's name).
        key: everything that determines the arrays (source fingerprints and options), JSON-able.
        build: decodes the source; called only on a miss.
    """
    directory = resolve_cache_dir(cache_dir)
    if directory is None:
        return build()
    path = _entry_path(directory, kind, label, key)
    if path.is_file():
        try:
            return _read(path)
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
            pass  # unreadable entry (disk trouble, a foreign file): decode again and overwrite
    arrays, meta = build()
    try:
        _write(path, arrays, meta)
    except OSError as err:
        warnings.warn(
            f"initlab: could not write cache entry {path}: {err}", stacklevel=user_stacklevel()
        )
    return arrays, meta
