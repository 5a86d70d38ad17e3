r"""MetaInit: tune the norm of every weight tensor to minimize the gradient quotient.

Dauphin & Schoenholz (2019), *MetaInit: Initializing learning by learning to initialize*
(NeurIPS), §3 and Figure 2 (its PyTorch code); the improved variant is GradInit's (Zhu et al.
2021, appendix D and Table 9: real data, Adam with GradInit's clipping).

The gradient quotient of a loss ``L`` at parameters ``theta`` (``g = grad L``, ``H`` the Hessian,
``N`` the number of trainable entries, ``eps = 1e-5``)::

    GQ(theta) = (1/N) * sum_j | (g_j - (H g)_j) / (g_j + eps * sgn(g_j)) - 1 |,
    sgn(x) = +1 if x >= 0 else -1   (a constant: no gradient flows through it)

``g - H g`` is, to first order, the gradient after a gradient step of size 1, so ``GQ`` measures
how much one step changes the gradient, relative to the gradient: 0 where the loss is locally
linear. MetaInit parametrizes each chosen tensor as ``W_i = s_i * W0_i / ||W0_i||`` (``s_i``
starts at ``||W0_i||``, i.e. ``W_i = alpha_i * W0_i`` with ``alpha_i = s_i / ||W0_i||`` starting
at 1) and descends ``GQ`` in the norms ``s`` only; the directions are kept.

``H g`` is computed as in the paper's code, ``grad_theta (||g||^2 / 2)`` with ``g`` *not*
detached: its value is the exact Hessian-vector product ``H v`` at ``v = g``, and keeping ``v = g``
on the graph makes the meta-gradient the exact derivative of ``GQ`` (detaching ``v`` would drop the
``H dg/ds`` term). The meta-gradient is a third-order derivative (a backward through the double
backward); ``g`` and ``H g`` cover every trainable tensor, scaled or not. PyTorch's native
BatchNorm (batch statistics), LayerNorm and InstanceNorm kernels give a wrong third derivative
(their double backward holds the saved statistics constant), so the forward runs them as
elementary operations (:mod:`initlab._core.norms`): on a conv-BatchNorm net the native kernels
gave a weight's meta-gradient -2.64 where finite differences give +3.38.

Variants (``variant=``):

* ``"paper"`` (Figure 2): ``GQ`` of each step is measured on a new batch of random data (inputs
  ``N(0, 1)`` of ``input_shape`` -- the whole batch's shape, the paper's ``x_size`` -- and labels
  uniform over the classes) unless ``data`` is given; the norms take signSGD steps with momentum,
  ``m <- momentum * m - lr * sign(dGQ/ds)``, ``s <- s + m`` (``lr = 0.1``, ``momentum = 0.9``,
  500 steps); the chosen tensors are those with at least 2 dimensions; the model is in eval mode
  (the paper calls ``model.eval()``: normalization layers use their running statistics).
* ``"gradinit"`` (GradInit's appendix D): real data (``data``), one step per batch; Adam on the
  scales ``alpha`` exactly as in :func:`~initlab.gradinit_` (``lr = 1e-3``, per-scalar
  gradient clipping at 1, betas (0.9, 0.999)); the chosen tensors are every trainable non-zero
  tensor; normalization layers use batch statistics, dropout off.

In both, ``alpha >= alpha_min`` (0.01; a safeguard the paper's code does not have: a norm can
never reach zero or change sign). Guarantees shared with GradInit: the model is evaluated at the
scaled tensors as :func:`torch.func.functional_call` does (parameters never replaced), changed in
place once at the end
(``W <- alpha * W``, tied tensors once), buffers bit-identical afterwards and modes restored, the
model left unchanged on any exception, no hooks, random data drawn from ``generator`` only. Under
``torch.distributed`` each rank computes ``GQ`` of its own batch and the alpha-gradients are
averaged before the step, so MetaInit minimizes the mean over ranks of the per-rank ``GQ`` (``GQ``
is not linear in the gradient, so this is not the ``GQ`` of the global batch) and all ranks end
bit-identical. Ranks that start from different weights, or run different numbers of steps, raise
the same :class:`~initlab._core.distributed.RankMismatchError` on every rank (checked at entry and
in lockstep, as in GradInit), as does a step whose passes fail on some ranks only.

Under ``torch.autocast`` the gradient quotient is computed in the parameters' dtype (autocast
off inside MetaInit; a loss function that turns autocast on around the model raises): it divides
by ``g``, and bfloat16 rounding flips the sign of the small entries the sign steps follow
(measured: norms 20% off on a small CNN after 2 steps, a factor 8 on one GPT-2 projection). The
quotient itself is formed in float32 at least: for a float16 model ``(g - Hg) / (g + eps)``
overflows float16 and the scales' gradient was NaN.

Cost per step: one forward, a backward with graph, a double backward with graph, and the backward
of all that to the scales (third order). Memory: for that backward every parameter holds its
scaled tensor, ``g``, the double backward's own copy of ``g`` (the vector of ``H g``) and ``H g``;
the quotient keeps nothing more (its autograd Function forms ``q`` again in its backward, where
the elementwise chain it replaced kept three more full-size tensors). Measured on a 25-layer
width-1024 Tanh MLP (float32, batch 64, 3 steps, CPU): the peak resident memory grows by about
14.5x the parameters' bytes (a plain forward + backward: 1.2x; the elementwise chain: about 20x),
``benchmarks/bench_metainit_memory.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial, reduce
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import CheckpointError

from initlab._core.attention import with_math_attention
from initlab._core.autocast import autocast_off, refuse_autocast_inside
from initlab._core.backward import refuse_complex, with_grad
from initlab._core.compiled import takes_compiled
from initlab._core.data import DataCounter
from initlab._core.distributed import check_same_parameters, run_together, same_options
from initlab._core.heap import kept_heap
from initlab._core.knobs import check_callback, integer_of
from initlab._core.loss import LossLike, TargetError, resolve_loss
from initlab._core.method_report import MethodReport
from initlab._core.norms import composite_norms
from initlab._core.parametrized import writing_layers
from initlab._core.rng import as_generator, draw_device
from initlab._core.rows import Rows
from initlab._core.state import restore_on_failure
from initlab.methods._alpha import (
    AlphaAdam,
    AtParams,
    LossFn,
    TensorFilter,
    Tensors,
    alpha_rows,
    batch_pairs,
    check_alpha_grad,
    check_finite,
    check_number,
    evaluation_modes,
    fold_alpha,
    grads_or_zeros,
    loss_at,
    nonzero,
    positive_int,
    rank_mean,
    refuse_shared_memory,
    scalar_mean,
    scaled_params,
    second_order,
    select_tensors,
    set_evaluation_modes,
    warn_half_precision,
)

__all__ = ["METAINIT_COLUMNS", "METAINIT_TRACE_COLUMNS", "gradient_quotient", "metainit_"]

#: Rows of :func:`metainit_`'s report, one per tensor with a scale: ``layer`` and ``param`` (the
#: module's qualified name and the parameter's local name), ``role``, ``alpha``
#: (the learned ``s / ||W0||``, folded in), ``norm_before`` (``||W0||``), ``norm_after`` (``s``),
#: ``tied_to`` (a tied tensor, listed once with one scale: its other names, comma-separated;
#: ``None`` for a tensor that is not tied).
METAINIT_COLUMNS = ("layer", "param", "role", "alpha", "norm_before", "norm_after", "tied_to")

#: Columns of the per-step ``trace``: ``iteration``; ``gq`` (the gradient quotient of the step's
#: batch at the scales before the step, rank-averaged); ``loss`` (the loss there); ``grad_norm``
#: (``||g||_2`` there, rank-averaged); ``alpha_min`` / ``alpha_max`` (after the step).
METAINIT_TRACE_COLUMNS = ("iteration", "gq", "loss", "grad_norm", "alpha_min", "alpha_max")

_VARIANTS = ("paper", "gradinit")
_PAPER_STEPS = 500

_AUTOCAST = (
    "the gradient quotient divides by the gradient, and bfloat16/float16 rounding flips the signs "
    "of its small entries, which the sign steps follow (the scales move the wrong way)"
)
_WHY = "the gradient quotient needs the Hessian-vector product H g, and its descent one more order"
_ADVICE = (
    "use a method that needs first derivatives only: gradinit_ (first-order objective steps) or "
    "lsuv_"
)


def _wide_terms(
    g: torch.Tensor, h: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(g - h, g + eps * s, eps * s)`` in float32 at least (a float16 quotient
    ``(g - Hg) / (g + eps)`` overflows: NaN gradients), ``s = sgn(g)``, +1 at 0; fresh tensors,
    bit for bit the values of the elementwise chain ``_gq`` formed before."""
    wide = torch.promote_types(g.dtype, torch.float32)
    gw = g.to(wide)
    diff = gw - h.to(wide)
    eps_s = torch.where(gw >= 0, 1.0, -1.0).to(wide).mul_(eps)
    return diff, eps_s + gw, eps_s


class _QuotientSum(torch.autograd.Function):
    """``sum_j |q_j|``, ``q = (g - h) / (g + eps * s) - 1`` (``s = sgn(g)``, +1 at 0, a constant),
    for one tensor's gradient ``g`` and ``h = H g``, keeping only ``g`` and ``h`` for the backward.

    The chain of elementwise operations it replaces kept, per parameter, ``g - h``,
    ``g + eps * s`` and ``q`` (full-size, float32 at least) until the meta-gradient's backward;
    this keeps ``g`` and ``h`` and forms the rest again there. With ``d = g + eps * s``::

        d|q|/dg = sign(q) * (h + eps * s) / d**2,   d|q|/dh = -sign(q) / d

    (``sign(0) = 0``, the subgradient of ``abs`` in torch). The backward is not differentiable
    again: nothing differentiates the meta-gradient.
    """

    @staticmethod
    def forward(ctx: Any, g: torch.Tensor, h: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(g, h)
        ctx.eps = eps
        diff, d, _ = _wide_terms(g, h, eps)
        return diff.div_(d).sub_(1).abs_().sum()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        g, h = ctx.saved_tensors
        diff, d, eps_s = _wide_terms(g, h, ctx.eps)
        # r = grad * sign(q) / d, then d|q|/dg = r * (h + eps * s) / d, d|q|/dh = -r
        r = diff.div_(d).sub_(1).sign_().mul_(grad).div_(d)
        dg = eps_s.add_(h).mul_(r).div_(d) if ctx.needs_input_grad[0] else None
        dh = r.neg_() if ctx.needs_input_grad[1] else None
        return (
            None if dg is None else dg.to(g.dtype),
            None if dh is None else dh.to(h.dtype),
            None,
        )


def _gq(
    model: nn.Module,
    loss_fn: LossFn,
    ts: Tensors,
    theta: Sequence[torch.Tensor],
    batch: Any,
    eps: float,
    what: str = "metainit_",
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``GQ`` at ``theta`` (on the graph), the loss, and ``||g||_2``. Callers run it, and the
    meta-gradient's backward, under :func:`~initlab._core.norms.composite_norms`: the
    meta-gradient is a third derivative, which the native BatchNorm/LayerNorm kernels get wrong
    (and a checkpointed block recomputes its forward in that backward)."""
    loss = loss_at(model, loss_fn, ts, theta, batch)
    g = grads_or_zeros(loss, theta, create_graph=True)
    live = [x for x in g if x.requires_grad]  # the rest are zeros: H g's rows there are too
    with second_order(what, _WHY, _ADVICE) as check:
        check([*g, loss])
        if not live:
            raise ValueError("the gradient does not depend on the parameters: GQ is undefined")
        # H g = d/dtheta (g . v) at v = g, with g on the graph (paper, Fig. 2): the vector is g
        # itself, not the copy a backward of ||g||^2 / 2 would make (one parameter size less)
        hg = grads_or_zeros(live, theta, grad_outputs=live, create_graph=True)
    wide = reduce(torch.promote_types, (x.dtype for x in g), torch.float32)
    total = loss.new_zeros((), dtype=wide)
    for gi, hi in zip(g, hg, strict=True):
        total = total + _QuotientSum.apply(gi, hi, eps)
    grad_norm = float(torch.stack([x.detach().double().square().sum() for x in g]).sum().sqrt())
    return total / ts.numel, loss, grad_norm


@with_math_attention
def gradient_quotient(
    model: nn.Module,
    batch: Any,
    loss_fn: LossLike = None,
    *,
    eps: float = 1e-5,
    batch_stats: bool = True,
) -> float:
    """The gradient quotient ``GQ`` of ``loss_fn(model, batch)`` at the model's current weights.

    ``GQ = mean_j |(g_j - (H g)_j) / (g_j + eps * sgn(g_j)) - 1|`` over every trainable entry
    (Dauphin & Schoenholz 2019, eq. 3 and Figure 2). Dropout is off; normalization layers use
    batch statistics when ``batch_stats`` (else their running statistics); buffers and modes are
    restored. The model is not changed.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> net = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))
        >>> gq = gradient_quotient(net, (torch.randn(32, 5), torch.randint(0, 3, (32,))))
        >>> gq > 0
        True
    """
    eps = check_number("gradient_quotient", "eps", eps, strict=False)
    ts = select_tensors(model, "default", nonzero, "gradient_quotient")
    a = torch.ones(len(ts.scaled), dtype=torch.float64, device="cpu", requires_grad=True)
    with evaluation_modes(model, batch_stats=batch_stats), autocast_off(), composite_norms():
        gq, _, _ = _gq(
            model,
            resolve_loss(loss_fn, what="gradient_quotient"),
            ts,
            scaled_params(ts, a),
            batch,
            eps,
            "gradient_quotient",
        )
    return float(gq.detach())


def _at_least_2d(name: str, tensor: torch.Tensor, role: str) -> bool:
    return tensor.dim() >= 2


def _random_batches(
    model: nn.Module,
    ts: Tensors,
    input_shape: Sequence[int],
    n_classes: int | None,
    steps: int,
    gen: torch.Generator | None,
) -> Iterator[tuple[Any, None]]:
    """``(x, y)``: ``x ~ N(0, 1)`` of ``input_shape``, ``y`` uniform labels (the paper's data)."""
    ref = ts.tensors[0]
    shape = tuple(int(s) for s in input_shape)
    for _ in range(steps):
        x = torch.randn(shape, generator=gen, dtype=ref.dtype, device=draw_device(gen)).to(
            ref.device
        )
        k = n_classes
        if k is None:
            with torch.no_grad():
                out = _loss_free_forward(model, ts, x)
            k = int(out.shape[-1])
            n_classes = k
        y = torch.randint(0, k, (shape[0],), generator=gen).to(ref.device)
        yield (x, y), None


def _check_batch_shape(input_shape: object, what: str) -> tuple[int, ...]:
    """``input_shape`` as a tuple of ints; ``ValueError`` for one that is not a shape: a
    non-empty sequence, or 1-D NumPy array or tensor (``np.array([64, 4])``), of positive
    integers (``(B,)`` is one: a batch of ``B`` scalars, which a model may take), each one
    ``operator.index`` takes (a NumPy integer too; no bool, float or string)."""
    sizes: list[object] = []
    if isinstance(input_shape, (np.ndarray, torch.Tensor)):
        sizes = list(input_shape) if input_shape.ndim == 1 else []
    elif isinstance(input_shape, Sequence) and not isinstance(input_shape, str):
        sizes = list(input_shape)
    shape = tuple(integer_of(s) or 0 for s in sizes)
    if not shape or min(shape) < 1:
        raise ValueError(
            f"{what}: input_shape must be the whole batch's shape, batch dimension first, in "
            f"positive ints (e.g. (64, 4): 64 examples of shape (4,)), got {input_shape!r}"
        )
    return shape


@contextmanager
def _random_batch_hint(
    input_shape: Sequence[int] | None, counter: DataCounter, what: str
) -> Iterator[None]:
    """An error of the model or the loss on the first random batch (``input_shape`` given: the
    paper's random data) raised again saying what the batch was: ``input_shape`` is the whole
    batch's shape, batch first, so ``(4,)``, one example's shape, is a batch of 4 scalars and
    labels of shape ``(4,)`` (the loss then blames the targets, which :func:`metainit_` drew).
    A ``TargetError`` and torch's plain ``RuntimeError`` or ``IndexError`` only; later steps
    and initlab's own errors pass as they are."""
    try:
        yield
    except (TargetError, RuntimeError, IndexError) as err:
        exact = type(err) in (TargetError, RuntimeError, IndexError)  # not initlab's subclasses
        if input_shape is None or counter.batches > 1 or not exact:
            raise
        raise type(err)(f"{_random_batch_text(input_shape, what)} The error: {err}") from err


def _random_batch_text(input_shape: Sequence[int], what: str) -> str:
    shape = tuple(int(s) for s in input_shape)
    text = (
        f"{what}: the model or the loss failed on the random batch of input_shape={shape}, which "
        f"is the whole batch's shape, batch dimension first: inputs x of shape {shape}"
    )
    labels = f"and random labels ({what}'s own) of shape ({shape[0]},)"
    if len(shape) == 1:
        return (
            f"{text}, a batch of {shape[0]} scalars, {labels}. For examples of shape {shape}, "
            f"pass input_shape=(B, {shape[0]}), e.g. (64, {shape[0]})."
        )
    return (
        f"{text}, {shape[0]} examples of shape {shape[1:]}, {labels}. Is that what the model takes?"
    )


def _loss_free_forward(model: nn.Module, ts: Tensors, x: torch.Tensor) -> torch.Tensor:
    out = AtParams(model, ts.slots, [t.detach() for t in ts.tensors])(x)
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            "metainit_ with random data infers the number of classes from the model's output, "
            f"which is a {type(out).__name__}; pass n_classes= (and loss_fn=)"
        )
    return out


@takes_compiled(collective=True)
@with_grad
@with_math_attention
@same_options
@writing_layers
def metainit_(
    model: nn.Module,
    data: Any = None,
    loss_fn: LossLike = None,
    *,
    variant: Literal["paper", "gradinit"] = "paper",
    steps: int | None = None,
    lr: float | None = None,
    momentum: float = 0.9,
    eps: float = 1e-5,
    alpha_min: float = 0.01,
    clip: float | None = 1.0,
    params: str | TensorFilter = "default",
    batch_stats: bool | None = None,
    input_shape: Sequence[int] | None = None,
    n_classes: int | None = None,
    generator: torch.Generator | int | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
    keep_heap: bool = True,
) -> MethodReport:
    r"""MetaInit (Dauphin & Schoenholz 2019): descend the gradient quotient in the weight norms.

    See the module docstring for the objective, the two variants and the guarantees.

    Args:
        model: any ``nn.Module``; its chosen tensors are rescaled in place.
        data: an iterable of batches (real data), or ``None`` for the paper's random data (then
            ``input_shape`` is required).
        loss_fn: ``loss_fn(model, batch) -> scalar``; default cross-entropy of
            ``model(batch[0])`` against ``batch[1]``. Random batches are ``(x, y)``.
        variant: ``"paper"`` (signSGD with momentum on the norms) or ``"gradinit"`` (Adam on the
            scales with per-scalar clipping).
        steps: number of steps; default 500 with random data, one pass over ``data`` otherwise
            (``steps`` batches are needed).
        lr: default 0.1 (``"paper"``) or 1e-3 (``"gradinit"``).
        momentum: signSGD momentum (``"paper"``).
        eps: the gradient quotient's safeguard.
        alpha_min: lower bound of every scale ``s / ||W0||``.
        clip: per-scalar gradient clipping (``"gradinit"``; ``None`` or 0: off).
        params: ``"default"`` (``"paper"``: tensors with >= 2 dims; ``"gradinit"``: every
            trainable tensor but a lone scalar or a log no layer claims, a temperature, a gate,
            Mamba's ``A_log``: ``info["not_scaled"]``) or ``params(name, tensor, role) ->
            bool``; all-zero tensors never get a scale.
        batch_stats: normalization layers use batch statistics (default: ``False`` for
            ``"paper"``, as its ``model.eval()``, ``True`` for ``"gradinit"``).
        input_shape: shape of one random input batch, batch dimension first (random data):
            ``(64, 8)`` for 64 examples of shape ``(8,)``; ``(8,)`` is a batch of 8 scalars.
            Integers in a sequence, a 1-D NumPy array or a tensor (``torch.tensor([64, 8])``).
        n_classes: number of random labels (default: the model output's last dimension).
        generator: ``torch.Generator`` or int seed for the random data.
        progress: called with every trace row.
        keep_heap: on Linux with glibc, keep the C heap for the length of the call, so that
            steps after the first do not fault in again the memory the previous one freed
            (:func:`~initlab._core.heap.kept_heap`, as :func:`~initlab.gradinit_`). ``False``
            leaves the allocator alone.

    Returns:
        A :class:`~initlab.MethodReport` with rows
        :data:`~initlab.methods.metainit.METAINIT_COLUMNS`, ``trace`` rows
        :data:`~initlab.methods.metainit.METAINIT_TRACE_COLUMNS`, and ``info`` with ``steps``,
        ``variant``, ``gq_first``, ``gq_last``.

    Raises:
        ValueError: bad options or too few batches; a tensor that gets a scale and another
            Parameter object over the same memory (named; a tie is one object:
            :func:`~initlab.methods._alpha.refuse_shared_memory`).
        TypeError: a trainable complex parameter (named; freeze it, or use
            ``lsuv_(orthogonal=False)``).
        FloatingPointError: a non-finite loss or GQ, or a non-finite meta-gradient of a finite
            one (named, with float16 and the float32 copy to use where the model is float16);
            the model is left unchanged.
    """
    start = time.perf_counter()
    what = "metainit_"
    opts = _Options.check(
        variant, steps, lr, momentum, eps, alpha_min, clip, batch_stats, n_classes, what
    )
    check_callback(what, "progress", progress)
    loss = resolve_loss(loss_fn, what=what)
    check_same_parameters(  # first: what differs by rank raises on every rank
        model, what, measured_in=lambda m: set_evaluation_modes(m, opts.batch_stats)
    )
    refuse_complex(
        model, what, "MetaInit's gradient quotient is defined for real tensors: freeze them "
        "(requires_grad_(False)) for this call, or use lsuv_(orthogonal=False), which needs no "
        "gradient (it scales each layer to an output variance E|y - E y|^2)"
    )  # fmt: skip
    ts = select_tensors(model, params, _at_least_2d if opts.paper else nonzero, what)
    refuse_shared_memory(model, ts, what)
    warn_half_precision(ts, what, _SIGNS_FLIP)
    gen = as_generator(generator)
    counter = DataCounter()
    batches = _step_batches(model, ts, data, input_shape, opts, gen, what, counter)

    update = _ScaleUpdate(ts, opts)
    with restore_on_failure(model):
        # the gradient quotient divides by g: in bfloat16 its rounding flips the signs the steps
        # follow where g is small, so GQ is computed in the parameters' dtype, autocast off
        with (
            evaluation_modes(model, batch_stats=opts.batch_stats),
            autocast_off(),
            refuse_autocast_inside(model, what, _AUTOCAST),
            kept_heap(bool(keep_heap)),
            _random_batch_hint(input_shape if data is None else None, counter, what),
        ):
            trace, forward, backward = _descend(
                model, loss, ts, batches, update, opts.eps, progress, what
            )
        if not trace:
            raise ValueError(f"{what} ran no step: the data has no batch")
        fold_alpha(ts, update.alpha, what)
    return _report(model, ts, update.alpha, trace, (forward, backward), counter, variant, start)


_SIGNS_FLIP = (
    "the gradient quotient divides by the gradient, and the rounding of its passes flips the "
    "signs its steps follow (a small MLP: alphas 0.92, 1.01, 0.63 in bfloat16 against 0.92, "
    "0.75, 1.02)"
)
_GQ_OVERFLOW = "the gradient quotient's pass (its H g, or its quotient by a gradient entry near 0)"
_OVERFLOW = (
    "the meta-gradient's backward (through the quotient's derivative, about h / g**2 where a "
    "gradient entry g is small)"
)


def _meta_gradient(
    model: nn.Module,
    loss: LossFn,
    ts: Tensors,
    alpha: torch.Tensor,
    batch: Any,
    eps: float,
    step: tuple[str, int],
) -> tuple[torch.Tensor, float, float, float]:
    """``dGQ/dalpha`` at ``alpha``, with the loss, ``GQ`` (both checked finite, means over ranks)
    and ``||g||_2``. Forward and backwards run under
    :func:`~initlab._core.norms.composite_norms` (a third derivative; a checkpointed block
    recomputes its forward in the backward); under DDP the local parts fail together."""
    what, t = step
    a = alpha.detach().clone().requires_grad_(True)
    theta = scaled_params(ts, a)
    try:
        with composite_norms():
            gq, value, grad_norm = run_together(
                what, partial(_gq, model, loss, ts, theta, batch, eps)
            )
            loss_value = scalar_mean(value)
            check_finite(loss_value, t, what)
            gq_value = scalar_mean(gq)
            half = _GQ_OVERFLOW if ts.float16 else ""
            check_finite(gq_value, t, what, "gradient quotient", overflow=half)
            with second_order(what, _WHY, _ADVICE):
                meta = run_together(what, partial(grads_or_zeros, gq, [a]))[0]
    except CheckpointError as err:
        raise ValueError(
            f"{what}: activation checkpointing recomputes a forward inside the backward, where "
            "the normalization layers do not run as the elementary operations whose third "
            "derivative MetaInit needs (the native kernels' is wrong), so the recomputation "
            "differs. Turn checkpointing off for metainit_ (a Hugging Face model: "
            "model.gradient_checkpointing_disable()) and on again after; the model was left "
            "unchanged"
        ) from err
    return meta, loss_value, gq_value, grad_norm


def _descend(
    model: nn.Module,
    loss: LossFn,
    ts: Tensors,
    batches: Iterator[tuple[Any, Any]],
    update: _ScaleUpdate,
    eps: float,
    progress: Callable[[dict[str, Any]], None] | None,
    what: str,
) -> tuple[list[dict[str, Any]], int, int]:
    """The steps, one per batch: ``GQ``, its gradient in the scales, the step on them, a trace
    row; returns the trace and the counts of forward and backward passes."""
    forward = backward = 0
    trace: list[dict[str, Any]] = []
    for t, (batch, _) in enumerate(batches):
        meta, loss_value, gq_value, grad_norm = _meta_gradient(
            model, loss, ts, update.alpha, batch, eps, (what, t)
        )
        forward += 1
        grad = rank_mean([meta.double()])[0]
        check_alpha_grad(grad, ts, t, what, "the gradient quotient", _OVERFLOW)  # on every rank
        backward += 3
        alpha = update.step(grad)
        row = {
            "iteration": t,
            "gq": gq_value,
            "loss": loss_value,
            "grad_norm": scalar_mean(torch.tensor(grad_norm, device="cpu")),
            "alpha_min": float(alpha.min()),
            "alpha_max": float(alpha.max()),
        }
        trace.append(row)
        if progress is not None:
            progress(dict(row))
    return trace, forward, backward


def _report(
    model: nn.Module,
    ts: Tensors,
    alpha: torch.Tensor,
    trace: list[dict[str, Any]],
    passes: tuple[int, int],
    counter: DataCounter,
    variant: str,
    start: float,
) -> MethodReport:
    """:func:`metainit_`'s report: a row per scaled tensor, the trace, the passes and ``info``."""
    forward, backward = passes
    return MethodReport(
        alpha_rows(model, ts, alpha),
        METAINIT_COLUMNS,
        method="metainit",
        forward_passes=forward,
        backward_passes=backward,
        wall_s=time.perf_counter() - start,
        trace=Rows(trace, METAINIT_TRACE_COLUMNS, title="metainit trace"),
        used=counter.use(),
        info={
            "steps": len(trace),
            "variant": variant,
            "gq_first": trace[0]["gq"],
            "gq_last": trace[-1]["gq"],
            "not_scaled": list(ts.left),
        },
    )


@dataclass(frozen=True)
class _Options:
    """The checked numeric options of one :func:`metainit_` call (defaults of its variant)."""

    paper: bool
    steps: int | None
    lr: float
    momentum: float
    eps: float
    alpha_min: float
    clip_value: float  # 0: no clipping
    batch_stats: bool
    n_classes: int | None

    @classmethod
    def check(
        cls,
        variant: str,
        steps: int | None,
        lr: float | None,
        momentum: float,
        eps: float,
        alpha_min: float,
        clip: float | None,
        batch_stats: bool | None,
        n_classes: int | None,
        what: str,
    ) -> _Options:
        if variant not in _VARIANTS:
            raise ValueError(f"{what}: variant must be one of {_VARIANTS}, got {variant!r}")
        paper = variant == "paper"
        lr = check_number(what, "lr", lr if lr is not None else (0.1 if paper else 1e-3))
        momentum = check_number(what, "momentum", momentum, strict=False)
        if momentum >= 1:
            raise ValueError(f"{what}: momentum must be in [0, 1), got {momentum!r}")
        eps = check_number(what, "eps", eps, strict=False)
        alpha_min = check_number(what, "alpha_min", alpha_min, strict=False)
        clip_value = (
            0.0 if clip is None else check_number(what, "clip", clip, strict=False, finite=False)
        )
        if steps is not None:
            steps = positive_int(what, "steps", steps)
        if batch_stats is None:
            batch_stats = not paper
        return cls(paper, steps, lr, momentum, eps, alpha_min, clip_value, batch_stats, n_classes)


def _step_batches(
    model: nn.Module,
    ts: Tensors,
    data: Any,
    input_shape: Sequence[int] | None,
    opts: _Options,
    gen: torch.Generator | None,
    what: str,
    counter: DataCounter,
) -> Iterator[tuple[Any, Any]]:
    """The batch of every step: the paper's random data (``data=None``) or ``data``'s batches."""
    if data is None:
        if input_shape is None:
            raise ValueError(f"{what}: random data (data=None) needs input_shape=(batch, ...)")
        shape = _check_batch_shape(input_shape, what)
        table = getattr(model, "get_input_embeddings", lambda: None)()
        if isinstance(table, nn.Embedding):  # a Hugging Face model of token ids
            raise ValueError(
                f"{what}: random data (data=None) draws float inputs N(0, 1) of input_shape, and "
                f"this model takes token ids (its input embedding, {type(table).__name__}"
                f"({table.num_embeddings}, {table.embedding_dim}), indexes a table): pass data, "
                "batches of input_ids (random ones work: torch.randint(0, vocab_size, (B, T)))"
            )
        n_classes = opts.n_classes
        if n_classes is not None:
            n_classes = positive_int(what, "n_classes", n_classes)
        random = _random_batches(model, ts, shape, n_classes, opts.steps or _PAPER_STEPS, gen)
        return ((counter.add_one(b), n) for b, n in random)
    if opts.n_classes is not None:
        raise ValueError(
            f"{what}: n_classes={opts.n_classes!r} sets the random labels of the paper's random "
            "data (data=None); with data, the labels are the data's: leave n_classes out"
        )
    return batch_pairs(data, opts.steps, False, what, counter)


class _ScaleUpdate:
    """The step on the scales: signSGD with momentum on the norms (``"paper"``), or Adam on
    ``alpha`` with per-scalar clipping (``"gradinit"``); ``alpha >= alpha_min`` in both."""

    def __init__(self, ts: Tensors, opts: _Options) -> None:
        n = len(ts.scaled)
        self.opts = opts
        self.alpha = torch.ones(n, dtype=torch.float64, device="cpu")
        self.norms0 = torch.tensor(ts.norms, dtype=torch.float64, device="cpu")
        self.memory = torch.zeros(n, dtype=torch.float64, device="cpu")
        self.adam = AlphaAdam.zeros(n, opts.lr)

    def step(self, grad: torch.Tensor) -> torch.Tensor:
        """Take one step along ``grad`` (the rank-mean alpha-gradient); returns the new alpha."""
        opts = self.opts
        if opts.paper:
            # signSGD with momentum on the norms s = alpha * ||W0|| (Figure 2).
            self.memory = opts.momentum * self.memory - opts.lr * grad.sign()
            s = (self.alpha * self.norms0 + self.memory).maximum(opts.alpha_min * self.norms0)
            self.alpha = s / self.norms0
        else:
            if opts.clip_value > 0:
                grad = grad.clamp(-opts.clip_value, opts.clip_value)
            self.alpha = self.adam.step(self.alpha, grad, opts.alpha_min)
        return self.alpha
