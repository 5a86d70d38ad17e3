"""Train many small models at once: :func:`train_runs` (vectorized), :func:`train_one` (reference).

:func:`train_one` is a plain PyTorch loop (``nn.Module``, ``torch.optim.SGD``/``Adam``) and defines
what a run *is*. :func:`train_runs` trains ``R`` runs of one group (:meth:`RunConfig.group_key`)
together, with their parameters stacked along a leading run dimension, and gives the same numbers
up to float rounding. Per run and in both trainers:

1. **Model.** ``model = model_factory(config)`` in float32 (under a forked global RNG seeded with
   ``config.seed``), then ``init_model(model, config.scheme,
   generator=torch.Generator().manual_seed(config.seed))`` (``measure=False``: the report's
   statistics are skipped, the draws are the same), then the study's model options
   (:func:`initlab.study.models.apply_study_options`: conditioning multipliers), then
   ``.to(dtype).to(device)`` (a float64 run starts from the float32 run's weights).
2. **Data order.** Epoch ``e`` visits the training rows in the order :func:`epoch_order`
   ``(config.seed, e, n)``: a ``torch.randperm`` from a CPU generator seeded with a hash of
   ``(seed, e)``. Minibatches are consecutive slices of ``batch_size`` rows; the last, partial
   one is included, so an epoch has ``ceil(n / batch_size)`` steps.
3. **Output scale** (``config.output_std`` not ``None``), on the very first step only, in this
   order: forward the first minibatch to get the raw logits ``z`` (``B x C``); measure
   ``sd = z.std()`` (all ``B·C`` entries, Bessel-corrected, gradient-free); set
   ``c = output_std / sd`` (``c = 1`` if ``sd`` is not positive); the first step's loss is computed
   from ``z * c``. From then on the logits are ``model(x) * c`` with ``c`` fixed: a model with an
   ``output_scale`` buffer (:class:`initlab.zoo.PaperMLP`) gets ``output_scale *= c``; for other
   models the trainer multiplies their logits by ``c``.
4. **Step.** Loss: mean cross-entropy of the minibatch (recorded in ``step_loss``); gradient; the
   optimizer update with ``torch.optim`` semantics: SGD with momentum (dampening 0, no Nesterov,
   weight decay added to the gradient) or Adam (betas 0.9 / 0.999, eps 1e-8, weight decay added to
   the gradient).
5. **Evaluation** after every epoch (``evaluate="every_epoch"``, the default) or after the last
   one only (``"last_epoch"``; the other epochs' metrics are ``nan``): full passes (in chunks, no
   gradient, ``model.eval()``) over the training split and, if given, the test split: mean
   cross-entropy and accuracy. Only the last pass over the training split is needed for
   ``final_train_loss``; the others cost about a third of the training's arithmetic each epoch.
6. **Divergence.** The first training loss (a step loss or an epoch's train loss) that is not
   finite or exceeds :func:`~initlab.study.config.divergence_limit` of the run's first step loss
   (``1e6 * max(loss_0, 1)``: a loss grown a million-fold) marks the run ``diverged`` and freezes
   it: no further updates; that loss is recorded, later step losses and epoch metrics are
   ``nan``; ``final_train_loss`` is ``nan``. A run whose losses stay finite and under the limit
   is untouched by this step. In :func:`train_runs` its stacked parameters and
   optimizer state are zeroed from then on (the frozen values are kept aside for ``keep_state``),
   so nothing non-finite reaches the shared tensors and the other runs are unaffected.

Vectorization. A :class:`~initlab.zoo.paper_mlp.PaperMLP`, or an ``nn.Sequential`` of ``Linear``,
``ReLU`` and ``Identity`` (optionally led by a ``LayerNorm`` without affine parameters), runs on an
explicit engine (:class:`_MLPEngine`): weights stacked as ``(R, in, out)``, ``torch.baddbmm`` per
layer, a hand-written backward whose weight-gradient GEMM SGD accumulates straight into its
momentum buffer, and the fixed input LayerNorm applied once to the whole data set instead of per
batch. Any other model runs through ``torch.func.stack_module_state`` + ``vmap(functional_call)``
and autograd (deterministic models whose forward does not update buffers: no dropout, no
BatchNorm in training mode); a model with BatchNorm or dropout, and a convolutional model on the
CPU, is trained one run at a time (``engine="loop"``: :func:`train_one` per run, torch's RNG
forked and seeded per run for dropout).
On the CPU a group of 16 runs or more on the two vectorized engines is trained as independent
blocks of at most 16 runs (:func:`_blocks`), each block's ops on one intra-op thread; with
several torch threads the blocks run in that many Python threads (one thread per block of runs
scales where splitting every small batched product over threads does not). Runs trained one at
a time use torch's threads, so their numbers may depend on the thread count (at the level of
rounding). Each step gathers an ``(R, B, d)`` batch
with every run's own row indices. Per-run learning
rate, momentum and weight decay are ``(R,)`` tensors broadcast over the stacks (scalars where the
whole group shares the value).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from initlab._core.backward import with_grad
from initlab.study._vectorized import (
    _ADAM_BETAS,
    _ADAM_EPS,
    _Engine,
    _mlp_modules,
    _MLPEngine,
    _needs_one_at_a_time,
    _per_run,
    _VecAdam,
    _VecOptimizer,
    _VecSGD,
    _VmapEngine,
)
from initlab.study.config import RunConfig, RunResult, divergence_limit
from initlab.study.inputs import normalize_inputs

__all__ = ["ENGINES", "EVALUATIONS", "epoch_order", "train_one", "train_runs"]

#: ``engine=`` values of :func:`train_runs`.
ENGINES = ("auto", "mlp", "vmap", "loop")

#: ``evaluate=`` values of :func:`train_runs` and :func:`train_one`.
EVALUATIONS = ("every_epoch", "last_epoch")

#: Rows per evaluation chunk in :func:`train_runs`, and rows x runs per chunk (so the runs per
#: block): both independent of the number of runs in a group, so that a run's evaluation is
#: computed the same way (bit for bit) however the runner groups and chunks the runs. Small
#: blocks (4 runs x 512 rows: the paper MLP's activations and weights, ~1.6 MB, stay in a core's
#: L2 cache while a block's rows stream past) evaluate 1.35x faster on one thread than 64 runs x
#: 256 rows (89 vs 66 GFLOP/s on letter, 384/64 widths).
_EVAL_CHUNK_ROWS = 512
_EVAL_ELEMENTS = 2048
#: Rows per evaluation chunk in :func:`train_one`.
_EVAL_ROWS = 8192

ModelFactory = Callable[[RunConfig], nn.Module]
Split = tuple[Tensor, Tensor]


# ---------------------------------------------------------------------------------------------
# Shared pieces: data order, model construction, output scale, data preparation
# ---------------------------------------------------------------------------------------------


def epoch_order(seed: int, epoch: int, n: int) -> Tensor:
    """The order in which run ``seed`` visits ``n`` training rows in ``epoch`` (a CPU tensor).

    ``torch.randperm(n)`` from a fresh CPU generator seeded with the first 63 bits of
    ``sha256(f"initlab.order:{seed}:{epoch}")``: independent of the initialization's generator
    (seeded with ``seed``), the same in every process and for every device.
    """
    digest = hashlib.sha256(f"initlab.order:{seed}:{epoch}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randperm(n, generator=generator, device="cpu")


def _build_model(
    config: RunConfig,
    model_factory: ModelFactory,
    dtype: torch.dtype,
    device: torch.device,
    initialized: nn.Module | None = None,
) -> nn.Module:
    """Step 1 of the module docstring: build, cast, initialize with the run's seed, apply the
    study's model options, move. ``initialized``: the run's model already built and initialized
    (a data-dependent init, :mod:`initlab.study.pipelines`), only cast and moved."""
    from initlab.init.model import init_model  # imported late: keeps `initlab.study` light
    from initlab.study.models import apply_study_options
    from initlab.study.pipelines import check_data_free

    if initialized is not None:
        return initialized.to(dtype=dtype).to(device)
    check_data_free(config)  # a data-dependent init needs the data: `initialized` holds its result

    # Constructors draw PyTorch's default init from the global RNG: fork it, seeded by the run,
    # so anything the scheme leaves alone is reproducible too (and the caller's RNG untouched).
    # Built and drawn in float32, then cast: a float64 run (an exact check of a stored float32
    # one) starts from the same weights, not from float64 draws of another stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = model_factory(config).to(dtype=torch.float32)
    init_model(
        model, config.scheme, generator=torch.Generator().manual_seed(config.seed), measure=False
    )
    apply_study_options(model, config)
    return model.to(dtype=dtype).to(device)


def _scale_from_std(std: Tensor, target: Tensor) -> Tensor:
    """``target / std`` where ``std > 0``, else 1 (also for a ``nan`` std)."""
    return torch.where(std > 0, target / std, torch.ones_like(std))


def _has_scale_buffer(model: nn.Module) -> bool:
    buf = getattr(model, "output_scale", None)
    return isinstance(buf, Tensor) and buf.numel() == 1 and any(b is buf for b in model.buffers())


def _prepare(
    split: Split, device: torch.device, dtype: torch.dtype, name: str, like: Tensor | None = None
) -> Split:
    """``split`` checked and moved; ``like``: the training inputs, whose example shape a test
    split must have (checked here, not by a shape error after the first epoch has trained)."""
    x, y = split
    if x.ndim < 2 or y.ndim != 1 or x.shape[0] != y.shape[0]:
        raise ValueError(
            f"{name} must be (x: (n, ...), y: (n,)), got shapes {tuple(x.shape)} and "
            f"{tuple(y.shape)}"
        )
    if x.shape[0] == 0:
        raise ValueError(f"{name} split is empty")
    if like is not None and x.shape[1:] != like.shape[1:]:
        raise ValueError(
            f"{name} inputs have examples of shape {tuple(x.shape[1:])}, the training inputs "
            f"{tuple(like.shape[1:])}: the {name} split must have the training split's features"
        )
    return x.to(device=device, dtype=dtype), y.to(device=device, dtype=torch.long)


def _check_group(configs: Sequence[RunConfig]) -> None:
    keys = {c.group_key() for c in configs}
    if len(keys) > 1:
        raise ValueError(
            "train_runs needs configs that share RunConfig.group_key() (dataset, model, "
            f"model_cfg, optimizer, epochs, batch_size, input_norm); got {len(keys)} groups, e.g. "
            f"{list(keys)[:2]}"
        )


def _torch_optimizer(config: RunConfig, params: Any) -> torch.optim.Optimizer:
    if config.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
    return torch.optim.Adam(
        params, lr=config.lr, betas=_ADAM_BETAS, eps=_ADAM_EPS, weight_decay=config.weight_decay
    )


def _result(
    config: RunConfig,
    step_loss: list[float],
    train_metrics: list[tuple[float, float]],
    test_metrics: list[tuple[float, float]],
    diverged: bool,
    wall_s: float,
    state: dict[str, Tensor] | None,
) -> RunResult:
    train_loss = [m[0] for m in train_metrics]
    return RunResult(
        config=config,
        step_loss=step_loss,
        epoch_train_loss=train_loss,
        epoch_train_acc=[m[1] for m in train_metrics],
        epoch_test_loss=[m[0] for m in test_metrics],
        epoch_test_acc=[m[1] for m in test_metrics],
        diverged=diverged,
        final_train_loss=math.nan if diverged else train_loss[-1],
        wall_s=wall_s,
        state=state,
    )


# ---------------------------------------------------------------------------------------------
# The reference: one run, plain PyTorch
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def _evaluate_one(
    model: nn.Module, mult: float | Tensor, x: Tensor, y: Tensor
) -> tuple[float, float]:
    model.eval()
    loss_sum, correct = 0.0, 0
    for start in range(0, x.shape[0], _EVAL_ROWS):
        logits = model(x[start : start + _EVAL_ROWS]) * mult
        yc = y[start : start + _EVAL_ROWS]
        loss_sum += float(F.cross_entropy(logits, yc, reduction="sum"))
        correct += int((logits.argmax(dim=-1) == yc).sum())
    return loss_sum / x.shape[0], correct / x.shape[0]


@with_grad  # trains whatever the caller's grad mode, inference mode included
def train_one(
    config: RunConfig,
    train: Split,
    test: Split | None = None,
    *,
    model_factory: ModelFactory,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    keep_state: bool = False,
    evaluate: str = "every_epoch",
    initialized: nn.Module | None = None,
) -> RunResult:
    """Train one run in a plain PyTorch loop: the reference that :func:`train_runs` must match.

    Follows steps 1-6 of the module docstring with an ``nn.Module`` and ``torch.optim``.

    Args:
        config: the run.
        train: ``(x, y)`` training split: ``x`` is ``(n, ...)``, ``y`` class indices ``(n,)``.
        test: optional test split, evaluated after every epoch.
        model_factory: builds the (uninitialized) model for a config.
        device: where to train.
        dtype: floating dtype of the model and the inputs (``torch.float64`` for exact checks:
            the model is built and initialized in float32 and cast, so it starts from the same
            weights as the float32 run).
        keep_state: store the final ``state_dict`` in :attr:`RunResult.state` (see
            :func:`train_runs` for models without an ``output_scale`` buffer).
        evaluate: ``"every_epoch"`` or ``"last_epoch"`` (module docstring, step 5).
        initialized: the run's model, built and initialized already (a data-dependent init:
            :func:`initlab.study.pipelines.initialize_run`); used in place of step 1, trained
            in place. Required for a run whose ``scheme`` has data-dependent steps.
    """
    start = time.perf_counter()
    _check_evaluate(evaluate)
    device = torch.device(device)
    train, test = normalize_inputs(config.input_norm, train, test)  # RunConfig.input_norm
    x, y = _prepare(train, device, dtype, "train")
    test_xy = _prepare(test, device, dtype, "test", like=x) if test is not None else None
    model = _build_model(config, model_factory, dtype, device, initialized)
    optimizer = _torch_optimizer(config, model.parameters())
    use_buffer = _has_scale_buffer(model)
    mult: float | Tensor = 1.0  # logit multiplier for models without an ``output_scale`` buffer
    n, bs = x.shape[0], config.batch_size
    steps = math.ceil(n / bs)
    step_loss: list[float] = []
    train_metrics: list[tuple[float, float]] = []
    test_metrics: list[tuple[float, float]] = []
    diverged = False
    limit = math.inf  # step 6: set from the first step's loss
    for epoch in range(config.epochs):
        if not diverged:
            mult, limit, diverged = _train_epoch(
                config, model, optimizer, x, y, epoch, steps, mult, limit, step_loss,
                use_buffer, device, dtype,
            )  # fmt: skip
        skip = evaluate == "last_epoch" and epoch < config.epochs - 1
        if diverged or skip:  # diverged (frozen) or not evaluated after this epoch
            train_metrics.append((math.nan, math.nan))
            if test_xy is not None:
                test_metrics.append((math.nan, math.nan))
            continue
        train_metrics.append(_evaluate_one(model, mult, x, y))
        if test_xy is not None:
            test_metrics.append(_evaluate_one(model, mult, *test_xy))
        if not (math.isfinite(train_metrics[-1][0]) and train_metrics[-1][0] <= limit):
            diverged = True
    step_loss += [math.nan] * (config.epochs * steps - len(step_loss))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()} if keep_state else None
    return _result(
        config,
        step_loss,
        train_metrics,
        test_metrics,
        diverged,
        time.perf_counter() - start,
        state,
    )


def _train_epoch(
    config: RunConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: Tensor,
    y: Tensor,
    epoch: int,
    steps: int,
    mult: float | Tensor,
    limit: float,
    step_loss: list[float],
    use_buffer: bool,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[float | Tensor, float, bool]:
    """The steps of one epoch of :func:`train_one` (module docstring, steps 2-4 and 6), each
    loss appended to ``step_loss``, up to the first that diverges; returns ``(mult, limit,
    diverged)``, the logit multiplier and divergence limit set on the very first step."""
    n, bs = x.shape[0], config.batch_size
    diverged = False
    order = epoch_order(config.seed, epoch, n).to(device)
    model.train()
    for s in range(steps):
        idx = order[s * bs : (s + 1) * bs]
        xb, yb = x[idx], y[idx]
        logits = model(xb) * mult
        fold: Tensor | None = None
        if epoch == 0 and s == 0 and config.output_std is not None:
            target = torch.tensor(config.output_std, dtype=dtype, device=device)
            c = _scale_from_std(logits.detach().std(), target)
            logits = logits * c
            if use_buffer:
                fold = c  # folded into the buffer after this step (autograd saved it)
            else:
                mult = c
        loss = F.cross_entropy(logits, yb)
        value = loss.item()
        step_loss.append(value)
        if epoch == 0 and s == 0:
            limit = divergence_limit(value)
        if math.isfinite(value) and value <= limit:
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        else:
            diverged = True
        if fold is not None:
            with torch.no_grad():
                model.output_scale.mul_(fold)  # type: ignore[operator]
        if diverged:
            break
    return mult, limit, diverged


# ---------------------------------------------------------------------------------------------
# The vectorized trainer
# ---------------------------------------------------------------------------------------------


def _cross_entropy_and_grad(logits: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """Per-run mean cross-entropy ``(R,)`` of logits ``(R, B, C)`` and its gradient
    ``(softmax - onehot) / B`` w.r.t. the logits, from one ``log_softmax`` (as
    ``F.cross_entropy`` computes it)."""
    b = logits.shape[1]
    idx = y.unsqueeze(2)
    log_p = torch.log_softmax(logits, dim=2)
    loss = log_p.gather(2, idx).squeeze(2).mean(dim=1).neg_()
    grad = log_p.exp_()  # softmax, in place (the loss above is computed already)
    grad.scatter_add_(2, idx, torch.full_like(idx, -1, dtype=grad.dtype))
    return loss, grad.div_(b)


@torch.no_grad()
def _evaluate_runs(
    eng: _Engine, scale: Tensor, x: Tensor, y: Tensor, n_runs: int
) -> tuple[Tensor, Tensor]:
    """Mean cross-entropy and accuracy of every run on a whole split, as ``(R,)`` float64.

    Blocks of at most ``_EVAL_ELEMENTS // _EVAL_CHUNK_ROWS`` runs, chunks of
    ``_EVAL_CHUNK_ROWS`` rows: the same for every group, so each run's numbers do not depend on
    which runs it is evaluated with.
    """
    loss_sum = torch.zeros(n_runs, dtype=torch.float64, device="cpu")
    correct = torch.zeros(n_runs, dtype=torch.float64, device="cpu")
    rows, block = _EVAL_CHUNK_ROWS, max(1, _EVAL_ELEMENTS // _EVAL_CHUNK_ROWS)
    for r0 in range(0, n_runs, block):
        runs = slice(r0, min(n_runs, r0 + block))
        r = runs.stop - runs.start
        for i in range(0, x.shape[0], rows):
            cx, cy = x[i : i + rows], y[i : i + rows]
            logits = eng.forward(cx.unsqueeze(0).expand(r, *cx.shape), train=False, runs=runs)
            logits = logits * _per_run(scale[runs], logits)
            b, c = logits.shape[1:]
            ry = cy.unsqueeze(0).expand(r, -1)
            losses = F.cross_entropy(logits.reshape(r * b, c), ry.reshape(r * b), reduction="none")
            loss_sum[runs] += losses.view(r, b).sum(dim=1).double().cpu()
            correct[runs] += (logits.argmax(dim=-1) == ry).sum(dim=1).double().cpu()
    return loss_sum / x.shape[0], correct / x.shape[0]


def _check_evaluate(evaluate: str) -> None:
    if evaluate not in EVALUATIONS:
        raise ValueError(f"evaluate must be one of {EVALUATIONS}, got {evaluate!r}")


def train_runs(
    configs: Sequence[RunConfig],
    train: Split,
    test: Split | None = None,
    *,
    model_factory: ModelFactory,
    device: str | torch.device = "cpu",
    progress: Callable[[int, int], None] | None = None,
    dtype: torch.dtype = torch.float32,
    keep_state: bool = False,
    engine: str = "auto",
    evaluate: str = "every_epoch",
    initialized: Sequence[nn.Module | None] | None = None,
) -> list[RunResult]:
    """Train the runs of one group together; the same results as :func:`train_one` per run.

    Args:
        configs: runs sharing :meth:`RunConfig.group_key` (``ValueError`` otherwise); they may
            differ in scheme, seed, lr, momentum, weight decay and output std.
        train: ``(x, y)`` training split: ``x`` is ``(n, ...)``, ``y`` class indices ``(n,)``.
        test: optional test split, evaluated after every epoch.
        model_factory: builds the (uninitialized) model for a config.
        device: where to train.
        progress: called as ``progress(steps_done, steps_total)`` after every optimization step
            (of every block of runs: see :func:`_blocks`; ``steps_total`` counts each block's).
        dtype: floating dtype of the models and inputs (``torch.float64`` for exact checks).
        keep_state: store each run's final ``state_dict`` in :attr:`RunResult.state` (for a
            diverged run: its frozen parameters). A model without an ``output_scale`` buffer
            does not hold the output scale ``c``: the state is its parameters only.
        engine: ``"auto"`` (the explicit MLP engine where the model allows it, one run at a
            time for models with BatchNorm or dropout and for convolutional models on the CPU,
            else vmap), ``"mlp"``, ``"vmap"`` or ``"loop"`` (:func:`train_one` per run).
        evaluate: ``"every_epoch"`` (default) or ``"last_epoch"``: the full passes of step 5
            after every epoch, or after the last one only (the result's ``final_train_loss``
            needs only that one; the others' metrics are ``nan``, and a divergence is then seen
            in the step losses or the last pass).
        initialized: per config, its model built and initialized already (a data-dependent
            init: :func:`initlab.study.pipelines.initialize_run`), used in place of step 1 and
            stacked like the built ones (so such runs train vectorized too), or ``None`` (built
            as step 1 says). Required for runs whose ``scheme`` has data-dependent steps.

    Returns:
        One :class:`RunResult` per config, in order; ``wall_s`` is this call's wall time divided by
        the number of runs.
    """
    start = time.perf_counter()
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if not configs:
        return []
    _check_group(configs)
    _check_evaluate(evaluate)
    if initialized is not None and len(initialized) != len(configs):
        raise ValueError(
            f"initialized needs one model per config: {len(initialized)} for {len(configs)}"
        )
    loop_kw = {"model_factory": model_factory, "dtype": dtype, "keep_state": keep_state}
    loop_kw.update(evaluate=evaluate, initialized=initialized)
    if engine == "loop" or (engine == "auto" and _one_at_a_time(configs[0], model_factory, device)):
        return _train_each(configs, train, test, device=device, progress=progress, **loop_kw)
    train, test = normalize_inputs(configs[0].input_norm, train, test)  # RunConfig.input_norm
    device = torch.device(device)
    given = initialized if initialized is not None else [None] * len(configs)
    models = [
        _build_model(c, model_factory, dtype, device, m)
        for c, m in zip(configs, given, strict=True)
    ]
    blocks = _blocks(len(configs), device)
    engines = [_make_engine(models[b], engine, train[0]) for b in blocks]

    raw, y = _prepare(train, device, dtype, "train")
    x = engines[0].preprocess(raw)  # a per-row transform, the same for every block
    test_xy = None
    if test is not None:
        tx, ty = _prepare(test, device, dtype, "test", like=raw)
        test_xy = (engines[0].preprocess(tx), ty)
    report = _BlockProgress(progress, len(blocks))

    def train_block(i: int) -> _Group:
        group = _Group(configs[blocks[i]], models[blocks[i]], engines[i], dtype, device, keep_state)
        group.allocate(x.shape[0], has_test=test_xy is not None)
        for epoch in range(group.epochs):
            group.train_epoch(epoch, x, y, report)
            if evaluate == "every_epoch" or epoch == group.epochs - 1:
                group.evaluate_epoch(epoch, (x, y), test_xy)
        return group

    groups = _run_blocks(train_block, len(blocks))
    states = [g.final_states() for g in groups]
    wall = (time.perf_counter() - start) / len(configs)
    return [r for g, st in zip(groups, states, strict=True) for r in g.results(wall, st)]


#: A group of runs is trained as independent blocks of at most this many runs (on the CPU): in
#: parallel threads of one intra-op thread each when torch has several threads. Small batched
#: products split over two threads synchronize every few microseconds (the 140 runs of
#: Table 2's letter slice took 42.7 s on two threads, 1.7x the time of one thread per half).
#: Small blocks keep a block's weights, momentum and activations in cache: the letter slice (140
#: runs: 12 blocks of 11-12) took 20.2-21.0 s against 21.8-22.5 s in 4 blocks of 35 (48 here),
#: dna's 140 runs 6.6 against 6.9-7.1 s, with bit-identical results.
_BLOCK_RUNS = 16
#: Fewer runs than this per block are not split (one block, torch's intra-op threads).
_MIN_BLOCK_RUNS = 8


def _blocks(n_runs: int, device: torch.device) -> list[slice]:
    """The blocks of a group of ``n_runs``: a multiple of 4 blocks (even work for 2 or 4
    threads) of at most :data:`_BLOCK_RUNS` runs, fewer where a block would get under
    :data:`_MIN_BLOCK_RUNS`; sizes differ by at most one; one block off the CPU. They depend on
    ``n_runs`` only, never on the thread count, so a run's arithmetic does not either (each
    block runs on one thread)."""
    k = -(-n_runs // _BLOCK_RUNS)
    k = max(1, min(-(-k // 4) * 4, n_runs // _MIN_BLOCK_RUNS))
    if device.type != "cpu":
        k = 1
    size, extra = divmod(n_runs, k)
    bounds = [0]
    for i in range(k):
        bounds.append(bounds[-1] + size + (i < extra))
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


def _run_blocks(fn: Callable[[int], _Group], n_blocks: int) -> list[_Group]:
    """``[fn(i) for i in range(n_blocks)]``; with several blocks and several torch threads, in
    that many Python threads (each block's ops then run on one intra-op thread; torch's thread
    count is restored afterwards)."""
    threads = min(torch.get_num_threads(), n_blocks)
    if threads <= 1:
        return [fn(i) for i in range(n_blocks)]

    def one_thread(i: int) -> _Group:
        torch.set_num_threads(1)  # this thread's OpenMP and MKL settings
        return fn(i)

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="train_runs") as pool:
            return list(pool.map(one_thread, range(n_blocks)))
    finally:
        torch.set_num_threads(before)


class _BlockProgress:
    """``progress(steps_done, steps_total)`` over all blocks (thread-safe): each block's steps
    count once, so ``steps_total`` is the blocks times the steps of one run."""

    def __init__(self, progress: Callable[[int, int], None] | None, n_blocks: int) -> None:
        self.progress, self.n_blocks = progress, n_blocks
        self.done = 0
        self.lock = threading.Lock()

    def __call__(self, step: int, total: int) -> None:
        if self.progress is None:
            return
        with self.lock:
            self.done += 1
            self.progress(self.done, total * self.n_blocks)


def _make_engine(models: Sequence[nn.Module], engine: str, x: Tensor) -> _Engine:
    """The explicit MLP engine where ``engine``, the model and the inputs ``x`` allow it, else
    the vmap engine."""
    mods = _mlp_modules(models[0]) if engine in ("auto", "mlp") else None
    mlp = _MLPEngine(models, mods) if mods is not None else None
    if mlp is not None and mlp.accepts(x):
        return mlp
    if engine == "mlp":
        raise ValueError(
            "engine='mlp' needs a PaperMLP or an nn.Sequential of Linear/ReLU/Identity (led by "
            "at most a Flatten and a LayerNorm without affine parameters) and inputs it takes "
            f"as rows, got {type(models[0]).__name__} on inputs {tuple(x.shape)}"
        )
    return _VmapEngine(models)


def _one_at_a_time(
    config: RunConfig, model_factory: ModelFactory, device: str | torch.device
) -> bool:
    """Whether ``engine="auto"`` trains the group's model one run at a time: models with
    BatchNorm or dropout (vmap cannot), and convolutional models on the CPU, where a convolution
    over a whole minibatch already runs at oneDNN's speed and vmap's grouped convolution of the
    stacked runs is slower (1.2-1.7x on the zoo's strided AlexNet and FitNet)."""
    with torch.random.fork_rng(devices=[]):
        model = model_factory(config)
    if _needs_one_at_a_time(model):
        return True
    has_conv = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    return has_conv and torch.device(device).type == "cpu"


def _train_each(
    configs: Sequence[RunConfig],
    train: Split,
    test: Split | None,
    *,
    device: str | torch.device,
    progress: Callable[[int, int], None] | None,
    initialized: Sequence[nn.Module | None] | None = None,
    **kwargs: Any,
) -> list[RunResult]:
    """``engine="loop"``: :func:`train_one` per run, with torch's global RNG forked and seeded
    from ``sha256(f"initlab.rng:{seed}")`` (dropout masks reproducible, the caller's RNG state
    untouched); ``progress`` is called after each run. Each run trains on torch's threads (not
    pinned like :func:`_blocks`' blocks: a convolution gains from them), so its numbers may
    differ between thread counts at the level of rounding."""
    start = time.perf_counter()
    device = torch.device(device)
    results = []
    for i, config in enumerate(configs):
        digest = hashlib.sha256(f"initlab.rng:{config.seed}".encode()).digest()
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
            model = initialized[i] if initialized is not None else None
            results.append(
                train_one(config, train, test, device=device, initialized=model, **kwargs)
            )
        if progress is not None:
            steps = len(results[0].step_loss)
            progress((i + 1) * steps, len(configs) * steps)
    wall = (time.perf_counter() - start) / len(configs)
    return [dataclasses.replace(r, wall_s=wall) for r in results]


class _Group:
    """The state of :func:`train_runs` over one group: stacked parameters (through the engine),
    the optimizer, each run's logit multiplier, its records and which runs are still alive."""

    def __init__(
        self,
        configs: Sequence[RunConfig],
        models: Sequence[nn.Module],
        eng: _Engine,
        dtype: torch.dtype,
        device: torch.device,
        keep_state: bool,
    ) -> None:
        cfg0 = configs[0]
        self.configs, self.models, self.eng = configs, models, eng
        self.dtype, self.device, self.keep_state = dtype, device, keep_state
        self.n_runs = n_runs = len(configs)
        self.batch_size, self.epochs = cfg0.batch_size, cfg0.epochs
        self.params = eng.params
        opt_cls = _VecSGD if cfg0.optimizer == "sgd" else _VecAdam
        self.opt: _VecOptimizer = opt_cls(self.params, configs)
        # The logit multiplier per run: on the MLP engine it includes the models' own
        # ``output_scale`` buffers (the vmap engine applies buffers itself); times c after step one.
        self.use_buffer = [_has_scale_buffer(m) for m in models]
        self.scale = torch.ones(n_runs, dtype=dtype, device=device)
        if isinstance(eng, _MLPEngine):
            for r, m in enumerate(models):
                if self.use_buffer[r]:
                    self.scale[r] = m.output_scale.detach().reshape(())  # type: ignore[union-attr]
        self.target_std = torch.tensor(
            [c.output_std if c.output_std is not None else math.nan for c in configs],
            dtype=dtype,
            device=device,
        )
        self.wants_scale = torch.tensor([c.output_std is not None for c in configs], device=device)
        self.run_c = torch.ones(n_runs, dtype=dtype, device=device)  # the c of step 3
        cpu = torch.device("cpu")  # the bookkeeping below: per-run numbers, read on the host
        self.limit = torch.full((n_runs,), math.inf, dtype=torch.float64, device=cpu)  # step 6
        self.alive = torch.ones(n_runs, dtype=torch.bool, device=cpu)
        self.alive_dev = self.alive.to(device)
        self.frozen: dict[int, list[Tensor]] = {}

    def allocate(self, n: int, *, has_test: bool) -> None:
        """The records: per-step losses and per-epoch ``(loss, accuracy)`` of each split."""
        self.n = n
        self.steps = math.ceil(n / self.batch_size)
        self.total = self.steps * self.epochs
        self.has_test = has_test
        nan, f64, cpu = math.nan, torch.float64, torch.device("cpu")
        self.step_loss = torch.full((self.total, self.n_runs), nan, dtype=f64, device=cpu)
        self.ep_train = torch.full((self.epochs, self.n_runs, 2), nan, dtype=f64, device=cpu)
        self.ep_test = torch.full((self.epochs, self.n_runs, 2), nan, dtype=f64, device=cpu)

    def freeze(self, runs: list[int]) -> None:
        """Mark runs diverged: zero learning rate from the next update on; keep their values."""
        for r in runs:
            if self.keep_state:
                self.frozen[r] = [p[r].detach().clone() for p in self.params]
            self.alive[r] = False
        self.alive_dev = self.alive.to(self.device)
        self.opt.set_alive(self.alive)

    def clear(self, runs: list[int]) -> None:
        """Zero frozen runs' stacked values (after any backward pass that saved them), so no
        non-finite number stays in the shared tensors."""
        with torch.no_grad():
            for t in [*self.params, *self.opt.state_tensors()]:
                t[runs] = 0

    def train_epoch(
        self, epoch: int, x: Tensor, y: Tensor, progress: Callable[[int, int], None] | None
    ) -> None:
        """Steps 2-4 and 6 of the module docstring for every minibatch of ``epoch``."""
        n_runs, bs = self.n_runs, self.batch_size
        orders = torch.stack([epoch_order(c.seed, epoch, self.n) for c in self.configs])
        orders = orders.to(self.device)
        self.eng.train(True)
        for s in range(self.steps):
            idx = orders[:, s * bs : (s + 1) * bs]
            b = idx.shape[1]
            flat = idx.reshape(-1)
            xb = x.index_select(0, flat).view(n_runs, b, *x.shape[1:])
            yb = y.index_select(0, flat).view(n_runs, b)
            self.step(epoch * self.steps + s, xb, yb, first=epoch == 0 and s == 0)
            if progress is not None:
                progress(epoch * self.steps + s + 1, self.total)

    def step(self, g_step: int, xb: Tensor, yb: Tensor, *, first: bool) -> None:
        """One optimization step of every run on its minibatch ``(xb, yb)``."""
        raw = self.eng.forward(xb, train=True)
        mult = _per_run(self.scale, raw)
        logits = raw * mult
        if first and bool(self.wants_scale.any()):
            sd = logits.reshape(self.n_runs, -1).std(dim=1)
            self.run_c = torch.where(
                self.wants_scale, _scale_from_std(sd, self.target_std), self.run_c
            )
            logits = logits * _per_run(self.run_c, logits)
            mult = mult * _per_run(self.run_c, logits)
            self.scale = self.scale * self.run_c
        loss, dlogits = _cross_entropy_and_grad(logits, yb)
        values = loss.to(dtype=torch.float64, device="cpu")
        self.step_loss[g_step] = torch.where(self.alive, values, math.nan)
        if g_step == 0:
            self.limit = torch.tensor([divergence_limit(v) for v in values.tolist()], device="cpu")
        bad = self.alive & ~(torch.isfinite(values) & (values <= self.limit))
        frozen_now = bad.nonzero().flatten().tolist() if bool(bad.any()) else []
        if frozen_now:
            self.freeze(frozen_now)
        draw = torch.where(_per_run(self.alive_dev, dlogits), dlogits * mult, 0.0)
        self.eng.backward_step(draw, self.opt, frozen_now)
        if frozen_now:
            self.clear(frozen_now)

    def evaluate_epoch(self, epoch: int, train: Split, test: Split | None) -> None:
        """Step 5 (evaluation), then freeze the runs whose epoch train loss is not finite or
        over their divergence limit (step 6)."""
        self.eng.train(False)
        for split, out in (train, self.ep_train), (test, self.ep_test):
            if split is not None:
                loss_e, acc_e = _evaluate_runs(self.eng, self.scale, *split, self.n_runs)
                out[epoch] = torch.stack([loss_e, acc_e], dim=1)
                out[epoch][~self.alive] = math.nan
        loss = self.ep_train[epoch, :, 0]
        bad = self.alive & ~(torch.isfinite(loss) & (loss <= self.limit))
        if bool(bad.any()):
            runs = bad.nonzero().flatten().tolist()
            self.freeze(runs)
            self.clear(runs)

    def final_states(self) -> list[dict[str, Tensor] | None]:
        """Each run's final ``state_dict`` (``keep_state``; frozen values for diverged runs)."""
        states: list[dict[str, Tensor] | None] = [None] * self.n_runs
        if not self.keep_state:
            return states
        final = [
            self.frozen[r] if r in self.frozen else [p[r].detach() for p in self.params]
            for r in range(self.n_runs)
        ]
        self.eng.write_back(self.models, final)
        for r, m in enumerate(self.models):
            if self.use_buffer[r]:
                with torch.no_grad():
                    if isinstance(self.eng, _MLPEngine):
                        m.output_scale.copy_(self.scale[r])  # type: ignore[operator]
                    else:
                        m.output_scale.mul_(self.run_c[r])  # type: ignore[operator]
            states[r] = {k: v.detach().clone() for k, v in m.state_dict().items()}
        return states

    def results(self, wall: float, states: list[dict[str, Tensor] | None]) -> list[RunResult]:
        """One :class:`RunResult` per config, in order."""
        results = []
        for r, config in enumerate(self.configs):
            test = self.ep_test[:, r].tolist() if self.has_test else []
            results.append(
                _result(
                    config,
                    self.step_loss[:, r].tolist(),
                    [(float(a), float(b)) for a, b in self.ep_train[:, r].tolist()],
                    [(float(a), float(b)) for a, b in test],
                    diverged=not self.alive[r].item(),
                    wall_s=wall,
                    state=states[r],
                )
            )
        return results
