"""Activation statistics for the scaling linter: dead ReLU units and sigmoid/tanh input scales.

:class:`ActivationWatch` (forward pre-hooks on ReLU/ReLU6, Sigmoid and Tanh modules, during the
caller's passes; an in-place ReLU is read before it overwrites its input) and
:func:`_interpret_functional` (one forward of the traced graph with ``torch.fx.Interpreter``, no
grad, for functional activations found in the graph) feed :class:`_ActStats`, whose rows have the
columns :data:`ACTIVATION_COLUMNS`. Both stay importable from :mod:`initlab.diagnostics.linter`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from initlab._core.hooks import (
    HookContext,
    hook_handles,
    in_library_replay,
    refuse_inside_vmap,
)
from initlab._core.rows import Rows
from initlab.measure._fx import _fn_name, _fns

__all__ = ["ACTIVATION_COLUMNS", "ActivationWatch"]

ACTIVATION_COLUMNS: tuple[str, ...] = (
    "layer",
    "module_type",
    "kind",
    "source",
    "units",
    "examples",
    "dead_frac",
    "dead_channel_frac",
    "input_std",
    "input_E_x2",
    "batches",
)
"""Columns of :attr:`LintResult.activations`: ``kind`` (``relu``/``sigmoid``/``tanh``),
``source`` (``module``: through a pre-hook; ``functional``: through the fx interpreter; ``fx``:
found in the graph but not measured; ``runtime``: a functional ReLU of a model fx cannot trace,
seen by running it), ``units`` (entries per example), ``examples`` (examples
seen), ``dead_frac`` (ReLU: units ``<= 0`` for every example), ``dead_channel_frac`` (ReLU on
inputs with >= 3 dims: channels (dim 1) all of whose entries are dead), ``input_std`` and
``input_E_x2`` (std and ``E[x^2]`` of all input entries pooled; sigmoid and tanh only, NaN for
ReLU), ``batches`` (forward calls measured)."""

_RELU_MODULES: tuple[type[nn.Module], ...] = (nn.ReLU, nn.ReLU6)
_SIGMOID_MODULES: tuple[type[nn.Module], ...] = (nn.Sigmoid,)
_TANH_MODULES: tuple[type[nn.Module], ...] = (nn.Tanh,)
_RELU_FNS = _fns("relu", "relu_", "relu6") | _fns("relu", "relu_", module=torch)
_SIGMOID_FNS = _fns("sigmoid") | _fns("sigmoid", "sigmoid_", module=torch)
_TANH_FNS = _fns("tanh") | _fns("tanh", "tanh_", module=torch)
_KIND_METHODS = {
    "relu": "relu",
    "relu_": "relu",
    "sigmoid": "sigmoid",
    "sigmoid_": "sigmoid",
    "tanh": "tanh",
    "tanh_": "tanh",
}


def _activation_kind(module: nn.Module) -> str | None:
    if isinstance(module, _RELU_MODULES):
        return "relu"
    if isinstance(module, _SIGMOID_MODULES):
        return "sigmoid"
    if isinstance(module, _TANH_MODULES):
        return "tanh"
    return None


def _functional_kind(node: Any) -> str | None:
    if node.op == "call_function":
        t = node.target
        if t in _RELU_FNS:
            return "relu"
        if t in _SIGMOID_FNS:
            return "sigmoid"
        if t in _TANH_FNS:
            return "tanh"
    elif node.op == "call_method":
        return _KIND_METHODS.get(node.target)
    return None


# ----------------------------------------------------------------------------- activation stats


class _ActStats:
    """Running statistics of one activation call site (device tensors, no host sync)."""

    __slots__ = (
        "batches", "ever_pos", "examples", "kind", "module_type", "n", "s1", "s2", "source",
        "units",
    )  # fmt: skip

    def __init__(self, kind: str, module_type: str, source: str) -> None:
        self.kind, self.module_type, self.source = kind, module_type, source
        self.ever_pos: torch.Tensor | None = None
        self.s1: torch.Tensor | None = None
        self.s2: torch.Tensor | None = None
        self.n = 0
        self.units = 0
        self.batches = 0
        self.examples = 0

    def add(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() == 0:
            return
        with torch.no_grad():
            d = x.detach()
            self.batches += 1
            self.examples += int(d.shape[0]) if d.dim() > 1 else 1
            self.n += d.numel()
            per_example = d[0] if d.dim() > 1 else d
            self.units = per_example.numel()
            if self.kind == "relu" and d.dim() > 1:
                pos = (d > 0).flatten(1).any(0).reshape(d.shape[1:])
                if self.ever_pos is None or self.ever_pos.shape != pos.shape:
                    self.ever_pos = pos
                else:
                    self.ever_pos = self.ever_pos | pos
            if self.kind == "relu":
                return  # the dead-unit mask is all a ReLU needs (its input moments: the probe)
            s2 = torch.linalg.vector_norm(d, dtype=torch.float64).square()
            s1 = torch.sum(d, dtype=torch.float64)
            self.s2 = s2 if self.s2 is None else self.s2 + s2
            self.s1 = s1 if self.s1 is None else self.s1 + s1

    def row(self, layer: str) -> dict[str, Any]:
        dead = dead_ch = math.nan
        if self.ever_pos is not None:
            alive = self.ever_pos
            dead = int((~alive).sum()) / alive.numel()
            if alive.dim() >= 2:
                dead_ch = int((~alive.flatten(1).any(1)).sum()) / alive.shape[0]
        mean_sq = mean = math.nan
        if self.n and self.s2 is not None and self.s1 is not None:
            mean_sq = float(self.s2) / self.n
            mean = float(self.s1) / self.n
        std = math.sqrt(max(mean_sq - mean * mean, 0.0)) if math.isfinite(mean_sq) else math.nan
        return {
            "layer": layer,
            "module_type": self.module_type,
            "kind": self.kind,
            "source": self.source,
            "units": self.units,
            "examples": self.examples,
            "dead_frac": dead,
            "dead_channel_frac": dead_ch,
            "input_std": std,
            "input_E_x2": mean_sq,
            "batches": self.batches,
        }


# the advice of a refusal (an activation called inside torch.func.vmap)
_WATCH_OUT = " (or leave the activation watch out: diagnose(..., lint=False))"


class ActivationWatch(HookContext):
    """Forward pre-hooks on ReLU/ReLU6, Sigmoid and Tanh modules: dead units and input moments.

    A context manager; the batch is dim 0. A module called ``k`` times per forward gets one entry
    per call: ``name`` for the first, ``name@1``, ``name@2``, ... for the others (fx's naming).
    Hooks are removed on exit, also after an exception. Read the result with :meth:`rows`.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.stats: dict[str, _ActStats] = {}
        self._calls: dict[str, int] = {}

    def register(self) -> None:
        self._hooks.add(self.model.register_forward_pre_hook(self._root_hook))
        for name, module in self.model.named_modules():
            kind = _activation_kind(module)
            if kind is not None:
                self._hooks.add(module.register_forward_pre_hook(self._hook(name, kind, module)))

    def _root_hook(self, module: nn.Module, args: tuple) -> None:
        self._calls.clear()

    def _hook(self, name: str, kind: str, module: nn.Module) -> Callable[..., None]:
        def hook(_m: nn.Module, args: tuple) -> None:
            if in_library_replay():  # the moment probe re-running a block: no forward
                return
            refuse_inside_vmap(name, "the activation watch", _WATCH_OUT)
            call = self._calls.get(name, 0)
            self._calls[name] = call + 1
            key = name if call == 0 else f"{name}@{call}"
            st = self.stats.get(key)
            if st is None:
                st = self.stats[key] = _ActStats(kind, type(module).__name__, "module")
            if args:
                st.add(args[0])

        return hook

    def rows(self) -> Rows:
        """One row per activation call site, columns :data:`ACTIVATION_COLUMNS`."""
        return Rows(
            [st.row(name) for name, st in self.stats.items()],
            ACTIVATION_COLUMNS,
            title="activations",
        )


def _interpret_functional(
    gm: Any, nodes: list[Any], forward_args: Sequence[tuple[tuple, dict]]
) -> dict[str, _ActStats]:
    """Run the traced graph (no grad) once per ``(args, kwargs)`` and record the inputs of the
    given activation nodes."""
    import torch.fx

    wanted = {n.name: n for n in nodes}
    stats: dict[str, _ActStats] = {}

    class Watch(torch.fx.Interpreter):
        def run_node(self, n: Any) -> Any:
            if n.name in wanted:
                args, _ = self.fetch_args_kwargs_from_env(n)
                if args and isinstance(args[0], torch.Tensor):
                    st = stats.setdefault(
                        n.name, _ActStats(_functional_kind(n) or "relu", _fn_name(n.target),
                                          "functional")
                    )  # fmt: skip
                    st.add(args[0])
            return super().run_node(n)

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for args, kwargs in forward_args:
        values = list(args)
        for ph in placeholders[len(values) :]:
            if ph.target in kwargs:
                values.append(kwargs[ph.target])
            elif ph.args:
                values.append(ph.args[0])
            else:
                raise ValueError(f"no value for the model input {ph.target!r}")
        with torch.no_grad():
            Watch(gm).run(*values)
    return stats


_RELU_NAMES = {"relu", "relu_", "relu6"}


class _ReluWatch(TorchFunctionMode):
    """The inputs of functional ReLU calls (``F.relu``, ``torch.relu``, ``x.relu()``) made
    outside the leaf modules of ``torch.nn`` (an ``nn.ReLU`` is watched by its hook, and fx does
    not enter the others either), keyed by the calling module and the call's index in the
    forward (``module:relu`` for the first, ``other:relu_1`` for the second, counted across the
    model as fx numbers its nodes; the count restarts with each forward)."""

    def __init__(self, leaves: set[int]) -> None:
        super().__init__()
        self.leaves = leaves
        self.stack: list[tuple[str, bool]] = []  # (module name, whether it is a torch.nn leaf)
        self.stats: dict[str, _ActStats] = {}
        self.calls = 0  # functional ReLU calls in this forward

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        fn = getattr(func, "__name__", "")
        replay = in_library_replay()
        if fn in _RELU_NAMES and args and not (self.stack and self.stack[-1][1]) and not replay:
            k = self.calls
            self.calls += 1
            where = (self.stack[-1][0] if self.stack else "") or "<root>"
            key = f"{where}:relu" + (f"_{k}" if k else "")
            refuse_inside_vmap(key, "the ReLU watch", kind="functional ReLU")
            st = self.stats.setdefault(key, _ActStats("relu", fn, "runtime"))
            st.add(args[0])  # before the call: an in-place ReLU overwrites it
        return func(*args, **(kwargs or {}))


def _runtime_relus(
    model: nn.Module, forward_args: Sequence[tuple[tuple, dict]]
) -> dict[str, _ActStats]:
    """Run ``model(*args, **kwargs)`` (no grad) per entry and record the inputs of its
    functional ReLU calls (:class:`_ReluWatch`): the dead units of a model fx cannot trace."""
    import torch.fx

    tracer = torch.fx.Tracer()
    names = {id(m): n for n, m in model.named_modules()}
    leaves = {id(m) for n, m in model.named_modules() if n and tracer.is_leaf_module(m, n)}
    watch = _ReluWatch(leaves)

    def pre(module: nn.Module, _args: tuple) -> None:
        watch.stack.append((names.get(id(module), ""), id(module) in leaves))

    def post(_module: nn.Module, _args: tuple, _out: Any) -> None:
        if watch.stack:
            watch.stack.pop()

    with hook_handles() as handles:
        for m in model.modules():
            handles.add(m.register_forward_pre_hook(pre))
            handles.add(m.register_forward_hook(post, always_call=True))
        for args, kwargs in forward_args:
            watch.calls = 0
            with torch.no_grad(), watch:
                model(*args, **kwargs)
    return watch.stats
