r"""Automatic preconditioning (Defazio & Bottou 2020, §5 and App. E): conditioning multipliers.

* :func:`precondition_` (beyond the paper, which sets the multipliers by hand): measure the GR
  scaling ``gamma_l`` of every layer with the moment probe and choose conditioning multipliers
  ``alpha_l`` (§5) that make all ``gamma_l`` equal, for any architecture; realized as learning
  rates (:func:`preconditioned_param_groups`), a :class:`ConditioningMultiplier`
  parametrization, or an in-place rescaling.
* The paper's closed forms, as checked special cases: :func:`kernel_size_alpha`
  (``alpha^4 k^2 = const``) and :func:`resnet_multipliers` (App. E, re-derived).

Every method changes the model in place (or, where said, not at all), leaves no hooks behind,
restores weights, buffers and train/eval modes if it fails midway (``restore_on_failure``), never
moves the model, and sums its statistics over the ranks of a ``torch.distributed`` job
(:func:`~initlab._core.distributed.all_reduce_sum`), so all ranks end with identical weights (a
probe whose passes fail on some ranks only raises the same
:class:`~initlab._core.distributed.RankMismatchError` on every rank). Forward passes used only for
measuring leave buffers (BatchNorm running statistics) as they were, and run under a forked RNG
(seeded from ``generator`` when given), so dropout masks are reproducible and torch's global RNG
state is untouched.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.nn.utils import parametrize

from initlab._core.attention import with_math_attention
from initlab._core.backward import check_trainable, with_grad
from initlab._core.compiled import takes_compiled
from initlab._core.data import batch_size, data_use, default_forward, output_tensor, take_batches
from initlab._core.distributed import (
    all_reduce_sum,
    check_same_parameters,
    is_distributed,
    run_together,
    same_options,
)
from initlab._core.knobs import (
    check_kwargs,
    errors_named,
    parameter_names,
    renamed_kwargs,
    user_stacklevel,
)
from initlab._core.loss import LossLike, resolve_loss
from initlab._core.method_report import MethodReport
from initlab._core.modules import first_names, refuse_shared_writes
from initlab._core.parametrized import writing_layers
from initlab._core.rng import Seeds
from initlab._core.rows import Rows, join_name
from initlab._core.state import preserved_state, restore_on_failure
from initlab.init._experts import router_experts
from initlab.init._structure import parameter_owners
from initlab.init.registry import Registry, default_registry
from initlab.measure.conditioning import gr_scaling, imbalance, with_multipliers
from initlab.measure.probe import MomentProbe, measure_moments
from initlab.measure.probe.run import probe_options
from initlab.measure.runtime_trace import attention_layers, recording
from initlab.methods._measuring import (
    Forward,
    check_positive,
    keep_buffers,
    kernel_taps,
    rounding_tolerance,
)

__all__ = [
    "PRECONDITION_COLUMNS",
    "ConditioningMultiplier",
    "kernel_size_alpha",
    "precondition_",
    "preconditioned_param_groups",
    "resnet_multipliers",
]


def kernel_size_alpha(
    kernel_size: int | Sequence[int], reference: int | Sequence[int] = 1
) -> float:
    """Conditioning multiplier that corrects a kernel size: ``alpha^4 k^2 = const`` (§5, App. E).

    Under geometric initialization the GR scaling of a convolution in a chain of equal-resolution
    convolutions is proportional to its number of kernel taps ``k^2`` (Remark 6; the other factors
    telescope), so ``alpha = (taps_ref / taps)^(1/4)`` balances it against a layer with the
    reference kernel: ``1 / sqrt(3)`` for a 3x3 convolution among 1x1 ones.

    Example:
        >>> round(kernel_size_alpha(3) * 3**0.5, 12)
        1.0
    """
    return (kernel_taps(reference) / kernel_taps(kernel_size)) ** 0.25


def resnet_multipliers(
    scales: Sequence[float],
    *,
    kernel_first: int = 3,
    kernel_block: int = 3,
    kernel_last: int = 1,
    beta0: float = 1.0,
) -> dict[str, Any]:
    r"""Conditioning multipliers of a ResNet without normalization (App. E, re-derived).

    Blocks ``z_{l+1} = z_l + s_l F_l(z_l)`` whose branch ``F_l`` is a chain of convolutions, each
    with the multiplier ``beta_l`` (times :func:`kernel_size_alpha` inside a bottleneck), preceded
    by a non-residual convolution ``alpha_first C_0`` and followed by a linear layer
    ``alpha_last W`` (every weight's init divided by its multiplier, so the forward pass is that of
    geometric init). Derivation (single channel, no ReLU, as in App. E.1; the branch keeps second
    moments, ``E[F(z)^2] = E[z^2]`` and ``E[(J_F^T v)^2] = E[v^2]``):

    * The stream grows forward and backward by the same factor:
      ``E[z_{l+1}^2] = (1 + s_l^2) E[z_l^2]`` and ``E[dz_l^2] = (1 + s_l^2) E[dz_{l+1}^2]``, so
      ``P = E[z^2] E[dz^2]`` is the same at every block boundary.
    * The rest of the network is homogeneous in ``z``, not in the branch output, so the curvature
      ratio is taken after the addition (App. E.1): for a branch convolution with kernel ``k``,
      ``gamma = (s_l beta_l)^4 k^2 E[x^2]^2 E[dz_{l+1}^2] / E[z_{l+1}^2]
      = (s_l beta_l)^4 k^2 P / (1 + s_l^2)^2``.
    * Equal across blocks iff ``beta_l^2 s_l^2 / (1 + s_l^2)`` is constant:
      ``beta_l = beta_{l-1} (s_{l-1} / s_l) sqrt((1 + s_l^2) / (1 + s_{l-1}^2))``
      (``beta_l = beta_0`` when all ``s_l`` are equal, as the paper says).
    * First convolution (kernel ``k_0``, before block 1 with ``s_1``, ``k_1``):
      ``gamma_0 = alpha^4 k_0^2 E[dy_0^2]`` with ``E[dy_0^2] = (1 + s_1^2) E[dz_1^2]``, so
      ``alpha_first^2 = beta_1^2 s_1^2 k_1 / (k_0 (1 + s_1^2))``.
    * Last layer (kernel ``k_L``, 1 for a linear layer, after the last block with ``s``, ``k``):
      ``alpha_last^2 = beta_L^2 s^2 k / (k_L (1 + s^2))`` (the paper's
      ``alpha^2 = s^2 k / (1 + s^2)`` for ``beta = 1``, ``k_L = 1``).

    Checked against the actual Gauss-Newton blocks of a linear residual net with unequal ``s_l``
    (tests): the blocks' spread drops from thousands to under 3x and the residual blocks agree
    within 1.5x; the first layer comes out at 0.4-0.8x of them, because deeper activations are
    anisotropic (products of random matrices), which the independence assumption A3 ignores.

    Args:
        scales: the block scales ``s_1 .. s_L`` (positive).
        kernel_first: kernel width of the first (non-residual) convolution.
        kernel_block: kernel width the branch convolutions are referred to (the one whose
            multiplier is ``beta_l`` itself).
        kernel_last: kernel width of the last layer (1 for a linear layer).
        beta0: ``beta`` of the first block (free: only ratios matter).

    Returns:
        ``{"alpha_first": float, "beta": [beta_1, ...], "alpha_last": float}``.

    Example:
        >>> m = resnet_multipliers([0.5, 0.5, 0.5], kernel_first=3, kernel_block=3)
        >>> m["beta"], round(m["alpha_first"] ** 2, 6)
        ([1.0, 1.0, 1.0], 0.2)
    """
    s = [check_positive("scale", v) for v in scales]
    if not s:
        raise ValueError("scales must name at least one block")
    beta0 = check_positive("beta0", beta0)
    betas = [beta0]
    for prev, cur in itertools.pairwise(s):
        betas.append(betas[-1] * (prev / cur) * math.sqrt((1 + cur * cur) / (1 + prev * prev)))
    k0, k, k_last = (check_positive("kernel", v) for v in (kernel_first, kernel_block, kernel_last))
    first = math.sqrt(betas[0] ** 2 * s[0] ** 2 * k / (k0 * (1 + s[0] ** 2)))
    last = math.sqrt(betas[-1] ** 2 * s[-1] ** 2 * k / (k_last * (1 + s[-1] ** 2)))
    return {"alpha_first": first, "beta": betas, "alpha_last": last}


# ----------------------------------------------------------------------------- preconditioning


class ConditioningMultiplier(nn.Module):
    """A ``torch.nn.utils.parametrize`` parametrization ``W = alpha * W'`` (§5).

    Registered by :func:`precondition_` with ``how="parametrize"``; ``right_inverse`` stores
    ``W' = W / alpha``, so the module's effective weight (and the forward pass) is unchanged while
    the optimizer trains ``W'``. Remove it with
    ``parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)``.
    """

    def __init__(self, alpha: float) -> None:
        super().__init__()
        self.alpha = float(alpha)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.alpha

    def right_inverse(self, weight: torch.Tensor) -> torch.Tensor:
        return weight / self.alpha

    def extra_repr(self) -> str:
        return f"alpha={self.alpha:.6g}"


PRECONDITION_COLUMNS: tuple[str, ...] = (
    "layer",
    "kind",
    "k2",
    "alpha",
    "lr_scale_sgd",
    "lr_scale_adam",
    "gamma_before",
    "gamma_after",
    "nu_before",
    "nu_after",
    "gamma_b_before",
    "gamma_b_after",
)
"""Columns of the :func:`precondition_` report, one row per weight layer: the multiplier
``alpha`` (1 for layers left alone), the learning-rate factors that realize it with ``how="lr"``
(``alpha^2`` for SGD, ``alpha`` for Adam; see :func:`preconditioned_param_groups`; 1 for the other
``how``, which need no optimizer change), and ``gamma_w``, ``nu_w``,
``gamma_b`` before and after (``alpha^4`` included, see :func:`~initlab.gr_scaling`).
For ``how="rescale"`` ``alpha`` is the equivalent multiplier ``1 / r`` of the in-place rescaling."""

_HOWS = ("lr", "parametrize", "rescale")


def _target_value(target: str | float, gammas: Sequence[float]) -> float:
    if target == "median":
        return statistics.median(gammas)
    if target == "geomean":
        return math.exp(statistics.fmean(math.log(g) for g in gammas))
    if isinstance(target, str):
        raise ValueError(f"unknown target={target!r}; valid: 'median', 'geomean' or a number")
    return check_positive("target", target)


@takes_compiled(collective=True)
@with_grad
@renamed_kwargs(n_batches="max_batches")
@with_math_attention
@same_options
@writing_layers
def precondition_(
    model: nn.Module,
    data: Any,
    loss_fn: LossLike = None,
    *,
    target: str | float | None = None,
    how: Literal["lr", "parametrize", "rescale"] = "lr",
    max_iter: int = 3,
    tol: float = 0.01,
    modules: Sequence[str] | Callable[[str, nn.Module], bool] | None = None,
    forward: Forward | None = None,
    max_batches: int | None = None,
    registry: Registry | None = None,
    generator: torch.Generator | int | None = None,
    **probe_kwargs: Any,
) -> MethodReport:
    r"""Choose conditioning multipliers ``alpha_l`` that make every layer's GR scaling equal.

    The paper sets multipliers by hand for known imbalances (kernel sizes, residual blocks; §5,
    App. E); this measures ``gamma_l`` (:func:`~initlab.gr_scaling`) on ``data`` and
    solves for them, for any architecture: ``gamma_l`` scales as ``alpha_l^4`` and nothing else
    the probe measures changes, so ``alpha_l = (target / gamma_l)^(1/4)`` balances all layers.

    **What a multiplier is, and how it persists without a wrapper.** A multiplier
    ``y = alpha * W' x`` with ``W' = W / alpha`` computes the same function as ``y = W x``; it
    changes the *parametrization* the optimizer sees (the Hessian block of ``W'`` is ``alpha^2``
    times that of ``W``, so its squared singular values, ``gamma``, scale by ``alpha^4``). Nothing
    stored in the model's ``W`` can express that, so the choice is where the parametrization
    lives:

    * ``how="lr"`` (default): the model is **not changed at all** (bit for bit); the report carries
      ``alpha_l`` and the learning-rate factors that realize the reparametrization exactly:
      an SGD step on ``W'`` with rate ``eta`` (momentum, Nesterov and L2 weight decay included)
      is an SGD step on ``W`` with rate ``eta alpha^2`` and weight decay ``lambda / alpha^2``;
      Adam is invariant to the gradient's scale, so there the factor is ``alpha`` (with
      ``eps / alpha``; AdamW's decoupled decay ``lambda / alpha``).
      :func:`preconditioned_param_groups` builds the ``torch.optim`` parameter groups.
    * ``how="parametrize"``: registers a :class:`ConditioningMultiplier` parametrization on each
      changed weight (the paper's literal construction). This *is* a wrapper, left on purpose
      because you asked for it; any optimizer then sees ``W'``.
    * ``how="rescale"``: changes the weights **in place** and leaves nothing behind, using the
      rescaling symmetry of positively homogeneous networks: multiplying layer ``l``'s weight by
      ``r_l`` and its bias by ``C_l = r_1 ... r_l`` (execution order) scales its output by ``C_l``,
      every gradient ``dy_l`` by ``1 / C_l``, and keeps the network function when ``C_L = 1``.
      Then ``gamma_l`` becomes ``gamma_l / r_l^4``: exactly the multiplier ``alpha_l = 1 / r_l``
      for the weights (a bias scaled by ``C_l`` is reparametrized too: an SGD step moves it at
      ``lr / C_l^2`` of the original bias's rate, where ``how="lr"`` and ``"parametrize"`` leave
      biases at the base rate, so the three train alike only without biases; the report's
      ``gamma_b_after`` shows the difference), but with the constraint ``prod r_l = 1``, so the
      common value is the geometric mean
      (``target`` must be ``"geomean"``). Valid for chains of linear/conv layers joined by
      ReLU, pooling, reshapes (MLPs, VGG/AlexNet-style nets without normalization); checked on
      the first batch (the output must not change, ``1e-4`` relative) and refused with a
      ``ValueError`` otherwise (residual additions, normalization layers, biases outside the
      weight layers); use ``how="lr"`` there.

    ``lr`` and ``parametrize`` need one probe (``gamma`` after is ``alpha^4 gamma`` before, exact,
    since the measured moments do not change). ``rescale`` re-probes after each rescaling and
    repeats (up to ``max_iter`` times) while the spread ``max gamma / min gamma`` exceeds
    ``1 + tol``.

    Limits: ``gamma`` is the paper's estimate under its assumptions (A1-A3); inside residual
    branches the measured values differ from App. E's corrected ones (see
    :func:`initlab.gr_scaling`), and layers whose ``gamma`` is not derived (attention, RNNs) keep
    ``alpha = 1``: ``nn.MultiheadAttention``'s fused projection, and the query, key and value
    projections of any other attention implementation (Hugging Face's eager or SDPA code, your
    own), found by a runtime trace of the loss on the first batch (the model called as the loss
    calls it; a trace that fails is said in a ``UserWarning``) and reported with
    ``kind="attention"``;
    a mixture-of-experts router (its logits choose the experts), ``kind="router"``.
    A layer whose weight is shared with another module (a head tied to the input embedding, a
    weight reused by two layers) keeps ``alpha = 1`` too, reported with ``kind="tied"``: one
    tensor cannot take two multipliers, and one given to a single use would change the function.
    A layer whose weight is frozen (``requires_grad=False``) keeps ``alpha = 1``, reported with
    ``kind="frozen"`` (``how="rescale"`` changed it in place). Biases are not given multipliers
    (except the reparametrization ``how="rescale"`` implies, above). A weight it would change that
    is a distinct Parameter over another's memory (not a tie) is refused by name beforehand.

    Args:
        model: the model.
        data: a batch or an iterable of batches.
        loss_fn: the loss in any form :func:`initlab.resolve_loss` reads (``loss_fn(model,
            batch)``, a criterion such as ``nn.CrossEntropyLoss()``, the model's own loss, a
            name; default: the model's own, else cross-entropy or MSE on ``(x, y)``), reducing
            over the batch as a criterion declares (``reduction="sum"``), else by the mean unless
            you pass ``loss_reduction="sum"``.
        target: the common ``gamma``: ``"median"`` (default for ``lr``/``parametrize``: half of
            the layers get larger steps, half smaller), ``"geomean"`` (default and only choice
            for ``rescale``), or a number.
        how: ``"lr"``, ``"parametrize"`` or ``"rescale"`` (see above).
        max_iter: rescaling rounds for ``how="rescale"``.
        tol: stop when ``max/min gamma <= 1 + tol``.
        modules: names of the layers to balance, or a predicate ``(name, module) -> bool``
            (default: every linear/conv layer with a finite ``gamma``); the others keep
            ``alpha = 1`` (for ``rescale`` they still pass the cumulative scale on).
        forward: ``forward(model, batch) -> output`` for the function check of ``rescale``.
        max_batches: use at most this many batches of ``data`` (default all; data without a
            length, a generator or an ``IterableDataset``, up to 1000 batches, and more raise;
            ``n_batches=`` before 0.2).
        registry: the layer registry.
        generator: seeds the measurement passes' RNG (dropout).
        **probe_kwargs: passed to :class:`~initlab.MomentProbe` (``loss_reduction``, ...;
            ``batch_dim``: the report's ``used`` counts the examples along it too).

    Returns:
        :class:`~initlab.MethodReport` with rows :data:`PRECONDITION_COLUMNS`;
        ``info``: ``how``, ``target`` (the common gamma), ``spread_before``, ``spread_after``,
        ``alpha`` (dict name -> alpha), ``iterations``. ``trace`` has one row per probe:
        ``iteration, spread, max, min``.
    """
    start = time.perf_counter()
    check_kwargs(
        "precondition_",
        probe_kwargs,
        probe_options(),
        own=parameter_names(precondition_),
    )
    target, tol = _check_options(how, target, max_iter, tol)
    forward = forward or default_forward
    reg = default_registry() if registry is None else registry
    check_same_parameters(model, "precondition_", modes=True)
    batches = run_together(
        "precondition_",
        lambda: take_batches(data, max_batches, what="precondition_", exact=False, keep_rng=True),
    )
    seeds = Seeds(model, generator)
    loss = resolve_loss(loss_fn, what="precondition_")
    check_trainable(model, "precondition_", "precondition")
    run = _Balancing(model, batches, loss, _selected(model, modules), seeds, reg, probe_kwargs)
    with restore_on_failure(model):
        before = run.probe()
        first = run.log(before, 0)
        run.warn_unmeasured(before)
        gammas = {r["layer"]: r["gamma_w"] for r in run.balanced(before)}
        common = _target_value(target, list(gammas.values()))
        if how in ("lr", "parametrize"):
            alpha = {n: (common / g) ** 0.25 for n, g in gammas.items()}
            after = with_multipliers(before, alpha)
            run.log(after, 1)
            iterations = 1
        else:
            after, alpha, iterations = run.rescale(before, forward, max_iter, tol)
            common = _target_value("geomean", [r["gamma_w"] for r in run.balanced(after)])
        if how == "parametrize":
            _parametrize(model, alpha)
    rows_out = _report_rows(before, after, alpha, how)
    last = run.trace[-1]
    return MethodReport(
        rows_out,
        PRECONDITION_COLUMNS,
        method="precondition_",
        forward_passes=run.forward,
        backward_passes=run.backward,
        wall_s=time.perf_counter() - start,
        trace=Rows(run.trace, ("iteration", "spread", "max", "min"), title="precondition_ trace"),
        used=data_use(batches, probe_kwargs.get("batch_dim") or 0),
        info={
            "how": how,
            "target": common,
            "spread_before": first["spread"],
            "spread_after": last["spread"],
            "iterations": iterations,
            "alpha": alpha,
        },
    )


def _refuse_nonfinite(probe: MomentProbe) -> None:
    """Raise (on every rank) if the probe left out batch-calls that held NaN/inf: the GR scalings
    would silently come from part of the data."""
    counts = {r["layer"]: r["nonfinite"] for r in probe.table() if r["nonfinite"]}
    for r in probe.param_table():
        if r["nonfinite"]:
            counts[r["layer"]] = counts.get(r["layer"], 0.0) + r["nonfinite"]
    total = torch.tensor([float(sum(counts.values()))], dtype=torch.float64, device="cpu")
    all_reduce_sum([total])
    if total.item() > 0:
        where = ", ".join(repr(k) for k in list(counts)[:6]) + (", ..." if len(counts) > 6 else "")
        raise ValueError(
            "precondition_: the forward or backward pass produced non-finite values (NaN or inf) "
            f"{f'at layer(s) {where}' if counts else 'on another rank'}, which the moment probe "
            "leaves out, so the GR scalings would come from part of the data only. Check the "
            "model and the loss on these batches (an overflow, a NaN loss) or leave the batches "
            "out"
        )


def _selected(
    model: nn.Module, modules: Sequence[str] | Callable[[str, nn.Module], bool] | None
) -> list[str] | None:
    """``modules`` as a list of names (a predicate applied to ``model.named_modules()``);
    raises for a name the model does not have."""
    if modules is None:
        return None
    named = dict(model.named_modules())
    if callable(modules):
        return [n for n, m in named.items() if modules(n, m)]
    if isinstance(modules, str) or not all(isinstance(n, str) for n in modules):
        raise TypeError(
            "precondition_: modules must be a sequence of module names or a predicate "
            f"(name, module) -> bool, got {modules!r}"
        )
    names = first_names(model)  # a module's second name is the module too
    unknown = [n for n in modules if n not in names]
    if unknown:
        shown = ", ".join(repr(n) for n in list(named)[1:6])
        raise ValueError(
            f"precondition_: modules names {unknown} are not modules of the model (it has e.g. "
            f"{shown})"
        )
    return [names[n] for n in modules]


def _check_options(
    how: str, target: str | float | None, max_iter: object, tol: float
) -> tuple[str | float, float]:
    """Validate :func:`precondition_`'s options; the target (default filled in) and ``tol``."""
    if how not in _HOWS:
        raise ValueError(f"unknown how={how!r}; valid values: {', '.join(map(repr, _HOWS))}")
    if target is None:
        target = "geomean" if how == "rescale" else "median"
    if how == "rescale" and target != "geomean":
        raise ValueError(
            "how='rescale' keeps the network function, so prod(alpha) = 1 and the common gamma is "
            "the geometric mean: use target='geomean' (or how='lr' for another target)"
        )
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"max_iter must be a positive int, got {max_iter!r}")
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 <= tol < math.inf:
        raise ValueError(
            f"precondition_: tol must be a finite number >= 0 (stop when max/min gamma <= 1 + "
            f"tol), got {tol!r}"
        )
    return target, float(tol)


class _Balancing:
    """The probes of one :func:`precondition_` call: GR scalings, the layers balanced, the trace,
    and the forward/backward passes spent."""

    def __init__(
        self,
        model: nn.Module,
        batches: Sequence[Any],
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        modules: Sequence[str] | None,
        seeds: Seeds,
        registry: Registry,
        probe_kwargs: dict[str, Any],
    ) -> None:
        self.model, self.batches, self.loss_fn = model, batches, loss_fn
        self.modules, self.seeds, self.registry = modules, seeds, registry
        self.probe_kwargs = probe_kwargs
        self.dist = is_distributed()
        self.tied = _shared_weight_layers(model)  # in-place rescaling never changes the ties
        self.frozen = {  # _parameters: reading a parametrized weight would run its forward
            name
            for name, m in model.named_modules()
            if (w := m._parameters.get("weight")) is not None and not w.requires_grad
        }
        self.n_examples: int | None = None
        if probe_kwargs.get("batch_dim") in (None, 0):
            examples = torch.tensor(
                [float(sum(batch_size(b) for b in batches))], dtype=torch.float64, device="cpu"
            )
            all_reduce_sum([examples])
            self.n_examples = int(examples.item())
        self.forward = 0
        self.backward = 0
        self.never: set[str] = set()  # layers the last probe never saw called
        self.trace: list[dict[str, Any]] = []
        self.attention_found: dict[str, str] | None = None

    def probe(self) -> Rows:
        """The GR scaling of every layer (:func:`~initlab.gr_scaling`) from one moment probe;
        the layers that feed attention get ``kind="attention"`` (see :meth:`attention`)."""
        # measure_moments leaves buffers (BN statistics) as they were; local passes: under DDP,
        # one that fails on some ranks raises on all; its errors named by precondition_
        with self.seeds.scope(1), errors_named("precondition_", "measure_moments"):
            p = run_together(
                "precondition_",
                lambda: measure_moments(
                    self.model, self.batches, self.loss_fn, **self.probe_kwargs
                ),
            )
        self.forward += len(self.batches)
        self.backward += len(self.batches)
        _refuse_nonfinite(p)
        self.never = {r["layer"] for r in p.table() if not r["calls"]}
        rows = gr_scaling(
            p, self.model, examples=self.n_examples, registry=self.registry, all_reduce=self.dist
        )
        attention = self.attention()
        routers = {n for n, m in self.model.named_modules() if router_experts(m)}
        out = rows.to_rows()
        for r in out:
            if r["layer"] in self.tied:
                r["kind"] = "tied"
            elif r["layer"] in self.frozen:
                r["kind"] = "frozen"
            elif r["layer"] in attention and r["kind"] == "mlp":
                r["kind"] = "attention"
            elif r["kind"] == "mlp" and r["layer"] in routers:
                r["kind"] = "router"  # its logits choose experts: outside the GR setting
        return Rows(out, rows.columns, title=rows.title, used=rows.used)

    def attention(self) -> dict[str, str]:
        """The query, key and value projections of any attention implementation, found once by
        a runtime trace of the loss on the first batch (the model called as the loss calls it;
        :func:`~initlab.measure.runtime_trace.attention_layers`): the GR formula does not cover
        a product of two activations, so, as ``nn.MultiheadAttention``'s fused projection, they
        keep ``alpha = 1``. A trace that fails is said in a ``UserWarning``."""
        if self.attention_found is None:
            types = {n: type(m).__name__ for n, m in self.model.named_modules()}
            self.forward += 1
            try:
                with (
                    preserved_state(self.model),
                    torch.no_grad(),
                    warnings.catch_warnings(),  # the probe's pass said them already
                    recording(self.model) as graph,
                ):
                    warnings.simplefilter("ignore")
                    self.loss_fn(self.model, self.batches[0])
            except Exception as err:  # the probe ran this loss: say it, do not refuse
                self.attention_found = {}
                _warn_untraced(err)
            else:
                self.attention_found = attention_layers(graph, types)
        return self.attention_found

    def balanced(self, rows: Rows) -> list[dict[str, Any]]:
        """The rows of the layers to balance (linear/conv, finite positive gamma, selected)."""
        modules = self.modules
        keep = [
            r
            for r in rows
            if r["kind"] in ("mlp", "conv")
            and math.isfinite(r["gamma_w"])
            and r["gamma_w"] > 0
            and (modules is None or r["layer"] in modules)
        ]
        if modules is not None:
            missing = sorted(set(modules) - {r["layer"] for r in keep})
            kinds = {r["layer"]: r["kind"] for r in rows}
            fixed = [
                m for m in missing if kinds.get(m) in ("tied", "frozen", "attention", "router")
            ]
            if fixed:
                raise ValueError(
                    f"module(s) {fixed} keep alpha = 1 (kind "
                    f"{sorted({kinds[m] for m in fixed})}: a weight shared with another module, "
                    "a frozen weight, or an attention projection): leave them out of modules="
                )
            if missing:
                raise ValueError(f"no finite gamma for module(s) {missing}: cannot balance them")
        if not keep:
            raise ValueError(_nothing_to_balance(rows))
        return keep

    def warn_unmeasured(self, rows: Rows) -> None:
        """Warn about the linear/conv layers that keep ``alpha = 1`` for want of a finite GR
        scaling (the spread reported leaves them out); with ``modules=``, :meth:`balanced`
        raises instead."""
        # nn.MultiheadAttention runs its out_proj's weight itself: part of its attention row
        inside_mha = {
            join_name(n, "out_proj")
            for n, m in self.model.named_modules()
            if isinstance(m, nn.MultiheadAttention)
        }
        left = [
            r["layer"]
            for r in rows
            if r["kind"] in ("mlp", "conv")
            and not (math.isfinite(r["gamma_w"]) and r["gamma_w"] > 0)
            and r["layer"] not in inside_mha
        ]
        if self.modules is not None or not left:
            return
        never = [n for n in left if n in self.never]
        other = [n for n in left if n not in self.never]
        parts = [
            f"never called on the data: {never} (a weight the model uses directly, as in "
            "F.conv1d(x, layer.weight), is not seen)" if never else "",
            f"zero or non-finite moments: {other}" if other else "",
        ]  # fmt: skip
        warnings.warn(
            f"precondition_: {len(left)} linear/conv layer(s) keep alpha = 1 with no finite GR "
            f"scaling to balance, and the spread reported leaves them out: "
            f"{'; '.join(p for p in parts if p)}",
            UserWarning,
            stacklevel=user_stacklevel(),
        )

    def log(self, rows: Rows, iteration: int) -> dict[str, Any]:
        """Append the spread of ``rows`` to the trace; returns :func:`~initlab.imbalance`."""
        imb = imbalance(self.balanced(rows))
        self.trace.append(
            {"iteration": iteration, "spread": imb["spread"], "max": imb["max"], "min": imb["min"]}
        )
        return imb

    def rescale(
        self, before: Rows, forward: Forward, max_iter: int, tol: float
    ) -> tuple[Rows, dict[str, float], int]:
        """``how="rescale"``: rescale in place and re-probe until the spread is within ``tol``.

        Returns the last probe's rows, the equivalent multipliers and the rounds done.
        """
        alpha: dict[str, float] = {}
        iterations = 0
        rows = before
        for it in range(1, max_iter + 1):
            if imbalance(self.balanced(rows))["spread"] <= 1 + tol:
                break
            current = {r["layer"]: r["gamma_w"] for r in self.balanced(rows)}
            geo = _target_value("geomean", list(current.values()))
            ratios = {n: (g / geo) ** 0.25 for n, g in current.items()}
            called = [r["layer"] for r in rows if math.isfinite(r["E_x2"])]
            _rescale_(self.model, called, ratios, self.batches, forward, self.seeds, self.registry)
            self.forward += 2
            for n, r in ratios.items():
                alpha[n] = alpha.get(n, 1.0) / r
            rows = self.probe()
            self.log(rows, it)
            iterations = it
        return rows, alpha, iterations


def _nothing_to_balance(rows: Rows) -> str:
    """Why no layer can be balanced, from the kinds of ``rows``."""
    kinds: dict[str, int] = {}
    for r in rows:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    said = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    text = (
        f"precondition_: no linear/conv layer with a finite GR scaling to balance (the model's "
        f"{len(rows)} measured module(s) by kind: {said or 'none'})"
    )
    if kinds.get("frozen"):
        text += "; frozen layers (requires_grad=False) keep alpha = 1"
    if kinds.get("unclaimed"):
        text += (
            "; an unclaimed module's own raw parameters (a LoRA adapter's A and B, say) are not "
            "a layer it can scale: register a handler for it (initlab.register_handler)"
        )
    return text


def _warn_untraced(err: Exception) -> None:
    """Warn that the trace finding attention projections failed with ``err``."""
    first = (str(err).splitlines() or [""])[0][:200]
    warnings.warn(
        f"precondition_: the runtime trace that finds attention projections failed "
        f"({type(err).__name__}: {first}); a query, key or value projection, if the model has "
        "one, is balanced like any linear layer instead of keeping alpha = 1: leave such layers "
        "out with modules=",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def _shared_weight_layers(model: nn.Module) -> set[str]:
    """The names of modules holding a parameter that another module holds too (tied weights; one
    module registered under two names is one module)."""
    return {
        name
        for owners in parameter_owners(model).values()
        if len({id(m) for _, _, m in owners}) > 1
        for name, _, _ in owners
    }


_SHARED_EFFECT = {  # what each writing how would do to two Parameters over one memory
    "rescale": "how='rescale' would multiply that memory in place by both layers' factors",
    "parametrize": "how='parametrize' would store each W / alpha apart, silently untying them",
}


def _rescale_(
    model: nn.Module,
    order: Sequence[str],
    ratios: Mapping[str, float],
    batches: Sequence[Any],
    forward: Forward,
    seeds: Seeds,
    registry: Registry,
) -> None:
    """Multiply weight ``l`` by ``r_l`` and bias ``l`` by ``C_l`` (execution order); check the
    function is unchanged on the first batch. A frozen tensor (``requires_grad=False``) that
    would change is refused before anything changes."""
    modules = dict(model.named_modules())
    factors: list[tuple[str, torch.Tensor, float]] = []
    cumulative = 1.0
    for name in order:
        r = ratios.get(name, 1.0)
        cumulative *= r
        for spec in registry.specs(modules[name], name) or []:
            if spec.role in ("weight", "bias"):
                factor = r if spec.role == "weight" else cumulative
                tensor = getattr(modules[name], spec.name)
                factors.append((join_name(name, spec.name), tensor, factor))
    frozen = [n for n, t, f in factors if f != 1.0 and not t.requires_grad]
    if frozen:
        raise ValueError(
            f"how='rescale' would change the frozen tensor(s) {frozen} (requires_grad=False: the "
            "rescaled chain multiplies every later bias); use how='lr' or how='parametrize', or "
            "unfreeze them"
        )
    written = [t for _, t, f in factors if f != 1.0]
    refuse_shared_writes("precondition_", model, written, _SHARED_EFFECT["rescale"])
    with torch.no_grad(), keep_buffers(model), seeds.scope(2):
        before = output_tensor(forward(model, batches[0])).detach().to(torch.float64)
    with torch.no_grad():
        for _, t, factor in factors:
            t.mul_(factor)
    with torch.no_grad(), keep_buffers(model), seeds.scope(2):
        out = output_tensor(forward(model, batches[0])).detach()
    after = out.to(torch.float64)
    err = (after - before).norm() / before.norm().clamp_min(1e-300)
    bad = torch.tensor(
        [float(err > rounding_tolerance(out, 1e-4))], dtype=torch.float64, device="cpu"
    )
    all_reduce_sum([bad])
    if bad.item() > 0:
        raise ValueError(
            f"how='rescale' changed the network function (relative change {err.item():.2e}): the "
            "weight layers do not form a positively homogeneous chain (residual additions, "
            "normalization layers or biases outside them); use how='lr' or how='parametrize'"
        )


def _parametrize(model: nn.Module, alpha: Mapping[str, float]) -> None:
    """``W = alpha W'`` on each weight with ``alpha != 1`` (none over another's memory)."""
    modules = dict(model.named_modules())
    written = [modules[name].weight for name, a in alpha.items() if a != 1.0]
    refuse_shared_writes("precondition_", model, written, _SHARED_EFFECT["parametrize"])
    done: list[nn.Module] = []
    try:
        for name, a in alpha.items():
            if a == 1.0:
                continue
            parametrize.register_parametrization(modules[name], "weight", ConditioningMultiplier(a))
            done.append(modules[name])
    except BaseException:
        for module in done:
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
        raise


def _report_rows(
    before: Rows, after: Rows, alpha: Mapping[str, float], how: str
) -> list[dict[str, Any]]:
    after_by = {r["layer"]: r for r in after}
    out = []
    for r in before:
        a = float(alpha.get(r["layer"], 1.0))
        lr_a = a if how == "lr" else 1.0  # parametrize/rescale: the optimizer needs no change
        b = after_by.get(r["layer"], r)
        out.append(
            {
                "layer": r["layer"],
                "kind": r["kind"],
                "k2": r["k2"],
                "alpha": a,
                "lr_scale_sgd": lr_a * lr_a,
                "lr_scale_adam": lr_a,
                "gamma_before": r["gamma_w"],
                "gamma_after": b["gamma_w"],
                "nu_before": r["nu_w"],
                "nu_after": b["nu_w"],
                "gamma_b_before": r["gamma_b"],
                "gamma_b_after": b["gamma_b"],
            }
        )
    return out


@takes_compiled(scripted=True)
def preconditioned_param_groups(
    model: nn.Module,
    alpha: Mapping[str, float] | MethodReport,
    *,
    lr: float,
    optimizer: Literal["sgd", "adam", "adamw"] = "sgd",
    weight_decay: float = 0.0,
    eps: float | None = None,
) -> list[dict[str, Any]]:
    r"""``torch.optim`` parameter groups that train ``model`` as if its weights had multipliers.

    Training ``W' = W / alpha`` inside ``y = alpha W' x`` (what :func:`precondition_` chooses) is
    the same as training ``W`` with per-group hyper-parameters, which is how ``how="lr"`` needs no
    wrapper. Derivation (``g`` the gradient w.r.t. ``W``; then ``g' = alpha g``):

    * SGD (momentum ``mu``, dampening, Nesterov, L2 ``lambda``): the step direction on ``W'`` is
      ``d' = alpha g + lambda W / alpha = alpha (g + (lambda / alpha^2) W)``, the momentum buffer is
      ``alpha`` times that of ``W`` with decay ``lambda / alpha^2``, and ``W = alpha W'`` moves by
      ``alpha`` times the ``W'`` step: **lr ``eta alpha^2``, weight_decay ``lambda / alpha^2``**.
    * Adam (L2 in the gradient): ``m' = alpha m``, ``v' = alpha^2 v`` so
      ``m'/(sqrt(v') + eps) = m/(sqrt(v) + eps/alpha)``: **lr ``eta alpha``, weight_decay
      ``lambda / alpha^2``, eps ``eps / alpha``**.
    * AdamW (decoupled decay ``W' <- W'(1 - eta lambda)``): **lr ``eta alpha``, weight_decay
      ``lambda / alpha``, eps ``eps / alpha``**.

    These are exact (tests check one optimizer against the other step by step), except that
    without ``eps=`` the Adam groups keep the optimizer's default ``eps`` (a difference only where
    ``sqrt(v)`` is as small as ``eps``).

    Args:
        model: the model (unchanged).
        alpha: multipliers per module name, or the report of :func:`precondition_` with
            ``how="lr"``.
        lr: the base learning rate ``eta``.
        optimizer: ``"sgd"``, ``"adam"`` or ``"adamw"`` (which rule above).
        weight_decay: the base ``lambda``.
        eps: the optimizer's ``eps`` (Adam/AdamW); when given each group gets ``eps / alpha``.

    Returns:
        One group per weight with ``alpha != 1`` (``{"params": [w], "lr": ..., "weight_decay":
        ...}``, plus ``"eps"``) and one group with every other parameter at the base values.
    """
    if optimizer not in ("sgd", "adam", "adamw"):
        raise ValueError(f"unknown optimizer={optimizer!r}; valid: 'sgd', 'adam', 'adamw'")
    if isinstance(alpha, MethodReport):
        if alpha.info.get("how") != "lr":
            raise ValueError(
                f"this report is for how={alpha.info.get('how')!r}: the model already carries the "
                "multipliers (parametrize) or was rescaled, so the optimizer needs no change; "
                "parameter groups are for how='lr'"
            )
        alpha = alpha.info["alpha"]
    modules, names = dict(model.named_modules()), first_names(model)
    groups: list[dict[str, Any]] = []
    taken: set[int] = set()
    for name, a in alpha.items():
        if name not in names:
            raise ValueError(f"model has no module named {name!r}")
        name = names[name]  # a module's second name is the module too
        a = check_positive("alpha", a)
        if a == 1.0:
            continue
        w = modules[name].weight
        if id(w) in taken:
            continue
        taken.add(id(w))
        if optimizer == "sgd":
            group = {"params": [w], "lr": lr * a * a, "weight_decay": weight_decay / (a * a)}
        else:
            wd = weight_decay / (a * a) if optimizer == "adam" else weight_decay / a
            group = {"params": [w], "lr": lr * a, "weight_decay": wd}
            if eps is not None:
                group["eps"] = eps / a
        groups.append(group)
    rest = []
    for p in model.parameters():
        if id(p) not in taken:
            taken.add(id(p))
            rest.append(p)
    if rest:
        group = {"params": rest, "lr": lr, "weight_decay": weight_decay}
        if eps is not None and optimizer != "sgd":
            group["eps"] = eps
        groups.append(group)
    return groups
