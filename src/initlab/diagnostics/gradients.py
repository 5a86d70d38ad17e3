r"""Weight magnitudes and the spread of gradients across minibatches (GradInit, Figures 4-10).

GradInit (Zhu et al. 2021, App. F) plots, for each layer ``i``, the "averaged per-dimension weight
magnitude ``||W_i|| / d_i``" and "the standard deviation of the gradient ``sigma(g_i)``", "computed
over the minibatches". Read literally with ``d_i`` the number of entries of ``W_i`` and the words
"averaged per-dimension magnitude", this is the mean absolute entry: ``||W_i||_1 / d_i``
(``W_abs_mean``); Figure 9's caption calls the gradient quantity the "averaged per-dimension
standard deviation", i.e. the standard deviation of each entry of the gradient across minibatches,
averaged over the entries (``grad_std``). We report both, plus the Frobenius norm ``W_norm`` (the
"weight norm" of Figures 9-10) so either reading can be plotted:

==================  ==========================================================================
``layer``           module name (``""``: the root model)
``param``           parameter name within the module
``module_type``     class name of the module
``shape``           parameter shape
``numel``           ``d``: the number of entries
``W_norm``          ``||W||_F``
``W_abs_mean``      ``||W||_1 / d`` (GradInit's "averaged per-dimension weight magnitude")
``grad_norm``       mean over minibatches of ``||g_b||_F`` (``g_b``: gradient of batch ``b``'s
                    loss, as autograd produced it)
``grad_std``        ``(1/d) sum_j std_b(g_bj)``, the per-entry standard deviation over the ``B``
                    minibatches (unbiased, ``ddof = 1``) averaged over entries; NaN for ``B < 2``
``E_dW2``           ``E[g^2]`` pooled over minibatches and entries
``E_dW2_stderr``    standard error of ``E_dW2`` from its per-batch values (NaN for ``B < 2``)
``batches``         ``B``
==================  ==========================================================================

A parameter shared by several modules (tied weights) gets one row per module that owns it, with
the same numbers. Per-entry statistics use Welford's update computed in float64 (no cancellation
when the mean gradient is large against its spread) and stored in the parameter's precision,
float32 at least: one copy of the weights' size for one batch, two from the second on (float64
storage held four for float32 weights; their gradients hold no spread below float32's rounding).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from initlab._core.backward import backward_of, check_trainable, finite_loss, with_grad
from initlab._core.compiled import module_type_name, takes_compiled
from initlab._core.data import DataCounter, iter_batches
from initlab._core.knobs import renamed_kwargs
from initlab._core.loss import LossLike, resolve_loss
from initlab._core.reductions import sum_of_squares
from initlab._core.rng import Seeds
from initlab._core.rows import Rows
from initlab._core.state import preserved_state

__all__ = ["GRADIENT_COLUMNS", "GradientStats", "gradient_stats"]

GRADIENT_COLUMNS: tuple[str, ...] = (
    "layer",
    "param",
    "module_type",
    "shape",
    "numel",
    "W_norm",
    "W_abs_mean",
    "grad_norm",
    "grad_std",
    "E_dW2",
    "E_dW2_stderr",
    "batches",
)
"""Columns of :meth:`GradientStats.rows` (see the module docstring)."""

_F64 = torch.float64


class _Entry:
    __slots__ = ("count", "m2", "mean", "norms", "owners", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.owners: list[tuple[str, str, str]] = []  # (layer, param, module type)
        self.count = 0
        self.mean: torch.Tensor | None = None
        self.m2: torch.Tensor | None = None
        self.norms: list[torch.Tensor] = []  # ||g_b||^2 per batch (device scalars)


#: Entries per float64 chunk of Welford's update: the transients stay a few MiB whatever the
#: tensor's size (a full float64 copy of a 4096 x 4096 gradient was 128 MiB, several at once).
_CHUNK = 1 << 20


def _welford(e: _Entry, g: torch.Tensor) -> None:
    """Add gradient ``g`` (any float dtype) to ``e``'s per-entry mean and sum of squared
    deviations: Welford's update computed in float64 chunk by chunk, stored in the parameter's
    precision (float32 at least), whose gradients hold no spread below their own rounding; the
    sum of squares from the second batch on (one batch has no spread). Holds 1x (one batch) or
    2x the parameter's entries in that precision, not 4x in float64."""
    store = torch.promote_types(e.tensor.dtype, torch.float32)
    if e.mean is None:
        e.mean = torch.empty(g.shape, dtype=store, device=g.device)
    elif e.m2 is None:
        e.m2 = torch.zeros(g.shape, dtype=store, device=g.device)
    flat, means = g.reshape(-1), e.mean.view(-1)
    m2s = e.m2.view(-1) if e.m2 is not None else None
    for start in range(0, flat.numel(), _CHUNK):
        part = slice(start, start + _CHUNK)
        x = flat[part].to(_F64)
        if m2s is None:
            means[part] = x
            continue
        mean = means[part].to(_F64)
        delta = x - mean
        mean += delta / e.count
        m2s[part] = m2s[part].to(_F64) + delta * (x - mean)
        means[part] = mean


def _mean_std(m2: torch.Tensor, batches: int) -> float:
    """``mean(sqrt(m2 / (batches - 1)))`` in float64, chunk by chunk (see :data:`_CHUNK`)."""
    flat = m2.reshape(-1)
    total = torch.zeros((), dtype=_F64, device=m2.device)
    for start in range(0, flat.numel(), _CHUNK):
        total += torch.sqrt(flat[start : start + _CHUNK].to(_F64) / (batches - 1)).sum()
    return float(total) / flat.numel()


class GradientStats:
    """Accumulate per-entry gradient statistics over minibatches (rows :data:`GRADIENT_COLUMNS`).

    Call :meth:`update` after each backward (it reads ``param.grad``); :meth:`rows` reads the
    result. ``W`` statistics are taken when the accumulator is created.

    Args:
        model: the model whose parameters are tracked (every parameter with ``requires_grad``).
    """

    def __init__(self, model: nn.Module) -> None:
        self._entries: dict[int, _Entry] = {}
        for name, module in model.named_modules():
            for local, p in module.named_parameters(recurse=False):
                if p.requires_grad:
                    entry = self._entries.setdefault(id(p), _Entry(p))
                    entry.owners.append((name, local, module_type_name(module)))
        with torch.no_grad():
            self._w = {
                key: (
                    torch.linalg.vector_norm(e.tensor, dtype=_F64),
                    torch.linalg.vector_norm(e.tensor, ord=1, dtype=_F64),
                )
                for key, e in self._entries.items()
            }

    def update(
        self, grads: Iterable[tuple[torch.Tensor, torch.Tensor | None]] | None = None
    ) -> None:
        """Add one minibatch: ``grads`` as ``(param, grad)`` pairs, or each tracked ``param.grad``.

        A parameter without a gradient in this batch counts as a zero gradient.
        """
        pairs = (
            {id(p): g for p, g in grads}
            if grads is not None
            else {key: e.tensor.grad for key, e in self._entries.items()}
        )
        with torch.no_grad():
            for key, e in self._entries.items():
                g = pairs.get(key)
                g = torch.zeros_like(e.tensor) if g is None else g.detach()
                e.count += 1
                _welford(e, g)
                e.norms.append(sum_of_squares(g))

    def rows(self) -> Rows:
        """One row per parameter, columns :data:`GRADIENT_COLUMNS`."""
        out: list[dict[str, Any]] = []
        for key, e in self._entries.items():
            w_norm, w_l1 = (float(t) for t in self._w[key])
            d = e.tensor.numel()
            b = e.count
            norms = [float(t) for t in e.norms]
            if b >= 2 and e.m2 is not None:
                grad_std = _mean_std(e.m2, b)
                per_batch = [n / d for n in norms]
                mean_sq = sum(per_batch) / b
                var = sum((v - mean_sq) ** 2 for v in per_batch) / (b - 1)
                stderr = math.sqrt(var / b)
            else:
                grad_std = stderr = math.nan
            out.extend(
                {
                    "layer": layer,
                    "param": param,
                    "module_type": module_type,
                    "shape": tuple(e.tensor.shape),
                    "numel": d,
                    "W_norm": w_norm,
                    "W_abs_mean": w_l1 / d if d else math.nan,
                    "grad_norm": sum(math.sqrt(n) for n in norms) / b if b else math.nan,
                    "grad_std": grad_std,
                    "E_dW2": sum(norms) / (b * d) if b and d else math.nan,
                    "E_dW2_stderr": stderr,
                    "batches": b,
                }
                for layer, param, module_type in e.owners
            )
        return Rows(out, GRADIENT_COLUMNS, title="weight magnitude and gradient spread")


@takes_compiled(scripted=True)
@with_grad
@renamed_kwargs(batches="data")
def gradient_stats(
    model: nn.Module,
    data: Any,
    loss_fn: LossLike = None,
    *,
    max_batches: int | None = None,
    generator: torch.Generator | int | None = None,
) -> Rows:
    """Weight magnitudes and gradient spread across the batches of ``data`` (rows
    :data:`GRADIENT_COLUMNS`; ``used`` says how many batches and examples).

    Runs ``loss.backward()`` per batch, ``loss_fn`` in any form :func:`initlab.resolve_loss`
    reads, over at most ``max_batches`` batches (``None``: all; data without a length, a
    generator or an ``IterableDataset``, up to 1000 batches, and more raise); the model's
    parameters, buffers (e.g. BatchNorm running statistics), train/eval modes and ``.grad`` are
    as before afterwards. Batch ``i`` runs in its own forked-RNG scope seeded from
    ``generator`` (a seed, a ``torch.Generator``, or ``None`` for a fixed seed), so dropout
    masks do not depend on torch's global RNG (:class:`~initlab._core.rng.Seeds`).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from initlab import Batches
        >>> net = nn.Linear(3, 2)
        >>> xs = Batches([torch.randn(8, 3) for _ in range(3)])
        >>> rows = gradient_stats(net, xs, lambda m, x: m(x).square().mean())
        >>> [r["batches"] for r in rows]
        [3, 3]
    """
    loss = resolve_loss(loss_fn, what="gradient_stats")
    check_trainable(model, "gradient_stats")
    acc = GradientStats(model)
    params = [e.tensor for e in acc._entries.values()]
    counter = DataCounter()
    seeds = Seeds(model, generator)
    with preserved_state(model):
        batches = counter.wrap(iter_batches(data, max_batches, what="gradient_stats"))
        for i, batch in enumerate(batches):
            for p in params:
                p.grad = None
            with seeds.scope(i):
                value = finite_loss(loss, model, batch, what="gradient_stats", index=i)
                backward_of(value, "gradient_stats")
            acc.update()
    if counter.batches == 0:
        raise ValueError("gradient_stats got no batch: the data is empty")
    rows = acc.rows()
    rows.used = counter.use()
    return rows
