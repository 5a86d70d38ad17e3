"""A study's data sets: catalogue names with options, loaded into a :class:`StudyData`.

A data set in a study spec is a catalogue name (:func:`initlab.data.list_datasets`), optionally
followed by options after ``?``, joined by ``&``::

    libsvm:letter
    mnist?pad=2&train_per_class=500&test_per_class=100
    cifar10?train_per_class=1000&test_per_class=0&range=symmetric

The whole string is the run's ``dataset`` (part of its key), so a subset is a different data set.

Options (:data:`DATA_OPTIONS`):

* ``train_per_class=k``: keep the first ``k`` training examples of each class, in the source order
  (for the CIFAR-10 JPEG copy: the first ``k`` files of each class folder, the only ones decoded);
  a balanced, deterministic subset that makes CPU studies of image sets affordable.
* ``test_per_class=k``: the same for the test split; ``0`` drops the test split (no per-epoch test
  evaluation).
* ``pad=p``: images only: ``p`` zero pixels on each side (MNIST's 28×28 → 32×32 with ``pad=2``,
  as LeNet-5 took it), before the range mapping.
* ``range=unit`` (default: pixels in ``[0, 1]``) or ``range=symmetric`` (``2x - 1``, in
  ``[-1, 1]``, the CIFAR-10 input range of Defazio & Bottou, App. F). Images only.
* ``channels=C``: says that the examples are square ``C``-channel images. The catalogue knows its
  image sets (MNIST 1, CIFAR 3); a data set of your own ``load_fn`` (``run_study(load_fn=...)``)
  is taken as vectors unless its name says ``channels=C``. ``load_fn`` owns the rest of its
  names' syntax: only ``channels`` is read from them here.

Image sets come as ``(N, C, H, W)``; vector sets as ``(N, d)``. :func:`example_shape` says which,
from the name and the feature count, without loading anything.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "DATA_OPTIONS",
    "check_dataset_name",
    "dataset_identity",
    "example_shape",
    "load_split",
    "load_study_data",
    "parse_dataset_name",
]

#: Channels of the catalogue's image kinds (images are square: ``C × S × S``).
_IMAGE_CHANNELS = {"mnist": 1, "cifar10": 3, "cifar100": 3}
_RANGES = ("unit", "symmetric")
#: What leaving an image option out means (``channels``: the catalogue's own count, above).
_IMAGE_DEFAULTS: dict[str, Any] = {"pad": 0, "range": "unit"}


def _count(minimum: int) -> Callable[[str, str], int]:
    def parse(key: str, text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = -1
        if value < minimum or str(value) != text.strip():
            raise ValueError(f"data option {key}={text!r}: must be an integer >= {minimum}")
        return value

    return parse


def _range(key: str, text: str) -> str:
    if text not in _RANGES:
        raise ValueError(f"data option {key}={text!r}: valid values are {', '.join(_RANGES)}")
    return text


#: Option name → parser of its value (see the module doc).
DATA_OPTIONS: dict[str, Callable[[str, str], Any]] = {
    "train_per_class": _count(1),
    "test_per_class": _count(0),
    "pad": _count(0),
    "range": _range,
    "channels": _count(1),
}
_IMAGE_ONLY = ("pad", "range")  # options that need an image set


def parse_dataset_name(name: str) -> tuple[str, dict[str, Any]]:
    """Split ``"base?key=value&..."`` into the catalogue name and the parsed options.

    Example:
        >>> parse_dataset_name("mnist?pad=2&train_per_class=10")
        ('mnist', {'pad': 2, 'train_per_class': 10})
    """
    base, _, query = name.partition("?")
    options: dict[str, Any] = {}
    for item in filter(None, query.split("&")):
        key, eq, text = item.partition("=")
        if not eq or key not in DATA_OPTIONS:
            raise ValueError(
                f"data set {name!r}: bad option {item!r}; write name?key=value&..., keys: "
                f"{', '.join(DATA_OPTIONS)}"
            )
        if key in options:
            raise ValueError(f"data set {name!r}: option {key!r} given twice")
        options[key] = DATA_OPTIONS[key](key, text)
    if not base:
        raise ValueError(f"data set {name!r}: no catalogue name before '?'")
    return base, options


def dataset_identity(name: str) -> str:
    """The data set a study's name denotes, as text: two names of one identity load the same
    data. A catalogue name becomes its entry's canonical name (``iris``, ``Iris`` and
    ``libsvm:iris`` are all ``libsvm:iris``); its options are sorted, and dropped where they say
    what leaving them out says (an empty ``?``; on an image set ``pad=0``, ``range=unit`` and its
    own ``channels``): ``mnist?pad=0`` and ``mnist?`` are ``mnist``. A name with an option the
    loader refuses keeps its options, sorted (the loader names the error). A name outside the
    catalogue (a ``load_fn`` of the user's, which owns its syntax) keeps its base as written;
    only empty options are dropped and the others sorted.

    Example:
        >>> dataset_identity("MNIST?range=unit&pad=2&")
        'mnist?pad=2'
    """
    from initlab.data.catalogue import catalogue_entry

    base, _, query = name.partition("?")
    items = sorted(filter(None, query.split("&")))
    try:
        entry = catalogue_entry(base)
    except ValueError:
        return base + ("?" + "&".join(items) if items else "")
    try:
        _, options = parse_dataset_name(name)
    except ValueError:
        options = None
    if options is not None:
        if entry.kind in _IMAGE_CHANNELS:
            defaults = {**_IMAGE_DEFAULTS, "channels": _IMAGE_CHANNELS[entry.kind]}
            options = {k: v for k, v in options.items() if k not in defaults or defaults[k] != v}
        items = sorted(f"{k}={v}" for k, v in options.items())
    return entry.name + ("?" + "&".join(items) if items else "")


def _image_kind(base: str) -> str | None:
    """The catalogue kind of an image set (``"mnist"``, ``"cifar10"``, ...), else ``None``
    (vector sets, and names outside the catalogue)."""
    from initlab.data.catalogue import catalogue_entry

    try:
        kind = catalogue_entry(base).kind
    except ValueError:
        return None
    return kind if kind in _IMAGE_CHANNELS else None


def _channels(name: str) -> int | None:
    """The channels of data set ``name``'s images, ``None`` for vectors (see the module doc)."""
    base, _, query = name.partition("?")
    kind = _image_kind(base)
    if kind is not None:
        return _IMAGE_CHANNELS[kind]
    for item in query.split("&"):  # a load_fn's own name: read only channels=C
        key, _, text = item.partition("=")
        if key == "channels":
            return DATA_OPTIONS["channels"](key, text)
    return None


def example_shape(name: str, n_features: int) -> tuple[int, ...]:
    """The shape of one example of data set ``name`` with ``n_features`` scalars per example.

    Image sets (the catalogue's, or a name with ``channels=C``): ``(C, S, S)`` with
    ``S = sqrt(n_features / C)`` (so options such as ``pad`` need no bookkeeping here);
    everything else: ``(n_features,)``.
    """
    channels = _channels(name)
    if channels is None:
        return (n_features,)
    side = math.isqrt(n_features // channels)
    if channels * side * side != n_features:
        raise ValueError(
            f"data set {name!r}: {n_features} features are not {channels} square channels"
        )
    return (channels, side, side)


def _transform(x: torch.Tensor, options: Mapping[str, Any]) -> torch.Tensor:
    pad = options.get("pad", _IMAGE_DEFAULTS["pad"])
    if pad:
        x = F.pad(x, (pad, pad, pad, pad))
    if options.get("range", _IMAGE_DEFAULTS["range"]) == "symmetric":
        x = x * 2 - 1
    return x


def check_dataset_name(name: str) -> tuple[str, dict[str, Any]]:
    """``(catalogue name, options)`` of a data set name with options (module doc), checked
    without loading anything: the options parse, and the image options are on an image set.

    Raises:
        ValueError: a bad option, or an option the data set cannot take (``pad`` on vectors).
    """
    base, options = parse_dataset_name(name)
    kind = _image_kind(base)
    image_only = [k for k in _IMAGE_ONLY if k in options]
    if image_only and kind is None:
        raise ValueError(
            f"data set {name!r}: option(s) {', '.join(image_only)} apply to image sets only "
            f"(mnist, cifar10, cifar100), not {base!r}"
        )
    if "channels" in options and (kind is None or options["channels"] != _IMAGE_CHANNELS[kind]):
        have = "vectors" if kind is None else f"{_IMAGE_CHANNELS[kind]}-channel images"
        raise ValueError(f"data set {name!r}: {base!r} has {have}; drop channels=")
    return base, options


def load_split(
    name: str, split: str = "train", root: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` of one split of data set ``name`` with its options applied (module doc; the
    split's ``*_per_class`` option limits it). The command line's ``--data`` reads the training
    split this way, so it takes the same names as a study spec."""
    base, options = check_dataset_name(name)
    x, data = _load_split(base, options, split, root)
    return x, data.y


def _load_split(base: str, options: Mapping[str, Any], split: str, root: str | None) -> Any:
    """``(x with the options applied, the loaded Dataset)`` of one split."""
    from initlab.data import load_dataset

    data = load_dataset(base, split, root=root, limit_per_class=options.get(f"{split}_per_class"))
    return _transform(data.x, options), data


def load_study_data(name: str, root: str | None = None, *, test_split: bool = True) -> Any:
    """A data set's train and (where it exists and is not dropped) test split as a
    :class:`~initlab.study.runner.StudyData`, options applied (see the module doc).

    A data set published without a test split (several LIBSVM sets) gives ``test=None``; a
    missing file, or any error reading a published test split (a parse error, a label the
    training split lacks), raises. ``test_split=False``: the training split only (``test=None``;
    the command line's ``--data``, which sizes a zoo model from ``n_features`` and ``n_classes``
    as a study does).
    """
    from initlab.data.catalogue import catalogue_entry
    from initlab.study.runner import StudyData

    base, options = check_dataset_name(name)
    x, train = _load_split(base, options, "train", root)
    test = None
    # Only a split the catalogue does not publish means "no test split": any error reading one
    # it publishes (a parse error, a label absent from the training split) is the data set's.
    wanted = test_split and options.get("test_per_class") != 0
    if wanted and "test" in catalogue_entry(base).splits:
        x_test, data = _load_split(base, options, "test", root)
        test = (x_test, data.y)
    return StudyData(
        train=(x, train.y),
        test=test,
        n_features=math.prod(x.shape[1:]),
        n_classes=int(train.n_classes),
    )
