"""The tensors of a probed module call: :func:`_flatten_call` lists its arguments' tensors with
their paths; :func:`_fresh_full_view` says where an output's gradient hook must also go on the
output's base (an in-place op on a view output rebases it and its own hook never fires);
:func:`_inner_outputs` finds the outputs that another output of the call is computed from."""

from __future__ import annotations

import torch

from initlab._core.pytree import flatten_tensors


def _flatten_call(args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a module call's arguments with their paths (positions, then keywords):
    ``flatten_tensors(list(args)) + flatten_tensors(dict(kwargs))``, with a shortcut for the
    common call of tensors only."""
    if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
        return [(str(i), a) for i, a in enumerate(args)]
    return flatten_tensors(list(args)) + flatten_tensors(dict(kwargs))


def _fresh_full_view(t: torch.Tensor, base: torch.Tensor | None, inputs: set[int]) -> bool:
    """``t`` is a row-major view of all of ``base``, a non-leaf made by the module's forward."""
    return (
        base is not None
        and base.requires_grad
        and not base.is_leaf
        and id(base) not in inputs
        and base.numel() == t.numel()
        and base.is_contiguous()
        and t.is_contiguous()
        and t.storage_offset() == base.storage_offset()
    )


def _inner_outputs(
    outs: list[tuple[str, torch.Tensor]], leaves: list[torch.Tensor], bounded: bool = True
) -> set[int]:
    """The ids of the outputs that another output of the same call is computed from (an
    ``nn.LSTMCell``'s ``c``, with ``h = o * tanh(c)``; ``z`` of a module returning
    ``(tanh(z), z)``; a sequence ``y`` returned beside ``y[:, -1]``).

    The gradient autograd delivers at such an output ``o_j`` is ``dL/do_j`` through its uses
    outside the call *plus* the path through the other outputs, ``sum_k (do_k/do_j)^T dL/do_k``:
    its ``dy`` must be taken on a copy that only the rest of the graph uses. Found by a walk of
    the call's autograd graph from the outputs' nodes back to the inputs' (``leaves``), done
    only for a call with two or more distinct outputs that require grad. ``bounded``: the inputs
    were not written in place during the call, so their nodes are older than the call's and the
    walk can stop at older nodes; an input written in place has a node made inside the call, and
    the walk then goes on until it meets the inputs' nodes (slower, never short)."""
    by_edge: dict[tuple[object, int], set[int]] = {}  # (node, output_nr) -> output ids
    for _, t in outs:
        if t.grad_fn is not None:
            by_edge.setdefault((t.grad_fn, t.output_nr), set()).add(id(t))
    if sum(len(ids) for ids in by_edge.values()) < 2:
        return set()
    stop = {t.grad_fn for t in leaves if t.grad_fn is not None}
    # Nodes made before the call's newest input are not the call's: the walk ends there (an
    # output that is an input, or a tensor kept from before the call, would else lead it through
    # the whole graph upstream, every earlier layer once per call). Sequence numbers grow in the
    # order autograd records nodes on a thread.
    floor = max((node._sequence_nr() for node in stop), default=-1) if bounded else -1
    found: set[int] = set()
    seen: set[object] = set()
    stack = [
        edge
        for node, _ in by_edge
        if node not in stop
        for edge in node.next_functions
        if edge[0] is not None
    ]
    while stack:
        edge = stack.pop()
        found.update(by_edge.get(edge, ()))
        node = edge[0]
        if node in seen or node in stop or node._sequence_nr() <= floor:
            continue
        seen.add(node)
        stack.extend(e for e in node.next_functions if e[0] is not None)
    return found
