"""Which tensor of a module is "the weight", and what its fans are: one registry of layer handlers.

A *handler* is a small function ``handler(module) -> Iterable[ParamSpec]`` that names the module's
own (direct) parameters and gives each a role (:data:`ROLES`) and, for weights, its
:class:`~initlab.Fans` -- per block for fused weights (the q/k/v blocks of an attention
``in_proj_weight``, the gates of an LSTM). Handlers never choose an initialization formula; a scheme
turns fans into a distribution, and ``init_model`` applies it. Adding a layer type is one handler
function plus one :func:`register_handler` call::

    register_handler(MyTransposedLinear, transposed_linear_handler)

Everything a handler returns is validated against the module it describes (names exist, blocks tile
dim 0, fans agree with :func:`~initlab.compute_fans`), and :meth:`Registry.register` validates
the handler itself when it is registered (and its output right away when ``example=`` is given), so
a wrong handler fails loudly at registration instead of silently mis-initializing a model.

Lookup walks ``type(module).__mro__``: a subclass without a handler of its own uses its parent's
(``NonDynamicallyQuantizableLinear`` -> ``Linear``'s; ``LazyConv2d`` -> ``Conv2d``'s). A key can be
a dotted class path (``"transformers.pytorch_utils.Conv1D"``), so a type from a library that may not
be installed is registered without importing it. :meth:`Registry.specs` returns ``None`` for a
module no handler claims; what to do then (error, warn, skip) is the caller's explicit policy.

Why a process-wide default registry exists: like :mod:`copyreg` for pickling, a library that
defines a layer registers its handler once, at import, and every later ``init_model`` call in the
process picks it up without the user threading a registry through their code. Mutating shared state
is the price, so the default is built lazily on first use (no work at import time),
:meth:`Registry.copy` gives an independent copy, and ``init_model(..., registry=...)`` takes a
private registry for code (and tests) that must not see or cause global changes.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Iterable
from dataclasses import replace

import torch
from torch import nn
from torch.nn.utils import parametrize, prune

from initlab._core.parametrized import computed, registry_reads_computed, trainable
from initlab.init._experts import expert_layout, router_experts
from initlab.init._norm_like import norm_identity
from initlab.init.fans import Fans, compute_fans
from initlab.init.specs import _FAN_ROLES, ROLES, Block, ParamSpec

__all__ = [
    "ROLES",
    "Block",
    "Handler",
    "ParamSpec",
    "Registry",
    "bilinear_handler",
    "conv_handler",
    "default_registry",
    "embedding_handler",
    "experts_handler",
    "linear_fans",
    "linear_handler",
    "multihead_attention_handler",
    "norm_handler",
    "norm_like_handler",
    "register_handler",
    "rnn_cell_handler",
    "rnn_handler",
    "router_handler",
    "transposed_linear_handler",
]

Handler = Callable[[nn.Module], Iterable[ParamSpec]]
"""A function from a module to the specs of its direct parameters."""

RegistryKey = type[nn.Module] | str


def _dotted(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _key_name(key: RegistryKey) -> str:
    return key if isinstance(key, str) else _dotted(key)


def _handler_name(handler: object) -> str:
    module = getattr(handler, "__module__", None)
    qualname = getattr(handler, "__qualname__", None)
    if qualname is None:
        return repr(handler)
    return f"{module}.{qualname}" if module else qualname


def _check_key(module_type: object) -> None:
    if isinstance(module_type, str):
        parts = module_type.split(".")
        if len(parts) < 2 or not all(parts):
            raise ValueError(
                f"a string key must be a dotted class path 'pkg.module.ClassName', "
                f"got {module_type!r}"
            )
    elif not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise ValueError(
            f"module_type must be an nn.Module subclass or a dotted class path string, "
            f"got {module_type!r}"
        )


def _check_handler(handler: object) -> None:
    if not callable(handler):
        raise ValueError(f"handler must be callable, got {handler!r}")
    try:
        signature = inspect.signature(handler)
    except (TypeError, ValueError):  # some builtins have no signature; nothing to check
        return
    try:
        signature.bind(object())
    except TypeError as err:
        raise ValueError(
            f"handler {_handler_name(handler)} must accept exactly one positional argument "
            f"(the module), but its signature is {signature}: {err}"
        ) from None


def _register_again(parametrization: nn.Module, name: str) -> str | None:
    """The ``torch.nn.utils.parametrizations`` call that registers ``parametrization`` again on
    tensor ``name`` with its own options (a Wav2Vec2 positional conv's ``weight_norm`` has
    ``dim=2``; the default, 0, would give it another norm); ``None`` for another kind."""
    kind, p = type(parametrization).__name__, parametrization
    where = "torch.nn.utils.parametrizations"
    if kind == "_WeightNorm":
        return f"{where}.weight_norm(layer, {name!r}, dim={p.dim})"
    if kind == "_SpectralNorm":
        return (
            f"{where}.spectral_norm(layer, {name!r}, n_power_iterations="
            f"{p.n_power_iterations}, eps={p.eps:g}, dim={p.dim})"
        )
    if kind == "_Orthogonal":
        trivial = "" if "base" in p._buffers else ", use_trivialization=False"
        options = f"orthogonal_map={p.orthogonal_map.name!r}{trivial}"
        return f"{where}.orthogonal(layer, {name!r}, {options})"
    return None


def _way_back(module: nn.Module, name: str) -> str:
    """How to take the parametrizations off ``module``'s tensor ``name`` keeping its current
    value, and the call that registers them again after (the generic one for a stack of them or
    another kind)."""
    plist = module.parametrizations[name]
    again = (_register_again(plist[0], name) if len(plist) == 1 else None) or (
        f"torch.nn.utils.parametrize.register_parametrization(layer, {name!r}, ...)"
    )
    return (
        f"torch.nn.utils.parametrize.remove_parametrizations(layer, {name!r}) keeps the current "
        f"values (then {again})"
    )


def _refuse_parametrized(module: nn.Module, names: list[str], where: str = "") -> None:
    """Raise ValueError if some of ``names`` are computed by parametrizations
    (``torch.nn.utils.parametrize``: ``weight_norm``, ``spectral_norm``, ``orthogonal``...):
    such a ``weight`` is not a tensor that can be read, written or scaled in place. ``where``:
    the module's qualified name in the model, for the message."""
    kinds = {
        name: sorted({type(p).__name__ for p in module.parametrizations[name]})
        for name in names
        if parametrize.is_parametrized(module, name)
    }
    if not kinds:
        return
    what = ", ".join(f"{name!r} by {' and '.join(k)}" for name, k in kinds.items())
    ours = any("ConditioningMultiplier" in k for k in kinds.values())
    hint = (
        ". A ConditioningMultiplier is precondition_(how='parametrize')'s: its report has "
        "gamma_after, and gr_scaling of the model as it was before, with "
        "alpha=report.info['alpha'], measures it"
        if ours
        else ""
    )
    ways = "; ".join(_way_back(module, name) for name in kinds)
    cls = _dotted(type(module).__bases__[0])
    layer = f"the layer {where!r} (a {cls})" if where else f"a {cls}"
    raise ValueError(
        f"{layer} has parametrized tensors ({what}; torch.nn.utils.parametrize): initlab reads "
        "and writes a layer's own tensors and does not handle parametrizations. Remove them for "
        f"this call and register them again after, each of them: {ways}"
        f"{_renormalized(kinds)}{hint}"
    )


#: The parametrizations that renormalize the tensor they are registered on, and how.
_RENORMALIZE = {
    "_SpectralNorm": "spectral_norm divides the tensor by its largest singular value",
    "_Orthogonal": "orthogonal makes every singular value of the tensor 1",
}


def _renormalized(kinds: dict[str, list[str]]) -> str:
    """The caveat of the way out above for a parametrization that renormalizes: registered
    again, it undoes the scale an init drew (only the directions stay)."""
    found = [_RENORMALIZE[k] for ks in kinds.values() for k in ks if k in _RENORMALIZE]
    if not found:
        return ""
    return (
        f". Registered again, {' and '.join(dict.fromkeys(found))}: the scale an init gave it "
        "(init_model, lsuv_, gradinit_, a fold) is lost; the parametrization sets the scale, "
        "not the scheme (to change it, scale the layer's output). Measuring this way (diagnose, "
        "gr_scaling) loses nothing: the values kept are already normalized"
    )


_NORM_HOOKS = {  # hook class -> (the function that adds it, the one that removes it)
    "WeightNorm": ("weight_norm", "remove_weight_norm"),
    "SpectralNorm": ("spectral_norm", "remove_spectral_norm"),
}


def _refuse_norm_hooks(module: nn.Module, names: list[str] | None, where: str = "") -> None:
    """The same refusal for the older, hook-based ``torch.nn.utils.weight_norm`` and
    ``spectral_norm``, and for ``torch.nn.utils.prune``, which recompute a tensor before every
    forward from other tensors (pruning: ``weight = weight_orig * weight_mask``): for those of
    ``names`` (``None``: any) a hook recomputes. ``where``: the module's qualified name in the
    model, for the message."""
    cls = _dotted(type(module))
    layer = f"the layer {where!r} (a {cls})" if where else f"a {cls}"
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, prune.BasePruningMethod):
            if names is None or hook._tensor_name in names:
                raise _pruned(layer, hook, where)
            continue
        kind = type(hook).__name__
        if kind in _NORM_HOOKS and (names is None or getattr(hook, "name", None) in names):
            added, remove = _NORM_HOOKS[kind]
            raise ValueError(
                f"{layer}'s {hook.name!r} is recomputed before every forward by "
                f"torch.nn.utils.{added} (a {kind} hook): initlab reads and writes a layer's own "
                "tensors. Remove it for this call and apply it again after: "
                f"torch.nn.utils.{remove}(layer) keeps the current values"
            )


def _pruned(layer: str, hook: prune.BasePruningMethod, where: str) -> ValueError:
    """The refusal of a tensor pruned by ``torch.nn.utils.prune`` (``hook``, a pruning method or
    a ``PruningContainer`` of several) on ``layer``: its forward's ``name`` is
    ``name_orig * name_mask``, no parameter; the parameter ``name_orig`` is not what it uses."""
    name = hook._tensor_name
    methods = getattr(hook, "_pruning_methods", (hook,))
    kinds = " then ".join(type(m).__name__ for m in methods)
    get = f"layer = model.get_submodule({where!r}); " if where else ""
    return ValueError(
        f"{layer}'s {name!r} is pruned by torch.nn.utils.prune ({kinds}): the forward uses "
        f"{name} = {name}_orig * {name}_mask, recomputed by a forward pre-hook, and initlab reads "
        f"and writes a layer's own tensors (the parameter {name}_orig is not the {name} the "
        f"forward uses). Remove the pruning for this call and apply it again after: {get}"
        f"mask = layer.{name}_mask.clone(); torch.nn.utils.prune.remove(layer, {name!r}) makes "
        f"{name} a plain parameter holding {name}_orig * {name}_mask; after the call, "
        f"torch.nn.utils.prune.custom_from_mask(layer, {name!r}, mask) prunes it again "
        f"({name}_orig then holds {name} as it is then, which the mask multiplies)"
    )


def _tensors_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """The direct parameters of ``module``, and those its parametrizations compute
    (:func:`~initlab._core.parametrized.computed`) where the registry reads computed tensors
    (:func:`~initlab._core.parametrized.registry_reads_computed`); inside a writer, the frozen
    ones (computed from tensors that all have ``requires_grad=False``), which a writer leaves
    as they are (the trainable ones it refuses)."""
    tensors: dict[str, torch.Tensor] = dict(module.named_parameters(recurse=False))
    if parametrize.is_parametrized(module):
        for name in module.parametrizations:
            if registry_reads_computed() or not trainable(module, name):
                tensors[name] = computed(module, name)
    return tensors


def _shape(module: nn.Module, name: str) -> torch.Size:
    """The shape of ``module``'s tensor ``name``, a computed one evaluated without side effects."""
    if parametrize.is_parametrized(module, name):
        return computed(module, name).shape
    return getattr(module, name).shape


def _validate_specs(module: nn.Module, specs: list[ParamSpec], handler: Handler) -> None:
    """Raise ValueError unless ``specs`` correctly describe direct parameters of ``module``."""

    def fail(problem: str) -> ValueError:
        return ValueError(
            f"handler {_handler_name(handler)} returned invalid specs for "
            f"{_dotted(type(module))}: {problem}"
        )

    params = _tensors_of(module)
    seen: set[str] = set()
    for spec in specs:
        if not isinstance(spec, ParamSpec):
            raise fail(f"expected ParamSpec items, got {type(spec).__name__} ({spec!r})")
        name = spec.name
        if name in seen:
            raise fail(f"parameter {name!r} is named twice")
        seen.add(name)
        if name not in params:
            if name in module._parameters:  # registered, but set to None
                raise fail(f"parameter {name!r} is None on this module")
            raise fail(
                f"no direct parameter named {name!r}; the module has {sorted(params) or 'none'}"
            )
        if spec.role not in _FAN_ROLES:
            continue
        shape = tuple(params[name].shape)
        if spec.stacked:
            if len(shape) != 3:
                raise fail(f"stacked parameter {name!r} has shape {shape}; it needs 3 dims")
            # one matrix, (out, in) whatever the layout: the checks below as for a plain weight
            shape = shape[:0:-1] if spec.transposed else shape[1:]
            spec = replace(spec, transposed=False)
        if spec.blocks:
            _validate_blocks(spec, shape, fail)
        else:
            where = (
                f"parameter {name!r} of shape {shape} (groups={spec.groups}, "
                f"transposed={spec.transposed})"
            )
            _check_fans(spec, spec.fans, shape, where, fail)


def _stride_of(fans: Fans | None, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """``{"stride": (s, 1, ...)}`` for fans that divide ``fan_in`` by a transposed convolution's
    total stride ``s`` (only the product matters to :func:`compute_fans`), else ``{}``."""
    if fans is None or fans.stride == 1:
        return {}
    return {"stride": (fans.stride, *([1] * (len(shape) - 3)))}


def _validate_blocks(
    spec: ParamSpec,
    shape: tuple[int, ...],
    fail: Callable[[str], ValueError],
) -> None:
    """Raise ``fail(...)`` unless the blocks tile dim 0 exactly and each block's fans are right."""
    name, rows = spec.name, shape[0] if shape else 0
    if any(b.step != 1 for b in spec.blocks):  # interleaved rows: each row in exactly one block
        taken = sorted(r for b in spec.blocks for r in range(rows)[b.rows])
        if taken != list(range(rows)) or any(b.stop > rows for b in spec.blocks):
            raise fail(f"the blocks of {name!r} do not take each of its {rows} rows once")
    position = 0
    for block in sorted(spec.blocks, key=lambda b: b.start):
        if block.step != 1:
            where = f"block rows {block.start}::{block.step} of {name!r} (shape {shape})"
            _check_fans(spec, block.fans, (len(block), *shape[1:]), where, fail)
            continue
        where = f"block [{block.start}, {block.stop}) of {name!r} (shape {shape})"
        if block.start < position:
            raise fail(f"{where} overlaps the previous block, which ends at row {position}")
        if block.start > position:
            raise fail(f"{where} leaves rows [{position}, {block.start}) uncovered")
        if block.stop > rows:
            raise fail(f"{where} runs past dim 0, which has {rows} rows")
        _check_fans(spec, block.fans, (block.stop - block.start, *shape[1:]), where, fail)
        position = block.stop
    if position != rows and all(b.step == 1 for b in spec.blocks):
        raise fail(f"blocks of {name!r} cover rows [0, {position}) of {rows}; they must cover all")


def _check_fans(
    spec: ParamSpec,
    fans: Fans | None,
    shape: tuple[int, ...],
    where: str,
    fail: Callable[[str], ValueError],
) -> None:
    """Raise ``fail(...)`` unless ``fans`` are :func:`~initlab.compute_fans` of ``shape`` in the
    spec's layout (a whole parameter, or one block of it); ``where`` names it."""
    try:
        expected = compute_fans(
            shape, groups=spec.groups, transposed=spec.transposed, **_stride_of(fans, shape)
        )
    except ValueError as err:
        raise fail(f"{where}: {err}") from None
    if fans != expected:
        raise fail(f"{where} has fans {expected}, but the spec says {fans}")


class Registry:
    """A mapping from module types (or dotted class paths) to handlers.

    Example:
        >>> reg = default_registry().copy()
        >>> [(s.name, s.role, s.fans) for s in reg.specs(nn.Linear(3, 2))]
        [('weight', 'weight', Fans(fan_in=3, fan_out=2, receptive_field=1)), ('bias', 'bias', None)]
        >>> reg.specs(nn.ReLU()) is None  # unregistered: the caller's policy decides
        True
    """

    def __init__(self) -> None:
        self._handlers: dict[RegistryKey, Handler] = {}

    def register(
        self,
        module_type: type[nn.Module] | str,
        handler: Handler,
        *,
        override: bool = False,
        example: nn.Module | None = None,
    ) -> None:
        """Register ``handler`` for ``module_type`` (and, through the MRO, its subclasses).

        Args:
            module_type: an ``nn.Module`` subclass, or a dotted class path ``"pkg.module.Class"``
                matched against ``f"{cls.__module__}.{cls.__qualname__}"`` of each class in a
                module's MRO (registers a type without importing its library).
            handler: ``handler(module) -> Iterable[ParamSpec]``, one positional argument.
            override: replace an existing handler for the same key (a class and its dotted path
                count as the same key).
            example: a module of this type; the handler is run on it and its specs validated now.

        Raises:
            ValueError: bad key, non-callable handler or wrong arity, duplicate key without
                ``override=True``, or (with ``example``) invalid specs. The registry is unchanged.
        """
        _check_key(module_type)
        _check_handler(handler)
        duplicates = self._same_keys(module_type)
        if duplicates and not override:
            raise ValueError(
                f"a handler is already registered for {_key_name(module_type)} "
                f"({_handler_name(self._handlers[duplicates[0]])}); "
                "pass override=True to replace it"
            )
        if example is not None:
            if not isinstance(example, nn.Module):
                raise ValueError(f"example must be an nn.Module, got {type(example).__name__}")
            if not self._key_matches(module_type, type(example)):
                raise ValueError(
                    f"example of type {_dotted(type(example))} is not an instance of "
                    f"{_key_name(module_type)}"
                )
            self._run(handler, example)
        for key in duplicates:
            del self._handlers[key]
        self._handlers[module_type] = handler

    def handler_for(self, module: nn.Module) -> Handler | None:
        """The handler for ``module``: the first class in ``type(module).__mro__`` with one;
        else :func:`experts_handler` for a bank of experts and :func:`router_handler` for a
        router that declare their layout (:mod:`initlab.init._experts`); else, for a
        normalization layer of another library (``LlamaRMSNorm``, ``T5LayerNorm``,
        ``GemmaRMSNorm``...) recognized by its structure and forward, the specs
        :func:`norm_like_handler` gives (its forward probed once, here)."""
        check_strings = any(isinstance(key, str) for key in self._handlers)
        for cls in type(module).__mro__:
            handler = self._handlers.get(cls)
            if handler is None and check_strings:
                handler = self._handlers.get(_dotted(cls))
            if handler is not None:
                return handler
        if expert_layout(module) is not None:
            return experts_handler
        if router_experts(module) is not None:
            return router_handler
        identity = norm_identity(module)  # probed once: the handler gets the answer
        return None if identity is None else functools.partial(_norm_like_specs, identity=identity)

    def specs(self, module: nn.Module, name: str = "") -> list[ParamSpec] | None:
        """Validated specs of ``module``'s direct parameters, or ``None`` if no handler claims it.
        ``name``: the module's qualified name in the model, for the messages.

        Raises:
            ValueError: the handler's output does not match the module (unknown or ``None``
                parameter, a name twice, blocks that overlap or leave gaps, fans that disagree
                with :func:`~initlab.compute_fans`), the module is lazy and not yet
                materialized, or some of its tensors are parametrized
                (``torch.nn.utils.parametrize``; the message says how to remove them for the
                call), except inside a measuring entry point
                (:func:`~initlab._core.parametrized.reading_scope`), where the computed tensors
                are described. The message names the handler, the module type and the problem.
        """
        handler = self.handler_for(module)
        if handler is None:
            return None
        return self._run(handler, module, name)

    def copy(self) -> Registry:
        """An independent registry with the same handlers (registering on it leaves this alone)."""
        new = Registry()
        new._handlers = dict(self._handlers)
        return new

    def registered_types(self) -> list[str]:
        """Dotted class paths of the registered keys, in registration order."""
        return [_key_name(key) for key in self._handlers]

    def __contains__(self, module_type: object) -> bool:
        """Whether ``module_type`` (a class or dotted path) is registered directly (not via MRO)."""
        if not isinstance(module_type, (str, type)):
            return False
        return bool(self._same_keys(module_type))  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self._handlers)

    def __repr__(self) -> str:
        return f"Registry({len(self)} handlers)"

    def _same_keys(self, module_type: RegistryKey) -> list[RegistryKey]:
        """Registered keys denoting the same type as ``module_type`` (itself or its dotted path)."""
        if isinstance(module_type, str):
            return [k for k in self._handlers if _key_name(k) == module_type]
        keys: list[RegistryKey] = [module_type] if module_type in self._handlers else []
        if _dotted(module_type) in self._handlers:
            keys.append(_dotted(module_type))
        return keys

    @staticmethod
    def _key_matches(key: RegistryKey, cls: type) -> bool:
        if isinstance(key, str):
            return any(_dotted(c) == key for c in cls.__mro__)
        return issubclass(cls, key)

    @staticmethod
    def _run(handler: Handler, module: nn.Module, where: str = "") -> list[ParamSpec]:
        for name, param in module.named_parameters(recurse=False):
            if isinstance(param, nn.parameter.UninitializedParameter):
                raise ValueError(
                    f"{_dotted(type(module))}.{name} is an uninitialized lazy parameter; run a "
                    "forward pass (or materialize the module) before asking for its fans"
                )
        params = [p for _, p in module.named_parameters(recurse=False)]
        if params and all(p.numel() == 0 for p in params):
            return []  # a zero-width layer (MobileBERT's Linear(V, 0)): nothing to draw or measure
        try:
            result = handler(module)
            if not isinstance(result, Iterable):
                raise ValueError(f"expected an iterable of ParamSpec, got {type(result).__name__}")
            specs = list(result)
        except ValueError as err:
            raise ValueError(
                f"handler {_handler_name(handler)} failed on {_dotted(type(module))}: {err}"
            ) from err
        names = [s.name for s in specs if isinstance(s, ParamSpec)]
        _refuse_norm_hooks(module, names, where)
        if not registry_reads_computed():  # a measuring entry point reads the computed tensors
            # a writer writes no frozen tensor: a frozen computed one is described, not refused
            _refuse_parametrized(module, [n for n in names if trainable(module, n)], where)
        _validate_specs(module, specs, handler)
        return specs


# --------------------------------------------------------------------------------------------
# Built-in handlers. Each names the module's direct parameters and states their fans from the
# module's own hyper-parameters; the registry cross-checks them against compute_fans.


def norm_like_handler(module: nn.Module) -> list[ParamSpec]:
    """A normalization layer that no handler is registered for, recognized by what it does
    (:mod:`initlab.init._norm_like`): ``weight`` -> "norm_scale" with its ``identity`` (1 for
    ``w * n(x)``, 0 for Gemma's ``(1 + w) * n(x)``), ``bias`` -> "norm_shift".

    Raises:
        ValueError: ``module`` does not have the structure, or its forward shows neither form.
    """
    identity = norm_identity(module)
    if identity is None:
        raise ValueError(
            f"{type(module).__name__} is not a normalization layer norm_like_handler recognizes: "
            "it needs a 1-D weight (and optionally a bias of its shape) as its only parameters, "
            "no submodules or buffers, and a forward(x) whose output is w * n(x) or (1 + w) * n(x)"
        )
    return _norm_like_specs(module, identity)


def experts_handler(module: nn.Module) -> list[ParamSpec]:
    """A bank of experts (:mod:`initlab.init._experts`): each 3-D weight ``stacked``, with the
    fans of one expert's matrix; a concatenated ``gate_up_proj`` in two blocks (gate, input);
    the biases.

    Raises:
        ValueError: ``module`` does not declare a layout :func:`expert_layout` reads.
    """
    layout = expert_layout(module)
    if layout is None:
        raise ValueError(
            f"{type(module).__name__} is not a bank of experts experts_handler reads: it needs an "
            "is_transposed attribute, a 3-D down_proj beside gate_up_proj, gate_proj or up_proj "
            "(E matrices each, of matching shapes) and no other parameter than their biases"
        )
    specs = []
    for name in layout.weights:
        out, inp = layout.matrix(module._parameters[name])
        half, fans = out // 2, Fans(inp, out // 2)
        if name != "gate_up_proj":
            blocks: tuple[Block, ...] = ()
        elif layout.concatenated:  # [gate; input]
            blocks = (Block(0, half, fans), Block(half, out, fans, gated=True))
        else:  # rows gate, input, gate, input, ... (GPT-OSS)
            blocks = (Block(0, out, fans, step=2), Block(1, out, fans, gated=True, step=2))
        whole = None if blocks else Fans(inp, out)
        specs.append(
            ParamSpec(name, "weight", whole, blocks, transposed=layout.transposed, stacked=True)
        )
    return specs + [ParamSpec(b, "bias") for b in layout.biases]


def router_handler(module: nn.Module) -> list[ParamSpec]:
    """A mixture-of-experts router (:mod:`initlab.init._experts`): ``weight`` ``(E, hidden)``,
    a linear map to one logit per expert; its ``bias`` of ``E``.

    Raises:
        ValueError: ``module`` is not a router :func:`router_experts` reads.
    """
    experts = router_experts(module)
    if experts is None:
        raise ValueError(
            f"{type(module).__name__} is not a router router_handler reads: its class name holds "
            "'Router', with a 2-D weight of num_experts rows"
        )
    hidden = int(module._parameters["weight"].shape[1])
    bias = module._parameters.get("bias")
    specs = [ParamSpec("weight", "weight", Fans(hidden, experts))]
    return specs + ([ParamSpec("bias", "bias")] if bias is not None and bias.dim() == 1 else [])


def _norm_like_specs(module: nn.Module, identity: float) -> list[ParamSpec]:
    specs = [ParamSpec("weight", "norm_scale", identity=identity)]
    if _present(module, "bias"):
        specs.append(ParamSpec("bias", "norm_shift"))
    return specs


def _present(module: nn.Module, name: str) -> bool:
    """Whether ``module`` has the tensor ``name``: a parameter (not None), or one computed by a
    parametrization (then named, so that the registry refuses it as it refuses a weight's:
    :func:`_refuse_parametrized`; left out, a parametrized bias went unnoticed)."""
    return module._parameters.get(name) is not None or parametrize.is_parametrized(module, name)


def _bias_specs(module: nn.Module, *names: str) -> list[ParamSpec]:
    """Bias specs for those of ``names`` that are present on ``module`` (:func:`_present`)."""
    return [ParamSpec(n, "bias") for n in names if _present(module, n)]


def _gate_blocks(n_gates: int, hidden: int, fans: Fans) -> tuple[Block, ...]:
    return tuple(Block(g * hidden, (g + 1) * hidden, fans) for g in range(n_gates))


def linear_handler(module: nn.Module) -> list[ParamSpec]:
    """``nn.Linear``: weight ``(out, in)`` with fans ``(in, out)``; bias."""
    fans = Fans(fan_in=module.in_features, fan_out=module.out_features)
    return [ParamSpec("weight", "weight", fans), *_bias_specs(module, "bias")]


def transposed_linear_handler(module: nn.Module) -> list[ParamSpec]:
    """A linear layer whose weight is stored transposed, ``(in, out)``, with ``y = x @ W + b``.

    Hugging Face GPT-2's ``Conv1D`` is one; register your own in one call::

        register_handler(MyLayer, transposed_linear_handler)

    The module must have a 2-D ``weight`` and may have a ``bias``.
    """
    n_in, n_out = _shape(module, "weight")
    fans = Fans(fan_in=int(n_in), fan_out=int(n_out))
    return [ParamSpec("weight", "weight", fans, transposed=True), *_bias_specs(module, "bias")]


def linear_fans(module: nn.Module, registry: Registry | None = None) -> tuple[int, int] | None:
    """``(fan_in, n_out)`` of a dense linear layer -- ``nn.Linear``, or any module whose handler
    is :func:`linear_handler` or :func:`transposed_linear_handler` (GPT-2's ``Conv1D``) --
    else ``None``. Either layout is the matrix ``W`` of ``y = W x + b`` up to a transpose, which
    changes neither its singular values nor the GR formula."""
    registry = registry if registry is not None else default_registry()
    handler = registry.handler_for(module)
    if handler is linear_handler:
        return int(module.in_features), int(module.out_features)
    if handler is transposed_linear_handler:
        n_in, n_out = _shape(module, "weight")
        return int(n_in), int(n_out)
    return None


def bilinear_handler(module: nn.Module) -> list[ParamSpec]:
    """``nn.Bilinear``: weight ``(out, in1, in2)``; bias.

    Fans follow torch's convention for a 3-D tensor (``in2`` acts as the "kernel"):
    ``fan_in = in1 * in2``, ``fan_out = out * in2``.
    """
    n_out, n1, n2 = module.out_features, module.in1_features, module.in2_features
    fans = Fans(fan_in=n1 * n2, fan_out=n_out * n2, receptive_field=n2)
    return [ParamSpec("weight", "weight", fans), *_bias_specs(module, "bias")]


def conv_handler(module: nn.Module) -> list[ParamSpec]:
    """``nn.Conv{1,2,3}d`` and ``nn.ConvTranspose{1,2,3}d``: weight (with groups/layout); bias.

    ``fan_in = (in / g) * k`` and ``fan_out = (out / g) * k`` with ``k = prod(kernel_size)``, for
    both layouts (``ConvTranspose`` stores ``(in, out / g, *kernel)``; ``transposed=True`` says so).
    For a ``Conv``, dilation, stride and padding do not change the fans: each output still sums
    ``(in / g) * k`` inputs, dilation only spreads the taps apart. A ``ConvTranspose`` of stride
    ``s`` has ``fan_in = (in / g) * k / prod(s)``: each output sums only the taps congruent to
    its position mod ``s``, ``k / s`` per dim on average (:mod:`initlab.init.fans`).
    """
    groups = module.groups
    stride = tuple(module.stride) if module.transposed else 1
    fans = compute_fans(
        _shape(module, "weight"), groups=groups, transposed=bool(module.transposed), stride=stride
    )
    weight = ParamSpec("weight", "weight", fans, groups=groups, transposed=bool(module.transposed))
    return [weight, *_bias_specs(module, "bias")]


def embedding_handler(module: nn.Module) -> list[ParamSpec]:
    """``nn.Embedding`` / ``nn.EmbeddingBag``: table ``(num_embeddings, dim)``, role "embedding".

    Fans are ``fan_in = embedding_dim``, ``fan_out = num_embeddings``: the tied-output-projection
    view (a table tied to the head ``Linear(dim, vocab)`` has exactly these fans), which is what
    :func:`~initlab.compute_fans` gives for the table's shape. A lookup has no fan-in in the
    matrix-multiply sense, so the default init of role "embedding" (N(0, 1), torch's) ignores the
    fans; they are informational, for schemes that want the tied view.
    """
    fans = Fans(fan_in=module.embedding_dim, fan_out=module.num_embeddings)
    return [ParamSpec("weight", "embedding", fans)]


def multihead_attention_handler(module: nn.Module) -> list[ParamSpec]:
    """``nn.MultiheadAttention``: the q/k/v projections and their biases.

    With equal q/k/v dims the fused ``in_proj_weight`` ``(3E, E)`` is three blocks (q, k, v), each
    with fans ``(E, E)``; otherwise ``q_proj_weight`` ``(E, E)``, ``k_proj_weight`` ``(E, kdim)``
    and ``v_proj_weight`` ``(E, vdim)`` are separate weights. ``in_proj_bias``, ``bias_k`` and
    ``bias_v`` (``add_bias_kv``) are biases. ``out_proj`` is a child ``Linear`` with its own
    handler.
    """
    e = module.embed_dim
    if module._qkv_same_embed_dim:
        weights = [ParamSpec("in_proj_weight", "weight", blocks=_gate_blocks(3, e, Fans(e, e)))]
    else:
        weights = [
            ParamSpec("q_proj_weight", "weight", Fans(fan_in=e, fan_out=e)),
            ParamSpec("k_proj_weight", "weight", Fans(fan_in=module.kdim, fan_out=e)),
            ParamSpec("v_proj_weight", "weight", Fans(fan_in=module.vdim, fan_out=e)),
        ]
    return [*weights, *_bias_specs(module, "in_proj_bias", "bias_k", "bias_v")]


def norm_handler(module: nn.Module) -> list[ParamSpec]:
    """Normalization layers: ``weight`` -> "norm_scale", ``bias`` -> "norm_shift" (when present).

    Serves BatchNorm/SyncBatchNorm/InstanceNorm (all ``_NormBase``), LayerNorm, GroupNorm, RMSNorm
    and LocalResponseNorm (no parameters). Non-affine layers give no specs.
    """
    roles = {"weight": "norm_scale", "bias": "norm_shift"}
    return [ParamSpec(n, r) for n, r in roles.items() if _present(module, n)]


_RNN_GATES = {"RNN_TANH": 1, "RNN_RELU": 1, "GRU": 3, "LSTM": 4}
_RNN_NAME = re.compile(r"(weight|bias)_(ih|hh|hr)_l(\d+)(_reverse)?")


def rnn_handler(module: nn.Module) -> list[ParamSpec]:
    """``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU``: every layer and direction.

    ``weight_ih_l{l}`` ``(G*H, in_l)`` and ``weight_hh_l{l}`` ``(G*H, H_out)`` are ``G`` gate
    blocks (RNN 1, GRU 3, LSTM 4), each with fans ``(in_l, H)`` / ``(H_out, H)``, where ``in_0`` is
    ``input_size``, ``in_l = H_out * num_directions`` above it, and ``H_out`` is ``proj_size`` if
    set, else ``H``. An LSTM's ``weight_hr_l{l}`` ``(proj_size, H)`` is a plain weight (fans
    ``(H, proj_size)``); biases are biases.
    Names come from the module's own parameters, so every parameter is claimed, and from its
    parametrizations (``torch.nn.utils.parametrize``), so that a computed tensor is named and
    refused as a Linear's is (left out, an orthogonal ``weight_hh_l0`` went unclaimed).
    """
    n_gates, hidden = _RNN_GATES[module.mode], module.hidden_size
    h_out = module.proj_size if getattr(module, "proj_size", 0) > 0 else hidden
    directions = 2 if module.bidirectional else 1
    names = [name for name, _ in module.named_parameters(recurse=False)]
    if parametrize.is_parametrized(module):
        names += [name for name in module.parametrizations if name not in names]
    specs = []
    for name in names:
        match = _RNN_NAME.fullmatch(name)
        if match is None:
            raise ValueError(f"unexpected RNN parameter name {name!r}")
        kind, which, layer = match.group(1), match.group(2), int(match.group(3))
        if kind == "bias":
            specs.append(ParamSpec(name, "bias"))
        elif which == "hr":
            specs.append(ParamSpec(name, "weight", Fans(fan_in=hidden, fan_out=h_out)))
        else:
            if which == "hh":
                n_in = h_out
            else:
                n_in = module.input_size if layer == 0 else h_out * directions
            blocks = _gate_blocks(n_gates, hidden, Fans(fan_in=n_in, fan_out=hidden))
            specs.append(ParamSpec(name, "weight", blocks=blocks))
    return specs


def rnn_cell_handler(module: nn.Module) -> list[ParamSpec]:
    """``nn.RNNCell`` / ``nn.LSTMCell`` / ``nn.GRUCell``: gate blocks as in :func:`rnn_handler`."""
    if isinstance(module, nn.LSTMCell):
        n_gates = 4
    elif isinstance(module, nn.GRUCell):
        n_gates = 3
    else:
        n_gates = 1
    hidden = module.hidden_size
    ih_fans = Fans(fan_in=module.input_size, fan_out=hidden)
    hh_fans = Fans(fan_in=hidden, fan_out=hidden)
    return [
        ParamSpec("weight_ih", "weight", blocks=_gate_blocks(n_gates, hidden, ih_fans)),
        ParamSpec("weight_hh", "weight", blocks=_gate_blocks(n_gates, hidden, hh_fans)),
        *_bias_specs(module, "bias_ih", "bias_hh"),
    ]


_GPT2_CONV1D_PATHS = (
    "transformers.pytorch_utils.Conv1D",
    "transformers.modeling_utils.Conv1D",  # where older transformers versions defined it
)


def scalar_bias_handler(module: nn.Module) -> list[ParamSpec]:
    """A module whose only parameter is an additive ``bias`` (FixUp's scalar bias)."""
    return [ParamSpec("bias", "bias")]


def scalar_scale_handler(module: nn.Module) -> list[ParamSpec]:
    """A module whose only parameter is a multiplicative ``weight`` (FixUp's multiplier)."""
    return [ParamSpec("weight", "norm_scale")]


def _builtin_registry() -> Registry:
    """A fresh registry holding the built-in handlers."""
    reg = Registry()
    reg.register(nn.Linear, linear_handler)
    reg.register(nn.Bilinear, bilinear_handler)
    for conv in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
        reg.register(conv, conv_handler)
    for conv in (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d):
        reg.register(conv, conv_handler)
    reg.register(nn.Embedding, embedding_handler)
    reg.register(nn.EmbeddingBag, embedding_handler)
    reg.register(nn.MultiheadAttention, multihead_attention_handler)
    # _NormBase: BatchNorm1d/2d/3d, SyncBatchNorm, InstanceNorm1d/2d/3d and their lazy variants.
    norms: list[type[nn.Module]] = [
        nn.modules.batchnorm._NormBase,
        nn.LayerNorm,
        nn.GroupNorm,
        nn.LocalResponseNorm,
    ]
    if hasattr(nn, "RMSNorm"):  # torch >= 2.4
        norms.append(nn.RMSNorm)
    for norm in norms:
        reg.register(norm, norm_handler)
    reg.register(nn.RNNBase, rnn_handler)
    reg.register(nn.RNNCellBase, rnn_cell_handler)
    for path in _GPT2_CONV1D_PATHS:
        reg.register(path, transposed_linear_handler)
    # FixUp's scalar bias (init 0) and branch multiplier (init 1), Zhang et al. 2019 §3; by dotted
    # path so that the registry does not import the model zoo.
    reg.register("initlab.zoo.ScalarBias", scalar_bias_handler)
    reg.register("initlab.zoo.ScalarScale", scalar_scale_handler)
    return reg


@functools.cache
def default_registry() -> Registry:
    """The process-wide default registry, built with the built-in handlers on first call.

    Registering on it affects every later lookup in the process; use ``default_registry().copy()``
    for a private registry.
    """
    return _builtin_registry()


def register_handler(
    module_type: type[nn.Module] | str,
    handler: Handler,
    *,
    override: bool = False,
    example: nn.Module | None = None,
    registry: Registry | None = None,
) -> None:
    """Register ``handler`` for ``module_type`` in ``registry`` (default: :func:`default_registry`).

    See :meth:`Registry.register` for the arguments and the validation done.

    Example:
        >>> import torch
        >>> class MyLinearT(nn.Module):  # stores its weight as (in, out)
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.weight = nn.Parameter(torch.empty(3, 5))
        >>> reg = default_registry().copy()
        >>> register_handler(
        ...     MyLinearT, transposed_linear_handler, registry=reg, example=MyLinearT()
        ... )
        >>> reg.specs(MyLinearT())[0].fans
        Fans(fan_in=3, fan_out=5, receptive_field=1)
    """
    target = default_registry() if registry is None else registry
    target.register(module_type, handler, override=override, example=example)
