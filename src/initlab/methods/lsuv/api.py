"""The public entry point :func:`lsuv_`: options, data, the sweeps, the report.

Validates the options, takes the batches (concatenated or not), builds the units
(:mod:`initlab.methods.lsuv.units`), runs the sweeps with the engine's hooks installed
(:mod:`initlab.methods.lsuv.engine`) under eval mode and the model's guard, and builds the report
and warnings. The algorithm is described in :mod:`initlab.methods.lsuv`.
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import nn

from initlab._core.compiled import takes_compiled
from initlab._core.data import (
    DataUse,
    batch_tensors,
    data_use,
    default_forward,
    masks_positions,
    object_fields,
    take_batches,
    with_fields,
)
from initlab._core.distributed import (
    check_same_parameters,
    check_same_trainable,
    failing_together,
    run_together,
    same_options,
)
from initlab._core.heap import kept_heap
from initlab._core.hooks import hook_handles
from initlab._core.knobs import check_flags, renamed_kwargs, user_stacklevel
from initlab._core.method_report import MethodReport
from initlab._core.modules import refuse_shared_writes
from initlab._core.parametrized import writing_layers
from initlab._core.pytree import flatten_tensors, shallow_types
from initlab._core.rng import as_generator
from initlab._core.state import model_kept, restore_on_failure
from initlab.init.registry import Registry, default_registry
from initlab.measure.residual import KNOWN_BLOCKS
from initlab.measure.runtime_trace import blocks_of, recording
from initlab.methods.lsuv.engine import Engine
from initlab.methods.lsuv.units import (
    DEAD,
    NEVER,
    Mode,
    Selection,
    Unit,
    build_units,
    find_blocks,
    selected,
)

__all__ = ["KNOWN_BLOCKS", "LSUV_COLUMNS", "lsuv_"]

#: Columns of the :class:`~initlab.MethodReport` rows of :func:`lsuv_`, one row per
#: layer (an attention module gives one row per q/k/v projection and one for ``out_proj``):
#:
#: * ``layer``: qualified name of the layer (``"attn.in_proj_weight[q]"`` for a projection block);
#: * ``module_type``: its class name;
#: * ``order``: position in execution order (first call), from 0; ``None``: never ran;
#: * ``calls``: times the layer ran during the final, measuring sweep (all batches);
#: * ``measured_at``: whose output variance is brought to the target: ``"output"`` (the layer's
#:   own), ``"projection"`` (one q/k/v block of an attention input projection),
#:   ``"attention output"`` (``out_proj``: the attention module's output), or
#:   ``"block output: <name>"`` (``strategy="stream"``: the residual block's output); ``None``
#:   for a layer skipped before any measurement (recurrent, fused, frozen, shared, unclaimed:
#:   its ``order`` and ``calls`` are counted, nothing else);
#: * ``shared_with``: other layers that share this layer's weight tensor (tied), comma-separated;
#: * ``scale``: total factor the weight was multiplied by after the orthogonal pre-init;
#: * ``iterations``: corrections applied (rescalings, plus block re-runs in ``"stream"`` mode);
#: * ``var_before``: variance LSUV measured at the layer before correcting it (after the pre-init
#:   and after the layers before it were fixed) -- the first call of the first batch of the first
#:   sweep, pooled over ranks;
#: * ``var_after``: the achieved variance, measured in the final sweep in which nothing was
#:   rescaled, pooled over all calls, batches and ranks;
#: * ``skipped``: why the layer was not scaled, or ``""``.
LSUV_COLUMNS = (
    "layer",
    "module_type",
    "order",
    "calls",
    "measured_at",
    "shared_with",
    "scale",
    "iterations",
    "var_before",
    "var_after",
    "skipped",
)

NormMode = Literal["eval", "train"]

_MODES = ("layers", "branches", "stream")
_NORM_MODES = ("eval", "train")


def _entry(items: list[Any], path: str) -> Any:
    """One key of several dict batches: a list there holds one item per example (a detection
    model's targets, a collated list of strings), so the lists are joined; else :func:`_cat`."""
    if isinstance(items[0], list):
        if not all(isinstance(b, list) for b in items):
            raise ValueError(f"batch entry {path} is a list in some batches only")
        return [x for b in items for x in b]
    return _cat(items, path)


def _cat(items: list[Any], path: str) -> Any:
    """Concatenate one position of several batches along dim 0."""
    first = items[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(t, torch.Tensor) for t in items):
            raise ValueError(f"batch entry {path or 'input'} is a tensor in some batches only")
        if first.dim() == 0 or any(t.shape[1:] != first.shape[1:] for t in items):
            shapes = [tuple(t.shape) for t in items]
            raise ValueError(
                f"lsuv_ cannot concatenate the batches along dim 0: entry {path or 'input'} has "
                f"shapes {shapes}; pass concat_batches=False to run the batches one after another"
            )
        return torch.cat(items, 0)
    if isinstance(first, Mapping):
        if any(not isinstance(b, Mapping) or b.keys() != first.keys() for b in items):
            raise ValueError("lsuv_ cannot concatenate batches whose dict keys differ")
        return type(first)({k: _entry([b[k] for b in items], f"{path}.{k}") for k in first})
    if isinstance(first, (tuple, list)):
        if any(type(b) is not type(first) or len(b) != len(first) for b in items):
            raise ValueError("lsuv_ cannot concatenate batches of different structure")
        values = [_cat([b[i] for b in items], f"{path}.{i}") for i in range(len(first))]
        if hasattr(first, "_fields"):  # namedtuple
            return type(first)(*values)
        return type(first)(values)
    fields = object_fields(first)
    if fields is not None:  # a batch object: its attributes, concatenated
        if any(type(b) is not type(first) for b in items):
            raise ValueError("lsuv_ cannot concatenate batches of different types")
        parts = [object_fields(b) or {} for b in items]
        return with_fields(
            first, {k: _cat([p[k] for p in parts], f"{path}.{k}".lstrip(".")) for k in fields}
        )
    if any(b is not first and b != first for b in items):
        raise ValueError(
            f"lsuv_ cannot concatenate batches whose non-tensor entry {path or 'input'} differs; "
            "pass concat_batches=False"
        )
    return first


def _check_positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


@takes_compiled(collective=True)
@renamed_kwargs(mode="strategy", batches="max_batches")
@same_options
@writing_layers
def lsuv_(
    model: nn.Module,
    data: Any,
    *,
    target: float = 1.0,
    tol: float = 0.1,
    max_iter: int = 10,
    orthogonal: bool = True,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    strategy: Mode = "layers",
    max_batches: int | None = 1,
    concat_batches: bool = True,
    generator: torch.Generator | int | None = None,
    modules: Selection | None = None,
    blocks: Selection | None = None,
    norm_mode: NormMode = "eval",
    registry: Registry | None = None,
    keep_heap: bool = True,
) -> MethodReport:
    """Layer-sequential unit-variance initialization (Mishkin & Matas 2016, Algorithm 1), in place.

    Optionally pre-initializes every layer with an orthonormal matrix and zero biases, then scales
    each layer's weight, in execution order and the first layer included, so that its output
    variance over the data reaches ``target``: ``W <- W * sqrt(target / Var(y))`` until
    ``|Var(y) - target| < tol`` or ``max_iter`` corrections, where ``Var(y) = E|y - E y|²`` over
    all elements of the output (a complex output: ``Var(Re y) + Var(Im y)``; its orthogonal
    pre-init is real only, so pass ``orthogonal=False``). A "layer" is every module whose
    registry handler names one weight (:func:`~initlab.init.registry.default_registry`): Linear,
    Conv/ConvTranspose, Bilinear, GPT-2 ``Conv1D``, your registered types. See the module
    docstring for the one-pass algorithm; on a plain network it costs **2 forward passes
    whatever the depth** (the paper's loop costs about two per layer).

    Choices, where the paper is silent:

    * **In-place activations**: each layer is measured inside its own forward hook, before a
      following ``ReLU(inplace=True)`` can overwrite its output.
    * **Biases**: zeroed by the pre-init (the paper's assumption). With ``orthogonal=False``
      they are left as they are, and a non-zero bias ``b`` is accounted for exactly:
      ``y = s W x + b``, so ``s`` solves ``Var(s Wx + b) = target``; layers whose bias alone
      exceeds the target are skipped and reported.
    * **Layers that run several times** per forward, and **tied weights** (one tensor in several
      layers: scaled once, stays tied): scaled by the variance **pooled over all calls** (and all
      tied layers), which takes a few sweeps.
    * **Layers that never run** on the data: warned about, left untouched (not even
      pre-initialized), reported with ``skipped="never called"``. **Dead layers** (zero output
      variance): skipped and reported, never divided by a small number.
    * **Attention** (``nn.MultiheadAttention``): the q, k and v blocks of the input projection are
      three layers, each measured on its own projection ``x W_q^T + b_q`` (computed from the
      module's inputs in a pre-hook, before the module uses the weight, so the correction is
      exact); ``out_proj`` -- which the module applies functionally, never calling the child
      ``Linear`` -- is a layer whose output is the attention module's output. (The PyPI ``lsuv``
      package only scales ``out_proj`` and leaves the projections at their orthogonal init.) The
      fused fast path of ``nn.TransformerEncoderLayer`` is turned off during the call (and
      restored) so that its inner layers run as modules.
    * **BatchNorm**: ``norm_mode="eval"`` (default, as the reference LSUV code and the PyPI
      package do) runs the whole model in eval mode: BatchNorm normalizes with its running
      statistics, which at initialization make it close to the identity, so the layer before it
      is scaled to the target and BN passes it on. ``norm_mode="train"`` keeps BatchNorm layers in
      training mode (batch statistics; their running statistics are restored afterwards): then a
      BN that follows a layer divides the layer's scale out again, so LSUV on that layer has no
      effect on the BN output (its own output still reaches the target).
    * **Dropout** is always off (eval mode), and every module's train/eval flag is restored.

    Residual networks, ``strategy``:

    * ``"layers"`` (the paper): every layer's own output reaches the target. In a residual net
      each branch then adds a unit-variance signal to the stream, whose variance grows with depth.
    * ``"branches"``: inside each residual block only the **branch end** -- the last layer that
      ran in the block and did not take the block's own input (so a projection shortcut is never
      it) -- is pre-initialized and scaled, so that the branch output reaches the target; the other
      layers of the block keep their weights (reported as skipped). Layers outside blocks are
      treated as in ``"layers"``.
    * ``"stream"``: every layer as in ``"layers"``, except each block's branch end, which is scaled
      so that the **block's output** (the residual stream after the block) reaches the target.
      That output is not linear in the weight, so the block alone (not the model) is re-run on its
      cached input with secant steps, at most ``max_iter`` times per sweep. A branch can only add
      to the stream: with an identity shortcut and nothing after the sum,
      ``Var(x + f) = Var(x) + Var(f) >= Var(x)``, so a target at or below the block's variance
      without its branch (measured by one re-run with the branch end's weight at zero) cannot be
      reached; that branch end is then scaled as in ``"layers"`` and its ``measured_at`` says so.
      In practice ``"stream"`` suits nets with an activation (or a normalization) after the sum,
      or between blocks, which keeps the stream below the target.

    Both block modes add one measuring "discovery" pass that finds each block's branch end.
    Blocks are given by ``blocks=``, or found by type (:data:`KNOWN_BLOCKS`: initlab's and
    torchvision's ResNet blocks); blocks must not nest.

    Like every data-dependent initialization in initlab: changes ``model`` in place, never moves
    it, leaves no hook behind (also after an exception), and restores every weight, buffer and
    train/eval mode if anything fails midway (:func:`~initlab._core.state.restore_on_failure`).
    Buffers come back in any case: its forward passes leave no running statistic or counter.

    Args:
        model: any ``nn.Module``.
        data: one batch or many (a ``DataLoader``, a list of batches, ``initlab.Batches``); the
            rule is in :mod:`initlab._core.data`. A dict batch's ``attention_mask`` leaves the
            padded positions out of a token model's statistics: its layers' (channels-last
            outputs), ``nn.MultiheadAttention``'s projections' and, with ``"stream"``, its
            blocks' outputs.
        target: the output variance to reach (1 in the paper).
        tol: stop when ``|Var - target| < tol`` (on the variance, as the paper writes it; the
            PyPI package compares standard deviations).
        max_iter: at most this many corrections per layer (the paper's ``T_max``), and at most
            this many correcting sweeps.
        orthogonal: pre-initialize each layer's weight with a (semi-)orthogonal matrix -- per
            q/k/v block and per convolution group, through the registry's layout -- and zero its
            biases, at the layer's first call. Only the scaled layers are touched (norm layers
            and embeddings are not, unlike ``init_model(model, "orthogonal")``).
        forward: ``forward(model, batch)`` runs the model on one batch (default
            :func:`~initlab._core.data.default_forward`).
        strategy: ``"layers"``, ``"branches"`` or ``"stream"`` (above; ``mode=`` before 0.2).
        max_batches: how many batches of ``data`` the statistics pool over (``None``: all of
            them, data without a length up to 1000 batches, and more raise; ``batches=`` before
            0.2): at most this many (a loader with fewer is read whole).
        concat_batches: with several batches, run them as one concatenated batch (exact in one
            sweep; dim 0 of every tensor is concatenated) rather than one after another.
        generator: ``torch.Generator`` or int seed for the orthogonal pre-init; the same seed
            gives identical weights.
        modules: the layers to process: qualified names, or a predicate ``(name, module) ->
            bool``; default every layer. Naming an attention module selects its projections and
            ``out_proj``.
        blocks: the residual blocks for ``strategy="branches"``/``"stream"``: qualified names or a
            predicate; default: modules of a type in :data:`KNOWN_BLOCKS`.
        norm_mode: ``"eval"`` or ``"train"``: the mode BatchNorm layers run in (above).
        registry: the layer registry (default :func:`~initlab.init.registry.default_registry`).
        keep_heap: on Linux with glibc, keep the C heap for the length of the call, so that
            sweeps after the first do not fault in again the memory the previous one freed
            (:func:`~initlab._core.heap.kept_heap`, as :func:`~initlab.gradinit_`; ~10% of
            the call on a 56-layer CNN). ``False`` leaves the allocator alone.

    Returns:
        :class:`~initlab.MethodReport` named ``"lsuv"``, one row per layer (schema
        :data:`~initlab.methods.lsuv.LSUV_COLUMNS`), with ``forward_passes`` (full forwards of the
        model), ``backward_passes`` (0) and ``wall_s``; ``info`` holds ``sweeps``,
        ``block_replays``, ``batches``, ``examples``, ``converged`` (every scaled layer within
        ``tol``, and at least one scaled), ``skipped`` (layer -> why it was not scaled: never
        called, dead, unsupported, frozen (a weight with ``requires_grad=False`` is kept as it is),
        shared with a module LSUV does not scale, a module no registry handler claims that holds a
        raw weight matrix, ...; also warned about) and the settings.

    Raises:
        ValueError: bad options; ``data`` has fewer batches than asked for; non-finite data or a
            non-finite layer output; no layer LSUV can scale (none holds a weight, or every one
            is recurrent, frozen, shared, ...) (the model is left unchanged); a layer it would
            write is a distinct ``Parameter`` over another's memory (``nn.Parameter(
            a.weight.data.t())``; named, before any write: the model is left unchanged).
        TypeError: ``orthogonal=True`` and a layer to draw has a complex weight (named).

    Example:
        >>> net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(inplace=True), nn.Linear(64, 10))
        >>> report = lsuv_(net, torch.randn(256, 32), generator=0)
        >>> report.forward_passes
        2
        >>> all(abs(r["var_after"] - 1.0) < 0.1 for r in report)
        True
    """
    start = time.perf_counter()
    target, tol, forward = _check_options(
        target, tol, max_iter, strategy, norm_mode, blocks, forward
    )
    check_flags("lsuv_", orthogonal=orthogonal, concat_batches=concat_batches, keep_heap=keep_heap)
    gen = as_generator(generator)
    registry = registry if registry is not None else default_registry()
    modes = functools.partial(_set_measuring_modes, norm_mode=norm_mode)
    if not orthogonal:  # the orthogonal pre-init broadcasts rank 0's draw; else ranks must agree
        check_same_parameters(model, "lsuv_", measured_in=modes)
    else:  # the same layers frozen (so the same units) on every rank
        check_same_trainable(model, "lsuv_")
    used, runs = run_together("lsuv_", lambda: _take_data(data, max_batches, concat_batches))
    units = build_units(model, modules, registry)
    if orthogonal:  # what the pre-init does not redraw (a norm, an embedding) must agree
        _refuse_complex_draw(units)
        check_same_parameters(model, "lsuv_", redrawn=_redrawn(units), measured_in=modes)
    _refuse_unscalable(units, modules, model, registry)
    block_names = find_blocks(model, blocks, strategy) if strategy != "layers" else {}
    engine = Engine(
        units,
        target=target,
        tol=tol,
        max_iter=max_iter,
        orthogonal=orthogonal,
        generator=gen,
        block_names=block_names,
    )
    with restore_on_failure(model), failing_together("lsuv_"), kept_heap(bool(keep_heap)):
        passes, sweeps = _run(model, engine, runs, forward, strategy, norm_mode, max_iter)
    rows, off = _report_rows(units, engine, target, tol)
    _warn(units, off, target, tol, max_iter)
    info = {
        "strategy": strategy,
        "target": target,
        "tol": tol,
        "sweeps": sweeps,
        "block_replays": engine.replays,
        "batches": used.batches,
        "examples": used.examples,
        "converged": not off and any(not u.skipped and not u.frozen for u in engine.active),
        "skipped": {u.name: u.skipped or u.frozen for u in units if u.skipped or u.frozen},
    }
    return MethodReport(
        rows,
        LSUV_COLUMNS,
        method="lsuv",
        forward_passes=passes,
        backward_passes=0,
        wall_s=time.perf_counter() - start,
        info=info,
        used=used,
    )


def _refuse_unscalable(
    units: list[Unit], modules: Selection | None, model: nn.Module, registry: Registry
) -> None:
    """Raise if no layer can be scaled: none holds a weight, or every one is a layer LSUV cannot
    scale (recurrent, frozen, shared with a module it does not scale, ...). The message names
    the embedding tables found: LSUV leaves them as they are (its "layers" are weights)."""
    chosen = "" if modules is None else f" among modules={modules!r}"
    if not units:
        tables = [
            f"{name} ({type(module).__name__})"
            for name, module in model.named_modules()
            if selected(modules, name, module)
            and any(s.role == "embedding" for s in registry.specs(module, name) or [])
        ]
        left = "it leaves embedding tables and norm layers as they are"
        if tables:
            more = " ..." if len(tables) > 4 else ""
            left = (
                f"it leaves embedding tables (here {', '.join(tables[:4])}{more}) and norm layers "
                "as they are; init_model draws a table with its embedding_std"
            )
        raise ValueError(
            f"lsuv_: no layer to scale{chosen}: no module holds a weight LSUV scales (linear, "
            "convolution and attention layers, and those a handler registered with "
            f"initlab.register_handler describes); {left}; nothing was changed"
        )
    if all(u.kind == "static" for u in units):
        why = "; ".join(f"{u.name}: {u.skipped}" for u in units[:4])
        raise ValueError(
            f"lsuv_: no layer to scale{chosen}: every weight layer is one LSUV cannot scale ({why}"
            f"{' ...' if len(units) > 4 else ''}); nothing was changed"
        )


def _check_options(
    target: float,
    tol: float,
    max_iter: int,
    strategy: str,
    norm_mode: str,
    blocks: Selection | None,
    forward: Callable[[nn.Module, Any], Any] | None,
) -> tuple[float, float, Callable[[nn.Module, Any], Any]]:
    """Validate :func:`lsuv_`'s options; ``target``, ``tol`` as floats and the forward (the model
    itself: :func:`~initlab._core.compiled.takes_compiled`)."""
    target = _check_positive("target", target)
    tol = _check_positive("tol", tol)
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"max_iter must be an int >= 1, got {max_iter!r}")
    if strategy not in _MODES:
        raise ValueError(f"unknown strategy {strategy!r}; valid strategies: {list(_MODES)}")
    if norm_mode not in _NORM_MODES:
        raise ValueError(f"unknown norm_mode {norm_mode!r}; valid values: {list(_NORM_MODES)}")
    if blocks is not None and strategy == "layers":
        raise ValueError("blocks= is used by strategy='branches' or 'stream' only")
    if forward is None:
        forward = default_forward
    elif not callable(forward):
        raise TypeError(f"forward must be callable (model, batch) -> output, got {forward!r}")
    return target, tol, forward


def _refuse_complex_draw(units: Sequence[Unit]) -> None:
    """Raise ``TypeError`` naming the layers the orthogonal pre-init would draw whose weight is
    complex (``orthogonal_`` draws real matrices; torch's message named no layer and no fix)."""
    names = [
        u.name
        for u in units
        if u.weight is not None and u.weight.is_complex() and not (u.skipped or u.frozen)
    ]
    if names:
        raise TypeError(
            f"lsuv_: layer(s) {', '.join(names)} have a complex weight, and the orthogonal "
            "pre-init draws real matrices: pass orthogonal=False (LSUV then scales their "
            "weights as they are, to an output variance E|y - E y|^2 of target)"
        )


def _redrawn(units: Sequence[Unit]) -> list[torch.Tensor]:
    """The tensors the orthogonal pre-init replaces by rank 0's: the weights of the units it
    draws (a whole parameter; a row block of a fused one is not the parameter) and their
    trainable biases (zeroed)."""
    out: list[torch.Tensor] = []
    for u in units:
        if u.weight is not None and not (u.skipped or u.frozen):
            out.append(u.weight)
            out.extend(b for b in u.biases() if b.requires_grad)
    return out


def _take_data(
    data: Any, max_batches: int | None, concat_batches: bool
) -> tuple[DataUse, list[Any]]:
    """How much data was taken (the batches checked finite), and what each forward pass runs
    on."""
    taken = take_batches(data, max_batches, what="lsuv_", exact=False)
    for batch in taken:
        for path, t in flatten_tensors(batch):
            if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
                raise ValueError(f"lsuv_: the data has non-finite values (entry {path})")
    if concat_batches and len(taken) > 1:
        held = [bool(batch_tensors(b)) for b in taken]
        if any(held) and not all(held):
            i = held.index(False)
            raise TypeError(
                f"lsuv_: batch {i} holds no tensor: it is {shallow_types(taken[i])}, where other "
                "batches hold tensors, so the batches cannot be concatenated: drop it (a batch is "
                "a tensor, a tuple (x, y), a dict of model inputs or a custom object)"
            )
    runs = [_cat(taken, "")] if concat_batches and len(taken) > 1 else taken
    return data_use(taken), runs


@contextmanager
def _measuring_modes(model: nn.Module, norm_mode: str) -> Iterator[None]:
    """Eval mode (BatchNorm in train mode for ``norm_mode="train"``) and the fused attention fast
    path off; every flag, every buffer (what the passes' forwards wrote there: BatchNorm's
    running statistics, a model's own counters) and the fast path put back on exit."""
    mha_backend = getattr(torch.backends, "mha", None)
    fastpath = mha_backend.get_fastpath_enabled() if mha_backend is not None else None
    try:
        with model_kept(model, params="never", buffers="always"):
            _set_measuring_modes(model, norm_mode)
            if mha_backend is not None:
                mha_backend.set_fastpath_enabled(False)
            yield
    finally:
        if mha_backend is not None and fastpath is not None:
            mha_backend.set_fastpath_enabled(fastpath)


def _set_measuring_modes(model: nn.Module, norm_mode: str) -> None:
    """The modes of :func:`_measuring_modes`, set without saving anything to put back."""
    model.eval()
    if norm_mode == "train":
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.train()


def _run(
    model: nn.Module,
    engine: Engine,
    runs: list[Any],
    forward: Callable[[nn.Module, Any], Any],
    strategy: str,
    norm_mode: str,
    max_iter: int,
) -> tuple[int, int]:
    """The sweeps of one call, hooks installed: ``(forward passes, sweeps)``.

    A discovery pass first in the block modes; then correcting sweeps, each followed by a
    measuring one, until nothing is corrected and nothing is pending, or ``max_iter`` sweeps.
    """
    passes = 0
    sweeps = 0

    def run_pass(trace: bool = False) -> list[dict[str, Any]]:
        """One pass over the data; with ``trace``, the residual branches of its first batch."""
        nonlocal passes
        branches: list[dict[str, Any]] = []
        for i, batch in enumerate(runs):
            # a padded batch's statistics are over its real tokens (an encoder-decoder's: all)
            engine.batch = batch if masks_positions(model) else None
            if trace and i == 0:
                with recording(model) as graph:
                    forward(model, batch)
                branches = blocks_of(graph)
            else:
                forward(model, batch)
            passes += 1
        return branches

    with _measuring_modes(model, norm_mode), hook_handles() as handles:
        engine.install(handles)
        with torch.no_grad():
            if strategy != "layers":
                engine.discovering = True
                engine.begin_sweep(False)
                branches = run_pass(trace=strategy == "branches")
                engine.discovering = False
                engine.discover(strategy, branches)  # type: ignore[arg-type]
                _check_found(engine, strategy)
            _refuse_shared_memory(model, engine)  # before the first sweep writes anything
            while True:
                sweeps += 1
                engine.begin_sweep(sweeps <= max_iter)
                run_pass()
                engine.end_sweep()
                if engine.corrected:
                    continue  # measure again, with nothing rescaled
                if not engine.may_correct or not engine.pending() or sweeps >= max_iter:
                    break
    return passes, sweeps


def _refuse_shared_memory(model: nn.Module, engine: Engine) -> None:
    """Raise where a layer LSUV would write (its weight, and with the orthogonal pre-init its
    trainable biases; in the block modes only the layers the discovery pass left to scale) lies
    over the memory of another ``Parameter`` object
    (:func:`~initlab._core.modules.refuse_shared_writes`; a tie, one object, is one unit):
    scaling ``W_a <- s_a W_a`` and ``W_b <- s_b W_b`` would multiply that memory by both."""
    written: list[torch.Tensor] = []
    for u in engine.active:
        if u.weight is not None and not (u.skipped or u.frozen):
            written.append(u.weight)
            if engine.orthogonal:
                written.extend(b for b in u.biases() if b.requires_grad)
    refuse_shared_writes(
        "lsuv_",
        model,
        written,
        "each is scaled (and first drawn, with orthogonal=True) as a layer of its own, so the "
        "one memory would be multiplied by both layers' factors and neither output would end "
        "at the target",
    )


def _check_found(engine: Engine, strategy: str) -> None:
    """A block strategy needs a residual block: by type, by name or by the runtime trace."""
    if engine.block_names or engine.branch_ends:
        return
    raise ValueError(
        f"lsuv_: strategy={strategy!r} found no residual block: no module of a known block type "
        f"({list(KNOWN_BLOCKS)}) and no residual addition x + f(x) in a runtime trace of the "
        "first batch; pass blocks= (qualified names or a predicate (name, module) -> bool), or "
        "use strategy='layers'"
    )


def _report_rows(
    units: list[Unit], engine: Engine, target: float, tol: float
) -> tuple[list[dict[str, Any]], list[str]]:
    """The report's rows (:data:`LSUV_COLUMNS`, execution order) and the scaled layers that did
    not reach the target; marks the units that never ran."""
    for u in engine.active:
        if u.order is None and not u.skipped:
            u.skipped = NEVER
    rows = []
    ordered = sorted(units, key=lambda u: (u.order is None, u.order if u.order is not None else 0))
    for u in ordered:
        rows.append(
            {
                "layer": u.name,
                "module_type": u.module_type,
                "order": u.order,
                "calls": u.calls,
                "measured_at": u.measured_at(),
                "shared_with": ", ".join(n for n, _ in u.members[1:] if n != u.name),
                "scale": u.scale,
                "iterations": u.iterations,
                "var_before": u.var_before,
                "var_after": u.var_after,
                "skipped": u.skipped or u.frozen,
            }
        )
    scaled = [u for u in engine.active if not u.skipped and not u.frozen]
    off = [u.name for u in scaled if u.var_after is None or abs(u.var_after - target) >= tol]
    return rows, off


def _warn(units: list[Unit], off: list[str], target: float, tol: float, max_iter: int) -> None:
    """Warn about layers never run, dead, not scaled, or not within ``tol`` (for the caller of
    :func:`lsuv_`: ``user_stacklevel()``)."""
    never = [u.name for u in units if u.skipped == NEVER]
    dead = [u.name for u in units if u.skipped == DEAD]
    other = [
        f"{u.name} ({u.skipped})" for u in units if u.skipped and u.skipped not in (NEVER, DEAD)
    ]
    if never:
        warnings.warn(
            f"lsuv_: {len(never)} layer(s) never ran on the data and were skipped: {never} "
            "(their forward was not called; a weight the model uses directly, as in "
            "F.conv1d(x, layer.weight), is not seen)",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    if dead:
        warnings.warn(
            f"lsuv_: {len(dead)} layer(s) have zero output variance (dead) and were skipped: "
            f"{dead}",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    if other:
        warnings.warn(
            f"lsuv_: layer(s) not scaled: {other}", UserWarning, stacklevel=user_stacklevel()
        )
    if off:
        warnings.warn(
            f"lsuv_: {len(off)} layer(s) did not reach |Var - {target:g}| < {tol:g} within "
            f"max_iter={max_iter}: {off}",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
