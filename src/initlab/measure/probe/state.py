"""What the moment probe keeps per parameter, per module and per module call.

:class:`_ParamState` (everything measured about one parameter tensor), :class:`_ModuleState`
(one probed module: its accumulators, calls in flight, parameters), :class:`_Frame` (one module
call between its forward pre-hook and forward hook), :class:`_Forward` (one forward of the root
model) and :class:`_Record` (what one module call keeps for per-example gradients until its
parameters' gradient hooks fire).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from initlab._core.hooks import refuse_inside_vmap
from initlab.measure.probe.contribution import _Contribution
from initlab.measure.probe.per_example import PER_EXAMPLE, _kind

if TYPE_CHECKING:
    from initlab.measure.probe.batch import _RootBatch, _Scale
    from initlab.measure.probe.capture import _AttentionCapture

_MISMATCH = (
    "per-example gradients do not add up to the minibatch gradient (the parameter is also used "
    "outside its modules' forwards, a tensor the module computes reaches the loss other than "
    "through what it returns, or the module couples examples)"
)


class _ParamState:
    """Everything measured about one parameter tensor (shared by all modules that own it), or
    about a tensor a parametrization computes (``param``: its value at the probe's
    ``__enter__``; ``remark``: which parametrization; its gradients arrive in ``grad_parts``, one
    per evaluation, and are summed when the trainable tensors' gradients arrive)."""

    def __init__(self, param: torch.Tensor, vecs: list[torch.Tensor]) -> None:
        self.param = param
        self.computed_trainable: bool | None = None  # a computed tensor: whether it has gradients
        self.remark = ""  # a computed tensor: the parametrization that computes it
        self.no_example: str | None = None  # a computed tensor without per-example gradients
        self.grad_parts: list[torch.Tensor] = []
        self.acc_w: torch.Tensor | None = None  # W's sums at the probe's __enter__
        self.numel = param.numel()
        self.acc_dw: torch.Tensor | None = None
        self.acc_mb: torch.Tensor | None = None  # dW_minibatch
        self.acc_ex: torch.Tensor | None = None
        self.failed = 0
        self.notes: list[str] = []
        self.mismatch: torch.Tensor | None = None  # device count of failed consistency checks
        self.pending: list[_Record] = []
        self.vecs = vecs  # random vectors, one per dim: the rank-one check projection
        self._vecs_as: dict[torch.dtype, list[torch.Tensor]] = {torch.float64: vecs}
        self.adopted_at: int | None = None
        self.label = ""

    @property
    def trainable(self) -> bool:
        """Whether gradients reach the tensor: the parameter's ``requires_grad``, or for a
        computed tensor whether one of its parametrization's parameters requires grad."""
        if self.computed_trainable is not None:
            return self.computed_trainable
        return self.param.requires_grad

    def set_vecs(self, vecs: list[torch.Tensor], *more: list[torch.Tensor]) -> None:
        """The check's vectors (float64), and the same in other dtypes (``more``)."""
        self.vecs = vecs
        self._vecs_as = {torch.float64: vecs}
        for other in more:
            self._vecs_as[other[0].dtype if other else torch.float64] = other

    def vecs_as(self, dtype: torch.dtype) -> list[torch.Tensor]:
        out = self._vecs_as.get(dtype)
        if out is None:
            out = self._vecs_as[dtype] = [v.to(dtype) for v in self.vecs]
        return out

    def fail(self, note: str) -> None:
        self.failed += 1
        if note not in self.notes:
            self.notes.append(note)

    def report(self) -> tuple[int, list[str]]:
        """(number of backward passes without an exact per-example result, reasons)."""
        mismatches = 0 if self.mismatch is None else int(self.mismatch.item())
        notes = list(self.notes)
        if mismatches:
            notes.append(_MISMATCH)
        return self.failed + mismatches, notes


class _Frame:
    """One module call in flight (between its forward pre-hook and forward hook)."""

    __slots__ = ("call", "capture", "inputs", "leaves", "scale", "start_seq", "versions")

    def __init__(
        self,
        call: int,
        inputs: Any,
        leaves: list[torch.Tensor],
        versions: list[int],
        scale: _Scale,
        seq: int,
    ) -> None:
        self.call = call
        self.inputs = inputs  # (args, kwargs) as the module received them
        self.leaves = leaves  # their tensors, in flatten_tensors order
        self.versions = versions
        self.scale = scale  # read when the gradients arrive: the root's batch is settled then
        self.start_seq = seq
        self.capture: _AttentionCapture | None = None  # attention: its projections, captured


class _ModuleState:
    def __init__(
        self, name: str, module: nn.Module, rank: int, batch_dim: int, given: bool = False
    ) -> None:
        self.name = name
        self.module = module
        self.rank = rank
        self.bd = batch_dim
        self.bd_given = given  # batch_dim= was passed (not the default)
        self.kind = _kind(module)
        self.replay = PER_EXAMPLE[self.kind].replay is not None  # grads by a re-run
        self.order: int | None = None
        self.calls_this_forward = 0
        self.max_calls = 0
        self.acc: dict[tuple[int, str, str], torch.Tensor] = {}
        self.params: list[tuple[str, _ParamState]] = []
        self.adoptable: list[tuple[str, _ParamState, _ModuleState]] = []
        self.frames: list[_Frame] = []
        self.last_seq = -1
        self.float16 = False  # a float16 output or output gradient seen

    def refuse_vmapped(self) -> None:
        """Raise if the module's hooks run inside ``torch.func.vmap``
        (:func:`~initlab._core.hooks.refuse_inside_vmap`): they see one example of each tensor,
        the batch dimension the moments and per-example gradients are taken over hidden."""
        refuse_inside_vmap(
            self.name,
            "the moment probe",
            " (or leave the module out of the probe: modules= of MomentProbe, measure_moments or "
            "diagnose)",
        )


class _Forward:
    """One forward of the root model; ``coupled`` when BatchNorm used batch statistics in it."""

    __slots__ = ("coupled",)

    def __init__(self) -> None:
        self.coupled = False


class _Record:
    """What one module call keeps for per-example gradients until its parameters' hooks fire."""

    def __init__(
        self,
        state: _ModuleState,
        frame: _Frame,
        params: dict[str, _ParamState],
        forward: _Forward,
    ) -> None:
        self.state = state
        self.forward = forward
        self.call = frame.call
        self._scale = frame.scale
        self.root: _RootBatch | None = None  # the root forward's batch, checked once settled
        self.params = params
        self.live = True
        self.fail: str | None = None
        self.batch = 0
        self.inputs: Any = None
        self.versions: list[int] = []
        self.x: torch.Tensor | None = None
        self.x_version = 0
        self.out_meta: list[tuple[str, tuple[int, ...]]] = []
        self.dys: dict[str, torch.Tensor] = {}
        self.contrib: dict[int, _Contribution] = {}
        self.generic_key = -1
        self.capture: _AttentionCapture | None = None  # attention: replaces the re-run
        self.compute_eps = 0.0  # eps of the dtype the module's backward ran in (its output's)

    @property
    def scale(self) -> float:
        """The factor of the call's gradients (the root batch's size, for a mean loss)."""
        return self._scale.value
