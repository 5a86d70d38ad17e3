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
                               ``dead_or_exploding_layers``, which recommends the fix). A model
                               with normalization or attention layers, outside GR scaling's
                               derivation, gets at most ``warn`` and no fix.
``nu_spread``                  the same for the weight-to-gradient ratio ``nu``.
``dead_or_exploding_layers``   layers with a linter finding ``vanishing_*``, ``exploding_*``,
                               ``dead_relu``, ``bias_dominates``, ``non_finite``,
                               ``identical_units`` (warn or bad; the last two fixed by ``init``)
                               or ``input_scale`` (the data's scale: no fix here, the logit and
                               spread fixes wait for it), whose gradient is 0
                               (the diagnosis's ``zero_gradient``, ``bad``: it vanished, or its
                               squares underflow in float32; fix: LSUV; at a float16 layer
                               ``warn`` and no fix: it may be float16's range, below 5.96e-8),
                               or whose trainable
                               parameters get no gradient (the diagnosis's ``no_gradient``: not
                               called on the data, or run under ``torch.no_grad()``; ``warn``,
                               and no fix here changes it); reference 0.
=============================  ==================================================================

Verdicts are ``"ok"``, ``"warn"``, ``"bad"``, or ``"n/a"`` where a check has no reference (a loss
that is neither cross-entropy nor MSE, a ``gamma`` measured on fewer than two weights, outputs
that could not be read: ``why`` says which).

The outputs are read with ``forward`` (``forward(model, batch)``), by default the model's call
inside a ``loss_fn(model, batch)`` (a model that takes two tensors works as the loss calls it),
else the default forward; the fixes ``lsuv_`` and ``scale_output_`` get the same ``forward=``, and
so does the measurement's loss where it is a loss on the outputs (a criterion on ``forward``'s
output and the target ``batch[1]``).

Fixes, in the order they are applied (:data:`FIXES`), each through the public method with the
``generator``:

1. ``"init"``: ``init_model(model, "geometric")`` (the output head of a language model is drawn
   small, ties kept), when a layer or the loss is non-finite, a recurrent layer's signal or
   gradient vanishes or explodes (``lsuv_`` skips recurrent layers; the init redraws their gate
   blocks), or the loss or logits are too large
   and the init shrinks them (measured, then put back: the logits' std after it at most half of
   now; a classifier's head is drawn as it is, so only ``"output_scale"`` is recommended there).
   An init that changes nothing is not listed as applied (``skipped`` says so);
2. ``"lsuv"``: ``lsuv_(model, data)``, when a signal or gradient vanishes or explodes (at a
   layer that is not recurrent), or ReLU units are dead; after ``"init"``,
   ``lsuv_(model, data, orthogonal=False)``: the init's weights are rescaled, not replaced by
   LSUV's orthogonal start;
3. ``"output_scale"``: ``scale_output_(model, data, target, how="hook")``, when the initial
   loss or the logits' std is too high (``bad``; a ``warn`` on the model as given is reported,
   not treated: shrinking the outputs also slows their learning), or after ``"lsuv"`` brought a
   vanished signal back to logits too large (the two are then judged, and undone, together).
   ``target`` (:func:`~initlab.diagnostics._doctor_checks.output_target`) is half the ``logit_std``
   reference, ``sqrt(0.2 ln C) / 2``, not the paper's 0.05: the hook multiplies every gradient
   by its scale ``s``, so SGD at the same learning rate changes the outputs ``s^2`` as fast (a
   note says so, with ``s``). The hook goes on the output head when the model computes
   its own loss from it (``get_output_embeddings()``, else the last ``nn.Linear`` with ``C``
   outputs), else on the model; it persists (``report.reports["output_scale"].info["handle"]``
   removes it) and is not in the ``state_dict``;
4. ``"precondition"``: ``precondition_(model, data, loss_fn, how="lr")``, when the ``gamma``
   spread is large in a model without normalization or attention layers: the model is
   unchanged, the multipliers become learning rates (:meth:`DoctorReport.param_groups`; a note
   gives their range and what they do at an unchanged base rate).

``fix=True`` applies the recommended fixes, re-measures after each one that changes the model,
and skips a later one that is no longer needed (LSUV after an init that already fixed the
signal); a fix that leaves the checks worse than before it (their verdicts add up to more: ok 0,
warn 1, bad 2; or to as much with a check that was ``ok`` now ``warn`` or ``bad``: a trade of one
problem for another) is undone and reported in ``undone`` (LSUV on a model whose zero gradients
it cannot give a gradient, raising the initial loss). ``fix=["init", "output_scale"]`` applies
exactly those, in the order above, and keeps them (a fix that made the checks worse gets a note).
A fix that raises leaves the model as it was before that fix (the methods'
``restore_on_failure``), is reported in ``failed`` and the others go on; any other error (a
re-measurement's forward) puts the model back as it was before ``doctor``, hooks included.
Where ``"init"`` or ``"lsuv"`` is to be applied and a trainable tensor is a distinct Parameter
over another's memory (``nn.Parameter(a.weight.data.t())``, not a tie), ``doctor`` raises before
any fix, naming them (:func:`~initlab._core.modules.refuse_shared_writes`).
``fix=False`` (default) never changes the model: parameters, buffers, modes, gradients, hooks and
the RNGs are as before.
"""

from __future__ import annotations

import functools
import json
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from initlab._core.backward import with_grad
from initlab._core.compiled import takes_compiled
from initlab._core.data import DataUse, data_use, take_batches
from initlab._core.distributed import is_distributed
from initlab._core.forward_loss import with_forward
from initlab._core.loss import LossLike, resolve_loss
from initlab._core.modules import refuse_shared_writes
from initlab._core.parametrized import check_writable, reading_scope, writing_scope
from initlab._core.rng import as_generator
from initlab._core.rows import Rows, _fmt
from initlab._core.state import copies_held, model_kept, restore_on_failure
from initlab.diagnostics._doctor_checks import (
    _ILL,
    _RANK,
    CHECKS,
    FIXES,
    OUTPUT_TARGET,
    SPREAD_BAD,
    SPREAD_WARN,
    _Check,
    _checks,
    _grade,
    _Measure,
    _measure,
    _outputs_only,
    _recommended,
    _Setup,
    _total,
    _worse,
    output_target,
)
from initlab.diagnostics._outputs import (
    Forward,
    fixes_forward,
    unchanged,
)
from initlab.diagnostics.diagnose import FRESH_EVAL_NORMS
from initlab.diagnostics.report import Report, _encode_rows, _encode_value
from initlab.init.model import init_model
from initlab.measure.probe.checks import refuse_parametrized
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

_ALIASES = {"scale_output": "output_scale", "init_model": "init", "preconditioning": "precondition"}


# ----------------------------------------------------------------------------- fixing


def _refusal(model: nn.Module) -> str | None:
    """The message with which the fixes (the methods that write weights) refuse ``model``'s
    parametrized tensors, with the way back for each; ``None`` where they do not."""
    try:
        with writing_scope():
            refuse_parametrized(model)
    except ValueError as err:
        return str(err)
    return None


def _fix_names(fix: bool | str | Sequence[str] | None) -> list[str] | None:
    """``None`` for "the recommended ones", else the names asked for, in :data:`FIXES` order."""
    if fix is True:
        return None
    if fix is False or fix is None:
        return []
    names = [fix] if isinstance(fix, str) else list(fix)
    clean: dict[str, str] = {}
    for n in names:
        key = _ALIASES.get(str(n).rstrip("_"), str(n).rstrip("_"))
        if key not in FIXES:
            raise ValueError(f"doctor: unknown fix {n!r}; valid: {', '.join(FIXES)} (or True)")
        if key in clean:  # a repeat is likely a typo for another fix: say so
            same = "" if clean[key] == n else f" ({clean[key]!r} and {n!r} are both {key!r})"
            raise ValueError(
                f"doctor: fix {key!r} given twice{same}; name each fix once, of {', '.join(FIXES)}"
            )
        clean[key] = n
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
        report = scale_output_(
            model, batches, target=output_target(m), how="hook", module=module,
            generator=generator, forward=forward,
        )  # fmt: skip
        s = float(report.info["scale"])
        warnings.warn(  # a note in the report: training at the same learning rate is slower
            f"the outputs are multiplied by {s:.3g}, and so is every gradient: at the same "
            f"learning rate SGD changes the outputs {s * s:.2g}x as fast (Adam {s:.2g}x); "
            f"retune the learning rate (SGD's up to {1 / (s * s):.3g}x)",
            UserWarning,
            stacklevel=2,
        )
        return report
    report = precondition_(model, batches, setup.loss, how="lr", generator=generator)
    _say_rates(report)
    return report


def _say_rates(report: Rows) -> None:
    """A note (a warning the report keeps) on the learning rates precondition's param groups
    give: the range of the per-layer factors around the base rate, what they do at an unchanged
    base rate, and that step zero cannot tell whether they train better than one rate."""
    sgd = [float(r["lr_scale_sgd"]) for r in report if math.isfinite(r["lr_scale_sgd"])]
    adam = [float(r["lr_scale_adam"]) for r in report if math.isfinite(r["lr_scale_adam"])]
    if not sgd or min(sgd) >= 1.0:
        return
    low = min(sgd)
    warnings.warn(
        f"report.param_groups(model, lr=...) multiplies each weight layer's learning rate by "
        f"x{low:.3g} to x{max(sgd):.3g} for SGD (Adam: x{min(adam):.3g} to x{max(adam):.3g}), the "
        f"layer of median γ at x1: at your base rate the slowest layer learns {1 / low:.3g}x "
        "slower than before; tune the base rate again, and compare with one rate for all layers "
        "(step zero does not tell which trains better)",
        UserWarning,
        stacklevel=2,
    )


@dataclass
class _Course:
    """The fixes of one :func:`doctor` call: what was applied, skipped, failed."""

    applied: list[str] = field(default_factory=list)
    reports: dict[str, Rows] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    undone: dict[str, str] = field(default_factory=dict)
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
    """Apply the fixes (``names``, or the recommended ones re-checked before each); re-measure
    after each fix that changes the model, and undo a recommended one that left the checks worse
    (:func:`_worse`); a fix asked for by name stays, with a note."""
    auto = names is None
    todo = _recommended(_checks(before, model, setup)) if auto else list(names or [])
    _refuse_shared_memory(model, todo)
    course, current = _Course(), before
    for name in todo:
        if name in course.applied:  # applied already, after a fix that needed it
            continue
        done = [*course.applied, *course.unchanged]
        now = _checks(current, model, setup, done)
        if auto and course.applied and name not in _recommended(now):
            course.skipped[name] = f"no longer needed after {', '.join(course.applied)}"
            continue
        changes = name != "precondition"  # how="lr" leaves the model as it was
        # the model before this fix, to undo it: shared with doctor's own copy (and the fix's)
        # while the weights are unchanged (copies_held)
        with copies_held(model.state_dict().values() if changes else []) as kept:
            current = _fix(name, model, setup, course, auto, (current, now, done, kept))
    return course, current


def _refuse_shared_memory(model: nn.Module, todo: Sequence[str]) -> None:
    """Raise before any fix where the fixes to apply write weights (``"init"``, ``"lsuv"``: every
    trainable tensor, as far as doctor can tell before running them) and a trainable one is a
    distinct Parameter over another's memory (:func:`~initlab._core.modules.refuse_shared_writes`):
    each fix would write the two as tensors of their own (``init_model`` and ``lsuv_`` refuse
    such a model). ``"output_scale"`` (a hook) and ``"precondition"`` (rates) write no weight."""
    effects = {
        "init": "init_model would draw one over the other",
        "lsuv": "lsuv_ would multiply that memory by both layers' factors",
    }
    writers = [f for f in todo if f in effects]
    if not writers:
        return
    refuse_shared_writes(
        "doctor",
        model,
        [p for p in model.parameters() if p.requires_grad],
        f"the fix(es) {', '.join(map(repr, writers))} would write each as a tensor of its own "
        f"({'; '.join(effects[f] for f in writers)})",
    )


def _fix(
    name: str,
    model: nn.Module,
    setup: _Setup,
    course: _Course,
    auto: bool,
    state: tuple[_Measure, list[_Check], list[str], list[torch.Tensor]],
) -> _Measure:
    """Apply the fix ``name`` and re-measure; with ``auto``, undo it (back to ``kept``, the
    model's tensors before it) when it left the checks worse. ``state`` is the measurement and
    checks before the fix, the fixes done and ``kept``. Returns the measurement the next fix
    starts from."""
    current, now, done, kept = state
    call = functools.partial(_apply, name, model, setup, current, done)
    if not course.run(name, call) or name == "precondition":  # precondition: rates, not weights
        return current
    if name == "init" and unchanged(model, kept):
        course.applied.remove(name)  # never listed as applied: say it changed nothing
        course.unchanged.append(name)
        course.reports.pop(name, None)
        course.skipped[name] = (
            "changed nothing: the model already has init_model(model, 'geometric') with "
            "this generator"
        )
        return current
    after = _measure(model, setup)
    checks = _checks(after, model, setup, [*done, name])
    worse = _worse(now, checks)
    outputs = worse and _outputs_only(now, checks) and "output_scale" not in (*done, name)
    both = (
        _with_output_scale(name, model, setup, after, done, now, course)
        if auto and outputs
        else None
    )
    if both is not None:
        # the fix brought the signal back to the logits (LSUV on a vanished one); with their
        # scale set after it, the two together improved the checks: both stay
        after, worse = both, ""
    elif auto and outputs and "output_scale" in course.applied:
        _undo("output_scale", model, kept, course)
        course.undone["output_scale"] = (
            f"applied after {name} to set the logits' scale, the two improved no check "
            "together: undone with it"
        )
    if auto and worse:
        _undo(name, model, kept, course)
        course.undone[name] = f"it made the checks worse ({worse}); the model is as before it"
        return current
    if worse:
        course.notes.setdefault(name, []).append(f"it made the checks worse: {worse}")
    return after


def _with_output_scale(
    name: str,
    model: nn.Module,
    setup: _Setup,
    after: _Measure,
    done: list[str],
    now: list[_Check],
    course: _Course,
) -> _Measure | None:
    """Apply ``output_scale`` after the fix ``name`` (it left only the output checks worse);
    the measurement after both when together they leave the checks better than before
    ``name``, else ``None``."""
    then = functools.partial(_apply, "output_scale", model, setup, after, [*done, name])
    if not course.run("output_scale", then):
        return None
    both = _measure(model, setup)
    better = _total(_checks(both, model, setup, [*done, name, "output_scale"])) < _total(now)
    return both if better else None


def _undo(name: str, model: nn.Module, kept: list[torch.Tensor], course: _Course) -> None:
    """Put the model back as it was before the fix ``name``: its tensors copied back in place
    (ties and references kept), ``scale_output_``'s hook removed."""
    report = course.reports.pop(name)
    handle = getattr(report, "info", {}).get("handle")
    if handle is not None:
        handle.remove()
    with torch.no_grad():
        for t, k in zip(model.state_dict().values(), kept, strict=True):
            t.copy_(k)
    course.applied.remove(name)


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
        untreated: ``{check: why}`` for the checks the first measurement finds ill-conditioned
            but recommends no fix for: why not, and what to do instead.
        skipped: ``{fix: why}`` for recommended fixes found unnecessary after earlier ones.
        failed: ``{fix: error}`` for fixes that raised (the model was restored to before them).
        undone: ``{fix: why}`` for recommended fixes that ran and left the checks worse (the
            model was put back as it was before them).
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
        untreated: Mapping[str, str] | None = None,
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
        self.undone: dict[str, str] = dict(course.undone)
        self.notes: dict[str, list[str]] = dict(course.notes)
        self.recommended: list[str] = list(recommended)
        self.untreated: dict[str, str] = dict(untreated or {})
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
        # the layers no fix here mends (the input's scale, a layer without a gradient): in full
        for r in ill:  # as it stands (after the fixes, where they ran)
            if r["check"] == "dead_or_exploding_layers" and r["verdict"] in _ILL and not r["fix"]:
                lines.append(f"  {r['check']}, no fix here: {r['why']}")
        lines.extend(self._untreated_lines(ill))
        lines.append(f"  recommended: {', '.join(self.recommended) or 'nothing'}")
        notes = self.diagnosis.meta.get("notes", ()) if self.diagnosis is not None else ()
        lines.extend(f"  note: {n}" for n in notes if n.startswith(FRESH_EVAL_NORMS))
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
            row = next((r for r in self if r["check"] == "gamma_spread_with_param_groups"), None)
            if row is not None and row["verdict"] in ("warn", "bad"):
                lines.append(f"    {row['verdict']}: {row['why']}")
        return "\n".join(lines)

    def _untreated_lines(self, ill: list[dict[str, Any]]) -> list[str]:
        """One line per reason the ill-conditioned checks get no fix (checks of one reason
        together), for those still ill as they stand."""
        by_reason: dict[str, list[str]] = {}
        for r in ill:
            why = self.untreated.get(r["check"])
            if why and r["verdict"] in _ILL:
                by_reason.setdefault(why, []).append(r["check"])
        said = {why: " and ".join([", ".join(c[:-1]), c[-1]] if c[1:] else c)
                for why, c in by_reason.items()}  # fmt: skip
        return [f"  {checks}, no fix here: {why}" for why, checks in said.items()]

    def _fix_lines(self, fixing: bool, how_to_fix: str) -> list[str]:
        if not fixing and self.meta.get("refused"):
            return [
                "  not changed (fix=False); the fixes (and doctor(model, data, fix=True)) refuse "
                f"this model: {self.meta['refused']}"
            ]
        if not fixing:  # with nothing recommended, fix=True would change nothing
            return [f"  not changed (fix=False){'; ' + how_to_fix if self.recommended else ''}"]
        lines = [f"  applied: {', '.join(self.applied) or 'nothing'}"]
        for name, why in self.skipped.items():
            lines.append(f"  skipped {name}: {why}")
        for name, err in self.failed.items():
            lines.append(f"  failed {name} (model restored to before it): {err}")
        for name, why in self.undone.items():
            lines.append(f"  undone {name}: {why}")
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
            "undone": self.undone,
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
    verdict = _grade(after, SPREAD_WARN, SPREAD_BAD)
    fast, unbalanced = _fast_bias(rep)
    if math.isfinite(fast) and _RANK[_grade(fast, SPREAD_WARN, SPREAD_BAD)] > _RANK[verdict]:
        verdict = _grade(fast, SPREAD_WARN, SPREAD_BAD)
    else:
        unbalanced = ""
    return {
        "check": "gamma_spread_with_param_groups", "value": after,
        "before": before, "after": after, "reference": SPREAD_WARN,
        "verdict_before": _grade(before, SPREAD_WARN, SPREAD_BAD), "verdict": verdict,
        "why": "γ max/min over every weight layer when training with report.param_groups(model, "
        "lr=...) (the learning rates of precondition_'s multipliers; the weights are unchanged)"
        + (f"; {kept} layer(s) keep their γ (attention, tied, frozen: alpha = 1)" if kept else "")
        + unbalanced,
        "fix": "",
    }  # fmt: skip


def _fast_bias(rep: Any) -> tuple[float, str]:
    """How much faster than the balanced weights the fastest bias learns with
    ``precondition_``'s param groups (its ``gamma_b`` over the median weight ``gamma``: biases
    keep the base learning rate), and a sentence that says so. A bias usually learns far slower
    than the weights (``gamma_b`` 10-1000x below); one far faster diverges first."""
    rows = rep.to_rows()
    weights = sorted(r["gamma_after"] for r in rows
                     if math.isfinite(r["gamma_after"]) and r["gamma_after"] > 0)  # fmt: skip
    biases = [(r["gamma_b_after"], r["layer"]) for r in rows
              if math.isfinite(r["gamma_b_after"]) and r["gamma_b_after"] > 0]  # fmt: skip
    if not weights or not biases:
        return math.nan, ""
    top, layer = max(biases)
    ratio = top / weights[len(weights) // 2]
    return ratio, (
        f"; but the biases keep the base learning rate, and {layer}'s learns {ratio:.3g}x as fast "
        "as the balanced weights (γ_b over their median γ): at a base rate near the weights' "
        "limit it is the first to diverge (if training diverges, give that bias a smaller rate, "
        "or train with lsuv instead)"
    )


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
@with_grad
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
            the recommended fixes, re-checking before each), or the names of those to apply,
            of ``"init"``, ``"lsuv"``, ``"output_scale"``, ``"precondition"`` (in that order,
            :data:`~initlab.diagnostics.doctor.FIXES`).
        max_batches: batches taken from ``data``.
        generator: seed or generator for the fixes' draws (init, LSUV) and measurement passes.
            Torch's global RNG is left as it was (reading a ``DataLoader`` draws from it; it is
            put back), except with fixes and ``generator=None``: the fixes then draw from it, as
            ``init_model`` does, after the data has advanced it.
        forward: ``forward(model, batch) -> output``, how the model runs on one batch: for the
            checks on its outputs (the logits' std, the number of classes), the ``forward=``
            of the fixes ``lsuv_`` and ``scale_output_``, and, with a loss on the outputs (a
            criterion, a named loss, the default loss on ``(x, y, ...)`` batches), the
            measurement's loss ``loss(model, batch) = criterion(forward(model, batch), y)``
            with ``y = batch[1]`` (a ``forward`` that passes ``batch[1]`` to the model, as it
            is or converted, ``.float()``, ``.to(device)``, raises: keep the target there,
            ``model(batch[0], *batch[2:])``). A ``loss_fn(model,
            batch)`` or the model's own loss runs the model itself. Default: for a
            ``loss_fn(model, batch)``, the model's first call inside it (so ``model(a, b)``
            works as the loss calls it); else the default forward (``model(x)`` of ``(x, y)``,
            ``model(**batch)``).

    One process: under ``torch.distributed`` every rank raises a ``ValueError`` saying to run it
    before the process group (its choices follow one process's data).

    Cost: without fixes, one :func:`~initlab.diagnose` pass (without spectra) and one forward of
    the outputs; each fix adds its own passes and a re-measurement (LSUV's orthogonal pre-init
    is a QR per layer). Memory: the weights before doctor, and while a measurement runs a copy
    of the weights after the last fix (nested blocks share unchanged copies,
    :mod:`initlab._core.state`). A 12-layer width-1024 MLP measured 27-42x a forward+backward
    with ``fix=True``.

    Returns:
        a :class:`DoctorReport`: one row per check (``initial_loss``, ``logit_std``,
        ``gamma_spread``, ``nu_spread``, ``dead_or_exploding_layers``), what each fix does and
        when it is recommended: ``help(initlab.diagnostics.doctor)``.
    """
    names = _fix_names(fix)
    if is_distributed():
        raise ValueError(
            "doctor runs in one process: its checks and the fixes it chooses follow one process's "
            "data, so ranks could choose different fixes (and their collectives would not match). "
            "Run it before torch.distributed.init_process_group, or on one process of its own, and "
            "start every rank from the model it leaves (save it, or broadcast rank 0's weights)"
        )
    if names != []:  # the fixes write the model: refused up front if they cannot
        check_writable(model, "doctor")
    # without fixes doctor only reads (parametrized layers measured); with them it writes
    with reading_scope() if names == [] else writing_scope():
        # the global RNG put back after reading, unless a fix draws from it (generator=None)
        keep = names == [] or generator is not None
        batches = take_batches(data, max_batches, exact=False, what="doctor", keep_rng=keep)
        loss = resolve_loss(loss_fn, what="doctor")
        if forward is not None:  # the measurement runs the model as the checks and fixes do
            loss = with_forward(loss, forward, batches, "doctor")
        setup = _Setup(batches, loss, as_generator(generator), fixes_forward(loss, forward))
        before = _measure(model, setup)
        checks = _checks(before, model, setup)
        meta = {
            "model": type(model).__name__, "loss": loss.name, "kind": before.kind or "other",
            "classes": before.classes or None,
            "ln_C": math.log(before.classes) if before.kind == "classification" else None,
            "fix": "recommended" if names is None else names,
        }  # fmt: skip
        untreated = {c.check: c.untreated for c in checks if c.verdict in _ILL and not c.fixes}
        common = {"used": data_use(batches), "recommended": _recommended(checks), "meta": meta,
                  "untreated": {k: v for k, v in untreated.items() if v}}  # fmt: skip
        if names == []:
            meta["refused"] = _refusal(model)
            rows = _rows(checks, None)
            for r in rows if meta["refused"] else ():  # a call that would fail is no advice
                if r["fix"]:
                    r["fix"] = f"once the parametrizations are removed (see summary): {r['fix']}"
            return DoctorReport(rows, DOCTOR_COLUMNS, diagnosis=before.report, **common)
        # an error after a fix (a later fix's or a re-measurement's pass) puts the model back
        # as it was before doctor, its output-scale hook removed; success keeps the fixes
        with model_kept(model, params="failure", buffers="failure", hooks="failure"):
            course, after = _treat(model, setup, before, names)
        rows = _rows(checks, _after_checks(after, model, course, setup))
        extra = _param_groups_row(course)
        if extra is not None:
            rows.append(extra)
        return DoctorReport(
            rows, DOCTOR_FIX_COLUMNS, course=course, diagnosis=before.report,
            diagnosis_after=after.report, **common,
        )  # fmt: skip
