"""Train many small models at once: :func:`train_runs` (vectorized), :func:`train_one` (reference).

:func:`train_one` is a plain PyTorch loop (``nn.Module``, ``torch.optim.SGD``/``Adam``) and defines
what a run *is*. :func:`train_runs` trains ``R`` runs of one group (:meth:`RunConfig.group_key`)
together, with their parameters stacked along a leading run dimension, and gives the same numbers
up to float rounding. Per run and in both trainers:

1. **Model.** ``model = model_factory(config).to(dtype)``, then ``init_model(model,
   config.scheme, generator=torch.Generator().manual_seed(config.seed))`` (``measure=False``: the
   report's statistics are skipped, the draws are the same), then ``.to(device)``.
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
5. **Evaluation** after every epoch: full passes (in chunks, no gradient, ``model.eval()``) over the
   training split and, if given, the test split: mean cross-entropy and accuracy.
6. **Divergence.** The first non-finite training loss (a step loss or an epoch's train loss) marks
   the run ``diverged`` and freezes it: no further updates; later step losses and epoch metrics are
   ``nan``; ``final_train_loss`` is ``nan``. In :func:`train_runs` its stacked parameters and
   optimizer state are zeroed from then on (the frozen values are kept aside for ``keep_state``),
   so nothing non-finite reaches the shared tensors and the other runs are unaffected.

Vectorization. A :class:`~initlab.zoo.paper_mlp.PaperMLP`, or an ``nn.Sequential`` of ``Linear``,
``ReLU`` and ``Identity`` (optionally led by a ``LayerNorm`` without affine parameters), runs on an
explicit engine (:class:`_MLPEngine`): weights stacked as ``(R, in, out)``, ``torch.baddbmm`` per
layer, a hand-written backward whose weight-gradient GEMM SGD accumulates straight into its
momentum buffer, and the fixed input LayerNorm applied once to the whole data set instead of per
batch. Any other model runs through ``torch.func.stack_module_state`` + ``vmap(functional_call)``
and autograd (deterministic models whose forward does not update buffers: no dropout, no
BatchNorm in training mode). Each step gathers an ``(R, B, d)`` batch with every run's own row
indices. Per-run learning rate, momentum and weight decay are ``(R,)`` tensors broadcast over the
stacks (scalars where the whole group shares the value).
"""

from __future__ import annotations

import copy
import hashlib
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from initlab.study.config import RunConfig, RunResult

__all__ = ["ENGINES", "epoch_order", "train_one", "train_runs"]

#: ``engine=`` values of :func:`train_runs`.
ENGINES = ("auto", "mlp", "vmap")

_ADAM_BETAS = (0.9, 0.999)
_ADAM_EPS = 1e-8
#: Rows x runs per evaluation chunk in :func:`train_runs` (bounds the activation memory).
_EVAL_ELEMENTS = 1 << 13
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
    return torch.randperm(n, generator=generator)


def _build_model(
    config: RunConfig, model_factory: ModelFactory, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """Step 1 of the module docstring: build, cast, initialize with the run's seed, move."""
    from initlab.init.model import init_model  # imported late: keeps `initlab.study` light

    model = model_factory(config).to(dtype=dtype)
    init_model(
        model, config.scheme, generator=torch.Generator().manual_seed(config.seed), measure=False
    )
    return model.to(device)


def _scale_from_std(std: Tensor, target: Tensor) -> Tensor:
    """``target / std`` where ``std > 0``, else 1 (also for a ``nan`` std)."""
    return torch.where(std > 0, target / std, torch.ones_like(std))


def _has_scale_buffer(model: nn.Module) -> bool:
    buf = getattr(model, "output_scale", None)
    return isinstance(buf, Tensor) and buf.numel() == 1 and any(b is buf for b in model.buffers())


def _prepare(split: Split, device: torch.device, dtype: torch.dtype, name: str) -> Split:
    x, y = split
    if x.ndim < 2 or y.ndim != 1 or x.shape[0] != y.shape[0]:
        raise ValueError(
            f"{name} must be (x: (n, ...), y: (n,)), got shapes {tuple(x.shape)} and "
            f"{tuple(y.shape)}"
        )
    if x.shape[0] == 0:
        raise ValueError(f"{name} split is empty")
    return x.to(device=device, dtype=dtype), y.to(device=device, dtype=torch.long)


def _check_group(configs: Sequence[RunConfig]) -> None:
    keys = {c.group_key() for c in configs}
    if len(keys) > 1:
        raise ValueError(
            "train_runs needs configs that share RunConfig.group_key() (dataset, model, "
            f"model_cfg, optimizer, epochs, batch_size); got {len(keys)} groups, e.g. "
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


@torch.enable_grad()
def train_one(
    config: RunConfig,
    train: Split,
    test: Split | None = None,
    *,
    model_factory: ModelFactory,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    keep_state: bool = False,
) -> RunResult:
    """Train one run in a plain PyTorch loop: the reference that :func:`train_runs` must match.

    Follows steps 1-6 of the module docstring with an ``nn.Module`` and ``torch.optim``.

    Args:
        config: the run.
        train: ``(x, y)`` training split: ``x`` is ``(n, ...)``, ``y`` class indices ``(n,)``.
        test: optional test split, evaluated after every epoch.
        model_factory: builds the (uninitialized) model for a config.
        device: where to train.
        dtype: floating dtype of the model and the inputs (``torch.float64`` for exact checks).
        keep_state: store the final ``state_dict`` in :attr:`RunResult.state` (see
            :func:`train_runs` for models without an ``output_scale`` buffer).
    """
    start = time.perf_counter()
    device = torch.device(device)
    x, y = _prepare(train, device, dtype, "train")
    test_xy = _prepare(test, device, dtype, "test") if test is not None else None
    model = _build_model(config, model_factory, dtype, device)
    optimizer = _torch_optimizer(config, model.parameters())
    use_buffer = _has_scale_buffer(model)
    mult: float | Tensor = 1.0  # logit multiplier for models without an ``output_scale`` buffer
    n, bs = x.shape[0], config.batch_size
    steps = math.ceil(n / bs)
    step_loss: list[float] = []
    train_metrics: list[tuple[float, float]] = []
    test_metrics: list[tuple[float, float]] = []
    diverged = False
    for epoch in range(config.epochs):
        if not diverged:
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
                if math.isfinite(value):
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
        if diverged:  # diverged during this epoch's steps or earlier: frozen, not evaluated
            train_metrics.append((math.nan, math.nan))
            if test_xy is not None:
                test_metrics.append((math.nan, math.nan))
            continue
        train_metrics.append(_evaluate_one(model, mult, x, y))
        if test_xy is not None:
            test_metrics.append(_evaluate_one(model, mult, *test_xy))
        if not math.isfinite(train_metrics[-1][0]):
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


# ---------------------------------------------------------------------------------------------
# Vectorized optimizers (torch.optim semantics, per-run hyperparameters)
# ---------------------------------------------------------------------------------------------


def _per_run(values: Tensor, like: Tensor) -> Tensor:
    """View an ``(R,)`` tensor so it broadcasts against ``like: (R, ...)``."""
    return values.view(-1, *([1] * (like.ndim - 1)))


def _uniform(values: list[float]) -> float | None:
    """The common value of a per-run hyperparameter, or ``None`` if the runs differ."""
    return values[0] if all(v == values[0] for v in values) else None


class _VecOptimizer:
    """An optimizer over stacked parameters ``(R, ...)`` with per-run hyperparameters.

    Per step: :meth:`begin_step`, then :meth:`update` once per parameter, given either its
    gradient or, for a weight, the two ``bmm`` operands of its gradient (so SGD can accumulate the
    product straight into its momentum buffer with ``baddbmm_``). A run whose ``alive`` flag is
    off gets a zero learning rate.
    """

    def __init__(self, params: list[Tensor], configs: Sequence[RunConfig]) -> None:
        self.params = params
        self._like = params[0]
        self._lr = torch.tensor([c.lr for c in configs], dtype=torch.float64)
        self._alive = torch.ones(len(configs), dtype=torch.bool)
        wds = [c.weight_decay for c in configs]
        self._wd_scalar = _uniform(wds)
        self._wd = [_per_run(self._tensor(wds), p) for p in params]

    def _tensor(self, values: Any) -> Tensor:
        return torch.as_tensor(values, dtype=self._like.dtype).to(self._like.device)

    def set_alive(self, alive: Tensor) -> None:
        """Runs with ``alive[r]`` off are frozen (zero learning rate) from now on."""
        self._alive = alive.clone()

    def _weight_decay(self, i: int, g: Tensor) -> None:
        """``g += weight_decay * param`` in place (torch.optim's coupled weight decay)."""
        if self._wd_scalar is None:
            g.addcmul_(self.params[i], self._wd[i])
        elif self._wd_scalar != 0:
            g.add_(self.params[i], alpha=self._wd_scalar)

    def state_tensors(self) -> list[Tensor]:
        """Per-parameter state stacks (zeroed for a run that diverges)."""
        return []

    def begin_step(self) -> None:
        raise NotImplementedError

    def update(
        self, i: int, grad: Tensor | None = None, gemm: tuple[Tensor, Tensor] | None = None
    ) -> None:
        raise NotImplementedError


class _VecSGD(_VecOptimizer):
    """``torch.optim.SGD(lr, momentum, dampening=0, nesterov=False, weight_decay)`` per run.

    Update, per run: ``buf = momentum * buf + grad + weight_decay * param``; ``param -= lr * buf``.
    With ``buf`` starting at zero this is torch's first step (``buf = grad + wd * param``) and its
    momentum-free path (``momentum = 0``); only the rounding order differs.
    """

    def __init__(self, params: list[Tensor], configs: Sequence[RunConfig]) -> None:
        super().__init__(params, configs)
        moms = [c.momentum for c in configs]
        self._mom_scalar = _uniform(moms)
        self._mom = [_per_run(self._tensor(moms), p) for p in params]
        self._bufs = [torch.zeros_like(p, requires_grad=False) for p in params]
        self._neg_lr: list[Tensor] = []

    def state_tensors(self) -> list[Tensor]:
        return self._bufs

    def begin_step(self) -> None:
        neg_lr = self._tensor(-self._lr * self._alive)
        self._neg_lr = [_per_run(neg_lr, p) for p in self.params]

    @torch.no_grad()
    def update(
        self, i: int, grad: Tensor | None = None, gemm: tuple[Tensor, Tensor] | None = None
    ) -> None:
        buf = self._bufs[i]
        if self._mom_scalar is None:
            buf.mul_(self._mom[i])
        if gemm is not None:
            # buf = momentum * buf + A @ B in one GEMM (beta = 0 ignores buf entirely)
            buf.baddbmm_(*gemm, beta=1.0 if self._mom_scalar is None else self._mom_scalar)
        else:
            assert grad is not None
            if self._mom_scalar is not None:
                buf.mul_(self._mom_scalar)
            buf.add_(grad)
        self._weight_decay(i, buf)
        self.params[i].addcmul_(buf, self._neg_lr[i])


class _VecAdam(_VecOptimizer):
    """``torch.optim.Adam(lr, betas=(0.9, 0.999), eps=1e-8, weight_decay)`` per run.

    ``m = lerp(m, g, 1 - beta1)``; ``v = beta2 * v + (1 - beta2) * g²``;
    ``param -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)``, as torch's
    single-tensor implementation computes it.
    """

    def __init__(self, params: list[Tensor], configs: Sequence[RunConfig]) -> None:
        super().__init__(params, configs)
        self._m = [torch.zeros_like(p, requires_grad=False) for p in params]
        self._v = [torch.zeros_like(p, requires_grad=False) for p in params]
        self._tmp = [torch.empty_like(p, requires_grad=False) for p in params]  # scratch
        self._t = 0
        self._bc2_sqrt = 1.0
        self._step_size: list[Tensor] = []

    def state_tensors(self) -> list[Tensor]:
        return self._m + self._v

    def begin_step(self) -> None:
        beta1, beta2 = _ADAM_BETAS
        self._t += 1
        self._bc2_sqrt = (1 - beta2**self._t) ** 0.5
        # torch: step_size = lr / bias_correction1 in Python floats, then used as a scalar
        step_size = self._tensor(self._lr / (1 - beta1**self._t) * self._alive)
        self._step_size = [_per_run(step_size, p) for p in self.params]

    @torch.no_grad()
    def update(
        self, i: int, grad: Tensor | None = None, gemm: tuple[Tensor, Tensor] | None = None
    ) -> None:
        beta1, beta2 = _ADAM_BETAS
        g = torch.bmm(*gemm, out=self._tmp[i]) if gemm is not None else grad
        assert g is not None
        self._weight_decay(i, g)
        m, v, tmp = self._m[i], self._v[i], self._tmp[i]
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        # g (possibly in tmp) is not needed any more
        denom = torch.sqrt(v, out=tmp).div_(self._bc2_sqrt).add_(_ADAM_EPS)
        update = torch.div(m, denom, out=tmp).mul_(self._step_size[i])
        self.params[i].sub_(update)


# ---------------------------------------------------------------------------------------------
# Vectorized engines: a stack of R models as tensors with a leading run dimension
# ---------------------------------------------------------------------------------------------


class _Engine:
    """R models of one architecture as stacked tensors ``params`` (each ``(R, ...)``)."""

    params: list[Tensor]

    def preprocess(self, x: Tensor) -> Tensor:
        """Per-row input transform applied once to a whole split (identity by default)."""
        return x

    def train(self, mode: bool) -> None:
        """Switch train/eval mode where the engine has one."""

    def forward(self, x: Tensor, *, train: bool) -> Tensor:
        """Raw logits ``(R, B, C)`` of ``x: (R, B, ...)``; ``train`` keeps what backward needs."""
        raise NotImplementedError

    def backward_step(self, dlogits: Tensor, opt: _VecOptimizer, frozen_now: list[int]) -> None:
        """Back-propagate ``dlogits`` (the gradient w.r.t. the last training forward's output)
        and apply ``opt`` to every parameter. ``frozen_now``: runs that diverged at this step
        (their cached values are zeroed so their gradients are exactly zero)."""
        raise NotImplementedError

    def write_back(self, models: Sequence[nn.Module], values: Sequence[list[Tensor]]) -> None:
        """Copy each run's values (in ``params`` order, without the run dim) into its model."""
        raise NotImplementedError


def _mlp_modules(model: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """The layer list of a model the explicit MLP engine can run, else ``None``.

    Accepted: :class:`~initlab.zoo.paper_mlp.PaperMLP` and ``nn.Sequential``, made of ``Linear``,
    ``ReLU``, ``Identity`` and, as the very first layer only, a ``LayerNorm`` over the last
    dimension without affine parameters.
    """
    from initlab.zoo.paper_mlp import PaperMLP

    if type(model) is PaperMLP:
        mods: list[tuple[str, nn.Module]] = []
        if model.input_norm is not None:
            mods.append(("input_norm", model.input_norm))
        mods += [(f"layers.{name}", m) for name, m in model.layers.named_children()]
    elif type(model) is nn.Sequential:
        mods = list(model.named_children())
    else:
        return None
    for i, (_, m) in enumerate(mods):
        if type(m) in (nn.Linear, nn.ReLU, nn.Identity):
            continue
        if (
            type(m) is nn.LayerNorm
            and i == 0
            and len(m.normalized_shape) == 1
            and m.weight is None
            and m.bias is None
        ):
            continue
        return None
    if not any(type(m) is nn.Linear for _, m in mods):
        return None
    return mods


class _MLPEngine(_Engine):
    """Explicit batched-matmul engine with a hand-written backward, for Linear/ReLU chains.

    A linear layer is stacked as ``wt: (R, in, out)`` (transposed weights, so the forward
    ``baddbmm(b, h, wt)`` and the weight gradient ``h^T @ dy`` are batched GEMMs without copies)
    and ``b: (R, 1, out)``. Backward per linear layer: ``dh = dy @ wt^T`` (before the update),
    then the optimizer consumes ``(h^T, dy)`` (SGD accumulates the product into its momentum
    buffer with ``baddbmm_``) and ``db = dy.sum(1)``; ReLU backward is ``threshold_backward``
    on the saved output. The leading LayerNorm without affine parameters is a fixed per-row
    transform, applied once per split in :meth:`preprocess`.
    """

    def __init__(self, models: Sequence[nn.Module], mods: list[tuple[str, nn.Module]]) -> None:
        self.params = []
        self._names: list[tuple[str, bool]] = []  # (parameter name, stored transposed)
        self._ops: list[tuple[str, int, int | None]] = []  # ("linear", w, b) | ("relu", -1, None)
        self._pre: tuple[tuple[int, ...], float] | None = None
        self._saved: list[Tensor] = []  # the input of every op, from the last training forward
        per_model = [dict(m.named_modules()) for m in models]

        def stack(qualname: str, attr: str, transpose: bool) -> int:
            ts = [getattr(pm[qualname], attr).detach() for pm in per_model]
            t = torch.stack([w.t() if transpose else w.unsqueeze(0) for w in ts]).contiguous()
            self.params.append(t)
            self._names.append((f"{qualname}.{attr}", transpose))
            return len(self.params) - 1

        for qual, m in mods:
            if isinstance(m, nn.LayerNorm):
                self._pre = (tuple(m.normalized_shape), float(m.eps))
            elif isinstance(m, nn.Linear):
                w = stack(qual, "weight", True)
                b = stack(qual, "bias", False) if m.bias is not None else None
                self._ops.append(("linear", w, b))
            elif isinstance(m, nn.ReLU):
                self._ops.append(("relu", -1, None))
        self._first_linear = next(i for i, op in enumerate(self._ops) if op[0] == "linear")

    def preprocess(self, x: Tensor) -> Tensor:
        if self._pre is None:
            return x
        return F.layer_norm(x, self._pre[0], eps=self._pre[1])

    @torch.no_grad()
    def forward(self, x: Tensor, *, train: bool) -> Tensor:
        p = self.params
        saved: list[Tensor] = []
        h = x
        fresh = False  # h is a tensor this forward created (safe to modify in place)
        for kind, w, b in self._ops:
            saved.append(h)
            if kind == "linear":
                h = torch.bmm(h, p[w]) if b is None else torch.baddbmm(p[b], h, p[w])
                fresh = True
            else:
                h = h.relu_() if fresh else torch.relu(h)
                fresh = True
        if train:
            self._saved = saved
        return h

    @torch.no_grad()
    def backward_step(self, dlogits: Tensor, opt: _VecOptimizer, frozen_now: list[int]) -> None:
        for t in self._saved:
            for r in frozen_now:
                t[r] = 0
        opt.begin_step()
        grad = dlogits
        for j in range(len(self._ops) - 1, self._first_linear - 1, -1):
            kind, w, b = self._ops[j]
            inp = self._saved[j]
            if kind == "relu":
                # the op's output is the next op's saved input, or the logits for a last ReLU
                out = self._saved[j + 1] if j + 1 < len(self._saved) else inp.relu()
                grad = torch.ops.aten.threshold_backward(grad, out, 0.0)
                continue
            wt = self.params[w]
            grad_in = torch.bmm(grad, wt.transpose(1, 2)) if j > self._first_linear else None
            opt.update(w, gemm=(inp.transpose(1, 2), grad))
            if b is not None:
                opt.update(b, grad=grad.sum(dim=1, keepdim=True))
            if grad_in is not None:
                grad = grad_in
        self._saved = []

    def write_back(self, models: Sequence[nn.Module], values: Sequence[list[Tensor]]) -> None:
        with torch.no_grad():
            for model, vals in zip(models, values, strict=True):
                named = dict(model.named_parameters())
                for (name, transposed), v in zip(self._names, vals, strict=True):
                    target = named[name]
                    target.copy_((v.t() if transposed else v).reshape(target.shape))


class _VmapEngine(_Engine):
    """Generic engine: ``stack_module_state`` + ``vmap(functional_call)`` and autograd."""

    def __init__(self, models: Sequence[nn.Module]) -> None:
        params, buffers = torch.func.stack_module_state(list(models))
        self._names = list(params)
        self.params = [params[n].detach().requires_grad_(True) for n in self._names]
        self._buffers = buffers
        self._base = copy.deepcopy(models[0]).to("meta")
        self._out: Tensor | None = None

        def call(ps: tuple[Tensor, ...], bs: dict[str, Tensor], x: Tensor) -> Tensor:
            return torch.func.functional_call(
                self._base, ({**dict(zip(self._names, ps, strict=True)), **bs}), (x,)
            )

        self._call = torch.func.vmap(call, in_dims=(0, 0, 0))

    def train(self, mode: bool) -> None:
        self._base.train(mode)

    def forward(self, x: Tensor, *, train: bool) -> Tensor:
        if not train:
            with torch.no_grad():
                return self._call(tuple(self.params), self._buffers, x)
        with torch.enable_grad():
            self._out = self._call(tuple(self.params), self._buffers, x)
        return self._out.detach()

    def backward_step(self, dlogits: Tensor, opt: _VecOptimizer, frozen_now: list[int]) -> None:
        assert self._out is not None
        grads = torch.autograd.grad(self._out, self.params, grad_outputs=dlogits)
        self._out = None
        with torch.no_grad():
            for g in grads:
                for r in frozen_now:
                    g[r] = 0
        opt.begin_step()
        for i, g in enumerate(grads):
            opt.update(i, grad=g)

    def write_back(self, models: Sequence[nn.Module], values: Sequence[list[Tensor]]) -> None:
        with torch.no_grad():
            for model, vals in zip(models, values, strict=True):
                named = dict(model.named_parameters())
                for name, v in zip(self._names, vals, strict=True):
                    named[name].copy_(v)


# ---------------------------------------------------------------------------------------------
# The vectorized trainer
# ---------------------------------------------------------------------------------------------


def _cross_entropy_and_grad(logits: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """Per-run mean cross-entropy ``(R,)`` of logits ``(R, B, C)`` and its gradient
    ``(softmax - onehot) / B`` w.r.t. the logits."""
    b = logits.shape[1]
    idx = y.unsqueeze(2)
    lse = torch.logsumexp(logits, dim=2, keepdim=True)
    loss = (lse - logits.gather(2, idx)).squeeze(2).mean(dim=1)
    grad = torch.sub(logits, lse).exp_()
    grad.scatter_add_(2, idx, torch.full_like(idx, -1, dtype=grad.dtype))
    return loss, grad.div_(b)


@torch.no_grad()
def _evaluate_runs(
    eng: _Engine, scale: Tensor, x: Tensor, y: Tensor, n_runs: int
) -> tuple[Tensor, Tensor]:
    """Mean cross-entropy and accuracy of every run on a whole split, as ``(R,)`` float64."""
    loss_sum = torch.zeros(n_runs, dtype=torch.float64)
    correct = torch.zeros(n_runs, dtype=torch.float64)
    rows = max(1, _EVAL_ELEMENTS // n_runs)
    for i in range(0, x.shape[0], rows):
        cx, cy = x[i : i + rows], y[i : i + rows]
        logits = eng.forward(cx.unsqueeze(0).expand(n_runs, *cx.shape), train=False)
        logits = logits * _per_run(scale, logits)
        r, b, c = logits.shape
        ry = cy.unsqueeze(0).expand(n_runs, -1)
        losses = F.cross_entropy(logits.reshape(r * b, c), ry.reshape(r * b), reduction="none")
        loss_sum += losses.view(r, b).sum(dim=1).double().cpu()
        correct += (logits.argmax(dim=-1) == ry).sum(dim=1).double().cpu()
    return loss_sum / x.shape[0], correct / x.shape[0]


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
) -> list[RunResult]:
    """Train the runs of one group together; the same results as :func:`train_one` per run.

    Args:
        configs: runs sharing :meth:`RunConfig.group_key` (``ValueError`` otherwise); they may
            differ in scheme, seed, lr, momentum, weight decay and output std.
        train: ``(x, y)`` training split: ``x`` is ``(n, ...)``, ``y`` class indices ``(n,)``.
        test: optional test split, evaluated after every epoch.
        model_factory: builds the (uninitialized) model for a config.
        device: where to train.
        progress: called as ``progress(steps_done, steps_total)`` after every optimization step.
        dtype: floating dtype of the models and inputs (``torch.float64`` for exact checks).
        keep_state: store each run's final ``state_dict`` in :attr:`RunResult.state` (for a
            diverged run: its frozen parameters). A model without an ``output_scale`` buffer
            does not hold the output scale ``c``: the state is its parameters only.
        engine: ``"auto"`` (the explicit MLP engine where the model allows it, else vmap),
            ``"mlp"`` or ``"vmap"``.

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
    device = torch.device(device)
    cfg0 = configs[0]
    n_runs = len(configs)
    models = [_build_model(c, model_factory, dtype, device) for c in configs]
    mods = _mlp_modules(models[0]) if engine in ("auto", "mlp") else None
    if engine == "mlp" and mods is None:
        raise ValueError(
            "engine='mlp' needs a PaperMLP or an nn.Sequential of Linear/ReLU/Identity (and a "
            f"leading LayerNorm without affine parameters), got {type(models[0]).__name__}"
        )
    eng: _Engine = _MLPEngine(models, mods) if mods is not None else _VmapEngine(models)
    params = eng.params
    opt: _VecOptimizer = (_VecSGD if cfg0.optimizer == "sgd" else _VecAdam)(params, configs)

    x, y = _prepare(train, device, dtype, "train")
    x = eng.preprocess(x)
    test_xy = None
    if test is not None:
        tx, ty = _prepare(test, device, dtype, "test")
        test_xy = (eng.preprocess(tx), ty)

    # The logit multiplier per run: on the MLP engine it includes the models' own
    # ``output_scale`` buffers (the vmap engine applies buffers itself); times c after step one.
    use_buffer = [_has_scale_buffer(m) for m in models]
    scale = torch.ones(n_runs, dtype=dtype, device=device)
    if isinstance(eng, _MLPEngine):
        for r, m in enumerate(models):
            if use_buffer[r]:
                scale[r] = m.output_scale.detach().reshape(())  # type: ignore[union-attr]
    target_std = torch.tensor(
        [c.output_std if c.output_std is not None else math.nan for c in configs],
        dtype=dtype,
        device=device,
    )
    wants_scale = torch.tensor([c.output_std is not None for c in configs], device=device)
    run_c = torch.ones(n_runs, dtype=dtype, device=device)  # the c of step 3

    n, bs, epochs = x.shape[0], cfg0.batch_size, cfg0.epochs
    steps = math.ceil(n / bs)
    total = steps * epochs
    step_loss = torch.full((total, n_runs), math.nan, dtype=torch.float64)
    ep_train = torch.full((epochs, n_runs, 2), math.nan, dtype=torch.float64)
    ep_test = torch.full((epochs, n_runs, 2), math.nan, dtype=torch.float64)
    alive = torch.ones(n_runs, dtype=torch.bool)
    alive_dev = alive.to(device)
    frozen: dict[int, list[Tensor]] = {}

    def freeze(runs: list[int]) -> None:
        """Mark runs diverged: zero learning rate from the next update on; keep their values."""
        nonlocal alive_dev
        for r in runs:
            if keep_state:
                frozen[r] = [p[r].detach().clone() for p in params]
            alive[r] = False
        alive_dev = alive.to(device)
        opt.set_alive(alive)

    def clear(runs: list[int]) -> None:
        """Zero frozen runs' stacked values (after any backward pass that saved them), so no
        non-finite number stays in the shared tensors."""
        with torch.no_grad():
            for t in [*params, *opt.state_tensors()]:
                t[runs] = 0

    for epoch in range(epochs):
        orders = torch.stack([epoch_order(c.seed, epoch, n) for c in configs]).to(device)
        eng.train(True)
        for s in range(steps):
            idx = orders[:, s * bs : (s + 1) * bs]
            b = idx.shape[1]
            flat = idx.reshape(-1)
            xb = x.index_select(0, flat).view(n_runs, b, *x.shape[1:])
            yb = y.index_select(0, flat).view(n_runs, b)
            raw = eng.forward(xb, train=True)
            mult = _per_run(scale, raw)
            logits = raw * mult
            if epoch == 0 and s == 0 and bool(wants_scale.any()):
                sd = logits.reshape(n_runs, -1).std(dim=1)
                run_c = torch.where(wants_scale, _scale_from_std(sd, target_std), run_c)
                logits = logits * _per_run(run_c, logits)
                mult = mult * _per_run(run_c, logits)
                scale = scale * run_c
            loss, dlogits = _cross_entropy_and_grad(logits, yb)
            values = loss.to(dtype=torch.float64, device="cpu")
            g_step = epoch * steps + s
            step_loss[g_step] = torch.where(alive, values, math.nan)
            bad = alive & ~torch.isfinite(values)
            frozen_now = bad.nonzero().flatten().tolist() if bool(bad.any()) else []
            if frozen_now:
                freeze(frozen_now)
            draw = torch.where(_per_run(alive_dev, dlogits), dlogits * mult, 0.0)
            eng.backward_step(draw, opt, frozen_now)
            if frozen_now:
                clear(frozen_now)
            if progress is not None:
                progress(g_step + 1, total)

        eng.train(False)
        for split, out in ((x, y), ep_train), (test_xy, ep_test):
            if split is not None:
                loss_e, acc_e = _evaluate_runs(eng, scale, *split, n_runs)
                out[epoch] = torch.stack([loss_e, acc_e], dim=1)
                out[epoch][~alive] = math.nan
        bad = alive & ~torch.isfinite(ep_train[epoch, :, 0])
        if bool(bad.any()):
            runs = bad.nonzero().flatten().tolist()
            freeze(runs)
            clear(runs)

    states: list[dict[str, Tensor] | None] = [None] * n_runs
    if keep_state:
        final = [
            frozen[r] if r in frozen else [p[r].detach() for p in params] for r in range(n_runs)
        ]
        eng.write_back(models, final)
        for r, m in enumerate(models):
            if use_buffer[r]:
                with torch.no_grad():
                    if isinstance(eng, _MLPEngine):
                        m.output_scale.copy_(scale[r])  # type: ignore[operator]
                    else:
                        m.output_scale.mul_(run_c[r])  # type: ignore[operator]
            states[r] = {k: v.detach().clone() for k, v in m.state_dict().items()}

    wall = (time.perf_counter() - start) / n_runs
    results = []
    for r, config in enumerate(configs):
        results.append(
            _result(
                config,
                step_loss[:, r].tolist(),
                [(float(a), float(b)) for a, b in ep_train[:, r].tolist()],
                [(float(a), float(b)) for a, b in ep_test[:, r].tolist()] if test_xy else [],
                diverged=not alive[r].item(),
                wall_s=wall,
                state=states[r],
            )
        )
    return results
