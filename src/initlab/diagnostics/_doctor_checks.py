"""What :func:`~initlab.diagnostics.doctor.doctor` measures and concludes: one measurement of
the model (a diagnosis and one no-grad pass of the outputs), the checks on it with their
references and verdicts, and the fixes each check recommends (see the doctor's docstring)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from initlab._core.data import batch_size
from initlab._core.knobs import errors_named
from initlab._core.loss import Loss
from initlab._core.loss_counts import target_count
from initlab._core.parametrized import machinery
from initlab._core.rng import Seeds, peeked
from initlab._core.rows import _fmt
from initlab._core.underflow import FLOAT16_ADVICE
from initlab.diagnostics._outputs import (
    Forward,
    init_logit_std,
    output_pass,
)
from initlab.diagnostics.diagnose import diagnose
from initlab.diagnostics.report import RATIO_BAD, RATIO_WARN, Report
from initlab.init._structure import has_attention

FIXES: tuple[str, ...] = ("init", "lsuv", "output_scale", "precondition")
"""The fixes, in the order they are applied (see :mod:`initlab.diagnostics.doctor`)."""

CHECKS: tuple[str, ...] = (
    "initial_loss",
    "logit_std",
    "gamma_spread",
    "nu_spread",
    "dead_or_exploding_layers",
)
"""The checks, in the order of the report's rows."""

OUTPUT_TARGET = 0.05
"""The outputs' std the ``output_scale`` fix gives where they have no reference (the paper's §6.4
value); classification and regression outputs get :func:`output_target`."""
SPREAD_WARN = RATIO_WARN**2
"""A ``gamma`` (or ``nu``) max/min above this: ``warn``."""
SPREAD_BAD = RATIO_BAD**2
"""... above this: ``bad``."""

_LOSS_WARN, _LOSS_BAD = 1.1, 2.0  # initial loss / ln C
_STD_BAD = 3.0  # logit std / reference
_MSE_WARN, _MSE_BAD = 2.0, 10.0  # MSE / E[y^2], logit std / std(y)
_LAYER_RULES = {
    "vanishing_signal": "lsuv",
    "exploding_signal": "lsuv",
    "vanishing_gradient": "lsuv",
    "exploding_gradient": "lsuv",
    "dead_relu": "lsuv",
    "bias_dominates": "lsuv",
    "zero_gradient": "lsuv",
    "non_finite": "init",
    "identical_units": "init",
}
_CALLS = {
    "init": "init_model(model, 'geometric')",
    "lsuv": "lsuv_(model, data)",
    "output_scale": "scale_output_(model, data, target=sqrt(0.2 ln C) / 2, how='hook')",
    "precondition": "precondition_(model, data, how='lr') → preconditioned_param_groups",
}


# ----------------------------------------------------------------------------- measuring


@dataclass
class _Measure:
    """What one measurement of the model gave (a :func:`diagnose` and one no-grad pass)."""

    report: Report
    loss: float
    logit_std: float
    kind: str = ""  # "classification", "regression" or ""
    classes: int = 0
    target_sq: float = math.nan
    target_std: float = math.nan
    own_loss: bool = False
    own_other: bool = False  # the model's own loss is not a cross-entropy of its logits
    missing: str = ""  # why the outputs could not be read ("" when they were)
    init_std: tuple[float, str] | None = None  # init_logit_std's (std, error); None: not tried


@dataclass
class _Setup:
    """What every measurement and fix of one :func:`doctor` call shares."""

    batches: list[Any]
    loss: Loss
    generator: torch.Generator | None
    forward: Forward | None  # the fixes' and the output pass's (None: the default forward)


def _measure(model: nn.Module, setup: _Setup) -> _Measure:
    """The checks' measurement: diagnose's pass and the output pass, their random draws (dropout
    masks) seeded from the generator without moving it (the fixes draw as they would alone)."""
    batches, loss = setup.batches, setup.loss
    generator = peeked(setup.generator)
    with errors_named("doctor", "diagnose"):  # a loss undefined on a batch raises there too
        report = diagnose(
            model, batches, loss, max_batches=len(batches), gradients=False, spectra=False,
            generator=generator, name=type(model).__name__,
        )  # fmt: skip
    losses = [float(v) for v in report.meta.get("loss", [])]
    with Seeds(model, generator).scope():
        outputs = output_pass(model, batches, loss, setup.forward)
    return _Measure(report, _per_example(losses, batches, loss), **outputs)


def _per_example(losses: list[float], batches: list[Any], loss: Loss) -> float:
    """The mean loss per target over the batches (:func:`~initlab._core.loss_counts.target_count`:
    per counted token for a language model's cross-entropy, per element for MSE; per example for a
    loss without targets): a criterion that declares ``reduction="sum"`` gives each batch's sum, any
    other loss (a mean) is weighted by the batch's count."""
    if not losses:
        return math.nan
    counts = [target_count(loss, b) or float(batch_size(b)) for b in batches[: len(losses)]]
    if loss.reduction == "sum":
        total = sum(losses)
    else:
        total = sum(n * v for n, v in zip(counts, losses, strict=True))
    return total / sum(counts) if sum(counts) > 0 else math.nan


# ----------------------------------------------------------------------------- checks


@dataclass
class _Check:
    check: str
    value: float
    reference: float
    verdict: str
    why: str
    fixes: tuple[str, ...] = ()
    untreated: str = ""  # why an ill check gets no fix, and what to do: one short clause

    @property
    def fix(self) -> str:
        return "; ".join(_CALLS[f] for f in FIXES if f in self.fixes)

    def untreat(self, reason: str) -> None:
        """No fix for this check; the first reason given is kept (the one that decided)."""
        self.fixes = ()
        self.untreated = self.untreated or reason


def _grade(ratio: float, warn: float, bad: float) -> str:
    if not math.isfinite(ratio):
        return "bad"
    return "ok" if ratio <= warn else ("warn" if ratio <= bad else "bad")


def _loss_check(m: _Measure) -> _Check:
    big = ("init", "output_scale")
    if not math.isfinite(m.loss):
        return _Check("initial_loss", m.loss, math.nan, "bad", "the loss is not finite", big)
    if m.kind == "classification":
        ref = math.log(m.classes)
        verdict = _grade(m.loss / ref, _LOSS_WARN, _LOSS_BAD)
        if verdict == "ok":
            low = " (below: better than chance, e.g. trained weights)" if m.loss < 0.9 * ref else ""
            why = f"{_fmt(m.loss)} is within 10% of ln C = {ref:.4g} (C = {m.classes}){low}"
        else:
            why = (
                f"too high: {_fmt(m.loss)} is {m.loss / ref:.3g}× ln C = {ref:.4g} (C = "
                f"{m.classes}); an untrained model should start near ln C: the logits are too large"
            )
        return _Check("initial_loss", m.loss, ref, verdict, why, big if verdict != "ok" else ())
    if m.kind == "regression":
        ref = m.target_sq
        verdict = _grade(m.loss / ref, _MSE_WARN, _MSE_BAD) if ref > 0 else "n/a"
        why = f"MSE {_fmt(m.loss)} vs E[y^2] = {_fmt(ref)}, the loss of predicting 0"
        return _Check("initial_loss", m.loss, ref, verdict, why, big if verdict in _ILL else ())
    why = "no reference: the loss is neither cross-entropy on integer targets nor MSE on floats" + (
        " (the model's own loss, of a kind its targets do not tell)" if m.own_loss else ""
    )
    if m.own_other:
        why = (
            "no reference: the model's own loss is not the cross-entropy of its logits on the "
            "labels (e.g. a CTC loss, or a sum over a sequence), so ln C does not apply"
        )
    if m.missing:
        why = f"no reference: the model's outputs (the number of classes) are unknown: {m.missing}"
    return _Check("initial_loss", m.loss, math.nan, "n/a", why)


_ILL = ("warn", "bad")

# Measured by a tester: a default T5 at 1.17× ln V, given init or an output scale, ended 200
# steps near ln V, where the model as built reached a third of it.
_MILD = (
    "; mild, so no fix is recommended: shrinking the outputs (init, an output scale) also slows "
    "their learning, which can cost more than it gains at this size"
)


def _mild_untreated(checks: list[_Check]) -> None:
    """The output checks at ``warn`` on the model as given: reported, not treated
    (:data:`_MILD`). After doctor's own init they are treated: the geometric init leaves a
    classifier's logits large, and the paper pairs it with output scaling (§6.4)."""
    for c in checks:
        if c.check in ("initial_loss", "logit_std") and c.verdict == "warn" and c.fixes:
            c.untreat(
                "mild (warn): shrinking the outputs also slows their learning; "
                "doctor(model, data, fix='output_scale') scales them anyway"
            )
            c.why += _MILD


def output_target(m: _Measure) -> float:
    """The outputs' std the ``output_scale`` fix gives: for classification half the
    ``logit_std`` reference, ``sqrt(0.2 ln C) / 2`` (0.34 for C = 10), the least change that
    brings both output checks inside their references with a margin (the paper's 0.05 would
    shrink every gradient about 7x more, and SGD's effective learning rate by that squared); for
    a regression the targets' std; else :data:`OUTPUT_TARGET`."""
    if m.kind == "classification" and m.classes > 1:
        return 0.5 * math.sqrt(0.2 * math.log(m.classes))
    if m.kind == "regression" and m.target_std > 0:
        return float(m.target_std)
    return OUTPUT_TARGET


def _std_check(m: _Measure) -> _Check:
    fixes = ("init", "output_scale")
    std = m.logit_std
    if m.missing:
        return _Check("logit_std", std, math.nan, "n/a", f"not measured: {m.missing}")
    if m.kind == "classification":
        ref = math.sqrt(0.2 * math.log(m.classes))
        verdict = _grade(std / ref, 1.0, _STD_BAD)
        why = (
            f"logits' std {_fmt(std)}: the cross-entropy exceeds ln C by about std²/2, which is "
            f"{'within' if verdict == 'ok' else 'beyond'} 10% of ln C at std ≤ {ref:.3g}"
        )
    elif m.kind == "regression" and m.target_std > 0:
        ref = m.target_std
        verdict = _grade(std / ref, _MSE_WARN, _MSE_BAD)
        why = f"outputs' std {_fmt(std)} vs the targets' std {_fmt(ref)}"
    else:
        ref, verdict = math.nan, ("n/a" if math.isfinite(std) else "bad")
        why = f"outputs' std {_fmt(std)}; no reference without class or regression targets"
    return _Check("logit_std", std, ref, verdict, why, fixes if verdict in _ILL else ())


def _spread_check(m: _Measure, key: str) -> _Check:
    imb = m.report.meta.get("imbalance") or {}
    value = float(imb.get(f"{key}_max_over_min", math.nan))
    symbol = "γ" if key == "gamma" else "ν"
    name = f"{key}_spread"
    zero = int(imb.get(f"{key}_zero") or 0)
    if value == math.inf and zero:
        why = (
            f"{symbol} max/min over {imb.get(f'{key}_layers')} weights is infinite: {zero} have "
            f"{symbol} = 0 (min {imb.get(f'{key}_argmin')!r}), no gradient reaches them; see "
            "dead_or_exploding_layers (no learning rate balances a layer that gets no gradient)"
        )
        if _float16_zero(m):
            why += "; in float16 a gradient below 5.96e-8 is 0: " + FLOAT16_ADVICE
        none = f"{zero} weight(s) get no gradient ({symbol} = 0): see dead_or_exploding_layers"
        return _Check(name, value, SPREAD_WARN, "bad", why, untreated=none)
    if not math.isfinite(value):
        count = int(imb.get(f"{key}_layers") or 0)
        why = f"{symbol} measured on {count} weight(s): a max/min needs two or more" + (
            "; layers without a gradient: see dead_or_exploding_layers" if _no_gradient(m) else ""
        )
        return _Check(name, value, SPREAD_WARN, "n/a", why)
    verdict = _grade(value, SPREAD_WARN, SPREAD_BAD)
    why = (
        f"{symbol} max/min over {imb.get(f'{key}_layers')} weights = {value:.3g} (max "
        f"{imb.get(f'{key}_argmax')!r}, min {imb.get(f'{key}_argmin')!r}): a layer with r× the "
        f"{symbol} of another learns r× faster at one learning rate"
    )
    return _Check(
        name, value, SPREAD_WARN, verdict, why, ("precondition",) if verdict in _ILL else ()
    )


def _normalized(model: nn.Module) -> bool:
    """Whether a normalization layer (BatchNorm, LayerNorm, GroupNorm, RMSNorm, ...) resets the
    signal's scale somewhere in the model. The modules of a parametrization (``weight_norm``'s
    ``_WeightNorm``, ``spectral_norm``'s ``_SpectralNorm``) compute a weight, not the signal:
    they are no normalization layer."""
    skip = machinery(model)
    return any("Norm" in type(mod).__name__ for mod in model.modules() if id(mod) not in skip)


def _trusted(finding: Mapping[str, Any], normalized: bool, traced: bool) -> bool:
    """Whether a linter finding calls for a fix. Dead units and NaN/inf always do. A signal or a
    gradient that vanishes or explodes through depth does in a plain chain (MLP, VGG-like): with
    normalization layers the scale is reset (an embedding of std 0.02 or a small residual branch
    are by design), and without a trace the skip paths the chain product ignores are unknown."""
    rule = finding.get("rule")
    if rule in ("non_finite", "dead_relu", "input_scale"):
        return True
    if normalized:
        return False
    return traced or not str(rule).endswith("_gradient")


def _no_gradient(m: _Measure, quantity: str = "no_gradient") -> list[dict[str, Any]]:
    """The diagnosis's ``no_gradient`` rows (layers whose trainable parameters got no gradient:
    not called on the data, or under ``torch.no_grad()``), or its ``zero_gradient`` rows (a
    gradient of 0: vanished, or underflowed in float32), as linter-like findings."""
    return [
        {"layer": r["layer"], "rule": quantity, "severity": r["verdict"], "message": r["note"]}
        for r in m.report.rows
        if r["quantity"] == quantity and r["verdict"] in ("warn", "bad")  # not a branch closed
    ]


_UNTRACED_RULES = ("not_traced", "not_measured")
"""The linter's findings that say what it could not inspect in a model fx could not trace."""


def _untraced(m: _Measure) -> str:
    """The linter's word on a model torch.fx could not trace: what was inspected and what was
    not (its ``not_traced`` and ``not_measured`` findings), as the end of a check's text."""
    said = [r["message"] for r in m.report.findings if r.get("rule") in _UNTRACED_RULES]
    return "".join(f"; {s}" for s in said)


def _layers_check(m: _Measure, model: nn.Module) -> _Check:
    normalized, traced = _normalized(model), bool(m.report.meta.get("traced"))
    found = [
        r
        for r in m.report.findings
        if r.get("rule") in (*_LAYER_RULES, "input_scale") and r.get("severity") in _ILL
    ]  # the input's scale: no fix here changes the data, the message says what to do
    silent, zero = _no_gradient(m), _no_gradient(m, "zero_gradient")
    half = [r for r in zero if r["layer"] in _float16_zero(m)]  # no fix: float16's range
    trusted = [r for r in found if _trusted(r, normalized, traced)]
    ignored = len(found) - len(trusted)
    hits = zero + trusted + silent
    note = (
        f" ({ignored} vanishing/exploding finding(s) not counted: "
        + ("normalization layers reset the scale" if normalized else "the model was not traced")
        + "; see report.diagnosis.findings)"
        if ignored
        else ""
    )
    note += _untraced(m)
    if not hits:
        why = "no vanishing or exploding signal or gradient, no dead ReLU, no NaN/inf" + note
        return _Check("dead_or_exploding_layers", 0.0, 0.0, "ok", why)
    verdict = "bad" if any(r["severity"] == "bad" for r in hits) else "warn"
    layers = {r["layer"] for r in hits}
    shown = "; ".join(f"{r['layer'] or '<root>'}: {r['rule']} ({r['message']})" for r in hits[:4])
    more = f"; and {len(hits) - 4} more finding(s)" if len(hits) > 4 else ""
    if silent:
        more += "; no fix here gives a layer a gradient: check how the model and loss use it"
    fixed = [r for r in hits if r["rule"] in _LAYER_RULES and r not in half]
    named = dict(model.named_modules())
    recurrent = sorted({r["layer"] for r in fixed if _recurrent_lsuv(r, named)})
    fixes = tuple(sorted({"init" if _recurrent_lsuv(r, named) else _LAYER_RULES[r["rule"]]
                          for r in fixed}))  # fmt: skip
    if recurrent:
        more += (
            f"; lsuv_ skips recurrent layers ({', '.join(recurrent)}), so it cannot rescale "
            "them: init_model(model, 'geometric') redraws their gate blocks (gain 1)"
        )
    check = _Check(
        "dead_or_exploding_layers", float(len(layers)), 0.0, verdict, shown + more + note, fixes
    )
    if half and fixes:  # the fixes are the other findings'
        check.why += "; " + _FLOAT16_UNTREATED
    elif half:
        check.untreat(_FLOAT16_UNTREATED)
    return check


def _recurrent_lsuv(finding: Mapping[str, Any], named: Mapping[str, nn.Module]) -> bool:
    """Whether LSUV would be the finding's fix but its layer is recurrent, which ``lsuv_``
    skips (its output is not linear in a weight): the fix there is ``init``."""
    module = named.get(finding["layer"])
    rnn = isinstance(module, (nn.RNNBase, nn.RNNCellBase))
    return rnn and _LAYER_RULES.get(finding["rule"]) == "lsuv"


_FLOAT16_UNTREATED = (
    "a gradient that is 0 in float16 may be float16's range (below 5.96e-8 it rounds to 0), "
    f"not the init's, so no fix is applied for it: {FLOAT16_ADVICE}"
)


def _float16_zero(m: _Measure) -> set[str]:
    """The layers whose zero gradient the diagnosis blames on float16's range (its imbalance's
    ``float16_zero``: :mod:`initlab._core.underflow`)."""
    imb = m.report.meta.get("imbalance") or {}
    return set(imb.get("float16_zero") or ())


def _init_for_logits(
    checks: list[_Check], model: nn.Module, setup: _Setup, m: _Measure, done: bool = False
) -> None:
    """Keep ``"init"`` as a fix for logits that are too large only where it shrinks them (the
    logits' std after it at most half of now): ``init_model`` draws a language model's output
    head small, not a classifier's ``classifier``/``score`` head, so on those it would replace
    the model's init and leave the logits as large; ``output_scale`` is the fix there.
    ``done``: the init was already applied (``m`` is after it), so it did not."""
    for c in checks[:2]:  # initial_loss, logit_std
        if "init" not in c.fixes or not math.isfinite(c.value) or not math.isfinite(m.logit_std):
            continue
        if done:
            c.fixes = tuple(f for f in c.fixes if f != "init")
            c.why += "; init_model(model, 'geometric') was applied: scale the output instead"
            continue
        if m.init_std is None:  # measured once per measurement
            m.init_std = init_logit_std(model, setup.batches, setup.loss, setup.forward,
                                        setup.generator)  # fmt: skip
        after, error = m.init_std
        if math.isfinite(after) and after <= 0.5 * m.logit_std:
            continue
        c.fixes = tuple(f for f in c.fixes if f != "init")
        c.why += (
            f"; init_model(model, 'geometric') would not shrink the logits (std {_fmt(m.logit_std)}"
            f" → {_fmt(after)}): scale the output instead"
            if math.isfinite(after)
            else f"; init_model(model, 'geometric') failed here ({error}), so it is no fix here"
            if error
            else "; init_model(model, 'geometric') leaves the logits non-finite: no fix here"
        )


def _checks(
    m: _Measure, model: nn.Module, setup: _Setup | None = None, done: Sequence[str] = ()
) -> list[_Check]:
    """The checks of one measurement; with ``setup``, ``"init"`` is recommended for large
    logits only where it shrinks them (:func:`_init_for_logits`; ``done``: the fixes already
    run, changed or not)."""
    checks = [_loss_check(m), _std_check(m), _spread_check(m, "gamma"), _spread_check(m, "nu")]
    if setup is not None:
        _init_for_logits(checks, model, setup, m, "init" in done)
    if checks[2].verdict == "n/a" and checks[3].verdict in _ILL:
        checks[3].fixes = ("precondition",)
    elif checks[2].verdict != "n/a":
        checks[3].fixes = ()  # ν follows γ; the preconditioning balances γ
    checks.append(_layers_check(m, model))
    if "init" not in done:
        _mild_untreated(checks)
    if any(f.get("rule") == "input_scale" for f in m.report.findings):
        _data_first(checks)
    outside = _outside_gr(model)
    if outside:
        _spreads_untreated(checks, outside)
    _nu_follows_gamma(checks[2], checks[3])
    return checks


def _nu_follows_gamma(gamma: _Check, nu: _Check) -> None:
    """An ill ν spread without a fix of its own: γ's reason where γ's spread gets no fix either,
    and where γ's is within its reference, that precondition (which balances γ) does not apply;
    where γ's has a fix, that fix treats both (no reason)."""
    if nu.verdict not in _ILL or nu.fixes or nu.untreated:
        return
    if gamma.untreated:
        nu.untreated = gamma.untreated
    elif gamma.verdict == "ok":
        nu.untreated = (
            "precondition balances γ, which is within its reference, not ν; "
            "block_curvature(model, data) measures the curvature per layer"
        )


def _outside_gr(model: nn.Module) -> str:
    """What puts ``model`` outside GR scaling's derivation (Defazio & Bottou's A1–A3 and Table 1:
    linear layers, convolutions and ReLUs): ``"normalization"`` or ``"attention"`` layers, or
    ``""``."""
    if _normalized(model):
        return "normalization"
    return "attention" if has_attention(model) else ""


def _spreads_untreated(checks: list[_Check], outside: str) -> None:
    """γ and ν spreads of a model outside the derivation: reported (at most ``warn``), not
    treated: the spread does not tell which layers learn too fast there, and precondition's
    rates hurt in a tester's runs (a BERT classifier under Adam: loss 0.011 → 0.70)."""
    for c in checks:
        if c.check in ("gamma_spread", "nu_spread") and c.verdict in _ILL:
            c.verdict = "warn"
            c.untreat(
                f"the model has {outside} layers, outside GR scaling's derivation: reported, not "
                "treated; block_curvature(model, data) measures the curvature"
            )
            c.why += (
                f"; but the model has {outside} layers, which GR scaling's derivation (linear "
                "layers, convolutions and ReLUs: Defazio & Bottou, A1–A3 and Table 1) does not "
                "cover: the spread is reported, not treated (precondition's per-layer rates made "
                "a BERT classifier and a Llama train worse); block_curvature measures the "
                "Hessian blocks themselves"
            )


def _data_first(checks: list[_Check]) -> None:
    """With the network's input off scale, the logits', the loss's and the spreads' fixes wait:
    an output scale would shrink the outputs (and every gradient) by what the data grew them, and
    the first layer's γ grows with E[x_0^2]^2, so per-layer rates would all but freeze it."""
    for c in checks:
        waits = c.check in ("initial_loss", "logit_std", "gamma_spread", "nu_spread")
        if waits and c.verdict in _ILL and c.fixes:
            c.untreat(
                "the network's input is off scale: scale the data first, then run doctor again"
            )
            c.why += (
                "; the network's input is off scale (dead_or_exploding_layers): scale the data "
                "first, then run doctor again"
            )


def _recommended(checks: Iterable[_Check]) -> list[str]:
    wanted = {f for c in checks if c.verdict in _ILL for f in c.fixes}
    return [f for f in FIXES if f in wanted]


# ----------------------------------------------------------------------------- fixes compared


_RANK = {"ok": 0, "warn": 1, "bad": 2}


def _worsened(before: list[_Check], after: list[_Check]) -> list[tuple[_Check, _Check]]:
    """The checks whose verdict a fix made worse, ``(before, after)``."""
    return [
        (b, a)
        for b, a in zip(before, after, strict=True)
        if _RANK.get(a.verdict, 0) > _RANK.get(b.verdict, 0)
    ]


def _outputs_only(before: list[_Check], after: list[_Check]) -> bool:
    """Whether the checks a fix left worse are the outputs' only (the initial loss, the logits'
    std), which ``output_scale`` sets."""
    worse = {b.check for b, _ in _worsened(before, after)}
    return bool(worse) and worse <= {"initial_loss", "logit_std"}


def _total(checks: list[_Check]) -> int:
    """The verdicts added up: ok 0, warn 1, bad 2 (n/a 0)."""
    return sum(_RANK.get(c.verdict, 0) for c in checks)


def _worse(before: list[_Check], after: list[_Check]) -> str:
    """The checks a fix left worse (``"initial_loss ok → warn"``), when the verdicts add up to
    more than before (:func:`_total`), or to as much with a check that was ok now ill: a trade
    (a vanishing-gradient flag cleared by logits scaled up, the initial loss and the logits'
    std now warn) is no improvement; ``""`` otherwise."""
    worsened = _worsened(before, after)
    total, was = _total(after), _total(before)
    traded = total == was and any(b.verdict == "ok" for b, _ in worsened)
    if total < was or (total == was and not traded):
        return ""
    text = "; ".join(f"{b.check} {b.verdict} → {a.verdict}" for b, a in worsened)
    if traded:  # the checks it made better: worse from after to before
        better = "; ".join(
            f"{b.check} {b.verdict} → {a.verdict}" for a, b in _worsened(after, before)
        )
        text += f" for {better}: a trade, no better"
    return text
