r"""Input scaling (Defazio & Bottou 2020, §6.3): balance the first layer's weights and bias.

:func:`input_scale` / :func:`input_scale_for` measure ``E[x^2]`` on real batches and return a data
transform ``x -> c x`` (an :class:`InputScaling`) that makes the first layer's weights and bias
balanced, ``E[(c x_0)^2] = 1 / (k_0 sqrt(n_0))``. The model is never changed. Statistics are summed
over the ranks of a ``torch.distributed`` job, after every rank has read its data (a failure on
some ranks raises the same error on every rank: :func:`~initlab._core.distributed.run_together`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from initlab._core.data import (
    DataUse,
    TakenBatches,
    data_use,
    default_forward,
    first_tensor,
    take_batches,
)
from initlab._core.distributed import (
    all_reduce_sum,
    check_same_values,
    local_passes,
    run_together,
)
from initlab._core.knobs import renamed_kwargs
from initlab._core.parametrized import reading_layers
from initlab._core.rng import Seeds
from initlab.init.registry import Registry, default_registry
from initlab.measure.conditioning import weight_layers
from initlab.methods._measuring import Forward, execution_order, keep_buffers, kernel_taps

__all__ = ["InputScaling", "input_scale", "input_scale_for"]


@dataclass(frozen=True)
class InputScaling:
    """A data transform ``x -> factor * x`` (§6.3), e.g. for a ``DataLoader`` transform or collate.

    Called on a tensor it returns ``factor * x``; on a tuple/list (a collated ``(inputs, targets)``
    batch) it scales the first element and keeps the rest; on a dict, the ``"input"`` entry, else
    the first tensor entry. Picklable (for ``DataLoader`` workers).

    Attributes:
        factor: the multiplier ``c``.
        target: ``E[(c x)^2]`` it gives, ``1 / sqrt(n_in * receptive_field)``.
        measured: ``E[x^2]`` of the data it was fitted on.
        n_in: input channels (features) of the first layer.
        receptive_field: kernel taps of the first layer (``k^2``; 1 for an MLP).
        used: the data it was fitted on (``used.batches``, ``used.examples``).
    """

    factor: float
    target: float
    measured: float
    n_in: int
    receptive_field: int
    used: DataUse | None = None

    def __call__(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x * self.factor
        if isinstance(x, (tuple, list)):
            return type(x)([self(x[0]), *x[1:]])
        if isinstance(x, Mapping):
            key = "input" if "input" in x else next(k for k, v in x.items() if torch.is_tensor(v))
            return {**x, key: self(x[key])}
        raise TypeError(f"InputScaling takes a tensor, tuple, list or dict, got {type(x).__name__}")


@renamed_kwargs(n_batches="max_batches")
def input_scale(
    data: Any,
    *,
    kernel_size: int | Sequence[int] = 1,
    n_in: int | None = None,
    max_batches: int | None = None,
) -> InputScaling:
    """The factor ``c`` with ``E[(c x_0)^2] = 1 / (k_0 sqrt(n_0))`` on ``data`` (§6.3).

    Derivation (the paper's, for the first layer with zero bias): with ``k2`` kernel taps and
    ``p2`` output positions, ``gamma_0 = n_0 k2 p2 E[x_0^2]^2 E[dy^2] / E[y^2]`` and
    ``gamma_0^b = p2 E[dy^2] / E[y^2]`` (see :func:`initlab.gr_scaling`); they are equal iff
    ``E[x_0^2] = 1 / sqrt(n_0 k2)``, which is ``1 / (k_0 sqrt(n_0))`` for a ``k_0 x k_0`` kernel
    (about 0.19 for RGB inputs and ``k_0 = 3``) and ``1 / sqrt(n_0)`` for an MLP.

    Args:
        data: a batch or an iterable of batches; the input is the batch's first tensor.
        kernel_size: the first layer's kernel: an int ``k`` for a ``k x k`` kernel (1 for an MLP),
            or a sequence of sizes per dimension (``(5,)`` for a ``Conv1d`` with kernel 5), whose
            product is the number of taps ``k2``.
        n_in: input channels (features) per group of the first layer; default: dim 1 of the
            input (features of a ``(B, n)`` input, channels of ``(B, C, ...)``).
        max_batches: use at most this many batches of ``data`` (default all; data without a
            length, a generator or an ``IterableDataset``, up to 1000 batches, and more raise;
            ``n_batches=`` before 0.2).

    ``E[x^2]`` is the non-central second moment over all elements of all batches (and ranks).
    Under ``torch.distributed`` every rank reads and checks its own batches first; where that
    fails on some ranks (a non-float or non-finite input, no batch), every rank raises the same
    :class:`~initlab._core.distributed.RankMismatchError`, naming each failed rank's error; so it
    does where the ranks' ``n_in`` (their inputs' widths) or kernel taps differ, naming both.

    Example:
        >>> x = torch.randn(1000, 3, 8, 8) * 4 + 1
        >>> scaling = input_scale(x, kernel_size=3)
        >>> round((scaling(x) ** 2).mean().item() * 3 * 3**0.5, 6)
        1.0
    """
    # reading and checking the data is local: a failure on some ranks raises on every rank
    batches, sums, n_in, taps = run_together(
        "input_scale", lambda: _moment_sums(data, kernel_size, n_in, max_batches)
    )
    check_same_values(  # one factor for one first layer: its fans must agree across ranks
        "input_scale",
        {"n_in": n_in, "kernel taps": taps},
        "the pooled E[x^2] serves one first layer, the same on every rank: give every rank "
        "inputs with the same number of features or channels (dim 1), or pass the same n_in= "
        "and kernel_size= on every rank",
    )
    all_reduce_sum([sums])
    measured = sums[0].item() / sums[1].item()
    if not measured > 0:
        raise ValueError("the inputs are all zero: no factor can reach the target second moment")
    want = 1.0 / math.sqrt(n_in * taps)
    return InputScaling(
        factor=math.sqrt(want / measured),
        target=want,
        measured=measured,
        n_in=n_in,
        receptive_field=taps,
        used=data_use(batches),
    )


def _moment_sums(
    data: Any, kernel_size: int | Sequence[int], n_in: int | None, max_batches: int | None
) -> tuple[TakenBatches, torch.Tensor, int, int]:
    """This rank's part of :func:`input_scale`: its batches, ``[sum x^2, count]`` over their
    inputs (float64), ``n_in`` (given, or read off dim 1 of the inputs) and the kernel taps."""
    batches = take_batches(data, max_batches, what="input_scale", exact=False)
    taps = kernel_taps(kernel_size)
    sums = torch.zeros(2, dtype=torch.float64, device="cpu")
    dims = set()
    for batch in batches:
        x = first_tensor(batch)
        if not x.is_floating_point():
            raise TypeError(f"input_scale needs floating-point inputs, got {x.dtype}")
        dims.add(int(x.shape[1]) if x.dim() >= 2 else None)
        sums += torch.stack(
            (
                x.detach().to(torch.float64).square().sum().cpu(),
                torch.tensor(float(x.numel()), device="cpu"),
            )
        )
    if n_in is None:
        if len(dims) != 1 or None in dims:
            raise ValueError("cannot read n_in off the data (need a (B, n, ...) input); pass n_in=")
        n_in = dims.pop()
    if isinstance(n_in, bool) or not isinstance(n_in, int) or n_in < 1:
        raise ValueError(f"n_in must be a positive int, got {n_in!r}")
    return batches, sums, n_in, taps


@renamed_kwargs(n_batches="max_batches")
@reading_layers
def input_scale_for(
    model: nn.Module,
    data: Any,
    *,
    forward: Forward | None = None,
    max_batches: int | None = None,
    registry: Registry | None = None,
) -> InputScaling:
    """:func:`input_scale` with ``k_0`` and ``n_0`` read off the model's first weight layer.

    One forward pass of the first batch (``no_grad``, temporary hooks, buffers kept) finds the first
    conv/linear-type layer to run; its kernel taps and input channels per group give ``k2`` and
    ``n_0``. The model is not changed.

    Raises:
        ValueError: the first weight layer is not linear or convolutional, or it does not see the
            raw input (e.g. a ``LayerNorm`` or another transform comes first, so scaling the data
            would not set its input moment).
    """
    # the forward is local: a failure on some ranks raises on every rank
    taps, n_in = run_together(
        "input_scale_for", lambda: _first_layer(model, data, forward, max_batches, registry)
    )
    return input_scale(data, kernel_size=(taps,), n_in=n_in, max_batches=max_batches)


def _first_layer(
    model: nn.Module,
    data: Any,
    forward: Forward | None,
    max_batches: int | None,
    registry: Registry | None,
) -> tuple[int, int]:
    """This rank's part of :func:`input_scale_for`: the kernel taps and input channels per group
    of the first weight layer that runs on the first batch, checked to see the raw input."""
    reg = default_registry() if registry is None else registry
    forward = forward or default_forward
    batches = take_batches(data, max_batches, what="input_scale_for", exact=False)
    layers = {name: (module, spec, kind) for name, module, spec, kind in weight_layers(model, reg)}

    def run() -> None:
        with torch.no_grad(), keep_buffers(model), Seeds(model, None).scope(), local_passes(model):
            forward(model, batches[0])

    skip = " (or give kernel_size and n_in to input_scale)"
    order, inputs, _ = execution_order(model, list(layers), run, "input_scale_for", skip)
    if not order:
        raise ValueError("no weight layer ran in the forward pass")
    first = order[0]
    module, spec, kind = layers[first]
    if kind == "other" or spec.fans is None:
        raise ValueError(
            f"the first weight layer {first!r} ({type(module).__name__}) is not linear or "
            "convolutional; give kernel_size and n_in to input_scale yourself"
        )
    raw = first_tensor(batches[0]).detach().to(torch.float64)
    seen = inputs.get(first)
    same = (
        seen is not None
        and seen.numel() == raw.numel()
        and torch.allclose(seen.to(torch.float64).square().mean(), raw.square().mean(), rtol=1e-6)
    )
    if not same:
        raise ValueError(
            f"the first weight layer {first!r} does not see the raw input (its input's second "
            "moment differs from the data's): scaling the data would not set it. Scale inside "
            "the model, or call input_scale on the tensors that layer sees"
        )
    taps = spec.fans.receptive_field
    return taps, spec.fans.fan_in // taps
