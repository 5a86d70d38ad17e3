"""Distinct Parameters over one memory (``nn.Parameter(a.weight.data)``, a view of it): not a tie
(one object under two names), yet writing one writes the other. The writers refuse them by name
before touching anything; disjoint views of one buffer are no conflict."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from initlab.init.model import init_model
from initlab.methods.gradinit import gradinit_
from initlab.methods.metainit import metainit_


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
