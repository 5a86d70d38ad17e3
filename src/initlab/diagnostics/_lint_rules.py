"""The linter's rule table: the finding row (:data:`FINDING_COLUMNS`), the thresholds, the
reason of each rule (the paper's note and citation), and the rules read off a module's parameters
and its activation statistics. :mod:`initlab.diagnostics.linter` applies them and re-exports the
public names."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = [
    "BIAS_SHARE",
    "DEAD_BAD",
    "DEAD_MIN_EXAMPLES",
    "DEAD_WARN",
    "FINDING_COLUMNS",
    "RULES",
    "SATURATED_STD",
    "SIGNAL_HIGH",
    "SIGNAL_LOW",
    "TANH_LINEAR_STD",
]

FINDING_COLUMNS: tuple[str, ...] = (
    "layer",
    "module_type",
    "rule",
    "severity",
    "value",
    "message",
    "reason",
)
"""Columns of the linter's findings: ``layer`` (module name, ``"<module>:<node>"`` for a
functional op, or a residual block's name), ``module_type`` (class or function name), ``rule``
(a key of :data:`RULES`), ``severity`` (``info``/``warn``/``bad``), ``value`` (the number the rule
tested, NaN if none), ``message`` (what was found and what to do), ``reason`` (the paper's note and
citation)."""

TANH_LINEAR_STD = 0.5
"""tanh inputs with a std below this are inside tanh's linear regime (not flagged)."""
SATURATED_STD = 2.0
"""sigmoid/tanh inputs with a std at or above this are saturated (severity ``bad``)."""
DEAD_WARN = 0.1
"""Dead-ReLU fraction above which a ReLU is flagged ``warn``."""
DEAD_BAD = 0.5
"""Dead-ReLU fraction above which a ReLU is flagged ``bad``."""
DEAD_MIN_EXAMPLES = 16
"""Fewer examples measured: no dead-ReLU finding (a live unit that is positive half the time looks
dead over ``n`` examples with probability ``2^-n``; 16 examples make that 1.5e-5)."""
BIAS_SHARE = 0.9
"""A layer whose bias makes up more than this share of its output's ``E[y^2]`` (``E[b^2] /
E[y^2]``), with ``E[b^2] > 1``, is flagged ``bias_dominates`` (``warn``): its output is mostly a
large constant. (A small bias over a signal that vanished, as torch's default init leaves a deep
MLP's head, is the signal's problem: ``vanishing_signal``.)"""
SIGNAL_LOW = 1e-3
"""``E[y^2]`` or a cumulative gain below this: the signal vanishes (``bad``)."""
SIGNAL_HIGH = 1e3
"""``E[y^2]`` or a cumulative gain above this: the signal explodes (``bad``)."""


def _gate_share(module: nn.Module) -> float:
    """The share of the squared gradient a gated recurrent layer's gates pass to its input at
    init, whatever its weights: gates at ``sigmoid(0) = 1/2``. An LSTM's candidate ``g`` gets
    ``dL/dg = dL/dh * o * i * tanh'(c)``, ``o * i = 1/4``: ``1/16`` per layer; a GRU's candidate
    ``n`` gets ``dL/dh * (1 - z)``, ``1 - z = 1/2``: ``1/4`` per layer (``num_layers`` stacked
    layers: that power). Any other module: 1. A healthy default-init LSTM of 2 layers with a
    linear head has an end-to-end backward gain near 1e-4, of which ``1/256`` is its gates'."""
    if isinstance(module, (nn.LSTM, nn.LSTMCell)):
        share = 1 / 16
    elif isinstance(module, (nn.GRU, nn.GRUCell)):
        share = 1 / 4
    else:
        return 1.0
    return share ** int(getattr(module, "num_layers", 1))


_DB = "Defazio & Bottou (2019), Scaling Laws for the Principled Design, Initialization and "
_DB += "Preconditioning of ReLU Networks"
_SEC7 = (
    "a pooling operation that changes the forward and backward signals in a way that counteracts "
    "the change in spatial dimension is needed. The use of stride-2 convolutions, as well as "
    "average pooling, results in the correct scaling, but other common types of spatial reduction "
    "generally do not"
)

RULES: dict[str, str] = {
    "max_pool": f'Table 1: "Max pooling" does not maintain scaling; Section 7: "{_SEC7}". {_DB}.',
    "resampling": f'Section 7: "{_SEC7}". {_DB}.',
    "sigmoid": f'Table 1: "Sigmoid" does not maintain scaling. {_DB}.',
    "tanh": f'Table 1: "Tanh" does not maintain scaling; note: "Maintains scaling if entirely '
    f'within the linear regime". {_DB}.',
    "skip_connection": 'Table 1: "Skip connections" do not maintain scaling; note: "Operations in '
    "residual blocks will be scaled correctly against each other, but not against non-residual "
    f'operations". App. E corrects this with conditioning multipliers. {_DB}.',
    "mixed_kernel_sizes": 'Table 1: "(Strided) convolution" maintains scaling; note: "As above, '
    'but only if all kernel sizes are the same". gamma scales with k^2; Section 5/App. E: a '
    f"conditioning multiplier alpha with alpha^4 k^2 = const corrects it. {_DB}.",
    "dead_relu": "A ReLU unit that is never positive passes no signal and no gradient: the layers "
    "before it lose those units (Table 1 assumes ReLU's positive homogeneity, which a dead unit "
    f"keeps but with gain 0). {_DB}.",
    "vanishing_signal": f"Signals outside [{SIGNAL_LOW:g}, {SIGNAL_HIGH:g}]: the product of gains "
    "should stay near 1 (Mishkin & Matas 2016, LSUV: a deep net trains well when the product of "
    "layer gains is about 1).",
    "exploding_signal": f"Signals outside [{SIGNAL_LOW:g}, {SIGNAL_HIGH:g}]: the product of gains "
    "should stay near 1 (Mishkin & Matas 2016, LSUV).",
    "bias_dominates": "Defazio & Bottou init the biases at zero (Table 2's schemes; Prop. 7/9 "
    "balance biases against weights at c = 2): a bias that dwarfs W x makes every example's "
    "output nearly the same constant, and the units it pushes negative before a ReLU are dead.",
    "input_scale": "Section 6.3: the first layer's weights and biases are balanced when "
    "E[x_0^2] = 1 / (k_0 sqrt(n_0)) (about 0.2 for RGB and k = 3, not the traditional 1); an "
    f"input far off scale puts every layer's signal off scale whatever its gain. {_DB}.",
    "vanishing_gradient": "Gradients shrink through depth; the lecture (vanishing/exploding "
    "gradients) keeps L * ||W_j|| ~ 1 per layer.",
    "exploding_gradient": "Gradients grow through depth; the lecture (vanishing/exploding "
    "gradients) keeps L * ||W_j|| ~ 1 per layer.",
    "non_finite": "NaN/inf values: every moment, gain and ratio downstream is undefined.",
    "not_traced": "torch.fx could not trace the model; only module types were inspected.",
    "not_measured": "The traced graph could not be run on the batch: functional activations "
    "have no probe data (their rules fire without numbers).",
    "identical_units": "Units with equal incoming weights compute the same function; with equal "
    "outgoing weights too they receive the same gradient, gradient descent keeps them equal, and "
    "the layer acts as one unit (why every init scheme draws weights at random).",
}
"""Reason (the paper's note and citation) for each rule."""


def _finding(
    layer: str, module_type: str, rule: str, severity: str, value: float, message: str
) -> dict[str, Any]:
    return {
        "layer": layer,
        "module_type": module_type,
        "rule": rule,
        "severity": severity,
        "value": float(value),
        "message": message,
        "reason": RULES[rule],
    }


def _parameter_findings(named: Mapping[str, nn.Module]) -> list[dict[str, Any]]:
    """``non_finite``: parameters holding NaN/inf; ``identical_units``: a trainable weight whose
    rows (one per output unit) are all equal."""
    out = []
    for name, m in named.items():
        for pname, p in m.named_parameters(recurse=False):
            w = p.detach()
            if not bool(torch.isfinite(w).all()):
                out.append(
                    _finding(name, type(m).__name__, "non_finite", "bad", math.nan,
                             f"non-finite values in the parameter {name}.{pname}")
                )  # fmt: skip
            elif p.requires_grad and pname == "weight" and w.dim() >= 2 and w.shape[0] > 1:
                rows = w.reshape(w.shape[0], -1)  # an all-zero weight is a design (Fixup)
                if bool(rows[0].any()) and bool((rows == rows[0]).all()):
                    out.append(
                        _finding(name, type(m).__name__, "identical_units", "warn", 0.0,
                                 f"every row of {name}.{pname} is the same ({w.shape[0]} units "
                                 "of one function, e.g. a constant init): with equal outgoing "
                                 "weights too they get one gradient and stay equal; draw the "
                                 "weights at random")
                    )  # fmt: skip
    return out


def _activation_findings(r: Mapping[str, Any]) -> list[dict[str, Any]]:
    out = []
    layer, mtype, kind, std = r["layer"], r["module_type"], r["kind"], r["input_std"]
    if kind == "relu":
        dead = r["dead_frac"]
        if math.isfinite(dead) and dead > DEAD_WARN and r["examples"] >= DEAD_MIN_EXAMPLES:
            sev = "bad" if dead > DEAD_BAD else "warn"
            out.append(
                _finding(layer, mtype, "dead_relu", sev, dead,
                         f"{dead:.0%} of the units entering this ReLU are never positive over "
                         f"{r['examples']} examples: no signal or gradient passes them; what "
                         "feeds it drives them negative (the layer before it: its bias, its "
                         "weights' scale, or the input's)")
            )  # fmt: skip
    elif kind == "sigmoid":
        sev = "bad" if math.isfinite(std) and std >= SATURATED_STD else "warn"
        std_txt = f"input std {std:.3g}" if math.isfinite(std) else "input std not measured"
        out.append(
            _finding(layer, mtype, "sigmoid", sev, std,
                     f"sigmoid ({std_txt}) breaks the scaling: its output is centred at 1/2 and "
                     "its slope is at most 1/4; prefer ReLU"
                     + ("; the input is saturated" if sev == "bad" else ""))
        )  # fmt: skip
    elif kind == "tanh":
        if not math.isfinite(std):
            out.append(
                _finding(layer, mtype, "tanh", "warn", std,
                         "tanh with an unmeasured input std: it keeps the scaling only within its "
                         f"linear regime (input std < {TANH_LINEAR_STD})")
            )  # fmt: skip
        elif std >= TANH_LINEAR_STD:
            sev = "bad" if std >= SATURATED_STD else "warn"
            out.append(
                _finding(layer, mtype, "tanh", sev, std,
                         f"tanh input std {std:.3g} >= {TANH_LINEAR_STD}: outside its linear regime"
                         + (" (saturated)" if sev == "bad" else "")
                         + "; scale its input down or use ReLU")
            )  # fmt: skip
    return out
