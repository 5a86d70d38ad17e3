r"""GradInit: learn one scale per weight tensor so that the first optimizer step works well.

Zhu, Ni, Xu, Kong, Huang & Goldstein (2021), *GradInit: Learning to Initialize Neural Networks for
Stable and Efficient Training* (NeurIPS), Algorithm 1; appendix A-B for the settings; the public
reference implementation (``gradinit_utils.py``, ``RescaleAdam``) for the details the paper leaves
open. Notation: tensor ``i`` of the model is ``W_i``, its scale ``alpha_i`` (initially 1), and the
network is evaluated at ``theta_alpha = (alpha_i * W_i)_i``.

Algorithm (one iteration ``t = 1..T``)::

    S  = batch t of the loader,  S~ = overlap_batch(S, batch t+1, r)
    g  = grad_theta L(S; theta_alpha)                      (all trainable tensors)
    if ||g||_p > gamma:   constraint step: Adam step on alpha along d||g||_p / d alpha
    else:                 objective step:  Adam step on alpha along d/d alpha of
                                          L(S~; theta_alpha - eta * A[g]) / eta
    alpha <- max(alpha, alpha_min)
    after T iterations:  W_i <- alpha_i * W_i   (in place, once per distinct tensor)

``A[g] = g`` and ``p = 2`` for SGD; ``A[g] = sign(g)`` and ``p = 1`` for Adam (Adam's first step,
``g / (|g| + eps)``, is ``sign(g)`` up to its ``eps``).
Dividing the look-ahead loss by ``eta`` is the reference code's ``obj_loss = updated_loss / eta``;
it only matters through the clipping below and Adam's ``eps``.

What is exactly what here:

* **Which tensors get an alpha** (``params="default"``): every trainable tensor that is not all
  zeros -- weights, embeddings, norm scales, and the biases/norm shifts that are non-zero -- as in
  the reference code (its optimizer skips tensors of norm 0, where a scale has no effect), but for
  a tensor no layer claims that is a lone scalar (a temperature such as CLIP's ``logit_scale``, a
  gate) or holds a log by its name (Mamba's ``A_log``): ``alpha * log(a)`` would raise ``a`` to
  the power ``alpha`` (``info["not_scaled"]`` names them). All trainable tensors, scaled or not,
  enter ``g``, ``||g||`` and the look-ahead step. Tied tensors are one tensor (deduplicated by
  identity): one alpha, folded once, and they stay tied.
* **Functional evaluation.** The model is evaluated at ``theta_alpha`` with its modules'
  parameter entries swapped for the call, as :func:`torch.func.functional_call` swaps them
  (:class:`~initlab.methods._alpha.AtParams`); its parameters are never replaced, wrapped or
  re-registered. ``loss_fn(model, batch)`` receives a stand-in that runs the model at ``theta``
  when called like the model; its other attributes are the model's. Only calls of the
  stand-in itself are evaluated at ``theta``: calling a submodule directly (``model.encoder(x)``)
  inside ``loss_fn`` bypasses the scales.
* **S~** (:func:`overlap_batch`): the first ``m = round(r * B)`` examples of ``S`` followed by the
  first ``B - m`` examples of the *next* batch of the loader (``B`` = size of ``S``; fewer if the
  next batch is shorter). Iteration ``t`` therefore reads batches ``t`` and ``t + 1``: ``T``
  iterations need ``T + 1`` batches (``T`` when ``r = 1``), and the default ``T`` is one pass,
  ``(number of batches) - 1``. With ``generator=`` the ``m`` shared and ``B - m`` fresh examples
  are random subsets instead of the first ones. A batch is a tensor, a tuple/list/namedtuple or a
  dict of them (nested); every tensor with at least one dimension is sliced and concatenated along
  ``batch_dim`` (dim 0 by default; ``batch_dim=1`` takes whole sequences of time-major ``(T, B)``
  batches, and a tensor with ``batch_dim`` dims or fewer, such as targets ``(B,)``, along dim 0;
  a tensor that holds another number of examples there is refused by name, rather than spliced;
  every tensor with more than ``batch_dim`` dims must hold the examples at ``batch_dim``: a
  batch-major ``(B, T)`` mask beside time-major inputs is misread where ``T == B``),
  and a ``PackedSequence`` gives whole sequences (``B`` is its number of sequences; the
  chosen ones are packed again, each still the example of its target). The reference code draws
  half batches and builds ``S`` from two of them and ``S~`` from the first plus a third: the same
  thing with ``r = 0.5`` and a loader of full batches.
* **alpha-gradient clipping** (``clip``): each scalar's gradient is clamped to ``[-clip, clip]``
  before the Adam step, as ``RescaleAdam`` does (``grad_clip``, default 1; for a scalar, norm and
  value clipping coincide). ``clip=None`` turns it off.
* **Adam on alpha**: betas (0.9, 0.999), eps 1e-8, bias-corrected; constraint steps and objective
  steps keep separate moment estimates and step counts (as ``RescaleAdam(is_constraint=...)``).
  The clamp ``alpha >= alpha_min`` applies to every alpha (the reference uses 0 for biases).
* **First-order vs exact** (``exact``). The default is the reference implementation: ``A[g]`` is
  detached, so the objective's alpha-gradient is ``<grad L(S~; theta'), W_i> / eta`` with
  ``theta' = theta_alpha - eta * A[g]``. ``exact=True`` differentiates through ``A[g(alpha)]`` as
  well (a double backward through ``g``). For ``optimizer="adam"``, ``sign`` is piecewise constant,
  so its derivative is zero almost everywhere and the exact alpha-gradient *equals* the
  first-order one: ``exact=True`` changes nothing there (and costs nothing).
* **Normalization layers and dropout.** During the iterations every module is in eval mode
  (dropout off) except normalization layers with statistics (BatchNorm, SyncBatchNorm,
  InstanceNorm), which are in train mode and normalize with the batch's statistics, as in the
  reference code. Their running statistics are updated by the forward passes but every buffer is
  copied back at the end, so buffers are bit-identical after the call; train/eval flags are
  restored.
* **Distributed** (``torch.distributed`` initialized): ``g`` is averaged over ranks before its norm
  is taken and before the look-ahead step, and the alpha-gradients are averaged before the Adam
  step (in exact mode also the look-ahead loss's gradient w.r.t. ``theta'``), so both steps use
  the gradient of the global loss and all ranks end bit-identical. The ranks must start from
  the same weights and run the same number of iterations: both are checked (a checksum of the
  parameters and buffers at entry, but the running statistics of the norm layers, which run on
  batch statistics here; the iteration count, and every batch in lockstep), and a
  mismatch raises the same :class:`~initlab._core.distributed.RankMismatchError` on every rank,
  as does a forward or backward pass that fails on some ranks only (each is run together,
  :func:`~initlab._core.distributed.run_together`; one small all-reduce each). Give every rank
  the same number of batches of the same size (both checked: the ranks' gradients are averaged
  with equal weights) and the same options (checked at entry).
* **Failure**: on any exception (including the errors below) the model's tensors and modes are
  put back (:func:`~initlab._core.state.restore_on_failure`); no hook is ever attached.

Errors and warnings: fewer batches than ``T`` needs -> ``ValueError`` saying how many; a non-finite
loss at any iteration -> ``FloatingPointError`` (at the first one, before anything changed);
``optimizer="adam"`` with ``gamma`` on the wrong scale -> ``UserWarning`` suggesting
``gamma * ||g||_1 / ||g||_2`` (the same bound moved to the L1 scale of this gradient; the paper
used gamma = 1 with SGD on CIFAR-10 and gamma = 1e3 with Adam on IWSLT'14). The rule: at the
first iteration, warn if ``gamma < sqrt(||g||_1 * ||g||_2)``, i.e. gamma is nearer, on a log
scale, to the gradient's L2 norm than to its L1 norm. The two differ by about ``0.8 sqrt(N)``
for a dense gradient of ``N`` entries (hundreds for a CIFAR ResNet), so a gamma picked on the L2
scale (as for SGD) falls below that midpoint, every step becomes a constraint step and GradInit
only shrinks the weights.

Cost per iteration (``F``/``B``: one forward/backward of the model): objective step ``2F + 2B``
(first-order: ``theta'`` is built without a graph to alpha, and each alpha-gradient is one dot
product ``<dL~/dtheta'_k, W_k>`` of the look-ahead gradient); exact (SGD): ``2F``, a backward with
graph, and one backward through the look-ahead loss and on through the double backward of ``g``;
constraint step: ``F``, a backward with graph and a double backward. ``g`` is built with its graph
only when a constraint step is expected (the previous step was one); when an objective step is
followed by a constraint step, that step costs one more ``F + B``. Wherever ``g`` is differentiated
again, the convolutions and batch norms of ``L(S)`` run with their second derivatives written out,
and the double backward gives each scaled convolution weight only what its alpha reads
(``<G, W_k>``, without the weight-gradient kernels;
:func:`~initlab.methods._second_order.written_out_second_order`): the same forward and ``g``, the
same alpha-gradients to rounding (tested against autograd in float64), about a quarter less time per
constraint step on CIFAR CNNs (``benchmarks/bench_gradinit.py``).

On CPU under Linux, glibc's allocator hands memory freed at the top of its heap back to the system
once more than its trim threshold is free, and a step that frees and takes back several hundred MB
pays a page fault per 4 KiB of it, every step. A constraint step on ResNet-20 at CIFAR batch 128
does (about 800 MB): 2.8-3.2x a plain training step with those faults, 2.4-2.5x without
(``benchmarks/bench_gradinit_faults.py``). :func:`gradinit_` therefore keeps the heap for the
length of its call (``keep_heap=True``, :func:`~initlab._core.heap.kept_heap`: nothing trimmed,
nothing mapped on its own; afterwards glibc's thresholds are left at the largest values its own
rule gives them, 32 and 64 MiB). ``keep_heap=False``, another C library, or malloc's thresholds
set in the environment (``GLIBC_TUNABLES``, ``MALLOC_TRIM_THRESHOLD_``, ...) leave the allocator
as it is.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from initlab._core.attention import with_math_attention
from initlab._core.backward import refuse_complex, with_grad
from initlab._core.compiled import takes_compiled
from initlab._core.data import DataCounter
from initlab._core.distributed import (
    check_same_parameters,
    is_distributed,
    run_together,
    same_options,
)
from initlab._core.heap import kept_heap
from initlab._core.knobs import check_batch_dim, check_callback, renamed_kwargs, user_stacklevel
from initlab._core.loss import LossLike, resolve_loss
from initlab._core.method_report import MethodReport
from initlab._core.norms import float16_norms
from initlab._core.parametrized import writing_layers
from initlab._core.reductions import sum_of_products, total_sum_of_squares
from initlab._core.rng import as_generator
from initlab._core.rows import Rows
from initlab._core.state import restore_on_failure
from initlab.methods._alpha import (
    AlphaAdam,
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
    scaled_leaves,
    scaled_params,
    second_order,
    select_tensors,
    set_evaluation_modes,
    warn_half_precision,
)
from initlab.methods._overlap import overlap_batch
from initlab.methods._second_order import written_out_second_order

__all__ = [
    "GRADINIT_COLUMNS",
    "GRADINIT_TRACE_COLUMNS",
    "gradinit_",
    "gradinit_alpha_grad",
    "overlap_batch",
]

#: Rows of the :class:`~initlab.MethodReport` of :func:`gradinit_`, one per tensor
#: with an alpha: ``layer`` and ``param`` (the first qualified name of the tensor, split into the
#: module's qualified name and the parameter's local name), ``role`` (from the layer
#: registry: weight, bias, norm_scale, norm_shift, embedding, or ``unclaimed``), ``alpha`` (the
#: learned scale, folded into the tensor), ``norm_before`` / ``norm_after`` (Frobenius norms),
#: ``tied_to`` (a tied tensor, listed once with one alpha: its other names, comma-separated;
#: ``None`` for a tensor that is not tied).
GRADINIT_COLUMNS = ("layer", "param", "role", "alpha", "norm_before", "norm_after", "tied_to")

#: Columns of the per-iteration ``trace``: ``iteration`` (0-based); ``step`` ("constraint" or
#: "objective"); ``grad_norm`` (``||g||_p`` of the rank-averaged gradient on S at the alphas
#: before the step, p = 2 for SGD, 1 for Adam); ``loss`` (L(S) there, rank-averaged);
#: ``objective`` (objective steps: the look-ahead loss L(S~; theta - eta A[g]), rank-averaged;
#: ``None`` on constraint steps); ``alpha_min`` / ``alpha_max`` (after the step).
GRADINIT_TRACE_COLUMNS = (
    "iteration",
    "step",
    "grad_norm",
    "loss",
    "objective",
    "alpha_min",
    "alpha_max",
)

_OPTIMIZERS = ("sgd", "adam")

_CONSTRAINT_WHY = "its constraint step descends the gradient norm ||g|| in alpha"
_CONSTRAINT_ADVICE = (
    "raise gamma above the gradient norms of the trace so that no constraint step is taken (the "
    "objective steps of exact=False are first-order)"
)
_EXACT_WHY = "exact=True differentiates through the simulated step theta - eta * g"
_EXACT_ADVICE = "use exact=False (the reference implementation's first-order objective step)"


def _attach(local: Sequence[torch.Tensor], mean: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The rank mean in value, the local tensor in derivative (``local + (mean - local).detach()``).

    Averaging the alpha-gradients of anything computed from it over ranks gives the exact
    alpha-gradient of the same quantity computed from the rank-mean gradient.
    """
    if not is_distributed():
        return list(local)
    return [g + (m - g).detach() for g, m in zip(local, mean, strict=True)]


# --------------------------------------------------------------------------------------------------
# One GradInit step
# --------------------------------------------------------------------------------------------------


@dataclass
class _StepResult:
    kind: str
    grad: torch.Tensor  # alpha-gradient, rank-averaged, float64, not clipped
    grad_norm: float
    grad_norm2: float
    loss: float
    objective: float | None


class _GradInitStep:
    """The alpha-gradient of one GradInit iteration (constraint or objective), DDP-aware."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        ts: Tensors,
        *,
        eta: float,
        optimizer: str,
        exact: bool,
        what: str,
    ) -> None:
        self.model, self.loss_fn, self.ts = model, loss_fn, ts
        self.eta = eta
        self.sign = optimizer == "adam"
        # sign(g) has zero derivative a.e.: exact and first-order coincide for Adam.
        self.exact = exact and not self.sign
        self.what = what
        self.forward = 0
        self.backward = 0
        self.last_kind = "objective"
        self.checked = False  # the graph of g was checked for a cut second derivative

    def _norm(self, g: Sequence[torch.Tensor]) -> torch.Tensor:
        """``||g||_1`` (Adam) or ``||g||_2``, differentiable, in float32 at least (a float16
        model's ``sum g^2`` passes 65504 at ``||g|| = 256``: the constraint's alpha-gradient was
        then zero, and the constraint steps changed nothing)."""
        wide = [x.float() if x.dtype in (torch.float16, torch.bfloat16) else x for x in g]
        if self.sign:
            return torch.stack([x.abs().sum() for x in wide]).sum()
        return torch.stack([x.square().sum() for x in wide]).sum().sqrt()

    def _direction(self, g: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [x.sign() for x in g] if self.sign else list(g)

    def _loss(self, theta: list[torch.Tensor], batch: Any, twice: bool) -> torch.Tensor:
        """``L(batch; theta)``; ``twice``: it will be differentiated twice (the convolutions and
        batch norms get their second derivatives written out, :func:`written_out_second_order`;
        in a float16 model the normalizations of float16 inputs run on float32 statistics,
        :func:`~initlab._core.norms.float16_norms`: their native double backwards overflow
        float16, and every constraint step's alpha-gradient was NaN).
        """
        self.forward += 1

        def evaluate() -> torch.Tensor:
            if not twice:
                return loss_at(self.model, self.loss_fn, self.ts, theta, batch)
            # Every differentiation through g ends at the alphas: a scaled tensor's gradient there
            # is read only through <., W_k> (written_out_second_order's ``scaled``).
            half = float16_norms() if self.ts.float16 else nullcontext()
            with half, written_out_second_order([theta[i] for i in self.ts.scaled]):
                return loss_at(self.model, self.loss_fn, self.ts, theta, batch)

        # a local pass: under DDP, if it fails on some ranks every rank raises the same error
        return run_together(self.what, evaluate)

    def _alpha_grad(self, out: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        grad = run_together(self.what, lambda: grads_or_zeros(out, [a])[0])
        return rank_mean([grad.double()])[0]

    def __call__(
        self,
        alpha: torch.Tensor,
        batch: Any,
        tilde: Callable[[], Any],
        gamma: float,
        iteration: int,
        force: str | None = None,
    ) -> _StepResult:
        ts = self.ts
        a = alpha.detach().clone().requires_grad_(True)
        # A constraint step needs g with its graph. Build it when the step is likely one (the
        # previous step was); otherwise free the graph of L(S) during the backward (less memory,
        # faster on CPU) and, on a wrong guess, evaluate L(S) once more.
        with_graph = self.exact or force == "constraint" or self.last_kind == "constraint"
        theta = scaled_params(ts, a) if with_graph else scaled_leaves(ts, alpha)
        loss = self._loss(theta, batch, with_graph)
        loss_value = scalar_mean(loss)
        check_finite(loss_value, iteration, self.what)
        g = run_together(self.what, lambda: grads_or_zeros(loss, theta, create_graph=with_graph))
        self.backward += 1
        g_mean = rank_mean(g)
        # ||g||_2 (for the warning on gamma's scale): a few kernels for all of g, accurate to
        # ~3e-7 without a float64 copy of g; ||g||_1 for Adam.
        grad_norm2 = math.sqrt(total_sum_of_squares(g_mean))
        grad_norm = grad_norm2
        if self.sign:
            grad_norm = float(sum(x.abs().sum(dtype=torch.float64) for x in g_mean))
        kind = force or ("constraint" if grad_norm > gamma else "objective")
        self.last_kind = kind

        if kind == "constraint":
            if not with_graph:  # guessed wrong: evaluate L(S) again, keeping the graph
                theta = scaled_params(ts, a)
                loss = self._loss(theta, batch, True)
                g = run_together(self.what, lambda: grads_or_zeros(loss, theta, create_graph=True))
                self.backward += 1
            with second_order(self.what, _CONSTRAINT_WHY, _CONSTRAINT_ADVICE) as check:
                self._check_once(check, [*g, loss])
                norm = self._norm(_attach(g, g_mean))
                grad = self._alpha_grad(norm, a)
            self.backward += 1
            self._check_grad(grad, kind, iteration)
            return _StepResult(kind, grad, grad_norm, grad_norm2, loss_value, None)

        if self.exact:
            step = self._direction(_attach(g, g_mean))
            look = [t - self.eta * d for t, d in zip(theta, step, strict=True)]
        else:
            del loss, g  # frees the graph of L(S) (and of g) before the look-ahead forward
            look = self._look_ahead(theta, self._direction(g_mean))
            del g_mean  # and g itself: the look-ahead pass holds theta' and its gradient only
        look_loss = run_together(
            self.what, lambda: loss_at(self.model, self.loss_fn, ts, look, tilde())
        )
        self.forward += 1
        objective = scalar_mean(look_loss)
        check_finite(objective, iteration, self.what, "look-ahead loss")
        if not self.exact:
            grad = self._first_order_grad(look_loss, look)
        else:
            with second_order(self.what, _EXACT_WHY, _EXACT_ADVICE) as check:
                self._check_once(check, [*g, loss])
                grad = self._exact_grad(look_loss / self.eta, look, a)
        self.backward += 1
        self._check_grad(grad, kind, iteration)
        return _StepResult(kind, grad, grad_norm, grad_norm2, loss_value, objective)

    def _look_ahead(
        self, theta: list[torch.Tensor], step: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """``theta' = theta - eta * A[g]`` as fresh leaves (first order: no graph to alpha); only
        the scaled ones need a gradient. A scaled entry of ``theta`` is a product ``alpha_k * W_k``
        of this step, not the parameter: it is overwritten in place (no new memory)."""
        scaled, rest = self.ts.scaled, self.ts.unscaled
        look = [t.detach() for t in theta]
        with torch.no_grad():
            if scaled:
                torch._foreach_add_(
                    [look[i] for i in scaled], [step[i] for i in scaled], alpha=-self.eta
                )
            if rest:
                moved = torch._foreach_add(
                    [look[i] for i in rest], [step[i] for i in rest], alpha=-self.eta
                )
                for i, t in zip(rest, moved, strict=True):
                    look[i] = t
        for i in scaled:
            look[i].requires_grad_()
        return look

    def _first_order_grad(self, look_loss: torch.Tensor, look: list[torch.Tensor]) -> torch.Tensor:
        """The first-order objective's alpha-gradient, ``<dL(S~; theta') / d theta'_k, W_k> / eta``
        for each scaled tensor ``k`` (rank mean): one dot product per tensor, no graph to alpha."""
        ts = self.ts
        grads = run_together(
            self.what, lambda: grads_or_zeros(look_loss, [look[i] for i in ts.scaled])
        )
        dots = [sum_of_products(g, ts.tensors[i]) for g, i in zip(grads, ts.scaled, strict=True)]
        return rank_mean([_host_vector(dots) / self.eta])[0]

    def _exact_grad(
        self, scaled_loss: torch.Tensor, look: list[torch.Tensor], a: torch.Tensor
    ) -> torch.Tensor:
        """The exact objective's alpha-gradient, through ``A[g(alpha)]`` (rank mean)."""
        if not is_distributed():
            return self._alpha_grad(scaled_loss, a)
        # d/d alpha of the mean over ranks: average dL~/d theta' first, then pull it back
        # through theta'(alpha) (which depends on every rank's g through the rank-mean g).
        u = rank_mean(
            run_together(self.what, lambda: grads_or_zeros(scaled_loss, look, retain_graph=True))
        )
        self.backward += 1
        grad = run_together(self.what, lambda: grads_or_zeros(look, [a], grad_outputs=u)[0])
        return rank_mean([grad.double()])[0]

    def _check_grad(self, grad: torch.Tensor, kind: str, iteration: int) -> None:
        """A non-finite alpha-gradient of a finite loss raised for what it is
        (:func:`~initlab.methods._alpha.check_alpha_grad`)."""
        of = {
            "constraint": "the constraint step's ||g|| (a second derivative of the loss)",
            "objective": "the look-ahead loss"
            + (" (through g: a second derivative of the loss)" if self.exact else ""),
        }[kind]
        check_alpha_grad(grad, self.ts, iteration, self.what, of, "the derivatives")

    def _check_once(self, check: Callable[[Sequence[torch.Tensor]], None], g: Any) -> None:
        """At the first step that differentiates through ``g`` (the gradient and its loss): is
        its graph complete?"""
        if not self.checked:
            check(g)
            self.checked = True


def _host_vector(values: list[torch.Tensor]) -> torch.Tensor:
    """Scalars on any devices as one float64 CPU vector (one copy per device, not per scalar)."""
    out = torch.zeros(len(values), dtype=torch.float64, device="cpu")
    by_device: dict[torch.device, list[int]] = {}
    for k, v in enumerate(values):
        by_device.setdefault(v.device, []).append(k)
    for ks in by_device.values():
        out[ks] = torch.stack([values[k] for k in ks]).to(device="cpu", dtype=torch.float64)
    return out


def _warn_gamma_scale(gamma: float, norm1: float, norm2: float) -> None:
    """Warn if an L1 bound ``gamma`` is nearer (log scale) to ``||g||_2`` than to ``||g||_1``."""
    if not gamma < math.sqrt(norm1 * norm2):
        return
    suggest = gamma * norm1 / max(norm2, 1e-300)
    warnings.warn(
        f"gradinit_ with optimizer='adam' bounds ||g||_1, which is {norm1:.4g} at the first "
        f"iteration (||g||_2 = {norm2:.4g}); gamma={gamma:g} is on the L2 scale, so every step "
        f"will be a constraint step that only shrinks the weights. The same bound on the L1 "
        f"scale of this gradient is gamma * ||g||_1 / ||g||_2 = {suggest:.3g} (the paper used "
        f"gamma=1e3 with Adam for a Transformer).",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def _check_common(
    optimizer: str, eta: float, overlap: float, what: str
) -> tuple[str, float, float]:
    if optimizer not in _OPTIMIZERS:
        raise ValueError(f"{what}: optimizer must be one of {_OPTIMIZERS}, got {optimizer!r}")
    eta = check_number(what, "eta", eta)
    overlap = check_number(what, "overlap", overlap, strict=False)
    if overlap > 1:
        raise ValueError(f"{what}: overlap must be in [0, 1], got {overlap}")
    return optimizer, eta, overlap


def _refuse_complex(model: nn.Module, what: str) -> None:
    """Raise ``TypeError`` naming the trainable complex parameters: ``g`` holds the gradients
    of every trainable tensor, and ``||g||_p`` of a complex ``g`` is no real scalar torch can
    differentiate (it raised "grad can be implicitly created only for real scalar outputs")."""
    refuse_complex(
        model, what, "GradInit's gradient norm ||g|| and alpha-gradients are defined for real "
        "tensors: freeze them (requires_grad_(False)) for this call"
    )  # fmt: skip


_SIGNS_FLIP = (
    "Adam's steps on the scales follow the signs of their gradients (its first step is about "
    "lr * sign), and the rounding of the passes flips the signs of the small ones (a tiny "
    "BERT: a LayerNorm's alpha 0.832 in float32, 1.053 in float16, 1.184 in bfloat16)"
)


@with_math_attention
def gradinit_alpha_grad(
    model: nn.Module,
    batch: Any,
    batch_tilde: Any | None = None,
    loss_fn: LossLike = None,
    *,
    step: Literal["objective", "constraint"] = "objective",
    alpha: torch.Tensor | Sequence[float] | None = None,
    eta: float = 0.1,
    optimizer: Literal["sgd", "adam"] = "sgd",
    exact: bool = False,
    params: str | TensorFilter = "default",
) -> tuple[torch.Tensor, float]:
    """The alpha-gradient of one GradInit step, without changing the model.

    ``step="objective"``: gradient of ``L(S~; theta_alpha - eta * A[g]) / eta`` (first-order or
    exact, as in :func:`gradinit_`); ``step="constraint"``: gradient of ``||g||_p``. ``g`` is the
    gradient of ``L(batch)`` at ``theta_alpha``; ``alpha`` defaults to ones, in the order of the
    scaled tensors (``model.named_parameters()`` order, tied tensors once). Returns the gradient
    (float64, before clipping) and the objective's value (the look-ahead loss, not divided by
    ``eta``, or ``||g||_p``). Modes and buffers are handled as in :func:`gradinit_` and restored.

    Raises:
        ValueError: bad options (``step``, ``optimizer``, ``eta``, ``alpha``'s length).
        TypeError: a trainable complex parameter (named; freeze it for the call).
        FloatingPointError: a non-finite loss, or a non-finite alpha-gradient of a finite loss
            (its derivative overflowed: a float16 model's range, named with the float32 copy to
            use; :func:`~initlab.methods._alpha.check_alpha_grad`).
    """
    what = "gradinit_alpha_grad"
    optimizer, eta, _ = _check_common(optimizer, eta, 0.5, what)
    if step not in ("objective", "constraint"):
        raise ValueError(f"{what}: step must be 'objective' or 'constraint', got {step!r}")
    _refuse_complex(model, what)
    ts = select_tensors(model, params, nonzero, what)
    if alpha is None:
        a = torch.ones(len(ts.scaled), dtype=torch.float64, device="cpu")
    else:
        a = torch.as_tensor(alpha, dtype=torch.float64, device="cpu").reshape(-1).clone()
        if a.numel() != len(ts.scaled):
            raise ValueError(f"{what}: alpha has {a.numel()} entries, expected {len(ts.scaled)}")
    tilde = batch if batch_tilde is None else batch_tilde
    run = _GradInitStep(
        model,
        resolve_loss(loss_fn, what=what),
        ts,
        eta=eta,
        optimizer=optimizer,
        exact=exact,
        what=what,
    )
    with evaluation_modes(model, batch_stats=True):
        res = run(a, batch, lambda: tilde, math.inf, 0, force=step)
    value = res.grad_norm if step == "constraint" else res.objective
    assert value is not None
    return res.grad, value


@takes_compiled(collective=True)
@with_grad
@renamed_kwargs(iterations="steps")
@with_math_attention
@same_options
@writing_layers
def gradinit_(
    model: nn.Module,
    data: Any,
    loss_fn: LossLike = None,
    *,
    steps: int | None = None,
    lr: float = 1e-3,
    eta: float = 0.1,
    gamma: float = 1.0,
    optimizer: Literal["sgd", "adam"] = "sgd",
    overlap: float = 0.5,
    batch_dim: int | None = None,
    alpha_min: float = 0.01,
    clip: float | None = 1.0,
    params: str | TensorFilter = "default",
    exact: bool = False,
    generator: torch.Generator | int | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
    keep_heap: bool = True,
) -> MethodReport:
    r"""GradInit (Zhu et al. 2021, Algorithm 1): learn a scale per tensor, fold it in, in place.

    See the module docstring for the algorithm and every choice made. Defaults follow the paper's
    CIFAR-10 setup and its reference code: ``eta = 0.1``, ``gamma = 1``, ``alpha_min = 0.01``,
    per-scalar gradient clipping at 1, Adam on alpha with ``lr = tau = 1e-3`` (the paper tunes
    ``tau`` in {1e-3, ..., 1e-1}), ``overlap = 0.5``, one pass over the loader.

    Args:
        model: any ``nn.Module``; changed in place (its scaled tensors are multiplied by alpha).
        data: many batches (a ``DataLoader``, a list of batches, ``initlab.Batches``) or one
            batch (the rule: :mod:`initlab._core.data`).
        loss_fn: any form :func:`initlab.resolve_loss` reads: ``loss_fn(model, batch)`` (call
            ``model`` like the model), a criterion (``nn.CrossEntropyLoss()``,
            ``F.cross_entropy``), the model's own loss, a name. Default: the model's own loss,
            else cross-entropy (integer targets) or MSE on ``(x, y)`` batches.
        steps: ``T``; needs ``T + 1`` batches (``T`` when ``overlap == 1``). Default: one
            pass, number of batches minus one (all batches of an iterable without ``len``).
            (``iterations=`` before 0.2.)
        lr: Adam learning rate ``tau`` on the alphas.
        eta: step size of the simulated first step ``theta - eta * A[g]``.
        gamma: the gradient-norm bound (on ``||g||_2`` for SGD, ``||g||_1`` for Adam).
        optimizer: ``"sgd"`` (``A[g] = g``, p = 2) or ``"adam"`` (``A[g] = sign(g)``, p = 1).
        overlap: fraction ``r`` of ``S~`` taken from ``S`` (:func:`overlap_batch`).
        batch_dim: the dim of the batch's tensors that holds the examples
            (:func:`~initlab.measure_moments`'s): ``None`` reads dim 0; ``1`` for a time-major
            model. ``S~`` takes whole examples along it (along dim 0 in a tensor with
            ``batch_dim`` dims or fewer, such as per-sequence targets ``(B,)``:
            :func:`overlap_batch`), and ``used`` counts them. Every tensor with more than
            ``batch_dim`` dims must hold the examples at ``batch_dim``: a batch-major mask
            ``(B, T)`` beside a time-major ``(T, B)`` input is sliced along its time steps,
            refused where ``T != B`` but spliced with no word where ``T == B``.
        alpha_min: lower bound of every alpha.
        clip: clamp each alpha's gradient to ``[-clip, clip]``; ``None`` or 0: no clipping.
        params: ``"default"`` (every trainable non-zero tensor but a lone scalar or a log no
            layer claims: ``info["not_scaled"]``) or a filter
            ``params(name, tensor, role) -> bool`` (all-zero tensors never get a scale).
        exact: differentiate through ``A[g]`` (SGD; identical to first-order for Adam).
        generator: a seed or generator: draw the shared and fresh examples of ``S~`` at random
            with it (``None``: the first examples of each batch, deterministically).
        progress: called with every trace row as it is produced.
        keep_heap: on Linux with glibc, keep the C heap for the length of the call, so that
            steps after the first do not fault in again the memory the previous one freed
            (:func:`~initlab._core.heap.kept_heap`: about a quarter of a constraint step on a
            CIFAR ResNet; glibc's thresholds are left at the largest values its own rule
            reaches). ``False`` leaves the allocator alone; so does a process started with
            malloc's thresholds in its environment.

    Returns:
        A :class:`~initlab.MethodReport`: rows
        :data:`~initlab.methods.gradinit.GRADINIT_COLUMNS`, ``trace`` rows
        :data:`~initlab.methods.gradinit.GRADINIT_TRACE_COLUMNS`, ``info`` with ``steps``,
        ``constraint_steps``,
        ``objective_steps``, ``gamma``, ``optimizer``, ``exact``.

    Raises:
        ValueError: bad options, or fewer batches than the iterations need (says how many); a
            batch tensor that does not hold the examples along ``batch_dim`` (named, by
            :func:`overlap_batch`); a tensor that gets a scale and another Parameter object over
            the same memory (named; a tie is one object:
            :func:`~initlab.methods._alpha.refuse_shared_memory`).
        TypeError: a trainable complex parameter (named; freeze it for the call).
        FloatingPointError: a non-finite loss, or a non-finite alpha-gradient of a finite loss
            (named, with float16 and the float32 copy to use where the model is float16); the
            model is left unchanged.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        >>> batches = [(torch.randn(16, 4), torch.randint(0, 3, (16,))) for _ in range(5)]
        >>> report = gradinit_(net, batches, gamma=10.0)
        >>> len(report.trace), [(r["layer"], r["param"]) for r in report][:3]
        (4, [('0', 'weight'), ('0', 'bias'), ('2', 'weight')])
    """
    start = time.perf_counter()
    what = "gradinit_"
    generator = as_generator(generator)
    optimizer, eta, overlap = _check_common(optimizer, eta, overlap, what)
    dim = check_batch_dim(what, batch_dim)
    check_callback(what, "progress", progress)
    lr, alpha_min, gamma, clip_value = _check_step_options(lr, alpha_min, gamma, clip, what)
    if steps is not None:
        steps = positive_int(what, "steps", steps)
    loss = resolve_loss(loss_fn, what=what)
    # first: what differs by rank raises on every rank; the norms run on batch statistics
    check_same_parameters(model, what, measured_in=lambda m: set_evaluation_modes(m, True))
    _refuse_complex(model, what)
    ts = select_tensors(model, params, nonzero, what)
    refuse_shared_memory(model, ts, what)
    warn_half_precision(ts, what, _SIGNS_FLIP)
    counter = DataCounter(dim)
    pairs = batch_pairs(data, steps, overlap < 1, what, counter, same_size=True)

    run = _GradInitStep(model, loss, ts, eta=eta, optimizer=optimizer, exact=exact, what=what)
    n = len(ts.scaled)
    alpha = torch.ones(n, dtype=torch.float64, device="cpu")
    adam = {"constraint": AlphaAdam.zeros(n, lr), "objective": AlphaAdam.zeros(n, lr)}
    trace: list[dict[str, Any]] = []
    with restore_on_failure(model):
        with evaluation_modes(model, batch_stats=True), kept_heap(bool(keep_heap)):
            for t, (batch, nxt) in enumerate(pairs):
                res = run(alpha, batch, _tilde(batch, nxt, overlap, generator, dim), gamma, t)
                if t == 0 and optimizer == "adam":
                    _warn_gamma_scale(gamma, res.grad_norm, res.grad_norm2)
                grad = res.grad
                if clip_value > 0:
                    grad = grad.clamp(-clip_value, clip_value)
                alpha = adam[res.kind].step(alpha, grad, alpha_min)
                trace.append(_trace_row(t, res, alpha))
                if progress is not None:
                    progress(dict(trace[-1]))
        if not trace:
            raise ValueError(f"{what} ran no step: the data has too few batches")
        fold_alpha(ts, alpha, what)
    kinds = [r["step"] for r in trace]
    return MethodReport(
        alpha_rows(model, ts, alpha),
        GRADINIT_COLUMNS,
        method="gradinit",
        forward_passes=run.forward,
        backward_passes=run.backward,
        wall_s=time.perf_counter() - start,
        trace=Rows(trace, GRADINIT_TRACE_COLUMNS, title="gradinit trace"),
        used=counter.use(),
        info={
            "steps": len(trace),
            "constraint_steps": kinds.count("constraint"),
            "objective_steps": kinds.count("objective"),
            "gamma": gamma,
            "optimizer": optimizer,
            "exact": bool(exact),
            "not_scaled": list(ts.left),
        },
    )


def _check_step_options(
    lr: float, alpha_min: float, gamma: float, clip: float | None, what: str
) -> tuple[float, float, float, float]:
    """``lr``, ``alpha_min``, ``gamma`` and the clip value (0: no clipping), checked."""
    lr = check_number(what, "lr", lr)
    alpha_min = check_number(what, "alpha_min", alpha_min, strict=False)
    gamma = check_number(what, "gamma", gamma, strict=False, finite=False)
    clip_value = (
        0.0 if clip is None else check_number(what, "clip", clip, strict=False, finite=False)
    )
    return lr, alpha_min, gamma, clip_value


def _tilde(
    batch: Any, nxt: Any, overlap: float, generator: torch.Generator | None, batch_dim: int
) -> Callable[[], Any]:
    """``S~`` of one iteration, built only when the step needs it (:func:`overlap_batch`, its
    examples taken along ``batch_dim``)."""

    def tilde() -> Any:
        if nxt is None:
            return batch
        return overlap_batch(batch, nxt, overlap, generator=generator, batch_dim=batch_dim)

    return tilde


def _trace_row(t: int, res: _StepResult, alpha: torch.Tensor) -> dict[str, Any]:
    """One row of the trace (:data:`GRADINIT_TRACE_COLUMNS`)."""
    return {
        "iteration": t,
        "step": res.kind,
        "grad_norm": res.grad_norm,
        "loss": res.loss,
        "objective": res.objective,
        "alpha_min": float(alpha.min()),
        "alpha_max": float(alpha.max()),
    }
