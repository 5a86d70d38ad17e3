"""Methods that differentiate twice or evaluate functionally run on attention models with no
workaround: they select SDPA's math backend themselves and give back the user's setting.

The oracle is the workaround itself: the same call wrapped by hand in
``sdpa_kernel(SDPBackend.MATH)`` gives identical numbers.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import initlab
from initlab._core.attention import math_attention

pytestmark = pytest.mark.usefixtures("one_thread")

T, D, CLASSES = 5, 16, 3


class SdpaBlock(nn.Module):
    """A pre-LN block that calls ``F.scaled_dot_product_attention`` itself (as HF models do)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).view(x.shape[0], T, 3, 2, D // 2).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(a.transpose(1, 2).reshape(x.shape[0], T, D))
        return self.head(x.mean(1))


class MhaModel(nn.Module):
    """``nn.MultiheadAttention`` with a residual connection and a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 4, batch_first=True)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((x + self.attn(x, x, x, need_weights=False)[0]).mean(1))


def _encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(D, 4, 32, dropout=0.0, batch_first=True)
    return nn.Sequential(layer, nn.Flatten(), nn.Linear(T * D, CLASSES))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "sdpa": SdpaBlock,
    "multihead": MhaModel,
    "encoder_layer": _encoder,
}


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(6, T, D, generator=g), torch.randint(0, CLASSES, (6,), generator=g))
        for _ in range(3)
    ]


GRID = (torch.linspace(-1, 1, 3), torch.linspace(-1, 1, 2))

CALLS: dict[str, Callable[[nn.Module, Any], Any]] = {
    "gradinit_sgd": lambda m, d: initlab.gradinit_(m, d, nn.CrossEntropyLoss(), steps=1),
    "gradinit_adam": lambda m, d: initlab.gradinit_(
        m, d, nn.CrossEntropyLoss(), steps=1, optimizer="adam", gamma=100.0
    ),
    "gradinit_exact": lambda m, d: initlab.gradinit_(m, d, "cross_entropy", steps=1, exact=True),
    "metainit_paper": lambda m, d: initlab.metainit_(m, d, F.cross_entropy, steps=2),
    "metainit_gradinit": lambda m, d: initlab.metainit_(m, d, steps=2, variant="gradinit"),
    "precondition": lambda m, d: initlab.precondition_(m, d, nn.CrossEntropyLoss()),
    "block_curvature": lambda m, d: initlab.block_curvature(m, d, probes=2, generator=0),
    "ggn_blocks": lambda m, d: initlab.block_curvature(
        m, d, F.cross_entropy, kind="ggn", probes=2, generator=0
    ),
    "landscape": lambda m, d: initlab.loss_landscape(m, d, grid=GRID, generator=0),
}


def _numbers(result: Any, model: nn.Module) -> list[float]:
    rows = result.to_rows() if hasattr(result, "to_rows") else list(result)
    out = [
        float(v)
        for r in rows
        for k, v in r.items()
        if isinstance(v, float) and not k.endswith("_s") and "wall" not in k
    ]
    return out + [float(p.detach().double().sum()) for p in model.parameters()]


def _sdpa_flags() -> tuple[bool, ...]:
    b = torch.backends.cuda
    return (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled())


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_twice_differentiable_methods_run_on_attention(call: str, model_name: str) -> None:
    """No workaround asked: the result equals the hand-made one (sdpa_kernel MATH around it)."""
    model = _model(model_name)
    got = _numbers(CALLS[call](model, _data()), model)
    ref_model = _model(model_name)
    with sdpa_kernel(SDPBackend.MATH):
        want = _numbers(CALLS[call](ref_model, _data()), ref_model)
    assert got == pytest.approx(want, rel=1e-6, abs=1e-9, nan_ok=True)


def test_the_users_attention_settings_come_back() -> None:
    """Inside a user's own backend choice (fused kernels only, the module fast path on), a method
    still runs, and both settings are as the user left them afterwards, also after an error."""
    mha = torch.backends.mha
    before_fast = mha.get_fastpath_enabled()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        flags = _sdpa_flags()
        assert flags[2] is False  # the user turned math off
        model = _model("sdpa")
        initlab.gradinit_(model, _data(), nn.CrossEntropyLoss(), steps=1, exact=True)
        assert _sdpa_flags() == flags
        with pytest.raises(ValueError):
            initlab.gradinit_(model, _data(), nn.CrossEntropyLoss(), steps=1, eta=-1.0)
        assert _sdpa_flags() == flags
    assert mha.get_fastpath_enabled() == before_fast
    with math_attention():
        assert _sdpa_flags()[2] and not mha.get_fastpath_enabled()
    assert mha.get_fastpath_enabled() == before_fast


def test_hessian_of_an_attention_model_matches_the_dense_oracle() -> None:
    """Curvature through SDPA equals the dense float64 Hessian of the same loss."""
    model = _model("sdpa").double()
    x, y = (t.double() if t.is_floating_point() else t for t in _data()[0])
    params = {n: p.detach() for n, p in model.named_parameters() if n.startswith("proj")}

    def f(ps: dict[str, torch.Tensor]) -> torch.Tensor:
        out = torch.func.functional_call(model, ps, (x,), strict=False)
        return F.cross_entropy(out, y)

    v = {n: torch.randn_like(p) for n, p in params.items()}
    hv = initlab.hessian_vector_product(f, params, v)
    names = list(params)
    flat = torch.cat([params[n].reshape(-1) for n in names])
    sizes = [params[n].numel() for n in names]

    def flat_f(theta: torch.Tensor) -> torch.Tensor:
        parts = theta.split(sizes)
        return f({n: t.view_as(params[n]) for n, t in zip(names, parts, strict=True)})

    with sdpa_kernel(SDPBackend.MATH):
        dense = torch.autograd.functional.hessian(flat_f, flat)
    want = dense @ torch.cat([v[n].reshape(-1) for n in names])
    got = torch.cat([hv[n].reshape(-1) for n in names])
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_gradinit_on_attention_keeps_the_model_usable() -> None:
    """After GradInit the model is a normal module again: its fused fast path is the user's."""
    model = _model("encoder_layer")
    ref = copy.deepcopy(model)
    report = initlab.gradinit_(model, _data(), nn.CrossEntropyLoss(), steps=2)
    assert report.used.batches == 3
    assert any(
        not torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True)
    )
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(model(_data()[0][0])).all()


class TwoInputSdpa(SdpaBlock):
    """``SdpaBlock`` called as ``model(x, temperature)``: ``model(batch[0])`` raises."""

    def forward(self, x: torch.Tensor, temperature: float) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x / temperature)


def _alphas(report: Any) -> dict[str, tuple[str, float]]:
    """``{layer: (kind, alpha)}`` of a :func:`initlab.precondition_` report."""
    return {r["layer"]: (r["kind"], r["alpha"]) for r in report.to_rows()}


@pytest.mark.parametrize("form", ["tuple", "dict"])
def test_precondition_finds_attention_through_the_users_own_call(form: str) -> None:
    """The attention trace ran ``model(batch[0])``; a model taking two inputs (or a dict batch)
    failed there in silence and its qkv projection was balanced (alpha 1.68). It runs the loss
    now: the same weights give what the single-input model gives, qkv at alpha = 1."""
    want = _alphas(initlab.precondition_(_model("sdpa"), _data(), nn.CrossEntropyLoss()))
    assert want["qkv"] == ("attention", 1.0)
    model = TwoInputSdpa()
    model.load_state_dict(_model("sdpa").state_dict())
    data: list[Any] = _data()
    if form == "dict":
        data = [{"x": x, "y": y} for x, y in data]
        got = initlab.precondition_(
            model, data, lambda m, b: F.cross_entropy(m(b["x"], 1.0), b["y"])
        )
    else:
        got = initlab.precondition_(
            model,
            data,
            lambda m, b: F.cross_entropy(m(b[0], 1.0), b[1]),
            forward=lambda m, b: m(b[0], 1.0),
        )
    kinds, alphas = zip(*_alphas(got).values(), strict=True)
    assert dict(zip(_alphas(got), kinds, strict=True)) == {n: k for n, (k, _) in want.items()}
    assert alphas == pytest.approx([a for _, a in want.values()], rel=1e-6)


def test_precondition_warns_when_the_attention_trace_fails() -> None:
    """A trace that fails (here: the loss raises on its second call, the trace's) is said."""
    calls = []

    def loss(m: nn.Module, b: Any) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("second call")
        return F.cross_entropy(m(b[0]), b[1])

    with pytest.warns(UserWarning, match="trace that finds attention projections failed"):
        report = initlab.precondition_(_model("sdpa"), _data()[:1], loss)
    assert _alphas(report)["qkv"][0] == "mlp"
