r"""The per-tensor scale (alpha) machinery shared by GradInit and MetaInit.

Both :func:`~initlab.methods.gradinit.gradinit_` and :func:`~initlab.methods.metainit.metainit_`
learn one scalar ``alpha_i`` per trainable tensor ``W_i`` and evaluate the network at
``theta_alpha = (alpha_i * W_i)_i``. This module holds what they share:

* which tensors get an alpha (:func:`select_tensors`, filters :func:`nonzero`, roles from the layer
  registry, tied tensors once) and the :class:`Tensors` record of them;
* functional evaluation at ``theta_alpha`` (:func:`scaled_params`, :class:`AtParams`,
  :func:`loss_at`: the modules' parameter entries swapped for the call as
  :func:`torch.func.functional_call` swaps them, the parameters themselves never replaced);
* gradients (:func:`grads_or_zeros`), rank means (:func:`rank_mean`, :func:`scalar_mean`) and the
  finiteness check (:func:`check_finite`);
* second derivatives: a model that cannot be differentiated twice raises a clear
  :class:`~initlab.measure.curvature.DoubleBackwardError` (:func:`second_order`), also where
  autograd would silently drop part of the derivative (a ``@once_differentiable`` backward);
* the evaluation modes (dropout off, optional batch statistics; buffers and modes restored);
* Adam on the alphas with the clamp ``alpha >= alpha_min`` (:class:`AlphaAdam`, ``RescaleAdam``),
  folding ``W <- alpha * W`` once per tensor (:func:`fold_alpha`) and the report rows;
* the batches of the iterations (:func:`batch_pairs`) and the option checks.
"""

from __future__ import annotations

import contextlib
import math
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from initlab._core.backward import require_grad
from initlab._core.data import (
    DataCounter,
    check_data,
    examples_in,
    is_single_batch,
    iter_batches,
)
from initlab._core.distributed import (
    all_reduce_sum,
    check_same_count,
    in_lockstep,
    is_distributed,
    run_together,
    world_size,
)
from initlab._core.knobs import user_stacklevel
from initlab._core.loss import Loss, resolve_loss
from initlab._core.modules import refuse_shared_writes
from initlab._core.norms import exact_weight_norm, may_float16, may_weight_norm
from initlab._core.rows import split_name
from initlab._core.state import model_kept
from initlab.init.registry import default_registry
from initlab.measure.curvature.products import (
    DoubleBackwardError,
    _cuts_second_order,
    _is_second_order_error,
)

__all__ = [
    "AlphaAdam",
    "AtParams",
    "LossFn",
    "SecondOrder",
    "TensorFilter",
    "Tensors",
    "alpha_rows",
    "alpha_values",
    "batch_pairs",
    "check_finite",
    "check_number",
    "default_loss",
    "evaluation_modes",
    "fold_alpha",
    "grads_or_zeros",
    "known_length",
    "loss_at",
    "nonzero",
    "positive_int",
    "rank_mean",
    "refuse_shared_memory",
    "scalar_mean",
    "scaled_leaves",
    "scaled_params",
    "second_order",
    "select_tensors",
    "set_evaluation_modes",
    "tensor_roles",
]

LossFn = Callable[[Any, Any], torch.Tensor]
"""``loss_fn(model, batch) -> scalar tensor``; ``model`` is called like the original model."""

TensorFilter = Callable[[str, torch.Tensor, str], bool]
"""``params(name, tensor, role) -> bool``: whether the tensor gets a scale."""

_BETAS = (0.9, 0.999)
_ADAM_EPS = 1e-8
_END = object()  # end-of-data marker


default_loss: Loss = resolve_loss(None)
"""The loss when none is given: the model's own (dict batches with labels), else cross-entropy
(integer targets) or MSE (float targets) on ``(x, y)`` batches."""


Slot = tuple[dict[str, Any], str]
"""Where a parameter sits: ``(module._parameters, local name)``."""


class AtParams:
    """Stand-in for ``model`` evaluated at other tensors, as ``functional_call(model, ...)``.

    Calling it runs the model's forward with ``tensors[k]`` in every ``(module._parameters,
    name)`` of ``slots[k]`` (the slots :func:`select_tensors` records: tied and shared ones
    included), swapped directly as ``functional_call`` swaps them but without its per-call walk
    of the model (0.3 ms a call on VGG-19-BN); the parameters are put back after the call, also
    when it raises. Every other attribute is the model's own.
    """

    def __init__(
        self, model: nn.Module, slots: Sequence[Sequence[Slot]], tensors: Sequence[torch.Tensor]
    ) -> None:
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_slots", slots)
        object.__setattr__(self, "_tensors", tensors)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        saved: list[tuple[dict[str, Any], str, Any]] = []
        try:
            for where, t in zip(self._slots, self._tensors, strict=True):
                for params, name in where:
                    saved.append((params, name, params[name]))
                    params[name] = t
            return self._model(*args, **kwargs)
        finally:
            for params, name, old in reversed(saved):
                params[name] = old

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_model"), name)


@dataclass
class Tensors:
    """The distinct trainable tensors of a model and which of them carry a scale."""

    names: list[str]
    tensors: list[torch.Tensor]
    roles: list[str]
    scaled: list[int]  # positions in ``tensors`` that get an alpha, in alpha order
    norms: list[float] = field(default_factory=list)  # norms of the scaled tensors before
    tied: dict[str, list[str]] = field(default_factory=dict)  # first name -> its other names
    left: list[str] = field(default_factory=list)  # lone scalars no layer claims, not scaled
    # per tensor, every (module._parameters, name) holding it (for AtParams)
    slots: list[list[Slot]] = field(default_factory=list, repr=False)
    # the model can reach torch._weight_norm (initlab._core.norms.may_weight_norm), found once
    weight_norm: bool = False
    # the model holds float16 tensors (initlab._core.norms.may_float16), found once
    float16: bool = False

    @property
    def numel(self) -> int:
        return sum(t.numel() for t in self.tensors)

    @property
    def unscaled(self) -> list[int]:
        """Positions in ``tensors`` without an alpha."""
        scaled = set(self.scaled)
        return [i for i in range(len(self.tensors)) if i not in scaled]


def tensor_roles(model: nn.Module) -> dict[int, str]:
    """Role of every parameter claimed by the default layer registry, by tensor identity."""
    registry = default_registry()
    roles: dict[int, str] = {}
    for name, module in model.named_modules():
        specs = registry.specs(module, name)
        for spec in specs or ():
            param = module._parameters.get(spec.name)
            if param is not None:
                roles.setdefault(id(param), spec.role)
    return roles


def nonzero(name: str, tensor: torch.Tensor, role: str) -> bool:
    return bool(torch.count_nonzero(tensor.detach()) > 0)


def _holds_a_log(name: str) -> bool:
    """Whether a parameter's leaf name has the word ``log`` (``A_log``, ``log_scale``)."""
    return "log" in re.split(r"[^a-z]+", name.rsplit(".", 1)[-1].lower())


def select_tensors(
    model: nn.Module, params: str | TensorFilter, default: TensorFilter, what: str
) -> Tensors:
    """Distinct trainable tensors (first name wins for tied ones) and the ones that get a scale.

    ``params="default"`` leaves out (in ``left``) a tensor no layer claims that is a lone scalar
    (a temperature such as CLIP's ``logit_scale``, a gate) or whose name says it holds a log
    (Mamba's ``A_log``, a ``log_scale``): GradInit and MetaInit learn the scales of layers'
    tensors, and ``alpha * log(a)`` would raise ``a`` to the power ``alpha``.
    """
    if isinstance(params, str):
        if params != "default":
            raise ValueError(f"{what}: params must be 'default' or a callable, got {params!r}")
        chosen: TensorFilter = default
    elif callable(params):
        chosen = params
    else:
        raise TypeError(f"{what}: params must be 'default' or a callable, got {params!r}")
    roles = tensor_roles(model)
    out = Tensors([], [], [], [])
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(p), name) != name:
            out.tied.setdefault(first[id(p)], []).append(name)
    where: dict[int, list[Slot]] = {}
    for module in model.modules():
        for local, p in module._parameters.items():
            if p is not None:
                where.setdefault(id(p), []).append((module._parameters, local))
    for name, p in model.named_parameters():  # deduplicates tied tensors by identity
        if not p.requires_grad:
            continue
        role = roles.get(id(p), "unclaimed")
        out.names.append(name)
        out.tensors.append(p)
        out.roles.append(role)
        out.slots.append(where[id(p)])
        if chosen is default and role == "unclaimed" and (p.numel() == 1 or _holds_a_log(name)):
            out.left.append(name)
        elif chosen(name, p, role) and bool(torch.count_nonzero(p.detach()) > 0):
            out.scaled.append(len(out.tensors) - 1)
            out.norms.append(float(p.detach().double().norm()))
    if not out.scaled:
        raise ValueError(
            f"{what}: no tensor to scale (the model has no trainable non-zero tensor that the "
            "params selection accepts)"
        )
    out.weight_norm = may_weight_norm(model)
    out.float16 = may_float16(model)
    return out


def refuse_shared_memory(model: nn.Module, ts: Tensors, what: str) -> None:
    """Raise ``ValueError`` where a tensor that gets a scale lies over the memory of another
    ``Parameter`` object (:func:`~initlab._core.modules.refuse_shared_writes`: made with
    ``nn.Parameter(a.weight.data)`` or a view of it; a tie, one object, has one alpha). The
    iterations evaluate ``alpha_a * W_a`` and ``alpha_b * W_b`` as two tensors; the fold would
    then scale the one memory by both, ``alpha_a * alpha_b`` (a frozen or unscaled one by a scale
    that is not its own)."""
    refuse_shared_writes(
        what,
        model,
        [ts.tensors[i] for i in ts.scaled],
        "each would learn its own scale alpha as if it were a tensor of its own, and folding "
        "W <- alpha * W into both would scale that memory by the product of their alphas",
    )


def scaled_params(ts: Tensors, a: torch.Tensor) -> list[torch.Tensor]:
    """``alpha_k * W`` for the scaled tensors, fresh leaves for the others (all need a gradient).

    ``alpha`` is cast once per device and dtype of the tensors (the product :func:`fold_alpha`
    makes at the end); with a graph, the alpha-gradient gathers through one cast and one unbind.
    """
    theta = [p.detach().requires_grad_() for p in ts.tensors]
    casts: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, ...]] = {}
    for k, i in enumerate(ts.scaled):
        w = ts.tensors[i].detach()
        key = (w.device, w.dtype)
        if key not in casts:
            casts[key] = a.to(device=w.device, dtype=w.dtype).unbind()
        theta[i] = casts[key][k] * w
    return theta


def scaled_leaves(ts: Tensors, a: torch.Tensor) -> list[torch.Tensor]:
    """The values of :func:`scaled_params` (bit for bit) as fresh leaves that need a gradient,
    without a graph to ``a`` (for a step whose alpha-gradient does not go through them); the
    products in one fused multiply."""
    theta = [p.detach() for p in ts.tensors]
    if ts.scaled:
        with torch.no_grad():
            products = torch._foreach_mul([theta[i] for i in ts.scaled], alpha_values(ts, a))
        for i, t in zip(ts.scaled, products, strict=True):
            theta[i] = t
    return [t.requires_grad_() for t in theta]


def alpha_values(ts: Tensors, a: torch.Tensor) -> list[float]:
    """``alpha_k`` as Python numbers, each rounded to its tensor's dtype: the factor that
    :func:`scaled_params` and :func:`fold_alpha` multiply by."""
    rounded: dict[torch.dtype, list[float]] = {}
    values = []
    for k, i in enumerate(ts.scaled):
        dtype = ts.tensors[i].dtype
        if dtype not in rounded:
            rounded[dtype] = a.detach().to(dtype).tolist()
        values.append(rounded[dtype][k])
    return values


def loss_at(
    model: nn.Module, loss_fn: LossFn, ts: Tensors, theta: Sequence[torch.Tensor], batch: Any
) -> torch.Tensor:
    # torch._weight_norm's native second derivative is wrong, and GradInit's steps use it
    with exact_weight_norm() if ts.weight_norm else contextlib.nullcontext():
        loss = loss_fn(AtParams(model, ts.slots, theta), batch)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            f"loss_fn must return a scalar tensor, got "
            f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}"
        )
    if torch.is_grad_enabled():
        require_grad(loss)
    return loss.reshape(())


def grads_or_zeros(
    outputs: torch.Tensor | Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor] | None = None,
    *,
    create_graph: bool = False,
    retain_graph: bool | None = None,
) -> list[torch.Tensor]:
    """``torch.autograd.grad`` with zeros for inputs the outputs do not depend on."""
    grads = torch.autograd.grad(
        outputs,
        list(inputs),
        grad_outputs=grad_outputs,
        create_graph=create_graph,
        retain_graph=retain_graph,
        allow_unused=True,
    )
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs, strict=True)]


SecondOrder = Callable[[Sequence[torch.Tensor]], None]
"""``check(grads)``: see :func:`second_order`."""


@contextmanager
def second_order(what: str, why: str, advice: str) -> Iterator[SecondOrder]:
    """Run a block that differentiates through gradients (``why``); a model that cannot be
    differentiated twice raises :class:`~initlab.measure.curvature.DoubleBackwardError` naming
    ``what``, ``why`` and ``advice`` (what to do instead).

    Inside, call the yielded ``check(tensors)`` on gradients built with ``create_graph=True`` and
    the loss they came from: it raises when their graph holds a ``@once_differentiable``
    backward, whose second derivative autograd would drop without an error (a silently wrong
    result).
    """

    def fail(cause: str) -> DoubleBackwardError:
        return DoubleBackwardError(
            f"{what} differentiates the loss twice ({why}), and the model has an operation "
            f"without a second derivative: {cause.rstrip('.')}. Use twice-differentiable "
            "operations in the model (e.g. a custom autograd.Function without "
            f"@once_differentiable), or {advice}",
            None,
            None,
        )

    def check(grads: Sequence[torch.Tensor]) -> None:
        if _cuts_second_order(list(grads)):
            raise fail("a backward marked @once_differentiable")

    try:
        yield check
    except (RuntimeError, NotImplementedError) as err:
        if isinstance(err, DoubleBackwardError) or not _is_second_order_error(err):
            raise
        raise fail(str(err).strip().splitlines()[0]) from err


def rank_mean(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Detached copies averaged over ranks (the detached tensors themselves without a group)."""
    if not is_distributed():
        return [t.detach() for t in tensors]
    out = [t.detach().clone() for t in tensors]
    all_reduce_sum(out)
    n = world_size()
    return [t / n for t in out]


def scalar_mean(value: torch.Tensor) -> float:
    return float(rank_mean([value.detach().double().reshape(1)])[0])


def _when(iteration: int) -> str:
    if iteration == 0:
        return "at the first iteration, before anything changed"
    return f"at iteration {iteration}; the model was left unchanged"


def check_finite(
    value: float, iteration: int, what: str, quantity: str = "loss", overflow: str = ""
) -> None:
    """Raise where ``value`` (the ``quantity``) is not finite; ``overflow`` (given for a float16
    model): what may have overflowed its range, named with the float32 copy to use."""
    if not math.isfinite(value):
        why = f". {float16_copy(what, overflow)}" if overflow else ""
        raise FloatingPointError(f"{what}: the {quantity} is {value} {_when(iteration)}{why}")


def float16_copy(what: str, overflowed: str) -> str:
    """The advice where ``overflowed`` may have overflowed a float16 model's range."""
    return (
        f"The model is float16, whose range (largest value 65504) {overflowed} overflowed; run "
        f"{what} on a float32 copy (m32 = copy.deepcopy(model).float(), the data in float32) and "
        "copy its weights back (model.load_state_dict(m32.state_dict()))"
    )


def warn_half_precision(ts: Tensors, what: str, why: str) -> None:
    """Warn when the scaled tensors are float16/bfloat16: the passes run in that dtype, and the
    steps on the scales follow signs that its rounding flips (``why``: how, for the method), so
    the scales can land far from a float32 run's."""
    half = sorted({str(ts.tensors[i].dtype).removeprefix("torch.") for i in ts.scaled
                   if ts.tensors[i].dtype in (torch.float16, torch.bfloat16)})  # fmt: skip
    if half:
        warnings.warn(
            f"{what}: the model's weights are {' and '.join(half)}: {why}, so the scales can "
            f"differ far from float32's. Run {what} on a float32 copy (m32 = copy.deepcopy("
            "model).float(), the data in float32) and copy its weights back (model."
            "load_state_dict(m32.state_dict()))",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def check_alpha_grad(
    grad: torch.Tensor, ts: Tensors, iteration: int, what: str, of: str, cause: str
) -> None:
    """Raise on a non-finite gradient in the scales of a finite loss (checked before), for what
    it is: a derivative that overflowed (a float16 model's range) or is undefined. Left to the
    optimizer, it made the scales NaN, reported later as a NaN loss or with the advice "lower
    lr", which cannot help. ``of``: the quantity differentiated; ``cause``: why its derivative
    may overflow float16."""
    if bool(torch.isfinite(grad).all()):
        return
    bad = [ts.names[i] for k, i in enumerate(ts.scaled) if not grad[k].isfinite()]
    reason = (
        float16_copy(what, cause)
        if ts.float16
        else "Its derivative overflowed or is undefined at these weights (a sqrt, norm or "
        "division at zero in the model or the loss)"
    )
    raise FloatingPointError(
        f"{what}: the alpha-gradient of {of} is not finite for {len(bad)} tensor(s) "
        f"({', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}) {_when(iteration)}, while the "
        f"loss is finite. {reason}"
    )


@contextmanager
def evaluation_modes(model: nn.Module, batch_stats: bool) -> Iterator[None]:
    """Dropout off; normalization with batch statistics if ``batch_stats``; then put back.

    On exit (success or failure) every buffer gets its saved value back (in place), so running
    statistics that the forward passes updated are bit-identical to before, and every module its
    ``training`` flag. A Hugging Face model's cache is off meanwhile (:func:`without_cache`).
    """
    with model_kept(model, params="never", buffers="always"), without_cache(model):
        set_evaluation_modes(model, batch_stats)
        yield


@contextmanager
def without_cache(model: nn.Module) -> Iterator[None]:
    """``model.config.use_cache = False`` inside the block, put back on exit: in eval mode a
    Hugging Face model keeps a key/value or recurrent-state cache, which a gradient does not need
    and RWKV writes in place ("modified by an inplace operation" in the backward); gradient
    checkpointing turns it off the same way."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", None) is not True:
        yield
        return
    config.use_cache = False  # type: ignore[union-attr]
    try:
        yield
    finally:
        config.use_cache = True  # type: ignore[union-attr]


def set_evaluation_modes(model: nn.Module, batch_stats: bool) -> None:
    """The modes of :func:`evaluation_modes`, set without saving anything to put back."""
    model.eval()
    if batch_stats:
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._NormBase):
                m.train()


@dataclass
class AlphaAdam:
    """Adam on the vector of scales (``RescaleAdam``: bias-corrected, eps outside the sqrt)."""

    lr: float
    m: torch.Tensor
    v: torch.Tensor
    t: int = 0

    @classmethod
    def zeros(cls, n: int, lr: float) -> AlphaAdam:
        z = torch.zeros(n, dtype=torch.float64, device="cpu")
        return cls(lr, z, z.clone())

    def step(self, alpha: torch.Tensor, grad: torch.Tensor, alpha_min: float) -> torch.Tensor:
        b1, b2 = _BETAS
        self.t += 1
        self.m = b1 * self.m + (1 - b1) * grad
        self.v = b2 * self.v + (1 - b2) * grad * grad
        denom = (self.v / (1 - b2**self.t)).sqrt() + _ADAM_EPS
        new = alpha - self.lr / (1 - b1**self.t) * self.m / denom
        return new.clamp_min(alpha_min)


def alpha_rows(model: nn.Module, ts: Tensors, alpha: torch.Tensor) -> list[dict[str, Any]]:
    """One row per scaled tensor; a tied tensor once, under its first name, with ``tied_to``
    its other names (``None`` for a tensor that is not tied)."""
    rows = []
    for k, i in enumerate(ts.scaled):
        layer, param = split_name(ts.names[i])
        rows.append(
            {
                "layer": layer,
                "param": param,
                "role": ts.roles[i],
                "alpha": float(alpha[k]),
                "norm_before": ts.norms[k],
                "norm_after": float(ts.tensors[i].detach().double().norm()),
                "tied_to": ", ".join(ts.tied[ts.names[i]]) if ts.names[i] in ts.tied else None,
            }
        )
    return rows


def fold_alpha(ts: Tensors, alpha: torch.Tensor, what: str) -> None:
    """``W <- alpha * W`` in place, once per distinct tensor (the product the iterations used),
    each entry rounded once to the tensor's dtype (the product taken in float32 at least: a
    bfloat16 ``alpha`` of 1.0027 is 1.0). Warns when a tensor's dtype cannot hold its scale:
    its norm moved by a factor off ``alpha`` by more than half the change ``alpha - 1``
    (and more than float32's rounding)."""
    bad = [ts.names[i] for k, i in enumerate(ts.scaled) if not math.isfinite(float(alpha[k]))]
    if bad:
        raise FloatingPointError(
            f"{what}: the scales of {len(bad)} tensor(s) are not finite ({', '.join(bad[:4])}"
            f"{' ...' if len(bad) > 4 else ''}); the model was left unchanged: lower lr (or "
            "alpha_min)"
        )
    off: list[str] = []
    with torch.no_grad():
        for k, i in enumerate(ts.scaled):
            w = ts.tensors[i]
            work = torch.promote_types(w.dtype, torch.float32)
            w.copy_(w.to(work) * alpha[k].to(dtype=work, device=w.device))
            before, a = ts.norms[k], float(alpha[k])
            if not w.is_floating_point() or not before > 0:
                continue
            applied = float(w.double().norm()) / before
            if abs(applied - a) > max(0.5 * abs(a - 1.0), 4 * torch.finfo(torch.float32).eps):
                off.append(f"{ts.names[i]}: alpha {a:.5g}, applied {applied:.5g} ({w.dtype})")
    overflow = [  # finite before (its norm), not after
        ts.names[i]
        for k, i in enumerate(ts.scaled)
        if math.isfinite(ts.norms[k]) and not bool(torch.isfinite(ts.tensors[i].detach()).all())
    ]
    if overflow:
        raise FloatingPointError(
            f"{what}: scaling {', '.join(overflow[:4])}{' ...' if len(overflow) > 4 else ''} "
            f"overflowed their dtype (scales up to {float(alpha.abs().max()):.3g}); the model was "
            "left unchanged: lower lr (or alpha_min)"
        )
    if off:
        warnings.warn(
            f"{what}: {len(off)} of {len(ts.scaled)} tensor(s) could not take their scale in "
            f"their dtype (each entry rounds to the nearest representable value): "
            f"{'; '.join(off[:4])}{' ...' if len(off) > 4 else ''}. Run {what} on a float32 copy "
            "of the model and cast it after (model.float(), then model.to(dtype)); the rows' "
            "norm_after / norm_before is the factor applied",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def known_length(data: Any) -> int | None:
    if is_single_batch(data):
        return 1
    try:
        return len(data)
    except TypeError:
        return None


def positive_int(what: str, key: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{what}: {key} must be a positive int, got {value!r}")
    return value


def check_number(
    what: str,
    key: str,
    value: object,
    *,
    low: float = 0.0,
    strict: bool = True,
    finite: bool = True,
) -> float:
    """``value`` as a float ``> low`` (``>= low`` unless ``strict``), finite unless ``finite``
    is False (a threshold such as a gradient-norm bound may be ``inf``: never reached)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        value = float(value)
        ok = not math.isnan(value) and (value > low if strict else value >= low)
        ok = ok and (math.isfinite(value) or not finite)
    if not ok:
        sign = ">" if strict else ">="
        kind = "a finite number" if finite else "a number"
        raise ValueError(f"{what}: {key} must be {kind} {sign} {low}, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def batch_pairs(
    data: Any,
    iterations: int | None,
    need_next: bool,
    what: str,
    counter: DataCounter | None = None,
    *,
    same_size: bool = False,
) -> Iterator[tuple[Any, Any]]:
    """``(S, next batch or None)`` per step, streaming; checks the length when it is known (data
    without a length and ``iterations=None`` is read up to the cap of
    :func:`~initlab._core.data.iter_batches`, whose error names ``steps=``, the entry points' knob).
    ``counter`` counts the batches and examples read (along its ``batch_dim``). ``same_size``: under
    ``torch.distributed``, every step's batch must hold as many examples on every rank (for a
    method that averages the ranks' means with equal weights: GradInit).

    Under ``torch.distributed`` the ranks agree first on the number of iterations (when every
    rank knows it) and then step in lockstep (:func:`~initlab._core.distributed.in_lockstep`):
    ranks with different numbers of batches, or a batch that fails its check on one rank, raise
    the same :class:`~initlab._core.distributed.RankMismatchError` on every rank."""
    total = run_together(what, lambda: _checked_iterations(data, iterations, need_next, what))
    check_same_count(total, what, "iterations")
    counter = counter or DataCounter()
    pairs = in_lockstep(_stream_pairs(data, total, need_next, what, counter), what)
    return _same_sizes(pairs, what, counter.batch_dim) if same_size and is_distributed() else pairs


def _same_sizes(
    pairs: Iterator[tuple[Any, Any]], what: str, batch_dim: int
) -> Iterator[tuple[Any, Any]]:
    """``pairs``, each step's batch checked to hold as many examples (along ``batch_dim``,
    :func:`~initlab._core.data.examples_in`) on every rank (one small all-reduce a step): the
    ranks' gradients are averaged with equal weights, so a rank with a smaller batch would count
    as much as one with a larger (the result off the single-process one on the union,
    silently)."""
    for s, nxt in pairs:
        check_same_count(examples_in(s, batch_dim), what, "examples in a batch")
        yield s, nxt


def _checked_iterations(
    data: Any, iterations: int | None, need_next: bool, what: str
) -> int | None:
    """The number of iterations (``None``: until the data ends); raises if too few batches, or
    if ``data`` is no batches at all (:func:`~initlab._core.data.check_data`)."""
    check_data(data, what)
    n = known_length(data)
    extra = 1 if need_next else 0
    if iterations is None:
        if n is not None:
            iterations = n - extra
            if iterations < 1:
                raise ValueError(
                    f"{what} needs at least {1 + extra} batches (one iteration reads batch t and, "
                    f"for S~, batch t+1) but the data gave {n}"
                )
    elif n is not None and n < iterations + extra:
        raise _too_few(what, iterations, need_next, n)
    return iterations


def _too_few(what: str, iterations: int, need_next: bool, got: int) -> ValueError:
    """The error for data with ``got`` batches, too few for ``iterations`` (the same whether the
    data's length is known up front or found by reading it)."""
    needed = iterations + (1 if need_next else 0)
    return ValueError(
        f"{what} needs {needed} batches for {iterations} "
        f"iteration{'s' if iterations != 1 else ''}"
        f"{' (each reads batch t and, for S~, batch t+1)' if need_next else ''} but the data "
        f"gave {got}: pass data with at least {needed} batches"
        f"{' (or fewer steps)' if iterations > 1 else ''}; the model was left unchanged"
    )


def _stream_pairs(
    data: Any, total: int | None, need_next: bool, what: str, counter: DataCounter
) -> Iterator[tuple[Any, Any]]:
    """The pairs of :func:`batch_pairs`, read lazily from ``data``."""
    needed = None if total is None else total + (1 if need_next else 0)
    it = counter.wrap(iter_batches(data, needed, what=what, bound="steps"))
    got = 0

    def pull() -> Any:
        nonlocal got
        b = next(it, _END)
        got += b is not _END
        return b

    def short(t: int) -> ValueError:
        return _too_few(what, total if total is not None else t + 1, need_next, got)

    current = pull()
    if current is _END:
        raise ValueError(f"{what} got no batch: the data is empty")
    t = 0
    while total is None or t < total:
        if need_next:
            nxt = pull()
            if nxt is _END:
                if total is None and t > 0:
                    return
                raise short(t)
            yield current, nxt
            current = nxt
        else:
            yield current, None
            if total is not None and t + 1 == total:
                return
            current = pull()
            if current is _END:
                if total is None:
                    return
                raise short(t + 1)
        t += 1
