"""The scaling linter: Table 1's rules, residual detection, dead ReLUs counted by hand."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from initlab import measure_moments
from initlab.diagnostics import diagnose, make_loss
from initlab.diagnostics.linter import (
    DEAD_MIN_EXAMPLES,
    RULES,
    SATURATED_STD,
    TANH_LINEAR_STD,
    ActivationWatch,
    gradient_ratios,
    lint_model,
    signal_ratios,
)

from .conformance_models import LSTMLM

STRUCTURAL = {"max_pool", "resampling", "sigmoid", "tanh", "mixed_kernel_sizes", "skip_connection"}


def rules_of(findings) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for f in findings:
        out.setdefault(f["rule"], []).append(f)
    return out


def watched(model: nn.Module, batches: list[torch.Tensor]) -> ActivationWatch:
    with ActivationWatch(model) as watch, torch.no_grad():
        for x in batches:
            model(x)
    return watch


def images(n: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


def test_max_pool_and_sigmoid_are_flagged_with_the_papers_reasons():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.Sigmoid(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(64, 3),
    )  # fmt: skip
    x = images()
    result = lint_model(model, activations=watched(model, [x]))
    found = rules_of(result.findings)
    assert [f["layer"] for f in found["max_pool"]] == ["2"]
    assert [f["layer"] for f in found["sigmoid"]] == ["1"]
    assert 'Table 1: "Max pooling"' in found["max_pool"][0]["reason"]
    assert "stride-2 convolutions, as well as average pooling" in found["max_pool"][0]["reason"]
    assert 'Table 1: "Sigmoid"' in found["sigmoid"][0]["reason"]
    # the sigmoid's input std is the hand-computed std of the conv output
    expected = model[0](x).detach().double().std(unbiased=False).item()
    assert found["sigmoid"][0]["value"] == pytest.approx(expected, rel=1e-6)
    assert found["max_pool"][0]["severity"] == "warn"


def test_strided_convs_relu_and_average_pooling_pass():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU(),
        nn.AvgPool2d(2), nn.Flatten(), nn.Linear(8, 4),
    )  # fmt: skip
    report = diagnose(model, (images(), torch.randint(0, 4, (32,))))
    assert not STRUCTURAL & {f["rule"] for f in report.findings}
    assert report.meta["traced"] is True


def test_functional_ops_are_found_through_fx_and_measured():
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.fc = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = F.max_pool2d(torch.sigmoid(self.conv(x)), 4)
            h = F.interpolate(h, scale_factor=0.5)
            return self.fc(torch.tanh(h.flatten(1)))

    torch.manual_seed(0)
    model = Functional()
    batches = [images(seed=0), images(seed=1)]
    result = lint_model(model, forward_args=[((x,), {}) for x in batches])
    found = rules_of(result.findings)
    assert set(found) >= {"max_pool", "sigmoid", "resampling"}
    assert found["max_pool"][0]["layer"] == "<root>:max_pool2d"
    pre = torch.cat([model.conv(x) for x in batches]).detach().double()
    assert found["sigmoid"][0]["value"] == pytest.approx(pre.std(unbiased=False).item(), rel=1e-6)
    acts = {r["layer"]: r for r in result.activations}
    assert acts["<root>:sigmoid"]["source"] == "functional"
    assert acts["<root>:sigmoid"]["batches"] == 2


def test_mixed_kernel_sizes_are_flagged_on_the_odd_convolution():
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 1), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
    )  # fmt: skip
    found = rules_of(lint_model(model).findings)
    (f,) = found["mixed_kernel_sizes"]
    assert f["layer"] == "2"
    assert f["value"] == pytest.approx(1 / 9)
    assert "alpha = 1.73" in f["message"]  # alpha^4 k^2 = const: alpha = 9^(1/4)
    assert "only if all kernel sizes are the same" in f["reason"]


class Block(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1)
        self.relu = nn.ReLU(inplace=True)
        self.short = nn.Conv2d(c_in, c_out, 1, stride) if stride > 1 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.conv2(self.relu(self.conv1(x))) + self.short(x))


def test_skip_connections_are_found_with_branch_and_shortcut():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), Block(4, 4, 1), Block(4, 8, 2))
    result = lint_model(model)
    found = rules_of(result.findings)
    assert [f["layer"] for f in found["skip_connection"]] == ["1", "2"]
    blocks = {b["name"]: b for b in result.residual_blocks}
    assert blocks["1"]["branch"] == ["1.conv1", "1.conv2"] and blocks["1"]["shortcut"] == []
    assert blocks["2"]["branch"] == ["2.conv1", "2.conv2"]
    assert blocks["2"]["shortcut"] == ["2.short"]
    assert (
        "residual blocks will be scaled correctly against each other"
        in (found["skip_connection"][0]["reason"])
    )
    # the 1x1 projection among 3x3 convolutions is also a kernel-size finding
    assert [f["layer"] for f in found["mixed_kernel_sizes"]] == ["2.short"]


def test_positional_embedding_addition_is_not_a_skip_connection():
    class Tokens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(20, 8)
            self.pos = nn.Embedding(16, 8)
            self.fc = nn.Linear(8, 8)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(idx.size(1), device=idx.device)
            h = self.tok(idx) + self.pos(pos)
            return h + self.fc(h)

    idx = torch.randint(0, 20, (2, 5), generator=torch.Generator().manual_seed(0))
    result = lint_model(Tokens())
    if result.traced:
        assert [(b["branch"], b["source"]) for b in result.residual_blocks] == [(["fc"], "fx")]
    else:  # torch < 2.5: fx cannot trace torch.arange of a traced size; nothing is guessed
        assert "arange" in result.trace_error and result.residual_blocks == []
    result = lint_model(Tokens(), forward_args=[((idx,), {})])
    assert [b["branch"] for b in result.residual_blocks] == [["fc"]]


def test_transformer_layers_are_residual_by_type():
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    found = rules_of(lint_model(model).findings)
    assert [f["layer"] for f in found["skip_connection"]] == [
        "layers.0:self_attn", "layers.0:ff", "layers.1:self_attn", "layers.1:ff",
    ]  # fmt: skip


@pytest.mark.parametrize("inplace", [False, True])
def test_dead_relu_fraction_matches_a_hand_count(inplace):
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 40), nn.ReLU(inplace=inplace), nn.Linear(40, 2))
    with torch.no_grad():
        model[0].bias[:10] = -50.0  # never positive
        model[0].bias[10:13] = -4.0  # rarely positive
    batches = [torch.randn(16, 5, generator=g) for _ in range(2)]
    watch = watched(model, batches)
    with torch.no_grad():
        pre = torch.cat([model[0](x) for x in batches])
    dead = int((pre <= 0).all(dim=0).sum())
    assert dead >= 10
    (row,) = watch.rows()
    assert row["layer"] == "1" and row["examples"] == 32 >= DEAD_MIN_EXAMPLES
    assert row["dead_frac"] == dead / 40
    found = rules_of(lint_model(model, activations=watch).findings)
    assert found["dead_relu"][0]["value"] == dead / 40
    assert found["dead_relu"][0]["severity"] == ("bad" if dead / 40 > 0.5 else "warn")
    # what makes units dead is upstream (it said "check the bias init and the input scale")
    assert "the layer before it: its bias, its weights' scale" in found["dead_relu"][0]["message"]


def test_dead_channels_of_a_convolution():
    g = torch.Generator().manual_seed(1)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
    with torch.no_grad():
        model[0].bias[:2] = -100.0
    x = torch.randn(20, 3, 6, 6, generator=g)
    (row,) = watched(model, [x]).rows()
    pre = model[0](x).detach()
    assert row["dead_frac"] == float((pre <= 0).all(dim=0).double().mean())
    assert row["dead_channel_frac"] == 0.5


@pytest.mark.parametrize(("scale", "expected"), [(0.1, None), (1.0, "warn"), (4.0, "bad")])
def test_tanh_rule_uses_the_input_std(scale, expected):
    model = nn.Sequential(nn.Tanh(), nn.Linear(6, 2))
    x = scale * torch.randn(64, 6, generator=torch.Generator().manual_seed(2))
    found = rules_of(lint_model(model, activations=watched(model, [x])).findings)
    std = x.double().std(unbiased=False).item()
    if expected is None:
        assert std < TANH_LINEAR_STD and "tanh" not in found
    else:
        assert found["tanh"][0]["severity"] == expected
        assert found["tanh"][0]["value"] == pytest.approx(std, rel=1e-6)
        assert (std >= SATURATED_STD) == (expected == "bad")
        assert "linear regime" in RULES["tanh"]


def test_untraceable_model_falls_back_to_module_types():
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.pool = nn.MaxPool2d(2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # data-dependent control flow: fx cannot trace this
                x = -x
            return self.pool(self.conv(x))

    result = lint_model(Branchy())
    found = rules_of(result.findings)
    assert not result.traced and result.trace_error
    assert found["not_traced"][0]["severity"] == "info"
    # the way that works on any model is named (it said only "pass residual_blocks=")
    assert "pass forward_args=[(args, kwargs)]" in found["not_traced"][0]["message"]
    assert [f["layer"] for f in found["max_pool"]] == ["pool"]


class _UntracedRelu(nn.Module):
    """A functional ReLU (and an ``nn.ReLU``) behind data-dependent control flow: fx fails."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.act, self.l2 = nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.l1(x))
        if h.sum() < -1:
            h = -h
        return self.l2(self.act(h - 0.5))


def test_untraceable_model_still_measures_its_functional_relus():
    """fx failed, so F.relu was not inspected: 44% dead units were never reported (doctor said
    dead_or_exploding_layers ok). Running the model measures them; the oracle is the mask of
    ``l1``'s outputs never positive over the batches, computed here directly."""
    torch.manual_seed(0)
    model = _UntracedRelu()
    with torch.no_grad():
        model.l1.weight.mul_(1e-4)
    xs = [torch.randn(32, 12, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    res = lint_model(model, forward_args=[((x,), {}) for x in xs])
    assert not res.traced
    rows = {r["layer"]: r for r in res.activations}
    assert set(rows) == {
        "<root>:relu",
        "act",
    }  # the nn.ReLU's call is its hook's, not counted twice
    with torch.no_grad():
        alive = torch.cat([model.l1(x) for x in xs]).gt(0).any(0)
    want = float((~alive).double().mean())
    assert 0.2 < want < 0.8
    assert rows["<root>:relu"]["dead_frac"] == pytest.approx(want, abs=1e-12)
    assert rows["<root>:relu"]["source"] == "runtime" and rows["<root>:relu"]["examples"] == 64
    (dead,) = rules_of(res.findings)["dead_relu"]
    assert dead["layer"] == "<root>:relu" and dead["value"] == pytest.approx(want, abs=1e-12)
    (nt,) = rules_of(res.findings)["not_traced"]
    assert "functional ReLUs (by running the model)" in nt["message"]
    assert "not inspected: functional operations (F.max_pool2d, torch.tanh" in nt["message"]


def test_vanishing_signal_and_non_finite_values_give_bad_verdicts():
    torch.manual_seed(0)
    small = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 3))  # fmt: skip
    with torch.no_grad():
        for m in small:
            if isinstance(m, nn.Linear):
                m.weight.mul_(1e-2)
                m.bias.zero_()
    data = (torch.randn(32, 8), torch.randint(0, 3, (32,)))
    report = diagnose(small, data, spectra=False)
    found = rules_of(report.findings)
    assert "vanishing_signal" in found
    layer = found["vanishing_signal"][0]["layer"]
    assert report.verdicts[layer][0] == "bad"
    assert "vanishes" in report.verdicts[layer][1]

    broken = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    with torch.no_grad():
        broken[2].weight[0, 0] = float("nan")
    report = diagnose(broken, data, make_loss("cross_entropy"), spectra=False)
    verdict, reason = report.verdicts["2"]
    assert verdict == "bad"
    assert "non-finite activations in 2" in reason
    # the first layer computes finite activations but gets NaN gradients through layer 2
    assert "non-finite activations in 0" not in report.verdicts["0"][1]
    assert "non-finite gradients in 0" in report.verdicts["0"][1]
    assert any("non-finite loss" in n for n in report.meta["notes"])
    assert math.isnan(report.value("2", "E_y2"))


class _Counting(nn.Module):
    """A forward that counts its calls in a buffer (in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return self.fc(x)


def test_lint_model_leaves_the_buffers_as_they_were():
    """Tracing runs the forward's Python: the counter was left at 1 by lint_model."""
    model = _Counting()
    result = lint_model(model)
    assert result.traced
    assert float(model.steps) == 0.0


class _PreNorm(nn.Module):
    """A small embedding table (std 0.02, as GPT-2's) -> LayerNorm -> Linear: a pre-norm block."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 32)
        nn.init.normal_(self.emb.weight, std=0.02)
        self.norm = nn.LayerNorm(32)
        self.proj = nn.Linear(32, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(self.emb(ids)))


def test_lint_model_measures_the_signal_from_the_normalization_before_a_layer():
    """The forward gain was taken from the embedding's output across the LayerNorm (the
    projection "exploded", x2500) and the 0.02-std table "vanished"; lint_model on its own now
    follows the same rule as diagnose."""
    from initlab.measure.probe import measure_moments

    model = _PreNorm()
    ids = torch.randint(0, 50, (16, 8), generator=torch.Generator().manual_seed(1))
    table = measure_moments(model, ids, lambda m, x: m(x).square().mean()).table()
    ratios = signal_ratios(table)
    assert ratios["proj"][1] == "norm" and 0.1 < ratios["proj"][0] < 10
    rules = {f["rule"] for f in lint_model(model, probe_table=table).findings}
    assert not rules & {"vanishing_signal", "exploding_signal"}


def _deep_mlp(depth: int, act: type[nn.Module], scale: float | None) -> nn.Sequential:
    """``depth`` Linear layers of width 32, He-initialized times ``scale`` (``None``: torch's
    default init), zero biases."""
    dims = [16] + [32] * (depth - 1) + [10]
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(dims)):
        lin = nn.Linear(a, b)
        if scale is not None:
            nn.init.kaiming_normal_(lin.weight)
            lin.weight.data.mul_(scale)
        nn.init.zeros_(lin.bias)
        layers += [lin] if i == depth - 1 else [lin, act()]
    return nn.Sequential(*layers)


@pytest.mark.parametrize(
    ("act", "scale", "rule"),
    [(nn.ReLU, 1.0, None), (nn.ReLU, 0.5, "vanishing_gradient"),
     (nn.ReLU, 2.0, "exploding_gradient"), (nn.Sigmoid, None, "vanishing_gradient")],
)  # fmt: skip
def test_the_backward_gain_is_measured_end_to_end(act, scale, rule):
    """The gradient rules multiplied the Linear layers' own gains E[dx^2]/E[dy^2] and left out the
    activations between them: a He-initialized 30-layer ReLU MLP (true gain near 1) read as
    "exploding" (2.8e8), a sigmoid net's vanishing gradient went unreported. The oracle: the
    squared gradient at each layer's input over that at the logits, by hooks of its own."""
    torch.manual_seed(0)
    model = _deep_mlp(30 if act is nn.ReLU else 20, act, scale)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(64, 16, generator=g), torch.randint(0, 10, (64,), generator=g))
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(name: str):  # the layer's input and output, their gradients kept
        def hook(_m: nn.Module, args: tuple, out: torch.Tensor) -> None:
            for t in (args[0], out):
                if t.requires_grad:
                    t.retain_grad()
            seen[name] = (args[0], out)

        return hook

    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    hooks = [m.register_forward_hook(keep(n)) for n, m in linears.items()]
    F.cross_entropy(model(batch[0]), batch[1]).backward()
    for h in hooks:
        h.remove()
    model.zero_grad(set_to_none=True)
    at_logits = seen[list(linears)[-1]][1].grad.double().square().sum()
    truth = {n: float(x.grad.double().square().sum() / at_logits)
             for n, (x, _) in seen.items() if x.grad is not None}  # fmt: skip
    measured = gradient_ratios(measure_moments(model, batch, F.cross_entropy).rows())
    for n, want in truth.items():
        assert measured[n] == pytest.approx(want, rel=1e-4), n
    found = rules_of(diagnose(model, batch, F.cross_entropy, spectra=False).findings)
    flagged = {k for k in ("vanishing_gradient", "exploding_gradient") if k in found}
    assert flagged == ({rule} if rule else set())


def _lstm_gain(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Own float64 end-to-end backward gain at the LSTM: sum(dx^2) at its input over sum(dy^2)
    at the logits."""
    m = copy.deepcopy(model).double()
    h = m.emb(x).detach().requires_grad_(True)
    logits = m.head(m.rnn(h)[0])
    logits.retain_grad()
    F.cross_entropy(logits.reshape(-1, 20), y.reshape(-1)).backward()
    return float(h.grad.square().sum() / logits.grad.square().sum())


@pytest.mark.parametrize("weak", [False, True])
def test_a_healthy_lstm_is_no_vanishing_gradient_its_gates_pass_1_16_per_layer(weak):
    """A default-init 2-layer LSTM LM has an end-to-end backward gain near 1e-4 (gates at
    sigmoid(0) = 1/2 pass i * o = 1/4 of the gradient, squared 1/16, per layer, whatever the
    weights); it was 'bad: vanishing_gradient' against 1e-3. Judged against 1e-3 / 16^2 it is
    not; an LSTM whose input weights are 100x smaller still is."""
    torch.manual_seed(1)
    model = LSTMLM().eval()
    if weak:
        with torch.no_grad():
            for name, p in model.rnn.named_parameters():
                if name.startswith("weight_ih"):
                    p.mul_(0.01)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(1, 20, (6, 7), generator=g), torch.randint(1, 20, (6, 7), generator=g)
    gain = _lstm_gain(model, x, y)
    if weak:
        assert gain < 1e-3 / 256
    else:
        assert 1e-3 / 256 < gain < 1e-3  # below the plain threshold, above the gated one
    loss = nn.CrossEntropyLoss()
    found = diagnose(model, (x, y), lambda m, b: loss(m(b[0]).flatten(0, 1), b[1].flatten()),
                     spectra=False).findings  # fmt: skip
    vanishing = [f for f in found if f["rule"] == "vanishing_gradient" and f["layer"] == "rnn"]
    if not weak:
        assert vanishing == []
        return
    (f,) = vanishing
    assert f["value"] == pytest.approx(gain * 256, rel=1e-3)
    assert "the share the gates of rnn pass at init" in f["message"]


def test_a_weight_of_identical_rows_is_named_and_init_recommended():
    """A constant init (every weight 0.1): its units compute one function and, their outgoing
    weights equal too, get one gradient forever; the report listed only consequences. An
    all-zero weight (Fixup's last layer of a branch) is a design, not flagged."""
    from initlab import doctor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 3))  # fmt: skip
    with torch.no_grad():
        for m in model:
            if isinstance(m, nn.Linear):
                m.weight.fill_(0.1)
                m.bias.zero_()
    data = (torch.randn(32, 8), torch.randint(0, 3, (32,)))
    found = rules_of(lint_model(model).findings)["identical_units"]
    assert {f["layer"] for f in found} == {"0", "2", "4"}
    rep = doctor(model, data, nn.CrossEntropyLoss())
    assert "init" in rep.recommended
    with torch.no_grad():
        model[2].weight.zero_()
    assert {f["layer"] for f in rules_of(lint_model(model).findings)["identical_units"]} == {
        "0",
        "4",
    }


@pytest.mark.parametrize(("scale", "rules"), [(1.0, set()), (8.0, {"exploding_signal"})])
def test_an_input_off_scale_is_named_and_not_blamed_on_the_layers(scale, rules):
    """Features of scale 1000 into a He-initialized MLP (every gain about 2): each layer read
    "E[y^2] = 2.6e6: the signal explodes here", and after LSUV brought the signal back to 1,
    "vanishing" (E[y^2] / E[x_0^2] = 7.6e-7); the input was never named. A net whose own gains
    explode on such an input is still flagged."""
    torch.manual_seed(0)
    model = _deep_mlp(4, nn.ReLU, scale)
    g = torch.Generator().manual_seed(0)
    batch = (1000 * torch.randn(64, 16, generator=g), torch.randint(0, 10, (64,), generator=g))
    found = rules_of(diagnose(model, batch, F.cross_entropy, spectra=False).findings)
    (inp,) = found["input_scale"]
    assert inp["severity"] == "bad" and inp["layer"] == "0"
    assert inp["value"] == pytest.approx(float(batch[0].double().square().mean()), rel=1e-6)
    assert "scale the data" in inp["message"] and "input_scale_for" in inp["message"]
    signal = {k for k in ("exploding_signal", "vanishing_signal") if k in found}
    assert signal == rules
    if rules:
        return
    from initlab import lsuv_

    lsuv_(model, batch[0], generator=0)  # the signal back to about 1 after every layer
    after = rules_of(diagnose(model, batch, F.cross_entropy, spectra=False).findings)
    assert "vanishing_signal" not in after and "input_scale" in after


def test_a_bias_that_dwarfs_the_weights_output_is_named():
    """Every bias at 10 in a He-initialized MLP: doctor named logits too large and a dead ReLU
    "driven negative by what feeds it", never the biases (E[b^2] = 100 of E[y^2] = 103)."""
    torch.manual_seed(0)
    model = _deep_mlp(4, nn.ReLU, 1.0)
    with torch.no_grad():
        for m in model:
            if isinstance(m, nn.Linear):
                m.bias.fill_(10.0)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(64, 16, generator=g), torch.randint(0, 10, (64,), generator=g))
    with torch.no_grad():  # the oracle: the first layer's output, in float64
        y = model[0].double()(batch[0].double())
        model.float()
    found = rules_of(diagnose(model, batch, F.cross_entropy, spectra=False).findings)
    first = next(f for f in found["bias_dominates"] if f["layer"] == "0")
    assert first["severity"] == "warn"
    assert first["value"] == pytest.approx(100.0 / float(y.square().mean()), rel=1e-5)
    torch.manual_seed(0)
    healthy = rules_of(
        diagnose(_deep_mlp(4, nn.ReLU, None), batch, F.cross_entropy, spectra=False).findings
    )  # torch's default init: biases of 1/sqrt(3 fan_in)
    assert "bias_dominates" not in healthy


def test_a_small_signal_after_a_normalization_is_a_warning_with_its_reason():
    """GPT-2's scaled residual projections read "bad: the signal vanishes here" in diagnose (and
    doctor ignored them in a normalized model): after a normalization it is warn, with why."""
    torch.manual_seed(0)
    normed = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 10))
    plain = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))
    for model in (normed, plain):
        with torch.no_grad():
            model[2].weight.mul_(1e-3)
            model[2].bias.zero_()
    batch = (torch.randn(64, 16), torch.randint(0, 10, (64,)))
    soft = rules_of(diagnose(normed, batch, F.cross_entropy, spectra=False).findings)
    (finding,) = [f for f in soft["vanishing_signal"] if f["layer"] == "2"]
    assert finding["severity"] == "warn" and "the next normalization resets" in finding["message"]
    hard = rules_of(diagnose(plain, batch, F.cross_entropy, spectra=False).findings)
    (finding,) = [f for f in hard["vanishing_signal"] if f["layer"] == "2"]
    assert finding["severity"] == "bad"
