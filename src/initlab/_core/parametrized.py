"""Tensors computed by ``torch.nn.utils.parametrize`` parametrizations (``weight_norm``,
``spectral_norm``, ``orthogonal``...), for the entry points that only read a model.

A parametrized layer's ``weight`` is no parameter: ``module.weight`` runs
``module.parametrizations.weight`` on the trainable ``original`` tensors (``original0``,
``original1`` for ``weight_norm``). The measuring entry points (``measure_moments``,
``gr_scaling``, ``diagnose``, ``doctor`` without fixes, ``layer_spectra``) read such a layer through
its *computed* tensor, the one its forward uses; the methods that write weights refuse it
(:func:`initlab.init.registry._refuse_parametrized`). Which of the two applies is a context:

* :func:`reading_layers` / :func:`reading_scope` (the measuring entry points) let the layer
  registry describe computed tensors, unless a writer is running;
* :func:`writing_layers` / :func:`writing_scope` (the methods that write weights, ``doctor`` with
  fixes) make every read inside them refuse a layer whose parametrized tensor is trainable, the
  moment probe included, so that a writer refuses before it measures anything; a frozen one
  (computed from tensors that all have ``requires_grad=False``) is described, since writers
  leave frozen tensors as they are (``init_model(frozen="init")`` refuses it itself).
  :func:`listing_scope` lets a writer list layers it does not write (``scale_output_``).
  :func:`writing_layers` also refuses, up front, a model made under ``torch.inference_mode()``
  that it could not write (:func:`check_writable`).

The mode is a ``contextvars.ContextVar`` set for the duration of one entry point's call and reset
when it returns or raises (per thread and per task, as torch's grad mode is): no state outlives a
call or is shared between concurrent ones. Threading it through every registry lookup as an
argument would reach a dozen signatures that only pass it on.

:func:`computed` evaluates a computed tensor without side effects (``torch.no_grad()``, the
parametrizations in eval mode: ``spectral_norm`` runs no power iteration, its buffers are left
alone); :func:`parametrized_note` is the note a measured row of such a tensor carries.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from typing import Any, Literal, TypeVar

import torch
from torch import nn
from torch.nn.utils import parametrize

from initlab._core.hooks import hook_handles
from initlab._core.modules import inference_tensors
from initlab._core.state import preserved_state

__all__ = [
    "check_stats_writable",
    "check_writable",
    "computed",
    "layer_tensor",
    "listing_scope",
    "machinery",
    "owns_tensors",
    "parametrized_names",
    "parametrized_note",
    "plain_copy",
    "reading_layers",
    "reading_scope",
    "refuse_computed",
    "registry_reads_computed",
    "trainable",
    "writing_layers",
    "writing_scope",
]

_F = TypeVar("_F", bound=Callable)

_MODE: ContextVar[Literal["read", "write"] | None] = ContextVar("initlab_layers", default=None)


@contextmanager
def _mode(value: Literal["read", "write"]) -> Iterator[None]:
    token = _MODE.set(value)
    try:
        yield
    finally:
        _MODE.reset(token)


@contextmanager
def reading_scope() -> Iterator[None]:
    """Inside it the registry describes computed tensors, unless it is inside a writer
    (:func:`writing_scope`)."""
    if _MODE.get() is not None:
        yield
        return
    with _mode("read"):
        yield


@contextmanager
def writing_scope() -> Iterator[None]:
    """Inside it everything refuses computed tensors (the moment probe included)."""
    with _mode("write"):
        yield


@contextmanager
def listing_scope() -> Iterator[None]:
    """Inside it the registry describes computed tensors, inside a writer too: for a writer that
    only lists weight layers (to hook them, to pick the one it writes) and asks the registry
    again, outside it, about the one it writes, which refuses there."""
    with _mode("read"):
        yield


def _run_in(scope: Callable[[], AbstractContextManager[None]], fn: _F) -> _F:
    """``fn`` run inside ``scope()`` at every call."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with scope():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def reading_layers(fn: _F) -> _F:
    """Decorate a measuring entry point: it runs in a :func:`reading_scope`."""
    return _run_in(reading_scope, fn)


def writing_layers(fn: _F) -> _F:
    """Decorate a method that writes weights: it refuses a model it cannot write
    (:func:`check_writable`), then runs in a :func:`writing_scope`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        model = args[0] if args else kwargs.get("model")
        if isinstance(model, nn.Module):
            check_writable(model, fn.__name__)
        with writing_scope():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def check_writable(model: nn.Module, what: str) -> None:
    """Raise ``ValueError`` naming ``model``'s parameters, and its norm layers' running
    statistics, made under ``torch.inference_mode()`` (inference tensors), unless inference mode
    is on now: outside it torch refuses in-place writes to them, and only after it wrote the
    values (a writer that failed there left the model half-written), nor can they be trained.
    Other buffers (an input's mean and std) are no writer's to write: such a model runs."""
    if torch.is_inference_mode_enabled():
        return
    names = inference_tensors(model, buffers=False)
    if names:
        raise ValueError(
            f"{what}: the model's tensors ({names}) were created under torch.inference_mode(), "
            "and torch refuses to write such tensors in place outside it (nor can they be "
            "trained): build (or load) the model outside torch.inference_mode() (calling initlab "
            "under it is fine). The model was left as it was"
        )


def check_stats_writable(model: nn.Module, what: str) -> None:
    """Raise ``ValueError`` naming the running statistics of ``model``'s train-mode norm layers
    (BatchNorm, InstanceNorm) made under ``torch.inference_mode()`` (inference tensors), unless
    inference mode is on now: a measuring forward in train mode updates them in place (and puts
    them back), which torch refuses outside it, after it wrote them. For a reader that runs a
    forward without autograd (:func:`check_writable` is the writers')."""
    if torch.is_inference_mode_enabled():
        return
    names = inference_tensors(model, buffers=False, params=False, training=True)
    if names:
        raise ValueError(
            f"{what}: the model's tensors ({names}) were created under torch.inference_mode(), "
            "and its forward in train mode updates them in place, which torch refuses outside "
            "it: build (or load) the model outside torch.inference_mode(), put it in eval mode "
            f"(model.eval()), or call {what} under torch.inference_mode(). The model was left "
            "as it was"
        )


def registry_reads_computed() -> bool:
    """Whether the layer registry describes computed tensors now (inside a measuring entry point,
    not inside a writer); else it refuses them."""
    return _MODE.get() == "read"


def refuse_computed() -> bool:
    """Whether the moment probe refuses computed tensors now (inside a writer)."""
    return _MODE.get() == "write"


def parametrized_names(module: nn.Module) -> list[str]:
    """The names of ``module``'s tensors computed by parametrizations (``[]``: none)."""
    if not parametrize.is_parametrized(module):
        return []
    return list(module.parametrizations)  # type: ignore[arg-type]


def owns_tensors(module: nn.Module) -> bool:
    """``module`` directly owns a parameter, or a tensor computed by a parametrization."""
    return next(module.parameters(False), None) is not None or bool(parametrized_names(module))


def machinery(model: nn.Module) -> set[int]:
    """``id`` of every module that implements a parametrization in ``model``: each layer's
    ``parametrizations`` dict, its ``ParametrizationList`` entries and their modules. They are
    no layers: their "output" is a layer's computed tensor."""
    out: set[int] = set()
    for module in model.modules():
        if parametrize.is_parametrized(module):
            out.update(id(m) for m in module.parametrizations.modules())  # type: ignore[union-attr]
    return out


def computed(module: nn.Module, name: str) -> torch.Tensor:
    """``module.<name>`` as computed by its parametrizations, detached: evaluated under
    ``torch.no_grad()`` with the parametrizations in eval mode (``spectral_norm`` divides by the
    singular value its current vectors give, without a power iteration that would change them)."""
    plist = module.parametrizations[name]  # type: ignore[index]
    modes = [(m, m.training) for m in plist.modules()]
    try:
        for m, _ in modes:
            m.training = False
        with torch.no_grad():
            return plist().detach()
    finally:
        for m, training in modes:
            m.training = training


def layer_tensor(module: nn.Module, name: str) -> torch.Tensor | None:
    """The tensor ``name`` of ``module`` as its forward sees it: the parameter (or buffer), or
    the computed tensor of a parametrization (:func:`computed`); ``None`` if there is none."""
    if parametrize.is_parametrized(module, name):
        return computed(module, name)
    value = getattr(module, name, None)
    return value if isinstance(value, torch.Tensor) else None


def trainable(module: nn.Module, name: str) -> bool:
    """Whether training moves ``module``'s tensor ``name``: a computed one when a parameter of
    its parametrizations requires grad; a parameter (or a missing one) unless it is frozen."""
    if parametrize.is_parametrized(module, name):
        plist = module.parametrizations[name]  # type: ignore[index]
        return any(p.requires_grad for p in plist.parameters())
    param = module._parameters.get(name)
    return param is None or bool(param.requires_grad)


def plain_copy(model: nn.Module, run: Callable[[nn.Module], Any], *, what: str) -> nn.Module:
    """A deep copy of ``model`` in which every computed tensor is a parameter holding its value
    (:func:`computed`), trainable as the tensors it was computed from (:func:`trainable`): the
    same forward, with the computed tensors as leaves (their curvature blocks are then those of
    ``dL/dW``). ``model`` itself is not changed.

    ``run(m)`` is the caller's forward on ``m``; it is run once on the copy (no grad) to check
    that the copy's forward runs the copy (:func:`_check_runs_copy`): a forward replaced on the
    instance (``model.forward = lambda *a: orig(*a)``, a closure the copy shares) runs ``model``
    instead, and its measurement would be of the wrong tensors; that raises (``what``: the entry
    point named), ``model`` left as it was."""
    twin = copy.deepcopy(model)
    _check_runs_copy(model, twin, run, what)
    for module in list(twin.modules()):  # the walk must not see the modules removed
        names = parametrized_names(module)
        values = {name: (computed(module, name).clone(), trainable(module, name)) for name in names}
        if not names:
            continue
        # not remove_parametrizations: it deletes the property from the Parametrized class,
        # which the copy shares with ``model``
        module.__class__ = type(module).__bases__[0]
        del module._modules["parametrizations"]
        for name, (value, grad) in values.items():
            module.register_parameter(name, nn.Parameter(value, requires_grad=grad))
    return twin


class _RanOriginal(Exception):
    """Raised by :func:`_check_runs_copy`'s hook: the copy's forward called ``model``'s module."""


def _check_runs_copy(
    model: nn.Module, twin: nn.Module, run: Callable[[nn.Module], Any], what: str
) -> None:
    """Raise ``ValueError`` if ``run(twin)`` calls a module of ``model`` (a forward replaced on
    the instance, which ``copy.deepcopy`` shares with the copy): stopped at that module's first
    call by a forward pre-hook, before it runs, inside ``preserved_state`` of both (the copy's
    buffers too: a train-mode forward moves BatchNorm statistics). Other errors of the run are
    left to the measurement, which runs it again and reports them."""

    def stop(name: str, _module: nn.Module, _args: Any) -> None:
        raise _RanOriginal(name)

    with preserved_state(model), preserved_state(twin, params=False), hook_handles() as handles:
        for name, module in model.named_modules():
            handles.add(module.register_forward_pre_hook(functools.partial(stop, name)))
        try:
            with torch.no_grad():
                run(twin)
        except _RanOriginal as hit:
            called = f"the original's module {str(hit)!r}" if str(hit) else "the original"
            replaced = [
                repr(n or "the model") for n, m in model.named_modules() if "forward" in vars(m)
            ]
            raise ValueError(
                f"{what}: the model has a parametrized layer, whose computed weight is measured "
                f"on a copy of the model, but the copy's forward runs the original model (it "
                f"called {called}): the forward of "
                f"{', '.join(replaced) or 'a module'} is replaced on the instance (model.forward "
                "= ...) by a function the copy shares. Remove that replacement for this call "
                "(del model.forward), or bind it to its module as a method (module.forward = "
                "types.MethodType(fn, module), fn taking self), which a copy rebinds to itself. "
                "Nothing was measured; the model is left as it was"
            ) from None
        except Exception:  # the measurement runs the forward again and reports its errors
            pass


def parametrized_note(module: nn.Module, name: str) -> str:
    """The note of a measured row of a computed tensor: which parametrization computes it and
    that its gradients are those of the computed tensor, not of the trainable ones."""
    plist = module.parametrizations[name]  # type: ignore[index]
    kinds = " and ".join(dict.fromkeys(type(p).__name__ for p in plist))
    trainable = ", ".join(f"parametrizations.{name}.{n}" for n, _ in plist.named_parameters())
    ours = (
        "; precondition_(how='parametrize')'s report has gamma_after, that of the trainable tensor"
        if "ConditioningMultiplier" in kinds
        else ""
    )
    return (
        f"{name!r} is computed by {kinds} (torch.nn.utils.parametrize): W and the gradient "
        f"columns are those of the computed {name} the forward uses (dL/dW), not of the "
        f"trainable tensors ({trainable or 'none'}){ours}"
    )
