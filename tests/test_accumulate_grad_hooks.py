"""Hooks on a parameter's ``AccumulateGrad`` node (the older "optimizer step in the backward"
recipe, ``p.view_as(p).grad_fn.next_functions[0][0].register_hook(...)``, and
``torch.distributed.optim._apply_optimizer_in_backward``) do not fire inside the entry points
that back-propagate a loss with ``loss.backward()`` (the probe's ``measure_moments`` and
``gr_scaling``, ``gradient_stats``, ``diagnose``): the results are bit for bit those of the same
model without the hooks, the weights and the optimizer's state are as before, and the hooks are
back, in their order, firing on the user's own backward after the call (or after an interrupt).
torch's own hooks on the node (FSDP's gradient reduction) stay active. A
``DistributedDataParallel`` model runs its wrapped module without DDP's reducer (a measurement is
local): the gradients it reads are each rank's own."""

from __future__ import annotations

import copy
import struct
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

import initlab
from initlab._core.state import model_kept

from .conformance_models import interrupted_loss
from .ddp_util import run_ranks

with warnings.catch_warnings():  # the package's own import uses the deprecated torch.jit.interface
    warnings.simplefilter("ignore", DeprecationWarning)
    from torch.distributed.optim import _apply_optimizer_in_backward

pytestmark = pytest.mark.usefixtures("one_thread")

_CE = nn.CrossEntropyLoss()


def _xy(rows: int = 64, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 6, generator=gen), torch.randint(0, 3, (rows,), generator=gen)


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = _xy()
    return [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))


def _bits(value: Any) -> Any:
    """The rows with every float as its exact bits (``-0.0`` differs from ``0.0``; NaN is
    equal to NaN)."""
    if isinstance(value, float):
        return struct.pack("<d", value).hex() if value == value else "nan"
    if isinstance(value, dict):
        return {k: _bits(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_bits(v) for v in value]
    return value


def _diagnose(model: nn.Module, data: Any) -> Any:
    report = initlab.diagnose(model, data, _CE, spectra=False, lint=False, generator=0)
    return {name: list(rows) for name, rows in sorted(report.tables.items())}


_CALLS: dict[str, Callable[[nn.Module, Any], Any]] = {
    "measure_moments": lambda m, d: list(initlab.measure_moments(m, d, _CE).rows()),
    "gr_scaling": lambda m, d: list(initlab.gr_scaling(m, d, _CE)),
    "gradient_stats": lambda m, d: list(initlab.gradient_stats(m, d, _CE)),
    "diagnose": _diagnose,
}


def _node(p: torch.Tensor) -> Any:
    """The parameter's ``AccumulateGrad`` node, as the recipe reaches it."""
    return p.view_as(p).grad_fn.next_functions[0][0]


def _node_hooks(
    model: nn.Module, kind: str, *, primed: bool = True
) -> tuple[list[torch.optim.Optimizer], list[int]]:
    """One SGD-with-momentum optimizer per parameter, stepped by a hook on its node
    (``kind``: ``register_hook``, ``register_prehook``, or torch's
    ``_apply_optimizer_in_backward``); the list counts the steps. ``primed``: each optimizer has
    taken one step already (it holds a momentum buffer)."""
    steps = [0]
    if kind == "apply_optimizer_in_backward":
        _apply_optimizer_in_backward(
            torch.optim.SGD, model.parameters(), {"lr": 0.5, "momentum": 0.9}
        )
        opts = [p._in_backward_optimizers[0] for p in model.parameters()]  # type: ignore[attr-defined]
        for opt in opts:
            real = opt.step

            def counted(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
                steps[0] += 1
                return _real(*args, **kwargs)

            opt.step = counted  # type: ignore[method-assign]
    else:
        opts = []
        nodes = []
        for p in model.parameters():
            opt = torch.optim.SGD([p], lr=0.5, momentum=0.9)

            def step(*_args: Any, _opt: torch.optim.Optimizer = opt) -> None:
                steps[0] += 1
                _opt.step()

            node = _node(p)
            getattr(node, kind)(step)
            opts.append(opt)
            nodes.append(node)  # the recipe keeps the nodes alive
        model._nodes = nodes  # type: ignore[assignment]
    if not primed:
        return opts, steps
    x, y = _xy(16, seed=5)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()  # the user's step: momentum buffers exist
    model.zero_grad()
    return opts, steps


_KINDS = ["register_hook", "register_prehook", "apply_optimizer_in_backward"]


@pytest.mark.parametrize("kind", _KINDS)
@pytest.mark.parametrize("name", list(_CALLS))
def test_accumulate_grad_node_hooks_do_not_fire_inside_the_call(name: str, kind: str) -> None:
    model = _mlp()
    opts, steps = _node_hooks(model, kind)
    n_params = len(list(model.parameters()))
    assert steps[0] == n_params
    plain = _mlp()
    with torch.no_grad():
        for a, b in zip(plain.parameters(), model.parameters(), strict=True):
            a.copy_(b)  # the hook-free model: the same weights
    want = _bits(_CALLS[name](plain, _data()))
    weights = copy.deepcopy(model.state_dict())
    states = [copy.deepcopy(o.state_dict()) for o in opts]
    got = _bits(_CALLS[name](model, _data()))
    assert steps[0] == n_params  # no step inside the call
    assert got == want  # gamma, moments, gradient spread: bit for bit as without the hooks
    for key, value in model.state_dict().items():
        assert torch.equal(value, weights[key]), key
    for opt, before in zip(opts, states, strict=True):
        after = opt.state_dict()
        assert after["param_groups"] == before["param_groups"]
        for i, entry in before["state"].items():
            assert torch.equal(after["state"][i]["momentum_buffer"], entry["momentum_buffer"])
    x, y = _xy(16, seed=7)
    F.cross_entropy(model(x), y).backward()  # the user's own backward: the hooks fire again
    assert steps[0] == 2 * n_params


def test_node_hooks_come_back_in_order_after_an_interrupt() -> None:
    model = _mlp()
    fired: list[str] = []
    node = _node(model[0].weight)
    handles = [node.register_hook(lambda *_a, s=s: fired.append(s)) for s in "abc"]
    with pytest.raises(KeyboardInterrupt):
        initlab.gradient_stats(model, _data(), interrupted_loss(at=2))
    assert fired == []
    handles[1].remove()
    x, y = _xy(16)
    F.cross_entropy(model(x), y).backward()
    assert fired == ["a", "c"]


def test_torchs_own_node_hooks_stay_active() -> None:
    """FSDP's reduction hook on the node is torch's: it fires inside the call."""
    model = _mlp()
    fired = [0]

    def reduce_hook(*_args: Any) -> None:
        fired[0] += 1

    reduce_hook.__module__ = "torch.distributed.fsdp._runtime_utils"  # where FSDP's hook lives
    node = _node(model[0].weight)
    node.register_hook(reduce_hook)
    initlab.gradient_stats(model, _data()[:1], _CE)
    assert fired[0] == 1


class _NoViews(torch.Tensor):
    """A wrapper subclass that takes every op but views: its ``__torch_dispatch__`` declines
    them (``NotImplemented``), and torch raises ``TypeError`` ("Multiple dispatch failed")."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> _NoViews:
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)

    def __init__(self, elem: torch.Tensor) -> None:
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default):
            return NotImplemented
        out = func(*pytree.tree_map(_unwrap, args), **pytree.tree_map(_unwrap, kwargs or {}))
        if func._schema.is_mutable:
            return args[0]
        return pytree.tree_map(lambda t: _NoViews(t) if isinstance(t, torch.Tensor) else t, out)


def _unwrap(t: Any) -> Any:
    return t.elem if isinstance(t, _NoViews) else t


class _Gain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(_NoViews(torch.ones(6)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def test_a_parameter_subclass_without_views_has_no_node_to_suspend() -> None:
    """model_kept ran ``p.view_as(p)`` to reach each node and caught only RuntimeError: a
    subclass declining views raised TypeError from every entry point (layer_spectra included,
    which ran before). Its node is out of the recipe's reach too: no hook to suspend."""
    torch.manual_seed(0)
    model = nn.Sequential(_Gain(), nn.Linear(6, 3))
    with pytest.raises(TypeError, match="Multiple dispatch failed"):
        model[0].w.view_as(model[0].w)
    with model_kept(model):
        pass
    rows = initlab.layer_spectra(model, _data()[:1]).to_rows()
    expected = torch.linalg.matrix_norm(model[1].weight.detach().double(), ord=2)
    assert [r["layer"] for r in rows] == ["1"]
    assert rows[0]["op_norm"] == pytest.approx(float(expected), rel=1e-6)


def _ddp_worker(rank: int, world: int) -> tuple[list[float], int]:
    model = nn.parallel.DistributedDataParallel(_mlp())
    _, steps = _node_hooks(model.module, "register_hook", primed=False)
    x, y = _xy(32)
    half = slice(16 * rank, 16 * (rank + 1))
    rows = initlab.gradient_stats(model, [(x[half], y[half])], _CE)
    return [r["E_dW2"] for r in rows], steps[0]


def test_ddp_model_gradients_are_each_ranks_own_with_the_users_hooks_suspended() -> None:
    """Each rank reads the gradient of the mean loss over its own 16 examples (DDP's all-reduce
    does not run inside a measurement), which a float64 computation on that half gives."""
    (r0, steps0), (r1, steps1) = run_ranks(_ddp_worker, 2)
    assert steps0 == steps1 == 0
    x, y = _xy(32)
    for rank, got in enumerate((r0, r1)):
        model = _mlp().double()
        half = slice(16 * rank, 16 * (rank + 1))
        F.cross_entropy(model(x[half].double()), y[half]).backward()
        want = [float(p.grad.square().mean()) for p in model.parameters()]
        assert got == pytest.approx(want, rel=1e-5)
