r"""Loss landscapes: the loss on a 2-D slice ``L(θ + t₁ d₁ + t₂ d₂)`` through the parameters.

The lecture's picture (seeds digest §3): ``Σ_i L(m(x_i; θ* + t₁ θ₁ + t₂ θ₂), y_i)`` over a grid of
``(t₁, t₂)`` for two directions ``θ₁, θ₂``. :func:`loss_landscape` evaluates it for any model,

* with **filter-normalized** random directions (Li, Xu, Taylor, Studer & Goldstein 2018,
  *Visualizing the Loss Landscape of Neural Nets*, §4): ``d ~ N(0, I)`` per parameter tensor, then
  every filter ``d_i`` (the slice along dim 0: a convolution's output filter, a linear layer's
  row) is rescaled to the norm of the same filter of ``θ``, ``d_i ← d_i ‖θ_i‖ / ‖d_i‖``;
  one-dimensional parameters (biases, norm scales and shifts) get ``d = 0`` (Li et al.'s
  ``ignore="biasbn"``), so the slice moves the weights only;
* with the **top Hessian eigenvectors** (``directions="hessian"``: the two eigenvectors of largest
  ``|λ|`` of the Hessian of the loss on the first batch, by Lanczos with Hessian-vector products,
  :func:`initlab.measure.curvature.hessian_eigenpairs`; unit norm in the full parameter space);
* or with directions you give.

The model is never mutated: every point is a functional call (``torch.func.functional_call``)
with ``θ + t₁ d₁ + t₂ d₂`` and cloned buffers, so its parameters, buffers (BatchNorm running
statistics included) and ``state_dict`` are bitwise unchanged, and its train/eval modes are
restored. The model is evaluated in eval mode (dropout off) except for BatchNorm, which follows the
explicit policy ``bn``:

* ``"eval"``: normalize with the running statistics (what inference does);
* ``"batch"``: normalize with the statistics of the batch at each grid point (train-mode
  behaviour), without updating the running statistics;
* ``"fixed"``: normalize with the batch statistics measured once at the centre ``θ`` (per batch)
  and held fixed over the grid, so the slice sees the network as a fixed function of its weights;
  a BatchNorm module called several times per forward normalizes each call with that call's own
  statistics at ``θ`` (in call order; ``notes`` says so).

With several batches the value is the weighted mean ``Σ_b n_b L_b / Σ_b n_b`` of the per-batch
losses, ``n_b`` what batch ``b``'s mean divides by
(:func:`~initlab._core.loss_counts.target_count`): for torch's cross-entropy/NLL criteria, initlab's
``"cross_entropy"`` and the model's own loss (the Hugging Face convention) the targets not equal to
``ignore_index``, each counted by its class weight; for another loss on targets their number of
elements (MSE's mean); the batch's examples for a loss without targets. So a mean-reduced loss gives
its mean over all the data; for a criterion that declares ``reduction="sum"`` it is the sum ``Σ_b
L_b`` (the total over all the data).

Grid points are evaluated in chunks with ``torch.func.vmap`` over stacked parameter sets. The
chunk size bounds the memory: about ``2**21`` elements of parameters and activations per chunk
by default, cache-sized (much bigger chunks were slower than a plain loop for compute-bound
models on CPU). When vmap cannot run the model (an op without a batching rule, data-dependent
control flow), the points are evaluated one by one and ``notes`` says why.

Example (the lecture's plain vs residual LeakyReLU nets)::

    from initlab.zoo import create_model
    x = torch.linspace(-2, 2, 256)[:, None]
    batch = (x, torch.sin(3 * x))
    for name in ("lecture_mlp", "lecture_resnet_mlp"):
        net = create_model(name, depth=12)
        land = loss_landscape(net, batch, "mse", generator=0)
        land.plot()
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import functional as F

from initlab._core.attention import with_math_attention
from initlab._core.backward import check_defined, outputs_watch, with_grad
from initlab._core.compiled import takes_compiled
from initlab._core.data import DataUse, batch_size, data_use, take_batches
from initlab._core.functional import quiet_vmap_fallback
from initlab._core.hooks import hook_handles, refuse_inside_vmap
from initlab._core.knobs import renamed_kwargs
from initlab._core.loss import Loss
from initlab._core.loss_counts import target_count
from initlab._core.norms import may_weight_norm
from initlab._core.rng import as_generator, draw_device
from initlab._core.rows import Rows
from initlab._core.state import keeps_config
from initlab.measure.curvature import (
    Forward,
    LossFn,
    _batchnorms,
    functional_forward,
    model_state,
    on_batches,
    resolve_loss,
    split_loss,
)
from initlab.measure.curvature.functional import canonical_names, tied_aliases

__all__ = [
    "LANDSCAPE_COLUMNS",
    "Landscape",
    "filter_normalized_direction",
    "loss_landscape",
]

LANDSCAPE_COLUMNS: tuple[str, ...] = ("t1", "t2", "loss")
"""Columns of :meth:`Landscape.to_rows` (and ``rows()``, ``to_pandas()``, ``to_markdown()``): the
grid coordinates and the loss there."""

BNPolicy = Literal["eval", "batch", "fixed"]
_BN = ("eval", "batch", "fixed")
# Elements of parameters + activations per vmapped chunk: cache-sized. Measured on CPU (15x15
# grid, benchmarks/bench_landscape.py): chunks far above this are slower than a plain loop for
# compute-bound models (paper_mlp, strided LeNet), while tiny models gain 8-15x from vmap.
_BUDGET = 1 << 21
_AUTO_VMAP = 1 << 17  # batched="auto" on CPU: vmap below this many elements per point


def _bounds(t: torch.Tensor) -> str:
    return f"[{float(t.min()):.3g}, {float(t.max()):.3g}]" if t.numel() else "[]"


@dataclass(frozen=True, eq=False)
class Landscape:
    """A 2-D slice of the loss: ``values[i, j] = L(θ + t1[i] d₁ + t2[j] d₂)``.

    Attributes:
        values: ``(len(t1), len(t2))`` float64 tensor of losses (CPU).
        t1, t2: the grid coordinates (float64, CPU).
        directions: ``(d₁, d₂)``, each a dict parameter name → tensor.
        center: the loss at ``θ`` (``t₁ = t₂ = 0``).
        bn: the BatchNorm policy used.
        method: ``"vmap"`` or ``"loop"``.
        notes: what the reader should know (fallbacks, BatchNorm without running statistics).
        used: the batches and examples the values were computed on.
    """

    values: torch.Tensor
    t1: torch.Tensor
    t2: torch.Tensor
    directions: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]
    center: float
    bn: str
    method: str
    notes: tuple[str, ...] = field(default_factory=tuple)
    used: DataUse | None = None

    def __repr__(self) -> str:
        """A summary (the grid, the loss range, the policy), not the direction tensors."""
        finite = self.values[torch.isfinite(self.values)]
        span = f"{float(finite.min()):.6g}..{float(finite.max()):.6g}" if finite.numel() else "n/a"
        grid = "x".join(str(len(t)) for t in (self.t1, self.t2) if len(t) > 1) or "1"
        tensors = len(self.directions[0])
        return (
            f"Landscape(grid {grid}, t1 {_bounds(self.t1)}, t2 {_bounds(self.t2)}, center "
            f"{self.center:.6g}, loss {span}, bn={self.bn!r}, method={self.method!r}, directions "
            f"over {tensors} tensor(s), notes={len(self.notes)}, used={self.used})"
        )

    def rows(self) -> Rows:
        """The grid as :class:`~initlab.Rows`: one row per grid point, columns
        :data:`LANDSCAPE_COLUMNS` ``(t1, t2, loss)``, ``t2`` varying fastest; ``.used`` set."""
        rows = [
            {"t1": float(a), "t2": float(b), "loss": float(self.values[i, j])}
            for i, a in enumerate(self.t1)
            for j, b in enumerate(self.t2)
        ]
        return Rows(
            rows, LANDSCAPE_COLUMNS, title=f"loss landscape (bn={self.bn!r})", used=self.used
        )

    def to_rows(self) -> list[dict[str, Any]]:
        """Tidy rows as plain dicts ``{"t1", "t2", "loss"}``, one per grid point, ``t2`` fastest."""
        return self.rows().to_rows()

    def to_pandas(self) -> Any:
        """The tidy rows as a ``pandas.DataFrame`` (needs pandas)."""
        return self.rows().to_pandas()

    def to_markdown(self) -> str:
        """The tidy rows as a markdown table."""
        return self.rows().to_markdown()

    def plot(
        self,
        ax: Any = None,
        *,
        levels: int | Sequence[float] = 20,
        filled: bool = True,
        log: bool = False,
        colorbar: bool = True,
    ) -> Any:
        """Contour plot of the slice (``t1`` horizontal, ``t2`` vertical); a line for a 1-D grid.

        Needs matplotlib (``pip install initlab[plot]``), imported here only
        (:func:`initlab._core.figures.new_figure`; no pyplot).

        Args:
            ax: a matplotlib ``Axes`` (default: one on a new ``Figure``, ``ax.figure``).
            levels: number of contour levels or the levels.
            filled: ``contourf`` (default) or line contours with labels.
            log: plot ``log10(loss)`` (for positive losses spanning decades).
            colorbar: add a colour bar (filled plots).

        Returns:
            The ``Axes``.
        """
        if ax is None:
            from initlab._core.figures import new_figure

            ax = new_figure("Landscape.plot", "Landscape.to_rows() gives the numbers").add_subplot()
        z = self.values.clone()
        label = "loss"
        if log:
            z = z.clamp_min(torch.finfo(torch.float64).tiny).log10()
            label = "log10 loss"
        if len(self.t1) == 1 or len(self.t2) == 1:
            t, name = (self.t2, "t2") if len(self.t1) == 1 else (self.t1, "t1")
            ax.plot(t.numpy(), z.reshape(-1).numpy())
            ax.set_xlabel(name)
            ax.set_ylabel(label)
            return ax
        xx, yy = torch.meshgrid(self.t1, self.t2, indexing="ij")
        if filled:
            cs = ax.contourf(xx.numpy(), yy.numpy(), z.numpy(), levels=levels)
            if colorbar:
                ax.figure.colorbar(cs, ax=ax, label=label)
        else:
            cs = ax.contour(xx.numpy(), yy.numpy(), z.numpy(), levels=levels)
            ax.clabel(cs, fontsize=7)
        ax.plot([0.0], [0.0], "k+")
        ax.set_xlabel("t1")
        ax.set_ylabel("t2")
        ax.set_title(f"loss landscape (bn={self.bn})")
        return ax

    def contour(self, ax: Any = None, *, levels: int | Sequence[float] = 20) -> Any:
        """Line contours with labels (:meth:`plot` with ``filled=False``)."""
        return self.plot(ax, levels=levels, filled=False, colorbar=False)


def _trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def filter_normalized_direction(
    model: nn.Module,
    *,
    generator: torch.Generator | int | None = None,
) -> dict[str, torch.Tensor]:
    r"""A random direction with filter-wise normalization (Li et al. 2018, §4).

    For every trainable parameter ``θ`` with at least two dimensions: ``d ~ N(0, I)`` (drawn in
    float64 on the CPU, so a seed gives the same direction on every device; complex128, real
    and imaginary parts ``N(0, 1/2)``, for a complex parameter), then for every filter ``i`` (the
    slice ``[i]`` along dim 0) ``d_i ← d_i · ‖θ_i‖ / ‖d_i‖``, so ``‖d_i‖ = ‖θ_i‖`` (``‖z‖² =
    Σ|z|²``). One-dimensional parameters (biases, norm parameters) get ``d = 0``.

    Returns:
        Parameter name → direction (the parameter's dtype and device).
    """
    gen = as_generator(generator)
    out = {}
    for name, p in _trainable(model).items():
        wide = torch.complex128 if p.is_complex() else torch.float64
        d = torch.randn(p.shape, generator=gen, dtype=wide, device=draw_device(gen))
        if p.dim() <= 1:
            d.zero_()
        else:
            theta = p.detach().to(device="cpu", dtype=wide)
            dn = d.reshape(d.shape[0], -1).norm(dim=1)
            tn = theta.reshape(theta.shape[0], -1).norm(dim=1)
            scale = tn / dn.clamp_min(torch.finfo(torch.float64).tiny)
            d = d * scale.view(-1, *([1] * (p.dim() - 1)))
        out[name] = d.to(dtype=p.dtype, device=p.device)
    return out


def _as_grid(values: Any, what: str) -> torch.Tensor:
    t = torch.as_tensor(values, dtype=torch.float64, device="cpu").detach().reshape(-1)
    if t.numel() == 0 or not torch.isfinite(t).all():
        raise ValueError(f"grid {what} must be a non-empty sequence of finite numbers")
    return t


def _by_first_name(
    d: Mapping[str, Any], params: Mapping[str, torch.Tensor], canon: Mapping[str, str], which: str
) -> dict[str, Any]:
    """``d`` keyed by first names: a tied tensor may be given under any of its names, once."""
    unknown = [k for k in d if canon.get(k) not in params]
    if unknown:
        raise ValueError(f"direction {which} names parameters the model does not train: {unknown}")
    out: dict[str, Any] = {}
    for k, t in d.items():
        first = canon[k]
        if first in out:
            raise ValueError(
                f"direction {which} gives the tied tensor {first} twice (as {first} and its "
                "alias); a tied tensor has one direction: give it once"
            )
        out[first] = t
    return out


def _user_direction(
    d: Any, params: Mapping[str, torch.Tensor], which: str, canon: Mapping[str, str]
) -> dict[str, torch.Tensor]:
    names = list(params)
    if isinstance(d, Mapping):
        given = _by_first_name(d, params, canon, which)
        out = {n: given.get(n) for n in names}
    elif isinstance(d, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in d):
        if len(d) != len(names):
            raise ValueError(
                f"direction {which} has {len(d)} tensors; the model has {len(names)} trainable "
                "parameters (pass a dict name -> tensor to give only some)"
            )
        out = dict(zip(names, d, strict=True))
    else:
        raise TypeError(
            f"direction {which} must be a dict name -> tensor or a list of tensors, "
            f"got {type(d).__name__}"
        )
    res = {}
    for n, t in out.items():
        p = params[n]
        if t is None:
            res[n] = torch.zeros_like(p)
            continue
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(
                f"direction {which}[{n}] has shape {tuple(t.shape)}, parameter {tuple(p.shape)}"
            )
        res[n] = t.detach().to(dtype=p.dtype, device=p.device)
    return res


def _bn_stats(
    model: nn.Module,
    batch: Any,
    base: dict[str, torch.Tensor | None],
    forward: Forward,
) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per BatchNorm module, the batch mean and biased variance of its input at ``θ``, one pair
    per call in call order (train-mode forward)."""
    stats: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def hook(name: str) -> Callable:
        def fn(module: nn.Module, args: tuple) -> None:
            refuse_inside_vmap(name, "loss_landscape(bn='fixed')", " (or pass bn='eval')")
            x = args[0].detach()
            dims = [d for d in range(x.dim()) if d != 1]
            pair = (x.mean(dim=dims), x.var(dim=dims, unbiased=False))
            stats.setdefault(name, []).append(pair)

        return fn

    with hook_handles() as handles, torch.no_grad():
        for name, bn in _batchnorms(model):
            handles.add(bn.register_forward_pre_hook(hook(name)))
        functional_forward(model, base, batch, forward)
    return stats


class _PerCall:
    """``bn="fixed"`` for BatchNorm modules called several times per forward: a buffer holds one
    pair of statistics, so a forward hook replaces call ``k``'s output by
    ``F.batch_norm(x, μ_k, σ²_k, γ, β)`` with the statistics of call ``k`` at ``θ`` (calls
    counted in order, modulo their number at ``θ``: a pass of several forwards, as the Hessian's,
    sees each forward alike)."""

    def __init__(self, model: nn.Module, calls: list[dict[str, list[tuple[Any, Any]]]]) -> None:
        self.model = model
        self.calls = [{n: c for n, c in per.items() if len(c) > 1} for per in calls]

    @contextmanager
    def on(self, index: int) -> Iterator[None]:
        """The hooks for batch ``index`` while the block runs."""
        per = self.calls[index] if self.calls else {}
        if not per:
            yield
            return
        modules = dict(self.model.named_modules())
        seen = dict.fromkeys(per, 0)

        def hook(name: str) -> Callable:
            def fn(module: nn.Module, args: tuple, _out: Any) -> torch.Tensor:
                mean, var = per[name][seen[name] % len(per[name])]
                seen[name] += 1
                return F.batch_norm(
                    args[0], mean, var, module.weight, module.bias, False, 0.0, module.eps
                )

            return fn

        with hook_handles() as handles:
            for name in per:
                handles.add(modules[name].register_forward_hook(hook(name)))
            yield
        off = {n: seen[n] for n in per if seen[n] % len(per[n])}
        if off:
            raise RuntimeError(
                f"BatchNorm modules were called {off} times, not a multiple of their calls per "
                f"forward at θ ({ {n: len(per[n]) for n in off} }): bn='fixed' pairs each call "
                "with its statistics at θ by call order; use bn='batch' or bn='eval'"
            )


def _point_params(
    theta: Mapping[str, torch.Tensor],
    d1: Mapping[str, torch.Tensor],
    d2: Mapping[str, torch.Tensor],
    a: torch.Tensor,
    b: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """``θ + a d₁ + b d₂`` for a vector of ``a``, ``b`` (stacked along a new dim 0)."""
    out = {}
    for n, p in theta.items():
        view = (-1,) + (1,) * p.dim()
        aa = a.to(dtype=p.dtype, device=p.device).view(view)
        bb = b.to(dtype=p.dtype, device=p.device).view(view)
        out[n] = p.unsqueeze(0) + aa * d1[n].unsqueeze(0) + bb * d2[n].unsqueeze(0)
    return out


def _activation_elements(model: nn.Module, batch: Any, base: dict, forward: Forward) -> int:
    """Elements of all leaf-module outputs in one forward (for the chunk size)."""
    total = 0

    def fn(_m: nn.Module, _a: tuple, out: Any) -> None:
        nonlocal total
        if isinstance(out, torch.Tensor):
            total += out.numel()

    with hook_handles() as handles, torch.no_grad():
        for m in model.modules():
            if next(m.children(), None) is None:
                handles.add(m.register_forward_hook(fn))
        functional_forward(model, base, batch, forward)
    return total


def _bn_bases(
    model: nn.Module, batches: list[Any], bn: str, fwd: Forward, notes: list[str]
) -> tuple[list[dict[str, torch.Tensor | None]], _PerCall]:
    """Per batch, the state (cloned buffers) under the BatchNorm policy ``bn``, and the hooks for
    BatchNorm modules called several times (:class:`_PerCall`); the model is put in eval mode
    with its BatchNorms as the policy needs (the caller restores the modes)."""
    model.eval()
    bns = _batchnorms(model)
    if bn == "batch":
        for _, m in bns:
            m.train()
    bases = [model_state(model) for _ in batches]
    calls: list[dict[str, list[tuple[torch.Tensor, torch.Tensor]]]] = []
    if bn == "fixed" and bns:
        for _, m in bns:
            m.train()
        calls = [_bn_stats(model, b, model_state(model), fwd) for b in batches]
        for _, m in bns:
            m.eval()
        for base, per in zip(bases, calls, strict=True):
            for name, pairs in per.items():
                prefix = f"{name}." if name else ""
                base[f"{prefix}running_mean"], base[f"{prefix}running_var"] = pairs[0]
        shared = {n: len(c) for per in calls for n, c in per.items() if len(c) > 1}
        notes.extend(
            f"BatchNorm {n or '(the model)'} is called {k} times per forward: each call is "
            "normalized with its own batch statistics at θ"
            for n, k in shared.items()
        )
    untracked = [n for n, m in bns if not m.track_running_stats]
    if untracked and bn == "eval":
        notes.append(
            f"BatchNorm layers {untracked} keep no running statistics: they normalize with "
            "batch statistics even under bn='eval'"
        )
    return bases, _PerCall(model, calls)


def _directions(
    model: nn.Module,
    directions: Any,
    theta: dict[str, torch.Tensor],
    hessian: Callable[[], tuple[torch.Tensor, list[dict[str, torch.Tensor]]]],
    gen: torch.Generator | None,
    notes: list[str],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(d1, d2)`` for ``directions`` (``hessian()``: the operator's top-2 eigenpairs)."""
    if isinstance(directions, str) and directions == "filter_normalized":
        return (
            filter_normalized_direction(model, generator=gen),
            filter_normalized_direction(model, generator=gen),
        )
    if isinstance(directions, str) and directions == "hessian":
        lams, vecs = hessian()
        notes.append(
            f"Hessian eigenvalues of the directions (first batch): "
            f"{float(lams[0]):.4g}, {float(lams[1]):.4g}"
        )
        return vecs[0], vecs[1]
    canon = canonical_names(model)  # a pair (check_options)
    return (
        _user_direction(directions[0], theta, "d1", canon),
        _user_direction(directions[1], theta, "d2", canon),
    )


def _hessian_pairs(
    model: nn.Module,
    batches: list[Any],
    loss: Loss,
    theta: dict[str, torch.Tensor],
    forward: Forward | None,
    bases: list[dict[str, torch.Tensor | None]],
    per_call: _PerCall,
    gen: torch.Generator | None,
) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """The top-2 eigenpairs of the curvature operator on the first batch, with the running
    statistics of its BatchNorm base and ``per_call``'s hooks (``directions="hessian"``)."""
    from initlab.measure.curvature import CurvatureOperator

    overrides = {k: v for k, v in bases[0].items() if k not in theta and "running_" in k}
    with per_call.on(0):
        op = CurvatureOperator(
            model,
            batches[0],
            loss,
            params=list(theta),
            forward=forward,
            buffers=overrides,
            _what="loss_landscape",
        )
        return op.eigenpairs(2, generator=gen)


def _loss_at(
    model: nn.Module,
    batches: list[Any],
    weights: list[float],
    bases: list[dict[str, torch.Tensor | None]],
    per_call: _PerCall,
    fwd: Forward,
    on_outputs: Callable[[Any, Any], torch.Tensor],
) -> Callable[..., torch.Tensor]:
    """``at(params, centre=False)``: the example-weighted loss over ``batches`` with the trainable
    parameters ``params`` (the rest from each batch's base); at the centre, a NaN loss on finite
    outputs raises."""

    weight_norm = may_weight_norm(model)  # once for the grid's passes

    def at(params: Mapping[str, torch.Tensor], centre: bool = False) -> torch.Tensor:
        total: torch.Tensor | float = 0.0
        for i, (w, b, base) in enumerate(zip(weights, batches, bases, strict=True)):
            watch = outputs_watch(model) if centre else nullcontext([])
            with per_call.on(i), watch as finite:  # the watch sees the hooks' outputs
                # forward only: the native float16 norms (no second derivative to overflow)
                out = functional_forward(model, {**base, **params}, b, fwd, weight_norm, False)
            value = on_outputs(out, b).reshape(())
            if centre:  # the model as it is: a NaN loss on finite outputs is the loss's own
                check_defined(value, all(finite), what="loss_landscape", index=i)
            total = total + w * value
        assert isinstance(total, torch.Tensor)
        return total

    return at


def _chunk(
    batched: bool | str,
    chunk_size: int | None,
    per_point: Callable[[], int],
    on_cpu: bool,
    n_points: int,
    notes: list[str],
) -> int | None:
    """Grid points per vmapped call, or ``None`` for the loop (``batched``, ``chunk_size`` as in
    :func:`loss_landscape`; ``per_point()``: parameter and activation elements of one point)."""
    size = per_point() if batched == "auto" or (batched and chunk_size is None) else 0
    if batched == "auto":
        batched = not on_cpu or size < _AUTO_VMAP
        notes.append(
            f"batched='auto': {'vmap' if batched else 'loop'} ({size} elements "
            f"per point on {'cpu' if on_cpu else 'an accelerator'})"
        )
    if not batched:
        return None
    if chunk_size is None:
        return max(1, min(n_points, _BUDGET // max(size, 1)))
    return max(1, min(n_points, chunk_size))  # a positive int (check_options)


def _grid_values(
    at: Callable[[Mapping[str, torch.Tensor]], torch.Tensor],
    theta: dict[str, torch.Tensor],
    d1: Mapping[str, torch.Tensor],
    d2: Mapping[str, torch.Tensor],
    t1: torch.Tensor,
    t2: torch.Tensor,
    chunk: int | None,
    notes: list[str],
) -> tuple[torch.Tensor, str]:
    """The loss at every grid point (row-major, ``t2`` fastest) and the method used."""
    aa, bb = torch.meshgrid(t1, t2, indexing="ij")
    aa, bb = aa.reshape(-1), bb.reshape(-1)
    n_points = aa.numel()
    values = torch.empty(n_points, dtype=torch.float64, device="cpu")
    if chunk is not None:
        try:
            vf = torch.func.vmap(at)
            with quiet_vmap_fallback():  # an op without a batching rule (GRUCell) loops
                for s in range(0, n_points, chunk):
                    e = min(n_points, s + chunk)
                    values[s:e] = vf(_point_params(theta, d1, d2, aa[s:e], bb[s:e])).double()
            return values, "vmap"
        except Exception as err:  # vmap cannot run this model: evaluate point by point
            notes.append(f"vmap failed ({type(err).__name__}: {err}); evaluated in a loop")
    for i in range(n_points):
        pp = _point_params(theta, d1, d2, aa[i : i + 1], bb[i : i + 1])
        values[i] = float(at({n: v[0] for n, v in pp.items()}))
    return values, "loop"


def _grid(grid: int | tuple[Any, Any] | None) -> tuple[torch.Tensor, torch.Tensor]:
    if grid is None:
        grid = 21
    if isinstance(grid, int) and not isinstance(grid, bool) and grid >= 1:
        # one point: the centre (linspace(-1, 1, 1) would be the corner -1)
        axis = _as_grid(torch.linspace(-1, 1, grid, device="cpu") if grid > 1 else [0.0], "t1")
        return axis, axis.clone()
    if not (isinstance(grid, (tuple, list)) and len(grid) == 2):
        raise ValueError(
            f"grid must be a number of points per axis (a positive int n: linspace(-1, 1, n) "
            f"for both, n = 1 the centre) or a pair (t1_values, t2_values), got {grid!r}"
        )
    return _as_grid(grid[0], "t1"), _as_grid(grid[1], "t2")


def _batch_weights(loss: Loss, batches: list[Any]) -> list[float]:
    """Each batch's factor in the value over several batches (module docstring): 1 for a
    sum-reduced loss, else what the batch's mean divides by over its total over the batches
    (:func:`~initlab._core.loss_counts.target_count`; the examples where that is unknown)."""
    if loss.reduction == "sum":
        return [1.0] * len(batches)
    known = [target_count(loss, b) for b in batches]
    counts = [c for c in known if c is not None]
    if len(counts) < len(batches) or not sum(counts) > 0:
        counts = [float(batch_size(b)) for b in batches]
    total = sum(counts)
    return [c / total for c in counts]


def check_options(
    *,
    directions: Any = "filter_normalized",
    grid: int | tuple[Any, Any] | None = None,
    bn: str = "eval",
    batched: bool | str = True,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The checks of :func:`loss_landscape`'s options that need neither the model nor data (run
    at its entry, and by :func:`initlab.diagnose` on its ``landscape={...}`` before its pass);
    returns the grid's axes ``(t1, t2)`` (float64).

    Raises:
        ValueError: an unknown ``bn`` or ``directions`` name, ``directions`` neither a name nor a
            pair, ``batched`` none of ``True``, ``False``, ``"auto"``, a ``grid`` that is neither
            a positive int nor a pair of non-empty finite sequences, a ``chunk_size`` (where
            vmap may run) that is not a positive int.
    """
    if bn not in _BN:
        raise ValueError(f"unknown bn policy {bn!r}; valid policies: {list(_BN)}")
    if batched not in (True, False, "auto"):
        raise ValueError(f"batched must be True, False or 'auto', got {batched!r}")
    if isinstance(directions, str) and directions not in ("filter_normalized", "hessian"):
        raise ValueError(
            f"unknown directions {directions!r}; valid: 'filter_normalized', 'hessian', "
            "or a pair of directions"
        )
    if not isinstance(directions, str) and not (
        isinstance(directions, (tuple, list)) and len(directions) == 2
    ):
        raise ValueError("directions must be a name or a pair (d1, d2)")
    bad_chunk = isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    if batched is not False and chunk_size is not None and bad_chunk:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    return _grid(grid)


@takes_compiled
@with_grad
@renamed_kwargs(batch_or_batches="data")
@with_math_attention
@keeps_config
def loss_landscape(
    model: nn.Module,
    data: Any,
    loss_fn: LossFn = None,
    *,
    directions: Literal["filter_normalized", "hessian"] | Sequence[Any] = "filter_normalized",
    grid: int | tuple[Any, Any] | None = None,
    bn: BNPolicy = "eval",
    generator: torch.Generator | int | None = None,
    batched: bool | Literal["auto"] = True,
    chunk_size: int | None = None,
    forward: Forward | None = None,
    max_batches: int | None = None,
) -> Landscape:
    r"""The loss on the plane ``θ + t₁ d₁ + t₂ d₂`` over a grid (module docstring).

    Args:
        model: any ``nn.Module``; never mutated (parameters, buffers, modes).
        data: one batch or many (:mod:`initlab._core.data`; formerly ``batch_or_batches=``): a
            tensor, an ``(x, y)`` tuple, a dict of model inputs, a ``DataLoader``, a list of
            ``(x, y)`` tuples or ``initlab.Batches([...])``; all of them are held (at most
            ``max_batches``).
        loss_fn: the loss, in any form :func:`~initlab._core.loss.resolve_loss` accepts:
            ``loss_fn(model, batch)``, a criterion (``nn.CrossEntropyLoss()``,
            ``F.cross_entropy``), the model's own loss, a name (``"cross_entropy"``, ``"mse"``,
            ...) or ``initlab.outputs_loss(fn)``. ``None``: the resolver's default.
        directions: ``"filter_normalized"`` (default), ``"hessian"`` (top-2 eigenvectors by
            ``|λ|``), or two directions, each a dict parameter name → tensor (missing names: 0)
            or a list of tensors for all trainable parameters in ``named_parameters`` order. A
            tied tensor is one parameter with one direction: give it under any one of its
            names; :attr:`Landscape.directions` keys it by its first name in
            ``named_parameters()``.
        grid: ``(t1_values, t2_values)``, or ``n``: ``linspace(-1, 1, n)`` for both (default
            21); ``n = 1`` is the centre ``t₁ = t₂ = 0`` alone.
        bn: BatchNorm policy ``"eval"``, ``"batch"`` or ``"fixed"`` (module docstring).
        generator: ``torch.Generator``, int seed or ``None`` (random directions, Lanczos start).
        batched: ``True``: evaluate chunks of grid points with ``torch.func.vmap`` (falls back
            to a loop when vmap fails); ``False``: one point at a time; ``"auto"``: vmap on an
            accelerator, or on the CPU when one point is small (fewer than ``2**17`` parameter
            and activation elements), else the loop. Measured on one CPU thread
            (``benchmarks/bench_landscape.py``): vmap gives about 7x the points/s of a loop for
            the lecture's small MLPs (Python-overhead bound), but about 0.6x for compute-bound
            models (``paper_mlp``, strided LeNet), whose per-point batched matmuls run slower
            than plain ones.
        chunk_size: grid points per vmapped call (default from a budget of about ``2**21``
            elements of parameters and activations per chunk).
        forward: ``forward(model, batch) -> outputs`` for a loss on the outputs (default
            :func:`~initlab._core.data.default_forward`); one that passes the target
            ``batch[1]`` a criterion reads to the model raises
            (:func:`~initlab._core.forward_loss.target_kept`).
        max_batches: use at most this many batches of ``data`` (``None``: all; data without a
            length, a generator or an ``IterableDataset``, up to 1000 batches, and more raise:
            pass ``max_batches=``).

    Returns:
        :class:`Landscape` (``used``: the batches and examples read).
    """
    t1, t2 = check_options(
        directions=directions, grid=grid, bn=bn, batched=batched, chunk_size=chunk_size
    )
    batches = take_batches(data, max_batches, what="loss_landscape", exact=False)
    loss = on_batches(resolve_loss(loss_fn, what="loss_landscape"), batches)
    fwd, on_outputs = split_loss(loss, forward, what="loss_landscape")
    used = data_use(batches)
    weights = _batch_weights(loss, batches)
    theta = {n: p.detach() for n, p in _trainable(model).items()}
    if not theta:
        raise ValueError("the model has no trainable parameter to move along")
    notes: list[str] = [
        f"{n} is tied to {', '.join(a)}: one tensor, one direction (keyed {n}); moving it "
        "moves every use"
        for n, a in tied_aliases(model).items()
        if n in theta
    ]
    modes = [(m, m.training) for m in model.modules()]
    try:
        bases, per_call = _bn_bases(model, batches, bn, fwd, notes)
        gen = as_generator(generator)
        hessian = partial(
            _hessian_pairs, model, batches, loss, theta, forward, bases, per_call, gen
        )
        d1, d2 = _directions(model, directions, theta, hessian, gen, notes)
        at = _loss_at(model, batches, weights, bases, per_call, fwd, on_outputs)
        with torch.no_grad():
            center = float(at(theta, centre=True))

            def per_point() -> int:
                acts = _activation_elements(model, batches[0], bases[0], fwd)
                return sum(p.numel() for p in theta.values()) + acts * len(batches)

            on_cpu = next(iter(theta.values())).device.type == "cpu"
            chunk = _chunk(batched, chunk_size, per_point, on_cpu, t1.numel() * t2.numel(), notes)
            values, method = _grid_values(at, theta, d1, d2, t1, t2, chunk, notes)
    finally:
        for m, mode in modes:
            m.train(mode)
    if not math.isfinite(center):
        notes.append("the loss at the centre is not finite")
    return Landscape(
        values.reshape(len(t1), len(t2)), t1, t2, (dict(d1), dict(d2)), center, bn, method,
        tuple(notes), used,
    )  # fmt: skip
