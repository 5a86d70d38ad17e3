"""A ``torch.compile``'d model is run through the module it wraps.

``torch.compile(model)`` returns an ``OptimizedModule`` that holds the user's module as
``_orig_mod`` and shares its parameters and buffers. initlab's procedures hook layers, swap
parameter entries and differentiate twice; inside a compiled graph each of these makes dynamo
break the graph or recompile (an LSUV or a moment probe of a small MLP took seconds instead of
milliseconds, and ended at dynamo's recompile limit). Every entry point that takes a model
therefore runs on the wrapped module: the same parameters (a change in place shows through the
compiled model), the same values (eager), the layers named as in the user's own module (``"0"``,
not ``"_orig_mod.0"``). The compiled model itself is left as it was, compiled.

:func:`takes_compiled` is therefore the decorator of every entry point that takes a model, and
it holds the other checks they share before any work: the model is an ``nn.Module`` (not the data,
swapped), not TorchScript (:func:`scripted_error`), has values (:func:`check_materialized`: no
lazy or meta-device tensor), and the keywords are the function's own (a guessed name is answered
with initlab's, :func:`~initlab._core.knobs.check_kwargs`; ``forward`` takes ``(model, batch)``).
It also runs every ``DistributedDataParallel`` in the model as the module it wraps, without DDP's
collectives (:func:`~initlab._core.distributed.local_passes`): an entry point's passes are local.

The forward hooks of a compiled model (on the ``OptimizedModule`` the user holds) run outside its
compiled code, on every call; while an entry point runs the wrapped module they are relayed to it
(:func:`eager_submodules`), so its passes see the model's output as the user's calls do. A hook on
a module *inside* compiled code is another matter: dynamo does not guard on hooks, so a graph
compiled before the hook (or for another instance of the class) never runs it. A hook initlab
leaves on purpose therefore goes on the wrapper (:func:`hook_target`).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch import nn

from initlab._core.distributed import is_distributed, local_passes
from initlab._core.knobs import accepted_keywords, check_keywords
from initlab._core.rows import shown

__all__ = [
    "check_materialized",
    "eager_submodules",
    "hook_target",
    "module_type_name",
    "scripted_error",
    "scripted_part",
    "takes_compiled",
    "uncompiled",
]

F = TypeVar("F", bound=Callable[..., Any])


def uncompiled(model: Any) -> Any:
    """The module a ``torch.compile``'d model wraps (unwrapped again if that is compiled too);
    anything else as it is."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # loaded by any torch.compile
    if eval_frame is None:
        return model
    while isinstance(model, eval_frame.OptimizedModule):
        model = model._orig_mod
    return model


def _wrappers(model: Any) -> list[nn.Module]:
    """The ``torch.compile`` wrappers around ``model``'s uncompiled module, innermost first."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    chain: list[nn.Module] = []
    while eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        chain.insert(0, model)
        model = model._orig_mod
    return chain


class _Relay:
    """A forward hook on a compiled model's wrapped module that runs the wrapper's forward hooks
    (as the wrapper's own call does after the wrapped module's): registered by
    :func:`eager_submodules` for the duration of an entry point."""

    def __init__(self, wrapper: nn.Module) -> None:
        self.wrapper = wrapper

    def __call__(self, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> Any:
        w = self.wrapper
        for key, hook in list(w._forward_hooks.items()):
            with_kwargs = key in w._forward_hooks_with_kwargs
            got = hook(w, args, kwargs, output) if with_kwargs else hook(w, args, output)
            output = output if got is None else got
        return output


@contextmanager
def eager_submodules(model: nn.Module, wrappers: Sequence[nn.Module] = ()) -> Iterator[None]:
    """For the block, every ``torch.compile``'d submodule of ``model`` is replaced in its parent by
    the module it wraps (the same parameters, run eagerly, named without ``_orig_mod``); put back
    after, also on failure. The forward hooks of each wrapper (and of ``wrappers``, the ones
    around ``model`` itself, innermost first) run after the wrapped module's, as in the compiled
    model's call (a :class:`_Relay` on it, removed after)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    if eval_frame is not None:
        swapped = [
            (parent, name, child)
            for parent in model.modules()
            for name, child in parent._modules.items()
            if isinstance(child, eval_frame.OptimizedModule)
        ]
    relays = [(model, w) for w in wrappers]
    relays += [(uncompiled(child), w) for *_, child in swapped for w in _wrappers(child)]
    handles = []
    try:
        for parent, name, child in swapped:
            parent._modules[name] = uncompiled(child)
        for module, wrapper in relays:
            handles.append(module.register_forward_hook(_Relay(wrapper), with_kwargs=True))
        yield
    finally:
        for handle in reversed(handles):
            handle.remove()
        for parent, name, child in reversed(swapped):
            parent._modules[name] = child


def hook_target(model: nn.Module, name: str, what: str) -> nn.Module:
    """The module to register a lasting forward hook on so that it scales what submodule ``name``
    (``""``: the model) of ``model`` puts out, where ``model`` is what an entry point runs: the
    module itself, or, where the user's model calls it through a ``torch.compile`` wrapper (the
    compiled model, or a compiled submodule), the outermost wrapper (whose hooks run on every call
    of it, and during the entry point through the relay: :func:`eager_submodules`). A module inside
    compiled code is refused with a ``ValueError`` (``what`` names the entry point): the compiled
    graph would not run its hook."""
    path = name.split(".") if name else []
    module = model
    for i in range(len(path) + 1):
        relays = [h for h in module._forward_hooks.values() if isinstance(h, _Relay)]
        if relays and i == len(path):
            return relays[-1].wrapper  # the outermost: registered last
        if relays:
            inside = ".".join(path[:i]) or "the model"
            raise ValueError(
                f"{what}: {name!r} is inside {inside!r}, which is torch.compile'd: a hook on a "
                "module inside compiled code is not run by a graph compiled before it. Hook the "
                "compiled module itself (module=None, or the compiled submodule), use "
                "how='fold' or how='module', or call it on the eager model and compile after"
            )
        if i < len(path):
            module = module.get_submodule(path[i])
    return module


def takes_compiled(fn: F | None = None, *, scripted: bool = False, collective: bool = False) -> Any:
    """Run ``fn`` with its model (the first positional argument or ``model=``) uncompiled, its
    compiled submodules too (:func:`eager_submodules`), and its DDP wrappers calling the modules
    they wrap (:func:`~initlab._core.distributed.local_passes`); a model that is no
    ``nn.Module`` (model and data swapped) is refused with a ``TypeError`` naming ``fn``.

    A TorchScript model or submodule (``torch.jit.script``/``trace``) takes no hooks and no
    parameter swaps: unless ``scripted`` (an entry point that needs neither), it is refused with
    a ``TypeError`` naming it and saying to run on the eager module and script it afterwards
    (:func:`scripted_error`). A ``collective`` entry point under ``torch.distributed`` leaves the
    refusal to its first collective check
    (:func:`~initlab._core.distributed.check_same_trainable`), so that every rank raises, not
    just the ranks whose model is scripted.
    """
    if fn is None:
        return functools.partial(takes_compiled, scripted=scripted, collective=collective)
    accepted = accepted_keywords(fn)

    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        _check_keywords(fn.__name__, kwargs, accepted)
        held = args[0] if args else kwargs.get("model")  # the model as the user holds it
        if args and isinstance(args[0], nn.Module):
            args = (uncompiled(args[0]), *args[1:])
        if isinstance(kwargs.get("model"), nn.Module):
            kwargs["model"] = uncompiled(kwargs["model"])
        model = args[0] if args else kwargs.get("model")
        together = collective and is_distributed()  # then check_same_trainable refuses
        if not scripted and not together and isinstance(model, nn.Module):
            found = scripted_part(model)
            if found is not None:
                raise scripted_error(found[1], fn.__name__, found[0])
        if not isinstance(model, nn.Module):
            if model is not None and not isinstance(getattr(model, "model", None), nn.Module):
                raise TypeError(  # a probe (gr_scaling's second form) holds its model
                    f"{fn.__name__}: the model must be an nn.Module, got "
                    f"{type(model).__name__}; call {fn.__name__}(model, ...) with the model first"
                )
            return fn(*args, **kwargs)
        check_materialized(model, fn.__name__)
        with eager_submodules(model, _wrappers(held)), local_passes(model):
            return fn(*args, **kwargs)

    return inner


def _check_keywords(
    what: str, kwargs: dict[str, Any], accepted: tuple[set[str], set[str]] | None
) -> None:
    """An unknown keyword names initlab's one (``loss=`` → ``loss_fn=``); a ``forward`` that
    cannot be called as ``forward(model, batch)`` is named before any pass runs."""
    check_keywords(what, kwargs, accepted)
    forward = kwargs.get("forward")
    if callable(forward):
        try:
            inspect.signature(forward).bind(None, None)
        except TypeError as err:
            raise TypeError(
                f"{what}: forward must be called as forward(model, batch) and return the model's "
                f"output ({err})"
            ) from None
        except ValueError:  # no signature to read (a builtin): left to the call
            pass


def scripted_part(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The first TorchScript module in ``model`` (itself: name ``""``), or ``None``."""
    return next(
        ((n, m) for n, m in model.named_modules() if isinstance(m, torch.jit.ScriptModule)), None
    )


def check_materialized(model: nn.Module, what: str) -> None:
    """Raise a ``ValueError`` naming the tensors of ``model`` that hold no values yet: on the meta
    device (``torch.device("meta")``: materialize with ``model.to_empty(device=...)``) or lazy
    (``nn.LazyLinear`` before its first forward pass)."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    lazy = [n for n, t in tensors if isinstance(t, nn.parameter.UninitializedTensorMixin)]
    meta = [n for n, t in tensors if n not in lazy and t.is_meta]

    if lazy:
        raise ValueError(
            f"{what}: {shown(lazy, 5)} of the model {'are' if len(lazy) > 1 else 'is'} "
            "uninitialized "
            "(a lazy module, e.g. nn.LazyLinear, before its first forward pass); run the model "
            "once on a batch (model(x)) so that they take their shapes, then call "
            f"{what} again"
        )
    if meta:
        raise ValueError(
            f"{what}: {shown(meta, 5)} of the model live on the meta device and have no values; "
            "materialize the model first with model.to_empty(device=...), which gives every "
            "tensor uninitialized memory, then initialize it: initlab.init_model(model, scheme) "
            f"sets the parameters and the norm layers' running statistics{_other_buffers(model)}"
        )


def _other_buffers(model: nn.Module) -> str:
    """What :func:`check_materialized`'s advice leaves unset: what ``init_model`` with its
    defaults leaves as it was (:func:`~initlab.init._unset.unset_by_init`, the rule of
    :attr:`~initlab.init.model.InitReport.buffers_left` too; after ``to_empty``: whatever was in
    memory), and how to set it."""
    from initlab.init._unset import unset_by_init  # init builds on _core

    try:
        unset = unset_by_init(model)
    except (ValueError, TypeError, RuntimeError, NotImplementedError):  # init_model says why
        return "; InitReport.buffers_left names the buffers it leaves as they were"
    stats = set(unset.frozen_stats)
    non_persistent = {
        f"{name}.{b}" if name else b
        for name, module in model.named_modules()
        for b in module._non_persistent_buffers_set
    }
    kept = [b for b in unset.buffers if b not in stats and b not in non_persistent]
    lost = [b for b in unset.buffers if b not in stats and b in non_persistent]

    ways = []
    if unset.frozen:
        with_stats = (
            f" and the running statistics of frozen norm layers ({shown(unset.frozen_stats, 4)})"
        )
        ways.append(
            f"the frozen parameters {shown(unset.frozen, 4)}{with_stats if stats else ''} are kept "
            "(frozen='skip'): frozen='init' draws them too, or model.load_state_dict(...) restores "
            "pretrained ones"
        )
    if unset.other:
        ways.append(
            f"{shown(unset.other, 4)} are left as they were (unclaimed, or kept as the model draws "
            "them: its report's rows say which)"
        )
    if kept:
        ways.append(f"model.load_state_dict(...) restores the buffers {shown(kept, 4)}")
    if lost:
        ways.append(
            f"{shown(lost, 4)} (non-persistent) are in no state_dict: compute them as the model's "
            "constructor does (e.g. a rotary embedding's inv_freq), or build that module outside "
            "the meta device"
        )
    if not ways:
        return ""
    return "; it leaves these as to_empty made them (uninitialized memory): " + "; ".join(ways)


def module_type_name(module: nn.Module) -> str:
    """The class name of ``module``; for a TorchScript module, the eager class it was scripted
    from (``"Linear"``, not ``"RecursiveScriptModule"``)."""
    if isinstance(module, torch.jit.ScriptModule):
        return str(getattr(module, "original_name", type(module).__name__))
    return type(module).__name__


def scripted_error(module: nn.Module, what: str, name: str = "") -> TypeError:
    """The error for a TorchScript model (``name=""``) or submodule ``name`` given to ``what``."""
    where = f"its submodule {name!r} is" if name else "the model is"
    return TypeError(
        f"{what}: {where} a TorchScript module ({type(module).__name__}), which takes no hooks "
        f"and no parameter swaps; run {what} on the eager module and script it after "
        "(torch.jit.script(model))"
    )
