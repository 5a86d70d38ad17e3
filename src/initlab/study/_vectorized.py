"""The vectorized pieces of :func:`initlab.study.train_runs`: optimizers over stacked parameters
``(R, ...)`` with per-run hyperparameters (:class:`_VecSGD`, :class:`_VecAdam`, ``torch.optim``
semantics) and the engines that run a stack of ``R`` models (:class:`_MLPEngine`, an explicit
MLP with a hand-written backward; :class:`_VmapEngine`, ``torch.func`` + autograd). The module
docstring of :mod:`initlab.study.trainer` describes what a run is.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from initlab.study.config import RunConfig

_ADAM_BETAS = (0.9, 0.999)
_ADAM_EPS = 1e-8


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
        self._lr = torch.tensor([c.lr for c in configs], dtype=torch.float64, device="cpu")
        self._alive = torch.ones(len(configs), dtype=torch.bool, device="cpu")
        wds = [c.weight_decay for c in configs]
        self._wd_scalar = _uniform(wds)
        self._wd = [_per_run(self._tensor(wds), p) for p in params]

    def _tensor(self, values: Any) -> Tensor:
        return torch.as_tensor(values, dtype=self._like.dtype, device=self._like.device)

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

    def forward(self, x: Tensor, *, train: bool, runs: slice | None = None) -> Tensor:
        """Raw logits ``(R, B, C)`` of ``x: (R, B, ...)``; ``train`` keeps what backward needs.
        ``runs``: only these runs (evaluation; ``x`` then has their number of rows)."""
        raise NotImplementedError

    def backward_step(self, dlogits: Tensor, opt: _VecOptimizer, frozen_now: list[int]) -> None:
        """Back-propagate ``dlogits`` (the gradient w.r.t. the last training forward's output)
        and apply ``opt`` to every parameter. ``frozen_now``: runs that diverged at this step
        (their cached values are zeroed so their gradients are exactly zero)."""
        raise NotImplementedError

    def write_back(self, models: Sequence[nn.Module], values: Sequence[list[Tensor]]) -> None:
        """Copy each run's values (in ``params`` order, without the run dim) into its model."""
        raise NotImplementedError


def _is_plain_flatten(m: nn.Module) -> bool:
    return type(m) is nn.Flatten and m.start_dim == 1 and m.end_dim == -1


def _is_fixed_layernorm(m: nn.Module) -> bool:
    return (
        type(m) is nn.LayerNorm
        and len(m.normalized_shape) == 1
        and m.weight is None
        and m.bias is None
    )


def _mlp_modules(model: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """The layer list of a model the explicit MLP engine can run, else ``None``.

    Accepted: :class:`~initlab.zoo.paper_mlp.PaperMLP` (which flattens image inputs itself) and
    ``nn.Sequential``, made of ``Linear``, ``ReLU``, ``Identity`` led by at most an
    ``nn.Flatten()`` and then a ``LayerNorm`` over the last dimension without affine parameters
    (the per-row transforms of :meth:`_MLPEngine.preprocess`).
    """
    from initlab.zoo.paper_mlp import PaperMLP

    if type(model) is PaperMLP:
        mods: list[tuple[str, nn.Module]] = [("flatten", nn.Flatten())]
        if model.input_norm is not None:
            mods.append(("input_norm", model.input_norm))
        mods += [(f"layers.{name}", m) for name, m in model.layers.named_children()]
    elif type(model) is nn.Sequential:
        mods = list(model.named_children())
    else:
        return None
    lead = 0  # the per-row transforms that lead the chain
    if lead < len(mods) and _is_plain_flatten(mods[lead][1]):
        lead += 1
    if lead < len(mods) and _is_fixed_layernorm(mods[lead][1]):
        lead += 1
    if any(type(m) not in (nn.Linear, nn.ReLU, nn.Identity) for _, m in mods[lead:]):
        return None
    if not any(type(m) is nn.Linear for _, m in mods):
        return None
    return mods


def _needs_one_at_a_time(model: nn.Module) -> bool:
    """Whether a training-mode forward of ``model`` updates buffers or draws random numbers
    (BatchNorm, dropout), which ``vmap`` over stacked runs cannot reproduce run by run."""
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.dropout import _DropoutNd

    return any(
        isinstance(m, _BatchNorm) or (isinstance(m, _DropoutNd | nn.AlphaDropout) and m.p > 0)
        for m in model.modules()
    )


class _MLPEngine(_Engine):
    """Explicit batched-matmul engine with a hand-written backward, for Linear/ReLU chains.

    A linear layer is stacked as ``wt: (R, in, out)`` (transposed weights, so the forward
    ``baddbmm(b, h, wt)`` and the weight gradient ``h^T @ dy`` are batched GEMMs without copies)
    and ``b: (R, 1, out)``. Backward per linear layer: ``dh = dy @ wt^T`` (before the update),
    then the optimizer consumes ``(h^T, dy)`` (SGD accumulates the product into its momentum
    buffer with ``baddbmm_``) and ``db = dy.sum(1)``; ReLU backward is ``threshold_backward``
    on the saved output, in place. A leading ``Flatten`` and LayerNorm without affine parameters
    are fixed per-row transforms, applied once per split in :meth:`preprocess`.

    Every activation and gradient lives in a contiguous workspace allocated once per
    ``(runs, rows)`` shape (a training batch, the last partial one, an evaluation chunk) and
    reused by later steps: fresh multi-megabyte tensors per step cost page faults and cache
    misses. (Contiguous: ``bmm`` into a strided view, e.g. to keep a column of ones beside the
    activations for the biases, falls back to one GEMM per run, 10x slower on two threads.)
    """

    def __init__(self, models: Sequence[nn.Module], mods: list[tuple[str, nn.Module]]) -> None:
        self.params = []
        self._names: list[tuple[str, bool]] = []  # (parameter name, stored transposed)
        self._ops: list[tuple[str, int, int | None]] = []  # ("linear", w, b) | ("relu", -1, None)
        self._flatten = False  # flatten each example (images into vectors) first
        self._pre: tuple[tuple[int, ...], float] | None = None
        self._saved: list[Tensor] = []  # the input of every op, from the last training forward
        self._ws: dict[tuple[int, ...], list[Tensor]] = {}  # workspaces by (kind, runs, rows)
        per_model = [dict(m.named_modules()) for m in models]

        def stack(qualname: str, attr: str, transpose: bool) -> int:
            ts = [getattr(pm[qualname], attr).detach() for pm in per_model]
            t = torch.stack([w.t() if transpose else w.unsqueeze(0) for w in ts]).contiguous()
            self.params.append(t)
            self._names.append((f"{qualname}.{attr}", transpose))
            return len(self.params) - 1

        for qual, m in mods:
            if isinstance(m, nn.Flatten):
                self._flatten = True
            elif isinstance(m, nn.LayerNorm):
                self._pre = (tuple(m.normalized_shape), float(m.eps))
            elif isinstance(m, nn.Linear):
                w = stack(qual, "weight", True)
                b = stack(qual, "bias", False) if m.bias is not None else None
                self._ops.append(("linear", w, b))
            elif isinstance(m, nn.ReLU):
                self._ops.append(("relu", -1, None))
        self._first_linear = next(i for i, op in enumerate(self._ops) if op[0] == "linear")
        self._widths = [(self.params[w].shape[1], self.params[w].shape[2]) for w in self._w_ids()]

    def _w_ids(self) -> list[int]:
        return [w for kind, w, _ in self._ops if kind == "linear"]

    def accepts(self, x: Tensor) -> bool:
        """Whether the engine can run inputs shaped like ``x`` (rows of vectors, or of anything
        when the model flattens its inputs)."""
        return x.ndim == 2 or self._flatten

    def preprocess(self, x: Tensor) -> Tensor:
        if self._flatten:
            x = x.flatten(1)
        if self._pre is None:
            return x
        return F.layer_norm(x, self._pre[0], eps=self._pre[1])

    def _workspace(self, kind: int, like: Tensor) -> list[Tensor]:
        """Per linear layer, a ``(R, B, width)`` tensor for the batch shape of ``like``: its
        output (``kind`` 0) or the gradient w.r.t. its input (``kind`` 1; none for the first
        layer, whose input needs no gradient)."""
        r, b = like.shape[:2]
        key = (kind, r, b)
        if key not in self._ws:
            widths = [w[1 - kind] if kind == 0 or i else 0 for i, w in enumerate(self._widths)]
            self._ws[key] = [like.new_empty(r, b, w) for w in widths]
        return self._ws[key]

    @torch.no_grad()
    def forward(self, x: Tensor, *, train: bool, runs: slice | None = None) -> Tensor:
        p = self.params if runs is None else [t[runs] for t in self.params]
        outs = self._workspace(0, x)
        saved: list[Tensor] = []
        h = x
        fresh = False  # h is a workspace this forward wrote (safe to modify in place)
        k = 0
        for kind, w, b in self._ops:
            saved.append(h)
            if kind == "linear":
                if b is None:
                    h = torch.bmm(h, p[w], out=outs[k])
                else:
                    h = torch.baddbmm(p[b], h, p[w], out=outs[k])
                k += 1
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
        grad = dlogits  # the caller's: it does not reuse it, so a ReLU may modify it in place
        grads_in = self._workspace(1, dlogits)
        k = len(grads_in)
        for j in range(len(self._ops) - 1, self._first_linear - 1, -1):
            kind, w, b = self._ops[j]
            inp = self._saved[j]
            if kind == "relu":
                # the op's output is the next op's saved input, or the logits for a last ReLU
                out = self._saved[j + 1] if j + 1 < len(self._saved) else inp.relu()
                grad = torch.ops.aten.threshold_backward.grad_input(grad, out, 0.0, grad_input=grad)
                continue
            k -= 1
            wt = self.params[w]
            grad_in = None
            if j > self._first_linear:
                grad_in = torch.bmm(grad, wt.transpose(1, 2), out=grads_in[k])
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

    def forward(self, x: Tensor, *, train: bool, runs: slice | None = None) -> Tensor:
        if not train:
            params, buffers = self.params, self._buffers
            if runs is not None:
                params = [p[runs] for p in params]
                buffers = {k: b[runs] for k, b in buffers.items()}
            with torch.no_grad():
                return self._call(tuple(params), buffers, x)
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
