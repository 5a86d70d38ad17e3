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
parameter hook added inside the block and still attached at its end is removed), and a Hugging Face
model's ``config.problem_type`` (its forward sets it from the first labels it is given). Tensors are
copied back in place under ``no_grad``, so tied tensors stay tied, references the user holds stay
valid, and nothing moves across devices. Memory: one copy of what is restored. Under the user's
``torch.autocast`` the block runs without autocast's cache of cast weights, which changes in place
would leave stale (:func:`~initlab._core.autocast.autocast_uncached`). Embeddings built with
``sparse=True`` give dense gradients inside the block (the same values; every method reads
gradients as dense tensors) and are sparse again after it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from initlab._core.autocast import autocast_uncached

__all__ = [
    "config_kept",
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


def _remove_new_hooks(before: dict[int, tuple[object, dict[str, set[int]]]]) -> None:
    for obj, dicts in before.values():
        for attr, old in dicts.items():
            hooks = getattr(obj, attr, None)
            if not hooks:
                continue
            for key in [k for k in hooks if k not in old]:
                del hooks[key]
                for side in _HOOK_SIDE_DICTS:
                    getattr(obj, side, {}).pop(key, None)


def _snapshot(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for t in tensors:
        if id(t) not in seen:
            seen[id(t)] = (t, t.detach().clone())
    return list(seen.values())


def _put_back(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for t, old in saved:
            if t.shape != old.shape or not torch.equal(t, old):
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
    cpu_rng = torch.get_rng_state() if rng else None
    cuda_rng = torch.cuda.get_rng_state_all() if rng and torch.cuda.is_initialized() else None
    sparse = [
        m for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
    ]
    failed = True
    try:
        for m in sparse:
            m.sparse = False
        with autocast_uncached(), config_kept(model):
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
            p.requires_grad_(req)
        restore_modes(model, modes)
        if hooks == "always" or (hooks == "failure" and failed):
            _remove_new_hooks(added)
        if cpu_rng is not None:
            torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


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
