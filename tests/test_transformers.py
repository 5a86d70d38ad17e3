"""Hugging Face ``transformers`` as a real client: every feature on tiny models built from configs
(no download), with dict batches, attention masks and the model's own loss, and with a criterion.

Families: a decoder LM with tied embeddings (GPT-2), an encoder classifier with attention masks and
padding (BERT), a Llama-style decoder (RoPE, RMSNorm, SwiGLU, grouped-query attention, untied head)
and an encoder-decoder (T5: relative position buckets, gated-GELU feed-forward, cross-attention,
a tied head whose logits the model rescales by 1/sqrt(d_model); labels shifted into the decoder).
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import initlab
from initlab._core.loss import TargetError

transformers = pytest.importorskip("transformers")

from .hf_models import FAMILIES, B, T, V, batches, model_of  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]


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
    ran = [r for r in table if r["calls"]]  # T5's `shared` table runs as encoder/decoder copies
    assert {r["layer"] for r in table} - {r["layer"] for r in ran} <= {"shared"}
    assert len(ran) > 0 and all(math.isfinite(r["E_y2"]) for r in ran)
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
    # The attention policy of any implementation: q/k/v projections keep alpha = 1 (the GR
    # formula does not cover a product of two activations), found by the runtime trace.
    qkv = re.compile(r"(c_attn|self\.(query|key|value)|[qkv]_proj|Attention\.[qkv])$")
    attention = [r for r in report if qkv.search(r["layer"])]
    assert attention and all(r["kind"] == "attention" and r["alpha"] == 1.0 for r in attention)
    # a head tied to the input embedding keeps alpha = 1 too (one tensor, one multiplier)
    tied = [r for r in report if r["kind"] == "tied"]
    assert {r["layer"] for r in tied} == {r["layer"] for r in report if _is_tied(model, r["layer"])}
    assert all(r["alpha"] == 1.0 for r in tied)
    assert all(r["kind"] in ("mlp", "tied") for r in report if not qkv.search(r["layer"]))


def _is_tied(model: nn.Module, layer: str) -> bool:
    weight = model.get_submodule(layer).weight
    return sum(p is weight for _, p in model.named_parameters(remove_duplicate=False)) > 1


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
@pytest.mark.parametrize("family", ["gpt2", "llama", "t5"])
def test_init_model_starts_a_language_model_near_ln_v(family: str, scheme: str) -> None:
    """Every scheme: the initial loss within 10% of ln V; a tie stays one tensor."""
    model = model_of(family)
    report = initlab.init_model(model, scheme, generator=0)
    assert tie_kept(model)
    assert own_loss(model, batches(family)) == pytest.approx(math.log(V), rel=0.10)
    roles = {r["role"] for r in report.to_rows()}
    assert ("head" if family == "llama" else "tied embedding/head") in roles, roles


# ----------------------------------------------------------------------------- structure

#: The two residual branch ends of layer i: attention's output projection and the MLP's last.
BRANCH_ENDS = {
    "gpt2": ("transformer.h.{}.attn.c_proj", "transformer.h.{}.mlp.c_proj"),
    "bert": ("bert.encoder.layer.{}.attention.output.dense", "bert.encoder.layer.{}.output.dense"),
    "llama": ("model.layers.{}.self_attn.o_proj", "model.layers.{}.mlp.down_proj"),
    "t5": (
        "encoder.block.{}.layer.0.SelfAttention.o",
        "encoder.block.{}.layer.1.DenseReluDense.wo",
    ),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_lsuv_residual_aware_scales_both_branch_ends(family: str) -> None:
    """strategy='branches' with no block named: the runtime trace finds both residual branches
    of every layer; each branch end's output reaches unit variance (measured here by hooks on
    the concatenated batches, independently of LSUV), the other branch layers keep weights."""
    model = model_of(family)
    data = batches(family, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = initlab.lsuv_(model, data, max_batches=2, generator=0, strategy="branches")
    rows = {r["layer"]: r for r in report}
    ends = [e.format(i) for i in range(2) for e in BRANCH_ENDS[family]]
    named = dict(model.named_modules())
    outs: dict[str, list[torch.Tensor]] = {e: [] for e in ends}
    handles = [
        named[e].register_forward_hook(lambda m, a, y, e=e: outs[e].append(y.detach()))
        for e in ends
    ]
    try:
        with torch.no_grad():
            model(**{k: torch.cat([b[k] for b in data]) for k in data[0]})
    finally:
        for h in handles:
            h.remove()
    for e in ends:
        assert not rows[e]["skipped"], e
        assert float(outs[e][0].double().var(unbiased=False)) == pytest.approx(1.0, abs=0.1), e
    frozen = [r["layer"] for r in report if "not its branch end" in r["skipped"]]
    assert frozen and all(
        torch.equal(model.state_dict()[f"{n}.weight"], before[f"{n}.weight"]) for n in frozen
    )
    assert tie_kept(model)


def test_theory_rows_say_where_the_gr_setting_does_not_hold() -> None:
    rows = {r["block"]: r for r in initlab.theory_vs_actual(model_of("bert"), batches("bert"))}
    p = "bert.encoder.layer.0."
    assert "attention scores" in rows[p + "attention.self.query.weight"]["note"]
    assert "attention scores" in rows[p + "attention.self.key.bias"]["note"]
    assert "attention values" in rows[p + "attention.self.value.weight"]["note"]
    assert "normalized" in rows[p + "attention.output.dense.weight"]["note"]
    assert "outside" not in rows[p + "intermediate.dense.weight"]["note"]  # GELU, then Linear


def test_spectra_of_gpt2_conv1d_is_the_matrix_norm() -> None:
    model = model_of("gpt2")
    rows = {r["layer"]: r for r in initlab.layer_spectra(model, batches("gpt2"), generator=0)}
    w = model.transformer.h[0].attn.c_attn.weight.detach().double()
    row = rows["transformer.h.0.attn.c_attn"]
    assert row["op_method"] == "svd"
    assert row["op_norm"] == pytest.approx(float(torch.linalg.matrix_norm(w, 2)), rel=1e-5)
    # the data's forward orders the Conv1D rows and gives their input shapes, as for Linear
    calls = [
        f"transformer.h.{i}.{m}"
        for i in range(2)
        for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    ]
    assert [rows[n]["order"] for n in [*calls, "lm_head"]] == list(range(9))
    assert rows["transformer.h.0.mlp.c_proj"]["input_shape"] == (T, 4 * 32)


def test_input_scaling_names_why_it_does_not_apply_to_token_ids() -> None:
    from initlab.methods.input_scale import input_scale_for

    with pytest.raises(TypeError, match="floating-point inputs"):
        initlab.input_scale(batches("gpt2"))
    with pytest.raises(ValueError, match="does not see the raw input"):
        input_scale_for(model_of("gpt2"), batches("gpt2"))


FACTORY = """
import torch
import transformers


def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16)
    return transformers.GPT2LMHeadModel(cfg)


def batches():
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(1, 64, (4, 8), generator=g) for _ in range(3)]
    return [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i} for i in ids]
"""


def test_cli_diagnose_a_hugging_face_factory(tmp_path: Any) -> None:
    from initlab.cli import main

    path = tmp_path / "hf_models.py"
    path.write_text(FACTORY)
    out = tmp_path / "out"
    args = ["--model", f"{path}:gpt2", "--data", f"{path}:batches", "--out", str(out)]
    assert main(["diagnose", *args, "--no-plots"]) == 0
    summary = (out / "summary.txt").read_text()
    assert "3 batch(es), 12 examples" in summary
    assert "runtime trace of one forward (4 found)" in summary
    assert "Lipschitz upper bound: not available" in summary  # LayerNorm: no bound, no number
    assert "transformer.h.0.ln_1" in summary and "explodes" not in summary


def test_t5_residual_branches_found_by_the_runtime_trace() -> None:
    """Encoder-decoder: 2 branches per encoder layer, 3 per decoder layer (cross-attention's
    branch holds its query and output projections; its keys and values come from the encoder)."""
    from initlab.diagnostics.linter import lint_model

    model = model_of("t5")
    res = lint_model(model, forward_args=[((), b) for b in batches("t5", 1)])
    branches = [b["branch"] for b in res.residual_blocks]
    assert len(branches) == 2 * 2 + 2 * 3
    cross = [b for b in branches if any("EncDecAttention" in n for n in b)]
    assert len(cross) == 2 and all(
        any(n.endswith("EncDecAttention.q") for n in b)
        and any(n.endswith("EncDecAttention.o") for n in b)
        and not any(n.endswith(("EncDecAttention.k", "EncDecAttention.v")) for n in b)
        for b in cross
    )
    assert sum(f["rule"] == "skip_connection" for f in res.findings) == 10


def test_lsuv_stream_re_runs_a_decoder_layer_on_a_fresh_cache() -> None:
    """strategy="stream" re-runs each block on its saved input: a decoder layer's DynamicCache
    was shared, so the re-run appended its keys a second time ("The size of tensor a (24) must
    match the size of tensor b (12)" inside SDPA). The result equals the run without a cache."""
    layers = ["model.layers.0", "model.layers.1"]
    results = []
    for use_cache in (True, False):
        model = model_of("llama")
        batch = dict(batches("llama", 1)[0], use_cache=use_cache)
        batch["attention_mask"][0, -2:] = 0  # padded: the attention takes an explicit mask
        report = initlab.lsuv_(model, batch, strategy="stream", blocks=layers, generator=0)
        results.append((report.to_rows(), [p.detach().clone() for p in model.parameters()]))
    (rows_cache, params_cache), (rows_plain, params_plain) = results
    strip = [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows_cache]
    assert strip == [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows_plain]
    assert all(torch.equal(a, b) for a, b in zip(params_cache, params_plain, strict=True))


def test_scale_output_hook_on_a_model_that_returns_its_loss_warns_naming_the_head() -> None:
    """A hook on the model's output scales .logits but not the .loss the model computed from
    them: training on model(**batch).loss did not see the scale (no word). A warning names the
    head; on the head, the model's own loss sees the scaled logits."""
    model, data = model_of("llama"), batches("llama", 2)
    with torch.no_grad():
        before = float(model(**data[0]).loss)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        report = initlab.scale_output_(model, data, target=0.05, how="hook")
    assert any(re.search(r"returns a loss of its own .*module='lm_head'", str(w.message))
               for w in seen)  # fmt: skip
    report.info["handle"].remove()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        report = initlab.scale_output_(model, data, target=0.05, how="hook", module="lm_head")
    assert not any("returns a loss of its own" in str(w.message) for w in seen)
    with torch.no_grad():
        out = model(**data[0])
    assert float(out.logits.std()) == pytest.approx(0.05, rel=0.05)
    labels = data[0]["labels"]
    own = torch.nn.functional.cross_entropy(
        out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
    )
    assert float(out.loss) == pytest.approx(float(own), rel=1e-5)  # the loss of the scaled logits
    assert float(out.loss) != before
    report.info["handle"].remove()
    unlabeled = [{k: v for k, v in b.items() if k != "labels"} for b in data]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        report = initlab.scale_output_(model, unlabeled, target=0.05, how="hook")  # no own loss
    assert not any("returns a loss of its own" in str(w.message) for w in seen)
    report.info["handle"].remove()


# ----------------------------------------------------------------------------- regressions


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_diagnose_after_init_model_finds_no_signal_across_the_norms(family: str) -> None:
    """Pre-norm decoders right after init_model: every projection's E[y^2] ~ 1, the embedding's
    small by design. The forward gain was taken from the embedding across every norm ("the
    signal explodes here" on every projection, "vanishes" on the embedding)."""
    model = model_of(family)
    initlab.init_model(model, "geometric", generator=0)
    report = initlab.diagnose(model, batches(family, 1), spectra=False)
    signal = [(f["layer"], f["message"]) for f in report.findings if f["rule"].endswith("_signal")]
    assert not [s for s in signal if "network's input" in s[1] or "wte" in s[0]], signal
    embeddings = [n for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    assert embeddings and all(report.verdicts[n][0] != "bad" for n in embeddings)


def w2v_ctc() -> nn.Module:
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    cfg = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=4, vocab_size=12, feat_extract_norm="group",
        mask_time_prob=0.0, layerdrop=0.0, pad_token_id=0,
    )  # fmt: skip
    model = transformers.Wav2Vec2ForCTC(cfg)
    parametrize.remove_parametrizations(model.wav2vec2.encoder.pos_conv_embed.conv, "weight")
    return model.eval()


def w2v_batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(2):
        labels = torch.randint(1, 12, (2, 5), generator=g)
        labels[1, 3:] = -100
        out.append({"input_values": torch.randn(2, 400, generator=g), "labels": labels})
    return out


def test_doctor_on_a_ctc_model_does_not_compare_its_loss_with_ln_c() -> None:
    """A CTC loss (HF's default: summed over the batch, ~130 here) is no per-token cross-entropy:
    it was "bad" against ln 12 and doctor re-initialized a healthy model."""
    model = w2v_ctc()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rep = initlab.doctor(model, w2v_batches(), fix=True, generator=0)
    loss = rep.row("initial_loss")
    assert loss["verdict_before"] == "n/a" and "not the cross-entropy" in loss["why"], loss
    assert rep.meta["ln_C"] is None
    assert "init" not in rep.applied and "output_scale" not in rep.applied, rep.applied
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_a_classifier_after_init_model_starts_at_ln_c() -> None:
    """BERT's classifier after init_model: its logits were too large (drawn at the scheme's ReLU
    gain, not as a head) and doctor recommended output_scale; the classifier is drawn as a head
    now, and doctor finds the initial loss and the logits as they should be (the case of a head
    init_model does not shrink: tests/test_doctor.py)."""
    model = model_of("bert")
    initlab.init_model(model, "geometric", generator=0)
    data = batches("bert", 2)
    rep = initlab.doctor(model, data, generator=0)
    ill = [r["check"] for r in rep if r["check"] in ("initial_loss", "logit_std")
           and r["verdict"] in ("warn", "bad")]  # fmt: skip
    assert not ill, rep.to_rows()
    assert "init" not in rep.recommended and "output_scale" not in rep.recommended


def test_a_measurement_leaves_the_config_problem_type_as_it_was() -> None:
    """The model's own loss (loss=None on labels) ran its forward with them, which set
    config.problem_type (None -> 'single_label_classification') on a config models share."""
    model = model_of("bert")
    assert model.config.problem_type is None
    data = batches("bert", 2)
    initlab.gr_scaling(model, data)
    initlab.diagnose(model, data, spectra=False)
    assert model.config.problem_type is None
    # the curvature and landscape entry points call the model functionally, outside model_kept
    initlab.block_curvature(model, data, probes=2, generator=0)
    initlab.loss_landscape(model, data, grid=3, generator=0)
    initlab.theory_vs_actual(model, data, probes=2, generator=0)
    assert model.config.problem_type is None
    model.config.problem_type = "single_label_classification"  # one the user set stays
    initlab.gradient_stats(model, data)
    assert model.config.problem_type == "single_label_classification"


@pytest.mark.parametrize("entry", ["lsuv_", "measure_moments", "precondition_"])
def test_a_moe_model_initlab_calls_first_keeps_its_router_logits(entry: str) -> None:
    """transformers installs its output-capturing hooks on a model's first forward and marks the
    model hooked: initlab removed them (every hook added in its call), so the next forward of a
    Mixtral with output_router_logits raised IndexError in its load-balancing loss, and
    precondition_'s attention trace failed (q/k/v balanced as MLP layers, alpha ~10)."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32, output_router_logits=True,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config)
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    report = getattr(initlab, entry)(model, [batch])
    with torch.no_grad():
        out = model(**batch)
    assert out.router_logits is not None and len(out.router_logits) == 2
    assert torch.isfinite(out.loss)
    if entry == "precondition_":
        kinds = {r["layer"]: r["kind"] for r in report}
        assert kinds["model.layers.0.self_attn.q_proj"] == "attention"


def test_gemma2_zero_stored_sandwich_norms_close_no_residual_branch() -> None:
    """Gemma 2's post-attention and post-feed-forward norms store 0 and scale by ``1 + w``: they
    were taken for zero-initialized gates closing each branch, and 14 of the 15 projections left
    the γ/ν imbalance as "no gradient at init, by design" (doctor: γ on 1 weight, n/a). The
    oracle: one backward of the model's own loss in float64; every projection whose weight
    gradient is not 0 is judged, and counted in the imbalance."""
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=V, max_position_embeddings=32,
        sliding_window=4, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model = transformers.Gemma2ForCausalLM(cfg)
    assert not model.model.layers[0].post_attention_layernorm.weight.any()  # stored as 0
    data = batches("llama", 2)
    ref = transformers.Gemma2ForCausalLM(cfg).double()
    ref.load_state_dict(model.state_dict())
    for b in data:
        ref(**b).loss.backward()
    learning = {n for n, m in ref.named_modules() if isinstance(m, nn.Linear)
                and n.startswith("model.layers.") and bool(m.weight.grad.any())}  # fmt: skip
    assert len(learning) == 14, sorted(learning)  # 7 projections in each of 2 layers
    rep = initlab.diagnose(model, data, spectra=False, generator=0)
    rows = {r["layer"]: r for r in rep.layers.to_rows()}
    for name in learning:
        assert "no gradient at init" not in rows[name]["reason"], rows[name]
        assert math.isfinite(rows[name]["gamma_w"]), rows[name]
    assert rep.meta["imbalance"]["gamma_layers"] >= len(learning)
    assert math.isfinite(rep.meta["imbalance"]["gamma_max_over_min"])


def test_clip_without_return_loss_is_told_its_switch_not_given_a_cross_entropy() -> None:
    """CLIPModel computes its own loss only with return_loss=True: the message said to add
    'labels', which CLIP takes and ignores (loss None), and initlab then fell back silently to
    cross-entropy on logits_per_image (γ 3.25 against 2.23 under CLIP's loss). The oracle for
    the loss used with the switch: CLIP's contrastive loss written out in float64."""
    torch.manual_seed(0)
    text = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, max_position_embeddings=16, bos_token_id=1,
                eos_token_id=2, pad_token_id=0)  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, image_size=16, patch_size=8)  # fmt: skip
    model = transformers.CLIPModel(
        transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, V, (B, T), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "pixel_values": torch.randn(B, 3, 16, 16, generator=g)}  # fmt: skip
    for given in (batch, {**batch, "labels": torch.arange(B)}):
        with pytest.raises(TargetError, match=r"return_loss=True in every batch"):
            initlab.gr_scaling(model, [given])
    with torch.no_grad():
        own = initlab.resolve_loss(None)(model, {**batch, "return_loss": True})
        logits = model(**batch).logits_per_text.double()
        target = torch.arange(B)
        expected = (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
    assert float(own) == pytest.approx(float(expected), rel=1e-5)


def test_a_classifier_given_label_not_labels_gets_cross_entropy_on_its_logits() -> None:
    """BERT reads 'labels'; a batch's 'label' (the GLUE column) goes into its **kwargs and the
    loss stays None. loss_fn=None refused it (taken for labels the model ignored); it keeps the
    documented cross-entropy on the logits, the loss BERT computes from 'labels'. The oracle:
    cross-entropy in float64 on the logits of a forward without labels."""
    model = model_of("bert")
    b = batches("bert", 1)[0]
    batch = {
        "input_ids": b["input_ids"],
        "attention_mask": b["attention_mask"],
        "label": b["labels"],
    }
    with torch.no_grad():
        got = initlab.resolve_loss(None)(model, batch)
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        expected = F.cross_entropy(logits.double(), b["labels"])
    assert float(got) == pytest.approx(float(expected), rel=1e-5)
    assert len(initlab.gradient_stats(model, [batch]).to_rows()) > 0
