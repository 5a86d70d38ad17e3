r"""Output scaling (Defazio & Bottou 2020, §6.4): give the logits a chosen standard deviation.

:func:`scale_output_` measures the std of the model's output on real batches and applies a fixed
scalar that gives it ``target`` (0.05 in the paper's experiments), folded into the last layer,
returned as an :class:`OutputScale` module, or attached as a removable forward hook
(:class:`OutputScaleHook`, ``how="hook"``, opt-in); :func:`measure_output_std` is the measurement
alone. Any model works, Hugging Face ones included: the output may be a tensor, a tuple (its first
tensor is the output), a dict (its ``"logits"``) or an object with ``.logits``.

Every method changes the model in place (or, where said, not at all), leaves no hooks behind (except
the one ``how="hook"`` adds on purpose and hands back), restores weights, buffers and train/eval
modes if it fails midway (``restore_on_failure``), never moves the model, and sums its statistics
over the ranks of a ``torch.distributed`` job (:func:`~initlab._core.distributed.all_reduce_sum`),
so all ranks end with identical weights (ranks that start from different weights, or whose data
fails to load or to run through the model on one rank, raise the same
:class:`~initlab._core.distributed.RankMismatchError` on every rank). Forward passes used only for
measuring leave buffers (BatchNorm running statistics) as they were, and run under a forked RNG
(seeded from ``generator`` when given), so dropout masks are reproducible and torch's global RNG
state is untouched.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import fx, nn

from initlab._core.compiled import hook_target, takes_compiled
from initlab._core.data import (
    DataUse,
    data_use,
    default_forward,
    masks_positions,
    output_key,
    output_tensor,
    real_positions,
    take_batches,
)
from initlab._core.distributed import (
    all_reduce_sum,
    check_same_parameters,
    run_together,
    same_options,
)
from initlab._core.hooks import hook_handles
from initlab._core.knobs import renamed_kwargs, user_stacklevel
from initlab._core.loss import model_loss
from initlab._core.method_report import MethodReport
from initlab._core.modules import first_names, refuse_shared_writes, shares_memory
from initlab._core.parametrized import listing_scope, writing_layers
from initlab._core.rng import Seeds
from initlab._core.rows import join_name
from initlab._core.state import restore_on_failure
from initlab.init._structure import find_classifier
from initlab.init.registry import Registry, default_registry
from initlab.measure.conditioning import weight_layers
from initlab.methods._measuring import (
    Forward,
    check_positive,
    execution_order,
    keep_buffers,
    rounding_tolerance,
)

__all__ = [
    "OUTPUT_SCALE_COLUMNS",
    "OutputScale",
    "OutputScaleHook",
    "measure_output_std",
    "scale_output_",
    "scaled_output",
]


def _times(t: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    return t * (scale.to(t.dtype) if isinstance(scale, torch.Tensor) else scale)


def _with_attr(obj: Any, name: str, value: Any) -> Any:
    """A new ``obj`` with attribute ``name`` set to ``value``: ``dataclasses.replace`` for a
    dataclass, ``_replace`` for a named tuple, else a shallow copy with the attribute set."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: f for f in dataclasses.fields(obj)}
        if name in fields and fields[name].init:
            return dataclasses.replace(obj, **{name: value})
    if isinstance(obj, tuple) and hasattr(obj, "_replace"):
        return obj._replace(**{name: value})
    try:
        new = copy.copy(obj)
        setattr(new, name, value)
    except (TypeError, AttributeError, copy.Error) as err:
        raise TypeError(
            f"cannot scale the .{name} of a {type(obj).__name__} output: it cannot be copied "
            f"with the attribute replaced ({err}); return a tensor, a tuple, a dict or a "
            "dataclass with .logits, or scale a submodule's output (module=)"
        ) from err
    return new


def _with_item(mapping: Mapping[Any, Any], key: Any, value: Any) -> Any:
    """A shallow copy of ``mapping`` (same type where it can be copied) with ``key`` set."""
    try:
        new = copy.copy(mapping)
        if isinstance(new, MutableMapping) and new is not mapping:
            new[key] = value
            return new
    except (TypeError, AttributeError, copy.Error):
        pass
    return {**mapping, key: value}


def _with_first(seq: tuple[Any, ...] | list[Any], i: int, value: Any) -> Any:
    items = list(seq)
    items[i] = value
    if type(seq) in (tuple, list):
        return type(seq)(items)
    if isinstance(seq, tuple) and hasattr(seq, "_fields"):
        return type(seq)(*items)  # a named tuple
    try:
        return type(seq)(items)
    except TypeError:
        return tuple(items) if isinstance(seq, tuple) else items


def scaled_output(output: Any, scale: float | torch.Tensor) -> Any:
    """``output`` with its output tensor multiplied by ``scale``; the input is not modified.

    The tensor is the one :func:`~initlab._core.data.output_tensor` reads (and
    :func:`measure_output_std` measures): the output itself when it is a tensor; a dict's
    ``"logits"`` (a shallow copy of the dict, of the same type where it can be copied, carries the
    scaled tensor; a Hugging Face ``ModelOutput`` is such a dict); an object's ``.logits`` (a new
    object: ``dataclasses.replace`` for a dataclass, ``_replace`` for a named tuple, else a shallow
    copy with the attribute set); else the first tensor of a dict's values, a tuple or a list (a
    new one of the same type). Everything else (``.loss``, caches, hidden states) is passed on
    as it was: a loss the model computed from its logits is *not* recomputed (scale the head's
    output, ``module="lm_head"``, for a loss of the scaled logits).

    Raises:
        TypeError: the output holds no tensor, or cannot be rebuilt with the scaled one.
    """
    if isinstance(output, (torch.Tensor, fx.Proxy)):  # a Proxy: torch.fx tracing the model
        return _times(output, scale)
    if isinstance(output, Mapping) and isinstance(output.get("logits"), torch.Tensor):
        return _with_item(output, "logits", _times(output["logits"], scale))
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return _with_attr(output, "logits", _times(logits, scale))
    if isinstance(output, Mapping):
        key = output_key(output.items())
        if key is not None:
            return _with_item(output, key, _times(output[key], scale))
    if isinstance(output, (tuple, list)):
        i = output_key(enumerate(output))
        if i is not None:
            return _with_first(output, i, _times(output[i], scale))
    raise TypeError(
        f"cannot scale a {type(output).__name__} output: it holds no tensor; return a tensor, a "
        "tuple whose first item is the output, a dict with 'logits' or an object with .logits"
    )


class OutputScale(nn.Module):
    """``x -> scale * x`` with a fixed (non-trainable) scalar ``scale`` kept in a buffer.

    The paper's "fixed scalar multiplication factor at the end of the network" (§6.4), for when the
    scale cannot be folded into the last layer: ``nn.Sequential(model, OutputScale(s))``. The
    input may be any model output (:func:`scaled_output`): a tensor, a tuple, a dict with
    ``"logits"`` or an object with ``.logits`` (a Hugging Face output), of which only the logits
    are scaled.

    ``nn.Sequential`` passes one positional argument, so it does not fit a keyword-input model
    (dict batches, ``model(**batch)``, Hugging Face models). Scale those with a forward hook
    instead: ``scale_output_(..., how="hook")``, or by hand
    ``handle = model.register_forward_hook(OutputScaleHook(s))`` (``handle.remove()`` undoes it).
    """

    scale: torch.Tensor

    def __init__(
        self,
        scale: float,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        # ``dtype``: the output's (float64 for a float64 model; default float32); ``device``: the
        # output's (default: torch's default device, as for torch's own modules); a normal tensor
        # even under torch.inference_mode() (scale_output_ called there): training saves it
        with torch.inference_mode(False):
            scale_t = torch.tensor(float(scale), dtype=dtype or torch.float32, device=device)
        self.register_buffer("scale", scale_t)

    def forward(self, x: Any) -> Any:
        return scaled_output(x, self.scale)

    def extra_repr(self) -> str:
        return f"scale={self.scale.item():.6g}"


class OutputScaleHook:
    """A forward hook ``(module, args, output) -> scale * output`` with a fixed float ``scale``.

    ``module.register_forward_hook(OutputScaleHook(s))`` multiplies the module's output by ``s``
    (the logits of any output :func:`scaled_output` takes) until the returned handle's
    ``.remove()`` is called. A plain picklable object (the model can be deep-copied or pickled with
    it), but not in the ``state_dict``: a checkpoint does not carry the scale.
    """

    def __init__(self, scale: float) -> None:
        self.scale = float(scale)

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        return scaled_output(output, self.scale)

    def __repr__(self) -> str:
        return f"OutputScaleHook(scale={self.scale:.6g})"


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


def _check_per_example(y: torch.Tensor, what: str) -> None:
    """Raise ``ValueError`` for a scalar output: one number per batch (a model that returns its
    own loss) has no logits to scale, and scaling it would scale the loss."""
    if y.dim() == 0:
        raise ValueError(
            f"{what}: the model's output is a scalar (0-d: its loss?), not per-example outputs: "
            "there are no logits to scale. Pass forward=lambda model, batch: <the logits> (e.g. "
            "the head's output), or scale the layer that computes them"
        )


def _output_moments(
    model: nn.Module,
    batches: Sequence[Any],
    forward: Forward,
    seeds: Seeds,
    what: str,
    seen: Callable[[torch.Tensor], None] = lambda y: None,
) -> tuple[torch.Tensor, list[torch.Tensor], bool]:
    """``[sum y, sum y^2, n]`` over all logits of all batches (and ranks), the outputs, and
    whether the model returned a loss of its own beside them (``.loss``). ``seen`` is called
    with the first batch's output while the model's whole output is still alive.

    Under DDP the forward passes run together (a pass that fails on some ranks raises on all).
    """

    def local() -> tuple[torch.Tensor, list[torch.Tensor], bool]:
        sums = torch.zeros(3, dtype=torch.float64, device="cpu")
        outs, own_loss = [], False
        with torch.no_grad(), keep_buffers(model):
            for i, batch in enumerate(batches):
                with seeds.scope(i):
                    raw = forward(model, batch)
                    y = output_tensor(raw)
                    _check_per_example(y, what)
                    if i == 0:
                        seen(y)
                    y = y.detach()
                own_loss = own_loss or model_loss(raw) is not None
                outs.append(y)
                real = real_positions(y, batch) if masks_positions(model) else y  # no padding
                y64 = real.to(torch.float64)
                n = y64.new_tensor(float(y64.numel()))  # on the output's device (CUDA: one sync)
                sums += torch.stack((y64.sum(), y64.square().sum(), n)).cpu()
        return sums, outs, own_loss

    sums, outs, own_loss = run_together(what, local)
    all_reduce_sum([sums])
    return sums, outs, own_loss


def _std(sums: torch.Tensor) -> float:
    s1, s2, n = sums.tolist()
    if n < 2:
        raise ValueError(f"the output has {int(n)} element(s); a std needs at least 2")
    if not (math.isfinite(s1) and math.isfinite(s2)):
        raise ValueError(
            "the model's output is not finite (NaN or inf) on the data, so its std is undefined: "
            "check the model (an overflow, a division by zero) before scaling its output"
        )
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

    ``std = sqrt(E[y^2] - E[y]^2)`` over every logit of every example; of a token model with
    padded batches, over its real tokens (a dict batch's ``attention_mask`` leaves the padded
    positions out, :func:`~initlab._core.data.real_positions`). Runs under ``no_grad``; the
    model's buffers are left as they were.
    """
    batches = run_together(
        "measure_output_std",
        lambda: take_batches(data, max_batches, what="measure_output_std", exact=False),
    )
    seeds = Seeds(model, generator)
    sums, _, _ = _output_moments(
        model, batches, forward or default_forward, seeds, "measure_output_std"
    )
    return _std(sums)


@takes_compiled(collective=True)
@renamed_kwargs(n_batches="max_batches")
@same_options
@writing_layers
def scale_output_(
    model: nn.Module,
    data: Any,
    *,
    target: float = 0.05,
    forward: Forward | None = None,
    module: str | None = None,
    how: Literal["fold", "module", "hook"] = "fold",
    max_batches: int | None = None,
    registry: Registry | None = None,
    generator: torch.Generator | int | None = None,
) -> MethodReport:
    """Give the model's output (logits) the standard deviation ``target`` on ``data`` (§6.4).

    Measures ``std`` of all output elements pooled over the batches given (summed over ranks when
    distributed; a padded token batch's real tokens: see :func:`measure_output_std`) and applies
    the fixed factor
    ``s = target / std``. The output may be a tensor, a tuple (its first tensor), a dict (its
    ``"logits"``) or an object with ``.logits`` (Hugging Face models); dict batches are passed as
    keywords (``model(**batch)``).

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
      ``ValueError`` suggests ``how="module"``. A head whose weight is tied (the same tensor as an
      input embedding's or another module's weight, as in most language models) is refused with a
      ``ValueError`` naming the tie: scaling it would scale the embedding too; so is a weight or
      bias that is a distinct Parameter over another's memory (``nn.Parameter(emb.weight.data)``).
    * ``how="module"``: the model is left unchanged and ``report.info["module"]`` is an
      :class:`OutputScale` ``(s)`` on the output's device, for
      ``nn.Sequential(model, report.info["module"])``. This
      always reaches the target but adds a module, which is why it is never done behind the
      user's back. ``nn.Sequential`` passes no keywords: for a keyword-input model use
      ``how="hook"``.
    * ``how="hook"`` (opt-in): the weights are left unchanged and an :class:`OutputScaleHook`
      ``(s)`` is registered as a forward hook on the model itself (its output is scaled), or on
      the submodule named ``module`` (e.g. ``"lm_head"``; the model's output must then be ``s``
      times the old one, checked on the first batch as for ``"fold"``, and a loss the model
      computes from the head's output sees the scaled logits). ``report.info["handle"]`` is the
      hook's handle: **the hook persists until** ``report.info["handle"].remove()``, which puts
      the model back exactly as it was. It is the only hook any method of initlab leaves on the
      model, and only when asked for; it is not in the ``state_dict``.
      On a ``torch.compile``'d model the hook goes on the compiled model the user holds (its
      hooks run on every call; a hook on the module it wraps is not run by a graph compiled
      before it), and a ``module`` inside compiled code is refused.

    Conditioning: the paper puts the scalar *after* the last layer as a fixed multiplier, which
    leaves every layer's GR scaling as it was. Folding it into the last layer's weights gives the
    same function but a different parametrization: that layer's γ is multiplied by ``1/s⁴``
    (a conditioning multiplier α = s, Section 5), so with ``s = 0.05`` the last layer ends up
    ~10⁵× out of balance. Use ``how="module"`` or ``"hook"`` to keep the network balanced,
    ``"fold"`` when the architecture must not change.

    Args:
        model: the model, in the mode it should be measured in.
        data: one batch or many (the rule: :mod:`initlab._core.data`).
        target: the std the logits get (the paper uses 0.05; 0.01 to 0.1 works).
        forward: ``forward(model, batch) -> output`` (default
            :func:`~initlab._core.data.default_forward`); a dict output uses its ``"logits"``.
        module: ``"fold"``: name of the layer to fold into (default: the last weight layer to
            run); ``"hook"``: name of the module whose output is scaled (default: the model).
        how: ``"fold"``, ``"module"`` or ``"hook"``.
        max_batches: use at most this many batches of ``data`` (default all; data without a
            length, a generator or an ``IterableDataset``, up to 1000 batches, and more raise;
            ``n_batches=`` before 0.2).
        registry: the layer registry (which modules are weight layers).
        generator: seeds the RNG of the measurement passes (dropout in train mode); the method
            draws nothing itself.

    Returns:
        :class:`~initlab.MethodReport`, one row
        (:data:`~initlab.methods.output_scale.OUTPUT_SCALE_COLUMNS`); ``info`` has ``scale``,
        ``std_before``, ``std_after``, ``layer`` (the layer folded into, the module hooked, ``""``
        for the model itself or ``how="module"``), and ``module`` for ``how="module"``, ``hook`` and
        ``handle`` for ``how="hook"``.

    Raises:
        ValueError: an unknown ``how`` or ``module``; a zero-std output; a fold (or a hook on a
            submodule) that is not exact; a fold into a tied head.

    Example:
        >>> net = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
        >>> x = torch.randn(512, 10, generator=torch.Generator().manual_seed(0))
        >>> from initlab.methods.output_scale import measure_output_std
        >>> report = scale_output_(net, x, target=0.05)
        >>> report.info["layer"], round(measure_output_std(net, x), 6)
        ('2', 0.05)
    """
    start = time.perf_counter()
    if how not in ("fold", "module", "hook"):
        raise ValueError(f"unknown how={how!r}; valid values: 'fold', 'module', 'hook'")
    target = check_positive("target", target)
    forward = forward or default_forward
    reg = default_registry() if registry is None else registry
    check_same_parameters(model, "scale_output_", modes=True)
    batches = run_together(
        "scale_output_",
        lambda: take_batches(data, max_batches, what="scale_output_", exact=False, keep_rng=True),
    )
    used = data_use(batches)
    seeds = Seeds(model, generator)
    passes = 0
    with restore_on_failure(model):
        with listing_scope():  # how="fold" asks again about the layer it writes, which refuses
            layers = [name for name, *_ in weight_layers(model, reg)]
        module = _check_module(model, module, layers, how)
        with _producer(model, layers) as producer:
            order, _, (sums, outs, own_loss) = execution_order(
                model,
                layers,
                lambda: _output_moments(model, batches, forward, seeds, "scale_output_", producer),
            )
        passes += len(batches)
        std = _std(sums)
        if not std > 0:
            raise ValueError("the output has zero std on the data: no scale can reach the target")
        s = target / std
        info: dict[str, Any] = {"scale": s, "std_before": std, "std_after": s * std, "how": how}
        if how == "module":
            info["layer"] = ""
            wide = outs[0].is_floating_point() and outs[0].dtype == torch.float64
            info["module"] = OutputScale(
                s, dtype=torch.float64 if wide else None, device=outs[0].device
            )
        elif how == "fold":
            name = _fold_layer(model, module, producer, order)
            info["layer"] = name
            _refuse_tied(model, name, reg)
            _refuse_frozen(model, name, reg)
            _fold_checked(model, name, s, reg, batches[0], outs[0], forward, seeds)
            passes += 1
    if how == "hook":
        if not module and own_loss:
            warnings.warn(_own_loss_hook_note(model), UserWarning, stacklevel=user_stacklevel())
        # Outside restore_on_failure, which removes every hook added inside it.
        info["layer"] = module or ""
        info["hook"] = OutputScaleHook(s)
        info["handle"] = _attach_hook(
            model, info["layer"], info["hook"], batches[0], outs[0], forward, seeds
        )
        passes += 1  # _attach_hook's check pass, on the model or a module
    return _report(info, how, std, s, target, passes, start, used)


def _report(
    info: dict[str, Any],
    how: str,
    std: float,
    s: float,
    target: float,
    passes: int,
    start: float,
    used: DataUse,
) -> MethodReport:
    """:func:`scale_output_`'s report: its one row, the passes and ``info``."""
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
        used=used,
    )


class _Producer:
    """Which weight layer's output is the output measured (or a view of it): forward hooks keep
    a weak reference to each layer's latest output; called with the measured output (while the
    model's output holds it), :attr:`name` is the last layer to run whose output shares its
    memory (``None``: none does, something computed after them). A model that returns a dict
    or tuple of heads folds into the one its logits come from, not the last to run."""

    def __init__(self) -> None:
        self.latest: dict[str, weakref.ref[torch.Tensor]] = {}
        self.name: str | None = None

    def hook(self, name: str) -> Callable[..., None]:
        def keep(module: nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor):
                self.latest.pop(name, None)  # the order of the dict: the order of the calls
                self.latest[name] = weakref.ref(output)

        return keep

    def __call__(self, y: torch.Tensor) -> None:
        found = [n for n, ref in self.latest.items() if (t := ref()) is not None and _same(t, y)]
        self.name = found[-1] if found else None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` share their memory (the same storage)."""
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() != 0
    except (RuntimeError, NotImplementedError):
        return a is b


@contextmanager
def _producer(model: nn.Module, layers: list[str]) -> Iterator[_Producer]:
    """A :class:`_Producer` hooked on ``layers`` for the block."""
    modules, producer = dict(model.named_modules()), _Producer()
    with hook_handles() as handles:
        for name in layers:
            handles.add(modules[name].register_forward_hook(producer.hook(name)))
        yield producer


def _output_layer(model: nn.Module, order: list[str]) -> str | None:
    """The layer to fold into when no layer's output is the output (:class:`_Producer`): the one
    the logits come out of where the model says
    which (its ``get_output_embeddings()``; a classifier's or detector's output layer,
    :func:`~initlab.init._structure.find_classifier`) and it ran; else the last weight layer to
    run (DETR's box predictor runs after its class head, which its logits come out of)."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if isinstance(head, nn.Module):
        wanted = {id(p) for p in head.parameters(recurse=False)}
    else:
        found = find_classifier(model, {id(p): {"weight"} for p in model.parameters()})
        wanted = {found[0]} if found is not None else set()
    for name, module in model.named_modules():
        if name in order and any(id(p) in wanted for p in module.parameters(recurse=False)):
            return name
    return order[-1] if order else None


def _fold_layer(model: nn.Module, module: str | None, producer: _Producer, order: list[str]) -> str:
    """The layer ``how="fold"`` folds into: ``module`` if named, else the weight layer that
    produced the output, else the last weight layer to run (:func:`_output_layer`)."""
    name = module if module is not None else producer.name
    name = name if name is not None else _output_layer(model, order)
    if name is None:
        raise ValueError("no weight layer ran in the forward pass: nothing to fold into")
    return name


def _check_module(model: nn.Module, module: str | None, layers: list[str], how: str) -> str | None:
    """``module`` names a submodule (returned under its first name: a second name is the module
    too); for a fold (and, as before, ``how="module"``), a weight layer."""
    if module is None or (how == "hook" and module == ""):
        return module
    names = first_names(model)
    if module not in names:
        raise ValueError(f"model has no module named {module!r}")
    module = names[module]
    if how != "hook" and module not in layers:
        raise ValueError(f"module {module!r} has no weight parameter to fold the scale into")
    return module


def _refuse_tied(model: nn.Module, name: str, registry: Registry) -> None:
    """Raise if a weight or bias of layer ``name`` is also another module's parameter, e.g. a
    language model's head tied to the input embedding; or a distinct Parameter over another's
    memory (``nn.Parameter(embed.weight.data)``: not a tie, the shared refusal of
    :func:`~initlab._core.modules.refuse_shared_writes`)."""
    layer = dict(model.named_modules())[name]
    own = [
        (spec.name, getattr(layer, spec.name))
        for spec in registry.specs(layer, name) or []
        if spec.role in ("weight", "bias")
    ]
    refuse_shared_writes(
        "scale_output_",
        model,
        [t for _, t in own if isinstance(t, torch.Tensor)],
        f"how='fold' multiplies {name}'s weight and bias in place by the scale, so it would "
        "multiply the other tensor over that memory too (how='hook', module="
        f"{name!r} or how='module' leave the weights as they are)",
    )
    ties: list[str] = []
    for other_name, other in model.named_modules(remove_duplicate=False):
        if other is layer:
            continue
        for pname, p in other._parameters.items():
            if p is None:
                continue
            for own_name, t in own:
                if isinstance(t, torch.Tensor) and shares_memory(t, p):
                    ties.append(f"{join_name(name, own_name)} is {join_name(other_name, pname)}")
    if ties:
        raise ValueError(
            f"cannot fold the output scale into {name!r}: its weight is tied "
            f"({'; '.join(dict.fromkeys(ties))}), so scaling it would scale the tied module too. "
            f"Use how='hook', module={name!r} (a removable forward hook on this layer: the "
            "model's own loss sees the scaled output), how='hook' (on the model's output) or "
            "how='module' (an OutputScale module to append)"
        )


def _refuse_frozen(model: nn.Module, name: str, registry: Registry) -> None:
    """Raise if the weight of layer ``name`` is frozen (``requires_grad=False``): folding would
    change a tensor the user holds fixed (every initlab method keeps frozen tensors)."""
    layer = dict(model.named_modules())[name]
    frozen = [
        join_name(name, spec.name)
        for spec in registry.specs(layer, name) or []
        if spec.role in ("weight", "bias")
        and isinstance(t := getattr(layer, spec.name), torch.Tensor)
        and not t.requires_grad
    ]
    if frozen:
        raise ValueError(
            f"cannot fold the output scale into {name!r}: {', '.join(frozen)} is frozen "
            "(requires_grad=False). Use how='hook' or how='module' (the frozen weights stay as "
            "they are), or unfreeze the layer"
        )


def _output_error(
    model: nn.Module,
    s: float,
    batch: Any,
    out_before: torch.Tensor,
    forward: Forward,
    seeds: Seeds,
) -> tuple[bool, float]:
    """Run ``batch`` once (buffers kept); whether the output is *not* ``s * out_before`` on any
    rank (to rounding), and this rank's relative error."""
    with torch.no_grad(), keep_buffers(model), seeds.scope(0):
        after = output_tensor(forward(model, batch)).detach()
    want = out_before.to(torch.float64) * s
    err = (after.to(torch.float64) - want).norm() / want.norm().clamp_min(1e-300)
    bad = torch.tensor(
        [float(err > rounding_tolerance(after, 1e-5))], dtype=torch.float64, device="cpu"
    )
    all_reduce_sum([bad])
    return bad.item() > 0, err.item()


def _own_loss_hook_note(model: nn.Module) -> str:
    """The warning of ``how="hook"`` on a model that returns its own loss: the loss is not
    recomputed from the scaled logits."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    names = {id(m): n for n, m in model.named_modules()}
    named = (
        f"module={names[id(head)]!r} (its output embeddings)"
        if id(head) in names
        else ("module='<the head whose output the loss reads>'")
    )
    return (
        "scale_output_(how='hook') on the model itself: the model returns a loss of its own "
        "(.loss), computed from its logits inside the forward, which a hook on the model's output "
        "does not change: training on model(**batch).loss will not see the scale (the logits "
        f"do). To train on that loss, hook the head instead, {named}, or use how='fold'"
    )


def _attach_hook(
    model: nn.Module,
    name: str,
    hook: OutputScaleHook,
    batch: Any,
    out_before: torch.Tensor,
    forward: Forward,
    seeds: Seeds,
) -> Any:
    """Register ``hook`` on module ``name`` (``""``: the model; on the ``torch.compile`` wrapper
    the user's model calls it through, :func:`~initlab._core.compiled.hook_target`) and return
    its handle, after checking (one pass) that the output measured is scaled exactly."""
    target = hook_target(model, name, "scale_output_(how='hook')")
    if any(isinstance(h, OutputScaleHook) for h in target._forward_hooks.values()):
        warnings.warn(
            f"scale_output_: {name or 'the model'} already has an output scale hook (an earlier "
            "scale_output_(how='hook')); this one multiplies after it (by about 1, the output "
            "being scaled already). Remove the old one with its report's info['handle'].remove()",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    handle = target.register_forward_hook(hook)
    try:
        bad, err = _output_error(model, hook.scale, batch, out_before, forward, seeds)
    except BaseException:
        handle.remove()
        raise
    if bad and not name:
        handle.remove()
        raise ValueError(
            "a hook on the model's output does not scale the output measured by the same factor "
            f"(relative error {err:.2e}): forward= computes something not degree-1 homogeneous "
            "in it. Pass a forward= that returns the model's output, or use how='module'"
        )
    if bad:
        handle.remove()
        raise ValueError(
            f"scaling the output of {name!r} does not scale the model's output by the same "
            f"factor (relative error {err:.2e}; something not degree-1 homogeneous follows it). "
            "Hook the model itself (module=None) or use how='module'"
        )
    return handle


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
    specs = registry.specs(layer, name) or []
    with torch.no_grad():
        for spec in specs:
            if spec.role in ("weight", "bias"):
                getattr(layer, spec.name).mul_(s)
    bad, err = _output_error(model, s, batch, out_before, forward, seeds)
    if bad:
        raise ValueError(
            f"folding the output scale into {name!r} is not exact: the output is not "
            f"linear in that layer's weight and bias (relative error {err:.2e}; "
            "something with parameters, or a non-homogeneous function, follows it). "
            "Use how='module' to get an OutputScale module to append (how='hook' for a "
            "keyword-input model), or name the right layer with module="
        )
