"""The moment probe: :class:`MomentProbe` (hooks, per-call bookkeeping); :func:`measure_moments`
runs it over data (:mod:`~initlab.measure.probe.run`).

What is measured, the gradient scaling and what is exact: :mod:`initlab.measure.probe`. The hooks
are registered in :meth:`MomentProbe.register` and kept in the
:class:`~initlab._core.hooks.HookContext`'s handles, all removed on exit. Per-example gradients
come from :data:`~initlab.measure.probe.per_example.PER_EXAMPLE`; accumulation from
:mod:`~initlab.measure.probe.accumulate`; the results' tables from
:mod:`~initlab.measure.probe.report`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.nn.utils import parametrize

from initlab._core.autocast import without_autocast
from initlab._core.compiled import scripted_error, uncompiled
from initlab._core.data import DataUse, at_mask, masks_positions, padding_mask
from initlab._core.hooks import HookContext, HookHandles
from initlab._core.knobs import check_batch_dim, user_stacklevel
from initlab._core.modules import with_first_names
from initlab._core.parametrized import (
    computed,
    machinery,
    owns_tensors,
    parametrized_names,
    parametrized_note,
    refuse_computed,
)
from initlab._core.pytree import flatten_tensors, map_tensors
from initlab._core.rows import Rows
from initlab._core.state import model_modes, restore_modes
from initlab.measure.probe.accumulate import _Consts, _Ledger, _Partial
from initlab.measure.probe.batch import _RootBatch, _Scale, check_root_batch, mean_factor
from initlab.measure.probe.checks import packed_note, refuse_norm_hooks, refuse_parametrized
from initlab.measure.probe.contribution import _Contribution, _Unavailable
from initlab.measure.probe.outputs import _flatten_call, _fresh_full_view, _inner_outputs
from initlab.measure.probe.per_example import (
    _captured_contributions,
    _Checks,
    _closed_form_contributions,
    _closed_form_input,
    _combine,
    _replay_contributions,
    _start_capture,
    _usable_capture,
)
from initlab.measure.probe.report import _module_table, _param_table, _probe_rows
from initlab.measure.probe.state import _Forward, _Frame, _ModuleState, _ParamState, _Record

__all__ = ["ModuleSelection", "MomentProbe"]

ModuleSelection = (
    Literal["params", "leaves", "all"] | Sequence[str] | Callable[[str, nn.Module], bool]
)

_SELECTIONS = ("params", "leaves", "all")
_REDUCTIONS = ("mean", "sum")


_DRAWS: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _check_draw(
    gen: torch.Generator, n: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.randn(n)`` from ``gen`` (seeded 0: the same every time), in float64 and float32 on
    ``device``; kept per ``(n, device)`` (read only), as a probe entered every step redraws it."""
    key = (n, device)
    hit = _DRAWS.get(key)
    if hit is None:
        if len(_DRAWS) > 16:
            _DRAWS.clear()
        here = torch.randn(n, generator=gen, dtype=torch.float64, device=gen.device).to(device)
        hit = _DRAWS[key] = (here, here.float())
    return hit


class MomentProbe(HookContext):
    """Record second moments of inputs, outputs, gradients and parameters of a model's modules.

    Use as a context manager around forward (and backward) passes; read the results with
    :meth:`rows` (long tidy schema :data:`PROBE_COLUMNS`), :meth:`table` (one row per module) and
    :meth:`param_table` (one row per parameter). See the module docstring for the exact
    definitions, the gradient scaling and what is exact.

    Args:
        model: any ``nn.Module``; its forward is the "root" forward that numbers module calls.
        modules: which modules to probe: ``"params"`` (default; every module that directly owns a
            parameter), ``"leaves"`` (modules without children), ``"all"`` (every module, the root
            included), a sequence of qualified names, or a predicate ``(name, module) -> bool``.
        per_example: also compute ``E[dW^2]`` of per-example gradients (``dW_example``). Closed
            forms for Linear, Conv, LayerNorm, Embedding and MultiheadAttention (its projections
            captured during its forward), one extra vmapped forward+backward for other modules.
        loss_reduction: ``"mean"`` or ``"sum"``: how your loss reduces over the batch. With
            ``"mean"`` ``dy``, ``dx`` and ``dW_example`` are multiplied by the batch size so they
            are gradients of one example's loss; ``dW`` is always the gradient of your loss.
        batch_dim: the batch dimension of the root model's inputs and of every module's inputs and
            outputs. ``None``: 0, except 1 for modules with ``batch_first=False`` (e.g.
            ``nn.MultiheadAttention``); the root uses 0, checked against its output
            (:mod:`~initlab.measure.probe.batch`: settled by it or refused).

    ``__init__`` only stores the arguments. ``__enter__`` registers the hooks, measures ``W`` and
    remembers the train/eval mode of every module; ``__exit__`` removes every hook (also when the
    block raised) and restores the modes. Entering again starts a fresh measurement.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        modules: ModuleSelection = "params",
        per_example: bool = True,
        loss_reduction: Literal["mean", "sum"] = "mean",
        batch_dim: int | None = None,
    ) -> None:
        if isinstance(modules, str) and modules not in _SELECTIONS:
            raise ValueError(
                f"unknown modules={modules!r}; valid values: {', '.join(map(repr, _SELECTIONS))}, "
                "a sequence of qualified module names, or a predicate (name, module) -> bool"
            )
        if loss_reduction not in _REDUCTIONS:
            raise ValueError(
                f"unknown loss_reduction={loss_reduction!r}; valid values: "
                f"{', '.join(map(repr, _REDUCTIONS))}"
            )
        check_batch_dim("MomentProbe", batch_dim)
        if isinstance(model, torch.jit.ScriptModule):
            raise scripted_error(model, "MomentProbe")
        if uncompiled(model) is not model:
            warnings.warn(
                "MomentProbe on a torch.compile'd model: its hooks break the compiled graph (and "
                "recompile it) on every call you make. Probe the module it wraps, "
                "MomentProbe(model._orig_mod), and call that; measure_moments(model, data) does so",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        self.model = model
        self.modules = modules
        self.per_example = per_example
        self.loss_reduction = loss_reduction
        self.batch_dim = batch_dim
        self._states: list[_ModuleState] = []
        self._params: dict[int, _ParamState] = {}
        self._hooks = HookHandles()
        self._selected: list[tuple[str, nn.Module]] = []
        self._modes: dict[str, bool] = {}
        self._active = False
        self._replaying = False
        self._root: _RootBatch | None = None  # the batch of the root forward last entered
        self._mask: torch.Tensor | None = None  # its attention_mask where it pads (B, T)
        self.example_count: float | None = None
        """What a mean-reduced loss divides by on the batch being run, where it is not the batch
        size (:func:`~initlab._core.loss_counts.example_count`); the gradients are scaled by it."""
        self.target_rows: int | None = None  # dim 0 of the batch's targets: evidence of B
        self._next_order = 0
        self._seq = 0
        self._forward = _Forward()
        self._consts = _Consts()
        self._ledger = _Ledger()  # the hooks' additions to accumulators, applied in batches
        self._checks = _Checks()  # the per-example gradients' consistency checks, likewise
        self.used: DataUse | None = None  # set by measure_moments
        #: forwards of the root model with gradients enabled (the probe's last entry); more than
        #: one per backward pass means the loss called the model several times per batch
        self.grad_forwards = 0

    # -- lifecycle ---------------------------------------------------------------------------

    def _select(self) -> list[tuple[str, nn.Module]]:
        skip = machinery(self.model)  # a parametrization's modules are part of their layer
        named = [(n, m) for n, m in self.model.named_modules() if id(m) not in skip]
        spec = self.modules
        if isinstance(spec, str):
            if spec == "params":
                chosen = [(n, m) for n, m in named if owns_tensors(m)]
            elif spec == "leaves":
                chosen = [(n, m) for n, m in named if all(id(c) in skip for c in m.children())]
            else:
                chosen = named
        elif callable(spec):
            chosen = [(n, m) for n, m in named if spec(n, m)]
        else:
            wanted = with_first_names(self.model, spec)  # a second name is the module too
            by_name = dict(named)
            unknown = [n for n in wanted if n not in by_name]
            if unknown:
                known = ", ".join(repr(n) for n, _ in named[:12])
                raise ValueError(
                    f"unknown module names {unknown}; the model has e.g. {known}"
                    + (" ..." if len(named) > 12 else "")
                )
            keep = set(wanted)
            chosen = [(n, m) for n, m in named if n in keep]
        if not chosen:
            hint = (
                "the model has no parameters; use modules='leaves' or 'all' to probe it"
                if spec == "params"
                else "nothing matched"
            )
            raise ValueError(f"MomentProbe(modules={spec!r}) selects no module: {hint}")
        return chosen

    def _module_batch_dim(self, module: nn.Module) -> int:
        if self.batch_dim is not None:
            return self.batch_dim
        return 1 if getattr(module, "batch_first", None) is False else 0

    def __enter__(self) -> MomentProbe:
        if self._active:
            raise RuntimeError("this MomentProbe is already active")
        refuse_norm_hooks(self.model)
        if refuse_computed():  # inside a method that writes weights, as the registry does
            refuse_parametrized(self.model)
        self._selected = self._select()
        self._states, self._params = [], {}
        self._modes = model_modes(self.model)
        self._root, self._next_order, self._seq = None, 0, 0
        self._forward = _Forward()
        self._ledger.clear()
        self._checks.clear()
        self.grad_forwards = 0
        super().__enter__()  # register(); every hook removed again if it raises
        self._active = True
        return self

    def register(self) -> None:
        """Hook the root model, every selected module and its parameters (and the BatchNorms)."""
        gen = torch.Generator().manual_seed(0)
        self._hooks.add(
            self.model.register_forward_pre_hook(
                self._root_pre_hook, with_kwargs=True, prepend=True
            )
        )
        self._hooks.add(self.model.register_forward_hook(self._root_hook))
        by_module: dict[int, _ModuleState] = {}
        given = self.batch_dim is not None
        for rank, (name, module) in enumerate(self._selected):
            st = _ModuleState(name, module, rank, self._module_batch_dim(module), given)
            by_module[id(module)] = st
            self._states.append(st)
            for local in parametrized_names(module):  # its computed tensors ("weight") first
                st.params.append((local, self._computed_state(name, module, local, st.replay)))
            for local, p in module.named_parameters(recurse=False):
                ps = self._params.get(id(p))
                if ps is None:
                    ps = self._params[id(p)] = _ParamState(p, [])
                    ps.acc_w = self._ledger.new_acc(p.device)  # W as at __enter__
                    self._ledger.add(ps.acc_w, self._ledger.reduce(p), p.numel())
                    ps.label = f"{name}.{local}" if name else local
                    if p.requires_grad:
                        self._hooks.add(p.register_hook(self._param_hook(ps)))
                st.params.append((local, ps))
            self._hooks.add(module.register_forward_pre_hook(self._pre_hook(st), with_kwargs=True))
            self._hooks.add(module.register_forward_hook(self._forward_hook(st), prepend=True))
            if self.per_example and st.kind == "attention":
                # pops the projection capture first, also when the forward raised
                self._hooks.add(
                    module.register_forward_hook(
                        self._capture_stop_hook(st), prepend=True, always_call=True
                    )
                )
        if self.per_example:
            self._draw_check_vectors(gen)
            for module in self.model.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    self._hooks.add(module.register_forward_pre_hook(self._bn_hook))
        self._adopt_children(by_module)

    def _computed_state(
        self, name: str, module: nn.Module, local: str, replay: bool
    ) -> _ParamState:
        """The state of the tensor ``local`` computed by ``module``'s parametrizations: its value
        now (``W``), and hooks that collect the gradient of every evaluation with gradients and
        hand their sum over when the trainable tensors' gradients arrive (all evaluations'
        gradients are in by then)."""
        plist = module.parametrizations[local]
        ps = self._params.get(id(plist))
        if ps is not None:
            return ps
        value = computed(module, local)
        ps = self._params[id(plist)] = _ParamState(value, [])
        sources = [p for p in plist.parameters() if p.requires_grad]
        ps.computed_trainable = bool(sources)
        ps.remark = parametrized_note(module, local)
        if replay:
            ps.no_example = (
                "per-example gradients of a computed tensor are given for unmodified Linear, "
                "Conv1d/2d/3d (not ConvTranspose), Embedding and LayerNorm layers only: the "
                f"others' ({parametrize.type_before_parametrizations(module).__name__}) come "
                "from a re-run, which cannot swap it"
            )
        ps.acc_w = self._ledger.new_acc(value.device)
        self._ledger.add(ps.acc_w, self._ledger.reduce(value), value.numel())
        ps.label = f"{name}.{local}" if name else local
        if sources:
            self._hooks.add(plist.register_forward_hook(self._evaluation_hook(ps)))
            for p in sources:
                self._hooks.add(p.register_hook(self._sources_hook(ps)))
        return ps

    def _draw_check_vectors(self, gen: torch.Generator) -> None:
        """The random vectors of every parameter's rank-one consistency check (one per dim), cut
        from one draw."""
        params = list(self._params.values())
        dims = [d for ps in params for d in ps.param.shape]
        on: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        start = 0
        for ps in params:
            device = ps.param.device
            if device not in on:
                here, here32 = _check_draw(gen, sum(dims), device)
                on[device] = (list(here.split(dims)), list(here32.split(dims)))
            n = ps.param.dim()
            v64, v32 = on[device]
            ps.set_vecs(v64[start : start + n], v32[start : start + n])
            start += n

    def _adopt_children(self, by_module: dict[int, _ModuleState]) -> None:
        """A replayed module's per-example gradients cover the parameters of its probed
        children that it uses without calling them (attributed to it when that happens)."""
        for st in self._states:
            if not st.replay:
                continue
            for sub_name, sub in st.module.named_modules():
                owner = by_module.get(id(sub))
                if not sub_name or owner is None:
                    continue
                for local, p in sub.named_parameters(recurse=False):
                    st.adoptable.append((f"{sub_name}.{local}", self._params[id(p)], owner))

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)  # removes every hook
        finally:
            restore_modes(self.model, self._modes)  # the core's one restoration of modes
            self._modes = {}
            self._flush()
            self._drop_pending()
            for st in self._states:
                st.frames.clear()
            self._active = False

    def _drop_pending(self) -> None:
        for ps in self._params.values():
            for rec in ps.pending:
                rec.live = False
            ps.pending = []
            ps.adopted_at = None
            ps.grad_parts = []

    # -- hooks -------------------------------------------------------------------------------

    def _root_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._replaying:
            return
        # the moments leave padded positions out (an encoder-decoder's: counted)
        self._mask = padding_mask(kwargs) if masks_positions(module) else None
        for st in self._states:
            st.calls_this_forward = 0
            st.frames.clear()
        self._root = _RootBatch([t for _, t in flatten_tensors((args, kwargs))], self.batch_dim)
        if torch.is_grad_enabled():
            self._drop_pending()
            self._forward = _Forward()
            self.grad_forwards += 1

    def _root_hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        """Settle the root forward's batch size (:mod:`.batch`); refuse an unclear one."""
        if self._replaying or self._root is None:
            return
        self._root.settle(output, self.target_rows)
        scaled = self.loss_reduction == "mean" and self.example_count is None
        if self._root.conflict and scaled and torch.is_grad_enabled():
            raise ValueError(f"MomentProbe: {self._root.conflict}")

    def _bn_hook(self, module: nn.Module, args: tuple) -> None:
        if not self._replaying and (module.training or not module.track_running_stats):
            self._forward.coupled = True

    def _scale(self, st: _ModuleState, tensors: list[tuple[str, torch.Tensor]]) -> _Scale:
        if self.loss_reduction == "sum":
            return _Scale(1.0)
        if self.example_count is not None:
            return _Scale(self.example_count)
        if self._root is not None and self._root.size is not None:
            return _Scale(root=self._root)  # the root's output may still change its size
        for _, t in tensors:
            if t.dim() > st.bd:
                return _Scale(float(t.shape[st.bd]))
        return _Scale(1.0)

    def _stats(
        self,
        st: _ModuleState,
        call: int,
        quantity: str,
        path: str,
        t: torch.Tensor,
        scale: float,
        also: tuple[str, ...] = (),
        seen: dict[int, Any] | None = None,
    ) -> None:
        """Accumulate ``t`` under ``path`` (and the same tensor under the paths ``also``);
        ``seen``: sums already taken in this hook call, by tensor."""
        if not t.is_floating_point() or t.layout != torch.strided:
            return
        st.float16 |= t.dtype == torch.float16 and quantity in ("y", "dy")  # float16_layers
        key_t = id(t)
        if self._mask is not None and st.bd == 0:
            t = at_mask(t, self._mask)  # (B, T, ...) at the real tokens of a padded batch
        sums = None if seen is None else seen.get(key_t)
        if sums is None:
            sums = self._ledger.reduce(t, scale, self._consts)
            if seen is not None:
                seen[key_t] = sums
        for p in (path, *also):
            key = (call, quantity, p)
            acc = st.acc.get(key)
            if acc is None:
                acc = st.acc[key] = self._ledger.new_acc(t.device)
            self._ledger.add(acc, sums, t.numel())

    def _grad_hook(
        self,
        st: _ModuleState,
        call: int,
        quantity: str,
        path: str,
        scale: _Scale,
        rec: _Record | None = None,
        once: list[bool] | None = None,
        shape: torch.Size | None = None,
        also: tuple[str, ...] = (),
    ) -> Callable[[torch.Tensor], None]:
        """``also``: more paths the same tensor was passed as (one hook, one reduction)."""

        @without_autocast
        def hook(grad: torch.Tensor) -> None:
            if self._replaying:
                return
            if once is not None:  # a view output hooked twice: whichever fires first counts
                if once[0]:
                    return
                once[0] = True
            if shape is not None:
                grad = grad.reshape(shape)
            self._stats(st, call, quantity, path, grad, scale.value, also)
            if rec is not None and rec.live and rec.fail is None:
                self._record_grad(rec, path, grad)

        return hook

    def _pre_hook(self, st: _ModuleState) -> Callable:
        @without_autocast
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
            if self._replaying:
                return None
            st.refuse_vmapped()
            call = st.calls_this_forward
            st.calls_this_forward += 1
            st.max_calls = max(st.max_calls, call + 1)
            if st.order is None:
                st.order = self._next_order
                self._next_order += 1
            self._seq += 1
            st.last_seq = self._seq
            inputs = _flatten_call(args, kwargs)
            scale = self._scale(st, inputs)
            seen: dict[int, Any] = {}  # a tensor passed several times: reduced once
            for path, t in inputs:
                if "mask" not in path.split(".", 1)[0].lower():  # an additive mask: no signal
                    self._stats(st, call, "x", path, t, 1.0, seen=seen)
            new_args, new_kwargs = args, kwargs
            if torch.is_grad_enabled() and any(t.requires_grad for _, t in inputs):
                inplace = getattr(module, "inplace", False) is True
                aliases: dict[int, torch.Tensor] = {}

                def alias(t: torch.Tensor) -> torch.Tensor:
                    # One alias per distinct tensor keeps `query is key` true; a module that
                    # writes into its input in place keeps the original (a view's hook would be
                    # bypassed by the in-place rebase, the base's hook sees the old value).
                    if not t.requires_grad or inplace:
                        return t
                    if id(t) not in aliases:
                        aliases[id(t)] = t.view_as(t)
                    return aliases[id(t)]

                new_args = map_tensors(args, alias)
                new_kwargs = map_tensors(kwargs, alias)
                hooked = _flatten_call(new_args, new_kwargs)
                paths: dict[int, tuple[torch.Tensor, list[str]]] = {}
                for path, t in hooked:
                    if t.requires_grad and t.is_floating_point():
                        paths.setdefault(id(t), (t, []))[1].append(path)
                for t, (first, *more) in paths.values():
                    t.register_hook(self._grad_hook(st, call, "dx", first, scale, also=tuple(more)))
            frame_inputs = (tuple(new_args), dict(new_kwargs))
            leaves = [
                t for _, t in (inputs if new_args is args and new_kwargs is kwargs else hooked)
            ]
            versions = [t._version for t in leaves]
            frame = _Frame(call, frame_inputs, leaves, versions, scale, self._seq)
            st.frames.append(frame)
            if self.per_example and st.kind == "attention" and torch.is_grad_enabled():
                frame.capture = _start_capture(module)  # popped by _capture_stop_hook
            if new_args is args and new_kwargs is kwargs:
                return None
            return tuple(new_args), new_kwargs

        return hook

    def _capture_stop_hook(self, st: _ModuleState) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not self._replaying and st.frames and st.frames[-1].capture is not None:
                st.frames[-1].capture.stop()

        return hook

    def _forward_hook(self, st: _ModuleState) -> Callable:
        @without_autocast
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            if self._replaying or not st.frames:
                return None
            frame = st.frames.pop()
            # a 0-d output (the loss a model returns beside its logits) is no activation
            outs = [(p, t) for p, t in flatten_tensors(output) if t.is_floating_point() and t.dim()]
            inputs = {id(t) for t in frame.leaves}
            inputs |= {id(t._base) for t in frame.leaves if t._base is not None}
            grad_on = torch.is_grad_enabled()
            rec = None
            if self.per_example and grad_on:
                rec = self._make_record(st, frame, outs)
            # an output another output is computed from is returned as a copy: dy is its
            # gradient through the rest of the graph only (:func:`_inner_outputs`)
            inner = (
                _inner_outputs(
                    outs, frame.leaves, [t._version for t in frame.leaves] == frame.versions
                )
                if grad_on and len(outs) > 1
                else ()
            )
            copies = {id(t): t.clone() for _, t in outs if id(t) in inner}
            seen: set[int] = set()
            for i, (path, t) in enumerate(outs):
                self._stats(st, frame.call, "y", path, t, 1.0)
                if grad_on and t.requires_grad:
                    # the record takes each output tensor once (a tensor returned twice would
                    # otherwise bring its total gradient twice)
                    first = id(t) not in seen and (st.replay or i == 0)
                    seen.add(id(t))
                    use = rec if first else None
                    t = copies.get(id(t), t)
                    base = t._base
                    if not _fresh_full_view(t, base, inputs):
                        t.register_hook(
                            self._grad_hook(st, frame.call, "dy", path, frame.scale, use)
                        )
                        continue
                    # An in-place op on a view output (Linear on 3-D input returns a view; then
                    # ReLU(inplace=True)) rebases it and its hook never fires; the hook on the base
                    # still sees the gradient w.r.t. the old value.
                    once = [False]
                    for target, shape in ((t, None), (base, t.shape)):
                        target.register_hook(
                            self._grad_hook(
                                st, frame.call, "dy", path, frame.scale, use, once, shape
                            )
                        )
            return map_tensors(output, lambda t: copies.get(id(t), t)) if copies else None

        return hook

    def _param_hook(self, ps: _ParamState) -> Callable[[torch.Tensor], None]:
        @without_autocast
        def hook(grad: torch.Tensor) -> None:
            if not self._replaying:
                self._param_grad(ps, grad)

        return hook

    def _param_grad(self, ps: _ParamState, grad: torch.Tensor) -> None:
        """Accumulate the minibatch gradient ``grad`` of one backward, then the per-example one."""
        if ps.acc_dw is None:
            ps.acc_dw = self._ledger.new_acc(grad.device)
        sums = self._ledger.reduce(grad, 1.0, self._consts)
        self._ledger.add(ps.acc_dw, sums, grad.numel())
        factor = mean_factor(self.loss_reduction, self.example_count, self._root)
        if factor is not None:  # dW_minibatch: the mean over the examples of their gradients
            ps.acc_mb = ps.acc_mb if ps.acc_mb is not None else self._ledger.new_acc(grad.device)
            mb = sums if factor == 1.0 else self._ledger.reduce(grad, factor, self._consts)
            self._ledger.add(ps.acc_mb, mb, grad.numel())
        if self.per_example:
            with torch.no_grad():
                self._finish_example(ps, grad.detach(), sums)

    def _evaluation_hook(self, ps: _ParamState) -> Callable:
        """On a ``ParametrizationList``: keep the gradient of each evaluation of the computed
        tensor that has one (in ``ps.grad_parts``). An evaluation that is a trainable tensor
        itself (a parametrization returning its input) is handed on as a view of it: a hook on
        the leaf would fire after :meth:`_sources_hook`, which hands the sum over."""

        def keep(grad: torch.Tensor) -> None:
            if not self._replaying:
                ps.grad_parts.append(grad.detach())

        def hook(plist: nn.Module, args: tuple, output: Any) -> torch.Tensor | None:
            if self._replaying or not isinstance(output, torch.Tensor):
                return None
            if not (torch.is_grad_enabled() and output.requires_grad):
                return None
            evaluation = output.view_as(output) if output.grad_fn is None else output
            evaluation.register_hook(keep)
            return evaluation if evaluation is not output else None

        return hook

    def _sources_hook(self, ps: _ParamState) -> Callable[[torch.Tensor], None]:
        """On a trainable tensor of a parametrization: the gradients of the computed tensor's
        evaluations are all in (autograd reaches it through them), their sum is dL/dW."""

        @without_autocast
        def hook(grad: torch.Tensor) -> None:
            if self._replaying or not ps.grad_parts:
                return
            parts, ps.grad_parts = ps.grad_parts, []
            total = parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)
            self._param_grad(ps, total)

        return hook

    # -- per-example gradients ---------------------------------------------------------------

    def _make_record(
        self, st: _ModuleState, frame: _Frame, outs: list[tuple[str, torch.Tensor]]
    ) -> _Record | None:
        params = self._record_params(st, frame)
        if not params:
            return None
        rec = _Record(st, frame, params, self._forward)
        leaves = frame.leaves
        now = [t._version for t in leaves]
        if now != frame.versions:
            rec.fail = "the module modifies its input in place"
        rec.fail = rec.fail or packed_note(frame.inputs)
        if not st.replay:
            _keep_closed_form_input(rec, st, leaves)
        else:
            self._keep_replay_inputs(rec, st, frame, outs, leaves, now)
            rec.capture = _usable_capture(rec, frame.capture)
        frame.capture = None
        rec.root = self._root  # checked against the call's batch when its gradients arrive
        for ps in params.values():
            ps.pending.append(rec)
        return rec

    def _record_params(self, st: _ModuleState, frame: _Frame) -> dict[str, _ParamState]:
        """The parameters a call's record covers: the module's own, and for a replayed module
        those of probed children it used without calling them (adopted once, by the innermost
        call)."""
        params = {local: ps for local, ps in st.params if ps.trainable and ps.no_example is None}
        if st.replay:
            for rel, ps, owner in st.adoptable:
                if not ps.trainable or owner.last_seq > frame.start_seq:
                    continue  # owner ran inside this call: its own record covers it
                if ps.adopted_at is not None and ps.adopted_at > frame.start_seq:
                    continue  # adopted by an inner call already
                ps.adopted_at = frame.start_seq
                params[rel] = ps
        return params

    def _keep_replay_inputs(
        self,
        rec: _Record,
        st: _ModuleState,
        frame: _Frame,
        outs: list[tuple[str, torch.Tensor]],
        leaves: list[torch.Tensor],
        versions: list[int],
    ) -> None:
        """Keep what a replay needs: the inputs, their versions and the outputs' paths/shapes."""
        rec.inputs = map_tensors(frame.inputs, lambda t: t.detach())
        rec.versions = versions
        once: dict[int, tuple[str, tuple[int, ...]]] = {}
        for path, t in outs:
            if t.requires_grad:
                once.setdefault(id(t), (path, tuple(t.shape)))
        rec.out_meta = list(once.values())
        if self._root is not None and self._root.size is not None:
            rec.batch = self._root.size  # settled by check_root_batch
        else:
            rec.batch = next(
                (int(t.shape[st.bd]) for t in leaves if t.dim() > st.bd),
                0,
            )

    def _record_grad(self, rec: _Record, path: str, grad: torch.Tensor) -> None:
        check_root_batch(rec)
        if rec.fail is not None:
            return
        if grad.is_floating_point():  # bfloat16 under autocast: sets the check's tolerance
            rec.compute_eps = max(rec.compute_eps, torch.finfo(grad.dtype).eps)
        if rec.forward.coupled:
            return  # BatchNorm coupled the examples: _finish_example reports NaN with the reason
        if rec.state.replay:
            rec.dys[path] = grad.detach()
            return
        assert rec.x is not None
        if rec.x._version != rec.x_version:
            rec.fail = "the module's input was modified in place after its forward"
            return
        try:
            with torch.no_grad():
                _closed_form_contributions(rec, grad)
        except Exception as err:  # report, never guess
            rec.fail = f"per-example gradient failed: {type(err).__name__}: {err}"[:300]

    def _finish_example(
        self, ps: _ParamState, grad: torch.Tensor, grad_sums: torch.Tensor | _Partial
    ) -> None:
        """``grad_sums``: the ledger's reduction of ``grad`` (:meth:`_Ledger.reduce`: its
        ``sum(grad^2)`` sets the consistency check's tolerance)."""
        records, n_pending = ps.pending, len(ps.pending)
        try:
            if ps.no_example is not None:
                raise _Unavailable(ps.no_example)
            parts = self._example_parts(ps, records)
            batch = records[0].batch
            if any(rec.batch != batch for rec in records):
                raise _Unavailable("module calls saw different batch sizes")
            scale = records[0].scale
            sqn, proj = _combine(parts, batch, n_pending, grad.device, tuple(ps.param.shape))
            total = sqn.sum()  # sum_i ||dW_i||^2
            # sum_i dW_i must equal scale * dW: checked through a random rank-one projection, on
            # the device, when results are read (no sync here)
            compute_eps = max(rec.compute_eps for rec in records)
            self._checks.add(ps, proj, grad, grad_sums, total, scale, compute_eps)
            if ps.acc_ex is None:
                ps.acc_ex = self._ledger.new_acc(grad.device)
            self._ledger.add(ps.acc_ex, total, batch * ps.numel)
        except _Unavailable as err:
            if ps.acc_ex is None:
                ps.acc_ex = self._ledger.new_acc(grad.device)
            ps.fail(str(err))
        finally:
            for rec in records:
                rec.params = {k: v for k, v in rec.params.items() if v is not ps}
                rec.contrib.pop(id(ps), None)
                if not rec.params:
                    rec.live = False
            ps.pending = []

    def _example_parts(self, ps: _ParamState, records: list[_Record]) -> list[_Contribution]:
        """The contributions of every recorded call to ``ps`` (replaying modules that need it)."""
        if not records and ps.computed_trainable is not None:
            raise _Unavailable(
                "a computed tensor used outside its own layer's call (by its parent, as "
                "nn.MultiheadAttention uses out_proj.weight): the parent's re-run cannot swap it"
            )
        if not records:
            raise _Unavailable("the gradient reached it outside any recorded module call")
        parts: list[_Contribution] = []
        for rec in records:
            check_root_batch(rec)
            if rec.fail is not None:
                raise _Unavailable(rec.fail)
            if rec.forward.coupled:
                raise _Unavailable(
                    "BatchNorm used batch statistics in this forward: the examples interact, "
                    "per-example gradients are undefined"
                )
            if rec.capture is not None:
                self._from_capture(rec, ps)
            replay = rec.state.replay and rec.capture is None
            if replay and rec.dys and rec.generic_key != len(rec.dys):
                self._replay(rec)
                rec.generic_key = len(rec.dys)
            part = rec.contrib.get(id(ps))
            if part is not None:
                parts.append(part)
        return parts

    def _from_capture(self, rec: _Record, ps: _ParamState) -> None:
        """The contribution of ``ps`` from the record's captured projections; on an unexpected
        failure the record falls back to the re-run."""
        try:
            _captured_contributions(rec, ps)
        except _Unavailable:
            raise
        except Exception:
            rec.capture = None
            rec.contrib.clear()

    def _replay(self, rec: _Record) -> None:
        """Re-run the module of ``rec`` for its contributions, with the probe's hooks muted."""
        self._replaying = True
        try:
            _replay_contributions(rec)
        except _Unavailable:
            raise
        except Exception as err:
            raise _Unavailable(
                f"per-example gradient via torch.func failed: {type(err).__name__}: {err}"[:300]
            ) from err
        finally:
            self._replaying = False

    # -- results -----------------------------------------------------------------------------

    def _flush(self) -> None:
        """Apply what the hooks handed over (moments' sums, consistency checks)."""
        self._ledger.flush()
        self._checks.flush()

    def _report_states(self) -> list[_ModuleState]:
        self._flush()
        called = sorted((s for s in self._states if s.order is not None), key=lambda s: s.order)
        return called + [s for s in self._states if s.order is None]

    def rows(self) -> Rows:
        """All measurements in the long tidy schema :data:`PROBE_COLUMNS`.

        Raises:
            ValueError: a module's first input or first output (the tensors :meth:`table` uses)
                accumulated fewer than 2 elements, so its variance is undefined; probe with a
                larger batch. Other tensors (a scalar keyword argument) get ``var = NaN``.
        """
        return _probe_rows(self._report_states())

    def table(self) -> Rows:
        """One row per probed module (all calls pooled), columns :data:`TABLE_COLUMNS`.

        ``E_*``/``var_*`` use the first tensor of each kind (input ``"0"``, output ``"0"`` or the
        first output path); ``gain_fwd = var(y) / var(x)``, ``gain_bwd = E[dx^2] / E[dy^2]``.
        ``cum_gain_fwd`` multiplies ``gain_fwd`` over modules in execution order up to this one;
        ``cum_gain_bwd`` multiplies ``gain_bwd`` from the last executed module back to this one
        (the order gradients flow): the probed modules' own gains only (a functional activation
        between two of them is not in it; the linter's
        :func:`~initlab.diagnostics.linter.gradient_ratios` measures the end-to-end backward gain
        directly). Modules whose gain is undefined (never called, integer input)
        get NaN and are skipped in the products. ``calls`` is the number of calls per root forward
        (0: never called); ``nonfinite`` counts excluded batch-calls over all tensors.
        """
        return _module_table(self._report_states())

    def param_table(self) -> Rows:
        """One row per (probed module, direct parameter), columns :data:`PARAM_TABLE_COLUMNS`.

        ``E_W2`` as at ``__enter__``; ``E_dW2`` the minibatch gradient's ``E[dW^2]`` averaged over
        backward passes; ``E_dW2_example`` the per-example one (NaN with a ``note`` where it cannot
        be computed exactly); ``ratio = E_dW2_example / E_W2`` (the weight-to-gradient ratio
        ``nu``); ``nonfinite`` counts backward passes left out.
        """
        return _param_table(self._report_states())

    @property
    def float16_layers(self) -> frozenset[str]:
        """Modules with a float16 output or output gradient (:mod:`initlab._core.underflow`)."""
        return frozenset(st.name for st in self._states if st.float16)

    @property
    def notes(self) -> list[str]:
        """Why some ``dW_example`` values are NaN: ``"<module>.<param>: <reason>"``."""
        self._flush()
        return [f"{ps.label}: {n}" for ps in self._params.values() for n in ps.report()[1]]

    def __repr__(self) -> str:
        state = "active" if self._active else "inactive"
        return (
            f"MomentProbe({type(self.model).__name__}, modules={self.modules!r}, "
            f"{len(self._states)} modules, {state})"
        )


def _keep_closed_form_input(rec: _Record, st: _ModuleState, leaves: list[torch.Tensor]) -> None:
    """Keep the input tensor the module's closed form uses, or the reason there is none."""
    x, why = _closed_form_input(st.kind, st.module, st.bd, leaves)
    if x is None:
        rec.fail = rec.fail or why
        return
    try:  # no cost where it holds; an input pooled over batch_dim= lacks that dim
        rec.batch = int(x.shape[st.bd])
    except IndexError:
        rec.fail = (
            rec.fail or f"module input of shape {tuple(x.shape)} has no dim {st.bd} (the batch dim)"
        )
        return
    rec.x = x.detach()
    rec.x_version = x._version
