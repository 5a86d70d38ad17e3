"""Hugging Face ``transformers`` as a real client: every feature on tiny models built from configs
(no download), with dict batches, attention masks and the model's own loss, and with a criterion.

Families: a decoder LM with tied embeddings (GPT-2), an encoder classifier with attention masks and
padding (BERT), a Llama-style decoder (RoPE, RMSNorm, SwiGLU, grouped-query attention, untied head).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import initlab

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]

V, T, B = 64, 8, 4


def gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=V, n_positions=16, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def bert() -> nn.Module:
    cfg = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        vocab_size=V, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        max_position_embeddings=16,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(cfg)


def llama() -> nn.Module:
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=V, max_position_embeddings=32,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


FAMILIES: dict[str, Callable[[], nn.Module]] = {"gpt2": gpt2, "bert": bert, "llama": llama}


def model_of(family: str) -> nn.Module:
    torch.manual_seed(0)
    return FAMILIES[family]()


def batches(family: str, n: int = 3) -> list[dict[str, torch.Tensor]]:
    """Dict batches as a collator gives them: ids, an attention mask (BERT: padded), labels."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(1, V, (B, T), generator=g)
        mask = torch.ones(B, T, dtype=torch.long)
        if family == "bert":
            mask[0, T // 2 :] = 0  # one padded sequence
            labels = torch.randint(0, 3, (B,), generator=g)
        else:
            labels = ids
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def criterion_of(family: str) -> Any:
    """A standard criterion for the family's logits: nn.CrossEntropyLoss on BERT's (B, C); the
    named cross-entropy (flattening (B, T, V) against (B, T)) for the language models."""
    return nn.CrossEntropyLoss() if family == "bert" else "cross_entropy"


def tie_kept(model: nn.Module) -> bool:
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    tied = getattr(model.config, "tie_word_embeddings", False) and out is not None
    return not tied or out.weight is inp.weight


def own_loss(model: nn.Module, data: list[dict[str, torch.Tensor]]) -> float:
    with torch.no_grad():
        return sum(float(model(**b).loss) for b in data) / len(data)


LOSSES = ("model", "criterion")


def loss_arg(family: str, form: str) -> Any:
    return None if form == "model" else criterion_of(family)


# ----------------------------------------------------------------------------- measurements


@pytest.mark.parametrize("form", LOSSES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moments_gr_scaling_and_gradient_stats(family: str, form: str) -> None:
    model = model_of(family)
    data = batches(family)
    loss = "model" if form == "model" else criterion_of(family)
    probe = initlab.measure_moments(model, data, loss)
    assert (probe.used.batches, probe.used.examples) == (3, 3 * B)
    table = probe.table()
    assert len(table) > 0 and all(math.isfinite(r["E_y2"]) for r in table)
    assert any(math.isfinite(r["E_dy2"]) and r["E_dy2"] > 0 for r in table)
    gr = initlab.gr_scaling(model, data, loss_arg(family, form))
    assert len(gr) > 0 and gr.used.batches == 3
    stats = initlab.gradient_stats(model, data, loss_arg(family, form))
    assert stats.used.batches == 3 and all(r["batches"] == 3 for r in stats)
    assert tie_kept(model)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hessian_blocks_and_landscape(family: str) -> None:
    model = model_of(family)
    data = batches(family)
    blocks = initlab.block_curvature(model, data, probes=2, generator=0, group="module")
    diagonal = [r for r in blocks if r["block_row"] == r["block_col"]]
    assert diagonal and all(math.isfinite(r["value"]) for r in diagonal)
    grid = (torch.linspace(-0.5, 0.5, 3), torch.linspace(-0.5, 0.5, 3))
    land = initlab.loss_landscape(model, data[:1], grid=grid, generator=0)
    center = [r for r in land.to_rows() if r["t1"] == 0 and r["t2"] == 0]
    assert center and center[0]["loss"] == pytest.approx(own_loss(model, data[:1]), rel=1e-5)
    assert tie_kept(model)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_theory_vs_actual(family: str) -> None:
    """Every nn.Linear weight gets a row with a measured block; a tied tensor appears once."""
    model = model_of(family)
    rows = initlab.theory_vs_actual(model, batches(family), probes=2, generator=0)
    assert len(rows) > 0 and all(math.isfinite(r["actual"]) for r in rows)
    blocks = [r["block"] for r in rows]
    assert len(blocks) == len(set(blocks))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_diagnose_and_spectra(family: str) -> None:
    model = model_of(family)
    data = batches(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = initlab.diagnose(model, data, spectra=False, lint=False)
    assert report.meta["batches"] == 3 and len(report.to_rows()) > 0
    spectra = initlab.layer_spectra(model, data, generator=0)
    assert len(spectra) > 0 and spectra.used.batches == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


# ----------------------------------------------------------------------------- methods


@pytest.mark.parametrize(
    "options",
    [{}, {"optimizer": "adam", "gamma": 100.0}, {"exact": True}],
    ids=["sgd", "adam", "exact"],
)
@pytest.mark.parametrize("form", LOSSES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gradinit(family: str, form: str, options: dict) -> None:
    model = model_of(family)
    data = batches(family)
    report = initlab.gradinit_(model, data, loss_arg(family, form), steps=2, generator=0, **options)
    assert report.info["steps"] == 2 and report.used.batches == 3
    assert all(math.isfinite(r["alpha"]) and r["alpha"] >= 0.01 for r in report)
    assert all(math.isfinite(r["loss"]) for r in report.trace)
    assert tie_kept(model)
    names = [(r["layer"], r["param"]) for r in report]
    assert len(names) == len(set(names))  # a tied tensor has one alpha


@pytest.mark.parametrize("variant", ["paper", "gradinit"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_metainit(family: str, variant: str) -> None:
    model = model_of(family)
    report = initlab.metainit_(model, batches(family), steps=2, variant=variant)
    assert math.isfinite(report.info["gq_last"]) and tie_kept(model)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_lsuv_reaches_unit_variance(family: str) -> None:
    model = model_of(family)
    report = initlab.lsuv_(model, batches(family), max_batches=2, generator=0)
    scaled = [r for r in report if not r["skipped"]]
    assert scaled and all(abs(r["var_after"] - 1.0) < 0.1 for r in scaled)
    assert tie_kept(model)


@pytest.mark.parametrize("form", LOSSES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_precondition_balances_gamma(family: str, form: str) -> None:
    model = model_of(family)
    report = initlab.precondition_(model, batches(family), loss_arg(family, form))
    assert report.info["spread_after"] <= report.info["spread_before"] * (1 + 1e-9)
    assert tie_kept(model)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_output_scale_module(family: str) -> None:
    model = model_of(family)
    data = batches(family)
    report = initlab.scale_output_(model, data, target=0.05, how="module")
    assert report.info["std_after"] == pytest.approx(0.05, rel=1e-6)
    scale = report.info["module"]
    with torch.no_grad():
        logits = torch.cat([scale(model(**b)).logits.reshape(-1) for b in data])
    assert float(logits.double().std(unbiased=False)) == pytest.approx(0.05, rel=1e-4)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_output_scale_hook_on_a_model_output(family: str) -> None:
    """A Hugging Face ``ModelOutput`` keeps its type and its own loss; its logits get the std."""
    model = model_of(family)
    data = batches(family)
    report = initlab.scale_output_(model, data, target=0.05, how="hook")
    with torch.no_grad():
        outs = [model(**b) for b in data]
    assert all(isinstance(o, transformers.utils.ModelOutput) for o in outs)
    logits = torch.cat([o.logits.reshape(-1) for o in outs]).double()
    assert float(logits.std(unbiased=False)) == pytest.approx(0.05, rel=1e-4)
    report.info["handle"].remove()
    assert not any(m._forward_hooks for m in model.modules())


@pytest.mark.parametrize(
    "scheme", ["fan_in", "fan_out", "xavier", "geometric", "orthogonal", "operator_norm"]
)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_init_model_starts_a_language_model_near_ln_v(family: str, scheme: str) -> None:
    """Every scheme: the initial loss within 10% of ln V; a tie stays one tensor."""
    model = model_of(family)
    report = initlab.init_model(model, scheme, generator=0)
    assert tie_kept(model)
    assert own_loss(model, batches(family)) == pytest.approx(math.log(V), rel=0.10)
    roles = {r["role"] for r in report.to_rows()}
    assert ("tied embedding/head" if family == "gpt2" else "head") in roles, roles
