r"""Output scaling (Defazio & Bottou 2020, §6.4): give the logits a chosen standard deviation.

:func:`scale_output_` measures the std of the model's output on real batches and applies a fixed
scalar that gives it ``target`` (0.05 in the paper's experiments), folded into the last layer or
returned as an :class:`OutputScale` module; :func:`measure_output_std` is the measurement alone.

Every method changes the model in place (or, where said, not at all), leaves no hooks behind,
restores weights, buffers and train/eval modes if it fails midway
(``restore_on_failure``), never moves the model, and sums its statistics over
the ranks of a ``torch.distributed`` job (:func:`~initlab._core.distributed.all_reduce_sum`), so all
ranks end with identical weights. Forward passes used only for measuring leave buffers (BatchNorm
running statistics) as they were, and run under a forked RNG (seeded from ``generator`` when
given), so dropout masks are reproducible and torch's global RNG state is untouched.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn

from initlab._core.data import data_use, default_forward, output_tensor, take_batches
from initlab._core.distributed import all_reduce_sum
from initlab._core.knobs import renamed_kwargs
from initlab._core.method_report import MethodReport
from initlab._core.state import restore_on_failure
from initlab.init.registry import Registry, default_registry
from initlab.measure.conditioning import weight_layers
from initlab.methods._measuring import (
    Forward,
    Seeds,
    check_positive,
    execution_order,
    keep_buffers,
    rounding_tolerance,
)

__all__ = ["OUTPUT_SCALE_COLUMNS", "OutputScale", "measure_output_std", "scale_output_"]


class OutputScale(nn.Module):
    """``x -> scale * x`` with a fixed (non-trainable) scalar ``scale`` kept in a buffer.

    The paper's "fixed scalar multiplication factor at the end of the network" (§6.4), for when the
    scale cannot be folded into the last layer: ``nn.Sequential(model, OutputScale(s))``.
    """

    scale: torch.Tensor

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.register_buffer("scale", torch.tensor(float(scale)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale.to(x.dtype)

    def extra_repr(self) -> str:
        return f"scale={self.scale.item():.6g}"


OUTPUT_SCALE_COLUMNS: tuple[str, ...] = (
    "layer",
    "how",
    "std_before",
    "scale",
    "std_after",
    "target",
)
"""Columns of the :func:`scale_output_` report (one row): ``layer``, the layer the scale was
folded into (``""`` for ``how="module"``), the std of the logits before and after, the factor, the
target."""


def _output_moments(
    model: nn.Module, batches: Sequence[Any], forward: Forward, seeds: Seeds
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``[sum y, sum y^2, n]`` over all logits of all batches (and ranks), and the outputs."""
    sums = torch.zeros(3, dtype=torch.float64)
    outs = []
    with torch.no_grad(), keep_buffers(model):
        for i, batch in enumerate(batches):
            with seeds.scope(i):
                y = output_tensor(forward(model, batch)).detach()
            outs.append(y)
            y64 = y.to(torch.float64)
            sums += torch.stack((y64.sum(), y64.square().sum(), torch.tensor(float(y.numel()))))
    all_reduce_sum([sums])
    return sums, outs


def _std(sums: torch.Tensor) -> float:
    s1, s2, n = sums.tolist()
    if n < 2:
        raise ValueError(f"the output has {int(n)} element(s); a std needs at least 2")
    mean = s1 / n
    return math.sqrt(max(s2 / n - mean * mean, 0.0))


@renamed_kwargs(n_batches="max_batches")
def measure_output_std(
    model: nn.Module,
    data: Any,
    *,
    forward: Forward | None = None,
    max_batches: int | None = None,
    generator: torch.Generator | int | None = None,
) -> float:
    """Population std of all output elements, pooled over the batches (and ranks).

    ``std = sqrt(E[y^2] - E[y]^2)`` over every logit of every example. Runs under ``no_grad``; the
    model's buffers are left as they were.
    """
    batches = take_batches(data, max_batches, what="measure_output_std")
    sums, _ = _output_moments(model, batches, forward or default_forward, Seeds(model, generator))
    return _std(sums)


@renamed_kwargs(n_batches="max_batches")
def scale_output_(
    model: nn.Module,
    data: Any,
    *,
    target: float = 0.05,
    forward: Forward | None = None,
    module: str | None = None,
    how: Literal["fold", "module"] = "fold",
    max_batches: int | None = None,
    registry: Registry | None = None,
    generator: torch.Generator | int | None = None,
) -> MethodReport:
    """Give the model's output (logits) the standard deviation ``target`` on ``data`` (§6.4).

    Measures ``std`` of all output elements pooled over the batches given (summed over ranks when
    distributed; see :func:`measure_output_std`) and applies the fixed factor
    ``s = target / std``:

    * ``how="fold"`` (default): multiply the weight **and bias** of the last weight layer (the last
      conv/linear-type module to run, or the module named ``module``) by ``s``, in place. Exact when
      the output is positively homogeneous of degree 1 in that layer's ``(W, b)``, i.e.
      ``f(sW, sb) = s f(W, b)`` for ``s > 0``: the layer is the last thing with parameters on
      the path to the output and only degree-1 homogeneous operations follow (reshape, average
      pooling, ReLU, max pooling, dropout). The typical case is a final ``nn.Linear`` or a final
      convolution followed by global average pooling. Not exact after the layer: another bias or
      linear layer, LayerNorm, tanh, softmax, a residual addition. This is checked on the first
      batch (the new output must equal ``s`` times the old one to ``1e-5`` relative, or 10 machine
      epsilons of a half-precision output); if it does not, nothing is changed and a
      ``ValueError`` suggests ``how="module"``.
    * ``how="module"``: the model is left unchanged and ``report.info["module"]`` is an
      :class:`OutputScale` ``(s)``, for ``nn.Sequential(model, report.info["module"])``. This
      always reaches the target but adds a module, which is why it is never done behind the
      user's back.

    Conditioning: the paper puts the scalar *after* the last layer as a fixed multiplier, which
    leaves every layer's GR scaling as it was. Folding it into the last layer's weights gives the
    same function but a different parametrization: that layer's γ is multiplied by ``1/s⁴``
    (a conditioning multiplier α = s, Section 5), so with ``s = 0.05`` the last layer ends up
    ~10⁵× out of balance. Use ``how="module"`` to keep the network balanced, ``"fold"`` when the
    architecture must not change.

    Args:
        model: the model, in the mode it should be measured in.
        data: one batch or many (the rule: :mod:`initlab._core.data`).
        target: the std the logits get (the paper uses 0.05; 0.01 to 0.1 works).
        forward: ``forward(model, batch) -> output`` (default
            :func:`~initlab._core.data.default_forward`); a dict output uses its ``"logits"``.
        module: name of the layer to fold into (default: the last weight layer to run).
        how: ``"fold"`` or ``"module"``.
        max_batches: use at most this many batches of ``data`` (default all; ``n_batches=``
            before 0.2).
        registry: the layer registry (which modules are weight layers).
        generator: seeds the RNG of the measurement passes (dropout in train mode); the method
            draws nothing itself.

    Returns:
        :class:`~initlab.MethodReport`, one row (:data:`OUTPUT_SCALE_COLUMNS`);
        ``info`` has ``scale``, ``std_before``, ``std_after``, ``layer`` (and ``module`` for
        ``how="module"``).

    Example:
        >>> net = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
        >>> x = torch.randn(512, 10, generator=torch.Generator().manual_seed(0))
        >>> report = scale_output_(net, x, target=0.05)
        >>> report.info["layer"], round(measure_output_std(net, x), 6)
        ('2', 0.05)
    """
    start = time.perf_counter()
    if how not in ("fold", "module"):
        raise ValueError(f"unknown how={how!r}; valid values: 'fold', 'module'")
    target = check_positive("target", target)
    forward = forward or default_forward
    reg = default_registry() if registry is None else registry
    batches = take_batches(data, max_batches, what="scale_output_")
    seeds = Seeds(model, generator)
    passes = 0
    with restore_on_failure(model):
        layers = [name for name, *_ in weight_layers(model, reg)]
        if module is not None:
            if module not in dict(model.named_modules()):
                raise ValueError(f"model has no module named {module!r}")
            if module not in layers:
                raise ValueError(
                    f"module {module!r} has no weight parameter to fold the scale into"
                )
        order, _, (sums, outs) = execution_order(
            model, layers, lambda: _output_moments(model, batches, forward, seeds)
        )
        passes += len(batches)
        std = _std(sums)
        if not std > 0:
            raise ValueError("the output has zero std on the data: no scale can reach the target")
        s = target / std
        info: dict[str, Any] = {"scale": s, "std_before": std, "std_after": s * std, "how": how}
        if how == "module":
            info["layer"] = ""
            info["module"] = OutputScale(s)
        else:
            name = module if module is not None else (order[-1] if order else None)
            if name is None:
                raise ValueError("no weight layer ran in the forward pass: nothing to fold into")
            info["layer"] = name
            _fold_checked(model, name, s, reg, batches[0], outs[0], forward, seeds)
            passes += 1
    row = {
        "layer": info["layer"],
        "how": how,
        "std_before": std,
        "scale": s,
        "std_after": s * std,
        "target": target,
    }
    return MethodReport(
        [row],
        OUTPUT_SCALE_COLUMNS,
        method="scale_output_",
        forward_passes=passes,
        backward_passes=0,
        wall_s=time.perf_counter() - start,
        info=info,
        used=data_use(batches),
    )


def _fold_checked(
    model: nn.Module,
    name: str,
    s: float,
    registry: Registry,
    batch: Any,
    out_before: torch.Tensor,
    forward: Forward,
    seeds: Seeds,
) -> None:
    """Multiply layer ``name``'s weight and bias by ``s``; check that the output on ``batch`` is
    ``s`` times ``out_before`` (one forward pass), else raise (the caller's guard restores)."""
    layer = dict(model.named_modules())[name]
    specs = registry.specs(layer) or []
    with torch.no_grad():
        for spec in specs:
            if spec.role in ("weight", "bias"):
                getattr(layer, spec.name).mul_(s)
        with keep_buffers(model), seeds.scope(0):
            after = output_tensor(forward(model, batch)).detach()
    want = out_before.to(torch.float64) * s
    err = (after.to(torch.float64) - want).norm() / want.norm().clamp_min(1e-300)
    bad = torch.tensor([float(err > rounding_tolerance(after, 1e-5))], dtype=torch.float64)
    all_reduce_sum([bad])
    if bad.item() > 0:
        raise ValueError(
            f"folding the output scale into {name!r} is not exact: the output is not "
            f"linear in that layer's weight and bias (relative error {err.item():.2e}; "
            "something with parameters, or a non-homogeneous function, follows it). "
            "Use how='module' to get an OutputScale module to append, or name the right "
            "layer with module="
        )
