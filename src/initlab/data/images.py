"""Image-folder trees: ``<directory>/<class>/<image>.png|.jpg|.jpeg``, decoded with Pillow.

Classes are the sub-folder names in sorted order (as in torchvision's ``ImageFolder``), files are
taken in sorted order within each class, and hidden files and other suffixes are ignored. Every
image must have the same size; each is converted to ``mode`` (``"RGB"`` → 3 channels, ``"L"`` → 1).

Large trees are decoded in worker processes (CIFAR-10's 60,000 32 x 32 JPEGs take seconds, not
minutes) and then come from the cache, keyed by the files' relative paths, sizes and mtimes.
Pillow is imported only when a tree is decoded: ``pip install pillow`` (or ``initlab[images]``).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from initlab.data import _pil_decode
from initlab.data.cache import CacheDir, cached, tree_fingerprint
from initlab.data.dataset import Dataset, check_image_dtype, check_per_class, image_dataset

__all__ = ["IMAGE_SUFFIXES", "load_image_folder"]

#: File name suffixes read as images (compared case-insensitively).
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")

# Below this many files, starting worker processes (~0.2 s each) costs more than it saves.
_PARALLEL_MIN_FILES = 4000


class _Tree(NamedTuple):
    classes: list[str]
    paths: list[str]  # absolute
    labels: list[int]
    records: list[tuple[str, int, int]]  # (relative path, size, mtime_ns), for the cache key


def _list_tree(directory: Path, limit_per_class: int | None) -> _Tree:
    # os.scandir and plain strings: pathlib costs seconds on a 60,000-file tree.
    if not directory.is_dir():
        raise FileNotFoundError(f"image folder {directory} does not exist")
    with os.scandir(directory) as it:
        classes = sorted(e.name for e in it if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise FileNotFoundError(f"{directory}: no class sub-folders (expected <class>/<image>)")
    tree = _Tree(classes, [], [], [])
    for k, cls in enumerate(classes):
        with os.scandir(directory / cls) as it:
            entries = sorted(
                (
                    e
                    for e in it
                    if e.name.lower().endswith(IMAGE_SUFFIXES)
                    and e.is_file()
                    and not e.name.startswith(".")
                ),
                key=lambda e: e.name,
            )
        if not entries:
            raise FileNotFoundError(
                f"{directory / cls}: no images ({', '.join(IMAGE_SUFFIXES)}) in class folder"
            )
        for e in entries[:limit_per_class]:
            st = e.stat()
            tree.paths.append(e.path)
            tree.labels.append(k)
            tree.records.append((f"{cls}/{e.name}", st.st_size, st.st_mtime_ns))
    return tree


def _cpu_count() -> int:
    if hasattr(os, "sched_getaffinity"):  # the CPUs this process may use (containers, taskset)
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _decode_in_workers(paths: list[str], mode: str, n_workers: int) -> np.ndarray:
    """:func:`_pil_decode.decode` split over ``n_workers`` processes (see that module for why)."""
    source = Path(_pil_decode.__file__).read_text(encoding="utf-8")
    bounds = np.linspace(0, len(paths), n_workers + 1).astype(int)
    with tempfile.TemporaryDirectory(prefix="initlab-decode-") as tmp:
        jobs: list[tuple[Path, subprocess.Popen[bytes]]] = []
        try:
            for w, (lo, hi) in enumerate(itertools.pairwise(bounds)):
                paths_file, out_file = Path(tmp, f"{w}.json"), Path(tmp, f"{w}.npy")
                paths_file.write_text(json.dumps(paths[lo:hi]), encoding="utf-8")
                command = [sys.executable, "-c", source, str(paths_file), str(out_file), mode]
                # cwd=tmp: nothing on the worker's sys.path[0] can shadow numpy or PIL.
                jobs.append((out_file, subprocess.Popen(command, cwd=tmp, stderr=subprocess.PIPE)))
            errors = [proc.communicate()[1].decode(errors="replace").strip() for _, proc in jobs]
        finally:
            for _, proc in jobs:
                if proc.poll() is None:  # interrupted: do not leave workers behind
                    proc.kill()
                    proc.wait()
        for (_, proc), err in zip(jobs, errors, strict=True):
            if proc.returncode != 0:
                if "Pillow" in err:
                    raise ImportError(err)
                raise ValueError(err or f"image decoding worker failed ({proc.returncode})")
        parts = [np.load(out_file) for out_file, _ in jobs]
    for lo, part in zip(bounds[1:], parts[1:], strict=False):
        if part.shape[1:] != parts[0].shape[1:]:
            raise ValueError(
                f"{paths[lo]}: image size {part.shape[1:]} differs from {paths[0]}'s "
                f"{parts[0].shape[1:]}; all images in a folder must have one size"
            )
    return np.concatenate(parts)


def load_image_folder(
    directory: str | os.PathLike[str],
    *,
    mode: str = "RGB",
    limit_per_class: int | None = None,
    dtype: torch.dtype = torch.float32,
    name: str | None = None,
    split: str | None = None,
    workers: int | None = None,
    cache_dir: CacheDir = None,
) -> Dataset:
    """Load ``directory/<class>/<image>`` as ``(N, C, H, W)`` images (format in module doc).

    Args:
        directory: the tree's root; its sub-folders are the classes.
        mode: Pillow mode every image is converted to: ``"RGB"`` (3 channels) or ``"L"`` (1).
        limit_per_class: keep only the first (sorted) ``limit_per_class`` files of each class.
        dtype: a floating dtype gives pixels scaled to ``[0, 1]``; ``torch.uint8`` the raw bytes.
        name: display name; default the folder's name.
        split: recorded in :attr:`Dataset.split`.
        workers: decoding processes; default one per CPU (at most 8) for trees of 4,000 files or
            more, else decode in this process.
        cache_dir: see :mod:`initlab.data.cache`; ``False`` disables the cache.

    :attr:`Dataset.label_map` holds the class folder names.
    """
    check_image_dtype(dtype)
    if mode not in ("RGB", "L"):
        raise ValueError(f"mode must be 'RGB' (3 channels) or 'L' (1 channel), got {mode!r}")
    if limit_per_class is not None:
        check_per_class("limit_per_class", limit_per_class)
    directory = Path(directory)
    tree = _list_tree(directory, limit_per_class)
    paths = tree.paths

    def build() -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        n_workers = workers
        if n_workers is None:
            n_workers = min(_cpu_count(), 8) if len(paths) >= _PARALLEL_MIN_FILES else 1
        n_workers = min(n_workers, len(paths))
        if n_workers <= 1 or not sys.executable:
            images = _pil_decode.decode(paths, mode)
        else:
            images = _decode_in_workers(paths, mode, n_workers)
        x = np.ascontiguousarray(images.transpose(0, 3, 1, 2))
        return {"x": x, "y": np.array(tree.labels, dtype=np.int64)}, {}

    key = {
        "tree": tree_fingerprint(tree.records),
        "mode": mode,
        "limit_per_class": limit_per_class,
    }
    label = f"{directory.parent.name}-{directory.name}"
    arrays, _ = cached(cache_dir, "images", label, key, build)
    return image_dataset(
        arrays["x"], arrays["y"], tuple(tree.classes), name or directory.name, split, dtype
    )
