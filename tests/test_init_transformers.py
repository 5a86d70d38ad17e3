"""init_model on transformers: the head policy (initial loss near ln V for every scheme), ties
kept, gains that follow the nonlinearity after each layer, and GPT-2's residual scaling found
without names. Tiny GPT-2-like and Llama-like models in plain torch; Hugging Face's GPT-2 when
``transformers`` is installed."""

from __future__ import annotations

import math
import types
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import initlab
from initlab._core.rows import join_name
from initlab.init._structure import token_tables
from initlab.init.gains import calculate_gain
from initlab.init.registry import ParamSpec, default_registry
from initlab.init.rules import gpt2_residual_scaling

V, D, HEADS, LAYERS, T, B = 100, 32, 4, 2, 16, 16
SCHEMES = ["fan_in", "lecun", "fan_out", "arithmetic", "xavier", "geometric", "operator_norm",
           "orthogonal"]  # fmt: skip
Z = 5.0


class Attention(nn.Module):
    """Causal self-attention with separate q/k/v/o projections (Llama) or a fused c_attn (GPT-2)."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.fused = fused
        if fused:
            self.c_attn = nn.Linear(D, 3 * D)
            self.c_proj = nn.Linear(D, D)
        else:
            self.q_proj = nn.Linear(D, D, bias=False)
            self.k_proj = nn.Linear(D, D, bias=False)
            self.v_proj = nn.Linear(D, D, bias=False)
            self.o_proj = nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        if self.fused:
            q, k, v = self.c_attn(x).split(D, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = (z.view(b, t, HEADS, D // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, D)
        return self.c_proj(y) if self.fused else self.o_proj(y)


class GPT2MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = nn.Linear(D, 4 * D)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * D, D)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class GPT2Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(D)
        self.attn = Attention(fused=True)
        self.ln_2 = nn.LayerNorm(D)
        self.mlp = GPT2MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Like(nn.Module):
    """GPT-2: token and position embeddings, pre-LN blocks, final LayerNorm, tied lm_head."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.wpe = nn.Embedding(T, D)
        self.h = nn.ModuleList(GPT2Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class RMSNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; ``functional=True`` applies SiLU as a function
    (invisible to the structure, seen by a trace)."""

    def __init__(self, functional: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(D, 3 * D, bias=False)
        self.up_proj = nn.Linear(D, 3 * D, bias=False)
        self.down_proj = nn.Linear(3 * D, D, bias=False)
        self.act_fn = None if functional else nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        gate = F.silu(gate) if self.act_fn is None else self.act_fn(gate)
        return self.down_proj(gate * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm()
        self.self_attn = Attention(fused=False)
        self.post_attention_layernorm = RMSNorm()
        self.mlp = LlamaMLP(functional)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaLike(nn.Module):
    """Llama: token embedding, pre-RMSNorm blocks with SwiGLU MLPs, final RMSNorm, untied head."""

    def __init__(self, functional: bool = False) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(V, D)
        self.layers = nn.ModuleList(LlamaBlock(functional) for _ in range(LAYERS))
        self.norm = RMSNorm()
        self.lm_head = nn.Linear(D, V, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def _registry() -> initlab.Registry:
    reg = default_registry().copy()
    reg.register(RMSNorm, lambda m: [ParamSpec("weight", "norm_scale")])
    return reg


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(seed))


def initial_loss(model: nn.Module, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    logits = getattr(logits, "logits", logits)
    return float(F.cross_entropy(logits.reshape(-1, V), tokens[:, 1:].reshape(-1)))


def _rows(report: initlab.InitReport) -> dict[str, dict]:
    return {join_name(r["layer"], r["param"]): r for r in report.to_rows()}


MODELS = {"gpt2": GPT2Like, "llama": LlamaLike}


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_initial_loss_is_near_ln_v_for_every_scheme(name: str, scheme: str) -> None:
    torch.manual_seed(0)
    model = MODELS[name]()
    report = initlab.init_model(model, scheme, generator=0, registry=_registry(), policy="error")
    loss = initial_loss(model, _tokens())
    assert loss == pytest.approx(math.log(V), rel=0.10), (name, scheme, loss)
    rows = _rows(report)
    if name == "gpt2":
        assert model.lm_head.weight is model.wte.weight  # still one tensor
        assert rows["wte.weight"]["role"] == rows["lm_head.weight"]["role"] == "tied embedding/head"
        assert rows["lm_head.weight"]["tied_to"] == "wte.weight"
    else:
        assert rows["lm_head.weight"]["role"] == "head"
        assert rows["embed_tokens.weight"]["role"] == "embedding"


def test_torch_default_tied_init_is_far_from_ln_v() -> None:
    """What the head policy fixes: the tied table drawn as an embedding, N(0, 1)."""
    torch.manual_seed(0)
    model = GPT2Like()
    initlab.init_model(model, "geometric", generator=0, head="off")
    assert initial_loss(model, _tokens()) > 2 * math.log(V)


@pytest.mark.parametrize("scheme", ["fan_in", "geometric", "orthogonal"])
def test_head_std_is_the_gain_one_std_over_sqrt_fan_in(scheme: str) -> None:
    model = LlamaLike()
    report = initlab.init_model(model, scheme, generator=0, registry=_registry())
    row = _rows(report)["lm_head.weight"]
    gain_one = initlab.get_scheme(scheme, nonlinearity="linear").spec(initlab.Fans(D, V)).std
    assert row["target_std"] == pytest.approx(gain_one / math.sqrt(D), rel=1e-12)
    assert row["gain"] == 1.0 and row["gain_from"].startswith("none: head")
    n = model.lm_head.weight.numel()
    tol = Z * math.sqrt(2 / n) / 2  # relative std of a sample std: half that of the variance
    if scheme != "orthogonal":
        assert row["achieved_std"] == pytest.approx(row["target_std"], rel=tol)
    else:  # exact RMS for a semi-orthogonal draw
        assert row["achieved_std"] == pytest.approx(row["target_std"], rel=0.02)


@pytest.mark.parametrize("scheme", ["fan_in", "geometric", "orthogonal"])
def test_a_position_table_summed_with_a_tied_token_table_is_drawn_at_its_std(scheme: str) -> None:
    """At ``embedding_std = 1`` beside the small tied table, positions drowned the tokens."""
    model = GPT2Like()
    rows = _rows(initlab.init_model(model, scheme, generator=0))
    wte, wpe = rows["wte.weight"], rows["wpe.weight"]
    assert wpe["target_std"] == wte["target_std"] and "tied token table wte.weight" in wpe["note"]
    n = model.wpe.weight.numel()
    assert wpe["achieved_std"] == pytest.approx(wpe["target_std"], rel=Z * math.sqrt(2 / n) / 2)
    # a rule on the table keeps the rule's draw; an untied model keeps embedding_std
    rule = initlab.Rule("wpe.weight", "scale", "a test", 0.5)
    ruled = _rows(initlab.init_model(GPT2Like(), scheme, generator=0, rules=[rule]))["wpe.weight"]
    assert not ruled["note"] and ruled["achieved_std"] == pytest.approx(0.5, rel=0.1)
    untied = _rows(initlab.init_model(GPT2Like(), scheme, generator=0, head="off"))
    assert untied["wpe.weight"]["target_std"] == 1.0


def test_hugging_face_gpt2_sees_its_tokens_after_init() -> None:
    """The final hidden states of two unrelated sequences: nearly equal (cosine 0.999) when
    ``wpe`` drowned the tied ``wte``; Hugging Face's own init gives 0.48 here."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    initlab.init_model(model, "geometric", generator=0)
    gen = torch.Generator().manual_seed(1)
    a, b = (torch.randint(0, 64, (8, 16), generator=gen) for _ in range(2))
    with torch.no_grad():
        ha, hb = (model(input_ids=x, output_hidden_states=True).hidden_states[-1] for x in (a, b))
    assert float(F.cosine_similarity(ha, hb, dim=-1).mean()) < 0.8


def test_report_shows_gain_per_layer_from_structure() -> None:
    report = initlab.init_model(GPT2Like(), "geometric", generator=0)
    rows = _rows(report)
    gelu = calculate_gain("gelu")
    fc = rows["h.0.mlp.c_fc.weight"]
    assert fc["gain"] == pytest.approx(gelu) and fc["gain_from"].startswith("gelu")
    assert fc["target_std"] == pytest.approx(math.sqrt(gelu**2 / math.sqrt(D * 4 * D)))
    for name in ("h.0.attn.c_attn.weight", "h.1.attn.c_proj.weight"):
        assert rows[name]["gain"] == 1.0 and "attention" in rows[name]["gain_from"], name
    assert rows["h.0.mlp.c_proj.weight"]["gain"] == 1.0
    assert list(rows["wte.weight"])[:2] == ["layer", "param"]

    rows = _rows(initlab.init_model(LlamaLike(), "fan_in", generator=0, registry=_registry()))
    silu = calculate_gain("silu")
    gate = rows["layers.1.mlp.gate_proj.weight"]
    assert gate["gain"] == pytest.approx(silu) and gate["gain_from"].startswith("silu")
    assert gate["target_std"] == pytest.approx(silu / math.sqrt(D))
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        row = rows[f"layers.0.self_attn.{name}.weight"]
        assert row["gain"] == 1.0 and row["target_std"] == pytest.approx(1 / math.sqrt(D))
    assert rows["layers.0.mlp.up_proj.weight"]["gain"] == 1.0  # multiplied, not activated
    assert rows["layers.0.mlp.down_proj.weight"]["gain"] == 1.0
    for row in rows.values():
        assert row["gain"] is None or row["gain"] != math.sqrt(2), row


def test_operator_norm_uses_average_lipschitz_of_the_found_nonlinearity() -> None:
    rows = _rows(initlab.init_model(GPT2Like(), "operator_norm", generator=0))
    fc = rows["h.0.mlp.c_fc.weight"]
    lip = initlab.init.gains.average_lipschitz("gelu")
    assert fc["gain"] == pytest.approx(1 / lip)
    assert fc["target_std"] == pytest.approx(1 / ((math.sqrt(D) + math.sqrt(4 * D)) * lip))


def test_trace_finds_functional_nonlinearities_and_leaves_the_model_as_it_was() -> None:
    model = LlamaLike(functional=True)
    rows = _rows(initlab.init_model(model, "geometric", generator=0, registry=_registry()))
    assert rows["layers.0.mlp.gate_proj.weight"]["gain_from"].startswith("scheme (no")

    model.eval()
    model.layers[0].train()
    modes = {n: m.training for n, m in model.named_modules()}
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    report = initlab.init_model(
        model, "geometric", generator=0, registry=_registry(), example_inputs=_tokens()[:, :-1]
    )
    rows = _rows(report)
    gate = rows["layers.0.mlp.gate_proj.weight"]
    assert gate["gain"] == pytest.approx(calculate_gain("silu"))
    assert gate["gain_from"] == "silu: traced, silu()"
    for name in ("mlp.up_proj", "mlp.down_proj", "self_attn.q_proj", "self_attn.o_proj"):
        assert rows[f"layers.1.{name}.weight"]["gain"] == 1.0, name
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == hooks
    assert initial_loss(model, _tokens()) == pytest.approx(math.log(V), rel=0.10)


def test_trace_follows_activation_modules_through_dropout() -> None:
    model = nn.Sequential(
        nn.Embedding(V, D), nn.Linear(D, D), nn.Dropout(0.1), nn.Tanh(), nn.Linear(D, V)
    )
    report = initlab.init_model(model, "fan_in", generator=0, example_inputs=_tokens())
    rows = _rows(report)
    assert rows["1.weight"]["gain"] == pytest.approx(5 / 3)
    assert rows["1.weight"]["gain_from"] == "tanh: traced, Tanh"
    assert rows["4.weight"]["role"] == "head"


def test_models_without_a_head_are_drawn_as_before() -> None:
    def make() -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4, 16), nn.GELU(),
            nn.Linear(16, 4),
        )  # fmt: skip

    a, b = make(), make()
    ra = initlab.init_model(a, "geometric", generator=0)
    rb = initlab.init_model(b, "geometric", generator=0, gains="scheme")
    for (_, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert {r["gain_from"] for r in ra if r["role"] == "weight"} == {"scheme"}
    assert [r["target_std"] for r in ra] == [r["target_std"] for r in rb]
    # gains="follow" on the same model: the GELU after the Linear is found.
    rows = _rows(initlab.init_model(make(), "geometric", generator=0, gains="follow"))
    assert rows["3.weight"]["gain"] == pytest.approx(calculate_gain("gelu"))
    assert rows["0.weight"]["gain"] == pytest.approx(math.sqrt(2))
    assert rows["5.weight"]["gain_from"].startswith("scheme (no")


def test_explicit_nonlinearity_is_kept() -> None:
    rows = _rows(initlab.init_model(GPT2Like(), "xavier", generator=0))
    fc = rows["h.0.mlp.c_fc.weight"]
    assert fc["gain"] == 1.0 and fc["gain_from"].startswith("scheme (its nonlinearity is kept")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gpt2_residual_scaling_finds_the_2n_projections(name: str) -> None:
    base, ruled = MODELS[name](), MODELS[name]()
    initlab.init_model(base, "fan_in", generator=3, registry=_registry())
    report = initlab.init_model(
        ruled, "fan_in", generator=3, registry=_registry(), rules=[gpt2_residual_scaling()]
    )
    want = {
        "gpt2": [f"h.{i}.{b}.c_proj.weight" for i in range(LAYERS) for b in ("attn", "mlp")],
        "llama": [
            f"layers.{i}.{b}.weight"
            for i in range(LAYERS)
            for b in ("self_attn.o_proj", "mlp.down_proj")
        ],
    }[name]
    scaled = [k for k, r in _rows(report).items() if r["rule"] and "Radford" in r["rule"]]
    assert scaled == want
    factor = 1 / math.sqrt(2 * LAYERS)
    base_params, ruled_params = dict(base.named_parameters()), dict(ruled.named_parameters())
    for key, param in ruled_params.items():
        expected = base_params[key] * factor if key in want else base_params[key]
        torch.testing.assert_close(param, expected, atol=0, rtol=0)
    # Statistically: each tensor's second moment over its target variance, pooled over all n
    # entries; the relative std of a sample variance is about sqrt(2/n).
    rows = _rows(report)
    n = sum(ruled_params[k].numel() for k in want)
    pooled = sum(
        float(ruled_params[k].detach().double().pow(2).sum()) / rows[k]["target_std"] ** 2
        for k in want
    )
    assert pooled / n == pytest.approx(1.0, abs=Z * math.sqrt(2 / n))
    for k in want:
        assert rows[k]["target_std"] == pytest.approx(
            rows[k]["gain"] / math.sqrt(rows[k]["fan_in"]) * factor
        )


def test_gpt2_residual_scaling_warns_when_nothing_matches() -> None:
    with pytest.warns(UserWarning, match="found no residual projection"):
        initlab.init_model(nn.Linear(4, 4), "geometric", rules=[gpt2_residual_scaling()])
    with pytest.raises(ValueError, match="n_layers"):
        gpt2_residual_scaling(0)


def test_bad_keywords() -> None:
    with pytest.raises(ValueError, match="gains"):
        initlab.init_model(nn.Linear(2, 2), gains="relu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="head"):
        initlab.init_model(nn.Linear(2, 2), head="zero")  # type: ignore[arg-type]


def test_hugging_face_gpt2() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=LAYERS, n_embd=D, n_head=HEADS, vocab_size=V, n_positions=T
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    report = initlab.init_model(
        model, "geometric", generator=0, rules=[gpt2_residual_scaling()], policy="error"
    )
    assert model.lm_head.weight is model.transformer.wte.weight
    rows = _rows(report)
    assert rows["transformer.wte.weight"]["role"] == "tied embedding/head"
    assert rows["transformer.h.0.mlp.c_fc.weight"]["gain"] == pytest.approx(calculate_gain("gelu"))
    assert rows["transformer.h.0.attn.c_attn.weight"]["gain"] == 1.0
    scaled = sorted(k for k, r in rows.items() if r["rule"])
    assert scaled == sorted(
        f"transformer.h.{i}.{b}.c_proj.weight" for i in range(LAYERS) for b in ("attn", "mlp")
    )
    model.eval()
    assert initial_loss(model, _tokens()) == pytest.approx(math.log(V), rel=0.10)


class _TorchEncoderLM(nn.Module):
    """Embedding, torch's own ``nn.TransformerEncoder`` (its activation a function attribute),
    head."""

    def __init__(self, activation: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        layer = nn.TransformerEncoderLayer(D, HEADS, 2 * D, 0.0, activation, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)))


@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_torch_transformer_layers_get_their_activation_function_by_structure(
    activation: str,
) -> None:
    """``TransformerEncoderLayer`` keeps its activation as a function (``self.activation``), not a
    module: by structure, linear1 gets its gain and linear2, the MLP's output, gain 1, as a trace
    of a forward pass finds."""
    rows = _rows(initlab.init_model(_TorchEncoderLM(activation), "fan_in", generator=0))
    traced = _rows(
        initlab.init_model(
            _TorchEncoderLM(activation), "fan_in", generator=0, example_inputs=_tokens()[:, :T]
        )
    )
    for i in range(2):
        first, second = (f"encoder.layers.{i}.linear{k}.weight" for k in (1, 2))
        assert rows[first]["gain"] == pytest.approx(calculate_gain(activation))
        assert rows[second]["gain"] == 1.0
        assert (rows[first]["gain"], rows[second]["gain"]) == (
            traced[first]["gain"],
            traced[second]["gain"],
        )


def test_bert_mlp_output_projection_gets_gain_one() -> None:
    """BertOutput.dense (dense -> dropout -> residual sum -> LayerNorm) kept the ReLU gain
    (std 0.149 under geometric for 0.105), where DistilBERT's lin2 and Llama's down_proj get 1."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=64, vocab_size=100)  # fmt: skip
    torch.manual_seed(0)
    rows = _rows(initlab.init_model(transformers.BertModel(config), "geometric", generator=0))
    out = rows["encoder.layer.0.output.dense.weight"]
    assert out["gain"] == 1.0 and out["gain_from"].startswith("none: MLP output projection")
    mid = rows["encoder.layer.0.intermediate.dense.weight"]
    assert mid["gain"] == pytest.approx(calculate_gain("gelu"))


@pytest.mark.parametrize("scheme", ["geometric", "orthogonal"])
def test_gpt2_fused_qkv_is_drawn_per_projection(scheme: str) -> None:
    """GPT-2's c_attn (Conv1D, (n, 3n)) was one 64x192 matrix: geometric std 0.095 for the
    0.125 of an n x n projection, and its q block was not orthogonal (singular values 0.0004 to
    0.94). Drawn per q/k/v block now, as nn.MultiheadAttention's in_proj_weight."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=100, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    rows = _rows(initlab.init_model(model, scheme, generator=0))
    row = rows["transformer.h.0.attn.c_attn.weight"]
    assert (row["blocks"], row["fan_in"], row["fan_out"]) == (3, 64, 64)
    w = model.transformer.h[0].attn.c_attn.weight.detach().double()
    for k in range(3):
        block = w[:, 64 * k : 64 * (k + 1)]
        if scheme == "orthogonal":
            sv = torch.linalg.svdvals(block)
            torch.testing.assert_close(sv, torch.full_like(sv, float(sv.mean())), rtol=1e-5, atol=0)
        else:
            assert float(block.std()) == pytest.approx(
                row["target_std"], rel=4 / math.sqrt(2 * 4096)
            )
    if scheme == "geometric":  # gain 1 (attention), (n * n)^(-1/4) with n = 64
        assert row["target_std"] == pytest.approx(0.125)


@pytest.mark.parametrize(("family", "identity"), [("llama", 1.0), ("t5", 1.0), ("gemma", 0.0)])
def test_hugging_face_norms_are_reset_to_their_identity(family: str, identity: float) -> None:
    """LlamaRMSNorm and T5LayerNorm scale by ``w``, GemmaRMSNorm by ``1 + w``: each weight is put
    back where its layer leaves the normalized input as it is (they were left unclaimed, with a
    warning: a trained model kept its trained norms; ones would double Gemma's outputs)."""
    pytest.importorskip("transformers")
    from . import hf_models

    model = hf_models.model_of(family) if family != "gemma" else hf_models.gemma()
    norms = {n: p for n, p in model.named_parameters() if "norm" in n}
    assert norms
    with torch.no_grad():
        for p in norms.values():
            p.uniform_(0.5, 2.0)  # as trained
    report = initlab.init_model(model, "geometric", generator=0)  # warnings are errors here
    rows = {join_name(r["layer"], r["param"]): r for r in report.to_rows()}
    for name, p in norms.items():
        assert torch.equal(p, torch.full_like(p, identity)), name
        assert rows[name]["role"] == "norm_scale" and rows[name]["distribution"] == "constant"
    assert not report.unclaimed()


def _fused_models() -> dict[str, Callable[[], nn.Module]]:
    tf = pytest.importorskip("transformers")
    small = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, vocab_size=64)
    return {
        "gpt_neox": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(intermediate_size=64, **small)),
        "bloom": lambda: tf.BloomForCausalLM(tf.BloomConfig(hidden_size=32, n_head=4, n_layer=1,
                                                            vocab_size=64)),
        "falcon_grouped": lambda: tf.FalconForCausalLM(tf.FalconConfig(
            new_decoder_architecture=True, num_kv_heads=2, **small)),
        "falcon_multi_query": lambda: tf.FalconForCausalLM(tf.FalconConfig(
            multi_query=True, new_decoder_architecture=False, **small)),
        "falcon_per_head": lambda: tf.FalconForCausalLM(tf.FalconConfig(
            multi_query=False, new_decoder_architecture=False, **small)),
        "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(intermediate_size=48,
                                                         num_key_value_heads=2, pad_token_id=0,
                                                         **small)),
        "modernbert": lambda: tf.ModernBertForMaskedLM(tf.ModernBertConfig(
            intermediate_size=48, pad_token_id=0, **small)),
        "gpt_bigcode_mq": lambda: tf.GPTBigCodeForCausalLM(tf.GPTBigCodeConfig(
            n_embd=32, n_head=4, n_layer=1, vocab_size=64, multi_query=True)),
        "gpt_bigcode_mha": lambda: tf.GPTBigCodeForCausalLM(tf.GPTBigCodeConfig(
            n_embd=32, n_head=4, n_layer=1, vocab_size=64, multi_query=False)),
        "mpt": lambda: tf.MptForCausalLM(tf.MptConfig(d_model=32, n_heads=4, n_layers=1,
                                                      vocab_size=64)),
        "persimmon": lambda: tf.PersimmonForCausalLM(tf.PersimmonConfig(intermediate_size=64,
                                                                        **small)),
        "codegen": lambda: tf.CodeGenForCausalLM(tf.CodeGenConfig(
            n_embd=32, n_head=4, n_layer=1, vocab_size=64, rotary_dim=4, n_positions=32)),
        "deepseek_v3": lambda: tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4,
            num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=1, **small)),
        "dbrx": lambda: tf.DbrxForCausalLM(tf.DbrxConfig(
            d_model=32, n_heads=4, n_layers=1, vocab_size=64, max_seq_len=32,
            attn_config={"kv_n_heads": 2, "rope_theta": 1e4, "clip_qkv": 8.0},
            ffn_config={"ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2})),
        "mamba2": lambda: tf.Mamba2ForCausalLM(tf.Mamba2Config(
            vocab_size=64, hidden_size=32, num_hidden_layers=1, state_size=8, expand=2,
            head_dim=8, num_heads=8, n_groups=1, chunk_size=4, conv_kernel=4)),
        "mamba": lambda: tf.MambaForCausalLM(tf.MambaConfig(hidden_size=32, state_size=4,
                                                            num_hidden_layers=1, vocab_size=64)),
    }  # fmt: skip


_H, _HD, _N = 4, 8, 32


def _split_as_the_model_does(family: str, w: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """Each head's query, key and value rows of a fused weight ``(out, 32)``, cut as each
    model's forward cuts its output (read from its code, independently of initlab's layouts)."""
    if family in ("gpt_neox", "bloom", "falcon_per_head", "gpt_bigcode_mha", "persimmon"):
        heads = w.view(_H, 3, _HD, _N)  # (q, k, v) head by head
        return {p: [heads[h, i] for h in range(_H)] for i, p in enumerate("qkv")}
    if family == "falcon_grouped":  # 2 groups of (2 query heads, 1 key, 1 value)
        groups = w.view(2, 4, _HD, _N)
        q = [groups[g, j] for g in range(2) for j in range(2)]
        return {
            "q": q,
            "k": [groups[g, 2] for g in range(2)],
            "v": [groups[g, 3] for g in range(2)],
        }
    if family == "codegen":  # 4 groups of (query, value, key), one head each here
        groups = w.view(4, 3, _HD, _N)
        return {p: [groups[g, i] for g in range(4)] for i, p in enumerate("qvk")}
    kv = {"phi3": 2, "modernbert": 4, "mpt": 4, "dbrx": 2}.get(family, 1)  # [q; k; v]
    q, k, v = w.split([_H * _HD, kv * _HD, kv * _HD])
    return {p: list(t.view(-1, _HD, _N)) for p, t in zip("qkv", (q, k, v), strict=True)}


def _kv_heads(family: str) -> int:
    kv = {"falcon_grouped": 2, "phi3": 2, "dbrx": 2, "falcon_multi_query": 1, "gpt_bigcode_mq": 1}
    return kv.get(family, _H)


@pytest.mark.parametrize(
    "family",
    ["gpt_neox", "bloom", "falcon_grouped", "falcon_multi_query", "falcon_per_head", "phi3",
     "modernbert", "gpt_bigcode_mq", "gpt_bigcode_mha", "mpt", "persimmon", "codegen", "dbrx"],
)  # fmt: skip
def test_fused_qkv_weights_are_drawn_per_projection_as_the_model_cuts_them(family: str) -> None:
    """GPT-NeoX/Bloom/Falcon's query_key_value, Phi-3's qkv_proj, ModernBERT's Wqkv and
    GPTBigCode's c_attn were drawn as one matrix: a geometric std of (n * 3n)^(-1/4) for every
    head (0.134 for 0.177 at n = 32), an orthogonal query head with singular values down to 0.02.
    Each head now gets its projection's std, and an orthogonal draw is orthogonal per head."""
    torch.manual_seed(0)
    model = _fused_models()[family]()
    (name,) = [
        n for n, _ in model.named_parameters()
        if n.endswith(("query_key_value.weight", "qkv_proj.weight", "Wqkv.weight", "c_attn.weight"))
    ]  # fmt: skip
    skip = "skip" if family == "dbrx" else "warn"  # DBRX's experts (2-D, E stacked) unclaimed
    initlab.init_model(model, "geometric", generator=0, policy=skip)
    parts = _split_as_the_model_does(family, model.get_parameter(name).detach().double())
    for proj, heads in parts.items():
        fan_out = _H * _HD if proj == "q" else _kv_heads(family) * _HD
        want = (_N * fan_out) ** -0.25  # gain 1 (attention)
        got = torch.stack(heads).std().item()
        assert got == pytest.approx(want, rel=4 / math.sqrt(2 * sum(h.numel() for h in heads)))
    initlab.init_model(model, "orthogonal", generator=0, policy=skip)
    parts = _split_as_the_model_does(family, model.get_parameter(name).detach().double())
    for proj, heads in parts.items():
        for head in heads:  # orthonormal rows, up to the scheme's gain
            sv = torch.linalg.svdvals(head)
            torch.testing.assert_close(sv, sv.new_full(sv.shape, float(sv.mean())), rtol=1e-6,
                                       atol=0, msg=f"{family} {proj}")  # fmt: skip


@pytest.mark.parametrize(
    ("family", "suffix", "widths"),
    [
        ("deepseek_v3", "kv_a_proj_with_mqa.weight", (16, 8)),
        ("mamba", "in_proj.weight", (64, 64)),
        ("mamba2", "in_proj.weight", (64, 64, 8, 8, 8)),
    ],
)
def test_a_fused_weight_of_several_widths_is_drawn_as_its_matrices(
    family: str, suffix: str, widths: tuple[int, ...]
) -> None:
    """DeepSeek's latent key/value projection (the compressed kv, then the key's rotary part,
    split so by its forward), Mamba's in_proj (its input, then its gate: chunk(2)) and Mamba 2's
    (z, x, B, C, dt) are matrices of their own: each its own std, each orthogonal."""
    torch.manual_seed(0)
    model = _built(_fused_models()[family])
    name = next(n for n, _ in model.named_parameters() if n.endswith(suffix))
    report = initlab.init_model(model, "geometric", generator=0, policy="skip")  # Mamba's A_log
    row = {join_name(r["layer"], r["param"]): r for r in report.to_rows()}[name]
    assert row["blocks"] == len(widths)
    for part, width in zip(model.get_parameter(name).detach().double().split(widths), widths,
                           strict=True):  # fmt: skip
        want = row["gain"] * (_N * width) ** -0.25
        assert part.std().item() == pytest.approx(want, rel=4 / math.sqrt(2 * part.numel()))
    initlab.init_model(model, "orthogonal", generator=0, policy="skip")
    for part in model.get_parameter(name).detach().double().split(widths):
        sv = torch.linalg.svdvals(part)
        torch.testing.assert_close(sv, sv.new_full(sv.shape, float(sv.mean())), rtol=1e-6, atol=0)


@pytest.mark.parametrize("family", ["phi3", "modernbert"])
def test_a_fused_gate_and_input_are_drawn_as_two_matrices(family: str) -> None:
    torch.manual_seed(0)
    model = _fused_models()[family]()
    (name,) = [
        n for n, _ in model.named_parameters() if n.endswith(("gate_up_proj.weight", "Wi.weight"))
    ]
    report = initlab.init_model(model, "geometric", generator=0)
    row = {join_name(r["layer"], r["param"]): r for r in report.to_rows()}[name]
    assert (row["blocks"], row["fan_in"], row["fan_out"]) == (2, _N, 48)
    # the activated half at its activation's gain, the half it multiplies at gain 1
    halves = model.get_parameter(name).detach().double().chunk(2)
    for half, gain in zip(halves, (row["gain"], 1.0), strict=True):
        want = gain * (_N * 48) ** -0.25
        assert half.std().item() == pytest.approx(want, rel=4 / math.sqrt(2 * half.numel()))
    assert row["gain"] > 1.1 and "input half at gain 1" in row["gain_from"]


def test_a_fused_qkv_without_a_config_is_cut_in_three_equal_projections() -> None:
    # nanoGPT's c_attn (an nn.Linear(n, 3n) split in thirds), timm's qkv
    report = initlab.init_model(GPT2Like(), "orthogonal", generator=0)
    row = _rows(report)["h.0.attn.c_attn.weight"]
    assert (row["blocks"], row["fan_in"], row["fan_out"]) == (3, D, D)


class _TokenClassifier(nn.Module):
    """A token table of 64 words, an MLP 64 wide, a 5-label classifier: no vocabulary head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)
        self.classifier = nn.Linear(16, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        return self.classifier(h + self.down(F.gelu(self.up(h)))).mean(1)


def test_an_mlp_as_wide_as_the_vocabulary_is_not_taken_for_the_head() -> None:
    # the last Linear with out_features == vocabulary size was the head, drawn 1/sqrt(d) small
    rows = _rows(initlab.init_model(_TokenClassifier(), "geometric", generator=0))
    assert rows["up.weight"]["role"] == "weight" and rows["up.weight"]["gain"] != 1.0
    assert not any(r["role"] == "head" for r in rows.values())


@pytest.mark.parametrize("family", ["electra", "deberta"])
def test_a_hugging_face_model_declaring_no_vocabulary_head_gets_none(family: str) -> None:
    """ElectraForPreTraining and DebertaV2ForSequenceClassification return None from
    get_output_embeddings(); their MLP, as wide as the vocabulary here, was taken for a head
    (DeBERTa's relative-position table counted as a word table too). DeBERTa's head is its
    classifier (:func:`find_classifier`); Electra's discriminator declares none."""
    tf = pytest.importorskip("transformers")
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=4, max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    if family == "electra":
        model = tf.ElectraForPreTraining(tf.ElectraConfig(embedding_size=32, **small))
    else:
        config = tf.DebertaV2Config(relative_attention=True, max_relative_positions=32,
                                    position_buckets=32, num_labels=3, **small)  # fmt: skip
        model = tf.DebertaV2ForSequenceClassification(config)
    assert model.get_output_embeddings() is None
    tables = [name for name, _ in token_tables(model)]
    assert tables and not [name for name in tables if "rel_embeddings" in name]
    rows = _rows(initlab.init_model(model, "geometric", generator=0))
    heads = [n for n, r in rows.items() if r["role"] in ("head", "tied embedding/head")]
    assert heads == ([] if family == "electra" else ["classifier.weight"])


def test_mambas_time_step_bias_is_kept() -> None:
    """dt_proj.bias is softplus^-1 of a time step drawn in [0.001, 0.1]; the bias policy set it to
    0 (dt = 0.69 in every channel: the state kept half of itself per step instead of ~0.99)."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = tf.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=8)
    model = tf.MambaForCausalLM(config)
    biases = {n: p.detach().clone() for n, p in model.named_parameters() if "dt_proj.bias" in n}
    with pytest.warns(UserWarning, match="A_log"):  # the SSM's own parameters: unclaimed
        rows = _rows(initlab.init_model(model, "geometric", generator=0))
    assert len(biases) == 2
    for name, before in biases.items():
        assert torch.equal(model.get_parameter(name), before), name
        assert rows[name]["scheme"] == "untouched" and "time-step bias" in rows[name]["note"]
    dt = F.softplus(model.get_parameter(next(iter(biases))).detach())
    assert float(dt.min()) >= 0.001 and float(dt.max()) <= 0.1 + 1e-6


class _PerLayerConfig:
    """A Hugging Face config whose attributes vary per layer (Gemma 4): a global read raises."""

    model_type, num_attention_heads, hidden_size = "phi3", 4, 32

    @property
    def head_dim(self) -> int:
        raise RuntimeError("'head_dim' is a per-layer attribute and may vary across layers")


class _PerLayerAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = _PerLayerConfig()
        self.qkv_proj, self.o_proj = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.qkv_proj(x)[..., :32])


def test_a_config_that_refuses_a_global_read_does_not_stop_init_model() -> None:
    # every nn.Linear read the config's head_dim: Gemma 4's RuntimeError stopped init_model
    rows = _rows(initlab.init_model(_PerLayerAttention(), "geometric", generator=0))
    assert rows["qkv_proj.weight"]["blocks"] == 3  # head_dim from hidden_size / heads
    assert rows["o_proj.weight"]["blocks"] == 1


def _classifiers() -> dict[str, Callable[[], tuple[nn.Module, dict[str, torch.Tensor]]]]:
    tf = pytest.importorskip("transformers")
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, num_labels=3)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (32, 8), generator=gen)
    labels = torch.randint(0, 3, (32,), generator=gen)

    def llama() -> tuple[nn.Module, dict[str, torch.Tensor]]:
        config = tf.LlamaConfig(vocab_size=64, pad_token_id=0, **small)
        return tf.LlamaForSequenceClassification(config), {"input_ids": ids, "labels": labels}

    def bert_tokens() -> tuple[nn.Module, dict[str, torch.Tensor]]:
        config = tf.BertConfig(vocab_size=64, **small)
        token_labels = torch.randint(0, 3, (32, 8), generator=gen)
        return tf.BertForTokenClassification(config), {"input_ids": ids, "labels": token_labels}

    def vit() -> tuple[nn.Module, dict[str, torch.Tensor]]:
        config = tf.ViTConfig(image_size=16, patch_size=4, **small)
        pixels = torch.randn(32, 3, 16, 16, generator=gen)
        return tf.ViTForImageClassification(config), {"pixel_values": pixels, "labels": labels}

    return {"llama_sequence": llama, "bert_tokens": bert_tokens, "vit_image": vit}


@pytest.mark.parametrize("family", ["llama_sequence", "bert_tokens", "vit_image"])
def test_a_classifiers_output_layer_is_drawn_as_a_head(family: str) -> None:
    """The output layer of a ...ForSequence/Token/ImageClassification model (config.num_labels
    outputs) was drawn at the scheme's ReLU gain: initial losses of 1.6 (text) to 3.4 (images)
    times ln C. Drawn as a head, the loss starts near ln C, as with the model's own init."""
    torch.manual_seed(0)
    model, batch = _classifiers()[family]()
    # ViT's cls_token and position_embeddings are raw parameters no handler claims
    rows = _rows(initlab.init_model(model, "geometric", generator=0, policy="skip"))
    heads = [n for n, r in rows.items() if r["role"] == "head"]
    assert heads == [{"llama_sequence": "score.weight"}.get(family, "classifier.weight")]
    with torch.no_grad():
        loss = float(model.eval()(**batch).loss)
    assert loss == pytest.approx(math.log(3), abs=0.2)


def _built(factory: Callable[[], nn.Module]) -> nn.Module:
    """The model, or a skip where the installed transformers does not have it."""
    try:
        return factory()
    except AttributeError as err:  # e.g. GPT-OSS and DeepSeek-V3 are newer than transformers 4.48
        pytest.skip(str(err))


def _banks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The banks of experts, 3-D tensors (transformers 5); before, experts were a ``ModuleList``
    of MLPs, claimed as plain layers."""
    found = [
        (n, m) for n, m in model.named_modules()
        if isinstance(getattr(m, "down_proj", None), nn.Parameter) and m.down_proj.dim() == 3
    ]  # fmt: skip
    if not found:
        pytest.skip("this transformers keeps its experts as separate Linear layers")
    return found


def _moe_models() -> dict[str, Callable[[], nn.Module]]:
    tf = pytest.importorskip("transformers")
    small = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=64, max_position_embeddings=32,
                 num_experts_per_tok=2)  # fmt: skip
    return {
        "mixtral": lambda: tf.MixtralForCausalLM(tf.MixtralConfig(num_local_experts=4, **small)),
        "qwen2_moe": lambda: tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
            num_experts=4, moe_intermediate_size=24, shared_expert_intermediate_size=48, **small)),
        "gpt_oss": lambda: tf.GptOssForCausalLM(tf.GptOssConfig(
            num_local_experts=4, head_dim=8, layer_types=["full_attention"], **small)),
        "llama4": lambda: tf.Llama4ForCausalLM(tf.Llama4TextConfig(
            num_local_experts=4, head_dim=8, intermediate_size_mlp=64, **small)),
    }  # fmt: skip


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "gpt_oss", "llama4"])
def test_mixture_of_experts_layers_are_drawn_one_expert_at_a_time(family: str) -> None:
    """The experts (3-D tensors) and the router were left unclaimed, with a warning, at the
    model's own init. Each expert's matrix is now drawn as its own orthogonal matrix, in the
    model's layout (GPT-OSS stores ``(E, in, out)``, its gate and input interleaved, each drawn
    as its own matrix; Llama 4
    ``(E, in, out)`` without declaring it, read from its code); the router
    too; the initial loss stays near ln V."""
    torch.manual_seed(0)
    model = _built(_moe_models()[family])
    banks = _banks(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*sinks")  # GPT-OSS's attention sinks
        report = initlab.init_model(model, "orthogonal", generator=0)
    rows = {join_name(r["layer"], r["param"]): r for r in report.to_rows()}
    for name, bank in banks:
        for param in ("gate_up_proj", "down_proj"):
            row = rows[f"{name}.{param}"]
            assert row["distribution"] == "orthogonal", row
            w = getattr(bank, param).detach().double()
            w = w.transpose(1, 2) if family in ("gpt_oss", "llama4") else w  # (E, out, in)
            if param != "gate_up_proj":
                halves: tuple[torch.Tensor, ...] = (w,)
            elif family == "gpt_oss":  # rows gate, input, gate, input, ...
                halves = (w[:, 0::2], w[:, 1::2])
            else:  # [gate; input]
                halves = w.split(w.shape[1] // 2, dim=1)
            gains = (row["gain"], 1.0) if len(halves) == 2 else (row["gain"],)  # input: gain 1
            for m, gain in zip(halves, gains, strict=True):  # per expert: orthonormal, x gain
                small = m @ m.transpose(1, 2) if m.shape[1] <= m.shape[2] else m.transpose(1, 2) @ m
                eye = torch.eye(small.shape[-1], dtype=torch.float64).expand_as(small)
                torch.testing.assert_close(small, gain**2 * eye, atol=1e-5, rtol=0)
    routers = [n for n, m in model.named_modules() if "Router" in type(m).__name__]
    assert routers and all(rows[f"{n}.weight"]["role"] == "weight" for n in routers)
    assert not report.unclaimed() or family == "gpt_oss"
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = float(model(input_ids=ids, labels=ids).loss)
    assert abs(loss - math.log(64)) < 0.15 * math.log(64)


def test_layer_spectra_of_a_bank_of_experts_are_those_of_its_experts() -> None:
    """One row per bank: the largest singular value over its experts (the oracle: each
    expert's matrix by itself), not of the 3-D tensor flattened as a convolution's."""
    torch.manual_seed(0)
    model = _built(_moe_models()["mixtral"])
    name, bank = _banks(model)[0]
    rows = {join_name(r["layer"], r["param"]): r for r in initlab.layer_spectra(model)}
    expected = max(float(torch.linalg.svdvals(m.double())[0]) for m in bank.down_proj.detach())
    row = rows[f"{name}.down_proj"]
    assert row["sv_max"] == pytest.approx(expected, rel=1e-9)
    assert row["op_norm"] == row["sv_max"] and "4 experts" in row["note"]


def test_a_detector_s_class_head_and_a_ctc_head_are_drawn_as_heads() -> None:
    """DETR's ``class_labels_classifier`` (num_labels + 1 outputs: the "no object" class) and a
    CTC model's ``lm_head`` got the scheme's ReLU gain (DETR's class loss 3.62 for ln 6 = 1.79):
    only ``...Classification`` models' classifiers were found."""
    pytest.importorskip("transformers")
    from . import hf_models

    torch.manual_seed(0)
    rows = _rows(initlab.init_model(hf_models.detr(), "geometric", generator=0))
    head = rows["class_labels_classifier.weight"]
    assert head["role"] == "head" and head["fan_out"] == 6  # 5 labels and "no object"

    class TinyForCTC(nn.Module):  # the shape of Wav2Vec2ForCTC: features, then lm_head
        def __init__(self) -> None:
            super().__init__()
            self.config = types.SimpleNamespace(vocab_size=12)
            self.proj, self.lm_head = nn.Linear(8, 16), nn.Linear(16, 12)

    rows = _rows(initlab.init_model(TinyForCTC(), "geometric", generator=0))
    assert rows["lm_head.weight"]["role"] == "head"


@pytest.mark.parametrize("family", ["electra", "albert"])
def test_a_head_s_dense_layer_before_its_activation_gets_the_activation_s_gain(
    family: str,
) -> None:
    """Electra's discriminator head and ALBERT's MLM head run ``dense`` -> GELU -> their output
    layer: ``dense`` was taken for an MLP output projection by its name (gain 1)."""
    tf = pytest.importorskip("transformers")
    small = dict(
        vocab_size=64, embedding_size=16, hidden_size=32, num_hidden_layers=1,
        num_attention_heads=4, intermediate_size=64, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    if family == "electra":
        model, dense = (
            tf.ElectraForPreTraining(tf.ElectraConfig(**small)),
            "discriminator_predictions",
        )
    else:
        model, dense = tf.AlbertForMaskedLM(tf.AlbertConfig(**small)), "predictions"
    rows = _rows(initlab.init_model(model, "geometric", generator=0))
    row = rows[f"{dense}.dense.weight"]
    assert row["gain"] == pytest.approx(calculate_gain("gelu")) and "gelu" in row["gain_from"]


def test_gpt_oss_experts_gate_gets_its_clamped_swish_s_gain() -> None:
    """GPT-OSS writes its experts' activation in their forward, ``g * sigmoid(1.702 g)`` of the
    gate clamped at 7: the gate kept the scheme's ReLU gain (1.414). The oracle: the second
    moment by Gauss-Hermite quadrature, ``gain = 1 / sqrt(E[act(z)^2])``."""
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    model = _built(_moe_models()["gpt_oss"])
    (name, bank), *_ = _banks(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*sinks")  # GPT-OSS's attention sinks
        rows = {join_name(r["layer"], r["param"]): r for r in
                initlab.init_model(model, "geometric", generator=0).to_rows()}  # fmt: skip
    z, w = np.polynomial.hermite_e.hermegauss(160)
    g = np.minimum(z, bank.limit)
    second = float(np.sum(w * (g / (1 + np.exp(-bank.alpha * g))) ** 2) / np.sqrt(2 * np.pi))
    row = rows[f"{name}.gate_up_proj"]
    assert row["gain"] == pytest.approx(1 / math.sqrt(second), rel=1e-6)
    assert "GPT-OSS" in row["gain_from"]


def test_a_vit_without_an_embedding_table_gets_its_transformer_gains() -> None:
    """ViT has no nn.Embedding and no vocabulary head (a patch conv and a classifier): its
    attention and MLP layers kept the scheme's ReLU gain (q, fc1, fc2 at sqrt 2), where BERT's
    get 1, GELU's and 1."""
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        image_size=8, patch_size=4, num_channels=3, num_labels=5,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(config)
    rows = _rows(initlab.init_model(model, "geometric", generator=0, policy="skip"))
    # transformers 5 names (vit.layers.0.attention.q_proj, mlp.fc1) or 4's (vit.encoder.layer.0.
    # attention.attention.query, intermediate.dense)
    five = "vit.layers.0.attention.q_proj.weight" in rows
    layer = "vit.layers.0." if five else "vit.encoder.layer.0."
    projections = (
        [f"attention.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if five
        else [f"attention.attention.{n}" for n in ("query", "key", "value")]
        + ["attention.output.dense"]
    )
    for name in projections:
        assert rows[f"{layer}{name}.weight"]["gain"] == 1.0, name
    assert rows[f"{layer}{'mlp.fc2' if five else 'output.dense'}.weight"]["gain"] == 1.0
    mid = rows[f"{layer}{'mlp.fc1' if five else 'intermediate.dense'}.weight"]
    assert mid["gain"] == pytest.approx(calculate_gain("gelu")) and "gelu" in mid["gain_from"]


def test_a_cnn_with_a_channel_attention_gate_keeps_the_schemes_gains() -> None:
    """A squeeze-and-excitation gate named ChannelAttention made init_model read the CNN as a
    transformer (gains followed: tanh's 1.667 where the scheme's 1.414 was documented)."""

    class ChannelAttention(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.fc = nn.Sequential(nn.Linear(c, c // 2), nn.ReLU(), nn.Linear(c // 2, c))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.sigmoid(self.fc(x.mean((2, 3))))[:, :, None, None]

    def make(gate: bool) -> nn.Module:
        layers = [nn.Conv2d(3, 8, 3), nn.Tanh(), nn.Conv2d(8, 8, 3), nn.Tanh()]
        return nn.Sequential(*layers, *([ChannelAttention(8)] if gate else []))

    plain = _rows(initlab.init_model(make(False), "geometric", generator=0))
    gated = _rows(initlab.init_model(make(True), "geometric", generator=0))
    for name in ("0.weight", "2.weight"):
        assert gated[name]["gain"] == plain[name]["gain"] == pytest.approx(math.sqrt(2)), name


class _Recurrent(nn.Module):
    """A token model of recurrent layers, each followed by a ReLU outside it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 64)
        self.lstm = nn.LSTM(64, 64, batch_first=True, proj_size=48)
        self.gru = nn.GRU(48, 64, batch_first=True)
        self.rnn = nn.RNN(64, 64, batch_first=True, nonlinearity="relu")
        self.cell = nn.GRUCell(64, 64)
        self.out = nn.Linear(64, V)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.lstm(self.emb(tokens))[0])
        h = F.relu(self.gru(h)[0])
        h = self.rnn(h)[0]
        return self.out(F.relu(self.cell(h[:, -1])))


@pytest.mark.parametrize("traced", [False, True])
def test_recurrent_gate_weights_get_the_gain_of_the_gates_not_of_what_follows_the_layer(
    traced: bool,
) -> None:
    """gains="auto" in a token model: an LSTM's and a GRU's gate blocks are followed by their
    sigmoid/tanh gates (gain 1, fan_in std 1/sqrt(fan_in) per gate block), not by the ReLU after
    the layer (sqrt(2)); a ReLU RNN's by its own ReLU; an LSTM's projection gets gain 1."""
    torch.manual_seed(0)
    model = _Recurrent().double()
    example = _tokens()[:, :-1] if traced else None
    rows = _rows(initlab.init_model(model, "fan_in", generator=0, example_inputs=example))
    params = dict(model.named_parameters())
    want = {
        "lstm.weight_ih_l0": (1.0, 4, 64),
        "lstm.weight_hh_l0": (1.0, 4, 48),
        "lstm.weight_hr_l0": (1.0, 1, 64),
        "gru.weight_ih_l0": (1.0, 3, 48),
        "gru.weight_hh_l0": (1.0, 3, 64),
        "rnn.weight_ih_l0": (math.sqrt(2), 1, 64),
        "rnn.weight_hh_l0": (math.sqrt(2), 1, 64),
        "cell.weight_ih": (1.0, 3, 64),
        "cell.weight_hh": (1.0, 3, 64),
    }
    for name, (gain, gates, fan_in) in want.items():
        row = rows[name]
        assert row["gain"] == pytest.approx(gain), (name, row["gain_from"])
        assert row["gain_from"].startswith("none" if gain == 1.0 else "relu"), name
        if gates > 1:
            assert "gates" in row["gain_from"], name
        for block in params[name].detach().chunk(gates, dim=0):
            std = float(block.pow(2).mean().sqrt())
            assert std == pytest.approx(
                gain / math.sqrt(fan_in), rel=Z / math.sqrt(2 * block.numel())
            )


class _PlainRecurrent(nn.Module):
    """An LSTM, a GRU and a tanh RNN with a linear head: no embedding table, no attention."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(32, 64)
        self.gru = nn.GRU(64, 48)
        self.rnn = nn.RNN(48, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.gru(self.lstm(x)[0])[0])[0][-1])


@pytest.mark.parametrize("gains", ["auto", "follow", "scheme"])
def test_recurrent_gates_set_the_gain_in_a_model_without_tokens(gains: str) -> None:
    """A plain recurrent model (no embedding, no attention, no example_inputs) under the default
    gains="auto": the gate blocks of the LSTM (4), the GRU (3) and the tanh RNN (1) are drawn at
    gain 1, std 1/sqrt(fan_in) per block, as in a token model; gains="scheme" keeps the fan_in
    scheme's ReLU gain, sqrt(2 / fan_in). The head keeps the scheme's gain under "auto" (nothing
    else is followed in such a model)."""
    torch.manual_seed(0)
    model = _PlainRecurrent().double()
    rows = _rows(initlab.init_model(model, "fan_in", generator=0, gains=gains))
    params = dict(model.named_parameters())
    gate_gain = math.sqrt(2) if gains == "scheme" else 1.0
    want = {
        "lstm.weight_ih_l0": (4, 32),
        "lstm.weight_hh_l0": (4, 64),
        "gru.weight_ih_l0": (3, 64),
        "gru.weight_hh_l0": (3, 48),
        "rnn.weight_ih_l0": (1, 48),
        "rnn.weight_hh_l0": (1, 64),
    }
    for name, (gates, fan_in) in want.items():
        row = rows[name]
        assert row["gain"] == pytest.approx(gate_gain), (name, row["gain_from"])
        assert row["gain_from"].startswith("scheme" if gains == "scheme" else "none"), name
        for block in params[name].detach().chunk(gates, dim=0):
            std = float(block.pow(2).mean().sqrt())
            assert std == pytest.approx(
                gate_gain / math.sqrt(fan_in), rel=Z / math.sqrt(2 * block.numel())
            ), name
    if gains == "auto":
        assert rows["head.weight"]["gain_from"] == "scheme"
