"""Residual blocks from one forward (:mod:`initlab.measure.runtime_trace`) where ``torch.fx`` fails:
plain-torch models with data-dependent control flow, then tiny Hugging Face GPT-2, BERT and Llama,
through the runtime trace, the scaling linter's fallback and ``initlab.diagnose``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import initlab
from initlab.diagnostics.linter import lint_model
from initlab.measure._fx import trace_model
from initlab.measure.runtime_trace import (
    attention_layers,
    find_runtime_blocks,
    runtime_trace,
    what_follows,
)

pytestmark = pytest.mark.usefixtures("one_thread")

D = 8


def _gate(x: torch.Tensor) -> torch.Tensor:
    """Data-dependent control flow: ``torch.fx.symbolic_trace`` cannot trace it."""
    return x if x.sum() > -1e9 else -x


class PreLN(nn.Module):
    """``x + fc2(relu(fc1(ln(x))))`` then a head; a BatchNorm (train mode: its running stats move)
    and a dropout (uses the RNG) on the way."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.bn = nn.BatchNorm1d(D)
        self.ln = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _gate(self.bn(self.inp(x)))
        x = x + self.drop(self.fc2(torch.relu(self.fc1(self.ln(x)))))
        return self.head(x)


class Projected(nn.Module):
    """``proj(x) + fc2(tanh(fc1(x)))``: a projection shortcut, in-place addition."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, 2 * D)
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, 2 * D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _gate(x)
        out = self.fc2(torch.tanh(self.fc1(x)))
        out += self.proj(x)
        return out


class Embed(nn.Module):
    """``tok_emb(idx) + pos_emb(arange)`` (not residual), then one residual block."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(16, D)
        self.pos = nn.Embedding(10, D)
        self.mlp = nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.Linear(D, D))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        idx = _gate(idx)
        h = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        return h + self.mlp(h)


class Boom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


def _state(model: nn.Module) -> dict[str, Any]:
    return {
        "tensors": {k: v.clone() for k, v in model.state_dict().items()},
        "modes": {n: m.training for n, m in model.named_modules()},
        "rng": torch.get_rng_state(),
        "grads": [p.grad for p in model.parameters()],
    }


def _assert_unchanged(model: nn.Module, before: dict[str, Any], rng: bool = True) -> None:
    for k, v in model.state_dict().items():
        assert torch.equal(v, before["tensors"][k]), k
    assert {n: m.training for n, m in model.named_modules()} == before["modes"]
    assert not rng or torch.equal(torch.get_rng_state(), before["rng"])
    assert [p.grad for p in model.parameters()] == before["grads"]
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    assert not torch.overrides._get_current_function_mode_stack()


def _x(n: int = 4) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(0))


# ----------------------------------------------------------------------------- plain torch


def test_fx_fails_on_the_test_models() -> None:
    for cls in (PreLN, Projected, Embed):
        assert trace_model(cls())[0] is None


def test_pre_ln_block_exactly_and_model_unchanged() -> None:
    torch.manual_seed(0)
    model = PreLN().train()
    before = _state(model)
    blocks = find_runtime_blocks(model, (_x(),))
    _assert_unchanged(model, before)
    assert len(blocks) == 1
    (b,) = blocks
    assert b["branch"] == ["ln", "fc1", "fc2"]
    assert b["shortcut"] == []
    assert b["module"] == "" and b["source"] == "runtime"
    assert b["name"] == f"<root>:{b['node']}" and b["node"].startswith("add")
    assert b["input"] == "batch_norm"  # the block input: the gated BatchNorm output


def test_projection_shortcut_and_inplace_add() -> None:
    torch.manual_seed(0)
    blocks = find_runtime_blocks(Projected(), (_x(),))
    assert [(b["branch"], b["shortcut"]) for b in blocks] == [(["fc1", "fc2"], ["proj"])]
    assert blocks[0]["node"].startswith("add_")  # ``out += ...`` is Tensor.add_


def test_position_embeddings_are_not_a_residual_connection() -> None:
    torch.manual_seed(0)
    idx = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(0))
    blocks = find_runtime_blocks(Embed(), (idx,))
    assert [(b["branch"], b["shortcut"]) for b in blocks] == [(["mlp.0", "mlp.2"], [])]


class SharedBias(nn.Module):
    """Two pre-LN attention layers; the first computes a position bias (an embedding of relative
    positions, plus the padding mask) and every layer adds it to its scores in place, as T5 did
    in transformers 4.x. The bias is a data ancestor of the second layer's scores (through the
    first layer's softmax), yet ``scores += bias`` is no residual connection."""

    def __init__(self, fx: bool = False) -> None:
        super().__init__()
        self.fx = fx
        self.rel = nn.Embedding(2 * 10, 2)
        self.ln = nn.ModuleList(nn.LayerNorm(D) for _ in range(2))
        self.qkv = nn.ModuleList(nn.Linear(D, 3 * D) for _ in range(2))
        self.o = nn.ModuleList(nn.Linear(D, D) for _ in range(2))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if not self.fx:
            x = _gate(x)
        b, t, _ = x.shape
        pos = torch.arange(t, device=x.device)
        bias = self.rel(pos[None, :] - pos[:, None] + 10).permute(2, 0, 1).unsqueeze(0)
        bias = bias + (1.0 - mask[:, None, None, :].to(x.dtype)) * -1e4
        for ln, qkv, o in zip(self.ln, self.qkv, self.o, strict=True):
            q, k, v = qkv(ln(x)).view(b, t, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
            scores = q @ k.transpose(-1, -2)
            scores += bias
            attn = torch.softmax(scores.float(), dim=-1).type_as(scores)
            x = x + o((attn @ v).transpose(1, 2).reshape(b, t, D))
        return x


def test_an_attention_bias_added_to_the_scores_is_not_a_residual_connection() -> None:
    """Only the two attention residuals; the shared bias added to the second layer's scores
    is attention logits plus a bias (it feeds a softmax), by the runtime trace and by fx."""
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    expected = [(["ln.0", "qkv.0", "o.0"], []), (["ln.1", "qkv.1", "o.1"], [])]
    blocks = find_runtime_blocks(SharedBias(), (x, mask))
    assert [(b["branch"], b["shortcut"]) for b in blocks] == expected
    gm, error = trace_model(SharedBias(fx=True))
    if gm is None:  # torch < 2.5 cannot trace torch.arange of a traced size
        assert "arange" in error
        return
    from initlab.measure.residual import find_residual_blocks

    assert [(b["branch"], b["shortcut"]) for b in find_residual_blocks(gm)] == expected


def test_recorded_graph() -> None:
    torch.manual_seed(0)
    graph = runtime_trace(PreLN(), (_x(),))
    assert graph.nodes[0].kind == "input"
    assert {"inp", "bn", "ln", "fc1", "fc2", "head"} <= graph.params
    linears = [n for n in graph.nodes if n.fn == "linear"]
    assert [n.module for n in linears] == ["inp", "fc1", "fc2", "head"]
    assert linears[1].stack == ("", "fc1")


def test_failure_leaves_no_hooks() -> None:
    model = Boom()
    with pytest.raises(RuntimeError, match="boom"):
        runtime_trace(model, (_x(),))
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    assert not torch.overrides._get_current_function_mode_stack()


def test_linter_falls_back_to_the_runtime_trace() -> None:
    torch.manual_seed(0)
    model = PreLN()
    res = lint_model(model, forward_args=[((_x(),), {})])
    assert not res.traced
    assert [b["branch"] for b in res.residual_blocks] == [["ln", "fc1", "fc2"]]
    skips = [f for f in res.findings if f["rule"] == "skip_connection"]
    assert len(skips) == 1 and "ln, fc1, fc2" in skips[0]["message"]
    (nt,) = [f for f in res.findings if f["rule"] == "not_traced"]
    assert "runtime trace" in nt["message"] and "1 residual block)" in nt["message"]
    # without forward arguments (or with tracing disabled): no runtime trace
    assert lint_model(model).residual_blocks == []
    assert lint_model(model, forward_args=[((_x(),), {})], trace=False).residual_blocks == []
    # the user's blocks win
    res = lint_model(model, forward_args=[((_x(),), {})], residual_blocks=["fc1"])
    assert [b["source"] for b in res.residual_blocks] == ["user"]


def test_linter_notes_a_failed_runtime_trace() -> None:
    res = lint_model(Boom(), forward_args=[((_x(),), {})])
    assert res.residual_blocks == []
    (nt,) = [f for f in res.findings if f["rule"] == "not_traced"]
    assert "runtime trace of residual additions failed (RuntimeError: boom)" in nt["message"]


def test_traceable_models_keep_the_fx_blocks() -> None:
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(D, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.fc(x)

    res = lint_model(Plain(), forward_args=[((_x(),), {})])
    assert res.traced and [b["source"] for b in res.residual_blocks] == ["fx"]


# ----------------------------------------------------------------------------- Hugging Face

V, T, B = 64, 8, 4


def _hf(family: str) -> nn.Module:
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=V, n_positions=16)
        return tf.GPT2LMHeadModel(cfg)
    if family == "bert":
        cfg = tf.BertConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
            vocab_size=V, max_position_embeddings=16,
        )  # fmt: skip
        return tf.BertForMaskedLM(cfg)
    cfg = tf.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=V,
    )  # fmt: skip
    return tf.LlamaForCausalLM(cfg)


def _batches(n: int = 2) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(1, V, (B, T), generator=g)
        mask = torch.ones(B, T, dtype=torch.long)
        mask[0, T // 2 :] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids})
    return out


def _expected(family: str) -> list[list[str]]:
    out = []
    for i in range(2):
        if family == "gpt2":
            p = f"transformer.h.{i}."
            out += [[p + "ln_1", p + "attn.c_attn", p + "attn.c_proj"]]
            out += [[p + "ln_2", p + "mlp.c_fc", p + "mlp.c_proj"]]
        elif family == "bert":
            p = f"bert.encoder.layer.{i}."
            att = [p + f"attention.self.{s}" for s in ("query", "key", "value")]
            out += [[*att, p + "attention.output.dense"]]
            out += [[p + "intermediate.dense", p + "output.dense"]]
        else:
            p = f"model.layers.{i}."
            att = [p + f"self_attn.{s}_proj" for s in ("q", "k", "v", "o")]
            out += [[p + "input_layernorm", *att]]
            mlp = [p + f"mlp.{s}_proj" for s in ("gate", "up", "down")]
            out += [[p + "post_attention_layernorm", *mlp]]
    return out


FAMILIES = ("gpt2", "bert", "llama")


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("family", FAMILIES)
def test_transformer_blocks(family: str) -> None:
    model = _hf(family)
    assert trace_model(model)[0] is None
    before = _state(model)
    blocks = find_runtime_blocks(model, (), _batches(1)[0])
    _assert_unchanged(model, before)
    assert [b["branch"] for b in blocks] == _expected(family)
    assert all(b["shortcut"] == [] and b["source"] == "runtime" for b in blocks)
    assert len({b["name"] for b in blocks}) == 4


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("family", FAMILIES)
def test_transformer_linter(family: str) -> None:
    model = _hf(family)
    res = lint_model(model, forward_args=[((), b) for b in _batches()])
    assert [b["branch"] for b in res.residual_blocks] == _expected(family)
    assert sum(f["rule"] == "skip_connection" for f in res.findings) == 4


@pytest.mark.filterwarnings("ignore")
def test_diagnose_gpt2_sees_the_residual_blocks() -> None:
    model = _hf("gpt2")
    before = _state(model)
    report = initlab.diagnose(model, _batches(), spectra=False)
    _assert_unchanged(model, before, rng=False)
    got = report.meta["residual_blocks"]
    assert [b["branch"] for b in got] == _expected("gpt2")
    assert {b["source"] for b in got} == {"runtime"}
    assert sum(f["rule"] == "skip_connection" for f in report.findings) == 4


@pytest.mark.filterwarnings("ignore")
def test_diagnose_bert_lipschitz_uses_the_blocks() -> None:
    report = initlab.diagnose(_hf("bert"), _batches(1))
    lip = report.meta["lipschitz"]
    assert len(report.meta["residual_blocks"]) == 4
    assert lip["residual"] > 1e3 * lip["plain"]
    assert not lip["guaranteed"] and any("LayerNorm" in n for n in lip["notes"])
    # LayerNorm has no operator-norm bound: the summary prints no number
    assert "Lipschitz upper bound: not available" in report.summary()


class _Attention(nn.Module):
    """Separate q/k/v projections, SDPA or eager softmax, a gated MLP and a LayerNorm."""

    def __init__(self, eager: bool) -> None:
        super().__init__()
        self.eager = eager
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))
        self.gate, self.up, self.down = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.eager:
            a = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, dim=-1) @ v
        else:
            a = F.scaled_dot_product_attention(q, k, v)
        h = self.norm(x + self.o(a))
        return self.down(F.silu(self.gate(h)) * self.up(h))


@pytest.mark.parametrize("eager", [True, False])
def test_what_follows_each_layer(eager: bool) -> None:
    model = _Attention(eager)
    graph = runtime_trace(model, (torch.randn(2, 5, 8),))
    types = {n: type(m).__name__ for n, m in model.named_modules()}
    got = what_follows(graph, types)
    assert got["q"] >= {"attention scores"} and got["k"] >= {"attention scores"}
    assert got["v"] == {"attention values"}
    assert got["o"] == {"normalization"}
    assert got["gate"] == got["up"] == {"product"}
    assert got["down"] == set() and got["norm"] == set()
    assert attention_layers(graph, types) == {
        "q": "attention scores", "k": "attention scores", "v": "attention values",
    }  # fmt: skip


def test_a_product_by_a_function_of_the_same_activation_or_by_constants_is_no_gate() -> None:
    """GELU written out (GPT-2's ``0.5 x (1 + tanh(...x...))``) and a rotary embedding's
    ``q * cos + rotate(q) * sin`` were read as gated units ("multiplied by another activation");
    a product by another layer's output (SwiGLU's up) still is one."""

    class Written(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.q, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 8)
            self.register_buffer("cos", torch.linspace(0.1, 1.0, 16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            h = 0.5 * h * (1 + torch.tanh(0.79788 * (h + 0.044715 * h.pow(3))))  # GELU
            q = self.q(h)
            q = q * self.cos + torch.flip(q, dims=[-1]) * (1 - self.cos)  # rotary-like
            return self.out(q)

    model = Written()
    graph = runtime_trace(model, (torch.randn(2, 5, 8),))
    got = what_follows(graph, {n: type(m).__name__ for n, m in model.named_modules()})
    assert got["fc"] == set() and got["q"] == set()


class _QKNorm(nn.Module):
    """``w * x / rms(x)``, by hand, as Gemma 3's, OLMo 2's and Qwen 3's ``RMSNorm`` classes."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


@pytest.mark.parametrize("eager", [True, False])
def test_a_query_and_key_behind_a_qk_norm_still_feed_the_scores(eager: bool) -> None:
    """The walk stopped at ``q_norm`` (a module with a parameter): q and k were taken for MLP
    layers (precondition_ rescaled them). It walks through normalizations now; ``o`` still
    meets only its norm, and nothing inside a norm counts as a product."""

    class QK(_Attention):
        def __init__(self) -> None:
            super().__init__(eager)
            self.q_norm, self.k_norm = _QKNorm(8), _QKNorm(8)
            self.q, self.k = nn.Sequential(self.q, self.q_norm), nn.Sequential(self.k, self.k_norm)

    model = QK()
    graph = runtime_trace(model, (torch.randn(2, 5, 8),))
    types = {n: type(m).__name__ for n, m in model.named_modules()}
    found = attention_layers(graph, types)
    assert found["q.0"] == found["k.0"] == "attention scores" and found["v"] == "attention values"
    got = what_follows(graph, types)
    assert got["q.0"] >= {"normalization", "attention scores"} and "product" not in got["q.0"]
    assert got["o"] == {"normalization"}
