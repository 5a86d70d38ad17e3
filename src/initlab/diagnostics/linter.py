r"""The scaling linter: what in a model breaks Defazio & Bottou's GR scaling (their Table 1).

Inserting a layer between two layers keeps the network's conditioning when it keeps the product
``E[dx^2] E[x^2]`` of the (non-central) second moments of its input and its input gradient, and
when it changes the spatial size ``p^2`` in a way that counteracts the ``p^2`` factor of ``gamma``
(Section 7). Table 1 lists which common layers do. The linter walks the model and reports, as rows
of :data:`FINDING_COLUMNS` (``layer, module_type, rule, severity, value, message, reason``), every
place where this breaks, with the paper's note as ``reason``. Severities: ``"info"``, ``"warn"``,
``"bad"``.

Rules (:data:`RULES` holds each rule's reason text):

==========================  ======  ===========================================================
rule                        sev.    fires on
==========================  ======  ===========================================================
``max_pool``                warn    ``nn.MaxPool*``, ``nn.AdaptiveMaxPool*``,
                                    ``nn.FractionalMaxPool*``, ``F.max_pool*``,
                                    ``F.adaptive_max_pool*`` (Table 1: max pooling does not
                                    maintain scaling; Section 7: only stride and average pooling
                                    compensate the change of ``p^2``)
``resampling``              warn    other spatial changes that do not compensate ``p^2``:
                                    ``nn.Upsample*``, ``F.interpolate``/``F.upsample*``,
                                    ``nn.LPPool*``/``F.lp_pool*`` (a strided convolution, strided
                                    slicing and average pooling compensate and are not flagged)
``sigmoid``                 warn    ``nn.Sigmoid``, ``torch.sigmoid``; ``bad`` when the input std
                                    is >= :data:`SATURATED_STD` (saturated)
``tanh``                    warn    ``nn.Tanh``, ``torch.tanh`` whose input std (all elements of
                                    the input over the batch, pooled) is >= :data:`TANH_LINEAR_STD`
                                    = 0.5, or not measured; ``bad`` at >= :data:`SATURATED_STD` = 2.
                                    Below 0.5 tanh is inside its linear regime (tanh(0.5) =
                                    0.46) and is not flagged
``skip_connection``         warn    each residual block (see "Residual blocks" below)
``mixed_kernel_sizes``      warn    each convolution whose kernel size differs from the most
                                    common kernel size among the model's convolutions
``dead_relu``               warn    a ReLU with a fraction of dead units > :data:`DEAD_WARN` = 0.1
                                    (``bad`` > :data:`DEAD_BAD` = 0.5); a unit is one entry of an
                                    example's input to the ReLU (all non-batch dims) and is dead
                                    when it is ``<= 0`` for every example of every batch measured;
                                    needs :data:`DEAD_MIN_EXAMPLES` = 16 examples
``vanishing_signal``        bad     (``warn`` after a normalization layer, with the reason: a
                                    residual branch's small output is by design there, and the
                                    next normalization resets the scale) a module whose
                                    ``E[y^2]``, or ``E[y^2]`` relative to the
                                    network's input ``E[x^2]`` (the end-to-end forward gain,
                                    :func:`signal_ratios`), is below :data:`SIGNAL_LOW` = 1e-3;
                                    after a normalization layer (a type name with ``Norm``) the
                                    reference is that layer's output ``E[y^2]`` (it sets the
                                    scale: in a pre-norm transformer each projection is judged
                                    from the norm before it, not from a 0.02-std embedding); an
                                    embedding that feeds a normalization is not judged
``exploding_signal``        bad     ... above :data:`SIGNAL_HIGH` = 1e3
``bias_dominates``          warn    a weight layer (not a normalization) whose bias makes up
                                    more than :data:`BIAS_SHARE` = 0.9 of its output's
                                    ``E[y^2]`` (``E[b^2] / E[y^2]``, the weight non-zero) and
                                    ``E[b^2] > 1``: its output is mostly a large constant, the
                                    same for every example
``input_scale``             bad     the network's floating input ``E[x_0^2]``
                                    (:func:`network_input`) outside [1e-3, 1e3]; the modules
                                    judged from it are then flagged only where their ``E[y^2]``
                                    and their gain from the input are both off scale (they carry
                                    the input's scale)
``vanishing_gradient``      bad     the end-to-end backward gain (:func:`gradient_ratios`: the
                                    squared gradient at a module's input, summed over its
                                    elements, over that at the last module's output, measured
                                    directly, activations and pooling between the modules
                                    included) below 1e-3, in models without residual blocks only
                                    (a sum's gradient reaches a layer by the skip path too); a
                                    layer with gated recurrent layers on its way to the output
                                    is judged against 1e-3 times the share their gates pass at
                                    any init (gates at sigmoid(0) = 1/2: 1/16 per LSTM layer,
                                    1/4 per GRU layer; a default 2-layer LSTM's gain is ~1e-4)
``exploding_gradient``      bad     ... above 1e3
``non_finite``              bad     a module with NaN/inf inputs, outputs or gradients (the
                                    probe's ``nonfinite`` count), or a non-finite parameter
``not_traced``              info    ``torch.fx.symbolic_trace`` failed: functional operations
                                    were not inspected, only module types (residual additions
                                    and functional ReLUs come from running the model where
                                    forwards are given); the message says what was inspected
``not_measured``            info    the traced graph (or, untraced, the model) failed to run on
                                    the batch: functional activations were not measured
``identical_units``         warn    a trainable weight (of more than one row, not all zeros)
                                    whose rows are all equal (a constant init): its units compute
                                    one function; they separate only through different outgoing
                                    weights (a network of constant layers never does)
==========================  ======  ===========================================================

How the model is walked. First ``torch.fx.symbolic_trace`` (warnings silenced). Where it traces,
every ``call_module`` and every functional call (``F.max_pool2d``, ``torch.tanh``,
``x.sigmoid()``, ``a + b``) is seen; leaf modules of ``torch.nn`` are not entered. Where tracing
fails (data-dependent control flow), the linter falls back to ``model.named_modules()``: module
types only, plus a ``not_traced`` finding saying so. Probe data supplies the numbers: the input
std of sigmoid/tanh and the dead-ReLU counts come from forward pre-hooks on activation *modules*
(:class:`ActivationWatch`, during the caller's passes; an in-place ReLU is read before it
overwrites its input); functional activations found in the graph are measured by one extra
forward of the traced graph (``torch.fx.Interpreter``, no grad) per ``forward_args`` entry;
where fx cannot trace, functional ReLUs (``F.relu``, ``torch.relu``, ``x.relu()`` outside the
leaf modules of ``torch.nn``) are measured by running the model on them, no grad
(``source="runtime"``, named ``module:relu``, ``module:relu_1``, ...).

Residual blocks. (1) ``residual_blocks=`` given by the user: module names (every weight inside is
on the branch, the shortcut is the identity) or dicts ``{"name", "branch", "shortcut"}``. (2) Else,
in the traced graph, an addition ``a + b`` (``operator.add``, ``torch.add``, ``Tensor.add``) is a
residual connection when one operand (the skip) reaches a node that is a *data* ancestor of the
other operand (the branch) within :data:`SHORTCUT_STEPS` steps back along first arguments: that
node is the block input, the parameterized modules on the walk are the shortcut (a projection), and
the parameterized modules between the block input and the branch operand are the branch (there
must be at least one). Of the two orientations the one with fewer shortcut modules wins. Shape
queries and tensor factories (``x.size()``, ``torch.arange``) do not carry data ancestry, so
``tok_emb(idx) + pos_emb(arange(idx.size(1)))`` is not a residual connection. (3) Leaf modules that
are residual by construction: ``nn.TransformerEncoderLayer`` (2 blocks) and
``nn.TransformerDecoderLayer`` (3 blocks). (4) Untraceable models (Hugging Face GPT-2, BERT, Llama)
given ``forward_args``: the same rule applied to the data flow of one forward of the first
``forward_args`` entry (:func:`~initlab.measure.runtime_trace.find_runtime_blocks`, no grad, the
model put back as it was; ``source="runtime"``), plus (3); without ``forward_args``, only (1) and
(3).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from initlab._core.compiled import takes_compiled
from initlab._core.hooks import VmappedModuleError
from initlab._core.parametrized import reading_layers
from initlab._core.rows import Rows
from initlab.diagnostics._lint_rules import (
    BIAS_SHARE,
    DEAD_BAD,
    DEAD_MIN_EXAMPLES,
    DEAD_WARN,
    FINDING_COLUMNS,
    RULES,
    SATURATED_STD,
    SIGNAL_HIGH,
    SIGNAL_LOW,
    TANH_LINEAR_STD,
    _activation_findings,
    _finding,
    _gate_share,
    _parameter_findings,
)
from initlab.diagnostics.activations import (
    ACTIVATION_COLUMNS,
    ActivationWatch,
    _activation_kind,
    _ActStats,
    _functional_kind,
    _interpret_functional,
    _runtime_relus,
)
from initlab.measure._fx import _fn_name, _fns, _node_module_path, trace_model
from initlab.measure.residual import (
    SHORTCUT_STEPS as SHORTCUT_STEPS,  # re-exported: the residual-block search's reach
)
from initlab.measure.residual import (
    _known_residual_blocks,
    _user_blocks,
    find_residual_blocks,
    split_additions,
)
from initlab.measure.runtime_trace import additions_of, runtime_trace

__all__ = [
    "ACTIVATION_COLUMNS",
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
    "ActivationWatch",
    "LintResult",
    "find_residual_blocks",
    "gradient_ratios",
    "lint_model",
    "signal_ratios",
    "trace_model",
]

_MAX_POOL_MODULES: tuple[type[nn.Module], ...] = (
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
    nn.FractionalMaxPool2d,
    nn.FractionalMaxPool3d,
)
_RESAMPLE_MODULES: tuple[type[nn.Module], ...] = (
    nn.Upsample,
    nn.UpsamplingNearest2d,
    nn.UpsamplingBilinear2d,
    nn.LPPool1d,
    nn.LPPool2d,
)
_CONV_MODULES: tuple[type[nn.Module], ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


_MAX_POOL_FNS = _fns(
    "max_pool1d",
    "max_pool2d",
    "max_pool3d",
    "max_pool1d_with_indices",
    "max_pool2d_with_indices",
    "max_pool3d_with_indices",
    "adaptive_max_pool1d",
    "adaptive_max_pool2d",
    "adaptive_max_pool3d",
    "adaptive_max_pool1d_with_indices",
    "adaptive_max_pool2d_with_indices",
    "adaptive_max_pool3d_with_indices",
    "fractional_max_pool2d",
    "fractional_max_pool3d",
) | _fns("max_pool1d", "max_pool2d", "max_pool3d", "adaptive_max_pool1d", module=torch)
_RESAMPLE_FNS = _fns(
    "interpolate", "upsample", "upsample_nearest", "upsample_bilinear", "lp_pool1d", "lp_pool2d"
)


# ----------------------------------------------------------------------------- findings


@dataclass
class LintResult:
    """What the linter found.

    Attributes:
        findings: rows of :data:`FINDING_COLUMNS`.
        activations: rows of :data:`ACTIVATION_COLUMNS`.
        residual_blocks: the residual blocks (dicts, see :func:`find_residual_blocks`).
        traced: whether ``torch.fx`` traced the model.
        trace_error: why it did not.
        branch_sums: additions that sum parallel branches (``p(x) + q(x)``, no residual block:
            :func:`~initlab.measure.residual.find_branch_sums`), found by the fx or the runtime
            trace; ``None`` where neither ran.
    """

    findings: Rows
    activations: Rows
    residual_blocks: list[dict[str, Any]] = field(default_factory=list)
    traced: bool = False
    trace_error: str = ""
    branch_sums: list[dict[str, Any]] | None = None


@takes_compiled
@reading_layers
def lint_model(
    model: nn.Module,
    *,
    probe_table: Rows | Iterable[Mapping[str, Any]] | None = None,
    probe_rows: Rows | Iterable[Mapping[str, Any]] | None = None,
    param_table: Rows | Iterable[Mapping[str, Any]] | None = None,
    activations: ActivationWatch | None = None,
    forward_args: Sequence[tuple[tuple, dict]] | None = None,
    residual_blocks: Sequence[str | Mapping[str, Any]] | None = None,
    trace: bool = True,
) -> LintResult:
    """Check ``model`` against Table 1 and the probe's numbers (rules in the module docstring).

    Args:
        model: the model (not modified; a functional-activation pass restores buffers).
        probe_table: :meth:`MomentProbe.table` rows (``E_y2``, cumulative gains, ``nonfinite``)
            for the signal rules; ``None`` skips them.
        probe_rows: :meth:`MomentProbe.rows` (splits non-finite counts into activations and
            gradients; without it the table's pooled count is used).
        param_table: :meth:`MomentProbe.param_table` rows (non-finite gradients).
        activations: an :class:`ActivationWatch` that watched the caller's passes.
        forward_args: ``(args, kwargs)`` of forwards of the model (one per batch), used only to
            measure functional sigmoid/tanh/ReLU calls found in the traced graph (one forward of
            the traced graph per entry, no grad).
        residual_blocks: user-declared residual blocks (module names or dicts); default: detect.
        trace: try ``torch.fx.symbolic_trace`` (else module types only).
    """
    from initlab._core.state import preserved_state

    findings: list[dict[str, Any]] = []
    gm, error = trace_model(model) if trace else (None, "tracing disabled")
    named = dict(model.named_modules())
    act_stats: dict[str, _ActStats] = dict(activations.stats) if activations else {}
    runtime = forward_args if trace and gm is None and forward_args else None
    blocks, runtime_note, sums = _residual_blocks(model, gm, residual_blocks, runtime)

    # -- structural rules: from the graph where it traced, else from module types
    if gm is not None:
        structural, functional_acts = _structural_from_graph(gm)
    else:
        if trace:
            relus = _untraced_relus(model, forward_args, act_stats, findings)
            findings.append(
                _not_traced(model, error, runtime_note, relus, residual_blocks is not None)
            )
        structural, functional_acts = _structural_from_types(named), []
    findings.extend(_structural_findings(structural))

    # functional activations: one interpreter pass on the first batch
    if functional_acts and forward_args is not None:
        try:
            with preserved_state(model, params=False):
                measured = _interpret_functional(gm, functional_acts, forward_args)
            _keep_measured(act_stats, functional_acts, measured)
        except Exception as err:  # measuring is best effort; the structural finding stays
            findings.append(
                _finding("", type(model).__name__, "not_measured", "info", math.nan,
                         "functional activations not measured "
                         f"({type(err).__name__}: {str(err).splitlines()[0][:200]})")
            )  # fmt: skip
    _unmeasured_activations(act_stats, functional_acts, named)
    act_rows = [st.row(name) for name, st in act_stats.items()]
    for r in act_rows:
        findings.extend(_activation_findings(r))

    findings.extend(_kernel_size_findings(named))
    findings.extend(_skip_findings(blocks))
    findings.extend(
        _probe_findings(probe_table, probe_rows, param_table, chain=not blocks, named=named)
    )
    findings.extend(_parameter_findings(named))
    return LintResult(
        findings=Rows(findings, FINDING_COLUMNS, title="scaling linter"),
        activations=Rows(act_rows, ACTIVATION_COLUMNS, title="activations"),
        residual_blocks=blocks,
        traced=gm is not None,
        trace_error=error,
        branch_sums=sums,
    )


# ----------------------------------------------------------------------------- lint_model's rules


def _structural_from_graph(gm: Any) -> tuple[list[tuple[str, str, str]], list[Any]]:
    """``([(layer, type, rule)], functional activation nodes)`` from the traced graph."""
    functional_acts: list[Any] = []
    structural: list[tuple[str, str, str]] = []  # (layer, type, rule)
    for node in gm.graph.nodes:
        if node.op == "call_module":
            sub = gm.get_submodule(node.target)
            if isinstance(sub, _MAX_POOL_MODULES):
                structural.append((node.target, type(sub).__name__, "max_pool"))
            elif isinstance(sub, _RESAMPLE_MODULES):
                structural.append((node.target, type(sub).__name__, "resampling"))
        elif node.op == "call_function":
            where = f"{_node_module_path(node) or '<root>'}:{node.name}"
            if node.target in _MAX_POOL_FNS:
                structural.append((where, _fn_name(node.target), "max_pool"))
            elif node.target in _RESAMPLE_FNS:
                structural.append((where, _fn_name(node.target), "resampling"))
        if _functional_kind(node) is not None:
            functional_acts.append(node)
    return structural, functional_acts


def _structural_from_types(named: Mapping[str, nn.Module]) -> list[tuple[str, str, str]]:
    """``[(layer, type, rule)]`` from module types only (the model did not trace)."""
    structural: list[tuple[str, str, str]] = []
    for name, m in named.items():
        if isinstance(m, _MAX_POOL_MODULES):
            structural.append((name, type(m).__name__, "max_pool"))
        elif isinstance(m, _RESAMPLE_MODULES):
            structural.append((name, type(m).__name__, "resampling"))
    return structural


def _untraced_relus(
    model: nn.Module,
    forward_args: Sequence[tuple[tuple, dict]] | None,
    act_stats: dict[str, _ActStats],
    findings: list[dict[str, Any]],
) -> bool:
    """Measure the functional ReLUs of a model fx cannot trace by running it on
    ``forward_args`` (:func:`_runtime_relus`, state kept) into ``act_stats``; whether that ran
    (a failure is a ``not_measured`` finding)."""
    from initlab._core.state import preserved_state

    if not forward_args:
        return False
    try:
        with preserved_state(model, params=False):
            act_stats.update(_runtime_relus(model, forward_args))
    except Exception as err:  # best effort, as the interpreter's pass
        why = (
            str(err)  # a ReLU inside torch.func.vmap: the model ran, the batch was hidden
            if isinstance(err, VmappedModuleError)
            else "the model did not run on the batch "
            f"({type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]})"
        )
        findings.append(
            _finding("", type(model).__name__, "not_measured", "info", math.nan,
                     f"functional ReLUs not measured: {why}")
        )  # fmt: skip
        return False
    return True


def _not_traced(
    model: nn.Module,
    error: str,
    runtime_note: str = "",
    relus: bool = False,
    declared: bool = False,
) -> dict[str, Any]:
    """The ``not_traced`` finding: what was inspected without the fx graph (module types, the
    activation modules, the functional ReLUs where ``relus`` ran), and what was not."""
    seen = "module types and activation modules" + (
        ", functional ReLUs (by running the model)" if relus else ""
    )
    missed = "F.max_pool2d, torch.tanh" + (
        "" if runtime_note or declared else ", residual additions"
    )
    note = runtime_note
    if not runtime_note and not declared:
        note = (
            "pass forward_args=[(args, kwargs)] (a batch's forward, e.g. ((), batch) for a "
            "Hugging Face model) to find the residual blocks by running the model, or "
            "residual_blocks= to declare them"
        )
    message = (
        f"torch.fx could not trace the model ({error}); inspected: {seen}; not inspected: "
        f"functional operations ({missed})"
    )
    if note:
        message += f"; {note}"
    return _finding("", type(model).__name__, "not_traced", "info", math.nan, message)


def _structural_findings(structural: list[tuple[str, str, str]]) -> list[dict[str, Any]]:
    out = []
    for layer, mtype, rule in structural:
        msg = (
            f"{mtype} changes the spatial size p^2 without compensating the forward and backward "
            "signals: layers after it are scaled differently from layers before it; use a strided "
            "convolution or average pooling instead"
        )
        out.append(_finding(layer, mtype, rule, "warn", math.nan, msg))
    return out


def _keep_measured(
    act_stats: dict[str, _ActStats], nodes: list[Any], measured: Mapping[str, _ActStats]
) -> None:
    """Store the interpreter's measurements of functional activations under ``module:node``."""
    for node in nodes:
        if node.name in measured:
            act_stats[f"{_node_module_path(node) or '<root>'}:{node.name}"] = measured[node.name]


def _unmeasured_activations(
    act_stats: dict[str, _ActStats], nodes: list[Any], named: Mapping[str, nn.Module]
) -> None:
    """Give functional activations and activation modules nobody measured an empty entry."""
    for node in nodes:
        key = f"{_node_module_path(node) or '<root>'}:{node.name}"
        if key not in act_stats:
            act_stats[key] = _ActStats(_functional_kind(node) or "", _fn_name(node.target), "fx")
    # activation modules nobody watched still get a (not measured) entry
    for name, m in named.items():
        kind = _activation_kind(m)
        if kind is not None and name not in act_stats:
            act_stats[name] = _ActStats(kind, type(m).__name__, "module")


def _kernel_size_findings(named: Mapping[str, nn.Module]) -> list[dict[str, Any]]:
    """``mixed_kernel_sizes``: convolutions whose kernel size is not the most common one."""
    out: list[dict[str, Any]] = []
    convs = [(n, m) for n, m in named.items() if isinstance(m, _CONV_MODULES)]
    sizes = Counter(tuple(m.kernel_size) for _, m in convs)
    if len(sizes) <= 1:
        return out
    modal = max(sizes.items(), key=lambda kv: kv[1])[0]
    listing = ", ".join(f"{'x'.join(map(str, k))} (x{c})" for k, c in sizes.items())
    for n, m in convs:
        k = tuple(m.kernel_size)
        if k != modal:
            ratio = math.prod(k) / math.prod(modal)
            out.append(
                _finding(
                    n, type(m).__name__, "mixed_kernel_sizes", "warn", ratio,
                    f"kernel {'x'.join(map(str, k))} among mostly "
                    f"{'x'.join(map(str, modal))} convolutions (kernel sizes: {listing}): its "
                    f"gamma carries a factor k^2 {ratio:.3g}x that of the others; correct with "
                    f"a conditioning multiplier alpha = {ratio ** -0.25:.3g} "
                    "(alpha^4 k^2 = const)",
                )
            )  # fmt: skip
    return out


def _residual_blocks(
    model: nn.Module,
    gm: Any,
    residual_blocks: Sequence[str | Mapping[str, Any]] | None,
    runtime: Sequence[tuple[tuple, dict]] | None = None,
) -> tuple[list[dict[str, Any]], str, list[dict[str, Any]] | None]:
    """``(blocks, note, sums)``: the user's blocks if given, else those found in the graph (or,
    with ``runtime`` forward arguments and no graph, by a runtime trace of the first forward)
    plus the transformer layers'; ``note`` says what the runtime trace did ("" when it did not
    run); ``sums`` the sums of parallel branches found alike (:func:`find_branch_sums`;
    ``None``: nothing was traced)."""
    found, sums = split_additions(gm) if gm is not None else ([], None)
    if residual_blocks is not None:
        return _user_blocks(model, residual_blocks), "", sums
    blocks: list[dict[str, Any]] = found
    note = ""
    if gm is None and runtime:
        args, kwargs = runtime[0]
        try:
            blocks, sums = additions_of(runtime_trace(model, args, kwargs))
            note = (f"residual additions were found by a runtime trace of one forward "
                    f"({len(blocks)} residual block{'s' * (len(blocks) != 1)})")  # fmt: skip
        except Exception as err:  # the runtime trace is best effort, like the fx trace
            msg = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
            note = (f"the runtime trace of residual additions failed ({msg}); pass "
                    "residual_blocks= to declare residual blocks")  # fmt: skip
    in_blocks = {b for blk in blocks for b in blk["branch"]}
    blocks += [b for b in _known_residual_blocks(model) if not set(b["branch"]) & in_blocks]
    return blocks, note, sums


def _skip_findings(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for b in blocks:
        short = ", shortcut " + ", ".join(b["shortcut"]) if b["shortcut"] else ""
        out.append(
            _finding(
                b["name"], "residual block", "skip_connection", "warn", float(len(b["branch"])),
                f"skip connection around {', '.join(b['branch'])}{short}: these layers are "
                "balanced against each other but not against layers outside residual blocks; use "
                "conditioning multipliers (Defazio & Bottou App. E) or compare gamma within blocks",
            )
        )  # fmt: skip
    return out


def _probe_findings(
    probe_table: Iterable[Mapping[str, Any]] | None,
    probe_rows: Iterable[Mapping[str, Any]] | None,
    param_table: Iterable[Mapping[str, Any]] | None,
    *,
    chain: bool,
    named: Mapping[str, nn.Module] | None = None,
) -> list[dict[str, Any]]:
    """Signals, gradients and non-finite values from the probe's tables (``named``: the model's
    modules, for the gates of recurrent layers, :func:`_gate_shares`)."""
    out: list[dict[str, Any]] = []
    table = list(probe_table or ())
    rows = list(probe_rows) if probe_rows is not None else None
    nonfinite = _nonfinite_counts(rows) if rows is not None else None
    ratios, exempt = signal_ratios(table), _feeds_norm(table)
    backward = gradient_ratios(rows) if rows is not None and chain else {}
    shares = _gate_shares(table, named or {})
    backward = {k: (v, *shares.get(k, (1.0, ""))) for k, v in backward.items()}
    inputs = _input_finding(table)
    if inputs is not None:
        out.append(inputs)
    for r in table:
        out.extend(
            _signal_findings(
                r, ratios, exempt, backward, nonfinite=nonfinite, input_off=inputs is not None
            )
        )
    out.extend(_bias_findings(table, list(param_table or ())))
    for r in param_table or ():
        if r.get("nonfinite", 0) and r["nonfinite"] > 0:
            out.append(
                _finding(r["layer"], "", "non_finite", "bad", float(r["nonfinite"]),
                         f"non-finite gradients of {r['layer']}.{r['param']} "
                         f"({int(r['nonfinite'])} gradient tensor(s) left out)")
            )  # fmt: skip
    return out


def _gate_shares(
    probe_table: Iterable[Mapping[str, Any]], named: Mapping[str, nn.Module]
) -> dict[str, tuple[float, str]]:
    """``{layer: (share, names)}``: the product of :func:`_gate_share` over the gated recurrent
    modules (LSTM, GRU and their cells) that run at or after each probed module (a chain: they
    lie between its input and the last module's output), and their names; layers without any
    are left out. The end-to-end backward gain of such a layer is judged against
    ``SIGNAL_LOW * share``: the gates' ``sigmoid(0) = 1/2`` pass that share at any init, and no
    init of the weights changes it."""
    out: dict[str, tuple[float, str]] = {}
    share, names = 1.0, []
    for r in reversed(_in_order(probe_table)):
        own = _gate_share(named[r["layer"]]) if r["layer"] in named else 1.0
        if own < 1.0:
            share, names = share * own, [r["layer"] or "<root>", *names]
        if share < 1.0:
            out[r["layer"]] = (share, ", ".join(names))
    return out


def _positive(v: Any) -> bool:
    return isinstance(v, float) and math.isfinite(v) and v > 0


def _in_order(probe_table: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return sorted((r for r in probe_table if r["order"] is not None), key=lambda r: r["order"])


def _bias_findings(
    probe_table: list[Mapping[str, Any]], param_table: list[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """``bias_dominates``: layers whose bias is more than :data:`BIAS_SHARE` of ``E[y^2]``."""
    moments = {(r["layer"], r["param"]): r.get("E_W2") for r in param_table}
    out = []
    for r in probe_table:
        layer, mtype, y2 = r["layer"], str(r["module_type"] or ""), r["E_y2"]
        b2, w2 = moments.get((layer, "bias")), moments.get((layer, "weight"))
        if "Norm" in mtype or not (_positive(b2) and _positive(w2) and _positive(y2)):
            continue
        share = b2 / y2
        if share > BIAS_SHARE and b2 > 1.0:
            out.append(
                _finding(layer, mtype, "bias_dominates", "warn", share,
                         f"the bias makes up {min(share, 1.0):.0%} of E[y^2] (E[b^2] = {b2:.3g}, "
                         f"E[y^2] = {y2:.3g}): the output is mostly a constant, the same for "
                         "every example; zero the biases (init_model's bias='zeros', or lsuv_)")
            )  # fmt: skip
    return out


def network_input(probe_table: Iterable[Mapping[str, Any]]) -> tuple[float, str, str]:
    """``(E[x_0^2], layer, module type)``: the second moment of the network's floating input,
    read at the first probed module (in execution order) with a finite positive ``E[x^2]``;
    ``(nan, "", "")`` where the input is token ids (the first module's input is not floating)."""
    rows = [r for r in _in_order(probe_table) if _positive(r["E_x2"]) or _positive(r["E_y2"])]
    if not rows or not _positive(rows[0]["E_x2"]):
        return math.nan, "", ""
    return rows[0]["E_x2"], rows[0]["layer"], str(rows[0]["module_type"] or "")


_BRANCH = (
    " (after a normalization: a residual branch's small output is by design in scaled inits such "
    "as GPT-2's, and the next normalization resets the scale; warn, not bad)"
)


def _off_scale(value: Any) -> bool:
    """A finite nonzero second moment (or ratio) outside [SIGNAL_LOW, SIGNAL_HIGH]."""
    return (
        isinstance(value, float)
        and math.isfinite(value)
        and value != 0.0
        and not SIGNAL_LOW <= value <= SIGNAL_HIGH
    )


def _input_finding(probe_table: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """``input_scale``: the network's input ``E[x_0^2]`` off scale (every layer after it carries
    that scale, whatever its gain); ``None`` where it is in range or not floating."""
    value, layer, mtype = network_input(probe_table)
    if not _off_scale(value) or "Norm" in mtype:  # a normalization first sets the scale itself
        return None
    bound = f"< {SIGNAL_LOW:g}" if value < SIGNAL_LOW else f"> {SIGNAL_HIGH:g}"
    return _finding(
        layer, mtype, "input_scale", "bad", value,
        f"the network's input has E[x^2] = {value:.3g} {bound}: the signal is off scale from "
        "the start, whatever the layers' gains; scale the data (standardize the features, or "
        "initlab.methods.input_scale.input_scale_for(model, data) for the factor c with "
        "E[(c x)^2] = 1 / (k sqrt(n_in)), the paper's §6.3)",
    )  # fmt: skip


def signal_ratios(probe_table: Iterable[Mapping[str, Any]]) -> dict[str, tuple[float, str]]:
    """``{layer: (E[y^2] / reference, reference)}``: each module's output second moment relative
    to the network's input (the end-to-end forward gain, measured directly), or, after a
    normalization layer, to that layer's output; ``reference`` is ``""`` for the network's input,
    else the normalization layer's name (NaN where a moment is missing).

    The network's input ``E[x_0^2]`` is ``E[x^2]`` of the first probed module (in execution order)
    with a finite positive value, or its ``E[y^2]`` if its input is not floating point (token ids).
    A normalization layer (a module whose type name has ``Norm``: BatchNorm, LayerNorm, RMSNorm,
    Hugging Face's ``LlamaRMSNorm``, ...) sets its output's scale itself: every module after it,
    until the next one, is measured from its output ``E[y^2]``. Unlike the product of per-module
    gains this stays right through skip connections.
    """
    rows = _in_order(probe_table)
    ref = next((r["E_x2"] if _positive(r["E_x2"]) else r["E_y2"] for r in rows
                if _positive(r["E_x2"]) or _positive(r["E_y2"])), math.nan)  # fmt: skip
    ref_name, out = "", {}
    for r in rows:
        y2 = r["E_y2"]
        out[r["layer"]] = (y2 / ref if _positive(y2) and _positive(ref) else math.nan, ref_name)
        if "Norm" in str(r["module_type"] or "") and _positive(y2):
            ref, ref_name = y2, r["layer"] or "<root>"
    return out


def gradient_ratios(probe_rows: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """``{layer: S_dx / S_dy(last)}``: the squared gradient at each module's input, summed over
    its elements and the examples (``S = E[dx^2] * numel`` of its first input, all calls pooled),
    over that at the output of the last module to run (in execution order), from the probe's long
    rows (:meth:`MomentProbe.rows`). The end-to-end backward gain, measured directly: whatever
    lies between the probed modules (a ReLU halves it, a sigmoid's slope of at most 1/4 cuts
    it, a pooling spreads it) is in it, which a product of the modules' own gains leaves out (a
    He-initialized ReLU MLP of 30 layers read as 2.8e8 that way, for a true ratio near 1).
    Summed, not per element, so that a width or a pooling that changes the number of elements
    does not read as a gain. Layers without a gradient at their input (the first layer, whose
    input needs none) are left out."""
    stats: dict[tuple[str, str, str], dict[str, float]] = {}  # (layer, quantity, index)
    paths: dict[tuple[str, str], list[str]] = {}  # (layer, quantity) -> its tensors, in order
    order: dict[str, int] = {}
    for r in probe_rows:
        if r["call"] != "all" or r["quantity"] not in _ACT_QUANTITIES:
            continue
        seen = paths.setdefault((r["layer"], r["quantity"]), [])
        if r["index"] not in seen:
            seen.append(r["index"])
        stats.setdefault((r["layer"], r["quantity"], r["index"]), {})[r["stat"]] = r["value"]
        if r["order"] is not None:
            order[r["layer"]] = int(r["order"])

    def summed(layer: str, q: str) -> float:
        """``E[q^2] * numel`` of the first input (``dx``) or output (``dy``) tensor, in the
        order of ``x``/``y`` as :meth:`MomentProbe.table` reads them."""
        own = paths.get((layer, q), [])
        path = next((i for i in paths.get((layer, q[1]), []) if i in own), own[0] if own else "")
        s = stats.get((layer, q, path), {})
        return float(s.get("sq_mean", math.nan)) * float(s.get("numel", math.nan))

    ran = sorted(order, key=order.__getitem__)
    last = next((n for n in reversed(ran) if math.isfinite(summed(n, "dy"))), None)
    out_sq = summed(last, "dy") if last is not None else math.nan
    if not (math.isfinite(out_sq) and out_sq > 0):
        return {}
    ratios = {n: summed(n, "dx") / out_sq for n in ran}
    return {n: v for n, v in ratios.items() if math.isfinite(v)}


def _feeds_norm(probe_table: Iterable[Mapping[str, Any]]) -> set[str]:
    """Embeddings whose next probed module (other embeddings skipped) is a normalization layer,
    which rescales them: a table of std 0.02 (``E[y^2] = 4e-4``, GPT-2's, Llama's, the small tied
    table :func:`initlab.init_model` draws) is no vanishing signal there."""
    out: set[str] = set()
    waiting: list[str] = []
    for r in _in_order(probe_table):
        kind = str(r["module_type"] or "")
        if "Embedding" in kind:
            waiting.append(r["layer"])
            continue
        if "Norm" in kind:
            out.update(waiting)
        waiting = []
    return out


def _nonfinite_counts(probe_rows: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """``{layer: {"x"|"y"|"dy"|"dx": batch-calls with NaN/inf}}`` from the probe's long rows."""
    out: dict[str, dict[str, int]] = {}
    for r in probe_rows:
        keep = r["stat"] == "nonfinite" and r["call"] == "all" and r["quantity"] in _ACT_QUANTITIES
        if keep and r["value"] > 0:
            d = out.setdefault(r["layer"], {})
            d[r["quantity"]] = d.get(r["quantity"], 0) + int(r["value"])
    return out


_ACT_QUANTITIES = ("x", "y", "dy", "dx")


def _signal_findings(
    r: Mapping[str, Any],
    ratios: Mapping[str, tuple[float, str]],
    exempt: set[str],
    backward: Mapping[str, tuple[float, float, str]],
    *,
    nonfinite: Mapping[str, Mapping[str, int]] | None,
    input_off: bool = False,
) -> list[dict[str, Any]]:
    """A module's ``non_finite``, ``vanishing_``/``exploding_signal`` and ``_gradient``
    findings. With the network's input off scale (``input_off``: its own ``input_scale``
    finding), a module judged from that input is flagged only where both its ``E[y^2]`` and its
    gain from the input are off scale: a layer of gain 2 on an input of 1e6 carries the input's
    scale, and one that brought such an input back to 1 did its job."""
    out = []
    layer, mtype = r["layer"], r["module_type"]
    name = layer or "<root>"
    if nonfinite is not None:
        counts = nonfinite.get(layer, {})
        fwd = {q: c for q, c in counts.items() if q in ("x", "y")}
        bwd = {q: c for q, c in counts.items() if q in ("dy", "dx")}
        for kind, part in (("activations", fwd), ("gradients", bwd)):
            if part:
                listing = ", ".join(f"{q}: {c}" for q, c in part.items())
                out.append(
                    _finding(layer, mtype, "non_finite", "bad", float(sum(part.values())),
                             f"non-finite {kind} in {name} (batch-calls with NaN/inf, left out "
                             f"of the moments: {listing})")
                )  # fmt: skip
    elif r.get("nonfinite", 0) and r["nonfinite"] > 0:
        out.append(
            _finding(layer, mtype, "non_finite", "bad", float(r["nonfinite"]),
                     f"non-finite activations or gradients in {name} ({int(r['nonfinite'])} "
                     "batch-call tensor(s) with NaN/inf, left out of the moments)")
        )  # fmt: skip

    # after a normalization a small signal is a residual branch's output by design (GPT-2's
    # scaled projections), and the next normalization resets the scale: warn, with that reason
    ratio, ref = ratios.get(layer, (math.nan, ""))

    def check(value: Any, what: str, low_rule: str, high_rule: str, where: str) -> bool:
        if not _off_scale(value):
            return False
        low = value < SIGNAL_LOW
        bound = f"< {SIGNAL_LOW:g}" if low else f"> {SIGNAL_HIGH:g}"
        soft = low and where == "signal" and bool(ref)
        out.append(
            _finding(layer, mtype, low_rule if low else high_rule, "warn" if soft else "bad",
                     value, f"{what} = {value:.3g} {bound}: the {where} "
                     + ("vanishes" if low else "explodes") + " here" + (_BRANCH if soft else ""))
        )  # fmt: skip
        return True

    # A normalization sets its output's scale itself: its ratio to the network's input is no
    # gain through depth (a LayerNorm after a 0.02-std embedding is "x2600" by design); an
    # embedding that feeds one is rescaled by it.
    what = (f"E[y^2] / E[y^2] of {ref} (the normalization before it)" if ref
            else "E[y^2] / E[x^2] of the network's input")  # fmt: skip
    if layer in exempt:
        pass
    elif input_off and not ref:
        if _off_scale(r.get("E_y2")) and "Norm" not in mtype:
            check(ratio, what, "vanishing_signal", "exploding_signal", "signal")
    elif (
        not check(r.get("E_y2"), "E[y^2]", "vanishing_signal", "exploding_signal", "signal")
        and "Norm" not in mtype
    ):  # the absolute value first (it is flagged alone), then the gain
        check(ratio, what, "vanishing_signal", "exploding_signal", "signal")
    if layer in backward:
        gain, share, gated = backward[layer]
        what = "||dx||^2 / ||dy||^2 of the last module's output (the end-to-end backward gain)"
        if gain < SIGNAL_LOW and share < 1.0:  # over what recurrent gates pass at any init
            what = (f"{what} / {share:.3g}, the share the gates of {gated} pass at init "
                    "(sigmoid(0) = 1/2: 1/16 per LSTM layer, 1/4 per GRU layer)")  # fmt: skip
            gain = min(gain / share, 1.0)
        check(gain, what, "vanishing_gradient", "exploding_gradient", "gradient")
    return out
