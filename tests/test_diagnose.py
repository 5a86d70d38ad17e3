"""diagnose() against float64 computations written out by hand, on five model families, and its
report exits (pandas, markdown, JSON round trip, one self-contained HTML file)."""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from initlab import AmbiguousDataError, Batches, init_model
from initlab._core.data import DataUse
from initlab.cli.diagnose import diagnose_command
from initlab.diagnostics import (
    DIAGNOSTIC_COLUMNS,
    LAYER_COLUMNS,
    Report,
    diagnose,
    gradient_stats,
    make_loss,
)
from initlab.diagnostics.gradients import GradientStats
from initlab.diagnostics.report import ratio_reason, ratio_verdict

from .conformance_models import CPU_DATA_PARALLEL
from .half_models import HandNorm, ln_net, scaled_ce, small_gradient_batch, small_gradient_net

F64 = torch.float64


def has_conditioning() -> bool:
    try:
        from initlab.measure.conditioning import gr_scaling  # noqa: F401
    except ImportError:
        return False
    return True


needs_conditioning = pytest.mark.skipif(
    not has_conditioning(), reason="initlab.measure.conditioning (gamma) has not landed"
)


def mlp3(seed: int = 0, widths: tuple[int, ...] = (6, 12, 10, 4)) -> nn.Sequential:
    torch.manual_seed(seed)
    a, b, c, d = widths
    return nn.Sequential(
        nn.Linear(a, b), nn.ReLU(), nn.Linear(b, c), nn.ReLU(), nn.Linear(c, d)
    ).to(F64)


# ----------------------------------------------------------------------------- gamma and nu


def hand_gamma_nu(model: nn.Sequential, x: torch.Tensor, t: torch.Tensor) -> dict[str, tuple]:
    """gamma_w, gamma_b and per-example nu_w of each Linear, by explicit float64 autograd."""
    layers = [(str(i), m) for i, m in enumerate(model) if isinstance(m, nn.Linear)]
    weights = [m.weight.detach().clone().requires_grad_(True) for _, m in layers]
    biases = [m.bias.detach().clone().requires_grad_(True) for _, m in layers]
    h, xs, ys = x, [], []
    for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
        xs.append(h)
        y = h @ w.T + b
        ys.append(y)
        h = torch.relu(y) if i < len(weights) - 1 else y
    losses = F.cross_entropy(h, t, reduction="none")  # one loss per example
    dys = torch.autograd.grad(losses.sum(), ys, retain_graph=True)  # row i: d loss_i / d y_i
    out = {}
    for k, (name, _) in enumerate(layers):
        n_in = weights[k].shape[1]
        e_x2, e_y2, e_dy2 = (t_.detach().square().mean().item() for t_ in (xs[k], ys[k], dys[k]))
        gamma_w = n_in * e_x2**2 * e_dy2 / e_y2
        gamma_b = e_dy2 / e_y2
        # per-example weight gradients, one autograd call per example
        sq = 0.0
        for i in range(x.shape[0]):
            (g,) = torch.autograd.grad(losses[i], weights[k], retain_graph=True)
            sq += g.square().sum().item()
        nu_w = sq / (x.shape[0] * weights[k].numel()) / weights[k].detach().square().mean().item()
        out[name] = (gamma_w, gamma_b, nu_w)
    return out


@needs_conditioning
def test_gamma_and_nu_match_a_hand_computation():
    model = mlp3()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, 6, generator=g, dtype=F64)
    t = torch.randint(0, 4, (24,), generator=g)
    report = diagnose(model, (x, t), make_loss("cross_entropy"))
    for layer, (gamma_w, gamma_b, nu_w) in hand_gamma_nu(model, x, t).items():
        assert report.value(layer, "gamma", "weight") == pytest.approx(gamma_w, rel=1e-9)
        assert report.value(layer, "gamma", "bias") == pytest.approx(gamma_b, rel=1e-9)
        assert report.value(layer, "nu", "weight") == pytest.approx(nu_w, rel=1e-9)
    wide = {r["layer"]: r for r in report.layers}
    gammas = {k: v[0] for k, v in hand_gamma_nu(model, x, t).items()}
    median = sorted(gammas.values())[1]
    for layer, gamma in gammas.items():
        assert wide[layer]["gamma_rel_median"] == pytest.approx(gamma / median, rel=1e-9)
    assert report.meta["imbalance"]["gamma_max_over_min"] == pytest.approx(
        max(gammas.values()) / min(gammas.values()), rel=1e-9
    )
    # probing only the weight layers gives the same gamma and nu
    lean = diagnose(model, (x, t), make_loss("cross_entropy"), modules="weights", spectra=False)
    for layer in gammas:
        for q in ("gamma", "nu"):
            assert lean.value(layer, q, "weight") == report.value(layer, q, "weight")


@needs_conditioning
def test_prop4_gamma_equals_nu_for_an_mlp_at_init():
    """Prop. 4: gamma_l = nu_l for i.i.d. mean-zero layers. One draw has sampling error (the
    post-ReLU inputs are not centred, A1), so we average log(gamma / nu) over seeded draws and
    allow 4 standard errors of that mean plus 2% for the second-order bias of non-centred inputs
    (measured: -0.6%, -3% +- 2%, -1.5% for the three layers)."""
    logs = []
    for seed in range(8):
        g = torch.Generator().manual_seed(100 + seed)
        model = mlp3(seed, (32, 128, 128, 64))
        init_model(model, "geometric", generator=seed)  # zero biases
        x = torch.randn(512, 32, generator=g, dtype=F64)
        t = torch.randint(0, 64, (512,), generator=g)
        rep = diagnose(model, (x, t), make_loss("cross_entropy"), spectra=False, lint=False,
                       gradients=False)  # fmt: skip
        logs.append([
            math.log(rep.value(n, "gamma", "weight") / rep.value(n, "nu", "weight"))
            for n in ("0", "2", "4")
        ])  # fmt: skip
    per_layer = torch.tensor(logs, dtype=F64)
    mean = per_layer.mean(0)
    stderr = per_layer.std(0) / math.sqrt(len(logs))
    assert bool((mean.abs() <= 4 * stderr + 0.02).all()), (mean, stderr)


def test_ratio_verdicts_and_reason_text():
    assert ratio_verdict(3.9) == "ok" and ratio_verdict(1 / 3.9) == "ok"
    assert ratio_verdict(12) == "warn" and ratio_verdict(1 / 12) == "warn"
    assert ratio_verdict(150) == "bad" and ratio_verdict(1 / 150) == "bad"
    assert ratio_reason("γ", 12) == (
        "γ 12× the median: this layer learns 12× faster than the median layer at the same "
        "learning rate"
    )
    assert "4× slower" in ratio_reason("γ", 0.25)


@needs_conditioning
def test_a_conditioning_multiplier_shows_up_as_a_gamma_verdict():
    model = mlp3(3, (16, 32, 32, 8))
    init_model(model, "geometric", generator=0)
    data = (torch.randn(128, 16, dtype=F64), torch.randint(0, 8, (128,)))
    base = diagnose(model, data, spectra=False, lint=False)
    scaled = diagnose(model, data, alpha={"2": 3.0}, spectra=False, lint=False)
    # alpha multiplies gamma by alpha^4 = 81 and leaves the other layers unchanged
    g0, g1 = base.value("2", "gamma", "weight"), scaled.value("2", "gamma", "weight")
    assert g1 == pytest.approx(81 * g0, rel=1e-9)
    verdict, reason = scaled.verdicts["2"]
    assert verdict in ("warn", "bad") and reason.startswith("γ ")
    assert "faster than the median layer" in reason


# ----------------------------------------------------------------------------- GradInit stats


def test_weight_magnitude_and_gradient_std_across_three_batches():
    model = mlp3(4)
    g = torch.Generator().manual_seed(5)
    batches = [
        (torch.randn(16, 6, generator=g, dtype=F64), torch.randint(0, 4, (16,), generator=g))
        for _ in range(3)
    ]
    report = diagnose(model, batches, make_loss("cross_entropy"))
    params = dict(model.named_parameters())
    grads = {name: [] for name in params}
    for x, t in batches:
        loss = F.cross_entropy(model(x), t)
        for name, gr in zip(params, torch.autograd.grad(loss, list(params.values())), strict=True):
            grads[name].append(gr)
    for name, p in params.items():
        layer, _, param = name.rpartition(".")
        stack = torch.stack(grads[name])
        w = p.detach()
        assert report.value(layer, "W_norm", param) == pytest.approx(w.norm().item(), rel=1e-12)
        assert report.value(layer, "W_abs_mean", param) == pytest.approx(
            w.abs().mean().item(), rel=1e-12
        )
        assert report.value(layer, "grad_std", param) == pytest.approx(
            stack.std(0, unbiased=True).mean().item(), rel=1e-9
        )
        assert report.value(layer, "grad_norm", param) == pytest.approx(
            stack.flatten(1).norm(dim=1).mean().item(), rel=1e-9
        )
        # minibatch nu with its standard error over the 3 batches
        per_batch = stack.flatten(1).square().mean(1) / w.square().mean()
        row = next(r for r in report.rows if r["layer"] == layer and r["param"] == param
                   and r["quantity"] == "nu_minibatch")  # fmt: skip
        assert row["value"] == pytest.approx(per_batch.mean().item(), rel=1e-9)
        assert row["stderr"] == pytest.approx(per_batch.std().item() / math.sqrt(3), rel=1e-9)


def test_gradient_stats_standalone_leaves_the_model_alone():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    xs = [torch.randn(8, 3) for _ in range(3)]
    with pytest.raises(AmbiguousDataError):  # three batches, or one batch of three tensors?
        gradient_stats(model, xs, lambda m, x: m(x).square().mean())
    rows = gradient_stats(model, Batches(xs), lambda m, x: m(x).square().mean())
    assert {r["batches"] for r in rows} == {3}
    assert (rows.used.batches, rows.used.examples) == (3, 24)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


# ----------------------------------------------------------------------------- model families


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


def resnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU(inplace=True),
        Block(6), Block(6), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 5),
    )  # fmt: skip


def cnn_bn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, stride=2, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
        nn.Conv2d(6, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5),
    )  # fmt: skip


class Encoder(nn.Module):
    def __init__(self, vocab: int = 23, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


class Tied(nn.Module):
    def __init__(self, vocab: int = 23, dim: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mid(self.embed(tokens))))


def image_batches() -> list:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 5, (8,), generator=g))
            for _ in range(2)]  # fmt: skip


def token_batches() -> list:
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 23, (4, 5), generator=g), torch.randint(0, 23, (4, 5), generator=g))
            for _ in range(2)]  # fmt: skip


def mlp_batches() -> list:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 6, generator=g), torch.randint(0, 4, (16,), generator=g))
            for _ in range(2)]  # fmt: skip


CASES: list[tuple[str, Callable[[], nn.Module], Callable[[], list]]] = [
    ("mlp", lambda: mlp3().float(), mlp_batches),
    ("cnn_bn_train", cnn_bn, image_batches),
    ("resnet_inplace_relu", resnet, image_batches),
    ("transformer_encoder", Encoder, token_batches),
    ("tied_embeddings", Tied, token_batches),
]


def snapshot(model: nn.Module) -> tuple:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    modes = {n: m.training for n, m in model.named_modules()}
    grads = {n: p.grad for n, p in model.named_parameters()}
    grad_values = {n: None if g is None else g.clone() for n, g in grads.items()}
    return state, modes, grads, grad_values


@pytest.mark.parametrize(("name", "build", "data"), CASES, ids=[c[0] for c in CASES])
def test_diagnose_runs_and_leaves_the_model_unchanged(name, build, data):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    model = build()
    model.train()
    if name == "mlp":
        model[2].eval()  # a mixed mode that must survive
    first = next(model.parameters())
    first.grad = torch.full_like(first, 0.5)  # an accumulated gradient that must survive
    state, modes, grads, grad_values = snapshot(model)
    rng = torch.get_rng_state()
    with sdpa_kernel(SDPBackend.MATH):  # math attention for the transformer
        report = diagnose(model, data(), progress=lambda _msg: None)

    # unchanged: state dict bitwise (BN running stats included), modes, grads, RNG
    after = model.state_dict()
    assert after.keys() == state.keys()
    for k, v in after.items():
        assert torch.equal(v, state[k]), k
    assert {n: m.training for n, m in model.named_modules()} == modes
    for n, p in model.named_parameters():
        assert p.grad is grads[n]
        if p.grad is not None:
            assert torch.equal(p.grad, grad_values[n])
    assert torch.equal(torch.get_rng_state(), rng)

    # rows for every parameterized module, finite where expected
    owners = {n for n, m in model.named_modules() if next(m.parameters(False), None) is not None}
    layers = {r["layer"] for r in report.layers}
    assert owners <= layers
    uncalled = {r["layer"] for r in report.layers if r["layer"] in owners and r["order"] is None}
    # MultiheadAttention uses its out_proj's weights without calling it: the only exception
    assert all(n.endswith("self_attn.out_proj") for n in uncalled), uncalled
    for layer in owners - uncalled:
        assert math.isfinite(report.value(layer, "E_y2")), layer
    weights = [r for r in report.layers if r["layer"] in owners and r["shape"] is not None]
    for r in weights:
        assert math.isfinite(r["nu"]) or math.isfinite(r["nu_minibatch"]), r["layer"]
        assert math.isfinite(r["W_abs_mean"]) and math.isfinite(r["grad_std"]), r["layer"]
    linear_like = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    for layer in linear_like:
        if layer.endswith("out_proj"):
            continue  # used functionally inside MultiheadAttention: no probe rows of its own
        assert math.isfinite(report.value(layer, "op_norm", "weight")), layer
        if has_conditioning():
            assert math.isfinite(report.value(layer, "gamma", "weight")), layer
    assert {r["verdict"] for r in report.layers} <= {"ok", "warn", "bad"}
    assert set(report.rows.columns) == set(DIAGNOSTIC_COLUMNS)
    assert report.layers.columns == list(LAYER_COLUMNS)
    if name == "resnet_inplace_relu":
        assert {b["name"] for b in report.meta["residual_blocks"]} == {"3", "4"}
        assert math.isfinite(report.meta["lipschitz"]["residual"])
    if name == "cnn_bn_train":
        # train-mode BN: per-example gradients are undefined, the minibatch nu stands in
        assert any("BatchNorm" in n for n in report.meta["notes"])


# ----------------------------------------------------------------------------- exits


@pytest.fixture(scope="module")
def small_report() -> Report:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(16, 3))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(2)]  # fmt: skip
    return diagnose(model, data, name="tiny cnn")


def rows_equal(a, b) -> bool:
    def same(x, y) -> bool:
        if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
            return True
        return x == y

    return len(a) == len(b) and all(
        r.keys() == s.keys() and all(same(r[k], s[k]) for k in r) for r, s in zip(a, b, strict=True)
    )


def test_report_round_trips_through_json_and_pandas(small_report):
    text = small_report.to_json()
    json.loads(text)  # strict JSON: no NaN tokens
    assert "NaN" not in text
    back = Report.from_json(text)
    assert rows_equal(back.rows.to_rows(), small_report.rows.to_rows())
    assert rows_equal(back.layers.to_rows(), small_report.layers.to_rows())
    assert rows_equal(back.findings.to_rows(), small_report.findings.to_rows())
    for name, table in small_report.tables.items():
        assert rows_equal(back.tables[name].to_rows(), table.to_rows()), name
    assert back.meta["model"] == "tiny cnn"
    df = small_report.to_pandas()
    assert list(df.columns) == list(DIAGNOSTIC_COLUMNS) and len(df) == len(small_report.rows)
    df_back = back.to_pandas()
    assert df_back.equals(df)
    assert list(small_report.to_pandas("layers").columns) == list(LAYER_COLUMNS)
    md = small_report.to_markdown()
    assert "### Per-layer summary" in md and "| 2 | max_pool | warn |" in md


def test_save_html_is_one_self_contained_file(small_report, tmp_path):
    path = small_report.save_html(tmp_path / "report.html")
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]
    text = path.read_text(encoding="utf-8")
    assert '<img src="data:image/png;base64,' in text
    assert text.count("data:image/png;base64,") >= 3
    assert "<table>" in text and "max_pool" in text and "Per-layer summary" in text
    assert not re.search(r"https?://", text)
    assert "<link" not in text and "<script" not in text and "url(" not in text
    assert 'src="' not in text.replace('src="data:image/png;base64,', "")


def test_summary_lists_each_layer_with_its_verdict(small_report):
    text = small_report.summary()
    assert "tiny cnn" in text
    for r in small_report.layers:
        assert re.search(rf"^\s+{re.escape(r['layer'] or '<root>')}\s+{r['verdict']}", text, re.M)
    assert small_report.verdicts["2"][0] == "warn"  # the max pool
    assert "max pooling" in small_report.verdicts["2"][1]


# ----------------------------------------------------------------------------- options


def test_curvature_rows_and_plots(tmp_path):
    model = mlp3(7, (5, 8, 8, 3)).float()
    data = (torch.randn(32, 5), torch.randint(0, 3, (32,)))
    report = diagnose(model, data, curvature=True, curvature_options={"probes": 4})
    assert "curvature" in report.tables, report.meta["notes"]
    curv = report.tables["curvature"]
    assert len(curv) == 6 * 6  # full L x L map of the 6 parameter tensors
    for layer in ("0", "2", "4"):
        for param in ("weight", "bias"):
            assert report.value(layer, "curv_block", param) > 0
            assert math.isfinite(report.value(layer, "curv_theory_ratio", param))
    report.save_html(tmp_path / "r.html")
    text = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert "Hessian blocks" in text and "Theory vs actual" in text


def _f16_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g).half().float(), torch.randint(0, 4, (8,), generator=g)


def test_curvature_of_a_float16_layernorm_model_matches_float32():
    """torch's native layer_norm double backward overflows float16: the LayerNorm's input
    layer had NaN curv_block and curv_theory_ratio rows, empty verdicts and no note. The same
    weights and probes in float16 and float32 now agree to 1% (float16 products: 11 bits,
    5e-4 per rounding; seen 3e-4)."""
    x, y = _f16_batch()
    reports = {}
    for dtype in (torch.float32, torch.float16):
        reports[dtype] = diagnose(ln_net().to(dtype), (x.to(dtype), y), nn.CrossEntropyLoss(),
                                  curvature=True, generator=0, spectra=False)  # fmt: skip
    for layer in ("0", "3"):
        for param in ("weight", "bias"):
            for quantity in ("curv_block", "curv_theory_ratio"):
                wide = reports[torch.float32].value(layer, quantity, param)
                half = reports[torch.float16].value(layer, quantity, param)
                assert math.isfinite(half) and half == pytest.approx(wide, rel=1e-2)
    assert not [n for n in reports[torch.float16].meta["notes"] if "NaN" in n]


def test_nonfinite_curvature_products_get_a_note_naming_float16():
    """Products still NaN in float16 (a normalization written by hand) left NaN rows with
    nothing said; a note names the blocks, float16 and the float32 copy now."""
    x, y = _f16_batch()
    model = ln_net(scale=0.01, norm=HandNorm()).half()
    report = diagnose(model, (x.half(), y), nn.CrossEntropyLoss(), curvature=True, generator=0,
                      spectra=False)  # fmt: skip
    assert math.isnan(report.value("0", "curv_block", "weight"))
    notes = [n for n in report.meta["notes"] if n.startswith("curvature: products held NaN/inf")]
    assert len(notes) == 1 and "(0.weight, 0.bias)" in notes[0], report.meta["notes"]
    assert "float16" in notes[0] and "float32 copy" in notes[0]


@CPU_DATA_PARALLEL
def test_a_data_parallel_model_gets_its_curvature():
    """The curvature was dropped with torch's note ("can't be used with nn.DataParallel")."""
    model = nn.DataParallel(mlp3(7, (5, 8, 8, 3)).float())
    data = (torch.randn(32, 5), torch.randint(0, 3, (32,)))
    report = diagnose(model, data, curvature=True, curvature_options={"probes": 2}, spectra=False)
    assert "curvature" in report.tables, report.meta["notes"]
    assert report.value("module.0", "curv_block", "weight") > 0


def test_landscape_is_embedded_and_plotted(tmp_path):
    class FakeLandscape:
        def to_rows(self):
            return [{"t1": a / 4, "t2": b / 4, "loss": (a / 4) ** 2 + 2 * (b / 4) ** 2}
                    for a in range(-4, 5) for b in range(-4, 5)]  # fmt: skip

    model = mlp3(8).float()
    report = diagnose(model, mlp_batches(), landscape=FakeLandscape(), spectra=False)
    assert len(report.tables["landscape"]) == 81
    figs = report.figures()
    assert "Loss landscape" in figs


def test_plot_gamma_nu_compares_several_reports():
    from initlab.diagnostics.plots import plot_gamma_nu, plot_weight_grad

    reports = {}
    for scheme in ("fan_in", "geometric"):
        model = mlp3(9, (8, 32, 16, 4)).float()
        init_model(model, scheme, generator=0)
        reports[scheme] = diagnose(model, _mlp8(), spectra=False)
    fig = plot_gamma_nu(reports)
    axes = fig.get_axes()
    assert len(axes) == 2 and axes[0].get_yscale() == "log"
    assert [t.get_text() for t in axes[0].get_legend().get_texts()] == ["fan_in", "geometric"]
    assert len(plot_weight_grad(reports).get_axes()) == 2


def _mlp8() -> list:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g))
            for _ in range(2)]  # fmt: skip


def test_diagnose_command_writes_the_report_folder(tmp_path):
    messages: list[str] = []
    report = diagnose_command(
        "zoo:paper_mlp", data="random", out=tmp_path / "out", batch_size=32, max_batches=2,
        model_kwargs={"n_in": 12, "widths": [16, 8]}, init="geometric", progress=messages.append,
    )  # fmt: skip
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["report.html", "report.json", "report.md", "summary.txt"]
    assert report.meta["command"]["loss"] == "random_quadratic"
    assert any("forward + backward" in m for m in messages)
    assert Report.from_json((tmp_path / "out" / "report.json").read_text()).meta["batches"] == 2


def test_landscape_option_computes_one(tmp_path):
    model = mlp3(10).float()
    grid = (torch.linspace(-1, 1, 5), torch.linspace(-1, 1, 4))
    report = diagnose(model, mlp_batches(), landscape={"grid": grid}, spectra=False)
    assert len(report.tables["landscape"]) == 20, report.meta["notes"]
    assert report.tables["landscape"].columns == ["t1", "t2", "loss"]
    assert all(math.isfinite(r["loss"]) for r in report.tables["landscape"])
    report.save_html(tmp_path / "land.html")
    assert "Loss landscape" in (tmp_path / "land.html").read_text(encoding="utf-8")


@pytest.mark.parametrize("bad", [3, 2.5, "grid", [3, 3]])
def test_a_landscape_of_none_of_its_forms_is_refused(bad):
    """landscape=3 (a natural guess for a grid of 3) computed nothing and said nothing."""
    with pytest.raises(TypeError, match=r"landscape must be a Landscape .* True, or a dict") as e:
        diagnose(mlp3(10).float(), mlp_batches(), landscape=bad, spectra=False)
    if bad == 3:
        assert "landscape={'grid': 3}" in str(e.value)


BAD_STAGE_OPTIONS = [  # (diagnose's keywords, error, message): the caller's options, not the model
    ({"curvature_options": {"probs": 4}}, TypeError,
     r"unknown curvature_options option 'probs' .*block_curvature and theory_vs_actual.*"
     r"did you mean probes="),
    ({"curvature_options": {"seed": 1}}, TypeError, r"'seed' .*did you mean generator="),
    ({"curvature_options": {"data": 1}}, TypeError, r"unknown curvature_options option 'data'"),
    ({"curvature_options": {"probes": 0}}, ValueError,
     r"curvature_options: probes must be a positive int, got 0"),
    ({"curvature_options": {"kind": "gnn"}}, ValueError, r"curvature_options: unknown kind 'gnn'"),
    ({"curvature_options": {"gamma": "own"}}, ValueError, r"curvature_options: unknown gamma"),
    ({"curvature_options": {"params": ["0.wieght"]}}, ValueError,
     r"curvature_options: unknown parameter names \['0.wieght'\]"),
    ({"curvature_options": {"probes": 4, "max_probes": 2}}, ValueError,
     r"max_probes \(2\) must be >= probes \(4\)"),
    ({"curvature_options": ["probes", 4]}, TypeError, r"curvature_options must be a dict"),
    ({"landscape": {"gird": 5}}, TypeError,
     r"unknown landscape option 'gird' .*loss_landscape.*did you mean grid="),
    ({"landscape": {"grid": 0}}, ValueError, r"landscape: grid must be a number of points"),
    ({"landscape": {"bn": "train"}}, ValueError, r"landscape: unknown bn policy 'train'"),
    ({"landscape": {"directions": "hess"}}, ValueError, r"landscape: unknown directions 'hess'"),
    ({"landscape": {"generator": 1.5}}, TypeError, r"landscape: generator must be"),
]  # fmt: skip


@pytest.mark.parametrize(("options", "error", "match"), BAD_STAGE_OPTIONS)
def test_bad_stage_options_raise_before_the_pass(options, error, match):
    """A misspelt or refused curvature_options / landscape={...} option was caught with the
    stage's own failures on the model and became a note: the call returned a report without the
    stage. It raises now, as block_curvature and loss_landscape do, before any work."""
    said: list[str] = []
    with pytest.raises(error, match=match):
        diagnose(mlp3(10).float(), mlp_batches(), curvature=True, spectra=False,
                 progress=said.append, **options)  # fmt: skip
    assert said == []


def test_curvature_options_go_to_the_call_that_takes_them():
    """normalize= (block_curvature's alone) and gamma= (theory_vs_actual's alone) went to both
    calls, so each of them failed the other call into a note."""
    options = {"probes": 2, "normalize": "row", "gamma": "builtin"}
    report = diagnose(mlp3(10).float(), mlp_batches(), curvature=True, curvature_options=options,
                      spectra=False)  # fmt: skip
    assert "curvature" in report.tables and "theory_vs_actual" in report.tables, report.meta
    assert not [n for n in report.meta["notes"] if "not computed" in n]


def test_data_loader_input_takes_max_batches():
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(80, 6, generator=g), torch.randint(0, 4, (80,), generator=g))
    loader = DataLoader(ds, batch_size=16)
    report = diagnose(mlp3(11).float(), loader, max_batches=3, spectra=False)
    assert report.meta["batches"] == 3 and report.meta["examples"] == 48
    assert report.tables["gradients"][0]["batches"] == 3


def test_grad_std_of_one_batch_is_nan_with_a_note() -> None:
    """The report's rule: NaN where undefined, with a note (a spread over minibatches of one)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    batch = (torch.randn(16, 8), torch.randint(0, 3, (16,)))
    rows = diagnose(net, [batch, batch], "cross_entropy", max_batches=1, generator=0)
    spread = [r for r in rows.to_rows() if r["quantity"] == "grad_std"]
    assert spread and all(
        math.isnan(r["value"]) and r["note"] == "needs at least 2 batches (got 1)" for r in spread
    )
    two = diagnose(net, [batch, batch], "cross_entropy", generator=0)
    assert all(not r["note"] for r in two.to_rows() if r["quantity"] == "grad_std")


class NoGradientLayers(nn.Module):
    """``enc`` runs under no_grad (trainable, but it never learns), ``unused`` is never called,
    ``frozen`` does not train by design."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.unused, self.head = nn.Linear(10, 16), nn.Linear(16, 16), nn.Linear(16, 3)
        self.frozen = nn.Linear(10, 10).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            h = torch.relu(self.enc(x))
        return self.head(h) + 0 * self.frozen(x).sum()


def test_a_layer_that_gets_no_gradient_is_warned_not_ok() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(32, 10, generator=g), torch.randint(0, 3, (32,), generator=g))
    report = diagnose(NoGradientLayers(), [batch, batch], nn.CrossEntropyLoss(), spectra=False)
    verdicts = {r["layer"]: (r["verdict"], r["reason"]) for r in report.layers}
    assert verdicts["enc"][0] == "warn" and "no gradient reached this layer" in verdicts["enc"][1]
    assert "torch.no_grad()" in verdicts["enc"][1]
    assert verdicts["unused"][0] == "warn" and verdicts["unused"][1].startswith("not called")
    assert verdicts["head"] == ("ok", "")
    assert verdicts["frozen"][0] == "ok"  # requires_grad=False: not training is intended
    silent = {r["layer"] for r in report.to_rows() if r["quantity"] == "no_gradient"}
    assert silent == {"enc", "unused"}


def deep_sigmoid(depth: int = 12, width: int = 16) -> nn.Sequential:
    """Sigmoids after N(0, 0.01) layers: the gradient shrinks ~100x per layer, so near the input
    its squares underflow to 0 in float32 (E[dy^2] = 0): those layers get no gradient."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, width), nn.Sigmoid()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Sigmoid()]
    net = nn.Sequential(*layers, nn.Linear(width, 3))
    for p in net.parameters():
        nn.init.normal_(p, std=0.01)
    return net


def sigmoid_batches() -> list:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g))] * 2


def test_a_layer_whose_gradient_vanished_is_bad_and_makes_the_spread_infinite() -> None:
    report = diagnose(deep_sigmoid(), sigmoid_batches(), nn.CrossEntropyLoss(), spectra=False)
    rows = {r["layer"]: r for r in report.layers}
    assert rows["0"]["E_dy2"] == 0.0 and rows["0"]["gamma_w"] == 0.0  # underflowed
    verdict, reason = rows["0"]["verdict"], rows["0"]["reason"]
    assert verdict == "bad" and "no gradient reaches this layer" in reason, reason
    assert "underflows to 0 in float32" in reason
    zero = [r["layer"] for r in report.to_rows() if r["quantity"] == "zero_gradient"]
    assert "0" in zero and all(rows[k]["verdict"] == "bad" for k in zero)
    imb = report.meta["imbalance"]
    assert imb["gamma_max_over_min"] == math.inf and imb["gamma_argmin"] == "0"
    assert imb["gamma_zero"] == len(zero) and imb["gamma_layers"] == 14  # every weight counted
    assert "max/min over weights = inf" in report.summary()
    assert not any("do not add up" in n for n in report.meta["notes"]), report.meta["notes"]
    assert "max/min over weights = inf" in Report.from_json(report.to_json()).summary()


@needs_conditioning
def test_a_float16_layer_whose_gradient_is_0_may_have_underflowed_and_is_not_bad() -> None:
    """A float16 model whose gradient at its first layer's output is ~1e-8 (float64; the oracle
    is test_conditioning's): 0 in float16. diagnose said "bad: it will not learn", where the float32
    copy measures the gradient; now ``warn``, naming float16's range and the float32 copy."""
    x, t = small_gradient_batch()
    half = diagnose(small_gradient_net().half(), [(x.half(), t)], scaled_ce, spectra=False)
    rows = {(r["layer"], r["quantity"]): r for r in half.to_rows()}
    for layer in ("0", "1"):  # the Linear (γ = 0) and the LayerNorm after it (every gradient 0)
        zero = rows[(layer, "zero_gradient")]
        assert zero["verdict"] == "warn", zero
        assert "may have underflowed float16" in zero["note"] and "float32 copy" in zero["note"]
    layer0 = {r["layer"]: r for r in half.layers}["0"]
    assert layer0["verdict"] == "warn" and "will not learn" not in layer0["reason"], layer0
    assert half.meta["imbalance"]["float16_zero"] == ["0", "1"]
    full = diagnose(small_gradient_net(), [(x, t)], scaled_ce, spectra=False)
    assert not [r for r in full.to_rows() if r["quantity"] == "zero_gradient"]
    assert full.meta["imbalance"]["float16_zero"] == []


@needs_conditioning
def test_a_bfloat16_gradient_that_underflows_float32s_range_is_still_bad() -> None:
    """bfloat16 has float32's range: deep_sigmoid's vanished gradient is ``bad`` there as in
    float32, with the float32 reason (no float16 blamed)."""
    net = deep_sigmoid().to(torch.bfloat16)
    data = [(x.to(torch.bfloat16), t) for x, t in sigmoid_batches()]
    report = diagnose(net, data, nn.CrossEntropyLoss(), spectra=False)
    zero = [r for r in report.to_rows() if r["quantity"] == "zero_gradient"]
    assert zero and all(r["verdict"] == "bad" for r in zero)
    assert all("float16" not in r["note"] and "in float32" in r["note"] for r in zero), zero
    assert report.meta["imbalance"]["float16_zero"] == []


def test_a_layer_after_dead_units_has_no_weight_gradient_and_is_bad() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                        nn.Linear(16, 3))  # fmt: skip
    with torch.no_grad():
        net[0].bias.fill_(-100.0)  # every unit of the first ReLU is dead
    report = diagnose(net, sigmoid_batches(), nn.CrossEntropyLoss(), spectra=False)
    verdict, reason = report.verdicts["2"]
    assert verdict == "bad" and "input is 0" in reason, reason
    assert report.verdicts["0"][0] == "bad"  # no gradient reaches it through the dead units


class NormedEmbedding(nn.Module):
    """A 0.02-std embedding (E[y^2] = 4e-4) into a LayerNorm, then a small MLP head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.norm = nn.Embedding(50, 32), nn.LayerNorm(32)
        self.fc, self.head = nn.Linear(32, 32), nn.Linear(32, 5)
        nn.init.normal_(self.emb.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc(self.norm(self.emb(ids)))))


def test_the_forward_gain_restarts_after_a_normalization_layer() -> None:
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 50, (64,), generator=g), torch.randint(0, 5, (64,), generator=g))
    report = diagnose(NormedEmbedding(), [batch], nn.CrossEntropyLoss(), spectra=False)
    assert report.value("emb", "E_y2") < 1e-3  # small by design: the LayerNorm rescales it
    signal = [f for f in report.findings if f["rule"].endswith("_signal")]
    assert signal == [], signal
    assert report.verdicts["emb"][0] == "ok" and report.verdicts["fc"][0] == "ok"
    assert 0.1 < report.value("fc", "signal_fwd") < 10  # relative to the norm's output
    rows = [r for r in report.rows if r["layer"] == "fc" and r["quantity"] == "signal_fwd"]
    assert "norm" in rows[0]["note"]


def test_the_forward_gain_after_a_normalization_layer_still_flags_an_explosion() -> None:
    model = NormedEmbedding()
    with torch.no_grad():
        model.fc.weight.mul_(1e3)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 50, (64,), generator=g), torch.randint(0, 5, (64,), generator=g))
    report = diagnose(model, [batch], nn.CrossEntropyLoss(), spectra=False)
    verdict, reason = report.verdicts["fc"]
    assert verdict == "bad" and "explodes" in reason, reason


def test_the_report_says_how_much_data_it_read() -> None:
    """Every report has .used (the README says so); diagnose's Report had none. It survives a
    JSON round trip."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    data = Batches([(torch.randn(16, 4), torch.randint(0, 3, (16,))) for _ in range(3)])
    report = diagnose(model, data, spectra=False, max_batches=2)
    assert report.used == DataUse(batches=2, examples=32)
    assert Report.from_json(report.to_json()).used == report.used


class _ZeroGatedBlock(nn.Module):
    """``relu(x + bn2(fc2(relu(bn1(fc1(x))))))``, ``bn2``'s scale zero-initialized."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)
        self.bn1, self.bn2 = nn.BatchNorm1d(width), nn.BatchNorm1d(width)
        nn.init.zeros_(self.bn2.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.fc2(torch.relu(self.bn1(self.fc1(x))))))


def test_a_residual_branch_closed_at_init_is_no_vanished_gradient() -> None:
    """Zero-init-last-BN (Goyal et al. 2017): the layers before the zero scale get no gradient at
    step 0 by design and learn from step 1; they were 'bad' ("will not learn") and made the
    imbalance infinite. A zero-initialized head closes the chain the same way (the next
    test)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), _ZeroGatedBlock(32), _ZeroGatedBlock(32),
                          nn.Linear(32, 10))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(64, 16, generator=g), torch.randint(0, 10, (64,), generator=g))
            for _ in range(2)]  # fmt: skip
    report = diagnose(model, Batches(data), F.cross_entropy, spectra=False)
    layers = {r["layer"]: r for r in report.layers}
    for block in ("2", "3"):
        for name in ("fc1", "bn1", "fc2"):
            row = layers[f"{block}.{name}"]
            assert row["verdict"] == "ok" and f"{block}.bn2 (weight all zeros)" in row["reason"]
    assert math.isfinite(report.meta["imbalance"]["gamma_max_over_min"])


class _OnePlusNorm(nn.Module):
    """``(1 + w) * x / rms(x)``, as Gemma's RMSNorm: ``w = 0`` is the identity."""

    def __init__(self, width: int, fill: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((width,), fill))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class _Branch(nn.Module):
    """``x + norm(last(fc2(relu(fc1(x)))))``."""

    def __init__(self, width: int, norm: nn.Module, last: nn.Module) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)
        self.norm, self.last = norm, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.last(self.fc2(torch.relu(self.fc1(x)))))


@pytest.mark.parametrize(
    "case", ["fixup_zero_linear", "one_plus_w_at_0", "one_plus_w_at_minus_1", "zero_prelu"]
)
def test_a_branch_is_closed_only_where_the_effective_scale_is_zero(case: str) -> None:
    """A Fixup-style zero last layer, and a ``(1 + w)`` norm at ``w = -1``, close the branch (its
    layers get no gradient at step 0, by design); a ``(1 + w)`` norm stored at 0 (Gemma 2's
    sandwich norms) is the identity, and an all-zero weight the gradient goes through (a PReLU at
    0) closes nothing: those layers were claimed "no gradient at init, by design" and left out of
    the imbalance. The oracle: one float64 backward, the branch's fc1 gradient is 0 or not."""
    torch.manual_seed(0)
    w = 32
    norm: nn.Module = nn.Identity()
    last: nn.Module = nn.Linear(w, w)
    if case == "fixup_zero_linear":
        nn.init.zeros_(last.weight)
        nn.init.zeros_(last.bias)
    elif case.startswith("one_plus_w"):
        norm = _OnePlusNorm(w, -1.0 if case.endswith("minus_1") else 0.0)
    else:  # PReLU at 0 is a ReLU: a weight of zeros that passes the gradient of x > 0 back
        last = nn.PReLU(w, init=0.0)
    model = nn.Sequential(nn.Linear(16, w), _Branch(w, norm, last), nn.Linear(w, 10))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 16, generator=g), torch.randint(0, 10, (64,), generator=g)
    ref = copy.deepcopy(model).double()
    F.cross_entropy(ref(x.double()), y).backward()
    closed = not bool(ref[1].fc1.weight.grad.any())
    assert closed == (case in ("fixup_zero_linear", "one_plus_w_at_minus_1"))
    report = diagnose(model, Batches([(x, y)]), F.cross_entropy, spectra=False)
    layers = {r["layer"]: r for r in report.layers}
    for name in ("1.fc1", "1.fc2"):
        assert ("no gradient at init, by design" in layers[name]["reason"]) is closed, layers[name]
        if closed:
            assert layers[name]["verdict"] == "ok", layers[name]
        else:  # judged, and in the imbalance
            assert math.isfinite(layers[name]["gamma_rel_median"]), layers[name]
    assert math.isfinite(report.meta["imbalance"]["gamma_max_over_min"])


def test_the_layers_before_a_zero_initialized_head_learn_from_the_second_step() -> None:
    """A zero head (common for classifiers) passes no gradient back at step 0: the layers before
    it read "bad: will not learn" and doctor recommended LSUV, yet they learn once the head's
    first update moves it (the oracle: one SGD step, then their gradient is not 0)."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 10))  # fmt: skip
    nn.init.zeros_(plain[4].weight)  # closes the chain: the layers before it get no gradient
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 16, generator=g), torch.randint(0, 10, (64,), generator=g)
    report = diagnose(plain, Batches([(x, y)]), F.cross_entropy, spectra=False)
    layers = {r["layer"]: r for r in report.layers}
    for name in ("0", "2"):
        assert layers[name]["verdict"] == "ok", layers[name]
        assert "4 after it has a weight of all zeros" in layers[name]["reason"]
    assert layers["4"]["verdict"] != "bad"
    step = torch.optim.SGD(plain.parameters(), lr=0.1)
    for expected_zero in (True, False):
        step.zero_grad()
        F.cross_entropy(plain(x), y).backward()
        assert bool((plain[0].weight.grad == 0).all()) is expected_zero
        step.step()


def test_a_layer_without_gradient_behind_a_dead_relu_names_the_relu() -> None:
    """Layer 4's bias at -10: every unit of the ReLU after it is dead, and layers 0, 2, 4 get
    no gradient; they said "the gradient vanishes or underflows", not where it stops."""
    torch.manual_seed(0)
    model = nn.Sequential(*[x for _ in range(4) for x in (nn.Linear(16, 16), nn.ReLU())],
                          nn.Linear(16, 3))  # fmt: skip
    with torch.no_grad():
        model[4].bias.fill_(-10.0)
        dead = (model[:5](torch.randn(4096, 16)) > 0).sum(0) == 0  # the oracle: never positive
    assert bool(dead.all())
    data = [(torch.randn(64, 16), torch.randint(0, 3, (64,))) for _ in range(2)]
    layers = {r["layer"]: r for r in diagnose(model, Batches(data), F.cross_entropy,
                                              spectra=False).layers}  # fmt: skip
    for name in ("0", "2", "4"):
        assert layers[name]["verdict"] == "bad"
        assert "every unit of the ReLU 5 is dead" in layers[name]["reason"], name


def test_the_demo_comparison_names_the_layer_the_diagnosis_flags() -> None:
    """``compare_reports``'s worst_layer was the layer of the largest γ, flagged or not (the
    demo named ``layers.2`` for fan_in while its report warned on ``layers.0``)."""
    from initlab.cli.diagnose import compare_reports

    torch.manual_seed(0)
    healthy = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    skewed = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                           nn.Linear(16, 3))  # fmt: skip
    with torch.no_grad():
        skewed[2].weight.mul_(1e-2)  # far below the others: its γ, not the largest, is flagged
    g = torch.Generator().manual_seed(0)
    data = Batches([(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
                    for _ in range(2)])  # fmt: skip
    reports = {"healthy": diagnose(healthy, data, F.cross_entropy, spectra=False),
               "skewed": diagnose(skewed, data, F.cross_entropy, spectra=False)}  # fmt: skip
    rows = {r["scheme"]: r for r in compare_reports(reports)}
    for name, rep in reports.items():
        flagged = [r for r in rep.layers if r["verdict"] in ("warn", "bad")]
        if not flagged:
            assert rows[name]["worst_layer"] == "", name
            continue
        worst = rows[name]["worst_layer"]
        assert worst in {r["layer"] for r in flagged}
        assert rep.meta["imbalance"]["gamma_argmax"] != worst or name == "healthy"


def test_curvature_in_train_mode_with_dropout_says_so() -> None:
    """A model built in train mode (Hugging Face's are) had its curvature taken through one
    dropout mask per product (12% off GPT-2's eval-mode blocks) beside an eval-mode landscape,
    without a word."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3))
    data = (torch.randn(32, 6), torch.randint(0, 3, (32,)))
    note = "curvature measured in train mode: dropout is on (1 module(s), e.g. 2)"
    report = diagnose(model, data, F.cross_entropy, spectra=False, curvature={"probes": 2})
    assert any(n.startswith(note) for n in report.meta["notes"])
    report = diagnose(model.eval(), data, F.cross_entropy, spectra=False, curvature={"probes": 2})
    assert not any("dropout is on" in n for n in report.meta["notes"])


def test_a_zero_gradient_with_another_cause_is_not_excused_by_a_zero_layer_after_it() -> None:
    """Any all-zero layer later in the model (a LoRA adapter's B) excused a layer behind a
    dead ReLU as "learns from the second step on"; the head between them got a gradient."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.head = nn.Linear(8, 8), nn.Linear(8, 3)
            self.adapter_a = nn.Linear(8, 2, bias=False)
            self.adapter_b = nn.Linear(2, 3, bias=False)
            nn.init.constant_(self.a.bias, -100.0)  # the ReLU after `a` is dead for good
            nn.init.zeros_(self.adapter_b.weight)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.relu(self.a(x))) + self.adapter_b(self.adapter_a(x))

    torch.manual_seed(0)
    data = Batches([(torch.randn(32, 8), torch.randint(0, 3, (32,)))])
    layers = {r["layer"]: r for r in diagnose(Net(), data, F.cross_entropy, spectra=False).layers}
    assert layers["a"]["verdict"] == "bad" and "second step" not in layers["a"]["reason"]
    assert layers["adapter_a"]["verdict"] == "ok"  # closed by adapter_b: it learns once B moves
    assert "adapter_b after it has a weight of all zeros" in layers["adapter_a"]["reason"]


@pytest.mark.parametrize(
    ("dtype", "mean", "spread"), [(torch.float64, 1e8, 1e-3), (torch.float32, 1.0, 0.1)]
)
def test_grad_std_matches_a_float64_reference_with_storage_in_the_parameter_s_precision(
    dtype: torch.dtype, mean: float, spread: float
) -> None:
    """Welford's statistics are stored in the parameter's precision (float32 at least), computed
    in float64: a float64 gradient's spread 1e-11 of its mean survives; float32's to ~1e-6."""
    param = nn.Parameter(torch.zeros(7, 3, dtype=dtype))
    g = torch.Generator().manual_seed(0)
    grads = [mean + spread * torch.randn(7, 3, generator=g, dtype=torch.float64) for _ in range(5)]
    stats = GradientStats(nn.ParameterList([param]))
    for grad in grads:
        stats.update([(param, grad.to(dtype))])
    (row,) = stats.rows().to_rows()
    stacked = torch.stack([grad.to(dtype).double() for grad in grads])
    expected = float(stacked.std(dim=0, unbiased=True).mean())
    assert row["grad_std"] == pytest.approx(expected, rel=1e-9 if dtype == torch.float64 else 1e-5)
    one = GradientStats(nn.ParameterList([param]))
    one.update([(param, grads[0].to(dtype))])
    assert math.isnan(one.rows().to_rows()[0]["grad_std"])


class _OwnTanhBlock(nn.Module):
    """A parameter of its own applied by the block, then a child ``nn.Tanh``: the probe re-runs
    the block (under ``torch.func.vmap``) for per-example gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 8**0.5)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x @ self.w)


def test_the_probes_replay_of_a_block_is_no_call_for_the_activation_watch() -> None:
    """The activation watch (lint=True, the default) hooked the probe's own per-example replay of
    a block calling nn.Tanh: under vmap it refused (E_dW2_example NaN, a note telling the user
    to stop using vmap they never used; before that, a raw vmap error). The replay is skipped by
    other tools' hooks; the oracle is a float64 per-example loop of sum-reduced gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), _OwnTanhBlock(), nn.Linear(8, 3)).double()
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,))
    report = diagnose(model, [(x, y)], per_example=True, generator=0)
    row = next(r for r in report.tables["params"].to_rows() if r["layer"] == "1")
    expected = []
    for i in range(16):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        expected.append(float(model[1].w.grad.square().mean()))
    assert row["E_dW2_example"] == pytest.approx(sum(expected) / 16, rel=1e-9)
    acts = [r["layer"] for r in report.tables["activations"].to_rows()]
    assert acts == ["1.act"], acts
