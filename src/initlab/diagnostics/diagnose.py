r"""``initlab.diagnose``: is this network well-conditioned at step zero, where not, and why?

::

    report = initlab.diagnose(model, loader, loss_fn)   # loss_fn(model, batch) -> scalar
    print(report.summary())                              # one verdict per layer, with reasons
    report.to_pandas()                                   # every number, one tidy schema
    report.save_html("diagnosis.html")                   # one self-contained file with plots

One pass over up to ``max_batches`` batches (forward + backward each, under the moment probe and a
few cheap hooks) gives the second moments, gains, GR scaling ``gamma`` (via
:func:`initlab.gr_scaling`), weight-to-gradient ratios ``nu``, weight magnitudes and
the spread of gradients across batches, dead ReLU units and activation input scales. Then: the
spectra of the weights and the convolutions' true operator norms (:mod:`~initlab.diagnostics.
spectra`; one forward of the first batch without grad records input shapes and call counts) and
the scaling linter (:mod:`~initlab.diagnostics.linter`;
one forward of the traced graph if the model calls sigmoid/tanh/ReLU functionally). Optional:
Hessian/GGN blocks and theory vs actual (``curvature=True``, :mod:`initlab.measure.curvature`; costs
several Hessian-vector products per block), a loss landscape to embed (``landscape=``).

The model is never changed: parameters and buffers (BatchNorm running statistics) are restored
bitwise, train/eval modes and every ``param.grad`` are as before, and so are the global random
number generators. The report's schema, quantities and verdict rules are documented in
:mod:`initlab.diagnostics.report`.

Under ``torch.distributed`` every number is this rank's own, on its own batches: nothing is pooled
over the ranks and no collective runs, so a rank that fails raises alone. A
``DistributedDataParallel`` model is diagnosed as the module it wraps, without DDP's buffer
broadcast or gradient all-reduce (:func:`~initlab._core.distributed.local_passes`): the gradient
statistics (``grad_norm``, ``grad_std``) are this rank's minibatch gradients, like every moment,
not DDP's mean over the ranks; the layers are named as in the DDP model (``module.0``), and DDP's
state is left as it was.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from initlab._core.backward import check_trainable, with_grad
from initlab._core.compiled import takes_compiled
from initlab._core.data import examples_in, forward_args, take_batches
from initlab._core.loss import Loss, LossLike, resolve_loss
from initlab._core.loss_counts import batch_reduction
from initlab._core.norms import may_float16
from initlab._core.parametrized import reading_layers
from initlab._core.rng import Seeds, as_generator, stage_generator
from initlab._core.rows import Rows, shown
from initlab._core.state import preserved_state
from initlab._core.underflow import FLOAT16_ADVICE, FLOAT16_TINY, float16_layer
from initlab.diagnostics._lipschitz_ops import OperationWatch
from initlab.diagnostics._stage_options import check_curvature_options, check_landscape, for_call
from initlab.diagnostics.assemble import _weight_names, assemble
from initlab.diagnostics.gradients import GradientStats
from initlab.diagnostics.linter import ActivationWatch, LintResult, lint_model
from initlab.diagnostics.report import Report
from initlab.diagnostics.spectra import InputShapes, layer_spectra, lipschitz_bounds
from initlab.measure.conditioning import gr_scaling, imbalance
from initlab.measure.curvature import block_curvature, theory_vs_actual
from initlab.measure.curvature.estimators import FLOAT16_UNDERFLOW, FLOAT16_ZERO
from initlab.measure.curvature.operators import nonfinite_cause
from initlab.measure.landscape import loss_landscape
from initlab.measure.probe import MomentProbe
from initlab.measure.probe.run import probed_backward
from initlab.measure.probe.state import _MISMATCH
from initlab.measure.residual import _user_blocks
from initlab.measure.runtime_trace import RecordingError

__all__ = ["diagnose"]

Progress = Callable[[str], None]
_NAN = math.nan


# ----------------------------------------------------------------------------- helpers


# ----------------------------------------------------------------------------- diagnose


@takes_compiled
@with_grad
@reading_layers
def diagnose(
    model: nn.Module,
    data: Any,
    loss_fn: LossLike = None,
    *,
    max_batches: int = 4,
    per_example: bool | Literal["auto"] = "auto",
    modules: Any = "params",
    loss_reduction: Literal["mean", "sum"] | None = None,
    batch_dim: int | None = None,
    alpha: Any = None,
    gradients: bool = True,
    spectra: bool = True,
    lint: bool = True,
    curvature: bool = False,
    curvature_options: Mapping[str, Any] | None = None,
    residual_blocks: Sequence[str | Mapping[str, Any]] | None = None,
    landscape: Any = None,
    generator: int | torch.Generator | None = None,
    name: str | None = None,
    progress: Progress | None = None,
) -> Report:
    """Diagnose the conditioning of ``model`` layer by layer on ``data``.

    Args:
        model: any ``nn.Module``; never modified (see the module docstring). Under
            ``torch.distributed`` the report is this rank's own (a ``DistributedDataParallel``
            model: that of the module it wraps, on this rank's batches; module docstring).
        data: one batch or many (a ``DataLoader``, a list of batches, ``initlab.Batches``; the
            rule: :mod:`initlab._core.data`); at most ``max_batches`` are used.
        loss_fn: any form :func:`initlab.resolve_loss` reads: ``loss_fn(model, batch)``, a
            criterion (``nn.CrossEntropyLoss()``, ``F.cross_entropy``), the model's own loss, a
            name; default: the model's own loss, else cross-entropy or MSE on ``(x, y)``.
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
        loss_reduction: how ``loss_fn`` reduces over the batch (``"mean"`` or ``"sum"``);
            ``None``: the loss's own where it declares one (a criterion's ``reduction``), else
            ``"mean"``.
        batch_dim: the probe's ``batch_dim`` (default 0, 1 for ``batch_first=False`` modules);
            the report's ``used`` counts the examples along it.
        alpha: conditioning multipliers passed to :func:`initlab.gr_scaling`.
        gradients: weight magnitudes and gradient spread across batches (GradInit).
        spectra: singular values, convolution operator norms and Lipschitz bounds. Costs a
            float64 SVD per weight matrix, ``O(m n min(m, n))``: the largest part of a call on
            wide layers (a 25-layer MLP of width 1024: ~37x a forward+backward with spectra,
            ~7x without; measured on a loaded 2-core CPU); ``spectra=False`` skips it.
        lint: the scaling linter (Table 1), dead ReLUs, vanishing/exploding signals.
        curvature: Hessian block averages and theory vs actual (``initlab.measure.curvature``) on
            the first batch (the full block map, Figure 1, and theory vs actual, Figure 2);
            ``curvature_options`` go to both calls, each taking the ones it has (e.g.
            ``kind="ggn"``, ``probes=``, ``gamma=``, and a ``loss_fn`` of its own; the GGN needs
            a loss on the outputs: a criterion, a named loss or ``initlab.outputs_loss(fn)``). A
            key neither call takes, or a value they refuse, raises before the pass; a call that
            fails on the model is a note.
        residual_blocks: declare residual blocks (module names, or dicts with ``name``,
            ``branch``, ``shortcut``); default: found by the linter.
        landscape: a ``Landscape`` (from :func:`initlab.loss_landscape`) to embed, or
            ``True`` / a dict of its options (``grid=``, ``directions=``, ``bn=``) to compute
            one on the batches used here (filter-normalized random directions by default); an
            option it does not take, or a value it refuses, raises before the pass.
        generator: seed (or generator) for the pass's random draws (dropout masks, batch ``i``
            in its own forked-RNG scope), power iterations, curvature probes and landscape
            directions; ``None``: fixed seeds (a generator seeded
            :data:`~initlab._core.rng.STAGE_SEED` for the stages). Either way these draws do not
            depend on torch's global RNG; which examples the batches hold does, where ``data`` is
            a shuffling ``DataLoader`` (its order is drawn from the global RNG: seed it, or give
            the loader a ``generator=``, for fixed batches). The global RNG is left as it was
            (its state after reading the data is put back).
        name: the model's name in the report (default: its class name).
        progress: called with a short message at each stage (e.g. for a CLI).

    Returns:
        a :class:`~initlab.diagnostics.report.Report`.
    """
    opts = _Options(
        max_batches, per_example, modules, loss_reduction, batch_dim, alpha, gradients, spectra,
        lint, curvature, curvature_options, residual_blocks, landscape, name,
    )  # fmt: skip
    check_landscape(landscape)  # the caller's options raise here, before any work
    check_curvature_options(model, curvature_options)
    if residual_blocks is not None:  # unknown names fail before the pass, not after it
        _user_blocks(model, residual_blocks)
    # the global RNG put back after reading: diagnose draws nothing from it later
    batches = take_batches(data, max_batches, exact=False, what="diagnose", keep_rng=True)
    loss = resolve_loss(loss_fn, what="diagnose")
    check_trainable(model, "diagnose")
    opts.loss_reduction = batch_reduction(loss, loss_reduction, "diagnose")
    with preserved_state(model):  # weights, buffers, modes, grads and the RNGs as they were
        return _diagnose(model, batches, loss, opts, as_generator(generator), progress)


# ----------------------------------------------------------------------------- diagnose's stages


@dataclass
class _Options:
    """The knobs of one :func:`diagnose` call (documented there)."""

    max_batches: int
    per_example: bool | str
    modules: Any
    loss_reduction: str
    batch_dim: int | None
    alpha: Any
    gradients: bool
    spectra: bool
    lint: bool
    curvature: bool
    curvature_options: Mapping[str, Any] | None
    residual_blocks: Sequence[str | Mapping[str, Any]] | None
    landscape: Any
    name: str | None


def _diagnose(
    model: nn.Module,
    batches: list[Any],
    loss: Loss,
    o: _Options,
    generator: torch.Generator | None,
    progress: Progress | None,
) -> Report:
    """:func:`diagnose` after validation: one pass, then each stage, then the report."""
    say = progress or (lambda _msg: None)
    run = _Run(say)
    stages = stage_generator(generator)  # None: fixed draws, not the global RNG's
    if o.per_example == "auto":
        o.per_example = _auto_per_example(model, run.notes)
    _note_fresh_eval_norms(model, run.notes)

    # -- one pass over the batches: probe, activations, gradients
    with run.timed("pass_s"):
        modules = _weight_modules(model) if o.modules == "weights" else o.modules
        probe = MomentProbe(
            model,
            modules=modules,
            per_example=o.per_example,
            loss_reduction=o.loss_reduction,
            batch_dim=o.batch_dim,
        )
        grad_acc = GradientStats(model) if o.gradients else None
        watch = ActivationWatch(model) if o.lint else None
        seeds = Seeds(model, generator)
        losses = _one_pass(model, batches, loss, probe, grad_acc, (watch,), seeds, say)
    probe_table, param_table = _probe_tables(probe, losses, run)

    gr, cond_imbalance = _gr_scaling(model, probe, batches, o.alpha, o.batch_dim, run)
    if grad_acc is not None:
        run.tables["gradients"] = grad_acc.rows()
    spectra_rows: Rows | None = None
    ops: OperationWatch | None = None
    if o.spectra:
        say("spectra: SVDs and convolution operator norms")
        with run.timed("spectra_s"):
            shapes, ops = _plain_forward(model, batches[0], loss, seeds, run.notes)
            spectra_rows = layer_spectra(model, shapes, generator=stages)
            run.tables["spectra"] = spectra_rows
    lint_result, blocks = _lint(model, probe, watch, batches, o.lint, o.residual_blocks, run)
    findings = lint_result.findings if lint_result else Rows([], title="scaling linter")
    sums = lint_result.branch_sums if lint_result else None
    lipschitz = _lipschitz(model, spectra_rows, blocks, sums, ops)
    if o.curvature:
        say("curvature: Hessian blocks and theory vs actual")
        with run.timed("curvature_s"):
            _curvature(model, batches[0], loss, o.curvature_options, stages, run.tables,
                       run.notes)  # fmt: skip
    landscape = _landscape_stage(model, batches, loss, o.landscape, stages, run)

    say("building the report")
    rows, layers, imb = assemble(model, probe_table, param_table, gr, run.tables, findings, blocks,
                                 probe.float16_layers)  # fmt: skip
    if cond_imbalance is not None:
        imb["conditioning"] = cond_imbalance
    options = {
        "max_batches": o.max_batches,
        "per_example": o.per_example,
        "loss_reduction": o.loss_reduction,
        "gradients": o.gradients,
        "spectra": o.spectra,
        "lint": o.lint,
        "curvature": o.curvature,
        "batch_dim": o.batch_dim,
    }
    meta = _meta(o.name or type(model).__name__, batches, losses, options, imb, lipschitz, blocks,
                 lint_result, run)  # fmt: skip
    obj = landscape if landscape is not None and hasattr(landscape, "to_rows") else None
    return Report(rows, layers, findings, run.tables, meta, landscape=obj)


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
            f"per-example ν not computed: BatchNorm in train mode ({shown(coupled, 1)}) couples "
            "the examples; ν is the minibatch ratio"
        )
    return not coupled


FRESH_EVAL_NORMS = "BatchNorm in eval mode with running statistics never updated"
"""How the note on such BatchNorm layers starts (doctor's summary shows it)."""


def _note_fresh_eval_norms(model: nn.Module, notes: list[str]) -> None:
    """A note where BatchNorm layers run in eval mode on running statistics no batch has
    updated (still mean 0, variance 1): they normalize nothing, so the
    network is measured as one without normalization, unlike in training."""
    fresh = [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        and not m.training
        and m.track_running_stats
        and _fresh_statistics(m)
    ]
    if fresh:
        notes.append(
            f"{FRESH_EVAL_NORMS} ({shown(fresh, 1)}: "
            "mean 0, variance 1): they normalize nothing here, so the model is measured as one "
            "without normalization; call model.train() to diagnose it as it trains"
        )


def _fresh_statistics(bn: nn.modules.batchnorm._BatchNorm) -> bool:
    """Whether ``bn``'s running statistics are still their initial values (mean 0, variance 1),
    the tensors themselves read: a checkpoint loaded without ``num_batches_tracked`` leaves that
    count at 0 beside real statistics."""
    mean, var = bn.running_mean, bn.running_var
    if mean is None or var is None:
        return False
    return not bool(mean.any()) and bool((var == 1).all())


def _weight_modules(model: nn.Module) -> list[str]:
    """``modules="weights"``: the modules owning a registry role-"weight" parameter."""
    owners = {layer for layer, _ in _weight_names(model)}
    return [n for n, _ in model.named_modules() if n in owners]


def _one_pass(
    model: nn.Module,
    batches: list[Any],
    loss_fn: Loss,
    probe: MomentProbe,
    grad_acc: GradientStats | None,
    watchers: Iterable[Any],
    seeds: Seeds,
    say: Progress,
) -> list[float]:
    """Forward + backward of every batch under the probe and the watchers, batch ``i`` in
    ``seeds``' scope ``i`` (dropout masks from the generator, not torch's global RNG); the
    model's state is restored afterwards. Returns the losses."""
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
            with seeds.scope(i):
                loss = probed_backward(probe, loss_fn, model, batch, "diagnose", i)
            losses.append(float(loss.detach()))
            if grad_acc is not None:
                grad_acc.update()
    return losses


def _plain_forward(
    model: nn.Module, batch: Any, loss_fn: Loss, seeds: Seeds, notes: list[str]
) -> tuple[InputShapes, OperationWatch | None]:
    """Input shapes and call counts (:class:`InputShapes`) and the operations that ran
    (:class:`OperationWatch`) from one plain forward of the first batch (``loss_fn(model,
    batch)`` in ``seeds``' scope 0, the model put back), as :func:`layer_spectra` watches one:
    not from the probed pass, whose per-example replays (an eval-mode BatchNorm's, a transposed
    convolution's, re-run in the backward) would count as calls and square those layers' norms
    in the Lipschitz bound. It runs with grad, as the pass does (a PINN residual's or gradient
    penalty's ``torch.autograd.grad`` inside the loss), and no backward: its graph is freed with
    the loss. Where it fails, the call counts are left unknown and the operations unchecked (a
    note; the bound is then no guarantee): the forward's error, or the recorder's own
    (:class:`~initlab.measure.runtime_trace.RecordingError`, an initlab bug, said so)."""
    shapes, ops = InputShapes(model), OperationWatch(model)
    try:
        with preserved_state(model), torch.enable_grad(), seeds.scope(0), shapes, ops():
            loss_fn(model, batch)  # the result dropped: its graph freed, nothing accumulated
    except RecordingError as err:  # initlab's own, not the model's
        shapes.calls.clear()
        notes.append(f"the watch of the forward that counts each layer's calls failed ({err}): "
                     "call counts not known, operations not checked")  # fmt: skip
        return shapes, None
    except Exception as err:  # the pass ran this loss: report, keep the rest
        shapes.calls.clear()
        notes.append(f"the forward that counts each layer's calls failed "
                     f"({type(err).__name__}: {err}): call counts not known")  # fmt: skip
        return shapes, None
    return shapes, ops


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
    vanished = _vanished_params(probe_table, param_table)
    named, half = dict(probe.model.named_modules()), probe.float16_layers
    for n in probe.notes:
        label, _, why = n.partition(": ")
        if label in vanished and why == _MISMATCH:  # zeros and subnormals do not add up exactly
            layer = vanished[label]
            why = _VANISHED_FLOAT16 if float16_layer(named.get(layer), layer, half) else _VANISHED
        by_reason.setdefault(why, []).append(label)
    for why, labels in by_reason.items():
        run.notes.append(f"per-example ν unavailable for {shown(labels, 4)}: {why}")
    return probe_table, param_table


_VANISHED = (
    "the gradient vanishes before these layers (it is 0, or its squares underflow to 0 in "
    "float32), so per-example gradients cannot be told apart from the minibatch gradient"
)
_VANISHED_FLOAT16 = (
    "the gradient is 0 at these float16 layers, and may have underflowed float16 (below its "
    f"smallest subnormal, {FLOAT16_TINY:.3g}) rather than vanished, so per-example gradients "
    f"cannot be told apart from the minibatch gradient; {FLOAT16_ADVICE}"
)


def _vanished_params(probe_table: Rows, param_table: Rows) -> dict[str, str]:
    """Labels (``"layer.param"``) of the parameters whose minibatch gradient's ``E[dW^2]`` is 0
    or whose layer's ``E[dy^2]`` is, with their layers: a per-example check that fails there
    reads rounding, not a parameter used outside its module."""
    no_dy = {t["layer"] for t in probe_table if t["E_dy2"] == 0.0}
    return {
        f"{r['layer']}.{r['param']}" if r["layer"] else r["param"]: r["layer"]
        for r in param_table
        if r["E_dW2"] == 0.0 or r["layer"] in no_dy
    }


def _gr_scaling(
    model: nn.Module,
    probe: MomentProbe,
    batches: list[Any],
    alpha: Any,
    batch_dim: int | None,
    run: _Run,
) -> tuple[Rows | None, Any]:
    """γ (:func:`initlab.gr_scaling`) and its imbalance; ``None`` (with a note) where it fails."""
    gr: Rows | None = None
    try:
        examples = sum(examples_in(b) for b in batches)
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
            forward_args=[forward_args(b) for b in batches],
            residual_blocks=residual_blocks,
        )
        run.tables["activations"] = lint_result.activations
    if not lint_result.traced:
        runtime = [b for b in lint_result.residual_blocks if b.get("source") == "runtime"]
        found = (
            f"; residual blocks come from a runtime trace of one forward ({len(runtime)} found)"
            if runtime
            else ""
        )
        run.notes.append(f"torch.fx could not trace the model: {lint_result.trace_error}{found}")
    return lint_result, lint_result.residual_blocks


_NORMS = (
    nn.modules.batchnorm._NormBase,  # BatchNorm (covered in eval mode) and InstanceNorm
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.LocalResponseNorm,
    nn.CrossMapLRN2d,
)
"""Normalization layers: not covered by the Lipschitz bound (but an eval-mode BatchNorm, a
diagonal map with its own row), also without parameters."""


def _lipschitz(
    model: nn.Module,
    spectra_rows: Rows | None,
    blocks: list[dict[str, Any]],
    sums: list[dict[str, Any]] | None,
    ops: OperationWatch | None = None,
) -> dict[str, Any]:
    """Lipschitz bounds from the operator norms, naming the parameterized modules without one
    and the normalization layers without one, with or without affine parameters (a LayerNorm's
    ``(x - mean) / std`` is no bounded map, whatever its ``elementwise_affine``), but those the
    watch judges itself (:meth:`OperationWatch.judges`: never run, a PReLU), and the operations of
    the forward not known to be 1-Lipschitz (``ops``; ``None``: not checked)."""
    if spectra_rows is None:
        return {}
    covered = {r["layer"] for r in spectra_rows if math.isfinite(r["op_norm"])}
    uncovered = [
        n
        for n, m in model.named_modules()
        if (next(m.parameters(recurse=False), None) is not None or isinstance(m, _NORMS))
        and n not in covered
        and not (ops is not None and ops.judges(n, m))
        and ("." + n).split(".parametrizations.")[0][1:] not in covered  # its computed weight
    ]
    calls: dict[str, int | None] = {}
    for r in spectra_rows:  # the count the bound takes: its first row's, as lipschitz_bounds
        if math.isfinite(r["op_norm"]):
            calls.setdefault(r["layer"], r.get("calls"))
    operations = ops.failures(covered, uncovered, blocks, calls) if ops is not None else None
    return lipschitz_bounds(
        spectra_rows, blocks, uncovered=uncovered, branch_sums=sums, operations=operations
    )


def _landscape_stage(
    model: nn.Module,
    batches: list[Any],
    loss_fn: Loss,
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
        "examples": sum(examples_in(b, options["batch_dim"] or 0) for b in batches),
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
    loss_fn: Loss,
    options: Mapping[str, Any] | None,
    generator: torch.Generator | None,
    tables: dict[str, Rows],
    notes: list[str],
) -> None:
    opts = dict(options or {})
    loss = resolve_loss(opts.pop("loss_fn", loss_fn), what="diagnose(curvature=True)")
    if opts.get("kind", "hessian") == "ggn" and not loss.splittable:
        notes.append(
            "curvature not computed: the GGN needs the loss as a function of the outputs; pass a "
            "criterion (nn.CrossEntropyLoss()), a named loss or initlab.outputs_loss(fn)"
        )
        return
    dropout = [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0
    ]
    if dropout:
        notes.append(
            f"curvature measured in train mode: dropout is on ({len(dropout)} module(s), e.g. "
            f"{dropout[0]}), so each Hessian product draws its own mask and the blocks are those "
            "of one noisy loss; call model.eval() first for the deterministic curvature (the "
            "landscape is taken in eval mode)"
        )
    for key, fn in (("curvature", block_curvature), ("theory_vs_actual", theory_vs_actual)):
        try:
            with preserved_state(model), warnings.catch_warnings():
                # said once, as a note (_note_underflow_curvature), not by both calls
                warnings.filterwarnings("ignore", "block_curvature: .* float16 underflow")
                kw = for_call(fn, opts)  # checked by check_curvature_options
                kw.setdefault("generator", generator)
                if key == "curvature":
                    kw.setdefault("full_matrix", True)  # the Figure 1 heat map, same products
                got = fn(model, batch, loss, **kw)
            tables[key] = got if isinstance(got, Rows) else Rows(got, title=key)
        except Exception as err:  # report what failed, keep the rest
            notes.append(f"{key} not computed: {type(err).__name__}: {err}")
    _note_nonfinite_curvature(model, tables, notes)
    _note_underflow_curvature(tables, notes)


def _note_underflow_curvature(tables: Mapping[str, Rows], notes: list[str]) -> None:
    """A note naming the blocks of a float16 model whose curvature products underflowed
    float16 (or are 0 in it): their ``curv_block`` and ``curv_theory_ratio`` are not the float32
    ones (:func:`~initlab.measure.curvature.estimators._underflow_gaps`)."""
    rows = [r for r in tables.get("curvature", ()) if r.get("block_row") == r.get("block_col")]
    marks = (FLOAT16_UNDERFLOW, FLOAT16_ZERO)
    names = [str(r["block_row"]) for r in rows if any(m in str(r.get("note")) for m in marks)]
    if names:
        notes.append(
            f"curvature: float16 underflow in {len(names)} block(s) ({shown(names, 4)}): their "
            "products change with the loss's scale, or are 0, so curv_block and "
            "curv_theory_ratio are not the float32 values (see the curvature table's notes); "
            f"{FLOAT16_ADVICE}"
        )


def _note_nonfinite_curvature(
    model: nn.Module, tables: Mapping[str, Rows], notes: list[str]
) -> None:
    """A note naming the blocks whose curvature products held NaN/inf (their ``curv_block`` and
    ``curv_theory_ratio`` values are NaN), with the cause and what to do."""
    bad = [str(r["block_row"]) for r in tables.get("curvature", ()) if r.get("nonfinite")]
    bad += [
        str(r["block"])
        for r in tables.get("theory_vs_actual", ())
        if "non-finite products" in str(r.get("note", ""))
    ]
    if bad:
        names = list(dict.fromkeys(bad))
        shown = ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
        notes.append(
            f"curvature: products held NaN/inf for {len(names)} block(s) ({shown}), "
            f"whose curv_block and curv_theory_ratio are NaN: {nonfinite_cause(may_float16(model))}"
        )


def _landscape(
    model: nn.Module,
    batches: list[Any],
    loss_fn: Loss,
    opts: dict[str, Any],
    generator: torch.Generator | None,
    notes: list[str],
) -> Any:
    loss = resolve_loss(opts.pop("loss_fn", loss_fn), what="diagnose(landscape=...)")
    opts.setdefault("generator", generator)
    try:
        with preserved_state(model):
            return loss_landscape(model, batches, loss, **opts)
    except Exception as err:  # report what failed, keep the rest
        notes.append(f"landscape not computed: {type(err).__name__}: {err}")
        return None
