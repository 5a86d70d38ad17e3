r"""``initlab.diagnose``: is this network well-conditioned at step zero, where not, and why?

::

    report = initlab.diagnose(model, loader, loss_fn)   # loss_fn(model, batch) -> scalar
    print(report.summary())                              # one verdict per layer, with reasons
    report.to_pandas()                                   # every number, one tidy schema
    report.save_html("diagnosis.html")                   # one self-contained file with plots

One pass over up to ``max_batches`` batches (forward + backward each, under the moment probe and a
few cheap hooks) gives the second moments, gains, GR scaling ``gamma`` (via
:func:`initlab.gr_scaling`), weight-to-gradient ratios ``nu``, weight magnitudes and
the spread of gradients across batches, dead ReLU units and activation input scales. Then, without
more passes over the data: the spectra of the weights and the convolutions' true operator norms
(:mod:`~initlab.diagnostics.spectra`) and the scaling linter (:mod:`~initlab.diagnostics.linter`;
one forward of the traced graph if the model calls sigmoid/tanh/ReLU functionally). Optional:
Hessian/GGN blocks and theory vs actual (``curvature=True``, :mod:`initlab.measure.curvature`; costs
several Hessian-vector products per block), a loss landscape to embed (``landscape=``).

The model is never changed: parameters and buffers (BatchNorm running statistics) are restored
bitwise, train/eval modes and every ``param.grad`` are as before, and so are the global random
number generators. The report's schema, quantities and verdict rules are documented in
:mod:`initlab.diagnostics.report`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from initlab._core.data import take_batches
from initlab._core.loss import LOSSES, NamedLoss, default_loss, make_loss
from initlab._core.preserve import preserved_state
from initlab._core.rng import as_generator
from initlab._core.rows import Rows
from initlab.cli.inputs import load_data_spec, load_factory, load_model_spec
from initlab.diagnostics.gradients import GradientStats
from initlab.diagnostics.linter import (
    ActivationWatch,
    LintResult,
    _user_blocks,
    lint_model,
    signal_ratios,
)
from initlab.diagnostics.report import (
    DIAGNOSTIC_COLUMNS,
    LAYER_COLUMNS,
    Report,
    imbalance_summary,
    ratio_reason,
    ratio_verdict,
    worst,
)
from initlab.diagnostics.spectra import InputShapes, layer_spectra, lipschitz_bounds
from initlab.measure.probe import MomentProbe

__all__ = [
    "LOSSES",
    "NamedLoss",
    "default_loss",
    "diagnose",
    "diagnose_command",
    "diagnose_demo",
    "make_loss",
]

Progress = Callable[[str], None]
_NAN = math.nan


# ----------------------------------------------------------------------------- helpers


def _forward_args(batch: Any) -> tuple[tuple, dict]:
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, Mapping):
        return (), dict(batch)
    return (batch[0],), {}


def _examples(batch: Any) -> int:
    from initlab._core.data import batch_size

    try:
        return batch_size(batch)
    except (StopIteration, IndexError, TypeError):
        return 0


def _weight_names(model: nn.Module) -> set[tuple[str, str]]:
    from initlab.init.registry import default_registry

    reg = default_registry()
    out = set()
    for name, m in model.named_modules():
        specs = reg.specs(m)
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


# ----------------------------------------------------------------------------- diagnose


def diagnose(
    model: nn.Module,
    data: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    *,
    max_batches: int = 4,
    per_example: bool | Literal["auto"] = "auto",
    modules: Any = "params",
    loss_reduction: Literal["mean", "sum"] = "mean",
    batch_dim: int | None = None,
    alpha: Any = None,
    gradients: bool = True,
    spectra: bool = True,
    lint: bool = True,
    curvature: bool = False,
    curvature_options: Mapping[str, Any] | None = None,
    residual_blocks: Sequence[str | Mapping[str, Any]] | None = None,
    landscape: Any = None,
    generator: int | torch.Generator | None = 0,
    name: str | None = None,
    progress: Progress | None = None,
) -> Report:
    """Diagnose the conditioning of ``model`` layer by layer on ``data``.

    Args:
        model: any ``nn.Module``; never modified (see the module docstring).
        data: one batch (a tensor, or a tuple/list/dict of tensors) or an iterable of batches (a
            ``DataLoader``); at most ``max_batches`` are used.
        loss_fn: ``loss_fn(model, batch) -> scalar``; default :func:`default_loss` (cross-entropy
            or MSE on ``(x, y)`` batches).
        max_batches: batches taken from ``data``; the gradient spread across minibatches needs 2
            or more.
        per_example: exact per-example gradients for ``nu`` (the probe's ``dW_example``); without
            them ``nu`` is the minibatch ratio. ``"auto"`` (default): on, except when a BatchNorm
            is in train mode (it couples the examples, so per-example gradients are undefined
            for every parameter and computing them would be wasted work).
        modules: which modules the probe hooks (:class:`~initlab.MomentProbe`'s
            ``modules``: ``"params"``, the default, gives a row for every module that owns a
            parameter; ``"weights"`` hooks only modules with a registry role-"weight" parameter,
            which is all gamma and nu need and cheaper; names or a predicate also work).
        loss_reduction: how ``loss_fn`` reduces over the batch (``"mean"`` or ``"sum"``).
        batch_dim: the probe's ``batch_dim`` (default 0, 1 for ``batch_first=False`` modules).
        alpha: conditioning multipliers passed to :func:`initlab.gr_scaling`.
        gradients: weight magnitudes and gradient spread across batches (GradInit).
        spectra: singular values, convolution operator norms and Lipschitz bounds.
        lint: the scaling linter (Table 1), dead ReLUs, vanishing/exploding signals.
        curvature: Hessian block averages and theory vs actual (``initlab.measure.curvature``) on
            the first batch (the full block map, Figure 1, and theory vs actual, Figure 2);
            ``curvature_options`` go to both calls (e.g. ``kind="ggn"``, ``probes=``), plus
            ``loss_fn``/``forward`` to split the loss for the GGN when ``loss_fn`` is not a
            :class:`NamedLoss` (otherwise the Hessian of ``loss_fn(model, batch)`` is used).
        residual_blocks: declare residual blocks (module names, or dicts with ``name``,
            ``branch``, ``shortcut``); default: found by the linter.
        landscape: a ``Landscape`` (from :func:`initlab.loss_landscape`) to embed, or
            ``True`` / a dict of its options (``grid=``, ``directions=``, ``bn=``) to compute
            one on the batches used here (filter-normalized random directions by default).
        generator: seed (or generator) for power iterations and curvature probes.
        name: the model's name in the report (default: its class name).
        progress: called with a short message at each stage (e.g. for a CLI).

    Returns:
        a :class:`~initlab.diagnostics.report.Report`.
    """
    say = progress or (lambda _msg: None)
    batches = take_batches(data, max_batches, exact=False, what="diagnose")
    loss_fn = loss_fn or default_loss
    generator = as_generator(generator)
    timings: dict[str, float] = {}
    notes: list[str] = []
    tables: dict[str, Rows] = {}
    params = list(model.parameters())
    if per_example == "auto":
        coupled = [
            n
            for n, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
            and (m.training or not m.track_running_stats)
        ]
        per_example = not coupled
        if coupled:
            notes.append(
                f"per-example ν not computed: BatchNorm in train mode ({coupled[0]}"
                + (f" and {len(coupled) - 1} more" if len(coupled) > 1 else "")
                + ") couples the examples; ν is the minibatch ratio"
            )

    # -- one pass over the batches: probe, shapes, activations, gradients
    start = time.perf_counter()
    if modules == "weights":
        owners = {layer for layer, _ in _weight_names(model)}
        modules = [n for n, _ in model.named_modules() if n in owners]
    probe = MomentProbe(
        model,
        modules=modules,
        per_example=per_example,
        loss_reduction=loss_reduction,
        batch_dim=batch_dim,
    )
    grad_acc = GradientStats(model) if gradients else None
    shapes = InputShapes(model) if spectra else None
    watch = ActivationWatch(model) if lint else None
    losses: list[float] = []
    with preserved_state(model), ExitStack() as stack:
        stack.enter_context(probe)
        for ctx in (shapes, watch):
            if ctx is not None:
                stack.enter_context(ctx)
        for i, batch in enumerate(batches):
            say(f"batch {i + 1}/{len(batches)}: forward + backward under the probe")
            for p in params:
                p.grad = None
            loss = loss_fn(model, batch)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise ValueError("loss_fn(model, batch) must return a scalar tensor")
            losses.append(float(loss.detach()))
            loss.backward()
            if grad_acc is not None:
                grad_acc.update()
    timings["pass_s"] = time.perf_counter() - start
    if not all(math.isfinite(v) for v in losses):
        notes.append(f"non-finite loss in {sum(not math.isfinite(v) for v in losses)} batch(es)")
    probe_table = probe.table()
    param_table = probe.param_table()
    tables["probe"] = probe_table
    tables["params"] = param_table
    by_reason: dict[str, list[str]] = {}
    for n in probe.notes:
        label, _, why = n.partition(": ")
        by_reason.setdefault(why, []).append(label)
    for why, labels in by_reason.items():
        shown = ", ".join(labels[:4]) + (f" and {len(labels) - 4} more" if len(labels) > 4 else "")
        notes.append(f"per-example ν unavailable for {shown}: {why}")

    # -- GR scaling
    gr: Rows | None = None
    cond_imbalance: Any = None
    try:
        from initlab.measure.conditioning import gr_scaling, imbalance
    except ImportError as err:
        notes.append(f"γ not computed: initlab.measure.conditioning is not available ({err})")
    else:
        try:
            examples = sum(_examples(b) for b in batches)
            use = examples if batch_dim in (None, 0) and examples > 0 else None
            gr = gr_scaling(probe, model, alpha=alpha, examples=use)
            tables["gr_scaling"] = gr
            cond_imbalance = imbalance(gr)
        except Exception as err:  # the rest of the report stays useful
            notes.append(f"γ not computed: gr_scaling failed ({type(err).__name__}: {err})")
    if grad_acc is not None:
        tables["gradients"] = grad_acc.rows()

    # -- spectra
    spectra_rows: Rows | None = None
    if spectra:
        say("spectra: SVDs and convolution operator norms")
        start = time.perf_counter()
        spectra_rows = layer_spectra(model, shapes, generator=generator)
        tables["spectra"] = spectra_rows
        timings["spectra_s"] = time.perf_counter() - start

    # -- linter
    lint_result: LintResult | None = None
    blocks: list[dict[str, Any]] = []
    if lint:
        say("linter: tracing the model, checking Table 1")
        start = time.perf_counter()
        lint_result = lint_model(
            model,
            probe_table=probe_table,
            probe_rows=probe.rows(),
            param_table=param_table,
            activations=watch,
            forward_args=[_forward_args(b) for b in batches],
            residual_blocks=residual_blocks,
        )
        blocks = lint_result.residual_blocks
        tables["activations"] = lint_result.activations
        timings["lint_s"] = time.perf_counter() - start
        if not lint_result.traced:
            notes.append(f"torch.fx could not trace the model: {lint_result.trace_error}")
    elif residual_blocks is not None:
        blocks = _user_blocks(model, residual_blocks)
    findings = lint_result.findings if lint_result else Rows([], title="scaling linter")

    lipschitz: dict[str, Any] = {}
    if spectra_rows is not None:
        covered = {r["layer"] for r in spectra_rows if math.isfinite(r["op_norm"])}
        uncovered = [
            n
            for n, m in model.named_modules()
            if next(m.parameters(recurse=False), None) is not None and n not in covered
        ]
        lipschitz = lipschitz_bounds(spectra_rows, blocks, uncovered=uncovered)

    # -- curvature
    if curvature:
        say("curvature: Hessian blocks and theory vs actual")
        start = time.perf_counter()
        _curvature(model, batches[0], loss_fn, curvature_options, generator, tables, notes)
        timings["curvature_s"] = time.perf_counter() - start

    if landscape is True or isinstance(landscape, Mapping):
        say("loss landscape")
        start = time.perf_counter()
        opts = dict(landscape) if isinstance(landscape, Mapping) else {}
        landscape = _landscape(model, batches, loss_fn, opts, generator, notes)
        timings["landscape_s"] = time.perf_counter() - start
    if landscape is not None:
        to_rows = getattr(landscape, "to_rows", None)
        if callable(to_rows):
            got = to_rows()
            tables["landscape"] = got if isinstance(got, Rows) else Rows(got, title="landscape")

    say("building the report")
    rows, layers, imb = _assemble(
        model, probe_table, param_table, gr, tables, findings, lint_result
    )
    if cond_imbalance is not None:
        imb["conditioning"] = cond_imbalance
    meta = {
        "model": name or type(model).__name__,
        "batches": len(batches),
        "examples": sum(_examples(b) for b in batches),
        "loss": losses,
        "options": {
            "max_batches": max_batches,
            "per_example": per_example,
            "loss_reduction": loss_reduction,
            "gradients": gradients,
            "spectra": spectra,
            "lint": lint,
            "curvature": curvature,
        },
        "imbalance": imb,
        "lipschitz": lipschitz,
        "residual_blocks": [
            {k: b.get(k) for k in ("name", "branch", "shortcut", "source")} for b in blocks
        ],
        "traced": bool(lint_result and lint_result.traced),
        "notes": notes,
        "timings": timings,
    }
    obj = landscape if landscape is not None and hasattr(landscape, "to_rows") else None
    return Report(rows, layers, findings, tables, meta, landscape=obj)


def _curvature(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    options: Mapping[str, Any] | None,
    generator: torch.Generator | None,
    tables: dict[str, Rows],
    notes: list[str],
) -> None:
    try:
        from initlab.measure.curvature import block_curvature, theory_vs_actual
    except ImportError as err:
        notes.append(f"curvature not computed: initlab.measure.curvature is not available ({err})")
        return
    opts = dict(options or {})
    explicit = "loss_fn" in opts
    outputs_loss, forward = _split_loss(loss_fn, opts)
    if opts.get("kind", "hessian") == "ggn" and not explicit and not isinstance(loss_fn, NamedLoss):
        notes.append(
            "curvature not computed: the GGN needs the loss as a function of the outputs; pass "
            "curvature_options={'loss_fn': fn(outputs, batch), 'forward': ...} or a loss from "
            "make_loss()"
        )
        return
    for key, fn in (("curvature", block_curvature), ("theory_vs_actual", theory_vs_actual)):
        try:
            with preserved_state(model):
                kw = dict(opts)
                kw.setdefault("generator", generator)
                if key == "curvature":
                    kw.setdefault("full_matrix", True)  # the Figure 1 heat map, same products
                got = fn(model, batch, outputs_loss, forward=forward, **kw)
            tables[key] = got if isinstance(got, Rows) else Rows(got, title=key)
        except Exception as err:  # report what failed, keep the rest
            notes.append(f"{key} not computed: {type(err).__name__}: {err}")


def _split_loss(
    loss_fn: Callable[[nn.Module, Any], torch.Tensor], opts: dict[str, Any]
) -> tuple[Callable[[Any, Any], torch.Tensor], Callable[[nn.Module, Any], Any]]:
    """``(outputs_loss, forward)`` for the curvature and landscape modules, which take the loss as
    a function of the outputs: from ``opts`` (popped), a :class:`NamedLoss`, or, for any other
    ``loss_fn``, "outputs" that are the loss itself (exact for the Hessian and for loss values;
    not for the GGN)."""
    outputs_loss = opts.pop("loss_fn", None)
    forward = opts.pop("forward", None)
    if outputs_loss is None and isinstance(loss_fn, NamedLoss):
        return loss_fn.outputs_loss, forward or loss_fn.forward
    if outputs_loss is not None:
        return outputs_loss, forward or NamedLoss.forward

    def whole(m: nn.Module, b: Any) -> torch.Tensor:
        return loss_fn(m, b)

    def identity(out: torch.Tensor, b: Any) -> torch.Tensor:
        return out

    return identity, whole


def _landscape(
    model: nn.Module,
    batches: list[Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    opts: dict[str, Any],
    generator: torch.Generator | None,
    notes: list[str],
) -> Any:
    try:
        from initlab.measure.landscape import loss_landscape
    except ImportError as err:
        notes.append(f"landscape not computed: initlab.measure.landscape is not available ({err})")
        return None
    outputs_loss, forward = _split_loss(loss_fn, opts)
    opts.setdefault("generator", generator)
    try:
        with preserved_state(model):
            return loss_landscape(model, batches, outputs_loss, forward=forward, **opts)
    except Exception as err:  # report what failed, keep the rest
        notes.append(f"landscape not computed: {type(err).__name__}: {err}")
        return None


def _assemble(
    model: nn.Module,
    probe_table: Rows,
    param_table: Rows,
    gr: Rows | None,
    tables: Mapping[str, Rows],
    findings: Rows,
    lint_result: LintResult | None,
) -> tuple[Rows, Rows, dict[str, Any]]:
    """Long rows, the per-layer table with verdicts, and the imbalance summary."""
    named = dict(model.named_modules())
    index = _definition_index(model)
    weights = _weight_names(model)
    info: dict[str, dict[str, Any]] = {}  # layer -> module_type, order

    def meta(layer: str, module_type: str | None = None, order: Any = None) -> dict[str, Any]:
        d = info.setdefault(layer, {"module_type": module_type, "order": order})
        if d["module_type"] is None:
            base = layer.partition("@")[0]
            d["module_type"] = module_type or (type(named[base]).__name__ if base in named else "")
        if d["order"] is None and order is not None:
            d["order"] = order
        return d

    rows: list[dict[str, Any]] = []

    def add(
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
        d = meta(layer, module_type)
        v = float(value) if isinstance(value, (int, float)) and value is not None else _NAN
        rows.append(
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

    # per module: moments and gains
    ratios = signal_ratios(probe_table)
    for r in probe_table:
        meta(r["module"], r["module_type"], r["order"])
        for q in ("E_x2", "E_y2", "E_dy2", "E_dx2", "gain_fwd", "gain_bwd", "cum_gain_fwd",
                  "cum_gain_bwd", "nonfinite"):  # fmt: skip
            add(r["module"], "", q, r[q])
        add(r["module"], "", "signal_fwd", ratios.get(r["module"], _NAN))

    # per parameter: W, dW, nu
    grads = {(r["layer"], r["param"]): r for r in tables.get("gradients", ())}
    nus: dict[str, tuple[float, str]] = {}  # weight layer -> (nu used, which)
    wnames: dict[str, str] = {}
    for layer, param in sorted(weights):
        wnames.setdefault(layer, param)
    for r in param_table:
        layer, param = r["module"], r["param"]
        note = r["note"]
        add(layer, param, "E_W2", r["E_W2"])
        add(layer, param, "E_dW2", r["E_dW2"])
        add(layer, param, "E_dW2_example", r["E_dW2_example"], note=note)
        nu = r["ratio"]
        nu_mb = r["E_dW2"] / r["E_W2"] if r["E_W2"] else _NAN
        g = grads.get((layer, param))
        se = g["E_dW2_stderr"] / r["E_W2"] if g is not None and r["E_W2"] else _NAN
        add(layer, param, "nu", nu, note=note)
        add(layer, param, "nu_minibatch", nu_mb, stderr=se)
        if wnames.get(layer) == param and layer not in nus:
            if math.isfinite(nu) and nu > 0:
                nus[layer] = (nu, "per-example")
            elif math.isfinite(nu_mb) and nu_mb > 0:
                nus[layer] = (nu_mb, "minibatch")

    # gamma
    gammas: dict[str, float] = {}
    gamma_rel: dict[str, float] = {}
    for r in gr or ():
        layer = r["module"]
        meta(layer, r.get("module_type"))
        gw, gb = r.get("gamma_w", _NAN), r.get("gamma_b", _NAN)
        if gw is not None and math.isfinite(gw):
            gammas[layer] = gw
        if gb is not None:
            add(layer, "bias", "gamma", gb)
        rel = r.get("gamma_rel_median")
        if rel is not None and math.isfinite(rel):
            gamma_rel[layer] = rel
    if gammas and len(gamma_rel) < len(gammas):
        med = _median_pos(gammas.values())
        gamma_rel = {k: v / med for k, v in gammas.items()} if math.isfinite(med) else {}
    for layer, gw in gammas.items():
        rel = gamma_rel.get(layer, _NAN)
        v = ratio_verdict(rel)
        note = ratio_reason("γ", rel) if v in ("warn", "bad") else ""
        add(layer, "weight", "gamma", gw, verdict=v, note=note)
        add(layer, "weight", "gamma_rel_median", rel, verdict=v, note=note)
    nu_med = _median_pos(v for v, _ in nus.values())
    nu_rel = {k: v / nu_med for k, (v, _) in nus.items()} if math.isfinite(nu_med) else {}
    for layer, rel in nu_rel.items():
        v = ratio_verdict(rel)
        note = f"{nus[layer][1]} ν" + (
            f"; {ratio_reason('ν', rel)}" if v in ("warn", "bad") else ""
        )
        add(layer, wnames[layer], "nu_rel_median", rel, verdict=v, note=note)

    # gradients (GradInit)
    for r in tables.get("gradients", ()):
        for q in ("W_norm", "W_abs_mean", "grad_norm", "grad_std"):
            add(r["layer"], r["param"], q, r[q])

    # spectra
    for r in tables.get("spectra", ()):
        if r["param"]:
            add(r["layer"], r["param"], "sv_max", r["sv_max"], note=r["note"])
            add(r["layer"], r["param"], "sv_mean", r["sv_mean"])
        add(r["layer"], r["param"], "op_norm", r["op_norm"], note=r["op_method"])

    # activations
    for r in tables.get("activations", ()):
        layer = r["layer"]
        meta(layer, r["module_type"])
        if r["kind"] == "relu":
            add(layer, "", "dead_frac", r["dead_frac"])
            add(layer, "", "dead_channel_frac", r["dead_channel_frac"])
        add(layer, "", "act_input_std", r["input_std"])

    # curvature
    for r in tables.get("curvature", ()):
        if r.get("block_row") == r.get("block_col"):
            layer, param = _split_param(str(r["block_row"]), named)
            add(layer, param, "curv_block", r.get("value"), stderr=r.get("stderr", _NAN))
    for r in tables.get("theory_vs_actual", ()):
        if "module" in r and "param" in r:
            layer, param = r["module"], r["param"]
        else:
            layer, param = _split_param(str(r.get("block", "")), named)
        add(layer, param, "curv_theory_ratio", r.get("ratio"), stderr=r.get("ratio_stderr", _NAN))

    # linter findings
    by_layer: dict[str, list[dict[str, Any]]] = {}
    for f in findings:
        sev = f["severity"]
        verdict = sev if sev in ("warn", "bad") else "ok"
        add(f["layer"], "", f"lint:{f['rule']}", f["value"], verdict=verdict, note=f["message"],
            module_type=f["module_type"] or None)  # fmt: skip
        by_layer.setdefault(f["layer"], []).append(f)

    # verdicts
    probed = {r["module"] for r in probe_table}
    flagged = {f["layer"] for f in findings if f["severity"] in ("warn", "bad")}
    layer_names = sorted(
        {r["layer"] for r in rows if r["layer"] != "" or "" in probed | flagged},
        key=lambda n: _sort_key(n, index),
    )
    wide: list[dict[str, Any]] = []
    pivot: dict[tuple[str, str, str], float] = {(r["layer"], r["param"], r["quantity"]): r["value"]
                                                for r in rows}  # fmt: skip
    for layer in layer_names:
        reasons: list[tuple[str, str]] = []
        rel = gamma_rel.get(layer, _NAN)
        if layer in gammas and math.isfinite(rel):
            v = ratio_verdict(rel)
            if v in ("warn", "bad"):
                reasons.append((v, ratio_reason("γ", rel)))
        elif layer in nu_rel:
            v = ratio_verdict(nu_rel[layer])
            if v in ("warn", "bad"):
                reasons.append((v, ratio_reason("ν", nu_rel[layer])))
        for f in by_layer.get(layer, ()):
            if f["severity"] in ("warn", "bad"):
                reasons.append((f["severity"], _short_reason(f)))
        reasons.sort(key=lambda t: t[0] != "bad")
        verdict = worst(v for v, _ in reasons)
        reason = "; ".join(dict.fromkeys(t for _, t in reasons))
        add(layer, "", "verdict", _NAN, verdict=verdict, note=reason)
        wname = wnames.get(layer, "weight")

        def pv(q: str, param: str = "", layer: str = layer) -> float:
            return pivot.get((layer, param, q), _NAN)

        d = info[layer]
        shape = next(
            (r["shape"] for r in param_table if r["module"] == layer and r["param"] == wname),
            None,
        )
        wide.append(
            {
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
                "gamma_w": gammas.get(layer, _NAN),
                "gamma_b": pv("gamma", "bias"),
                "gamma_rel_median": gamma_rel.get(layer, _NAN),
                "nu": pv("nu", wname),
                "nu_minibatch": pv("nu_minibatch", wname),
                "nu_rel_median": nu_rel.get(layer, _NAN),
                "W_abs_mean": pv("W_abs_mean", wname),
                "grad_std": pv("grad_std", wname),
                "op_norm": pivot.get((layer, wname, "op_norm"), pv("op_norm")),
                "sv_mean": pv("sv_mean", wname),
                "dead_frac": pv("dead_frac"),
                "verdict": verdict,
                "reason": reason,
            }
        )
    imb = imbalance_summary(
        {
            k: {"gamma": gammas.get(k, _NAN), "nu": nus[k][0] if k in nus else _NAN}
            for k in {*gammas, *nus}
        }
    )
    return (
        Rows(rows, DIAGNOSTIC_COLUMNS, title="diagnosis (long rows)"),
        Rows(wide, LAYER_COLUMNS, title="diagnosis per layer"),
        imb,
    )


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


# ----------------------------------------------------------------------------- CLI and demo


def diagnose_command(
    model_spec: str,
    data: str | None = None,
    loss: str | None = None,
    out: str | Path | None = None,
    *,
    model_kwargs: str | Mapping[str, Any] | None = None,
    init: str | None = None,
    batch_size: int = 64,
    batches: int = 4,
    seed: int = 0,
    curvature: bool = False,
    plots: bool = True,
    progress: Progress | None = None,
    **options: Any,
) -> Report:
    """What ``initlab diagnose --model ... [--data ...] [--loss ...] [--out DIR]`` runs.

    Args:
        model_spec: ``"pkg.module:factory"``, ``"path/file.py:factory"`` or ``"zoo:NAME"`` (a
            model of :mod:`initlab.zoo`, whose input shape is then known).
        data: ``None``/``"random"`` (standard normal inputs of the zoo model's input shape),
            ``"random:3x32x32"`` (that shape per example), ``"digits"`` (scikit-learn's digits,
            standardized), a ``.pt`` file (a batch, a tuple ``(x, y)``, or a list of batches; a big
            batch is split into ``batch_size`` pieces), or ``"pkg.module:fn"`` returning a batch
            or an iterable of batches.
        loss: a name of :data:`LOSSES` or ``"pkg.module:fn"`` (``fn(model, batch) -> scalar``);
            default ``"auto"`` for data with targets, ``"random_quadratic"`` without.
        out: a folder: ``report.html`` (self-contained), ``report.json``, ``report.md``,
            ``summary.txt`` are written there.
        model_kwargs: keyword arguments of the factory (a dict or a JSON object string).
        init: initialize first with this scheme (``initlab.init_model(model, init,
            generator=seed)``); default: keep the factory's initialization.
        batch_size: examples per batch (random data, digits, a big ``.pt`` batch).
        batches: number of batches.
        seed: seeds the data, the init and the random loss.
        curvature: also compute Hessian blocks and theory vs actual.
        plots: embed plots in the HTML (needs matplotlib).
        progress: called with a short message at each stage.
        **options: passed to :func:`diagnose`.

    Returns:
        the report (also written to ``out``).
    """
    say = progress or (lambda _msg: None)
    say(f"building the model {model_spec}")
    model, shape = load_model_spec(model_spec, model_kwargs)
    if init is not None:
        from initlab.init.model import init_model

        say(f"initializing with {init!r} (seed {seed})")
        init_model(model, init, generator=seed)
    say("loading data")
    data_batches = load_data_spec(data, shape, batch_size=batch_size, batches=batches, seed=seed)
    has_targets = isinstance(data_batches[0], (tuple, list)) and len(data_batches[0]) >= 2
    loss_name = loss or ("auto" if has_targets else "random_quadratic")
    if ":" in loss_name and loss_name not in LOSSES:
        loss_fn = load_factory(loss_name)
    else:
        loss_fn = make_loss(loss_name, seed=seed)
    name = model_spec[4:] if model_spec.startswith("zoo:") else model_spec
    report = diagnose(
        model,
        data_batches,
        loss_fn,
        max_batches=batches,
        curvature=curvature,
        name=name,
        progress=say,
        **options,
    )
    report.meta["command"] = {
        "model": model_spec, "data": data or "random", "loss": loss_name, "init": init,
        "batch_size": batch_size, "batches": batches, "seed": seed,
    }  # fmt: skip
    if out is not None:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        say(f"writing {folder}/report.html, report.json, report.md, summary.txt")
        report.save_html(folder / "report.html", plots=plots)
        (folder / "report.json").write_text(report.to_json(indent=1), encoding="utf-8")
        (folder / "report.md").write_text(report.to_markdown(), encoding="utf-8")
        (folder / "summary.txt").write_text(report.summary() + "\n", encoding="utf-8")
    return report


def compare_reports(reports: Mapping[str, Report]) -> Rows:
    """One row per report: γ and ν max/min over weights and the verdict counts.

    Columns: ``scheme, gamma_max_over_min, nu_max_over_min, ok, warn, bad, worst_layer``.
    """
    out = []
    for label, rep in reports.items():
        imb = rep.meta.get("imbalance", {})
        counts = {v: sum(1 for r in rep.layers if r["verdict"] == v) for v in ("ok", "warn", "bad")}
        out.append(
            {
                "scheme": label,
                "gamma_max_over_min": imb.get("gamma_max_over_min", _NAN),
                "nu_max_over_min": imb.get("nu_max_over_min", _NAN),
                **counts,
                "worst_layer": imb.get("gamma_argmax") or imb.get("nu_argmax") or "",
            }
        )
    return Rows(out, title="conditioning by scheme (max/min over weights; 1 = balanced)")


def diagnose_demo(
    schemes: Sequence[str] = ("fan_in", "fan_out", "arithmetic", "geometric"),
    *,
    seed: int = 0,
    batch_size: int = 256,
    batches: int = 4,
    out: str | Path | None = None,
    progress: Progress | None = None,
) -> tuple[dict[str, Report], Rows]:
    """``initlab demo``'s diagnosis part: the paper MLP on digits, one report per scheme.

    Builds Defazio & Bottou's MLP (64 → 384 → 64 → 10, ReLU), initializes it with each scheme
    (``generator=seed``), and diagnoses it on ``batches`` batches of scikit-learn's digits with a
    cross-entropy loss. With ``out``: ``<scheme>.html`` per scheme and ``gamma_nu.png``, the
    schemes' γ and ν side by side.

    Returns:
        ``({scheme: report}, compare_reports(...))``.
    """
    from initlab.cli.demo import load_digits_tensors
    from initlab.init.model import init_model
    from initlab.zoo.paper_mlp import PaperMLP

    say = progress or (lambda _msg: None)
    x, y = load_digits_tensors()
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(x), generator=gen)
    data = [
        (x[perm[i : i + batch_size]], y[perm[i : i + batch_size]])
        for i in range(0, min(len(x), batch_size * batches), batch_size)
    ]
    reports: dict[str, Report] = {}
    for scheme in schemes:
        say(f"diagnosing the paper MLP initialized with {scheme!r}")
        model = PaperMLP(x.shape[1], 10)
        init_model(model, scheme, generator=seed)
        rep = diagnose(model, data, make_loss("cross_entropy"), max_batches=batches,
                       name=f"PaperMLP ({scheme})")  # fmt: skip
        rep.meta["scheme"] = scheme
        reports[scheme] = rep
    table = compare_reports(reports)
    if out is not None:
        from initlab.diagnostics.plots import plot_gamma_nu

        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        for scheme, rep in reports.items():
            rep.save_html(folder / f"{scheme}.html")
        plot_gamma_nu(reports).savefig(folder / "gamma_nu.png", dpi=110)
    return reports, table
