"""Named data sets: where their files live under the data root, and one ``load_dataset`` call.

The data root is ``root=`` if given, else ``$INITLAB_DATA_DIR``, else ``../shared/data`` relative
to the current directory if that exists (the project's checkout layout), else ``~/initlab-data``.
Under it, each format keeps its usual folder name::

    libsvm/letter.scale, libsvm/letter.scale.t, ...     LIBSVM text files
    mnist/train-images-idx3-ubyte.gz, ...                MNIST IDX files
    cifar-10-batches-py/data_batch_1, ...                CIFAR-10 pickles (as downloaded)
    cifar10-jpeg/{train,test}/<class>/NNNN.jpg           CIFAR-10 re-encoded as JPEG (lossy)
    cifar-100-python/train, test, meta                   CIFAR-100 pickles

Names are ``libsvm:<set>``, ``sklearn:<set>``, ``mnist``, ``cifar10`` and ``cifar100``. A bare set
name means the LIBSVM set (the study's sets: ``iris`` is ``libsvm:iris``), else the one set of that
name (``digits`` is ``sklearn:digits``); scikit-learn's ``iris`` and ``wine`` need the prefix.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from initlab._core.knobs import user_stacklevel
from initlab.data.cache import CacheDir
from initlab.data.cifar import load_cifar_pickle
from initlab.data.dataset import Dataset, check_per_class, first_per_class
from initlab.data.idx import MNIST_FILES, load_mnist
from initlab.data.images import load_image_folder
from initlab.data.libsvm import load_libsvm
from initlab.data.sklearn_sets import load_sklearn

__all__ = [
    "CATALOGUE",
    "CatalogueEntry",
    "catalogue_entry",
    "data_root",
    "list_datasets",
    "load_dataset",
]

_LIBSVM_SOURCE = "LIBSVM multiclass collection (Chang & Lin), from UCI / Statlog"


@dataclass(frozen=True)
class CatalogueEntry:
    """A named data set.

    Attributes:
        name: canonical name, e.g. ``"libsvm:letter"``.
        kind: ``"libsvm"``, ``"mnist"``, ``"cifar10"``, ``"cifar100"`` or ``"sklearn"``.
        n_features: scalars per example.
        n_classes: number of classes.
        rows: examples per split, as published.
        files: LIBSVM only: file name of each split under ``<root>/libsvm``.
        source: whom to cite.
    """

    name: str
    kind: str
    n_features: int
    n_classes: int
    rows: dict[str, int]
    files: dict[str, str] = field(default_factory=dict)
    source: str = ""

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(self.rows)


def _libsvm(
    name: str, train: str, n_train: int, n_features: int, n_classes: int, n_test: int = 0
) -> CatalogueEntry:
    files, rows = {"train": train}, {"train": n_train}
    if n_test:
        files["test"], rows["test"] = train + ".t", n_test
    return CatalogueEntry(
        f"libsvm:{name}", "libsvm", n_features, n_classes, rows, files, _LIBSVM_SOURCE
    )


#: Every named set. LIBSVM feature counts are fixed here so a train and a test file agree.
CATALOGUE: dict[str, CatalogueEntry] = {
    e.name: e
    for e in (
        _libsvm("dna", "dna.scale", 2000, 180, 3, n_test=1186),
        _libsvm("glass", "glass.scale", 214, 9, 6),
        _libsvm("iris", "iris.scale", 150, 4, 3),
        _libsvm("letter", "letter.scale", 15000, 16, 26, n_test=5000),
        _libsvm("pendigits", "pendigits", 7494, 16, 10, n_test=3498),
        _libsvm("satimage", "satimage.scale", 4435, 36, 6, n_test=2000),
        _libsvm("segment", "segment.scale", 2310, 19, 7),
        _libsvm("svmguide2", "svmguide2", 391, 20, 3),
        _libsvm("svmguide4", "svmguide4", 300, 10, 6, n_test=312),
        _libsvm("vehicle", "vehicle.scale", 846, 18, 4),
        _libsvm("vowel", "vowel.scale", 528, 10, 11),
        _libsvm("wine", "wine.scale", 178, 13, 3),
        CatalogueEntry("mnist", "mnist", 784, 10, {"train": 60000, "test": 10000},
                       source="MNIST (LeCun, Cortes & Burges)"),
        CatalogueEntry("cifar10", "cifar10", 3072, 10, {"train": 50000, "test": 10000},
                       source="CIFAR-10 (Krizhevsky, 2009)"),
        CatalogueEntry("cifar100", "cifar100", 3072, 100, {"train": 50000, "test": 10000},
                       source="CIFAR-100 (Krizhevsky, 2009)"),
        CatalogueEntry("sklearn:digits", "sklearn", 64, 10, {"train": 1797},
                       source="scikit-learn bundled copy of UCI optical digits"),
        CatalogueEntry("sklearn:iris", "sklearn", 4, 3, {"train": 150},
                       source="scikit-learn bundled copy of Fisher's iris"),
        CatalogueEntry("sklearn:wine", "sklearn", 13, 3, {"train": 178},
                       source="scikit-learn bundled copy of UCI wine"),
        CatalogueEntry("sklearn:breast_cancer", "sklearn", 30, 2, {"train": 569},
                       source="scikit-learn bundled copy of UCI breast cancer (Wisconsin)"),
    )
}  # fmt: skip


def data_root_source(root: str | os.PathLike[str] | None = None) -> tuple[Path, str]:
    """The data root (:func:`data_root`) and how it was chosen: ``"from root="``, ``"from
    $INITLAB_DATA_DIR"`` or ``"the default ..."`` (for messages)."""
    if root is not None:
        return Path(root).expanduser(), "from root="
    env = os.environ.get("INITLAB_DATA_DIR")
    if env:
        return Path(env).expanduser(), "from $INITLAB_DATA_DIR"
    shared = Path.cwd().parent / "shared" / "data"
    if shared.is_dir():
        return shared, "the default ../shared/data"
    return Path.home() / "initlab-data", "the default ~/initlab-data (../shared/data is absent)"


def data_root(root: str | os.PathLike[str] | None = None) -> Path:
    """Where named data sets are looked up (the order is in the module doc)."""
    return data_root_source(root)[0]


def _entry(name: str) -> CatalogueEntry:
    key = name.strip().lower()
    if key in CATALOGUE:
        return CATALOGUE[key]
    if f"libsvm:{key}" in CATALOGUE:  # the study's sets win bare names
        return CATALOGUE[f"libsvm:{key}"]
    matches = [e for n, e in CATALOGUE.items() if n.split(":", 1)[-1] == key]
    if len(matches) == 1:
        return matches[0]
    if matches:
        options = " or ".join(repr(e.name) for e in matches)
        raise ValueError(f"data set name {name!r} is ambiguous: say {options}")
    raise ValueError(f"unknown data set {name!r}; known: {', '.join(CATALOGUE)}")


def catalogue_entry(name: str) -> CatalogueEntry:
    """The catalogue entry a name resolves to, as :func:`load_dataset` resolves it (bare LIBSVM
    names, unique suffixes); ``ValueError`` for unknown or ambiguous names."""
    return _entry(name)


def _bundled_hint(entry: CatalogueEntry) -> str:
    """`` Or use sklearn:NAME, ...`` where scikit-learn bundles a set of ``entry``'s name."""
    bundled = f"sklearn:{entry.name.split(':', 1)[-1]}"
    if entry.kind == "sklearn" or bundled not in CATALOGUE:
        return ""
    needs = "" if _available(CATALOGUE[bundled], Path()) else ": pip install scikit-learn"
    return (
        f" Or use {bundled}, the copy bundled with scikit-learn (no download{needs}); its "
        "features are as the UCI source stores them, not scaled to [-1, 1] like the LIBSVM "
        "copy's, and it has no test split."
    )


#: The folders a data root holds, one per format (module doc).
ROOT_FOLDERS = ("libsvm", "mnist", "cifar-10-batches-py", "cifar10-jpeg", "cifar-100-python")


def misplaced_root(root: Path) -> str | None:
    """Why the folder ``root`` looks like a wrong data root (``None`` where it holds one of
    :data:`ROOT_FOLDERS`, or shows no sign of the named sets): it is one of those folders itself
    (one level too deep), it holds LIBSVM files without their ``libsvm/`` folder, or a folder
    inside it is the data root (one level too shallow)."""
    if not root.is_dir() or any((root / f).is_dir() for f in ROOT_FOLDERS):
        return None
    if root.name in ROOT_FOLDERS:
        return (
            f"{root} is one of a data root's folders ({root.name}/), not the root: pass the "
            f"folder that holds it, {root.parent}"
        )
    libsvm_files = {e.files["train"] for e in CATALOGUE.values() if e.kind == "libsvm"}
    if any((root / f).is_file() for f in libsvm_files):
        return f"{root} holds LIBSVM files; the loader reads them from {root / 'libsvm'}/"
    inner = sorted(d for d in root.iterdir() if any((d / f).is_dir() for f in ROOT_FOLDERS))
    if inner:
        return f"{root} holds no named set, but {inner[0]} holds some: pass that folder"
    return None


def _missing(entry: CatalogueEntry, looked: list[Path], root: Path, how: str) -> FileNotFoundError:
    if entry.kind == "libsvm" and looked[0].is_dir():
        return FileNotFoundError(
            f"{entry.name}: {looked[0]} is a folder where the LIBSVM file of that name should be "
            f"(data root {root}, {how}); put the file itself there"
        )
    where = ", ".join(str(p) for p in looked)
    misplaced = misplaced_root(root)
    hint = f" ({misplaced})" if misplaced else ""
    return FileNotFoundError(
        f"{entry.name}: not found; looked for {where} (data root {root}, {how}){hint}. Download "
        "it there, or point root= or the INITLAB_DATA_DIR environment variable at the folder "
        f"holding libsvm/, mnist/, cifar-10-batches-py/ or cifar10-jpeg/.{_bundled_hint(entry)}"
    )


def _cifar10_paths(root: Path, split: str) -> tuple[Path, Path]:
    return root / "cifar-10-batches-py", root / "cifar10-jpeg" / split


def _available(entry: CatalogueEntry, root: Path) -> bool:
    if entry.kind == "libsvm":
        return (root / "libsvm" / entry.files["train"]).is_file()
    if entry.kind == "mnist":
        return any((root / "mnist" / (MNIST_FILES["train"][0] + s)).is_file() for s in ("", ".gz"))
    if entry.kind == "cifar10":
        return any(p.is_dir() for p in _cifar10_paths(root, "train"))
    if entry.kind == "cifar100":
        return (root / "cifar-100-python").is_dir()
    return importlib.util.find_spec("sklearn") is not None  # bundled with scikit-learn


def list_datasets(root: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """One row per named set: ``name, kind, splits, n_features, n_classes, n_train, n_test,
    available, source`` (``available``: its files are under the data root, or it is bundled)."""
    directory = data_root(root)
    return [
        {
            "name": e.name,
            "kind": e.kind,
            "splits": e.splits,
            "n_features": e.n_features,
            "n_classes": e.n_classes,
            "n_train": e.rows["train"],
            "n_test": e.rows.get("test"),
            "available": _available(e, directory),
            "source": e.source,
        }
        for e in CATALOGUE.values()
    ]


def load_dataset(
    name: str,
    split: str = "train",
    *,
    root: str | os.PathLike[str] | None = None,
    dtype: torch.dtype = torch.float32,
    cache_dir: CacheDir = None,
    limit_per_class: int | None = None,
) -> Dataset:
    """Load a named set (see :func:`list_datasets`) from the data root.

    Args:
        name: e.g. ``"libsvm:letter"`` (or ``"letter"``), ``"mnist"``, ``"cifar10"``,
            ``"sklearn:digits"``.
        split: ``"train"`` or ``"test"``. LIBSVM sets published without a ``.t`` file and the
            scikit-learn sets have only ``"train"`` (the whole set).
        root: the data root (default: see module doc).
        dtype: image sets only: a floating dtype gives pixels in ``[0, 1]``, ``torch.uint8`` the
            raw bytes. Tabular sets are always ``float32``.
        cache_dir: see :mod:`initlab.data.cache`; ``False`` disables the cache.
        limit_per_class: keep only the first ``limit_per_class`` examples of each class, in the
            source order (:func:`~initlab.data.dataset.first_per_class`); for the CIFAR-10 JPEG
            copy these are the first files of each class folder, and only they are decoded.

    A LIBSVM test split uses the training split's label map and the catalogue's feature count.
    ``cifar10`` reads the official pickles (``cifar-10-batches-py``) when present, else the JPEG
    copy (``cifar10-jpeg``), named ``"CIFAR-10 (JPEG copy)"`` since it is lossy.
    """
    if limit_per_class is not None:
        check_per_class("limit_per_class", limit_per_class)  # before any (slow) decoding
    data = _load(name, split, root, dtype, cache_dir, limit_per_class)
    if limit_per_class is not None:
        return first_per_class(data, limit_per_class)
    _check_published(_entry(name), split, data)
    return data


def _check_published(entry: CatalogueEntry, split: str, data: Dataset) -> None:
    """Warn where a loaded split is not the published one: another number of rows (a file cut
    short, as an interrupted download leaves it, parses as fewer rows) or of classes (a class
    folder missing in one split renumbers every class after it)."""
    rows, want = len(data.y), entry.rows[split]
    problem = ""
    if rows != want:
        problem = f"{rows} examples where the published set has {want}"
    elif data.n_classes != entry.n_classes:
        problem = f"{data.n_classes} classes where the published set has {entry.n_classes}"
    if problem:
        warnings.warn(
            f"{entry.name} ({split} split) loaded with {problem}: the files are not the published "
            "ones (cut short, a subset, or another set under its name); if that is not meant, "
            "download it again",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def _load(
    name: str,
    split: str,
    root: str | os.PathLike[str] | None,
    dtype: torch.dtype,
    cache_dir: CacheDir,
    limit_per_class: int | None,
) -> Dataset:
    """:func:`load_dataset` without the per-class limit (except where a loader applies it)."""
    entry = _entry(name)
    if split not in entry.splits:
        if split in ("train", "test"):
            raise ValueError(
                f"{entry.name} has no {split!r} split (published splits: {', '.join(entry.splits)})"
            )
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    directory, how = data_root_source(root)
    short = entry.name.split(":", 1)[-1]

    if entry.kind == "sklearn":
        return dataclasses.replace(load_sklearn(short), split="train")
    if entry.kind == "libsvm":
        path = directory / "libsvm" / entry.files[split]
        if not path.is_file():
            raise _missing(entry, [path], directory, how)
        label_map = None
        if split != "train":  # the test split's classes are the training split's
            train = load_dataset(entry.name, "train", root=directory, cache_dir=cache_dir)
            label_map = train.label_map
        return load_libsvm(
            path,
            n_features=entry.n_features,
            label_map=label_map,
            name=short,
            split=split,
            cache_dir=cache_dir,
        )
    if entry.kind == "mnist":
        folder = directory / "mnist"
        try:
            return load_mnist(folder, split, dtype=dtype, cache_dir=cache_dir)
        except FileNotFoundError:
            if folder.is_dir():
                raise
            raise _missing(entry, [folder], directory, how) from None
    if entry.kind == "cifar10":
        pickles, jpegs = _cifar10_paths(directory, split)
        if pickles.is_dir():
            return load_cifar_pickle(pickles, split, dtype=dtype, cache_dir=cache_dir)
        if jpegs.is_dir():
            return load_image_folder(
                jpegs,
                dtype=dtype,
                name="CIFAR-10 (JPEG copy)",
                split=split,
                cache_dir=cache_dir,
                limit_per_class=limit_per_class,
            )
        raise _missing(entry, [pickles, jpegs], directory, how)
    folder = directory / "cifar-100-python"
    if not folder.is_dir():
        raise _missing(entry, [folder], directory, how)
    return load_cifar_pickle(folder, split, dtype=dtype, cache_dir=cache_dir)
