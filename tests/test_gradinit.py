"""GradInit (Zhu et al. 2021): alpha-gradients against a hand derivation and finite differences,
the step rules, S~, normalization layers, ties, failure, warnings, and DDP on two gloo ranks."""

from __future__ import annotations

import contextlib
import copy
import gc
import itertools
import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from initlab._core.data import Batches
from initlab.methods.gradinit import gradinit_, gradinit_alpha_grad, overlap_batch
from initlab.methods.metainit import metainit_

from .ddp_util import run_ranks
from .half_models import HandNorm, ln_net

D = torch.float64


def _mse(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


# --------------------------------------------------------------------------------------------------
# The 2-layer ReLU net y = W2 relu(W1 x + b1) + b2 with MSE, by hand
# --------------------------------------------------------------------------------------------------


def _hand(w1, b1, w2, b2, x, t):
    """Loss and its gradients for (w1, b1, w2, b2), written out with the chain rule."""
    z = x @ w1.T + b1
    h = z.clamp_min(0)
    y = h @ w2.T + b2
    loss = ((y - t) ** 2).mean()
    dy = 2 * (y - t) / y.numel()
    dz = (dy @ w2) * (z > 0).to(D)
    return loss, (dz.T @ x, dz.sum(0), dy.T @ h, dy.sum(0))


def _two_layer(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2)).to(D)
    with torch.no_grad():  # zero biases: no alpha, but they take the look-ahead step
        net[0].bias.zero_()
        net[2].bias.zero_()
    return net


def _data(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    s = (torch.randn(8, 3, generator=g, dtype=D), torch.randn(8, 2, generator=g, dtype=D))
    s_tilde = (torch.randn(8, 3, generator=g, dtype=D), torch.randn(8, 2, generator=g, dtype=D))
    return s, s_tilde


def _objective(net, alpha, s, s_tilde, eta, sign=False, through_g=True):
    """L(S~; theta_alpha - eta A[g(alpha)]) / eta with g by hand; returns it and the look-ahead."""
    w1, w2 = net[0].weight.detach(), net[2].weight.detach()
    theta = [alpha[0] * w1, net[0].bias.detach(), alpha[1] * w2, net[2].bias.detach()]
    _, g = _hand(*theta, *s)
    step = [x.sign() for x in g] if sign else g
    look = [p - eta * d for p, d in zip(theta, step, strict=True)]
    return _hand(*look, *s_tilde)[0] / eta, look


def test_first_order_alpha_grad_equals_hand_derivation() -> None:
    net, (s, s_tilde), eta = _two_layer(), _data(), 0.3
    alpha = torch.tensor([0.7, 1.3], dtype=D)
    # d/d alpha_i of L(S~; alpha W - eta g) / eta with g held fixed: <dL~/dW'_i, W_i> / eta.
    value, look = _objective(net, alpha, s, s_tilde, eta)
    _, d_look = _hand(*look, *s_tilde)
    expected = torch.stack(
        [(d_look[0] * net[0].weight).sum() / eta, (d_look[2] * net[2].weight).sum() / eta]
    )
    grad, objective = gradinit_alpha_grad(
        net, s, s_tilde, _mse, alpha=alpha, eta=eta, optimizer="sgd", exact=False
    )
    torch.testing.assert_close(grad, expected.detach(), rtol=1e-12, atol=1e-14)
    assert objective == pytest.approx(float(value) * eta, rel=1e-12)


def test_look_ahead_pass_holds_no_copy_of_g() -> None:
    # Memory: during L(S~; theta') there are as many weight-shaped storages as during
    # L(S; theta_alpha) (the parameter, gradinit_'s snapshot, theta' written over theta_alpha):
    # g is freed.
    shape = (37, 23)
    net = nn.Sequential(nn.Linear(23, 37), nn.Tanh(), nn.Linear(37, 3))
    counts: list[int] = []

    def loss_fn(model, batch):
        gc.collect()  # only live tensors (not earlier tests' garbage collected in between)
        tensors = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
        counts.append(len({t.untyped_storage().data_ptr() for t in tensors if t.shape == shape}))
        return F.cross_entropy(model(batch[0]), batch[1])

    gradinit_(net, _class_batches(4, width=23), loss_fn, gamma=math.inf)
    assert len(counts) == 6  # 3 iterations of L(S) then L(S~)
    assert counts[1::2] == counts[0::2], counts


def _central(f, alpha: torch.Tensor, h: float = 1e-6) -> torch.Tensor:
    return torch.stack(
        [(f(alpha + h * e) - f(alpha - h * e)) / (2 * h) for e in torch.eye(len(alpha), dtype=D)]
    )


def test_exact_alpha_grad_matches_finite_differences() -> None:
    net, (s, s_tilde), eta = _two_layer(), _data(), 0.3
    alpha = torch.tensor([0.7, 1.3], dtype=D)
    grad, _ = gradinit_alpha_grad(net, s, s_tilde, _mse, alpha=alpha, eta=eta, exact=True)
    fd = _central(lambda a: _objective(net, a, s, s_tilde, eta)[0], alpha)
    torch.testing.assert_close(grad, fd, rtol=1e-6, atol=1e-8)
    first_order, _ = gradinit_alpha_grad(net, s, s_tilde, _mse, alpha=alpha, eta=eta)
    assert not torch.allclose(grad, first_order)  # the term through g matters

    # The constraint step: d ||g(alpha)||_2 / d alpha.
    grad_c, norm = gradinit_alpha_grad(net, s, None, _mse, alpha=alpha, step="constraint")

    def gnorm(a):
        theta = [a[0] * net[0].weight, net[0].bias, a[1] * net[2].weight, net[2].bias]
        g = _hand(*[p.detach() for p in theta], *s)[1]
        return torch.sqrt(sum((x**2).sum() for x in g))

    torch.testing.assert_close(grad_c, _central(gnorm, alpha), rtol=1e-6, atol=1e-8)
    assert norm == pytest.approx(float(gnorm(alpha)), rel=1e-12)


def test_constraint_gradient_same_whether_or_not_a_constraint_step_was_expected() -> None:
    from initlab.methods._alpha import evaluation_modes as _evaluation_modes
    from initlab.methods._alpha import nonzero as _nonzero
    from initlab.methods._alpha import select_tensors as _select
    from initlab.methods.gradinit import _GradInitStep

    net, (s, _) = _two_layer(), _data()
    ts = _select(net, "default", _nonzero, "test")
    alpha = torch.tensor([0.7, 1.3], dtype=D)
    grads = []
    for last in ("objective", "constraint"):  # recompute L(S) with graph / graph built at once
        run = _GradInitStep(net, _mse, ts, eta=0.1, optimizer="sgd", exact=False, what="test")
        run.last_kind = last
        with _evaluation_modes(net, batch_stats=True):
            res = run(alpha, s, lambda: s, gamma=0.0, iteration=0)
        assert res.kind == "constraint"
        grads.append(res.grad)
    assert torch.equal(grads[0], grads[1])


def test_objective_gradient_same_whether_or_not_a_graph_to_alpha_was_built() -> None:
    from initlab.methods._alpha import evaluation_modes as _evaluation_modes
    from initlab.methods._alpha import nonzero as _nonzero
    from initlab.methods._alpha import select_tensors as _select
    from initlab.methods.gradinit import _GradInitStep

    net, (s, s_tilde) = _two_layer(), _data()
    ts = _select(net, "default", _nonzero, "test")
    alpha = torch.tensor([0.7, 1.3], dtype=D)
    grads = []
    for last in ("objective", "constraint"):  # theta as plain leaves / with its graph to alpha
        run = _GradInitStep(net, _mse, ts, eta=0.1, optimizer="sgd", exact=False, what="test")
        run.last_kind = last
        with _evaluation_modes(net, batch_stats=True):
            res = run(alpha, s, lambda: s_tilde, gamma=math.inf, iteration=0)
        assert res.kind == "objective"
        grads.append(res.grad)
    # the hand derivation (as in test_first_order_alpha_grad_equals_hand_derivation), both paths
    _, look = _objective(net, alpha, s, s_tilde, 0.1)
    _, d_look = _hand(*look, *s_tilde)
    expected = torch.stack([(d_look[i] * net[i].weight).sum() / 0.1 for i in (0, 2)]).detach()
    for grad in grads:
        torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_scaled_leaves_and_params_are_the_correctly_rounded_products(dtype: torch.dtype) -> None:
    from initlab.methods._alpha import nonzero as _nonzero
    from initlab.methods._alpha import scaled_leaves, scaled_params
    from initlab.methods._alpha import select_tensors as _select

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 2, bias=False))
    net[0].to(dtype)  # mixed dtypes: alpha is rounded per tensor dtype
    with torch.no_grad():
        net[1].bias.zero_()  # all zeros: no alpha
    ts = _select(net, "default", _nonzero, "test")
    a = torch.tensor([0.3, 1.7, 0.9, 1.1111111111], dtype=D)
    # oracle: alpha rounded to the tensor's dtype (as fold_alpha multiplies), the product exact in
    # float64 (operands of at most 24 bits) or correctly rounded (float64), rounded once
    expected = [p.detach() for p in ts.tensors]
    for k, i in enumerate(ts.scaled):
        w = expected[i]
        expected[i] = (w.double() * a[k].to(w.dtype).double()).to(w.dtype)
    leaves = scaled_leaves(ts, a)
    ref = scaled_params(ts, a.clone().requires_grad_())
    assert len(ts.scaled) == 4 and len(leaves) == len(ref) == len(expected) == 5
    for x, y, e in zip(leaves, ref, expected, strict=True):
        assert x.is_leaf and x.requires_grad and x.dtype == y.dtype == e.dtype
        assert torch.equal(x, e) and torch.equal(y.detach(), e)


def test_adam_exact_equals_first_order_and_hand_derivation() -> None:
    net, (s, s_tilde), eta = _two_layer(), _data(), 0.05
    alpha = torch.tensor([0.9, 1.2], dtype=D)
    kw = {"alpha": alpha, "eta": eta, "optimizer": "adam"}
    exact, _ = gradinit_alpha_grad(net, s, s_tilde, _mse, exact=True, **kw)
    first, _ = gradinit_alpha_grad(net, s, s_tilde, _mse, exact=False, **kw)
    assert torch.equal(exact, first)  # d sign(g) / d alpha = 0 almost everywhere
    _, look = _objective(net, alpha, s, s_tilde, eta, sign=True)
    _, d_look = _hand(*look, *s_tilde)
    expected = torch.stack(
        [(d_look[0] * net[0].weight).sum() / eta, (d_look[2] * net[2].weight).sum() / eta]
    )
    torch.testing.assert_close(first, expected.detach(), rtol=1e-12, atol=1e-14)
    # ... and matches finite differences of the exact objective (sign(g) is locally constant).
    fd = _central(lambda a: _objective(net, a, s, s_tilde, eta, sign=True)[0], alpha)
    torch.testing.assert_close(first, fd, rtol=1e-6, atol=1e-8)


# --------------------------------------------------------------------------------------------------
# The iteration: step rule, bounds, S~
# --------------------------------------------------------------------------------------------------


def _mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)


def _class_batches(
    n: int, size: int = 16, seed: int = 2, dtype: torch.dtype = torch.float32, width: int = 6
):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, width, generator=g).to(dtype), torch.randint(0, 3, (size,), generator=g))
        for _ in range(n)
    ]


def test_small_gamma_gives_constraint_steps_that_reduce_the_gradient_norm() -> None:
    net = _mlp()
    batch = _class_batches(1)[0]
    report = gradinit_(net, [batch] * 13, gamma=1e-4, lr=0.02)
    trace = report.trace.to_rows()
    assert len(trace) == 12 and {r["step"] for r in trace} == {"constraint"}
    norms = [r["grad_norm"] for r in trace]
    assert all(b < a for a, b in itertools.pairwise(norms))
    assert norms[-1] < 0.8 * norms[0]
    assert report.info["constraint_steps"] == 12 and report.info["objective_steps"] == 0
    # forward, backward with graph, double backward; the first step (no graph expected) has one
    # more forward and backward
    assert (report.forward_passes, report.backward_passes) == (13, 25)


def test_alpha_never_below_alpha_min() -> None:
    net = _mlp()
    report = gradinit_(net, _class_batches(9), gamma=0.0, lr=0.5, alpha_min=0.05)
    trace = report.trace.to_rows()
    assert min(r["alpha_min"] for r in trace) == pytest.approx(0.05)
    assert all(r["alpha_min"] >= 0.05 for r in trace)
    assert all(r["alpha"] >= 0.05 for r in report)
    # large gamma: objective steps only
    report = gradinit_(_mlp(), _class_batches(4), gamma=math.inf)
    assert {r["step"] for r in report.trace} == {"objective"}


def test_overlap_batch_composition() -> None:
    s = (torch.arange(8).float().unsqueeze(1), torch.arange(8))
    nxt = (torch.arange(100, 108).float().unsqueeze(1), torch.arange(100, 108))
    assert overlap_batch(s, nxt, 0.5)[1].tolist() == [0, 1, 2, 3, 100, 101, 102, 103]
    assert overlap_batch(s, nxt, 0.25)[1].tolist() == [0, 1, 100, 101, 102, 103, 104, 105]
    assert overlap_batch(s, nxt, 0.0)[1].tolist() == list(range(100, 108))
    assert overlap_batch(s, nxt, 1.0) is s
    short = (nxt[0][:2], nxt[1][:2])  # a shorter next batch gives what it has
    assert overlap_batch(s, short, 0.5)[1].tolist() == [0, 1, 2, 3, 100, 101]
    # dicts, nested, non-tensor leaves; rows stay aligned across tensors
    d = {"x": s[0], "y": s[1], "meta": "train", "pair": (s[1], s[1] * 2)}
    dn = {"x": nxt[0], "y": nxt[1], "meta": "train", "pair": (nxt[1], nxt[1] * 2)}
    out = overlap_batch(d, dn, 0.5)
    assert out["meta"] == "train" and out["pair"][1].tolist() == [0, 2, 4, 6, 200, 202, 204, 206]
    assert torch.equal(out["x"][:, 0].long(), out["y"])
    # random subsets with a generator: 4 distinct examples of S, 4 of the next batch
    out = overlap_batch(s, nxt, 0.5, generator=torch.Generator().manual_seed(0))[1].tolist()
    assert len(set(out[:4])) == 4 and set(out[:4]) <= set(range(8))
    assert len(set(out[4:])) == 4 and set(out[4:]) <= set(range(100, 108))


class _ObjectBatch:
    """A batch object (a user's class with tensor attributes): one batch everywhere."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, split: str) -> None:
        self.x, self.y, self.split = x, y, split


def test_overlap_batch_of_batch_objects() -> None:
    """S~ of batch objects holds the chosen examples of both (it was S itself, all of it)."""
    s = _ObjectBatch(torch.arange(8).float().unsqueeze(1), torch.arange(8), "train")
    nxt = _ObjectBatch(torch.arange(100, 108).float().unsqueeze(1), torch.arange(100, 108), "x")
    out = overlap_batch(s, nxt, 0.5)
    assert type(out) is _ObjectBatch and out is not s
    assert out.y.tolist() == [0, 1, 2, 3, 100, 101, 102, 103]
    assert torch.equal(out.x[:, 0].long(), out.y) and out.split == "train"
    assert overlap_batch(s, nxt, 0.0).y.tolist() == list(range(100, 108))
    assert s.y.tolist() == list(range(8))  # the batches are left as they were


def test_gradinit_evaluates_s_tilde_from_s_and_the_next_batch() -> None:
    seen = []

    def loss_fn(model, batch):
        seen.append(batch["y"].clone())
        return F.cross_entropy(model(batch["x"]), batch["y"])

    batches = [{"x": x, "y": y} for x, y in _class_batches(4, size=6)]
    report = gradinit_(_mlp(), batches, loss_fn, gamma=math.inf, overlap=0.5)
    assert len(report.trace) == 3  # one pass: T = batches - 1
    assert len(seen) == 6  # S, S~ per objective step
    for t in range(3):
        assert torch.equal(seen[2 * t], batches[t]["y"])
        expected = torch.cat([batches[t]["y"][:3], batches[t + 1]["y"][:3]])
        assert torch.equal(seen[2 * t + 1], expected)


# --------------------------------------------------------------------------------------------------
# Model state: normalization layers, dropout, modes, ties
# --------------------------------------------------------------------------------------------------


class _ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(4 * 16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(torch.relu(self.bn(self.conv(x)))).flatten(1))


def _image_batches(n: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(8, 2, 4, 4, generator=g) * 3 + 1, torch.randint(0, 3, (8,), generator=g))
        for _ in range(n)
    ]


@pytest.mark.parametrize("train", [True, False])
def test_batchnorm_buffers_bit_identical_modes_restored_batch_stats_used(train: bool) -> None:
    torch.manual_seed(0)
    model = _ConvBN().train(train)
    with torch.no_grad():
        model.bn.running_mean.uniform_()
        model.bn.running_var.uniform_(0.5, 2)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    batches = _image_batches(4)
    # loss with batch statistics and dropout off, at the initial weights
    ref = copy.deepcopy(model).eval()
    ref.bn.train()
    with torch.no_grad():
        expected = float(F.cross_entropy(ref(batches[0][0]), batches[0][1]))
    report = gradinit_(model, batches, gamma=1.0)
    for k, v in model.named_buffers():
        assert torch.equal(v, buffers[k]), k
    assert all(m.training == train for m in model.modules())
    assert report.trace[0]["loss"] == pytest.approx(expected, rel=1e-6)
    assert {(r["layer"], r["param"]) for r in report} == {
        ("conv", "weight"),
        ("conv", "bias"),
        ("bn", "weight"),
        ("fc", "weight"),
        ("fc", "bias"),
    }  # bn.bias is zero: no alpha
    # dropout is off: the alpha-gradient is deterministic
    g1, _ = gradinit_alpha_grad(model, batches[0], batches[1])
    g2, _ = gradinit_alpha_grad(model, batches[0], batches[1])
    assert torch.equal(g1, g2)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6, bias=False)
        self.b = nn.Linear(6, 6, bias=False)
        self.b.weight = self.a.weight
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


def test_tied_weights_share_one_alpha_and_stay_tied() -> None:
    torch.manual_seed(0)
    model = _Tied()
    before = model.a.weight.detach().clone()
    report = gradinit_(model, _class_batches(5), gamma=0.0, lr=0.05)
    assert model.b.weight is model.a.weight
    rows = {(r["layer"], r["param"]): r for r in report}
    assert set(rows) == {("a", "weight"), ("head", "weight"), ("head", "bias")}
    alpha = torch.tensor(rows["a", "weight"]["alpha"], dtype=D).to(torch.float32)
    assert float(alpha) != 1.0
    assert torch.equal(model.a.weight.detach(), before * alpha)  # folded exactly once


# --------------------------------------------------------------------------------------------------
# Bad input and failure
# --------------------------------------------------------------------------------------------------


def _snapshot(model: nn.Module):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return state, [m.training for m in model.modules()]


def _assert_unchanged(model: nn.Module, snap) -> None:
    state, modes = snap
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert [m.training for m in model.modules()] == modes
    for m in model.modules():
        assert not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks), m
    assert all(p.grad is None for p in model.parameters())


def test_failure_midway_leaves_the_model_unchanged() -> None:
    torch.manual_seed(0)
    model = _ConvBN().train()
    snap = _snapshot(model)
    calls = 0

    def loss_fn(m, batch):
        nonlocal calls
        calls += 1
        if calls == 5:
            raise RuntimeError("injected")
        return F.cross_entropy(m(batch[0]), batch[1])

    with pytest.raises(RuntimeError, match="injected"):
        gradinit_(model, _image_batches(6), loss_fn, gamma=1.0)
    _assert_unchanged(model, snap)


def test_bad_input_errors() -> None:
    model = _mlp()
    snap = _snapshot(model)
    batches = _class_batches(3)
    with pytest.raises(ValueError, match="needs 6 batches"):
        gradinit_(model, batches, steps=5)
    with pytest.raises(ValueError, match="needs 6 batches"):  # no len(): found out midway
        gradinit_(model, (b for b in batches), steps=5)
    with pytest.raises(FloatingPointError, match="first iteration"):
        gradinit_(model, batches, lambda m, b: F.cross_entropy(m(b[0]), b[1]) * math.inf)
    # one step on one batch: "or lower steps" was no advice; every form ends alike
    for one in (batches[:1], batches[0], Batches(batches[:1])):
        with pytest.raises(ValueError) as info:
            gradinit_(model, one, steps=1)
        text = str(info.value)
        assert "at least 2 batches; the model was left unchanged" in text and "steps" not in text
    with pytest.raises(ValueError, match="optimizer"):
        gradinit_(model, batches, optimizer="rmsprop")
    _assert_unchanged(model, snap)


class _ComplexFirst(nn.Module):
    """A complex Linear, its modulus, a real Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(8, 16, dtype=torch.complex64)
        self.l2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.l1(x.to(torch.complex64)).abs())


@pytest.mark.parametrize("call", ["gradinit_", "exact", "gradinit_alpha_grad"])
def test_a_trainable_complex_parameter_is_refused_by_name(call: str) -> None:
    """torch raised "grad can be implicitly created only for real scalar outputs" from inside
    the alpha-gradient (||g|| of a complex g), after a "Casting complex values" warning."""
    model = _ComplexFirst()
    snap = _snapshot(model)
    batches = [(torch.randn(8, 8), torch.randint(0, 4, (8,))) for _ in range(3)]
    what = "gradinit_alpha_grad" if call == "gradinit_alpha_grad" else "gradinit_"
    with pytest.raises(
        TypeError, match=rf"^{what}: parameter\(s\) l1.weight, l1.bias are complex; "
    ):
        if call == "gradinit_alpha_grad":
            gradinit_alpha_grad(model, batches[0], loss_fn=nn.CrossEntropyLoss())
        else:
            gradinit_(model, batches, nn.CrossEntropyLoss(), exact=call == "exact")
    _assert_unchanged(model, snap)
    # the advice holds: frozen, the complex layer is left alone and the real one is scaled
    model.l1.requires_grad_(False)
    report = gradinit_(model, batches, nn.CrossEntropyLoss(), lr=0.1)
    assert [r["layer"] for r in report] == ["l2", "l2"]
    assert torch.equal(model.l1.weight, snap[0]["l1.weight"])
    assert not torch.equal(model.l2.weight, snap[0]["l2.weight"])


def test_adam_with_gamma_on_the_l2_scale_warns() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)
    )
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(32, 16, generator=g), torch.randint(0, 10, (32,), generator=g))] * 3
    with pytest.warns(UserWarning, match=r"L1 scale .* = \d"):
        gradinit_(copy.deepcopy(net), data, optimizer="adam", gamma=1.0, eta=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gradinit_(copy.deepcopy(net), data, optimizer="adam", gamma=100.0, eta=1e-3)
        gradinit_(copy.deepcopy(net), data, optimizer="sgd", gamma=1.0)


# --------------------------------------------------------------------------------------------------
# DDP: two gloo ranks with different shards end bit-identical, and match one process on the union
# --------------------------------------------------------------------------------------------------

_CONFIGS = {
    "mixed": {"gamma": 0.35, "lr": 0.05, "overlap": 1.0},
    "exact": {"gamma": math.inf, "lr": 0.05, "overlap": 1.0, "exact": True},
    "default": {"gamma": 0.35, "lr": 0.05},
}


def _shards():
    batches = _class_batches(5, size=16, seed=7, dtype=D)
    return [[(x[:8], y[:8]) for x, y in batches], [(x[8:], y[8:]) for x, y in batches]], batches


def _ddp_worker(rank: int, world: int) -> dict:
    shards, _ = _shards()
    out = {}
    for name, cfg in _CONFIGS.items():
        model = _mlp(dtype=D)
        report = gradinit_(model, shards[rank], **cfg)
        out[name] = ([p.detach().clone() for p in model.parameters()], report.trace.to_rows())
    model = _mlp(dtype=D)
    metainit_(model, shards[rank], variant="gradinit", lr=0.05)
    out["metainit"] = ([p.detach().clone() for p in model.parameters()], None)
    return out


def test_ddp_two_ranks_identical_and_equal_to_one_process() -> None:
    r0, r1 = run_ranks(_ddp_worker, 2)
    for name in r0:
        for p0, p1 in zip(r0[name][0], r1[name][0], strict=True):
            assert torch.equal(p0, p1), name
    _, union = _shards()
    for name in ("mixed", "exact"):
        model = _mlp(dtype=D)
        report = gradinit_(model, union, **_CONFIGS[name])
        trace = report.trace.to_rows()
        assert [r["step"] for r in trace] == [r["step"] for r in r0[name][1]], name
        for p, q in zip(model.parameters(), r0[name][0], strict=True):
            torch.testing.assert_close(p.detach(), q, rtol=1e-10, atol=1e-12)
    assert {r["step"] for r in r0["mixed"][1]} == {"constraint", "objective"}


@pytest.mark.parametrize(
    "loss_fn",
    [nn.CrossEntropyLoss(), F.cross_entropy, "cross_entropy", None],
    ids=["module", "functional", "named", "default"],
)
def test_standard_criteria_equal_the_model_batch_loss(loss_fn) -> None:
    batches = _class_batches(4)
    ref = _mlp()
    gradinit_(ref, batches, lambda m, b: F.cross_entropy(m(b[0]), b[1]), steps=2, generator=0)
    model = _mlp()
    report = gradinit_(model, batches, loss_fn, steps=2, generator=0)
    for (k, v), w in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        assert torch.equal(v, w), k
    assert (report.used.batches, report.used.examples) == (3, 48)  # 2 steps + the next S~ batch


def test_iterations_is_the_old_name_of_steps() -> None:
    batches = _class_batches(4)
    new, old = _mlp(), _mlp()
    gradinit_(new, batches, steps=2, generator=0)
    with pytest.warns(DeprecationWarning, match="use steps="):
        gradinit_(old, batches, iterations=2, generator=0)
    assert all(torch.equal(a, b) for a, b in zip(new.parameters(), old.parameters(), strict=True))


# --------------------------------------------------------------------------------------------------
# Convolutions and batch norms with their second derivatives written out (the constraint step)
# --------------------------------------------------------------------------------------------------


def _bn(c: int, dims: int = 2, **kw) -> nn.Module:
    bn = (nn.BatchNorm1d if dims == 1 else nn.BatchNorm2d)(c, **kw)
    with torch.no_grad():  # away from the init's gamma = 1, beta = 0
        bn.weight.uniform_(0.5, 2.0)
        bn.bias.uniform_(-1.0, 1.0)
    return bn


_SECOND_ORDER_CASES = {
    "conv": (lambda: nn.Conv2d(3, 4, 3, padding=1, bias=False), (4, 3, 6, 6)),
    "conv_bias_stride": (lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1), (4, 3, 7, 7)),
    "conv_dilated_groups": (
        lambda: nn.Conv2d(4, 6, 3, padding=2, dilation=2, groups=2),
        (3, 4, 6, 6),
    ),
    "conv1d": (lambda: nn.Conv1d(3, 5, 3), (4, 3, 9)),
    "conv3d": (lambda: nn.Conv3d(2, 3, 2, bias=False), (2, 2, 4, 4, 4)),
    "bn2d": (lambda: _bn(3), (5, 3, 4, 4)),
    "bn1d_2d_input": (lambda: _bn(3, dims=1), (6, 3)),
    "bn_no_running_stats": (lambda: _bn(3, track_running_stats=False), (5, 3, 4, 4)),
    "bn_cumulative": (lambda: _bn(3, momentum=None), (5, 3, 4, 4)),
    "conv_bn_relu_conv": (
        lambda: nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1, bias=False),
            _bn(4),
            nn.ReLU(),
            nn.Conv2d(4, 4, 3, padding=1),
            _bn(4),
        ),
        (4, 3, 5, 5),
    ),
    "bn_bn": (lambda: nn.Sequential(_bn(3), _bn(3)), (5, 3, 4, 4)),
}


def _derivatives(model: nn.Module, x: torch.Tensor, written_out: bool, parts: str):
    """Gradients of ``L = sum(y^3)`` and the gradient of a quadratic in them (float64)."""
    from initlab.methods._second_order import written_out_second_order

    params = list(model.parameters())
    gen = torch.Generator().manual_seed(3)
    v = [torch.randn(p.shape, generator=gen, dtype=D) for p in params]
    x = x.detach().requires_grad_()
    block = written_out_second_order() if written_out else contextlib.nullcontext()
    with block:
        loss = model(x).pow(3).sum()
    g = torch.autograd.grad(loss, [x, *params], create_graph=True)
    phi = torch.zeros((), dtype=D)
    if parts in ("all", "input"):
        phi = phi + g[0].square().sum()
    if parts in ("all", "params"):
        phi = phi + sum(
            (gi * vi).sum() + gi.square().sum() for gi, vi in zip(g[1:], v, strict=True)
        )
    return g, torch.autograd.grad(phi, [x, *params], allow_unused=True)


@pytest.mark.parametrize("parts", ["all", "input", "params"])
@pytest.mark.parametrize("case", list(_SECOND_ORDER_CASES))
def test_written_out_second_derivatives_equal_autograds(case: str, parts: str) -> None:
    """Same first derivatives bit for bit (the same ATen kernels), the same second derivatives to
    float64 rounding (some cotangents of the backward are then None)."""
    factory, shape = _SECOND_ORDER_CASES[case]
    torch.manual_seed(0)
    model = factory().to(D).train()
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=D)
    state = copy.deepcopy(model.state_dict())
    g_ref, h_ref = _derivatives(model, x, False, parts)
    after_ref = copy.deepcopy(model.state_dict())
    model.load_state_dict(state)
    g, h = _derivatives(model, x, True, parts)
    for a, b in zip(g_ref, g, strict=True):
        assert torch.equal(a, b)
    for k, t in model.state_dict().items():  # running statistics updated the same way
        assert torch.equal(t, after_ref[k]), k
    scale = max(float(a.abs().max()) for a in h_ref if a is not None)
    for a, b in zip(h_ref, h, strict=True):  # exact zeros (e.g. d/d beta) come out as rounding
        a = torch.zeros_like(x) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-13 * scale)


def test_written_out_second_order_leaves_other_calls_to_autograd() -> None:
    from initlab.methods._second_order import written_out_second_order

    x = torch.randn(2, 3, 5, 5, dtype=D, requires_grad=True)
    conv_same = nn.Conv2d(3, 3, 3, padding="same").to(D)
    bn_eval = _bn(3).to(D).eval()
    with written_out_second_order():
        y_same, y_eval = conv_same(x), bn_eval(x)
        y_affine_off = F.batch_norm(x, None, None, training=True)
        y_conv = nn.Conv2d(3, 3, 3).to(D)(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y_autocast = nn.Conv2d(3, 3, 3)(x.float())
    assert type(y_same.grad_fn).__name__ == "ConvolutionBackward0"
    assert type(y_eval.grad_fn).__name__ == "NativeBatchNormBackward0"
    assert type(y_affine_off.grad_fn).__name__ == "NativeBatchNormBackward0"
    assert type(y_conv.grad_fn).__name__ == "_ConvBackward"
    assert type(y_autocast.grad_fn).__name__ == "ConvolutionBackward0"
    torch.testing.assert_close(y_same, conv_same(x), rtol=0, atol=0)


def test_written_out_second_order_takes_keyword_arguments() -> None:
    # F.conv1d(x, weight=w, ...) (Mamba's slow path) raised TypeError in the routing, which the
    # data contract then reported as "the model does not take its keys"
    from initlab.methods._second_order import written_out_second_order

    conv, bn = nn.Conv1d(3, 4, 3, padding=1).to(D), _bn(4, dims=1).to(D)
    x = torch.randn(5, 3, 7, generator=torch.Generator().manual_seed(1), dtype=D)

    def by_keyword() -> torch.Tensor:
        y = F.conv1d(input=x, weight=conv.weight, bias=conv.bias, padding=1, groups=1)
        return F.batch_norm(
            input=y, running_mean=None, running_var=None, weight=bn.weight, bias=bn.bias,
            training=True, momentum=0.1, eps=1e-5,
        )  # fmt: skip

    with written_out_second_order():
        y = by_keyword()
    assert type(y.grad_fn).__name__ != "NativeBatchNormBackward0"  # routed, not left to autograd
    assert type(y.grad_fn.next_functions[0][0]).__name__ == "_ConvBackward"
    torch.testing.assert_close(y, by_keyword(), rtol=0, atol=0)


def test_written_out_second_order_refuses_a_third_derivative() -> None:
    from initlab.methods._second_order import written_out_second_order

    conv = nn.Conv2d(2, 2, 3).to(D)
    x = torch.randn(2, 2, 5, 5, dtype=D, requires_grad=True)
    with written_out_second_order():
        loss = conv(x).pow(3).sum()
    (gx,) = torch.autograd.grad(loss, [x], create_graph=True)
    (hx,) = torch.autograd.grad(gx.square().sum(), [x])  # the second derivative: fine
    assert hx.shape == x.shape
    with pytest.raises(RuntimeError, match="cannot be differentiated again"):
        torch.autograd.grad(gx.square().sum(), [x], create_graph=True)


def _count_along(monkeypatch) -> list[int]:
    """Count the weight gradients replaced by their projection (``_second_order._along``)."""
    from initlab.methods import _second_order

    calls = [0]
    along = _second_order._along

    def counted(w: torch.Tensor, inner: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return along(w, inner)

    monkeypatch.setattr(_second_order, "_along", counted)
    return calls


class _SumWeightConv(nn.Module):
    """A convolution whose weight is computed (``W + D``): not a scaled tensor itself."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 3, 3, 3) * 0.3)
        self.delta = nn.Parameter(torch.randn(3, 3, 3, 3) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight + self.delta, padding=1)


class _TiedConvs(nn.Module):
    """One weight used by two convolutions."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.bn = _bn(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.tanh(self.bn(self.conv(x))))


_ALPHA_CASES = {
    **_SECOND_ORDER_CASES,
    "sum_weight": (
        lambda: nn.Sequential(nn.Conv2d(3, 3, 1), nn.Tanh(), _SumWeightConv()),
        (4, 3, 5, 5),
    ),
    "tied": (_TiedConvs, (4, 3, 5, 5)),
}


def _alpha_derivatives(model: nn.Module, x: torch.Tensor, mode: str):
    """``g`` of ``L = sum(y^3)`` at ``theta_k = alpha_k W_k`` and the alpha-gradient of a quadratic
    in ``g`` (float64); ``mode``: autograd's second derivatives, written out, or written out with
    every ``theta_k`` passed as ``scaled``."""
    from torch.func import functional_call

    from initlab.methods._second_order import written_out_second_order

    names, params = zip(*model.named_parameters(), strict=True)
    a = torch.linspace(0.7, 1.3, len(names), dtype=D).requires_grad_()
    theta = [a[k] * p.detach() for k, p in enumerate(params)]
    gen = torch.Generator().manual_seed(3)
    v = [torch.randn(p.shape, generator=gen, dtype=D) for p in params]
    x = x.detach().requires_grad_()
    blocks = {
        "autograd": contextlib.nullcontext,
        "written_out": written_out_second_order,
        "scaled": lambda: written_out_second_order(theta),
    }
    with blocks[mode]():
        loss = functional_call(model, dict(zip(names, theta, strict=True)), (x,)).pow(3).sum()
    g = torch.autograd.grad(loss, [x, *theta], create_graph=True)
    phi = g[0].square().sum() + sum(
        (gi * vi).sum() + gi.square().sum() for gi, vi in zip(g[1:], v, strict=True)
    )
    (grad,) = torch.autograd.grad(phi, [a])
    return g, grad


@pytest.mark.parametrize("case", list(_ALPHA_CASES))
def test_scaled_weights_alpha_grads_equal_autograds(monkeypatch, case: str) -> None:
    """With the scaled tensors passed to written_out_second_order, the last backward gives a
    convolution weight only its projection (the weight-gradient kernels skipped): the gradient of
    the alphas stays autograd's to float64 rounding, also where a weight is computed from the
    scaled tensors (a sum: not projected) or shared by two convolutions."""
    factory, shape = _ALPHA_CASES[case]
    torch.manual_seed(0)
    model = factory().to(D).train()
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=D)
    state = copy.deepcopy(model.state_dict())
    g_ref, ref = _alpha_derivatives(model, x, "autograd")
    along = _count_along(monkeypatch)
    for mode in ("written_out", "scaled"):
        model.load_state_dict(state)
        g, grad = _alpha_derivatives(model, x, mode)
        for a, b in zip(g_ref, g, strict=True):  # g itself: the same kernels
            assert torch.equal(a, b)
        torch.testing.assert_close(grad, ref, rtol=1e-12, atol=1e-13 * float(ref.abs().max()))
    convs = sum(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    assert (along[0] > 0) == (convs > 0)  # the projection was taken wherever there is a conv


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False),
        _bn(4),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, stride=2, padding=1),
        _bn(6),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, 3),
    ).to(D)


@pytest.mark.parametrize("step", ["constraint", "exact"])
def test_alpha_grads_through_written_out_second_order_equal_autograds(monkeypatch, step) -> None:
    """The constraint step's (and the exact objective's) alpha-gradient on a CNN with batch norm:
    the same with autograd's own double backward of convolutions and batch norms."""
    import initlab.methods.gradinit as gradinit_module

    g = torch.Generator().manual_seed(2)
    s = (torch.randn(6, 3, 6, 6, generator=g, dtype=D), torch.randint(0, 3, (6,), generator=g))
    alpha = torch.linspace(0.6, 1.4, 9, dtype=D)  # 2 conv weights + a bias, 2 BN x 2, fc x 2
    kw = {"step": "constraint"} if step == "constraint" else {"exact": True}
    model = _cnn()
    along = _count_along(monkeypatch)
    grad, value = gradinit_alpha_grad(model, s, alpha=alpha, **kw)
    # the second conv's two weight gradients of the last backward (the first conv has no g_x)
    assert along == [2]
    monkeypatch.setattr(gradinit_module, "written_out_second_order", contextlib.nullcontext)
    ref, ref_value = gradinit_alpha_grad(model, s, alpha=alpha, **kw)
    assert value == ref_value  # forward and first backward: the same kernels
    torch.testing.assert_close(grad, ref, rtol=1e-10, atol=1e-12)


class _SharedAndTied(nn.Module):
    """A block called twice (one module, one parameter entry) and a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(7, 4)
        self.block = nn.Linear(4, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight
        self.fail = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("planted failure")
        h = torch.tanh(self.block(torch.tanh(self.block(self.emb(ids))))).mean(1)
        return self.head(h)


def test_loss_at_swaps_entries_as_functional_call_does_and_puts_them_back() -> None:
    """The direct swap of :class:`AtParams` (``slots``) gives torch.func.functional_call's loss and
    gradients (the oracle) on shared modules and tied weights, and leaves the same Parameter
    objects in place, also when the forward raises."""
    from torch.func import functional_call

    from initlab.methods._alpha import loss_at, nonzero, scaled_leaves, select_tensors

    model = _SharedAndTied().double()
    ts = select_tensors(model, "default", nonzero, "test")
    assert [len(s) for s in ts.slots] == [2 if n == "emb.weight" else 1 for n in ts.names]
    before = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    ids = torch.randint(0, 7, (5, 3), generator=torch.Generator().manual_seed(1))
    batch = (ids, torch.randint(0, 7, (5,), generator=torch.Generator().manual_seed(2)))
    alpha = torch.tensor([0.5, 2.0, 1.5][: len(ts.scaled)], dtype=D)

    def loss_fn(m: nn.Module, b: tuple) -> torch.Tensor:
        return F.cross_entropy(m(b[0]), b[1])

    theta = scaled_leaves(ts, alpha)
    got = loss_at(model, loss_fn, ts, theta, batch)
    got_grads = torch.autograd.grad(got, theta)
    oracle_theta = [t.detach().clone().requires_grad_() for t in theta]
    tensors = dict(zip(ts.names, oracle_theta, strict=True))
    want = F.cross_entropy(functional_call(model, tensors, (ids,)), batch[1])
    want_grads = torch.autograd.grad(want, oracle_theta)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads, strict=True))
    model.fail = True
    with pytest.raises(RuntimeError, match="planted failure"):
        loss_at(model, loss_fn, ts, theta, batch)
    after = dict(model.named_parameters(remove_duplicate=False))
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    assert model.head.weight is model.emb.weight


def test_alpha_is_folded_in_float32_and_a_scale_the_dtype_cannot_hold_is_warned() -> None:
    """A bfloat16 model: alpha was rounded to bfloat16 before the product (1.0027 -> 1.0, the
    weight unchanged while the row said 1.0027), without a word. Each entry is now the product
    in float32 rounded once, and a tensor whose norm moved by another factor is named."""
    from initlab.methods._alpha import fold_alpha, select_tensors

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(3)))
    model = model.to(torch.bfloat16)
    ts = select_tensors(model, "default", lambda name, p, role: role == "weight", "gradinit_")
    before = [ts.tensors[i].detach().clone() for i in ts.scaled]
    # 1.25 is exact in bfloat16, 1.005 was 1.0078 there, 1.0012 is below every entry's spacing
    alpha = torch.tensor([1.25, 1.005, 1.0012], dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"gradinit_: 1 of 3 tensor\(s\) could not take their "
                      r"scale in their dtype .*2\.weight: alpha 1\.0012, applied 1 "):  # fmt: skip
        fold_alpha(ts, alpha, "gradinit_")
    for k, i in enumerate(ts.scaled):
        expected = (before[k].double() * float(alpha[k])).to(torch.bfloat16)
        assert torch.equal(ts.tensors[i], expected)


def _half_warned(dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """``pytest.warns`` the half-precision warning of gradinit_ for a float16/bfloat16 model:
    its Adam steps follow signs the rounding flips (a float32 copy advised); else nothing."""
    if dtype in (torch.float16, torch.bfloat16):
        said = r"gradinit_: the model's weights are .*float32 copy \(m32 = copy\.deepcopy"
        return pytest.warns(UserWarning, match=said)
    return contextlib.nullcontext()


def test_a_float16_model_with_a_large_gradient_takes_its_constraint_steps() -> None:
    """||g||^2 overflowed float16 (861^2 > 65504): the constraint's alpha-gradient was zero, the
    alphas stayed 1 while the trace listed three constraint steps. The norm is formed in float32
    now: float16 follows float32's alphas."""

    def run(dtype: torch.dtype) -> list[float]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                              nn.Linear(16, 3)).to(dtype)  # fmt: skip
        gen = torch.Generator().manual_seed(2)
        data = [
            (
                torch.randn(16, 6, generator=gen).to(dtype) * 3000,
                torch.randint(0, 3, (16,), generator=gen),
            )
            for _ in range(4)
        ]
        with _half_warned(dtype):
            report = gradinit_(model, data, steps=3, lr=0.05)
        assert [t["step"] for t in report.trace] == ["constraint"] * 3
        return [r["alpha"] for r in report]

    wide, half = run(torch.float32), run(torch.float16)
    assert any(abs(a - 1.0) > 0.1 for a in half)
    assert half == pytest.approx(wide, abs=0.02)


def _ln_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def _ln_alpha_grad_by_hand(net: nn.Sequential, batch, step: str, eta: float) -> torch.Tensor:
    """The alpha-gradient of ||g||_2 (constraint) or of L(theta - eta g) / eta (exact objective)
    in float64, with the LayerNorm and the cross-entropy written out."""
    x, y = batch[0].double(), batch[1]
    ws = [p.detach().double() for p in net.parameters()]
    scaled = [i for i, w in enumerate(ws) if bool(w.ne(0).any())]
    a = torch.ones(len(scaled), dtype=D, requires_grad=True)
    theta = [w.requires_grad_() for w in ws]
    for k, i in enumerate(scaled):
        theta[i] = a[k] * ws[i]

    def loss(t: list[torch.Tensor]) -> torch.Tensor:
        w1, b1, gain, shift, w2, b2 = t
        h = x @ w1.T + b1
        c = h - h.mean(-1, keepdim=True)
        h = c / (c.square().mean(-1, keepdim=True) + 1e-5).sqrt() * gain + shift
        out = h.clamp_min(0) @ w2.T + b2
        return -(out - out.exp().sum(-1, keepdim=True).log())[torch.arange(len(y)), y].mean()

    g = torch.autograd.grad(loss(theta), theta, create_graph=True)
    if step == "constraint":
        objective = torch.sqrt(sum(gi.square().sum() for gi in g))
    else:
        objective = loss([t - eta * gi for t, gi in zip(theta, g, strict=True)]) / eta
    return torch.autograd.grad(objective, a)[0]


@pytest.mark.parametrize("step", ["constraint", "objective"])
def test_a_float16_layernorm_model_gets_its_second_order_alpha_gradient(step: str) -> None:
    """torch's native layer_norm double backward works in float16 and overflows on the small
    activations in front of a LayerNorm: every constraint step's (and exact objective's)
    alpha-gradient was NaN, so gradinit_ failed on every float16 transformer. Those passes run the
    LayerNorm on float32 statistics now. Tolerance: float16 keeps 11 bits (2^-11 ~ 5e-4 relative
    per rounding) and the result is a float16 gradient; 1e-2 relative is ~20 roundings."""
    net, batch = ln_net(affine_random=True).half(), _ln_batch()
    half_batch = (batch[0].half(), batch[1])
    grad, _ = gradinit_alpha_grad(net, half_batch, None, nn.CrossEntropyLoss(), step=step,
                                  exact=True, eta=0.1)  # fmt: skip
    expected = _ln_alpha_grad_by_hand(net, batch, step, 0.1)
    assert bool(torch.isfinite(grad).all())
    torch.testing.assert_close(grad, expected, rtol=1e-2, atol=1e-3 * float(expected.abs().max()))


@pytest.mark.parametrize("kw", [
    {"gamma": 1e-4, "lr": 2e-3, "clip": None},  # constraint steps (SGD on ||g||)
    {"gamma": 1e6, "lr": 0.05, "clip": None, "exact": True},  # exact objective steps
])  # fmt: skip
def test_gradinit_on_a_float16_layernorm_model_follows_float32(kw: dict) -> None:
    """The same weights in float16 and float32: the same alphas, to 2% of their change (each step
    moves alpha by lr times an alpha-gradient exact to float16's 11 bits; the exact objective also
    rounds the look-ahead weights theta - eta g to float16)."""
    net, batch = ln_net(affine_random=True), _ln_batch()
    gen = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 8, generator=gen), batch[1]) for _ in range(4)]

    def run(dtype: torch.dtype) -> list[float]:
        model = copy.deepcopy(net).to(dtype)
        batches = [(x.to(dtype), y) for x, y in data]
        with _half_warned(dtype):
            report = gradinit_(model, batches, nn.CrossEntropyLoss(), steps=3, generator=0, **kw)
        want = "objective" if kw.get("exact") else "constraint"
        assert [t["step"] for t in report.trace] == [want] * 3
        return [r["alpha"] for r in report]

    wide, half = run(torch.float32), run(torch.float16)
    change = max(abs(a - 1.0) for a in wide)
    assert change > 5e-3
    assert half == pytest.approx(wide, abs=0.02 * change)


@pytest.mark.parametrize("steps", [1, 2])
def test_a_nonfinite_alpha_gradient_is_named_with_the_float16_cause(steps: int) -> None:
    """A float16 normalization written by hand still overflows in its double backward: that was
    reported as non-finite scales with "lower lr (or alpha_min)" (lr=1e-8 failed the same) or,
    one iteration on, as "the loss is nan". Now the alpha-gradient is named, with float16 and
    the float32 copy to use."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), HandNorm(), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        net[0].weight.mul_(0.01)
        net[0].bias.zero_()
    net = net.half()
    before = copy.deepcopy(net.state_dict())
    x, y = _ln_batch()
    data = [(x.half(), y)] * 4
    with _half_warned(torch.float16), pytest.raises(FloatingPointError) as info:
        gradinit_(net, data, nn.CrossEntropyLoss(), steps=steps, gamma=1e-4, lr=1e-8)
    message = str(info.value)
    assert re.search(
        r"gradinit_: the alpha-gradient of the constraint step's \|\|g\|\| .* not finite for 1 "
        r"tensor\(s\) \(0\.weight\) at the first iteration",
        message,
    )
    assert "float16" in message and "float32 copy" in message
    assert "bfloat16" not in message  # its alphas land far from float32's too: not advised
    assert "lower lr" not in message and "loss is nan" not in message
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())


class _Temperature(nn.Module):
    """Logits divided by a learned temperature kept as its log (CLIP's ``logit_scale``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(10, 16), nn.Linear(16, 4)
        self.log_t = nn.Parameter(torch.tensor(2.0))
        self.A_log = nn.Parameter(torch.full((16,), -1.0))  # a decay kept as its log (Mamba)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x)) * self.A_log.exp()
        return self.fc2(h) * self.log_t.exp()


@pytest.mark.parametrize("method", ["gradinit", "metainit"])
def test_a_lone_scalar_or_a_log_no_layer_claims_gets_no_scale_by_default(method: str) -> None:
    """``alpha * log t`` raises the temperature to the power ``alpha`` (CLIP's contrastive logits
    moved 14x; Mamba's ``A_log`` 1.13x after 20 steps): the layers' tensors are scaled, those are
    left and named in the report; a filter that asks for them still scales them."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 10, generator=g), torch.randint(0, 4, (16,), generator=g))
            for _ in range(4)]  # fmt: skip

    def run(model: nn.Module, **kwargs: object):  # type: ignore[no-untyped-def]
        if method == "gradinit":
            return gradinit_(model, data, steps=3, lr=0.1, **kwargs)
        return metainit_(model, data, steps=3, variant="gradinit", **kwargs)

    model = _Temperature()
    report = run(model)
    assert float(model.log_t.detach()) == 2.0 and bool((model.A_log == -1).all())
    assert report.info["not_scaled"] == ["log_t", "A_log"]
    assert {r["layer"] for r in report.to_rows()} == {"fc1", "fc2"}
    model = _Temperature()
    report = run(model, params=lambda name, t, role: True)
    assert {"log_t", "A_log"} <= {r["layer"] or r["param"] for r in report.to_rows()}
    assert report.info["not_scaled"] == []


@pytest.mark.parametrize("method", ["gradinit", "metainit"])
def test_a_hugging_face_cache_is_off_while_the_gradients_run(method: str) -> None:
    """In eval mode (dropout off) RWKV keeps its recurrent state as a cache, written in place:
    the backward raised "modified by an inplace operation". The cache is off during the call
    and ``config.use_cache`` is as before after it."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tf.RwkvForCausalLM(tf.RwkvConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=2, attention_hidden_size=16,
        intermediate_size=32, context_length=16))  # fmt: skip
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": (ids := torch.randint(0, 32, (2, 6), generator=g)), "labels": ids}
            for _ in range(3)]  # fmt: skip
    run = gradinit_ if method == "gradinit" else metainit_
    report = run(model, data, steps=2, generator=0)
    assert len(report.trace) == 2 and model.config.use_cache is True


def _absurd_setup() -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in "ab"]
    return model, data


@pytest.mark.parametrize(
    ("method", "options", "error", "text"),
    [
        ("gradinit_", {"lr": math.inf}, ValueError, "lr must be a finite number > 0.0, got inf"),
        ("gradinit_", {"alpha_min": math.inf}, ValueError, "alpha_min must be a finite number"),
        ("metainit_", {"lr": math.inf}, ValueError, "lr must be a finite number > 0.0, got inf"),
        ("metainit_", {"alpha_min": math.inf}, ValueError, "alpha_min must be a finite number"),
        # finite in float64, past float32 once folded in: the last step's scales were not checked
        ("gradinit_", {"lr": 1e40}, FloatingPointError, "overflowed their dtype"),
        ("gradinit_", {"alpha_min": 1e39}, FloatingPointError, "overflowed their dtype"),
    ],
)
def test_an_absurd_rate_or_floor_is_refused_and_the_model_left_unchanged(
    method: str, options: dict[str, float], error: type[Exception], text: str
) -> None:
    """inf was accepted, and the last step's scales were folded in unchecked: inf weights."""
    model, data = _absurd_setup()
    before = copy.deepcopy(model.state_dict())
    extra = {"gamma": 10.0} if method == "gradinit_" else {"variant": "gradinit"}
    with pytest.raises(error, match=re.escape(text)):
        run = {"gradinit_": gradinit_, "metainit_": metainit_}[method]
        run(model, data, nn.CrossEntropyLoss(), steps=1, **extra, **options)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


class _WeightNormed(nn.Module):
    """A layer computing its weight with torch._weight_norm in its own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
        self.g = nn.Parameter(torch.rand(4, 1, dtype=torch.float64) + 0.5)
        self.head = nn.Linear(4, 2, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(x @ torch._weight_norm(self.v, self.g, 0).t()))


def test_the_constraint_gradient_through_weight_norm_is_the_finite_difference_one() -> None:
    """The constraint step differentiates ||g||: a second derivative, which torch._weight_norm's
    native kernel gets wrong. Oracle: central differences of ||g|| in the scales."""
    torch.manual_seed(0)
    model = _WeightNormed()
    batch = (torch.randn(8, 3, dtype=torch.float64), torch.randint(0, 2, (8,)))
    grad, _ = gradinit_alpha_grad(model, batch, step="constraint")

    def norm_at(alpha: torch.Tensor) -> float:
        return gradinit_alpha_grad(model, batch, step="constraint", alpha=alpha)[1]

    h = 1e-6
    for k in range(grad.numel()):
        e = torch.zeros(grad.numel(), dtype=torch.float64)
        e[k] = h
        fd = (norm_at(1 + e) - norm_at(1 - e)) / (2 * h)
        assert float(grad[k]) == pytest.approx(fd, rel=1e-5, abs=1e-8), k
