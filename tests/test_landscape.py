"""Loss landscapes against a slow path that writes the parameters of a deep copy, in float64."""

from __future__ import annotations

import copy
import math
import re
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import initlab
from initlab._core.loss import TargetError
from initlab.measure.curvature import CurvatureOperator, hessian_eigenpairs
from initlab.measure.landscape import (
    LANDSCAPE_COLUMNS,
    Landscape,
    filter_normalized_direction,
    loss_landscape,
)
from initlab.zoo import create_model

from .conformance_models import CPU_DATA_PARALLEL
from .half_models import HandNorm, ln_net

DT = torch.float64
GRID = ([-1.0, -0.25, 0.5], [-0.5, 0.0, 0.75, 1.0])


def _bn_net() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.BatchNorm2d(3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(3 * 4 * 4, 6),
        nn.BatchNorm1d(6),
        nn.Tanh(),
        nn.Linear(6, 3),
    ).to(DT)
    # non-trivial running statistics and affine parameters
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    net.train()
    batch = (torch.randn(8, 2, 4, 4, dtype=DT), torch.randint(0, 3, (8,)))
    return net, batch


def _loss(out: torch.Tensor, batch: tuple) -> torch.Tensor:
    return F.cross_entropy(out, batch[1])


LOSS = nn.CrossEntropyLoss()  # the criterion form of _loss


def _slow(
    model: nn.Module, batches: list, d1: dict, d2: dict, t1: list, t2: list, bn: str
) -> torch.Tensor:
    """Write θ + a d1 + b d2 into a deep copy, point by point, and evaluate it."""
    twin = copy.deepcopy(model)
    bns = [m for m in twin.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    theta = {n: p.detach().clone() for n, p in twin.named_parameters()}
    stats: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    if bn == "fixed":  # batch statistics at θ, read back from running stats with momentum 1
        for batch in batches:
            probe = copy.deepcopy(twin).train()
            counts: dict[nn.Module, int] = {}
            for m in probe.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.momentum = 1.0
                    m.register_forward_pre_hook(
                        lambda mod, args, counts=counts: counts.__setitem__(
                            mod, args[0].numel() // args[0].shape[1]
                        )
                    )
            with torch.no_grad():
                probe(batch[0])
            per = []
            for m in probe.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    n = counts[m]  # running_var is unbiased; normalization uses the biased one
                    per.append((m.running_mean.clone(), m.running_var * (n - 1) / n))
            stats.append(per)
    sizes = [b[0].shape[0] for b in batches]
    out = torch.empty(len(t1), len(t2), dtype=DT)
    for i, a in enumerate(t1):
        for j, b in enumerate(t2):
            with torch.no_grad():
                for n, p in twin.named_parameters():
                    p.copy_(theta[n] + a * d1[n] + b * d2[n])
            total = 0.0
            for k, batch in enumerate(batches):
                twin.eval()
                if bn == "batch":
                    for m in bns:
                        m.train()
                if bn == "fixed":
                    for m, (mean, var) in zip(bns, stats[k], strict=True):
                        m.running_mean.copy_(mean)
                        m.running_var.copy_(var)
                with torch.no_grad():
                    total += sizes[k] / sum(sizes) * float(_loss(twin(batch[0]), batch))
            out[i, j] = total
    return out


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("bn", ["eval", "batch", "fixed"])
def test_grid_equals_slow_mutating_loop_and_model_untouched(bn: str, batched: bool) -> None:
    net, batch = _bn_net()
    before = _state(net)
    modes = [m.training for m in net.modules()]
    land = loss_landscape(net, batch, LOSS, grid=GRID, bn=bn, generator=3, batched=batched)
    assert land.method == ("vmap" if batched else "loop"), land.notes
    after = net.state_dict()
    for k, v in before.items():  # bitwise: parameters and running statistics
        assert torch.equal(after[k], v), k
    assert [m.training for m in net.modules()] == modes
    assert all(p.grad is None for p in net.parameters())
    expected = _slow(net, [batch], *land.directions, GRID[0], GRID[1], bn)
    torch.testing.assert_close(land.values, expected, rtol=1e-12, atol=1e-12)
    assert land.values.shape == (3, 4)
    assert land.center == pytest.approx(float(_slow(net, [batch], *land.directions, [0], [0], bn)))


def test_grid_of_n_points_per_axis() -> None:
    net, batch = _bn_net()
    n = loss_landscape(net, batch, LOSS, grid=5, generator=3)
    axes = (torch.linspace(-1, 1, 5), torch.linspace(-1, 1, 5))
    pair = loss_landscape(net, batch, LOSS, grid=axes, generator=3)
    assert torch.equal(n.t1, pair.t1) and torch.equal(n.t2, pair.t2)
    assert torch.equal(n.values, pair.values) and n.values.shape == (5, 5)
    default = loss_landscape(net, batch, LOSS, generator=3)
    assert torch.equal(default.t1, loss_landscape(net, batch, LOSS, grid=21, generator=3).t1)
    for bad in (0, True, (1.0,), "5"):
        with pytest.raises(ValueError, match="grid must be a number of points per axis"):
            loss_landscape(net, batch, LOSS, grid=bad, generator=3)  # type: ignore[arg-type]


def test_a_grid_of_one_point_is_the_centre() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 4)).to(DT)
    x, y = torch.randn(6, 3, dtype=DT), torch.randn(6, 4, dtype=DT)
    land = loss_landscape(net, (x, y), "mse", grid=1, generator=0)
    assert land.t1.tolist() == [0.0] and land.t2.tolist() == [0.0]
    w1, b1, w2, b2 = (p.detach() for p in net.parameters())
    own = float(((torch.relu(x @ w1.T + b1) @ w2.T + b2 - y) ** 2).mean())
    assert float(land.values[0, 0]) == pytest.approx(own, rel=1e-12)
    assert land.center == pytest.approx(own, rel=1e-12)
    two = loss_landscape(net, (x, y), "mse", grid=2, generator=0)
    assert two.t1.tolist() == [-1.0, 1.0] == two.t2.tolist()


def test_repr_summarizes_without_the_direction_tensors() -> None:
    """print(landscape) dumped every direction tensor (6.7k characters for a small MLP)."""
    net, batch = _bn_net()
    land = loss_landscape(net, batch, LOSS, grid=3, generator=3)
    text = repr(land)
    lo, hi = float(land.values.min()), float(land.values.max())
    assert text.startswith("Landscape(grid 3x3, t1 [-1, 1], t2 [-1, 1], center ")
    assert f"loss {lo:.6g}..{hi:.6g}" in text and "bn='eval'" in text
    assert "tensor([" not in text and len(text) < 300


def test_batched_equals_looped_and_policies_differ() -> None:
    net, batch = _bn_net()
    values = {}
    for bn in ("eval", "batch", "fixed"):
        a = loss_landscape(net, batch, LOSS, grid=GRID, bn=bn, generator=1, batched=True)
        b = loss_landscape(net, batch, LOSS, grid=GRID, bn=bn, generator=1, batched=False,
                           chunk_size=1)  # fmt: skip
        torch.testing.assert_close(a.values, b.values, rtol=1e-12, atol=1e-12)
        values[bn] = a.values
    chunked = loss_landscape(net, batch, LOSS, grid=GRID, bn="batch", generator=1, chunk_size=5)
    torch.testing.assert_close(chunked.values, values["batch"], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(values["eval"], values["batch"])
    assert not torch.allclose(values["fixed"], values["batch"])
    # at the centre, frozen batch statistics and live ones coincide
    centre = loss_landscape(net, batch, LOSS, grid=([0.0], [0.0]), bn="fixed", generator=1)
    live = loss_landscape(net, batch, LOSS, grid=([0.0], [0.0]), bn="batch", generator=1)
    assert float(centre.values[0, 0]) == pytest.approx(float(live.values[0, 0]), rel=1e-12)


def test_filter_normalization_property() -> None:
    net, _ = _bn_net()
    d = filter_normalized_direction(net, generator=0)
    assert set(d) == {n for n, _ in net.named_parameters()}
    for name, p in net.named_parameters():
        if p.dim() <= 1:
            assert torch.count_nonzero(d[name]) == 0, name
        else:
            dn = d[name].reshape(p.shape[0], -1).norm(dim=1)
            pn = p.detach().reshape(p.shape[0], -1).norm(dim=1)
            torch.testing.assert_close(dn, pn, rtol=1e-12, atol=0)
            assert d[name].dtype == p.dtype
    again = filter_normalized_direction(net, generator=0)
    other = filter_normalized_direction(net, generator=1)
    assert all(torch.equal(d[n], again[n]) for n in d)
    assert not torch.equal(d["0.weight"], other["0.weight"])


def test_filter_normalization_of_a_complex_weight_uses_its_complex_norm() -> None:
    """A complex weight's direction was drawn real and scaled by the real part's row norms
    (0.50 for 0.72 on this layer): ``‖d_i‖ = ‖θ_i‖`` with the complex norm ``Σ|z|²``, and an
    imaginary part of its own. The oracle: row norms of the complex128 weight."""
    torch.manual_seed(0)
    layer = nn.Linear(6, 5, dtype=torch.complex128)
    d = filter_normalized_direction(layer, generator=0)["weight"]
    assert d.dtype == torch.complex128 and float(d.imag.abs().max()) > 0.1
    want = torch.sqrt((layer.weight.detach().abs() ** 2).sum(dim=1))
    torch.testing.assert_close(d.abs().square().sum(dim=1).sqrt(), want, rtol=1e-12, atol=0)
    assert not torch.allclose(d.real.norm(dim=1), want)


def test_several_batches_are_an_example_weighted_mean() -> None:
    net, _ = _bn_net()
    gen = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(k, 2, 4, 4, generator=gen, dtype=DT), torch.randint(0, 3, (k,), generator=gen))
        for k in (4, 12)
    ]
    for bn in ("batch", "fixed"):
        land = loss_landscape(net, batches, LOSS, grid=GRID, bn=bn, generator=2)
        expected = _slow(net, batches, *land.directions, GRID[0], GRID[1], bn)
        torch.testing.assert_close(land.values, expected, rtol=1e-12, atol=1e-12)


def test_given_directions_hessian_directions_rows_and_plot() -> None:
    net, batch = _bn_net()
    net.eval()
    names = [n for n, _ in net.named_parameters()]
    gen = torch.Generator().manual_seed(5)
    d1 = {n: torch.randn(p.shape, generator=gen, dtype=DT) for n, p in net.named_parameters()}
    d2 = {"7.weight": torch.ones(3, 6, dtype=DT)}
    a = loss_landscape(net, batch, LOSS, directions=(d1, d2), grid=GRID)
    b = loss_landscape(net, batch, LOSS, directions=([d1[n] for n in names], d2), grid=GRID)
    torch.testing.assert_close(a.values, b.values, rtol=0, atol=0)
    assert torch.count_nonzero(a.directions[1]["0.weight"]) == 0
    torch.testing.assert_close(
        a.values, _slow(net, [batch], *a.directions, GRID[0], GRID[1], "eval"), rtol=1e-12,
        atol=1e-12,
    )  # fmt: skip
    with pytest.raises(ValueError, match="shape"):
        loss_landscape(net, batch, LOSS, directions=({"7.weight": torch.ones(2)}, d2))
    with pytest.raises(ValueError, match="bn policy"):
        loss_landscape(net, batch, LOSS, bn="train")  # type: ignore[arg-type]

    h = loss_landscape(net, batch, LOSS, directions="hessian", grid=GRID, generator=0)
    u1 = torch.cat([t.reshape(-1) for t in h.directions[0].values()])
    u2 = torch.cat([t.reshape(-1) for t in h.directions[1].values()])
    assert float(u1.norm()) == pytest.approx(1.0) and float(u2.norm()) == pytest.approx(1.0)
    assert abs(float(u1 @ u2)) < 1e-8
    assert any("eigenvalues" in n for n in h.notes)

    rows = a.rows()
    assert rows.columns == list(LANDSCAPE_COLUMNS) and len(rows) == 12
    assert rows[5] == {"t1": -0.25, "t2": 0.0, "loss": float(a.values[1, 1])}
    assert a.to_rows() == rows.to_rows() and isinstance(a.to_rows()[0], dict)
    assert a.used is not None and (a.used.batches, a.used.examples) == (1, 8)
    assert rows.used == a.used
    assert a.to_markdown().count("\n") == 12 + 4  # heading, blank, header, rule, 12 rows
    pd = pytest.importorskip("pandas")
    assert isinstance(a.to_pandas(), pd.DataFrame) and list(a.to_pandas().columns) == [
        "t1",
        "t2",
        "loss",
    ]
    pytest.importorskip("matplotlib")
    ax = a.plot(log=True)
    a.contour(ax=ax)
    assert ax.figure is not None and ax.get_xlabel() == "t1"
    line = loss_landscape(net, batch, LOSS, grid=([0.0], [-1.0, 0.0, 1.0]), generator=0)
    assert line.plot().get_xlabel() == "t2"


class _NoVmap(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * (2.0 if float(y.sum()) > 0 else 1.0)  # data-dependent: vmap cannot batch it


def test_vmap_failure_falls_back_to_a_loop() -> None:
    torch.manual_seed(0)
    net = _NoVmap().to(DT)
    batch = (torch.randn(5, 3, dtype=DT), torch.randn(5, 2, dtype=DT))
    land = loss_landscape(net, batch, "mse", grid=GRID, generator=0)
    assert land.method == "loop" and any("vmap failed" in n for n in land.notes)
    looped = loss_landscape(net, batch, "mse", grid=GRID, generator=0, batched=False)
    torch.testing.assert_close(land.values, looped.values, rtol=0, atol=0)


def test_auto_batching_and_bad_chunk_size() -> None:
    net, batch = _bn_net()
    small = loss_landscape(net, batch, LOSS, grid=GRID, generator=0, batched="auto")
    assert small.method == "vmap" and "vmap" in small.notes[-1]
    big = create_model("paper_mlp", n_in=64).to(DT)
    xb = (torch.randn(512, 64, dtype=DT), torch.randint(0, 10, (512,)))
    land = loss_landscape(big, xb, "cross_entropy", grid=([0.0], [0.0, 1.0]), batched="auto")
    assert land.method == "loop" and "loop" in land.notes[-1]
    with pytest.raises(ValueError, match="chunk_size"):
        loss_landscape(net, batch, LOSS, grid=GRID, chunk_size=0)
    with pytest.raises(ValueError, match="batched"):
        loss_landscape(net, batch, LOSS, grid=GRID, batched="yes")  # type: ignore[arg-type]


def test_lecture_nets_plain_and_residual() -> None:
    """The lecture's example: plain vs residual LeakyReLU MLPs, 1-D regression."""
    x = torch.linspace(-2, 2, 64, dtype=DT)[:, None]
    batch = (x, torch.sin(3 * x))
    out = {}
    for name in ("lecture_mlp", "lecture_resnet_mlp"):
        torch.manual_seed(0)
        net = create_model(name, depth=8).to(DT)
        land = loss_landscape(net, batch, "mse", generator=0, grid=(torch.linspace(-1, 1, 5),) * 2)
        assert isinstance(land, Landscape) and land.values.shape == (5, 5)
        assert math.isfinite(land.center)
        assert float(land.values[2, 2]) == pytest.approx(land.center, rel=1e-12)
        out[name] = land
    assert not torch.equal(out["lecture_mlp"].values, out["lecture_resnet_mlp"].values)


def test_renamed_keyword_and_loss_forms_agree() -> None:
    net, batch = _bn_net()
    ref = loss_landscape(net, batch, LOSS, grid=GRID, generator=4)
    with pytest.warns(DeprecationWarning, match="data="):
        old = loss_landscape(net, batch_or_batches=batch, loss_fn=LOSS, grid=GRID, generator=4)
    assert torch.equal(old.values, ref.values)
    for form in (F.cross_entropy, "cross_entropy", lambda m, b: F.cross_entropy(m(b[0]), b[1])):
        for batched in (True, False):
            land = loss_landscape(net, batch, form, grid=GRID, generator=4, batched=batched)
            torch.testing.assert_close(land.values, ref.values, rtol=1e-12, atol=0)
    h_ref = loss_landscape(net.eval(), batch, LOSS, directions="hessian", grid=GRID, generator=0)
    h = loss_landscape(
        net, batch, lambda m, b: F.cross_entropy(m(b[0]), b[1]), directions="hessian",
        grid=GRID, generator=0,
    )  # fmt: skip
    torch.testing.assert_close(h.values, h_ref.values, rtol=1e-8, atol=1e-10)
    with pytest.raises(ValueError, match="forward= applies"):
        loss_landscape(net, batch, lambda m, b: m(b[0]).sum(), forward=lambda m, b: m(b[0]))


@CPU_DATA_PARALLEL
def test_a_data_parallel_model_against_the_slow_loop_of_the_module_it_wraps() -> None:
    """torch's stateless API refuses nn.DataParallel (it raised "can't be used with
    nn.DataParallel module"); on the CPU its forward is its module's call."""
    net, batch = _bn_net()
    land = loss_landscape(nn.DataParallel(net), batch, LOSS, grid=GRID, bn="eval", generator=3)
    d1, d2 = ({k.removeprefix("module."): v for k, v in d.items()} for d in land.directions)
    expected = _slow(net, [batch], d1, d2, GRID[0], GRID[1], "eval")
    torch.testing.assert_close(land.values, expected, rtol=1e-12, atol=1e-12)


class _OwnLoss(nn.Module):
    """A Hugging Face-style model: a dict batch, its own mean cross-entropy over labels not -100."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))

    def forward(self, inputs, labels):
        logits = self.body(inputs)
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, -2), labels.flatten())}


_WEIGHT = torch.tensor([1.0, 5.0, 0.2], dtype=DT)
_CRITERIA = {
    "ignore_index": lambda: nn.CrossEntropyLoss(),
    "class_weights": lambda: nn.CrossEntropyLoss(weight=_WEIGHT),
    "label_smoothing": lambda: nn.CrossEntropyLoss(weight=_WEIGHT, label_smoothing=0.2),
    "tokens": lambda: nn.CrossEntropyLoss(weight=_WEIGHT),
    "own_loss": lambda: None,
}


@pytest.mark.parametrize("case", list(_CRITERIA))
def test_several_batches_give_the_loss_over_all_the_data(case: str) -> None:
    """A batch weighs what its mean divides by (the counted, class-weighted targets), not its
    examples: the value is the criterion on all the data at once. It weighed examples (1.1436
    against 1.2018 with ignored targets)."""
    torch.manual_seed(0)
    net = _OwnLoss().to(DT)
    shape = (13, 4) if case == "tokens" else (13,)
    x, t = torch.randn(*shape, 4, dtype=DT), torch.randint(0, 3, shape)
    t[:4] = -100  # all in the first batch
    pieces = [(x[a:b], t[a:b]) for a, b in ((0, 6), (6, 11), (11, 13))]
    crit = _CRITERIA[case]()
    if crit is None:
        batches: list = [{"inputs": a, "labels": b} for a, b in pieces]
        crit = nn.CrossEntropyLoss()
    else:
        batches = pieces
        net = net.body
    land = loss_landscape(net, batches, _CRITERIA[case](), grid=([0.0, 0.5], [-1.0]), generator=1)
    body = net.body if isinstance(net, _OwnLoss) else net
    prefix = "body." if isinstance(net, _OwnLoss) else ""
    d1, d2 = land.directions
    for i, t1 in enumerate((0.0, 0.5)):
        params = {
            n: p.detach() + t1 * d1[prefix + n] - d2[prefix + n] for n, p in body.named_parameters()
        }
        with torch.no_grad():
            out = torch.func.functional_call(body, params, (x,))
            want = crit(out.flatten(0, -2), t.flatten()).item()
        assert land.values[i, 0].item() == pytest.approx(want, rel=1e-12)
    with torch.no_grad():
        whole = crit(body(x).flatten(0, -2), t.flatten()).item()
    assert land.center == pytest.approx(whole, rel=1e-12)


class _XZ(nn.Module):
    """``model(x, z)``: a model of two inputs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(6, 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(z)


def _xzy() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)  # z has the output's shape: a criterion takes it
    return (
        torch.randn(16, 6, generator=g),
        torch.randn(16, 3, generator=g),
        torch.randint(0, 3, (16,), generator=g),
    )


def _ce64(m: _XZ, x: torch.Tensor, z: torch.Tensor, y: torch.Tensor) -> float:
    """The oracle: the cross-entropy on the labels, in float64 from the weights."""
    d = torch.float64
    out = x.to(d) @ m.a.weight.detach().to(d).T + m.a.bias.detach().to(d)
    out = out + z.to(d) @ m.b.weight.detach().to(d).T + m.b.bias.detach().to(d)
    logp = out - torch.logsumexp(out, dim=1, keepdim=True)
    return float(-logp[torch.arange(len(y)), y].mean())


def test_the_advice_for_a_model_of_two_inputs_gives_the_loss_on_the_labels() -> None:
    """The default forward's advice, forward=lambda model, batch: model(*batch[:2]), on a batch
    (x, z, y) had a criterion (and the default loss) score the output against z = batch[1]: a
    "cross-entropy" of -0.31 (true 1.34). Now both forms the advice writes out give the loss on
    the labels, and a forward= that passes batch[1] to the model raises."""
    m, (x, z, y) = _XZ(), _xzy()
    oracle = _ce64(m, x, z, y)
    with pytest.raises(TypeError) as err:
        initlab.loss_landscape(m, (x, z, y), nn.CrossEntropyLoss(), grid=3, generator=0)
    text = str(err.value)
    assert "model(*batch[:2])" not in text
    forward = eval(re.search(r"forward=(lambda model, batch: model\(batch\[0\], \*batch\[2:\]\))",
                             text).group(1))  # fmt: skip
    loss_fn = eval(re.search(r"loss_fn=(lambda model, batch: F\.cross_entropy\(model\(batch\[0\], "
                             r"batch\[1\]\), batch\[2\]\))", text).group(1), {"F": F})  # fmt: skip
    for data, kw in (((x, y, z), {"forward": forward}), ((x, z, y), {})):
        for loss in (nn.CrossEntropyLoss(), None) if kw else (loss_fn,):
            land = initlab.loss_landscape(m, data, loss, grid=3, generator=0, **kw)
            assert land.center == pytest.approx(oracle, rel=1e-5)
    consumed = lambda model, batch: model(batch[0], batch[1])  # noqa: E731
    for loss in (nn.CrossEntropyLoss(), None):
        with pytest.raises(TargetError, match=r"forward= passes batch\[1\] to the model"):
            initlab.loss_landscape(m, (x, z, y), loss, forward=consumed, grid=3, generator=0)
        with pytest.raises(TargetError, match=r"forward= passes batch\[1\] to the model"):
            initlab.block_curvature(m, (x, z, y), loss, forward=consumed, probes=1, generator=0)


def test_a_forward_that_gives_the_target_by_a_target_keyword_or_as_its_input_runs() -> None:
    """Not refused: labels=batch[1] (teacher forcing; the target is the labels), and a batch whose
    target is its input too ((ids, ids, mask), as a language model's)."""

    class Teacher(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> Any:
            return self.lin(x) * mask

    x, _, y = _xzy()
    mask = torch.ones(16, 1)
    m = Teacher()
    fwd = lambda model, b: model(b[0], b[2], labels=b[1])  # noqa: E731
    land = initlab.loss_landscape(m, (x, y, mask), nn.CrossEntropyLoss(), forward=fwd, grid=3)
    with torch.no_grad():
        oracle = float(F.cross_entropy(m.lin(x).double(), y))
    assert land.center == pytest.approx(oracle, rel=1e-5)
    same = (x, x, mask)  # the input is the target (MSE on a model of one shape)
    auto = nn.Linear(6, 6)
    fwd2 = lambda model, b: model(b[0]) * b[2]  # noqa: E731
    land = initlab.loss_landscape(auto, same, nn.MSELoss(), forward=fwd2, grid=3)
    with torch.no_grad():
        assert land.center == pytest.approx(float(F.mse_loss(auto(x).double(), x.double())), 1e-5)


_CONSUMERS: dict[str, Any] = {
    "loss_landscape": lambda m, b, loss, fwd: initlab.loss_landscape(
        m, b, loss, forward=fwd, grid=3, generator=0
    ),
    "block_curvature": lambda m, b, loss, fwd: initlab.block_curvature(
        m, b, loss, forward=fwd, probes=1, generator=0
    ),
    "doctor": lambda m, b, loss, fwd: initlab.doctor(m, b, loss, forward=fwd, generator=0),
}


@pytest.mark.parametrize("entry", list(_CONSUMERS))
def test_a_forward_that_converts_batch_1_on_its_way_in_is_refused_too(entry: str) -> None:
    """The guard compared by identity: model(batch[0], batch[1].float()) or .to(device) got
    through, and the loss scored the output against z = batch[1], silently (an MSE against z
    for the default loss where the shapes fit). A copy with batch[1]'s shape and values, or a
    view of it, is batch[1] too."""
    m, (x, z, y) = _XZ(), _xzy()
    before = copy.deepcopy(m.state_dict())
    forwards = {
        "float": (z.double(), lambda model, b: model(b[0], b[1].float())),
        "to": (z.double(), lambda model, b: model(b[0], b[1].to("cpu", torch.float32))),
        "clone": (z, lambda model, b: model(b[0], b[1].clone())),
        "detach, by keyword": (z, lambda model, b: model(b[0], z=b[1].detach())),
    }
    for name, (zz, fwd) in forwards.items():
        for loss in (None, nn.CrossEntropyLoss()):
            with pytest.raises(TargetError, match=r"forward= passes batch\[1\] to the model as an "
                               r"input, .* against an input of shape \(16, 3\)"):  # fmt: skip
                _CONSUMERS[entry](m, (x, zz, y), loss, fwd)
            assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items()), name


@pytest.mark.parametrize("entry", list(_CONSUMERS))
def test_a_two_entry_batch_given_whole_to_the_model_has_no_target_left(entry: str) -> None:
    """A batch (x, z) with forward=model(*batch) and a loss that reads batch[1] was never checked
    (only batches of 3+ entries were): the loss scored the output against z where the shapes
    fit (the default loss's MSE). Now the error says no target is left."""
    m, (x, z, _) = _XZ(), _xzy()
    for loss in (None, nn.MSELoss()):
        with pytest.raises(TargetError, match=r"forward= passes batch\[1\] to the model as an "
                           r"input, .*this batch has 2 entries: no target is left \(it would "
                           r"score the output against an input of shape \(16, 3\)\)\. Give the "
                           r"batches their targets"):  # fmt: skip
            _CONSUMERS[entry](m, (x, z), loss, lambda model, b: model(*b))


def test_what_the_target_guard_lets_through_and_what_it_refuses() -> None:
    """A loss that names the entries it reads (outputs_loss) is not guarded (it was refused when
    batch[1] went into the model); a part of batch[1] (a shifted decoder input), a fresh tensor
    equal to a constant batch[1], and (ids, ids.clone()) batches run, each to its float64
    oracle. A mask at batch[1] given by the keyword mask= is refused: the loss would read it."""
    m, (x, z, y) = _XZ(), _xzy()
    by_name = initlab.outputs_loss(lambda out, b: F.cross_entropy(out, b[2]))
    land = initlab.loss_landscape(m, (x, z, y), by_name, forward=lambda mm, b: mm(*b[:2]), grid=3)
    assert land.center == pytest.approx(_ce64(m, x, z, y), rel=1e-5)

    d = torch.float64
    w = lambda lin: (lin.weight.detach().to(d), lin.bias.detach().to(d))  # noqa: E731
    (wa, ba), (wb, bb) = w(m.a), w(m.b)
    seq = torch.randn(16, 4, generator=torch.Generator().manual_seed(5))
    shifted = initlab.criterion(lambda out, t: F.mse_loss(out, t[:, 1:]))
    land = initlab.loss_landscape(m, (x, seq), shifted, grid=3,
                                  forward=lambda mm, b: mm(b[0], b[1][:, :-1]))  # fmt: skip
    out = x.to(d) @ wa.T + ba + seq[:, :-1].to(d) @ wb.T + bb
    assert land.center == pytest.approx(float(F.mse_loss(out, seq[:, 1:].to(d))), rel=1e-5)

    zeros = torch.zeros(16, 3)  # a constant target: a fresh zeros input equals it, and is not it
    fresh = lambda mm, b: mm(b[0], torch.zeros(len(b[0]), 3))  # noqa: E731
    land = initlab.loss_landscape(m, (x, zeros), nn.MSELoss(), forward=fresh, grid=3)
    out = x.to(d) @ wa.T + ba + bb
    assert land.center == pytest.approx(float((out**2).mean()), rel=1e-5)

    auto = nn.Linear(6, 6)
    land = initlab.loss_landscape(auto, (x, x.clone()), nn.MSELoss(), grid=3,
                                  forward=lambda mm, b: mm(b[0]) * 1.0)  # fmt: skip
    with torch.no_grad():
        assert land.center == pytest.approx(float(F.mse_loss(auto(x).double(), x.double())), 1e-5)

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * mask

    mask = (torch.arange(48).reshape(16, 3) % 2).float()
    with pytest.raises(TargetError, match=r"forward= passes batch\[1\] to the model"):
        initlab.loss_landscape(Masked(), (x, mask, y), nn.CrossEntropyLoss(), grid=3,
                               forward=lambda mm, b: mm(b[0], mask=b[1]))  # fmt: skip


_NAMED_CONSUMERS: dict[str, Any] = {
    **_CONSUMERS,
    "hessian_eigenpairs": lambda m, b, loss, fwd: hessian_eigenpairs(m, b, loss, k=1, forward=fwd),
    "CurvatureOperator": lambda m, b, loss, fwd: CurvatureOperator(m, b, loss, forward=fwd).loss,
    "theory_vs_actual": lambda m, b, loss, fwd: initlab.theory_vs_actual(
        m, b, loss, forward=fwd, probes=1, generator=0
    ),
}


@pytest.mark.parametrize("entry", list(_NAMED_CONSUMERS))
def test_the_target_guard_names_the_entry_point_and_the_default_loss(entry: str) -> None:
    """block_curvature and hessian_eigenpairs called themselves "curvature:", and with no loss
    given the message spoke of "the loss 'auto'", an internal name."""
    m, (x, z, y) = _XZ(), _xzy()
    consumed = lambda model, b: model(b[0], b[1])  # noqa: E731
    with pytest.raises(TargetError, match=rf"^{entry}: forward= passes batch\[1\] to the model as "
                       r"an input, and the default loss \(cross-entropy for integer targets, MSE "
                       r"for float ones\) reads the target"):  # fmt: skip
        _NAMED_CONSUMERS[entry](m, (x, z, y), None, consumed)
    with pytest.raises(TargetError, match=rf"^{entry}: .*, and the loss 'CrossEntropyLoss' reads"):
        _NAMED_CONSUMERS[entry](m, (x, z, y), nn.CrossEntropyLoss(), consumed)


class _SharedBN(nn.Module):
    """One BatchNorm called twice per forward, on inputs of very different statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.c, self.b = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.a(x))
        return self.b(torch.tanh(self.bn(self.c(h) * 3 + 5)))


def _shared_by_hand(p: dict, x: torch.Tensor, stats: list | None = None) -> tuple:
    """:class:`_SharedBN` written out in float64: ``(out, [(mean, var) of each BN call])``;
    ``stats``: normalize call ``k`` with ``stats[k]`` instead of its batch's statistics."""
    seen: list = []

    def bn(z: torch.Tensor) -> torch.Tensor:
        k = len(seen)
        m, v = (z.mean(0), z.var(0, unbiased=False)) if stats is None else stats[k]
        seen.append((m, v))
        return (z - m) / torch.sqrt(v + 1e-5) * p["bn.weight"] + p["bn.bias"]

    h = bn(x @ p["a.weight"].T + p["a.bias"])
    z = bn((h @ p["c.weight"].T + p["c.bias"]) * 3 + 5)
    return torch.tanh(z) @ p["b.weight"].T + p["b.bias"], seen


@pytest.mark.parametrize("batched", [True, False])
def test_fixed_gives_each_call_of_a_shared_batchnorm_its_own_statistics(batched: bool) -> None:
    torch.manual_seed(0)
    model = _SharedBN().to(DT)
    with torch.no_grad():
        model.bn.weight.uniform_(0.5, 1.5)
        model.bn.bias.uniform_(-0.2, 0.2)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 3, generator=gen, dtype=DT), torch.randn(8, 2, generator=gen,
                dtype=DT)) for _ in range(2)]  # fmt: skip
    land = loss_landscape(model, batches, "mse", grid=GRID, bn="fixed", generator=0,
                          batched=batched)  # fmt: skip
    assert land.method == ("vmap" if batched else "loop"), land.notes
    theta = {n: p.detach() for n, p in model.named_parameters()}
    stats = [_shared_by_hand(theta, x)[1] for x, _ in batches]

    def own(p: dict) -> float:  # equal batches: the mean of the two batch means
        return sum(
            float(F.mse_loss(_shared_by_hand(p, x, st)[0], y)) / 2
            for (x, y), st in zip(batches, stats, strict=True)
        )

    live = loss_landscape(model, batches, "mse", grid=([0.0], [0.0]), bn="batch")
    assert land.center == pytest.approx(live.center, rel=1e-12)
    assert land.center == pytest.approx(own(theta), rel=1e-12)
    d1, d2 = land.directions
    expected = torch.tensor(
        [[own({n: theta[n] + a * d1[n] + b * d2[n] for n in theta}) for b in GRID[1]]
         for a in GRID[0]], dtype=DT,
    )  # fmt: skip
    torch.testing.assert_close(land.values, expected, rtol=1e-12, atol=1e-12)
    assert any("bn" in n and "2 times" in n for n in land.notes), land.notes

    # the Hessian directions are those of the loss with each call's statistics held fixed
    h = loss_landscape(model, batches, "mse", directions="hessian", grid=([0.0], [0.0]),
                       bn="fixed", generator=0)  # fmt: skip
    names, shapes = list(theta), [theta[n].shape for n in theta]
    sizes = [theta[n].numel() for n in theta]
    x0, y0 = batches[0]

    def flat_loss(v: torch.Tensor) -> torch.Tensor:
        p = {n: t.reshape(s) for n, t, s in zip(names, v.split(sizes), shapes, strict=True)}
        return F.mse_loss(_shared_by_hand(p, x0, stats[0])[0], y0)

    hess = torch.autograd.functional.hessian(flat_loss, torch.cat([theta[n].reshape(-1) for n
                                             in names]))  # fmt: skip
    lam, vec = torch.linalg.eigh(hess)
    top = lam.abs().argsort(descending=True)[:2]
    assert float(lam.abs()[top[0]] - lam.abs()[top[1]]) > 1e-3 * float(lam.abs().max())
    for k, d in zip(top, h.directions, strict=True):
        u = torch.cat([d[n].reshape(-1) for n in names])
        assert abs(float(u @ vec[:, k])) == pytest.approx(1.0, abs=1e-8)


class _MoreCallsAway(_SharedBN):
    """Calls its BatchNorm twice at θ, three times once ``c.weight`` has grown."""

    limit = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.a(x))
        for _ in range(1 if float(self.c.weight.detach().sum()) < self.limit else 2):
            h = self.bn(self.c(h))
        return self.b(h)


def test_fixed_refuses_a_batchnorm_called_more_often_than_at_the_centre() -> None:
    torch.manual_seed(0)
    model = _MoreCallsAway().to(DT)
    model.limit = float(model.c.weight.detach().sum()) + 4.5
    x, y = torch.randn(8, 3, dtype=DT), torch.randn(8, 2, dtype=DT)
    away = ({"c.weight": torch.ones(3, 3, dtype=DT)}, {})
    near = loss_landscape(model, (x, y), "mse", directions=away, grid=([0.0, 0.25], [0.0]),
                          bn="fixed")  # fmt: skip
    assert near.method == "loop" and near.values.isfinite().all()
    with pytest.raises(RuntimeError, match=r"called \{'bn': 3\} times.*bn='batch'"):
        loss_landscape(model, (x, y), "mse", directions=away, grid=([0.0, 1.0], [0.0]), bn="fixed")


def test_hessian_directions_of_a_float16_layernorm_model() -> None:
    """torch's native layer_norm double backward overflows float16: the Hessian products were
    NaN and directions="hessian" died with a raw torch _LinAlgError from linalg.eigh. The
    directions are now the float64 Hessian's top eigenvectors (the LayerNorm written out here) to
    float16's accuracy (|<u, v>| within 1e-3 of 1: 11 bits, 5e-4 per rounding), and the grid
    agrees with float32's loss at the centre to float16's rounding of the weights and logits."""
    net = ln_net().half()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
    names = [n for n, _ in net.named_parameters()]
    shapes = [p.shape for p in net.parameters()]
    sizes = [p.numel() for p in net.parameters()]

    def flat_loss(v: torch.Tensor) -> torch.Tensor:
        w1, b1, gain, shift, w2, b2 = (
            t.reshape(s) for t, s in zip(v.split(sizes), shapes, strict=True)
        )
        h = x.double().half().double() @ w1.T + b1
        c = h - h.mean(-1, keepdim=True)
        h = c / (c.square().mean(-1, keepdim=True) + 1e-5).sqrt() * gain + shift
        out = h.clamp_min(0) @ w2.T + b2
        return -(out - out.exp().sum(-1, keepdim=True).log())[torch.arange(len(y)), y].mean()

    theta = torch.cat([p.detach().double().reshape(-1) for p in net.parameters()])
    lam, vec = torch.linalg.eigh(torch.autograd.functional.hessian(flat_loss, theta))
    top = lam.abs().argsort(descending=True)[:2]
    land = loss_landscape(net, (x.half(), y), nn.CrossEntropyLoss(), directions="hessian",
                          grid=3, generator=0)  # fmt: skip
    assert bool(torch.isfinite(land.values).all())
    for k, d in zip(top, land.directions, strict=True):
        u = torch.cat([d[n].double().reshape(-1) for n in names])
        assert abs(float(u @ vec[:, k]) / float(u.norm())) == pytest.approx(1.0, abs=1e-3)
    assert land.center == pytest.approx(float(flat_loss(theta)), rel=2e-3)


def test_nonfinite_hessian_products_in_landscape_name_float16() -> None:
    """Products still NaN in float16 (a normalization written by hand) raise a clear error
    naming float16 and the float32 copy, not linalg.eigh's "failed to converge"."""
    net = ln_net(scale=0.01, norm=HandNorm()).half()
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(8, 8, generator=g).half(), torch.randint(0, 4, (8,), generator=g))
    with pytest.raises(FloatingPointError, match=r"loss_landscape: a Hessian product .* NaN/inf: "
                       r"the model is float16, .* float32 copy"):  # fmt: skip
        loss_landscape(net, batch, nn.CrossEntropyLoss(), directions="hessian", generator=0)


class _GRUCellNet(nn.Module):
    """A GRUCell over two steps: torch has no vmap batching rule for ``aten::gru_cell``."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.GRUCell(3, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.cell(x[:, 0])
        return self.head(self.cell(x[:, 1], h))


def test_vmap_over_gru_cell_keeps_torch_fallback_warning_to_itself() -> None:
    # torch's "There is a performance drop ... batching rule for aten::gru_cell. Please file us
    # an issue" is about initlab's own vmap; other warnings still reach the user
    torch.manual_seed(0)
    net = _GRUCellNet().to(DT)
    batch = (torch.randn(5, 2, 3, dtype=DT), torch.randint(0, 2, (5,)))
    d = {n: torch.randn_like(p) for n, p in net.named_parameters()}
    e = {n: torch.randn_like(p) for n, p in net.named_parameters()}
    t1, t2 = [-0.5, 0.5], [0.0, 1.0]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        land = initlab.loss_landscape(net, batch, LOSS, directions=[d, e], grid=(t1, t2))
        warnings.warn("the user's own", UserWarning, stacklevel=1)
    assert land.method == "vmap", land.notes
    assert [str(w.message) for w in seen] == ["the user's own"]
    own = torch.empty(2, 2, dtype=DT)
    for i, a in enumerate(t1):
        for j, b in enumerate(t2):
            twin = copy.deepcopy(net)
            with torch.no_grad():
                for n, p in twin.named_parameters():
                    p.add_(a * d[n] + b * e[n])
                own[i, j] = _loss(twin(batch[0]), batch)
    torch.testing.assert_close(land.values, own, rtol=1e-12, atol=1e-12)
