"""Output scaling on any model (Hugging Face-like ones included): ``how="fold"``, ``"module"`` and
``"hook"`` on an MLP, a keyword-input model with a tied head returning an object with ``.logits``
and ``.loss``, and a model with an untied head returning a dict."""

from __future__ import annotations

import contextlib
import copy
import pickle
from collections import namedtuple
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from initlab.methods.output_scale import (
    OutputScale,
    OutputScaleHook,
    measure_output_std,
    scale_output_,
    scaled_output,
)

from .conformance_models import VOCAB, WIDTH, TiedKeywordModel, TiedOutput, make_data

TARGET = 0.05
REL = 1e-5


class DictHeadModel(nn.Module):
    """Keyword input (``input_ids``, ``labels``), an untied head, a dict output with ``logits``
    (and ``loss`` when labels are given)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.hidden = nn.Linear(WIDTH, WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        h = torch.relu(self.hidden(self.emb(input_ids))).mean(dim=1)
        logits = self.lm_head(h)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _tied() -> TiedKeywordModel:
    torch.manual_seed(2)
    return TiedKeywordModel()


def _dict_model() -> DictHeadModel:
    torch.manual_seed(4)
    return DictHeadModel()


def _mlp_data() -> torch.Tensor:
    return torch.randn(64, 6, generator=torch.Generator().manual_seed(1))


def _kw_data() -> list[dict[str, torch.Tensor]]:
    return make_data("dict_list", "tied_kw")  # two {"input_ids", "labels"} batches


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_state(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), k


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _logits(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    return out["logits"] if isinstance(out, dict) else out.logits


MODELS = {"mlp": (_mlp, _mlp_data), "tied_kw": (_tied, _kw_data), "dict": (_dict_model, _kw_data)}


def _own_loss_note(expected: bool) -> Any:
    """A hook on a model that returns its own loss warns that the loss is not recomputed (it said
    nothing: training on that loss did not see the scale); the hook on the head is the way."""
    if not expected:
        return contextlib.nullcontext()
    return pytest.warns(UserWarning, match=r"returns a loss of its own .*hook the head instead")


@pytest.mark.parametrize("name", list(MODELS))
def test_hook_reaches_target_and_removes_cleanly(name: str) -> None:
    build, data = MODELS[name]
    model, batches = build(), data()
    before = _state(model)
    first = batches if isinstance(batches, torch.Tensor) else batches[0]
    ref = _logits(model(first) if isinstance(first, torch.Tensor) else model(**first)).detach()
    with _own_loss_note(name != "mlp"):  # the keyword models return their own loss
        report = scale_output_(model, batches, target=TARGET, how="hook")
    handle = report.info["handle"]
    assert isinstance(report.info["hook"], OutputScaleHook)
    assert report[0]["layer"] == "" == report.info["layer"] and report[0]["how"] == "hook"
    assert _hook_count(model) == 1
    _same_state(model, before)  # weights untouched
    assert measure_output_std(model, batches) == pytest.approx(TARGET, rel=REL)
    handle.remove()
    assert _hook_count(model) == 0
    _same_state(model, before)
    out = _logits(model(first) if isinstance(first, torch.Tensor) else model(**first))
    assert torch.equal(out, ref)  # exactly as before


def test_hook_keeps_the_output_type_and_other_fields() -> None:
    model, batches = _tied(), _kw_data()
    plain = model(**batches[0])
    with _own_loss_note(True):
        report = scale_output_(model, batches, how="hook")
    out = model(**batches[0])
    s = report.info["scale"]
    assert type(out) is TiedOutput
    torch.testing.assert_close(out.logits, plain.logits * s)
    assert torch.equal(out.loss, plain.loss)  # the model's own loss is passed on as it was
    report.info["handle"].remove()

    dmodel = _dict_model()
    dplain = dmodel(**batches[0])
    with _own_loss_note(True):
        report = scale_output_(dmodel, batches, how="hook")
    dout = dmodel(**batches[0])
    assert type(dout) is dict and set(dout) == {"logits", "loss"}
    torch.testing.assert_close(dout["logits"], dplain["logits"] * report.info["scale"])
    assert torch.equal(dout["loss"], dplain["loss"])
    report.info["handle"].remove()


def test_hook_on_a_tied_head_scales_the_loss_input_too() -> None:
    model, batches = _tied(), _kw_data()
    before = _state(model)
    report = scale_output_(model, batches, how="hook", module="head")
    assert report[0]["layer"] == "head" and report.forward_passes == len(batches) + 1
    assert measure_output_std(model, batches) == pytest.approx(TARGET, rel=REL)
    out = model(**batches[0])
    assert torch.allclose(out.loss, F.cross_entropy(out.logits, batches[0]["labels"]))
    report.info["handle"].remove()
    assert _hook_count(model) == 0
    _same_state(model, before)


def test_hook_on_a_submodule_that_does_not_scale_the_output_is_refused() -> None:
    model, batches = _dict_model(), _kw_data()
    before = _state(model)
    with pytest.raises(ValueError, match="does not scale the model's output"):
        scale_output_(model, batches, how="hook", module="hidden")  # relu(Wx + b) then a bias
    assert _hook_count(model) == 0
    _same_state(model, before)
    with pytest.raises(ValueError, match="no module named"):
        scale_output_(model, batches, how="hook", module="nope")


def test_fold_into_an_untied_head_of_a_keyword_model_with_dict_output() -> None:
    model, batches = _dict_model(), _kw_data()
    report = scale_output_(model, batches, target=TARGET)
    assert report.info["layer"] == "lm_head" and report[0]["how"] == "fold"
    assert measure_output_std(model, batches) == pytest.approx(TARGET, rel=REL)
    assert _hook_count(model) == 0
    # one dict batch (not a list) works the same
    model2 = _dict_model()
    scale_output_(model2, batches[0], target=0.1)
    assert measure_output_std(model2, batches[0]) == pytest.approx(0.1, rel=REL)


def test_fold_on_mlp_reaches_target() -> None:
    model, x = _mlp(), _mlp_data()
    report = scale_output_(model, x, target=TARGET)
    assert report.info["layer"] == "2"
    assert measure_output_std(model, x) == pytest.approx(TARGET, rel=REL)


@pytest.mark.parametrize("module", [None, "head"])
def test_fold_into_a_tied_head_names_the_tie(module: str | None) -> None:
    model, batches = _tied(), _kw_data()
    before = _state(model)
    with pytest.raises(ValueError, match="tied") as err:
        scale_output_(model, batches, module=module)
    msg = str(err.value)
    assert "head.weight is emb.weight" in msg
    assert "how='hook'" in msg and "how='module'" in msg
    # the one way that keeps the model's own loss in step comes first
    assert msg.index("how='hook', module='head'") < msg.index("how='module'")
    _same_state(model, before)
    assert _hook_count(model) == 0


def test_module_reaches_target_on_every_output_kind() -> None:
    model, x = _mlp(), _mlp_data()
    report = scale_output_(model, x, target=TARGET, how="module")
    scale = report.info["module"]
    assert isinstance(scale, OutputScale)
    assert measure_output_std(nn.Sequential(model, scale), x) == pytest.approx(TARGET, rel=REL)

    for build in (_tied, _dict_model):
        kw, batches = build(), _kw_data()
        before = _state(kw)
        report = scale_output_(kw, batches, target=TARGET, how="module")
        _same_state(kw, before)
        scale = report.info["module"]
        # nn.Sequential passes no keywords: attach the module's forward as a hook instead
        handle = kw.register_forward_hook(lambda m, a, out, scale=scale: scale(out))
        assert measure_output_std(kw, batches) == pytest.approx(TARGET, rel=REL)
        handle.remove()
        out = kw(**batches[0])
        scaled = scale(out)
        assert type(scaled) is type(out)
        torch.testing.assert_close(_logits(scaled), _logits(out) * report.info["scale"])


def test_scaled_output_kinds() -> None:
    t = torch.randn(4, 3)
    assert torch.equal(scaled_output(t, 2.0), t * 2)
    tup = scaled_output((t, "cache"), 2.0)
    assert type(tup) is tuple and torch.equal(tup[0], t * 2) and tup[1] == "cache"
    lst = scaled_output(["x", t], 2.0)
    assert type(lst) is list and lst[0] == "x" and torch.equal(lst[1], t * 2)
    Pair = namedtuple("Pair", ["logits", "aux"])
    pair = scaled_output(Pair(t, 1), 2.0)
    assert type(pair) is Pair and torch.equal(pair.logits, t * 2) and pair.aux == 1
    d = {"loss": torch.tensor(1.0), "logits": t}
    out = scaled_output(d, 2.0)
    assert out is not d and torch.equal(out["logits"], t * 2) and d["logits"] is t
    assert torch.equal(out["loss"], d["loss"])

    @dataclass(frozen=True)
    class Frozen:
        logits: torch.Tensor
        loss: torch.Tensor | None = None

    fr = scaled_output(Frozen(t, None), 2.0)
    assert type(fr) is Frozen and torch.equal(fr.logits, t * 2) and fr.loss is None

    class Plain:
        def __init__(self, logits: torch.Tensor) -> None:
            self.logits = logits

    p = Plain(t)
    q = scaled_output(p, 2.0)
    assert type(q) is Plain and q is not p and torch.equal(q.logits, t * 2) and p.logits is t
    with pytest.raises(TypeError, match="holds no tensor"):
        scaled_output("text", 2.0)
    half = scaled_output(t.half(), torch.tensor(2.0))
    assert half.dtype == torch.float16


class _LossFirst(nn.Module):
    """Returns ``(loss, logits)`` (a Hugging Face model called with ``return_dict=False`` and
    labels) or ``{"loss": ..., "logits_per_image": ...}`` (``CLIPOutput``: no ``.logits``)."""

    def __init__(self, as_dict: bool) -> None:
        super().__init__()
        self.as_dict = as_dict
        self.lin = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Any:
        logits = self.lin(x)
        loss = F.cross_entropy(logits, labels)
        return {"loss": loss, "logits_per_image": logits} if self.as_dict else (loss, logits)


@pytest.mark.parametrize("as_dict", [False, True], ids=["tuple", "mapping"])
def test_hook_scales_the_output_it_measured_not_a_loss_before_it(as_dict: bool) -> None:
    # the std was measured on the logits and the hook multiplied the 0-d loss: CLIP's loss
    # 2.43 -> 0.06 with logits unchanged, and a report of std_after 0.05
    torch.manual_seed(0)
    model = _LossFirst(as_dict)
    gen = torch.Generator().manual_seed(2)
    batches = [
        {"x": torch.randn(8, 6, generator=gen), "labels": torch.randint(0, 4, (8,), generator=gen)}
        for _ in range(2)
    ]
    before = model(**batches[0])
    with pytest.warns(UserWarning, match="returns a loss of its own"):
        report = scale_output_(model, batches, target=TARGET, how="hook")
    after = model(**batches[0])
    key = "logits_per_image" if as_dict else 1
    torch.testing.assert_close(after[key], before[key] * report.info["scale"], rtol=1e-6, atol=0)
    loss = "loss" if as_dict else 0
    assert torch.equal(after[loss], before[loss])
    assert measure_output_std(model, batches) == pytest.approx(TARGET, rel=REL)


def test_hook_on_the_model_is_checked_against_what_forward_returns() -> None:
    # a root hook was never checked: a forward= not proportional to the output passed silently
    torch.manual_seed(0)
    model, x = nn.Linear(6, 4), torch.randn(16, 6)
    before = _state(model)
    with pytest.raises(ValueError, match="forward= computes something not degree-1 homogeneous"):
        scale_output_(model, x, how="hook", forward=lambda m, b: m(b).softmax(-1))
    assert _hook_count(model) == 0
    _same_state(model, before)


def test_hook_is_picklable_and_deep_copies_with_the_model() -> None:
    hook = pickle.loads(pickle.dumps(OutputScaleHook(0.25)))
    assert hook.scale == 0.25 and "0.25" in repr(hook)
    model, x = _mlp(), _mlp_data()
    report = scale_output_(model, x, how="hook")
    clone = copy.deepcopy(model)
    torch.testing.assert_close(clone(x), model(x))
    restored = pickle.loads(pickle.dumps(model))
    torch.testing.assert_close(restored(x), model(x))
    report.info["handle"].remove()


def test_measure_output_std_reads_logits() -> None:
    model, batches = _tied(), _kw_data()
    logits = torch.cat([model(**b).logits.detach() for b in batches]).double()
    assert measure_output_std(model, batches) == pytest.approx(
        logits.std(unbiased=False).item(), rel=1e-9
    )
    dmodel = _dict_model()
    logits = dmodel(**batches[0])["logits"].detach().double()
    assert measure_output_std(dmodel, batches[0]) == pytest.approx(
        logits.std(unbiased=False).item(), rel=1e-9
    )


def test_unknown_how_lists_hook() -> None:
    with pytest.raises(ValueError, match="'hook'"):
        scale_output_(_mlp(), _mlp_data(), how="bogus")  # type: ignore[arg-type]


def test_output_scale_traces_under_fx() -> None:
    """The scaling linter walks a model with ``torch.fx``: a model ending in ``OutputScale`` (the
    README's) could not be traced ("cannot scale a Proxy output")."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3), OutputScale(0.25))
    traced = torch.fx.symbolic_trace(model)
    x = torch.randn(5, 4)
    torch.testing.assert_close(traced(x), model(x), rtol=0, atol=0)
    torch.testing.assert_close(model(x), 0.25 * model[:3](x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_output_scale_module_keeps_the_models_precision(dtype: torch.dtype) -> None:
    """The OutputScale module's buffer was float32 for a float64 model: its std missed the
    target by 3e-8 relative where fold and hook reach it to rounding."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dtype)
    x = torch.randn(256, 8, dtype=dtype)
    report = scale_output_(model, x, target=TARGET, how="module")
    scaled = nn.Sequential(model, report.info["module"])
    assert report.info["module"].scale.dtype == dtype
    with torch.no_grad():
        std = float(scaled(x).double().std(unbiased=False))
    eps = torch.finfo(dtype).eps
    assert std == pytest.approx(TARGET, rel=100 * eps)


def test_an_encoder_decoder_s_logits_are_read_at_every_position() -> None:
    """T5's logits are its decoder's: the encoder's attention_mask (of the same length here)
    must not pick them. The std measured is that of all the logits (the oracle, by hand)."""
    pytest.importorskip("transformers")
    from .hf_models import V, t5

    torch.manual_seed(0)
    model = t5().eval()
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[1, 4:] = mask[2, 2:] = 0
    batch = {"input_ids": torch.randint(2, V, (3, 8), generator=g), "attention_mask": mask,
             "labels": torch.randint(2, V, (3, 8), generator=g)}  # fmt: skip
    with torch.no_grad():
        want = float(model(**batch).logits.double().std(unbiased=False))
    report = scale_output_(model, [batch], how="hook", module="lm_head")
    report.info["handle"].remove()
    assert report.info["std_before"] == pytest.approx(want, rel=1e-6)


def test_the_default_fold_goes_into_the_layer_the_logits_come_out_of() -> None:
    """DETR's box MLP runs after its class head: the fold went into the last layer to run, which
    the logits do not depend on, and failed as "not degree-1 homogeneous". The class head is the
    layer the logits come out of (the detector's classifier)."""
    pytest.importorskip("transformers")
    from .hf_models import detection_batches, detr

    torch.manual_seed(0)
    model = detr().eval()
    batches = detection_batches()
    report = scale_output_(model, batches)
    assert report.info["layer"] == "class_labels_classifier"
    with torch.no_grad():
        logits = torch.cat([model(**b).logits for b in batches]).double()
    assert float(logits.std(unbiased=False)) == pytest.approx(0.05, rel=1e-3)


class _TwoHeads(nn.Module):
    """Logits from ``head``; an auxiliary head that runs after it, in a dict or a tuple."""

    def __init__(self, as_dict: bool) -> None:
        super().__init__()
        self.as_dict = as_dict
        self.body, self.head, self.aux = nn.Linear(8, 32), nn.Linear(32, 4), nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> Any:
        h = torch.relu(self.body(x))
        logits, aux = self.head(h).view(len(x), 2, 2), self.aux(h)
        return {"logits": logits, "aux": aux} if self.as_dict else (logits, aux)


@pytest.mark.parametrize("as_dict", [True, False])
def test_the_default_fold_goes_into_the_layer_the_measured_output_comes_from(
    as_dict: bool,
) -> None:
    """The fold took the last weight layer to run (the auxiliary head) and failed as "something
    follows it"; the logits (a view of the head's output here) come from ``head``."""
    torch.manual_seed(0)
    model = _TwoHeads(as_dict)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    aux = model(x)["aux" if as_dict else 1].detach()
    report = scale_output_(model, x)
    assert report.info["layer"] == "head"
    with torch.no_grad():
        out = model(x)
    logits = (out["logits"] if as_dict else out[0]).double()
    assert float(logits.std(unbiased=False)) == pytest.approx(0.05, rel=1e-6)
    assert torch.equal(out["aux" if as_dict else 1], aux)


def test_a_second_output_scale_hook_on_the_same_module_is_warned_about() -> None:
    """Two calls stacked two hooks without a word (the second multiplies by about 1)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(256, 10, generator=torch.Generator().manual_seed(0))
    first = scale_output_(net, x, target=0.05, how="hook")
    with pytest.warns(UserWarning, match="already has an output scale hook"):
        second = scale_output_(net, x, target=0.05, how="hook")
    assert second.info["scale"] == pytest.approx(1.0, rel=1e-4)
    for report in (first, second):
        report.info["handle"].remove()
    assert not net._forward_hooks


def test_a_hook_on_the_model_counts_its_check_pass() -> None:
    """The check pass after attaching the hook ran on the model too, but was counted only for a
    module's hook (forward_passes 1 where the model ran twice)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    calls = []
    model.register_forward_pre_hook(lambda m, a: calls.append(1))
    report = scale_output_(model, [torch.randn(16, 4)], how="hook")
    report.info["handle"].remove()
    assert report.forward_passes == len(calls) == 2
