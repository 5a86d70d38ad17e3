"""Running data through a :class:`~initlab.measure.probe.moment_probe.MomentProbe`:
:func:`measure_moments`, and the probed pass of a loss other entry points share
(:func:`probed_backward`; :func:`probe_options`, the probe's keyword options)."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from initlab._core.backward import backward_of, check_trainable, finite_loss, with_grad
from initlab._core.compiled import takes_compiled
from initlab._core.data import DataUse, default_forward, examples_in, iter_batches
from initlab._core.knobs import check_kwargs, parameter_names, renamed_kwargs
from initlab._core.loss import Loss, LossLike, resolve_loss
from initlab._core.loss_counts import batch_reduction, example_count
from initlab._core.parametrized import reading_layers
from initlab._core.rng import Seeds
from initlab._core.state import preserved_state
from initlab.measure.probe.batch import target_rows
from initlab.measure.probe.moment_probe import MomentProbe

__all__ = ["measure_moments", "probe_options", "probed_backward"]


@takes_compiled
@with_grad
@renamed_kwargs(batches="data")
@reading_layers
def measure_moments(
    model: nn.Module,
    data: Any,
    loss_fn: LossLike = None,
    *,
    max_batches: int | None = None,
    generator: torch.Generator | int | None = None,
    **probe_kwargs: Any,
) -> MomentProbe:
    """Run a :class:`MomentProbe` over ``data`` and return it (read it with ``table()`` etc.).

    Args:
        model: the model; its train/eval mode is left as it is.
        data: one batch or many (:mod:`initlab._core.data`): one batch is a tensor, a tuple such
            as ``(x, y)``, a dict of model inputs (``model(**batch)``) or a ``[x, y]`` list from
            default collate; many batches are a ``DataLoader``, any iterable or generator of
            batches, a list of ``(x, y)`` tuples, or ``initlab.Batches([...])``. Batches are
            read one at a time (a loader is streamed, never held whole). A list of same-shaped
            tensors is ambiguous and raises :class:`~initlab.AmbiguousDataError`.
        loss_fn: the loss the probe back-propagates, in any form
            :func:`~initlab._core.loss.resolve_loss` accepts: ``loss_fn(model, batch)``, a
            criterion such as ``nn.CrossEntropyLoss()`` or ``F.cross_entropy`` (applied to
            ``(x, y)`` batches), ``"model"`` for the model's own ``output.loss``, or a name
            (``"cross_entropy"``, ``"mse"``, ``"auto"``, ``"random_quadratic"``). ``None``:
            forward only, under ``torch.no_grad()``, with the default forward (``model(x)``,
            ``model(batch[0])``, ``model(**batch)``).
        max_batches: read at most this many batches (``None``: all; data without a length, a
            generator or an ``IterableDataset``, is read up to 1000 batches, and more raise:
            pass ``max_batches=``).
        generator: seed (or ``torch.Generator``) of the passes' random draws (dropout masks):
            batch ``i`` runs in its own forked-RNG scope (:class:`~initlab._core.rng.Seeds`),
            so the same call on the same batches gives the same moments whatever torch's global
            RNG holds (a shuffling ``DataLoader``'s order is drawn from it); ``None``: a fixed
            seed.
        **probe_kwargs: passed to :class:`MomentProbe` (``modules``, ``per_example``, ...).
            ``loss_reduction`` left out or ``None``: the loss's own where it declares one (a
            criterion's ``reduction``), else ``"mean"``; one that contradicts it raises.

    Returns:
        The probe, with ``probe.used`` (:class:`~initlab._core.data.DataUse`: batches read, and
        the examples: the batch sizes the gradients were scaled by).

    Raises:
        ValueError: ``data`` holds no batch, a weight is recomputed by the hook-based
            ``torch.nn.utils.weight_norm``/``spectral_norm``, or the batch size is unclear
            (:mod:`~initlab.measure.probe.batch`). Tensors computed by ``torch.nn.utils.
            parametrize`` parametrizations are measured as computed (:mod:`initlab.measure.probe`).

    The model is left as it was (:func:`~initlab._core.state.preserved_state`), on success and
    on failure: weights, buffers (a train-mode BatchNorm's running statistics), train/eval modes,
    the random number generators, and every parameter's ``.grad`` (set to ``None`` for the
    measurement, so gradients you accumulated before are untouched).

    Under ``torch.distributed`` the moments are this rank's own, on its own batches: nothing is
    pooled over the ranks and no collective runs (:func:`~initlab.gr_scaling` with
    ``all_reduce=True`` pools them). A ``DistributedDataParallel`` model is measured as the
    module it wraps, without DDP's buffer broadcast or gradient all-reduce
    (:func:`~initlab._core.distributed.local_passes`): the same moments as that module's on this
    rank, the layers named as in the DDP model (``module.0``), and DDP's state left as it was.
    """
    check_kwargs(
        "measure_moments",
        probe_kwargs,
        probe_options(),
        own=parameter_names(measure_moments),
    )
    loss = None if loss_fn is None else resolve_loss(loss_fn, what="measure_moments")
    if loss is not None:
        check_trainable(model, "measure_moments")
    probe_kwargs["loss_reduction"] = batch_reduction(
        loss, probe_kwargs.get("loss_reduction"), "measure_moments"
    )
    probe = MomentProbe(model, **probe_kwargs)
    params = list(model.parameters())
    seeds = Seeds(model, generator)
    n_batches = n_examples = 0
    # The model comes back as it was: weights, buffers (BatchNorm statistics), modes, .grad, RNGs.
    with preserved_state(model):
        for p in params:
            p.grad = None
        with probe:
            for batch in iter_batches(data, max_batches, what="measure_moments"):
                n_batches += 1
                probe._root = None
                with seeds.scope(n_batches - 1):
                    _run(probe, model, batch, loss, params, n_batches - 1)
                root = probe._root  # the examples the probe scaled by, where the model ran
                n_examples += root.size if root and root.size is not None else examples_in(batch)
    if n_batches == 0:
        raise ValueError("measure_moments got no batch: the data is empty")
    probe.used = DataUse(n_batches, n_examples)
    return probe


def probe_options() -> set[str]:
    """The keyword options of :class:`MomentProbe` (what ``**probe_kwargs`` may hold)."""
    params = inspect.signature(MomentProbe.__init__).parameters
    return {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _run(
    probe: MomentProbe,
    model: nn.Module,
    batch: Any,
    loss: Loss | None,
    params: list[nn.Parameter],
    index: int,
) -> None:
    """One probed pass: forward only (``loss`` None) or forward and backward of the loss."""
    if loss is None:
        with torch.no_grad():
            default_forward(model, batch)
        return
    probed_backward(probe, loss, model, batch, "measure_moments", index)
    for p in params:
        p.grad = None


def probed_backward(
    probe: MomentProbe, loss: Loss, model: nn.Module, batch: Any, what: str, index: int
) -> torch.Tensor:
    """``loss(model, batch)`` and its backward under ``probe``, which is told first how many
    examples the loss averages over (:func:`~initlab._core.loss_counts.example_count`); the loss. A
    non-finite loss on finite outputs raises, naming batch ``index``
    (:func:`~initlab._core.backward.finite_loss`)."""
    probe.example_count = example_count(loss, batch)
    probe.target_rows = target_rows(batch)
    value = finite_loss(loss, model, batch, what=what, index=index)
    backward_of(value, what)
    return value
