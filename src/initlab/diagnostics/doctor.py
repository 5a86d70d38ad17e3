r"""``initlab.doctor``: one call that checks a network at step zero, recommends fixes, applies them.

::

    report = initlab.doctor(model, loader)              # measures only: the model is not changed
    print(report.summary())                             # what is ill-conditioned, what would fix it
    report = initlab.doctor(model, loader, fix=True)    # apply the recommended fixes, re-measure
    report.to_pandas()                                  # one row per check, before and after

Checks (one tidy row each, :data:`DOCTOR_COLUMNS`):

=============================  ==================================================================
``initial_loss``               the mean loss over the batches. Reference: ``ln C`` for a
                               cross-entropy on integer targets (``C`` classes: the logits' last
                               dim, dim 1 for dense ``(B, C, *S)`` logits; a language model's
                               vocabulary): an untrained classifier should start near it. The
                               model's own loss counts as one only where it equals the
                               cross-entropy of its logits on the labels (as is, or shifted by one
                               for a causal language model); a CTC loss does not. ``ok``
                               within 10%, ``warn`` up to 2x, ``bad`` beyond (too high). For MSE on
                               float targets the reference is ``E[y^2]``, the loss of predicting 0
                               (``warn`` beyond 2x, ``bad`` beyond 10x). Otherwise ``n/a``.
``logit_std``                  the std of all output elements (the logits), pooled over batches.
                               Reference: ``sqrt(0.2 ln C)``, the std at which the excess
                               cross-entropy ``~ std^2 / 2`` reaches 10% of ``ln C`` (``warn``
                               above, ``bad`` above 3x); for MSE the targets' std (``warn``
                               above 2x, ``bad`` above 10x).
``gamma_spread``               max/min over the weights of the GR scaling ``gamma``
                               (:func:`initlab.gr_scaling`, via :func:`initlab.diagnose`): a layer
                               with ``r`` times the ``gamma`` of another learns ``r`` times faster
                               at one learning rate (Cor. 2: ``kappa >= max/min``). ``warn`` above
                               :data:`SPREAD_WARN` = 16 (some layer 4x from the median, the
                               per-layer ``warn`` of :mod:`~initlab.diagnostics.report`), ``bad``
                               above :data:`SPREAD_BAD` = 10^4; ``inf`` and ``bad`` when some
                               weight's ``gamma`` is 0 (no gradient reaches it: counted in
                               ``dead_or_exploding_layers``, which recommends the fix).
``nu_spread``                  the same for the weight-to-gradient ratio ``nu``.
``dead_or_exploding_layers``   layers with a linter finding ``vanishing_*``, ``exploding_*``,
                               ``dead_relu`` or ``non_finite`` (warn or bad), whose gradient is 0
                               (the diagnosis's ``zero_gradient``, ``bad``: it vanished, or its
                               squares underflow in float32; fix: LSUV), or whose trainable
                               parameters get no gradient (the diagnosis's ``no_gradient``: not
                               called on the data, or run under ``torch.no_grad()``; ``warn``,
                               and no fix here changes it); reference 0.
=============================  ==================================================================

Verdicts are ``"ok"``, ``"warn"``, ``"bad"``, or ``"n/a"`` where a check has no reference (a loss
that is neither cross-entropy nor MSE, a ``gamma`` measured on fewer than two weights, outputs
that could not be read: ``why`` says which).

The outputs are read with ``forward`` (``forward(model, batch)``), by default the model's call
inside a ``loss_fn(model, batch)`` (a model that takes two tensors works as the loss calls it),
else the default forward; the fixes ``lsuv_`` and ``scale_output_`` get the same ``forward=``.

Fixes, in the order they are applied (:data:`FIXES`), each through the public method with the
``generator``:

1. ``"init"``: ``init_model(model, "geometric")`` (the output head of a language model is drawn
   small, ties kept), when a layer or the loss is non-finite, or the loss or logits are too large
   and the init shrinks them (measured, then put back: the logits' std after it at most half of
   now; a classifier's head is drawn as it is, so only ``"output_scale"`` is recommended there).
   An init that changes nothing is not listed as applied (``skipped`` says so);
2. ``"lsuv"``: ``lsuv_(model, data)``, when a signal or gradient vanishes or explodes, or ReLU
   units are dead; after ``"init"``, ``lsuv_(model, data, orthogonal=False)``: the init's weights
   are rescaled, not replaced by LSUV's orthogonal start;
3. ``"output_scale"``: ``scale_output_(model, data, target=0.05, how="hook")``, when the initial
   loss or the logits' std is too high. The hook goes on the output head when the model computes
   its own loss from it (``get_output_embeddings()``, else the last ``nn.Linear`` with ``C``
   outputs), else on the model; it persists (``report.reports["output_scale"].info["handle"]``
   removes it) and is not in the ``state_dict``;
4. ``"precondition"``: ``precondition_(model, data, loss_fn, how="lr")``, when the ``gamma``
   spread is large: the model is unchanged, the multipliers become learning rates
   (:meth:`DoctorReport.param_groups`).

``fix=True`` applies the recommended fixes, and before each one after the first re-measures and
skips it when it is no longer needed (LSUV after an init that already fixed the signal);
``fix=["init", "output_scale"]`` applies exactly those, in the order above. A fix that raises
leaves the model as it was before that fix (the methods' ``restore_on_failure``), is reported in
``failed`` and the others go on. ``fix=False`` (default) never changes the model: parameters,
buffers, modes, gradients, hooks and the RNGs are as before.
"""

from __future__ import annotations

import functools
import json
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from initlab._core.compiled import takes_compiled
from initlab._core.data import DataUse, batch_size, data_use, take_batches
from initlab._core.distributed import is_distributed
from initlab._core.loss import Loss, LossLike, resolve_loss, target_count
from initlab._core.rng import as_generator
from initlab._core.rows import Rows, _fmt
from initlab._core.state import restore_on_failure
from initlab.diagnostics._outputs import (
    Forward,
    fixes_forward,
    init_logit_std,
    output_pass,
    unchanged,
)
from initlab.diagnostics.diagnose import diagnose
from initlab.diagnostics.report import RATIO_BAD, RATIO_WARN, Report, _encode_rows, _encode_value
from initlab.init.model import init_model
from initlab.methods.lsuv import lsuv_
from initlab.methods.output_scale import scale_output_
from initlab.methods.precondition import precondition_, preconditioned_param_groups

__all__ = [
    "CHECKS",
    "DOCTOR_COLUMNS",
    "DOCTOR_FIX_COLUMNS",
    "FIXES",
    "OUTPUT_TARGET",
    "SPREAD_BAD",
    "SPREAD_WARN",
    "DoctorReport",
    "doctor",
]

FIXES: tuple[str, ...] = ("init", "lsuv", "output_scale", "precondition")
"""The fixes, in the order they are applied (see the module docstring)."""

CHECKS: tuple[str, ...] = (
    "initial_loss",
    "logit_std",
    "gamma_spread",
    "nu_spread",
    "dead_or_exploding_layers",
)
"""The checks, in the order of the report's rows."""

DOCTOR_COLUMNS: tuple[str, ...] = ("check", "value", "reference", "verdict", "why", "fix")
"""Columns of a :func:`doctor` report without fixes: the measured ``value``, its ``reference``
(NaN where none), the ``verdict``, ``why`` in words, and the recommended ``fix`` (a call; ``""``
when none is needed)."""

DOCTOR_FIX_COLUMNS: tuple[str, ...] = (
    "check",
    "value",
    "before",
    "after",
    "reference",
    "verdict_before",
    "verdict",
    "why",
    "fix",
)
"""Columns with fixes: ``before``/``verdict_before`` measured before any fix, ``value`` =
``after``, and ``verdict``, ``why``, ``fix`` about the model as it is after the fixes."""

OUTPUT_TARGET = 0.05
"""The logits' std ``scale_output_`` gives (the paper's §6.4 value)."""
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
    "zero_gradient": "lsuv",
    "non_finite": "init",
}
_ALIASES = {"scale_output": "output_scale", "init_model": "init", "preconditioning": "precondition"}
_CALLS = {
    "init": "init_model(model, 'geometric')",
    "lsuv": "lsuv_(model, data)",
    "output_scale": f"scale_output_(model, data, target={OUTPUT_TARGET}, how='hook')",
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
    init_std: float | None = None  # the logits' std right after init_model (None: not tried)


@dataclass
class _Setup:
    """What every measurement and fix of one :func:`doctor` call shares."""

    batches: list[Any]
    loss: Loss
    generator: torch.Generator | None
    forward: Forward | None  # the fixes' and the output pass's (None: the default forward)


def _measure(model: nn.Module, setup: _Setup) -> _Measure:
    batches, loss = setup.batches, setup.loss
    report = diagnose(
        model, batches, loss, max_batches=len(batches), gradients=False, spectra=False,
        generator=setup.generator, name=type(model).__name__,
    )  # fmt: skip
    losses = [float(v) for v in report.meta.get("loss", [])]
    outputs = output_pass(model, batches, loss, setup.forward)
    _check_loss_defined(losses, outputs.pop("finite_outputs"))
    return _Measure(report, _per_example(losses, batches, loss), **outputs)


def _check_loss_defined(losses: list[float], finite_outputs: list[bool]) -> None:
    """Raise if a batch's loss is not finite while the model's outputs on it are: the loss is
    undefined there (a mean over no target, e.g. every label the ignore index -100), which no
    change of the model fixes."""
    for i, (value, finite) in enumerate(zip(losses, finite_outputs, strict=False)):
        if finite and not math.isfinite(value):
            raise ValueError(
                f"doctor: the loss of batch {i} is {value} while the model's outputs on it are "
                "finite: the loss is undefined on that batch, not the model ill-conditioned "
                "(e.g. every target is the ignore index -100, and a mean over no target is "
                "0/0). Drop such batches or pass a loss defined on them; nothing was changed"
            )


def _per_example(losses: list[float], batches: list[Any], loss: Loss) -> float:
    """The mean loss per target over the batches (:func:`~initlab._core.loss.target_count`: per
    counted token for a language model's cross-entropy, per element for MSE; per example for a
    loss without targets): a criterion that declares ``reduction="sum"`` gives each batch's sum,
    any other loss (a mean) is weighted by the batch's count."""
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

    @property
    def fix(self) -> str:
        return "; ".join(_CALLS[f] for f in FIXES if f in self.fixes)


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
        return _Check(name, value, SPREAD_WARN, "bad", why)
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
    signal's scale somewhere in the model."""
    return any("Norm" in type(mod).__name__ for mod in model.modules())


def _trusted(finding: Mapping[str, Any], normalized: bool, traced: bool) -> bool:
    """Whether a linter finding calls for a fix. Dead units and NaN/inf always do. A signal or a
    gradient that vanishes or explodes through depth does in a plain chain (MLP, VGG-like): with
    normalization layers the scale is reset (an embedding of std 0.02 or a small residual branch
    are by design), and without a trace the skip paths the chain product ignores are unknown."""
    rule = finding.get("rule")
    if rule in ("non_finite", "dead_relu"):
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
        if r["quantity"] == quantity
    ]


def _layers_check(m: _Measure, model: nn.Module) -> _Check:
    normalized, traced = _normalized(model), bool(m.report.meta.get("traced"))
    found = [
        r for r in m.report.findings if r.get("rule") in _LAYER_RULES and r.get("severity") in _ILL
    ]
    silent, zero = _no_gradient(m), _no_gradient(m, "zero_gradient")
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
    if not hits:
        why = "no vanishing or exploding signal or gradient, no dead ReLU, no NaN/inf" + note
        return _Check("dead_or_exploding_layers", 0.0, 0.0, "ok", why)
    verdict = "bad" if any(r["severity"] == "bad" for r in hits) else "warn"
    layers = {r["layer"] for r in hits}
    shown = "; ".join(f"{r['layer'] or '<root>'}: {r['rule']} ({r['message']})" for r in hits[:4])
    more = f"; and {len(hits) - 4} more" if len(hits) > 4 else ""
    if silent:
        more += "; no fix here gives a layer a gradient: check how the model and loss use it"
    fixes = tuple(sorted({_LAYER_RULES[r["rule"]] for r in hits if r["rule"] in _LAYER_RULES}))
    return _Check(
        "dead_or_exploding_layers", float(len(layers)), 0.0, verdict, shown + more + note, fixes
    )


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
        after = m.init_std
        if math.isfinite(after) and after <= 0.5 * m.logit_std:
            continue
        c.fixes = tuple(f for f in c.fixes if f != "init")
        c.why += (
            f"; init_model(model, 'geometric') would not shrink the logits (std {_fmt(m.logit_std)}"
            f" → {_fmt(after)}): scale the output instead"
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
    return checks


def _recommended(checks: Iterable[_Check]) -> list[str]:
    wanted = {f for c in checks if c.verdict in _ILL for f in c.fixes}
    return [f for f in FIXES if f in wanted]


# ----------------------------------------------------------------------------- fixing


def _fix_names(fix: bool | str | Sequence[str] | None) -> list[str] | None:
    """``None`` for "the recommended ones", else the names asked for, in :data:`FIXES` order."""
    if fix is True:
        return None
    if fix is False or fix is None:
        return []
    names = [fix] if isinstance(fix, str) else list(fix)
    clean = set()
    for n in names:
        key = _ALIASES.get(str(n).rstrip("_"), str(n).rstrip("_"))
        if key not in FIXES:
            raise ValueError(f"doctor: unknown fix {n!r}; valid: {', '.join(FIXES)} (or True)")
        clean.add(key)
    return [f for f in FIXES if f in clean]


def _head_name(model: nn.Module, m: _Measure) -> str | None:
    """Where the output-scale hook goes: the head when the model computes its own loss."""
    if not m.own_loss:
        return None
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    linears = [(n, mod) for n, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    if not isinstance(head, nn.Module):
        fits = [mod for _, mod in linears if mod.out_features == m.classes]
        head = fits[-1] if fits else None
    return next((n for n, mod in model.named_modules() if mod is head), None)


def _apply(name: str, model: nn.Module, setup: _Setup, m: _Measure, applied: Sequence[str]) -> Rows:
    batches, generator, forward = setup.batches, setup.generator, setup.forward
    if name == "init":
        with restore_on_failure(model):
            return init_model(model, "geometric", generator=generator)
    if name == "lsuv":  # after "init": its weights rescaled, not replaced by an orthogonal start
        orthogonal = "init" not in applied
        return lsuv_(
            model, batches, max_batches=len(batches), orthogonal=orthogonal, generator=generator,
            forward=forward,
        )  # fmt: skip
    if name == "output_scale":
        module = _head_name(model, m)
        return scale_output_(
            model, batches, target=OUTPUT_TARGET, how="hook", module=module, generator=generator,
            forward=forward,
        )  # fmt: skip
    return precondition_(model, batches, setup.loss, how="lr", generator=generator)


@dataclass
class _Course:
    """The fixes of one :func:`doctor` call: what was applied, skipped, failed."""

    applied: list[str] = field(default_factory=list)
    reports: dict[str, Rows] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    notes: dict[str, list[str]] = field(default_factory=dict)
    unchanged: list[str] = field(default_factory=list)  # ran, changed nothing (in skipped)

    def run(self, name: str, call: Callable[[], Rows]) -> bool:
        """Run one fix; its warnings become notes, an error a failure. Whether it applied."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                self.reports[name] = call()
            except (ValueError, TypeError, RuntimeError) as err:
                self.failed[name] = f"{type(err).__name__}: {err}"
        if caught:
            self.notes[name] = list(dict.fromkeys(str(w.message) for w in caught))
        if name in self.failed:
            return False
        self.applied.append(name)
        return True


def _treat(
    model: nn.Module, setup: _Setup, before: _Measure, names: list[str] | None
) -> tuple[_Course, _Measure]:
    """Apply the fixes (``names``, or the recommended ones re-checked before each); re-measure."""
    auto = names is None
    todo = _recommended(_checks(before, model, setup)) if auto else list(names or [])
    course, current, stale = _Course(), before, False
    for name in todo:
        done = [*course.applied, *course.unchanged]
        if auto and course.applied:
            if stale:
                current, stale = _measure(model, setup), False
            if name not in _recommended(_checks(current, model, setup, done)):
                course.skipped[name] = f"no longer needed after {', '.join(course.applied)}"
                continue
        call = functools.partial(_apply, name, model, setup, current, done)
        kept = [t.detach().clone() for t in model.state_dict().values()] if name == "init" else []
        if course.run(name, call) and kept and unchanged(model, kept):
            course.applied.remove(name)  # never listed as applied: say it changed nothing
            course.unchanged.append(name)
            course.reports.pop(name, None)
            course.skipped[name] = (
                "changed nothing: the model already has init_model(model, 'geometric') with "
                "this generator"
            )
        elif name in course.applied:
            stale = stale or name != "precondition"  # how="lr" leaves the model as it was
    if stale:
        current = _measure(model, setup)
    return course, current


# ----------------------------------------------------------------------------- the report


class DoctorReport(Rows):
    """What :func:`doctor` found (and fixed): one row per check.

    Columns :data:`DOCTOR_COLUMNS` (``fix=False``) or :data:`DOCTOR_FIX_COLUMNS` (fixes asked
    for). ``to_rows``, ``to_pandas``, ``to_markdown``, ``to_json`` and :meth:`summary`.

    Attributes:
        applied: names of the fixes applied, in order (:data:`FIXES`).
        reports: ``{fix: report}``: the :class:`~initlab.MethodReport` of each fix applied
            (``init``: the :class:`~initlab.InitReport`).
        recommended: the fixes the first measurement recommends.
        skipped: ``{fix: why}`` for recommended fixes found unnecessary after earlier ones.
        failed: ``{fix: error}`` for fixes that raised (the model was restored to before them).
        notes: ``{fix: [message]}``: the warnings a fix raised (caught, kept here).
        used: the data read (:class:`~initlab._core.data.DataUse`).
        diagnosis: the :class:`~initlab.Report` of the first measurement; ``diagnosis_after``
            that of the last (``None`` without fixes).
        meta: the model's name, the loss's name and kind, ``ln C``, the fix mode.
    """

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        columns: Sequence[str],
        *,
        used: DataUse,
        recommended: Sequence[str] = (),
        course: _Course | None = None,
        diagnosis: Report | None = None,
        diagnosis_after: Report | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(rows, columns, title="initlab doctor", used=used)
        course = course or _Course()
        self.applied: list[str] = list(course.applied)
        self.reports: dict[str, Rows] = dict(course.reports)
        self.skipped: dict[str, str] = dict(course.skipped)
        self.failed: dict[str, str] = dict(course.failed)
        self.notes: dict[str, list[str]] = dict(course.notes)
        self.recommended: list[str] = list(recommended)
        self.diagnosis = diagnosis
        self.diagnosis_after = diagnosis_after
        self.meta: dict[str, Any] = dict(meta or {})

    def row(self, check: str) -> dict[str, Any]:
        """The row of one check (``KeyError`` when absent)."""
        for r in self._rows:
            if r["check"] == check:
                return dict(r)
        raise KeyError(f"no check {check!r}; checks: {[r['check'] for r in self._rows]}")

    def value(self, check: str, column: str = "value") -> Any:
        """One cell: ``report.value("initial_loss", "before")``."""
        return self.row(check)[column]

    def param_groups(self, model: nn.Module, *, lr: float, **kwargs: Any) -> list[dict[str, Any]]:
        """``torch.optim`` parameter groups: those of the ``precondition`` fix
        (:func:`initlab.preconditioned_param_groups`, ``optimizer=``, ``weight_decay=``, ``eps=``
        passed on), or one group of every parameter when it was not applied."""
        if "precondition" in self.reports:
            return preconditioned_param_groups(model, self.reports["precondition"], lr=lr, **kwargs)
        group = {"params": list(model.parameters()), "lr": lr}
        group["weight_decay"] = kwargs.get("weight_decay", 0.0)
        return [group]

    def summary(self, how_to_fix: str = "doctor(model, data, fix=True) applies the fixes") -> str:
        """A few lines: what is ill-conditioned, what was fixed (or ``how_to_fix``, when nothing
        was), the before/after of the initial loss and of the γ spread."""
        m = self.meta
        head = f"initlab doctor: {m.get('model', 'model')}"
        if self.used is not None:
            head += f" ({self.used.batches} batch(es), {self.used.examples} examples)"
        lines = [head]
        fixing = "before" in self.columns
        verdict_key = "verdict_before" if fixing else "verdict"
        ill = [r for r in self._rows if r["check"] in CHECKS and r[verdict_key] in _ILL]
        if ill:
            lines.append("  ill-conditioned: " + "; ".join(_ill_text(r, verdict_key) for r in ill))
        else:
            lines.append("  ill-conditioned: nothing found")
        lines.append(f"  recommended: {', '.join(self.recommended) or 'nothing'}")
        lines.extend(self._fix_lines(fixing, how_to_fix))
        lines.append(self._numbers_line("initial_loss", "initial loss", fixing))
        lines.append(self._numbers_line("gamma_spread", "γ spread (max/min)", fixing))
        if "precondition" in self.reports:
            _, after, kept = _all_layer_spreads(self.reports["precondition"])
            keep = f"; {kept} layer(s) keep their γ: attention, tied, frozen" if kept else ""
            lines.append(
                f"  with report.param_groups(model, lr=...): γ spread {_fmt(after)} over every "
                f"weight layer (the model itself is unchanged by precondition_{keep})"
            )
        return "\n".join(lines)

    def _fix_lines(self, fixing: bool, how_to_fix: str) -> list[str]:
        if not fixing:
            return [f"  not changed (fix=False); {how_to_fix}"]
        lines = [f"  applied: {', '.join(self.applied) or 'nothing'}"]
        for name, why in self.skipped.items():
            lines.append(f"  skipped {name}: {why}")
        for name, err in self.failed.items():
            lines.append(f"  failed {name} (model restored to before it): {err}")
        for name, notes in self.notes.items():
            lines.extend(f"  {name} warned: {note}" for note in notes)
        if "output_scale" in self.reports:
            layer = self.reports["output_scale"].info.get("layer") or "the model"  # type: ignore[attr-defined]
            lines.append(
                f"  note: the output scale is a forward hook on {layer} (not in the state_dict); "
                "report.reports['output_scale'].info['handle'].remove() undoes it"
            )
        return lines

    def _numbers_line(self, check: str, label: str, fixing: bool) -> str:
        r = self.row(check)
        if r["verdict"] == "n/a" and not math.isfinite(r["value"]):
            return f"  {label}: n/a ({r['why']})"
        finite = math.isfinite(r["reference"])
        ref = f" (reference {_fmt(r['reference'])})" if finite else " (no reference)"
        if fixing:
            return f"  {label}: {_fmt(r['before'])} → {_fmt(r['after'])}{ref}"
        return f"  {label}: {_fmt(r['value'])}{ref}"

    def __str__(self) -> str:
        return f"{self.summary()}\n\n{super().__str__()}"

    def __repr__(self) -> str:
        return f"DoctorReport({len(self)} checks, applied={self.applied})"

    def to_markdown(self, columns: Sequence[str] | None = None) -> str:
        """The summary, the checks, and each applied fix's report, as markdown."""
        parts = ["# initlab doctor\n", "```\n" + self.summary() + "\n```\n"]
        parts.append(Rows(self._rows, columns or self.columns, "Checks").to_markdown())
        for name, rep in self.reports.items():
            parts.append(Rows(rep.to_rows(), rep.columns, f"Fix: {name}").to_markdown())
        return "\n".join(parts)

    def to_json(self, indent: int | None = None) -> str:
        """The checks, the fixes (their rows and ``info``), the data used and ``meta`` as strict
        JSON (NaN is ``null``)."""
        fixes = {
            name: {"rows": _encode_rows(rep), "info": _encode_value(getattr(rep, "info", {}))}
            for name, rep in self.reports.items()
        }
        obj = {
            "format": "initlab.doctor/1",
            "checks": _encode_rows(self),
            "applied": self.applied,
            "recommended": self.recommended,
            "skipped": self.skipped,
            "failed": self.failed,
            "notes": self.notes,
            "fixes": fixes,
            "used": self.used.as_dict() if self.used is not None else None,
            "meta": _encode_value(self.meta),
        }
        return json.dumps(obj, indent=indent, allow_nan=False)


def _ill_text(row: Mapping[str, Any], verdict_key: str) -> str:
    value = row["before"] if verdict_key == "verdict_before" else row["value"]
    return f"{row['check']} ({row[verdict_key]}: {_fmt(value)})"


def _rows(before: list[_Check], after: list[_Check] | None) -> list[dict[str, Any]]:
    if after is None:
        return [
            {"check": c.check, "value": c.value, "reference": c.reference, "verdict": c.verdict,
             "why": c.why, "fix": c.fix}
            for c in before
        ]  # fmt: skip
    return [
        {"check": a.check, "value": a.value, "before": b.value, "after": a.value,
         "reference": a.reference, "verdict_before": b.verdict, "verdict": a.verdict,
         "why": a.why, "fix": a.fix}
        for b, a in zip(before, after, strict=True)
    ]  # fmt: skip


def _after_checks(
    after: _Measure, model: nn.Module, course: _Course, setup: _Setup
) -> list[_Check]:
    """The checks after the fixes; a spread that ``precondition_`` balanced through learning rates
    (the weights unchanged) points to the param groups instead of recommending it again."""
    checks = _checks(after, model, setup, [*course.applied, *course.unchanged])
    if "precondition" in course.applied:
        for c in checks:
            if "precondition" in c.fixes:
                c.fixes = tuple(f for f in c.fixes if f != "precondition")
                c.why += (
                    "; balanced by precondition_: train with report.param_groups(model, lr=...)"
                )
    return checks


def _param_groups_row(course: _Course) -> dict[str, Any] | None:
    rep = course.reports.get("precondition")
    if rep is None:
        return None
    before, after, kept = _all_layer_spreads(rep)
    return {
        "check": "gamma_spread_with_param_groups", "value": after,
        "before": before, "after": after, "reference": SPREAD_WARN,
        "verdict_before": _grade(before, SPREAD_WARN, SPREAD_BAD),
        "verdict": _grade(after, SPREAD_WARN, SPREAD_BAD),
        "why": "γ max/min over every weight layer when training with report.param_groups(model, "
        "lr=...) (the learning rates of precondition_'s multipliers; the weights are unchanged)"
        + (f"; {kept} layer(s) keep their γ (attention, tied, frozen: alpha = 1)" if kept else ""),
        "fix": "",
    }  # fmt: skip


def _all_layer_spreads(rep: Any) -> tuple[float, float, int]:
    """γ max/min before and after ``precondition_``'s multipliers over every layer of its report
    with a finite positive γ (the ones it balanced and the ones that keep ``alpha = 1``, as the
    ``gamma_spread`` check counts them), and how many keep theirs."""
    rows = [
        r
        for r in rep.to_rows()
        if all(math.isfinite(r[k]) and r[k] > 0 for k in ("gamma_before", "gamma_after"))
    ]
    if not rows:
        return math.nan, math.nan, 0

    def spread(key: str) -> float:
        values = [r[key] for r in rows]
        return max(values) / min(values)

    kept = sum(r["kind"] not in ("mlp", "conv") for r in rows)
    return spread("gamma_before"), spread("gamma_after"), kept


# ----------------------------------------------------------------------------- doctor


@takes_compiled
def doctor(
    model: nn.Module,
    data: Any,
    loss_fn: LossLike = None,
    *,
    fix: bool | str | Sequence[str] = False,
    max_batches: int = 4,
    generator: int | torch.Generator | None = None,
    forward: Forward | None = None,
) -> DoctorReport:
    """Check ``model`` at step zero on ``data``, recommend fixes, and (``fix``) apply them.

    Args:
        model: any ``nn.Module`` (Hugging Face models included: dict batches go to
            ``model(**batch)``); changed only with ``fix``.
        data: one batch or many (the rule: :mod:`initlab._core.data`); at most ``max_batches``.
        loss_fn: any form :func:`initlab.resolve_loss` reads; default: the model's own loss,
            else cross-entropy (integer targets) or MSE (float targets).
        fix: ``False`` (measure only; the model is left bit for bit as it was), ``True`` (apply
            the recommended fixes, re-checking before each), or names of :data:`FIXES` to apply.
        max_batches: batches taken from ``data``.
        generator: seed or generator for the fixes' draws (init, LSUV) and measurement passes.
        forward: ``forward(model, batch) -> output``, how the model runs on one batch: for the
            checks on its outputs (the logits' std, the number of classes) and the ``forward=``
            of the fixes ``lsuv_`` and ``scale_output_``. Default: for a ``loss_fn(model,
            batch)``, the model's first call inside it (so ``model(a, b)`` works as the loss
            calls it); else the default forward (``model(x)`` of ``(x, y)``, ``model(**batch)``).

    One process: under ``torch.distributed`` every rank raises a ``ValueError`` saying to run it
    before the process group (its choices follow one process's data).

    Returns:
        a :class:`DoctorReport` (see the module docstring for the checks and the fixes).
    """
    names = _fix_names(fix)
    if is_distributed():
        raise ValueError(
            "doctor runs in one process: its checks and the fixes it chooses follow one process's "
            "data, so ranks could choose different fixes (and their collectives would not match). "
            "Run it before torch.distributed.init_process_group, or on one process of its own, and "
            "start every rank from the model it leaves (save it, or broadcast rank 0's weights)"
        )
    batches = take_batches(data, max_batches, exact=False, what="doctor")
    loss = resolve_loss(loss_fn, what="doctor")
    setup = _Setup(batches, loss, as_generator(generator), fixes_forward(loss, forward))
    before = _measure(model, setup)
    checks = _checks(before, model, setup)
    meta = {
        "model": type(model).__name__, "loss": loss.name, "kind": before.kind or "other",
        "classes": before.classes or None,
        "ln_C": math.log(before.classes) if before.kind == "classification" else None,
        "fix": "recommended" if names is None else names,
    }  # fmt: skip
    common = {"used": data_use(batches), "recommended": _recommended(checks), "meta": meta}
    if names == []:
        return DoctorReport(_rows(checks, None), DOCTOR_COLUMNS, diagnosis=before.report, **common)
    course, after = _treat(model, setup, before, names)
    rows = _rows(checks, _after_checks(after, model, course, setup))
    extra = _param_groups_row(course)
    if extra is not None:
        rows.append(extra)
    return DoctorReport(
        rows, DOCTOR_FIX_COLUMNS, course=course, diagnosis=before.report,
        diagnosis_after=after.report, **common,
    )  # fmt: skip
