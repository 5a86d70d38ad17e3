"""Torch's default device (``torch.set_default_device``, a ``with torch.device(...)`` block) does
not reach initlab's own tensors.

A user who ran ``torch.set_default_device("cuda")`` and hands initlab a model and data on the CPU
(or one built inside ``with torch.device("meta"):`` and materialized with ``to_empty``) got raw
torch errors from 12 of the 14 entry points: their scratch tensors (draws, sums, counts) were made
on the default device. On the CPU, a default device of ``"meta"`` stands in for CUDA and exposes
every such tensor: each entry point must give, under it, bit for bit what a plain call gives,
while the user's own forward still sees the user's default device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import initlab

from .ddp_util import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")

_CE = nn.CrossEntropyLoss()


class _Net(nn.Sequential):
    """A small CNN whose forward records the device a tensor made without ``device=`` gets
    there (the user's default device: initlab must not change it around the forward)."""

    def __init__(self) -> None:
        super().__init__(
            nn.Conv2d(3, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.Conv2d(4, 4, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(4, 3),
        )
        self.seen: set[str] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add(torch.empty(0).device.type)
        return super().forward(x)


def _net() -> _Net:
    torch.manual_seed(0)
    return _Net()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 3, 6, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen))
        for _ in range(2)
    ]


def _plain(value: Any) -> Any:
    """Rows and values as plain Python (NaN as a string, so that equal results compare equal);
    a tensor as its dtype, device and values."""
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.device.type, _plain(value.tolist()))
    if isinstance(value, initlab.Rows):
        return _plain(value.to_rows())
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _report(r: Any) -> Any:
    return _plain([r.to_rows(), getattr(r, "info", None), getattr(r, "notes", None)])


#: The 14 entry points: name -> (call on a model and CPU batches, its result as plain values).
_ENTRY: dict[str, tuple[Callable[[nn.Module, Any], Any], Callable[[Any], Any]]] = {
    "init_model": (lambda m, d: initlab.init_model(m, "geometric", generator=0), _report),
    "lsuv_": (
        lambda m, d: initlab.lsuv_(m, initlab.Batches([x for x, _ in d]), generator=0),
        _report,
    ),
    "gradinit_": (lambda m, d: initlab.gradinit_(m, d, _CE, steps=1, generator=0), _report),
    "metainit_": (lambda m, d: initlab.metainit_(m, d, _CE, steps=2, generator=0), _report),
    "scale_output_": (lambda m, d: initlab.scale_output_(m, d, target=0.05), _report),
    "precondition_": (lambda m, d: initlab.precondition_(m, d, _CE, generator=0), _report),
    "measure_moments": (
        lambda m, d: initlab.measure_moments(m, d, _CE),
        lambda r: _plain([r.rows(), r.param_table(), r.notes]),
    ),
    "gr_scaling": (lambda m, d: initlab.gr_scaling(m, d, _CE), _report),
    "diagnose": (
        lambda m, d: initlab.diagnose(m, d, _CE, generator=0),
        lambda r: _plain([r.rows, r.layers, r.findings, r.tables]),
    ),
    "doctor": (lambda m, d: initlab.doctor(m, d, _CE, generator=0), _report),
    "lint_model": (
        lambda m, d: initlab.lint_model(m),
        lambda r: _plain([r.findings, r.activations, r.residual_blocks]),
    ),
    "layer_spectra": (lambda m, d: initlab.layer_spectra(m, d, generator=0), _report),
    "block_curvature": (
        lambda m, d: initlab.block_curvature(m, d, _CE, probes=2, generator=0),
        lambda r: _plain([r.to_rows(), r.samples, r.notes]),
    ),
    "loss_landscape": (
        lambda m, d: initlab.loss_landscape(m, d, _CE, grid=3, generator=0),
        lambda r: _plain([r.to_rows(), r.notes]),
    ),
}


def _run(name: str, how: str | None) -> tuple[Any, dict[str, torch.Tensor], set[str]]:
    """The result, the model's state after the call and the devices its forward saw; ``how``:
    ``None`` (a plain call), ``"block"`` (``with torch.device("meta")``) or ``"set"``
    (``torch.set_default_device("meta")``)."""
    call, outcome = _ENTRY[name]
    model, data = _net(), _batches()  # made on the CPU, outside the block
    if how is None:
        result = call(model, data)
    elif how == "block":
        with torch.device("meta"):
            result = call(model, data)
    else:
        torch.set_default_device("meta")
        try:
            result = call(model, data)
        finally:
            torch.set_default_device(None)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return outcome(result), state, model.seen


@pytest.mark.parametrize("how", ["block", "set"])
@pytest.mark.parametrize("name", list(_ENTRY))
def test_entry_point_under_a_meta_default_device_gives_the_plain_result(
    name: str, how: str
) -> None:
    """Each entry point, on a CPU model and CPU data, gives under a default device of ``"meta"``
    the rows and the model state (bits) that a plain call gives; the user's forward still makes
    its own tensors on the user's default device (initlab does not override it around it)."""
    want, want_state, want_seen = _run(name, None)
    got, state, seen = _run(name, how)
    assert got == want
    assert state.keys() == want_state.keys()
    for k, v in want_state.items():
        assert state[k].device.type == "cpu" and state[k].dtype == v.dtype
        assert torch.equal(state[k], v), k
    assert want_seen <= {"cpu"}
    assert seen == {"meta" for _ in want_seen}  # the forward ran there, under the user's default


def test_scale_output_module_under_a_meta_default_device_is_on_the_output_device() -> None:
    """``scale_output_(how="module")`` made the ``OutputScale`` it returns on torch's default
    device (a meta buffer the model's CPU output could not be scaled by); it is on the output's
    device, with the plain call's value."""
    want = initlab.scale_output_(_net(), _batches(), target=0.05, how="module")
    model, data = _net(), _batches()
    with torch.device("meta"):
        got = initlab.scale_output_(model, data, target=0.05, how="module")
    scale = got.info["module"].scale
    assert scale.device.type == "cpu"
    assert torch.equal(scale, want.info["module"].scale)
    x = data[0][0]
    assert torch.equal(nn.Sequential(model, got.info["module"])(x), model(x) * scale)


#: The entry points whose rank bookkeeping (counts, flags, option codes compared across ranks)
#: was made on torch's default device under DDP.
_DDP = ["gradinit_", "metainit_", "lsuv_", "scale_output_", "precondition_", "gr_scaling"]


def _ddp_worker(rank: int, world_size: int) -> dict[str, list[Any]]:
    """On each rank: every :data:`_DDP` entry point, plain and under ``torch.device("meta")``:
    its result and the model's state after it, as plain values."""
    out: dict[str, list[Any]] = {}
    for name in _DDP:
        out[name] = []
        for how in (None, "block"):
            result, state, _ = _run(name, how)
            out[name].append([result, {k: _plain(v) for k, v in state.items()}])
    return out


def test_ddp_entry_points_under_a_meta_default_device_give_the_plain_result() -> None:
    """Under a process group, the rank checks' tensors (then moved to the backend's device) were
    made on torch's default device: "Cannot copy out of meta tensor" on every rank."""
    for ranks in run_ranks(_ddp_worker, 2):
        for name, (plain, under_meta) in ranks.items():
            assert under_meta == plain, name


# --- the study's trainer: train_one, train_runs (each engine), initialize_run ----------------


def _study(how: str | None) -> list[Any]:
    """Every trainer on a small study, its data made outside the block and its models built on
    the CPU by the user's factory: the step losses, epoch metrics and final states."""
    from initlab.study import RunConfig, build_model, train_one, train_runs
    from initlab.study.pipelines import initialize_run

    gen = torch.Generator().manual_seed(0)
    split = (torch.randn(40, 6, generator=gen), torch.randint(0, 3, (40,), generator=gen))

    def factory(config: RunConfig) -> nn.Module:
        with torch.device("cpu"):  # the user's choice of where to build
            return build_model(config, n_in=6, n_classes=3)

    configs = [
        RunConfig(dataset="toy", epochs=2, batch_size=16, seed=s, lr=lr, output_std=std)
        for s, lr, std in ((0, 0.1, None), (1, 0.05, 0.5))
    ]

    def plain(results: list[Any]) -> list[Any]:
        keys = ("step_loss", "epoch_train_loss", "epoch_train_acc", "epoch_test_loss", "state")
        return _plain([[getattr(r, k) for k in keys] for r in results])

    def run() -> list[Any]:
        kw: dict[str, Any] = {"model_factory": factory, "keep_state": True}
        out = [plain([train_one(configs[0], split, split, **kw)])]
        for engine in ("mlp", "vmap", "loop"):
            out.append(plain(train_runs(configs, split, split, engine=engine, **kw)))
        lsuv = RunConfig(dataset="toy", epochs=1, batch_size=16, scheme="orthogonal + lsuv")
        model, _ = initialize_run(lsuv, split, factory)
        return [*out, _plain(model.state_dict())]

    if how is None:
        return run()
    with torch.device("meta"):
        return run()


def test_study_trainers_under_a_meta_default_device_give_the_plain_result() -> None:
    """The trainers' data order (a CPU generator's permutation), per-run bookkeeping (limits,
    alive flags, loss records) and optimizer hyperparameters were made on torch's default device:
    "Cannot copy out of meta tensor" from each engine."""
    assert _study("meta") == _study(None)


# --- helpers a user calls on CPU tensors: fixup_init_, first_per_class -----------------------


@pytest.mark.parametrize("seed", [3, None])
def test_fixup_init_under_a_meta_default_device_draws_the_plain_values(seed: int | None) -> None:
    """fixup_init_ documents its draws as made on the CPU and copied in; they were made on torch's
    default device ("Cannot copy out of meta tensor" from the copy)."""
    from initlab.zoo import create_model, fixup_init_

    def init(how: str | None) -> list[torch.Tensor]:
        model = create_model("fixup_resnet20", fixup_init=False)  # on the CPU, outside the block
        torch.manual_seed(5)  # the global RNG, for generator=None
        if how is None:
            fixup_init_(model, generator=seed)
        else:
            with torch.device("meta"):
                fixup_init_(model, generator=seed)
        return [p.detach().clone() for p in model.parameters()]

    want = init(None)
    got = init("meta")
    assert all(g.device.type == "cpu" and torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_first_per_class_under_a_meta_default_device() -> None:
    """The rank of each row within its class was computed with an ``arange`` on torch's default
    device (a CPU data set: "Cannot copy out of meta tensor")."""
    from initlab.data.dataset import Dataset, first_per_class

    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 3, (60,), generator=g)
    data = Dataset(torch.arange(60.0)[:, None], y, "t", 1, 3, (0, 1, 2))
    with torch.device("meta"):
        sub = first_per_class(data, 4)
    seen: dict[int, int] = {}
    rows = []
    for i, label in enumerate(y.tolist()):  # the oracle: the first 4 rows of each class
        if seen.get(label, 0) < 4:
            rows.append(i)
            seen[label] = seen.get(label, 0) + 1
    assert sub.x.device.type == "cpu" and sub.x[:, 0].long().tolist() == rows


def test_figure2_summary_under_a_meta_default_device() -> None:
    """figure2_summary's quantiles were taken of a tensor made on torch's default device."""
    from initlab.measure.curvature.figure2 import figure2_summary

    rows = [{"block": "conv", "ratio": v} for v in (0.5, 1.0, 2.0, 4.0, 8.0)]
    want = figure2_summary(rows).to_rows()
    with torch.device("meta"):
        got = figure2_summary(rows).to_rows()
    assert got == want
    conv = next(r for r in got if r["block"] == "conv")
    assert conv["median"] == 2.0  # the middle of five, by hand
