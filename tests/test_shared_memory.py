"""Distinct Parameters over one memory (``nn.Parameter(a.weight.data)``, a view of it): not a tie
(one object under two names), yet writing one writes the other. Every writer refuses them by name
before touching anything (where it would write one of them); disjoint views of one buffer are no
conflict; the readers measure each layer as it is used."""

from __future__ import annotations

import copy
import itertools
import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from initlab._core.modules import memory_overlaps, shares_memory
from initlab.diagnostics.doctor import doctor
from initlab.init.model import init_model
from initlab.measure.probe import measure_moments
from initlab.methods.gradinit import gradinit_
from initlab.methods.lsuv import lsuv_
from initlab.methods.metainit import metainit_
from initlab.methods.output_scale import scale_output_
from initlab.methods.precondition import precondition_
from initlab.study.config import RunConfig
from initlab.study.models import apply_study_options
from initlab.zoo.resnet import FixupResNet, fixup_init_


class _Viewed(nn.Module):
    """``b.weight`` is the transpose of ``a.weight``'s memory, another Parameter object."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 64)
        self.b = nn.Linear(64, 16)
        self.b.weight = nn.Parameter(self.a.weight.data.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class _Aliased(nn.Module):
    """``head.weight`` holds the same elements as ``embed.weight``: another Parameter object."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.mid = nn.Linear(32, 32)
        self.head = nn.Linear(32, 50, bias=False)
        self.head.weight = nn.Parameter(self.embed.weight.data)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.embed(t)))


def _bits(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def _same(before: dict[str, torch.Tensor], model: nn.Module) -> bool:
    now = dict(model.named_parameters(remove_duplicate=False))
    return all(torch.equal(before[n], now[n]) for n in before)


def test_init_model_refuses_a_view_of_another_parameter_by_name() -> None:
    torch.manual_seed(0)
    model = _Viewed()
    before = _bits(model)
    with pytest.raises(ValueError, match="same memory") as err:
        init_model(model, "fan_in", generator=0)
    msg = str(err.value)
    assert "a.weight and b.weight" in msg and "overlapping elements" in msg
    assert "clone()" in msg and "left as it was" in msg
    assert _same(before, model)


def test_init_model_refuses_the_same_elements_and_names_the_tie() -> None:
    torch.manual_seed(0)
    model = _Aliased()
    before = _bits(model)
    with pytest.raises(ValueError, match="same memory") as err:
        init_model(model, "geometric", generator=0)
    assert "embed.weight and head.weight (the same elements)" in str(err.value)
    assert "head.weight = embed.weight" in str(err.value)
    assert _same(before, model)


def test_init_model_leaves_frozen_shared_memory_alone() -> None:
    """Both tensors frozen and skipped: neither is written, so there is nothing to refuse."""
    torch.manual_seed(0)
    model = _Viewed()
    model.a.weight.requires_grad_(False)
    model.b.weight.requires_grad_(False)
    before = _bits(model)
    init_model(model, "fan_in", generator=0)
    assert torch.equal(model.a.weight, before["a.weight"])
    assert torch.equal(model.b.weight, before["b.weight"])


def test_disjoint_views_of_one_buffer_each_get_their_own_draw() -> None:
    """Two weights cut from one flat buffer (as FSDP does) share a storage, not elements: each
    is drawn at its own fan_in std, sqrt(2 / fan_in) (float64 oracle)."""
    flat = torch.empty(64 * 256 + 256 * 64)
    model = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 256))
    model[0].weight = nn.Parameter(flat[: 64 * 256].view(64, 256))
    model[2].weight = nn.Parameter(flat[64 * 256 :].view(256, 64))
    init_model(model, "fan_in", generator=0)
    for layer, fan_in in ((model[0], 256), (model[2], 64)):
        w = layer.weight.detach().double()
        n = w.numel()
        want = 2.0 / fan_in
        # sample variance of n normal draws: relative std sqrt(2 / n); five of them
        assert abs(float(w.var()) / want - 1) < 5 * math.sqrt(2 / n)
    assert model[0].weight.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def _bytes_of(t: torch.Tensor) -> set[int]:
    """Every byte address ``t``'s elements occupy, element by element (the oracle)."""
    base, size = t.data_ptr(), t.element_size()
    out: set[int] = set()
    for index in itertools.product(*(range(n) for n in t.shape)):
        start = base + size * sum(i * st for i, st in zip(index, t.stride(), strict=True))
        out.update(range(start, start + size))
    return out


def _layouts() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    fused = torch.zeros(8, 6)
    return {
        "even and odd rows": (fused[0::2], fused[1::2]),
        "even and odd columns": (fused[:, 0::2], fused[:, 1::2]),
        "rows 0::2 and 3::3 (row 6)": (fused[0::2], fused[3::3]),
        "a row and the odd rows around it": (fused[2], fused[1::2]),
        "a row and the odd rows through it": (fused[3], fused[1::2]),
        "columns 0::3 and the transpose's rows 1::3": (fused[:, 0::3], fused.t()[1::3]),
        "even floats and the half-floats of the odd ones": (
            fused[:, 0::2],
            fused.view(torch.int16)[:, 2::4],
        ),
        "even floats and their own upper halves": (
            fused[:, 0::2],
            fused.view(torch.int16)[:, 1::4],
        ),
        "even floats and a byte of each odd one": (
            fused[:, 0::2],
            fused.view(torch.uint8)[:, 5::8],
        ),
        "even floats and a byte of each": (fused[:, 0::2], fused.view(torch.uint8)[:, 3::8]),
    }


@pytest.mark.parametrize("layout", list(_layouts()))
def test_shared_memory_means_an_element_in_common(layout: str) -> None:
    """Two views of one buffer are over the same memory exactly when a byte of one is a byte of
    the other (a set of byte addresses per tensor, the oracle), not when their ranges overlap:
    interleaved rows or columns of a fused weight share none."""
    a, b = _layouts()[layout]
    want = bool(_bytes_of(a) & _bytes_of(b))
    assert bool(memory_overlaps([("a", a), ("b", b)])) is want
    assert shares_memory(a, b) is want and shares_memory(b, a) is want


def test_interleaved_rows_of_one_buffer_each_get_their_own_draw() -> None:
    """The even and odd rows of one buffer as two weights: no element in common, so init_model
    draws each at its own std sqrt(2 / fan_in) (float64 oracle); rows 0::2 and 3::3 share rows
    6, 12, ... and are refused."""
    fused = torch.zeros(256, 128)
    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128))
    model[0].weight = nn.Parameter(fused[0::2])
    model[2].weight = nn.Parameter(fused[1::2])
    init_model(model, "fan_in", generator=0)
    for layer in (model[0], model[2]):
        w = layer.weight.detach().double()
        assert abs(float(w.var()) / (2.0 / 128) - 1) < 5 * math.sqrt(2 / w.numel())
    assert torch.equal(fused[0::2], model[0].weight.detach())
    base = torch.zeros(512, 128)
    model[0].weight = nn.Parameter(base[0::2][:128])
    model[2].weight = nn.Parameter(base[3::3][:128])
    with pytest.raises(ValueError, match=r"0\.weight and 2\.weight \(overlapping elements\)"):
        init_model(model, "fan_in", generator=0)


def _batches(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 16, generator=gen), torch.randint(0, 16, (16,), generator=gen)
    return [(x, y)] * n


def _square_viewed() -> nn.Module:
    """``b.weight`` is ``a.weight.t()``'s memory (square, so the forward runs)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    model[2].weight = nn.Parameter(model[0].weight.data.t())
    return model


@pytest.mark.parametrize("method", ["gradinit_", "metainit_"])
def test_alpha_methods_refuse_shared_memory_up_front(method: str) -> None:
    """Each tensor would learn its own alpha, and the fold would scale the one memory by both
    (0.851 * 0.979 = 0.833, once blamed on float32 rounding): refused before any step, with no
    warning."""
    model = _square_viewed()
    before = _bits(model)
    call = gradinit_ if method == "gradinit_" else metainit_
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="same memory") as err:
            call(model, _batches(), nn.CrossEntropyLoss(), steps=3, generator=0)
    msg = str(err.value)
    assert msg.startswith(f"{method}: 0.weight and 2.weight (overlapping elements)")
    assert "float32" not in msg
    assert _same(before, model)


def test_gradinit_refuses_a_scaled_view_of_a_frozen_tensor() -> None:
    """The frozen tensor gets no scale, but folding its view's would write it."""
    model = _square_viewed()
    model[0].weight.requires_grad_(False)
    before = _bits(model)
    with pytest.raises(ValueError, match=r"0\.weight and 2\.weight"):
        gradinit_(model, _batches(), nn.CrossEntropyLoss(), steps=3, generator=0)
    assert _same(before, model)


# -- every writer, table-driven --------------------------------------------------------------


def _fixup_viewed() -> nn.Module:
    """A FixUp ResNet whose first block's ``conv2.weight`` holds ``conv1.weight``'s elements."""
    torch.manual_seed(0)
    model = FixupResNet(depth=8, n_classes=4, in_channels=1)
    block = model.layer1[0]
    block.conv2.weight = nn.Parameter(block.conv1.weight.data)
    return model


def _convs_viewed() -> nn.Module:
    """Two 3x3 convolutions, the second's weight over the first's memory."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 2, 3, padding=1), nn.ReLU(), nn.Conv2d(2, 2, 3, padding=1), nn.Flatten()
    )
    model[2].weight = nn.Parameter(model[0].weight.data)
    return model


def _study(model: nn.Module) -> Any:
    config = RunConfig.make(
        "img2x4?channels=2", model="x", model_cfg={"conditioning": "kernel_size"}
    )
    return apply_study_options(model, config)


class _Block(nn.Module):
    """``x + c2(relu(c1(x)))``: ``c2`` is the branch end."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.c2(torch.relu(self.c1(x)))


def _blocks_viewed(layer: str) -> nn.Module:
    """Two residual blocks; the second's ``layer`` weight is the first's, transposed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), _Block(), _Block())
    getattr(model[2], layer).weight = nn.Parameter(getattr(model[1], layer).weight.data.t())
    return model


def _lsuv_branches(model: nn.Module) -> Any:
    return lsuv_(model, _batches()[0][0], strategy="branches", blocks=["1", "2"], generator=0)


_CE = nn.CrossEntropyLoss()
_PAIR = "0.weight and 2.weight (overlapping elements)"
_FIXUP = "layer1.0.conv1.weight and layer1.0.conv2.weight (the same elements)"
_CONVS = "0.weight and 2.weight (the same elements)"

# (id, refusing entry point, model, call, the pair named)
WRITERS: list[tuple[str, str, Callable[[], nn.Module], Callable[[nn.Module], Any], str]] = [
    ("init_model", "init_model", _square_viewed, lambda m: init_model(m, "fan_in", generator=0),
     _PAIR),
    ("lsuv_", "lsuv_", _square_viewed, lambda m: lsuv_(m, _batches()[0][0], generator=0), _PAIR),
    ("lsuv_-scale-only", "lsuv_", _square_viewed,
     lambda m: lsuv_(m, _batches()[0][0], orthogonal=False), _PAIR),
    ("lsuv_-branch-ends", "lsuv_", lambda: _blocks_viewed("c2"), _lsuv_branches,
     "1.c2.weight and 2.c2.weight (overlapping elements)"),
    ("gradinit_", "gradinit_", _square_viewed,
     lambda m: gradinit_(m, _batches(), _CE, steps=3, generator=0), _PAIR),
    ("metainit_", "metainit_", _square_viewed,
     lambda m: metainit_(m, _batches(), _CE, steps=3, generator=0), _PAIR),
    ("scale_output_-fold", "scale_output_", _square_viewed,
     lambda m: scale_output_(m, _batches(), target=0.05), _PAIR),
    ("precondition_-parametrize", "precondition_", _square_viewed,
     lambda m: precondition_(m, _batches(), _CE, how="parametrize", generator=0), _PAIR),
    ("precondition_-rescale", "precondition_", _square_viewed,
     lambda m: precondition_(m, _batches(), _CE, how="rescale", generator=0), _PAIR),
    ("doctor-init", "doctor", _square_viewed,
     lambda m: doctor(m, _batches(), _CE, fix="init", generator=0), _PAIR),
    ("doctor-lsuv", "doctor", _square_viewed,
     lambda m: doctor(m, _batches(), _CE, fix="lsuv", generator=0), _PAIR),
    ("fixup_init_", "fixup_init_", _fixup_viewed, lambda m: fixup_init_(m, generator=0), _FIXUP),
    ("study-conditioning", "model_cfg conditioning='kernel_size'", _convs_viewed, _study, _CONVS),
]  # fmt: skip


@pytest.mark.parametrize(
    ("what", "make", "call", "pair"), [w[1:] for w in WRITERS], ids=[w[0] for w in WRITERS]
)
def test_every_writer_refuses_shared_memory_before_writing(
    what: str, make: Callable[[], nn.Module], call: Callable[[nn.Module], Any], pair: str
) -> None:
    """Each would write the two as tensors of their own (draw one over the other, scale the one
    memory by both factors, store ``W / alpha`` apart and so untie them): refused up front with
    the shared message naming the pair, no warning, every tensor as it was, still one memory."""
    model = make()
    before = _bits(model)
    modules = [n for n, _ in model.named_modules()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="same memory") as err:
            call(model)
    msg = str(err.value)
    assert msg.startswith(f"{what}: {pair} are distinct Parameters over the same memory"), msg
    assert "nn.Parameter(t.detach().clone())" in msg and msg.endswith("left as it was")
    assert _same(before, model)
    assert [n for n, _ in model.named_modules()] == modules  # no parametrization registered
    first, second = pair.split(" (")[0].split(" and ")
    params = dict(model.named_parameters())
    assert params[first].data_ptr() == params[second].data_ptr()


def _deep_viewed() -> nn.Module:
    """Three layers; ``2.weight`` is ``0.weight.t()``'s memory, ``4`` has its own."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)
    )
    model[2].weight = nn.Parameter(model[0].weight.data.t())
    return model


def _frozen_pair(model: nn.Module) -> nn.Module:
    for i in (0, 2):
        model[i].requires_grad_(False)
    return model


_TWO = ("0.weight", "2.weight")

# (id, model, call, the pair): entry points that write neither tensor of the pair
NOT_WRITING: list[tuple[str, Callable[[], nn.Module], Callable[[nn.Module], Any], tuple[str, str]]]
NOT_WRITING = [
    ("lsuv_-other-layer", _deep_viewed,
     lambda m: lsuv_(m, _batches()[0][0], modules=["4"], generator=0), _TWO),
    ("lsuv_-pair-frozen", lambda: _frozen_pair(_deep_viewed()),
     lambda m: lsuv_(m, _batches()[0][0], generator=0), _TWO),
    ("lsuv_-branches-inner-layers", lambda: _blocks_viewed("c1"), _lsuv_branches,
     ("1.c1.weight", "2.c1.weight")),
    ("init_model-pair-frozen", lambda: _frozen_pair(_deep_viewed()),
     lambda m: init_model(m, "fan_in", generator=0), _TWO),
    ("precondition_-lr", _square_viewed,
     lambda m: precondition_(m, _batches(), _CE, how="lr", generator=0), _TWO),
    ("scale_output_-module", _square_viewed,
     lambda m: scale_output_(m, _batches(), target=0.05, how="module"), _TWO),
    ("scale_output_-hook", _square_viewed,
     lambda m: scale_output_(m, _batches(), target=0.05, how="hook"), _TWO),
    ("doctor-output_scale", _square_viewed,
     lambda m: doctor(m, _batches(), _CE, fix="output_scale", generator=0), _TWO),
]  # fmt: skip


@pytest.mark.parametrize(
    ("make", "call", "pair"), [w[1:] for w in NOT_WRITING], ids=[w[0] for w in NOT_WRITING]
)
def test_writers_run_where_they_write_neither_tensor(
    make: Callable[[], nn.Module], call: Callable[[nn.Module], Any], pair: tuple[str, str]
) -> None:
    """Only a writer that would write one of the pair refuses (a layer left out, frozen, inside
    a block but not its branch end, or a method that writes no weight): the pair keeps its
    values and its one memory."""
    model = make()
    before = _bits(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the methods' notes on this small model are no matter
        call(model)
    params = dict(model.named_parameters())
    for name in pair:
        assert torch.equal(params[name], before[name])
    assert params[pair[0]].data_ptr() == params[pair[1]].data_ptr()


def test_measure_moments_reads_each_use_of_the_memory_as_its_layer() -> None:
    """measure_moments on a model whose ``2.weight`` is ``0.weight.t()``'s memory: every row of
    both layers is what a float64 computation gives (x, y, dy per example as the probe scales it,
    ``dy * B`` for a mean loss; W; each Parameter's own gradient dW and per-example dW): the
    shared memory mixes nothing up."""
    model = _square_viewed()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 16, (8,), generator=gen)
    batches = [(x, y), (x * 0.5, y)]
    rows = measure_moments(copy.deepcopy(model), batches, _CE).rows()
    got = {
        (r["layer"], r["quantity"], r["param"]): r["value"]
        for r in rows
        if r["call"] == "all" and r["stat"] == "sq_mean" and r["param"] in ("", "weight")
    }
    w0 = model[0].weight.detach().double()
    b0, b2 = (model[i].bias.detach().double() for i in (0, 2))
    assert torch.equal(model[2].weight.detach().double(), w0.t())
    want: dict[tuple[str, str, str], list[torch.Tensor]] = {}
    for xb, yb in batches:
        xb = xb.double()
        a, b = w0.clone().requires_grad_(), w0.t().clone().requires_grad_()
        h = xb @ a.t() + b0
        h.retain_grad()
        r = h.relu()
        out = r @ b.t() + b2
        out.retain_grad()
        nn.functional.cross_entropy(out, yb).backward()
        n = xb.shape[0]
        for layer, inp, o, w in (("0", xb, h, a), ("2", r, out, b)):
            assert o.grad is not None and w.grad is not None
            dy = o.grad * n  # the gradient of each example's own loss
            per_example = (dy[:, :, None] * inp[:, None, :]).square().mean()
            for key, v in (
                ("x", inp.square().mean()), ("y", o.square().mean()),
                ("dy", dy.square().mean()), ("W", w.detach().square().mean()),
                ("dW", w.grad.square().mean()), ("dW_example", per_example),
            ):  # fmt: skip
                param = "weight" if key.startswith(("W", "dW")) else ""
                want.setdefault((layer, key, param), []).append(v.detach())
    assert len(want) == 12
    for key, values in want.items():
        assert got[key] == pytest.approx(float(torch.stack(values).mean()), rel=1e-5), key
