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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
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
from initlab.diagnostics.assemble import _weight_names, assemble
from initlab.diagnostics.gradients import GradientStats
from initlab.diagnostics.linter import ActivationWatch, LintResult, lint_model
from initlab.diagnostics.report import Report
from initlab.diagnostics.residual import _user_blocks
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
    run = _Run(say)
    if per_example == "auto":
        per_example = _auto_per_example(model, run.notes)

    # -- one pass over the batches: probe, shapes, activations, gradients
    with run.timed("pass_s"):
        if modules == "weights":
            modules = _weight_modules(model)
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
        losses = _one_pass(model, batches, loss_fn, probe, grad_acc, (shapes, watch), say)
    probe_table, param_table = _probe_tables(probe, losses, run)

    gr, cond_imbalance = _gr_scaling(model, probe, batches, alpha, batch_dim, run)
    if grad_acc is not None:
        run.tables["gradients"] = grad_acc.rows()
    spectra_rows: Rows | None = None
    if spectra:
        say("spectra: SVDs and convolution operator norms")
        with run.timed("spectra_s"):
            spectra_rows = layer_spectra(model, shapes, generator=generator)
            run.tables["spectra"] = spectra_rows
    lint_result, blocks = _lint(model, probe, watch, batches, lint, residual_blocks, run)
    findings = lint_result.findings if lint_result else Rows([], title="scaling linter")
    lipschitz = _lipschitz(model, spectra_rows, blocks)
    if curvature:
        say("curvature: Hessian blocks and theory vs actual")
        with run.timed("curvature_s"):
            _curvature(model, batches[0], loss_fn, curvature_options, generator, run.tables,
                       run.notes)  # fmt: skip
    landscape = _landscape_stage(model, batches, loss_fn, landscape, generator, run)

    say("building the report")
    rows, layers, imb = assemble(model, probe_table, param_table, gr, run.tables, findings)
    if cond_imbalance is not None:
        imb["conditioning"] = cond_imbalance
    options = {
        "max_batches": max_batches,
        "per_example": per_example,
        "loss_reduction": loss_reduction,
        "gradients": gradients,
        "spectra": spectra,
        "lint": lint,
        "curvature": curvature,
    }
    meta = _meta(name or type(model).__name__, batches, losses, options, imb, lipschitz, blocks,
                 lint_result, run)  # fmt: skip
    obj = landscape if landscape is not None and hasattr(landscape, "to_rows") else None
    return Report(rows, layers, findings, run.tables, meta, landscape=obj)


# ----------------------------------------------------------------------------- diagnose's stages


class _Run:
    """What the stages of one :func:`diagnose` call share: progress, timings, notes, tables."""

    def __init__(self, say: Progress) -> None:
        self.say = say
        self.timings: dict[str, float] = {}
        self.notes: list[str] = []
        self.tables: dict[str, Rows] = {}

    @contextmanager
    def timed(self, key: str) -> Iterator[None]:
        """Record the block's wall time as ``timings[key]`` (not when it raised)."""
        start = time.perf_counter()
        yield
        self.timings[key] = time.perf_counter() - start


def _auto_per_example(model: nn.Module, notes: list[str]) -> bool:
    """``per_example="auto"``: off when a BatchNorm couples the examples (with a note)."""
    coupled = [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        and (m.training or not m.track_running_stats)
    ]
    if coupled:
        notes.append(
            f"per-example ν not computed: BatchNorm in train mode ({coupled[0]}"
            + (f" and {len(coupled) - 1} more" if len(coupled) > 1 else "")
            + ") couples the examples; ν is the minibatch ratio"
        )
    return not coupled


def _weight_modules(model: nn.Module) -> list[str]:
    """``modules="weights"``: the modules owning a registry role-"weight" parameter."""
    owners = {layer for layer, _ in _weight_names(model)}
    return [n for n, _ in model.named_modules() if n in owners]


def _one_pass(
    model: nn.Module,
    batches: list[Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    probe: MomentProbe,
    grad_acc: GradientStats | None,
    watchers: Iterable[Any],
    say: Progress,
) -> list[float]:
    """Forward + backward of every batch under the probe and the watchers; the model's state is
    restored afterwards. Returns the losses."""
    params = list(model.parameters())
    losses: list[float] = []
    with preserved_state(model), ExitStack() as stack:
        stack.enter_context(probe)
        for ctx in watchers:
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
    return losses


def _probe_tables(probe: MomentProbe, losses: list[float], run: _Run) -> tuple[Rows, Rows]:
    """The probe's module and parameter tables (kept in ``run.tables``), plus notes on
    non-finite losses and on parameters without per-example ν."""
    if not all(math.isfinite(v) for v in losses):
        run.notes.append(
            f"non-finite loss in {sum(not math.isfinite(v) for v in losses)} batch(es)"
        )
    probe_table = probe.table()
    param_table = probe.param_table()
    run.tables["probe"] = probe_table
    run.tables["params"] = param_table
    by_reason: dict[str, list[str]] = {}
    for n in probe.notes:
        label, _, why = n.partition(": ")
        by_reason.setdefault(why, []).append(label)
    for why, labels in by_reason.items():
        shown = ", ".join(labels[:4]) + (f" and {len(labels) - 4} more" if len(labels) > 4 else "")
        run.notes.append(f"per-example ν unavailable for {shown}: {why}")
    return probe_table, param_table


def _gr_scaling(
    model: nn.Module,
    probe: MomentProbe,
    batches: list[Any],
    alpha: Any,
    batch_dim: int | None,
    run: _Run,
) -> tuple[Rows | None, Any]:
    """γ (:func:`initlab.gr_scaling`) and its imbalance; ``None`` (with a note) where it fails."""
    try:
        from initlab.measure.conditioning import gr_scaling, imbalance
    except ImportError as err:
        run.notes.append(f"γ not computed: initlab.measure.conditioning is not available ({err})")
        return None, None
    gr: Rows | None = None
    try:
        examples = sum(_examples(b) for b in batches)
        use = examples if batch_dim in (None, 0) and examples > 0 else None
        gr = gr_scaling(probe, model, alpha=alpha, examples=use)
        run.tables["gr_scaling"] = gr
        return gr, imbalance(gr)
    except Exception as err:  # the rest of the report stays useful
        run.notes.append(f"γ not computed: gr_scaling failed ({type(err).__name__}: {err})")
        return gr, None


def _lint(
    model: nn.Module,
    probe: MomentProbe,
    watch: ActivationWatch | None,
    batches: list[Any],
    lint: bool,
    residual_blocks: Sequence[str | Mapping[str, Any]] | None,
    run: _Run,
) -> tuple[LintResult | None, list[dict[str, Any]]]:
    """The scaling linter (if ``lint``) and the residual blocks (found, or as declared)."""
    if not lint:
        blocks = _user_blocks(model, residual_blocks) if residual_blocks is not None else []
        return None, blocks
    run.say("linter: tracing the model, checking Table 1")
    with run.timed("lint_s"):
        lint_result = lint_model(
            model,
            probe_table=run.tables["probe"],
            probe_rows=probe.rows(),
            param_table=run.tables["params"],
            activations=watch,
            forward_args=[_forward_args(b) for b in batches],
            residual_blocks=residual_blocks,
        )
        run.tables["activations"] = lint_result.activations
    if not lint_result.traced:
        run.notes.append(f"torch.fx could not trace the model: {lint_result.trace_error}")
    return lint_result, lint_result.residual_blocks


def _lipschitz(
    model: nn.Module, spectra_rows: Rows | None, blocks: list[dict[str, Any]]
) -> dict[str, Any]:
    """Lipschitz bounds from the operator norms, naming the parameterized modules without one."""
    if spectra_rows is None:
        return {}
    covered = {r["layer"] for r in spectra_rows if math.isfinite(r["op_norm"])}
    uncovered = [
        n
        for n, m in model.named_modules()
        if next(m.parameters(recurse=False), None) is not None and n not in covered
    ]
    return lipschitz_bounds(spectra_rows, blocks, uncovered=uncovered)


def _landscape_stage(
    model: nn.Module,
    batches: list[Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    landscape: Any,
    generator: torch.Generator | None,
    run: _Run,
) -> Any:
    """Compute the loss landscape (``landscape=True`` or options) or take the given one; its
    rows go to ``run.tables["landscape"]``. Returns the landscape (or ``None``)."""
    if landscape is True or isinstance(landscape, Mapping):
        run.say("loss landscape")
        with run.timed("landscape_s"):
            opts = dict(landscape) if isinstance(landscape, Mapping) else {}
            landscape = _landscape(model, batches, loss_fn, opts, generator, run.notes)
    if landscape is not None:
        to_rows = getattr(landscape, "to_rows", None)
        if callable(to_rows):
            got = to_rows()
            run.tables["landscape"] = got if isinstance(got, Rows) else Rows(got, title="landscape")
    return landscape


def _meta(
    name: str,
    batches: list[Any],
    losses: list[float],
    options: dict[str, Any],
    imb: dict[str, Any],
    lipschitz: dict[str, Any],
    blocks: list[dict[str, Any]],
    lint_result: LintResult | None,
    run: _Run,
) -> dict[str, Any]:
    """The report's ``meta``."""
    return {
        "model": name,
        "batches": len(batches),
        "examples": sum(_examples(b) for b in batches),
        "loss": losses,
        "options": options,
        "imbalance": imb,
        "lipschitz": lipschitz,
        "residual_blocks": [
            {k: b.get(k) for k in ("name", "branch", "shortcut", "source")} for b in blocks
        ],
        "traced": bool(lint_result and lint_result.traced),
        "notes": run.notes,
        "timings": run.timings,
    }


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
