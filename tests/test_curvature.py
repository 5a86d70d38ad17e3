"""Curvature products, block operators and the block estimator against float64 dense oracles.

The oracles build the full Hessian with ``torch.autograd.functional.hessian`` of a function of the
flat parameter vector, and the Gauss–Newton matrix as ``Jᵀ H_out J`` from an explicit Jacobian and
the loss's Hessian on the outputs, on a deep copy of the model (so even a BatchNorm in train mode
cannot touch the model under test). Nothing here goes through the library's helpers.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import types
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.autograd import Function
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

import initlab
from initlab._core.data import Batches
from initlab._core.loss import Loss, TargetError, criterion, outputs_loss, resolve_loss
from initlab.measure.curvature import (
    BLOCK_COLUMNS,
    BlockOperator,
    CurvatureOperator,
    DoubleBackwardError,
    block_curvature,
    figure2_ratios,
    figure2_summary,
    ggn_vector_product,
    hessian_eigenpairs,
    hessian_vector_product,
    quadratic_loss,
    theory_vs_actual,
)
from initlab.measure.curvature.products import _cuts_second_order

from .conformance_models import CPU_DATA_PARALLEL, KeywordNet
from .half_models import HandNorm, ln_net

DT = torch.float64


# ----------------------------------------------------------------------------- cases as data


def _mlp() -> tuple[nn.Module, tuple, Loss]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT)
    batch = (torch.randn(6, 3, dtype=DT), torch.randint(0, 3, (6,)))
    return net, batch, resolve_loss(F.cross_entropy)


def _cnn() -> tuple[nn.Module, tuple, Loss]:
    torch.manual_seed(1)
    net = nn.Sequential(
        nn.Conv2d(1, 2, 3, stride=2, padding=1, padding_mode="circular"),
        nn.Softplus(),
        nn.Flatten(),
        nn.Linear(2 * 3 * 3, 2),
    ).to(DT)
    batch = (torch.randn(4, 1, 5, 5, dtype=DT), torch.randn(4, 2, dtype=DT))
    return net, batch, criterion(lambda out, y: (out - y).square().mean())


def _bn_train() -> tuple[nn.Module, tuple, Loss]:
    torch.manual_seed(2)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Softplus(), nn.Linear(4, 2)).to(DT)
    net.train()
    batch = (torch.randn(5, 3, dtype=DT), torch.randint(0, 2, (5,)))
    return net, batch, resolve_loss(nn.CrossEntropyLoss())


CASES = {"mlp": _mlp, "cnn": _cnn, "bn_train": _bn_train}


def _flat_fn(model: nn.Module, x: torch.Tensor) -> tuple[Callable, torch.Tensor, list[int]]:
    """``theta -> model_theta(x)`` on a deep copy, and the flat parameter vector."""
    twin = copy.deepcopy(model)
    names = [n for n, _ in twin.named_parameters()]
    shapes = [p.shape for _, p in twin.named_parameters()]
    sizes = [p.numel() for _, p in twin.named_parameters()]
    theta = torch.cat([p.detach().reshape(-1) for _, p in twin.named_parameters()])
    buffers = {n: b.clone() for n, b in twin.named_buffers()}

    def out(flat: torch.Tensor) -> torch.Tensor:
        params, i = {}, 0
        for n, s, k in zip(names, shapes, sizes, strict=True):
            params[n] = flat[i : i + k].reshape(s)
            i += k
        state = {**{n: b.clone() for n, b in buffers.items()}, **params}
        return torch.func.functional_call(twin, state, (x,))

    return out, theta, sizes


def dense_hessian(model: nn.Module, batch: tuple, loss: Loss) -> tuple[torch.Tensor, list]:
    out, theta, sizes = _flat_fn(model, batch[0])
    h = torch.autograd.functional.hessian(
        lambda t: loss.on_outputs(out(t), batch), theta, vectorize=True
    )
    return h, sizes


def dense_ggn(model: nn.Module, batch: tuple, loss: Loss) -> tuple[torch.Tensor, list]:
    out, theta, sizes = _flat_fn(model, batch[0])
    y = out(theta).detach()
    jac = torch.autograd.functional.jacobian(out, theta, vectorize=True).reshape(y.numel(), -1)
    h_out = torch.autograd.functional.hessian(
        lambda o: loss.on_outputs(o.reshape(y.shape), batch), y
    )
    h_out = h_out.reshape(y.numel(), y.numel())
    return jac.T @ h_out @ jac, sizes


ORACLES = {"hessian": dense_hessian, "ggn": dense_ggn}


@functools.cache
def oracle(case: str, kind: str) -> tuple[torch.Tensor, list[int]]:
    """The dense matrix of a (deterministic) case, computed once per test session."""
    model, batch, loss = CASES[case]()
    return ORACLES[kind](model, batch, loss)


def _blocks(mat: torch.Tensor, sizes: list[int]) -> list[list[torch.Tensor]]:
    cuts = torch.tensor([0, *sizes]).cumsum(0).tolist()
    return [
        [mat[cuts[i] : cuts[i + 1], cuts[j] : cuts[j + 1]] for j in range(len(sizes))]
        for i in range(len(sizes))
    ]


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model: nn.Module, before: dict[str, torch.Tensor], modes: list) -> None:
    after = model.state_dict()
    assert set(after) == set(before)
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    assert [m.training for m in model.modules()] == modes
    assert all(p.grad is None for p in model.parameters())


# ------------------------------------------------------------------------ exact products


@pytest.mark.parametrize("mode", ["rev_rev", "fwd_rev"])
@pytest.mark.parametrize("kind", ["hessian", "ggn"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_operator_equals_dense_oracle(case: str, kind: str, mode: str) -> None:
    model, batch, loss = CASES[case]()
    before, modes = _snapshot(model), [m.training for m in model.modules()]
    expected, _ = oracle(case, kind)
    op = CurvatureOperator(model, batch, loss, kind=kind, ad_mode=mode)
    dense = op.to_dense()
    assert dense.dtype == DT and dense.shape == expected.shape
    torch.testing.assert_close(dense, expected, rtol=0, atol=1e-10)
    _assert_unchanged(model, before, modes)


@pytest.mark.parametrize("mode", ["rev_rev", "fwd_rev"])
def test_hessian_and_ggn_vector_product_functions(mode: str) -> None:
    model, batch, loss = _mlp()
    names = [n for n, _ in model.named_parameters()]
    params = {n: p.detach() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(3)
    v = {n: torch.randn(p.shape, generator=gen, dtype=DT) for n, p in params.items()}
    flat_v = torch.cat([v[n].reshape(-1) for n in names])

    def f(p: dict) -> torch.Tensor:
        return loss.on_outputs(torch.func.functional_call(model, p, (batch[0],)), batch)

    hv = hessian_vector_product(f, params, v, ad_mode=mode)
    assert isinstance(hv, dict) and list(hv) == names
    h, _ = dense_hessian(model, batch, loss)
    torch.testing.assert_close(torch.cat([hv[n].reshape(-1) for n in names]), h @ flat_v,
                               rtol=0, atol=1e-10)  # fmt: skip

    gv = ggn_vector_product(
        lambda p: torch.func.functional_call(model, p, (batch[0],)),
        lambda out: loss.on_outputs(out, batch),
        params,
        v,
        ad_mode=mode,
    )
    g, _ = dense_ggn(model, batch, loss)
    torch.testing.assert_close(torch.cat([gv[n].reshape(-1) for n in names]), g @ flat_v,
                               rtol=0, atol=1e-10)  # fmt: skip

    # sequences in, tuples out; a plain tensor works too
    seq = hessian_vector_product(
        lambda ps: f(dict(zip(names, ps, strict=True))), [params[n] for n in names],
        [v[n] for n in names], ad_mode=mode,
    )  # fmt: skip
    assert isinstance(seq, tuple)
    torch.testing.assert_close(seq[0], hv[names[0]], rtol=0, atol=1e-12)
    x = torch.tensor([1.0, 2.0], dtype=DT)
    out = hessian_vector_product(lambda t: (t**3).sum(), x, torch.ones(2, dtype=DT), ad_mode=mode)
    torch.testing.assert_close(out, 6 * x)


def test_product_validation() -> None:
    x = torch.zeros(3, dtype=DT)

    def f(t: torch.Tensor) -> torch.Tensor:
        return t.square().sum()

    with pytest.raises(ValueError, match="shape"):
        hessian_vector_product(f, x, torch.zeros(4, dtype=DT))
    with pytest.raises(TypeError, match="dtype"):
        hessian_vector_product(f, x, torch.zeros(3, dtype=torch.float32))
    with pytest.raises(TypeError, match="structure"):
        hessian_vector_product(f, [x], {"a": x})
    with pytest.raises(ValueError, match="entries"):
        hessian_vector_product(f, {"a": x}, {"b": x})
    with pytest.raises(TypeError, match="floating point"):
        hessian_vector_product(f, torch.zeros(3, dtype=torch.long), torch.zeros(3))
    with pytest.raises(ValueError, match="scalar"):
        hessian_vector_product(lambda t: t * 2, x, x)
    with pytest.raises(ValueError, match="mode"):
        hessian_vector_product(f, x, x, ad_mode="magic")  # type: ignore[arg-type]


def test_block_operator_matmul_transpose_and_names() -> None:
    model, batch, loss = _cnn()
    h, sizes = oracle("cnn", "hessian")
    blocks = _blocks(h, sizes)
    op = CurvatureOperator(model, batch, loss)
    assert [b.name for b in op.blocks] == [n for n, _ in model.named_parameters()]
    blk = op.block("0.weight", 2)
    assert isinstance(blk, BlockOperator) and blk.shape == (sizes[0], sizes[2])
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(sizes[2], generator=gen, dtype=DT)
    torch.testing.assert_close(blk @ v, blocks[0][2] @ v, rtol=0, atol=1e-10)
    m = torch.randn(sizes[2], 3, generator=gen, dtype=DT)
    torch.testing.assert_close(blk @ m, blocks[0][2] @ m, rtol=0, atol=1e-10)
    torch.testing.assert_close(blk.T.to_dense(), blocks[2][0], rtol=0, atol=1e-10)
    flat = torch.randn(op.shape[1], generator=gen, dtype=DT)
    torch.testing.assert_close(op @ flat, h @ flat, rtol=0, atol=1e-10)
    with pytest.raises(KeyError, match="unknown block"):
        op.block("nope", 0)
    with pytest.raises(ValueError, match="length"):
        blk @ torch.zeros(sizes[2] + 1, dtype=DT)


def test_module_grouping_and_relu_hessian_diagonal_equals_ggn() -> None:
    """App. A.1: for a ReLU net (piecewise linear in each layer) the Hessian's diagonal blocks,
    even with weight and bias of a layer grouped, equal the Gauss–Newton blocks; off-diagonal
    blocks do not."""
    torch.manual_seed(4)
    net = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
    net = net.to(DT)
    batch = (torch.randn(7, 3, dtype=DT), torch.randint(0, 2, (7,)))
    h = CurvatureOperator(net, batch, "cross_entropy", group="module")
    g = CurvatureOperator(net, batch, "cross_entropy", kind="ggn", group="module")
    assert [b.name for b in h.blocks] == ["0", "2", "4"]
    for i in range(3):
        torch.testing.assert_close(
            h.block(i, i).to_dense(), g.block(i, i).to_dense(), rtol=0, atol=1e-10
        )
    assert (h.block(0, 1).to_dense() - g.block(0, 1).to_dense()).abs().max() > 1e-6


# ------------------------------------------------------------------- the block estimator


def _exact_values(mat: torch.Tensor, sizes: list[int], normalize: str = "min") -> torch.Tensor:
    blocks = _blocks(mat, sizes)
    n = len(sizes)
    out = torch.zeros(n, n, dtype=DT)
    for i in range(n):
        for j in range(n):
            norm = {
                "min": min(sizes[i], sizes[j]),
                "row": sizes[i],
                "col": sizes[j],
                "geometric": math.sqrt(sizes[i] * sizes[j]),
                "none": 1,
            }[normalize]
            out[i, j] = blocks[i][j].square().sum() / norm
    return out


@pytest.mark.parametrize("kind", ["hessian", "ggn"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_block_estimator_within_five_stderr(case: str, kind: str) -> None:
    model, batch, loss = CASES[case]()
    before, modes = _snapshot(model), [m.training for m in model.modules()]
    mat, sizes = oracle(case, kind)
    exact = _exact_values(mat, sizes)
    rows = block_curvature(model, batch, loss, kind=kind, probes=48, generator=11, full_matrix=True)
    assert rows.columns == list(BLOCK_COLUMNS)
    assert len(rows) == len(sizes) ** 2
    for r in rows:
        e = float(exact[r["row_index"], r["col_index"]])
        assert r["probes"] == 48 and r["nonfinite"] == 0
        assert abs(r["value"] - e) <= 5 * r["stderr"] + 1e-12 * float(exact.max()), r
    torch.testing.assert_close(rows.matrix().diagonal(), torch.tensor(
        [r["value"] for r in rows if r["row_index"] == r["col_index"]], dtype=DT))  # fmt: skip
    _assert_unchanged(model, before, modes)


def test_diagonal_only_normalizations_and_gaussian_probes() -> None:
    model, batch, loss = _cnn()
    mat, sizes = oracle("cnn", "hessian")
    diag = block_curvature(model, batch, loss, probes=8, generator=5)
    assert [(r["row_index"], r["col_index"]) for r in diag] == [(i, i) for i in range(4)]
    assert math.isnan(float(diag.matrix()[0, 1]))
    # The same probes under every normalization: values differ exactly by the normalizer.
    none = block_curvature(model, batch, loss, probes=8, generator=5, full_matrix=True,
                           normalize="none")  # fmt: skip
    for norm in ("row", "col", "geometric", "min"):
        rows = block_curvature(model, batch, loss, probes=8, generator=5, full_matrix=True,
                               normalize=norm)  # fmt: skip
        scale = _exact_values(torch.ones_like(mat), sizes, norm) / _exact_values(
            torch.ones_like(mat), sizes, "none"
        )
        torch.testing.assert_close(rows.matrix(), none.matrix() * scale, rtol=1e-12, atol=0)
    exact = _exact_values(mat, sizes)
    gauss = block_curvature(model, batch, loss, probes=64, generator=6, probe="gaussian")
    for r in gauss:
        e = float(exact[r["row_index"], r["col_index"]])
        assert abs(r["value"] - e) <= 5 * r["stderr"], r


def test_rel_tol_stops_when_reached() -> None:
    model, batch, loss = _mlp()
    rows = block_curvature(model, batch, loss, probes=4, rel_tol=0.2, max_probes=2000,
                           generator=0)  # fmt: skip
    n = rows[0]["probes"]
    assert 4 < n < 2000
    assert all(r["stderr"] <= 0.2 * r["value"] for r in rows)
    capped = block_curvature(model, batch, loss, probes=4, rel_tol=1e-6, max_probes=6,
                             generator=0)  # fmt: skip
    assert capped[0]["probes"] == 6
    assert any("rel_tol" in n for n in capped.notes)


def test_estimator_error_shrinks_like_one_over_sqrt_probes() -> None:
    """Seeded convergence: the RMS error of the mean of ``s`` probes (disjoint groups of one
    seeded run of 2048 probes) against the exact block falls like ``s^(-1/2)``."""
    model, batch, loss = _mlp()
    mat, sizes = oracle("mlp", "hessian")
    exact = float(_exact_values(mat, sizes)[0, 0])
    res = block_curvature(model, batch, loss, params=["0.weight"], probes=2048, generator=7)
    samples = res.samples[:, 0, 0]
    assert samples.shape == (2048,)
    assert res[0]["value"] == pytest.approx(float(samples.mean()), rel=1e-12)
    assert res[0]["stderr"] == pytest.approx(float(samples.std() / math.sqrt(2048)), rel=1e-12)
    counts = [4, 16, 64]
    rms = [float((samples.reshape(-1, s).mean(1) - exact).square().mean().sqrt()) for s in counts]
    x = torch.tensor(counts, dtype=DT).log()
    y = torch.tensor(rms, dtype=DT).log()
    slope = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
    assert -0.65 <= slope <= -0.35, (slope, rms)
    # and the stderr is honest: the RMS error at s probes is about std / sqrt(s)
    for s, r in zip(counts, rms, strict=True):
        assert 0.6 <= r / float(samples.std() / math.sqrt(s)) <= 1.5


# ------------------------------------------------------------------------------ bad input


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(3, 4)
        self.used = nn.Linear(4, 2)
        self.unused = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.body(x))
        return self.used(h), self.unused(h)


def test_parameters_the_loss_ignores_give_zero_blocks_with_note() -> None:
    torch.manual_seed(0)
    net = _TwoHeads().to(DT)
    x = torch.randn(5, 3, dtype=DT)
    rows = block_curvature(net, x, lambda m, b: m(b)[0].square().mean(), probes=4,
                           generator=0, full_matrix=True)  # fmt: skip
    for r in rows:
        touches = "unused" in r["block_row"] or "unused" in r["block_col"]
        assert (r["value"] == 0.0 and r["stderr"] == 0.0) == touches, r
        assert ("does not depend" in r["note"]) == touches
    assert any("unused.weight" in n for n in rows.notes)
    for kind in ("ggn",):
        # the GGN needs a loss on the outputs; it sees the first output (output_tensor)
        first = outputs_loss(lambda out, b: out.square().mean())
        g = block_curvature(net, x, first, kind=kind, probes=2)
        assert all(r["value"] == 0.0 for r in g if "unused" in r["block_row"])


class _OnceSquare(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class _Square(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _OnceSquare.apply(x)


@pytest.mark.parametrize("mode", ["rev_rev", "fwd_rev"])
def test_module_without_double_backward_is_named(mode: str) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), _Square(), nn.Linear(4, 1)).to(DT)
    x = torch.randn(5, 3, dtype=DT)
    with pytest.raises(DoubleBackwardError, match="'1'") as info:
        block_curvature(net, x, lambda m, b: m(b).mean(), probes=2, ad_mode=mode)
    assert info.value.module_name == "1" and info.value.module_type == "_Square"
    assert "Workaround" in str(info.value)


class _Node:
    """A graph node whose children are new objects at every access, as autograd's Python
    wrappers are when nothing else holds them (torch 2.11)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth

    @property
    def next_functions(self) -> tuple[tuple[object, int], ...]:
        child = DelayedError() if self.depth == 1 else _Node(self.depth - 1)
        return ((child, 0),)


class DelayedError:
    """Named as autograd's node that a ``@once_differentiable`` backward attaches."""

    next_functions = ()


def test_the_graph_walk_finds_a_cut_behind_transient_node_objects() -> None:
    # The walk remembered visited nodes by id() alone: a freed node's id, taken by the next
    # node's new object, made the walk skip it (torch 2.11 missed @once_differentiable nodes).
    loss = types.SimpleNamespace(grad_fn=_Node(depth=6))
    assert _cuts_second_order([loss])  # type: ignore[list-item]


def test_forward_mode_gap_in_mse_loss_is_reported() -> None:
    """torch 2.13 cannot take forward-over-reverse through F.mse_loss(reduction="mean")."""
    model, batch, _ = _mlp()
    target = (batch[0], torch.randn(6, 3, dtype=DT))
    with pytest.raises(DoubleBackwardError, match="rev_rev"):
        block_curvature(model, target, "mse", probes=1, ad_mode="fwd_rev")
    rows = block_curvature(model, target, "mse", probes=1, generator=0)  # rev_rev works
    assert all(math.isfinite(r["value"]) for r in rows)


def _bn_net(*extra: nn.Module) -> tuple[nn.Module, tuple]:
    """``Linear → [extra] → BatchNorm1d (train mode) → Tanh → Linear`` and a regression batch."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), *extra, nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2))
    return net.to(DT), (torch.randn(6, 3, dtype=DT), torch.randn(6, 2, dtype=DT))


@pytest.mark.parametrize("loss", [nn.HuberLoss(), nn.MSELoss()], ids=["huber", "mean_mse"])
def test_a_train_mode_batchnorm_is_not_blamed_for_the_forward_mode_gap_of_the_loss(
    loss: nn.Module,
) -> None:
    """The search for the failing module ran the BatchNorm alone under torch.func with its
    ``num_batches_tracked`` captured from outside; its ``add_(1)`` raised "During a grad (vjp,
    jvp, grad, etc) transform ... captured Tensor", which the bare pattern "jvp" read as a
    missing forward derivative: module '1' (BatchNorm1d) was named. The loss is the culprit."""
    net, batch = _bn_net()
    before = copy.deepcopy(net.state_dict())
    CurvatureOperator(net, batch, nn.MSELoss(reduction="sum"), ad_mode="fwd_rev").to_dense()
    where = r"through the loss function or the model's own forward \(no submodule fails alone\)"
    with pytest.raises(DoubleBackwardError, match=where) as info:
        CurvatureOperator(net, batch, loss, ad_mode="fwd_rev").to_dense()
    assert (info.value.module_name, info.value.module_type) == (None, None)
    assert "BatchNorm" not in str(info.value) and "captured" not in str(info.value)
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())


class _NoJvpSquare(Function):
    """``x²`` with a twice-differentiable backward and no forward-mode derivative (no jvp)."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x * x

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:  # type: ignore[override]
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class _NoJvp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NoJvpSquare.apply(x)


class _Counter(nn.Module):
    """Counts its calls in a plain tensor attribute (not a buffer), in place."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return x


@pytest.mark.parametrize(
    ("module", "says"),
    [
        (_NoJvp(), r"implement the jvp function .*ad_mode='rev_rev'"),
        (_Counter(), r"captured Tensor.*no derivative is missing.*register the tensor as a buffer"),
    ],
    ids=["no_jvp", "in_place_on_a_captured_tensor"],
)
def test_a_module_that_fails_forward_over_reverse_is_named_past_a_train_mode_batchnorm(
    module: nn.Module, says: str
) -> None:
    """The search checks the modules last-called first: the train-mode BatchNorm after the
    culprit was named (see above). A module with no forward-mode derivative is named, and so is
    one updating a tensor of its own in place, with what that failure is."""
    net, batch = _bn_net(module)
    with pytest.raises(DoubleBackwardError, match=says) as info:
        CurvatureOperator(net, batch, nn.MSELoss(reduction="sum"), ad_mode="fwd_rev").to_dense()
    assert (info.value.module_name, info.value.module_type) == ("1", type(module).__name__)
    dense = CurvatureOperator(net, batch, nn.MSELoss(reduction="sum")).to_dense()  # rev_rev works
    assert torch.isfinite(dense).all()


def test_fused_attention_needs_no_workaround() -> None:
    """On CPU, nn.MultiheadAttention(need_weights=False) dispatches to the flash kernel, whose
    backward has no derivative; block_curvature selects the math kernel itself (and gives the
    numbers the hand-made workaround gives)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.att = nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.att(x, x, x, need_weights=False)[0]).mean(1)

    torch.manual_seed(0)
    net = Net()
    x = torch.randn(3, 4, 8)

    loss = outputs_loss(lambda out, b: out.square().mean())
    rows = block_curvature(net, x, loss, probes=1, generator=0)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        by_hand = block_curvature(net, x, loss, probes=1, generator=0)
    assert [r["value"] for r in rows] == [r["value"] for r in by_hand]
    assert all(math.isfinite(r["value"]) for r in rows)


class _SqrtAbs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.zeros(2, dtype=DT))
        self.lin = nn.Linear(2, 2).to(DT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.s.abs().sqrt()  # infinite slope at s = 0


def test_nonfinite_products_are_flagged_per_block() -> None:
    torch.manual_seed(0)
    net = _SqrtAbs()
    x = torch.randn(4, 2, dtype=DT)
    rows = block_curvature(net, x, lambda m, b: m(b).square().mean(), probes=3, generator=0)
    by = {r["block_row"]: r for r in rows}
    assert by["s"]["nonfinite"] == 3 and math.isnan(by["s"]["value"])
    assert "non-finite" in by["s"]["note"]
    assert any("NaN" in n for n in rows.notes)


def test_named_losses_are_accepted() -> None:
    from initlab._core.loss import make_loss

    model, batch, loss = _mlp()
    a = block_curvature(model, batch, "cross_entropy", probes=3, generator=0)
    b = block_curvature(model, batch, make_loss("cross_entropy"), probes=3, generator=0)
    c = block_curvature(model, batch, loss, probes=3, generator=0)
    assert [r["value"] for r in a] == [r["value"] for r in b] == [r["value"] for r in c]
    rq = block_curvature(model, batch[0], "random_quadratic", probes=2, generator=0)
    assert all(math.isfinite(r["value"]) and r["value"] > 0 for r in rq)


def test_bad_arguments() -> None:
    model, batch, loss = _mlp()
    with pytest.raises(ValueError, match="kind"):
        block_curvature(model, batch, loss, kind="fisher")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown parameter"):
        block_curvature(model, batch, loss, params=["nope"])
    with pytest.raises(ValueError, match="probe"):
        block_curvature(model, batch, loss, probe="uniform")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_probes"):
        block_curvature(model, batch, loss, probes=8, max_probes=4)
    with pytest.raises(TypeError, match="accepted forms"):
        block_curvature(model, batch, 3, probes=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="forward= applies"):
        block_curvature(model, batch, lambda m, b: m(b[0]).sum(), forward=lambda m, b: m(b[0]))


# ------------------------------------------------------------------------- eigenpairs


def test_hessian_eigenpairs_match_dense_eigh() -> None:
    model, batch, loss = _cnn()
    h, _ = oracle("cnn", "hessian")
    vals, vecs = torch.linalg.eigh(h)
    order = vals.abs().argsort(descending=True)
    lam, u = hessian_eigenpairs(model, batch, loss, k=2, generator=0, iters=h.shape[0])
    torch.testing.assert_close(lam, vals[order[:2]], rtol=1e-8, atol=1e-10)
    for i in range(2):
        flat = torch.cat([t.reshape(-1) for t in u[i].values()])
        assert abs(float(flat @ vecs[:, order[i]])) == pytest.approx(1.0, abs=1e-8)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hessian_eigenpairs_of_a_repeated_eigenvalue(seed: int) -> None:
    """Orthonormal inputs give ``H = (2/4) I``: every start vector's Krylov space is an
    invariant subspace of dimension 1 (it raised "draw another start vector", which cannot help).
    Lanczos goes on from a fresh orthogonal direction; so does a Hessian-direction landscape."""
    net = nn.Linear(4, 1, bias=False)
    batch = (torch.eye(4), torch.randn(4, 1, generator=torch.Generator().manual_seed(seed)))
    lam, u = hessian_eigenpairs(net, batch, "mse", k=2, generator=seed)
    torch.testing.assert_close(lam, torch.full((2,), 0.5, dtype=torch.float64))
    flat = torch.stack([torch.cat([t.reshape(-1) for t in v.values()]) for v in u]).double()
    # float32 vectors of 4 entries: orthonormal to a few float32 units, not float64's
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(
        flat @ flat.T, torch.eye(2, dtype=torch.float64), rtol=0, atol=8 * eps
    )
    land = initlab.loss_landscape(net, batch, "mse", directions="hessian", grid=3, generator=seed)
    assert land.values.shape == (3, 3)


def _multi_output_regression() -> tuple[nn.Module, tuple, torch.Tensor]:
    """``nn.Linear(6, 4, bias=False)`` with the mean MSE: ``H = (2/(B·4)) XᵀX ⊗ I_4``, so every
    eigenvalue is exactly 4-fold (six distinct values); with its dense float64 Hessian."""
    torch.manual_seed(0)
    net = nn.Linear(6, 4, bias=False).to(DT)
    gen = torch.Generator().manual_seed(0)
    batch = (
        torch.randn(20, 6, dtype=DT, generator=gen),
        torch.randn(20, 4, dtype=DT, generator=gen),
    )
    h, _ = dense_hessian(net, batch, resolve_loss(nn.MSELoss()))
    return net, batch, h


def _flat(vec: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in vec.values()]).double()


@pytest.mark.parametrize("which", ["LM", "LA"])
@pytest.mark.parametrize("k", [2, 4, 6])
def test_hessian_eigenpairs_count_a_repeated_eigenvalue_as_often_as_it_repeats(
    k: int, which: str
) -> None:
    """One Krylov space holds one vector per eigenspace: the top-2 of the 4-fold spectrum came
    back as two distinct values, [1.0104, 0.6719] for [1.0104, 1.0104], with residuals ~1e-16 and
    no warning. k=6 crosses two eigenspaces (the largest value four times, the next twice)."""
    net, batch, h = _multi_output_regression()
    spectrum = torch.linalg.eigvalsh(h).flip(0)
    assert spectrum[0] - spectrum[4] > 0.1 and torch.allclose(spectrum[:4], spectrum[0].expand(4))
    exact = spectrum[:k]
    tol = 1e-8
    lam, u = hessian_eigenpairs(net, batch, nn.MSELoss(), k=k, which=which, tol=tol, generator=0)
    torch.testing.assert_close(lam, exact, rtol=tol, atol=0)
    vecs = torch.stack([_flat(v) for v in u], dim=1)
    torch.testing.assert_close(vecs.T @ vecs, torch.eye(k, dtype=DT), rtol=0, atol=1e-12)
    residuals = (h @ vecs - vecs * lam).norm(dim=0) / lam.abs()
    assert residuals.max() <= tol, residuals
    again, _ = hessian_eigenpairs(net, batch, nn.MSELoss(), k=k, which=which, tol=tol, generator=0)
    assert torch.equal(again, lam)  # the restarts draw from the seeded generator too


def test_a_hessian_landscape_moves_along_two_top_eigenvectors_of_a_repeated_eigenvalue() -> None:
    """The note said "Hessian eigenvalues of the directions: 1.01, 0.6719" (λ₁ and λ₅ of the
    4-fold spectrum): both directions belong to λ₁."""
    net, batch, h = _multi_output_regression()
    top = torch.linalg.eigvalsh(h)[-1]
    land = initlab.loss_landscape(
        net, batch, nn.MSELoss(), grid=3, directions="hessian", generator=0
    )
    d = torch.stack([_flat(v) / _flat(v).norm() for v in land.directions], dim=1)
    torch.testing.assert_close(d.T @ d, torch.eye(2, dtype=DT), rtol=0, atol=1e-10)
    torch.testing.assert_close(h @ d, top * d, rtol=0, atol=1e-6 * float(top))
    assert land.notes[0].endswith(f": {float(top):.4g}, {float(top):.4g}"), land.notes


def test_hessian_eigenpairs_that_do_not_converge_in_iters_warn() -> None:
    """Stopped at ``iters`` with residuals above ``tol``, the last Ritz values can skip a true
    eigenvalue (explorer's tanh MLP: the 5th was off by 1.7%): a warning; with enough steps the
    pairs are the dense ones and nothing is said."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 10), nn.Tanh(), nn.Linear(10, 4))
    net = net.double()
    gen = torch.Generator().manual_seed(0)
    batch = (torch.randn(32, 6, dtype=torch.float64, generator=gen), torch.randint(0, 4, (32,)))
    dense = CurvatureOperator(net, batch, "cross_entropy").to_dense()
    exact = sorted(torch.linalg.eigvalsh(dense).tolist(), key=abs, reverse=True)[:3]
    with pytest.warns(UserWarning, match=r"did not converge in 6 steps .* raise iters"):
        hessian_eigenpairs(net, batch, "cross_entropy", k=3, iters=6, tol=1e-10, generator=0)
    lam, _ = hessian_eigenpairs(
        net, batch, "cross_entropy", k=3, iters=dense.shape[0], tol=1e-10, generator=0
    )
    torch.testing.assert_close(lam, torch.tensor(exact, dtype=torch.float64), rtol=1e-7, atol=0)


# ----------------------------------------------------------------- theory vs actual (Fig. 2)


def test_theory_builtin_equals_conditioning_module() -> None:
    pytest.importorskip("initlab.measure.conditioning")
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(64, 5)
    )
    x = torch.randn(16, 3, 8, 8)
    loss = quadratic_loss(torch.randn(16, 5, 5))
    a = theory_vs_actual(net, x, loss, gamma="builtin", probes=2, generator=0)
    b = theory_vs_actual(net, x, loss, gamma="conditioning", probes=2, generator=0)
    assert [r["block"] for r in a] == ["0.weight", "0.bias", "3.weight", "3.bias"]
    for ra, rb in zip(a, b, strict=True):
        assert rb["gamma_source"] == "conditioning"
        assert ra["theory"] == pytest.approx(rb["theory"], rel=1e-6)
        assert ra["actual"] == rb["actual"]


class _FunctionalLN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.layer_norm(self.fc(x), (8,)))


def test_theory_note_names_the_normalization_that_follows() -> None:
    """A layer before a normalization is outside the GR setting; the note names the
    normalization met. A BatchNorm2d was called "a LayerNorm/RMSNorm"."""
    torch.manual_seed(0)
    conv = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
        nn.Linear(75, 4),
    )  # fmt: skip
    mlp = nn.Sequential(nn.Linear(6, 8), nn.GroupNorm(2, 8), nn.Tanh(), nn.Linear(8, 3))
    cases = [
        (conv, torch.randn(6, 2, 5, 5), 4, "0", "BatchNorm2d"),
        (mlp, torch.randn(6, 6), 3, "0", "GroupNorm"),
        (_FunctionalLN(), torch.randn(6, 6), 3, "fc", "layer_norm"),
    ]
    for net, x, classes, layer, norm in cases:
        batch = (x, torch.randint(0, classes, (6,)))
        rows = theory_vs_actual(net, batch, nn.CrossEntropyLoss(), probes=2, generator=0)
        note = rows.filter(block=f"{layer}.weight")[0]["note"]
        assert f"its output is normalized ({norm}) before the next layer" in note
        assert "LayerNorm/RMSNorm" not in note


def test_theory_matches_exact_block_for_last_layer_of_random_loss() -> None:
    """For the last layer with per-example random quadratic losses, the Hessian block is
    Σ_b x_b x_bᵀ ⊗ (R_b + R_bᵀ)/B; Eq. 1 is its expected ‖·‖²/n: check theory ≈ exact within
    the spread of ‖x_b‖⁴ and of ‖R_b + R_bᵀ‖² (a loose factor-2 band, but against the exact
    value, float64)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 4)).to(DT)
    b = 256
    x = torch.randn(b, 20, dtype=DT)
    loss = quadratic_loss(torch.randn(b, 4, 4, dtype=DT))
    rows = theory_vs_actual(net, x, loss, gamma="builtin", probes=32, generator=0)
    h, sizes = dense_hessian(net, (x,), loss)
    exact = _exact_values(h, sizes)
    for r in rows:
        i = ["0.weight", "0.bias", "2.weight", "2.bias"].index(r["block"])
        assert abs(r["actual"] - float(exact[i, i])) <= 5 * r["stderr"]
        if r["layer"] == "2":
            assert 0.5 <= r["theory"] / float(exact[i, i]) <= 2.0, r


def test_figure2_median_ratio_in_band() -> None:
    """Acceptance: median theory/actual over 30 random strided-LeNet setups in [0.5, 2]."""
    rows = figure2_ratios(30, 8, generator=0, probes=1, gamma="builtin")
    assert len(rows) == 30 * 10
    summary = {r["block"]: r for r in figure2_summary(rows)}
    assert 0.5 <= summary["all"]["median"] <= 2.0, summary["all"]
    weights = [r for name, r in summary.items() if name.endswith("weight")]
    assert all(0.25 <= r["median"] <= 4.0 for r in weights), weights


def test_figure2_leaves_the_global_rng_alone() -> None:
    """Its models' default initialization (overwritten by the scheme's draws) used to advance
    torch's global RNG: the user's next draws shifted by calling it."""
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    figure2_ratios(1, 4, generator=0, probes=1, gamma="builtin")
    assert torch.equal(torch.rand(3), expected)


# ----------------------------------------------------- data, loss forms and renamed knobs


def _values(rows) -> list:
    return [(r["block_row"], r["block_col"], r["value"], r["stderr"]) for r in rows]


def test_renamed_keywords_warn_and_agree() -> None:
    model, batch, loss = _mlp()
    new = block_curvature(model, batch, loss, probes=3, generator=0, ad_mode="fwd_rev")
    with pytest.warns(DeprecationWarning) as rec:
        old = block_curvature(model, batch=batch, loss_fn=loss, probes=3, generator=0,
                              mode="fwd_rev")  # fmt: skip
    assert {str(w.message).rsplit(" ", 1)[-1] for w in rec} == {"data=", "ad_mode="}
    assert _values(old) == _values(new)
    lam, _ = hessian_eigenpairs(model, batch, loss, k=1, generator=0, ad_mode="rev_rev")
    with pytest.warns(DeprecationWarning):
        lam_old, _ = hessian_eigenpairs(model, batch=batch, loss_fn=loss, k=1, generator=0,
                                        mode="rev_rev")  # fmt: skip
    assert torch.equal(lam, lam_old)
    x = torch.tensor([1.0, 2.0], dtype=DT)
    hv = hessian_vector_product(lambda t: (t**3).sum(), x, torch.ones(2, dtype=DT))
    with pytest.warns(DeprecationWarning, match="use ad_mode="):
        hv_old = hessian_vector_product(lambda t: (t**3).sum(), x, torch.ones(2, dtype=DT),
                                        mode="rev_rev")  # fmt: skip
    assert torch.equal(hv, hv_old)
    op = CurvatureOperator(model, batch, loss, ad_mode="fwd_rev")
    with pytest.warns(DeprecationWarning, match="ad_mode="):
        op_old = CurvatureOperator(model, batch, loss, mode="fwd_rev")
    assert op.ad_mode == op_old.ad_mode == "fwd_rev"
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    x = torch.randn(8, 4)
    q = quadratic_loss(torch.randn(8, 3, 3))
    t_new = theory_vs_actual(net, x, q, gamma="builtin", probes=2, generator=0, ad_mode="rev_rev")
    with pytest.warns(DeprecationWarning):
        t_old = theory_vs_actual(net, batch=x, loss_fn=q, gamma="builtin", probes=2, generator=0,
                                 mode="rev_rev")  # fmt: skip
    assert [r["theory"] for r in t_new] == [r["theory"] for r in t_old]
    assert [r["actual"] for r in t_new] == [r["actual"] for r in t_old]
    assert (t_new.used.batches, t_new.used.examples) == (1, 8)
    f_new = figure2_ratios(1, 4, generator=0, probes=1, gamma="builtin", ad_mode="rev_rev")
    with pytest.warns(DeprecationWarning, match="ad_mode="):
        f_old = figure2_ratios(1, 4, generator=0, probes=1, gamma="builtin", mode="rev_rev")
    assert [r["ratio"] for r in f_new] == [r["ratio"] for r in f_old]


def _correct(m: nn.Module, b: tuple) -> torch.Tensor:
    return (m(b[0]).argmax(1) == b[1]).sum()


_X = torch.tensor([1.0, 2.0], dtype=DT)
# what a loss returned that is no real floating-point scalar: the message said "f must return a
# real floating-point scalar tensor, got ()" (a shape, the scalar's) for an integer scalar
_NOT_A_LOSS: dict[str, tuple[Callable[[], object], str]] = {
    "block_curvature, an integer scalar": (
        lambda: block_curvature(*_mlp()[:2], lambda m, b: torch.tensor(1), probes=2),
        r"^block_curvature: the loss '<lambda>' returned an integer tensor \(torch.int64\), not a "
        r"floating-point one, so it cannot be differentiated \(a count or an accuracy has no "
        r"gradient\): return a floating-point loss",
    ),
    "block_curvature, a count of correct answers": (
        lambda: block_curvature(*_mlp()[:2], _correct, probes=2),
        r"^block_curvature: the loss '_correct' returned an integer tensor \(torch.int64\)",
    ),
    "CurvatureOperator ggn, a bool on the outputs": (
        lambda: CurvatureOperator(*_mlp()[:2], outputs_loss(lambda o, b: (o > 0).all(), "pos"),
                                  kind="ggn").to_dense(),
        r"^CurvatureOperator: the loss 'pos' returned a bool tensor \(torch.bool\), not a "
        r"floating-point one",
    ),
    "hessian_vector_product, an integer f": (
        lambda: hessian_vector_product(lambda t: (t > 0).sum(), _X, torch.ones(2, dtype=DT)),
        r"^f returned an integer tensor \(torch.int64\)",
    ),
    "hessian_vector_product, a vector f": (
        lambda: hessian_vector_product(lambda t: t**2, _X, torch.ones(2, dtype=DT)),
        r"^f returned a tensor of shape \(2,\), not a scalar: reduce it",
    ),
    "hessian_vector_product, a complex f": (
        lambda: hessian_vector_product(lambda t: (t * 1j).sum(), _X, torch.ones(2, dtype=DT)),
        r"^f returned a complex tensor \(torch.complex128\), not a real one",
    ),
    "ggn_vector_product, a float": (
        lambda: ggn_vector_product(lambda t: t, lambda y: 1.0, _X, torch.ones(2, dtype=DT)),
        r"^loss_fn_on_outputs returned a float, not a tensor",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(_NOT_A_LOSS))
def test_a_loss_that_is_no_real_float_scalar_is_named_by_what_it_is(case: str) -> None:
    call, says = _NOT_A_LOSS[case]
    with pytest.raises(ValueError, match=says):
        call()


@pytest.mark.parametrize("kind", ["hessian", "ggn"])
def test_loss_forms_give_the_same_blocks(kind: str) -> None:
    model, batch, _ = _mlp()
    forms: list = [nn.CrossEntropyLoss(), F.cross_entropy, "cross_entropy"]
    if kind == "hessian":
        forms.append(lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    results = [
        block_curvature(model, batch, form, kind=kind, probes=4, generator=3) for form in forms
    ]
    for res in results[1:]:
        torch.testing.assert_close(
            res.matrix(), results[0].matrix(), rtol=1e-12, atol=0, equal_nan=True
        )
    assert all((r.used.batches, r.used.examples) == (1, 6) for r in results)
    default = block_curvature(model, batch, None, kind=kind, probes=4, generator=3)
    torch.testing.assert_close(default.matrix(), results[0].matrix(), equal_nan=True)


def test_model_batch_loss_hessian_equals_dense_oracle() -> None:
    model, batch, _ = _mlp()
    expected, _ = oracle("mlp", "hessian")
    for ad_mode in ("rev_rev", "fwd_rev"):
        op = CurvatureOperator(
            model, batch, lambda m, b: F.cross_entropy(m(b[0]), b[1]), ad_mode=ad_mode
        )
        torch.testing.assert_close(op.to_dense(), expected, rtol=0, atol=1e-10)


def test_first_batch_of_many_is_used() -> None:
    model, batch, loss = _mlp()
    other = (batch[0].flip(0), batch[1].flip(0)[:6])
    one = block_curvature(model, batch, loss, probes=3, generator=0)
    for data in ([batch, other], iter([batch, other]), Batches([batch, other])):
        many = block_curvature(model, data, loss, probes=3, generator=0)
        assert _values(many) == _values(one)
        assert (many.used.batches, many.used.examples) == (1, 6)
    lam, _ = hessian_eigenpairs(model, [batch, other], loss, k=1, generator=0)
    lam1, _ = hessian_eigenpairs(model, batch, loss, k=1, generator=0)
    assert torch.equal(lam, lam1)


def test_dict_batch_to_keyword_model() -> None:
    model, batch, _ = _mlp()
    kw = KeywordNet(3, 4, 3).to(DT)
    kw.load_state_dict({"body.weight": model[0].weight, "body.bias": model[0].bias,
                        "head.weight": model[2].weight, "head.bias": model[2].bias})  # fmt: skip
    data = {"features": batch[0], "labels": batch[1]}
    ref = block_curvature(model, batch, "cross_entropy", probes=4, generator=1).matrix()
    for form in (None, "model", nn.CrossEntropyLoss(), "cross_entropy",
                 lambda m, b: m(**b)["loss"]):  # fmt: skip
        got = block_curvature(kw, data, form, probes=4, generator=1)
        torch.testing.assert_close(got.matrix(), ref, rtol=1e-10, atol=0, equal_nan=True)
    ggn = block_curvature(kw, data, nn.CrossEntropyLoss(), kind="ggn", probes=4, generator=1)
    ref_ggn = block_curvature(model, batch, "cross_entropy", kind="ggn", probes=4, generator=1)
    torch.testing.assert_close(ggn.matrix(), ref_ggn.matrix(), rtol=1e-10, atol=0, equal_nan=True)


def test_ggn_with_a_loss_that_runs_the_model_says_what_to_pass() -> None:
    model, batch, _ = _mlp()
    for form in (lambda m, b: F.cross_entropy(m(b[0]), b[1]), "model"):
        with pytest.raises(ValueError, match=r"criterion.*named loss.*outputs_loss"):
            block_curvature(model, batch, form, kind="ggn", probes=1)
    with pytest.raises(ValueError, match="outputs_loss"):
        hessian_eigenpairs(model, batch, lambda m, b: m(b[0]).sum(), kind="ggn")


@CPU_DATA_PARALLEL
def test_a_data_parallel_model_is_measured_through_the_module_it_wraps() -> None:
    """torch's stateless API refuses nn.DataParallel ("can't be used with nn.DataParallel
    module"): block_curvature raised it, diagnose(curvature=True) dropped the curvature. On the
    CPU its forward is its module's call: the same blocks, named under "module."."""
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(DT)
    batch = (torch.randn(6, 5, dtype=DT), torch.randint(0, 3, (6,)))
    loss = nn.CrossEntropyLoss()
    want = block_curvature(inner, batch, loss, probes=4, generator=0)
    got = block_curvature(nn.DataParallel(inner), batch, loss, probes=4, generator=0)
    assert [r["block_row"] for r in got] == [f"module.{r['block_row']}" for r in want]
    assert [r["value"] for r in got] == [r["value"] for r in want]


def test_a_compiled_model_in_f_is_answered_with_its_eager_module() -> None:
    """aot_autograd's graph has no double backward; the advice was to replace "the operation"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(5, 3)
    params = dict(model.named_parameters())
    v = {n: torch.ones_like(p) for n, p in params.items()}

    def f(ps: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(compiled, ps, (x,)).square().mean()

    with pytest.raises(DoubleBackwardError, match=r"call the eager module it wraps instead"):
        hessian_vector_product(f, params, v)


def test_theory_vs_actual_names_the_forward_not_an_inner_loss() -> None:
    """A dict batch the model cannot take: "loss_fn '<lambda>': ..." named an inner lambda."""
    net = nn.Sequential(nn.Linear(3, 2))
    batch = {"x": torch.randn(4, 3), "labels": torch.randint(0, 2, (4,))}
    for call in (block_curvature, theory_vs_actual):
        with pytest.raises(TypeError, match=r"^the default forward: a dict batch") as info:
            call(net, batch, nn.CrossEntropyLoss(), probes=2, generator=0)
        assert "<lambda>" not in str(info.value)


@dataclasses.dataclass
class _Record:
    x: torch.Tensor


class _OnRecord(nn.Module):
    """Takes a batch object, as the default forward passes it: model(batch)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, batch: _Record) -> torch.Tensor:
        return self.net(batch.x)


def test_curvature_and_landscapes_run_a_batch_object_as_model_batch() -> None:
    """A dataclass batch: the functional forward called model(batch[0]) ("'_Record' object is not
    subscriptable") where the default forward, and the README, say model(batch)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    x = torch.randn(6, 4)
    wrapped, record = _OnRecord(net), _Record(x)
    for loss in ("random_quadratic", outputs_loss(lambda out, b: out.square().mean())):
        land = initlab.loss_landscape(wrapped, record, loss, grid=2, generator=0)
        ref = initlab.loss_landscape(net, x, loss, grid=2, generator=0)
        assert float(land.center) == pytest.approx(float(ref.center), rel=1e-6)
        got = block_curvature(wrapped, record, loss, probes=4, generator=0).matrix()
        want = block_curvature(net, x, loss, probes=4, generator=0).matrix()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, equal_nan=True)
        assert len(theory_vs_actual(wrapped, record, loss, probes=2, generator=0).to_rows()) > 0
    for call in (initlab.loss_landscape, block_curvature, theory_vs_actual):  # no targets in it
        with pytest.raises(TargetError, match="needs \\(x, y\\) batches"):
            call(wrapped, record, nn.CrossEntropyLoss())


def test_reentrant_activation_checkpointing_is_answered_with_the_way_out() -> None:
    """torch.utils.checkpoint(use_reentrant=True) (Hugging Face's gradient_checkpointing_enable
    with that option) cannot go through autograd.grad: torch's raw RuntimeError came out of
    block_curvature and theory_vs_actual."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.mid, self.b = nn.Linear(5, 8), nn.Linear(8, 8), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # a hidden state in the checkpoint
            h = checkpoint(lambda t: torch.tanh(self.mid(t)), self.a(x), use_reentrant=True)
            return self.b(h)

    torch.manual_seed(0)
    batch = (torch.randn(6, 5), torch.randint(0, 3, (6,)))
    with pytest.raises(DoubleBackwardError, match=r"use_reentrant=False .*gradient_checkpointing"):
        initlab.block_curvature(Checkpointed(), batch, nn.CrossEntropyLoss(), probes=2, generator=0)


# ------------------------------------------------------------- mixed dtypes, sparse gradients


class _MixedHead(nn.Module):
    """A float32 body under a float64 head (the head's input cast up in the forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 5)
        self.head = nn.Linear(5, 3).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)).to(self.head.weight.dtype))


def _mixed() -> tuple[nn.Module, tuple, nn.Module, tuple]:
    """The mixed model with a float32 batch, and its float64 twin with the same batch in float64."""
    torch.manual_seed(0)
    model = _MixedHead()
    batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    return model, batch, copy.deepcopy(model).double(), (batch[0].double(), batch[1])


# float32 parameters and activations against the float64 twin: float32 rounding, not float64's
_F32 = {"rtol": 1e-4, "atol": 1e-6}


@pytest.mark.parametrize("mode", ["rev_rev", "fwd_rev"])
@pytest.mark.parametrize("kind", ["hessian", "ggn"])
def test_a_mixed_dtype_operator_equals_the_float64_oracle(kind: str, mode: str) -> None:
    """A float64 head on a float32 body: probes were drawn in the first parameter's dtype and the
    head's product refused them ("v entry for head.weight is ... float32, expected ... float64")."""
    model, batch, twin, batch64 = _mixed()
    how = {"kind": kind, "ad_mode": mode, "probes": 3, "generator": 0, "full_matrix": True}
    got = block_curvature(model, batch, F.cross_entropy, **how)
    want = block_curvature(twin, batch64, F.cross_entropy, **how)
    torch.testing.assert_close(got.samples, want.samples, **_F32)
    op = CurvatureOperator(model, batch, F.cross_entropy, kind=kind, ad_mode=mode)
    expected, _ = ORACLES[kind](twin, batch64, resolve_loss(F.cross_entropy))
    torch.testing.assert_close(op.to_dense(), expected, **_F32)
    assert op.dtype == torch.float64  # flat vectors in the widest dtype, split per parameter
    assert [t.dtype for t in op.split(torch.zeros(op.shape[1], dtype=torch.float64))] == [
        p.dtype for p in model.parameters()
    ]


def test_a_mixed_dtype_model_gets_theory_and_hessian_directions() -> None:
    """theory_vs_actual and loss_landscape(directions="hessian") on the mixed model agree with its
    float64 twin; each direction is in its parameter's dtype."""
    model, batch, twin, batch64 = _mixed()
    got = theory_vs_actual(model, batch, F.cross_entropy, probes=3, generator=0).to_rows()
    want = theory_vs_actual(twin, batch64, F.cross_entropy, probes=3, generator=0).to_rows()
    torch.testing.assert_close(
        torch.tensor([r["actual"] for r in got], dtype=torch.float64),
        torch.tensor([r["actual"] for r in want], dtype=torch.float64),
        **_F32,
    )
    land = initlab.loss_landscape(
        model, batch, F.cross_entropy, directions="hessian", grid=3, generator=0
    )
    ref = initlab.loss_landscape(
        twin, batch64, F.cross_entropy, directions="hessian", grid=3, generator=0
    )
    torch.testing.assert_close(land.values, ref.values, **_F32)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert {n: t.dtype for n, t in land.directions[0].items()} == dtypes


class _Bag(nn.Module):
    """Embedding (sparse or dense gradient), tanh, linear, mean over the sequence."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 5, sparse=sparse)
        self.out = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(x))).mean(1)


def _bags() -> tuple[nn.Module, nn.Module, tuple]:
    """The sparse-gradient model, its dense twin (same parameters) and a batch with repeats."""
    torch.manual_seed(0)
    sparse, dense = _Bag(True).double(), _Bag(False).double()
    dense.load_state_dict(sparse.state_dict())
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 20, (6, 4), generator=gen)
    return sparse, dense, (x, torch.randint(0, 3, (6,), generator=gen))


# one sum of the same products, summed in the sparse gradient's coalesce order
_SAME = {"rtol": 1e-12, "atol": 1e-15}


@pytest.mark.parametrize(
    ("kind", "mode"), [("hessian", "rev_rev"), ("ggn", "rev_rev"), ("ggn", "fwd_rev")]
)
def test_a_sparse_embedding_has_the_dense_embeddings_curvature(kind: str, mode: str) -> None:
    """nn.Embedding(sparse=True) gives sparse products: block_curvature died in
    linalg_vector_norm (SparseCPU) and Hessian directions in "reshape is not implemented for
    sparse tensors". Densified, every result is the sparse=False model's."""
    sparse, dense, batch = _bags()
    how = {"kind": kind, "ad_mode": mode, "probes": 3, "generator": 0, "full_matrix": True}
    got_rows = block_curvature(sparse, batch, F.cross_entropy, **how)
    want_rows = block_curvature(dense, batch, F.cross_entropy, **how)
    torch.testing.assert_close(got_rows.samples, want_rows.samples, **_SAME)
    got = CurvatureOperator(sparse, batch, F.cross_entropy, kind=kind, ad_mode=mode)
    want = CurvatureOperator(dense, batch, F.cross_entropy, kind=kind, ad_mode=mode)
    torch.testing.assert_close(got.to_dense(), want.to_dense(), **_SAME)


def test_a_sparse_embedding_gets_the_dense_embeddings_hessian_directions() -> None:
    """loss_landscape(directions="hessian") with a sparse-gradient embedding: the dense twin's
    directions and values."""
    sparse, dense, batch = _bags()
    land, ref = (
        initlab.loss_landscape(m, batch, F.cross_entropy, directions="hessian", grid=3, generator=0)
        for m in (sparse, dense)
    )
    torch.testing.assert_close(land.values, ref.values, **_SAME)
    for name, d in ref.directions[0].items():
        torch.testing.assert_close(land.directions[0][name], d, **_SAME)


@pytest.mark.parametrize("mode", ["rev_rev", "fwd_rev"])
def test_buffer_overrides_of_a_train_mode_batchnorm_are_not_written_to(mode: str) -> None:
    """A train-mode BatchNorm updates the running statistics it is given, in place: the caller's
    override tensors moved on every product."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)).train()
    batch = (torch.randn(8, 3), torch.randn(8, 2))
    mean, var = torch.full((4,), 0.5), torch.full((4,), 2.0)
    buffers = {"1.running_mean": mean, "1.running_var": var}
    op = CurvatureOperator(net, batch, nn.MSELoss(reduction="sum"), ad_mode=mode, buffers=buffers)
    dense = op.to_dense()
    assert torch.equal(mean, torch.full((4,), 0.5)) and torch.equal(var, torch.full((4,), 2.0))
    assert torch.equal(op.to_dense(), dense)  # the same operator on every call


@pytest.mark.parametrize("style", ["parametrization", "hook"])
def test_the_hessian_through_weight_norm_is_the_elementary_formula_s(style: str) -> None:
    """torch._weight_norm's native second derivative is wrong (an eigenvalue 0.9053 for 0.9173):
    the functional forward runs it as g * v / ||v||. Oracle: the Hessian of that formula written
    out here, by torch.autograd.functional.hessian."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    if style == "parametrization":
        torch.nn.utils.parametrizations.weight_norm(net[0])
        names = ("0.parametrizations.weight.original0", "0.parametrizations.weight.original1")
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            torch.nn.utils.weight_norm(net[0])
        names = ("0.weight_g", "0.weight_v")
    batch = (torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64))
    params = dict(net.named_parameters())
    order = list(params)
    g_name, v_name = names

    def loss(*flat: torch.Tensor) -> torch.Tensor:
        p = dict(zip(order, flat, strict=True))
        g, v = p[g_name], p[v_name]
        w0 = g * v / torch.linalg.vector_norm(v, dim=1, keepdim=True)
        h = torch.tanh(batch[0] @ w0.T + p["0.bias"])
        out = h @ p["2.weight"].T + p["2.bias"]
        return ((out - batch[1]) ** 2).sum()

    blocks = torch.autograd.functional.hessian(loss, tuple(params[n].detach() for n in order))
    sizes = [params[n].numel() for n in order]
    dense = torch.cat(
        [torch.cat([blocks[i][j].reshape(sizes[i], sizes[j]) for j in range(len(order))], 1)
         for i in range(len(order))]
    )  # fmt: skip
    op = CurvatureOperator(net, batch, nn.MSELoss(reduction="sum"))
    mine = op.to_dense()
    index = {n: k for k, n in enumerate(op.param_names)}
    perm = torch.cat([torch.arange(sum(sizes[:i]), sum(sizes[: i + 1])) for i in
                      sorted(range(len(order)), key=lambda i: index[order[i]])])  # fmt: skip
    torch.testing.assert_close(mine, dense[perm][:, perm], rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------------------------------
# float16: torch's native normalization double backwards overflow float16
# --------------------------------------------------------------------------------------------------


def _ln_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g).half(), torch.randint(0, 4, (8,), generator=g)


def _ln_hessian_by_hand(net: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The float64 Hessian of the cross-entropy of ``net`` (weights as stored), the LayerNorm
    written out."""
    shapes = [p.shape for p in net.parameters()]
    sizes = [p.numel() for p in net.parameters()]

    def loss(v: torch.Tensor) -> torch.Tensor:
        w1, b1, gain, shift, w2, b2 = (
            t.reshape(s) for t, s in zip(v.split(sizes), shapes, strict=True)
        )
        h = x.double() @ w1.T + b1
        c = h - h.mean(-1, keepdim=True)
        h = c / (c.square().mean(-1, keepdim=True) + 1e-5).sqrt() * gain + shift
        out = h.clamp_min(0) @ w2.T + b2
        return -(out - out.exp().sum(-1, keepdim=True).log())[torch.arange(len(y)), y].mean()

    theta = torch.cat([p.detach().double().reshape(-1) for p in net.parameters()])
    return torch.autograd.functional.hessian(loss, theta)


def test_hessian_eigenpairs_of_a_float16_layernorm_model_match_float64() -> None:
    """torch's native layer_norm double backward overflows float16 on the small activations in
    front of a LayerNorm: every Hessian product was NaN, and eigenpairs died in linalg.eigh
    ("failed to converge"). The products run the LayerNorm on float32 statistics now.
    Tolerance: each product is float16 (11 bits, 5e-4 relative per rounding); 5e-3 relative on
    the eigenvalues, 1e-3 on |<u, v>| (seen 2.5e-4 and 3e-5)."""
    net, (x, y) = ln_net(affine_random=True).half(), _ln_batch()
    lam, vec = torch.linalg.eigh(_ln_hessian_by_hand(net, x, y))
    top = lam.abs().argsort(descending=True)[:2]
    assert float(lam[top[0]] - lam[top[1]]) > 0.05 * float(lam[top[0]])  # separated: unique u
    values, vectors = hessian_eigenpairs(net, (x, y), nn.CrossEntropyLoss(), k=2, generator=0)
    torch.testing.assert_close(values, lam[top], rtol=5e-3, atol=0)
    names = [n for n, _ in net.named_parameters()]
    for k, d in zip(top, vectors, strict=True):
        u = torch.cat([d[n].double().reshape(-1) for n in names])
        assert abs(float(u @ vec[:, k]) / float(u.norm())) == pytest.approx(1.0, abs=1e-3)


def test_nonfinite_curvature_products_are_named_with_the_float16_cause() -> None:
    """A normalization written by hand in float16 still overflows: Lanczos fed the NaN products
    to linalg.eigh (a raw _LinAlgError), block_curvature said only "some products held NaN/inf".
    Both name float16 and the float32 copy now."""
    net, batch = ln_net(0.01, HandNorm(), affine_random=True).half(), _ln_batch()
    message = (
        r"hessian_eigenpairs: a Hessian product in the Lanczos iteration holds NaN/inf: the model "
        r"is float16, .* float32 copy"
    )
    with pytest.raises(FloatingPointError, match=message):
        hessian_eigenpairs(net, batch, nn.CrossEntropyLoss(), k=2, generator=0)
    est = block_curvature(net, batch, nn.CrossEntropyLoss(), generator=0)
    assert est.to_rows()[0]["nonfinite"] > 0
    assert any("NaN/inf" in n and "float16" in n and "float32 copy" in n for n in est.notes)


# --------------------------------------------------------------------------------------------------
# float16 underflow: gradients below float16's smallest subnormal (2^-24) are 0
# --------------------------------------------------------------------------------------------------


def _small_gradient_net(first: float = 0.01, rest: float = 0.02) -> nn.Sequential:
    """Linear -> LayerNorm -> Linear -> Tanh -> Linear; the first layer x``first`` (its output
    small, the LayerNorm's rstd ~100, as in front of a LayerNorm at a small init), the last two
    weights x``rest``: under a loss x1e-2 the gradient reaching the LayerNorm is ~1e-8 in float64,
    below float16's smallest subnormal 5.96e-8."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 16), nn.Tanh(),
                        nn.Linear(16, 3))  # fmt: skip
    with torch.no_grad():
        net[0].weight.mul_(first)
        net[0].bias.mul_(first)
        net[2].weight.mul_(rest)
        net[4].weight.mul_(rest)
    return net


def _small_gradient_case(scale: float = 1e-2) -> tuple[tuple[torch.Tensor, torch.Tensor], Callable]:
    g = torch.Generator().manual_seed(0)
    batch = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)

    def loss(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(b[0]), b[1]) * scale

    return batch, loss


def _exact_block(net: nn.Module, name: str, batch: tuple, loss: Callable) -> float:
    """``‖H_ll‖_F² / n_l`` of parameter ``name``, from the dense float64 Hessian."""
    model = copy.deepcopy(net).to(DT)
    params = {n: p.detach() for n, p in model.named_parameters()}
    x = (batch[0].to(DT), batch[1])

    def f(w: torch.Tensor) -> torch.Tensor:
        return loss(lambda inp: torch.func.functional_call(model, {**params, name: w}, (inp,)), x)

    h = torch.autograd.functional.hessian(f, params[name])
    return float(h.pow(2).sum()) / params[name].numel()


def test_float16_curvature_whose_gradients_underflowed_is_flagged_not_confident() -> None:
    """The gradient reaching the LayerNorm is below 2^-24, so it is 0 in float16, and the
    LayerNorm's second-order term (rstd^2 times that gradient) is lost: block_curvature gave
    2.1x the float64 value of a bias block, 4 standard errors off, with no note (a BERT at
    weights x0.01: 6.9x). The blocks are flagged now, with a warning naming float16 and the
    float32 copy; the float32 and bfloat16 copies of the same weights are unchanged, unflagged."""
    net, (batch, loss) = _small_gradient_net(), _small_gradient_case()
    names = ("0.weight", "0.bias", "1.weight", "4.weight")
    exact = {n: _exact_block(net, n, batch, loss) for n in names}
    for dtype in (torch.float32, torch.bfloat16):  # float32's range: no underflow, no note
        rows = block_curvature(net.to(dtype), (batch[0].to(dtype), batch[1]), loss,
                               params=list(names), probes=32, generator=0)  # fmt: skip
        for r in rows:
            assert r["note"] == "", r
            assert abs(r["value"] - exact[r["block_row"]]) < 3 * r["stderr"], (dtype, r)
    with pytest.warns(UserWarning, match=r"block_curvature: 3 block\(s\) of this float16 model"):
        rows = block_curvature(net.half(), (batch[0].half(), batch[1]), loss,
                               params=list(names), probes=32, generator=0)  # fmt: skip
    by = {r["block_row"]: r for r in rows}
    bias = by["0.bias"]
    assert bias["value"] > 1.8 * exact["0.bias"]  # what was reported as confident:
    assert bias["value"] - exact["0.bias"] > 3 * bias["stderr"]  # off by > 3 stderr
    assert by["1.weight"]["value"] == 0.0 < exact["1.weight"]  # every product underflowed
    for name in ("0.weight", "0.bias", "1.weight"):
        note = by[name]["note"]
        assert note.startswith("float16 underflow: with the loss scaled by 256"), note
        assert "5.96e-8" in note and "float32 copy" in note, note
    assert by["4.weight"]["note"] == ""  # its gradient is a float16 number: exact to rounding
    assert abs(by["4.weight"]["value"] - exact["4.weight"]) < 3 * by["4.weight"]["stderr"]
    assert any("float16 underflow" in n and "float32 copy" in n for n in rows.notes)


def test_float16_curvature_of_a_model_in_float16s_range_is_not_flagged() -> None:
    """The same model at its default init and an unscaled loss: float16 products within its
    range, no note, no warning (pytest turns one into an error), the exact values within their
    standard errors."""
    net, (batch, loss) = _small_gradient_net(1.0, 1.0), _small_gradient_case(1.0)
    names = [n for n, _ in net.named_parameters()]
    rows = block_curvature(net.half(), (batch[0].half(), batch[1]), loss, probes=16, generator=0)
    for r in rows:
        assert r["note"] == "", r
        exact = _exact_block(net, r["block_row"], batch, loss)
        assert abs(r["value"] - exact) < 3 * r["stderr"] + 0.01 * exact, r
    assert [r["block_row"] for r in rows] == names


def test_diagnose_curvature_of_a_float16_model_notes_the_underflow() -> None:
    """diagnose(curvature=True) took the underflowed blocks as they came (curv_block 1e-24 -> 0,
    curv_theory_ratio NaN in a float16 BERT); its notes name the blocks and the float32 copy,
    once, without the two warnings of its block_curvature and theory_vs_actual calls."""
    net, (batch, loss) = _small_gradient_net(), _small_gradient_case()
    rep = initlab.diagnose(net.half(), [(batch[0].half(), batch[1])], loss, spectra=False,
                           curvature=True, curvature_options={"probes": 4})  # fmt: skip
    said = [n for n in rep.meta["notes"] if n.startswith("curvature: float16 underflow")]
    assert len(said) == 1 and "0.weight" in said[0] and "float32 copy" in said[0], said
