"""A ``DistributedDataParallel`` model's passes inside an entry point are local (2 gloo CPU ranks).

DDP's forward broadcasts buffers and arms its reducer, whose backward all-reduces the gradients.
Inside initlab's local passes those collectives met the library's own agreement collectives:
with a loss failing on one rank, or ranks holding different numbers of batches, gloo aborted
both processes (``gr_scaling(all_reduce=True)``, ``precondition_``) or one rank got "Connection
closed by peer" (``diagnose``, ``measure_moments``), and ``diagnose`` mixed DDP's rank-averaged
gradients (``grad_norm``) with per-rank moments. Now a DDP model runs as the module it wraps:
every statistic is the rank's own, pooled only where the API pools it, and DDP is left as it was.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import initlab

from .ddp_util import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")

D = torch.float64


def _net(bn: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    mid = nn.BatchNorm1d(12) if bn else nn.Tanh()
    return nn.Sequential(nn.Linear(6, 12), mid, nn.ReLU(), nn.Linear(12, 3)).to(D)


def _batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randn(8, 6, generator=gen, dtype=D), torch.randint(0, 3, (8,), generator=gen))
        for _ in range(n)
    ]


def _failing_on(rank: int, before_forward: bool = False) -> Callable[[nn.Module, Any], Any]:
    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        if rank == 1 and before_forward:
            raise KeyError("bad labels on rank 1")
        out = model(batch[0])
        if rank == 1:
            raise KeyError("bad labels on rank 1")
        return F.cross_entropy(out, batch[1])

    return loss


def _outcome(call: Callable[[], Any]) -> tuple[str, str]:
    try:
        call()
    except Exception as err:
        return type(err).__name__, str(err)
    return "ok", ""


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _pooled_worker(rank: int, world: int) -> dict[str, Any]:
    """The entry points that pool over ranks, on a DDP model: a failure on rank 1 and uneven
    batch counts; each rank's outcome, whether the model is as before, and the results."""
    out: dict[str, Any] = {}
    for name, bn, early in (("mlp", False, False), ("bn, before the forward", True, True)):
        model = DDP(_net(bn))
        before = _state(model)
        loss = _failing_on(rank, early)
        data = _batches(rank, 2)
        out[f"gr_scaling, {name}"] = _outcome(
            lambda m=model, d=data, f=loss: initlab.gr_scaling(m, d, f, all_reduce=True)
        )
        out[f"precondition_, {name}"] = _outcome(
            lambda m=model, d=data, f=loss: initlab.precondition_(m, d, f)
        )
        out[f"kept, {name}"] = _same(before, _state(model))
    data = _batches(rank, 2 + rank)  # 2 and 3 batches: pooled
    rows = {}
    for kind, model in (("ddp", DDP(_net())), ("plain", _net())):
        got = initlab.gr_scaling(model, data, "cross_entropy", all_reduce=True).to_rows()
        rows[kind] = {r["layer"].removeprefix("module."): r["gamma_w"] for r in got}
        initlab.precondition_(model, data, "cross_entropy")
        rows[kind + " weights"] = [p.detach().clone() for p in model.parameters()]
    out["uneven"] = rows
    return out


def test_pooling_entry_points_on_a_ddp_model_fail_together_and_pool_uneven_batches() -> None:
    r0, r1 = run_ranks(_pooled_worker, 2, timeout_s=120)
    for name in ("mlp", "bn, before the forward"):
        for what in ("gr_scaling", "precondition_"):
            assert r0[f"{what}, {name}"] == r1[f"{what}, {name}"]
            kind, message = r0[f"{what}, {name}"]
            assert kind == "RankMismatchError"
            assert message.startswith(f"{what} stopped on every rank because 1 of 2 rank(s)")
            assert "rank 1: KeyError" in message and "bad labels on rank 1" in message
        assert r0[f"kept, {name}"] and r1[f"kept, {name}"]
    for got in (r0["uneven"], r1["uneven"]):
        assert got["ddp"] == got["plain"]
        assert set(got["ddp"]) == {"0", "3"} and all(math.isfinite(v) for v in got["ddp"].values())
        assert _same(got["ddp weights"], got["plain weights"])
    assert _same(r0["uneven"]["ddp weights"], r1["uneven"]["ddp weights"])


def _own_gradient_norm(rank: int) -> float:
    """Float64, by hand: the norm of this rank's own gradient of layer 0's weight."""
    net = _net()
    x, y = _batches(rank, 1)[0]
    F.cross_entropy(net(x), y).backward()
    return float(net[0].weight.grad.norm())


def _mean_gradient(rank_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """Float64, by hand: the mean over the ranks of each rank's own gradient (DDP's all-reduce)."""
    grads = []
    for x, y in rank_batches:
        net = _net()
        F.cross_entropy(net(x), y).backward()
        grads.append([p.grad for p in net.parameters()])
    return [sum(gs) / len(gs) for gs in zip(*grads, strict=True)]


def _local_worker(rank: int, world: int) -> dict[str, Any]:
    """The per-rank entry points on a DDP model (and on the module it wraps), then DDP's own
    training steps: a static_graph DDP before its first iteration included."""
    out: dict[str, Any] = {}
    data = _batches(rank, 1)[0]
    rows = {}
    for kind, model in (("ddp", DDP(_net())), ("plain", _net())):
        report = initlab.diagnose(model, data, "cross_entropy", spectra=False, lint=False)
        rows[kind] = [(r["layer"], r["param"], r["quantity"], r["value"]) for r in report.to_rows()]
        probe = initlab.measure_moments(model, _batches(rank, 2 + rank), "cross_entropy")
        rows[kind + " moments"] = [(r["layer"], r["E_x2"], r["E_dy2"]) for r in probe.table()]
    out["rows"] = rows
    out["own"] = _own_gradient_norm(rank)
    out["diagnose, loss fails on rank 1"] = _outcome(
        lambda: initlab.diagnose(DDP(_net()), data, _failing_on(rank), spectra=False, lint=False)
    )
    steps = []
    for options in ({}, {"static_graph": True}, {"broadcast_buffers": True}):
        model = DDP(_net(bn="broadcast_buffers" in options), **options)
        initlab.diagnose(model, _batches(rank, 2), "cross_entropy", spectra=False, lint=False)
        initlab.gr_scaling(model, _batches(rank, 2), "cross_entropy", all_reduce=True)
        for _ in range(2):  # DDP's own steps after the calls: its all-reduce, as before them
            model.zero_grad()
            F.cross_entropy(model(data[0]), data[1]).backward()
            steps.append([p.grad.clone() for p in model.parameters()])
    out["steps"] = steps
    return out


def test_ddp_model_gives_the_wrapped_modules_own_rows_on_each_rank_and_trains_after() -> None:
    r0, r1 = run_ranks(_local_worker, 2, timeout_s=120)
    for rank, got in enumerate((r0, r1)):
        ddp, plain = got["rows"]["ddp"], got["rows"]["plain"]
        assert [n for n, *_ in ddp] == [f"module.{n}" if n else n for n, *_ in plain]
        assert [(p, q) for _, p, q, _ in ddp] == [(p, q) for _, p, q, _ in plain]
        for (*key, a), (_, _, _, b) in zip(ddp, plain, strict=True):
            assert a == b or (math.isnan(a) and math.isnan(b)), key
        norms = {(n, p): v for n, p, q, v in ddp if q == "grad_norm"}
        assert norms["module.0", "weight"] == pytest.approx(_own_gradient_norm(rank), rel=1e-12)
        moments = got["rows"]["ddp moments"]
        assert [(n.removeprefix("module."), *v) for n, *v in moments] == got["rows"][
            "plain moments"
        ]
    assert r0["own"] != r1["own"]  # the ranks' own numbers, not a mean
    assert r0["diagnose, loss fails on rank 1"] == ("ok", "")
    assert r1["diagnose, loss fails on rank 1"] == ("KeyError", "'bad labels on rank 1'")
    both = [_batches(r, 1)[0] for r in range(2)]
    want = _mean_gradient(both)
    for got in (r0["steps"], r1["steps"]):
        for i, grads in enumerate(got):
            if i < 4:  # without BatchNorm: the float64 mean of the ranks' gradients
                for g, w in zip(grads, want, strict=True):
                    torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)
    for a, b in zip(r0["steps"], r1["steps"], strict=True):  # the BatchNorm model: the same
        assert _same(a, b)


def _copy_worker(rank: int, world: int) -> dict[str, Any]:
    """theory_vs_actual on a DDP model with a parametrized layer (measured on a deep copy of the
    model, taken inside the entry point), and a deep copy made inside ``local_passes`` by hand."""
    from torch.nn.utils.parametrizations import weight_norm

    from initlab._core.distributed import local_passes

    out: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(100 + rank)
    data = [(torch.randn(6, 4, generator=gen, dtype=D), torch.randint(0, 3, (6,), generator=gen))]
    for kind in ("ddp", "plain"):
        torch.manual_seed(0)
        net = nn.Sequential(weight_norm(nn.Linear(4, 8)), nn.Tanh(), nn.Linear(8, 3)).to(D)
        model = DDP(net) if kind == "ddp" else net
        rows = initlab.theory_vs_actual(model, data, "cross_entropy", probes=2, generator=0)
        out[kind] = [(r["layer"].removeprefix("module."), r["actual"]) for r in rows]
    model = DDP(_net())
    x = _batches(rank, 1)[0][0]
    with local_passes(model):
        twin = copy.deepcopy(model)
        with torch.no_grad():
            twin.module[0].weight.mul_(3.0)  # the copy's own weights, not the original's
        got = twin(x).detach()
    w0, b0 = model.module[0].weight.detach() * 3.0, model.module[0].bias.detach()
    w3, b3 = model.module[3].weight.detach(), model.module[3].bias.detach()
    out["copy"] = (got, torch.relu(torch.tanh(x @ w0.T + b0)) @ w3.T + b3)
    out["forward left"] = "forward" in vars(model)
    return out


def test_a_deep_copy_of_a_ddp_model_made_inside_an_entry_point_runs_the_copy() -> None:
    """A parametrized model is measured on a deep copy; the copy's DDP must call the copy's
    module (it called the original's: theory_vs_actual raised 'the copy's forward runs the
    original model')."""
    for got in run_ranks(_copy_worker, 2, timeout_s=120):
        assert got["ddp"] == got["plain"] and len(got["ddp"]) == 4
        torch.testing.assert_close(*got["copy"], rtol=1e-12, atol=1e-14)
        assert not got["forward left"]


class _Doubled(torch.autograd.Function):
    """``2 a``, with an attribute of its own named ``variable`` on the ctx (the ctx is the node)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
        ctx.variable = a.detach()
        return a * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


class _CustomFunctionNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_Doubled.apply(torch.tanh(self.a(x))))


class _CheckpointedNet(nn.Module):
    """A middle segment under a reentrant activation checkpoint (Hugging Face's
    gradient_checkpointing_enable() in many versions)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.mid, self.b = nn.Linear(6, 5), nn.Linear(5, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(lambda t: torch.tanh(self.mid(t)), self.a(x), use_reentrant=True)
        return self.b(h)


def _custom_model(case: str) -> nn.Module:
    torch.manual_seed(0)
    return {"custom function": _CustomFunctionNet, "reentrant": _CheckpointedNet}[case]().to(D)


def _grad_norms_worker(rank: int, world: int, case: str) -> dict[str, Any]:
    """gradient_stats on DDP(model) (one batch: each grad_norm is that batch's gradient's norm),
    and the norms by hand: ``loss.backward()`` on the plain model, float64."""
    x, y = _batches(rank, 1)[0]
    rows = initlab.gradient_stats(DDP(_custom_model(case)), [(x, y)], "cross_entropy")
    got = {(r["layer"].removeprefix("module."), r["param"]): r["grad_norm"] for r in rows}
    plain = _custom_model(case)
    F.cross_entropy(plain(x), y).backward()
    want = {tuple(n.rsplit(".", 1)): float(p.grad.norm()) for n, p in plain.named_parameters()}
    return {"got": got, "want": want}


def test_a_custom_function_whose_ctx_has_a_variable_attribute_is_no_leaf() -> None:
    """A custom autograd.Function's node is its ctx; a ``ctx.variable`` tensor was taken for a
    gradient accumulator's (torch.autograd.grad then raised 'One of the differentiated Tensors
    does not require grad')."""
    for got in run_ranks(_grad_norms_worker, 2, "custom function", timeout_s=120):
        assert set(got["got"]) == set(got["want"]) and len(got["want"]) == 4
        for key, value in got["want"].items():
            assert got["got"][key] == pytest.approx(value, rel=1e-12), key


def _train(model: nn.Module, rank: int, steps: int) -> list[list[torch.Tensor]]:
    """DDP's own training steps (SGD with momentum): each step's gradients."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out = []
    for x, y in _batches(rank + 10, steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        out.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return out


def _reentrant_worker(rank: int, world: int) -> dict[str, Any]:
    """gradient_stats on DDP(model with a reentrant checkpoint) for DDP options, then DDP's own
    steps on it and on an untouched twin."""
    out: dict[str, Any] = {}
    cases = {
        "default": ({}, 0),
        "static_graph, before training": ({"static_graph": True}, 0),
        "static_graph, after a step": ({"static_graph": True}, 1),
        "find_unused_parameters": ({"find_unused_parameters": True}, None),
    }
    for name, (options, before) in cases.items():
        model, twin = (DDP(_custom_model("reentrant"), **options) for _ in range(2))
        if before:
            _train(model, rank, before), _train(twin, rank, before)
        data = _batches(rank, 2)
        out[name] = _outcome(lambda m=model, d=data: initlab.gradient_stats(m, d, "cross_entropy"))
        if before is not None:  # DDP trains no reentrant checkpoint with find_unused_parameters
            out[name + ", steps"] = (_train(model, rank, 2), _train(twin, rank, 2))
    return out


def test_a_reentrant_checkpoint_in_a_ddp_model_back_propagates_or_names_the_cause() -> None:
    """torch.autograd.grad refuses a reentrant checkpoint ('When use_reentrant=True,
    torch.utils.checkpoint is incompatible with .grad()'): every pass on such a DDP model raised
    it. It runs loss.backward() (DDP's reducer unarmed) now, except where the reducer counts an
    unarmed backward: there the error names the cause and what to do."""
    for got in run_ranks(_grad_norms_worker, 2, "reentrant", timeout_s=120):
        assert set(got["got"]) == set(got["want"]) and len(got["want"]) == 6
        for key, value in got["want"].items():
            assert got["got"][key] == pytest.approx(value, rel=1e-12), key
    for got in run_ranks(_reentrant_worker, 2, timeout_s=120):
        assert got["default"] == got["static_graph, after a step"] == ("ok", "")
        for name, cause in (
            ("static_graph, before training", "static_graph=True before its first training"),
            ("find_unused_parameters", "find_unused_parameters=True"),
        ):
            kind, message = got[name]
            assert kind == "ValueError" and message.startswith("gradient_stats: "), message
            assert (
                cause in message and "use_reentrant=False" in message and "model.module" in message
            )
        for name in ("default", "static_graph, before training", "static_graph, after a step"):
            mine, twin = got[name + ", steps"]
            assert all(_same(a, b) for a, b in zip(mine, twin, strict=True)), name


def _leaf_cases() -> dict[str, Callable[[], tuple[torch.Tensor, list[torch.Tensor], Any]]]:
    """Graphs whose leaves are no DDP parameter: ``() -> (loss, leaves, read)``, ``read()`` what
    else to compare after the backward."""

    def shared() -> tuple[torch.Tensor, list[torch.Tensor], Any]:
        w1, w2 = (torch.randn(3, 3, dtype=D, requires_grad=True) for _ in range(2))
        v = torch.randn(3, 2, dtype=D)
        return ((w1 + w2) @ v).sum(), [w1, w2], lambda: w1.grad.data_ptr() == w2.grad.data_ptr()

    def held() -> tuple[torch.Tensor, list[torch.Tensor], Any]:
        x = torch.randn(5, 4, dtype=D, requires_grad=True)
        x.grad = torch.ones(5, 4, dtype=D)
        before = x.grad
        return (x.tanh() * 3).sum(), [x], lambda: x.grad is before

    def sparse() -> tuple[torch.Tensor, list[torch.Tensor], Any]:
        w = torch.randn(10, 4, dtype=D, requires_grad=True)
        idx = torch.tensor([[1, 2], [1, 7]])
        return F.embedding(idx, w, sparse=True).square().sum(), [w], lambda: w.grad.layout

    def hooked() -> tuple[torch.Tensor, list[torch.Tensor], Any]:
        x = torch.randn(4, dtype=D, requires_grad=True)
        calls: list[float] = []
        x.register_post_accumulate_grad_hook(lambda t: calls.append(float(t.grad.sum())))
        return (x * torch.arange(4.0, dtype=D)).sum(), [x], lambda: calls

    return {"shared": shared, "held": held, "sparse": sparse, "hooked": hooked}


def _leaves_worker(rank: int, world: int) -> dict[str, Any]:
    """Each case's gradients and ``read()``: torch's loss.backward(), and initlab's backward
    with a DDP bypassed (local_passes)."""
    from initlab._core.distributed import local_backward, local_passes

    out: dict[str, Any] = {}
    for name, build in _leaf_cases().items():
        for how in ("torch", "initlab"):
            torch.manual_seed(0)
            loss, leaves, read = build()
            if how == "torch":
                loss.backward()
            else:
                with local_passes(DDP(_net())):
                    local_backward(loss)
            grads = [g.to_dense() if g.is_sparse else g.clone() for g in (x.grad for x in leaves)]
            out[name, how] = (grads, read())
    return out


def test_initlab_backward_beside_a_ddp_accumulates_gradients_as_torch_does() -> None:
    """Under local_passes, leaves got one gradient tensor for two (w1 + w2), a new ``.grad``
    where torch adds in place, a failed copy for a sparse gradient ('copy_() between dense and
    sparse Tensors'), and no post-accumulate-grad hook call."""
    (got,) = run_ranks(_leaves_worker, 1, timeout_s=120)
    expected = {"shared": False, "held": True, "sparse": torch.sparse_coo}
    for name in ("shared", "held", "sparse", "hooked"):
        (want, want_read), (mine, mine_read) = got[name, "torch"], got[name, "initlab"]
        assert all(torch.equal(a, b) for a, b in zip(want, mine, strict=True)), name
        assert mine_read == want_read, name
        if name in expected:
            assert want_read == expected[name], name
    assert got["hooked", "torch"][1] == [6.0]  # 0 + 1 + 2 + 3, one call
