"""IDX files (the format MNIST ships in), gzipped or not.

An IDX file is a 4-byte magic number ``0x00 0x00 <type> <ndim>``, then ``ndim`` big-endian
``uint32`` sizes, then the array in C order, big-endian. Gzip is detected from the file's first
bytes, not its name.
"""

from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path

import numpy as np
import torch

from initlab.data.cache import CacheDir, cached, file_digest
from initlab.data.dataset import Dataset, check_image_dtype, image_dataset

__all__ = ["MNIST_FILES", "load_mnist", "read_idx"]

# IDX type byte -> NumPy dtype (big-endian).
_IDX_TYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

#: IDX file stems of each MNIST split: (images, labels).
MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def read_idx(path: str | os.PathLike[str], *, ndim: int | None = None) -> np.ndarray:
    """Read an IDX file (gzipped or plain) into a native-endian NumPy array.

    Args:
        path: the file.
        ndim: expected number of dimensions (3 for image files, 1 for label files), checked.

    Raises:
        ValueError: a truncated or corrupt gzip stream, bad magic number, wrong ``ndim``, a
            truncated header, or a size that does not match the header; the message names the
            file.
    """
    path = Path(path)
    with open(path, "rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    if gzipped:
        try:
            with gzip.open(path, "rb") as f:
                data = f.read()
        except (EOFError, OSError, zlib.error) as err:  # gzip.BadGzipFile is an OSError
            raise ValueError(
                f"{path}: truncated or corrupt gzip file ({err}); download it again"
            ) from err
    else:
        data = path.read_bytes()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_TYPES:
        raise ValueError(f"{path}: not an IDX file (magic number {data[:4].hex() or 'missing'})")
    dtype, rank = _IDX_TYPES[data[2]], data[3]
    if ndim is not None and rank != ndim:
        raise ValueError(f"{path}: expected an IDX file with {ndim} dimensions, found {rank}")
    header = 4 + 4 * rank
    if len(data) < header:
        raise ValueError(
            f"{path}: truncated IDX header ({rank} dimensions need {header} bytes of header, the "
            f"file has {len(data)})"
        )
    shape = tuple(int(s) for s in np.frombuffer(data, dtype=">u4", count=rank, offset=4))
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) - header != expected:
        raise ValueError(
            f"{path}: header promises shape {shape} ({expected} bytes) but {len(data) - header} "
            "bytes follow"
        )
    array = np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)
    return array.astype(dtype.newbyteorder("="))


def _find(directory: Path, stem: str) -> Path:
    # Both spellings occur in the wild: train-images-idx3-ubyte and train-images.idx3-ubyte.
    candidates = [stem, stem.replace("-idx", ".idx")]
    for c in candidates:
        for suffix in (".gz", ""):
            if (directory / (c + suffix)).is_file():
                return directory / (c + suffix)
    raise FileNotFoundError(f"MNIST file {stem}[.gz] not found in {directory}")


def load_mnist(
    directory: str | os.PathLike[str],
    split: str = "train",
    *,
    dtype: torch.dtype = torch.float32,
    cache_dir: CacheDir = None,
) -> Dataset:
    """MNIST from the four official IDX files in ``directory``, as ``(N, 1, 28, 28)`` images.

    Args:
        directory: folder holding ``train-images-idx3-ubyte[.gz]``,
            ``train-labels-idx1-ubyte[.gz]``, ``t10k-images-idx3-ubyte[.gz]`` and
            ``t10k-labels-idx1-ubyte[.gz]`` (``.idx3-ubyte`` spellings too).
        split: ``"train"`` (60,000) or ``"test"`` (10,000).
        dtype: a floating dtype gives pixels scaled to ``[0, 1]``; ``torch.uint8`` the raw bytes.
        cache_dir: see :mod:`initlab.data.cache`; ``False`` disables the cache.
    """
    if split not in MNIST_FILES:
        raise ValueError(f"split must be one of {sorted(MNIST_FILES)}, got {split!r}")
    check_image_dtype(dtype)
    directory = Path(directory)
    images_path, labels_path = (_find(directory, stem) for stem in MNIST_FILES[split])

    def build() -> tuple[dict[str, np.ndarray], dict[str, object]]:
        images = read_idx(images_path, ndim=3)
        labels = read_idx(labels_path, ndim=1)
        if images.dtype != np.uint8 or labels.dtype != np.uint8:
            raise ValueError(f"{directory}: MNIST images and labels must be unsigned bytes")
        if len(images) != len(labels):
            raise ValueError(f"{directory}: {len(images)} images but {len(labels)} labels")
        return {"x": images[:, None], "y": labels.astype(np.int64)}, {}

    key = {"images": file_digest(images_path), "labels": file_digest(labels_path)}
    arrays, _ = cached(cache_dir, "idx", f"mnist-{split}", key, build)
    # Checked here, not in build(): a cache entry written before this check is checked too.
    bad = (arrays["y"] < 0) | (arrays["y"] > 9)
    if bad.any():
        row = int(np.argmax(bad))
        raise ValueError(
            f"{labels_path}: label {int(arrays['y'][row])} at index {row} is outside MNIST's "
            "classes 0..9 (a corrupt or foreign labels file)"
        )
    return image_dataset(arrays["x"], arrays["y"], tuple(range(10)), "MNIST", split, dtype)
