"""How every entry point reads its ``data`` argument: one batch, or many.

The rule, in order (documented in the README and tested by the conformance suite):

1. :class:`Batches` (``initlab.Batches(items)``) is always *many* batches: the explicit form.
2. A tensor, a dict (any ``Mapping``: Hugging Face collators give one), a tuple that holds a
   tensor (``(x, y)``) and a custom object that is not iterable (a dataclass, or any object
   whose attributes hold the tensors) are *one* batch each.
3. A list of two or more items holding a tensor is one batch (a ``DataLoader``'s default collate
   gives ``[x, y]``), unless it can also be read as several batches: tensors of one shape
   (``[t1, t2, t3]``), or tensors whose first dimensions differ. That form raises
   :class:`AmbiguousDataError`, which names both readings: ``initlab.Batches([...])`` for many,
   a tuple for one. A list of one tensor, ``[x]``, is a list of one batch ``x``.
4. A list or tuple whose items are all batches in their own right (tuples, lists, dicts, custom
   objects) is many batches: ``[(x1, y1), (x2, y2)]``; so is a list whose other items hold no
   data (``None``, a string, a number: ``[(x, y), None]``). Such an item is passed on as a batch
   (a ``forward=`` or ``loss_fn=`` may make tensors from it: a tokenizer); the default forward
   refuses it, naming it.
5. Any other iterable (a ``DataLoader``, a generator, a dataset-like iterable) is many batches.

How many: ``max_batches`` batches at most, ``None`` for all of them. Data without a length (a
generator, an ``IterableDataset``, a ``DataLoader`` over one) may never end: with ``None`` it is
read up to :data:`UNSIZED_MAX_BATCHES` batches, and one more raises a ``ValueError`` that says to
pass ``max_batches=`` (``steps=`` for ``gradinit_`` and ``metainit_``, whose number of steps sets
how many batches they read), rather than reading, and holding, an endless stream.

A batch's size (its number of examples) is dim 0 of its first tensor (for a dict, of its first
tensor value, e.g. ``input_ids``; for a custom object, of its first tensor attribute); a
``PackedSequence`` there counts its sequences (``batch_sizes[0]``), not the time steps its
``data`` holds. An entry point that takes ``batch_dim`` (``measure_moments``, ``gr_scaling``,
``precondition_``, ``diagnose``, ``gradinit_``) counts along that dim instead, in the first tensor
that has it. The others (``lsuv_``, ``scale_output_``, ``metainit_``, ``doctor``, ...) do not guess
where the examples are: they read dim 0, so the ``used`` of a time-major ``(T, B)`` batch there
counts its ``T`` time steps as the examples.

Every batch read here is checked (:func:`check_batch`) before it is used: a batch with 0 examples,
or NaN/inf in a floating-point tensor, raises a ``ValueError`` that names the batch and the entry
(no statistic is defined on 0 examples, and one NaN input makes every statistic NaN). An entry
whose key names a mask (``attention_mask``, ``src_mask``) may hold ``-inf``: the additive
attention-mask convention. A tensor of the batch that requires a gradient is read detached: no
method writes the ``.grad`` of the user's data.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from initlab._core.batch_shape import TARGET_KEYS, check_batched, find_target, target_taken
from initlab._core.pytree import children, find_path, flatten_tensors, map_tensors, rebuild
from initlab._core.pytree import shallow_types as _shallow_types
from initlab._core.rng import global_rng_kept

__all__ = [
    "TARGET_KEYS",
    "UNSIZED_MAX_BATCHES",
    "AmbiguousDataError",
    "Batches",
    "DataCounter",
    "DataUse",
    "TakenBatches",
    "at_mask",
    "batch_children",
    "batch_rebuild",
    "batch_size",
    "batch_tensors",
    "check_batch",
    "check_data",
    "data_use",
    "default_forward",
    "examples_in",
    "find_target",
    "first_tensor",
    "forward_args",
    "is_single_batch",
    "iter_batches",
    "keyword_error",
    "masks_positions",
    "object_fields",
    "output_key",
    "output_tensor",
    "padding_mask",
    "take_batches",
    "with_fields",
]

DATA_FORMS = (
    "one batch: a tensor, a tuple such as (x, y), a dict of model inputs, a [x, y] list from "
    "default collate, or a custom object; many batches: a DataLoader, any iterable or generator "
    "of batches, a list of (x, y) tuples, or initlab.Batches([...])"
)


class AmbiguousDataError(ValueError):
    """A ``data`` value that reads both as one batch and as several (a list of same-shaped
    tensors); the message names both explicit forms."""


class Batches:
    """Many batches, said explicitly: ``initlab.Batches([t1, t2, t3])`` is three batches.

    Wrap any iterable of batches (a list of tensors, a generator); it is iterated once, lazily,
    when a method reads it. Use a tuple for the other reading (one batch whose items are ``x, y,
    ...``).
    """

    def __init__(self, items: Iterable[Any]) -> None:
        if isinstance(items, (torch.Tensor, Mapping)) or not isinstance(items, Iterable):
            raise TypeError(
                f"Batches takes an iterable of batches (a list, a DataLoader, a generator), got "
                f"{type(items).__name__}"
            )
        self.items = items

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)

    def __repr__(self) -> str:
        return f"Batches({self.items!r})"


class TakenBatches(list):
    """The list :func:`take_batches` returns: batches already read, so that an entry point that
    hands them on to another (``doctor`` to ``diagnose``, ``precondition_`` to
    ``measure_moments``) has them read as many batches again, never as one batch or as an
    ambiguous list of tensors."""


@dataclass(frozen=True)
class DataUse:
    """How much data a method read: ``batches`` batches holding ``examples`` examples (the sum
    of their :func:`batch_size`, along the method's ``batch_dim`` where it takes one)."""

    batches: int
    examples: int

    def as_dict(self) -> dict[str, int]:
        return {"batches": self.batches, "examples": self.examples}


def _is_container(value: Any) -> bool:
    return isinstance(value, (tuple, list, Mapping))


#: What holds no data, as a batch or an item of a list of batches (rule 4 of the module doc).
_NO_DATA = (type(None), str, bytes, int, float, complex)


def _ambiguous(tensors: list[torch.Tensor]) -> bool:
    if len(tensors) < 2:
        return False
    shapes = {tuple(t.shape) for t in tensors}
    dim0 = {t.shape[0] if t.dim() else None for t in tensors}
    return len(shapes) == 1 or len(dim0) > 1


def is_single_batch(data: Any) -> bool:
    """Whether ``data`` is one batch under the module's rule (see the module docstring).

    Raises:
        AmbiguousDataError: a list that reads both ways (e.g. two or more same-shaped tensors).
    """
    if isinstance(data, (Batches, TakenBatches)):
        return False
    if isinstance(data, (torch.Tensor, Mapping)):
        return True
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        return True  # a record, even one that defines __iter__ to unpack as (x, y)
    if isinstance(data, (tuple, list)):
        if len(data) == 0:
            return False
        batches = [_is_container(v) or _is_custom_object(v) for v in data]
        others = all(b or isinstance(v, _NO_DATA) for b, v in zip(batches, data, strict=True))
        if all(batches) or (isinstance(data, list) and any(batches) and others):
            return False  # every item is a batch in its own right, or no data at all
        if isinstance(data, list):
            if len(data) == 1 and isinstance(data[0], torch.Tensor):
                return False  # [x]: a list of one batch (the default forward reads it the same)
            tensors = [v for v in data if isinstance(v, torch.Tensor)]
            if len(tensors) == len(data) and _ambiguous(tensors):
                shapes = ", ".join(str(tuple(t.shape)) for t in tensors[:4])
                more = ", ..." if len(data) > 4 else ""
                raise AmbiguousDataError(
                    f"data is a list of {len(data)} tensors ({shapes}{more}), which reads both as "
                    f"{len(data)} batches and as one batch of "
                    f"{len(data)} tensors; say which: initlab.Batches([...]) for {len(data)} "
                    "batches, or a tuple (x, y, ...) for one batch"
                )
        return True
    return not isinstance(data, Iterable) or isinstance(data, (str, bytes))


def take_batches(
    data: Any,
    n: int | None = None,
    *,
    what: str = "this procedure",
    exact: bool = True,
    keep_rng: bool = False,
) -> TakenBatches:
    """The first ``n`` batches of ``data`` (all of them when ``n`` is None), as a list
    (:class:`TakenBatches`: read as many batches wherever it is passed on).

    With ``exact=False`` fewer than ``n`` batches are fine (at most ``n`` are taken). Reading
    advances torch's global RNG as iterating ``data`` does (a ``DataLoader``'s iterator draws its
    seed from it); with ``keep_rng`` it is put back after (:func:`~initlab._core.rng.
    global_rng_kept`), for an entry point that promises to leave it as it was and draws nothing
    from it later in the call (drawing from it after the reading, its draws would repeat those
    of a generator of batches that drew from it).

    Raises:
        AmbiguousDataError: ``data`` reads both as one batch and as several.
        TypeError: ``data`` is none of the accepted forms.
        ValueError: ``data`` is empty, or (``exact``) has fewer than ``n`` batches; the message
            says how many are needed.
    """
    with global_rng_kept() if keep_rng else contextlib.nullcontext():
        batches = TakenBatches(iter_batches(data, n, what=what))
    if exact and n is not None and len(batches) < n:
        raise ValueError(
            f"{what} needs {n} batches but the data gave {len(batches)}; pass a loader with at "
            f"least {n} batches (or lower the number of steps/batches asked for)"
        )
    if not batches:
        raise ValueError(f"{what} got no batch: the data is empty")
    return batches


UNSIZED_MAX_BATCHES = 1000
"""The most batches ``max_batches=None`` reads from data without a length (see the module doc)."""


#: What each keyword that bounds the batches read means, for the message of an endless stream.
_BOUNDS = {
    "max_batches": "how many batches to read",
    "steps": "how many steps to take; each step reads its batches from the data",
}


def iter_batches(
    data: Any, max_batches: int | None = None, *, what: str, bound: str = "max_batches"
) -> Iterator[Any]:
    """The batches of ``data`` one at a time (a loader is streamed, never held whole), at most
    ``max_batches``; the same rule and errors as :func:`take_batches`.

    ``bound``: the keyword of the entry point ``what`` that sets how many batches are read
    (``"max_batches"``; ``"steps"`` for ``gradinit_`` and ``metainit_``), named by the error.

    Raises:
        ValueError: ``max_batches`` is ``None`` and ``data`` has no length and more than
            :data:`UNSIZED_MAX_BATCHES` batches (it may be endless); the message says to pass
            ``bound=``.
    """
    if max_batches is not None and (
        isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1
    ):
        raise ValueError(f"{what}: max_batches must be a positive int or None, got {max_batches!r}")
    check_data(data, what)
    if isinstance(data, TakenBatches):  # checked and detached when they were taken
        yield from itertools.islice(data, max_batches)
        return
    if is_single_batch(data):
        check_batch(data, what=what)
        yield _detached(data)
        return
    unsized = max_batches is None and not _has_length(data)
    stop = UNSIZED_MAX_BATCHES + 1 if unsized else max_batches
    for i, batch in enumerate(itertools.islice(data, stop)):
        if unsized and i == UNSIZED_MAX_BATCHES:
            raise ValueError(
                f"{what}: the data has no length and gave more than {UNSIZED_MAX_BATCHES} "
                f"batches; it may never end (a generator or IterableDataset that cycles), and "
                f"{bound}=None reads data without a length up to {UNSIZED_MAX_BATCHES} "
                f"batches. Pass {bound}= ({_BOUNDS.get(bound, 'how many batches to read')})"
            )
        check_batch(batch, what=what, index=i)
        yield _detached(batch)


def check_data(data: Any, what: str) -> None:
    """Raise ``TypeError`` for ``None`` and for what holds data but is no batch nor batches: a
    path (a ``str``, ``bytes`` or ``os.PathLike``), a map-style ``torch.utils.data.Dataset`` (it
    is indexed for single examples) or an :class:`initlab.data.Dataset` record (a whole split)."""
    if data is None:
        raise TypeError(f"{what} needs data; accepted forms: {DATA_FORMS}")
    if isinstance(data, (str, bytes, os.PathLike)):
        raise TypeError(
            f"{what}: data is a path or a string ({data!r}), not batches: load it first "
            "(torch.load, or initlab.data.load_dataset for a named set) and pass the tensors, "
            "(x, y), or a DataLoader"
        )
    if isinstance(data, torch.utils.data.Dataset) and not isinstance(
        data, torch.utils.data.IterableDataset
    ):
        raise TypeError(
            f"{what}: data is a {type(data).__name__}, a map-style torch Dataset, which holds "
            "single examples: pass torch.utils.data.DataLoader(dataset, batch_size=...) instead "
            "(batch_size=None where its items are whole batches already)"
        )
    if any(  # by name: the core does not import the data wing
        c.__name__ == "Dataset" and c.__module__ == "initlab.data.dataset"
        for c in type(data).__mro__
    ):
        raise TypeError(
            f"{what}: data is the initlab data set {getattr(data, 'name', '')!r} (a whole "
            "split): pass batches of it, e.g. DataLoader(TensorDataset(ds.x, ds.y), "
            "batch_size=128), or one batch (ds.x[:256], ds.y[:256])"
        )


def _has_length(data: Any) -> bool:
    """Whether ``len(data)`` is known (a list, a map-style dataset's loader; for
    :class:`Batches`, its items'): a ``DataLoader`` over an ``IterableDataset`` without
    ``__len__`` raises ``TypeError``."""
    try:
        len(data.items if isinstance(data, Batches) else data)
    except (TypeError, NotImplementedError):
        return False
    return True


def _detached(batch: Any) -> Any:
    """``batch`` with its tensors that require a gradient detached (the same object otherwise;
    a batch object's attributes too, containers inside them included, in a copy): the tensors
    :func:`batch_tensors` reads. A tensor made under ``torch.inference_mode()`` is cloned (a
    normal tensor outside that mode: autograd may save it for backward,
    :func:`~initlab._core.backward.with_grad`)."""

    def detach(t: torch.Tensor) -> torch.Tensor:
        if t.is_inference() and not torch.is_inference_mode_enabled():
            return t.clone()
        return t.detach() if t.requires_grad else t

    fields = object_fields(batch)
    if fields is not None and not dataclasses.is_dataclass(batch):
        new = {k: map_tensors(v, detach) for k, v in fields.items()}
        changed = {k: v for k, v in new.items() if v is not fields[k]}
        return with_fields(batch, changed) if changed else batch
    return map_tensors(batch, detach)


def _entry_name(path: str, batch: Any) -> str:
    return "the batch tensor" if isinstance(batch, torch.Tensor) else f"entry {path!r}"


def check_batch(batch: Any, *, what: str, index: int | None = None) -> None:
    """Raise a ``ValueError`` if ``batch`` holds no example or non-finite values, a
    ``TypeError`` if it holds a numpy array (``torch.from_numpy`` first).

    * 0 examples: dim 0 of its first tensor is 0;
    * one example without its batch dimension: a scalar (0-d) target beside a first tensor with
      dimensions (``DataLoader(..., batch_size=None)`` yields such examples);
    * NaN or ``±inf`` in any floating-point tensor (in an entry whose key contains ``"mask"``,
      ``-inf`` is allowed: additive attention masks use it).

    The message names the batch (``index``: its position in the data), the entry, and what to do.
    A custom object's tensors are its attributes' (:func:`batch_tensors`); a batch that holds no
    tensor (``None``, a string, a number, a list of strings) is not checked further (a forward=
    or loss_fn= may make tensors from it; the default forward names it where the model fails).
    """
    which = "the batch" if index is None else f"batch {index}"
    array = find_path(batch, _is_numpy_array)
    fields = object_fields(batch) if array is None else None
    if fields is not None:  # a batch object: its attributes (batch_tensors reads them)
        array = find_path(fields, _is_numpy_array)
    if array is not None:
        where = f"entry {array!r}" if array else "the batch"
        raise TypeError(
            f"{what}: {which} holds a numpy array ({where}), not a torch tensor: convert it "
            "(torch.from_numpy(x), or a DataLoader over a TensorDataset)"
        )
    tensors = batch_tensors(batch)
    if not tensors:
        return
    meta = next((p for p, t in tensors if t.is_meta), None)
    if meta is not None:
        raise ValueError(
            f"{what}: {which} holds a tensor on the meta device ({_entry_name(meta, batch)}), "
            "which has a shape but no values: build the data on the CPU or a GPU"
        )
    path, first = tensors[0]
    check_batched(batch, what=what, which=which)
    if first.dim() >= 1 and first.shape[0] == 0:
        raise ValueError(
            f"{what}: {which} has 0 examples ({_entry_name(path, batch)} has shape "
            f"{tuple(first.shape)}); no statistic is defined on 0 examples. Drop empty batches "
            "(filter them out, or use a DataLoader with drop_last=True)"
        )
    for path, t in tensors:
        if not t.is_floating_point():
            continue
        masked = "mask" in path.rsplit(".", 1)[-1].lower()
        bad = (t.isnan() | t.isposinf()) if masked else ~t.isfinite()
        if bool(bad.any()):
            raise ValueError(
                f"{what}: {which} has {int(bad.sum())} non-finite value(s) (NaN or inf) in "
                f"{_entry_name(path, batch)} of shape {tuple(t.shape)}; every statistic over it "
                "would be NaN. Clean the data first (drop those examples, or replace the values, "
                "e.g. torch.nan_to_num)"
            )


def _is_numpy_array(obj: Any) -> bool:
    return type(obj).__name__ == "ndarray" and type(obj).__module__ == "numpy"


def data_use(batches: Iterable[Any], batch_dim: int = 0) -> DataUse:
    """The :class:`DataUse` of a list of batches (examples along ``batch_dim``, summed)."""
    batches = list(batches)
    return DataUse(len(batches), sum(batch_size(b, batch_dim) for b in batches))


class DataCounter:
    """Counts the batches and examples (along ``batch_dim``) a method reads: wrap its batch
    iterator with :meth:`wrap`."""

    def __init__(self, batch_dim: int = 0) -> None:
        self.batches = 0
        self.examples = 0
        self.batch_dim = batch_dim

    def wrap(self, batches: Iterable[Any]) -> Iterator[Any]:
        """Yield every batch of ``batches``, counting each as it is read."""
        for batch in batches:
            yield self.add_one(batch)

    def add_one(self, batch: Any) -> Any:
        """Count one batch read outside :meth:`wrap` (returns it)."""
        self.batches += 1
        self.examples += batch_size(batch, self.batch_dim)
        return batch

    def use(self) -> DataUse:
        return DataUse(self.batches, self.examples)


def batch_tensors(batch: Any) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a batch with their paths (:func:`~initlab._core.pytree.flatten_tensors`:
    containers, namedtuples, dataclasses); for any other object, the tensors among its
    attributes (:func:`object_fields`; ``batch.x``: path ``"x"``)."""
    tensors = flatten_tensors(batch)
    fields = None if tensors else object_fields(batch)
    return tensors if fields is None else flatten_tensors(fields)


def examples_in(batch: Any, batch_dim: int = 0) -> int:
    """Examples along ``batch_dim`` (:func:`batch_size`); 0 for a batch object with no tensor."""
    try:
        return batch_size(batch, batch_dim)
    except TypeError:
        return 0


def batch_children(node: Any) -> list[Any] | None:
    """The children of a container (:func:`~initlab._core.pytree.children`) or the attributes of
    a batch object (:func:`object_fields`); ``None`` for a leaf."""
    parts = children(node)
    if parts is None:
        fields = object_fields(node)
        parts = None if fields is None else list(fields.values())
    return parts


def batch_rebuild(node: Any, values: list[Any]) -> Any:
    """``node`` rebuilt with ``values`` in place of its :func:`batch_children`."""
    if children(node) is not None:
        return rebuild(node, values)
    fields = object_fields(node) or {}
    return with_fields(node, dict(zip(fields, values, strict=True)))


def object_fields(value: Any) -> dict[str, Any] | None:
    """The attributes of a batch object (a dataclass, a user's class, one with ``__slots__``) in
    the order they were set, or ``None`` for a tensor, container, string, number or ``None``."""
    if not _is_custom_object(value):
        return None
    if dataclasses.is_dataclass(value):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    fields = dict(getattr(value, "__dict__", {}))
    for cls in type(value).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name not in ("__dict__", "__weakref__") and hasattr(value, name):
                fields.setdefault(name, getattr(value, name))
    return fields


def with_fields(value: Any, fields: Mapping[str, Any]) -> Any:
    """A shallow copy of the batch object ``value`` with ``fields`` set (frozen dataclasses
    included)."""
    new = copy.copy(value)
    for name, field in fields.items():
        object.__setattr__(new, name, field)
    return new


def _is_custom_object(value: Any) -> bool:
    """An instance of a class with attributes (a dataclass, a user's batch class, one with
    ``__slots__``), not a tensor, container, string, number, ``None`` or a class."""
    return (
        not isinstance(value, (torch.Tensor, tuple, list, Mapping, str, bytes, int, float, complex))
        and value is not None
        and (hasattr(value, "__dict__") or hasattr(type(value), "__slots__"))
        and not isinstance(value, type)
    )


def first_tensor(batch: Any) -> torch.Tensor:
    """The batch itself (a tensor), or its first tensor (:func:`batch_tensors` order: a tuple,
    list, dict, namedtuple or dataclass, nested, or a custom object's attributes).

    Raises:
        TypeError: the batch holds no tensor.
    """
    tensors = batch_tensors(batch)
    if tensors:
        return tensors[0][1]
    raise TypeError(
        f"a batch must hold a tensor; got {_shallow_types(batch)}, which holds none. Accepted "
        f"data: {DATA_FORMS}"
    )


def forward_args(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The ``(args, kwargs)`` the default forward calls the model with (:func:`default_forward`):
    ``(x,)`` for a tensor ``x``, ``(batch[0],)`` for a tuple or list, ``**batch`` for a dict,
    ``(batch,)`` for any other object; a ``TypeError`` for an empty tuple or list."""
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)) and not batch:
        raise TypeError(
            f"the default forward: the batch is {_shallow_types(batch)}, no input: drop it"
        )
    if isinstance(batch, (tuple, list)):
        return (batch[0],), {}
    return (batch,), {}


def default_forward(model: nn.Module, batch: Any) -> Any:
    """The one default forward: ``model(x)`` for a tensor, ``model(batch[0])`` for a tuple or
    list, ``model(**batch)`` for a dict (without a target key its forward cannot take:
    :func:`~initlab._core.batch_shape.target_taken`), ``model(batch)`` for any other object."""
    args, kwargs = forward_args(target_taken(model, batch) if isinstance(batch, Mapping) else batch)
    try:
        return model(*args, **kwargs)
    except TypeError as err:
        clear = keyword_error(err, batch, "the default forward") or _no_tensor_error(err, batch)
        if clear is None:
            raise
        raise clear from err
    except ValueError as err:
        single = one_example_error(err)
        if single is None:
            raise
        raise single from err
    except RuntimeError as err:
        from initlab._core.dtypes import data_error  # dtypes builds on this module

        clear = data_error(err, model, batch)
        if clear is None:
            raise
        raise clear from err


def _no_tensor_error(err: TypeError, batch: Any) -> TypeError | None:
    """A clear error for a batch holding no tensor that the model failed on (``None`` else)."""
    if batch_tensors(batch):
        return None
    return TypeError(
        f"the default forward: the batch holds no tensor: it is {_shallow_types(batch)}, and the "
        f"model failed on it ({err}); give batches of tensors, or a forward= or loss_fn= that "
        "makes the model's inputs from these"
    )


def one_example_error(err: ValueError) -> ValueError | None:
    """A clear error for a batch of one example in a train-mode batch norm (torch: "Expected more
    than 1 value per channel when training"), or ``None`` for any other error (a subclass, such
    as the :class:`~initlab._core.distributed.RankMismatchError` another rank's failure raises
    here, is passed on as it is)."""
    if type(err) is not ValueError or "Expected more than 1 value per channel" not in str(err):
        return None
    return ValueError(
        "a batch of one example reached a batch norm layer in training mode, which needs more "
        "than one value per channel to normalize: drop short batches (a DataLoader's last batch: "
        f"DataLoader(..., drop_last=True)) ({err})"
    )


def keyword_error(err: TypeError, batch: Any, what: str) -> TypeError | None:
    """A clear error for a model that cannot take a dict batch's keys as keyword arguments
    (``model(**batch)``, the default forward of a dict batch), or whose ``forward`` needs more
    than a tuple batch's first entry (``model(batch[0])``: the advice keeps the target at
    ``batch[1]``, where :func:`find_target` reads it); ``None`` for any other error, and
    for one this function already made (the default forward's, inside a loss)."""
    text = str(err)
    if "is passed to the model as" in text:
        return None
    if isinstance(batch, (tuple, list)) and re.search(
        r"forward\(\) missing \d+ required positional argument", text
    ):
        return TypeError(
            f"{what}: a tuple batch is passed to the model as model(batch[0]) (the rest of the "
            f"tuple is read as targets), and the model's forward takes more inputs ({err}). Pass "
            "dict batches of its keyword arguments, a loss_fn(model, batch) that calls the model "
            "itself and names the target (e.g. loss_fn=lambda model, batch: "
            "F.cross_entropy(model(batch[0], batch[1]), batch[2]) for (x, z, y) batches), or, "
            "where the function takes one, a forward= that leaves the target at batch[1], where a "
            "loss reads it: forward=lambda model, batch: model(batch[0], *batch[2:]) for (x, y, "
            "z, ...) batches (model(*batch) where no loss reads a target)"
        )
    # The model's own forward refusing the batch: a key it does not take, or one it needs and
    # the batch lacks. A TypeError from deeper inside (a call in the model's code) is its own.
    unexpected = re.search(r"forward\(\) got an unexpected keyword argument '([^']*)'", text)
    missing = re.search(r"forward\(\) missing \d+ required (positional|keyword-only) arg", text)
    if not isinstance(batch, Mapping) or not (
        (unexpected is not None and unexpected.group(1) in batch) or missing is not None
    ):
        return None
    refused = (
        f"does not take the key {unexpected.group(1)!r} of the batch's keys "
        f"{sorted(map(str, batch))}: drop it or rename it to an argument of its forward"
        if unexpected is not None and unexpected.group(1) in batch
        else f"needs an argument the batch's keys {sorted(map(str, batch))} lack: add it"
    )
    return TypeError(
        f"{what}: a dict batch is passed to the model as keyword arguments, model(**batch), and "
        f"the model {refused} ({err}). Or pass (x, y) batches, forward=lambda model, batch: ... "
        "with a loss on the outputs, or a loss_fn(model, batch) that calls the model itself"
    )


def real_positions(t: torch.Tensor, batch: Any) -> torch.Tensor:
    """``t``'s entries at the batch's real tokens: where a dict batch carries an
    ``attention_mask`` that pads (:func:`padding_mask`, the probe's rule too) and whose shape
    leads ``t``'s (``(B, T)`` beside logits ``(B, T, V)``), the positions at its zeros are left
    out, ``t[mask]``; any other tensor or batch: ``t`` itself."""
    mask = padding_mask(batch) if isinstance(batch, Mapping) else None
    return t if mask is None else at_mask(t, mask)


def masks_positions(model: nn.Module) -> bool:
    """Whether a batch's ``attention_mask`` marks the padded positions of ``model``'s outputs and
    activations: not for an encoder-decoder (``config.is_encoder_decoder``: T5, BART, Whisper),
    whose decoder's positions are not its encoder's (a mask of the same length would pick
    decoder positions by the encoder's padding); its padded positions are counted."""
    return not getattr(getattr(model, "config", None), "is_encoder_decoder", False)


def padding_mask(kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    """The boolean ``attention_mask`` of a forward's keyword arguments (or a dict batch) where it
    pads (``(B, T)`` or more dims, with a zero); ``None`` where nothing is padded, and for a
    floating-point mask (an additive one, 0 where a token is kept, would read backwards)."""
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or mask.is_floating_point():
        return None
    mask = mask.to(torch.bool)
    return None if bool(mask.all()) else mask


def at_mask(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``t[mask]`` where ``mask``'s shape leads ``t``'s (its entries at the real positions),
    else ``t``."""
    if t.dim() <= mask.dim() or tuple(t.shape[: mask.dim()]) != tuple(mask.shape):
        return t
    return t[mask.to(device=t.device, dtype=torch.bool)]


def output_tensor(
    outputs: Any, *, what: str = "the model's output", way_out: str = "forward"
) -> torch.Tensor:
    """The tensor a model's output stands for: itself, ``.logits`` (Hugging Face outputs), the
    ``"logits"`` entry of a dict, or the first tensor of a tuple or list that is not a scalar
    (a Hugging Face model called with ``return_dict=False`` returns ``(loss, logits, ...)``).

    Raises:
        TypeError: no tensor can be found; the message names the output's type and the way out
            the caller takes (``way_out``: ``"forward"``, a ``forward=``; ``"loss_fn"``, a
            ``loss_fn(model, batch)`` reading the output).
    """
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = getattr(outputs, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(outputs, Mapping):
        if isinstance(outputs.get("logits"), torch.Tensor):
            return outputs["logits"]
        key = output_key(outputs.items())
        if key is not None:
            return outputs[key]
    elif isinstance(outputs, (tuple, list)):
        key = output_key(enumerate(outputs))
        if key is not None:
            return outputs[key]
    way = _no_tensor_way_out(outputs, way_out)
    raise TypeError(
        f"{what} is a {type(outputs).__name__} holding no tensor; return a tensor, a tuple whose "
        f"first item is the output, or an object with .logits, {way}"
    )


def _no_tensor_way_out(outputs: Any, way_out: str) -> str:
    """The end of :func:`output_tensor`'s error: the argument that reads the output's tensor
    field (``forward=`` or ``loss_fn=``, whichever the caller takes), with the field named."""
    field = _tensor_field(outputs)
    if way_out == "loss_fn":
        return (
            "or pass a loss_fn(model, batch) that reads it, e.g. loss_fn=lambda model, batch: "
            f"F.cross_entropy(model(batch[0]){field}, batch[1])"
        )
    return f"or pass forward=lambda model, batch: model(batch[0]){field}"


def _tensor_field(outputs: Any) -> str:
    """How to read the first tensor attribute of an output object (``.scores``), else
    ``.<field>``; ``["<key>"]`` for a dict and ``[<index>]`` for a tuple or list (they hold
    none)."""
    if isinstance(outputs, Mapping):
        return '["<key>"]'
    if isinstance(outputs, (tuple, list)):
        return "[<index>]"
    if dataclasses.is_dataclass(outputs) and not isinstance(outputs, type):
        items = [(f.name, getattr(outputs, f.name, None)) for f in dataclasses.fields(outputs)]
    else:
        items = list(getattr(outputs, "__dict__", {}).items())
    return next((f".{k}" for k, v in items if isinstance(v, torch.Tensor)), ".<field>")


def output_key(items: Iterable[tuple[Any, Any]]) -> Any:
    """Among the ``(key, value)`` items of a dict, tuple or list output, the key of the tensor
    :func:`output_tensor` reads: the first with a dimension (not a 0-d loss before the logits),
    else the first tensor; ``None`` without one. Whoever changes that output
    (``scale_output_``'s hook) changes the same tensor."""
    tensors = [(k, v) for k, v in items if isinstance(v, torch.Tensor)]
    return next((k for k, v in tensors if v.dim() > 0), tensors[0][0] if tensors else None)


def batch_size(batch: Any, batch_dim: int = 0) -> int:
    """Number of examples in a batch: the size along ``batch_dim`` of its first tensor that has
    that dim (dim 0: the first with a dimension; a 0-d entry, such as a temperature in a dict, is
    not a row count), or, where a ``PackedSequence`` comes first, its number of sequences
    (``batch_sizes[0]``: its ``data`` holds the time steps of all of them); 1 when there is
    none."""
    tensors = batch_tensors(batch)
    if not tensors:
        first_tensor(batch)  # raises, naming the batch's type and the accepted forms
    found: list[Any] = []

    def rows(node: Any) -> bool:
        has = isinstance(node, torch.Tensor) and node.dim() > batch_dim
        if isinstance(node, PackedSequence) or has:
            found.append(node)
        return bool(found)

    find_path(batch if flatten_tensors(batch) else object_fields(batch), rows)
    if not found:
        return 1
    first = found[0]
    if isinstance(first, PackedSequence):
        return int(first.batch_sizes[0])
    return int(first.shape[batch_dim])
