"""Issue 13: every bad input a clear error, no silent wrong result, the CLI without tracebacks.

Tables of cases: a bad input and the text its error (or warning) must contain. Every failing
data-dependent method leaves the model exactly as it was.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import prune

import initlab
from initlab._core.loss import TargetError, resolve_loss
from initlab.cli import main
from initlab.data import load_libsvm
from initlab.diagnostics.diagnose import diagnose
from initlab.measure.conditioning import gr_scaling
from initlab.measure.curvature import DoubleBackwardError
from initlab.measure.probe import MomentProbe, measure_moments
from initlab.methods.gradinit import gradinit_
from initlab.methods.lsuv import lsuv_
from initlab.methods.metainit import metainit_
from initlab.methods.output_scale import scale_output_
from initlab.methods.precondition import precondition_

pytestmark = pytest.mark.usefixtures("one_thread")


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _batches(n: int = 4, rows: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(rows, 4, generator=gen), torch.randint(0, 3, (rows,), generator=gen))
        for _ in range(n)
    ]


def _poisoned(value: float, batch: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = _batches()
    batches[batch][0][3, 1] = value
    return batches


def _empty() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))] * 4


class _Once(torch.autograd.Function):
    """ReLU whose backward is marked once-differentiable (its second derivative is missing)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.clamp_min(0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * (x > 0)


class _OnceNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_Once.apply(self.a(x)))


class _OnceSquare(torch.autograd.Function):
    """``x^2`` whose backward ``2 x g`` is marked once-differentiable."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class _OnceLastNet(nn.Module):
    """The once-differentiable op last, before a loss linear in it (:func:`_mean_loss`): its
    incoming gradient has no graph, so autograd attaches no ``DelayedError`` node."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _OnceSquare.apply(self.a(x))


def _mean_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(batch[0]).mean()


class _CdistNet(nn.Module):
    """Logits from distances to 3 centres: torch.cdist has no double backward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 8)
        self.centres = nn.Parameter(torch.randn(3, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -torch.cdist(self.a(x), self.centres)


class _NanOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * float("nan")


class _Masked(nn.Module):
    """Takes a dict batch whose additive attention mask holds -inf."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.a(x) + attention_mask.clamp_min(-1e4)[:, :1]


def _twice(model: Any, batch: Any) -> torch.Tensor:
    """A loss that calls the model twice per batch."""
    x, y = batch
    return F.cross_entropy(model(x), y) + F.cross_entropy(model(0.5 * x), y)


def _large(value: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = _batches(2)
    batches[1] = (batches[1][0] * value, batches[1][1])
    return batches


# name -> (model factory, call(model), exception type, text of the message)
def _bn_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _short_last_batch() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What a DataLoader over 33 examples in batches of 16 yields: a last batch of one."""
    x, y = torch.cat([b[0] for b in _batches(3)])[:33], torch.cat([b[1] for b in _batches(3)])[:33]
    return [(x[i : i + 16], y[i : i + 16]) for i in range(0, 33, 16)]


def _frozen_mlp() -> nn.Module:
    return _mlp().requires_grad_(False)


def _detached_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]).detach(), batch[1])


def _run_on_targets(
    entry: str, loss: Any, labels: Callable[[torch.Tensor], Any], model: nn.Module
) -> Any:
    """``entry`` on :func:`_batches` whose targets are ``labels(y)`` (a list, ``None``)."""
    batches = [(x, labels(y)) for x, y in _batches()]
    if entry == "gradinit_":
        return gradinit_(model, batches, loss, steps=2)
    return {"measure_moments": measure_moments, "gr_scaling": gr_scaling}[entry](
        model, batches, loss
    )


_LIST = (
    "a list of 16 items",
    torch.Tensor.tolist,
    "convert the labels to one tensor (torch.tensor(labels)), or fix the DataLoader's collate_fn",
)
_NONE = (
    "None",
    lambda y: None,
    "give every batch its targets (check the dataset and the DataLoader's collate_fn)",
)
_TARGET_LOSSES = {
    "a criterion": (nn.CrossEntropyLoss(), "the loss 'CrossEntropyLoss'"),
    "the named": ("cross_entropy", "the cross-entropy loss"),
    "the 'auto'": ("auto", "the default loss"),
    "the default": (None, "the default loss"),  # measure_moments: None runs no backward
}
# a target that is no tensor (a collate_fn that left the labels a list; (x, None)) reached torch
# (TypeError: cross_entropy_loss(): argument 'target' must be Tensor) or initlab's own tensor
# methods (AttributeError: 'list' object has no attribute 'is_floating_point')
_NOT_A_TENSOR = {
    f"{entry}, {loss_name} loss, a target that is {kind}": (
        _mlp,
        functools.partial(_run_on_targets, entry, loss, labels),
        TargetError,
        f"{said} takes the batch's targets as a tensor, and entry '1' of the batch (its "
        f"targets) is {kind}, not a tensor: {advice}",
    )
    for entry in ("measure_moments", "gr_scaling", "gradinit_")
    for loss_name, (loss, said) in _TARGET_LOSSES.items()
    for kind, labels, advice in (_LIST, _NONE)
    if loss is not None or entry != "measure_moments"
}
_ONE_EXAMPLE = "a batch of one example reached a batch norm layer in training mode"
_FROZEN = "no parameter of the model requires a gradient (all 4 are frozen)"
_ERRORS: dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module], Any], type, str]] = {
    "gr_scaling of a frozen model (was: 'element 0 of tensors does not require grad')": (
        _frozen_mlp,
        lambda m: gr_scaling(m, _batches()),
        ValueError,
        "gr_scaling: " + _FROZEN,
    ),
    "diagnose of a frozen model": (
        _frozen_mlp,
        lambda m: diagnose(m, _batches()),
        ValueError,
        "diagnose: " + _FROZEN,
    ),
    "measure_moments of a frozen model": (
        _frozen_mlp,
        lambda m: measure_moments(m, _batches(), "cross_entropy"),
        ValueError,
        "measure_moments: " + _FROZEN,
    ),
    "precondition_ of a frozen model": (
        _frozen_mlp,
        lambda m: precondition_(m, _batches()),
        ValueError,
        "precondition_: " + _FROZEN,
    ),
    "doctor of a frozen model (was: named diagnose)": (
        _frozen_mlp,
        lambda m: initlab.doctor(m, _batches()),
        ValueError,
        "doctor: " + _FROZEN,
    ),
    "precondition_, a loss without gradient (was: named measure_moments)": (
        _mlp,
        lambda m: precondition_(m, _batches(), _detached_loss),
        ValueError,
        "precondition_: the loss does not depend on the model's parameters",
    ),
    "theory_vs_actual, a loss without gradient (was: named measure_moments)": (
        _mlp,
        lambda m: initlab.theory_vs_actual(m, _batches(), _detached_loss),
        ValueError,
        "theory_vs_actual: the loss does not depend on the model's parameters",
    ),
    "lsuv_ of a model without a layer to scale (was: an empty report, converged=True)": (
        lambda: nn.Sequential(nn.Flatten(), nn.ReLU()),
        lambda m: lsuv_(m, torch.randn(16, 4), generator=0),
        ValueError,
        "lsuv_: no layer to scale: no module holds a weight",
    ),
    "gradinit_ on numpy arrays (was: 'a batch must hold a tensor; got tuple')": (
        _mlp,
        lambda m: gradinit_(m, [(b[0].numpy(), b[1].numpy()) for b in _batches()]),
        TypeError,
        "gradinit_: batch 0 holds a numpy array (entry '0'), not a torch tensor: convert it "
        "(torch.from_numpy(x)",
    ),
    "gr_scaling on a numpy batch (was: torch's 'linear(): argument 'input' must be Tensor')": (
        _mlp,
        lambda m: gr_scaling(m, {"x": _batches()[0][0].numpy()}),
        TypeError,
        "holds a numpy array (entry 'x'), not a torch tensor",
    ),
    **_NOT_A_TENSOR,
    **{
        f"{name}, batch_dim={dim} beyond the input (was: IndexError deep in the probe)": (
            _mlp,
            call,
            ValueError,
            f"MomentProbe: batch_dim={dim} is beyond the model's first input tensor, of shape "
            "(16, 4) (2 dims): pass the dim of that tensor that holds the examples (0 to 1), or "
            "batch_dim=None for dim 0",
        )
        for name, dim, call in (
            (
                "measure_moments",
                2,
                lambda m: measure_moments(m, _batches(), F.cross_entropy, batch_dim=2),
            ),
            ("gr_scaling", 5, lambda m: gr_scaling(m, _batches(), batch_dim=5)),
            ("diagnose", 3, lambda m: diagnose(m, _batches(), batch_dim=3)),
        )
    },
    "gradient_stats of a frozen model": (
        _frozen_mlp,
        lambda m: initlab.gradient_stats(m, _batches()),
        ValueError,
        "gradient_stats: " + _FROZEN,
    ),
    "gr_scaling, a last batch of one example, BatchNorm (was: torch's 'Expected more than 1')": (
        _bn_mlp,
        lambda m: gr_scaling(m, _short_last_batch()),
        ValueError,
        _ONE_EXAMPLE,
    ),
    "scale_output_, a last batch of one example, BatchNorm": (
        _bn_mlp,
        lambda m: scale_output_(m, _short_last_batch()),
        ValueError,
        "drop short batches (a DataLoader's last batch: DataLoader(..., drop_last=True))",
    ),
    "diagnose, one example, BatchNorm, a loss_fn(model, batch)": (
        _bn_mlp,
        lambda m: diagnose(m, _short_last_batch(), lambda m, b: F.cross_entropy(m(b[0]), b[1])),
        ValueError,
        _ONE_EXAMPLE,
    ),
    "scale_output_, NaN in the data (was: zero std)": (
        _mlp,
        lambda m: scale_output_(m, _poisoned(float("nan"))),
        ValueError,
        "scale_output_: batch 0 has 1 non-finite value(s) (NaN or inf) in entry '0'",
    ),
    "scale_output_, inf in the data (was: zero std)": (
        _mlp,
        lambda m: scale_output_(m, _poisoned(float("inf"), batch=2)),
        ValueError,
        "scale_output_: batch 2 has 1 non-finite value(s)",
    ),
    "scale_output_, the model outputs NaN (was: zero std)": (
        _NanOut,
        lambda m: scale_output_(m, _batches()),
        ValueError,
        "the model's output is not finite (NaN or inf) on the data",
    ),
    "lsuv_, a batch with 0 rows (was: ZeroDivisionError)": (
        _mlp,
        lambda m: lsuv_(m, torch.zeros(0, 4)),
        ValueError,
        "lsuv_: the batch has 0 examples (the batch tensor has shape (0, 4))",
    ),
    "gradinit_, batches with 0 rows (was: loss is nan)": (
        _mlp,
        lambda m: gradinit_(m, _empty()),
        ValueError,
        "gradinit_: batch 0 has 0 examples",
    ),
    "gradinit_, NaN in batch 1 (was: loss is nan)": (
        _mlp,
        lambda m: gradinit_(m, _poisoned(float("nan"), batch=1), gamma=10.0),
        ValueError,
        "gradinit_: batch 1 has 1 non-finite value(s)",
    ),
    "metainit_, batches with 0 rows (was: loss is nan)": (
        _mlp,
        lambda m: metainit_(m, _empty(), variant="gradinit"),
        ValueError,
        "metainit_: batch 0 has 0 examples",
    ),
    "precondition_, NaN in batch 1 (was: dropped silently)": (
        _mlp,
        lambda m: precondition_(m, _poisoned(float("nan"), batch=1)),
        ValueError,
        "precondition_: batch 1 has 1 non-finite value(s)",
    ),
    "precondition_, the forward overflows on a batch (was: dropped silently)": (
        _mlp,
        lambda m: precondition_(m, _large(1e38)),
        ValueError,
        "precondition_: the forward or backward pass produced non-finite values",
    ),
    "precondition_, rescale, a batch with 0 rows": (
        _mlp,
        lambda m: precondition_(m, _empty()[:1], how="rescale"),
        ValueError,
        "precondition_: batch 0 has 0 examples",
    ),
    "a -inf outside a mask entry": (
        _Masked,
        lambda m: scale_output_(
            m,
            {
                "x": torch.randn(8, 4),
                "attention_mask": torch.zeros(8, 2),
                "w": -torch.inf * torch.ones(8),
            },
        ),
        ValueError,
        "scale_output_: the batch has 8 non-finite value(s) (NaN or inf) in entry 'w'",
    ),
    "NaN in a mask entry": (
        _Masked,
        lambda m: scale_output_(
            m, {"x": torch.randn(8, 4), "attention_mask": torch.full((8, 2), torch.nan)}
        ),
        ValueError,
        "in entry 'attention_mask'",
    ),
    "gradinit_, constraint step through a @once_differentiable backward (was: silently wrong)": (
        _OnceNet,
        lambda m: gradinit_(m, _batches(), gamma=1e-6),
        DoubleBackwardError,
        "gradinit_ differentiates the loss twice (its constraint step descends the gradient norm "
        "||g|| in alpha), and the model has an operation without a second derivative: a backward "
        "marked @once_differentiable",
    ),
    "gradinit_, constraint step, a @once_differentiable op last (was: a raw torch error)": (
        _OnceLastNet,
        lambda m: gradinit_(m, _batches(), _mean_loss, gamma=1e-6),
        DoubleBackwardError,
        "and the model has an operation without a second derivative: a backward marked "
        "@once_differentiable",
    ),
    "metainit_, a @once_differentiable op last (was: GQ is undefined)": (
        _OnceLastNet,
        lambda m: metainit_(m, _batches(), _mean_loss, variant="gradinit"),
        DoubleBackwardError,
        "metainit_ differentiates the loss twice",
    ),
    "gradinit_, constraint step through torch.cdist (was: a raw torch error)": (
        _CdistNet,
        lambda m: gradinit_(m, _batches(), gamma=1e-6),
        DoubleBackwardError,
        "without a second derivative: the derivative for '_cdist_backward' is not implemented. "
        "Use twice-differentiable operations in the model",
    ),
    "gradinit_(exact=True) through torch.cdist": (
        _CdistNet,
        lambda m: gradinit_(m, _batches(), gamma=1e9, exact=True),
        DoubleBackwardError,
        "or use exact=False",
    ),
    "metainit_ through a @once_differentiable backward (was: silently wrong)": (
        _OnceNet,
        lambda m: metainit_(m, _batches(), variant="gradinit"),
        DoubleBackwardError,
        "metainit_ differentiates the loss twice",
    ),
}


@pytest.mark.parametrize("name", list(_ERRORS))
def test_bad_input_raises_a_clear_error_and_leaves_the_model(name: str) -> None:
    factory, call, kind, text = _ERRORS[name]
    model = factory()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(kind) as info:
        call(model)
    assert text in str(info.value)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_minus_inf_in_an_attention_mask_is_allowed() -> None:
    model = _Masked()
    mask = torch.zeros(64, 2)
    mask[:, 1] = -torch.inf
    report = scale_output_(model, {"x": torch.randn(64, 4), "attention_mask": mask}, target=0.5)
    assert report.info["std_after"] == pytest.approx(0.5)


def test_a_gradinit_objective_step_needs_no_second_derivative() -> None:
    """The check is where the second derivative is used: first-order steps still run."""
    report = gradinit_(_CdistNet(), _batches(), gamma=1e9)
    assert report.info["objective_steps"] == 3


# name -> (call, text) for the measurements (no model to restore)
_MEASURE_ERRORS: dict[str, tuple[Callable[[], Any], str]] = {
    "measure_moments, no batch": (
        lambda: measure_moments(_mlp(), []),
        "measure_moments got no batch: the data is empty",
    ),
    "gr_scaling, no batch (was: named measure_moments)": (
        lambda: gr_scaling(_mlp(), []),
        "gr_scaling got no batch: the data is empty",
    ),
    "measure_moments, a batch with 0 rows (was: an all-NaN table)": (
        lambda: measure_moments(_mlp(), torch.zeros(0, 4)),
        "measure_moments: the batch has 0 examples",
    ),
    "measure_moments, NaN data (was: an all-NaN table)": (
        lambda: measure_moments(_mlp(), _poisoned(float("nan"))[:1]),
        "measure_moments: batch 0 has 1 non-finite value(s)",
    ),
    "diagnose, a batch with 0 rows (was: a report)": (
        lambda: diagnose(_mlp(), _empty(), "cross_entropy"),
        "diagnose: batch 0 has 0 examples",
    ),
    "gr_scaling, a loss that calls the model twice per batch (was: NaN for every layer)": (
        lambda: gr_scaling(_mlp(), _batches(2), _twice),
        "gr_scaling: the model ran 4 forward passes with gradients for 2 backward passes, so the "
        "loss calls the model 2 times per batch",
    ),
}


_NO_PARAMETERS: dict[str, tuple[Callable[[nn.Module], Any], str]] = {
    "doctor": (lambda m: initlab.doctor(m, _batches(2)), "measure"),
    "gr_scaling": (lambda m: gr_scaling(m, _batches(2)), "measure"),
    "precondition_": (lambda m: precondition_(m, _batches(2)), "precondition"),
    "diagnose": (lambda m: diagnose(m, _batches(2)), "measure"),
    "measure_moments": (lambda m: measure_moments(m, _batches(2), "cross_entropy"), "measure"),
    "gradient_stats": (lambda m: initlab.gradient_stats(m, _batches(2)), "measure"),
}


@pytest.mark.parametrize("entry", list(_NO_PARAMETERS))
def test_a_model_without_parameters_is_refused_with_advice_the_entry_point_can_follow(
    entry: str,
) -> None:
    """They advised "use modules='leaves' or 'all' to probe it" (MomentProbe's advice): doctor
    and gr_scaling take no modules=, precondition_ no string, and diagnose or measure_moments
    with a loss then failed on a loss without gradient. MomentProbe itself keeps the advice."""
    call, task = _NO_PARAMETERS[entry]
    with pytest.raises(ValueError) as info:
        call(nn.Sequential(nn.Tanh()))
    assert str(info.value).startswith(
        f"{entry}: the model has no parameters, so there is nothing to {task}"
    ), str(info.value)
    assert "modules=" not in str(info.value)
    with pytest.raises(ValueError, match=r"use modules='leaves' or 'all' to probe it"):
        MomentProbe(nn.Sequential(nn.Tanh())).__enter__()


@pytest.mark.parametrize("name", list(_MEASURE_ERRORS))
def test_measurements_refuse_what_they_cannot_measure(name: str) -> None:
    call, text = _MEASURE_ERRORS[name]
    with pytest.raises(ValueError) as info:
        call()
    assert text in str(info.value)


class _PooledOverTime(nn.Module):
    """``(T, B, 4)`` inputs, examples on dim 1; the head sees them pooled over time, ``(B, 8)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).mean(0))


def test_a_module_input_without_the_batch_dim_has_no_per_example_value_and_says_why() -> None:
    """batch_dim=2 that the root input (6, 8, 4) has and the head's pooled (8, 8) input lacks:
    an IndexError from the probe's hook; now that layer's per-example moment is NaN, with a
    note, and the rest is measured."""
    model = _PooledOverTime()
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 8, 4, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    probe = measure_moments(model, (x, y), F.cross_entropy, batch_dim=2)
    rows = {(r["layer"], r["param"]): r for r in probe.param_table().to_rows()}
    assert "b.weight: module input of shape (8, 8) has no dim 2 (the batch dim)" in probe.notes
    assert math.isnan(rows["b", "weight"]["E_dW2_example"])
    w = model.b.weight.detach().double()
    assert rows["b", "weight"]["E_W2"] == pytest.approx(float((w**2).mean()), rel=1e-6)


class _StepsThenSequence(nn.Module):
    """``forward(t, x)``: ``t`` per-example scalars ``(B,)`` (diffusion timesteps, lengths) first,
    ``x`` time-major ``(T, B, 6)``: the examples are on dim 1 of ``x``, which ``t`` lacks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.l1, self.l2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)) * t[None, :, None]).mean(0)


def test_batch_dim_that_the_first_input_lacks_but_another_has_is_measured() -> None:
    """batch_dim=1 with the (B,) input first: refused since the root checked only the first input
    tensor ('pass 0 to 0', which would count time steps as examples); it ran before, as it does
    now, and a batch_dim that no input has is still refused, naming every input's shape."""
    model = _StepsThenSequence()
    gen = torch.Generator().manual_seed(0)
    x, t = torch.randn(5, 8, 6, generator=gen), torch.rand(8, generator=gen)
    y = torch.randint(0, 3, (8,), generator=gen)
    batch = {"t": t, "x": x, "labels": y}
    probe = measure_moments(model, [batch], nn.CrossEntropyLoss(), batch_dim=1)
    rows = {r["layer"]: r for r in probe.table().to_rows()}
    # own float64 forward: dy of one example's loss is B times the mean loss's gradient
    w1, b1 = model.l1.weight.detach().double(), model.l1.bias.detach().double()
    y1 = (x.double() @ w1.T + b1).requires_grad_()
    h = torch.relu(y1) * t.double()[None, :, None]
    out = (h @ model.l2.weight.detach().double().T + model.l2.bias.detach().double()).mean(0)
    (dy1,) = torch.autograd.grad(F.cross_entropy(out, y), y1)
    assert rows["l1"]["E_x2"] == pytest.approx(float((x.double() ** 2).mean()), rel=1e-6)
    assert rows["l1"]["E_y2"] == pytest.approx(float((y1.detach() ** 2).mean()), rel=1e-6)
    assert rows["l1"]["E_dy2"] == pytest.approx(float(((8 * dy1) ** 2).mean()), rel=1e-5)
    gammas = {r["layer"]: r["gamma_w"] for r in gr_scaling(model, [batch], batch_dim=1)}
    assert all(math.isfinite(v) and v > 0 for v in gammas.values()), gammas
    with pytest.raises(ValueError) as info:
        measure_moments(model, [batch], nn.CrossEntropyLoss(), batch_dim=3)
    assert str(info.value) == (
        "MomentProbe: batch_dim=3 is beyond every input tensor of the model, of shapes (8,), "
        "(5, 8, 6) (at most 3 dims): pass the dim that holds the examples in the input tensors "
        "that have them (0 to 2), or batch_dim=None for dim 0 of the first"
    )


def test_gr_scaling_of_a_probe_whose_loss_called_the_model_twice() -> None:
    model = _mlp()
    with MomentProbe(model) as probe:
        for batch in _batches(3):
            _twice(model, batch).backward()
    with pytest.raises(ValueError, match="calls the model 2 times per batch"):
        gr_scaling(probe)
    with MomentProbe(model) as probe:
        for batch in _batches(3):
            F.cross_entropy(model(batch[0]), batch[1]).backward()
    assert all(r["gamma_w"] > 0 for r in gr_scaling(probe))


# A criterion that sums over the batch, read as a mean, put every per-example moment off by B**2
# (gamma 1024x too large at batch 32) without a word: its declared reduction is now used.
_SUM_LOSSES: dict[str, Any] = {
    "nn.CrossEntropyLoss(reduction='sum')": nn.CrossEntropyLoss(reduction="sum"),
    "partial(F.cross_entropy, reduction='sum')": functools.partial(
        F.cross_entropy, reduction="sum"
    ),
}


@pytest.mark.parametrize("name", list(_SUM_LOSSES))
def test_a_summing_criterion_gives_the_moments_of_a_mean_one(name: str) -> None:
    model, batches = _mlp(), _batches()
    mean = gr_scaling(model, batches, nn.CrossEntropyLoss())
    summed = gr_scaling(model, batches, _SUM_LOSSES[name])
    for a, b in zip(mean, summed, strict=True):
        for col in ("gamma_w", "nu_w", "E_dy2"):
            assert b[col] == pytest.approx(a[col], rel=1e-5), col
    key = ("layer", "param", "quantity")
    ref = diagnose(model, batches, nn.CrossEntropyLoss(), spectra=False, generator=0).rows
    got = diagnose(model, batches, _SUM_LOSSES[name], spectra=False, generator=0).rows
    ref_values = {tuple(r[k] for k in key): r["value"] for r in ref}
    compared = 0
    for r in got:
        v = ref_values[tuple(r[k] for k in key)]
        # per-example quantities (the minibatch gradient's own scale with the loss, as they must)
        if r["quantity"] in ("gamma", "nu", "E_dW2_example", "E_dy2") and v == v:
            assert r["value"] == pytest.approx(v, rel=1e-5), r
            compared += 1
    assert compared >= 4
    probe = measure_moments(model, batches, _SUM_LOSSES[name])
    assert probe.loss_reduction == "sum"


class _Pair(NamedTuple):
    x: Any
    y: Any


@dataclasses.dataclass
class _Inputs:
    x: Any
    y: Any


@pytest.mark.parametrize(
    ("batch", "path"),
    [
        (lambda x, y: _Pair(x.numpy(), y), "entry 'x'"),
        (lambda x, y: _Inputs(x, y.numpy()), "entry 'y'"),
        (lambda x, y: {"inputs": {"x": x.numpy()}, "y": y}, "entry 'inputs.x'"),
        (lambda x, y: x.numpy(), "batch 0 holds a numpy array (the batch)"),
    ],
    ids=["namedtuple", "dataclass", "nested dict", "bare array"],
)
def test_a_numpy_array_anywhere_in_a_batch_is_named(batch: Any, path: str) -> None:
    x, y = _batches()[0]
    with pytest.raises(TypeError, match=re.escape(path)):
        gr_scaling(_mlp(), batch(x, y))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
@pytest.mark.parametrize("loss", [None, "cross_entropy", "auto"])
def test_the_default_losses_take_integer_labels_of_any_dtype(loss: Any, dtype: Any) -> None:
    # was: torch's "expected target dtype to be Long or Byte, but got Int" (numpy's int32 labels)
    plain = _batches()
    narrow = [(x, y.to(dtype)) for x, y in plain]
    got = [r["gamma_w"] for r in gr_scaling(_mlp(), narrow, loss)]
    assert got == [r["gamma_w"] for r in gr_scaling(_mlp(), plain, loss)]


def test_a_loss_reduction_that_contradicts_the_criterion_raises() -> None:
    with pytest.raises(ValueError, match="reduces over the batch by 'sum': pass loss_reduction="):
        gr_scaling(_mlp(), _batches(), nn.CrossEntropyLoss(reduction="sum"), loss_reduction="mean")
    assert resolve_loss(F.cross_entropy).reduction == "mean"
    assert resolve_loss(nn.MSELoss(reduction="sum")).reduction == "sum"
    assert resolve_loss(lambda m, b: m(b[0]).sum()).reduction is None  # unknown: mean, as before


@pytest.mark.parametrize(
    ("text", "line", "value"),
    [
        ("1 1:0.5 2:nan\n", 1, "'nan'"),
        ("1 1:0.5\n2 1:0.25 3:inf\n", 2, "'inf'"),
        ("1 1:-Infinity\n", 1, "'-Infinity'"),
        ("1 1:0.5\n1 2:1\n2 4:1e39\n", 3, "'1e39'"),
    ],
)
def test_load_libsvm_refuses_non_finite_values(
    tmp_path: Path, text: str, line: int, value: str
) -> None:
    path = tmp_path / "bad.libsvm"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        load_libsvm(path, cache_dir=False)
    assert f"bad.libsvm:{line}: feature" in str(info.value)
    assert f"has the value {value}; values must be finite numbers" in str(info.value)


class _RawLinear(nn.Module):
    """A custom layer whose weight is a raw parameter: no registry handler claims it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


def test_lsuv_reports_a_custom_layer_it_cannot_scale() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_RawLinear(), nn.ReLU(), nn.Linear(8, 3))
    raw = model[0].weight.detach().clone()
    with pytest.warns(UserWarning, match=r"not scaled: \['0 \(no registry handler for _RawLinear"):
        report = lsuv_(model, torch.randn(256, 4), generator=0)
    row = next(r for r in report if r["layer"] == "0")
    assert row["skipped"].startswith("no registry handler for _RawLinear (raw parameter(s) weight)")
    assert "register one (initlab.register_handler) to have LSUV scale it" in row["skipped"]
    assert report.info["skipped"] == {"0": row["skipped"]}
    assert torch.equal(model[0].weight, raw)


# A weight computed by a parametrization (torch.nn.utils.parametrize) is not a tensor the methods
# can write or scale in place: every method that writes weights says so and how to remove it for
# the call (was: "handler ... returned invalid specs ... no direct parameter named 'weight'").
# The measuring entry points read the computed weight (tests/test_parametrized.py).
_PARAMETRIZATIONS: dict[str, Callable[[nn.Module], Any]] = {
    "weight_norm": torch.nn.utils.parametrizations.weight_norm,
    "spectral_norm": torch.nn.utils.parametrizations.spectral_norm,
    "orthogonal": torch.nn.utils.parametrizations.orthogonal,
}
_WRITERS: dict[str, Callable[[nn.Module], Any]] = {
    "init_model": lambda m: initlab.init_model(m, "geometric", generator=0),
    "lsuv_": lambda m: lsuv_(m, _batches()[0][0], generator=0),
    "gradinit_": lambda m: gradinit_(m, _batches(), gamma=1e-6),
    "metainit_": lambda m: metainit_(m, _batches(), steps=2),
    "scale_output_": lambda m: scale_output_(m, _batches()),
    "precondition_": lambda m: precondition_(m, _batches()),
    "doctor(fix=True)": lambda m: initlab.doctor(m, _batches(), fix=True, generator=0),
}
_READERS: dict[str, Callable[[nn.Module], Any]] = {
    "gr_scaling": lambda m: gr_scaling(m, _batches()),
    "diagnose": lambda m: diagnose(m, _batches()),
    "layer_spectra": lambda m: initlab.layer_spectra(m),
    "doctor": lambda m: initlab.doctor(m, _batches(), generator=0),
    "measure_moments": lambda m: initlab.measure_moments(m, _batches()),
}
_REGISTRY_USERS = {**_WRITERS, **_READERS}


@pytest.mark.parametrize("kind", list(_PARAMETRIZATIONS))
@pytest.mark.parametrize("entry", list(_WRITERS))
def test_a_parametrized_weight_is_refused_with_the_way_out(kind: str, entry: str) -> None:
    """On a layer the writer writes: scale_output_ folds into the last one only."""
    model = _mlp()
    at = 2 if entry == "scale_output_" else 0
    _PARAMETRIZATIONS[kind](model[at])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        _WRITERS[entry](model)
    text = str(info.value)
    # the layer named (it was only "a torch.nn.modules.linear.Linear"), the way back its own
    name = (
        f"the layer '{at}' (a torch.nn.modules.linear.Linear) has parametrized tensors ('weight' by"
    )
    assert name in text
    assert "remove_parametrizations(layer, 'weight') keeps the current values" in text
    again = f"(then torch.nn.utils.parametrizations.{kind}(layer, 'weight', "  # its options
    assert again in text
    # registered again, these two renormalize: the way out loses an init's scale (it said not)
    lost = "the scale an init gave it (init_model, lsuv_, gradinit_, a fold) is lost"
    assert (lost in text) == (kind in ("spectral_norm", "orthogonal"))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # the way out: remove it (the weight kept), then the call runs
    model.eval()  # else spectral_norm runs a power iteration at every read of the weight
    weight = model[at].weight.detach().clone()
    torch.nn.utils.parametrize.remove_parametrizations(model[at], "weight")
    assert torch.equal(model[at].weight, weight)
    _WRITERS[entry](model)


@pytest.mark.parametrize("kind", list(_PARAMETRIZATIONS))
@pytest.mark.parametrize("entry", list(_READERS))
def test_a_parametrized_weight_is_measured_by_the_entry_points_that_read(
    kind: str, entry: str
) -> None:
    """Was refused as by the writers; they change nothing, and read the computed weight."""
    model = _mlp()
    _PARAMETRIZATIONS[kind](model[0])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _READERS[entry](model)
    assert torch.nn.utils.parametrize.is_parametrized(model[0], "weight")
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


class _Tripled(nn.Module):
    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return 3 * t


@pytest.mark.parametrize("entry", [*_WRITERS, "fold"])
def test_a_parametrized_bias_is_refused_as_a_parametrized_weight_is(entry: str) -> None:
    """Was: init_model blamed a missing handler, lsuv_ left it non-zero after saying its start
    zeroes the biases, a fold blamed "something that follows" the layer."""
    model = _mlp()
    torch.nn.utils.parametrize.register_parametrization(model[2], "bias", _Tripled())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    call = {
        **_WRITERS,
        "fold": lambda m: scale_output_(m, _batches(), module="2"),
    }[entry]
    with pytest.raises(ValueError) as info:
        call(model)
    name = "the layer '2' (a torch.nn.modules.linear.Linear) has parametrized tensors ('bias' by"
    assert f"{name} _Tripled" in str(info.value)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def _frozen_stem(kind: str) -> nn.Module:
    """:func:`_mlp` with a parametrized first layer, frozen (a pretrained stem kept fixed)."""
    model = _mlp()
    _PARAMETRIZATIONS[kind](model[0])
    model[0].requires_grad_(False)
    model.eval()  # spectral_norm: no power iteration at a read of the weight
    return model


@pytest.mark.parametrize("kind", list(_PARAMETRIZATIONS))
@pytest.mark.parametrize("entry", list(_WRITERS))
def test_a_frozen_parametrized_layer_is_left_as_it_is_not_refused(kind: str, entry: str) -> None:
    """A frozen parametrized stem refused the whole call, although every writer leaves frozen
    tensors as they are (init_model's frozen="skip" promises it): the writers run, and the stem's
    tensors, its buffers included, keep their bits."""
    model = _frozen_stem(kind)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # lsuv_: the frozen layer is not scaled
        _WRITERS[entry](model)
    for k, v in model.state_dict().items():
        if k.startswith("0."):
            assert torch.equal(v, before[k]), k


def test_init_model_reports_a_frozen_parametrized_tensor_and_refuses_to_draw_it() -> None:
    """frozen="skip": one row for the computed weight, frozen, naming what it is computed from,
    and no warning of unclaimed 'original' tensors; frozen="init" would draw into a tensor the
    next forward recomputes: refused as a trainable one is."""
    model = _frozen_stem("weight_norm")
    report = initlab.init_model(model, "geometric", generator=0)
    assert "0.weight" in report.frozen()
    row = next(r for r in report if (r["layer"], r["param"]) == ("0", "weight"))
    assert "computed by _WeightNorm" in row["note"]
    assert "parametrizations.weight.original0" in row["note"]
    assert not any("original" in r["param"] for r in report)
    with pytest.raises(ValueError, match=r"^the layer '0' .* has parametrized tensors"):
        initlab.init_model(model, "geometric", generator=0, frozen="init")


@pytest.mark.parametrize("how", ["module", "hook", "fold"])
def test_scale_output_refuses_no_parametrized_layer_it_does_not_write(how: str) -> None:
    """how='module' and 'hook' write no weight, 'fold' the last layer only: a weight_norm first
    layer made all three refuse. The output reaches the target (float64 std of the output)."""
    model = _mlp()
    torch.nn.utils.parametrizations.weight_norm(model[0])
    x = _batches()[0][0]
    report = scale_output_(model, x, target=0.05, how=how)
    out = model(x) if how != "module" else report.info["module"](model(x))
    assert float(out.detach().double().std(unbiased=False)) == pytest.approx(0.05, rel=1e-5)
    if how == "hook":
        report.info["handle"].remove()


class _Recurrent(nn.Module):
    """Linear -> recurrent layer (an unbatched sequence of the batch's rows) -> Linear."""

    def __init__(self, cls: type[nn.RNNBase]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.rnn, self.out = nn.Linear(4, 8), cls(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(self.inp(x))[0])


@pytest.mark.parametrize("cls", [nn.RNN, nn.LSTM, nn.GRU])
@pytest.mark.parametrize("entry", [e for e in _WRITERS if e != "scale_output_"])  # folds into out
def test_a_parametrized_recurrent_weight_is_refused_as_a_linear_s_is(
    cls: type[nn.RNNBase], entry: str
) -> None:
    """An orthogonal weight_hh_l0 (common for RNNs): the RNN handler named only the layer's own
    parameters, so init_model drew the rest and warned of an unclaimed 'original' (advising a
    handler, which LSTM has), lsuv_ skipped it, gradinit_/metainit_/scale_output_ ran."""
    model = _Recurrent(cls)
    torch.nn.utils.parametrizations.orthogonal(model.rnn, "weight_hh_l0")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        _WRITERS[entry](model)
    text = str(info.value)
    kind = f"a torch.nn.modules.rnn.{cls.__name__}"
    assert (
        f"the layer 'rnn' ({kind}) has parametrized tensors ('weight_hh_l0' by _Orthogonal" in text
    )
    assert "remove_parametrizations(layer, 'weight_hh_l0') keeps the current values" in text
    assert "(then torch.nn.utils.parametrizations.orthogonal(layer, 'weight_hh_l0', " in text
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    torch.nn.utils.parametrize.remove_parametrizations(model.rnn, "weight_hh_l0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # lsuv_: a recurrent layer is not scaled
        _WRITERS[entry](model)  # the way out: then the call runs


@pytest.mark.parametrize(
    ("add", "remove"),
    [
        (torch.nn.utils.weight_norm, torch.nn.utils.remove_weight_norm),
        (torch.nn.utils.spectral_norm, torch.nn.utils.remove_spectral_norm),
    ],
)
@pytest.mark.parametrize("entry", ["init_model", "lsuv_", "gr_scaling", "gradinit_", "moments"])
def test_the_hook_based_weight_and_spectral_norm_are_refused_too(
    add: Callable[..., Any], remove: Callable[..., Any], entry: str
) -> None:
    """measure_moments measured them (raw "per-example gradient failed: size mismatch" notes);
    the refusal named no layer ("a torch.nn.modules.linear.Linear's 'weight'")."""
    call = {**_REGISTRY_USERS, "moments": lambda m: initlab.measure_moments(m, _batches())}[entry]
    model = _mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch: deprecated for parametrizations
        add(model[0])
    with pytest.raises(
        ValueError,
        match=rf"^the layer '0' \(a torch.nn.modules.linear.Linear\)'s 'weight' is recomputed "
        rf"before every forward by torch.nn.utils.{add.__name__}.*torch.nn.utils.{remove.__name__}",
    ):
        call(model)
    remove(model[0])
    call(model)


@pytest.mark.parametrize("entry", [*_REGISTRY_USERS, "moments"])
def test_a_pruned_weight_is_refused_by_name_with_prune_remove(entry: str) -> None:
    """torch.nn.utils.prune: the writers and most readers blamed initlab's own handler ("returned
    invalid specs ... the module has ['bias', 'weight_orig']"), naming neither the layer nor
    pruning; measure_moments reported weight_orig (E_W2 0.0423), not the weight the forward uses
    (0.0363). Every one names the layer and prune.remove, and leaves the model as it was."""
    call = {**_REGISTRY_USERS, "moments": lambda m: initlab.measure_moments(m, _batches())}[entry]
    model = _mlp()
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        ValueError,
        match=r"^the layer '0' \(a torch.nn.modules.linear.Linear\)'s 'weight' is pruned by "
        r"torch.nn.utils.prune \(L1Unstructured\).*"
        r"torch.nn.utils.prune.remove\(layer, 'weight'\)",
    ):
        call(model)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert prune.is_pruned(model)


def test_measuring_a_pruned_model_the_way_the_refusal_says_reads_the_forwards_weight() -> None:
    """The way out, the pruning removed for the call and applied again after, measures
    W = W_orig * mask (float64 oracle), not W_orig, and gives the forward its weight back."""
    model = _mlp()
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    w = model[0].weight_orig.detach().double() * model[0].weight_mask.double()
    orig = model[0].weight_orig.detach().double().clone()
    mask = model[0].weight_mask.clone()
    prune.remove(model[0], "weight")
    table = initlab.measure_moments(model, _batches()).param_table()
    prune.custom_from_mask(model[0], "weight", mask)
    row = next(r for r in table if r["layer"] == "0" and r["param"] == "weight")
    assert row["E_W2"] == pytest.approx(float((w**2).mean()), rel=1e-6)
    assert row["E_W2"] != pytest.approx(float((orig**2).mean()), rel=0.01)
    assert torch.equal(model[0].weight.detach().double(), w)


def test_gr_scaling_after_precondition_by_parametrization_says_where_gamma_after_is() -> None:
    model, batches = _mlp(), _batches()
    report = precondition_(model, batches, how="parametrize")
    # the computed weights W = alpha W' are the weights before: gamma of the model as it was
    rows = gr_scaling(model, batches)
    for row, r in zip(rows, gr_scaling(_mlp(), batches), strict=True):
        assert row["gamma_w"] == pytest.approx(r["gamma_w"], rel=1e-5)
        parametrized = torch.nn.utils.parametrize.is_parametrized(model[int(row["layer"])])
        assert ("precondition_(how='parametrize')'s report has gamma_after" in row["note"]) == (
            parametrized
        )
    before = _mlp()  # the same model as it was before: gamma after, measured
    after = gr_scaling(before, batches, alpha=report.info["alpha"])
    for row, r in zip(after, report, strict=True):
        assert row["gamma_w"] == pytest.approx(r["gamma_after"], rel=1e-6)


@pytest.mark.parametrize(
    "entry",
    [
        lambda m, d: [r["gamma_w"] for r in gr_scaling(m, d)],
        lambda m, d: [r["alpha"] for r in metainit_(m, d, steps=2)],
        lambda m, d: [r["alpha"] for r in gradinit_(m, d, gamma=1e-6)],
        lambda m, d: [r["value"] for r in diagnose(m, d, spectra=False, generator=0).rows],
    ],
    ids=["gr_scaling", "metainit_", "gradinit_", "diagnose"],
)
def test_data_that_requires_grad_is_read_detached(entry: Callable[..., list[Any]]) -> None:
    plain = _batches()
    leaves = [(x.clone().requires_grad_(), y) for x, y in plain]
    got, expected = entry(_mlp(), leaves), entry(_mlp(), plain)
    assert all(x.grad is None for x, _ in leaves)  # was: gr_scaling and metainit_ wrote it
    assert got == pytest.approx(expected, rel=1e-6, nan_ok=True)


def _embedding_net(sparse: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(20, 8, sparse=sparse), nn.Flatten(), nn.Linear(24, 3))


def _token_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        (torch.randint(0, 20, (16, 3), generator=gen), torch.randint(0, 3, (16,), generator=gen))
        for _ in range(4)
    ]


@pytest.mark.parametrize(
    "entry",
    [
        lambda m, d: [r["gamma_w"] for r in gr_scaling(m, d)],
        lambda m, d: [r["alpha"] for r in gradinit_(m, d, gamma=1e-6)],
        lambda m, d: [r["alpha"] for r in metainit_(m, d, steps=2)],
        lambda m, d: [r["value"] for r in diagnose(m, d, spectra=False, generator=0).rows],
        lambda m, d: [r["alpha"] for r in precondition_(m, d)],
        lambda m, d: [r["grad_norm"] for r in initlab.gradient_stats(m, d)],
    ],
    ids=["gr_scaling", "gradinit_", "metainit_", "diagnose", "precondition_", "gradient_stats"],
)
def test_a_sparse_embedding_is_measured_with_dense_gradients(entry: Callable[..., Any]) -> None:
    # was: torch's "Could not run 'aten::...' with arguments from the 'SparseCPU' backend"
    sparse = _embedding_net(sparse=True)
    got, expected = entry(sparse, _token_batches()), entry(_embedding_net(False), _token_batches())
    assert got == pytest.approx(expected, rel=1e-6, nan_ok=True)
    assert sparse[0].sparse  # sparse again after the call


def test_a_parametrization_on_a_tensor_no_handler_names_is_left_alone() -> None:
    class _Scaled(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return 2 * w

    model = _mlp()
    model[0].register_buffer("extra", torch.ones(3))
    torch.nn.utils.parametrize.register_parametrization(model[0], "extra", _Scaled())
    rows = initlab.init_model(model, "geometric", generator=0)
    assert [(r["layer"], r["param"]) for r in rows][:2] == [("0", "weight"), ("0", "bias")]


# ---------------------------------------------------------------------------------------- CLI

_MODELS = """
import torch
from torch import nn
from torch.nn.utils import prune

def mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))

def boom():
    raise RuntimeError("factory failed")

def data_nan():
    x = torch.randn(16, 4)
    x[0, 0] = float("nan")
    return (x, torch.randint(0, 3, (16,)))

def data_empty():
    return (torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))

def data_none():
    return None

def data_ok():
    return [(torch.randn(16, 4), torch.randint(0, 3, (16,))) for _ in range(4)]

def data_list_labels():
    return (torch.randn(16, 4), torch.randint(0, 3, (16,)).tolist())

def bad_loss(model, batch):
    raise KeyError("no such entry")
"""


@pytest.fixture
def cli_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "mods.py").write_text(textwrap.dedent(_MODELS))
    torch.save(torch.randn(3), tmp_path / "vector.pt")
    (tmp_path / "garbage.pt").write_text("not a torch file")
    rng = torch.Generator().manual_seed(0)
    lines = [
        f"{int(c) + 1} "
        + " ".join(f"{j + 1}:{v:.3f}" for j, v in enumerate(torch.rand(4, generator=rng)))
        for c in torch.arange(30) % 3
    ]
    (tmp_path / "libsvm").mkdir()
    (tmp_path / "libsvm" / "iris.scale").write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("INITLAB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


_INIT = ["init", "--model", "mods.py:mlp", "--out", "out.pt"]

# argv (after `initlab`) -> (exit code, text of the one-line error)
_CLI: dict[str, tuple[list[str], int, str]] = {
    "a batch with 0 rows (was: ZeroDivisionError)": (
        [*_INIT, "--method", "lsuv", "--data", "mods.py:data_empty"],
        2,
        "initlab init: error: lsuv_: batch 0 has 0 examples",
    ),
    "a missing .pt file (was: FileNotFoundError)": (
        [*_INIT, "--method", "lsuv", "--data", "missing.pt"],
        2,
        "--data file missing.pt does not exist",
    ),
    "a .pt file torch cannot read (was: UnpicklingError)": (
        [*_INIT, "--method", "lsuv", "--data", "garbage.pt"],
        2,
        "--data garbage.pt: it is a text file, not a file that torch.save wrote",
    ),
    "data the model cannot take (was: RuntimeError)": (
        [*_INIT, "--method", "lsuv", "--data", "vector.pt"],
        2,  # bad input: the data does not fit the model
        "RuntimeError: mat1 and mat2 shapes cannot be multiplied (1x3 and 4x8) (the model could "
        "not run on the data",
    ),
    "labels left a list (was: AttributeError)": (
        ["diagnose", "--model", "mods.py:mlp", "--data", "mods.py:data_list_labels"],
        2,
        "initlab diagnose: error: the default loss takes the batch's targets as a tensor, and "
        "entry '1' of the batch (its targets) is a list of 16 items, not a tensor: convert the "
        "labels to one tensor (torch.tensor(labels))",
    ),
    "a data function that returns None (was: AttributeError)": (
        [*_INIT, "--method", "lsuv", "--data", "mods.py:data_none"],
        2,
        "--data 'mods.py:data_none' returned NoneType; return a tensor",
    ),
    "random data of the wrong shape (was: RuntimeError)": (
        [*_INIT, "--method", "lsuv", "--data", "random:8"],
        2,  # bad input: the data does not fit the model
        "shapes cannot be multiplied (512x8 and 4x8)",
    ),
    "a factory that raises (was: RuntimeError)": (
        ["init", "--model", "mods.py:boom", "--out", "out.pt"],
        2,
        "--model 'mods.py:boom': the factory raised RuntimeError: factory failed",
    ),
    "--out in a folder that cannot be made (was: FileNotFoundError)": (
        ["init", "--model", "mods.py:mlp", "--out", "/proc/initlab/out.pt"],
        2,
        "initlab init: error: No such file or directory: /proc/initlab",
    ),
    "a loss function that raises (was: KeyError)": (
        [*_INIT, "--method", "metainit", "--data", "mods.py:data_ok", "--loss", "mods.py:bad_loss"],
        2,
        "KeyError: 'no such entry'",
    ),
    "--report in a folder that does not exist (was: FileNotFoundError)": (
        [*_INIT, "--method", "lsuv", "--data", "random:4", "--report", "/proc/initlab/r.json"],
        2,
        "No such file or directory: /proc/initlab/r.json",
    ),
    "diagnose, random data of the wrong shape (was: RuntimeError)": (
        ["diagnose", "--model", "mods.py:mlp", "--data", "random:5"],
        2,  # bad input: the data does not fit the model
        "initlab diagnose: error: RuntimeError: mat1 and mat2 shapes cannot be multiplied",
    ),
    "diagnose, --out that cannot be made (was: FileNotFoundError)": (
        ["diagnose", "--model", "mods.py:mlp", "--data", "random:4", "--out", "/proc/initlab"],
        2,
        "No such file or directory: /proc/initlab",
    ),
    "doctor, random data of the wrong shape (was: RuntimeError)": (
        ["doctor", "--model", "mods.py:mlp", "--data", "random:5"],
        2,  # bad input: the data does not fit the model
        "initlab doctor: error: RuntimeError: mat1 and mat2 shapes",
    ),
    "doctor, --out that cannot be made (was: FileNotFoundError)": (
        ["doctor", "--model", "mods.py:mlp", "--data", "random:4", "--out", "/proc/initlab"],
        2,
        "No such file or directory: /proc/initlab",
    ),
    "diagnose, NaN data (was: a report of NaN)": (
        ["diagnose", "--model", "mods.py:mlp", "--data", "mods.py:data_nan"],
        2,
        "diagnose: batch 0 has 1 non-finite value(s)",
    ),
    "doctor, batches with 0 rows (was: a report)": (
        ["doctor", "--model", "mods.py:mlp", "--data", "mods.py:data_empty"],
        2,
        "doctor: batch 0 has 0 examples",
    ),
    "an unknown --data name (was: an error naming --model)": (
        [*_INIT, "--method", "lsuv", "--data", "nope"],
        2,
        "unknown --data 'nope'; give random, random:3x32x32, digits, a data set that `initlab "
        "data` lists",
    ),
    "a --data module that does not exist (was: an error naming --model)": (
        [*_INIT, "--method", "lsuv", "--data", "nope:fn"],
        2,
        "cannot import 'nope' for --data",
    ),
    "an unknown --loss (was: an error naming --model)": (
        [*_INIT, "--method", "metainit", "--data", "mods.py:data_ok", "--loss", "nope"],
        2,
        "unknown --loss 'nope'; valid: auto, cross_entropy, mse, random_quadratic, model or "
        "pkg.module:fn",
    ),
    "gradinit on data without targets (was: a hint to the Python API)": (
        [*_INIT, "--method", "gradinit", "--data", "random:4"],
        2,
        "--loss auto needs targets, and the batches of --data hold inputs only; pass --loss "
        "random_quadratic",
    ),
    "--max-batches 0 (was: IndexError)": (
        ["diagnose", "--model", "mods.py:mlp", "--data", "random:4", "--max-batches", "0"],
        2,
        "argument --max-batches/--batches: must be a positive integer, got '0'",
    ),
    "--batch-size 0 (was: RuntimeError)": (
        ["doctor", "--model", "mods.py:mlp", "--data", "random:4", "--batch-size", "0"],
        2,
        "argument --batch-size: must be a positive integer, got '0'",
    ),
    "--model-kwargs that is not JSON": (
        ["init", "--model", "mods.py:mlp", "--model-kwargs", "{bad", "--out", "out.pt"],
        2,
        "--model-kwargs is not valid JSON",
    ),
    "a named data set that is not there": (
        [*_INIT, "--method", "lsuv", "--data", "libsvm:letter", "--data-dir", "."],
        2,
        "libsvm:letter: not found",
    ),
}


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's own errors
        code = int(stop.code or 0)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("name", list(_CLI))
def test_cli_errors_print_one_line_without_traceback(
    cli_dir: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    argv, code, text = _CLI[name]
    got, err = _run(argv, capsys)
    assert got == code, err
    assert text in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()[-1]) > 0


@pytest.mark.parametrize("where", ["before", "after"])
def test_cli_debug_flag_prints_the_traceback(
    cli_dir: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    argv = ["init", "--model", "mods.py:boom", "--out", "out.pt"]
    argv = ["--debug", *argv] if where == "before" else [*argv, "--debug"]
    code, err = _run(argv, capsys)
    assert code == 2
    assert "Traceback (most recent call last)" in err
    assert "RuntimeError: factory failed" in err  # the cause, chained
    assert err.strip().splitlines()[-1].startswith("initlab init: error: --model 'mods.py:boom'")


@pytest.mark.parametrize("name", ["libsvm:iris", "iris", "sklearn:iris"])
def test_cli_data_takes_the_names_initlab_data_lists(
    cli_dir: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    argv = [*_INIT, "--method", "gradinit", "--data", name, "--data-dir", str(cli_dir)]
    argv += ["--batch-size", "8", "--max-batches", "3", "--report", "r.json"]
    code, err = _run(argv, capsys)
    assert code == 0, err
    assert set(torch.load(cli_dir / "out.pt", weights_only=True)) == {
        "0.weight",
        "0.bias",
        "2.weight",
        "2.bias",
    }
    rows = [r for r in json.loads((cli_dir / "r.json").read_text()) if r["table"] == "gradinit"]
    assert len(rows) == 4 and all(r["alpha"] > 0 for r in rows)


# ----------------------------------------------------------------------------- frozen tensors
# Every method keeps a tensor with requires_grad=False as it is (init_model, lsuv_, gradinit_ and
# metainit_ did; precondition_(how="rescale") and scale_output_(how="fold") changed it).


def _chain(frozen: int) -> tuple[nn.Module, list]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
        nn.Linear(32, 3),
    )  # fmt: skip
    with torch.no_grad():
        model[2].weight.mul_(5.0)  # unbalanced: rescaling moves every layer but the frozen one
    model[frozen].requires_grad_(False)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(64, 8, generator=gen), torch.randint(0, 3, (64,), generator=gen))] * 2
    return model, data


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    after = model.state_dict()
    return all(torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.parametrize("how", ["lr", "rescale"])
def test_precondition_keeps_a_frozen_layer_at_alpha_one(how: str) -> None:
    model, data = _chain(frozen=0)  # the first layer: nothing before it is rescaled
    before = _state(model)
    report = initlab.precondition_(model, data, how=how)
    (row,) = [r for r in report if r["layer"] == "0"]
    assert row["kind"] == "frozen" and row["alpha"] == 1.0
    assert torch.equal(model[0].weight, before["0.weight"])
    assert torch.equal(model[0].bias, before["0.bias"])
    if how == "rescale":
        assert not torch.equal(model[2].weight, before["2.weight"])  # the others did move


def test_precondition_rescale_refuses_to_change_a_frozen_bias() -> None:
    """A frozen layer after a rescaled one: its bias would take the chain's product."""
    model, data = _chain(frozen=2)
    before = _state(model)
    with pytest.raises(ValueError, match=r"would change the frozen tensor\(s\) \['2\.bias'\]"):
        initlab.precondition_(model, data, how="rescale")
    assert _unchanged(model, before)
    with pytest.raises(ValueError, match=r"module\(s\) \['2'\] keep alpha = 1.*frozen"):
        initlab.precondition_(model, data, modules=["0", "2"])


def test_scale_output_does_not_fold_into_a_frozen_head() -> None:
    model, data = _chain(frozen=6)
    before = _state(model)
    with pytest.raises(ValueError, match=r"cannot fold the output scale into '6': 6\.weight, "):
        initlab.scale_output_(model, data, how="fold")
    assert _unchanged(model, before)


def test_the_way_back_registers_a_parametrization_with_its_own_options() -> None:
    """Wav2Vec2's positional conv is weight-normed over dim 2; the message said
    weight_norm(layer, 'weight'), whose dim=0 gave it another norm (g of shape (32, 1, 1) for
    (1, 1, 8)), so the model no longer matched its checkpoints."""
    from torch.nn.utils import parametrizations, parametrize

    conv = nn.Conv1d(4, 6, 8, groups=2)
    parametrizations.weight_norm(conv, "weight", dim=2)
    parametrizations.spectral_norm(lin := nn.Linear(4, 6), "weight", n_power_iterations=3)
    parametrizations.orthogonal(sq := nn.Linear(4, 4), "weight", orthogonal_map="cayley")
    said = {
        conv: "weight_norm(layer, 'weight', dim=2)",
        lin: "spectral_norm(layer, 'weight', n_power_iterations=3, eps=1e-12, dim=0)",
        sq: "orthogonal(layer, 'weight', orthogonal_map='cayley')",
    }
    pattern = r"\(then (torch\.nn\.utils\.parametrizations\.\w+\(.*?\))\)"
    for layer, expected in said.items():
        with pytest.raises(ValueError) as info:
            initlab.init_model(nn.Sequential(layer), "fan_in", generator=0)
        call = re.search(pattern, str(info.value))
        assert call is not None and call.group(1).endswith(expected), str(info.value)
        shapes = [tuple(p.shape) for p in layer.parametrizations.weight.parameters()]
        kind = type(layer.parametrizations.weight[0])
        parametrize.remove_parametrizations(layer, "weight")
        eval(call.group(1), {"torch": torch, "layer": layer})  # the message's own call
        assert [tuple(p.shape) for p in layer.parametrizations.weight.parameters()] == shapes
        assert type(layer.parametrizations.weight[0]) is kind
