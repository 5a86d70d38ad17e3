"""The :class:`Dataset` record every loader returns: tensors plus what a report needs to know."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "Dataset",
    "Label",
    "check_image_dtype",
    "check_per_class",
    "first_per_class",
    "image_dataset",
]

#: An original label: an integer (LIBSVM, IDX) or a class name (CIFAR, image folders).
Label = int | str


@dataclass(frozen=True, eq=False, repr=False)
class Dataset:
    """One split of a classification data set.

    ``x`` is ``float32`` of shape ``(N, n_features)`` for tabular sets and ``(N, C, H, W)`` for
    images (``float32`` scaled to ``[0, 1]`` by default; loaders take ``dtype=torch.uint8`` for the
    raw bytes). ``y`` holds ``int64`` class indices ``0 .. n_classes - 1``; class ``k`` was stored
    as ``label_map[k]`` in the source (LIBSVM labels are mapped in sorted order, so ``-3, -1, 2``
    become ``0, 1, 2``). ``n_features`` is the number of scalars per example (``C * H * W`` for
    images). Indexing gives ``(x[i], y[i])``, so a ``Dataset`` is a map-style dataset for
    :class:`torch.utils.data.DataLoader`.

    Attributes:
        x: inputs, one row per example.
        y: class indices, ``int64``.
        name: display name, e.g. ``"letter"`` or ``"CIFAR-10 (JPEG copy)"``.
        n_features: scalars per example.
        n_classes: number of classes, ``len(label_map)`` (a split may not contain all of them).
        label_map: the original label of each class index.
        split: ``"train"``, ``"test"`` or ``None`` when the loader cannot tell.
    """

    x: torch.Tensor
    y: torch.Tensor
    name: str
    n_features: int
    n_classes: int
    label_map: tuple[Label, ...]
    split: str | None = None

    def __post_init__(self) -> None:
        if self.x.shape[0] != self.y.shape[0]:
            raise ValueError(
                f"{self.name}: x has {self.x.shape[0]} rows but y has {self.y.shape[0]}"
            )
        if self.y.dtype != torch.int64 or self.y.dim() != 1:
            raise ValueError(f"{self.name}: y must be a 1-D int64 tensor, got {self.y.dtype}")
        if self.n_classes != len(self.label_map):
            raise ValueError(
                f"{self.name}: n_classes={self.n_classes} but label_map has {len(self.label_map)}"
            )
        per_example = 1
        for size in self.x.shape[1:]:
            per_example *= size
        if self.x.dim() < 2 or per_example != self.n_features:
            raise ValueError(
                f"{self.name}: x of shape {tuple(self.x.shape)} has no {self.n_features} features"
            )

    def __len__(self) -> int:
        return self.y.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]

    def __repr__(self) -> str:
        split = f", split={self.split!r}" if self.split is not None else ""
        return (
            f"Dataset({self.name!r}{split}, x={tuple(self.x.shape)} {self.x.dtype}, "
            f"n_features={self.n_features}, n_classes={self.n_classes})"
        )


def check_image_dtype(dtype: torch.dtype) -> None:
    """Image loaders return a floating dtype (pixels scaled to ``[0, 1]``) or ``torch.uint8``."""
    if not (dtype.is_floating_point or dtype == torch.uint8):
        raise ValueError(f"dtype must be floating point or torch.uint8, got {dtype}")


def image_dataset(
    x: np.ndarray,
    y: np.ndarray,
    label_map: tuple[Label, ...],
    name: str,
    split: str | None,
    dtype: torch.dtype,
) -> Dataset:
    """Wrap uint8 ``(N, C, H, W)`` images as a :class:`Dataset`: raw, or scaled to ``[0, 1]``."""
    check_image_dtype(dtype)
    pixels = torch.from_numpy(np.ascontiguousarray(x))
    if dtype.is_floating_point:
        pixels = pixels.to(dtype).div_(255)
    return Dataset(
        x=pixels,
        y=torch.from_numpy(np.asarray(y, dtype=np.int64)),
        name=name,
        n_features=int(np.prod(x.shape[1:])),
        n_classes=len(label_map),
        label_map=label_map,
        split=split,
    )


def check_per_class(what: str, k: object) -> int:
    """``k`` as a per-class example count: a positive int, else a ``ValueError`` naming ``what``."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"{what} must be a positive int, got {k!r}")
    return k


def first_per_class(dataset: Dataset, k: int) -> Dataset:
    """The first ``k`` examples of every class, in the source order (all of a class with fewer).

    A balanced, deterministic subset: the kept rows stay in their original relative order, so
    ``first_per_class(d, k).x`` is ``d.x[rows]`` with ``rows`` increasing. The metadata
    (``n_classes``, ``label_map``) is unchanged, even if a class ends up absent.
    """
    check_per_class("first_per_class: k", k)
    y = dataset.y
    # rank of each row among the rows of its class: a stable sort by class, minus class offsets
    order = torch.sort(y, stable=True).indices
    counts = torch.bincount(y, minlength=dataset.n_classes)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(y)
    rank[order] = torch.arange(y.shape[0], device=y.device) - starts[y[order]]
    rows = (rank < k).nonzero().flatten()
    return Dataset(
        x=dataset.x[rows],
        y=y[rows],
        name=dataset.name,
        n_features=dataset.n_features,
        n_classes=dataset.n_classes,
        label_map=dataset.label_map,
        split=dataset.split,
    )
