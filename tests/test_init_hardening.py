"""init_model hardening: the output head and the gains do not hinge on size coincidences, strided
transposed convolutions get their true fans, dirac on an even kernel, frozen tensors are kept.

Expected values are recomputed here from the formulas (the squared-weight operator for the
second moments), not through the library's helpers.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import initlab
from initlab._core.rows import join_name
from initlab.init.gains import calculate_gain
from initlab.init.registry import default_registry
from initlab.init.sampling import dirac_

Z = 5.0  # z-score for statistical tolerances


def _rows(report: initlab.InitReport) -> dict[str, dict]:
    return {join_name(r["layer"], r["param"]): r for r in report.to_rows()}


def _weights(report: initlab.InitReport) -> dict[str, tuple]:
    """Weight name -> (role, gain, gain_from): what must not depend on a size coincidence."""
    return {
        k: (r["role"], r["gain"], r["gain_from"])
        for k, r in _rows(report).items()
        if r["role"] not in ("bias", "norm_scale", "norm_shift")
    }


# --------------------------------------------------------------------------------------------
# 1. The output head, and the gains, without size coincidences


def _bert(max_positions: int, labels: int):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.BertConfig(
        vocab_size=1000, hidden_size=512, num_hidden_layers=1, num_attention_heads=8,
        intermediate_size=1024, max_position_embeddings=max_positions, num_labels=labels,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


def test_bert_classifier_roles_and_gains_do_not_depend_on_max_positions_or_num_labels() -> None:
    """hidden == max_positions (512) made the pooler the head; num_labels == type_vocab_size (2)
    made the classifier the head by a size coincidence; with 514 positions no head was found and
    every gain flipped. The classifier is the head now by the model's own declaration
    (``...ForSequenceClassification`` with ``config.num_labels`` outputs), in every setting."""
    reports = {
        (mp, labels): _weights(
            initlab.init_model(_bert(mp, labels), "geometric", generator=0, measure=False)
        )
        for mp in (512, 514)
        for labels in (2, 3)
    }
    first = reports[(512, 3)]
    for key, rows in reports.items():
        assert rows == first, key
    assert [k for k, r in first.items() if "head" in r[0]] == ["classifier.weight"]
    layer = "bert.encoder.layer.0"
    for name in ("query", "key", "value"):
        role, gain, source = first[f"{layer}.attention.self.{name}.weight"]
        assert (role, gain) == ("weight", 1.0) and "attention" in source
    assert first[f"{layer}.intermediate.dense.weight"][1] == pytest.approx(calculate_gain("gelu"))
    assert first["bert.pooler.dense.weight"][1] == pytest.approx(calculate_gain("tanh"))
    assert first["classifier.weight"][:2] == ("head", 1.0)


def test_distilbert_pre_classifier_is_not_a_head_when_dim_equals_max_positions() -> None:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    reports = []
    for mp in (32, 40):
        config = transformers.DistilBertConfig(
            vocab_size=100, dim=32, n_layers=1, n_heads=2, hidden_dim=64,
            max_position_embeddings=mp, num_labels=3,
        )  # fmt: skip
        model = transformers.DistilBertForSequenceClassification(config)
        reports.append(_weights(initlab.init_model(model, "geometric", generator=0)))
    assert reports[0] == reports[1]
    assert reports[0]["pre_classifier.weight"][0] == "weight"


def test_hugging_face_language_model_head_is_still_found() -> None:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32,
    )  # fmt: skip
    model = transformers.BertForMaskedLM(config)
    rows = _rows(initlab.init_model(model, "geometric", generator=0, policy="skip"))
    assert rows["cls.predictions.decoder.weight"]["role"] == "tied embedding/head"
    assert rows["bert.embeddings.word_embeddings.weight"]["role"] == "tied embedding/head"
    assert rows["bert.embeddings.position_embeddings.weight"]["role"] == "embedding"


class _PlainEncoder(nn.Module):
    """A BERT-like classifier in plain torch: hidden == positions, labels == token types."""

    def __init__(self, d: int = 16, labels: int = 2) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(100, d)
        self.position_embeddings = nn.Embedding(d, d)
        self.token_type_embeddings = nn.Embedding(2, d)
        self.query = nn.Linear(d, d)
        self.pooler = nn.Linear(d, d)
        self.classifier = nn.Linear(d, labels)


class _PlainLM(nn.Module):
    """A plain-torch LM with more positions (512) than words (100) and a 512-wide FFN."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(100, d)
        self.pos = nn.Embedding(512, d)
        self.fc1 = nn.Linear(d, 512)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(512, d)
        self.lm_head = nn.Linear(d, 100, bias=False)


def test_plain_models_never_take_a_position_or_token_type_table_for_the_vocabulary() -> None:
    for labels in (2, 3):
        rows = _rows(initlab.init_model(_PlainEncoder(labels=labels), generator=0))
        assert not [k for k, r in rows.items() if "head" in r["role"]], labels
    rows = _rows(initlab.init_model(_PlainLM(), generator=0))
    assert [k for k, r in rows.items() if r["role"] == "head"] == ["lm_head.weight"]
    assert rows["fc1.weight"]["role"] == "weight"


# --------------------------------------------------------------------------------------------
# 2. Fans of strided transposed convolutions

_CONVT = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
# (dims, channels in, channels out, kernel, input size): about 65k-260k weights each.
_CONVT_CASES = [(1, 256, 256, 4, 64), (2, 64, 64, 4, 24), (3, 32, 32, 4, 12)]


def _interior(t: torch.Tensor, dims: int, margin: int) -> torch.Tensor:
    return t[(..., *([slice(margin, -margin)] * dims))]


class _CharLM(nn.Module):
    """A character LM whose position table is named ``pe`` and is as wide as its MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.pe = nn.Embedding(65, 64), nn.Embedding(256, 64)
        self.fc, self.proj, self.out = nn.Linear(64, 256), nn.Linear(256, 64), nn.Linear(64, 65)


class _Translator(nn.Module):
    """Source and target vocabularies: the generator's width is the target table's."""

    def __init__(self) -> None:
        super().__init__()
        self.src_emb, self.tgt_emb = nn.Embedding(120, 16), nn.Embedding(80, 16)
        self.body, self.generator = nn.Linear(16, 16), nn.Linear(16, 80)


class _OddNames(nn.Module):
    """A token table whose name contains 'type' and 'pos' inside words."""

    def __init__(self) -> None:
        super().__init__()
        self.prototype_tokens, self.composer_vocab = nn.Embedding(300, 32), nn.Embedding(7, 32)
        self.body, self.out = nn.Linear(32, 32), nn.Linear(32, 300)


@pytest.mark.parametrize(
    "make, head",
    [(_CharLM, "out"), (_Translator, "generator"), (_OddNames, "out")],
    ids=["pe_named_position_table", "two_vocabularies", "words_inside_names"],
)
def test_the_head_of_a_custom_model_is_its_vocabulary_wide_last_linear(make, head) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    rows = _rows(initlab.init_model(make(), "geometric", generator=0))
    heads = sorted(k.rsplit(".", 1)[0] for k, r in rows.items() if r["role"] == "head")
    assert heads == [head]


@pytest.mark.parametrize("stride", [1, 2, 4])
@pytest.mark.parametrize(("dims", "c_in", "c_out", "k", "size"), _CONVT_CASES)
def test_transposed_conv_fans_keep_the_second_moments(
    dims: int, c_in: int, c_out: int, k: int, size: int, stride: int
) -> None:
    """LeCun init keeps ``E[y²] = E[x²]`` and fan-out init keeps ``E[dx²] = E[dy²]``.

    For i.i.d. unit-variance inputs, ``E[y_i²] = Σ_j A_ij²`` for the layer's matrix ``A``, which
    is the transposed convolution of an all-ones input with the squared kernel ``W∘W``: exact in
    ``x``. Away from the borders its average over positions and channels is, up to the draw of
    ``W``, ``E[w²] · (inputs per output)``; the draw's relative error is that of a sample second
    moment, ``sqrt(2 / n)`` for ``n`` normal entries. Backward: ``Σ_i A_ij²``, the ordinary
    convolution (the adjoint) of an all-ones output gradient with ``W∘W``.
    """
    conv = _CONVT[dims](c_in, c_out, k, stride=stride, bias=False).double()
    report = initlab.init_model(conv, "lecun", generator=0)
    row = report.to_rows()[0]
    assert row["fan_in"] == pytest.approx(c_in * k**dims / stride**dims)  # formula, by hand
    assert row["fan_out"] == c_out * k**dims
    n = conv.weight.numel()
    tol = Z * math.sqrt(2 / n)
    w2 = conv.weight.detach() ** 2
    forward = _CONV_T[dims](torch.ones(1, c_in, *[size] * dims, dtype=torch.float64), w2,
                            stride=stride)  # fmt: skip
    assert _interior(forward, dims, k).mean().item() == pytest.approx(1.0, abs=tol)

    initlab.init_model(conv, "fan_out", generator=1, gains="scheme")
    w2 = conv.weight.detach() ** 2 / 2.0  # fan-out with gain 1: ReLU's gain² is 2
    out_size = (size - 1) * stride + k
    backward = _CONV[dims](torch.ones(1, c_out, *[out_size] * dims, dtype=torch.float64), w2,
                           stride=stride)  # fmt: skip
    assert _interior(backward, dims, k).mean().item() == pytest.approx(1.0, abs=tol)


def test_transposed_conv_fans_by_hand_and_validation() -> None:
    # k = 3, s = 2: 1.5 taps per output per dim on average, so fan_in is not an integer.
    fans = initlab.compute_fans((3, 8, 3), transposed=True, stride=2)
    assert (fans.fan_in, fans.fan_out, fans.n_in, fans.cols) == (4.5, 24, 3, 9)
    fans = initlab.compute_fans((64, 48, 3, 3), transposed=True, stride=(2, 2))
    assert (fans.fan_in, fans.fan_out, fans.stride) == (144, 432, 4)
    assert initlab.compute_fans((8, 4, 4, 4), transposed=True, stride=(1, 2)).fan_in == 64
    # grouped: in / g per output, out / g per input
    assert initlab.compute_fans((8, 2, 4), groups=4, transposed=True, stride=2).fan_in == 4
    with pytest.raises(ValueError, match="transposed convolution only"):
        initlab.compute_fans((8, 4, 3, 3), stride=2)
    with pytest.raises(ValueError, match="one stride per spatial dim"):
        initlab.compute_fans((8, 4, 3, 3), transposed=True, stride=(2, 2, 2))
    with pytest.raises(ValueError, match="positive int"):
        initlab.compute_fans((8, 4, 3), transposed=True, stride=0)
    with pytest.raises(ValueError, match="positive finite"):
        initlab.Fans(fan_in=float("nan"), fan_out=1)
    spec = default_registry().specs(nn.ConvTranspose2d(3, 8, 3, stride=2))[0]
    assert spec.fans == initlab.compute_fans((3, 8, 3, 3), transposed=True, stride=2)
    # an ordinary strided convolution keeps torch's fans
    assert default_registry().specs(nn.Conv2d(3, 8, 3, stride=2))[0].fans.fan_in == 27


@pytest.mark.parametrize("scheme", ["orthogonal", "operator_norm", "dirac"])
def test_matrix_schemes_use_the_kernel_matrix_of_a_strided_transposed_conv(scheme: str) -> None:
    """Orthogonal, operator-norm and dirac reason about the reshaped kernel matrix, whose column
    count ``n_in·k`` the stride does not change."""
    conv = nn.ConvTranspose2d(16, 16, 2, stride=2, bias=False)
    row = initlab.init_model(conv, scheme, generator=0).to_rows()[0]
    ref = initlab.init_model(nn.ConvTranspose2d(16, 16, 2, bias=False), scheme, generator=0)
    assert row["target_std"] == pytest.approx(ref.to_rows()[0]["target_std"], rel=1e-12)
    if scheme != "operator_norm":  # exact RMS entry for orthogonal and dirac
        rms = conv.weight.detach().double().pow(2).mean().sqrt().item()
        assert rms == pytest.approx(row["target_std"], rel=1e-5)


# --------------------------------------------------------------------------------------------
# 3. dirac on even kernels

_IDENTITY = initlab.get_scheme("dirac", nonlinearity="linear")


@pytest.mark.parametrize(
    ("conv", "shape"),
    [
        (lambda: nn.Conv2d(8, 8, 4, padding="same", bias=False), (2, 8, 9, 7)),
        (lambda: nn.Conv1d(4, 4, 2, padding="same", bias=False), (2, 4, 11)),
        (lambda: nn.Conv3d(3, 3, (3, 4, 2), padding="same", bias=False), (1, 3, 5, 6, 7)),
        (lambda: nn.Conv2d(6, 6, 3, padding=1, dilation=1, bias=False), (2, 6, 8, 8)),
        (lambda: nn.Conv2d(6, 6, 3, padding="same", dilation=3, bias=False), (2, 6, 8, 8)),
    ],
)
def test_dirac_with_same_padding_is_the_identity(conv, shape) -> None:  # type: ignore[no-untyped-def]
    layer = conv()
    report = initlab.init_model(layer, _IDENTITY, generator=0)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), warnings.catch_warnings():
        # torch notes (once per process) that it pads a copy for an even kernel
        warnings.filterwarnings("ignore", "Using padding='same' with even kernel", UserWarning)
        y = layer(x)
    torch.testing.assert_close(y, x, atol=1e-6, rtol=0)
    row = report.to_rows()[0]
    even = any(k % 2 == 0 for k in layer.kernel_size)
    assert (row["note"] is not None and "dirac delta at tap" in row["note"]) == even


def test_dirac_even_kernel_with_dilation_warns_with_the_shift() -> None:
    layer = nn.Sequential(nn.Conv2d(4, 4, 4, padding="same", dilation=2, bias=False))
    with pytest.warns(UserWarning, match=r"0\.weight .*shifted by \(1, 1\)"):
        initlab.init_model(layer, _IDENTITY, generator=0)
    x = torch.randn(1, 4, 12, 12, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        y = layer(x)
    # output i reads input i + 1: the copy is shifted, as the warning says
    torch.testing.assert_close(y[..., 3:-4, 3:-4], x[..., 4:-3, 4:-3], atol=1e-6, rtol=0)


def test_dirac_without_an_exact_tap_takes_the_least_shifted_one() -> None:
    """Kernel 2 at dilation 3 with padding="same" (1 before): tap 0 copies input i - 1, torch's
    centre (tap 1) input i + 2; the delta went to the centre."""
    layer = nn.Sequential(nn.Conv1d(3, 3, 2, padding="same", dilation=3, bias=False))
    with pytest.warns(UserWarning, match=r"0\.weight .*shifted by \(-1,\)"):
        initlab.init_model(layer, _IDENTITY, generator=0)
    x = torch.randn(1, 3, 10, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Using padding='same' with even kernel", UserWarning)
        y = layer(x)
    torch.testing.assert_close(y[..., 1:], x[..., :-1], atol=1e-6, rtol=0)  # output i = input i-1


def test_dirac_centre_is_validated() -> None:
    w = dirac_(torch.empty(2, 2, 4), centre=(1,))
    assert w[0, 0, 1] == 1 and w.sum() == 2
    with pytest.raises(ValueError, match="one tap per spatial dim"):
        dirac_(torch.empty(2, 2, 4), centre=(4,))


# --------------------------------------------------------------------------------------------
# 4. Frozen tensors


def _frozen_stem() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 4, 4))  # fmt: skip
    model[0].requires_grad_(False)
    model[1].requires_grad_(False)
    model[1].running_mean.fill_(3.0)
    return model


def test_frozen_tensors_are_left_as_they_were_and_reported() -> None:
    model = _frozen_stem()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rule = initlab.Rule("0.*", "zero", citation="test")
    with pytest.warns(UserWarning, match="matched only frozen parameters"):
        report = initlab.init_model(model, generator=0, rules=[rule])
    after = model.state_dict()
    for key in ("0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var"):
        assert torch.equal(after[key], before[key]), key
    assert not torch.equal(after["4.weight"], before["4.weight"])
    assert report.frozen() == ["0.weight", "0.bias", "1.weight", "1.bias"]
    rows = _rows(report)
    for name in report.frozen():
        assert rows[name]["scheme"] == "untouched" and rows[name]["note"].startswith("frozen")
    assert rows["4.weight"]["note"] is None
    assert "4 frozen" in str(report)


def test_frozen_init_draws_them_as_torch_init_does() -> None:
    model = _frozen_stem()
    before = model[0].weight.clone()
    report = initlab.init_model(model, generator=0, frozen="init")
    assert not torch.equal(model[0].weight, before)
    assert torch.all(model[1].running_mean == 0)
    assert report.frozen() == []
    assert not model[0].weight.requires_grad  # the flag itself is never changed
    with pytest.raises(ValueError, match="frozen"):
        initlab.init_model(model, frozen="keep")  # type: ignore[arg-type]


def test_a_rule_that_matches_only_frozen_tensors_warns() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    model[0].weight.requires_grad_(False)
    before = model[0].weight.clone()
    rule = initlab.Rule("0.weight", "constant", "test", 0.5)
    with pytest.warns(
        UserWarning, match=r"matched only frozen parameters \(0.weight\).*frozen='init'"
    ):
        initlab.init_model(model, "geometric", rules=[rule], generator=0)
    assert torch.equal(model[0].weight, before)


def test_a_classifiers_out_proj_is_not_an_attention_projection() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.RobertaConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=40, num_labels=3,
    )  # fmt: skip
    torch.manual_seed(0)
    rows = _rows(
        initlab.init_model(transformers.RobertaForSequenceClassification(config), generator=0)
    )
    # the head (it was labelled an attention projection by its name)
    head = rows["classifier.out_proj.weight"]
    assert head["role"] == "head" and head["gain_from"] == "none: head, std x 1/sqrt(fan_in)"
    query = rows["roberta.encoder.layer.0.attention.self.query.weight"]
    assert query["gain_from"] == "none: attention projection"


@pytest.mark.parametrize(
    "norm",
    [nn.BatchNorm2d(8, affine=False), nn.InstanceNorm2d(8, track_running_stats=True)],
    ids=["BatchNorm2d(affine=False)", "InstanceNorm2d(track_running_stats=True)"],
)
def test_running_statistics_of_norms_without_parameters_are_reset(norm: nn.Module) -> None:
    """Statistics measured under the old weights are stale once they are redrawn, as for affine
    norms (a non-affine norm has no parameter for the registry to claim)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), norm).train()
    for _ in range(3):
        model(torch.randn(4, 3, 8, 8) * 4 + 3)
    initlab.init_model(model, "geometric", generator=0)
    fresh = type(norm)(8, **({"affine": False} if isinstance(norm, nn.BatchNorm2d) else
                             {"track_running_stats": True}))  # fmt: skip
    for name, buf in fresh.named_buffers():
        assert torch.equal(getattr(model[1], name), buf), name


class _Codebook(nn.Module):
    """Integer codes (a quantized layer), claimed as a weight by a handler of one's own."""

    def __init__(self) -> None:
        super().__init__()
        self.codes = nn.Parameter(torch.zeros(4, 4, dtype=torch.int64), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_a_weight_that_cannot_be_drawn_is_refused_before_anything_is_written() -> None:
    registry = initlab.default_registry().copy()
    initlab.register_handler(
        _Codebook,
        lambda m: [initlab.ParamSpec("codes", "weight", initlab.compute_fans((4, 4)))],
        registry=registry,
        example=_Codebook(),
    )
    model = nn.Sequential(nn.Linear(3, 3), _Codebook())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"1\.codes is torch\.int64.*floating-point"):
        initlab.init_model(model, "geometric", generator=0, registry=registry, frozen="init")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
