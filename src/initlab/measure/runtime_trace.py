r"""Residual blocks from one forward pass, for models ``torch.fx`` cannot trace.

``torch.fx.symbolic_trace`` fails on most Hugging Face transformers (GPT-2, BERT, Llama: dynamic
control flow, caches, mask builders), so :func:`~initlab.measure.residual.find_residual_blocks`
sees no skip connection there. :func:`runtime_trace` runs the model once instead (no grad, the
model put back as it was by :func:`initlab._core.state.preserved_state`) and records the data flow
of that forward:

* a :class:`torch.overrides.TorchFunctionMode` sees every torch function and tensor method
  (``F.linear``, ``torch.addmm``, ``a + b``, ``x += y``, ``x.view(...)``): each call that returns
  tensors becomes a node whose inputs are the nodes that produced its tensor arguments (tensors
  are tagged by identity and kept alive for the pass, so identities are not reused). An
  in-place write (``x[i] = v``, which returns None, ``y.copy_(v)``, ``x.relu_()``, ``x += v``)
  is a node taking the target's earlier value and the value written, and the target (and the
  base it is a view of, where recorded) is tagged with it; a tensor sharing the written storage
  that was made before the write and reads an element it wrote (``v = buf[:, :4]`` before
  ``buf.copy_(h)``; not ``buf[:, 4:]`` beside a write into ``buf[:, :4]``) reads as that node
  too. A call taking a value out of torch (``h.item()``, ``float(h)``, ``h.tolist()``,
  ``bool(h)``) is a node without outputs. Tensor
  factories (``torch.arange``, ``torch.zeros_like``, ``x.new_zeros``) take no inputs, and shape
  queries return no tensor, so neither passes data ancestry on; a copy (``torch.tensor(h)``,
  ``x.new_tensor(h)``, ``torch.as_tensor(h)``) takes the tensor it copies. A call with ``out=``
  writes into its out tensors as an in-place write does (``torch.abs(h, out=buf[:])``: ``buf``
  holds it); ``v.data = h`` is a node ``set_data`` that ``v`` is tagged with (``v`` holds ``h``'s
  storage, the views made of ``v`` before it keep the old one);
* forward pre/post hooks on every module keep the stack of modules being run: each node records
  its innermost module. A module output that no torch function produced (an opaque extension)
  becomes a node of its own whose inputs are the module's tensor arguments;
* the model's tensor arguments are the input nodes; parameters and buffers are not nodes.

:func:`find_runtime_blocks` then applies the rule of
:func:`~initlab.measure.residual.find_residual_blocks` to that graph: an addition ``a + b``
(``torch.add``, ``Tensor.add``/``add_``, ``+``, ``+=``) of two recorded tensors is a residual
connection when one operand (the skip), walked back along first tensor arguments at most
:data:`~initlab.measure.residual.SHORTCUT_STEPS` steps (view-like and dtype-only calls and dropout
do not count as steps), reaches a node that is the other operand (the branch) or a data ancestor
of it. The branch is the parameterized modules (modules with parameters of their own) whose calls
lie between that block input and the branch operand, and there must be one. Modules enclosing the
addition are not branch members (a layer-scale parameter of the block itself is not a branch
layer). Of the two orientations the one with fewer shortcut modules wins. The blocks are the same
dicts, with ``source="runtime"``, ``module`` the innermost module whose forward makes the addition
and ``node``/``input`` the names of the recorded calls (``add_3``, ``layer_norm_1``).

What one pass cannot see: branches the pass did not take (data-dependent control flow records the
path of the batch given), and additions done outside torch functions (in C++ extensions). The
pass keeps every intermediate tensor alive until it ends (as a training forward's autograd graph
would).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from initlab._core.data import batch_tensors
from initlab._core.hooks import hook_handles
from initlab._core.state import preserved_state
from initlab.measure.residual import (
    SCORE_FNS,
    SHORTCUT_STEPS,
    _name_blocks,
    best_orientation,
    feeds_scores,
    is_projection,
    is_skip_connection,
)

__all__ = [
    "READ_NAMES",
    "RecordingError",
    "RuntimeGraph",
    "RuntimeNode",
    "additions_of",
    "attention_layers",
    "blocks_of",
    "find_runtime_blocks",
    "recording",
    "runtime_trace",
    "what_follows",
    "written_targets",
]

_ADD_NAMES = {"add", "add_", "__add__", "__iadd__", "__radd__"}
_FACTORY_NAMES = {
    "arange", "zeros", "ones", "full", "empty", "rand", "randn", "randint", "linspace",
    "logspace", "eye", "scalar_tensor", "zeros_like", "ones_like", "empty_like", "full_like",
    "rand_like", "randn_like", "randint_like", "new_zeros", "new_ones", "new_empty", "new_full",
}  # fmt: skip
# In-place writes: ``x[i] = v`` returns None, ``y.copy_(v)``, ``x.relu_()``, ``x += v`` return the
# target. Each becomes a node that the target (and the base it is a view of) is tagged with
# after ``on_call`` has seen the call with the target's earlier tag.
_WRITE_NAMES = {"__setitem__"}
_IN_PLACE_DUNDERS = {
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__",
}  # fmt: skip


def _in_place(fn: str) -> bool:
    return fn in _WRITE_NAMES or fn in _IN_PLACE_DUNDERS or (fn.endswith("_") and fn[0] != "_")


def written_targets(fn: str, args: tuple, kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    """The tensors a call ``fn(*args, **kwargs)`` writes into in place: an in-place call's
    target (``x[i] = v``, ``y.copy_(v)``, ``x.relu_()``, ``x += v``) and its ``out=`` tensors."""
    target = args[0] if args and isinstance(args[0], torch.Tensor) else None
    own = [target] if target is not None and _in_place(fn) else []
    return own + _tensors(kwargs.get("out"))


def _data_setter(func: Any) -> bool:
    """Whether ``func`` is the ``Tensor.data`` setter (``v.data = h``: ``v`` holds ``h`` now)."""
    return _fn_name(func) == "__set__" and getattr(func.__self__, "__name__", None) == "data"


def _sources(fn: str, args: tuple, kwargs: Mapping[str, Any]) -> Any:
    """The arguments a call's values come from: not a factory's (a shape, a fill value), not
    ``new_tensor``'s own tensor (a template of dtype and device: ``h.new_tensor(data)`` copies
    ``data``), not ``out=`` (written, not read)."""
    if fn in _FACTORY_NAMES:
        return ()
    kwargs = {k: v for k, v in kwargs.items() if k != "out"}
    return (args[1:] if fn == "new_tensor" else args, kwargs)


#: Calls that take a value out of torch (a Python number, bool or list, a NumPy array: what a
#: branch reads): each is a node without outputs, so that ``on_call`` sees it.
READ_NAMES = frozenset({
    "item", "tolist", "numpy", "__array__", "__bool__", "__int__", "__float__", "__index__",
    "__complex__", "allclose", "equal", "is_nonzero",
})  # fmt: skip


# Calls that change only a tensor's shape, layout or dtype: no step of the shortcut walk.
_FREE_NAMES = {
    "view", "reshape", "contiguous", "to", "type", "float", "half", "double", "bfloat16", "clone",
    "detach", "expand", "expand_as", "view_as", "reshape_as", "unsqueeze", "squeeze", "flatten",
    "transpose", "permute", "__get__", "dropout",
}  # fmt: skip


@dataclass
class RuntimeNode:
    """One recorded call: ``name`` (``fn`` plus a counter), ``fn`` (the function's name),
    ``inputs`` (indices of the nodes that produced its tensor arguments, in argument order),
    ``operands`` (for an addition: the nodes of its two operands, ``None`` where an operand was
    not a recorded tensor), ``module`` (innermost module running), ``stack`` (all modules running),
    ``kind`` (``"input"``, ``"call"`` or ``"module"``) and ``written`` (an in-place write: the
    tensors of its target's storage, views made before it included, read as this node)."""

    index: int
    name: str
    fn: str
    inputs: list[int]
    module: str
    stack: tuple[str, ...]
    kind: str = "call"
    operands: tuple[int | None, int | None] | None = None
    written: bool = False


@dataclass
class RuntimeGraph:
    """The data flow of one forward: ``nodes`` in call order and ``params`` (the qualified names
    of the modules with parameters of their own)."""

    nodes: list[RuntimeNode] = field(default_factory=list)
    params: set[str] = field(default_factory=set)
    projections: set[str] = field(default_factory=set)
    """The modules a projection shortcut is made of (:func:`~initlab.measure.residual.
    is_projection`)."""


def _fn_name(func: Any) -> str:
    return getattr(func, "__name__", None) or type(func).__name__


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _input_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of an outermost call's arguments: in containers, and in the attributes of a
    batch object (a dataclass or a user's class: :func:`~initlab._core.data.batch_tensors`),
    ``model(batch)`` reading ``batch.x``; a module passed as an argument is no batch."""
    out: list[torch.Tensor] = []
    for leaf in tree_flatten(obj)[0]:
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif not isinstance(leaf, nn.Module):
            out.extend(t for _, t in batch_tensors(leaf))
    return out


def _signals(obj: Any) -> list[torch.Tensor]:
    """The floating-point tensors in ``obj``: integer and boolean tensors (token ids, positions,
    masks) index or select data but are no signal, so they pass no data ancestry on."""
    return [t for t in _tensors(obj) if t.dtype.is_floating_point or t.dtype.is_complex]


def _storage_of(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage (``None`` for one without data: meta, empty, a wrapper
    subclass). The written tensors stay alive for the pass, so their addresses are not reused."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr() if storage.nbytes() else None
    except (RuntimeError, NotImplementedError, TypeError):
        return None


_Region = tuple[tuple[int, ...], tuple[int, ...], int, int]
"""Where a tensor lies in its storage: shape, strides, offset (in elements), element size."""


def _region(t: torch.Tensor) -> _Region:
    return tuple(t.shape), t.stride(), t.storage_offset(), t.element_size()


def _mark(last: torch.Tensor, region: _Region, index: int) -> None:
    """Record in ``last`` (a storage's last write per element) that node ``index`` wrote
    ``region``."""
    shape, stride, offset, _ = region
    if 0 not in shape:
        last.as_strided(shape, stride, offset).fill_(index)


class RecordingError(RuntimeError):
    """An error of the recorder itself (its bookkeeping, an ``on_call``), raised through the
    model's forward: a bug in initlab, not in the model, which a caller must not report as the
    forward failing."""


@contextmanager
def _own_errors(where: str) -> Iterator[None]:
    """Raise what the recorder's own code inside raises as a :class:`RecordingError`."""
    try:
        yield
    except RecordingError:
        raise
    except Exception as err:
        raise RecordingError(
            f"initlab's forward recorder failed at {where} ({type(err).__name__}: {err}): a bug "
            "in initlab, not in the model; please report it"
        ) from err


class _Recorder(TorchFunctionMode):
    """Tags tensors with the node that produced them (see the module docstring)."""

    def __init__(self, graph: RuntimeGraph, on_call: OnCall | None = None) -> None:
        super().__init__()
        self.graph = graph
        self.on_call = on_call
        self.tags: dict[int, int] = {}
        self.writes: dict[int, list[tuple[int, _Region]]] = {}  # storage -> its writes
        self.last: dict[int, torch.Tensor | None] = {}  # storage -> last write per element
        self.keep: list[torch.Tensor] = []  # identities stay unique while they are tagged
        self.stack: list[str] = []
        self.counts: Counter[str] = Counter()

    def node(self, fn: str, inputs: list[int], outputs: list[torch.Tensor], kind: str) -> int:
        k = self.counts[fn]
        self.counts[fn] += 1
        index = len(self.graph.nodes)
        stack = tuple(self.stack)
        self.graph.nodes.append(
            RuntimeNode(index, fn if k == 0 else f"{fn}_{k}", fn, inputs,
                        stack[-1] if stack else "", stack, kind)
        )  # fmt: skip
        self.tag(index, outputs)
        return index

    def tag(self, index: int, outputs: list[torch.Tensor]) -> None:
        for t in outputs:
            self.tags[id(t)] = index
            self.keep.append(t)

    def tag_of(self, obj: Any) -> int | None:
        """The node that produced ``obj``'s values: its own tag, or the last in-place write into
        its storage made after it (``v = buf[:, :4]; buf.copy_(h)``: ``v`` holds ``h`` now)."""
        if not isinstance(obj, torch.Tensor):
            return None
        own = self.tags.get(id(obj))
        storage = _storage_of(obj) if self.writes else None
        writes = self.writes.get(storage) if storage is not None else None
        if not writes or (own is not None and writes[-1][0] <= own):
            return own
        written = self.last_write(storage, writes, obj)  # type: ignore[arg-type]
        return written if written is not None and (own is None or written > own) else own

    def last_write(
        self, storage: int, writes: list[tuple[int, _Region]], t: torch.Tensor
    ) -> int | None:
        """The last write into an element ``t`` reads (``None``: none): from the storage's map of
        the last write per element, made on the first such question (``buf[:, 4:]`` reads none of
        a write into ``buf[:, :4]``, interleaved in memory); the last write into the storage
        where they do not share one element size (a dtype view)."""
        if storage not in self.last:
            size = writes[0][1][3]
            n = t.untyped_storage().nbytes() // size
            same = all(r[3] == size for _, r in writes)
            last = torch.full((n,), -1, dtype=torch.int32, device="cpu") if same and n else None
            for index, region in writes if last is not None else ():
                _mark(last, region, index)  # type: ignore[arg-type]
            self.last[storage] = last
        last = self.last[storage]
        if last is None or t.element_size() != writes[0][1][3]:
            return writes[-1][0]
        if t.numel() == 0:
            return None
        index = int(last.as_strided(tuple(t.shape), t.stride(), t.storage_offset()).max())
        return index if index >= 0 else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fn = _fn_name(func)
        with _own_errors(fn):
            operands = None
            if fn in _ADD_NAMES and len(args) >= 2:
                operands = (self.tag_of(args[0]), self.tag_of(args[1]))
            inputs = self.inputs_of(_sources(fn, args, kwargs))
        out = func(*args, **kwargs)  # the model's: its errors are its own
        with _own_errors(fn):
            self.record(func, fn, args, kwargs, out, operands, inputs)
        return out

    def record(
        self,
        func: Any,
        fn: str,
        args: tuple,
        kwargs: dict[str, Any],
        out: Any,
        operands: tuple[int | None, int | None] | None,
        inputs: list[int],
    ) -> None:
        """Record the call ``fn`` that returned ``out`` (see the module docstring)."""
        outputs, seen = _tensors(out), out
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        targets = written_targets(fn, args, kwargs)  # torch.abs(h, out=buf[:]) writes into buf
        if targets and fn in _WRITE_NAMES:  # x[i] = v returns None: the target holds the result
            outputs, seen = [target], target
        aliased = target is not None and _data_setter(func)  # v.data = h: v holds h's storage
        if aliased:
            fn, outputs, seen = "set_data", [target], target
        if outputs or fn in READ_NAMES:
            i = self.node(fn, inputs, [] if targets or aliased else outputs, "call")
            self.graph.nodes[i].operands = operands
            self.graph.nodes[i].written = bool(targets)
            if self.on_call is not None:
                self.on_call(self.graph.nodes[i], args, kwargs, seen, self.tag_of)
            if aliased:
                self.tag(i, outputs)
            self.wrote(i, outputs, targets)

    def wrote(self, i: int, outputs: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
        """Tag what node ``i`` wrote in place into ``targets``: ``outputs``, the bases the
        targets are views of, and every view of their storage (:meth:`tag_of`)."""
        if not targets:
            return
        bases = [t._base for t in targets if id(t._base) in self.tags]
        self.tag(i, outputs + bases)
        for t in targets:
            storage = _storage_of(t)
            if storage is not None:
                region = _region(t)
                self.writes.setdefault(storage, []).append((i, region))
                last = self.last.get(storage)
                if last is not None and region[3] == self.writes[storage][0][1][3]:
                    _mark(last, region, i)
                elif last is not None:
                    self.last[storage] = None  # mixed element sizes: the last write counts

    def inputs_of(self, obj: Any) -> list[int]:
        tags = (self.tag_of(t) for t in _signals(obj))
        return list(dict.fromkeys(t for t in tags if t is not None))


def runtime_trace(
    model: nn.Module, args: tuple = (), kwargs: Mapping[str, Any] | None = None
) -> RuntimeGraph:
    """Run ``model(*args, **kwargs)`` once (no grad; parameters, buffers, modes, hooks and RNG
    states put back) and return its :class:`RuntimeGraph` (see the module docstring)."""
    kwargs = dict(kwargs or {})
    with preserved_state(model), torch.no_grad(), recording(model) as graph:
        model(*args, **kwargs)
    return graph


OnCall = Callable[[RuntimeNode, tuple, dict[str, Any], Any, Callable[[Any], "int | None"]], None]
"""``on_call(node, args, kwargs, out, tag_of)`` of :func:`recording`: each recorded call with its
arguments and result, and each module node (``kind="module"``: an output no torch function
produced) with the module's arguments and output; ``tag_of(obj)`` is the index of the node that
produced a tensor (else ``None``). It runs inside the recorder, so its own torch calls are not
recorded."""


@contextmanager
def recording(model: nn.Module, on_call: OnCall | None = None) -> Iterator[RuntimeGraph]:
    """Record the data flow of every forward of ``model`` run inside the ``with`` block.

    The graph is filled as the block runs; the tensor arguments of each outermost module call
    (with a batch object's tensor attributes: ``model(batch)`` reading ``batch.x``) are its
    input nodes, recorded before the model's own forward pre-hooks run (their calls are the
    model's, ``x * 10`` in one included). Nothing of the model is changed or put back here
    (:func:`runtime_trace` keeps the model; a caller that runs its own pass, such as LSUV's
    discovery pass, keeps it its own way); the hooks are removed and the recorded tensors
    released on exit. ``on_call`` (see :data:`OnCall`) sees each call that returns tensors, with
    its arguments. What the recorder's own code (``on_call`` included) raises inside the forward
    comes out as a :class:`RecordingError`, so that a caller tells it from the model's errors.
    """
    graph = RuntimeGraph()
    names: dict[int, str] = {}
    for name, m in model.named_modules():
        names.setdefault(id(m), name)
        if next(m.parameters(recurse=False), None) is not None:
            graph.params.add(name)
            if is_projection(m):
                graph.projections.add(name)
    rec = _Recorder(graph, on_call)

    def pre(module: nn.Module, a: tuple, kw: dict) -> None:
        if not rec.stack:  # an outermost call: its tensor arguments are the inputs
            with torch._C.DisableTorchFunction(), _own_errors("the model's input"):
                fresh = [t for t in _input_tensors((a, kw)) if id(t) not in rec.tags]
                rec.node("input", [], fresh, "input")
        rec.stack.append(names.get(id(module), type(module).__name__))

    def post(module: nn.Module, a: tuple, kw: dict, out: Any) -> None:
        # the hook's own tensor queries are not recorded
        with torch._C.DisableTorchFunction(), _own_errors(type(module).__name__):
            untagged = [t for t in _tensors(out) if id(t) not in rec.tags]
            if untagged:  # an output no torch function produced: the module is one node
                i = rec.node(type(module).__name__, rec.inputs_of((a, kw)), untagged, "module")
                if rec.on_call is not None:
                    rec.on_call(graph.nodes[i], a, kw, out, rec.tag_of)
        if rec.stack:
            rec.stack.pop()

    with hook_handles() as handles:
        try:
            for m in model.modules():  # the model's own first: its pre-hooks run inside it
                handles.add(m.register_forward_pre_hook(pre, with_kwargs=True, prepend=m is model))
                handles.add(m.register_forward_hook(post, with_kwargs=True, always_call=True))
            with rec:
                yield graph
        finally:
            rec.keep.clear()


def find_runtime_blocks(
    model: nn.Module, args: tuple = (), kwargs: Mapping[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Residual blocks found by one forward of ``model`` (see the module docstring).

    Returns:
        dicts ``{"name", "module", "node", "input", "branch", "shortcut", "source": "runtime"}``
        as :func:`~initlab.measure.residual.find_residual_blocks` returns them.
    """
    return blocks_of(runtime_trace(model, args, kwargs))


def blocks_of(graph: RuntimeGraph) -> list[dict[str, Any]]:
    """The residual blocks of a recorded :class:`RuntimeGraph`."""
    return additions_of(graph)[0]


def additions_of(graph: RuntimeGraph) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(residual blocks, sums of parallel branches)`` of a recorded :class:`RuntimeGraph`: the
    sums are the additions of two branches with a layer each (``p(x) + q(x)``) that
    :func:`~initlab.measure.residual.is_skip_connection` rejects, as
    :func:`~initlab.measure.residual.find_branch_sums` finds them in a traced graph."""
    nodes = graph.nodes
    is_ancestor = _ancestry(nodes)
    consumers = _consumers(nodes)
    found: list[dict[str, Any]] = []
    sums: list[dict[str, Any]] = []
    for node in nodes:
        if node.operands is None or None in node.operands:
            continue
        if feeds_scores(node, lambda n: [nodes[j] for j in consumers[n.index]], lambda n: n.fn):
            continue
        a, b = (nodes[i] for i in node.operands)  # type: ignore[index]
        best = best_orientation((a, b), lambda s, br: _walk_skip(graph, s, br, is_ancestor))
        if best is None:
            continue
        x, branch, shortcut = best
        enclosing = set(node.stack)
        shortcut = [s for s in shortcut if s not in enclosing]
        members = [
            n.module
            for n in nodes[x.index + 1 : branch.index + 1]
            if n.module in graph.params
            and n.module not in enclosing
            and n.module not in shortcut
            and (n is branch or is_ancestor(n, branch))
            and is_ancestor(x, n)
        ]
        skip = is_skip_connection(members, shortcut, graph.projections.__contains__)
        if not skip and not (members and shortcut):
            continue
        (found if skip else sums).append(
            {
                "module": node.module,
                "node": node.name,
                "input": x.name,
                "branch": list(dict.fromkeys(members)),
                "shortcut": list(dict.fromkeys(shortcut)),
                "source": "runtime",
            }
        )
    _name_blocks(found)
    _name_blocks(sums)
    return found, sums


def _consumers(nodes: list[RuntimeNode]) -> list[list[int]]:
    """For each node, the indices of the nodes that take its output."""
    consumers: list[list[int]] = [[] for _ in nodes]
    for n in nodes:
        for i in n.inputs:
            consumers[i].append(n.index)
    return consumers


def _ancestry(nodes: list[RuntimeNode]) -> Callable[[RuntimeNode, RuntimeNode], bool]:
    """``is_ancestor(a, b)``: whether ``a`` is a data ancestor of ``b`` (bit sets)."""
    anc: list[int] = []
    for n in nodes:
        bits = 0
        for i in n.inputs:
            bits |= anc[i] | (1 << i)
        anc.append(bits)

    def is_ancestor(a: RuntimeNode, b: RuntimeNode) -> bool:
        return bool(anc[b.index] >> a.index & 1)

    return is_ancestor


def _walk_skip(
    graph: RuntimeGraph,
    skip: RuntimeNode,
    branch: RuntimeNode,
    is_ancestor: Callable[[RuntimeNode, RuntimeNode], bool],
) -> tuple[tuple[int, int, int], RuntimeNode, list[str]] | None:
    """Walk back from ``skip`` along first inputs to ``branch`` or one of its ancestors."""
    cur, walk, steps = skip, [], 0
    while steps <= SHORTCUT_STEPS and len(walk) <= 4 * SHORTCUT_STEPS:
        if cur is branch or is_ancestor(cur, branch):
            shortcut = [w.module for w in walk if w.module in graph.params]
            layers = len(set(shortcut) - graph.projections)
            return (layers, len(set(shortcut)), steps), cur, shortcut
        if not cur.inputs:
            return None
        walk.append(cur)
        steps += cur.fn not in _FREE_NAMES
        cur = graph.nodes[cur.inputs[0]]
    return None


_MATMUL_FNS = {"matmul", "bmm", "__matmul__", "__rmatmul__", "einsum", "baddbmm"}
_PRODUCT_FNS = {"mul", "__mul__", "__rmul__", "multiply"}
_NORM_FNS = {"layer_norm", "group_norm", "batch_norm", "instance_norm", "rms_norm", "normalize"}


def what_follows(
    graph: RuntimeGraph, types: Mapping[str, str], norms: dict[str, set[str]] | None = None
) -> dict[str, set[str]]:
    """What the output of each module with parameters meets before the next such module.

    Walks the recorded data flow forward from the module's calls and stops at the next module
    with parameters (a normalization layer is walked through). Collects ``"attention scores"``
    (a softmax, or the query/key argument of ``scaled_dot_product_attention``), ``"attention
    values"`` (a matrix product of two activations: the value side of attention),
    ``"product"`` (an elementwise product by another layer's output: a gated unit such as
    SwiGLU; not ``x * f(x)`` nor a product by constants such as a rotary embedding's cos)
    and ``"normalization"`` (a normalizing function, or a module whose type name ends in
    ``Norm``: ``LlamaRMSNorm``). Each takes a layer outside a chain of linear maps and
    elementwise activations, the setting of Defazio &
    Bottou's GR formula. ``types``: qualified module name -> type name. ``norms``, where given,
    gets per module the normalizations it meets: the type name of a normalization module
    (``BatchNorm2d``, ``LlamaRMSNorm``), else the function (``layer_norm``).
    """
    nodes = graph.nodes
    consumers = _consumers(nodes)
    out: dict[str, set[str]] = {}
    for name in graph.params:
        found: set[str] = set()
        start = {n.index for n in nodes if n.module == name}
        frontier = [(j, i) for i in start for j in consumers[i] if j not in start]
        seen: set[int] = set()
        while frontier and len(seen) < 400:
            j, came_from = frontier.pop()
            if j in seen:
                continue
            seen.add(j)
            kind, stop = _meets(nodes[j], came_from, types, name)
            if kind == "product" and not _gated(nodes, nodes[j], came_from, graph.params, name):
                kind = None  # x * f(x) (GELU written out), or x * constants (rotary cos, sin)
            if kind is not None:
                found.add(kind)
            if kind == "normalization" and norms is not None:
                norms.setdefault(name, set()).add(_norm_name(nodes[j], types))
            next_layer = nodes[j].module in graph.params and nodes[j].module != name
            if not (stop or (next_layer and kind != "normalization")):
                frontier += [(k, j) for k in consumers[j]]
        out[name] = found
    return out


def _norm_name(node: RuntimeNode, types: Mapping[str, str]) -> str:
    """The normalization a node belongs to: its module's type name where that names a
    normalization (``BatchNorm2d``, ``GroupNorm``, ``LlamaRMSNorm``), else its function."""
    kind = types.get(node.module, "")
    return kind if re.search(r"Norm(\dd)?$", kind) else node.fn


def _gated(
    nodes: list[RuntimeNode], node: RuntimeNode, came_from: int, params: set[str], name: str
) -> bool:
    """Whether an elementwise product multiplies the path from layer ``name`` by the output of
    another layer (a gate: SwiGLU's ``act(gate(x)) * up(x)``), not by a function of the same
    activation (GELU written as ``x * Phi(x)``) or by tensors no layer computes (a rotary
    embedding's cos and sin)."""
    return any(_layers_behind(nodes, k, params) - {name} for k in node.inputs if k != came_from)


def _layers_behind(nodes: list[RuntimeNode], start: int, params: set[str]) -> set[str]:
    """The layers (modules with parameters) whose outputs a node's tensor is computed from, the
    nearest ones only: the walk back stops at a layer's output."""
    found: set[str] = set()
    stack, seen = [start], set()
    while stack and len(seen) < 400:
        j = stack.pop()
        if j in seen:
            continue
        seen.add(j)
        if nodes[j].module in params:
            found.add(nodes[j].module)
        else:
            stack.extend(nodes[j].inputs)
    return found


def _meets(
    node: RuntimeNode, came_from: int, types: Mapping[str, str], name: str
) -> tuple[str | None, bool]:
    """``(what the walk met here or None, whether it stops here)``. A normalization (its
    function, or any call inside a module whose type name ends in ``Norm``) is walked through:
    a query or key behind a QK-norm (Gemma 3, OLMo 2, Qwen 3) still reaches its softmax."""
    if node.fn in _NORM_FNS or types.get(node.module, "").endswith("Norm"):
        return ("normalization", False) if node.module != name else (None, False)
    if node.fn in SCORE_FNS:
        return "attention scores", True
    if node.fn == "scaled_dot_product_attention":
        return ("attention scores" if came_from in node.inputs[:2] else "attention values"), True
    if node.fn in _MATMUL_FNS and len(node.inputs) >= 2:
        return "attention values", False
    if node.fn in _PRODUCT_FNS and len(node.inputs) >= 2:
        return "product", False
    return None, False


def attention_layers(graph: RuntimeGraph, types: Mapping[str, str]) -> dict[str, str]:
    """The layers whose output feeds attention -- query, key (the scores) and value projections
    of any attention implementation (``nn.MultiheadAttention`` is one module; Hugging Face's
    eager, SDPA or custom code are found alike) -- with what it feeds."""
    out = {}
    for name, kinds in what_follows(graph, types).items():
        if "attention scores" in kinds:
            out[name] = "attention scores"
        elif "attention values" in kinds:
            out[name] = "attention values"
    return out
