"""init_model: every layer type, ties, meta device, policy, rules, atomicity, dtypes.

Target stds are recomputed here from the papers' formulas, not through the library.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import initlab
from initlab._core.rows import join_name
from initlab.init.registry import ParamSpec, default_registry

Z = 5.0  # z-score for statistical tolerances


def std_tolerance(n: int, kurtosis: float = 3.0) -> float:
    """Relative tolerance on a sample *std* from n draws: half the variance's, z = 5."""
    return Z * math.sqrt((kurtosis - 1.0) / n) / 2.0


class Zoo(nn.Module):
    """One module of most built-in types; shapes large enough for statistical checks."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(96, 128)
        self.conv = nn.Conv2d(16, 32, 3, groups=2)
        self.convt = nn.ConvTranspose1d(24, 48, 5)
        self.mha = nn.MultiheadAttention(64, 4)
        self.bn = nn.BatchNorm2d(8)
        self.ln = nn.LayerNorm(8)
        self.lstm = nn.LSTM(32, 48)
        self.emb = nn.Embedding(300, 40)


def geometric_std(fan_in: int, fan_out: int) -> float:
    return math.sqrt(2.0 / math.sqrt(fan_in * fan_out))  # Defazio & Bottou Eq. 2, c = 2


def test_zoo_geometric_targets_and_roles() -> None:
    model = Zoo()
    model.bn.running_mean.fill_(3.0)
    # gains="scheme": the ReLU gain everywhere (the Zoo has an embedding table, so "auto" would
    # give the attention projections gain 1); this test is about the fans of each layer type.
    report = initlab.init_model(model, "geometric", generator=0, gains="scheme")
    rows = {join_name(r["layer"], r["param"]): r for r in report.to_rows()}
    expected = {
        "lin.weight": geometric_std(96, 128),
        "conv.weight": geometric_std(8 * 9, 16 * 9),  # per-group fans
        "convt.weight": geometric_std(24 * 5, 48 * 5),  # transposed layout (in, out, k)
        "mha.in_proj_weight": geometric_std(64, 64),  # per q/k/v block
        "mha.out_proj.weight": geometric_std(64, 64),
        "lstm.weight_ih_l0": geometric_std(32, 48),  # per gate
        "lstm.weight_hh_l0": geometric_std(48, 48),
    }
    params = dict(model.named_parameters())
    for name, std in expected.items():
        assert rows[name]["role"] == "weight"
        assert rows[name]["target_std"] == pytest.approx(std, rel=1e-12)
        achieved = params[name].detach().double().std().item()
        assert achieved == pytest.approx(std, rel=std_tolerance(params[name].numel()))
    for name in ("lin.bias", "conv.bias", "mha.in_proj_bias", "lstm.bias_ih_l0", "bn.bias"):
        assert torch.count_nonzero(params[name]) == 0
    assert torch.all(params["bn.weight"] == 1) and torch.all(params["ln.weight"] == 1)
    assert torch.all(model.bn.running_mean == 0) and torch.all(model.bn.running_var == 1)
    assert rows["emb.weight"]["role"] == "embedding"
    assert params["emb.weight"].std().item() == pytest.approx(1.0, rel=std_tolerance(300 * 40))
    assert not report.unclaimed()


def test_blocks_are_initialized_separately_orthogonal() -> None:
    mha = nn.MultiheadAttention(16, 2)
    initlab.init_model(mha, "orthogonal", generator=1)
    gain = 1.0  # an attention projection: no nonlinearity follows it (gains="auto")
    for q in mha.in_proj_weight.detach().double().split(16):
        torch.testing.assert_close(
            q.T @ q, gain**2 * torch.eye(16, dtype=torch.float64), atol=1e-5, rtol=0
        )


def test_tied_weights_stay_tied_and_are_drawn_once() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(200, 64)
            self.head = nn.Linear(64, 200, bias=False)
            self.head.weight = self.emb.weight

    model = Tied()
    report = initlab.init_model(model, "fan_in", generator=0)
    assert model.head.weight is model.emb.weight
    assert model.head.weight.data_ptr() == model.emb.weight.data_ptr()
    assert report.tied() == {"head.weight": "emb.weight"}
    # Drawn once, as the head policy says: fan_in at gain 1 (1/sqrt(64)) times 1/sqrt(fan_in).
    expected = torch.empty(200, 64).normal_(0, 1 / 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model.emb.weight.detach(), expected, atol=0, rtol=0)
    assert {r["role"] for r in report} == {"tied embedding/head"}
    # head="off": as the first claimant (the embedding) says, N(0, 1) with the same generator.
    initlab.init_model(model, "fan_in", generator=0, head="off")
    expected = torch.empty(200, 64).normal_(0, 1, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model.emb.weight.detach(), expected, atol=0, rtol=0)


@pytest.mark.parametrize("scheme", ["geometric", "orthogonal", "fan_in"])
def test_an_embeddings_padding_row_stays_zero(scheme: str) -> None:
    # nn.Embedding(padding_idx=...) and Hugging Face's _init_weights leave that row zero, so a
    # padding position contributes nothing; drawing the table over it broke that (was: N(0, 1))
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(10, 4, padding_idx=3), nn.EmbeddingBag(10, 4, padding_idx=-1), nn.Linear(4, 2)
    )
    rules = [initlab.Rule("0.weight", "scale", citation="test", value=2.0)]
    report = initlab.init_model(model, scheme, generator=0, rules=rules)
    rows = {r["layer"]: r for r in report if r["role"] == "embedding"}
    for layer, row in (("0", 3), ("1", 9)):  # the row said: the table is not quite as drawn
        orthogonal = rows[layer]["distribution"] == "orthogonal"
        said = "orthogonal except that row, " if orthogonal else "achieved_std"
        assert f"row {row} (padding_idx) zeroed after the draw: {said}" in rows[layer]["note"]
    assert torch.count_nonzero(model[0].weight[3]) == 0
    assert torch.count_nonzero(model[1].weight[9]) == 0
    assert torch.count_nonzero(model[0].weight[[0, 1, 2, 4]]) == 16  # the rest is drawn
    assert torch.count_nonzero(model[1].weight[:9]) == 36


def test_shared_module_initialized_once() -> None:
    block = nn.Linear(8, 8)
    model = nn.Sequential(block, nn.ReLU(), block)
    report = initlab.init_model(model, "geometric", generator=0)
    weights = [r for r in report.to_rows() if r["role"] == "weight"]
    assert [(r["layer"], r["param"], r["tied_to"]) for r in weights] == [
        ("0", "weight", None),
        ("2", "weight", "0.weight"),
    ]


def test_a_tied_head_s_row_names_its_own_module_type() -> None:
    """A Linear head tied to an embedding: its row (an alias of the table's) said Embedding."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(50, 32), nn.Linear(32, 50, bias=False)
            self.head.weight = self.embed.weight

    rows = {r["layer"]: r for r in initlab.init_model(Tied(), "geometric", generator=0).to_rows()}
    assert rows["embed"]["module_type"] == "Embedding" and rows["embed"]["tied_to"] is None
    assert rows["head"]["module_type"] == "Linear" and rows["head"]["tied_to"] == "embed.weight"


def test_meta_device_model_materialized_then_initialized() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 128))
    with pytest.raises(ValueError, match="to_empty"):
        initlab.init_model(model, "geometric")
    model.to_empty(device="cpu")
    initlab.init_model(model, "geometric", generator=0)
    w = model[0].weight.detach().double()
    assert w.device.type == "cpu"
    assert w.std().item() == pytest.approx(geometric_std(256, 512), rel=std_tolerance(w.numel()))
    assert torch.count_nonzero(model[0].bias) == 0


class _Rotary(nn.Module):
    """A rotary table computed in the constructor (non-persistent, as in Llama) and an input
    scale kept in the state_dict (persistent)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8), False)
        self.register_buffer("scale", torch.ones(8))
        self.proj = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x * self.scale))


def test_meta_device_advice_names_the_buffers_init_model_does_not_set() -> None:
    """to_empty then init_model, as advised, left a Llama's rotary inv_freq as uninitialized
    memory (2.3e-43, 1.13e+30, ...) without a word: the advice says which buffers init_model does
    not set and how to set them; the norm statistics, which it resets, are not among them."""
    with torch.device("meta"):
        model = _Rotary()
    with pytest.raises(ValueError) as err:
        initlab.init_model(model, "geometric")
    msg = str(err.value)
    assert "it leaves these as to_empty made them (uninitialized memory)" in msg
    assert "model.load_state_dict(...) restores the buffers scale" in msg
    assert "inv_freq (non-persistent) are in no state_dict" in msg
    assert "norm.running_mean" not in msg.partition("it leaves these")[2]
    model.to_empty(device="cpu")
    report = initlab.init_model(model, "geometric", generator=0)
    assert report.buffers_left == ["inv_freq", "scale"]
    assert "2 buffer(s) not set by init_model: inv_freq, scale" in str(report)
    assert torch.equal(model.norm.running_var, torch.ones(8))  # reset by init_model


def _frozen_norm_meta() -> nn.Module:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model[1].requires_grad_(False)
    return model


_FROZEN_STATS = ["1.running_mean", "1.running_var", "1.num_batches_tracked"]


def test_meta_advice_and_report_name_what_a_frozen_norm_layer_keeps() -> None:
    """A frozen BatchNorm on the meta device: init_model (frozen="skip") keeps its weight, bias
    and running statistics, so after to_empty they stay uninitialized memory. The advice said
    init_model sets "the norm layers' running statistics" and named none of them; it now names
    the frozen parameters and statistics, and InitReport.buffers_left lists the same buffers."""
    model = _frozen_norm_meta()
    with pytest.raises(ValueError) as err:
        initlab.init_model(model, "kaiming")
    left = str(err.value).partition("it leaves these as to_empty made them")[2]
    assert "the frozen parameters 1.weight, 1.bias and the running statistics" in left
    assert all(b in left for b in _FROZEN_STATS) and "frozen='init'" in left
    model.to_empty(device="cpu")
    model[1].running_var.fill_(float("nan"))  # stands in for uninitialized memory
    report = initlab.init_model(model, "kaiming", generator=0)
    assert report.buffers_left == _FROZEN_STATS
    assert torch.isnan(model[1].running_var).all()  # kept, as both messages say
    report = initlab.init_model(model, "kaiming", generator=0, frozen="init")
    assert report.buffers_left == []
    assert torch.equal(model[1].running_var, torch.ones(4))


def test_meta_advice_without_anything_left_names_nothing_more() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with pytest.raises(ValueError) as err:
        initlab.init_model(model, "kaiming")
    assert str(err.value).endswith("sets the parameters and the norm layers' running statistics")


class _LayerNormWithBuffer(nn.LayerNorm):
    """A norm layer claimed by its scale and shift, with a buffer no reset_running_stats sets."""

    def __init__(self, d: int) -> None:
        super().__init__(d)
        self.register_buffer("eps_t", torch.tensor(1e-6))


def test_buffers_left_lists_every_buffer_init_model_does_not_set() -> None:
    """A norm layer's own buffer that no reset_running_stats sets is left (it was missing from
    buffers_left, which took every norm layer's buffers for set); a plain model's summary says
    so neutrally, with no word of uninitialized memory (it printed "(after to_empty:
    uninitialized memory)" for every model with a buffer)."""
    model = nn.Sequential(nn.Linear(4, 4), _LayerNormWithBuffer(4), nn.BatchNorm1d(4))
    report = initlab.init_model(model, "kaiming", generator=0)
    assert report.buffers_left == ["1.eps_t"]
    assert model[1].eps_t.item() == pytest.approx(1e-6)
    summary = str(report).splitlines()[-1]
    assert summary.endswith("; 1 buffer(s) not set by init_model: 1.eps_t")
    assert "uninitialized" not in str(report)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_dtype_is_kept(dtype: torch.dtype) -> None:
    model = nn.Sequential(nn.Linear(128, 256), nn.LayerNorm(256)).to(dtype)
    initlab.init_model(model, "fan_in", generator=0)
    assert all(p.dtype == dtype for p in model.parameters())
    w = model[0].weight.detach().double()
    assert w.std().item() == pytest.approx(math.sqrt(2 / 128), rel=std_tolerance(w.numel()) + 0.01)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_reports_achieved_std_in_the_tensors_precision(dtype: torch.dtype) -> None:
    # a float64 model's std was taken in float32 (1e-8 off; CUDA and the CPU differed by 1 ulp)
    model = nn.Sequential(nn.Linear(96, 80), nn.Linear(80, 40)).to(dtype)
    rows = initlab.init_model(model, "fan_in", generator=0).to_rows()
    rel = {torch.float64: 1e-13, torch.float32: 1e-6, torch.bfloat16: 1e-6}[dtype]
    for row in (r for r in rows if r["param"] == "weight"):
        w = model.get_submodule(row["layer"]).weight.detach().double()
        assert row["achieved_std"] == pytest.approx(w.std().item(), rel=rel), row["layer"]


def test_same_seed_same_weights_and_int_seed_equals_generator() -> None:
    def make() -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8, 4))

    a, b, c, d = make(), make(), make(), make()
    initlab.init_model(a, "geometric", generator=torch.Generator().manual_seed(7))
    initlab.init_model(b, "geometric", generator=torch.Generator().manual_seed(7))
    initlab.init_model(c, "geometric", generator=7)
    initlab.init_model(d, "geometric", generator=8)
    for (_, pa), (_, pb), (_, pc), (_, pd) in zip(
        a.named_parameters(),
        b.named_parameters(),
        c.named_parameters(),
        d.named_parameters(),
        strict=True,
    ):
        assert torch.equal(pa, pb) and torch.equal(pa, pc)
        if pa.dim() > 1:
            assert not torch.equal(pa, pd)


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.full((4,), 3.0))


def test_policy_warn_names_unclaimed_and_leaves_them() -> None:
    model = Custom()
    with pytest.warns(UserWarning, match=r"\['scale'\]"):
        report = initlab.init_model(model, "geometric", generator=0)
    assert report.unclaimed() == ["scale"]
    assert torch.all(model.scale == 3.0)


def test_policy_error_raises_before_any_change() -> None:
    model = Custom()
    before = model.lin.weight.detach().clone()
    with pytest.raises(ValueError, match=r"scale.*register_handler"):
        initlab.init_model(model, "geometric", policy="error")
    assert torch.equal(model.lin.weight, before)


def test_policy_skip_is_silent() -> None:
    model = Custom()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        initlab.init_model(model, "geometric", policy="skip")
    assert torch.all(model.scale == 3.0)


def test_user_handler_claims_custom_parameter() -> None:
    registry = default_registry().copy()

    def handler(module: nn.Module) -> list[ParamSpec]:
        return [ParamSpec("scale", "norm_scale")]

    registry.register(Custom, handler)
    model = Custom()
    registry.register(nn.Linear, default_registry().handler_for(model.lin), override=True)
    report = initlab.init_model(model, "geometric", registry=registry)
    assert not report.unclaimed()
    assert torch.all(model.scale == 1.0)


def test_rules_zero_and_scale_residual_projections() -> None:
    def make() -> nn.Module:
        return nn.ModuleDict(
            {
                "b0": nn.ModuleDict({"fc": nn.Linear(64, 64), "proj": nn.Linear(64, 64)}),
                "b1": nn.ModuleDict({"fc": nn.Linear(64, 64), "proj": nn.Linear(64, 64)}),
            }
        )

    base, ruled = make(), make()
    initlab.init_model(base, "fan_in", generator=3)
    rules = [
        initlab.scale_residual_projections("*.proj.weight", n_layers=2),
        initlab.zero_last_residual_branch("b1.proj.weight"),
    ]
    report = initlab.init_model(ruled, "fan_in", generator=3, rules=rules)
    factor = 1 / math.sqrt(2 * 2)
    torch.testing.assert_close(
        ruled["b0"]["proj"].weight, base["b0"]["proj"].weight * factor, atol=0, rtol=0
    )
    torch.testing.assert_close(ruled["b0"]["fc"].weight, base["b0"]["fc"].weight, atol=0, rtol=0)
    assert torch.count_nonzero(ruled["b1"]["proj"].weight) == 0
    rows = {join_name(r["layer"], r["param"]): r for r in report.to_rows()}
    assert "Radford" in rows["b0.proj.weight"]["rule"]
    assert rows["b0.proj.weight"]["target_std"] == pytest.approx(math.sqrt(2 / 64) * factor)
    assert rows["b1.proj.weight"]["target_std"] == 0.0


def test_scheme_rule_and_rule_matching_nothing_warns() -> None:
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    rule = initlab.Rule("1.weight", "scheme", citation="test", value="orthogonal")
    with pytest.warns(UserWarning, match="matched no parameter"):
        initlab.init_model(model, "geometric", rules=[rule, initlab.Rule("nope", "zero", "test")])
    w = model[1].weight.detach().double()
    torch.testing.assert_close(w.T @ w, 2 * torch.eye(32, dtype=torch.float64), atol=1e-5, rtol=0)


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="no parameters"):
        initlab.init_model(nn.ReLU(), "geometric")
    with pytest.raises(ValueError, match="geometric"):  # the message lists valid names
        initlab.init_model(nn.Linear(2, 2), "geometrc")
    with pytest.raises(ValueError, match="policy"):
        initlab.init_model(nn.Linear(2, 2), policy="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="action"):
        initlab.Rule("*", "double", citation="x")
    with pytest.raises(ValueError, match="citation"):
        initlab.Rule("*", "zero", citation="")
    with pytest.raises(TypeError):
        initlab.init_model(nn.Linear(2, 2), generator="seed")  # type: ignore[arg-type]


def test_bad_handler_leaves_model_unchanged() -> None:
    registry = default_registry().copy()
    registry.register(
        nn.Linear, lambda m: [ParamSpec("weight", "weight", fans=initlab.Fans(3, 3))], override=True
    )
    model = nn.Sequential(nn.Conv1d(2, 2, 3), nn.Linear(4, 4))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="Linear"):
        initlab.init_model(model, "geometric", registry=registry, policy="skip")
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, q)


def test_report_exits() -> None:
    report = initlab.init_model(nn.Linear(8, 4), "geometric", generator=0)
    assert set(report.to_rows()[0]) == set(initlab.INIT_REPORT_COLUMNS)
    text = str(report)
    assert "weight" in text and "geometric" in text and "2 tensors initialized" in text
    df = report.to_pandas()
    assert list(df.columns) == list(initlab.INIT_REPORT_COLUMNS) and len(df) == 2
    assert "| layer | param |" in report.to_markdown()


class _ScalarBias(nn.Module):
    """Fixup's ``relu(conv(x) + b)`` with a scalar bias ``b``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Parameter(torch.zeros(1))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x) + self.b).mean((2, 3)))


def _gain_of(model: nn.Module, layer: str, **kwargs: object) -> tuple[float, str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = initlab.init_model(model, "fan_in", generator=0, gains="follow", **kwargs)
    row = next(r for r in rows.to_rows() if r["layer"] == layer and r["role"] == "weight")
    return row["gain"], row["gain_from"]


@pytest.mark.parametrize("act", [nn.Hardtanh(), nn.Tanhshrink(), nn.Hardswish(), nn.Mish()])
@pytest.mark.parametrize("traced", [False, True])
def test_an_activation_with_no_gain_here_keeps_the_schemes_gain(act: nn.Module, traced: bool):
    """Hardtanh and Tanhshrink got tanh's gain 5/3 and Hardswish SiLU's (a fragment of the class
    name); traced, Mish/Softplus/ReLU6 gave gain 1 "no nonlinearity follows". Both keep the
    scheme's gain now (ReLU's for fan_in), saying which activation follows."""
    model = nn.Sequential(nn.Linear(8, 16), act, nn.Linear(16, 2))
    inputs = {"example_inputs": torch.randn(4, 8)} if traced else {}
    gain, source = _gain_of(model, "0", **inputs)
    assert gain == pytest.approx(math.sqrt(2.0))
    assert f"{type(act).__name__} follows" in source


def test_the_trace_follows_pooling_and_a_scalar_bias_to_the_relu() -> None:
    """conv -> MaxPool2d -> ReLU, and Fixup's relu(conv(x) + b): traced as "no nonlinearity
    follows" (gain 1)."""
    x = torch.randn(2, 3, 8, 8)
    pooled = nn.Sequential(nn.Conv2d(3, 4, 3), nn.MaxPool2d(2), nn.ReLU(), nn.Flatten(),
                           nn.LazyLinear(2))  # fmt: skip
    pooled(x)
    assert _gain_of(pooled, "0", example_inputs=x) == (math.sqrt(2.0), "relu: traced, ReLU")
    fixup = _ScalarBias()
    assert _gain_of(fixup, "conv", example_inputs=x) == (math.sqrt(2.0), "relu: traced, relu()")


def test_attention_and_softmax_are_no_unknown_activation() -> None:
    """They sit in torch's activation module too: a layer before them keeps gain 1 traced
    (attention, a softmax at the output), not the scheme's "unknown activation" gain."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.Softmax(-1))
    gain, source = _gain_of(model, "2", example_inputs=torch.randn(3, 8))
    assert (gain, source) == (1.0, "none: traced, no nonlinearity follows")


class _WithToken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.cls_token = nn.Parameter(torch.ones(1, 1, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + self.cls_token


def test_a_rule_naming_only_an_unclaimed_tensor_says_so() -> None:
    """A rule for ViT's cls_token (a raw parameter no handler claims) warned "matched no
    parameter", though the name matched."""
    rule = initlab.Rule("cls_token", "zero", citation="ViT")
    with pytest.warns(UserWarning) as seen:
        initlab.init_model(_WithToken(), "geometric", rules=[rule], generator=0)
    texts = [str(w.message) for w in seen]
    assert any("matched only tensors no registry handler claims (cls_token)" in t for t in texts)
    assert not any("matched no parameter" in t for t in texts)


def test_a_zero_width_layer_has_nothing_to_draw() -> None:
    # MobileBERT with embedding_size == hidden_size builds a Linear(V, 0): init_model raised
    # "Fans.fan_out must be a positive finite number, got 0" (torch.nn.init warns, a no-op)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own "zero-element tensors" warning
        net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 0))
    report = initlab.init_model(net, "geometric", generator=0)  # warnings are errors here
    assert [r["layer"] for r in report.to_rows()] == ["0", "0"]
    assert net(torch.randn(2, 4)).shape == (2, 0)


def test_a_tied_orthogonal_head_with_a_padding_row_says_so() -> None:
    """BERT's tied decoder under "orthogonal": the padding row zeroed after the draw left the
    head off orthogonal by up to 0.058 (max |W^T W / s^2 - I|), and its row said nothing."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(40, 16, padding_idx=0)
            self.head = nn.Linear(16, 40, bias=False)
            self.head.weight = self.emb.weight

    model = Tied()
    report = initlab.init_model(model, "orthogonal", generator=0)
    (row,) = [r for r in report if r["layer"] == "emb"]
    assert row["distribution"] == "orthogonal"
    assert "row 0 (padding_idx) zeroed after the draw: orthogonal except that row" in row["note"]
    assert torch.count_nonzero(model.emb.weight[0]) == 0
    assert row["achieved_std"] < row["target_std"]


@pytest.mark.parametrize("head_first", [False, True])
def test_a_tied_table_s_padding_row_is_zero_whichever_module_comes_first(head_first: bool) -> None:
    """A Linear head declared before the Embedding it is tied to: the head planned the table
    and the padding row kept its draw (max |w| 0.087 under geometric), with no note."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            if head_first:
                self.head = nn.Linear(16, 50, bias=False)
                self.embed = nn.Embedding(50, 16, padding_idx=1)
            else:
                self.embed = nn.Embedding(50, 16, padding_idx=1)
                self.head = nn.Linear(16, 50, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    rules = [initlab.Rule("head.weight", "scale", citation="test", value=2.0)]
    report = initlab.init_model(model, "geometric", generator=0, rules=rules)
    assert torch.count_nonzero(model.embed.weight[1]) == 0
    assert torch.count_nonzero(model.embed.weight[[0, *range(2, 50)]]) == 49 * 16
    for row in report:  # the table's row and its alias's
        assert "row 1 (padding_idx) zeroed after the draw" in row["note"]
