"""The diagnosis tables of :func:`~initlab.diagnostics.diagnose.diagnose`, from its measurements.

:func:`assemble` turns the probe's tables, γ (GR scaling), the gradient, spectra, activation and
curvature tables and the linter's findings into the long rows (:data:`DIAGNOSTIC_COLUMNS`), the
per-layer table with verdicts (:data:`LAYER_COLUMNS`) and the imbalance summary. The quantities
and the verdict rules are documented in :mod:`initlab.diagnostics.report`: a weight's γ relative
to the median over weights decides its verdict (ν relative to its median where γ is missing),
and so do the linter's ``warn``/``bad`` findings on the layer.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from initlab._core.parametrized import layer_tensor
from initlab._core.rows import Rows, shown
from initlab._core.underflow import float16_layer, float16_zero
from initlab.diagnostics.linter import _positive, signal_ratios
from initlab.diagnostics.report import (
    DIAGNOSTIC_COLUMNS,
    LAYER_COLUMNS,
    imbalance_summary,
    ratio_reason,
    ratio_verdict,
    worst,
)
from initlab.init._norm_like import norm_identity

__all__ = ["assemble"]

_NAN = math.nan

#: Probe quantities copied into the long rows, per module.
_MOMENTS = ("E_x2", "E_y2", "E_dy2", "E_dx2", "gain_fwd", "gain_bwd", "cum_gain_fwd",
            "cum_gain_bwd", "nonfinite")  # fmt: skip


# ----------------------------------------------------------------------------- helpers


def _weight_names(model: nn.Module) -> set[tuple[str, str]]:
    from initlab.init.registry import default_registry

    reg = default_registry()
    out = set()
    for name, m in model.named_modules():
        specs = reg.specs(m, name)
        for s in specs or ():
            if s.role == "weight":
                out.add((name, s.name))
    return out


def _definition_index(model: nn.Module) -> dict[str, int]:
    return {name: i for i, (name, _) in enumerate(model.named_modules())}


def _sort_key(layer: str, index: Mapping[str, int]) -> tuple[float, str]:
    base, _, call = layer.partition("@")
    if base in index:
        return (index[base] + (int(call) * 1e-3 if call.isdigit() else 0.0), layer)
    mod, sep, _node = layer.partition(":")
    mod = "" if mod == "<root>" else mod
    if sep and mod in index:
        return (index[mod] + 0.5, layer)
    return (math.inf, layer)


def _short_reason(f: Mapping[str, Any]) -> str:
    rule, v = f["rule"], f["value"]
    fin = isinstance(v, float) and math.isfinite(v)
    if rule == "max_pool":
        return "max pooling breaks the scaling (Table 1)"
    if rule == "resampling":
        return f"{f['module_type']} changes p² without compensation (Section 7)"
    if rule == "sigmoid":
        return "sigmoid breaks the scaling (Table 1)" + (f"; input std {v:.2g}" if fin else "")
    if rule == "tanh":
        return "tanh outside its linear regime" + (f" (input std {v:.2g})" if fin else "")
    if rule == "skip_connection":
        return "skip connection: layers inside are balanced only against each other (Table 1)"
    if rule == "mixed_kernel_sizes":
        return f"kernel size unlike the other convolutions (k² factor {v:.3g}× in γ)"
    if rule == "dead_relu":
        return f"{v:.0%} of the ReLU units are dead"
    return str(f["message"])


def _median_pos(values: Iterable[float]) -> float:
    vals = sorted(v for v in values if math.isfinite(v) and v > 0)
    if len(vals) < 2:
        return _NAN
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


def _split_param(name: str, named: Mapping[str, nn.Module]) -> tuple[str, str]:
    """``"layer1.0.conv1.weight"`` -> ``("layer1.0.conv1", "weight")`` when that is a parameter."""
    layer, sep, param = name.rpartition(".")
    if sep and layer in named and param in dict(named[layer].named_parameters(recurse=False)):
        return layer, param
    if not sep and "" in named and name in dict(named[""].named_parameters(recurse=False)):
        return "", name
    return name, ""


def _owner(layer: str, param: str, named: Mapping[str, nn.Module]) -> tuple[str, str]:
    """A trainable tensor of a parametrization (layer ``"0.parametrizations.weight"``, param
    ``"original0"``) as a tensor of the layer it parametrizes (``"0"``,
    ``"parametrizations.weight.original0"``); any other ``(layer, param)`` as it is."""
    owner, sep, rest = f".{layer}".rpartition(".parametrizations.")
    owner = owner[1:]
    if sep and owner in named and parametrize.is_parametrized(named[owner]):
        return owner, f"parametrizations.{rest}.{param}"
    return layer, param


# ----------------------------------------------------------------------------- long rows


class _LongRows:
    """The long rows being built, and each layer's ``module_type`` and ``order``."""

    def __init__(self, model: nn.Module) -> None:
        self.named = dict(model.named_modules())
        self.index = _definition_index(model)
        self.weights = _weight_names(model)
        self.info: dict[str, dict[str, Any]] = {}  # layer -> module_type, order
        self.rows: list[dict[str, Any]] = []

    def meta(self, layer: str, module_type: str | None = None, order: Any = None) -> dict[str, Any]:
        d = self.info.setdefault(layer, {"module_type": module_type, "order": order})
        if d["module_type"] is None:
            base = layer.partition("@")[0]
            named = self.named
            d["module_type"] = module_type or (type(named[base]).__name__ if base in named else "")
        if d["order"] is None and order is not None:
            d["order"] = order
        return d

    def add(
        self,
        layer: str,
        param: str,
        quantity: str,
        value: Any,
        *,
        stderr: float = _NAN,
        verdict: str = "",
        note: str = "",
        module_type: str | None = None,
    ) -> None:
        d = self.meta(layer, module_type)
        v = float(value) if isinstance(value, (int, float)) and value is not None else _NAN
        self.rows.append(
            {
                "layer": layer,
                "param": param,
                "module_type": d["module_type"],
                "order": d["order"],
                "quantity": quantity,
                "value": v,
                "stderr": float(stderr) if isinstance(stderr, (int, float)) else _NAN,
                "verdict": verdict,
                "note": note,
            }
        )


@dataclass
class _Ratios:
    """Per weight layer: γ, γ and ν relative to their medians, the ν used and its weight's name."""

    gammas: dict[str, float] = field(default_factory=dict)
    gamma_rel: dict[str, float] = field(default_factory=dict)
    nus: dict[str, tuple[float, str]] = field(default_factory=dict)  # layer -> (nu used, which)
    nu_rel: dict[str, float] = field(default_factory=dict)
    wnames: dict[str, str] = field(default_factory=dict)
    zero: dict[str, str] = field(default_factory=dict)  # layer -> why its gradient is 0
    float16: set[str] = field(default_factory=set)  # of zero: may be float16 underflow (warn)
    gated: dict[str, str] = field(default_factory=dict)  # layer -> the zero gate after it


def _add_moments(out: _LongRows, probe_table: Rows) -> None:
    """Per module: second moments, gains, the end-to-end forward signal."""
    ratios = signal_ratios(probe_table)
    for r in probe_table:
        out.meta(r["layer"], r["module_type"], r["order"])
        for q in _MOMENTS:
            out.add(r["layer"], "", q, r[q])
        ratio, ref = ratios.get(r["layer"], (_NAN, ""))
        note = f"relative to the output of {ref} (the normalization before it)" if ref else ""
        out.add(r["layer"], "", "signal_fwd", ratio, note=note)


def _add_params(
    out: _LongRows, param_table: Rows, tables: Mapping[str, Rows], rat: _Ratios
) -> None:
    """Per parameter: ``E[W^2]``, ``E[dW^2]``, ν (per-example and minibatch)."""
    grads = {(r["layer"], r["param"]): r for r in tables.get("gradients", ())}
    for layer, param in sorted(out.weights):
        rat.wnames.setdefault(layer, param)
    for r in param_table:
        layer, param = r["layer"], r["param"]
        note = r["note"]
        out.add(layer, param, "E_W2", r["E_W2"])
        out.add(layer, param, "E_dW2", r["E_dW2"])
        out.add(layer, param, "E_dW2_example", r["E_dW2_example"], note=note)
        nu = r["ratio"]
        nu_mb = r["E_dW2"] / r["E_W2"] if r["E_W2"] else _NAN
        g = grads.get((layer, param))
        se = g["E_dW2_stderr"] / r["E_W2"] if g is not None and r["E_W2"] else _NAN
        out.add(layer, param, "nu", nu, note=note)
        out.add(layer, param, "nu_minibatch", nu_mb, stderr=se)
        if rat.wnames.get(layer) == param and layer not in rat.nus:
            if math.isfinite(nu) and nu > 0:
                rat.nus[layer] = (nu, "per-example")
            elif math.isfinite(nu_mb) and nu_mb > 0:
                rat.nus[layer] = (nu_mb, "minibatch")
            elif nu == 0.0 or nu_mb == 0.0:  # a zero gradient: infinitely slower, not unknown
                rat.nus[layer] = (0.0, "per-example" if nu == 0.0 else "minibatch")


def _add_gamma(out: _LongRows, gr: Rows | None, rat: _Ratios) -> None:
    """γ of weights and biases; each weight's γ relative to the median, with its verdict."""
    frozen: dict[str, float] = {}  # not trained: shown, not judged (gr_scaling's median too)
    for r in gr or ():
        layer = r["layer"]
        out.meta(layer, r.get("module_type"))
        gw, gb = r.get("gamma_w", _NAN), r.get("gamma_b", _NAN)
        if gw is not None and math.isfinite(gw):
            (rat.gammas if r.get("trainable", True) else frozen)[layer] = gw
        if gb is not None:
            out.add(layer, "bias", "gamma", gb)
        rel = r.get("gamma_rel_median")
        if rel is not None and math.isfinite(rel):
            rat.gamma_rel[layer] = rel
    if rat.gammas and len(rat.gamma_rel) < len(rat.gammas):
        med = _median_pos(rat.gammas.values())
        rat.gamma_rel = {k: v / med for k, v in rat.gammas.items()} if math.isfinite(med) else {}
    for layer, gw in rat.gammas.items():
        rel = rat.gamma_rel.get(layer, _NAN)
        v = ratio_verdict(rel)
        note = ratio_reason("γ", rel) if v in ("warn", "bad") else ""
        if gw == 0.0 and layer in rat.gated:
            v, note = "ok", rat.gated[layer]
        elif gw == 0.0:
            v = "warn" if layer in rat.float16 else "bad"
            note = rat.zero.get(layer, "γ = 0: no gradient reaches this layer")
        out.add(layer, "weight", "gamma", gw, verdict=v, note=note)
        out.add(layer, "weight", "gamma_rel_median", rel, verdict=v, note=note)
    for layer, gw in frozen.items():
        note = "frozen (requires_grad=False): not trained, not judged"
        out.add(layer, "weight", "gamma", gw, verdict=ratio_verdict(_NAN), note=note)
        out.add(layer, "weight", "gamma_rel_median", _NAN, verdict=ratio_verdict(_NAN), note=note)


def _add_nu_rel(out: _LongRows, rat: _Ratios) -> None:
    """Each weight's ν relative to the median, with its verdict."""
    nus = rat.nus
    nu_med = _median_pos(v for v, _ in nus.values())
    rat.nu_rel = {k: v / nu_med for k, (v, _) in nus.items()} if math.isfinite(nu_med) else {}
    for layer, rel in rat.nu_rel.items():
        v = ratio_verdict(rel)
        note = f"{nus[layer][1]} ν" + (
            f"; {ratio_reason('ν', rel)}" if v in ("warn", "bad") else ""
        )
        if nus[layer][0] == 0.0 and layer in rat.float16:
            v, note = "warn", rat.zero.get(layer, float16_zero(f"{nus[layer][1]} ν = 0"))
        elif nus[layer][0] == 0.0:
            v, note = "bad", f"{nus[layer][1]} ν = 0: the weight's gradient is 0"
        out.add(layer, rat.wnames[layer], "nu_rel_median", rel, verdict=v, note=note)


def _add_measurements(out: _LongRows, tables: Mapping[str, Rows]) -> None:
    """Gradients (GradInit), spectra and activations, as long rows."""
    for r in tables.get("gradients", ()):
        layer, param = _owner(r["layer"], r["param"], out.named)
        for q in ("W_norm", "W_abs_mean", "grad_norm"):
            out.add(layer, param, q, r[q])
        one = r["batches"] < 2  # a spread over minibatches needs two of them
        note = f"needs at least 2 batches (got {r['batches']})" if one else ""
        out.add(layer, param, "grad_std", r["grad_std"], note=note)
    for r in tables.get("spectra", ()):
        if r["param"]:
            out.add(r["layer"], r["param"], "sv_max", r["sv_max"], note=r["note"])
            out.add(r["layer"], r["param"], "sv_mean", r["sv_mean"])
        out.add(r["layer"], r["param"], "op_norm", r["op_norm"], note=r["op_method"])
    for r in tables.get("activations", ()):
        layer = r["layer"]
        out.meta(layer, r["module_type"])
        if r["kind"] == "relu":
            out.add(layer, "", "dead_frac", r["dead_frac"])
            out.add(layer, "", "dead_channel_frac", r["dead_channel_frac"])
        out.add(layer, "", "act_input_std", r["input_std"])


def _add_curvature(out: _LongRows, tables: Mapping[str, Rows]) -> None:
    """Diagonal Hessian/GGN blocks and theory-vs-actual ratios, as long rows."""
    for r in tables.get("curvature", ()):
        if r.get("block_row") == r.get("block_col"):
            layer, param = _split_param(str(r["block_row"]), out.named)
            out.add(layer, param, "curv_block", r.get("value"), stderr=r.get("stderr", _NAN))
    for r in tables.get("theory_vs_actual", ()):
        if "layer" in r and "param" in r:
            layer, param = r["layer"], r["param"]
        else:
            layer, param = _split_param(str(r.get("block", "")), out.named)
        out.add(layer, param, "curv_theory_ratio", r.get("ratio"),
                stderr=r.get("ratio_stderr", _NAN))  # fmt: skip


NOT_CALLED = "not called on this data: its parameters get no gradient, so it will not learn"
NO_GRADIENT = (
    "no gradient reached this layer: it ran under torch.no_grad(), its output was detached, or "
    "the output does not lead to the loss, so it will not learn"
)


def _add_no_gradient(out: _LongRows, probe_table: Rows, param_table: Rows) -> dict[str, str]:
    """A ``no_gradient`` row (``warn``) for every probed layer none of whose trainable
    parameters got a gradient (finite or not) on any batch; returns ``{layer: reason}``."""
    got: dict[str, list[bool]] = {}
    for r in param_table:
        module = out.named.get(r["layer"])
        param = None if module is None else module._parameters.get(r["param"])
        if param is not None and param.requires_grad:
            reached = math.isfinite(r["E_dW2"]) or r["nonfinite"] > 0
            got.setdefault(r["layer"], []).append(reached)
    silent = {}
    for t in probe_table:
        layer = t["layer"]
        if got.get(layer) and not any(got[layer]):
            silent[layer] = NO_GRADIENT if t["calls"] else NOT_CALLED
            out.add(layer, "", "no_gradient", 1.0, verdict="warn", note=silent[layer])
    return silent


def _zero_reason(
    e_x2: float, e_dy2: float, what: str, dead: Sequence[str] = (), float16: bool = False
) -> str:
    """Why a layer's gradient is 0 (``what``: ``"γ = 0"`` or ``"every gradient is 0"``);
    ``dead``: the ReLUs whose every unit is dead (no gradient passes them); ``float16``: the
    layer is float16 (:func:`~initlab._core.underflow.float16_layer`), so a zero gradient may be
    float16 underflow (a dead ReLU or a zero input still explain it first)."""
    if e_dy2 == 0.0 and dead:
        return (
            f"{what}: no gradient reaches this layer (E[dy^2] = 0 at its output): every unit of "
            f"the ReLU {shown(dead, 3)} is dead (its input never positive), and no gradient passes "
            "a dead ReLU; fix the layer that feeds it (its bias, its weights), and this one learns"
        )
    if float16:
        return float16_zero(f"{what}: " + ("E[dy^2] = 0 at its output" if e_dy2 == 0.0 else
                                           "its parameters' gradients are 0"))  # fmt: skip
    if e_dy2 == 0.0:
        return (
            f"{what}: no gradient reaches this layer (E[dy^2] = 0 at its output: the gradient "
            "vanishes before it, or underflows to 0 in float32), so it will not learn"
        )
    if e_x2 == 0.0:
        return (
            f"{what}: the layer's input is 0 (E[x^2] = 0, e.g. dead units before it), so its "
            "weight's gradient is 0 and it will not learn"
        )
    return f"{what}: its parameters' gradients are 0, so it will not learn"


def _add_zero_gradient(
    out: _LongRows,
    probe_table: Rows,
    param_table: Rows,
    gr: Rows | None,
    rat: _Ratios,
    dead: Sequence[str] = (),
    float16_outputs: Collection[str] = (),
) -> None:
    """A ``zero_gradient`` row (``bad``) for every layer whose trainable weight has γ = 0, or all
    of whose trainable parameters got a gradient that is exactly 0 (a vanished gradient, often
    one whose squares underflow in float32); the reasons go to ``rat.zero``. A layer that got no
    gradient at all is :func:`_add_no_gradient`'s. At a float16 layer (its parameters, or
    ``float16_outputs``: :attr:`~initlab.MomentProbe.float16_layers`) the zero may be float16
    underflow (:mod:`initlab._core.underflow`): ``warn``, and the layer goes to
    ``rat.float16``; without a dead ReLU before it or a zero input."""
    moments = {t["layer"]: (t["E_x2"], t["E_dy2"]) for t in probe_table}

    def reason(layer: str, e_x2: float, e_dy2: float, what: str) -> str:
        half = not (e_dy2 == 0.0 and dead) and e_x2 != 0.0
        half = half and float16_layer(out.named.get(layer), layer, float16_outputs)
        if half:
            rat.float16.add(layer)
        return _zero_reason(e_x2, e_dy2, what, dead, half)

    for r in gr or ():
        gw = r.get("gamma_w")
        if r.get("trainable", True) and gw == 0.0:
            rat.zero[r["layer"]] = reason(r["layer"], r["E_x2"], r["E_dy2"], "γ = 0")
    grads: dict[str, list[float]] = {}
    for r in param_table:
        module = out.named.get(r["layer"])
        param = None if module is None else module._parameters.get(r["param"])
        if param is not None and param.requires_grad:
            grads.setdefault(r["layer"], []).append(r["E_dW2"])
    for layer, values in grads.items():
        if layer not in rat.zero and all(v == 0.0 for v in values):
            e_x2, e_dy2 = moments.get(layer, (_NAN, _NAN))
            rat.zero[layer] = reason(layer, e_x2, e_dy2, "every gradient is 0")
    for layer, why in rat.zero.items():
        gate = rat.gated.get(layer)
        if gate is not None:  # a residual branch closed at init on purpose: it opens at step 1
            out.add(layer, "", "zero_gradient", 1.0, verdict="ok", note=gate)
        else:
            verdict = "warn" if layer in rat.float16 else "bad"
            out.add(layer, "", "zero_gradient", 1.0, verdict=verdict, note=why)


def closed_heads(model: nn.Module, probe_table: Rows) -> dict[str, str]:
    """``{layer: why}`` for the layers no gradient reaches at init (``E[dy^2] = 0`` exactly)
    where the first module after them (in execution order) that gets a gradient has a weight of
    all zeros: a zero-initialized head (common for classifiers; a LoRA adapter's ``B``) passes no
    gradient back until its first update moves it, and the layers before it learn from the second
    step on. Not a vanished gradient; where a module in between got a gradient, the zero has
    another cause and is not explained here."""
    rows = sorted((r for r in probe_table if r["order"] is not None), key=lambda r: r["order"])
    named = dict(model.named_modules())
    out: dict[str, str] = {}
    gate = None  # the nearest module after the current one that gets a gradient, all-zero weight
    for r in reversed(rows):
        if _positive(r["E_dy2"]):
            gate = r if _all_zero(named.get(r["layer"])) else None
        elif r["E_dy2"] == 0.0 and gate is not None:
            out[r["layer"]] = (
                f"no gradient at init, by design: {gate['layer']} after it has a weight of all "
                "zeros (a zero-initialized head or adapter) and passes no gradient back until its "
                "first update moves it; this layer learns from the second step on"
            )
    return out


def _weight(module: nn.Module | None) -> torch.Tensor | None:
    """``module``'s ``weight`` as its forward sees it (a parametrized one computed without side
    effects), or ``None``."""
    return None if module is None else layer_tensor(module, "weight")


def _all_zero(module: nn.Module | None) -> bool:
    """Whether ``module`` has a ``weight`` tensor with elements whose effective scale is zero
    everywhere: ``w`` itself, or ``1 + w`` for a norm whose forward computes ``(1 + w) * n(x)``
    (Gemma's, recognized by :func:`~initlab.init._norm_like.norm_identity`; its zeros are the
    identity, no closed gate)."""
    w = None if module is None else _weight(module)
    if module is None or not isinstance(w, torch.Tensor) or w.numel() == 0:
        return False
    w = w.detach()
    if norm_identity(module) == 0.0:  # (1 + w) * n(x): the scale is 1 + w
        w = w + 1
    return not bool(w.any())


def closed_branches(
    model: nn.Module, probe_table: Rows, blocks: Iterable[Mapping[str, Any]]
) -> dict[str, str]:
    """``{layer: why}`` for the layers of a residual branch that a zero-initialized module after
    them closes at init: a weight of all zeros on the branch (a BatchNorm's scale in
    zero-init-last-BN ResNets, Goyal et al. 2017; Fixup's last convolution; SkipInit's scale). No
    gradient reaches what comes before it in the branch until its first update (its own gradient
    is not 0), by design: not a vanished gradient. Only the layers before it that got no gradient
    (``E[dy^2] = 0`` exactly, as in :func:`closed_heads`) are claimed: a layer the gradient
    reached is no closed branch's, whatever the weights say."""
    order = {r["layer"]: r["order"] for r in probe_table if r["order"] is not None}
    silent = {r["layer"] for r in probe_table if r["E_dy2"] == 0.0}  # no gradient reached it
    named = dict(model.named_modules())
    out: dict[str, str] = {}
    for b in blocks:
        branch = [n for n in b.get("branch", ()) if n in order]
        for gate in branch:
            if not _all_zero(named.get(gate)):
                continue
            why = (
                f"no gradient at init, by design: {gate} (weight all zeros) closes the residual "
                f"branch of {b.get('name') or 'its block'} after this layer, which learns from "
                "the first step on (zero-initialized residual branches: Goyal et al. 2017, Fixup)"
            )
            for n in branch:
                if order[n] < order[gate] and n in silent:
                    out.setdefault(n, why)
    return out


def _add_findings(out: _LongRows, findings: Rows) -> dict[str, list[dict[str, Any]]]:
    """The linter's findings as long rows; returns them by layer."""
    by_layer: dict[str, list[dict[str, Any]]] = {}
    for f in findings:
        sev = f["severity"]
        verdict = sev if sev in ("warn", "bad") else "ok"
        out.add(f["layer"], "", f"lint:{f['rule']}", f["value"], verdict=verdict,
                note=f["message"], module_type=f["module_type"] or None)  # fmt: skip
        by_layer.setdefault(f["layer"], []).append(f)
    return by_layer


# ----------------------------------------------------------------------------- verdicts


def _verdict(
    layer: str, rat: _Ratios, layer_findings: Iterable[Mapping[str, Any]], silent: str = ""
) -> tuple[str, str]:
    """``(verdict, reason)`` of one layer: γ (else ν) against its median, the findings, and
    ``silent`` (why the layer got no gradient, ``""`` when it got one)."""
    reasons: list[tuple[str, str]] = [("warn", silent)] if silent else []
    if layer in rat.gated:  # γ = ν = 0 by design: no ratio to judge
        reasons.append(("ok", rat.gated[layer]))
    elif layer in rat.zero:
        reasons.append(("warn" if layer in rat.float16 else "bad", rat.zero[layer]))
    rel = rat.gamma_rel.get(layer, _NAN)
    judged = layer not in rat.gated
    if judged and layer in rat.gammas and math.isfinite(rel):
        v = ratio_verdict(rel)
        if v in ("warn", "bad"):
            reasons.append((v, ratio_reason("γ", rel)))
    elif judged and layer in rat.nu_rel:
        v = ratio_verdict(rat.nu_rel[layer])
        if v in ("warn", "bad"):
            reasons.append((v, ratio_reason("ν", rat.nu_rel[layer])))
    for f in layer_findings:
        if f["severity"] in ("warn", "bad"):
            reasons.append((f["severity"], _short_reason(f)))
    reasons.sort(key=lambda t: t[0] != "bad")
    verdict = worst(v for v, _ in reasons)
    return verdict, "; ".join(dict.fromkeys(t for _, t in reasons))


def _layer_row(
    layer: str,
    d: Mapping[str, Any],
    shape: Any,
    pivot: Mapping[tuple[str, str, str], float],
    rat: _Ratios,
    verdict: str,
    reason: str,
) -> dict[str, Any]:
    """One row of :data:`LAYER_COLUMNS`."""
    wname = rat.wnames.get(layer, "weight")

    def pv(q: str, param: str = "") -> float:
        return pivot.get((layer, param, q), _NAN)

    return {
        "layer": layer,
        "module_type": d["module_type"],
        "order": d["order"],
        "shape": shape,
        "E_x2": pv("E_x2"),
        "E_y2": pv("E_y2"),
        "E_dy2": pv("E_dy2"),
        "gain_fwd": pv("gain_fwd"),
        "gain_bwd": pv("gain_bwd"),
        "cum_gain_fwd": pv("cum_gain_fwd"),
        "cum_gain_bwd": pv("cum_gain_bwd"),
        "gamma_w": rat.gammas.get(layer, _NAN),
        "gamma_b": pv("gamma", "bias"),
        "gamma_rel_median": rat.gamma_rel.get(layer, _NAN),
        "nu": pv("nu", wname),
        "nu_minibatch": pv("nu_minibatch", wname),
        "nu_rel_median": rat.nu_rel.get(layer, _NAN),
        "W_abs_mean": pv("W_abs_mean", wname),
        "grad_std": pv("grad_std", wname),
        "op_norm": pivot.get((layer, wname, "op_norm"), pv("op_norm")),
        "sv_mean": pv("sv_mean", wname),
        "dead_frac": pv("dead_frac"),
        "verdict": verdict,
        "reason": reason,
    }


def _layer_table(
    out: _LongRows,
    probe_table: Rows,
    param_table: Rows,
    findings: Rows,
    by_layer: Mapping[str, list[dict[str, Any]]],
    rat: _Ratios,
    silent: Mapping[str, str],
) -> list[dict[str, Any]]:
    """The per-layer rows (definition order); adds each layer's ``verdict`` long row."""
    probed = {r["layer"] for r in probe_table}
    flagged = {f["layer"] for f in findings if f["severity"] in ("warn", "bad")}
    layer_names = sorted(
        {r["layer"] for r in out.rows if r["layer"] != "" or "" in probed | flagged},
        key=lambda n: _sort_key(n, out.index),
    )
    pivot: dict[tuple[str, str, str], float] = {(r["layer"], r["param"], r["quantity"]): r["value"]
                                                for r in out.rows}  # fmt: skip
    wide: list[dict[str, Any]] = []
    for layer in layer_names:
        verdict, reason = _verdict(layer, rat, by_layer.get(layer, ()), silent.get(layer, ""))
        out.add(layer, "", "verdict", _NAN, verdict=verdict, note=reason)
        wname = rat.wnames.get(layer, "weight")
        shape = next(
            (r["shape"] for r in param_table if r["layer"] == layer and r["param"] == wname),
            None,
        )
        wide.append(_layer_row(layer, out.info[layer], shape, pivot, rat, verdict, reason))
    return wide


def assemble(
    model: nn.Module,
    probe_table: Rows,
    param_table: Rows,
    gr: Rows | None,
    tables: Mapping[str, Rows],
    findings: Rows,
    blocks: Iterable[Mapping[str, Any]] = (),
    float16_outputs: Collection[str] = (),
) -> tuple[Rows, Rows, dict[str, Any]]:
    """Long rows, the per-layer table with verdicts, and the imbalance summary; the layers of a
    residual branch of ``blocks`` closed at init (:func:`closed_branches`) and those before a
    zero-initialized head (:func:`closed_heads`) are no zero gradient and stay out of the
    imbalance. ``float16_outputs``: the probe's float16 layers
    (:attr:`~initlab.MomentProbe.float16_layers`); the imbalance's ``float16_zero`` lists the
    layers whose zero gradient may be float16 underflow (:func:`_add_zero_gradient`)."""
    out = _LongRows(model)
    gated = {**closed_heads(model, probe_table), **closed_branches(model, probe_table, blocks)}
    rat = _Ratios(gated=gated)
    _add_moments(out, probe_table)
    _add_params(out, param_table, tables, rat)
    dead = [f["layer"] for f in findings if f["rule"] == "dead_relu" and f["value"] >= 1.0]
    _add_zero_gradient(out, probe_table, param_table, gr, rat, dead, float16_outputs)
    _add_gamma(out, gr, rat)
    _add_nu_rel(out, rat)
    _add_measurements(out, tables)
    _add_curvature(out, tables)
    silent = _add_no_gradient(out, probe_table, param_table)
    by_layer = _add_findings(out, findings)
    wide = _layer_table(out, probe_table, param_table, findings, by_layer, rat, silent)
    gammas, nus = rat.gammas, rat.nus
    imb = imbalance_summary(
        {
            k: {"gamma": gammas.get(k, _NAN), "nu": nus[k][0] if k in nus else _NAN}
            for k in dict.fromkeys([*gammas, *nus])  # model order: the first zero is argmin
            if k not in rat.gated
        }
    )
    imb["float16_zero"] = [k for k in rat.zero if k in rat.float16]
    return (
        Rows(out.rows, DIAGNOSTIC_COLUMNS, title="diagnosis (long rows)"),
        Rows(wide, LAYER_COLUMNS, title="diagnosis per layer"),
        imb,
    )
