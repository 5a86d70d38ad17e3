"""The private core's contract: the data rule, the loss resolver, leaving the model as it was, and
renamed keywords. Oracles are written by hand (explicit forward passes and torch losses)."""

from __future__ import annotations

import contextvars
import copy
import dataclasses
import functools
import inspect
import itertools
import warnings
import weakref
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

import initlab
from initlab._core import state as state_module
from initlab._core.data import (
    AmbiguousDataError,
    Batches,
    batch_size,
    data_use,
    default_forward,
    is_single_batch,
    iter_batches,
    output_tensor,
    take_batches,
)
from initlab._core.hooks import HookContext, hook_handles
from initlab._core.knobs import renamed_kwargs
from initlab._core.loss import LOSS_FORMS, TargetError, criterion, outputs_loss, resolve_loss
from initlab._core.norms import composite_norms, float16_norms, may_float16, may_weight_norm
from initlab._core.state import model_kept, restore_on_failure

from .conformance_models import CPU_DATA_PARALLEL


def _xy(n: int = 6, d: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, 2, (n,), generator=g)


# ------------------------------------------------------------------------------------- data


def test_one_batch_forms() -> None:
    x, y = _xy()
    for one in (x, (x, y), [x, y], {"input": x, "labels": y}, (x,)):
        assert is_single_batch(one)
        assert take_batches(one) == [one] or take_batches(one)[0] is one


def test_many_batch_forms() -> None:
    x, y = _xy(8)
    pairs = [(x[:4], y[:4]), (x[4:], y[4:])]
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    gen = ((a, b) for a, b in pairs)
    for many in (pairs, tuple(pairs), loader, gen, Batches([x[:4], x[4:]])):
        got = take_batches(many)
        assert len(got) == 2
        assert data_use(got).as_dict() == {"batches": 2, "examples": 8}


def test_a_list_of_same_shaped_tensors_names_both_readings() -> None:
    t = [torch.randn(16, 3) for _ in range(3)]
    with pytest.raises(AmbiguousDataError, match=r"initlab\.Batches\(\[\.\.\.\]\).*tuple"):
        take_batches(t)
    assert len(take_batches(Batches(t))) == 3
    assert len(take_batches(tuple(t))) == 1
    assert take_batches([t[0]])[0] is t[0]  # [x]: a list of one batch
    ragged = [torch.randn(16, 3), torch.randn(8, 3)]  # first dimensions differ
    with pytest.raises(AmbiguousDataError):
        take_batches(ragged)


def test_max_batches_and_counts() -> None:
    x, y = _xy(12)
    loader = DataLoader(TensorDataset(x, y), batch_size=5)
    assert [batch_size(b) for b in take_batches(loader)] == [5, 5, 2]
    assert len(take_batches(loader, 2)) == 2
    with pytest.raises(ValueError, match="max_batches must be a positive int"):
        take_batches(loader, 0)
    with pytest.raises(TypeError, match="needs data"):
        take_batches(None)
    with pytest.raises(TypeError, match="must hold a tensor"):
        batch_size(("a", "b"))


def _endless(rows: int = 4) -> Any:
    g = torch.Generator().manual_seed(0)
    while True:
        yield torch.randn(rows, 3, generator=g), torch.randint(0, 2, (rows,), generator=g)


_ALL_BATCHES: dict[str, Any] = {
    "measure_moments": lambda d, **k: initlab.measure_moments(nn.Linear(3, 2), d, **k),
    "gr_scaling": lambda d, **k: initlab.gr_scaling(nn.Linear(3, 2), d, **k),
    "gradient_stats": lambda d, **k: initlab.gradient_stats(nn.Linear(3, 2), d, **k),
    "scale_output_": lambda d, **k: initlab.scale_output_(nn.Linear(3, 2), d, **k),
    "precondition_": lambda d, **k: initlab.precondition_(nn.Linear(3, 2), d, max_iter=1, **k),
    "loss_landscape": lambda d, **k: initlab.loss_landscape(nn.Linear(3, 2), d, grid=2, **k),
}


@pytest.mark.parametrize("entry", list(_ALL_BATCHES))
def test_data_without_a_length_is_read_up_to_a_cap_not_forever(entry: str, monkeypatch) -> None:
    """An endless generator with max_batches=None (all) was read, and held, forever."""
    import initlab._core.data as core_data

    monkeypatch.setattr(core_data, "UNSIZED_MAX_BATCHES", 5)
    call = _ALL_BATCHES[entry]
    with pytest.raises(ValueError, match=rf"^{entry}: the data has no length and gave more than 5 "
                       r"batches.* Pass max_batches="):  # fmt: skip
        call(_endless())
    assert call(_endless(), max_batches=7).used.batches == 7  # asked for: not capped
    finite = itertools.islice(_endless(), 5)  # no length, within the cap: read whole
    assert call(finite).used.batches == 5


_STEPPED: dict[str, Any] = {
    "gradinit_": initlab.gradinit_,
    "metainit_": initlab.metainit_,
}


@pytest.mark.parametrize("entry", list(_STEPPED))
def test_an_endless_stream_names_the_keyword_of_the_entry_point(entry: str, monkeypatch) -> None:
    """gradinit_/metainit_ on an endless generator said "Pass max_batches=", a keyword both
    reject (their bound is steps=): the message names steps=, and steps= then works."""
    import initlab._core.data as core_data

    monkeypatch.setattr(core_data, "UNSIZED_MAX_BATCHES", 5)
    fn = _STEPPED[entry]
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"Pass steps= ") as err:
        fn(copy.deepcopy(net), _endless(), nn.CrossEntropyLoss())
    assert "max_batches" not in str(err.value)
    with pytest.raises(TypeError, match="max_batches"):  # the keyword it would have named
        fn(copy.deepcopy(net), _endless(), nn.CrossEntropyLoss(), max_batches=3)
    fn(copy.deepcopy(net), _endless(), nn.CrossEntropyLoss(), steps=3)  # the advice works


def test_default_forward_and_output_tensor() -> None:
    class Kw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
            return {"logits": self.lin(input_ids), "loss": None}

    x, y = _xy()
    lin = nn.Linear(3, 2)
    assert torch.equal(default_forward(lin, x), lin(x))
    assert torch.equal(default_forward(lin, [x, y]), lin(x))
    kw = Kw()
    out = default_forward(kw, {"input_ids": x, "labels": y})
    assert torch.equal(output_tensor(out), kw.lin(x))
    with pytest.raises(TypeError, match="holding no tensor"):
        output_tensor({"a": 1})


@dataclasses.dataclass
class _Scores:
    scores: torch.Tensor


class _ScoresModel(nn.Module):
    """Returns a dataclass whose tensor field is not ``.logits``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> _Scores:
        return _Scores(self.lin(x))


_NO_TENSOR_CALLS: dict[str, Any] = {
    "gr_scaling": initlab.gr_scaling,
    "diagnose": initlab.diagnose,
    "gradinit_": functools.partial(initlab.gradinit_, steps=1),
    "metainit_": functools.partial(initlab.metainit_, steps=1),
    "block_curvature": functools.partial(initlab.block_curvature, probes=1),
    "scale_output_": initlab.scale_output_,
    "precondition_": initlab.precondition_,
}


@pytest.mark.parametrize("entry", sorted(_NO_TENSOR_CALLS))
def test_an_output_with_no_tensor_names_the_argument_its_entry_point_takes(entry: str) -> None:
    """The advice "(or pass forward=)" was said to gr_scaling and diagnose (no forward=): the
    message names the argument the entry point called has, and that argument, as written in
    the message, runs."""
    call = _NO_TENSOR_CALLS[entry]
    data = [_xy(), _xy()]  # gradinit_ reads two
    with pytest.raises(TypeError, match="holding no tensor") as info:
        call(_ScoresModel(), data)
    message = str(info.value)
    way_out = "forward" if "forward=lambda" in message else "loss_fn"
    assert way_out in inspect.signature(getattr(initlab, entry)).parameters
    assert ("forward=" in message) == (way_out == "forward") and ".scores" in message
    if way_out == "forward":
        call(_ScoresModel(), data, forward=lambda model, batch: model(batch[0]).scores)
    else:
        loss = lambda model, batch: F.cross_entropy(model(batch[0]).scores, batch[1])  # noqa: E731
        call(_ScoresModel(), data, loss_fn=loss)


# ------------------------------------------------------------------------------------- loss


class _KwModel(nn.Module):
    """Keyword inputs, its own loss when labels come with the batch (like a HF model)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        logits = self.lin(input_ids)
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return type("Out", (), {"logits": logits, "loss": loss})()


@pytest.mark.parametrize(
    "form",
    [
        lambda m, b: F.cross_entropy(m(b[0]), b[1]),
        nn.CrossEntropyLoss(),
        F.cross_entropy,
        functools.partial(F.cross_entropy, reduction="mean"),
        "cross_entropy",
        "auto",
        None,
        criterion(lambda a, b: F.cross_entropy(a, b)),
    ],
    ids=["model_batch", "module", "functional", "partial", "named", "auto", "none", "wrapped"],
)
def test_every_loss_form_gives_the_same_value(form) -> None:
    x, y = _xy()
    lin = nn.Linear(3, 2)
    expected = F.cross_entropy(lin(x), y)
    assert torch.allclose(resolve_loss(form)(lin, (x, y)), expected)


def test_model_returned_loss_and_dict_criterion() -> None:
    x, y = _xy()
    model = _KwModel()
    expected = F.cross_entropy(model.lin(x), y)
    batch = {"input_ids": x, "labels": y}
    for form in (None, "model", nn.CrossEntropyLoss(), F.cross_entropy):
        assert torch.allclose(resolve_loss(form)(model, batch), expected), form
    with pytest.raises(TypeError, match="returned no loss"):
        resolve_loss("model")(model, {"input_ids": x})


def test_split_losses_and_bad_forms() -> None:
    x, y = _xy()
    lin = nn.Linear(3, 2)
    crit = resolve_loss(nn.CrossEntropyLoss())
    assert crit.splittable and crit.form == "criterion"
    out = crit.forward(lin, (x, y))
    assert torch.allclose(crit.on_outputs(out, (x, y)), F.cross_entropy(lin(x), y))
    assert not resolve_loss(lambda m, b: m(b[0]).sum()).splittable
    q = outputs_loss(lambda o, b: (o**2).mean())
    assert torch.allclose(q(lin, x), (lin(x) ** 2).mean())
    with pytest.raises(TypeError, match=r"accepted forms: loss_fn\(model, batch\)"):
        resolve_loss(3)
    with pytest.raises(ValueError, match="unknown loss 'hinge'"):
        resolve_loss("hinge")
    with pytest.raises(ValueError, match="not a scalar"):
        resolve_loss(nn.CrossEntropyLoss(reduction="none"))(lin, (x, y))
    with pytest.raises(ValueError, match="needs \\(x, y\\) batches"):
        resolve_loss(F.cross_entropy)(lin, x)
    assert "criterion" in LOSS_FORMS


# ------------------------------------------------------------------------------------- state


def _initlab_s(fn: Any) -> Any:
    """``fn`` as if initlab's code had made it (what marks a hook as initlab's: its module)."""
    fn.__module__ = "initlab.measure.probe.moment_probe"
    return fn


def test_model_kept_restores_everything() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4))
    model[2].weight = model[0].weight
    model.eval()
    model[2].bias.requires_grad_(False)
    grad = torch.ones(4, 4)
    model[0].weight.grad = grad
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    with model_kept(model, rng=True):
        model.train()
        for p in model.parameters():
            p.requires_grad_(True)
        model[0].register_forward_hook(_initlab_s(lambda *a: None))
        model[0].weight.register_hook(_initlab_s(lambda g: g))
        model(torch.randn(8, 4)).sum().backward()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not any(m.training for m in model.modules())
    assert model[0].weight.grad is grad and not model[2].bias.requires_grad
    assert not model[0]._forward_hooks and not model[0].weight._backward_hooks
    assert model[2].weight is model[0].weight
    assert torch.equal(torch.get_rng_state(), rng)


def test_restore_on_failure_keeps_weights_on_success_but_not_hooks() -> None:
    model = nn.Linear(2, 2)
    with restore_on_failure(model), torch.no_grad():
        model.weight.zero_()
        model.register_forward_pre_hook(_initlab_s(lambda *a: None))
    assert torch.count_nonzero(model.weight) == 0
    assert not model._forward_pre_hooks


class _HooksOnFirstCall(nn.Module):
    """Installs a forward hook on its first call and marks itself hooked, as Hugging Face's
    output capturing does (``maybe_install_capturing_hooks``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(3, 4), nn.Linear(4, 2)
        self.installed, self.seen = False, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.installed:
            self.body.register_forward_hook(lambda m, a, out: self.seen.append(out.shape))
            self.installed = True
        self.seen.clear()
        out = self.head(torch.relu(self.body(x)))
        if not self.seen:
            raise IndexError("tuple index out of range")  # what Mixtral's router-loss code raises
        return out


@pytest.mark.parametrize("entry", ["measure_moments", "lsuv_", "gr_scaling", "diagnose"])
def test_hooks_the_model_installs_on_its_first_call_stay(entry: str) -> None:
    model, (x, y) = _HooksOnFirstCall(), _xy(d=3)
    loss = () if entry == "lsuv_" else (nn.CrossEntropyLoss(),)
    getattr(initlab, entry)(model, (x, y), *loss)
    assert len(model.body._forward_hooks) == 1  # initlab's hooks gone, the model's own kept
    model(x)  # raised IndexError when initlab removed the model's hook


class _Clones(TorchDispatchMode):
    """Counts the copies made of tensors of one shape, and the most alive at once (an oracle
    outside the code under test)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape, self.count, self.alive, self.peak = torch.Size(shape), 0, 0, 0

    def _freed(self) -> None:
        self.alive -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.clone.default and out.shape == self.shape:
            self.count += 1
            self.alive += 1
            self.peak = max(self.peak, self.alive)
            weakref.finalize(out, self._freed)
        return out


def test_nested_blocks_share_the_copy_of_an_unchanged_tensor_and_copy_a_changed_one() -> None:
    model = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3))
    w0, w1 = model[0].weight.detach().clone(), model[1].weight.detach().clone()
    with _Clones((5, 7)) as first, _Clones((3, 5)) as second, model_kept(model):
        with torch.no_grad():
            model[1].weight.add_(1.0)
        changed = model[1].weight.detach().clone()  # the test's own copy: counted, 1
        with pytest.raises(RuntimeError), restore_on_failure(model):
            with torch.no_grad():
                model[0].weight.mul_(2.0)
                model[1].weight.mul_(3.0)
            raise RuntimeError("a failing method")
        # the inner block put back what it started from: the outer block's change stays
        assert torch.equal(model[0].weight, w0) and torch.equal(model[1].weight, changed)
    assert torch.equal(model[0].weight, w0) and torch.equal(model[1].weight, w1)
    assert first.count == 1  # unchanged: the inner block took the outer block's copy
    assert second.count == 3  # changed: the outer copy, the test's copy and the inner block's


def test_a_copy_is_shared_only_while_the_bits_are_the_same() -> None:
    model = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[-0.0, 1.0], [3.0, 2.0]]))
    with model_kept(model):
        with torch.no_grad():
            model.weight[0, 0] = 0.0  # equal to -0.0 under ==, another bit pattern
        with pytest.raises(RuntimeError), restore_on_failure(model):
            with torch.no_grad():
                model.weight.fill_(5.0)
            raise RuntimeError("a failing method")
        assert not torch.signbit(model.weight[0, 0])  # the inner block's start: +0.0
    # the outer block restores the sign of zero (== alone would call -0.0 and 0.0 the same)
    assert torch.signbit(model.weight[0, 0])
    assert model.weight[0, 1] == 1.0 and model.weight[1, 0] == 3.0 and model.weight[1, 1] == 2.0


def test_doctor_without_fixes_copies_each_weight_once() -> None:
    model = nn.Sequential(
        nn.Linear(6, 31), nn.ReLU(), nn.Linear(31, 29), nn.ReLU(), nn.Linear(29, 3)
    )
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    with _Clones((29, 31)) as clones:
        initlab.doctor(model, (x, y), generator=0)
    # doctor's measurements nest (diagnose inside, its passes inside that): one copy at a time
    assert clones.count >= 1 and clones.peak == 1


def test_doctor_with_a_fix_holds_the_weights_before_it_and_one_measurement_s_copy() -> None:
    model = nn.Sequential(
        nn.Linear(6, 31), nn.ReLU(), nn.Linear(31, 29), nn.ReLU(), nn.Linear(29, 3)
    )
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    with _Clones((29, 31)) as clones:
        report = initlab.doctor(model, (x, y), fix=["lsuv"], generator=0)
    assert report.applied == ["lsuv"]
    # the model before doctor (also the one before LSUV, and LSUV's own way back); after LSUV, a
    # check's what-if (the logits' std after init_model, measured and put back) and its pass
    assert clones.peak == 3


def test_hook_contexts_remove_on_error() -> None:
    lin = nn.Linear(2, 2)
    with pytest.raises(RuntimeError), hook_handles() as handles:
        handles.add(lin.register_forward_hook(lambda *a: None))
        raise RuntimeError
    assert not lin._forward_hooks

    class Watch(HookContext):
        def register(self) -> None:
            self._hooks.add(lin.register_forward_hook(lambda *a: None))
            raise ValueError("second registration failed")

    with pytest.raises(ValueError), Watch():
        pass
    assert not lin._forward_hooks


# ------------------------------------------------------------------------------------- knobs


def test_renamed_kwargs_warn_and_forward() -> None:
    @renamed_kwargs(iterations="steps")
    def f(*, steps: int = 1) -> int:
        return steps

    with pytest.warns(DeprecationWarning, match="use steps="):
        assert f(iterations=4) == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert f(steps=2) == 2
    with pytest.raises(TypeError, match="both iterations="):
        f(iterations=1, steps=2)


def test_a_renamed_keyword_given_beside_its_new_name_positionally_says_so() -> None:
    """measure_moments(model, data, loss, batches=2) (batches= the old name of data=, as lsuv_'s
    batches= is of max_batches=) failed with "got multiple values for argument 'data'"."""

    @renamed_kwargs(batches="data")
    def f(model: int, data: int, *, max_batches: int | None = None) -> int:
        return data

    said = (
        r"^f\(\) got both batches= \(deprecated\) and data \(positionally\); pass data once "
        r"\(a number of batches is max_batches=\)"
    )
    with pytest.raises(TypeError, match=said):
        f(1, 2, batches=2)


def test_a_criterion_read_as_model_batch_gets_a_message_not_a_raw_error() -> None:
    def my_criterion(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(a, b)

    x, y = _xy()
    lin = nn.Linear(3, 2)
    with pytest.raises(TypeError, match=r"initlab\.criterion\(my_criterion\)"):
        resolve_loss(my_criterion)(lin, (x, y))
    wrapped = resolve_loss(criterion(my_criterion))
    assert torch.allclose(wrapped(lin, (x, y)), F.cross_entropy(lin(x), y))


def test_the_old_outputs_batch_form_still_works_with_a_warning() -> None:
    x, y = _xy()
    lin = nn.Linear(3, 2)
    with pytest.warns(DeprecationWarning, match=r"initlab\.outputs_loss"):
        loss = resolve_loss(lambda outputs, batch: F.cross_entropy(outputs, batch[1]))
    assert loss.splittable and torch.allclose(loss(lin, (x, y)), F.cross_entropy(lin(x), y))


def test_iter_batches_streams() -> None:
    x, y = _xy(12)
    seen = []

    def gen():
        for i in range(0, 12, 4):
            seen.append(i)
            yield x[i : i + 4], y[i : i + 4]

    it = iter_batches(gen(), 2, what="test")
    next(it)
    assert seen == [0]
    assert len(list(it)) == 1 and seen == [0, 4]
    assert list(iter_batches((x, y), what="test")) == [(x, y)]


def test_a_dict_batch_to_a_model_without_those_keywords_gets_a_clear_error() -> None:
    x, y = _xy()
    with pytest.raises(TypeError, match=r"keyword arguments, model\(\*\*batch\).*\(x, y\) batches"):
        default_forward(nn.Sequential(nn.Linear(3, 2)), {"x": x, "labels": y})


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 2), nn.Linear(4, 2)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.a(a) + self.b(b)


_TUPLE_ADVICE = (
    r"the default forward: a tuple batch is passed to the model as model\(batch\[0\]\) \(the "
    r"rest of the tuple is read as targets\), and the model's forward takes more inputs "
    r"\(_TwoInputs\.forward\(\) missing 1 required positional argument: 'b'\)\. Pass dict "
    r"batches of its keyword arguments, a loss_fn\(model, batch\) that calls the model itself "
    r"and names the target .*, or, where the function takes one, a forward= that leaves the "
    r"target at batch\[1\], where a loss reads it: forward=lambda model, batch: "
    r"model\(batch\[0\], \*batch\[2:\]\) for \(x, y, z, \.\.\.\) batches"
)


@pytest.mark.parametrize(
    "call",
    [
        lambda m, b: default_forward(m, b),
        lambda m, b: initlab.lsuv_(m, b),
        lambda m, b: initlab.scale_output_(m, b),
        lambda m, b: initlab.block_curvature(m, (*b, torch.zeros(8, 2)), nn.MSELoss(), probes=1),
    ],
    ids=["default_forward", "lsuv_", "scale_output_", "block_curvature"],
)
def test_a_tuple_batch_to_a_model_of_several_inputs_gets_a_clear_error(call: Any) -> None:
    """torch's raw "forward() missing 1 required positional argument" before."""
    batch = (torch.randn(8, 3), torch.randn(8, 4))
    with pytest.raises(TypeError, match=_TUPLE_ADVICE):
        call(_TwoInputs(), batch)


class _KwOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.fc(x)


def test_a_dict_batch_without_labels_is_named_with_its_keys() -> None:
    """One batch of a labelled data set lacks its 'labels': the message said only "got a dict
    batch", not which keys it has or that the labels are missing."""
    x, y = _xy()
    loss = resolve_loss(None)
    assert torch.isfinite(loss(_KwOnly(), {"x": x, "labels": y}))
    with pytest.raises(TargetError, match=r"got a dict batch without 'labels' \(keys \['x'\]\)\. "
                       r"Give every batch its targets"):  # fmt: skip
        loss(_KwOnly(), {"x": x})


@dataclasses.dataclass
class _Out:
    """An output with a ``loss`` field (as Hugging Face's ``ModelOutput``)."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


class _IgnoresLabels(nn.Module):
    """A model with a loss of its own that it computes only when asked (``return_loss``, as
    CLIP's); labels reach it only through ``**kwargs`` (``switch=False``: no such keyword)."""

    def __init__(self, switch: bool) -> None:
        super().__init__()
        self.fc, self.switch = nn.Linear(3, 2), switch

    def forward(self, x: torch.Tensor, **kwargs: Any) -> _Out:
        logits = self.fc(x)
        own = self.switch and kwargs.get("return_loss", False)
        return _Out(logits, logits.square().mean() if own else None)


class _Switched(_IgnoresLabels):
    def forward(  # type: ignore[override]
        self, x: torch.Tensor, return_loss: bool = False, labels: Any = None
    ) -> _Out:
        return super().forward(x, return_loss=return_loss)


class _TakesLabel(_IgnoresLabels):
    """Names ``label`` in its forward and ignores it (loss ``None``)."""

    def forward(self, x: torch.Tensor, label: Any = None) -> _Out:  # type: ignore[override]
        return super().forward(x)


@pytest.mark.parametrize("switch", [True, False])
def test_a_model_that_ignores_its_labels_gets_no_silent_cross_entropy(switch: bool) -> None:
    """CLIP takes 'labels' and ignores them (its loss needs return_loss=True): loss_fn=None
    fell back to cross-entropy on its first output, silently another loss, and the message
    without labels said to add 'labels'. An output without a loss field keeps the fallback."""
    x, y = _xy()
    model = _Switched(switch) if switch else _TakesLabel(False)
    loss = resolve_loss(None)
    advice = r"return_loss=True in every batch" if switch else r"\('label'\) .* has loss None"
    with pytest.raises(TargetError, match=advice):
        loss(model, {"x": x, "labels" if switch else "label": y})
    if switch:
        with pytest.raises(TargetError, match=advice):
            loss(model, {"x": x})
        with pytest.raises(TypeError, match=advice):
            resolve_loss("model")(model, {"x": x})
        with torch.no_grad():
            own = loss(model, {"x": x, "return_loss": True})
            expected = model.fc(x).double().square().mean()
        assert float(own) == pytest.approx(float(expected), rel=1e-6)
    plain = _KwOnly()  # a tensor output, no loss field: cross-entropy on it, as documented
    with torch.no_grad():
        got = loss(plain, {"x": x, "labels": y})
        expected = F.cross_entropy(plain.fc(x).double(), y)
    assert float(got) == pytest.approx(float(expected), rel=1e-6)


class _Wrapper(nn.Module):
    """A thin wrapper, as accelerate's or DDP's: ``forward(*args, **kwargs)`` to ``module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


@pytest.mark.parametrize(
    "wrap", ["Wrapper", pytest.param("DataParallel", marks=CPU_DATA_PARALLEL), "twice"]
)
def test_a_wrapped_model_that_ignores_its_labels_gets_no_silent_cross_entropy(wrap: str) -> None:
    """Behind a ``forward(*args, **kwargs)`` wrapper the model's named 'labels' and its
    ``return_loss`` went unseen: loss_fn=None fell back to cross-entropy on the logits."""
    x, y = _xy()
    inner = _Switched(True)
    model = {
        "Wrapper": lambda: _Wrapper(inner),
        "DataParallel": lambda: nn.DataParallel(inner),
        "twice": lambda: _Wrapper(_Wrapper(inner)),
    }[wrap]()
    with pytest.raises(TargetError, match=r"return_loss=True in every batch"):
        resolve_loss(None)(model, {"x": x, "labels": y})
    with torch.no_grad():
        own = resolve_loss(None)(model, {"x": x, "return_loss": True})
        expected = inner.fc(x).double().square().mean()
    assert float(own) == pytest.approx(float(expected), rel=1e-6)


class _Opaque(nn.Module):
    """A wrapper that keeps its model under another name: what it forwards to is not known."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.inner = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)


def test_a_wrapper_whose_model_is_not_known_keeps_the_fallback() -> None:
    x, y = _xy()
    model = _Opaque(_Switched(True))
    with torch.no_grad():
        got = resolve_loss(None)(model, {"x": x, "labels": y})
        expected = F.cross_entropy(model.inner.fc(x).double(), y)
    assert float(got) == pytest.approx(float(expected), rel=1e-6)


class _LossOnByDefault(_IgnoresLabels):
    """PatchTSMixer's heads: ``return_loss`` defaults to True, the loss needs ``target_values``."""

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, target_values: Any = None, return_loss: bool = True
    ) -> _Out:
        logits = self.fc(x)
        own = return_loss and target_values is not None
        return _Out(logits, F.cross_entropy(logits, target_values) if own else None)


def test_a_loss_switch_on_by_default_is_not_advised() -> None:
    """A ``return_loss`` defaulting to True was advised ("pass return_loss=True"), which changes
    nothing: the model needs other entries for its loss. Set false, it is advised."""
    x, y = _xy()
    model = _LossOnByDefault(False)
    needs = r"give the batch what its forward needs for (it|its loss)"
    for loss, error in ((resolve_loss(None), TargetError), (resolve_loss("model"), TypeError)):
        with pytest.raises(error, match=needs) as caught:
            loss(model, {"x": x})
        assert "return_loss=True" not in str(caught.value)
        with pytest.raises(error, match=r"pass return_loss=True in every batch"):
            loss(model, {"x": x, "return_loss": False})
        with torch.no_grad():
            own = loss(model, {"x": x, "target_values": y})
            expected = F.cross_entropy(model.fc(x).double(), y)
        assert float(own) == pytest.approx(float(expected), rel=1e-6)


@pytest.mark.parametrize("key", ["label", "labels", "target", "targets", "y"])
def test_labels_a_forward_does_not_name_keep_the_fallback(key: str) -> None:
    """A loss field left None by a forward that takes the labels only through ``**kwargs``
    (``label`` into a Hugging Face classifier, which reads ``labels``) is no sign the model
    ignored them: loss_fn=None keeps the documented cross-entropy on the logits."""
    x, y = _xy()
    model = _IgnoresLabels(False)
    with torch.no_grad():
        got = resolve_loss(None)(model, {"x": x, key: y})
        expected = F.cross_entropy(model.fc(x).double(), y)
    assert float(got) == pytest.approx(float(expected), rel=1e-6)


def test_a_title_says_one_batch_and_one_example_in_the_singular() -> None:
    """ "(1 batches, 1 examples)"."""
    from initlab._core.data import DataUse
    from initlab._core.rows import Rows

    assert str(Rows([{"a": 1}], ["a"], title="t", used=DataUse(1, 1))).startswith(
        "t (1 batch, 1 example)"
    )
    assert str(Rows([{"a": 1}], ["a"], title="t", used=DataUse(2, 64))).startswith(
        "t (2 batches, 64 examples)"
    )


def test_a_slice_of_rows_is_rows_and_an_index_a_row() -> None:
    """``rows[:2]`` raised "dictionary update sequence element #0 has length 18"."""
    from initlab._core.data import DataUse
    from initlab._core.rows import Rows

    rows = Rows([{"a": i, "b": -i} for i in range(4)], ["a", "b"], title="t", used=DataUse(1, 8))
    head = rows[:2]
    assert isinstance(head, Rows) and head.to_rows() == [{"a": 0, "b": 0}, {"a": 1, "b": -1}]
    assert (head.columns, head.title, head.used) == (["a", "b"], "t", DataUse(1, 8))
    assert [r["a"] for r in rows[::-2]] == [3, 1] and rows[-1] == {"a": 3, "b": -3}


def test_int32_class_targets_of_a_torch_criterion_say_long() -> None:
    """torch's "expected target dtype to be Long" came without the one thing to do."""
    x, y = _xy()
    model = nn.Linear(3, 2)
    for loss in (nn.CrossEntropyLoss(), F.cross_entropy):
        with pytest.raises(TargetError, match=r"pass y\.long\(\), not torch\.int32"):
            resolve_loss(loss)(model, (x, y.int()))


@pytest.mark.parametrize(
    "fn",
    [nn.MSELoss(), F.mse_loss, nn.L1Loss(), F.l1_loss, nn.SmoothL1Loss(), nn.HuberLoss(),
     functools.partial(F.huber_loss, delta=0.5), F.smooth_l1_loss],
    ids=["MSELoss", "mse_loss", "L1Loss", "l1_loss", "SmoothL1Loss", "HuberLoss", "partial",
         "smooth_l1_loss"],
)  # fmt: skip
def test_an_elementwise_criterion_pairs_b_1_outputs_with_b_targets(fn: Any) -> None:
    """(B, 1) outputs and (B,) targets broadcast to (B, B) in torch (a UserWarning only): the
    moments were 20x off those of "mse", which pairs them."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 3, generator=g), torch.randn(6, generator=g)
    model = nn.Linear(3, 1)
    with torch.no_grad():
        want = fn(model(x).squeeze(-1), y)  # the pairing, by hand
    assert torch.allclose(resolve_loss(fn)(model, (x, y)), want)
    with pytest.raises(TargetError, match=r"needs outputs and targets of one shape; got outputs "
                       r"\(6, 2\) and targets \(6,\)"):  # fmt: skip
        resolve_loss(fn)(nn.Linear(3, 2), (x, y))


def test_autocast_checks_skip_a_device_type_torch_does_not_know(monkeypatch) -> None:
    # torch 2.4's is_autocast_enabled("mps") raises: every entry point raised through it
    from initlab._core.autocast import autocast_off, autocast_uncached

    real = torch.is_autocast_enabled

    def older(device_type: str) -> bool:
        if device_type == "mps":
            raise RuntimeError("unknown device type for autocast")
        return real(device_type)

    monkeypatch.setattr(torch, "is_autocast_enabled", older)
    with autocast_off(), autocast_uncached():
        pass
    with torch.autocast("cpu", dtype=torch.bfloat16), autocast_off():
        assert not real("cpu")


def test_one_padding_rule_for_outputs_and_the_probe() -> None:
    """``real_positions`` (LSUV, scale_output_, doctor) reads the mask as the probe does: an
    integer mask with zeros picks the real tokens; an all-ones mask and a floating-point mask
    (an additive one is 0 where a token is kept) pick nothing out."""
    from initlab._core.data import real_positions

    t = torch.arange(12.0).reshape(2, 3, 2)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert torch.equal(real_positions(t, {"attention_mask": mask}), t[mask.bool()])
    assert real_positions(t, {"attention_mask": torch.ones(2, 3, dtype=torch.long)}) is t
    additive = torch.tensor([[0.0, 0.0, -1e9], [0.0, -1e9, -1e9]])
    assert real_positions(t, {"attention_mask": additive}) is t


def test_a_method_report_s_summary_line_has_no_python_reprs() -> None:
    """It printed ``skipped={}``, ``not_scaled=[]`` and ``alpha={'0': 1.3339143427578855, ...}``."""
    from initlab._core.method_report import MethodReport

    info = {"scale": 0.123456, "skipped": {}, "not_scaled": [], "layer": "", "how": "lr",
            "alpha": {"0": 1.3339143427578855, "2": 0.75, "4": 1.0, "6": 2.0, "8": 0.5},
            "handle": object()}  # fmt: skip
    report = MethodReport([], ("layer",), method="m", forward_passes=1, backward_passes=0,
                          wall_s=0.0, info=info)  # fmt: skip
    line = str(report).splitlines()[-1]
    assert line == (
        "m: 1 forward / 0 backward passes, 0.00 s, scale=0.1235, how=lr, "
        "alpha=(0: 1.334, 2: 0.75, 4: 1, 6: 2, and 1 more)"
    )


_NORMS = {
    "batch_norm_train": (lambda: nn.BatchNorm2d(3).train(), (6, 3, 4, 4)),
    "batch_norm_eval": (lambda: nn.BatchNorm1d(3).eval(), (6, 3)),
    "batch_norm_cumulative": (lambda: nn.BatchNorm1d(3, momentum=None).train(), (6, 3)),
    "layer_norm": (lambda: nn.LayerNorm([2, 3]), (4, 2, 3)),
    "instance_norm": (
        lambda: nn.InstanceNorm1d(3, affine=True, track_running_stats=True),
        (4, 3, 5),
    ),
}


@pytest.mark.parametrize("name", list(_NORMS))
def test_composite_norms_compute_the_native_values_and_statistics(name: str) -> None:
    make, shape = _NORMS[name]
    torch.manual_seed(0)
    native = make().double()
    with torch.no_grad():
        for p in native.parameters():
            p.uniform_(0.5, 1.5)
    composite = copy.deepcopy(native)
    x = torch.randn(*shape, dtype=torch.float64)
    for _ in range(2):  # the running statistics move the same way twice
        expected = native(x)
        with composite_norms():
            got = composite(x)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    for a, b in zip(native.buffers(), composite.buffers(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    "norm", ["batch_norm", "layer_norm", "instance_norm", "torch.batch_norm", "torch.layer_norm"]
)
def test_composite_norms_have_the_right_third_derivative(norm: str) -> None:
    """gradcheck (finite differences) of a Hessian-vector product through the norm: the native
    batch_norm, layer_norm and instance_norm fail it."""
    fn = {
        "batch_norm": lambda z: F.batch_norm(z, None, None, training=True),
        "layer_norm": lambda z: F.layer_norm(z, (5,)),
        "instance_norm": lambda z: F.instance_norm(z.reshape(2, 3, 5)).reshape(6, 5),
        "torch.batch_norm": lambda z: torch.batch_norm(
            z, None, None, None, None, True, 0.1, 1e-5, False
        ),
        "torch.layer_norm": lambda z: torch.layer_norm(z, (5,)),
    }[norm]
    torch.manual_seed(0)
    x = torch.randn(6, 4, dtype=torch.float64)
    v = torch.randn(4, 5, dtype=torch.float64)
    w = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)

    def hvp(w_: torch.Tensor) -> torch.Tensor:
        loss = torch.tanh(fn(x @ w_)).square().sum()
        (g,) = torch.autograd.grad(loss, w_, create_graph=True)
        (hv,) = torch.autograd.grad((g * v).sum(), w_, create_graph=True)
        return hv

    assert not torch.autograd.gradcheck(hvp, (w,), raise_exception=False)  # the native kernel
    with composite_norms():
        assert torch.autograd.gradcheck(hvp, (w,))


def test_composite_norms_keep_the_native_checks_and_an_empty_batch_s_statistics() -> None:
    with composite_norms(), pytest.raises(ValueError, match="more than 1 spatial element"):
        nn.InstanceNorm1d(3)(torch.randn(4, 3, 1))
    bn = nn.BatchNorm1d(3)
    with composite_norms():
        assert bn(torch.randn(0, 3)).shape == (0, 3)
    assert torch.equal(bn.running_mean, torch.zeros(3)) and torch.equal(
        bn.running_var, torch.ones(3)
    )


def test_blocks_that_end_out_of_order_or_in_another_context_hold_no_copies() -> None:
    """Two generators each holding a block, ended in the order they began (not nested); a block
    ended in another context: no raw ValueError from the context variable, no copy kept."""
    model = nn.Linear(3, 3)

    def holding() -> Any:
        with model_kept(model):
            yield

    first, second = holding(), holding()
    next(first)
    next(second)
    first.close()
    second.close()
    assert state_module._HELD.get() == ()
    block = model_kept(model)
    block.__enter__()
    contextvars.copy_context().run(block.__exit__, None, None, None)
    assert all(not held for held in state_module._HELD.get())  # emptied where it was offered
    state_module._HELD.set(())


def test_composite_layer_norm_keeps_the_native_shape_check() -> None:
    with composite_norms(), pytest.raises(RuntimeError, match=r"normalized_shape=\[5\]"):
        F.layer_norm(torch.randn(4, 6), (5,))


_FLOAT16_NORMS = {
    "layer_norm": lambda z, w: F.layer_norm(z, (8,), w),
    "group_norm": lambda z, w: F.group_norm(z, 2, w),
    "rms_norm": lambda z, w: F.rms_norm(z, (8,), w),
    "batch_norm": lambda z, w: F.batch_norm(z, None, None, w, training=True),
    "instance_norm": lambda z, w: (
        F.instance_norm(z.reshape(2, 3, 8).transpose(1, 2), weight=w).transpose(1, 2).reshape(6, 8)
    ),
}


def _norm_alpha_grad(
    name: str, dtype: torch.dtype, routed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``g = dL/dw`` at ``w = alpha W`` and ``d||g||_2 / d alpha`` at ``alpha = 1`` (GradInit's
    constraint step) for ``L = sum tanh(norm(x w))^2``, ``W ~ 0.02`` (GPT-2-like: rstd ~ 25)."""
    torch.manual_seed(0)
    x = torch.randn(6, 4).to(dtype)
    big = (torch.randn(4, 8) * 0.02).half().to(dtype)  # the same values in every dtype
    gain = (torch.rand(8) + 0.5).half().to(dtype)
    a = torch.ones((), dtype=torch.float64, requires_grad=True)
    w = a.to(dtype) * big
    with float16_norms() if routed else nullcontext():
        loss = torch.tanh(_FLOAT16_NORMS[name](x @ w, gain)).square().sum()
    (g,) = torch.autograd.grad(loss, w, create_graph=True)
    (h,) = torch.autograd.grad(g.double().square().sum().sqrt(), a)
    return g.detach(), h


@pytest.mark.parametrize("name", list(_FLOAT16_NORMS))
def test_float16_norms_give_float16_second_derivatives_and_leave_other_dtypes_alone(
    name: str,
) -> None:
    """The native double backwards work in float16 and overflow in front of a normalization of
    small activations (gradinit_'s constraint step was NaN on every float16 LayerNorm model).
    Under float16_norms a float16 input's statistics are float32: the gradient and the
    second derivative agree with float64 to 1% (float16 keeps 11 bits, 5e-4 per rounding; seen
    <= 2.5e-3). float32, float64 and bfloat16 inputs run the native kernels, bit for bit."""
    g64, h64 = _norm_alpha_grad(name, torch.float64, routed=False)
    g16, h16 = _norm_alpha_grad(name, torch.float16, routed=True)
    torch.testing.assert_close(g16.double(), g64, rtol=0, atol=1e-2 * float(g64.abs().max()))
    torch.testing.assert_close(h16, h64, rtol=1e-2, atol=0)
    if name != "rms_norm":  # torch's own rms_norm is a float32 composite: finite already
        assert not bool(torch.isfinite(_norm_alpha_grad(name, torch.float16, routed=False)[1]))
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        native, routed = _norm_alpha_grad(name, dtype, False), _norm_alpha_grad(name, dtype, True)
        assert torch.equal(native[0], routed[0]) and torch.equal(native[1], routed[1])


def test_float16_norms_keep_the_native_checks_and_values() -> None:
    x = torch.randn(3, 6, 5).half()
    with float16_norms():
        with pytest.raises(RuntimeError, match="divisible by num_groups"):
            F.group_norm(x, 4)
        with pytest.raises(RuntimeError, match=r"normalized_shape=\[4\]"):
            F.rms_norm(x, (4,))
        assert F.group_norm(x[:0], 3).shape == (0, 6, 5)
        routed = [F.layer_norm(x, (5,)), F.group_norm(x, 3), F.rms_norm(x, (6, 5))]
    native = [F.layer_norm(x, (5,)), F.group_norm(x, 3), F.rms_norm(x, (6, 5))]
    for got, expected in zip(routed, native, strict=True):  # rms_norm's eps: float32's, as torch
        torch.testing.assert_close(got, expected, rtol=2e-3, atol=2e-3)
    assert may_float16(nn.Linear(2, 2).half()) and not may_float16(nn.Linear(2, 2).bfloat16())


def test_may_weight_norm_finds_each_way_a_model_reaches_torch_weight_norm() -> None:
    plain = nn.Sequential(nn.Linear(2, 2))
    assert not may_weight_norm(plain)
    torch.nn.utils.parametrizations.weight_norm(plain[0])
    assert may_weight_norm(plain)
    hooked = nn.Linear(2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.nn.utils.weight_norm(hooked)
    assert may_weight_norm(hooked)

    class Direct(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.v, self.g = nn.Parameter(torch.randn(2, 2)), nn.Parameter(torch.ones(2, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ torch._weight_norm(self.v, self.g, 0).t()

    assert may_weight_norm(nn.Sequential(Direct()))


_MODEL_EXTRACTORS = {
    "gr_scaling": lambda m, d: initlab.gr_scaling(m, d, nn.CrossEntropyLoss()),
    "diagnose": lambda m, d: initlab.diagnose(m, d, nn.CrossEntropyLoss()),
    "measure_moments": lambda m, d: initlab.measure_moments(m, d, nn.CrossEntropyLoss()),
    "lsuv_": lambda m, d: initlab.lsuv_(m, d, max_batches=3),
}


@pytest.mark.parametrize("entry", list(_MODEL_EXTRACTORS))
@pytest.mark.parametrize("bad", [None, "oops", 3, 2.5, b"raw"], ids=repr)
@pytest.mark.parametrize("at", [0, 1])
@pytest.mark.parametrize("wrap", ["list", "Batches"])
def test_a_batch_that_is_none_a_string_or_a_number_is_named(
    entry: str, bad: object, at: int, wrap: str
) -> None:
    """[(x, y), None] was read as one batch (model((x, y)): "linear(): argument 'input' must be
    Tensor, not tuple", or AttributeError "'NoneType' object has no attribute 'dim'"), and
    Batches([(x, y), None]) handed None to the model. Such a batch is read (a forward= or
    loss_fn= may make tensors from it): the default forward names it."""
    good = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    items: list[Any] = [good, good]
    items.insert(at, bad)
    data = items if wrap == "list" else initlab.Batches(items)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    said = "None" if bad is None else type(bad).__name__
    with pytest.raises(TypeError) as err:
        _MODEL_EXTRACTORS[entry](model, data)
    if entry == "lsuv_":  # it concatenates the batches first
        assert str(err.value) == (
            f"lsuv_: batch {at} holds no tensor: it is {said}, where other batches hold tensors, "
            "so the batches cannot be concatenated: drop it (a batch is a tensor, a tuple (x, y), "
            "a dict of model inputs or a custom object)"
        )
        return
    assert str(err.value).startswith(
        f"the default forward: the batch holds no tensor: it is {said}, and the model failed on it"
    )
    assert str(err.value).endswith(
        "give batches of tensors, or a forward= or loss_fn= that makes the model's inputs "
        "from these"
    )


@pytest.mark.parametrize("entry", ["gr_scaling", "diagnose", "measure_moments"])
@pytest.mark.parametrize(
    ("bad", "said"),
    [
        (["a", "b"], "the batch holds no tensor: it is a list (str, str), and the model failed"),
        ((None, None), "the batch holds no tensor: it is a tuple (NoneType, NoneType), and the"),
        ((), "the batch is an empty tuple, no input: drop it"),
    ],
)
def test_a_container_batch_without_a_tensor_is_named_by_the_default_forward(
    entry: str, bad: object, said: str
) -> None:
    """A batch of strings or Nones reached example_count ("'str' object has no attribute
    'dim'") or the model ("linear(): ... not str"), an empty one forward_args (IndexError)."""
    good = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with pytest.raises(TypeError) as err:
        _MODEL_EXTRACTORS[entry](model, initlab.Batches([good, bad]))
    assert str(err.value).startswith(f"the default forward: {said}")


@pytest.mark.parametrize("entry", ["measure_moments", "diagnose", "gr_scaling"])
@pytest.mark.parametrize("wrap", ["Batches", "DataLoader"])
def test_string_batches_reach_a_loss_fn_that_makes_the_tensors(entry: str, wrap: str) -> None:
    """Batches(["hello", "world"]) and a DataLoader of strings were refused ("batch 0 holds no
    tensor: it is str ... drop it") though the loss_fn tokenizes each batch (they worked before)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(256, 8), nn.Linear(8, 8))
    seen: list[str] = []

    def loss_fn(m: nn.Module, batch: str) -> torch.Tensor:
        seen.append(batch)
        return m(torch.tensor([[ord(c) % 256 for c in batch]])).pow(2).mean()

    texts = ["hello", "world"]
    data: Any = (
        initlab.Batches(texts)
        if wrap == "Batches"
        else torch.utils.data.DataLoader(texts, batch_size=None)
    )
    call = {
        "measure_moments": lambda: initlab.measure_moments(model, data, loss_fn),
        "diagnose": lambda: initlab.diagnose(model, data, loss_fn),
        "gr_scaling": lambda: initlab.gr_scaling(model, data, loss_fn),
    }[entry]
    call()
    assert set(seen) == set(texts)
