"""Make data-dependent statistics identical on every rank of a ``torch.distributed`` job.

When a process group is initialized, every statistic a data-dependent init measures (LSUV
variances, GradInit gradients and objectives, the output std) is summed over ranks before it is
used, and random draws are taken on rank 0 and broadcast, so all ranks end with bit-identical
weights. Without a process group every function here is the identity.

The ranks must also *start* alike and *stay in step*; the checks that guarantee it raise the same
:class:`RankMismatchError` on every rank (never a hang, nor gloo's "Connection closed by peer"
when one rank stops alone):

* :func:`check_same_parameters`: every rank holds bit-identical parameters and buffers at entry
  (an exact checksum of their bits, all-reduced). Left out: a batch norm's ``num_batches_tracked``
  counter, and the running statistics of a norm layer that normalizes by the batch's own
  statistics in the modes the method measures in (a train-mode BatchNorm: DDP without
  SyncBatchNorm leaves each rank's running statistics its own); they change no output the
  method reads (see :func:`_read_buffers`);
* :func:`run_together`: a step that can fail on one rank (reading its data, a forward or
  backward pass on it) fails on all;
* :func:`in_lockstep`: iterations over each rank's own batches stop together; ranks with
  different numbers of batches are an error;
* :func:`failing_together` with :func:`checkpoint`: a block whose collectives sit inside its
  passes (LSUV's hooks) fails on every rank when it fails on one, or when the ranks reach
  different collectives (their data took different paths through the model).

The passes themselves are local: a ``DistributedDataParallel`` model runs the module it wraps,
without DDP's own collectives (:func:`local_passes`), so that the only collectives are the ones
above and every statistic is the rank's own until it is pooled explicitly.
"""

from __future__ import annotations

import functools
import inspect
import zlib
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from initlab._core.state import defined_in, model_modes, restore_modes

__all__ = [
    "RankMismatchError",
    "all_reduce_sum",
    "broadcast_model",
    "check_same_count",
    "check_same_parameters",
    "check_same_trainable",
    "check_same_values",
    "checkpoint",
    "failing_together",
    "in_lockstep",
    "is_distributed",
    "local_backward",
    "local_passes",
    "run_together",
    "same_options",
    "world_size",
]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])
_END = object()


class RankMismatchError(ValueError):
    """The ranks of a ``torch.distributed`` job disagree (their parameters, their number of
    batches) or one of them failed; raised on every rank with the same message."""


def is_distributed() -> bool:
    """Whether a ``torch.distributed`` process group is initialized with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


_DDP = nn.parallel.DistributedDataParallel

#: The DDP wrappers :func:`local_passes` runs as their wrapped modules now (this context).
_BYPASSED: ContextVar[tuple[nn.parallel.DistributedDataParallel, ...]] = ContextVar(
    "initlab_ddp_bypassed", default=()
)


@contextmanager
def local_passes(model: nn.Module) -> Iterator[None]:
    """For the block, every ``DistributedDataParallel`` in ``model`` (``model`` itself, or a
    submodule) calls the module it wraps directly, as a plain module on this rank: its inputs
    moved to ``device_ids[0]`` where DDP has one (DDP's own ``to_kwargs``), nothing else of DDP's
    forward run; and the backward passes (:func:`local_backward`) accumulate the gradients
    without DDP's reducer. Put back after, also on failure.

    DDP's forward carries collectives of its own: it broadcasts rank 0's buffers
    (``broadcast_buffers=True`` and a model with buffers, e.g. a BatchNorm), may rebuild its
    gradient buckets (a broadcast), and arms its reducer, whose hooks on the parameters'
    gradient accumulators all-reduce the gradients in the backward (their mean over the ranks).
    An initlab pass is local (its statistics are this rank's own, pooled only where an entry
    point pools them explicitly, after the ranks agree: :func:`run_together`,
    :func:`in_lockstep`); DDP's collectives inside it met those agreement collectives when one
    rank failed or had more batches (gloo aborted every process, or "Connection closed by
    peer"), and mixed DDP-averaged gradients into per-rank statistics. DDP's state is left as it
    was: no DDP forward runs, and no gradient accumulator DDP hooks (a reducer counts the
    backward passes that reach it even unarmed: a ``static_graph=True`` DDP before its first
    iteration would count initlab's passes as part of it), except through a reentrant
    checkpoint, unarmed (:func:`local_backward`). The layer names are the model's
    (``module.0``), and a ``loss_fn(model, batch)`` gets the DDP model as given. DDP's
    experimental ``mixed_precision`` casts are not applied.

    The wrapper's call reads ``forward`` off the instance first (``nn.Module.__call__``): the
    block sets an instance attribute there (:func:`_wrapped_call`, which a deep copy of the model
    made in the block calls on the copy) and removes it after (a DDP already so set, by an
    enclosing block, is left to it). Without a DDP in ``model``: nothing."""
    wrappers = [m for m in model.modules() if isinstance(m, _DDP) and "forward" not in vars(m)]
    set_here = []
    token = _BYPASSED.set(_BYPASSED.get() + tuple(wrappers))
    try:
        for ddp in wrappers:
            vars(ddp)["forward"] = functools.partial(_wrapped_call, ddp)
            set_here.append((ddp, vars(ddp)["forward"]))
        yield
    finally:
        for ddp, forward in set_here:
            if vars(ddp).get("forward") is forward:
                del vars(ddp)["forward"]
        _BYPASSED.reset(token)


def local_backward(loss: torch.Tensor, what: str = "") -> None:
    """``loss.backward()``; while :func:`local_passes` runs a DDP as its wrapped module, the same
    gradients accumulated into each leaf's ``.grad`` by hand, as torch's accumulator does
    (:func:`_accumulate`):
    ``torch.autograd.grad`` over the leaves of ``loss``'s graph runs their tensor hooks but not
    their gradient accumulators, on which DDP's reducer has its hooks. Those hooks return at
    once while the reducer is unarmed (no DDP forward ran, or the last one's backward finished),
    but a reducer left armed by a DDP forward of the user's without its backward would
    all-reduce: ``torch.autograd.grad`` reaches none of them, whatever the reducer's state.

    A reentrant activation checkpoint in the graph (``torch.utils.checkpoint`` with
    ``use_reentrant=True``, Hugging Face's ``gradient_checkpointing_enable()`` in many versions)
    refuses ``torch.autograd.grad``, and its recomputed segment's leaves are not in the graph
    before it runs: there ``loss.backward()`` runs, DDP's hooks returning unarmed (a reducer
    left armed, as above, reduces that pass), unless a DDP's reducer acts on every backward that
    reaches it, armed or not (:func:`_counts_unarmed`), which raises a ``ValueError`` naming
    the cause and what to do (prefixed by ``what``)."""
    bypassed = _BYPASSED.get()
    if not bypassed:
        loss.backward()
        return
    leaves, reentrant = _graph_leaves(loss)
    if reentrant:
        _check_reentrant(bypassed, what)
        loss.backward()
        return
    if not leaves:  # nothing to accumulate into: what loss.backward() would do
        return
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    taken: set[int] = set()
    with torch.no_grad():
        for leaf, g in zip(leaves, grads, strict=True):
            if g is not None:
                _accumulate(leaf, g, shared=id(g) in taken)
                taken.add(id(g))


def _accumulate(leaf: torch.Tensor, g: torch.Tensor, *, shared: bool) -> None:
    """Accumulate ``g`` into ``leaf.grad`` as torch's ``AccumulateGrad`` does outside grad mode
    (``torch/csrc/autograd/functions/accumulate_grad.h``), then run the leaf's
    post-accumulate-grad hooks.

    * no ``.grad``: ``g`` itself where it is laid out like the leaf (its strides) and no other
      leaf took it (``shared``: one gradient of ``w1 + w2`` for both, which torch clones), else
      a copy laid out like the leaf (an expanded gradient, of a sum, is not a tensor to write
      into); a sparse ``g`` (``F.embedding(..., sparse=True)``) stays sparse (cloned if shared);
    * a ``.grad``: updated in place, ``grad += g`` (the same tensor object, which a caller may
      hold), except a sparse ``.grad`` with a dense ``g``: replaced by ``g + grad``.

    The hooks run after every gradient is computed, not as each is accumulated; a DDP's own
    (its Python reducer's all-reduce) are skipped. A model's parameters have their users' hooks
    suspended inside an entry point (:func:`~initlab._core.state.model_kept`), so these are
    those of other leaves (an input that requires grad). The hooks of a leaf's
    ``AccumulateGrad`` node itself do not run (a parameter's are suspended there too)."""
    grad = leaf.grad
    if grad is None:
        if g.layout != torch.strided:
            leaf.grad = g.clone() if shared else g
        elif shared or g.stride() != leaf.stride():
            leaf.grad = torch.empty_like(leaf).copy_(g)
        else:
            leaf.grad = g
    elif grad.layout != torch.strided and g.layout == torch.strided:
        leaf.grad = g + grad
    else:
        grad.add_(g)
    for hook in list((getattr(leaf, "_post_accumulate_grad_hooks", None) or {}).values()):
        if not defined_in(hook, "torch.nn.parallel"):
            hook(leaf)


def _counts_unarmed(ddp: nn.parallel.DistributedDataParallel) -> str | None:
    """Why ``ddp``'s reducer would take a backward pass that reaches its parameters for part of
    its training even though no DDP forward armed it (``None``: it would not). torch's
    ``Reducer::autograd_hook`` does this work before its unarmed early return (torch 2.4 to
    2.13): a static graph before its first iteration's backward has run counts each
    parameter's hooks (``static_graph_first_iteration``; DDP's ``_DDPSink`` sets
    ``_static_graph_delay_allreduce_enqueued`` in that backward), and ``find_unused_parameters``
    without a static graph marks the parameter used in the next iteration (its
    ``local_used_map_``, reset only when an armed backward finishes); the Python reducer
    (``torch._dynamo`` ``optimize_ddp="python_reducer"``) all-reduces in post-accumulate-grad
    hooks."""
    if ddp.static_graph:
        if not getattr(ddp, "_static_graph_delay_allreduce_enqueued", False):
            return "static_graph=True before its first training iteration"
    elif ddp.find_unused_parameters:
        return "find_unused_parameters=True"
    if getattr(ddp, "_accum_grad_hooks", None):
        return "the Python reducer (torch._dynamo's optimize_ddp='python_reducer')"
    return None


def _check_reentrant(bypassed: Iterable[nn.parallel.DistributedDataParallel], what: str) -> None:
    """Raise ``ValueError`` if one of the ``bypassed`` DDPs' reducers acts on an unarmed
    backward (:func:`_counts_unarmed`): a reentrant checkpoint's backward cannot be run without
    reaching its gradient accumulators."""
    causes = sorted({c for c in map(_counts_unarmed, bypassed) if c is not None})
    if causes:
        raise ValueError(
            f"{what + ': ' if what else ''}the model runs a reentrant activation checkpoint "
            "(torch.utils.checkpoint with use_reentrant=True; Hugging Face's "
            "gradient_checkpointing_enable() in many versions), which torch back-propagates only "
            "through the parameters' gradient accumulators, where DistributedDataParallel's "
            f"reducer has its hooks; with {' and '.join(causes)} that reducer takes every backward "
            "pass that reaches them into its training, so initlab's passes would change the "
            "DDP's next iterations. Use a non-reentrant checkpoint (use_reentrant=False; "
            "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': "
            "False})), or pass the module the DDP wraps (model.module) for this call"
        )


def _graph_leaves(loss: torch.Tensor) -> tuple[list[torch.Tensor], bool]:
    """The tensors ``loss.backward()`` would accumulate a gradient into: those of the gradient
    accumulator nodes (``AccumulateGrad``, by type) its graph reaches (each once, in the order
    first reached); and whether the graph holds a reentrant checkpoint (a node of a
    ``CheckpointFunction``, ``torch.utils.checkpoint``'s with ``use_reentrant=True``), whose
    segment's leaves are found only as its backward runs."""
    if loss.grad_fn is None:  # a leaf itself
        return ([loss] if loss.requires_grad else []), False
    leaves: dict[int, torch.Tensor] = {}
    reentrant = False
    seen, todo = {loss.grad_fn}, [loss.grad_fn]
    while todo:
        for node, _ in todo.pop().next_functions:
            if node is None or node in seen:
                continue
            seen.add(node)
            if type(node).__name__ == "AccumulateGrad":
                leaves.setdefault(id(node.variable), node.variable)
                continue
            forward_cls = getattr(type(node), "_forward_cls", None)
            reentrant |= getattr(forward_cls, "__name__", "") == "CheckpointFunction"
            todo.append(node)  # a custom Function's node is its ctx: a ctx.variable is no leaf
    return list(leaves.values()), reentrant


def _wrapped_call(ddp: nn.parallel.DistributedDataParallel, *inputs: Any, **kwargs: Any) -> Any:
    """``ddp``'s forward in :func:`local_passes`: its wrapped module called (hooks and all), the
    inputs moved to DDP's device as its own forward moves them. Set on the instance as
    ``functools.partial(_wrapped_call, ddp)``, not a closure: ``copy.deepcopy`` of the model
    inside the block (a parametrized model's copy, :func:`~initlab._core.parametrized.plain_copy`)
    copies a partial's arguments through its memo, so the copy's forward calls the copy's module
    (a closure is shared, and would run the original's)."""
    if ddp.device_ids:
        moved, moved_kwargs = ddp.to_kwargs(inputs, kwargs, ddp.device_ids[0])
        inputs, kwargs = moved[0], moved_kwargs[0]
    return ddp.module(*inputs, **kwargs)


def world_size() -> int:
    """Number of ranks (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def all_reduce_sum(tensors: Iterable[torch.Tensor]) -> None:
    """Sum each tensor over ranks, in place (one flattened collective for all of them, on the
    backend's device: the CPU bookkeeping of a method goes to the GPU under NCCL and back)."""
    tensors = list(tensors)
    if not tensors or not is_distributed():
        return
    flat = torch.cat([t.reshape(-1).to(_device(), torch.float64) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def broadcast_model(model: nn.Module, src: int = 0) -> None:
    """Copy every parameter and buffer of rank ``src`` to all ranks (in place)."""
    if not is_distributed():
        return
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=src)


def _device() -> torch.device:
    """Where this backend's collectives take their tensors (NCCL: the current CUDA device)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _min_max(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The element-wise minimum and maximum of an int64 tensor over ranks (one collective)."""
    both = torch.cat([values.reshape(-1), -values.reshape(-1)]).to(_device())
    dist.all_reduce(both, op=dist.ReduceOp.MIN)
    n = values.numel()
    return both[:n].cpu().view_as(values), (-both[n:]).cpu().view_as(values)


#: Where the rank-comparison bookkeeping is made (then moved to :func:`_device`): never torch's
#: default device (``torch.set_default_device``).
_CPU = torch.device("cpu")

_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def _checksum(t: torch.Tensor) -> list[int]:
    """Exact, order-independent checksum of a tensor's bits, for every dtype: ``[numel, Σ (l + 7
    h), Σ l h]`` over the 32-bit words ``w = 2^16 h + l`` of its elements (a 1- or 2-byte element
    read as a signed integer, modulo ``2^32``; an 8- or 16-byte one (float64, int64, complex64,
    complex128) as 2 or 4 words). Integer sums do not depend on the thread count or reduction
    order, so equal tensors give equal checksums on every rank. A quantized tensor is read as the
    values it represents (``dequantize``), a sparse one as its dense values."""
    t = t.detach()
    if t.is_quantized:
        t = t.dequantize()
    if t.layout != torch.strided:
        t = t.to_dense()
    t = t.resolve_conj().resolve_neg()
    size = t.element_size()
    if size in _INTS:  # a same-size view takes any strides (sub-byte dtypes have no copy kernel)
        words = t.view(_INTS[size]).reshape(-1)
    else:  # a view to a smaller dtype needs contiguous memory
        words = t.contiguous().reshape(-1).view(torch.int32)
    bits = words.to(torch.int64) & 0xFFFFFFFF
    low, high = bits & 0xFFFF, bits >> 16
    return [t.numel(), int((low + 7 * high).sum()), int((low * high).sum())]


def check_same_parameters(
    model: nn.Module,
    what: str,
    redrawn: Collection[torch.Tensor] = (),
    *,
    modes: bool = False,
    measured_in: Callable[[nn.Module], None] | None = None,
) -> None:
    """Raise :class:`RankMismatchError` on every rank unless all ranks hold bit-identical
    parameters and the buffers the method's passes read (:func:`_read_buffers`: an eval-mode
    batch norm's running statistics are part of the function the ranks compute, a train-mode
    one's are not): the same shapes and dtypes (:func:`_layout`), then the same values, by an
    exact checksum (:func:`_checksum`), each all-reduced in one small collective; the ``redrawn``
    tensors (which the method draws on rank 0 and broadcasts: LSUV's orthogonal pre-init) need
    only agree in shape and dtype. With ``modes``, for a method that measures in the caller's
    train/eval modes, the modes too. ``measured_in`` sets the modes of a method that measures in
    modes of its own (GradInit's batch statistics: ``set_evaluation_modes(model, True)``); the
    modules' flags are put back after the check. Without it, the caller's modes decide.

    A data-dependent initialization pools statistics over ranks (and a method applies one
    update on every rank); ranks that start from different weights would end different.
    """
    if not is_distributed():
        return
    named = check_same_trainable(model, what)
    if modes:
        _check_same_modes(model, what)
    buffers = _read_buffers(model, measured_in, what)
    tensors = [*named, *buffers]
    differ = _differing(tensors, [_layout(t) for _, t in tensors])
    if differ:
        raise RankMismatchError(
            f"{what}: the ranks' models differ in the shape or dtype of {len(differ)} of "
            f"{len(tensors)} tensors ({_listing(differ)}); every rank must hold the same model, "
            "in one dtype"
        )
    ids = {id(t) for t in redrawn}
    values = [(n, t) for n, t in tensors if id(t) not in ids]  # the same tensors on every rank
    differ = _differing(values, [_checksum(t) for _, t in values])
    if differ:
        in_buffers = {n for n, _ in buffers}.intersection(differ)
        kind = "buffers" if len(in_buffers) == len(differ) else "parameters"
        kind += " and buffers" if in_buffers and kind == "parameters" else ""
        raise RankMismatchError(
            f"{what}: the ranks hold different {kind} ({len(differ)} of {len(tensors)} tensors "
            f"differ: {_listing(differ)}). It pools its statistics over ranks (and a method "
            "applies one update everywhere), so ranks that start different pool unrelated "
            "numbers and end different; a buffer it reads (the running statistics of a batch "
            "norm in eval mode, in the modes it measures in) is part of the function each rank "
            "computes. Build the model with the same seed on every rank "
            "(torch.manual_seed(seed) before creating it), or copy rank 0's weights and buffers "
            "first: for t in [*model.parameters(), *model.buffers()]: "
            "torch.distributed.broadcast(t.detach(), src=0)"
        )


def _compared_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The named buffers that must agree across ranks when the method's passes read them: all of
    them (running statistics, masks, position ids), but a batch norm's ``num_batches_tracked``.
    That counter of train-mode updates changes no output: a forward reads it only in train mode,
    as the weight ``1 / num_batches_tracked`` of a ``momentum=None`` running average's next
    update, and a train-mode batch norm normalizes by the batch's own statistics. Ranks whose
    counts differ (one rank ran a train-mode pass the others did not) compute the same function;
    refusing them would be a false alarm. The running statistics are left out the same way where
    the layer uses batch statistics (:func:`_read_buffers`)."""
    counters = {
        id(m.num_batches_tracked)
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.num_batches_tracked is not None
    }
    return [(n, b) for n, b in model.named_buffers() if id(b) not in counters]


def _batch_statistics(m: nn.Module) -> bool:
    """Whether the norm layer ``m`` normalizes by the batch's own statistics in its present mode,
    so that its running statistics change no output (a train-mode forward only updates them): one
    of torch's batch norms in train mode, one of its instance norms in train mode or with
    ``track_running_stats=False``. An eval-mode batch norm reads its running statistics whenever
    it has them, and a norm layer with a ``forward`` of its own (a batch renormalization reads
    them in train mode too) is taken to read them."""
    forward = type(m).forward
    if forward in (nn.modules.batchnorm._BatchNorm.forward, nn.SyncBatchNorm.forward):
        return m.training
    if forward is nn.modules.instancenorm._InstanceNorm.forward:
        return m.training or not m.track_running_stats
    return False


def _read_buffers(
    model: nn.Module, measured_in: Callable[[nn.Module], None] | None, what: str
) -> list[tuple[str, torch.Tensor]]:
    """The compared buffers (:func:`_compared_buffers`) the method's passes read: but the
    ``running_mean`` and ``running_var`` of a norm layer that uses batch statistics
    (:func:`_batch_statistics`) in the modes ``measured_in`` sets (the caller's without it; every
    flag put back). Raises :class:`RankMismatchError` on every rank if the ranks read different
    ones (one small collective; nothing to compare without buffers, on every rank alike)."""
    buffers = _compared_buffers(model)  # as many on every rank: check_same_trainable
    if not buffers:
        return buffers
    saved = model_modes(model)
    try:
        if measured_in is not None:
            measured_in(model)
        unread = {
            id(b)
            for m in model.modules()
            if isinstance(m, nn.modules.batchnorm._NormBase) and _batch_statistics(m)
            for b in (m.running_mean, m.running_var)
            if b is not None
        }
    finally:
        restore_modes(model, saved)
    read = torch.tensor([id(b) not in unread for _, b in buffers], dtype=torch.int64, device=_CPU)
    lo, hi = _min_max(read)
    differ = [buffers[i][0] for i in (lo != hi).nonzero().flatten().tolist()]
    if differ:
        raise RankMismatchError(
            f"{what}: the ranks' normalization layers normalize by different statistics (the "
            f"batch's own on some ranks, the running ones in {_listing(differ)} on others): put "
            "them in the same train/eval mode, with the same track_running_stats, on every rank"
        )
    return [(n, b) for n, b in buffers if id(b) not in unread]


def _differing(named: list[tuple[str, torch.Tensor]], rows: list[list[int]]) -> list[str]:
    """The names whose row of three integers is not the same on every rank (one collective)."""
    lo, hi = _min_max(torch.tensor(rows, dtype=torch.int64, device=_CPU).reshape(-1, 3))
    return [named[i][0] for i in (lo != hi).any(dim=1).nonzero().flatten().tolist()]


def _listing(names: list[str]) -> str:
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def _check_same_modes(model: nn.Module, what: str) -> None:
    """Raise :class:`RankMismatchError` on every rank unless the ranks' modules are in the same
    train/eval modes (a BatchNorm's batch statistics on one rank, its running ones on another,
    pooled into one number)."""
    flags = "".join("1" if m.training else "0" for m in model.modules())
    local = torch.tensor([flags.count("1"), len(flags), zlib.crc32(flags.encode())], device=_CPU)
    lo, hi = _min_max(local.to(torch.int64))
    if bool((lo != hi).any()):
        raise RankMismatchError(
            f"{what}: the ranks' models are in different train/eval modes ({lo[0].item()} to "
            f"{hi[0].item()} modules in train mode); it measures in the caller's modes and pools "
            "the ranks' statistics: call model.train() or model.eval() alike on every rank"
        )


def _layout(t: torch.Tensor) -> list[int]:
    """``[numel, a code of the dtype, a code of the shape]``: what must agree across ranks of a
    tensor whose values the method replaces by rank 0's."""
    dtype = zlib.crc32(str(t.dtype).encode())
    return [t.numel(), dtype, sum((i + 1) * 1009**i * s for i, s in enumerate(t.shape)) % 2**61]


#: Arguments that may differ by rank: the model, the data, the loss, a seed, callbacks.
_PER_RANK = {"model", "data", "loss_fn", "generator", "forward", "progress", "registry"}
_PLAIN = (int, float, str, bool, type(None))


def same_options(fn: F) -> F:
    """Under ``torch.distributed``, check at entry that every rank called ``fn`` with the same
    options (its arguments of plain values, numbers, strings, booleans, ``None`` and sequences of
    them, but the model, the data, the loss, the generator and callbacks), in one collective: a
    difference raises :class:`RankMismatchError` on every rank, naming the options, before any
    other collective of ``fn`` (ranks given different options run different collectives: gloo
    aborted, or waited until its timeout). Nothing without a process group."""
    signature = inspect.signature(fn)
    names = [n for n in signature.parameters if n not in _PER_RANK]

    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        if is_distributed():
            bound = signature.bind_partial(*args, **kwargs)
            bound.apply_defaults()
            codes = torch.tensor(
                [_option_code(bound.arguments.get(n)) for n in names] or [0],
                dtype=torch.int64,
                device=_CPU,
            )
            lo, hi = _min_max(codes)
            differ = [names[i] for i in (lo != hi).nonzero().flatten().tolist() if i < len(names)]
            if differ:
                raise RankMismatchError(
                    f"{fn.__name__}: the ranks called it with different options ("
                    f"{', '.join(differ)}); every rank must pass the same ones, since they decide "
                    "the collectives it runs"
                )
        return fn(*args, **kwargs)

    return inner  # type: ignore[return-value]


def _option_code(value: Any) -> int:
    """A code of an option's value that equal values share on every rank (their ``repr``), or
    one code for any value that is not plain data (a callable, a tensor: not compared)."""
    plain = isinstance(value, _PLAIN) or (
        isinstance(value, (list, tuple)) and all(isinstance(v, _PLAIN) for v in value)
    )
    return zlib.crc32(repr(value).encode() if plain else b"<not compared>")


def check_same_trainable(model: nn.Module, what: str) -> list[tuple[str, nn.Parameter]]:
    """Raise :class:`RankMismatchError` on every rank unless all ranks hold an eager model (a
    TorchScript one, on every rank, gets the refusal of
    :func:`~initlab._core.compiled.scripted_error` there) with the same numbers of parameter
    tensors and of compared buffers (:func:`_compared_buffers`) and the same ``requires_grad``
    flags (a layer frozen on some ranks only makes the ranks' collectives differ in size);
    returns the named parameters. Two small collectives; nothing without a process group."""
    from initlab._core.compiled import scripted_error, scripted_part

    named = list(model.named_parameters())
    if not is_distributed():
        return named
    found = scripted_part(model)
    counts = [found is not None, len(named), len(_compared_buffers(model))]
    lo, hi = _min_max(torch.tensor(counts, dtype=torch.int64, device=_CPU))
    if lo[0].item() != hi[0].item():
        raise RankMismatchError(
            f"{what}: the model is a TorchScript module on some ranks only; run {what} on the "
            "eager module on every rank, and script it after"
        )
    if found is not None:  # scripted on every rank: each raises the same refusal
        raise scripted_error(found[1], what, found[0])
    if lo[1].item() != hi[1].item():
        raise RankMismatchError(
            f"{what}: the ranks' models have different numbers of parameter tensors "
            f"({lo[1].item()} to {hi[1].item()}); every rank must hold the same model"
        )
    if lo[2].item() != hi[2].item():
        raise RankMismatchError(
            f"{what}: the ranks' models have different numbers of buffers ({lo[2].item()} to "
            f"{hi[2].item()}); every rank must hold the same model"
        )
    flags = torch.tensor(
        [int(p.requires_grad) for _, p in named] or [0], dtype=torch.int64, device=_CPU
    )
    lo, hi = _min_max(flags)
    differ = [named[i][0] for i in (lo != hi).nonzero().flatten().tolist() if i < len(named)]
    if differ:
        raise RankMismatchError(
            f"{what}: the ranks' models differ in which tensors are trainable (requires_grad "
            f"differs for {_listing(differ)}); freeze the same layers on every rank"
        )
    return named


def _step_key(step: str | None) -> list[int]:
    """Two 20-bit hashes of ``step`` (stable across processes, unlike ``hash``), 0 for ``None``."""
    if step is None:
        return [0, 0]
    data = step.encode()
    return [(zlib.crc32(data) & 0xFFFFF) + 1, (zlib.adler32(data) & 0xFFFFF) + 1]


def _raise_together(
    error: BaseException | None, what: str, ended: bool = False, step: str | None = None
) -> int:
    """A collective: if ``error`` is set on some ranks, raise the same error on every rank; if on
    every rank, each raises its own (as without a process group); if the ranks name different
    ``step`` s, raise :class:`RankMismatchError` naming each rank's; else return the number of
    ranks that passed ``ended``."""
    keys = _step_key(step)
    flags = torch.tensor(
        [error is not None, ended, *keys, *(k * k for k in keys)],
        dtype=torch.int64,
        device=_device(),
    )
    dist.all_reduce(flags, op=dist.ReduceOp.SUM)
    world = dist.get_world_size()
    if flags[0].item() == 0:
        # keys equal on every rank iff (sum k)^2 == world * sum k^2 (Cauchy-Schwarz), per hash
        if any(int(flags[2 + i]) ** 2 != world * int(flags[4 + i]) for i in range(2)):
            steps: list[Any] = [None] * world
            dist.all_gather_object(steps, step)
            at = "; ".join(f"rank {r} at {s or 'another collective'}" for r, s in enumerate(steps))
            raise RankMismatchError(
                f"{what}: the ranks are out of step ({at}): their batches took different paths "
                "through the model (control flow that depends on the data); every rank's batch "
                "must run the same layers in the same order"
            )
        return int(flags[1].item())
    if error is not None and flags[0].item() == world:
        raise error
    texts: list[Any] = [None] * world
    mine = None if error is None else f"{type(error).__name__}: {error}"
    dist.all_gather_object(texts, mine)
    failed = [(r, text) for r, text in enumerate(texts) if text is not None]
    detail = "; ".join(f"rank {r}: {text}" for r, text in failed)
    raise RankMismatchError(
        f"{what} stopped on every rank because {len(failed)} of {len(texts)} rank(s) failed: "
        f"{detail}"
    ) from error


def checkpoint(what: str, step: str | None = None) -> None:
    """Before a collective inside a :func:`failing_together` block: if a peer rank failed since
    the last one, or names a different ``step`` (what the collective is for, e.g. "the first
    call of layer.3": ranks whose data took different paths through the model), raise the same
    :class:`RankMismatchError` here (one small all-reduce). Without a process group: nothing."""
    if is_distributed():
        _raise_together(None, what, step=step)


@contextmanager
def failing_together(what: str) -> Iterator[None]:
    """A block whose collectives each follow a :func:`checkpoint`: an exception on some ranks
    meets the other ranks at their next checkpoint (or at the end of the block), and every rank
    raises the same :class:`RankMismatchError`, instead of the others waiting in a collective
    the failed rank never reaches; an exception on every rank stays each rank's own. Without a
    process group: the block, its errors unchanged. A collective: enter it on every rank."""
    if not is_distributed():
        yield
        return
    try:
        yield
    except RankMismatchError:
        raise  # raised by a checkpoint or a check: the peer ranks raised it too
    except Exception as err:
        _raise_together(err, what)
        raise  # unreachable: _raise_together raised
    _raise_together(None, what)


def run_together(what: str, fn: Callable[[], T]) -> T:
    """``fn()`` (a local step without collectives: reading data, a forward or backward pass) as a
    :func:`failing_together` block: if it raises on some ranks, every rank raises
    :class:`RankMismatchError` with the same message (each failed rank's error in it); if on
    every rank, each rank raises its own error."""
    with failing_together(what):
        return fn()


def check_same_count(count: int | None, what: str, unit: str) -> None:
    """Raise :class:`RankMismatchError` on every rank if the ranks that know their ``count`` (of
    iterations, batches) do not all have the same one (``None``: unknown, not compared). A
    collective: call it on every rank."""
    if not is_distributed():
        return
    lo, _ = _min_max(
        torch.tensor(
            [2**62 if count is None else count, 2**62 if count is None else -count], device=_CPU
        )
    )
    known_lo, known_hi = int(lo[0]), -int(lo[1])  # over the ranks that know their count
    if known_hi >= 0 and known_lo != known_hi:
        raise RankMismatchError(
            f"{what}: the ranks have different numbers of {unit} ({known_lo} to {known_hi}); "
            "every rank must run the same number (give each rank the same number of batches, "
            "e.g. a DistributedSampler with drop_last=True, or pass steps=)"
        )


def check_same_values(what: str, values: dict[str, int], hint: str) -> None:
    """Raise :class:`RankMismatchError` on every rank unless every rank holds the same ``values``
    (integers by name, the same names on every rank), naming each that differs with its smallest
    and largest value over the ranks, then ``hint`` (what to do). One small collective: call it
    on every rank; nothing without a process group."""
    if not is_distributed() or not values:
        return
    names = list(values)
    lo, hi = _min_max(torch.tensor([values[n] for n in names], dtype=torch.int64, device=_CPU))
    differ = [
        f"{n} ({int(lo[i])} on some ranks, {int(hi[i])} on others)"
        for i, n in enumerate(names)
        if lo[i] != hi[i]
    ]
    if differ:
        raise RankMismatchError(f"{what}: the ranks differ in {', '.join(differ)}; {hint}")


def in_lockstep(items: Iterable[T], what: str) -> Iterator[T]:
    """Yield each rank's own items, the ranks in step: before every item they agree (one small
    all-reduce) that each has one.

    Raises :class:`RankMismatchError` on every rank when some ranks have run out while others
    have not (different numbers of batches), or when reading the next item raised on some rank
    (that rank's error is in the message; raised on every rank, each rank's own error). Stops on
    every rank together. Without a process group the items are yielded as they are.
    """
    if not is_distributed():
        yield from items
        return
    it = iter(items)
    step = 0
    while True:
        error: BaseException | None = None
        item: Any = _END
        try:
            item = next(it, _END)
        except Exception as err:
            error = err
        done, world = _raise_together(error, what, item is _END), dist.get_world_size()
        if done == world:
            return
        if done:
            raise RankMismatchError(
                f"{what}: the ranks have different numbers of batches: at iteration {step}, "
                f"{done} of {world} rank(s) had none left. Give every rank the same number of "
                "batches (e.g. a DistributedSampler with drop_last=True), or pass steps= no larger "
                "than the shortest rank's count"
            )
        yield item
        step += 1
