"""The measuring entry points on layers with ``torch.nn.utils.parametrize`` parametrizations.

A parametrized layer is measured on its computed tensor (the ``weight`` its forward uses): its
moments, ``E[W^2]`` and the gradients of that weight (minibatch and per-example) are checked here
against an independent float64 computation (autograd per example on the network written out with
the computed weight as a leaf); the other layers against the same model with the parametrization
removed (the values kept). The methods that write weights still refuse such a layer
(tests/test_hardening.py).
"""

from __future__ import annotations

import copy
import itertools
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrizations, parametrize

import initlab

B = 12


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _convnet() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv1d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv1d(4, 2, 3, groups=2), nn.Flatten(),
        nn.Linear(2 * 5, 3),
    )  # fmt: skip


_NETS: dict[str, Callable[[], nn.Sequential]] = {"mlp": _mlp, "conv": _convnet}
_INPUTS = {"mlp": (6,), "conv": (3, 7)}
_PARAMETRIZE: dict[str, Callable[[nn.Module], Any]] = {
    "weight_norm0": lambda m: parametrizations.weight_norm(m, "weight", dim=0),
    "weight_norm2": lambda m: parametrizations.weight_norm(m, "weight", dim=2),
    "spectral_norm": lambda m: parametrizations.spectral_norm(m, "weight"),
}
_CASES = [
    ("mlp", "weight_norm0"),
    ("mlp", "spectral_norm"),
    ("conv", "weight_norm0"),
    ("conv", "weight_norm2"),
    ("conv", "spectral_norm"),
]


def _data(net: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, *_INPUTS[net], generator=gen)
    return [(x, torch.randint(0, 3, (B,), generator=gen))]


def _model(net: str, kind: str) -> nn.Sequential:
    model = _NETS[net]()
    _PARAMETRIZE[kind](model[0])
    return model.eval()  # spectral_norm: no power iteration, the weight is the same every read


def _layer(module: nn.Module, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``module``'s map with weight ``w`` (its bias as it is, in float64)."""
    b = module.bias.detach().double()
    if isinstance(module, nn.Conv1d):
        return F.conv1d(x, w, b, module.stride, module.padding, module.dilation, module.groups)
    return F.linear(x, w, b)


def _reference(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Layer 0's moments in float64: ``x``, ``y``, ``dy`` (per-example loss), ``W`` (computed),
    ``dW`` of the mean loss and of each example's loss, by autograd one example at a time."""
    with torch.no_grad():
        w = model[0].weight.double()
    x = x.double()

    def rest(h: torch.Tensor) -> torch.Tensor:
        for m in model[1:]:
            wm = m.weight.detach().double() if hasattr(m, "weight") else None
            h = _layer(m, h, wm) if wm is not None else m(h)
        return h

    w_leaf = w.clone().requires_grad_()
    out = _layer(model[0], x, w_leaf)
    out.retain_grad()
    F.cross_entropy(rest(out), y).backward()
    dw_mb, dy = w_leaf.grad, out.grad * B
    per_example = []
    for i in range(B):
        wi = w.clone().requires_grad_()
        F.cross_entropy(rest(_layer(model[0], x[i : i + 1], wi)), y[i : i + 1]).backward()
        per_example.append(wi.grad.square().sum())
    numel = w.numel()
    return {
        "E_x2": x.square().mean().item(),
        "E_y2": out.detach().square().mean().item(),
        "E_dy2": dy.square().mean().item(),
        "E_W2": w.square().mean().item(),
        "E_dW2": dw_mb.square().mean().item(),
        "E_dW2_example": (torch.stack(per_example).sum() / (B * numel)).item(),
    }


def _row(rows: Any, **match: Any) -> dict[str, Any]:
    return next(r for r in rows if all(r[k] == v for k, v in match.items()))


@pytest.mark.parametrize(("net", "kind"), _CASES)
def test_the_parametrized_layer_is_measured_on_its_computed_weight(net: str, kind: str) -> None:
    model = _model(net, kind)
    data = _data(net)
    ref = _reference(model, *data[0])
    probe = initlab.measure_moments(model, data, nn.CrossEntropyLoss())
    t, p = _row(probe.table(), layer="0"), _row(probe.param_table(), layer="0", param="weight")
    for q in ("E_x2", "E_y2", "E_dy2"):
        assert t[q] == pytest.approx(ref[q], rel=1e-5), q
    for q in ("E_W2", "E_dW2", "E_dW2_example"):
        assert p[q] == pytest.approx(ref[q], rel=1e-5), q
    assert "is computed by _" in p["note"] and "not of the trainable tensors" in p["note"]
    assert "parametrizations.weight.original" in p["note"]
    assert probe.notes == []  # nothing unavailable
    # gr_scaling: nu of the computed weight, gamma from the same moments
    gr = _row(initlab.gr_scaling(model, data, nn.CrossEntropyLoss()), layer="0")
    assert gr["nu_w"] == pytest.approx(ref["E_dW2_example"] / ref["E_W2"], rel=1e-5)
    assert gr["nu_w_minibatch"] == pytest.approx(ref["E_dW2"] / ref["E_W2"], rel=1e-5)
    gamma = gr["n_in"] * gr["k2"] * gr["p2"] * ref["E_x2"] ** 2 * ref["E_dy2"] / ref["E_y2"]
    assert gr["gamma_w"] == pytest.approx(gamma, rel=1e-5)
    assert "is computed by _" in gr["note"]
    assert [r["layer"] for r in probe.table()] == ["0", "2", "4"][: len(probe.table())]


@pytest.mark.parametrize(("net", "kind"), _CASES)
def test_the_other_layers_are_measured_as_without_the_parametrization(net: str, kind: str) -> None:
    model, data = _model(net, kind), _data(net)
    plain = _model(net, kind)  # the same again (a parametrized module cannot be deep-copied)
    parametrize.remove_parametrizations(plain[0], "weight")  # keeps the computed values
    got = initlab.measure_moments(model, data, nn.CrossEntropyLoss())
    want = initlab.measure_moments(plain, data, nn.CrossEntropyLoss())
    for a, b in zip(got.table(), want.table(), strict=True):
        assert a["layer"] == b["layer"]
        for q in ("E_x2", "E_y2", "E_dy2", "E_dx2"):
            assert a[q] == pytest.approx(b[q], rel=1e-6, nan_ok=True), (a["layer"], q)
    rows = {(r["layer"], r["param"]): r for r in got.param_table()}
    for b in want.param_table():
        a = rows.pop((b["layer"], b["param"]))
        for q in ("E_W2", "E_dW2", "E_dW2_example"):
            assert a[q] == pytest.approx(b[q], rel=1e-5), (b["layer"], b["param"], q)
        assert (a["note"] != "") == ((b["layer"], b["param"]) == ("0", "weight"))
    assert rows == {}  # the same rows: no ParametrizationList among them
    gr = initlab.gr_scaling(model, data, nn.CrossEntropyLoss())
    gr_plain = initlab.gr_scaling(plain, data, nn.CrossEntropyLoss())
    for a, b in zip(gr, gr_plain, strict=True):
        for q in ("gamma_w", "gamma_b", "nu_w", "nu_b", "nu_w_minibatch"):
            assert a[q] == pytest.approx(b[q], rel=1e-5, nan_ok=True), (a["layer"], q)


def _hooks_left(model: nn.Module) -> bool:
    modules = any(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
        for m in model.modules()
    )
    return modules or any(p._backward_hooks for p in model.parameters())


@pytest.mark.parametrize(("net", "kind"), _CASES)
def test_diagnose_and_doctor_leave_the_parametrized_model_as_it_was(net: str, kind: str) -> None:
    model, data = _model(net, kind).train(), _data(net)  # spectral_norm: power iterations
    before = copy.deepcopy(model.state_dict())
    report = initlab.diagnose(model, data, nn.CrossEntropyLoss(), generator=0)
    layer0 = _row(report.layers, layer="0")
    assert layer0["gamma_w"] > 0 and layer0["nu"] > 0 and layer0["op_norm"] > 0
    assert not any("parametrizations" in r["layer"] for r in report.layers)
    spectra = _row(report.tables["spectra"], layer="0", param="weight")
    assert "is computed by _" in spectra["note"]
    doc = initlab.doctor(model, data, nn.CrossEntropyLoss(), generator=0)
    assert len(doc) > 0
    assert parametrize.is_parametrized(model[0], "weight")
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    assert not _hooks_left(model)
    # no tensor hook left either: a second run reads the same
    again = initlab.diagnose(model, data, nn.CrossEntropyLoss(), generator=0)
    assert [r["value"] for r in again.rows] == pytest.approx(
        [r["value"] for r in report.rows], nan_ok=True
    )


def test_layer_spectra_reads_the_computed_weight() -> None:
    model = _model("mlp", "spectral_norm")
    rows = initlab.layer_spectra(model)
    row = _row(rows, layer="0", param="weight")
    sv = torch.linalg.svdvals(model[0].weight.detach())
    assert row["sv_max"] == pytest.approx(float(sv.max()), rel=1e-5)
    assert "_SpectralNorm" in row["note"]


def test_a_parametrized_layer_that_is_re_run_gets_nan_with_a_note() -> None:
    """A layer whose per-example gradients come from a re-run (a custom module) cannot swap its
    computed weight: NaN with the reason, the other columns measured."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(3, 6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * F.linear(x, self.weight)

    torch.manual_seed(0)
    model = nn.Sequential(Scaled(), nn.ReLU(), nn.Linear(3, 3))
    parametrizations.weight_norm(model[0])
    probe = initlab.measure_moments(model, _data("mlp"), nn.CrossEntropyLoss())
    row = _row(probe.param_table(), layer="0", param="weight")
    assert row["E_dW2"] > 0 and row["E_W2"] > 0
    assert row["E_dW2_example"] != row["E_dW2_example"]  # NaN
    assert "cannot swap it" in row["note"]


def test_a_weight_evaluated_twice_in_a_forward_gets_the_sum_of_its_gradients() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 6)
            parametrizations.weight_norm(self.lin)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(torch.relu(self.lin(x)))

    torch.manual_seed(0)
    model = Twice()
    x = torch.randn(B, 6)
    probe = initlab.measure_moments(model, x, lambda m, b: m(b).square().sum())
    row = _row(probe.param_table(), layer="lin", param="weight")
    w = model.lin.weight.detach().clone().requires_grad_()
    b = model.lin.bias.detach()
    F.linear(torch.relu(F.linear(x, w, b)), w, b).square().sum().backward()
    assert row["E_dW2"] == pytest.approx(w.grad.square().mean().item(), rel=1e-5)
    assert row["E_dW2_example"] == row["E_dW2_example"]  # two calls: summed per example


def _tiny_wav2vec2(head: bool) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2, vocab_size=6, hidden_dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0,
        mask_time_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    cls = transformers.Wav2Vec2ForCTC if head else transformers.Wav2Vec2Model
    return cls(config)


@pytest.mark.parametrize("head", [False, True], ids=["Wav2Vec2Model", "Wav2Vec2ForCTC"])
def test_a_tiny_wav2vec2_is_diagnosed(head: bool) -> None:
    model = _tiny_wav2vec2(head)
    prefix = "wav2vec2." if head else ""
    conv_name = f"{prefix}encoder.pos_conv_embed.conv"
    conv = model.get_submodule(conv_name)
    assert parametrize.is_parametrized(conv, "weight")  # weight_norm with dim=2
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 400, generator=gen)
    if head:
        data: Any = [{"input_values": x, "labels": torch.randint(1, 6, (4, 5), generator=gen)}]
        loss: Any = "model"
    else:
        data, loss = [x], (lambda m, b: m(b).last_hidden_state.square().mean())
    before = copy.deepcopy(model.state_dict())
    report = initlab.diagnose(model, data, loss, generator=0)
    row = _row(report.layers, layer=conv_name)
    assert row["gamma_w"] > 0 and row["nu"] > 0
    params = _row(report.tables["params"], layer=conv_name, param="weight")
    assert "_WeightNorm" in params["note"]
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not _hooks_left(model)


class _Tripled(nn.Module):
    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return 3 * t


def test_a_parametrized_bias_is_measured_on_its_computed_value() -> None:
    model = _mlp()
    parametrize.register_parametrization(model[2], "bias", _Tripled())
    data = _data("mlp")
    before = copy.deepcopy(model.state_dict())
    probe = initlab.measure_moments(model, data, nn.CrossEntropyLoss())
    row = _row(probe.param_table(), layer="2", param="bias")
    assert row["E_W2"] == pytest.approx(model[2].bias.detach().square().mean().item(), rel=1e-6)
    assert "'bias' is computed by _Tripled" in row["note"]
    gr = _row(initlab.gr_scaling(model, data, nn.CrossEntropyLoss()), layer="2")
    assert gr["nu_b"] > 0 and "'bias' is computed by _Tripled" in gr["note"]
    initlab.diagnose(model, data, nn.CrossEntropyLoss(), generator=0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _exploding_mlp(parametrized: bool) -> nn.Sequential:
    """A ReLU MLP whose weight-normed hidden layers (g x6) and head (x10) explode; without the
    parametrizations the same computed weights (``remove_parametrizations`` keeps them)."""
    torch.manual_seed(0)
    widths = (20, 64, 64, 64, 10)
    layers: list[nn.Module] = []
    for n_in, n_out in itertools.pairwise(widths):
        layers += [nn.Linear(n_in, n_out), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    for layer in (model[0], model[2], model[4]):
        parametrizations.weight_norm(layer)
        with torch.no_grad():
            layer.parametrizations.weight.original0.mul_(6.0)
        if not parametrized:
            parametrize.remove_parametrizations(layer, "weight")
    with torch.no_grad():
        model[6].weight.mul_(10.0)
    return model


def test_doctor_does_not_count_weight_norm_as_a_normalization_layer() -> None:
    """weight_norm's ``_WeightNorm`` computes a weight, it resets no signal: the exploding layers
    are found as in the model without the parametrizations."""
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(32, 20, generator=gen), torch.randint(0, 10, (32,), generator=gen))]
    rows = {}
    for parametrized in (True, False):
        doc = initlab.doctor(_exploding_mlp(parametrized), data, nn.CrossEntropyLoss(), generator=0)
        rows[parametrized] = doc.row("dead_or_exploding_layers")
    assert rows[False]["verdict"] == "bad" and rows[False]["value"] >= 1
    assert rows[True]["verdict"] == rows[False]["verdict"]
    assert rows[True]["value"] == rows[False]["value"]
    assert "normalization" not in rows[True]["why"]


def test_the_refusal_gives_the_way_back_for_every_parametrized_tensor() -> None:
    """weight (weight_norm) and bias (a custom parametrization) of one layer: the message says
    how to remove and register again each; removing what it names lets init_model run."""
    model = _mlp()
    parametrizations.weight_norm(model[0], "weight", dim=0)
    parametrize.register_parametrization(model[0], "bias", _Tripled())
    with pytest.raises(ValueError, match="parametrized tensors") as err:
        initlab.init_model(model)
    text = str(err.value)
    removed = re.findall(r"remove_parametrizations\(layer, '(\w+)'\) keeps", text)
    assert removed == ["weight", "bias"]
    assert "parametrizations.weight_norm(layer, 'weight', dim=0)" in text
    assert "register_parametrization(layer, 'bias', ...)" in text
    for name in removed:
        parametrize.remove_parametrizations(model[0], name)
    initlab.init_model(model)  # no parametrization left: it runs


def _hessian_block(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> float:
    """``||H||_F^2 / n`` of the mean cross-entropy's Hessian in layer 0's (computed) weight, in
    float64 with the weight as a leaf."""
    w0 = model[0].weight.detach().double()

    def loss(w: torch.Tensor) -> torch.Tensor:
        h = torch.relu(F.linear(x.double(), w, model[0].bias.detach().double()))
        out = F.linear(h, model[2].weight.detach().double(), model[2].bias.detach().double())
        return F.cross_entropy(out, y)

    hess = torch.autograd.functional.hessian(loss, w0).reshape(w0.numel(), w0.numel())
    return (hess.square().sum() / w0.numel()).item()


def test_theory_vs_actual_has_the_block_of_the_computed_weight() -> None:
    """The weight-normed layer's weight has its row: the block of the computed weight, as in the
    model without the parametrization (same probes), and near the exact Hessian block."""
    model = _model("mlp", "weight_norm0")
    plain = _model("mlp", "weight_norm0")
    parametrize.remove_parametrizations(plain[0], "weight")
    data = _data("mlp")
    got = initlab.theory_vs_actual(model, data, nn.CrossEntropyLoss(), generator=0, probes=64)
    want = initlab.theory_vs_actual(plain, data, nn.CrossEntropyLoss(), generator=0, probes=64)
    assert [(r["layer"], r["param"]) for r in got] == [(r["layer"], r["param"]) for r in want]
    for a, b in zip(got, want, strict=True):
        for q in ("theory", "actual", "stderr"):
            assert a[q] == pytest.approx(b[q], rel=1e-5), (a["layer"], a["param"], q)
    row = _row(got, layer="0", param="weight")
    assert "'weight' is computed by _WeightNorm" in row["note"]
    assert "Hessian block of that computed tensor" in row["note"]
    exact = _hessian_block(model, *data[0])
    assert abs(row["actual"] - exact) < 4 * row["stderr"] + 1e-3 * exact
    assert parametrize.is_parametrized(model[0], "weight")
    assert type(model[0]).__name__ == "ParametrizedLinear" and model(data[0][0]).shape == (B, 3)


class _Attending(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.att = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.att(x, x, x)[0].mean(1))


@pytest.mark.parametrize("where", ["in_proj_weight", "out_proj.weight"])
@pytest.mark.parametrize("kind", ["weight_norm0", "spectral_norm"])
def test_attention_with_a_parametrized_projection_is_measured(where: str, kind: str) -> None:
    """nn.MultiheadAttention with a parametrized projection: no crash (its re-run wrote the
    originals in place); the computed tensor's per-example column NaN with the reason, every
    other column as in the model without the parametrization."""

    def build(parametrized: bool) -> _Attending:
        torch.manual_seed(0)
        model = _Attending().eval()
        owner, local = (
            (model.att, where) if where == "in_proj_weight" else (model.att.out_proj, "weight")
        )
        if kind == "spectral_norm":
            parametrizations.spectral_norm(owner, local)
        else:
            parametrizations.weight_norm(owner, local, dim=0)
        if not parametrized:
            parametrize.remove_parametrizations(owner, local)
        return model

    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(B, 3, 4, generator=gen), torch.randint(0, 3, (B,), generator=gen))]
    model, plain = build(True), build(False)
    before = copy.deepcopy(model.state_dict())
    got = initlab.measure_moments(model, data, nn.CrossEntropyLoss())
    want = {
        (r["layer"], r["param"]): r
        for r in initlab.measure_moments(plain, data, nn.CrossEntropyLoss()).param_table()
    }
    layer, param = (
        ("att", "in_proj_weight") if where == "in_proj_weight" else ("att.out_proj", "weight")
    )
    for r in got.param_table():
        b = want[(r["layer"], r["param"])]
        for q in ("E_W2", "E_dW2"):
            assert r[q] == pytest.approx(b[q], rel=1e-5), (r["layer"], r["param"], q)
        if (r["layer"], r["param"]) == (layer, param):
            assert r["E_dW2_example"] != r["E_dW2_example"]  # NaN
            assert "is computed by _" in r["note"]
        else:
            assert r["E_dW2_example"] == pytest.approx(b["E_dW2_example"], rel=1e-5), r["param"]
    assert any(n.startswith(f"{layer}.{param}: ") and "swap" in n for n in got.notes)
    initlab.diagnose(model, data, nn.CrossEntropyLoss(), generator=0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class _Unchanged(nn.Module):
    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return t


@pytest.mark.parametrize("identity", [nn.Identity, _Unchanged])
def test_a_parametrization_returning_its_input_is_measured(identity: type[nn.Module]) -> None:
    """The computed weight is the trainable tensor itself: its gradients are measured (they
    were NaN without a note), against the float64 reference."""
    model = _mlp()
    parametrize.register_parametrization(model[0], "weight", identity())
    data = _data("mlp")
    ref = _reference(model, *data[0])
    probe = initlab.measure_moments(model, data, nn.CrossEntropyLoss())
    row = _row(probe.param_table(), layer="0", param="weight")
    for q in ("E_W2", "E_dW2", "E_dW2_example"):
        assert row[q] == pytest.approx(ref[q], rel=1e-5), q
    assert probe.notes == []
    gr = _row(initlab.gr_scaling(model, data, nn.CrossEntropyLoss()), layer="0")
    assert gr["nu_w"] == pytest.approx(ref["E_dW2_example"] / ref["E_W2"], rel=1e-5)
    assert gr["nu_w_minibatch"] == pytest.approx(ref["E_dW2"] / ref["E_W2"], rel=1e-5)
    assert not _hooks_left(model)


def test_a_parametrized_conv_transpose_says_why_its_nu_is_nan() -> None:
    """A weight-normed ConvTranspose1d takes the re-run: nu_w NaN, and the notes say which
    layers get per-example gradients of a computed weight (ConvTranspose is no "Conv" there)
    without claiming nu is measured; its plain bias's nu_b as without the parametrization."""

    def build(parametrized: bool) -> nn.Sequential:
        torch.manual_seed(0)
        model = nn.Sequential(nn.ConvTranspose1d(3, 4, 3, stride=2), nn.Flatten(), nn.Linear(60, 3))
        parametrizations.weight_norm(model[0])
        if not parametrized:
            parametrize.remove_parametrizations(model[0], "weight")
        return model

    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(B, 3, 7, generator=gen), torch.randint(0, 3, (B,), generator=gen))]
    probe = initlab.measure_moments(build(True), data, nn.CrossEntropyLoss())
    note = next(n for n in probe.notes if n.startswith("0.weight: "))
    assert "not ConvTranspose" in note and "(ConvTranspose1d)" in note
    got = _row(initlab.gr_scaling(build(True), data, nn.CrossEntropyLoss()), layer="0")
    want = _row(initlab.gr_scaling(build(False), data, nn.CrossEntropyLoss()), layer="0")
    assert got["nu_w"] != got["nu_w"] and want["nu_w"] > 0
    assert got["nu_b"] == pytest.approx(want["nu_b"], rel=1e-5)
    assert "nu is measured" not in got["note"] and "nu_w NaN" in got["note"]


def test_doctor_says_its_fixes_refuse_a_parametrized_model() -> None:
    """doctor without fixes on a weight-normed model with a large head: the summary says the
    fixes refuse the model and how to remove the parametrizations (what the writers say), the
    fix column does not offer a call that fails as is, and no 'std -> nan'."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 10))
    parametrizations.weight_norm(model[0])
    with torch.no_grad():
        model[2].weight.mul_(30.0)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(32, 20, generator=gen), torch.randint(0, 10, (32,), generator=gen))]
    doc = initlab.doctor(model, data, nn.CrossEntropyLoss(), generator=0)
    with pytest.raises(ValueError, match="parametrized tensors") as err:
        initlab.doctor(model, data, nn.CrossEntropyLoss(), generator=0, fix=True)
    summary = doc.summary()
    assert "fix=True) applies the fixes" not in summary
    assert "refuse this model" in summary and str(err.value) in summary
    for check in ("initial_loss", "logit_std"):
        row = doc.row(check)
        assert row["verdict"] == "bad"
        assert "nan" not in row["why"]
        assert "init_model(model, 'geometric') failed here (ValueError: the layer '0'" in row["why"]
        assert row["fix"].startswith("once the parametrizations are removed")
