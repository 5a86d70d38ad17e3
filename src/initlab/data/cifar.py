"""CIFAR-10 and CIFAR-100 in the python pickle format their users download.

``cifar-10-batches-py/`` holds ``data_batch_1`` .. ``data_batch_5``, ``test_batch`` and
``batches.meta``; ``cifar-100-python/`` holds ``train``, ``test`` and ``meta``. Each batch is a
pickled dict with ``data`` (``uint8``, ``N x 3072``: the 1024 red, then green, then blue pixels of a
32 x 32 image, row by row) and ``labels`` (CIFAR-10) or ``fine_labels`` and ``coarse_labels``
(CIFAR-100); the meta file names the classes. Keys may be ``bytes`` (the files were written by
Python 2) or ``str``.

The pickles are read with an unpickler that only accepts plain containers and NumPy arrays, so a
tampered file cannot run code.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from initlab.data.cache import CacheDir, cached, file_digest
from initlab.data.dataset import Dataset, Label, check_image_dtype, image_dataset

__all__ = ["CIFAR10_FILES", "CIFAR100_FILES", "load_cifar_pickle", "read_cifar_pickle"]

#: Batch files of each split, and the meta file, of ``cifar-10-batches-py``.
CIFAR10_FILES = {
    "train": tuple(f"data_batch_{i}" for i in range(1, 6)),
    "test": ("test_batch",),
    "meta": "batches.meta",
}
#: The same for ``cifar-100-python``.
CIFAR100_FILES = {"train": ("train",), "test": ("test",), "meta": "meta"}

_SAFE_GLOBALS = {
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),  # bytes in protocol-2 pickles written by Python 3
    *(
        (module, name)
        for module in ("numpy.core.multiarray", "numpy._core.multiarray")
        for name in ("_reconstruct", "scalar")
    ),
    *((module, "_frombuffer") for module in ("numpy.core.numeric", "numpy._core.numeric")),
}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _SAFE_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a CIFAR pickle")
        return super().find_class(module, name)


def _str(value: Any) -> Any:
    return value.decode("latin-1") if isinstance(value, bytes) else value


def read_cifar_pickle(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Unpickle one CIFAR batch or meta file safely; ``bytes`` keys and names become ``str``."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            obj = _SafeUnpickler(io.BytesIO(f.read()), encoding="latin1").load()
    except (pickle.UnpicklingError, EOFError, ValueError) as err:
        raise ValueError(f"{path}: not a CIFAR python pickle ({err})") from err
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: not a CIFAR python pickle (a {type(obj).__name__}, not a dict)")
    return {_str(k): [_str(n) for n in v] if isinstance(v, list) else v for k, v in obj.items()}


def _variant(directory: Path) -> tuple[str, dict[str, Any]]:
    if (directory / "data_batch_1").is_file() or (directory / "batches.meta").is_file():
        return "CIFAR-10", CIFAR10_FILES
    if (directory / "train").is_file() or (directory / "meta").is_file():
        return "CIFAR-100", CIFAR100_FILES
    raise FileNotFoundError(
        f"{directory}: no CIFAR pickle batches (expected data_batch_1..5, test_batch, batches.meta "
        "as in cifar-10-batches-py, or train, test, meta as in cifar-100-python)"
    )


def _pixels(raw: Any, path: Path) -> np.ndarray:
    """The ``data`` entry as ``uint8``; pixels stored otherwise (floats, values outside 0..255)
    raise rather than wrap or truncate in the cast (300 became 44, 0.5 became 0)."""
    data = np.asarray(raw)
    if data.dtype == np.uint8 or not data.size:
        return data.astype(np.uint8)
    if data.dtype.kind not in "iu":
        got = f"{data.dtype.name} values (e.g. {data.flat[0].item()!r})"
    elif int(data.min()) < 0 or int(data.max()) > 255:
        got = f"values from {int(data.min())} to {int(data.max())}"
    else:
        return data.astype(np.uint8)
    raise ValueError(f"{path}: pixels must be integers in 0..255 (uint8), got {got}")


def load_cifar_pickle(
    directory: str | os.PathLike[str],
    split: str = "train",
    *,
    coarse: bool = False,
    dtype: torch.dtype = torch.float32,
    cache_dir: CacheDir = None,
) -> Dataset:
    """CIFAR-10 or CIFAR-100 (told apart by file names) as ``(N, 3, 32, 32)`` images.

    Args:
        directory: ``cifar-10-batches-py`` or ``cifar-100-python``, as extracted from the archive.
        split: ``"train"`` or ``"test"``.
        coarse: CIFAR-100 only: the 20 superclasses instead of the 100 classes.
        dtype: a floating dtype gives pixels scaled to ``[0, 1]``; ``torch.uint8`` the raw bytes.
        cache_dir: see :mod:`initlab.data.cache`; ``False`` disables the cache.

    :attr:`Dataset.label_map` holds the class names from the meta file (class indices if it is
    missing).
    """
    check_image_dtype(dtype)
    directory = Path(directory)
    name, files = _variant(directory)
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if coarse and name == "CIFAR-10":
        raise ValueError(f"{directory}: coarse=True needs CIFAR-100, this is CIFAR-10")
    batches = [directory / f for f in files[split]]
    missing = [b.name for b in batches if not b.is_file()]
    if missing:
        raise FileNotFoundError(f"{directory}: missing CIFAR batch file(s) {', '.join(missing)}")
    meta_path = directory / files["meta"]
    label_key = "labels" if name == "CIFAR-10" else "coarse_labels" if coarse else "fine_labels"
    names_key = {"labels": "label_names", "fine_labels": "fine_label_names"}.get(
        label_key, "coarse_label_names"
    )
    n_classes = {"labels": 10, "fine_labels": 100, "coarse_labels": 20}[label_key]

    def build() -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        xs, ys = [], []
        for path in batches:
            batch = read_cifar_pickle(path)
            if "data" not in batch or label_key not in batch:
                raise ValueError(f"{path}: no 'data' and {label_key!r} entries")
            data = _pixels(batch["data"], path)
            labels = np.asarray(batch[label_key])
            if labels.size and labels.dtype.kind not in "iu":  # "3" or 3.0 would convert silently
                raise ValueError(
                    f"{path}: labels must be integers, got {labels.flat[0].item()!r} "
                    f"({labels.dtype.name})"
                )
            labels = labels.astype(np.int64)
            if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(labels) != len(data):
                raise ValueError(
                    f"{path}: expected N x 3072 pixels and N labels, got {data.shape} and "
                    f"{labels.shape}"
                )
            if labels.size and (labels.min() < 0 or labels.max() >= n_classes):
                raise ValueError(f"{path}: labels outside 0..{n_classes - 1}")
            xs.append(data.reshape(-1, 3, 32, 32))
            ys.append(labels)
        names: list[Label] = list(range(n_classes))
        if meta_path.is_file():
            meta = read_cifar_pickle(meta_path)
            if len(meta.get(names_key, ())) == n_classes:
                names = [str(n) for n in meta[names_key]]
        return {"x": np.concatenate(xs), "y": np.concatenate(ys)}, {"label_map": names}

    key = {
        "batches": [file_digest(b) for b in batches],
        "meta": file_digest(meta_path) if meta_path.is_file() else None,
        "labels": label_key,
    }
    arrays, meta = cached(cache_dir, "cifar", f"{name}-{split}", key, build)
    display = f"{name} (coarse)" if coarse else name
    return image_dataset(arrays["x"], arrays["y"], tuple(meta["label_map"]), display, split, dtype)
