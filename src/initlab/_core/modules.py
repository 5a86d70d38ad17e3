"""A model's submodules by name, second names included; its tensors that share memory.

A submodule registered under two names (``model.alias = model.a``; a block reused in a
``ModuleList``; T5's ``encoder.embed_tokens`` in transformers 4.x, which is ``shared``) appears
once in ``named_modules()``, under its first name, and every result lists it there. A user may
name it either way: :func:`first_names` maps any name to the first one.

Two distinct ``Parameter`` objects may also lie over one memory (``nn.Parameter(a.weight.data)``,
``nn.Parameter(a.weight.data.t())``): not a tie (a tie is one object under two names), yet
writing one writes the other. :func:`shares_memory` tells whether two tensors overlap;
:func:`memory_overlaps` finds every such pair among many; :func:`shared_memory_error` is the
refusal of a method that would write one of them, and :func:`refuse_shared_writes` raises it for
the tensors a writer is about to write.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Sequence

import torch
from torch import nn

__all__ = [
    "first_names",
    "inference_tensors",
    "memory_overlaps",
    "nearest_names",
    "refuse_shared_writes",
    "shared_memory_error",
    "shares_memory",
    "with_first_names",
]


def first_names(model: nn.Module) -> dict[str, str]:
    """Every name of every submodule (second names included) → its first name in
    ``model.named_modules()``."""
    first: dict[int, str] = {}
    return {n: first.setdefault(id(m), n) for n, m in model.named_modules(remove_duplicate=False)}


def with_first_names(model: nn.Module, wanted: Iterable[str]) -> list[str]:
    """``wanted`` with every second name replaced by the first (unknown names kept as given)."""
    names = first_names(model)
    return [names.get(n, n) for n in wanted]


def nearest_names(name: str, names: Iterable[str], n: int = 3) -> str:
    """``" (nearest: 'a', 'b', 'c')"``: the names in ``names`` closest to an unknown ``name``
    (for an error message; ``""`` where there are none)."""
    near = difflib.get_close_matches(name, [k for k in names if k], n=n, cutoff=0.0)
    return f" (nearest: {', '.join(map(repr, near))})" if near else ""


def inference_tensors(
    model: nn.Module, buffers: bool = True, *, params: bool = True, training: bool = False
) -> str:
    """The names of ``model``'s parameters and buffers made under ``torch.inference_mode()``
    (inference tensors), at most three then ``...``, comma-separated; ``""`` for none. With
    ``buffers=False`` only the buffers of the norm layers with running statistics (BatchNorm,
    InstanceNorm: what a forward in train mode updates) count, with ``training`` only those of
    such layers in train mode; ``params=False`` leaves the parameters out."""
    norms = (nn.modules.batchnorm._NormBase,)
    tensors = [*model.named_parameters()] if params else []
    for name, module in model.named_modules():
        if buffers or (isinstance(module, norms) and (module.training or not training)):
            prefix = f"{name}." if name else ""
            tensors += [(prefix + b, t) for b, t in module.named_buffers(recurse=False)]
    names = [n for n, t in tensors if t.is_inference()]
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range ``[start, end)`` a tensor's elements occupy (``(0, 0)`` when unknown: no
    storage, a meta tensor, no element)."""
    try:
        start = t.data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0, 0
    if start == 0 or t.numel() == 0:
        return 0, 0
    extent = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True))
    return start, start + extent * t.element_size()


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same tensor, or a byte in common on one device. Views of one buffer with no element
    in common are not shared: slices of one flat buffer (as in FSDP), the even and odd rows of
    a fused weight. The byte ranges (:func:`_span`) are a first filter; where they overlap,
    :func:`_elements_meet` decides exactly."""
    if a is b:
        return True
    (a0, a1), (b0, b1) = _span(a), _span(b)
    if a.device != b.device or a0 == 0 or b0 == 0 or not (a0 < b1 and b0 < a1):
        return False
    return _elements_meet(a, b, min(a0, b0), max(a1, b1))


def _elements_meet(a: torch.Tensor, b: torch.Tensor, lo: int, hi: int) -> bool:
    """Whether a byte of ``a``'s elements is a byte of ``b``'s, both inside ``[lo, hi)``. In
    units of ``u = gcd(element sizes, start offsets from lo)`` bytes, element ``i`` of ``t``
    covers units ``off_t + sum_d i_d * stride_d * e_t / u + k``, ``0 <= k < e_t / u``:
    :meth:`torch.Tensor.as_strided` views of one bool mask over ``(hi - lo) / u`` units (the
    union of the two spans), on the tensors' device, mark ``a``'s units and read ``b``'s."""
    u = math.gcd(a.element_size(), b.element_size(), a.data_ptr() - lo, b.data_ptr() - lo)
    mask = torch.zeros((hi - lo) // u, dtype=torch.bool, device=a.device)

    def units(t: torch.Tensor) -> torch.Tensor:
        per = t.element_size() // u
        return mask.as_strided(
            (*t.shape, per), (*(st * per for st in t.stride()), 1), (t.data_ptr() - lo) // u
        )

    units(a).fill_(True)
    return bool(units(b).any())


def _same_place(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same elements in the same order: one tensor under two objects."""
    return (a.data_ptr(), a.shape, a.stride(), a.dtype) == (
        b.data_ptr(),
        b.shape,
        b.stride(),
        b.dtype,
    )


def memory_overlaps(tensors: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, str, bool]]:
    """``(name, other name, exact)`` for every pair of distinct tensor objects among ``tensors``
    whose memory overlaps (:func:`shares_memory`), in the order given; ``exact``: the same
    elements in the same order (same start, shape, strides and dtype). An object listed twice
    (a tie) is one tensor. Sorted by start address, each tensor is compared with those whose
    range is still open: ``O(n log n)`` plus, for each pair whose byte ranges overlap, a mask
    over both spans (:func:`_elements_meet`): blocks of columns of one matrix cost that matrix's
    size per pair (32 such blocks of a 16 MB buffer: 0.22 s, a reviewer's measurement)."""
    distinct: dict[int, tuple[int, str, torch.Tensor]] = {}
    for rank, (name, t) in enumerate(tensors):
        distinct.setdefault(id(t), (rank, name, t))
    placed = sorted(
        ((*_span(t), rank, name, t) for rank, name, t in distinct.values()), key=lambda e: e[:3]
    )
    found: list[tuple[int, int, str, str, bool]] = []
    open_: list[tuple[int, int, str, torch.Tensor]] = []
    for start, end, rank, name, t in placed:
        if start == 0:
            continue
        open_ = [e for e in open_ if e[0] > start]
        for _, other_rank, other, u in open_:
            if shares_memory(t, u):
                first, second = sorted([(other_rank, other), (rank, name)])
                found.append((first[0], second[0], first[1], second[1], _same_place(t, u)))
        open_.append((end, rank, name, t))
    return [(a, b, exact) for *_, a, b, exact in sorted(found)]


def shared_memory_error(
    what: str, pairs: Sequence[tuple[str, str, bool]], effect: str
) -> ValueError:
    """The refusal of ``what``, which would write (at least one of) each pair of distinct
    Parameters over one memory in ``pairs`` (:func:`memory_overlaps`): which, how they overlap,
    ``effect`` (what writing them would do), and the two ways out: one Parameter (a tie), or
    memory of its own for each."""
    shown = "; ".join(
        f"{a} and {b} ({'the same elements' if exact else 'overlapping elements'})"
        for a, b, exact in pairs[:3]
    )
    more = f" and {len(pairs) - 3} more pair(s)" if len(pairs) > 3 else ""
    a, b, exact = pairs[0]
    tie = (
        f"make them one Parameter, a tie ({b.rpartition('.')[0] or 'model'}."
        f"{b.rpartition('.')[2]} = {a}: one tensor under two names, written once)"
        if exact
        else "keep one Parameter and let the other module's forward read a view of it (e.g. "
        f"F.linear(x, {a}.t()) in place of a Parameter made of {a}.data.t())"
    )
    return ValueError(
        f"{what}: {shown}{more} are distinct Parameters over the same memory (made from another "
        f"Parameter's .data or a view of it; an optimizer also steps that memory once for each "
        f"of them): {effect}. Either {tie}, or give each its own memory "
        "(nn.Parameter(t.detach().clone())). The model was left as it was"
    )


def refuse_shared_writes(
    what: str, model: nn.Module, written: Iterable[torch.Tensor], effect: str
) -> None:
    """Raise :func:`shared_memory_error` for the pairs of distinct Parameters of ``model`` over
    one memory (:func:`memory_overlaps` of ``model.named_parameters()``) of which ``what`` would
    write at least one: a tensor of ``written``, or the Parameter a written tensor is a view of
    (a row block of a fused weight, ``in_proj_weight[:e]``). A pair of which neither is written
    (two frozen tensors left as they are) is no conflict. Call it before writing anything."""
    ids: set[int] = set()
    for t in written:
        ids.add(id(t))
        if t._base is not None:
            ids.add(id(t._base))
    named = list(model.named_parameters())
    hit = {name for name, p in named if id(p) in ids}
    pairs = [pair for pair in memory_overlaps(named) if pair[0] in hit or pair[1] in hit]
    if pairs:
        raise shared_memory_error(what, pairs, effect)
