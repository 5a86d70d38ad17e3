"""The model called with other tensors in place of its parameters and buffers.

``torch.func.functional_call`` swaps the tensors of a state dict into the module for one call and
puts the originals back. With a submodule registered under two names (``encoder.embed_tokens is
shared`` in transformers 4.x's T5 and BART, a block reused in a ``ModuleList``), its default
``tie_weights=True`` swaps that submodule's entry once per name, saving the tensor it had just
put in the second time, and its restore leaves that tensor in the module: after the call the model
holds a detached (under ``vmap``: a batched) tensor instead of its parameter (torch 2.4 to 2.13 at
least). :func:`functional_call` names every entry of the model once (one name per submodule, the
first one, and per local name) and calls with ``tie_weights=False``: each entry is swapped once,
tied tensors in different modules (a head sharing the embedding's weight) included.

An ``nn.DataParallel`` model, which torch's stateless API refuses ("can't be used with
nn.DataParallel module"), is called through the module it wraps, the state's names without their
``module.`` prefix: without devices (on the CPU) its forward is that module's call; with devices,
the batch goes to its first one, as its one-device forward puts it there (with several, the
replicas' BatchNorms in training mode would see parts of the batch; here the whole batch).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["functional_call", "quiet_vmap_fallback"]

# torch's UserWarning where vmap runs an op without a batching rule by a loop (aten::gru_cell):
# it asks to file a torch issue, about a vmap of initlab's, not of the user's
_VMAP_FALLBACK = (
    r"There is a performance drop because we have not yet implemented the batching rule for "
)


@contextmanager
def quiet_vmap_fallback() -> Iterator[None]:
    """Silence exactly torch's "performance drop ... batching rule for <op>" ``UserWarning``
    inside initlab's own ``torch.func.vmap`` (its loop fallback gives the same values); every
    other warning passes as before. ``warnings.catch_warnings`` swaps the process's filters: for
    the calling thread only, never inside threads that run at once (the study's blocks)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_VMAP_FALLBACK, category=UserWarning)
        yield


def functional_call(
    module: nn.Module,
    state: Mapping[str, torch.Tensor | None] | tuple[Mapping[str, torch.Tensor | None], ...],
    args: Any = (),
    kwargs: Mapping[str, Any] | None = None,
) -> Any:
    """``module(*args, **kwargs)`` with ``state`` (one mapping, or several merged in order) in
    place of the tensors it names, keyed as ``named_parameters()``/``named_buffers()`` key them
    (a tied or shared tensor under its first name); every other name of that tensor follows it.
    The module is left as it was, shared submodules included (see the module docstring)."""
    merged: dict[str, torch.Tensor | None] = {}
    for part in state if isinstance(state, tuple) else (state,):
        merged.update(part)
    while isinstance(module, nn.DataParallel):
        if module.device_ids:  # as its forward does, on its first device only
            args = args if isinstance(args, tuple) else (args,)
            moved, named = module.scatter(args, dict(kwargs or {}), module.device_ids[:1])
            args, kwargs = (moved[0] if moved else ()), (named[0] if named else {})
        merged = {k.removeprefix("module."): v for k, v in merged.items()}
        module = module.module
    return torch.func.functional_call(
        module, _every_entry(module, merged), args, kwargs, tie_weights=False, strict=False
    )


def _every_entry(
    module: nn.Module, state: Mapping[str, torch.Tensor | None]
) -> dict[str, torch.Tensor | None]:
    """``state`` keyed by one name per entry of every distinct submodule: an entry holding the
    same tensor as a named one gets its value; other names of the model's tensors in ``state``
    (a shared submodule's second name) are dropped, names the model does not have kept.

    One walk of ``named_modules(remove_duplicate=False)``, in the order ``named_parameters()``
    and ``named_buffers()`` take: a tensor's first name is the one they give it."""
    first: dict[int, str] = {}  # tensor -> its first name
    entries: list[tuple[str, torch.Tensor]] = []  # one per slot of a distinct submodule
    named: set[str] = set()  # every name of every tensor
    seen: set[int] = set()
    for prefix, sub in module.named_modules(remove_duplicate=False):
        distinct = id(sub) not in seen
        seen.add(id(sub))
        for local, t in (*sub._parameters.items(), *sub._buffers.items()):
            if t is None:
                continue
            name = f"{prefix}.{local}" if prefix else local
            named.add(name)
            first.setdefault(id(t), name)
            if distinct:
                entries.append((name, t))
    out = {name: state[first[id(t)]] for name, t in entries if first[id(t)] in state}
    out.update((k, v) for k, v in state.items() if k not in named)  # for torch to report
    return out
