"""Leave the model as it was: the one place that snapshots and restores a model's state.

:func:`model_kept` is used by every entry point that runs the model:

* measurements (the probe, ``diagnose``, curvature, landscapes, gradient spread) keep everything:
  parameters, buffers (BatchNorm running statistics and ``num_batches_tracked`` change in a
  train-mode forward), and the random number generators (dropout draws from them);
* data-dependent initializations (LSUV, GradInit, MetaInit, output scaling, preconditioning) change
  the weights on purpose: their tensors are put back only if they fail
  (:func:`restore_on_failure`).

Always restored, on success and on failure: every submodule's ``training`` flag, every parameter's
``requires_grad`` and ``.grad`` (the same tensor object, or ``None``), the hooks (any module or
parameter hook of initlab's added inside the block and still attached at its end is removed; hooks
the model's code installs as it runs, such as Hugging Face's output capturing, stay), and a
Hugging Face model's ``config.problem_type`` (its forward sets it from the first labels it is
given). The hooks that run as a parameter's gradient is accumulated are suspended for the
block: its post-accumulate-grad hooks (``register_post_accumulate_grad_hook``: PyTorch's
"optimizer step in the backward" recipe) and the hooks on its ``AccumulateGrad`` node (the older
recipe, ``p.view_as(p).grad_fn.next_functions[0][0].register_hook(...)``, and
``torch.distributed.optim._apply_optimizer_in_backward``), so that initlab's own backward passes
step no optimizer of the user's nor move the weights between batches: each is swapped for a
no-op under its key on entry and put back on exit, in its place, unless its handle removed it
meanwhile (:func:`_gradient_hooks_suspended`); torch's own (``DistributedDataParallel``'s,
FSDP's gradient reductions) stay (an entry point's passes run a DDP as the module it wraps and
reach its reducer's hooks only unarmed: :func:`~initlab._core.distributed.local_passes`).
Tensors are copied back in place under ``no_grad``, so tied tensors stay tied, references the user
holds stay valid, and nothing moves across devices. Memory: one copy of what is restored, shared
by nested blocks while the tensors keep its bits (:data:`_HELD`). Under the user's
``torch.autocast`` the block runs without autocast's cache of cast weights, which changes in place
would leave stale (:func:`~initlab._core.autocast.autocast_uncached`). Embeddings built with
``sparse=True`` give dense gradients inside the block (the same values; every method reads
gradients as dense tensors) and are sparse again after it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from initlab._core.autocast import autocast_uncached
from initlab._core.rng import global_rng_saved

__all__ = [
    "config_kept",
    "copies_held",
    "defined_in",
    "keeps_config",
    "model_kept",
    "model_modes",
    "preserved_state",
    "restore_modes",
    "restore_on_failure",
]

When = Literal["always", "failure", "never"]
F = TypeVar("F", bound=Callable[..., Any])

_ABSENT = object()

_MODULE_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
)
_HOOK_SIDE_DICTS = (
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks_with_kwargs",
)


def model_modes(model: nn.Module) -> dict[str, bool]:
    """The ``training`` flag of every submodule, by qualified name."""
    return {name: m.training for name, m in model.named_modules(remove_duplicate=False)}


def restore_modes(model: nn.Module, modes: dict[str, bool]) -> None:
    """Set every submodule's ``training`` flag back to ``modes`` (from :func:`model_modes`)."""
    for name, m in model.named_modules(remove_duplicate=False):
        if name in modes:
            m.training = modes[name]


def _hook_keys(model: nn.Module) -> dict[int, tuple[object, dict[str, set[int]]]]:
    keys: dict[int, tuple[object, dict[str, set[int]]]] = {}
    for m in model.modules():
        keys[id(m)] = (m, {a: set(getattr(m, a, {}) or {}) for a in _MODULE_HOOK_DICTS})
    for p in model.parameters():
        keys[id(p)] = (p, {"_backward_hooks": set(p._backward_hooks or {})})
    return keys


def defined_in(fn: object, package: str = "initlab") -> bool:
    """Whether the hook ``fn`` comes from ``package`` (initlab's own by default): its code, or its
    class's, lives there (through ``functools.partial`` and bound methods)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)  # a bound method: its function
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return module == package or module.startswith(f"{package}.")


class _Suspended:
    """A gradient hook taken out for a block: in its key's place, it does nothing when autograd
    calls it (and returns ``None``, as torch requires) and holds the real hook."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> None:
        return None


def _stays_active(fn: object) -> bool:
    """Whether a gradient hook stays active in a block: torch's own (``DistributedDataParallel``'s
    and FSDP's gradient reductions; an entry point's passes reach a DDP reducer's hooks only
    unarmed: :func:`~initlab._core.distributed.local_passes`), except ``torch.distributed.optim``'s
    optimizer steps (``_apply_optimizer_in_backward``: the user's optimizer)."""
    return defined_in(fn, "torch") and not defined_in(fn, "torch.distributed.optim")


def _noop_hook(*args: Any) -> None:
    return None


def _accumulator_hook_dicts(p: nn.Parameter) -> list[dict[Any, Any]]:
    """The dicts of the Python hooks on the ``AccumulateGrad`` node of ``p`` (its
    ``register_hook``'s, then its ``register_prehook``'s; the node the user reaches as
    ``p.view_as(p).grad_fn.next_functions[0][0]``, the older "optimizer step in the backward"
    recipe, and ``torch.distributed.optim._apply_optimizer_in_backward``): none where ``p``
    does not require a gradient or has no such node (an inference tensor; a tensor subclass that
    takes no ``view_as``, where the recipe cannot reach the node either). torch names no hook of
    a node; a node's hooks of a kind share one dict, which a hook's handle names
    (``hooks_dict_ref``): a no-op is registered to read it and removed (a node that had no hook
    of that kind keeps an empty dict)."""
    if not p.requires_grad or not p.is_leaf:
        return []
    try:
        with torch.inference_mode(False), torch.enable_grad():
            view = p.view_as(p)
    except (RuntimeError, NotImplementedError, TypeError):  # a subclass without views (its
        return []  # __torch_dispatch__ declining: TypeError "Multiple dispatch failed"): no recipe
    edges = view.grad_fn.next_functions if view.grad_fn is not None else ()
    node = edges[0][0] if edges else None
    if type(node).__name__ != "AccumulateGrad":
        return []
    dicts = []
    for register in (node.register_hook, node.register_prehook):
        handle = register(_noop_hook)
        hooks = handle.hooks_dict_ref()
        handle.remove()
        if hooks:
            dicts.append(hooks)
    return dicts


def _gradient_hook_dicts(params: list[nn.Parameter]) -> Iterator[dict[Any, Any]]:
    """For each of ``params``: its post-accumulate-grad hooks (``p._post_accumulate_grad_hooks``,
    which autograd reads at each accumulation) and its ``AccumulateGrad`` node's hooks
    (:func:`_accumulator_hook_dicts`)."""
    for p in params:
        hooks = getattr(p, "_post_accumulate_grad_hooks", None)
        if hooks:
            yield hooks
        yield from _accumulator_hook_dicts(p)


@contextmanager
def _gradient_hooks_suspended(params: list[nn.Parameter]) -> Iterator[None]:
    """Run the block with the hooks that run when a gradient of ``params`` is accumulated into
    ``.grad`` suspended (:func:`_gradient_hook_dicts`: an optimizer stepped in the backward), each
    swapped for a :class:`_Suspended` no-op under the same key, torch's own left active
    (:func:`_stays_active`); on exit, on failure and on ``KeyboardInterrupt`` too, each key still
    there gets its hook back, in its place. The keys stay in the dicts meanwhile, so a user's
    ``handle.remove()`` during the block removes the hook for good (it would otherwise come back
    on exit), and hooks added in the block stay after the old ones. The dict objects are kept:
    torch's autograd holds them. A hook already suspended (a nested block) is left to the block
    that suspended it."""
    saved: list[tuple[dict[Any, Any], Any, _Suspended]] = []
    try:
        for hooks in _gradient_hook_dicts(params):
            for key, fn in list(hooks.items()):
                if not isinstance(fn, _Suspended) and not _stays_active(fn):
                    hooks[key] = _Suspended(fn)
                    saved.append((hooks, key, hooks[key]))
        yield
    finally:
        for hooks, key, stub in saved:
            if hooks.get(key) is stub:  # not removed (nor replaced) in the block
                hooks[key] = stub.fn


def _remove_new_hooks(before: dict[int, tuple[object, dict[str, set[int]]]]) -> None:
    """Remove the hooks initlab added since ``before`` (:func:`_hook_keys`). Hooks the model's
    own code installs during a pass stay: Hugging Face installs its output-capturing hooks on the
    first forward and marks the model as hooked, so removing them breaks every later call."""
    for obj, dicts in before.values():
        for attr, old in dicts.items():
            hooks = getattr(obj, attr, None)
            if not hooks:
                continue
            for key in [k for k, fn in hooks.items() if k not in old and defined_in(fn)]:
                del hooks[key]
                for side in _HOOK_SIDE_DICTS:
                    getattr(obj, side, {}).pop(key, None)


#: The copies held by the blocks running now (:func:`model_kept`, :func:`copies_held`), innermost
#: last: a nested block takes a tensor's copy from an enclosing one when the tensor is still bit
#: for bit that copy, so a measurement inside a method (or inside ``diagnose``, inside ``doctor``)
#: adds no copy of unchanged weights. Copies are never written to, so a shared one restores exactly
#: the bits the tensor had when the inner block began. A ``ContextVar``: one stack per thread.
_HELD: ContextVar[tuple[dict[object, tuple[torch.Tensor, torch.Tensor]], ...]] = ContextVar(
    "initlab_held_copies", default=()
)

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _plain(t: torch.Tensor) -> bool:
    """A dense tensor whose bits :func:`_same_bits` can compare (no subclass, sparse, quantized
    or meta tensor: those are always copied)."""
    return (
        type(t) in (torch.Tensor, nn.Parameter)
        and t.layout == torch.strided
        and not t.is_meta
        and not t.is_quantized
        and not t.is_nested
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element size (floating point and complex), so that
    equality is bit equality: ``-0.0`` differs from ``0.0`` and a NaN equals its own copy."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_floating_point() and t.element_size() in _INT_OF_SIZE:
        return t.view(_INT_OF_SIZE[t.element_size()])
    return t


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bits (same shape, dtype and device); ``False`` where
    that cannot be told (meta tensors, a layout ``torch.equal`` does not take): copied back."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device or a.is_meta:
        return False
    if not (_plain(a) and _plain(b)):
        try:
            return not a.is_floating_point() and bool(torch.equal(a, b))
        except (NotImplementedError, RuntimeError):
            return False
    return bool(torch.equal(_bits(a), _bits(b)))


def _key(t: torch.Tensor) -> object:
    """Where ``t``'s elements lie (so a parameter and its ``state_dict()`` alias, a ``detach()``,
    are one tensor here), or the object itself for a tensor :func:`_plain` does not cover. Two
    tensors may share a key over time (memory freed and reused after ``p.data = other``): a copy
    is shared only after a bit-for-bit comparison (:func:`_held_copy`), so a key is a hint."""
    if not _plain(t):
        return id(t)
    return (t.device, t.dtype, t.data_ptr(), tuple(t.shape), t.stride())


def _held_copy(t: torch.Tensor) -> torch.Tensor | None:
    """An enclosing block's copy of ``t`` that still has ``t``'s bits, else ``None``."""
    if not _plain(t):
        return None
    key = _key(t)
    for held in reversed(_HELD.get()):
        entry = held.get(key)
        if entry is not None and _same_bits(t, entry[1]):
            return entry[1]
    return None


def _snapshot(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    seen: dict[object, tuple[torch.Tensor, torch.Tensor]] = {}
    for t in tensors:
        if _key(t) not in seen:
            copy = _held_copy(t)
            seen[_key(t)] = (t, t.detach().clone() if copy is None else copy)
    return list(seen.values())


@contextmanager
def _holding(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """Offer ``saved``'s copies to the blocks nested in this one (:data:`_HELD`). On exit the
    offer is emptied and taken off this context's stack by identity: blocks that end out of
    order (two generators) or in another context (a thread, a task) neither raise nor keep
    copies alive."""
    mine = {_key(t): (t, c) for t, c in saved}
    _HELD.set((*_HELD.get(), mine))
    try:
        yield
    finally:
        mine.clear()
        _HELD.set(tuple(h for h in _HELD.get() if h is not mine))


@contextmanager
def copies_held(tensors: Iterable[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Copies of ``tensors`` (in their order, tied ones sharing one) for the block: taken from an
    enclosing block where a tensor still has those bits, and offered to the blocks nested in this
    one. The copies must not be written to."""
    tensors = list(tensors)
    saved = _snapshot(tensors)
    copies = {_key(t): c for t, c in saved}
    with _holding(saved):
        yield [copies[_key(t)] for t in tensors]


def _put_back(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for t, old in saved:
            if not _same_bits(t, old):
                t.copy_(old)


@contextmanager
def model_kept(
    model: nn.Module,
    *,
    params: When = "always",
    buffers: When = "always",
    hooks: When = "always",
    rng: bool = False,
) -> Iterator[None]:
    """Run the block, then put ``model`` back as it was (see the module docstring).

    Args:
        model: the model.
        params: when parameter values are restored: ``"always"``, on ``"failure"``, ``"never"``.
        buffers: the same for buffers.
        hooks: the same for removing the hooks the block added (``"failure"``: a method whose
            result is a hook, kept when it succeeds).
        rng: also restore the CPU and CUDA random number generator states.

    Example:
        >>> net = nn.Linear(2, 2)
        >>> before = net.weight.detach().clone()
        >>> with model_kept(net):
        ...     _ = net.weight.data.mul_(0)
        >>> torch.equal(net.weight, before)
        True
    """
    plist = list(model.parameters())
    saved = {
        "params": _snapshot(plist) if params != "never" else [],
        "buffers": _snapshot(list(model.buffers())) if buffers != "never" else [],
    }
    grads = [(p, p.grad, p.requires_grad) for p in plist]
    modes = model_modes(model)
    added = _hook_keys(model)
    rng_back = global_rng_saved() if rng else None
    sparse = [
        m for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
    ]
    failed = True
    try:
        for m in sparse:
            m.sparse = False
        with (
            autocast_uncached(),
            config_kept(model),
            _gradient_hooks_suspended(plist),
            _holding(saved["params"] + saved["buffers"]),
        ):
            yield
        failed = False
    finally:
        for m in sparse:
            m.sparse = True
        for kind, when in (("params", params), ("buffers", buffers)):
            if when == "always" or (when == "failure" and failed):
                _put_back(saved[kind])
        for p, g, req in grads:
            p.grad = g
            if p.requires_grad != req:  # torch refuses setting it on an inference tensor
                p.requires_grad_(req)
        restore_modes(model, modes)
        if hooks == "always" or (hooks == "failure" and failed):
            _remove_new_hooks(added)
        if rng_back is not None:
            rng_back()


@contextmanager
def config_kept(model: nn.Module) -> Iterator[None]:
    """Run the block, then put a Hugging Face model's ``config.problem_type`` back (its forward
    sets it from the first labels it is given, on a config the models built from it share);
    nothing where the model has none."""
    config = getattr(model, "config", None)
    problem = getattr(config, "problem_type", _ABSENT)
    try:
        yield
    finally:
        if problem is not _ABSENT and getattr(config, "problem_type", _ABSENT) != problem:
            config.problem_type = problem


def keeps_config(fn: F) -> F:
    """Run ``fn(model, ...)`` inside :func:`config_kept` of its model (the first positional
    argument or ``model=``): for the entry points that run the model without
    :func:`model_kept` (the curvature and landscape ones call it functionally)."""

    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        model = args[0] if args else kwargs.get("model")
        with config_kept(model):
            return fn(*args, **kwargs)

    return inner  # type: ignore[return-value]


def restore_on_failure(model: nn.Module) -> AbstractContextManager[None]:
    """:func:`model_kept` for a method that changes the weights: tensors come back only if the
    block raises (modes, ``requires_grad``, ``.grad`` and hooks always)."""
    return model_kept(model, params="failure", buffers="failure")


def preserved_state(model: nn.Module, *, params: bool = True) -> AbstractContextManager[None]:
    """:func:`model_kept` for a measurement: parameters (with ``params``), buffers and the RNGs
    always come back."""
    return model_kept(model, params="always" if params else "never", rng=True)
