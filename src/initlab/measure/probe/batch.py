"""The batch size of one forward of the root model, which scales the per-example gradients.

With a mean-reduced loss the probe multiplies ``dy``, ``dx`` and ``dW_example`` by the batch size
``B`` (:mod:`initlab.measure.probe`), so a wrong ``B`` scales ``E_dy2``, ``E_dx2``,
``E_dW2_example`` and ``gr_scaling``'s ``gamma`` by ``(wrong / B)^2``. :class:`_RootBatch` takes
``B`` from the root's first input tensor (along ``batch_dim``, 0 by default) and checks it against
the root's output once its forward returns, before any gradient arrives:

* the output's dim 0 agrees with it, is 1 (pooled or broadcast), or is the product of the input's
  leading dims (tokens flattened to ``(B*T, V)``): ``B`` stays;
* otherwise the targets' dim 0 decides between the two (no targets known: the dim 0 of the
  other input tensors, offsets or lengths, where it holds one of them only). EmbeddingBag's own
  ``(flat_tokens, offsets)`` and a time-major ``(T, B, F)`` input take the output's, a CTC model's
  time-major ``(T, B, C)`` output of a batch-first input keeps the input's;
* otherwise ``B`` is unknown (:attr:`_RootBatch.conflict` says why), and a forward that a
  per-example scaled backward would follow is refused (:meth:`MomentProbe._root_hook`).

An explicit ``batch_dim`` is the user's word: ``B`` is the first input's size there, unchecked
(unknown where that input lacks the dim and another has it: each module call counts its own);
one that no input tensor has is refused.
:class:`_Scale` is a module call's gradient factor, read when its gradients arrive (after the root
settled ``B``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from initlab._core.data import find_target
from initlab._core.pytree import flatten_tensors
from initlab._core.rows import shown

if TYPE_CHECKING:
    from initlab.measure.probe.state import _Record


class _RootBatch:
    """The examples ``size`` of one root forward (``None``: its first input has no batch dim).

    Raises:
        ValueError: an explicit ``batch_dim`` that no input tensor has, where one has a dim
            (every module call would index a dim its inputs lack). One input with it is enough:
            ``forward(t, x)`` with ``t`` of shape ``(B,)`` and ``x`` time-major ``(T, B, F)``
            takes ``batch_dim=1`` (``size`` is then ``None``: each module call's own input
            counts its examples).
    """

    __slots__ = ("_inputs", "conflict", "explicit", "size")

    def __init__(self, tensors: list[torch.Tensor], batch_dim: int | None) -> None:
        dim = batch_dim or 0
        first = tensors[0] if tensors else None
        self.size = int(first.shape[dim]) if first is not None and first.dim() > dim else None
        self.explicit = batch_dim is not None
        if self.explicit and _beyond_every_input(tensors, dim):
            raise ValueError(_beyond_message(tensors, dim))
        self.conflict: str | None = None
        self._inputs = tensors  # kept until settle(): the evidence of a dim 0 that is no batch

    def settle(self, output: Any, target_rows: int | None) -> None:
        """Check ``size`` against the root's ``output`` and the targets' dim 0 (``None``:
        unknown); keep it, take the output's dim 0, or set :attr:`conflict`."""
        inputs, self._inputs = self._inputs, []
        if self.explicit or self.size is None:
            return
        out = next((t for _, t in flatten_tensors(output) if t.dim() >= 1), None)
        if out is None:
            return
        rows, first = int(out.shape[0]), inputs[0]
        if rows in (self.size, 1) or _flattens(first, rows):
            return
        if target_rows is None:  # the other inputs' dim 0 (offsets, lengths) for the one only
            others = {int(t.shape[0]) for t in inputs[1:] if t.dim() >= 1}
            if (rows in others) != (self.size in others):
                self.size = rows if rows in others else self.size
                return
        elif target_rows in (rows, self.size):
            self.size = target_rows
            return
        targets = "" if target_rows is None else f" and the targets {target_rows}"
        self.conflict = (
            f"the batch size is unclear: the model's first input tensor has {self.size} along "
            f"dim 0 (shape {tuple(first.shape)}) but its output has {rows} (shape "
            f"{tuple(out.shape)}){targets}. With a mean-reduced loss the per-example gradients "
            "(E_dy2, E_dx2, E_dW2_example, and gr_scaling's gamma) are the minibatch ones times "
            "the batch size, so a wrong one would scale them by its square. Put a batch-first "
            "tensor first in the model's inputs, pass batch_dim= (the dim of the first input "
            "tensor that holds the examples), or use a sum-reduced loss with "
            "loss_reduction='sum'"
        )


def _beyond_every_input(tensors: list[torch.Tensor], dim: int) -> bool:
    """Whether no input tensor has dim ``dim`` while some has a dim (0-d ones only: no batch to
    index, nothing refused)."""
    return any(t.dim() > 0 for t in tensors) and not any(t.dim() > dim for t in tensors)


def _beyond_message(tensors: list[torch.Tensor], dim: int) -> str:
    """The refusal of ``batch_dim=dim`` that no input tensor has: their shapes, and the dims one
    of them has (any of them may hold the examples, not only dim 0 of the first)."""
    shaped = [tuple(t.shape) for t in tensors if t.dim() > 0]
    top = max(len(s) for s in shaped) - 1
    if len(shaped) == 1:
        which = "first input tensor" if tensors[0].dim() > 0 else "one input tensor that is not 0-d"
        return (
            f"MomentProbe: batch_dim={dim} is beyond the model's {which}, of shape "
            f"{shaped[0]} ({top + 1} dims): pass the dim of that tensor that holds the examples "
            f"(0 to {top}), or batch_dim=None for dim 0"
        )
    return (
        f"MomentProbe: batch_dim={dim} is beyond every input tensor of the model, of shapes "
        f"{shown([str(s) for s in shaped], 4)} (at most {top + 1} dims): pass the dim that "
        f"holds the examples in the input tensors that have them (0 to {top}), or "
        "batch_dim=None for dim 0 of the first"
    )


def _flattens(x: torch.Tensor, rows: int) -> bool:
    """``rows`` is the product of ``x``'s first two or more dims (tokens ``(B, T)`` flattened to
    ``(B*T, V)`` logits): an output per token of ``B`` examples."""
    return any(math.prod(x.shape[:k]) == rows for k in range(2, x.dim() + 1))


def target_rows(batch: Any) -> int | None:
    """Dim 0 of the batch's targets (``y`` of ``(x, y, ...)``, a dict's ``labels``), or
    ``None``."""
    found = find_target(batch)
    y = None if found is None else found[1]
    return int(y.shape[0]) if isinstance(y, torch.Tensor) and y.dim() >= 1 else None


class _Scale:
    """The factor of a module call's gradients: ``fixed``, or the batch size of the root forward
    it ran in (``root``), read when the gradients arrive."""

    __slots__ = ("fixed", "root")

    def __init__(self, fixed: float = 1.0, root: _RootBatch | None = None) -> None:
        self.fixed = fixed
        self.root = root

    @property
    def value(self) -> float:
        root = self.root
        if root is None or root.size is None:
            return self.fixed
        return float(root.size)


def mean_factor(reduction: str, counted: float | None, root: _RootBatch | None) -> float | None:
    """What the minibatch gradient ``dW`` of one backward is multiplied by to give the mean over
    the root batch's ``B`` examples of their per-example gradients (those of ``dW_example``):
    1 for a mean over the ``B`` examples, ``1/B`` for a sum, ``N/B`` for a mean over ``N``
    counted targets (``counted``: :func:`~initlab._core.loss_counts.example_count`). ``None``: ``B``
    is unknown where it is needed."""
    if reduction == "mean" and counted is None:
        return 1.0
    size = None if root is None else root.size
    if not size:
        return None
    return (1.0 if reduction == "sum" else float(counted or 0.0)) / size


def check_root_batch(rec: _Record) -> None:
    """Once the root forward settled its batch size: a replayed call splits its inputs into that
    many examples; a closed form's input must hold as many (else the call's ``fail`` says so)."""
    root, rec.root = rec.root, None
    if root is None or root.size is None:
        return
    if rec.state.replay:
        rec.batch = root.size
    elif rec.fail is None and rec.batch != root.size:
        rec.fail = batch_mismatch(rec.batch, rec.state.bd, root.size)


def batch_mismatch(found: int, dim: int, batch: int) -> str:
    """Why a module call has no per-example gradients: its input does not hold the root batch's
    examples along ``dim``. An input of 1 there is shared by every example (broadcast, as position
    ids ``(1, T)``): its output's gradient arrives summed over the examples, whatever
    ``batch_dim``."""
    if found == 1 and batch > 1:
        return (
            f"module input has 1 along dim {dim} while the root batch has {batch} examples: one "
            "input shared by every example (e.g. position ids broadcast over the batch), whose "
            "output's gradient arrives summed over the examples, so the probe cannot split it"
        )
    return (
        f"module input has {found} along dim {dim}, the root batch has {batch} examples (set "
        "batch_dim?)"
    )
