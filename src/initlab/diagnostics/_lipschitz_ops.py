r"""Which operations of one forward the Lipschitz bound of :func:`~initlab.diagnostics.spectra.
lipschitz_bounds` may take as 1-Lipschitz (see :mod:`initlab.diagnostics.spectra`).

The product of operator norms bounds a network's Lipschitz constant only where every other
operation on the data path is at most 1-Lipschitz. :class:`OperationWatch` records the
operations of one forward (:func:`~initlab.measure.runtime_trace.recording`: a
``TorchFunctionMode`` and the module stack), those on the data path only (computed from the
model's input: not a weight's parametrization, a positional table, a mask), and judges each one
with its arguments against an explicit allow-list:

* 1-Lipschitz whatever their arguments (``tanh``, ``sigmoid`` and ``tanhshrink`` of real ones:
  of a complex tensor they have poles): ``relu``, ``tanh``, ``sigmoid``, ``hardtanh`` (``ReLU6``),
  ``hardsigmoid``, ``softsign``, ``log_sigmoid``, ``softshrink``, ``tanhshrink``, ``softmax``,
  ``softmin``, ``abs``, ``neg``, ``mean``; shape and layout changes (``view``, ``reshape``,
  ``flatten``, ``permute``, ``transpose``, ``squeeze``, ``split``, ``narrow``, basic slicing
  ``x[:, ::2]``, ``pixel_shuffle``, ...); dtype changes that do not round (``to``, ``float``,
  ``double``: to the same or a wider dtype, or back to a dtype the model computes in, below);
  max/min reductions over a dim (``amax``: a maxout);
  copies (``torch.tensor(h)``, ``x.new_tensor(h)``, ``as_tensor``, ``asarray``: of one
  activation; ``v.data = h``);
* with arguments that keep them 1-Lipschitz: ``clamp`` and elementwise ``max``/``min``/``maximum``
  with constant bounds that do not broadcast the activation to more entries (of two activations,
  ``clamp(a(x), min=b(x))``, they are not known); ``leaky_relu`` / ``elu`` / ``prelu`` with slope
  ``|a| <= 1`` (a ``prelu`` weight no activation computes: ``prelu(h, 0.01 * h[0])`` is a product
  of two), ``rrelu`` with ``|lower|, |upper| <= 1``, ``celu`` with ``alpha > 0`` (slope
  ``exp(x / alpha)`` below 0), ``softplus`` whose step at its ``threshold`` (where it turns to
  ``x``), ``log(1 + exp(-threshold)) / |beta|``, is below ``1e-6`` (the default's is 2e-9);
  ``interpolate`` to the same size at scale 1 (the identity); ``where``/``masked_fill`` of one
  activation and constants by a mask no activation computes; ``dropout`` in eval mode (``training``
  of ``F.dropout``, ``train`` of ``torch.dropout`` false; or ``p`` 0 or 1); max pooling with
  ``kernel <= stride`` and no dilation (non-overlapping windows), adaptive max/average pooling
  whose output size divides the input size; average pooling without
  ``ceil_mode`` or ``divisor_override``, that counts its zero padding; ``pad`` with constant
  padding; a product by a constant of ``max |c| <= 1`` (a division by one of ``min |c| >= 1``);
  adding a constant (a bias), with ``add``/``sub``'s ``alpha`` scaling the activation by ``|alpha|
  <= 1`` where it is given; both only where the output has as many entries as the activation (a
  constant of shape ``(1, 10)`` broadcasting an activation of shape ``(N, 1)`` repeats each entry
  ``r = 10`` times: Lipschitz constant ``sqrt(r) max |c|``, ``sqrt(r)`` for a sum);
  ``cat``/``stack`` of one activation with constants; ``sum`` over one entry; an in-place write
  (``x[i] = v``, ``y.copy_(v)``, a call's ``out=``) of constants at places no activation picks,
  or of one activation over a tensor holding none, without repeating its entries (``y[:] = h``;
  not ``h[:, 1] = h[:, 0]``, nor ``torch.neg(h, out=y[:, 4:])`` after ``out=y[:, :4]``), nor
  a view of its storage made before it that reads an entry more than once (stride 0, overlapping
  ``as_strided``: ``v = y.expand(3, 4)`` before ``y.copy_(h[:1])`` repeats ``h[0]`` 3 times),
  whoever reads that view (a trusted layer, the loss);
* the layers whose norms the bound takes: any call inside a Linear, convolution or eval-mode
  BatchNorm with a finite operator norm (of torch's own class, not a subclass, with its
  ``forward`` not replaced on the instance, nor its methods on the class, ``nn.Linear.forward =
  patched``, nor the ``torch.nn.functional`` functions they call; not the calls of its pre- or
  forward hooks, judged as any other: ``o * 10``), where the weight its ``linear``/``conv*``
  applies (a BatchNorm's weight and running variance) is the layer's own tensor, the one it held
  when the forward began (not one ``torch.func.functional_call(layer, {"weight": 10 *
  layer.weight}, (x,))`` swaps in), and a BatchNorm's ``batch_norm`` normalizes by its running
  statistics (``training`` false: not a call in train mode, ``bn.train(); bn(h); bn.eval()`` in
  the forward, by the batch's);
  under ``torch.nn.utils.parametrize`` (``weight_norm``, ``spectral_norm``, one's own), where
  the weight its forward computed is bit for bit the one the bound's norm is of (not a
  ``spectral_norm`` in training mode, whose power iteration moves it on each forward); and a
  linear map
  (``linear``, ``conv*``, ``addmm``, ``matmul``) of such a layer's weight elsewhere (its parent
  applying it: :data:`~initlab.diagnostics._lipschitz.INFERRED_CALLS`), where the weight is the
  layer's parameter itself (or ``W.t()``; not ``W * 10``), applied as the layer does (no
  ``alpha`` above 1, a convolution's stride and padding) and as often as the bound counts the
  layer's norm (``F.linear(layer(h), layer.weight)`` applies it twice);
* the sum ``x + F(x)`` of a residual block the bound models (one the runtime trace finds, with
  the same layers as one of the bound's blocks), whose operands each have as many entries as
  the sum (not one that broadcasts: ``h + f(h.amax(1, keepdim=True))`` or ``h[:, :1] + f(h)``
  repeats the entries of one, which ``||x|| + ||F||`` does not count).

A value read out of the data (``h.item()``, ``float(h)``, ``bool(h)`` for a Python branch, a cast
to an integer dtype, a comparison) makes the bound no guarantee: the one recorded forward may not
be the function at other inputs. So does a step function of the data, which jumps (not Lipschitz
at all, whatever its Jacobian, 0 almost everywhere): ``floor``, ``ceil``, ``round``, ``trunc``,
``frac``, ``sign``, ``h // c``, ``torch.div(h, c, rounding_mode="floor")`` (or ``"trunc"``),
``fmod``, ``remainder`` (``h % c``), and any use in the model of the integer indices a call
taken as 1-Lipschitz computed from the data (``h.max(dim=1).indices.float()``, ``torch.max(h,
1)[1]``, ``max_pool1d(h, 2, return_indices=True)[1]``: an argmax; the values stay 1-Lipschitz).
So does a cast to a floating dtype narrower (a larger ``eps``, a smaller ``max`` or a larger
``tiny``) than the activation's and than every dtype the model computes in (its floating
parameters' dtypes, and autocast's where it is on): ``h.half()``, ``h.to(torch.bfloat16)``,
``h.to(torch.float8_e4m3fn)`` in a float32 or float64 model (any call with such an output:
``torch.tensor(h, dtype=torch.half)``, a ``copy_`` into a float16 buffer) rounds to a coarser
grid than its arithmetic does, a step function, and overflows above the dtype's ``max``; a cast
back to a dtype the model computes in (``h.double().float()`` in a float32 model) rounds as its
every operation does, which the bound, of the map in exact arithmetic, leaves aside. So does a
``view`` of an activation as another dtype (``h.view(torch.float32)`` of a float64 ``h``): it
reinterprets bits. So does a write into a parameter or a running variance in
the forward (``a.weight.mul_(10)`` before ``a(x)`` and ``div_(10)`` after, through ``.data`` or
not; ``a.weight.data = w``; a ``batch_norm`` in train mode, which updates the running
statistics): the norms are taken after the forward, not of the weight applied.
Global forward pre-hooks (run before the model is entered) and a model class overriding
``__call__`` make the bound no guarantee too: their operations on the input are not judged. What
the recorder cannot see makes the bound no guarantee too: a call inside the model taking a
floating tensor no recorded call made (the output of a ``torch.jit.script`` function or a
compiled extension; a global tensor), and a module on the data path whose output no recorded
call made.
The constants the model may use are its parameters, buffers and tensor attributes (not an
``nn.Parameter`` the forward makes: ``nn.Parameter(h)`` copies ``h`` unseen).

Calls inside a module the bound lists as not covered are left to that note (a PReLU, judged
here by its slope, and a module the forward never calls are not listed). Everything else
(GELU, SiLU, SELU, ELU with ``alpha > 1``, upsampling, overlapping max pooling, ``torch.cat`` of
two activations, ``10 * x``, ``torch.add(x, F(x), alpha=2)``, a product of two activations, a
functional ``layer_norm``, any op not listed) is reported with its Lipschitz constant where
known, and makes the bound no guarantee.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrize
from torch.utils._pytree import tree_flatten

from initlab._core.autocast import _enabled_for
from initlab._core.hooks import hook_handles
from initlab._core.parametrized import computed
from initlab._core.rows import shown
from initlab.diagnostics._lipschitz_judges import (
    _LAYER_OPS,
    _arg,
    _flat,
    _judge,
    _memory_repeats,
    _repeated,
    _rounds,
    _tuple,
)
from initlab.measure.runtime_trace import (
    RuntimeGraph,
    RuntimeNode,
    _storage_of,
    additions_of,
    recording,
    written_targets,
)

__all__ = ["OperationWatch"]


class OperationWatch:
    """Record the data-path operations of the forwards run inside ``with watch(): ...``
    (:func:`recording`, hooks removed on exit) and judge them (see the module docstring): each
    judged call becomes ``(node, why)``, ``why`` ``None`` where it is 1-Lipschitz, ``"layer"``
    for a linear map (decided once the layers' norms are known), ``"sum"`` for a sum of two
    activations (decided against the residual blocks), else the reason it is not."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.owners = {id(p): n for n, m in model.named_modules() for p in m.parameters(False)}
        self.graph: RuntimeGraph | None = None
        self.judged: list[tuple[RuntimeNode, str | None, str | None]] = []
        self._data: dict[int, bool] = {}
        self._returned: set[str] = set()  # modules whose forward returned: their hooks run
        self._pre: set[str] = set()  # modules whose forward pre-hooks run
        self._untrusted: set[int] = set()  # calls by forward hooks, or on unseen tensors
        self._global_hooks = False
        self._before: list[str] = []  # what runs on the input before the model is entered
        self._known: set[int] = set()  # the model's parameters, buffers, tensor attributes
        self.ran: set[str] = set()  # the modules called in the forward
        self.calls: dict[str, int] = {}  # how often each module was called
        self._by_name: dict[str, nn.Module] | None = None
        self._own: dict[str, dict[str, torch.Tensor | None]] = {}  # layers' tensors at the start
        self._applied: list[tuple[str, str, dict[str, Any]]] = []  # what layers' calls applied
        self._always: list[tuple[tuple[str, ...], str, str]] = []  # (stack, fn, why), all judged
        self._held: dict[tuple[str, int], str] = {}  # what the norms are of: id, storage -> name
        self._tag_of: Callable[[Any], int | None] | None = None
        self._verdicts: dict[int, str | None] = {}  # each judged call's why, by node index
        self._dtypes: list[torch.dtype] = []  # the model's parameters' floating dtypes

    @contextmanager
    def __call__(self) -> Iterator[OperationWatch]:
        """Record (see the class). A module's forward hooks run after its forward, still inside
        the module for the recorder: a hook placed first marks their calls, which no trusted
        layer covers (``o * 10`` in a Linear's hook); global forward hooks run before it, so
        with any of them no layer is trusted. The model's own forward pre-hooks run inside it
        for the recorder (:func:`recording`): a pre-hook placed first marks their calls too."""
        hooks = nn.modules.module
        pre = bool(getattr(hooks, "_global_forward_pre_hooks", None))
        self._global_hooks = pre or bool(getattr(hooks, "_global_forward_hooks", None))
        self._before = _before_forward(self.model, pre)
        self._known = {id(t) for m in self.model.modules() for t in _floats(dict(vars(m)))}
        self._own = {n: _own_tensors(m) for n, m in self.model.named_modules()}
        self._held = _held(self.model)
        self._dtypes = list({p.dtype: 0 for p in _floats(list(self.model.parameters()))})
        with recording(self.model, self._on_call) as graph, hook_handles() as handles:
            self.graph = graph
            for name, m in self.model.named_modules():
                handles.add(m.register_forward_pre_hook(lambda *_, n=name: self._pre.add(n),
                                                        prepend=True))  # fmt: skip
                handles.add(m.register_forward_pre_hook(lambda *_, n=name: self._enter(n)))
                handles.add(m.register_forward_hook(
                    lambda *_, n=name: self._returned.add(n), prepend=True, always_call=True
                ))  # fmt: skip
            handles.add(self.model.register_forward_hook(lambda m, a, out: self._output(out)))
            yield self

    def _output(self, out: Any) -> None:
        """:meth:`_read_views` of the model's output; an error of its own noted, not raised."""
        try:
            self._read_views(("",), "output", _floats(out))
        except Exception as err:
            self._always.append(((), "output", f"{_INTERNAL} ({type(err).__name__}: {err})"))

    def _enter(self, name: str) -> None:
        self._returned.discard(name)
        self._pre.discard(name)
        self.ran.add(name)
        self.calls[name] = self.calls.get(name, 0) + 1

    def judges(self, name: str, module: nn.Module) -> bool:
        """Whether the watch judges ``module``'s part itself, so that the bound need not list it
        as not covered: it never ran in the forward (a linear map its parent applies with its
        weight is judged there: :meth:`failures` checks that the bound counts each such use, and
        any other use of its parameters is judged as a constant), or it is a PReLU (its
        ``prelu`` judged with its slope)."""
        return name not in self.ran or isinstance(module, nn.PReLU)

    def _is_data(self, node: RuntimeNode) -> bool:
        """Computed from the model's input: an input node, a call outside the model (what the
        loss does to the batch before the model sees it), or a call on such a tensor."""
        known = self._data.get(node.index)
        if known is None:
            nodes = self.graph.nodes if self.graph is not None else []
            known = node.kind == "input" or (node.kind == "call" and not node.stack)
            known = known or any(self._is_data(nodes[i]) for i in node.inputs)
            self._data[node.index] = known
        return known

    def _on_call(
        self,
        node: RuntimeNode,
        args: tuple,
        kwargs: dict[str, Any],
        out: Any,
        tag_of: Callable[[Any], int | None],
    ) -> None:
        """:meth:`_judge_call`; where the watch's own code raises (an initlab bug), the call is
        not known to be 1-Lipschitz, said so, and the forward goes on: the error is not the
        model's, and must not be reported as its forward failing."""
        try:
            self._judge_call(node, args, kwargs, out, tag_of)
        except Exception as err:
            why = f"{_INTERNAL} ({type(err).__name__}: {err})"
            self._always.append((node.stack, node.fn, why))

    def _judge_call(
        self,
        node: RuntimeNode,
        args: tuple,
        kwargs: dict[str, Any],
        out: Any,
        tag_of: Callable[[Any], int | None],
    ) -> None:
        """Judge one recorded call inside the model on the data path (see the class), and any
        call or module output there that :meth:`_unseen` finds."""
        self._tag_of = tag_of
        if node.written or node.fn in ("set_data", "batch_norm"):
            self._writes_held(node, args, kwargs)
        data_path = self._is_data(node)  # every call's flag cached in turn
        unseen = self._unseen(node, args, kwargs, out, tag_of) if node.stack else None
        if node.stack and node.kind == "call" and not unseen:
            unseen = self._indices(args, kwargs, tag_of)
        if not (unseen or (data_path and node.stack and node.kind == "call")):
            return
        flat = _flat(args, {k: v for k, v in kwargs.items() if k != "out"})  # out=: written
        data = [a for a in flat if isinstance(a, torch.Tensor) and self._tagged(a, tag_of)]
        self._read_views(node.stack, node.fn, data)
        why, owner = unseen or _judge(node.fn, args, kwargs, out, data), None
        if why is None:  # a cast to a narrower dtype than the model computes in
            why = _rounds(node.fn, out, data, self._grid(data))
        if not unseen and any(self._tagged(t, tag_of) for t in _floats(kwargs.get("out"))):
            why = _OUT_HOLDS  # as y[:, 4:].copy_(h) after y[:, :4].copy_(h): h twice
        if node.fn in _APPLIED_AT and node.kind == "call":  # checked once the trusted are known
            used = {k: _arg(args, kwargs, i, k, None) for i, k in _APPLIED_AT[node.fn]}
            self._applied.append((node.module, node.fn, used))
        if why == "layer":
            owner, why = self._layer_weight(node.fn, args, kwargs)
        if node.module in self._returned or node.module in self._pre or unseen:
            self._untrusted.add(node.index)
        self.judged.append((node, why, owner))
        self._verdicts[node.index] = why

    def _indices(self, args: tuple, kwargs: Mapping[str, Any], tag_of: Callable) -> str | None:
        """Why a call taking an integer or boolean tensor that a call judged 1-Lipschitz
        computed from the data (the indices of ``h.max(dim=1)``, of ``max_pool1d(...,
        return_indices=True)``: an argmax, where only the values were judged) is not known to be
        1-Lipschitz: the indices are a step function of the data (``h.max(1).indices.float()``
        jumps where two entries tie); ``None`` where it takes none."""
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and not (t.is_floating_point() or t.is_complex()):
                i = tag_of(t)
                if i is not None and i in self._verdicts and self._verdicts[i] is None:
                    return _INDICES
        return None

    def _grid(self, data: list[torch.Tensor]) -> list[torch.dtype]:
        """The dtypes of the model's own arithmetic: its floating parameters' and, where on for
        the activations' device, autocast's (:func:`_rounds`)."""
        device = data[0].device.type if data else "cpu"
        on = _enabled_for(device)
        return [*self._dtypes, torch.get_autocast_dtype(device)] if on else self._dtypes

    def _read_views(self, stack: tuple[str, ...], fn: str, tensors: list[torch.Tensor]) -> None:
        """Keep, for :meth:`failures`, the reads (by call ``fn``, or the model's ``output``)
        of a view made before a write into its storage that repeats entries
        (``v = y.expand(3, 4); y.copy_(h[:1])``: ``h[0]`` 3 times): its own call was judged on
        the constants it held then. Reported whoever reads it, a trusted layer included."""
        tag_of, nodes = self._tag_of, self.graph.nodes if self.graph is not None else []
        with torch._C.DisableTorchFunction():  # from the model's forward hook: not recorded
            for t in tensors if tag_of is not None else []:
                i = tag_of(t)
                if i is None or not nodes[i].written or not self._is_data(nodes[i]):
                    continue
                why = _repeated(_memory_repeats(t))
                if why is not None:
                    self._always.append((stack, fn, f"a view made before a write into it {why}"))

    def _writes_held(self, node: RuntimeNode, args: tuple, kwargs: Mapping[str, Any]) -> None:
        """Keep, for :meth:`failures`, a write into a parameter or a running variance in the
        forward (``a.weight.mul_(10)`` before ``a(x)``, ``div_(10)`` after; through ``.data``;
        ``a.weight.data = 10 * a.weight.data``; a ``batch_norm`` in training mode updates its
        running statistics): the norm the bound takes, after the forward, need not be that of
        the weight applied."""
        if node.fn == "batch_norm":
            stats = (_arg(args, kwargs, 1, "running_mean", None), _arg(args, kwargs, 2,
                     "running_var", None))  # fmt: skip
            training = _arg(args, kwargs, 5, "training", False)
            targets = [t for t in stats if isinstance(t, torch.Tensor)] if training else []
        elif node.fn == "set_data":
            targets = list(args[:1])
        else:
            targets = written_targets(node.fn, args, kwargs)
        for t in targets:
            name = self._held.get(("id", id(t))) or self._held.get(("at", _storage_of(t) or 0))
            if name is not None:
                self._always.append((node.stack, node.fn, _WRITES_HELD.format(name)))

    def _layer_weight(
        self, fn: str, args: tuple, kwargs: Mapping[str, Any]
    ) -> tuple[str | None, str]:
        """``(owner, "layer")`` where the linear map's weight is a parameter of module ``owner``
        itself (or exactly its transpose ``W.t()``, for a product), applied as that module
        applies it (a convolution's stride, padding, dilation and groups; a product's ``alpha``
        at most 1 in size); else ``(None, why)``: a weight derived from it (``W * 10``), or a
        map whose norm is not the weight's, is not the layer the bound takes."""
        if fn not in _WEIGHT_AT:
            return None, f"{fn} of a weight: its operator norm is not the bound's"
        alpha = kwargs.get("alpha", 1)
        if not isinstance(alpha, (int, float)) or abs(alpha) > 1:
            return None, f"a linear map scaled by alpha = {alpha}: its norm is not the layer's"
        found = [self._parameter(_arg(args, kwargs, i, k, None)) for i, k in _WEIGHT_AT[fn]]
        owner = next((o for o in found if o is not None), None)
        if owner is None:
            return None, _NOT_THE_WEIGHT
        module = self._modules().get(owner)
        if fn.startswith("conv") and not _same_conv(fn, args, kwargs, module):
            return None, "a convolution of a layer's weight with other stride, padding or groups"
        return owner, "layer"

    def _parameter(self, t: Any) -> str | None:
        """The module whose parameter ``t`` is, itself or exactly its transpose (else ``None``)."""
        if not isinstance(t, torch.Tensor):
            return None
        if id(t) in self.owners:
            return self.owners[id(t)]
        base = t._base
        if id(base) not in self.owners or base.dim() != 2 or t.dim() != 2:
            return None
        same = t.shape == base.shape[::-1] and t.stride() == base.stride()[::-1]
        return self.owners[id(base)] if same and t.storage_offset() == 0 else None

    def _modules(self) -> dict[str, nn.Module]:
        if self._by_name is None:
            self._by_name = dict(self.model.named_modules())
        return self._by_name

    def _unseen(
        self, node: RuntimeNode, args: tuple, kwargs: dict[str, Any], out: Any, tag_of: Callable
    ) -> str | None:
        """Where data may flow through operations the recorder does not see (a
        ``torch.jit.script`` function, a compiled extension): a call taking a floating tensor no
        recorded call produced that is no parameter, buffer or tensor attribute of the model,
        or a module on the data path returning one (its output tagged by this node)."""
        if node.kind == "module":
            made = [t for t in _floats(out) if tag_of(t) == node.index]
            if not self._is_data(node) or all(self._constant(t) for t in made):
                return None
            return "its output was made by no recorded operation; " + _UNSEEN
        stray = [t for t in _floats((args, kwargs)) if tag_of(t) is None and not self._constant(t)]
        if any(isinstance(t, nn.Parameter) for t in stray):
            return _STRAY_PARAMETER
        return "takes a tensor no recorded operation made; " + _UNSEEN if stray else None

    def _constant(self, t: torch.Tensor) -> bool:
        """A parameter, buffer or tensor attribute of the model (not any ``nn.Parameter``:
        ``nn.Parameter(h)`` in the forward copies an activation)."""
        return id(t) in self._known

    def _tagged(self, t: torch.Tensor, tag_of: Callable[[Any], int | None]) -> bool:
        i = tag_of(t)
        return i is not None and self._is_data(self.graph.nodes[i])  # type: ignore[union-attr]

    def failures(
        self,
        covered: Iterable[str],
        uncovered: Iterable[str],
        blocks: Sequence[Mapping[str, Any]],
        calls: Mapping[str, int | None] | None = None,
    ) -> list[str]:
        """The operations not known to be 1-Lipschitz, one entry per function and reason:
        ``"gelu in 1, 3: Lipschitz constant 1.13 > 1"``. ``covered``: layers with a finite
        operator norm; ``uncovered``: modules the bound already lists; ``blocks``: the bound's
        residual blocks; ``calls``: how often the bound counts each layer's norm (``None``:
        not known). A covered layer's weight must be applied that often: once per call of the
        layer's own (trusted) forward, plus once per linear map of it elsewhere
        (:meth:`_layer_weight`)."""
        modules = self._modules()
        trusted = {n for n in covered if _torch_forward(modules.get(n)) and not self._global_hooks}
        skipped, covered = set(uncovered), set(covered)
        modelled = self._modelled_sums(blocks, covered)
        miscounted = self._miscounted(trusted, covered, calls or {})
        found: dict[tuple[str, str], list[str]] = {}

        def add(fn: str, why: str, module: str) -> None:
            where = found.setdefault((fn, why), [])
            if (module or "<root>") not in where:
                where.append(module or "<root>")

        for name, fn, why in self._not_own(trusted):
            add(fn, why, name)
        for stack, fn, why in self._always:
            if not skipped.intersection(stack):
                add(fn, why, stack[-1] if stack else "")
        for node, why, owner in self.judged:
            inside = node.module in trusted and node.index not in self._untrusted
            if why is None or inside or skipped.intersection(node.stack):
                continue
            if why == "layer":
                if owner in covered and owner not in miscounted:
                    continue
                why = miscounted.get(owner or "\0", _NOT_TAKEN)
            if why == "sum":
                if node.name in modelled:
                    continue
                why = "a sum of two activations that is no residual block of the bound"
            add(node.fn, why, node.module)
        return self._before + [f"{fn} in {shown(w, 3)}: {why}" for (fn, why), w in found.items()]

    def _not_own(self, trusted: set[str]) -> list[tuple[str, str, str]]:
        """``(layer, fn, why)`` for the trusted layers whose own calls applied a tensor other
        than the one the bound's norm is of: under a parametrization (``spectral_norm``,
        ``weight_norm``) a weight not bit for bit the computed one (:func:`~initlab._core.
        parametrized.computed`; a ``spectral_norm`` in training mode takes a step of power
        iteration on each forward, so its weight moves); else a weight or running variance that
        is not the layer's own tensor itself, held when the forward began
        (``torch.func.functional_call(lin, {"weight": 10 * lin.weight}, (x,))``); a BatchNorm
        call that normalized by the batch's statistics (``training`` true: the layer was in
        train mode at the call, ``bn.train(); bn(h); bn.eval()`` in the forward), whose map is
        not the eval-mode one the bound's norm is of."""
        out: list[tuple[str, str, str]] = []
        for name, fn, used in self._applied:
            if name not in trusted or any(name == o[0] for o in out):
                continue
            module = self._modules()[name]
            for key, t in used.items():
                if key == "training":  # batch_norm's: batch statistics, not the running ones
                    if t:
                        out.append((name, fn, _BATCH_STATS))
                        break
                elif key == "weight" and parametrize.is_parametrized(module, "weight"):
                    now = computed(module, "weight")
                    same = isinstance(t, torch.Tensor) and t.shape == now.shape
                    if not (same and torch.equal(t.detach(), now)):
                        out.append((name, "weight", _RECOMPUTED))
                        break
                elif t is not self._own[name].get(key):
                    out.append((name, fn, _NOT_OWN.format(key)))
                    break
        return out

    def _miscounted(
        self, trusted: set[str], covered: set[str], calls: Mapping[str, int | None]
    ) -> dict[str, str]:
        """The covered layers whose weight the forward applies other than ``calls`` times (a
        linear map of it outside its forward: ``F.linear(layer(h), layer.weight)``, or by its
        parent while the layer never runs), with why."""
        uses: dict[str, int] = {}
        for node, why, owner in self.judged:
            inside = node.module in trusted and node.index not in self._untrusted
            if why == "layer" and owner in covered and not inside:
                uses[owner] = uses.get(owner, 0) + 1
        out = {}
        for owner, k in uses.items():
            n = k + (self.calls.get(owner, 0) if owner in trusted else 0)
            counted = calls.get(owner)
            if counted is not None and n != counted:
                out[owner] = (
                    f"applies {owner}'s weight {n} time(s) per forward, where the bound counts "
                    f"its norm {counted} time(s)"
                )
        return out

    def _modelled_sums(self, blocks: Sequence[Mapping[str, Any]], covered: set[str]) -> set[str]:
        """Names of the recorded additions that are residual blocks with the same layers of
        known norm (``covered``) as one of ``blocks`` (the fx trace and the runtime trace may
        differ on parameter-free or scalar modules, such as FixUp's biases)."""
        if self.graph is None:
            return set()

        def key(b: Mapping[str, Any]) -> frozenset[str]:
            return frozenset(
                n for n in (*b.get("branch", ()), *b.get("shortcut", ())) if n in covered
            )

        declared = {key(b) for b in blocks} - {frozenset()}
        return {b["node"] for b in additions_of(self.graph)[0] if key(b) in declared}


def _before_forward(model: nn.Module, global_pre_hooks: bool) -> list[str]:
    """What runs on the model's input before the recorder enters the model, so that its calls
    count as the loss's and are never judged: global forward pre-hooks
    (``register_module_forward_pre_hook``: ``x * 10``), a class overriding ``__call__``."""
    out = []
    if global_pre_hooks:
        out.append(
            "global forward pre-hooks (register_module_forward_pre_hook) run before the model "
            "is entered: their operations are not judged, not known to be 1-Lipschitz"
        )
    own = [k for k in ("__call__", "_wrapped_call_impl", "_call_impl")
           if getattr(type(model), k, None) is not getattr(nn.Module, k)]  # fmt: skip
    if own:
        out.append(
            f"{type(model).__name__} overrides {', '.join(own)}: what it does before its forward "
            "is not judged, not known to be 1-Lipschitz"
        )
    return out


def _own_tensors(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """The tensors of ``module`` whose norm the bound takes, as registered: its ``weight`` (not a
    parametrized one, computed on each access) and a BatchNorm's ``running_var``."""
    held = {**module._buffers, **module._parameters}
    return {k: held[k] for k in ("weight", "running_var") if k in held}


def _held(model: nn.Module) -> dict[tuple[str, int], str]:
    """The tensors whose norms the bound takes, by ``("id", id)`` and ``("at", storage)``: the
    model's parameters and running variances, to their names."""
    held: dict[tuple[str, int], str] = {}
    named = [*model.named_parameters(), *model.named_buffers()]
    for name, t in named:
        if name.rsplit(".", 1)[-1] == "running_var" or isinstance(t, nn.Parameter):
            held[("id", id(t))] = name
            held.setdefault(("at", _storage_of(t) or 0), name)
    held.pop(("at", 0), None)
    return held


def _torch_forward(module: nn.Module | None) -> bool:
    """Whether ``module`` is of torch's own class (``type(module).__module__`` under
    ``torch.nn.modules``), so that it runs torch's ``forward`` and helpers: not a subclass (one
    keeping torch's ``forward`` may override ``_conv_forward`` or ``_check_input_dim``), nor a
    ``forward`` set on the instance (``layer.forward = wrapper``, as accelerate's hooks do), nor
    on the class (:func:`_torch_code`: ``nn.Linear.forward = patched``)."""
    if module is None:
        return False
    cls = type(module)
    if parametrize.is_parametrized(module) and cls.__module__ == parametrize.__name__:
        cls = cls.__bases__[0]  # the class parametrize made: torch's own class beneath
    own = cls.__module__.startswith("torch.nn.modules.") and "forward" not in vars(module)
    return own and _torch_code(cls)


#: The methods of torch's layers that run their map, which a patch on the class may replace.
_HELPERS = ("forward", "_conv_forward", "_check_input_dim", "_output_padding")
#: The functions of ``torch.nn.functional`` torch's layers call (by ``F.name``, at call time).
_FUNCTIONAL = (
    "linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "batch_norm", "pad",
)  # fmt: skip


def _torch_code(cls: type) -> bool:
    """Whether the functions of ``cls`` and of its torch bases (``_ConvNd``, ``_BatchNorm``;
    not ``nn.Module``) are torch's own, defined in the file of the torch module that defines
    the class (a replacement on the class, ``nn.Linear.forward = lambda self, x: 10 *
    F.linear(x, self.weight)``, or a ``functools.wraps`` wrapper, is defined elsewhere), and
    so are the ``torch.nn.functional`` functions they call (``F.linear`` a builtin,
    ``F.batch_norm`` defined in ``functional.py``)."""
    for c in cls.__mro__:
        if c is nn.Module or not c.__module__.startswith("torch.nn.modules."):
            continue
        home = getattr(sys.modules.get(c.__module__), "__file__", None)
        for name, f in vars(c).items():
            function = isinstance(f, types.FunctionType)
            if (function and f.__code__.co_filename != home) or (name in _HELPERS and not function):
                return False
    called = [getattr(F, name, None) for name in _FUNCTIONAL]
    return all(
        isinstance(f, types.BuiltinFunctionType)
        or (isinstance(f, types.FunctionType) and f.__code__.co_filename == F.__file__)
        for f in called
    )


_NOT_TAKEN = "a linear map whose operator norm the bound does not take"
_RECOMPUTED = (
    "its parametrization computed a weight in the forward other than the one the bound's norm is "
    "of (spectral_norm in training mode takes a step of power iteration on each forward: call "
    "model.eval())"
)
_INTERNAL = (
    "initlab's watch failed to judge it, a bug in initlab (not in the model; please report it): "
    "not known to be 1-Lipschitz"
)
_INDICES = (
    "takes integer indices computed from the data (of max/min over a dim, of max pooling with "
    "return_indices: an argmax), a step function of the data: not Lipschitz, and the recorded "
    "forward may not be the function at other inputs"
)
_BATCH_STATS = (
    "normalizes by the batch's statistics (the BatchNorm was in train mode at its call, as after "
    "bn.train() in the forward): not the eval-mode map max |gamma| / sqrt(running_var + eps) "
    "the bound's norm is of, not known"
)
_OUT_HOLDS = (
    "writes with out= into a tensor holding an activation already: it may repeat entries, not known"
)
_WRITES_HELD = (
    "writes into {} during the forward: the operator norm the bound takes after it need not be "
    "that of the weight applied, not known"
)
_NOT_OWN = (
    "applies a {} other than the layer's own (torch.func.functional_call, or one swapped in "
    "during the forward): its operator norm is not the bound's"
)
_NOT_THE_WEIGHT = (
    "a linear map of a weight that is no layer's parameter itself (one derived from it, such as "
    "W * 10): its operator norm is not the bound's"
)
#: The tensors a layer's own call applies whose norm the bound takes: ``(position, keyword)``.
_APPLIED_AT: dict[str, tuple[tuple[int, str], ...]] = {
    **{f: ((1, "weight"),) for f in _LAYER_OPS if f.startswith("conv") or f == "linear"},
    "batch_norm": ((2, "running_var"), (3, "weight"), (5, "training")),
}
#: Where each linear map takes its weight: ``(position, keyword)`` of each operand it may be.
_WEIGHT_AT: dict[str, tuple[tuple[int, str], ...]] = {
    **{f: ((1, "weight"),) for f in _LAYER_OPS if f.startswith("conv") or f == "linear"},
    "addmm": ((1, "mat1"), (2, "mat2")), "addmv": ((1, "mat"), (2, "vec")),
    "baddbmm": ((1, "batch1"), (2, "batch2")),
    **{f: ((0, "input"), (1, "other")) for f in ("matmul", "__matmul__", "__rmatmul__")},
    "mm": ((0, "input"), (1, "mat2")), "bmm": ((0, "input"), (1, "mat2")),
    "mv": ((0, "input"), (1, "vec")),
}  # fmt: skip


def _same_conv(fn: str, args: tuple, kwargs: Mapping[str, Any], module: Any) -> bool:
    """Whether a convolution is applied with ``module``'s stride, padding, dilation, groups and
    output padding (the bound's norm is that of the module's own map)."""
    if not isinstance(module, nn.modules.conv._ConvNd) or module.padding_mode != "zeros":
        return False
    d, transposed = len(module.stride), "transpose" in fn
    got = {
        "stride": _arg(args, kwargs, 3, "stride", 1),
        "padding": _arg(args, kwargs, 4, "padding", 0),
        "dilation": _arg(args, kwargs, 7 if transposed else 5, "dilation", 1),
        "output_padding": _arg(args, kwargs, 5, "output_padding", 0) if transposed else 0,
    }
    for key, value in got.items():
        want = getattr(module, key)
        if isinstance(value, str) or isinstance(want, str):
            if value != want:
                return False
        elif _tuple(value, d) != tuple(want):
            return False
    return _arg(args, kwargs, 6, "groups", 1) == module.groups


_STRAY_PARAMETER = (
    "takes an nn.Parameter that is none of the model's (nn.Parameter(h) in the forward copies "
    "an activation where the recorder does not see it): not known to be 1-Lipschitz"
)
_UNSEEN = (
    "not known to be 1-Lipschitz: a torch.jit.script function or a compiled extension hides its "
    "operations (run the eager code), or a tensor from outside the model (a global: register it "
    "as a buffer)"
)


def _floats(obj: Any) -> list[torch.Tensor]:
    return [
        t
        for t in tree_flatten(obj)[0]
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
    ]
