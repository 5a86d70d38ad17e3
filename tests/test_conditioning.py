"""GR scaling and weight-to-gradient ratios against float64 computations written out by hand.

The oracles here use plain autograd on float64 models (per-example gradients by a loop over
examples) and the paper's formulas typed in directly, never the probe or initlab's helpers.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from initlab import diagnose, doctor, init_model
from initlab.measure.conditioning import (
    GR_COLUMNS,
    gr_scaling,
    gr_scaling_from_data,
    imbalance,
    with_multipliers,
)
from initlab.measure.probe import measure_moments

from .half_models import scaled_ce, small_gradient_batch, small_gradient_net

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")


def ce(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _nan_gradient(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy plus 0 whose gradient is NaN: d sqrt(u)/du at u = 0 is inf, times 0."""
    out = model(batch[0])
    return F.cross_entropy(out, batch[1]) + (out * 0).sqrt().sum()


def sq(t: torch.Tensor) -> float:
    return t.detach().square().mean().item()


def hand_layer_moments(model: nn.Sequential, layers: list[int], x, target):
    """Per layer: inputs, outputs, per-example output gradients (B * grad of the mean loss), and
    per-example weight/bias gradients by a loop over examples; all float64."""
    acts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    h = x
    for i, m in enumerate(model):
        out = m(h)
        if i in layers:
            out.retain_grad()
            acts[i] = (h, out)
        h = out
    loss = F.cross_entropy(h, target)
    loss.backward()
    b = x.shape[0]
    res = {}
    for i in layers:
        xin, y = acts[i]
        res[i] = {"x": xin.detach(), "y": y.detach(), "dy": y.grad * b}
        res[i]["dW_mb"] = model[i].weight.grad.detach().clone()
    model.zero_grad()
    ex_w = {i: 0.0 for i in layers}
    ex_b = {i: 0.0 for i in layers}
    for n in range(b):
        li = F.cross_entropy(model(x[n : n + 1]), target[n : n + 1])
        params = [p for i in layers for p in (model[i].weight, model[i].bias)]
        grads = torch.autograd.grad(li, params)
        for j, i in enumerate(layers):
            ex_w[i] += sq(grads[2 * j]) / b
            ex_b[i] += sq(grads[2 * j + 1]) / b
    for i in layers:
        res[i]["E_dW2_ex"] = ex_w[i]
        res[i]["E_db2_ex"] = ex_b[i]
    return res


def row(rows, module):
    hits = rows.filter(layer=module)
    assert len(hits) == 1
    return hits[0]


def test_gr_scaling_mlp_equals_hand_computation() -> None:
    """Prop. 3 (gamma), App. D (gamma_b) and nu for a 3-layer MLP, typed in from the paper."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(7, 24), nn.ReLU(), nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 5)
    ).to(F64)
    with torch.no_grad():
        model[0].bias.zero_()  # zero bias: nu_b undefined; the others keep torch's nonzero init
    x = torch.randn(40, 7, dtype=F64)
    target = torch.randint(0, 5, (40,))
    rows = gr_scaling_from_data(model, (x, target), ce)
    assert rows.columns == list(GR_COLUMNS)
    hand = hand_layer_moments(model, [0, 2, 4], x, target)
    for i in (0, 2, 4):
        h, r = hand[i], row(rows, str(i))
        n_in = model[i].in_features
        e_x2, e_y2, e_dy2 = sq(h["x"]), sq(h["y"]), sq(h["dy"])
        e_w2 = sq(model[i].weight)
        assert (r["kind"], r["n_in"], r["k2"], r["p2"]) == ("mlp", n_in, 1, 1.0)
        assert r["gamma_w"] == pytest.approx(n_in * e_x2**2 * e_dy2 / e_y2, rel=1e-9)
        assert r["gamma_b"] == pytest.approx(e_dy2 / e_y2, rel=1e-9)
        assert r["nu_w"] == pytest.approx(h["E_dW2_ex"] / e_w2, rel=1e-9)
        assert r["nu_w_minibatch"] == pytest.approx(sq(h["dW_mb"]) / e_w2, rel=1e-9)
        if i == 0:
            assert math.isnan(r["nu_b"]) and "bias is zero" in r["note"]
        else:
            assert r["nu_b"] == pytest.approx(h["E_db2_ex"] / sq(model[i].bias), rel=1e-9)
    gammas = [row(rows, m)["gamma_w"] for m in ("0", "2", "4")]
    med = statistics.median(gammas)
    assert [row(rows, m)["gamma_rel_median"] for m in ("0", "2", "4")] == pytest.approx(
        [g / med for g in gammas], rel=1e-12
    )


def test_gr_scaling_strided_conv_equals_hand_computation() -> None:
    """Eq. 1 with b = 1: gamma = n_in k^2 p^2 E[x^2]^2 E[dy^2]/E[y^2], p^2 = output positions."""
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3, stride=2, padding=1, padding_mode="circular"),
        nn.ReLU(),
        nn.Conv2d(6, 8, (3, 5), stride=2, padding=(1, 2)),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 3 * 3, 4),
    ).to(F64)
    x = torch.randn(12, 3, 10, 10, dtype=F64)
    target = torch.randint(0, 4, (12,))
    rows = gr_scaling_from_data(model, (x, target), ce)
    hand = hand_layer_moments(model, [0, 2, 5], x, target)
    for i, k2 in ((0, 9), (2, 15), (5, 1)):
        h, r = hand[i], row(rows, str(i))
        y = h["y"]
        p2 = y[0, 0].numel() if y.dim() == 4 else 1  # H' * W' output positions per channel
        n_in = h["x"].shape[1]
        e_x2, e_y2, e_dy2 = sq(h["x"]), sq(y), sq(h["dy"])
        assert (r["kind"], r["n_in"], r["k2"]) == ("conv" if i < 5 else "mlp", n_in, k2)
        assert r["p2"] == pytest.approx(p2, rel=1e-12)
        want = n_in * k2 * p2 * e_x2**2 * e_dy2 / e_y2
        assert r["gamma_w"] == pytest.approx(want, rel=1e-9)
        assert r["gamma_b"] == pytest.approx(p2 * e_dy2 / e_y2, rel=1e-9)
        assert r["nu_w"] == pytest.approx(h["E_dW2_ex"] / sq(model[i].weight), rel=1e-9)
    assert row(rows, "0")["p2"] == 25 and row(rows, "2")["p2"] == 9


def _strided_net(c: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, c, 3, stride=2, padding=1, padding_mode="circular"),
        nn.ReLU(),
        nn.Conv2d(c, 2 * c, 3, stride=2, padding=1, padding_mode="circular"),
        nn.ReLU(),
        nn.Conv2d(2 * c, 2 * c, 3, padding=1, padding_mode="circular"),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(2 * c * 16, 10),
    )


def _log_ratios(make, shape, seeds: int) -> list[list[float]]:
    out = []
    for seed in range(seeds):
        model = make()
        init_model(model, "geometric", generator=seed)
        g = torch.Generator().manual_seed(100 + seed)
        x = torch.randn(64, *shape, generator=g)
        t = torch.randint(0, 10, (64,), generator=g)
        rows = gr_scaling_from_data(model, (x, t), ce)
        out.append([math.log(r["nu_w"] / r["gamma_w"]) for r in rows])
    return out


def test_conv_gamma_equals_nu_at_init_seeded_average() -> None:
    """gamma_conv = nu_conv (module docstring derivation) on a strided conv net at init.

    The error is dominated by the finite width (one draw of the weights), not by the batch:
    across seeds the sd of log(nu/gamma) is about 0.01 / 0.06 / 0.10 for the three convs (16, 32,
    32 channels; measured once over 8 seeds), so the mean over 8 seeds has a standard error of at
    most 0.035; we allow 0.15 (4 SE). The test is sharp for the formula: leaving out the p^2
    factor would put the ratio off by p^2 = 64, 16, 16.
    """
    ratios = _log_ratios(lambda: _strided_net(16), (3, 16, 16), seeds=8)
    for layer in range(3):  # the convolutions
        mean = statistics.fmean(r[layer] for r in ratios)
        assert abs(mean) < 0.15, (layer, mean)
    # the first layer sees centred i.i.d. inputs: the position terms are uncorrelated exactly
    assert all(abs(r[0]) < 0.06 for r in ratios)


def test_prop4_mlp_gamma_equals_nu_at_init() -> None:
    """Prop. 4: gamma_l = nu_l for an MLP with i.i.d. mean-zero (geometric) init, i.i.d. inputs.

    Seed-to-seed sd of log(nu/gamma) (measured once over 8 seeds): 0.014, 0.04, 0.10 for the
    hidden layers and 0.26 for the 10-output last layer, whose E[y^2] = n E[W^2] E[x^2] holds only
    up to a sum over 10 rows (relative error ~ sqrt(2/10) of the activations' mean part). With 16
    seeds the standard errors are 0.004 / 0.01 / 0.025 / 0.065; allowed: 0.05 / 0.05 / 0.1 / 0.3.
    """
    ratios = []
    for seed in range(16):
        model = nn.Sequential(
            nn.Linear(32, 128),
            nn.ReLU(),
            nn.Linear(128, 96),
            nn.ReLU(),
            nn.Linear(96, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )
        init_model(model, "geometric", generator=seed)
        g = torch.Generator().manual_seed(200 + seed)
        x = torch.randn(256, 32, generator=g)
        t = torch.randint(0, 10, (256,), generator=g)
        rows = gr_scaling_from_data(model, (x, t), ce)
        ratios.append([math.log(r["nu_w"] / r["gamma_w"]) for r in rows])
    for layer, tol in enumerate((0.05, 0.05, 0.1, 0.3)):
        mean = statistics.fmean(r[layer] for r in ratios)
        assert abs(mean) < tol, (layer, mean)


def test_alpha_multiplies_gamma_and_nu_by_alpha4() -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
    x, t = torch.randn(32, 6), torch.randint(0, 3, (32,))
    probe = measure_moments(model, [(x, t)], ce)
    plain = gr_scaling(probe, examples=32)
    scaled = gr_scaling(probe, alpha={"0": 0.5}, examples=32)
    for col in ("gamma_w", "nu_w", "nu_w_minibatch"):
        assert row(scaled, "0")[col] == pytest.approx(row(plain, "0")[col] / 16, rel=1e-12)
        assert row(scaled, "2")[col] == row(plain, "2")[col]
    for col in ("gamma_b", "E_x2", "E_y2", "E_dy2"):
        assert row(scaled, "0")[col] == row(plain, "0")[col]
    again = with_multipliers(plain, {"0": 0.5})
    for a, b in zip(again, scaled, strict=True):
        for col in ("gamma_w", "nu_w", "gamma_rel_median", "alpha"):
            assert a[col] == pytest.approx(b[col], rel=1e-12)
    with pytest.raises(ValueError, match="alpha names modules"):
        gr_scaling(probe, alpha={"nope": 2.0})


def test_examples_needed_without_per_example_gradients() -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))
    x, t = torch.randn(16, 2, 4, 4), torch.randint(0, 3, (16,))
    full = gr_scaling(measure_moments(model, [(x, t)], ce))
    probe = measure_moments(model, [(x, t)], ce, per_example=False)
    blind = gr_scaling(probe)
    assert math.isnan(row(blind, "0")["gamma_w"]) and "examples=" in row(blind, "0")["note"]
    told = gr_scaling(probe, examples=16)
    assert row(told, "0")["gamma_w"] == pytest.approx(row(full, "0")["gamma_w"], rel=1e-12)
    assert row(told, "0")["p2"] == 16


def test_other_layer_types_get_nu_but_no_gamma() -> None:
    """A layer whose gamma is not derived (a GRU cell) is listed with NaN gamma and a note."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cell = nn.GRUCell(5, 6)
            self.head = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.cell(x))

    torch.manual_seed(4)
    x, t = torch.randn(8, 5), torch.randint(0, 3, (8,))
    rows = gr_scaling_from_data(Net(), (x, t), ce)
    cell = row(rows, "cell")
    assert cell["kind"] == "other" and math.isnan(cell["gamma_w"])
    assert "not derived" in cell["note"]
    assert row(rows, "head")["gamma_rel_median"] == 1.0


def test_imbalance_summary() -> None:
    rows = [
        {"layer": "a", "gamma_w": 4.0, "gamma_b": 0.5},
        {"layer": "b", "gamma_w": 1.0, "gamma_b": float("nan")},
        {"layer": "c", "gamma_w": 2.0, "gamma_b": 8.0},
        {"layer": "d", "gamma_w": float("nan"), "gamma_b": 1.0},
    ]
    imb = imbalance(rows)
    assert imb["spread"] == 4.0 and imb["median"] == 2.0 and imb["layers"] == 3
    assert (imb["argmax"], imb["argmin"]) == ("a", "b")
    assert imb["relative"] == {"a": 2.0, "b": 0.5, "c": 1.0}
    assert imb["spread_with_biases"] == 16.0
    assert math.isnan(imbalance([])["spread"])


# ------------------------------------------------------- gr_scaling(model, data, loss_fn)


def _gr_values(rows) -> list:
    return [(r["layer"], r["gamma_w"], r["nu_w"], r["p2"], r["note"]) for r in rows]


def test_gr_scaling_from_model_and_data_matches_the_probe_form():
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3)).double()
    gen = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(n, 6, generator=gen, dtype=F64), torch.randint(0, 3, (n,), generator=gen))
        for n in (16, 8)
    ]
    old = gr_scaling(measure_moments(model, data, ce), model, examples=24)
    forms = [ce, nn.CrossEntropyLoss(), F.cross_entropy, "cross_entropy"]
    for form in forms:
        rows = gr_scaling(model, data, form)
        assert _gr_values(rows) == _gr_values(old), form
        assert (rows.used.batches, rows.used.examples) == (2, 24)
    assert _gr_values(gr_scaling_from_data(model, data, ce)) == _gr_values(old)
    first = gr_scaling(model, data, ce, max_batches=1)
    assert first.used.batches == 1 and first.used.examples == 16
    assert _gr_values(first) == _gr_values(gr_scaling(model, data[0], ce))
    alpha = gr_scaling(model, data, ce, alpha={"0": 0.5})
    assert row(alpha, "0")["gamma_w"] == pytest.approx(row(old, "0")["gamma_w"] / 16, rel=1e-12)
    with pytest.raises(TypeError, match="second argument must be the model"):
        gr_scaling(measure_moments(model, data, ce), data)
    with pytest.raises(TypeError, match="pass the data"):
        gr_scaling(model)


def test_frozen_layers_are_out_of_the_median_and_the_spread() -> None:
    """A frozen middle (``requires_grad=False``) does not train: the trainable head and input
    layer were judged against it (its layers were the median). γ is still reported for it."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
        nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 5),
    )  # fmt: skip
    for layer in list(net)[2:-1]:
        layer.requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(32, 16, generator=gen), torch.randint(0, 5, (32,), generator=gen))]
    rows = {r["layer"]: r for r in gr_scaling(net, data, "cross_entropy")}
    assert [k for k, r in rows.items() if not r["trainable"]] == ["2", "4", "6"]
    assert all(math.isfinite(rows[k]["gamma_w"]) for k in rows)
    assert all(math.isnan(rows[k]["gamma_rel_median"]) for k in ("2", "4", "6"))
    assert "frozen" in rows["4"]["note"]
    med = (rows["0"]["gamma_w"] + rows["8"]["gamma_w"]) / 2  # the median of the two trainable
    assert rows["0"]["gamma_rel_median"] == pytest.approx(rows["0"]["gamma_w"] / med, rel=1e-12)
    spread = imbalance(list(rows.values()))
    assert spread["layers"] == 2 and set(spread["relative"]) == {"0", "8"}
    report = diagnose(net, data, "cross_entropy", spectra=False)
    frozen = [
        r
        for r in report.to_rows()
        if (r["layer"], r["param"], r["quantity"]) == ("4", "weight", "gamma")
    ]
    assert frozen and frozen[0]["note"].startswith("frozen") and frozen[0]["verdict"] in ("", "n/a")


def test_no_gradient_is_not_called_a_non_finite_one() -> None:
    """A layer under no_grad, a layer never called, an LSTM fed a PackedSequence: the loss is
    finite, so the note says what happened; only a NaN loss gives the not-finite note."""
    from torch.nn.utils.rnn import pack_padded_sequence

    class Silent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.nograd, self.unused, self.head = (
                nn.Linear(10, 16),
                nn.Linear(16, 16),
                nn.Linear(16, 3),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                h = F.relu(self.nograd(x))
            return self.head(h)

    class Packed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm, self.head = nn.LSTM(8, 12, batch_first=True), nn.Linear(12, 3)

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
            return self.head(self.lstm(packed)[1][0][-1])

    torch.manual_seed(0)
    x, t = torch.randn(32, 10), torch.randint(0, 3, (32,))
    rows = gr_scaling(Silent(), (x, t), ce)
    assert all("not finite" not in r["note"] for r in rows)
    assert row(rows, "nograd")["note"].startswith("no gradient reached this layer's output")
    assert row(rows, "unused")["note"].startswith("not called on this data")
    assert row(rows, "head")["note"] == ""
    # a finite loss with a NaN gradient (a NaN loss on finite outputs is refused: undefined)
    nan_grad = gr_scaling(Silent(), (x, t), _nan_gradient)
    assert "not finite" in row(nan_grad, "head")["note"]

    xs, lengths, y = torch.randn(5, 6, 8), torch.tensor([6, 3, 4, 2, 5]), torch.randint(0, 3, (5,))
    packed = gr_scaling(Packed(), (xs, lengths, y), lambda m, b: F.cross_entropy(m(*b[:2]), b[2]))
    note = row(packed, "lstm")["note"]
    assert "not finite" not in note and "PackedSequence" in note


def test_a_layer_whose_weight_is_used_directly_is_not_said_to_get_no_gradient() -> None:
    # Mamba calls F.conv1d(x, self.conv1d.weight, ...): the note said "not called on this data
    # ... so it gets no gradient" beside a gradient of norm 0.087
    class Direct(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.head = nn.Conv1d(4, 4, 3, padding=1), nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = F.conv1d(x, self.conv.weight, self.conv.bias, padding=1)
            return self.head(h.mean(-1))

    torch.manual_seed(0)
    x, t = torch.randn(16, 4, 7), torch.randint(0, 3, (16,))
    note = row(gr_scaling(Direct(), (x, t), ce), "conv")["note"]
    assert note.startswith("its forward was not called, yet its weight got a gradient"), note


def test_a_forward_hook_that_scales_a_layer_output_is_a_multiplier_after_it() -> None:
    """A user's forward hook that replaces a layer's output (initlab's own OutputScaleHook from
    scale_output_(how="hook", module=...)): the probe read the replaced output as the layer's,
    so its gamma moved by 1/s^4 (doctor then said its own fix wrecked the balance). The layer's
    numbers equal those of the same multiplier as a module after it."""
    from initlab.methods.output_scale import OutputScale, OutputScaleHook

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    x, y = torch.randn(64, 8), torch.randint(0, 4, (64,))
    explicit = {r["layer"]: r for r in gr_scaling(nn.Sequential(base, OutputScale(0.05)), (x, y))}
    handle = base[2].register_forward_hook(OutputScaleHook(0.05))
    hooked = {r["layer"]: r for r in gr_scaling(base, (x, y))}
    handle.remove()
    for name in ("0", "2"):
        for key in ("E_y2", "E_dy2", "gamma_w"):
            assert hooked[name][key] == pytest.approx(explicit[f"0.{name}"][key], rel=1e-6)


def test_a_layer_whose_output_gradient_underflowed_says_so() -> None:
    """E[dy^2] underflows to 0 in float32 (a gradient of ~1e-25): gamma is 0 with the reason,
    not a silent 0."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)

    def tiny_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]), batch[1]) * 1e-30

    rows = {r["layer"]: r for r in gr_scaling(net, [(x, t)], tiny_loss)}
    assert rows["0"]["E_dy2"] == 0.0 and rows["0"]["gamma_w"] == 0.0
    assert "E[dy^2] = 0" in rows["0"]["note"] and "underflow" in rows["0"]["note"]


def _output_gradient(model: nn.Module, layer: nn.Module, batch: tuple) -> torch.Tensor:
    """dL/dy at ``layer``'s output, by a plain hook (the oracle)."""
    got: dict[str, torch.Tensor] = {}

    def keep(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.register_hook(lambda g: got.__setitem__("dy", g.detach().double()))

    handle = layer.register_forward_hook(keep)
    scaled_ce(model, batch).backward()
    handle.remove()
    model.zero_grad(set_to_none=True)
    return got["dy"]


@pytest.mark.parametrize("how", ["half", "autocast"])
def test_a_gradient_below_float16s_smallest_subnormal_is_named_float16_underflow(how: str) -> None:
    """A float16 model (or float32 weights under float16 autocast) whose gradient at a layer's
    output is below 2^-24: float16 rounds it to 0. The note said "no gradient reaches this
    layer's output (... underflow to 0 in float32)", where the float32 copy measures it; it now
    names float16's range and the float32 copy."""
    x, t = small_gradient_batch()
    net64 = small_gradient_net().to(F64)
    dy = _output_gradient(net64, net64[0], (x.to(F64), t))
    assert 0.0 < float(dy.abs().max()) < 2.0**-25  # rounds to 0 in float16
    b = x.shape[0]  # per-example gradients of a mean loss: b * dy
    want = float((b * dy).pow(2).mean())
    r32 = {r["layer"]: r for r in gr_scaling(small_gradient_net(), [(x, t)], scaled_ce)}["0"]
    assert r32["E_dy2"] == pytest.approx(want, rel=1e-4) and "float16" not in r32["note"]

    if how == "half":
        net, batch, loss = small_gradient_net().half(), (x.half(), t), scaled_ce
        assert float(_output_gradient(net, net[0], batch).abs().max()) == 0.0
    else:
        net, batch = small_gradient_net(), (x, t)

        def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.float16):
                return scaled_ce(model, batch)

    rows = {r["layer"]: r for r in gr_scaling(net, [batch], loss)}
    r16 = rows["0"]
    assert r16["E_dy2"] == 0.0 and r16["gamma_w"] == 0.0
    note = r16["note"]
    assert "float16" in note and "5.96e-08" in note and "may have underflowed" in note, note
    assert "float32 copy" in note and "GradScaler" in note, note
    assert "no gradient reaches" not in note and "in float32" not in note, note
    assert rows["4"]["E_dy2"] > 0 and "float16" not in rows["4"]["note"]


class _Float32First(nn.Module):
    """A float32 first layer feeding float16 layers (a float32 embedding, transformers'
    ``_keep_in_fp32_modules``)."""

    def __init__(self, net: nn.Sequential) -> None:
        super().__init__()
        self.first, self.rest = net[0], net[1:].half()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rest(self.first(x).half())


def test_a_float32_layer_feeding_float16_layers_gets_their_underflow_named() -> None:
    """The gradient at a float32 layer passed through the float16 layers after it and
    underflowed there (4e-15 in float32, 0 here): the note blamed float32's range and doctor
    graded the layer bad; the zero is named as possible float16 underflow, and doctor applies
    no fix for it."""
    x, t = small_gradient_batch()
    row = {r["layer"]: r for r in gr_scaling(_Float32First(small_gradient_net()), [(x, t)],
                                             scaled_ce)}["first"]  # fmt: skip
    assert row["E_dy2"] == 0.0
    assert "may have underflowed float16" in row["note"] and "in float32" not in row["note"]
    report = doctor(_Float32First(small_gradient_net()), [(x, t)], scaled_ce, generator=0)
    assert report.recommended == []


def test_a_bfloat16_gradient_that_underflows_is_float32s_underflow_not_float16s() -> None:
    """bfloat16 has float32's range: a gradient whose squares underflow there (~1e-31) keeps the
    float32 note, word for word (no float16 blamed)."""
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)

    def tiny_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]), batch[1]) * 1e-30

    notes = []
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 3)).to(dtype)
        row = {r["layer"]: r for r in gr_scaling(net, [(x.to(dtype), t)], tiny_loss)}["0"]
        assert row["E_dy2"] == 0.0
        notes.append(row["note"])
    assert notes[0] == notes[1] and "float16" not in notes[1] and "in float32" in notes[1]


class _TimeMajor(nn.Module):
    """A projection of a time-major ``(T, B, F)`` input (batch_first=False), pooled over time."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.batch_first = batch_first
        self.inp, self.head = nn.Linear(3, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inp(x).tanh().mean(dim=1 if self.batch_first else 0))


def test_gr_scaling_takes_batch_dim_for_a_time_major_model() -> None:
    """The probe's "batch size is unclear" message says to pass batch_dim=, which gr_scaling
    did not take (TypeError); now it passes it to measure_moments."""
    x = torch.randn(6, 4, 3, generator=torch.Generator().manual_seed(1))  # (B=6, T=4, F)
    loss = lambda m, b: m(b).square().mean()  # noqa: E731
    ref = {r["layer"]: r for r in gr_scaling(_TimeMajor(True), x, loss)}
    got = {r["layer"]: r for r in gr_scaling(_TimeMajor(False), x.transpose(0, 1), loss,
                                             batch_dim=1)}  # fmt: skip
    assert got["inp"]["gamma_w"] == pytest.approx(ref["inp"]["gamma_w"], rel=1e-5)


def test_gr_scaling_names_itself_in_the_errors_of_its_data() -> None:
    """Its data's errors were measure_moments's ("measure_moments: max_batches must be ...")."""
    model = nn.Sequential(nn.Linear(3, 2))
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    with pytest.raises(ValueError, match=r"^gr_scaling: max_batches must be a positive int"):
        gr_scaling(model, [(x, y)], max_batches=0)
    with pytest.raises(TypeError, match=r"^gr_scaling: the batch holds a numpy array"):
        gr_scaling(model, (x.numpy(), y))


def _mean_gradient_ratio(model: nn.Module, layer: nn.Linear, batches, summed) -> float:
    """E[dW^2] / E[W^2] of the mean over each batch's examples of their own gradients,
    ``(1/B) sum_i dL_i/dW`` (``summed(out, target)``: the batch's sum of the ``L_i``), pooled over
    the batches; float64 autograd."""
    got = []
    for x, t in batches:
        model.zero_grad()
        summed(model(x), t).backward()
        got.append(sq(layer.weight.grad / x.shape[0]))
    model.zero_grad()
    return statistics.fmean(got) / sq(layer.weight)


@pytest.mark.parametrize("counted", ["all", "ignored_and_weighted"])
def test_nu_w_minibatch_is_the_mean_over_examples_whatever_the_reduction(counted) -> None:
    """``nu_w_minibatch`` uses ``(1/B) sum_i dW_i``, the per-example gradients of ``nu_w``: a sum-
    reduced loss gives the mean-reduced loss's value (it was B^2 times it), on ragged batches, with
    ignored targets and class weights; one batch of 16 lies in the documented [nu_w/B, nu_w]."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(F64)
    x, t = torch.randn(16, 5, dtype=F64), torch.randint(0, 3, (16,))
    kw = {}
    if counted != "all":
        t[:5] = -100
        kw = {"weight": torch.tensor([1.0, 5.0, 0.2], dtype=F64)}
    summed = lambda o, y: F.cross_entropy(o, y, reduction="sum", **kw)  # noqa: E731
    for batches in ([(x, t)], [(x[:11], t[:11]), (x[11:], t[11:])]):
        rows = {
            red: gr_scaling(model, batches, nn.CrossEntropyLoss(reduction=red, **kw))
            for red in ("mean", "sum")
        }
        for i in (0, 2):
            want = _mean_gradient_ratio(model, model[i], batches, summed)
            for red in ("mean", "sum"):
                assert row(rows[red], str(i))["nu_w_minibatch"] == pytest.approx(want, rel=1e-9)
            if len(batches) == 1:
                r = row(rows["sum"], str(i))
                assert r["nu_w"] / 16 <= r["nu_w_minibatch"] <= r["nu_w"]


def test_nu_w_minibatch_of_token_losses_and_of_the_models_own_loss() -> None:
    """Per-token losses: ``B`` counts sequences, as for ``nu_w``, so a sum over tokens gives the
    gradient over ``B`` (and ``nu_w`` and the column change together). A model's own loss on
    labels with -100 (Hugging Face's convention) gives the mean over the examples either way."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(F64)
    x, t = torch.randn(5, 7, 4, dtype=F64), torch.randint(0, 3, (5, 7))
    tokens = lambda o, y: F.cross_entropy(o.reshape(-1, 3), y.reshape(-1), reduction="sum")  # noqa: E731
    mean = gr_scaling(model, (x, t), nn.CrossEntropyLoss())
    summed = gr_scaling(model, (x, t), nn.CrossEntropyLoss(reduction="sum"))
    for i in (0, 2):
        want = _mean_gradient_ratio(model, model[i], [(x, t)], tokens)
        m, s = row(mean, str(i)), row(summed, str(i))
        assert s["nu_w_minibatch"] == pytest.approx(want, rel=1e-9)
        assert m["nu_w_minibatch"] == pytest.approx(want / 7**2, rel=1e-9)  # mean over 35 tokens
        assert s["nu_w_minibatch"] / s["nu_w"] == pytest.approx(
            m["nu_w_minibatch"] / m["nu_w"], rel=1e-9
        )
        assert s["nu_w_minibatch"] <= s["nu_w"]  # Cauchy-Schwarz; nu_w / B needs independence

    class OwnLoss(nn.Module):
        def __init__(self, reduction: str) -> None:
            super().__init__()
            self.body, self.reduction = model, reduction

        def forward(self, inputs, labels):
            logits = self.body(inputs)
            return {
                "logits": logits,
                "loss": F.cross_entropy(logits, labels, reduction=self.reduction),
            }

    x, t = torch.randn(9, 4, dtype=F64), torch.randint(0, 3, (9,))
    t[::3] = -100
    batches = [{"inputs": x[:6], "labels": t[:6]}, {"inputs": x[6:], "labels": t[6:]}]
    pairs = [(b["inputs"], b["labels"]) for b in batches]
    for red in ("mean", "sum"):
        rows = gr_scaling(OwnLoss(red), batches, loss_reduction=red)
        for i in (0, 2):
            want = _mean_gradient_ratio(
                model, model[i], pairs, lambda o, y: F.cross_entropy(o, y, reduction="sum")
            )
            assert row(rows, f"body.{i}")["nu_w_minibatch"] == pytest.approx(want, rel=1e-9)
