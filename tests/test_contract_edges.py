"""Issue 13, second sweep: the data and loss contract at its edges.

What PyTorch users pass that the first sweep did not try: batches that are custom objects or
dataclasses, ``DataLoader(batch_size=None)`` (single examples), loaders of bare tensors handed on
from one entry point to another, summing criteria outside the probe, outputs of shape ``(B, 1)``
with targets of shape ``(B,)``, one-hot labels, lists of ids in a batch, and ``max_batches``
above what the data holds. Each case: it works and gives the value an independent computation
gives, or it raises an error that names what is wrong and what to do, leaving the model as it was.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import initlab
from initlab._core.loss import TargetError, resolve_loss
from initlab.methods.gradinit import overlap_batch

from . import hf_models
from .conformance_models import CPU_DATA_PARALLEL

pytestmark = pytest.mark.usefixtures("one_thread")


def _data(rows: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(rows, 4, generator=gen), torch.randint(0, 3, (rows,), generator=gen)


def _mlp(seed: int = 0, out: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, out))


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- object batches


class _Obj:
    """A batch as a plain object: the tensors are its attributes."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y


@dataclass
class _DC:
    x: torch.Tensor
    y: torch.Tensor


class _ObjNet(nn.Module):
    """Takes the batch object itself (``model(batch)``, the default forward of an object)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()

    def forward(self, batch: Any) -> torch.Tensor:
        return self.net(batch.x)


def _obj_loss(model: Any, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch), batch.y)


_OBJECT_ENTRIES: dict[str, Callable[[nn.Module, Any], Any]] = {
    "measure_moments": lambda m, d: initlab.measure_moments(m, d, _obj_loss).used,
    "gr_scaling": lambda m, d: initlab.gr_scaling(m, d, _obj_loss).used,
    "diagnose": lambda m, d: initlab.diagnose(m, d, _obj_loss, spectra=False).meta["examples"],
    "doctor": lambda m, d: initlab.doctor(m, d, _obj_loss).used,
    "gradient_stats": lambda m, d: initlab.gradient_stats(m, d, _obj_loss).used,
    "lsuv_": lambda m, d: initlab.lsuv_(m, d, generator=0).used,
    "scale_output_": lambda m, d: initlab.scale_output_(m, d, generator=0).used,
    "precondition_": lambda m, d: initlab.precondition_(m, d, _obj_loss, generator=0).used,
    "loss_landscape": lambda m, d: initlab.loss_landscape(m, d, _obj_loss, grid=2).used,
    "block_curvature": lambda m, d: initlab.block_curvature(m, d, _obj_loss, probes=2).used,
}


def _examples(result: Any) -> int:
    return result if isinstance(result, int) else result.examples


@pytest.mark.parametrize("kind", [_Obj, _DC], ids=["object", "dataclass"])
@pytest.mark.parametrize("entry", list(_OBJECT_ENTRIES))
def test_a_custom_object_batch_is_one_batch_everywhere(entry: str, kind: type) -> None:
    x, y = _data()
    got = _OBJECT_ENTRIES[entry](_ObjNet(), kind(x, y))
    assert _examples(got) == 40


@pytest.mark.parametrize("kind", [_Obj, _DC], ids=["object", "dataclass"])
def test_a_list_of_custom_objects_is_many_batches(kind: type) -> None:
    x, y = _data()
    probe = initlab.measure_moments(
        _ObjNet(), [kind(x[:16], y[:16]), kind(x[16:], y[16:])], _obj_loss
    )
    assert (probe.used.batches, probe.used.examples) == (2, 40)
    whole = initlab.measure_moments(_ObjNet(), kind(x, y), _obj_loss)
    a, b = probe.table().to_rows(), whole.table().to_rows()
    for ra, rb in zip(a, b, strict=True):
        assert ra["E_x2"] == pytest.approx(rb["E_x2"], rel=1e-6)


@pytest.mark.parametrize("entry, examples", [("gradinit_", 30), ("metainit_", 20)])
def test_object_batches_reach_the_alpha_methods(entry: str, examples: int) -> None:
    """Two steps read 3 batches of 10 (GradInit's S~ takes the next one) and 2 (MetaInit)."""
    x, y = _data()
    data = [_DC(x[i : i + 10], y[i : i + 10]) for i in range(0, 40, 10)]
    report = getattr(initlab, entry)(_ObjNet(), data, _obj_loss, steps=2, generator=0)
    assert report.used.examples == examples


class _Listed:
    """A batch object whose values are plain lists (no tensor to count examples by)."""

    def __init__(self, x: list[list[float]]) -> None:
        self.x = x


class _ListedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()

    def forward(self, batch: _Listed) -> torch.Tensor:
        return self.net(torch.tensor(batch.x))


def test_scale_output_on_a_batch_without_tensors_fails_before_changing_the_model() -> None:
    model = _ListedNet()
    before = _state(model)
    with pytest.raises(TypeError, match="a batch must hold a tensor"):
        initlab.scale_output_(model, _Listed(_data()[0].tolist()))
    assert _same(before, _state(model))


# ----------------------------------------------------------------------------- single examples


_UNBATCHED_ENTRIES: dict[str, Callable[[nn.Module, Any], Any]] = {
    "measure_moments": lambda m, d: initlab.measure_moments(m, d, nn.CrossEntropyLoss()),
    "gr_scaling": lambda m, d: initlab.gr_scaling(m, d, nn.CrossEntropyLoss()),
    "gradient_stats": lambda m, d: initlab.gradient_stats(m, d, nn.CrossEntropyLoss()),
    "diagnose": lambda m, d: initlab.diagnose(m, d, nn.CrossEntropyLoss()),
    "loss_landscape": lambda m, d: initlab.loss_landscape(m, d, nn.CrossEntropyLoss(), grid=2),
    "lsuv_": lambda m, d: initlab.lsuv_(m, d),
    "gradinit_": lambda m, d: initlab.gradinit_(m, d, steps=1),
}


@pytest.mark.parametrize("entry", list(_UNBATCHED_ENTRIES))
def test_single_examples_from_a_loader_without_batch_size_are_refused(entry: str) -> None:
    # DataLoader(batch_size=None) yields (x of shape (4,), y 0-d): read as a batch, x would be
    # 4 examples (per-example moments off by 16 before).
    x, y = _data(10)
    loader = DataLoader(TensorDataset(x, y), batch_size=None)
    model = _mlp()
    before = _state(model)
    with pytest.raises(ValueError, match=r"without a batch dimension.*batch_size"):
        _UNBATCHED_ENTRIES[entry](model, loader)
    assert _same(before, _state(model))


def test_a_dict_example_without_batch_dimension_is_refused_too() -> None:
    x, y = _data(1)
    with pytest.raises(ValueError, match=r"target \(entry 'labels'\) is a scalar"):
        initlab.gradient_stats(_mlp(), {"x": x[0], "labels": y[0]}, lambda m, b: m(b["x"]).sum())


def test_a_batch_dimension_of_one_is_fine() -> None:
    x, y = _data(10)
    probe = initlab.measure_moments(_mlp(), DataLoader(TensorDataset(x, y), batch_size=1))
    assert (probe.used.batches, probe.used.examples) == (10, 10)


# ----------------------------------------------------------------------------- handed-on data


_HANDED_ON: dict[str, Callable[[torch.Tensor], Any]] = {
    "loader": lambda x: DataLoader(x, batch_size=8),
    "Batches": lambda x: initlab.Batches([x[:8], x[8:16], x[16:24]]),
    "generator": lambda x: (x[i : i + 8] for i in range(0, 24, 8)),
}


@pytest.mark.parametrize("form", list(_HANDED_ON))
@pytest.mark.parametrize("entry", ["precondition_", "doctor"])
def test_batches_of_bare_tensors_reach_the_entry_points_called_inside(
    entry: str, form: str
) -> None:
    # precondition_ hands its batches to measure_moments, doctor to diagnose: a list of
    # same-shaped tensors was read there as ambiguous.
    x, _ = _data()
    out = getattr(initlab, entry)(_mlp(out=4), _HANDED_ON[form](x[:24]), "random_quadratic")
    assert out.used.batches == 3


# ----------------------------------------------------------------------------- reductions


def test_doctor_reads_a_summing_criterion_per_example() -> None:
    x, y = _data()
    model = _mlp()
    with torch.no_grad():
        model[2].weight.mul_(0.01)
        model[2].bias.zero_()
    data = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 40, 8)]
    report = initlab.doctor(model, data, nn.CrossEntropyLoss(reduction="sum"), max_batches=5)
    row = next(r for r in report.to_rows() if r["check"] == "initial_loss")
    with torch.no_grad():
        want = F.cross_entropy(model(x), y).item()
    assert row["value"] == pytest.approx(want, rel=1e-5)
    assert row["verdict"] == "ok"


def test_doctor_weights_batches_of_different_sizes_by_their_examples() -> None:
    x, y = _data()
    model = _mlp()
    report = initlab.doctor(model, [(x[:30], y[:30]), (x[30:], y[30:])], nn.CrossEntropyLoss())
    row = next(r for r in report.to_rows() if r["check"] == "initial_loss")
    with torch.no_grad():
        want = F.cross_entropy(model(x), y).item()
    assert row["value"] == pytest.approx(want, rel=1e-5)


def test_the_landscape_of_a_summing_criterion_is_the_total() -> None:
    x, y = _data(20)
    model = _mlp()
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    land = initlab.loss_landscape(
        model, loader, nn.CrossEntropyLoss(reduction="sum"), grid=([0.0], [0.0])
    )
    with torch.no_grad():
        want = F.cross_entropy(model(x), y, reduction="sum").item()
    assert float(land.center) == pytest.approx(want, rel=1e-5)


# ----------------------------------------------------------------------------- targets


@pytest.mark.parametrize("loss", ["mse", None, "auto"])
def test_outputs_of_shape_b1_pair_with_targets_of_shape_b(loss: Any) -> None:
    # (B, 1) - (B,) broadcasts to (B, B): the loss was silently another number.
    x, _ = _data()
    target = torch.randn(40, generator=torch.Generator().manual_seed(3))
    model = _mlp(out=1)
    land = initlab.loss_landscape(model, (x, target), loss, grid=([0.0], [0.0]))
    with torch.no_grad():
        want = F.mse_loss(model(x).squeeze(1), target).item()
    assert float(land.center) == pytest.approx(want, rel=1e-6)


def test_mse_refuses_targets_of_another_shape() -> None:
    x, _ = _data()
    with pytest.raises(ValueError, match=r"outputs \(40, 3\) and targets \(40, 2\)"):
        initlab.gradient_stats(_mlp(), (x, torch.randn(40, 2)), "mse")


def test_integer_one_hot_labels_are_named() -> None:
    x, y = _data()
    with pytest.raises(ValueError, match=r"look one-hot.*y.argmax\(-1\)"):
        initlab.gradient_stats(_mlp(), (x, F.one_hot(y, 3)))


def test_float_class_probabilities_with_the_named_cross_entropy() -> None:
    x, y = _data()
    model = _mlp()
    land = initlab.loss_landscape(model, (x, F.one_hot(y, 3).float()), "cross_entropy", grid=1)
    with torch.no_grad():
        want = F.cross_entropy(model(x), y).item()
    assert float(land.center) == pytest.approx(want, rel=1e-6)


def test_a_criterion_that_fails_on_the_targets_names_both_shapes() -> None:
    x, y = _data()
    model = _mlp()
    before = _state(model)
    with pytest.raises(ValueError, match=r"output of shape \(40, 3\).*targets of shape \(40, 1\)"):
        initlab.gr_scaling(model, (x, y[:, None]), nn.CrossEntropyLoss())
    assert _same(before, _state(model))


class _LabelsKeyword(nn.Module):
    """Takes the labels as a keyword (and ignores them), so a dict batch reaches the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()

    def forward(self, x: torch.Tensor, labels: Any = None) -> torch.Tensor:
        return self.net(x)


@pytest.mark.parametrize("loss", [None, "cross_entropy", nn.CrossEntropyLoss()], ids=str)
def test_labels_of_a_dict_batch_left_a_list_are_named_not_missing(loss: Any) -> None:
    """Read as "a dict batch without 'labels' (keys ['labels', 'x'])": only a tensor was found."""
    x, y = _data()
    with pytest.raises(TargetError, match=r"entry 'labels' of the batch \(its targets\) is a list "
                       r"of 40 items, not a tensor: convert the labels to one tensor"):  # fmt: skip
        initlab.gradient_stats(_LabelsKeyword(), {"x": x, "labels": y.tolist()}, loss)


def test_a_criterion_of_ones_own_still_gets_a_target_that_is_no_tensor() -> None:
    """The target must be a tensor for torch's criteria and initlab's losses only."""
    x, y = _data()
    model = _mlp()

    def own(output: torch.Tensor, target: list[int]) -> torch.Tensor:
        return F.cross_entropy(output, torch.tensor(target))

    land = initlab.loss_landscape(model, (x, y.tolist()), own, grid=1)
    with torch.no_grad():
        logits = model(x).double()
        want = (logits.logsumexp(1) - logits[torch.arange(len(y)), y]).mean().item()
    assert float(land.center) == pytest.approx(want, rel=1e-6)


def test_a_criterion_of_ones_own_failing_on_a_list_target_names_its_type() -> None:
    """Was an AttributeError ('list' object has no attribute 'shape') while reporting it."""
    x, y = _data()

    def own(output: torch.Tensor, target: list[int]) -> torch.Tensor:
        return F.cross_entropy(output, torch.tensor(target[:-1]))  # a size mismatch

    with pytest.raises(TargetError, match=r"output of shape \(40, 3\) \(torch.float32\) and "
                       r"targets of type list: Expected input batch_size \(40\)"):  # fmt: skip
        initlab.gradient_stats(_mlp(), (x, y.tolist()), own)


def _probabilities(rows: int = 40) -> torch.Tensor:
    return torch.rand(rows, 3, generator=torch.Generator().manual_seed(2))


_WRONG_LENGTH = r"has a weight= of the wrong length for the model's 3 classes \(shape \(5,\)\)"
# a criterion's own weight= or pos_weight= that does not fit the model's 3 classes: a TargetError
# that said "Check that the targets are what the loss takes", or torch's raw error
_MISCONFIGURED: dict[str, tuple[Any, bool, str]] = {
    "CrossEntropyLoss weight=ones(5)": (
        nn.CrossEntropyLoss(weight=torch.ones(5)), False,
        r"^the loss 'CrossEntropyLoss' " + _WRONG_LENGTH + r": a class criterion takes one weight "
        r"per class, of shape \(3,\). Fix the criterion's weight= \(torch: weight tensor should "
        r"be defined either for all 3 classes",
    ),
    "CrossEntropyLoss weight=ones(2) (was: IndexError counting the targets)": (
        nn.CrossEntropyLoss(weight=torch.ones(2)), False,
        r"weight= of the wrong length for the model's 3 classes \(shape \(2,\)\)",
    ),
    "partial(F.nll_loss, weight=ones(5))": (
        functools.partial(F.nll_loss, weight=torch.ones(5)), False,
        r"^the loss 'nll_loss' " + _WRONG_LENGTH,
    ),
    "MultiMarginLoss weight=ones(5)": (
        nn.MultiMarginLoss(weight=torch.ones(5)), False,
        r"^the loss 'MultiMarginLoss' " + _WRONG_LENGTH + r".*inconsistent weight size",
    ),
    "CrossEntropyLoss weight of int64 (was: TargetError)": (
        nn.CrossEntropyLoss(weight=torch.ones(3, dtype=torch.long)), False,
        r"^the loss 'CrossEntropyLoss' has a weight= of dtype torch.int64, and the model's output "
        r"is torch.float32: pass the class weights in the output's dtype",
    ),
    "CrossEntropyLoss weight of float64 (was: torch's RuntimeError)": (
        nn.CrossEntropyLoss(weight=torch.ones(3, dtype=torch.float64)), False,
        r"has a weight= of dtype torch.float64, and the model's output is torch.float32",
    ),
    "BCEWithLogitsLoss pos_weight=ones(5)": (
        nn.BCEWithLogitsLoss(pos_weight=torch.ones(5)), True,
        r"^the loss 'BCEWithLogitsLoss' has a pos_weight= of shape \(5,\), which does not "
        r"broadcast against the model's output of shape \(40, 3\) \(3 classes along its last "
        r"dim\): pass one per class, e.g. of shape \(3,\)",
    ),
    "BCEWithLogitsLoss weight=ones(5)": (
        nn.BCEWithLogitsLoss(weight=torch.ones(5)), True,
        r"^the loss 'BCEWithLogitsLoss' has a weight= of shape \(5,\), which does not broadcast",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(_MISCONFIGURED))
def test_a_criterions_misconfigured_weight_is_named_not_the_targets(case: str) -> None:
    loss, float_targets, says = _MISCONFIGURED[case]
    x, y = _data()
    model = _mlp()
    before = _state(model)
    with pytest.raises(ValueError, match=says) as info:
        initlab.measure_moments(model, (x, _probabilities() if float_targets else y), loss)
    assert not isinstance(info.value, TargetError)
    assert _same(before, _state(model))


def test_a_fitting_weight_and_wrong_targets_still_blame_the_targets() -> None:
    x, _ = _data()
    loss = nn.BCEWithLogitsLoss(pos_weight=torch.ones(3))
    with pytest.raises(TargetError, match=r"targets of shape \(40, 5\)"):
        initlab.measure_moments(_mlp(), (x, torch.rand(40, 5)), loss)


def test_a_criterion_class_instead_of_an_instance_is_named() -> None:
    x, y = _data()
    with pytest.raises(TypeError, match=r"the class CrossEntropyLoss.*CrossEntropyLoss\(\)"):
        initlab.gradient_stats(_mlp(), (x, y), nn.CrossEntropyLoss)


# ----------------------------------------------------------------------------- counts


@pytest.mark.parametrize(
    "call",
    [
        lambda d: initlab.scale_output_(_mlp(), d, max_batches=10, generator=0),
        lambda d: initlab.input_scale(d, max_batches=10),
        lambda d: initlab.precondition_(_mlp(), d, max_batches=10, generator=0),
    ],
    ids=["scale_output_", "input_scale", "precondition_"],
)
def test_max_batches_is_at_most(call: Callable[[Any], Any]) -> None:
    x, y = _data()
    assert call([(x[:16], y[:16]), (x[16:], y[16:])]).used.batches == 2


# ----------------------------------------------------------------------------- ids in batches


def test_overlap_batch_slices_a_list_of_ids_with_its_rows() -> None:
    x = torch.arange(8.0)[:, None]
    s = (x[:4], [f"id{i}" for i in range(4)], "meta")
    nxt = (x[4:6], ["id4", "id5"], "other")
    tilde = overlap_batch(s, nxt, 0.5)
    assert tilde[0].flatten().tolist() == [0.0, 1.0, 4.0, 5.0]
    assert tilde[1] == ["id0", "id1", "id4", "id5"]
    assert tilde[2] == "meta"
    drawn = overlap_batch(s, nxt, 0.5, generator=torch.Generator().manual_seed(0))
    assert [f"id{int(v)}" for v in drawn[0].flatten().tolist()] == drawn[1]


def test_gradinit_takes_batches_with_ids_and_a_short_last_batch() -> None:
    x, y = _data(20)
    ids = [f"id{j}" for j in range(20)]
    data = [(x[i : i + 8], y[i : i + 8], ids[i : i + 8]) for i in range(0, 20, 8)]
    report = initlab.gradinit_(_mlp(), data, generator=0)
    assert report.used.batches == 3 and math.isfinite(report.trace[-1]["loss"])


def test_overlap_batch_names_batches_of_different_structure() -> None:
    x = torch.arange(8.0)[:, None]
    with pytest.raises(ValueError, match="differ in structure"):
        overlap_batch((x[:4], x[:4]), (x[4:],), 0.5)


# ----------------------------------------------------------------------------- ignored targets


_WEIGHT = torch.tensor([1.0, 2.0, 0.5])


@pytest.mark.parametrize(
    "mean, summed",
    [
        (nn.CrossEntropyLoss(), nn.CrossEntropyLoss(reduction="sum")),
        ("cross_entropy", nn.CrossEntropyLoss(reduction="sum")),
        (F.cross_entropy, functools.partial(F.cross_entropy, reduction="sum")),
        (nn.CrossEntropyLoss(weight=_WEIGHT), nn.CrossEntropyLoss(weight=_WEIGHT, reduction="sum")),
        (nn.NLLLoss(ignore_index=2), nn.NLLLoss(ignore_index=2, reduction="sum")),
    ],
    ids=["module", "named", "functional", "class_weights", "nll_ignore_2"],
)
def test_a_mean_over_the_counted_targets_gives_the_moments_of_the_summed_loss(
    mean: Any, summed: Any
) -> None:
    # torch's mean divides by the targets it counts (not ignore_index, weighted by class): the
    # per-example gradients are those of each example's own loss, an ignored one's zero, as
    # with reduction="sum" (the probe scaled by the batch size: off by B / count).
    x, y = _data(16)
    y = y.clone()
    y[:5] = -100 if not isinstance(mean, nn.NLLLoss) else 2
    torch.manual_seed(0)
    model = (
        nn.Sequential(nn.Linear(4, 3), nn.LogSoftmax(-1))
        if isinstance(mean, nn.NLLLoss)
        else _mlp()
    )
    a = initlab.measure_moments(model, (x, y), mean).table().to_rows()
    b = initlab.measure_moments(model, (x, y), summed).table().to_rows()
    for ra, rb in zip(a, b, strict=True):
        assert ra["E_dy2"] == pytest.approx(rb["E_dy2"], rel=1e-5)
    nll = isinstance(mean, nn.NLLLoss)  # the last layer with a weight feeds LogSoftmax
    out = (model[0](x) if nll else model(x)).detach().requires_grad_(True)
    (g,) = torch.autograd.grad(summed(model[1](out) if nll else out, y), out)
    assert a[-1]["E_dy2"] == pytest.approx(float(g.double().square().mean()), rel=1e-5)


# ----------------------------------------------------------------------------- second round


@dataclass
class _Pair:
    """A dataclass batch that unpacks as (noisy, clean): still one batch."""

    noisy: torch.Tensor
    clean: torch.Tensor

    def __iter__(self) -> Any:
        return iter((self.noisy, self.clean))


class _Slots:
    __slots__ = ("x", "y")

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y


def test_an_iterable_dataclass_is_one_batch() -> None:
    x = _data(16)[0]
    used = initlab.measure_moments(
        nn.Linear(4, 4), _Pair(x, x + 1), lambda m, b: (m(b.noisy) - b.clean).square().mean()
    ).used
    assert (used.batches, used.examples) == (1, 16)


def test_a_slots_object_is_one_batch() -> None:
    x, y = _data(16)
    used = initlab.measure_moments(_ObjNet(), _Slots(x, y), _obj_loss).used
    assert (used.batches, used.examples) == (1, 16)


def test_an_object_batch_that_requires_grad_is_read_detached() -> None:
    x, y = _data(16)
    x.requires_grad_(True)
    initlab.gradient_stats(_ObjNet(), _Obj(x, y), _obj_loss)
    assert x.grad is None


def test_an_object_batch_with_a_container_that_requires_grad_is_read_detached() -> None:
    """A tensor in a container inside a batch object is read (``batch_tensors``) and detached
    like a top-level attribute: no gradient reaches it."""
    x, y = _data(16)
    x.requires_grad_(True)
    batch = _Obj({"x": x}, y)
    net = _mlp()
    loss = lambda m, b: F.cross_entropy(m(b.x["x"]), b.y)  # noqa: E731
    report = initlab.gradient_stats(net, batch, loss)
    assert x.grad is None and report.used.examples == 16


def test_a_numpy_array_in_an_object_batch_is_named() -> None:
    x, y = _data(16)
    with pytest.raises(TypeError, match=r"holds a numpy array \(entry 'x'\).*torch\.from_numpy"):
        initlab.measure_moments(_ObjNet(), _Obj(x.numpy(), y), _obj_loss)


def test_a_scalar_entry_beside_the_target_is_not_an_unbatched_example() -> None:
    x, y = _data(8)
    batch = (x, y, torch.tensor(0.5))
    loss = lambda m, b: b[2] * F.cross_entropy(m(b[0]), b[1])  # noqa: E731
    assert initlab.measure_moments(_mlp(), batch, loss).used.examples == 8


def test_a_row_with_a_one_element_target_from_batch_size_none_is_refused() -> None:
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=None)
    with pytest.raises(ValueError, match="without a batch dimension"):
        initlab.measure_moments(_mlp(out=1), loader, "mse")


def test_a_leading_scalar_entry_of_a_dict_does_not_set_the_batch_size() -> None:
    x, y = _data(8)
    batch = {"temperature": torch.tensor(2.0), "x": x, "labels": y}
    used = initlab.measure_moments(
        _mlp(), batch, lambda m, b: F.cross_entropy(m(b["x"]), b["labels"])
    ).used
    assert used.examples == 8


def test_an_uncollated_hugging_face_row_is_named() -> None:
    rows = [{"input_ids": torch.randint(0, 20, (10,)), "labels": torch.randint(0, 20, (10,))}]
    with pytest.raises(ValueError, match=r"un-collated example.*DataCollator"):
        initlab.measure_moments(nn.Embedding(20, 4), rows, lambda m, b: m(b["input_ids"]).sum())


class _TokenLM(nn.Module):
    def __init__(self, vocab: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.e, self.h = nn.Embedding(vocab, 32), nn.Linear(32, vocab)
        with torch.no_grad():
            self.h.weight.normal_(0, 0.01)
            self.h.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.h(torch.tanh(self.e(x)))


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_doctor_reads_a_token_cross_entropy_per_counted_token(reduction: str) -> None:
    model = _TokenLM()
    ids = torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(0))
    targets = ids.clone()
    targets[:, :3] = -100
    data = [(ids[i : i + 4], targets[i : i + 4]) for i in range(0, 16, 4)]
    report = initlab.doctor(model, data, nn.CrossEntropyLoss(reduction=reduction))
    row = next(r for r in report.to_rows() if r["check"] == "initial_loss")
    with torch.no_grad():
        want = F.cross_entropy(model(ids).reshape(-1, 64), targets.reshape(-1)).item()
    assert row["value"] == pytest.approx(want, rel=1e-5) and row["verdict"] == "ok"


class _DictNet(nn.Module):
    """Takes the dict's keys and returns logits, no loss: the default reads initlab's CE."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.net(x)


def test_ignored_labels_in_a_dict_batch_give_the_moments_of_the_tuple_batch() -> None:
    x, y = _data(8)
    y = y.clone()
    y[:3] = -100
    model = _DictNet()
    a = initlab.gr_scaling(model, {"x": x, "labels": y}).to_rows()
    b = initlab.gr_scaling(model.net, (x, y), nn.CrossEntropyLoss(reduction="sum")).to_rows()
    for ra, rb in zip(a, b, strict=True):
        assert ra["E_dy2"] == pytest.approx(rb["E_dy2"], rel=1e-6)


def test_a_hugging_face_classifiers_own_loss_with_ignored_labels_matches_its_criterion() -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    bert = hf_models.bert().eval()  # 3 labels
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 3, (8,), generator=gen)
    labels[:3] = -100
    batch = {"input_ids": torch.randint(0, hf_models.V, (8, 6), generator=gen), "labels": labels}

    def head(loss: Any) -> float:
        rows = initlab.measure_moments(bert, batch, loss).param_table().to_rows()
        return next(r for r in rows if (r["layer"], r["param"]) == ("classifier", "weight"))[
            "E_dW2_example"
        ]

    # the mean over the counted labels reads as the summed loss (each example's own), as torch's
    # criterion does, not scaled by the batch size
    summed = head(nn.CrossEntropyLoss(reduction="sum"))
    assert head("model") == pytest.approx(summed, rel=1e-6)
    assert head(nn.CrossEntropyLoss()) == pytest.approx(summed, rel=1e-6)


# ----------------------------------------------------------------------------- T == C, shifts


class _Tagger(nn.Module):
    """Token logits ``(B, T, C)``: one class score per token (takes ids, or a dict's keys)."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.e, self.h = nn.Embedding(20, 8), nn.Linear(8, classes)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.h(self.e(input_ids))


_CLASS_LOSSES = {
    "cross_entropy": "cross_entropy",
    "auto": "auto",
    "nn.CrossEntropyLoss": nn.CrossEntropyLoss(),
    "F.cross_entropy": F.cross_entropy,
}


@pytest.mark.parametrize("form", ["tuple", "dict"])
@pytest.mark.parametrize("loss", sorted(_CLASS_LOSSES))
def test_token_logits_with_as_many_classes_as_tokens_are_read_classes_last(
    loss: str, form: str
) -> None:
    """``(B, T, C)`` with ``T == C`` fits torch's dense layout too; the token ids of the targets'
    shape in the batch say it is a token model, as for any other ``T``."""
    gen = torch.Generator().manual_seed(0)
    ids, y = torch.randint(0, 20, (4, 5), generator=gen), torch.randint(0, 5, (4, 5), generator=gen)
    model = _Tagger(5)
    batch = (ids, y) if form == "tuple" else {"input_ids": ids, "labels": y}
    value = float(resolve_loss(_CLASS_LOSSES[loss])(model, batch).detach())
    with torch.no_grad():
        out = model(ids).double()
    assert value == pytest.approx(float(F.cross_entropy(out.flatten(0, 1), y.flatten())), rel=1e-6)
    assert value != pytest.approx(float(F.cross_entropy(out, y)), rel=1e-3)  # the other reading


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_logits_that_read_both_ways_without_token_ids_warn_and_keep_torchs_layout(
    dtype: torch.dtype,
) -> None:
    """int32 labels too (the named loss converts them to int64; torch's criterion takes int64
    only): the converted copy is still the targets, not token ids."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, 3, generator=gen), torch.randint(0, 3, (4, 3), generator=gen)
    model = nn.Conv1d(3, 3, 1)  # (B, C, L) with L == C
    criteria = [nn.CrossEntropyLoss()] if dtype == torch.int64 else []
    for loss in ("cross_entropy", *criteria):
        with pytest.warns(UserWarning, match=r"read both as torch's layout .* and as tokens"):
            value = float(resolve_loss(loss)(model, (x, y.to(dtype))).detach())
        with torch.no_grad():
            assert value == pytest.approx(float(F.cross_entropy(model(x).double(), y)), rel=1e-6)


def test_a_token_classifier_with_as_many_labels_as_tokens_gives_its_own_loss() -> None:
    """Hugging Face's own token-classification loss is the oracle (classes last, flattened)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32,
        vocab_size=hf_models.V, num_labels=6, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, max_position_embeddings=16,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertForTokenClassification(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(1, hf_models.V, (4, 6), generator=gen),
        "attention_mask": torch.ones(4, 6, dtype=torch.long),
        "labels": torch.randint(0, 6, (4, 6), generator=gen),
    }
    with torch.no_grad():
        own = float(model(**batch).loss)
        for loss in ("cross_entropy", nn.CrossEntropyLoss()):
            assert float(resolve_loss(loss)(model, batch)) == pytest.approx(own, rel=1e-6)


def test_a_class_criterion_on_a_causal_lm_with_unshifted_labels_warns() -> None:
    """Labels that are the ``input_ids`` (Hugging Face's convention: the model shifts them) with a
    criterion that does not: a warning that says how to shift; pre-shifted labels then give the
    model's own loss, without a warning."""
    pytest.importorskip("transformers")
    model = hf_models.model_of("gpt2").eval()
    batch = hf_models.batches("gpt2", 1)[0]
    assert torch.equal(batch["labels"], batch["input_ids"])
    for loss in ("cross_entropy", nn.CrossEntropyLoss()):
        for data in (batch, (batch["input_ids"], batch["labels"])):
            with pytest.warns(UserWarning, match=r"causal language model .* shifts the labels"):
                resolve_loss(loss)(model, data)
    ids = batch["input_ids"]
    shifted = dict(batch, labels=torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1))
    with torch.no_grad():
        own = float(model(**batch).loss)
        assert float(resolve_loss(nn.CrossEntropyLoss())(model, shifted)) == pytest.approx(
            own, rel=1e-6
        )
        assert float(resolve_loss(None)(model, batch)) == pytest.approx(own, rel=1e-6)


def test_random_quadratic_refuses_an_output_too_large_for_its_matrix() -> None:
    """A language model's ``T * V`` outputs per example would need a ``d x d`` matrix of
    terabytes: a clear refusal, not the allocator's error."""
    model = _TokenLM(vocab=2000)
    ids = torch.randint(0, 2000, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"d = 16000 per example \(at most 8192.*loss_fn"):
        resolve_loss("random_quadratic")(model, ids)
    small = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(resolve_loss("random_quadratic")(_TokenLM(), small))  # d = 512


def test_all_modules_of_a_model_that_returns_its_loss_give_the_logits_moments() -> None:
    """``modules="all"`` reaches the root, whose output holds the scalar loss beside the logits:
    the loss is no activation (it was read as one of 1 element, "probe with a larger batch")."""
    pytest.importorskip("transformers")
    model = hf_models.model_of("bert").eval()
    batch = hf_models.batches("bert", 1)[0]
    rows = initlab.measure_moments(model, batch, "model", modules="all").rows().to_rows()
    root = {
        (r["index"], r["stat"]): r["value"]
        for r in rows
        if (r["layer"], r["quantity"], r["call"]) == ("", "y", 0)
    }
    assert {index for index, _ in root} == {"logits"}
    with torch.no_grad():
        logits = model(**batch).logits.double()
    assert root[("logits", "sq_mean")] == pytest.approx(float(logits.square().mean()), rel=1e-6)


_ALL_IGNORED_ENTRIES: dict[str, Callable[[nn.Module, Any, Any], Any]] = {
    "measure_moments": lambda m, d, loss: initlab.measure_moments(m, d, loss),
    "gr_scaling": lambda m, d, loss: initlab.gr_scaling(m, d, loss),
    "diagnose": lambda m, d, loss: initlab.diagnose(m, d, loss, spectra=False),
    "loss_landscape": lambda m, d, loss: initlab.loss_landscape(m, d, loss, grid=3, generator=0),
    "gradinit_": lambda m, d, loss: initlab.gradinit_(m, d, loss, steps=2),
}


@pytest.mark.parametrize("loss", ["model", "cross_entropy", "criterion"])
@pytest.mark.parametrize("entry", sorted(_ALL_IGNORED_ENTRIES))
def test_a_batch_whose_labels_are_all_ignored_is_named(entry: str, loss: str) -> None:
    """Every label -100: a mean over no target (NaN) and no gradient, which the measurements read
    as zero gradients ("ok"). Each entry point raises the same TargetError; the model is kept."""
    model = _Tagger(5)
    gen = torch.Generator().manual_seed(0)
    data = [
        {"input_ids": torch.randint(0, 20, (4, 6), generator=gen), "labels": y}
        for y in (torch.randint(0, 5, (4, 6), generator=gen), torch.full((4, 6), -100))
    ]
    data.append(data[0])
    own = _OwnLoss(model) if loss == "model" else model
    arg = {"model": "model", "cross_entropy": "cross_entropy"}.get(loss, nn.CrossEntropyLoss())
    before = _state(own)
    with pytest.raises(TargetError, match=r"24 targets \(entry 'labels'\) are all ignore_index"):
        _ALL_IGNORED_ENTRIES[entry](own, initlab.Batches(data), arg)
    assert _same(before, _state(own))


def test_a_summed_class_loss_over_no_target_is_zero_and_allowed() -> None:
    ids, y = torch.randint(0, 20, (4, 6)), torch.full((4, 6), -100)
    loss = resolve_loss(nn.CrossEntropyLoss(reduction="sum"))(_Tagger(5), (ids, y))
    assert float(loss.detach()) == 0.0


class _OwnLoss(nn.Module):
    """``_Tagger`` returning its own token cross-entropy as ``.loss`` (the Hugging Face way)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        logits = self.inner(input_ids)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


def test_per_example_gradients_of_a_padded_token_loss_are_shares_of_the_batch_loss() -> None:
    """The probe's documented ``L_i = B sum_t l_it / N`` (N counted tokens of the batch), against
    a float64 loop over the examples; with unequal lengths it is not each example's own token
    average (checked to differ)."""
    model = _Tagger(5)
    gen = torch.Generator().manual_seed(0)
    ids, y = torch.randint(0, 20, (4, 6), generator=gen), torch.randint(0, 5, (4, 6), generator=gen)
    for i, n in enumerate((6, 4, 2, 5)):
        y[i, n:] = -100
    rows = initlab.measure_moments(model, (ids, y), nn.CrossEntropyLoss()).param_table().to_rows()
    got = next(r for r in rows if (r["layer"], r["param"]) == ("h", "weight"))["E_dW2_example"]
    ref = _Tagger(5).double()
    counted = int((y != -100).sum())
    sums = {"share": 0.0, "own": 0.0}
    for i in range(4):
        weights = {"share": 4 / counted, "own": 1 / int((y[i] != -100).sum())}
        for which, weight in weights.items():
            ref.zero_grad()
            tokens = F.cross_entropy(ref(ids[i : i + 1]).flatten(0, 1), y[i], reduction="sum")
            (weight * tokens).backward()
            sums[which] += float(ref.h.weight.grad.square().sum())
    k = 4 * ref.h.weight.numel()
    assert got == pytest.approx(sums["share"] / k, rel=1e-5)
    assert got != pytest.approx(sums["own"] / k, rel=1e-2)


@pytest.mark.parametrize(
    ("problem", "labels", "verdicts"),
    [
        ("multi_label_classification", 4, {"n/a"}),  # its own loss is BCE: no MSE reference
        ("regression", 1, {"ok", "warn", "bad"}),  # MSE against E[y^2]
    ],
)
def test_doctor_reads_a_hugging_face_models_own_loss_on_float_targets_by_its_problem_type(
    problem: str, labels: int, verdicts: set[str]
) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32,
        vocab_size=hf_models.V, num_labels=labels, problem_type=problem,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=16,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(1, hf_models.V, (8, 6), generator=gen),
        "labels": (torch.rand(8, labels, generator=gen) < 0.3).float().squeeze(-1),
    }
    row = next(r for r in initlab.doctor(model, batch).to_rows() if r["check"] == "initial_loss")
    assert row["verdict"] in verdicts
    assert row["why"].startswith("MSE") == (problem == "regression")


class _WithPositions(nn.Module):
    """Token model with a position table looked up by ids ``(1, T)`` shared by the batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok, self.pos, self.head = nn.Embedding(20, 8), nn.Embedding(6, 8), nn.Linear(8, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1])[None]
        return self.head(self.tok(ids) + self.pos(positions))


def test_a_table_read_by_positions_shared_by_the_batch_says_why_it_has_no_per_example_value() -> (
    None
):
    gen = torch.Generator().manual_seed(0)
    ids, y = torch.randint(0, 20, (4, 6), generator=gen), torch.randint(0, 5, (4, 6), generator=gen)
    probe = initlab.measure_moments(_WithPositions(), (ids, y), nn.CrossEntropyLoss())
    row = next(r for r in probe.param_table().to_rows() if r["layer"] == "pos")
    assert math.isnan(row["E_dW2_example"]) and row["E_dW2"] > 0
    note = next(n for n in probe.notes if n.startswith("pos"))
    assert "shared by every example" in note and "batch_dim" not in note


_BAD_OPTIONS: dict[str, tuple[Callable[[nn.Module, Any], Any], type, str]] = {
    "precondition_ tol=-1": (
        lambda m, d: initlab.precondition_(m, d, F.cross_entropy, how="rescale", tol=-1),
        ValueError, r"tol must be a finite number >= 0",
    ),
    "precondition_ tol=None": (
        lambda m, d: initlab.precondition_(m, d, F.cross_entropy, tol=None),
        ValueError, r"tol must be a finite number >= 0 .*, got None",
    ),
    "lsuv_ concat_batches='no'": (
        lambda m, d: initlab.lsuv_(m, d, concat_batches="no"),
        TypeError, r"concat_batches must be True or False, got 'no'",
    ),
    "metainit_ momentum=2": (
        lambda m, d: initlab.metainit_(m, d, F.cross_entropy, momentum=2.0),
        ValueError, r"momentum must be in \[0, 1\)",
    ),
    "metainit_ n_classes with data": (
        lambda m, d: initlab.metainit_(m, d, F.cross_entropy, n_classes=3),
        ValueError, r"n_classes=3 sets the random labels .* leave n_classes out",
    ),
    "gradinit_ progress=3": (
        lambda m, d: initlab.gradinit_(m, d, F.cross_entropy, progress=3),
        TypeError, r"progress must be a function",
    ),
    "metainit_ progress=3": (
        lambda m, d: initlab.metainit_(m, d, F.cross_entropy, progress=3),
        TypeError, r"progress must be a function",
    ),
    # examples= divided the gradient counts: 0 raised ZeroDivisionError, -64 negated gamma and
    # p2, 6.4 scaled them by 10, all without a word
    **{
        f"gr_scaling examples={v!r}": (
            functools.partial(initlab.gr_scaling, examples=v),
            ValueError,
            rf"^gr_scaling: examples must be a positive int \(the number of examples the backward "
            rf"passes saw\) or None \(.*\), got {re.escape(repr(v))}$",
        )
        for v in (0, -64, 6.4, True, "64", 32.0, np.float64(32), np.int64(0), torch.tensor(True))
    },
}  # fmt: skip


@pytest.mark.parametrize("count", [np.int64(32), np.int32(32), torch.tensor(32)])
def test_gr_scaling_takes_a_numpy_or_tensor_integer_count_of_examples(count: Any) -> None:
    """examples= from np.sum(mask) or a 0-d tensor: refused since the count's check took Python
    ints only, though it gave the rows of examples=32 before. p2 = numel(dy) / (examples * n_out)
    is 64 rows / 32 = 2, so gamma (linear in p2) is twice that of the 64 counted examples."""
    data = initlab.Batches([_data(16) for _ in range(4)])
    got = initlab.gr_scaling(_mlp(), data, examples=count).to_rows()
    assert got == initlab.gr_scaling(_mlp(), data, examples=32).to_rows()
    counted = {r["layer"]: r for r in initlab.gr_scaling(_mlp(), data).to_rows()}
    for row in got:
        assert row["p2"] == 2.0
        assert row["gamma_w"] == pytest.approx(2 * counted[row["layer"]]["gamma_w"], rel=1e-12)


@pytest.mark.parametrize("case", sorted(_BAD_OPTIONS))
def test_bad_options_are_refused_at_entry_and_the_model_is_kept(case: str) -> None:
    """Options that were accepted silently (``tol=-1`` ran every round, ``"no"`` read as true,
    ``n_classes`` ignored) or failed late with a raw error (``progress=3`` after a step)."""
    call, error, text = _BAD_OPTIONS[case]
    model = _mlp()
    data = initlab.Batches([_data(16) for _ in range(4)])
    before = _state(model)
    with pytest.raises(error, match=text):
        call(model, data)
    assert _same(before, _state(model))


def test_scale_output_reaches_its_target_on_the_real_tokens_of_padded_batches() -> None:
    """Padded positions (``attention_mask`` 0) are left out of the output's std: the target holds
    on the tokens the model is trained on (0.0465 there when padding was counted)."""
    pytest.importorskip("transformers")
    model = hf_models.model_of("gpt2").eval()
    batch = hf_models.batches("gpt2", 1)[0]
    mask = batch["attention_mask"]
    for row, keep in enumerate((8, 3, 5, 2)):
        mask[row, keep:] = 0
    batch["labels"] = batch["labels"].masked_fill(mask == 0, -100)
    initlab.scale_output_(model, batch, target=0.05, how="hook", module="lm_head")
    with torch.no_grad():
        logits = model(**batch).logits.double()
    real = logits[mask.bool()]
    assert float(real.std(unbiased=False)) == pytest.approx(0.05, rel=1e-5)
    assert float(logits.std(unbiased=False)) != pytest.approx(0.05, rel=1e-4)  # padding differs


def test_lsuv_reaches_unit_variance_on_the_real_tokens_of_padded_batches() -> None:
    pytest.importorskip("transformers")
    model = hf_models.model_of("bert").eval()
    batch = hf_models.batches("bert", 1)[0]
    for row, keep in enumerate((8, 3, 5, 2)):
        batch["attention_mask"][row, keep:] = 0
    initlab.lsuv_(model, batch, generator=0)
    layer = model.bert.encoder.layer[1].intermediate.dense
    seen: dict[str, torch.Tensor] = {}
    handle = layer.register_forward_hook(lambda m, args, out: seen.__setitem__("y", out))
    with torch.no_grad():
        model(**batch)
    handle.remove()
    y = seen["y"].double()
    real = y[batch["attention_mask"].bool()]
    assert float(real.var(unbiased=False)) == pytest.approx(1.0, abs=1e-4)  # solved exactly
    assert abs(float(real.var(unbiased=False)) - 1.0) < abs(float(y.var(unbiased=False)) - 1.0)


class _Attending(nn.Module):
    """Token embedding -> self-attention (``nn.MultiheadAttention``, padding as its
    ``key_padding_mask``) -> head; the padded positions' embeddings are far larger than the
    real ones, so statistics over all positions differ from those over the real tokens."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.batch_first = batch_first
        self.emb = nn.Embedding(11, 8)
        with torch.no_grad():
            self.emb.weight[0].mul_(40.0)  # the padding token
        self.attn = nn.MultiheadAttention(8, 2, batch_first=batch_first)
        self.head = nn.Linear(8, 4)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids)
        if not self.batch_first:
            h = h.transpose(0, 1)
        out = self.attn(h, h, h, key_padding_mask=attention_mask == 0, need_weights=False)[0]
        return self.head(out if self.batch_first else out.transpose(0, 1))


@pytest.mark.parametrize("batch_first", [True, False])
def test_lsuv_reaches_unit_variance_of_attention_projections_on_the_real_tokens(
    batch_first: bool,
) -> None:
    """nn.MultiheadAttention's q/k/v and output projections (LSUV units of their own) are
    measured over the real tokens too (they were measured over every position)."""
    model = _Attending(batch_first)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 11, (4, 6), generator=gen)
    mask = torch.ones(4, 6, dtype=torch.long)
    for row, keep in enumerate((6, 3, 4, 2)):
        mask[row, keep:] = 0
        ids[row, keep:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    initlab.lsuv_(model, batch, generator=0, tol=1e-6, max_iter=20)
    seen: dict[str, Any] = {}
    handle = model.attn.register_forward_hook(lambda m, args, out: seen.update(args=args, out=out))
    with torch.no_grad():
        model(**batch)
    handle.remove()
    real = mask.bool() if batch_first else mask.bool().T
    w, b = model.attn.in_proj_weight.detach(), model.attn.in_proj_bias.detach()
    for k in range(3):  # q, k, v
        z = F.linear(seen["args"][k], w[8 * k : 8 * (k + 1)], b[8 * k : 8 * (k + 1)])
        assert float(z[real].double().var(unbiased=False)) == pytest.approx(1.0, abs=1e-4)
        assert abs(float(z.double().var(unbiased=False)) - 1.0) > 0.1  # padding differs
    out = seen["out"][0][real].double()
    assert float(out.var(unbiased=False)) == pytest.approx(1.0, abs=1e-4)


class _ResidualTokens(nn.Module):
    """Token embedding (real tokens small, the padding token large) -> a residual block -> head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8)
        with torch.no_grad():
            self.emb.weight.mul_(0.3)
            self.emb.weight[0].mul_(100.0)
        self.block = _Residual8()
        self.head = nn.Linear(8, 4)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.emb(input_ids)))


class _Residual8(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(self.a(x).tanh())


def test_lsuv_stream_fits_a_block_output_on_the_real_tokens() -> None:
    """strategy="stream" re-runs a block to fit its output: measured over the real tokens too."""
    model = _ResidualTokens()
    ids = torch.randint(1, 11, (4, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(4, 6, dtype=torch.long)
    for row, keep in enumerate((6, 3, 4, 2)):
        mask[row, keep:] = 0
        ids[row, keep:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    initlab.lsuv_(model, batch, generator=0, strategy="stream", blocks=["block"], tol=1e-6)
    with torch.no_grad():
        y = model.block(model.emb(ids)).double()
    assert float(y[mask.bool()].var(unbiased=False)) == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize(
    "entry",
    [
        lambda m, d: initlab.gr_scaling(m, d).to_rows(),
        lambda m, d: initlab.loss_landscape(m, d[0], grid=2, generator=0).values.tolist(),
        lambda m, d: initlab.gr_scaling(m, d, nn.CrossEntropyLoss()).to_rows(),
    ],
    ids=["gr_scaling", "loss_landscape", "gr_scaling-criterion"],
)
def test_a_tuple_output_of_return_dict_false_reads_as_the_dict_one(entry: Any) -> None:
    """A Hugging Face model called with return_dict=False returns (loss, logits, ...): the 0-d
    loss was taken for the logits ("IndexError: tuple index out of range")."""
    pytest.importorskip("transformers")
    model = hf_models.model_of("llama")
    data = hf_models.batches("llama", 2)
    tuples = [dict(b, return_dict=False) for b in data]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*is a causal language model", UserWarning)
        expected, got = entry(model, data), entry(model, tuples)
    assert got == expected


# ----------------------------------------------------------------------------- labels kept out


def test_a_criterion_on_a_hugging_face_model_does_not_hand_it_the_labels() -> None:
    """With a loss on the outputs the model gets no labels: class probabilities that its own
    single-label loss would refuse work, its config is not touched, and out-of-range labels give
    initlab's TargetError, not an IndexError from inside the model's loss."""
    pytest.importorskip("transformers")
    model = hf_models.model_of("bert").eval()
    batch = hf_models.batches("bert", 1)[0]
    gen = torch.Generator().manual_seed(0)
    soft = torch.softmax(torch.randn(hf_models.B, 3, generator=gen), -1)
    probs = dict(batch, labels=soft)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        want = float(F.cross_entropy(model(**inputs).logits.double(), soft.double()))
        assert float(resolve_loss(nn.CrossEntropyLoss())(model, probs)) == pytest.approx(
            want, rel=1e-6
        )
    report = initlab.gradient_stats(model, probs, nn.CrossEntropyLoss())
    assert report.used.examples == hf_models.B and model.config.problem_type is None
    initlab.block_curvature(model, probs, nn.CrossEntropyLoss(), generator=0)  # functional calls
    initlab.loss_landscape(model, probs, nn.CrossEntropyLoss(), grid=3, generator=0)
    assert model.config.problem_type is None
    wrong = dict(batch, labels=torch.full((hf_models.B,), 7))
    with pytest.raises(TargetError, match=r"Target 7 is out of bounds\. Check that the targets"):
        initlab.gr_scaling(model, wrong, nn.CrossEntropyLoss())


def test_an_encoder_decoder_gets_its_decoder_inputs_from_the_labels() -> None:
    """T5 builds its decoder inputs from the labels; without the labels they are built the same way
    (``prepare_decoder_input_ids_from_labels``): the named cross-entropy is the model's own loss."""
    pytest.importorskip("transformers")
    model = hf_models.model_of("t5").eval()
    batch = hf_models.batches("t5", 1)[0]
    with torch.no_grad():
        own = float(model(**batch).loss)
        assert float(resolve_loss("cross_entropy")(model, batch)) == pytest.approx(own, rel=1e-6)


class _TeacherForced(nn.Module):
    """A model of one's own that reads the labels (teacher forcing): it keeps getting them."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        assert labels is not None, "the labels were not passed"
        return self.net(x)


def test_a_model_of_ones_own_still_gets_the_labels() -> None:
    x, y = _data(8)
    value = resolve_loss(nn.CrossEntropyLoss())(_TeacherForced(), {"x": x, "labels": y})
    assert torch.isfinite(value)


def test_overlap_batch_chooses_per_image_targets_as_items() -> None:
    # the detection format: images (B, ...) and a list of B dicts of ragged boxes
    def batch(start: int, n: int) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
        images = torch.arange(start, start + n, dtype=torch.float32)[:, None]
        targets = [{"boxes": torch.full((i + 1, 4), float(i))} for i in range(start, start + n)]
        return images, targets

    tilde = overlap_batch(batch(0, 4), batch(10, 4), 0.5)
    assert tilde[0].flatten().tolist() == [0.0, 1.0, 10.0, 11.0]
    assert [t["boxes"].shape[0] for t in tilde[1]] == [1, 2, 11, 12]
    assert type(tilde[1]) is list
    drawn = overlap_batch(batch(0, 4), batch(10, 4), 0.5, generator=3)
    assert [t["boxes"].shape[0] - 1 for t in drawn[1]] == drawn[0].flatten().int().tolist()


class _Fussy(nn.Module):
    """A criterion with its own checks: its errors are its own, not a target problem."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise self.error


@pytest.mark.parametrize(
    "error",
    [ValueError("temperature must be positive"), torch.OutOfMemoryError("out of memory")],
    ids=["own_value_error", "out_of_memory"],
)
def test_a_criterions_own_error_passes_unchanged(error: Exception) -> None:
    x, y = _data()
    with pytest.raises(type(error)) as caught:
        initlab.gradient_stats(_mlp(), (x, y), _Fussy(error))
    assert caught.value is error


class _NeedsMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.net(x * mask)


def test_the_models_own_type_error_is_not_blamed_on_the_loss_form() -> None:
    x, y = _data()
    with pytest.raises(TypeError, match="missing 1 required positional argument") as caught:
        initlab.measure_moments(_NeedsMask(), (x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    assert "initlab.criterion" not in str(caught.value)


def test_a_wrapped_criterion_can_say_it_sums() -> None:
    x, y = _data(19)
    model = _mlp()
    batches = [(x[:8], y[:8]), (x[8:16], y[8:16]), (x[16:], y[16:])]
    summing = initlab.criterion(
        lambda o, t: F.cross_entropy(o, t, reduction="sum"), reduction="sum"
    )
    land = initlab.loss_landscape(model, batches, summing, grid=([0.0], [0.0]))
    with torch.no_grad():
        want = F.cross_entropy(model(x), y, reduction="sum").item()
    assert float(land.center) == pytest.approx(want, rel=1e-5)
    with pytest.raises(ValueError, match="declares reduction='sum'"):
        initlab.criterion(nn.CrossEntropyLoss(reduction="sum"), reduction="mean")


class _KwNet(nn.Module):
    """A model called with a dict batch (``model(**batch)``) that returns no loss of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.lin(x)


def test_the_default_loss_on_a_dict_batch_names_targets_it_cannot_pair() -> None:
    """The default on a dict batch without a model loss: torch's own error ("Expected input
    batch_size (8) to match target batch_size (16)") became the message the tuple form gives."""
    x, y = _data(8)
    bad = {"x": x, "labels": torch.stack([y, y], 1)}  # (8, 2) class indices for (8, 3) logits
    with pytest.raises(TargetError, match=r"output of shape \(8, 3\).*targets of shape \(8, 2\)"):
        resolve_loss(None)(_KwNet(), bad)
    with pytest.raises(TargetError, match=r"output of shape \(8, 3\).*targets of shape \(8, 2\)"):
        resolve_loss(None)(_KwNet(), (x, bad["labels"]))


class _NamesNoTarget(nn.Module):
    """A forward of named inputs only, no ``**kwargs`` (Hugging Face models before transformers
    5): ``model(**batch)`` refuses a batch's target key."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lin(input_ids)


class _SwitchedNoTarget(_NamesNoTarget):
    """CLIP's form: its loss only with ``return_loss=True`` (else ``loss`` None)."""

    def forward(self, input_ids: torch.Tensor, return_loss: bool = False) -> Any:  # type: ignore[override]
        logits = self.lin(input_ids)
        return {"loss": logits.square().mean() if return_loss else None, "logits": logits}


def test_a_target_key_the_forward_does_not_take_is_left_to_the_loss_on_its_outputs() -> None:
    """BERT before transformers 5 given the GLUE column 'label', CLIP given 'labels': the model
    refused the key ("unexpected keyword argument"), so loss_fn=None failed with the keys
    error where the documented fallback (cross-entropy on the logits; for CLIP, the advice to
    set its switch return_loss) applies. The target is left out of the forward's arguments."""
    x, y = _data(8)
    model = _NamesNoTarget()
    with torch.no_grad():
        got = resolve_loss(None)(model, {"input_ids": x, "label": y})
        expected = F.cross_entropy(model.lin(x).double(), y)
    assert float(got) == pytest.approx(float(expected), rel=1e-6)
    with pytest.raises(TargetError, match=r"pass return_loss=True in every batch"):
        resolve_loss(None)(_SwitchedNoTarget(), {"input_ids": x, "labels": y})


class _TakesX(nn.Module):
    """``forward(self, x)``: a dict batch ``{'x', 'y'}`` carries a target it cannot take."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


_DICT_TARGET_CALLS: dict[str, Callable[[nn.Module, Any], Any]] = {
    "measure_moments": lambda m, d: initlab.measure_moments(m, d),
    "measure_moments criterion": lambda m, d: initlab.measure_moments(
        m, d, loss_fn=nn.CrossEntropyLoss()
    ),
    "doctor": lambda m, d: initlab.doctor(m, d, generator=0),
    "lsuv_": lambda m, d: initlab.lsuv_(m, d, generator=0),
    "scale_output_": lambda m, d: initlab.scale_output_(m, d),
    "gr_scaling": lambda m, d: initlab.gr_scaling(m, d),
}


@pytest.mark.parametrize("call", list(_DICT_TARGET_CALLS))
def test_every_entry_point_leaves_out_a_target_key_the_forward_cannot_take(call: str) -> None:
    """A ``forward(self, x)`` given ``{'x', 'y'}``: loss_fn=None left the target out, but the
    forward-only paths (the probe's, doctor's, lsuv_'s, scale_output_'s) passed it on and the
    model refused 'y'. The default forward leaves it out everywhere; the moments match those of
    the same model on (x, y) tuples."""
    x, y = _data(16)
    as_dict, as_tuple = _TakesX(), _TakesX()
    got = _DICT_TARGET_CALLS[call](as_dict, [{"x": x, "y": y}])
    want = _DICT_TARGET_CALLS[call](as_tuple, [(x, y)])
    assert _same(_state(as_dict), _state(as_tuple))
    if call.startswith("measure_moments"):
        assert got.table().to_rows() == want.table().to_rows()
        assert got.param_table().to_rows() == want.param_table().to_rows()


class _WithLoss(nn.Module):
    """A model-and-loss wrapper: ``forward(*args, **kwargs)`` reads the labels itself."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        labels = kwargs.pop("labels")
        logits = self.module(*args, **kwargs)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


@CPU_DATA_PARALLEL
def test_a_wrapper_taking_kwargs_keeps_the_target_and_a_pass_through_one_does_not() -> None:
    """The signature read for the target went through any ``.module``: a model-and-loss wrapper
    whose ``**kwargs`` reads 'labels' lost them (KeyError inside it). A wrapper of one's own
    taking ``**kwargs`` keeps the target; DataParallel (as DDP and torch.compile) hands its
    arguments on, so the inner forward decides."""
    x, y = _data(16)
    batch = {"x": x, "labels": y}
    wrapped = _WithLoss(_TakesX())
    moments = initlab.measure_moments(wrapped, [batch])  # the default forward: labels kept
    assert moments.table().to_rows()
    with torch.no_grad():
        got = resolve_loss(None)(wrapped, batch)
        want = F.cross_entropy(wrapped.module(x).double(), y)
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    parallel = nn.DataParallel(_TakesX())
    with torch.no_grad():
        got = resolve_loss(None)(parallel, {"x": x, "y": y})
        want = F.cross_entropy(parallel.module(x).double(), y)
    assert float(got) == pytest.approx(float(want), rel=1e-6)


class _KeywordBugInside(nn.Module):
    """Takes the batch's keys; its own code calls a function with a keyword it does not take."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.lin.weight, bias=self.lin.bias, scale=2.0)  # type: ignore[call-arg]


@pytest.mark.parametrize("model", [_KeywordBugInside(), _mlp()], ids=["bug_inside", "no_keys"])
def test_a_type_error_is_blamed_on_the_batchs_keys_only_when_the_forward_refuses_them(
    model: nn.Module,
) -> None:
    x, y = _data(8)
    with pytest.raises(TypeError) as info:
        initlab.measure_moments(model, [{"x": x, "labels": y}])
    blamed = "does not take the key 'x' of the batch's keys" in str(info.value)
    assert blamed == isinstance(model, nn.Sequential), str(info.value)


def _ce_calls_model(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


_F64_CALLS: dict[str, Callable[[nn.Module, Any, Any], Any]] = {
    "lsuv_": lambda m, d, loss: initlab.lsuv_(m, d, generator=0),
    "gradinit_": lambda m, d, loss: initlab.gradinit_(m, d, loss, steps=1, generator=0),
    "metainit_": lambda m, d, loss: initlab.metainit_(m, d, loss, steps=1, generator=0),
    "scale_output_": lambda m, d, loss: initlab.scale_output_(m, d),
    "gr_scaling": lambda m, d, loss: initlab.gr_scaling(m, d, loss),
    "doctor": lambda m, d, loss: initlab.doctor(m, d, loss),
    "gradient_stats": lambda m, d, loss: initlab.gradient_stats(m, d, loss),
    "loss_landscape": lambda m, d, loss: initlab.loss_landscape(m, d, loss, grid=2),
    "block_curvature": lambda m, d, loss: initlab.block_curvature(m, d, loss, probes=2),
}


@pytest.mark.parametrize("loss", [nn.CrossEntropyLoss(), _ce_calls_model], ids=["crit", "fn"])
@pytest.mark.parametrize("entry", list(_F64_CALLS))
def test_float64_data_into_a_float32_model_says_what_to_convert(entry: str, loss: Any) -> None:
    """torch's bare "mat1 and mat2 must have the same dtype, but got Double and Float" named no
    batch, entry or fix. The data is not converted: the model is left as it was."""
    x, y = _data(24)
    data = [(x[i : i + 8].double(), y[i : i + 8]) for i in range(0, 24, 8)]
    model = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TypeError, match=r"^the batch's entry '0' \(shape \(8, 4\)\) is "
                       r"torch\.float64 and the model's parameters are torch\.float32 \(mat1 and "
                       r"mat2 .*\)\. initlab does not convert data: convert it "
                       r"\(x\.to\(torch\.float32\), x\.float\(\), in") as info:  # fmt: skip
        _F64_CALLS[entry](model, data, loss)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # the other way round: the conversion named is the model's dtype's (it said x.float())
    with pytest.raises(TypeError, match=r"convert it \(x\.to\(torch\.float64\), x\.double\(\)"):
        _F64_CALLS[entry](_mlp().double(), [(x[i : i + 8], y[i : i + 8]) for i in (0, 8)], loss)


def _int_message(shape: tuple[int, ...], dtype: torch.dtype, torch_part: str) -> str:
    """The pattern of initlab's message for integer/bool batch entry '0' of ``shape`` reaching a
    float32 model, torch's own error matching ``torch_part``."""
    kind = "bool" if dtype == torch.bool else "integer"
    return (
        rf"^the batch's entry '0' \(shape {re.escape(str(shape))}\) is {re.escape(str(dtype))} "
        rf"and the model's parameters are torch\.float32 \({torch_part}\): {kind} data reached "
        r"a layer that computes in floating point\. initlab does not convert data: convert it "
        r"\(x\.to\(torch\.float32\), x\.float\(\), in"
    )


_INT_CALLS: dict[str, Callable[[nn.Module, Any, Any], Any]] = {
    **_F64_CALLS,
    "precondition_": lambda m, d, loss: initlab.precondition_(m, d, loss),
    "measure_moments": lambda m, d, loss: initlab.measure_moments(m, d, loss),
    "diagnose": lambda m, d, loss: initlab.diagnose(m, d, loss),
}


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int64, torch.bool], ids=str)
@pytest.mark.parametrize("entry", list(_INT_CALLS))
def test_integer_or_bool_inputs_into_a_float_model_say_what_to_convert(
    entry: str, dtype: torch.dtype
) -> None:
    """uint8 images or int64 features gave torch's raw "mat1 and mat2 must have the same dtype,
    but got Byte and Float" from inside the model (only floating-point batch tensors were
    explained). The data is not converted, and the model is left as it was."""
    gen = torch.Generator().manual_seed(2)
    data = [
        (torch.randint(0, 2, (8, 4), generator=gen).to(dtype), torch.randint(0, 3, (8,)))
        for _ in range(3)
    ]
    model = _mlp()
    before = _state(model)
    with pytest.raises(TypeError, match=_int_message((8, 4), dtype, "mat1 and mat2 .*")) as info:
        _INT_CALLS[entry](model, data, nn.CrossEntropyLoss())
    assert isinstance(info.value.__cause__, RuntimeError)
    assert ("/ 255" in str(info.value)) == (dtype == torch.uint8)
    assert all(torch.equal(v, before[k]) for k, v in _state(model).items())


class _Tokens(nn.Module):
    """Token ids through an embedding (integer inputs are right here); ``bug``: a float64
    constant inside the forward (a dtype mismatch the ids did not cause)."""

    def __init__(self, bug: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head, self.bug = nn.Embedding(10, 8), nn.Linear(8, 3), bug

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids).mean(1)
        return self.head(h @ torch.eye(8, dtype=torch.float64) if self.bug else h)


def test_token_ids_are_not_refused_nor_blamed_for_a_mismatch_inside_the_model() -> None:
    """Integer inputs are explained only after the model raised, and only when torch's error
    names their dtype: token ids run, and a float64 constant inside the model keeps torch's
    own error (it names Float and Double, not Long)."""
    ids = torch.randint(0, 10, (8, 5), generator=torch.Generator().manual_seed(3))
    data = [(ids, torch.randint(0, 3, (8,)))]
    initlab.scale_output_(_Tokens(), data)
    initlab.gr_scaling(_Tokens(), data, nn.CrossEntropyLoss())
    with pytest.raises(RuntimeError, match="same dtype") as info:
        initlab.scale_output_(_Tokens(bug=True), data)
    assert type(info.value) is RuntimeError and "integer data" not in str(info.value)


#: First layers that take the data, with the shape of the data they take.
_FIRST_LAYERS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "Linear": (lambda: nn.Linear(4, 3), (8, 4)),
    "Linear(bias=False)": (lambda: nn.Linear(4, 3, bias=False), (8, 4)),
    "Conv2d": (lambda: nn.Conv2d(3, 2, 3), (8, 3, 5, 5)),
    "Conv2d(bias=False)": (lambda: nn.Conv2d(3, 2, 3, bias=False), (8, 3, 5, 5)),  # ResNet's stem
    "LayerNorm": (lambda: nn.LayerNorm(4), (8, 4)),
    "BatchNorm1d": (lambda: nn.BatchNorm1d(4), (8, 4)),
    "BatchNorm2d": (lambda: nn.BatchNorm2d(3), (8, 3, 5, 5)),
}

_FIRST_CALLS: dict[str, Callable[[nn.Module, Any], Any]] = {
    "gr_scaling": lambda m, d: initlab.gr_scaling(m, d, nn.CrossEntropyLoss()),
    "gr_scaling, loss_fn(model, batch)": lambda m, d: initlab.gr_scaling(m, d, _ce_calls_model),
    "block_curvature": lambda m, d: initlab.block_curvature(m, d, nn.CrossEntropyLoss(), probes=2),
}


@pytest.mark.parametrize("entry", list(_FIRST_CALLS))
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int64, torch.bool], ids=str)
@pytest.mark.parametrize("first", list(_FIRST_LAYERS))
def test_integer_inputs_are_named_whatever_the_first_layer(
    first: str, dtype: torch.dtype, entry: str
) -> None:
    """A bias-free conv said "expected scalar type Byte but found Float" (the input's dtype
    first), a LayerNorm "mixed dtype (CPU): all inputs must share same datatype" (no dtype), a
    BatchNorm '"batch_norm" not implemented for 'Long'' (a NotImplementedError): each came out
    raw, only linear layers and convs with a bias were explained."""
    make, shape = _FIRST_LAYERS[first]
    torch.manual_seed(0)
    model = nn.Sequential(make(), nn.Flatten(), nn.LazyLinear(3))
    model(torch.randn(shape))  # the lazy head takes its shape
    before = _state(model)
    gen = torch.Generator().manual_seed(4)
    data = [(torch.randint(0, 2, shape, generator=gen).to(dtype), torch.randint(0, 3, (8,)))]
    with pytest.raises(TypeError, match=_int_message(shape, dtype, ".+")) as info:
        _FIRST_CALLS[entry](model, data)
    assert isinstance(info.value.__cause__, RuntimeError)  # NotImplementedError included
    assert _same(_state(model), before)


class _TokensNorm(nn.Module):
    """Token ids through an embedding, then a norm that fails on a tensor the model made:
    ``"double"``, the embeddings in float64 into a float32 LayerNorm ("mixed dtype"); ``"pos"``,
    int64 positions of the ids' shape into a BatchNorm ("not implemented for 'Long'")."""

    def __init__(self, bug: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head, self.bug = nn.Embedding(10, 8), nn.Linear(8, 3), bug
        self.ln, self.bn = nn.LayerNorm(8), nn.BatchNorm1d(5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.bug == "double":
            return self.head(self.ln(self.emb(ids).mean(1).double()))
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        return self.head(self.emb(ids).mean(1) + self.bn(pos).mean())


@pytest.mark.parametrize("bug", ["double", "pos"])
def test_token_ids_are_not_blamed_for_a_norm_error_inside_the_model(bug: str) -> None:
    """The errors that name no input dtype (a norm's) blame an integer input only when the
    failing torch function took it: not the ids of a model whose own tensor broke the norm."""
    ids = torch.randint(0, 10, (8, 5), generator=torch.Generator().manual_seed(3))
    with pytest.raises(RuntimeError, match=r"mixed dtype|not implemented for 'Long'") as info:
        initlab.gr_scaling(_TokensNorm(bug), [(ids, torch.randint(0, 3, (8,)))])
    assert "integer data" not in str(info.value)


_NORMS: dict[str, Callable[[], nn.Module]] = {
    "LayerNorm": lambda: nn.LayerNorm(4),
    "GroupNorm": lambda: nn.GroupNorm(2, 4),
    "BatchNorm1d": lambda: nn.BatchNorm1d(4),
}


@pytest.mark.parametrize("entry", list(_INT_CALLS))
@pytest.mark.parametrize("norm", list(_NORMS))
def test_float64_data_into_a_float32_norm_first_says_what_to_convert(entry: str, norm: str) -> None:
    """A norm as the model's first layer: torch's "mixed dtype (CPU): all inputs must share same
    datatype" names no dtype, and came out raw (only the errors naming both dtypes were
    explained). The model is left as it was; float32 data into a float64 model says x.double().
    (metainit_ runs LayerNorm and BatchNorm as elementary operations: the Linear after it fails.)"""
    x, y = _data(16)
    torch.manual_seed(0)
    model = nn.Sequential(_NORMS[norm](), nn.Linear(4, 3))
    before = _state(model)
    data = [(x[i : i + 8].double(), y[i : i + 8]) for i in (0, 8)]
    with pytest.raises(TypeError, match=r"^the batch's entry '0' \(shape \(8, 4\)\) is "
                       r"torch\.float64 and the model's parameters are torch\.float32 \((?:mixed "
                       r"dtype|mat1 and mat2) .*\)\. initlab does not convert data: convert it "
                       r"\(x\.to\(torch\.float32\), x\.float\(\), in") as info:  # fmt: skip
        _INT_CALLS[entry](model, data, nn.CrossEntropyLoss())
    assert isinstance(info.value.__cause__, RuntimeError)
    assert _same(_state(model), before)
    with pytest.raises(TypeError, match=r"convert it \(x\.to\(torch\.float64\), x\.double\(\)"):
        _INT_CALLS[entry](model.double(), [(x[:8], y[:8]), (x[8:], y[8:])], nn.CrossEntropyLoss())


class _NormOfItsOwn(nn.Module):
    """A float32 model whose norm the data reaches in another dtype than the model's:
    ``"bfloat16"``, the norm's parameters (converting the data to float32 would not help);
    ``"shifted"``, the model's own tensor (``x + 1``), not the batch's, reaches a float32 norm."""

    def __init__(self, bug: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.ln, self.bug = nn.Linear(4, 4), nn.LayerNorm(4), bug
        if bug == "bfloat16":
            self.ln.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.ln(x if self.bug == "bfloat16" else x + 1).float())


@pytest.mark.parametrize("bug", ["bfloat16", "shifted"])
def test_a_norms_mixed_dtype_is_not_blamed_on_data_it_did_not_come_from(bug: str) -> None:
    """The "mixed dtype" of a norm names neither dtype: the batch is blamed only when the norm
    took it and every other tensor the norm took is of the model's dtype."""
    x, y = _data(8)
    with pytest.raises(RuntimeError, match=r"mixed dtype") as info:
        initlab.measure_moments(_NormOfItsOwn(bug), [(x.double(), y)], nn.CrossEntropyLoss())
    assert type(info.value) is RuntimeError and "convert" not in str(info.value)


class _TokensLinear(nn.Module):
    """Token ids through an embedding, then the model's own bug: an integer tensor into a Linear
    after the embedding ran: ``"positions"``, ``torch.arange(T)`` it makes; ``"ids"``, the
    batch's ids themselves (the embedding needs them as integers: converting them breaks it)."""

    def __init__(self, bug: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head, self.bug = nn.Embedding(10, 8), nn.Linear(8, 3), bug
        self.pos = nn.Linear(1, 8) if bug == "positions" else nn.Linear(5, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        if self.bug == "positions":
            return self.head((h + self.pos(torch.arange(ids.shape[1])[:, None])).mean(1))
        return self.head(h.mean(1)) + self.pos(ids)


@pytest.mark.parametrize("entry", list(_INT_CALLS))
@pytest.mark.parametrize("bug", ["positions", "ids"])
def test_token_ids_are_not_blamed_for_an_integer_tensor_the_model_feeds_a_linear(
    bug: str, entry: str
) -> None:
    """torch's "mat1 and mat2 must have the same dtype, but got Long and Float" names the ids'
    dtype, and initlab said to convert the ids to float (which breaks the embedding) and turned
    the RuntimeError into a TypeError. The ids are blamed only if the failing torch function took
    them and the model's embeddings could not: here torch's own error comes out, model unchanged."""
    gen = torch.Generator().manual_seed(3)
    data = [(torch.randint(0, 10, (8, 5), generator=gen), torch.randint(0, 3, (8,), generator=gen))
            for _ in range(2)]  # fmt: skip
    model = _TokensLinear(bug)
    before = _state(model)
    with pytest.raises(RuntimeError, match=r"same dtype, but got Long and Float") as info:
        _INT_CALLS[entry](model, data, nn.CrossEntropyLoss())
    assert type(info.value) is RuntimeError and "convert" not in str(info.value)
    assert _same(_state(model), before)


class _IdsAndFeatures(nn.Module):
    """Token ids through an embedding, int64 features (outside the embedding's range) into a
    Linear: the features are data to convert."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.lin = nn.Embedding(10, 4), nn.Linear(5, 4)

    def forward(self, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        return self.emb(ids).mean(1) + self.lin(feats)


def test_integer_features_beside_token_ids_are_still_named() -> None:
    """A model with an embedding still gets initlab's message for an integer input its
    embeddings cannot take (values past ``num_embeddings``)."""
    gen = torch.Generator().manual_seed(5)
    data = [{"ids": torch.randint(0, 10, (8, 3), generator=gen),
             "feats": torch.randint(100, 200, (8, 5), generator=gen)}]  # fmt: skip
    with pytest.raises(TypeError, match=r"^the batch's entry 'feats' \(shape \(8, 5\)\) is "
                       r"torch\.int64 .*: integer data reached a layer"):  # fmt: skip
        initlab.lsuv_(_IdsAndFeatures(), data, generator=0)


# ------------------------------------------------------------- sources that are not batches


def _initlab_dataset() -> Any:
    from initlab.data import Dataset

    x, y = _data(24)
    return Dataset(x=x, y=y, name="toy", n_features=4, n_classes=3, label_map=(0, 1, 2))


_SOURCES: dict[str, tuple[Callable[[], Any], str]] = {
    "TensorDataset": (
        lambda: TensorDataset(*_data(24)),
        r"data is a TensorDataset, a map-style torch Dataset, which holds single examples: "
        r"pass torch\.utils\.data\.DataLoader\(dataset, batch_size=\.\.\.\) instead",
    ),
    "path": (lambda: "train.pt", r"data is a path or a string \('train\.pt'\), not batches: load"),
    "initlab Dataset": (
        _initlab_dataset,
        r"data is the initlab data set 'toy' \(a whole split\): pass batches of it",
    ),
}


@pytest.mark.parametrize("source", list(_SOURCES))
@pytest.mark.parametrize("entry", list(_F64_CALLS))
def test_a_data_source_that_is_not_batches_is_named(entry: str, source: str) -> None:
    """A Dataset (not its DataLoader) or a path reached the model as model(dataset): torch's
    "linear(): argument 'input' must be Tensor, not TensorDataset"; gradinit_ said "the data
    gave 1" batch."""
    make, message = _SOURCES[source]
    model = _mlp()
    before = _state(model)
    with pytest.raises(TypeError, match=rf"^{re.escape(entry)}: {message}"):
        _F64_CALLS[entry](model, make(), nn.CrossEntropyLoss())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_gradinit_without_data_says_it_needs_data() -> None:
    with pytest.raises(TypeError, match=r"^gradinit_ needs data; accepted forms: one batch"):
        initlab.gradinit_(_mlp(), None, nn.CrossEntropyLoss(), steps=1)


def test_single_examples_with_a_vector_target_are_refused() -> None:
    """DataLoader(batch_size=None) rows (x (4,), y (2,)): read as a batch of 4 examples, gamma
    came out 2x (k = 2) and the example counts were 2x; only 0-d and (1,) targets were caught."""
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    rows = DataLoader(TensorDataset(x, torch.randn(6, 2)), batch_size=None)
    message = (
        r"batch 0 looks like one example without a batch dimension: its target \(entry '1'\) "
        r"is of shape \(2,\) while its input has shape \(4,\)"
    )
    for call in (initlab.gr_scaling, initlab.gradient_stats, initlab.measure_moments):
        with pytest.raises(ValueError, match=message):
            call(_mlp(out=2), rows, nn.MSELoss())
    # a batch of 4 token ids with their 4 targets is a batch
    ids = torch.tensor([0, 3, 1, 4])
    probe = initlab.measure_moments(nn.Embedding(5, 3), [(ids, ids)])
    assert probe.used is not None and probe.used.examples == 4


def test_a_contract_knob_an_entry_point_does_not_take_is_said_so() -> None:
    x, y = _data(8)
    for call, guess in ((initlab.block_curvature, "max_probes"), (initlab.theory_vs_actual, "")):
        with pytest.raises(TypeError, match=r"takes no max_batches=; accepted: ") as info:
            call(_mlp(), (x, y), nn.CrossEntropyLoss(), max_batches=3)
        assert "did you mean" not in str(info.value), guess
    with pytest.raises(TypeError, match=r"input_scale takes no generator=; accepted: "):
        initlab.input_scale(x, generator=0)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_seed_beyond_64_bits_is_named(seed: int) -> None:
    with pytest.raises(ValueError, match=rf"the seed {seed} does not fit in 64 bits"):
        initlab.lsuv_(_mlp(), _data(8)[0], generator=seed)


# ------------------------------------------------------------------ complex-valued parameters


class _ComplexHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 8)
        self.z = nn.Parameter(torch.randn(8, 3, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.body(x).to(torch.complex64) @ self.z).abs()


_COMPLEX_CALLS: dict[str, Callable[[nn.Module, Any], Any]] = {
    "measure_moments": lambda m, d: initlab.measure_moments(m, d, nn.CrossEntropyLoss()),
    "gr_scaling": lambda m, d: initlab.gr_scaling(m, d, nn.CrossEntropyLoss()),
    "gradient_stats": lambda m, d: initlab.gradient_stats(m, d, nn.CrossEntropyLoss()),
    "diagnose": lambda m, d: initlab.diagnose(m, d, nn.CrossEntropyLoss()),
    "doctor": lambda m, d: initlab.doctor(m, d, nn.CrossEntropyLoss()),
    "metainit_": lambda m, d: initlab.metainit_(m, d, nn.CrossEntropyLoss(), steps=1),
}


@pytest.mark.parametrize("entry", list(_COMPLEX_CALLS))
def test_a_trainable_complex_parameter_is_refused_by_name(entry: str) -> None:
    """metainit_ and diagnose died inside torch ("grad can be implicitly created only for real
    scalar outputs", "linalg.vector_norm: dtype should be complex"); the probe read the complex
    gradient's real part with a torch warning."""
    model, (x, y) = _ComplexHead(), _data(16)
    before = _state(model)
    with pytest.raises(TypeError, match=rf"^{entry}: parameter\(s\) z are complex; "):
        _COMPLEX_CALLS[entry](model, [(x[:8], y[:8]), (x[8:], y[8:])])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_frozen_complex_parameter_is_read_as_its_modulus() -> None:
    model, (x, y) = _ComplexHead(), _data(16)
    model.z.requires_grad_(False)
    probe = initlab.measure_moments(model, [(x, y)], nn.CrossEntropyLoss())
    row = next(r for r in probe.param_table() if r["param"] == "z")
    expected = float(model.z.detach().to(torch.complex128).abs().square().mean())
    assert row["E_W2"] == pytest.approx(expected, rel=1e-6)
    report = initlab.init_model(model, "fan_in", generator=0, policy="skip")
    z = next(r for r in report if r["param"] == "z")
    assert z["achieved_std"] == pytest.approx(float(model.z.detach().std()), rel=1e-6)


def test_data_on_the_meta_device_is_named() -> None:
    """input_scale raised torch's "Tensor.item() cannot be called on meta tensors" (from the
    batch check every entry point runs)."""
    meta = torch.empty(8, 4, device="meta")
    with pytest.raises(ValueError, match=r"^input_scale: the batch holds a tensor on the meta "):
        initlab.input_scale(meta)
    with pytest.raises(ValueError, match=r"^gr_scaling: batch 0 holds a tensor on the meta "):
        initlab.gr_scaling(_mlp(), [(meta, torch.zeros(8, dtype=torch.long))])


# ------------------------------------------------------------ a model that returns its loss


class _LossOut(nn.Module):
    """forward(x, y) -> the cross-entropy of its logits: a model that returns its own loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(x), y)


def test_a_model_that_returns_its_scalar_loss_is_measured_on_it() -> None:
    """Dict batches with the default loss gave a raw IndexError (the scalar read as logits);
    scale_output_ set the spread of the per-batch losses to 0.05 and hooked the loss itself."""
    x, y = _data(32)
    model = _LossOut()
    dicts = [{"x": x[:16], "y": y[:16]}, {"x": x[16:], "y": y[16:]}]
    got = [r["gamma_w"] for r in initlab.gr_scaling(model, dicts)]
    tuples = [(x[:16], y[:16]), (x[16:], y[16:])]  # the oracle: the logits, the criterion
    want = [r["gamma_w"] for r in initlab.gr_scaling(model.net, tuples, nn.CrossEntropyLoss())]
    assert got == pytest.approx(want, rel=1e-6)
    before = _state(model)
    with pytest.raises(ValueError, match=r"^scale_output_: the model's output is a scalar"):
        initlab.scale_output_(model, dicts)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    rep = initlab.doctor(model, dicts)
    assert rep.value("logit_std", "verdict") == "n/a"
    assert "the model's output is a scalar (its loss)" in rep.row("logit_std")["why"]


def test_lsuv_steps_points_to_max_iter_and_a_probe_refuses_a_generator() -> None:
    x, y = _data(8)
    with pytest.raises(TypeError, match=r"did you mean max_iter=\?"):
        initlab.lsuv_(_mlp(), x, steps=5)
    probe = initlab.measure_moments(_mlp(), [(x, y)], nn.CrossEntropyLoss())
    with pytest.raises(TypeError, match=r"^gr_scaling\(probe, \.\.\.\): generator= seeds"):
        initlab.gr_scaling(probe, generator=0)


def test_the_way_to_read_an_output_field_fits_the_outputs_kind() -> None:
    """A dict output holding no tensor was told to read `.<field>` (attribute syntax)."""
    from initlab._core.data import output_tensor

    with pytest.raises(TypeError, match=r'model\(batch\[0\]\)\["<key>"\]$'):
        output_tensor({"scores": [1.0, 2.0]})
    with pytest.raises(TypeError, match=r"model\(batch\[0\]\)\[<index>\]$"):
        output_tensor(([1.0], "x"))


def test_a_dataset_of_whole_batches_is_pointed_to_batch_size_none() -> None:
    with pytest.raises(TypeError, match=r"\(batch_size=None where its items are whole batches"):
        initlab.measure_moments(_mlp(), TensorDataset(*_data(8)))


def test_the_causal_lm_warning_names_a_keyword_and_a_shifted_loss_that_work() -> None:
    """The warning said "Pass loss=None", a keyword no entry point takes (theirs is loss_fn=).
    Oracle: the model's own (shifting) loss. The keyword it names is each entry point's, and the
    loss_fn it writes out, evaluated, gives the model's own loss on the batch's form."""
    pytest.importorskip("transformers")
    model = hf_models.model_of("gpt2").eval()
    batch = hf_models.batches("gpt2", 1)[0]
    with torch.no_grad():
        own = float(model(**batch).loss)
    takes_loss = [initlab.gradient_stats, initlab.gr_scaling, initlab.measure_moments,
                  initlab.diagnose, initlab.doctor, initlab.gradinit_, initlab.metainit_,
                  initlab.precondition_, initlab.block_curvature, initlab.loss_landscape,
                  initlab.theory_vs_actual]  # fmt: skip
    for data in (batch, (batch["input_ids"], batch["labels"])):
        with pytest.warns(UserWarning, match="causal language model") as seen:
            resolve_loss(nn.CrossEntropyLoss())(model, data)
        text = str(seen[0].message)
        assert re.search(r"\bloss=", text) is None, text
        assert "loss_fn=None" in text
        for fn in takes_loss:
            assert "loss_fn" in inspect.signature(fn).parameters, fn.__name__
        shift = eval(text.split("that shifts: ", 1)[1], {"F": F})  # the loss_fn it writes out
        with torch.no_grad():
            assert float(shift(model, data)) == pytest.approx(own, rel=1e-6)
    with torch.no_grad():  # the way to the own loss it names for a tuple batch: a dict batch
        ids = batch["input_ids"]
        assert float(resolve_loss(None)(model, {"input_ids": ids, "labels": ids})) == (
            pytest.approx(float(model(input_ids=ids, labels=ids).loss), rel=1e-6)
        )
