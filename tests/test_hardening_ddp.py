"""Issue 13, DDP: ranks that disagree raise the same clear error on every rank (2 gloo CPU ranks).

Each case runs on both ranks of one process group (one spawn for the whole table); a case that
raises must raise on *both* ranks, with the same type and message, and leave each rank's model as
it was. Ranks that agree run to the end with bit-identical weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from initlab.diagnostics.doctor import doctor
from initlab.measure.conditioning import gr_scaling
from initlab.methods.gradinit import gradinit_
from initlab.methods.lsuv import lsuv_
from initlab.methods.metainit import metainit_
from initlab.methods.output_scale import scale_output_
from initlab.methods.precondition import precondition_

from .ddp_util import run_ranks

D = torch.float64


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)).to(D)


def _batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randn(8, 6, generator=gen, dtype=D), torch.randint(0, 3, (8,), generator=gen))
        for _ in range(n)
    ]


def _with_nan(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = _batches(rank, 4)
    if rank == 1:
        batches[2][0][0, 0] = float("nan")
    return batches


def _wide(rank: int, n: int, bad: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank 1's batch ``bad`` has 7 features instead of 6: that rank fails inside an iteration."""
    batches = _batches(rank, n)
    if rank == 1:
        batches[bad] = (torch.randn(8, 7, dtype=D), batches[bad][1])
    return batches


class _Once(torch.autograd.Function):
    """tanh whose backward is marked once-differentiable (no second derivative)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = x.tanh()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)


class _OnceNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _model(0)[0], _model(0)[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_Once.apply(self.a(x)))


class _FailOn(nn.Module):
    """Identity that raises on one rank: a failure in the middle of a forward pass."""

    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.fail = fail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("this layer failed on this rank")
        return x


def _failing_mid_forward(rank: int) -> nn.Module:
    model = _model(0)
    return nn.Sequential(model[0], model[1], _FailOn(rank == 1), model[2])


class _Branch(nn.Module):
    """A layer chosen by the data: ``a`` where the batch's first entry is positive, else ``b``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.a, self.b = nn.Linear(6, 12), nn.Linear(12, 12), nn.Linear(12, 12)
        self.out = nn.Linear(12, 3)
        self.to(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).tanh()
        return self.out((self.a(h) if bool(x[0, 0] > 0) else self.b(h)).tanh())


def _signed(rank: int, positive: bool) -> torch.Tensor:
    x = _batches(rank, 1)[0][0]
    x[0, 0] = 1.0 if positive else -1.0
    return x


Case = Callable[[int], tuple[nn.Module, Callable[[nn.Module], Any]]]

#: name -> (model, call) on a rank; the expected outcome is in _EXPECTED.
_CASES: dict[str, Case] = {
    "gradinit_, ranks start from different weights": lambda r: (
        _model(r),
        lambda m: gradinit_(m, _batches(r, 4), gamma=10.0),
    ),
    "metainit_, ranks start from different weights": lambda r: (
        _model(r),
        lambda m: metainit_(m, _batches(r, 3), variant="gradinit"),
    ),
    "scale_output_, ranks start from different weights": lambda r: (
        _model(r),
        lambda m: scale_output_(m, _batches(r, 2)),
    ),
    "precondition_, ranks start from different weights": lambda r: (
        _model(r),
        lambda m: precondition_(m, _batches(r, 2)),
    ),
    "lsuv_(orthogonal=False), ranks start from different weights": lambda r: (
        _model(r),
        lambda m: lsuv_(m, _batches(r, 1)[0][0], orthogonal=False),
    ),
    "gradinit_, 4 and 5 batches (lists)": lambda r: (
        _model(0),
        lambda m: gradinit_(m, _batches(r, 4 + r), gamma=10.0),
    ),
    "gradinit_, 4 and 5 batches (generators)": lambda r: (
        _model(0),
        lambda m: gradinit_(m, (b for b in _batches(r, 4 + r)), gamma=10.0),
    ),
    "metainit_, 3 and 4 batches (lists)": lambda r: (
        _model(0),
        lambda m: metainit_(m, _batches(r, 3 + r), variant="gradinit"),
    ),
    "gradinit_, steps=4 and rank 1 has 4 batches": lambda r: (
        _model(0),
        lambda m: gradinit_(m, _batches(r, 5 - r), steps=4, gamma=10.0),
    ),
    "gradinit_, NaN in batch 2 of rank 1": lambda r: (
        _model(0),
        lambda m: gradinit_(m, (b for b in _with_nan(r)), gamma=10.0),
    ),
    "scale_output_, rank 1 has no batch": lambda r: (
        _model(0),
        lambda m: scale_output_(m, _batches(r, 2) if r == 0 else []),
    ),
    "lsuv_, ranks start from different weights (the orthogonal pre-init is broadcast)": lambda r: (
        _model(r),
        lambda m: lsuv_(m, _batches(r, 1)[0][0], generator=0),
    ),
    # eighth session: what the orthogonal pre-init does not redraw must agree
    "lsuv_, rank 1's hidden layer is wider (the pre-init broadcast rank 0's draw into it)": (
        lambda r: (_wider(r), lambda m: lsuv_(m, _batches(r, 1)[0][0], generator=0))
    ),
    "lsuv_, a LayerNorm that differs by rank (the pre-init redraws the Linear layers only)": (
        lambda r: (_normed(r), lambda m: lsuv_(m, _batches(r, 1)[0][0], generator=0))
    ),
    # options that differ by rank: different collectives (gloo aborted, or waited 30 minutes)
    "gradinit_, gamma differs by rank": lambda r: (
        _model(0),
        lambda m: gradinit_(m, _batches(r, 4), gamma=10.0 * (1 + r)),
    ),
    "scale_output_, how differs by rank": lambda r: (
        _model(0),
        lambda m: scale_output_(m, _batches(r, 2), how="fold" if r == 0 else "module"),
    ),
    "precondition_, how differs by rank": lambda r: (
        _model(0),
        lambda m: precondition_(m, _batches(r, 2), how="lr" if r == 0 else "rescale"),
    ),
    "lsuv_, target and max_iter differ by rank": lambda r: (
        _model(0),
        lambda m: lsuv_(m, _batches(r, 1)[0][0], target=1.0 + r, max_iter=5 + r, generator=0),
    ),
    "scale_output_, rank 1's model in eval mode (a BatchNorm's statistics mixed)": lambda r: (
        _bn_model().train(r == 0),
        lambda m: scale_output_(m, _batches(r, 2)),
    ),
    "gr_scaling(all_reduce=True), rank 1's model in eval mode": lambda r: (
        _bn_model().train(r == 0),
        lambda m: gr_scaling(m, _batches(r, 2), all_reduce=True),
    ),
    "gradinit_, float64 on rank 0 and float32 on rank 1": lambda r: (
        _model(0).to(torch.float32 if r else D),
        lambda m: gradinit_(m, _batches(r, 4), gamma=10.0),
    ),
    "gradinit_, batches of 8 on rank 0 and of 6 on rank 1": lambda r: (
        _model(0),
        lambda m: gradinit_(
            m, [(x[: 8 - 2 * r], y[: 8 - 2 * r]) for x, y in _batches(r, 4)], gamma=10.0
        ),
    ),
    "gradinit_, 5 and 4 batches with steps=3": lambda r: (
        _model(0),
        lambda m: gradinit_(m, _batches(r, 5 - r), steps=3, gamma=10.0),
    ),
    "gradinit_, rank 1's batch 2 is 7 wide (a failure inside an iteration)": lambda r: (
        _model(0),
        lambda m: gradinit_(m, _wide(r, 4, 2), gamma=10.0),
    ),
    "metainit_, rank 1's batch 1 is 7 wide (a failure inside an iteration)": lambda r: (
        _model(0),
        lambda m: metainit_(m, _wide(r, 3, 1), variant="gradinit"),
    ),
    "scale_output_, rank 1's batch 1 is 7 wide (a failure inside the passes)": lambda r: (
        _model(0),
        lambda m: scale_output_(m, _wide(r, 2, 1)),
    ),
    "precondition_, rank 1's batch 1 is 7 wide (a failure inside the passes)": lambda r: (
        _model(0),
        lambda m: precondition_(m, _wide(r, 2, 1)),
    ),
    "lsuv_(orthogonal=False), rank 1's batch is 7 wide (a failure inside the pass)": lambda r: (
        _model(0),
        lambda m: lsuv_(m, _wide(r, 1, 0)[0][0], orthogonal=False),
    ),
    "lsuv_, a layer raises on rank 1 in the middle of the forward pass": lambda r: (
        _failing_mid_forward(r),
        lambda m: lsuv_(m, _batches(0, 1)[0][0], generator=0),
    ),
    "gradinit_ constraint step through a once-differentiable op (fails on both ranks)": lambda r: (
        _OnceNet(),
        lambda m: gradinit_(m, _batches(r, 3), gamma=0.0),
    ),
    # second sweep: what differs by rank past the checks
    "gradinit_, layer 0 frozen on rank 1 only": lambda r: (
        _model(0).requires_grad_(True) if r == 0 else _frozen_first(),
        lambda m: gradinit_(m, _batches(r, 4), gamma=10.0),
    ),
    "lsuv_, layer 0 frozen on rank 1 only": lambda r: (
        _model(0) if r == 0 else _frozen_first(),
        lambda m: lsuv_(m, _batches(r, 1)[0][0], generator=0),
    ),
    "metainit_, layer 0 frozen on rank 1 only": lambda r: (
        _model(0) if r == 0 else _frozen_first(),
        lambda m: metainit_(m, _batches(r, 3), variant="gradinit"),
    ),
    "precondition_, TorchScript on rank 1 only": lambda r: (
        _model(0) if r == 0 else _scripted(),
        lambda m: precondition_(m, _batches(r, 2)),
    ),
    "lsuv_, TorchScript on both ranks": lambda r: (
        _scripted(),
        lambda m: lsuv_(m, _batches(r, 1)[0][0]),
    ),
    "lsuv_(norm_mode='train'), a one-example batch through BatchNorm on rank 1 only": lambda r: (
        _bn_model(),
        lambda m: lsuv_(m, _batches(r, 1)[0][0][: 1 if r else 8], norm_mode="train"),
    ),
    # fifth session: data-dependent control flow (it mixed layer a's moments with b's, silently)
    "lsuv_(orthogonal=False), the ranks' batches run different layers": lambda r: (
        _Branch(),
        lambda m: lsuv_(m, _signed(r, r == 0), orthogonal=False),
    ),
    "lsuv_, the ranks' batches run different layers": lambda r: (
        _Branch(),
        lambda m: lsuv_(m, _signed(r, r == 0), generator=0),
    ),
    "lsuv_, the ranks' batches run the same branch": lambda r: (
        _Branch(),
        lambda m: _quiet_lsuv(m, _signed(r, True)),
    ),
    "doctor under torch.distributed (one process's choices)": lambda r: (
        _model(0),
        lambda m: doctor(m, _batches(r, 2)),
    ),
    # fourth session: gr_scaling's pooled moments (all_reduce=True) fail together too
    "gr_scaling(all_reduce=True), rank 1 has no batch": lambda r: (
        _model(0),
        lambda m: gr_scaling(m, _batches(r, 2) if r == 0 else [], all_reduce=True),
    ),
    "gr_scaling(all_reduce=True), ranks start from different weights": lambda r: (
        _model(r),
        lambda m: gr_scaling(m, _batches(r, 2), all_reduce=True),
    ),
    "gr_scaling(all_reduce=True), ranks agree": lambda r: (
        _model(0),
        lambda m: gr_scaling(m, _batches(r, 2), all_reduce=True),
    ),
    # eleventh session: buffers (an eval-mode BatchNorm's statistics) were not compared
    "scale_output_, eval-mode BatchNorm's running_var differs by rank": lambda r: (
        _bn_buffer(r, "running_var"),
        lambda m: scale_output_(m, _batches(0, 2), target=0.05),
    ),
    "gradinit_, eval-mode BatchNorm's running_mean differs by rank (it runs on batch stats)": (
        lambda r: (
            _bn_buffer(r, "running_mean"),
            lambda m: gradinit_(m, _batches(r, 4), gamma=10.0),
        )
    ),
    "lsuv_, BatchNorm's running_var differs by rank (the pre-init redraws weights only)": (
        lambda r: (_bn_buffer(r, "running_var"), lambda m: lsuv_(m, _batches(r, 1)[0][0]))
    ),
    "gr_scaling(all_reduce=True), a weight and running_var differ by rank": lambda r: (
        _bn_weight_and_var(r),
        lambda m: gr_scaling(m, _batches(r, 2), all_reduce=True),
    ),
    "precondition_, a non-persistent buffer differs by rank": lambda r: (
        _Scaled(r),
        lambda m: precondition_(m, _batches(r, 2)),
    ),
    "scale_output_, only BatchNorm's num_batches_tracked differs (a counter: no output)": (
        lambda r: (
            _bn_buffer(r, "num_batches_tracked"),
            lambda m: scale_output_(m, _batches(0, 2), target=0.05),
        )
    ),
    # eleventh session: the running statistics of a norm on batch statistics change no output;
    # they differ by rank under DDP without SyncBatchNorm (each rank updates them from its batch)
    "gradinit_, a train-mode BatchNorm updated on each rank's own batch": lambda r: (
        _bn_warmed(r),
        lambda m: gradinit_(m, _batches(r, 4), gamma=10.0),
    ),
    "metainit_, a train-mode BatchNorm updated on each rank's own batch": lambda r: (
        _bn_warmed(r),
        lambda m: metainit_(m, _batches(r, 3), variant="gradinit"),
    ),
    "metainit_(batch_stats=False): it reads the running statistics, which differ by rank": (
        lambda r: (
            _bn_warmed(r),
            lambda m: metainit_(m, _batches(r, 3), variant="gradinit", batch_stats=False),
        )
    ),
    "lsuv_(norm_mode='train'), a BatchNorm updated on each rank's own batch": lambda r: (
        _bn_warmed(r),
        lambda m: lsuv_(m, _batches(r, 1)[0][0], norm_mode="train"),
    ),
    "lsuv_ (norm_mode='eval') of a train-mode model: it reads the running statistics": (
        lambda r: (_bn_warmed(r), lambda m: lsuv_(m, _batches(r, 1)[0][0]))
    ),
    "scale_output_, a train-mode BatchNorm updated on each rank's own batch": lambda r: (
        _bn_warmed(r),
        lambda m: scale_output_(m, _batches(r, 2)),
    ),
    "gr_scaling(all_reduce=True), a train-mode BatchNorm updated on each rank's own batch": (
        lambda r: (_bn_warmed(r), lambda m: gr_scaling(m, _batches(r, 2), all_reduce=True))
    ),
    "precondition_, the same BatchNorm updated on each rank's own batch, in eval mode": (
        lambda r: (_bn_warmed(r).eval(), lambda m: precondition_(m, _batches(r, 2)))
    ),
    "scale_output_, an eval-mode InstanceNorm tracks running statistics on rank 0 only": (
        lambda r: (_instance_normed(r), lambda m: scale_output_(m, _batches(r, 2)))
    ),
    # eleventh session: a complex128 buffer made the checksum raise KeyError: 16 on every rank
    "gradinit_, a complex128 buffer equal on both ranks": lambda r: (
        _Phased(r, 0.0),
        lambda m: gradinit_(m, _batches(r, 4), gamma=10.0),
    ),
    "precondition_, a complex128 buffer differs by rank": lambda r: (
        _Phased(r, 0.5),
        lambda m: precondition_(m, _batches(r, 2)),
    ),
}


def _bn_buffer(rank: int, name: str, train: bool = False) -> nn.Module:
    """The BatchNorm model with the buffer ``name`` of its norm set by rank (the parameters
    equal): 1.0 on rank 0, 0.02 on rank 1 (a count: 0 and 7)."""
    model = _bn_model().train(train)
    buffer = getattr(model[1], name)
    buffer.fill_((7 if rank else 0) if name == "num_batches_tracked" else (0.02 if rank else 1.0))
    return model


class _Scaled(nn.Module):
    """A model with a non-persistent buffer (not in the state_dict) that scales its output."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.net = _model(0)
        self.register_buffer("scale", torch.tensor(1.0 + rank, dtype=D), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.scale


def _bn_warmed(rank: int) -> nn.Module:
    """The BatchNorm model in train mode after one forward pass on this rank's own batch (as
    under DDP without SyncBatchNorm): its running statistics differ by rank, its parameters not."""
    model = _bn_model().train()
    with torch.no_grad():
        model(_batches(rank, 1)[0][0] * (1 + rank))
    return model


def _instance_normed(rank: int) -> nn.Module:
    """An eval-mode InstanceNorm1d with running statistics, which it reads on rank 0 only (rank 1
    turns ``track_running_stats`` off: its own statistics of each example)."""
    model = _model(0)
    norm = nn.InstanceNorm1d(3, track_running_stats=True).to(D)
    norm.track_running_stats = rank == 0
    layers = [model[0], nn.Unflatten(1, (3, 4)), norm, nn.Flatten(), model[1], model[2]]
    return nn.Sequential(*layers).eval()


class _Phased(nn.Module):
    """A model with a complex128 buffer (a rotary table kept in double precision) whose real part
    shifts the output: 1 on rank 0, ``1 + shift`` on rank 1."""

    def __init__(self, rank: int, shift: float) -> None:
        super().__init__()
        self.net = _model(0)
        phase = torch.full((3,), 1.0 + shift * rank, dtype=torch.complex128)
        self.register_buffer("phase", phase)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) + self.phase.real


def _bn_weight_and_var(rank: int) -> nn.Module:
    model = _bn_buffer(rank, "running_var")
    with torch.no_grad():
        model[1].weight.fill_(1.0 + rank)
    return model


def _wider(rank: int) -> nn.Module:
    """Hidden width 12 on rank 0, 16 on rank 1 (the same number of tensors)."""
    torch.manual_seed(0)
    width = 12 + 4 * rank
    return nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, 3)).to(D)


def _normed(rank: int) -> nn.Module:
    """A LayerNorm whose scale differs by rank after equal Linear layers."""
    model = _model(0)
    norm = nn.LayerNorm(12).to(D)
    with torch.no_grad():
        norm.weight.fill_(1.0 + rank)
    return nn.Sequential(model[0], norm, model[1], model[2])


def _quiet_lsuv(model: nn.Module, x: torch.Tensor) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "lsuv_: 1 layer.s. never ran", UserWarning)
        lsuv_(model, x, generator=0)


def _frozen_first() -> nn.Module:
    model = _model(0)
    model[0].requires_grad_(False)
    return model


def _scripted() -> nn.Module:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(_model(0))


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.Tanh(), nn.Linear(12, 3)).to(D)


#: name -> a fragment of the message every rank raises (a RankMismatchError, or the error type
#: given first), or None: runs, ranks end identical.
_EXPECTED: dict[str, str | tuple[str, str] | None] = {
    "gradinit_, ranks start from different weights": (
        "gradinit_: the ranks hold different parameters (4 of 4 tensors differ"
    ),
    "metainit_, ranks start from different weights": "metainit_: the ranks hold different",
    "scale_output_, ranks start from different weights": "scale_output_: the ranks hold different",
    "precondition_, ranks start from different weights": "precondition_: the ranks hold different",
    "lsuv_(orthogonal=False), ranks start from different weights": (
        "lsuv_: the ranks hold different"
    ),
    "gradinit_, 4 and 5 batches (lists)": (
        "gradinit_: the ranks have different numbers of iterations (3 to 4)"
    ),
    "gradinit_, 4 and 5 batches (generators)": (
        "gradinit_: the ranks have different numbers of batches: at iteration 3, 1 of 2 rank(s) "
        "had none left"
    ),
    "metainit_, 3 and 4 batches (lists)": (
        "metainit_: the ranks have different numbers of iterations (3 to 4)"
    ),
    "gradinit_, steps=4 and rank 1 has 4 batches": (
        "gradinit_ stopped on every rank because 1 of 2 rank(s) failed: rank 1: ValueError: "
        "gradinit_ needs 5 batches for 4 iterations"
    ),
    "gradinit_, NaN in batch 2 of rank 1": (
        "gradinit_ stopped on every rank because 1 of 2 rank(s) failed: rank 1: ValueError: "
        "gradinit_: batch 2 has 1 non-finite value(s)"
    ),
    "scale_output_, rank 1 has no batch": (
        "scale_output_ stopped on every rank because 1 of 2 rank(s) failed: rank 1: ValueError: "
        "scale_output_ got no batch: the data is empty"
    ),
    "gradinit_, rank 1's batch 2 is 7 wide (a failure inside an iteration)": (
        "gradinit_ stopped on every rank because 1 of 2 rank(s) failed: rank 1: RuntimeError: "
    ),
    "metainit_, rank 1's batch 1 is 7 wide (a failure inside an iteration)": (
        "metainit_ stopped on every rank because 1 of 2 rank(s) failed: rank 1: RuntimeError: "
    ),
    "scale_output_, rank 1's batch 1 is 7 wide (a failure inside the passes)": (
        "scale_output_ stopped on every rank because 1 of 2 rank(s) failed: rank 1: RuntimeError: "
    ),
    "precondition_, rank 1's batch 1 is 7 wide (a failure inside the passes)": (
        "precondition_ stopped on every rank because 1 of 2 rank(s) failed: rank 1: RuntimeError: "
    ),
    "lsuv_(orthogonal=False), rank 1's batch is 7 wide (a failure inside the pass)": (
        "lsuv_ stopped on every rank because 1 of 2 rank(s) failed: rank 1: RuntimeError: "
    ),
    "lsuv_, a layer raises on rank 1 in the middle of the forward pass": (
        "lsuv_ stopped on every rank because 1 of 2 rank(s) failed: rank 1: RuntimeError: this "
        "layer failed on this rank"
    ),
    "gradinit_ constraint step through a once-differentiable op (fails on both ranks)": (
        "DoubleBackwardError",
        "gradinit_ differentiates the loss twice",
    ),
    "lsuv_, ranks start from different weights (the orthogonal pre-init is broadcast)": None,
    "gradinit_, gamma differs by rank": (
        "gradinit_: the ranks called it with different options (gamma)"
    ),
    "gradinit_, batches of 8 on rank 0 and of 6 on rank 1": (
        "gradinit_: the ranks have different numbers of examples in a batch (6 to 8)"
    ),
    "scale_output_, rank 1's model in eval mode (a BatchNorm's statistics mixed)": (
        "scale_output_: the ranks' models are in different train/eval modes (0 to 5 modules"
    ),
    "gr_scaling(all_reduce=True), rank 1's model in eval mode": (
        "gr_scaling: the ranks' models are in different train/eval modes (0 to 5 modules"
    ),
    "scale_output_, how differs by rank": (
        "scale_output_: the ranks called it with different options (how)"
    ),
    "precondition_, how differs by rank": (
        "precondition_: the ranks called it with different options (how)"
    ),
    "lsuv_, target and max_iter differ by rank": (
        "lsuv_: the ranks called it with different options (target, max_iter)"
    ),
    "lsuv_, rank 1's hidden layer is wider (the pre-init broadcast rank 0's draw into it)": (
        "lsuv_: the ranks' models differ in the shape or dtype of 3 of 4 tensors (0.weight, "
        "0.bias, 2.weight)"
    ),
    "gradinit_, float64 on rank 0 and float32 on rank 1": (
        "gradinit_: the ranks' models differ in the shape or dtype of 4 of 4 tensors"
    ),
    "lsuv_, a LayerNorm that differs by rank (the pre-init redraws the Linear layers only)": (
        "lsuv_: the ranks hold different parameters (1 of 6 tensors differ: 1.weight)"
    ),
    "gradinit_, layer 0 frozen on rank 1 only": (
        "gradinit_: the ranks' models differ in which tensors are trainable (requires_grad "
        "differs for 0.weight, 0.bias)"
    ),
    "lsuv_, layer 0 frozen on rank 1 only": "lsuv_: the ranks' models differ in which tensors",
    "metainit_, layer 0 frozen on rank 1 only": "metainit_: the ranks' models differ in which",
    "precondition_, TorchScript on rank 1 only": (
        "precondition_: the model is a TorchScript module on some ranks only"
    ),
    "lsuv_, TorchScript on both ranks": (
        "TypeError",
        "lsuv_: the model is a TorchScript module (RecursiveScriptModule)",
    ),
    "lsuv_(norm_mode='train'), a one-example batch through BatchNorm on rank 1 only": (
        "lsuv_ stopped on every rank because 1 of 2 rank(s) failed: rank 1: "
    ),
    "doctor under torch.distributed (one process's choices)": (
        "ValueError",
        "doctor runs in one process",
    ),
    "gradinit_, 5 and 4 batches with steps=3": None,
    "lsuv_(orthogonal=False), the ranks' batches run different layers": (
        "lsuv_: the ranks are out of step (rank 0 at the first call of a; rank 1 at the first "
        "call of b): their batches took different paths through the model"
    ),
    "lsuv_, the ranks' batches run different layers": (
        "lsuv_: the ranks are out of step (rank 0 at the orthogonal draw of a; rank 1 at the "
        "orthogonal draw of b)"
    ),
    "lsuv_, the ranks' batches run the same branch": None,
    "gr_scaling(all_reduce=True), rank 1 has no batch": (
        "gr_scaling stopped on every rank because 1 of 2 rank(s) failed: rank 1: ValueError: "
        "gr_scaling got no batch: the data is empty"
    ),
    "gr_scaling(all_reduce=True), ranks start from different weights": (
        "gr_scaling: the ranks hold different"
    ),
    "gr_scaling(all_reduce=True), ranks agree": None,
    "scale_output_, eval-mode BatchNorm's running_var differs by rank": (
        "scale_output_: the ranks hold different buffers (1 of 8 tensors differ: 1.running_var)"
    ),
    "gradinit_, eval-mode BatchNorm's running_mean differs by rank (it runs on batch stats)": (
        None
    ),
    "lsuv_, BatchNorm's running_var differs by rank (the pre-init redraws weights only)": (
        "lsuv_: the ranks hold different buffers (1 of 8 tensors differ: 1.running_var)"
    ),
    "gr_scaling(all_reduce=True), a weight and running_var differ by rank": (
        "gr_scaling: the ranks hold different parameters and buffers (2 of 8 tensors differ: "
        "1.weight, 1.running_var)"
    ),
    "precondition_, a non-persistent buffer differs by rank": (
        "precondition_: the ranks hold different buffers (1 of 5 tensors differ: scale)"
    ),
    "scale_output_, only BatchNorm's num_batches_tracked differs (a counter: no output)": None,
    "gradinit_, a train-mode BatchNorm updated on each rank's own batch": None,
    "metainit_, a train-mode BatchNorm updated on each rank's own batch": None,
    "metainit_(batch_stats=False): it reads the running statistics, which differ by rank": (
        "metainit_: the ranks hold different buffers (2 of 8 tensors differ: 1.running_mean, "
        "1.running_var)"
    ),
    "lsuv_(norm_mode='train'), a BatchNorm updated on each rank's own batch": None,
    "lsuv_ (norm_mode='eval') of a train-mode model: it reads the running statistics": (
        "lsuv_: the ranks hold different buffers (2 of 8 tensors differ: 1.running_mean, "
        "1.running_var)"
    ),
    "scale_output_, a train-mode BatchNorm updated on each rank's own batch": None,
    "gr_scaling(all_reduce=True), a train-mode BatchNorm updated on each rank's own batch": None,
    "precondition_, the same BatchNorm updated on each rank's own batch, in eval mode": (
        "precondition_: the ranks hold different buffers (2 of 8 tensors differ: "
        "1.running_mean, 1.running_var)"
    ),
    "scale_output_, an eval-mode InstanceNorm tracks running statistics on rank 0 only": (
        "scale_output_: the ranks' normalization layers normalize by different statistics (the "
        "batch's own on some ranks, the running ones in 2.running_mean, 2.running_var on others)"
    ),
    "gradinit_, a complex128 buffer equal on both ranks": None,
    "precondition_, a complex128 buffer differs by rank": (
        "precondition_: the ranks hold different buffers (1 of 5 tensors differ: phase)"
    ),
}


#: ``(error type or "", message, parameters unchanged, parameters, train/eval flags unchanged)``
_Outcome = tuple[str, str, bool, list[torch.Tensor], bool]


def _cases_worker(rank: int, world: int) -> dict[str, _Outcome]:
    """Every case on this rank: its :data:`_Outcome`."""
    out = {}
    for name, case in _CASES.items():
        model, call = case(rank)
        before = [p.detach().clone() for p in model.parameters()]
        modes = [m.training for m in model.modules()]
        kind = text = ""
        try:
            call(model)
        except Exception as err:
            kind, text = type(err).__name__, str(err)
        after = [p.detach().clone() for p in model.parameters()]
        unchanged = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        kept = modes == [m.training for m in model.modules()]
        out[name] = (kind, text, unchanged, after, kept)
    return out


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, _Outcome]]:
    return run_ranks(_cases_worker, 2)


@pytest.mark.parametrize("name", list(_EXPECTED))
def test_ranks_that_disagree_raise_the_same_error_on_every_rank(
    outcomes: list[dict[str, _Outcome]], name: str
) -> None:
    (kind0, text0, unchanged0, params0, kept0), (kind1, text1, unchanged1, params1, kept1) = (
        outcomes[0][name],
        outcomes[1][name],
    )
    assert kept0 and kept1  # every module's train/eval flag as the caller left it
    expected = _EXPECTED[name]
    if expected is None:
        assert kind0 == kind1 == "", (text0, text1)
        for p0, p1 in zip(params0, params1, strict=True):
            assert torch.equal(p0, p1)
        return
    kind, fragment = expected if isinstance(expected, tuple) else ("RankMismatchError", expected)
    assert kind0 == kind1 == kind, (text0, text1)
    assert text0 == text1
    assert fragment in text0, text0
    assert unchanged0 and unchanged1


def _scripted_on_one_rank(rank: int, world_size: int) -> str | None:
    try:
        scale_output_(_scripted(), _batches(rank, 1))
    except TypeError as err:
        return str(err)
    return None


def test_a_one_rank_process_group_still_refuses_a_torchscript_model() -> None:
    """With a process group of one rank the collective check does not run (it checks ranks
    against each other only when there are several): the refusal is the eager one. (It was
    skipped, and scale_output_ failed later: "no weight layer ran in the forward pass".)"""
    (message,) = run_ranks(_scripted_on_one_rank, 1)
    assert message is not None and "scale_output_: the model is a TorchScript module" in message


def _routed_rows(rank: int, world: int) -> dict[str, float]:
    """gr_scaling(all_reduce=True) of a model whose batches choose layer a or b: rank 0's batch
    runs a, rank 1's b."""
    rows = gr_scaling(_Branch(), [(_signed(rank, rank == 0), _batches(rank, 1)[0][1])],
                      all_reduce=True)  # fmt: skip
    return {r["layer"]: r["gamma_w"] for r in rows}


def test_gr_scaling_pools_the_layers_each_rank_ran_by_name() -> None:
    """The moments were summed row by row in each rank's own table order: rank 0's layer a
    with rank 1's b, and even the shared head differed between the ranks. Now every rank has the
    single-process result on both ranks' batches."""
    ranks = run_ranks(_routed_rows, 2)
    data = [(_signed(r, r == 0), _batches(r, 1)[0][1]) for r in range(2)]
    expected = {r["layer"]: r["gamma_w"] for r in gr_scaling(_Branch(), data)}
    assert set(expected) == {"inp", "a", "b", "out"}
    for got in ranks:
        assert got.keys() == expected.keys()
        for layer, value in expected.items():
            assert got[layer] == pytest.approx(value, rel=1e-9), layer
