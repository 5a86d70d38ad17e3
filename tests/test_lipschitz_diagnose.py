"""diagnose()'s Lipschitz bound (``meta["lipschitz"]``) against float64 computations written out
by hand: dense Jacobians of each layer's map (``torch.autograd.functional.jacobian``), their
spectral norms and products, and the exact Jacobian norm of the whole model at chosen points."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from torch import nn

from initlab.diagnostics import diagnose

F64 = torch.float64


def _dense_norm(fn, shape: tuple[int, ...]) -> float:
    """``||J||_2`` of ``fn`` at 0 (exact for a linear map), ``J`` from autograd, in float64."""
    n = 1
    for s in shape:
        n *= s
    jac = torch.autograd.functional.jacobian(
        lambda v: fn(v.reshape(1, *shape)).reshape(-1), torch.zeros(n, dtype=F64)
    )
    return float(torch.linalg.matrix_norm(jac.reshape(-1, n), ord=2))


def _square_mean(model: nn.Module, batch) -> torch.Tensor:
    return (model(batch[0]) ** 2).mean()


def _lipschitz(model: nn.Module, x: torch.Tensor, **kw) -> dict:
    report = diagnose(model, [(x,)], _square_mean, generator=0, **kw)
    return report.meta["lipschitz"]


# ----------------------------------------------------------------------------- finding 1


def test_an_eval_batchnorm_replayed_for_per_example_gradients_counts_once() -> None:
    """The per-example probe re-runs an eval-mode BatchNorm in the backward; that replay was
    counted as a second call, so the BN scale (~5) entered the bound squared (22.0 for 4.4)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double().eval()
    with torch.no_grad():
        model[1].running_var.fill_(0.04)
    own = copy.deepcopy(model)
    expected = (
        _dense_norm(lambda v: v @ own[0].weight.T, (3,))
        * _dense_norm(lambda v: v * own[1].weight / torch.sqrt(own[1].running_var + 1e-5), (4,))
        * _dense_norm(lambda v: v @ own[2].weight.T, (4,))
    )
    x = torch.randn(5, 3, dtype=F64)
    for per_example in (True, False):
        lip = _lipschitz(model, x, per_example=per_example)
        assert lip["plain"] == pytest.approx(expected, rel=1e-9), per_example
        assert not any("several times" in n for n in lip["notes"])


@pytest.mark.parametrize("seed", [0, 4])
def test_a_replayed_transposed_convolution_counts_once_and_the_bound_holds(seed: int) -> None:
    """``ConvTranspose2d -> Conv2d`` is linear: its Lipschitz constant is ``||B A||`` (dense).
    The replayed ConvTranspose counted twice and the "guaranteed" bound fell below it."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.ConvTranspose2d(2, 3, 3, stride=2), nn.Conv2d(3, 1, 1)).double()
    own = copy.deepcopy(model)
    a = _dense_norm(
        lambda v: torch.nn.functional.conv_transpose2d(v, own[0].weight, stride=2), (2, 4, 4)
    )
    b = _dense_norm(lambda v: torch.nn.functional.conv2d(v, own[1].weight), (3, 9, 9))
    true = _dense_norm(lambda v: own(v) - own(torch.zeros_like(v)), (2, 4, 4))
    lip = _lipschitz(model, torch.randn(4, 2, 4, 4, dtype=F64))
    assert lip["plain"] == pytest.approx(a * b, rel=1e-7)
    assert true <= lip["plain"] * (1 + 1e-9)
    assert not any("several times" in n for n in lip["notes"])


# ----------------------------------------------------------------------------- finding 2


def _jacobian_norm(fn, x: torch.Tensor) -> float:
    """``||J(x)||_2`` of ``fn`` (a map of the flattened ``x``) at ``x``, in float64."""
    jac = torch.autograd.functional.jacobian(fn, x.reshape(-1))
    return float(torch.linalg.matrix_norm(jac.reshape(-1, x.numel()), ord=2))


@pytest.mark.parametrize(
    "norm",
    [
        nn.LayerNorm(4, elementwise_affine=False),
        nn.GroupNorm(2, 4, affine=False),
        nn.RMSNorm(4, elementwise_affine=False),
        nn.BatchNorm1d(4, affine=False),  # train mode: couples the examples
    ],
    ids=["layernorm", "groupnorm", "rmsnorm", "batchnorm_train"],
)
def test_a_normalization_layer_without_parameters_is_not_covered(norm: nn.Module) -> None:
    """Only modules with parameters were "uncovered": a LayerNorm without affine parameters
    gave a "guaranteed" bound of ~0.5 where the Jacobian norm is ~100."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), norm, nn.Linear(4, 2)).double().train()
    first = model[0]
    with torch.no_grad():  # inputs the first layer maps to ~1e-3: the norm divides by ~1e-3
        target = torch.randn(8, 4, dtype=F64) * 1e-3 - first.bias
        x = torch.linalg.solve(first.weight, target.T).T
    lip = _lipschitz(model, x, gradients=False)
    own = copy.deepcopy(model)
    observed = _jacobian_norm(lambda v: own(v.reshape(x.shape)).reshape(-1), x)
    assert observed > lip["plain"]  # the product of norms is no bound here
    assert not lip["guaranteed"] and lip["uncovered"] == ["1"]


# ----------------------------------------------------------------------------- finding 4


class _TwiceApplied(nn.Module):
    """Applies its child's weight twice in its own forward, never calling the child."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        with torch.no_grad():
            self.proj.weight.mul_(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return torch.nn.functional.linear(torch.nn.functional.linear(x, w), w)


class _ParentApplied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _TwiceApplied()
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(x))


def test_a_weight_applied_by_its_parent_makes_the_bound_no_guarantee() -> None:
    """The count of a weight its parent applies is a guess (once per parent call): here it runs
    twice and the "guaranteed" bound 1.61 was below ``||O W W|| = 1.99``."""
    torch.manual_seed(0)
    model = _ParentApplied().double()
    own = copy.deepcopy(model)
    w, o = own.inner.proj.weight.detach(), own.out.weight.detach()
    true = float(torch.linalg.matrix_norm(o @ w @ w, 2))
    lip = _lipschitz(model, torch.randn(8, 4, dtype=F64), per_example=False)
    assert true > lip["plain"]  # the guessed count gives no bound here
    assert not lip["guaranteed"]
    assert any("inner.proj" in n and "parent" in n for n in lip["notes"])


# ----------------------------------------------------------------------------- finding 3


def _unit(layer: nn.Module) -> nn.Module:
    """The layer made the identity (norm 1, no bias), so the product of norms is 1."""
    with torch.no_grad():
        w = layer.weight
        w.copy_(torch.eye(w.shape[0], w[0].numel()).reshape(w.shape))
        layer.bias.zero_()
    return layer


class _Cat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f, self.g = nn.Linear(3, 3), nn.Linear(6, 2)
        with torch.no_grad():
            self.f.weight.mul_(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.g(torch.cat([x, self.f(x)], -1))


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 10 * self.f(x)


class _Broadcast(nn.Module):
    """``(N, 1)`` times (or plus) a ``(1, 10)`` constant: each entry repeated 10 times."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.f, self.g, self.op = nn.Linear(1, 1), nn.Linear(10, 1), op
        self.register_buffer("c", torch.full((1, 10), 0.9 if op == "mul" else 0.0))
        with torch.no_grad():
            self.f.weight.fill_(1.0), self.g.weight.fill_(10**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.f(x)
        return self.g(h * self.c if self.op == "mul" else h + self.c)


def _spike() -> torch.Tensor:
    x = torch.randn(1, 6, 6, dtype=F64)
    x[0, 3, 3] = 5.0  # the max of the 4 overlapping windows that hold it
    return x


_NOT_ONE_LIPSCHITZ = {  # model, op name, point of the exact Jacobian, input shape
    "gelu": (lambda: nn.Sequential(_unit(nn.Linear(1, 1)), nn.GELU(), _unit(nn.Linear(1, 1))),
             "gelu", lambda: torch.tensor([2**0.5], dtype=F64), (1,)),
    "silu": (lambda: nn.Sequential(_unit(nn.Linear(1, 1)), nn.SiLU(), _unit(nn.Linear(1, 1))),
             "silu", lambda: torch.tensor([2.3994], dtype=F64), (1,)),
    "selu": (lambda: nn.Sequential(_unit(nn.Linear(1, 1)), nn.SELU(), _unit(nn.Linear(1, 1))),
             "selu", lambda: torch.tensor([-1e-6], dtype=F64), (1,)),
    "elu3": (lambda: nn.Sequential(_unit(nn.Linear(1, 1)), nn.ELU(3.0), _unit(nn.Linear(1, 1))),
             "elu", lambda: torch.tensor([-1e-6], dtype=F64), (1,)),
    "upsample": (lambda: nn.Sequential(_unit(nn.Conv2d(1, 1, 1)), nn.Upsample(scale_factor=2),
                                       _unit(nn.Conv2d(1, 1, 1))),
                 "interpolate", lambda: torch.randn(1, 4, 4, dtype=F64), (1, 4, 4)),
    "overlapping_max_pool": (lambda: nn.Sequential(_unit(nn.Conv2d(1, 1, 1)),
                                                   nn.MaxPool2d(3, 2, 1),
                                                   _unit(nn.Conv2d(1, 1, 1))),
                             "max_pool2d", _spike, (1, 6, 6)),
    "cat": (_Cat, "cat", lambda: torch.randn(3, dtype=F64), (3,)),
    "constant_factor": (_Scaled, "mul", lambda: torch.randn(3, dtype=F64), (3,)),
    "broadcast_product": (lambda: _Broadcast("mul"), "mul",
                          lambda: torch.randn(1, dtype=F64), (1,)),
    "broadcast_sum": (lambda: _Broadcast("add"), "add", lambda: torch.randn(1, dtype=F64), (1,)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(_NOT_ONE_LIPSCHITZ))
def test_an_operation_that_is_not_1_lipschitz_makes_the_bound_no_guarantee(case: str) -> None:
    """Every parameter-free operation was assumed 1-Lipschitz: each of these models exceeds
    its product of norms (exact Jacobian at a chosen point) and was printed as guaranteed."""
    torch.manual_seed(0)
    build, op, point, shape = _NOT_ONE_LIPSCHITZ[case]
    model = build().double().eval()
    report = diagnose(model, [(torch.randn(8, *shape, dtype=F64),)], _square_mean,
                      generator=0, per_example=False, gradients=False)  # fmt: skip
    lip = report.meta["lipschitz"]
    own = copy.deepcopy(model)
    observed = _jacobian_norm(lambda v: own(v.reshape(1, *shape)).reshape(-1), point())
    assert observed > lip["plain"] * (1 + 1e-6)  # the product of norms is no bound here
    assert not lip["guaranteed"]
    assert any(o.startswith(f"{op} in ") for o in lip["operations"]), lip["operations"]
    assert "upper bound: not available" in report.summary()


class _Allowed(nn.Module):
    """Only operations the bound may take as 1-Lipschitz, around two convolutions and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4).eval()
        self.head = nn.Linear(8, 3)
        self.drop = nn.Dropout(0.5).eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.leaky_relu(self.bn(self.c1(x)), 0.2)
        h = nn.functional.max_pool2d(torch.tanh(h), 2)  # non-overlapping windows
        h = h + self.c2(nn.functional.avg_pool2d(h, 3, 1, 1))  # a residual block
        h = self.drop(torch.sigmoid(h[:, :, ::2]) * 0.5).flatten(1)
        return self.head(torch.softmax(h, -1))


def test_operations_known_to_be_1_lipschitz_keep_the_bound_guaranteed() -> None:
    torch.manual_seed(0)
    model = _Allowed().double().eval()
    lip = _lipschitz(model, torch.randn(4, 2, 4, 4, dtype=F64), gradients=False)
    assert lip["operations"] == [] and lip["guaranteed"], lip
    own = copy.deepcopy(model)
    for _ in range(5):
        point = torch.randn(2, 4, 4, dtype=F64) * 3
        observed = _jacobian_norm(lambda v: own(v.reshape(1, 2, 4, 4)).reshape(-1), point)
        assert observed <= lip["residual"] * (1 + 1e-9)


def test_dropout_in_train_mode_says_to_call_eval() -> None:
    """Dropout in train mode scales what it keeps by 1/(1-p) (a Jacobian norm of 2 here, over
    a product of norms of 1): no guarantee, and nothing said to call model.eval(). The
    operation's entry and the summary line say so; in eval mode the bound is guaranteed."""
    torch.manual_seed(0)
    model = nn.Sequential(_unit(nn.Linear(4, 4)), nn.Dropout(0.5), _unit(nn.Linear(4, 4)))
    model = model.double().train()
    x = torch.randn(8, 4, dtype=F64)
    report = diagnose(model, [(x,)], _square_mean, generator=0, per_example=False,
                      gradients=False)  # fmt: skip
    lip, own = report.meta["lipschitz"], copy.deepcopy(model)
    observed = max(
        _jacobian_norm(lambda v: own(v.reshape(1, 4)).reshape(-1), x[i]) for i in range(8)
    )
    assert observed == pytest.approx(2.0) and lip["plain"] == pytest.approx(1.0)
    assert not lip["guaranteed"]
    assert [o for o in lip["operations"] if "model.eval()" in o], lip["operations"]
    line = [s for s in report.summary().splitlines() if "Lipschitz upper bound" in s]
    assert "call model.eval() first" in line[0], line
    assert _lipschitz(model.eval(), x, per_example=False, gradients=False)["guaranteed"]


def _residual_loss(model: nn.Module, batch) -> torch.Tensor:
    """A PINN's loss: the model's input gradient (``torch.autograd.grad``) in the loss."""
    x = batch[0].clone().requires_grad_(True)
    u = model(x)
    (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
    return (du**2).mean() + (u**2).mean()


def test_a_loss_that_needs_autograd_keeps_the_bound_guaranteed() -> None:
    """The forward that counts each layer's calls ran the loss without grad: a PINN residual
    failed there, the counts were dropped and a Linear-Tanh-Linear bound lost its guarantee.
    The oracle: the product of the weights' spectral norms in float64 bounds the exact
    Jacobian norm at every point."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    report = diagnose(model, [(torch.randn(16, 2, dtype=F64),)], _residual_loss, generator=0,
                      per_example=False, gradients=False)  # fmt: skip
    lip = report.meta["lipschitz"]
    norms = [torch.linalg.matrix_norm(model[i].weight.detach(), ord=2) for i in (0, 2)]
    assert lip["plain"] == pytest.approx(float(norms[0] * norms[1]), rel=1e-6)
    assert lip["guaranteed"] and lip["operations"] == [], lip
    own = copy.deepcopy(model)
    for _ in range(5):
        point = torch.randn(2, dtype=F64) * 2
        assert _jacobian_norm(lambda v: own(v.reshape(1, 2)).reshape(-1), point) <= lip["plain"]


@pytest.mark.parametrize(
    ("name", "cfg"),
    [
        ("resnet20", {}),
        ("vgg19", {"width": 0.125}),
        ("fitnet", {"activation": "maxout"}),
        ("strided_lenet", {}),
        ("lecture_resnet_mlp", {}),
        ("paper_mlp", {}),
    ],
)
def test_the_zoo_models_bounds_stay_guaranteed(name: str, cfg: dict) -> None:
    """No false alarm on the library's own models in eval mode (ReLU, LeakyReLU, maxout,
    non-overlapping and global pooling, option-A shortcuts, circular padding)."""
    from initlab.zoo import create_model, input_shape

    torch.manual_seed(0)
    model = create_model(name, **cfg).eval()
    x = torch.randn(2, *input_shape(name, **cfg))
    lip = _lipschitz(model, x, gradients=False, max_batches=1)
    assert lip["guaranteed"] and lip["operations"] == [], lip


# ----------------------------------------------------------------------------- explore12


def _max_jacobian_norm(model: nn.Module, shape: tuple[int, ...], points: int = 5) -> float:
    """The largest exact ``||J(x)||_2`` of ``model`` over random points at scales 1 and 3."""
    own = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    return max(
        _jacobian_norm(
            lambda v: own(v.reshape(1, *shape)).reshape(-1),
            (1 + 2 * (i % 2)) * torch.randn(*shape, dtype=F64, generator=g),
        )
        for i in range(points)
    )


def _checked(model: nn.Module, shape: tuple[int, ...]) -> tuple[dict, float]:
    """``(meta["lipschitz"], max exact ||J||)``; a bound claimed guaranteed must hold."""
    torch.manual_seed(0)
    model = model.double().eval()
    lip = _lipschitz(model, torch.randn(8, *shape, dtype=F64), gradients=False)
    exact = _max_jacobian_norm(model, shape)
    bound = lip["residual"] if math.isfinite(lip["residual"]) else lip["plain"]
    assert not lip["guaranteed"] or exact <= bound * (1 + 1e-9), (exact, lip)
    return lip, exact


class _Lambda(nn.Module):
    """``out(fn(inner(x), inner))`` with two 6 -> 6 layers and a 6 -> 3 head."""

    def __init__(self, fn, scale: float = 1.0) -> None:
        super().__init__()
        if isinstance(fn, nn.Module):  # an activation module: a child, called as one
            self.act, fn = fn, lambda h, m: m.act(h)
        self.fn, self.inner, self.other, self.out = (
            fn,
            nn.Linear(6, 6),
            nn.Linear(6, 6),
            nn.Linear(6, 3),
        )
        with torch.no_grad():
            self.inner.weight.mul_(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.fn(self.inner(x), self))


_ALPHA = {  # a factor alpha the bound missed: add/sub/rsub with alpha= on an activation
    "residual": lambda h, m: torch.add(h, m.other(h), alpha=10.0),
    "method": lambda h, m: h.add(m.other(h), alpha=-4.0),
    "sub": lambda h, m: torch.sub(h, m.other(h), alpha=5.0),
    "constant_plus": lambda h, m: torch.add(torch.ones(6, dtype=h.dtype), h, alpha=10.0),
    "rsub": lambda h, m: torch.rsub(h, 1.0, alpha=10.0),
}


@pytest.mark.parametrize("case", list(_ALPHA))
def test_alpha_of_an_add_or_sub_makes_the_bound_no_guarantee(case: str) -> None:
    """``torch.add(x, F(x), alpha=10)`` was judged as the residual block ``x + F(x)``: the
    "guaranteed" bound was 1.5 where the exact Lipschitz constant is 5.4."""
    lip, exact = _checked(_Lambda(_ALPHA[case]), (6,))
    assert not lip["guaranteed"]
    assert any("alpha" in o for o in lip["operations"]), lip["operations"]
    assert exact > min(lip["plain"], lip["residual"])  # the bound ignoring alpha would fail


@pytest.mark.parametrize(
    "fn",
    [
        lambda h, m: torch.add(h, torch.ones(6, dtype=h.dtype), alpha=10.0),  # alpha on a bias
        lambda h, m: torch.add(torch.ones(6, dtype=h.dtype), h, alpha=0.5),
        lambda h, m: h.sub(torch.ones(6, dtype=h.dtype), alpha=-3.0),
    ],
)
def test_alpha_on_a_constant_or_at_most_one_keeps_the_bound_guaranteed(fn) -> None:
    lip, _ = _checked(_Lambda(fn), (6,))
    assert lip["guaranteed"] and lip["operations"] == [], lip


@pytest.mark.parametrize(
    "fn",
    [
        lambda h, m: torch.clamp(h, min=m.other(h)),
        lambda h, m: h.clamp(max=m.other(h)),
        lambda h, m: torch.clamp_min(h, m.other(h)),
    ],
    ids=["clamp_min_kw", "clamp_max_method", "clamp_min"],
)
def test_a_clamp_between_two_activations_makes_the_bound_no_guarantee(fn) -> None:
    """``clamp(a(x), min=b(x))`` is ``max(a(x), b(x))``: allowed unconditionally, it gave a
    "guaranteed" bound 0.18 where the exact Jacobian norm reaches 9.5."""
    model = _Lambda(fn, scale=20.0)
    with torch.no_grad():
        model.other.weight.mul_(0.01)
    lip, exact = _checked(model, (6,))
    assert not lip["guaranteed"]
    assert any("of two activations" in o for o in lip["operations"]), lip["operations"]
    assert exact > lip["plain"]


def test_a_clamp_to_constant_bounds_keeps_the_bound_guaranteed() -> None:
    lip, _ = _checked(
        _Lambda(lambda h, m: torch.clamp(h, min=torch.full_like(h, -0.5)).clamp(max=2.0)), (6,)
    )
    assert lip["guaranteed"] and lip["operations"] == [], lip


def _times_ten(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return out * 10


def _keeps(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
    module.seen = out.detach().abs().amax()  # reads the output, returns nothing


@pytest.mark.parametrize("where", ["module", "global"])
def test_a_forward_hook_rescaling_a_covered_layer_makes_the_bound_no_guarantee(where) -> None:
    """A hook's calls were taken for the trusted Linear's own: ``o * 10`` in its forward hook
    kept a "guaranteed" bound of 0.76 where the exact Jacobian norm reaches 5."""
    model = _Lambda(lambda h, m: torch.relu(h))
    model.inner.scaled = True  # the copy the exact Jacobian is taken of keeps it
    hook = model.inner.register_forward_hook(_times_ten) if where == "module" else None
    glob = nn.modules.module.register_module_forward_hook(
        lambda mod, a, o: _times_ten(mod, a, o) if hasattr(mod, "scaled") else None
    ) if where == "global" else None  # fmt: skip
    try:
        lip, exact = _checked(model, (6,))
    finally:
        for h in (hook, glob):
            if h is not None:
                h.remove()
    assert not lip["guaranteed"]
    assert any(o.startswith("mul in inner") for o in lip["operations"]), lip["operations"]
    assert exact > lip["plain"]


def test_a_forward_hook_that_changes_nothing_keeps_the_bound_guaranteed() -> None:
    model = _Lambda(lambda h, m: torch.relu(h))
    model.inner.register_forward_hook(_keeps)
    model.inner.register_forward_pre_hook(lambda mod, a: None)
    lip, _ = _checked(model, (6,))
    assert lip["guaranteed"] and lip["operations"] == [], lip


@torch.jit.script
def _scripted_ten(x: torch.Tensor) -> torch.Tensor:
    return 10.0 * x


class _Scripted(nn.Module):
    """``out(relu(inner(x)))`` with a ``torch.jit.script`` function ``10 x`` at ``where``."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where, self.inner, self.out = where, nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inner(x))
        if self.where == "middle":
            h = _scripted_ten(h)
        elif self.where == "summed":
            h = h + _scripted_ten(h)
        out = self.out(h)
        return _scripted_ten(out) if self.where == "end" else out


@pytest.mark.parametrize("where", ["middle", "summed", "end"])
def test_a_scripted_function_on_the_data_path_makes_the_bound_no_guarantee(where: str) -> None:
    """TorchScript bypasses ``__torch_function__``: its ``10 x`` and every call after it went
    unseen, and the bound 0.76 stayed "guaranteed" where the exact Jacobian norm reaches 5."""
    lip, exact = _checked(_Scripted(where), (6,))
    assert not lip["guaranteed"]
    assert any("no recorded operation" in o and "torch.jit.script" in o
               for o in lip["operations"]), lip["operations"]  # fmt: skip
    assert exact > lip["plain"]


class _Attributes(nn.Module):
    """Constants kept as plain tensor attributes (no buffers), in a list and a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.out = nn.Linear(6, 6), nn.Linear(6, 3)
        self.scale = torch.full((6,), 0.5, dtype=F64)
        self.shifts = [torch.ones(6, dtype=F64)]
        self.gains = {"out": torch.full((6,), 0.9, dtype=F64)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inner(x)) * self.scale + self.shifts[0]
        return self.out(h * self.gains["out"])


def test_tensor_attributes_of_the_model_keep_the_bound_guaranteed() -> None:
    lip, _ = _checked(_Attributes(), (6,))
    assert lip["guaranteed"] and lip["operations"] == [], lip


def _every_other(h: torch.Tensor) -> torch.Tensor:
    """A mask no activation computes (``arange``: a factory)."""
    return torch.arange(h.shape[-1]) % 2 == 0


def _resampled(h: torch.Tensor, **kw) -> torch.Tensor:
    return nn.functional.interpolate(h.reshape(-1, 1, 2, 3), **kw).reshape(h.shape)


_ONE_LIPSCHITZ = {  # each 1-Lipschitz: the bound must hold and stay guaranteed
    "log_sigmoid": nn.LogSigmoid(),
    "prelu": nn.PReLU(),
    "prelu_channels": nn.PReLU(6, init=-0.9),
    "rrelu_eval": nn.RReLU(),
    "rrelu_upper_0.9": nn.RReLU(0.2, 0.9),
    "maximum": lambda h, m: torch.maximum(h, torch.zeros((), dtype=h.dtype)),
    "minimum": lambda h, m: torch.minimum(h, torch.full_like(h, 0.3)),
    "fmax": lambda h, m: torch.fmax(h, torch.zeros_like(h)),
    "same_size_nearest": lambda h, m: _resampled(h, size=(2, 3)),
    "same_size_bilinear": lambda h, m: _resampled(h, scale_factor=1.0, mode="bilinear"),
    "where": lambda h, m: torch.where(_every_other(h), h, 0.5),
    "where_method": lambda h, m: h.where(_every_other(h), torch.zeros_like(h)),
    "masked_fill": lambda h, m: h.masked_fill(_every_other(h), -2.0),
}


@pytest.mark.parametrize("case", list(_ONE_LIPSCHITZ))
def test_one_lipschitz_operations_keep_the_bound_guaranteed(case: str) -> None:
    """Each was a false alarm: ``log_sigmoid`` (the list spelled ``logsigmoid``), PReLU with
    slope 0.25 listed as not covered, RReLU, ``maximum``, same-size ``interpolate``, and
    ``where``/``masked_fill`` by a constant mask made the bound no guarantee."""
    lip, _ = _checked(_Lambda(_ONE_LIPSCHITZ[case]), (6,))
    assert lip["guaranteed"] and lip["operations"] == [] and lip["uncovered"] == [], lip


_NOT_ONE_LIPSCHITZ_EITHER = {  # op -> what the operations must name
    "prelu_3": (lambda: nn.PReLU(init=3.0), "prelu in act: slope 3"),
    "rrelu_3": (lambda: nn.RReLU(0.5, 3.0), "rrelu in act: slope 3"),
    "maximum_two": (lambda: lambda h, m: torch.maximum(h, m.other(h)), "maximum in <root>"),
    "interpolate_1.1": (lambda: lambda h, m: nn.functional.interpolate(  # 6 -> 6, not the identity
        h.reshape(-1, 1, 6), scale_factor=1.1).reshape(h.shape), "interpolate in <root>: resample"),
    "interpolate_2x": (lambda: lambda h, m: nn.functional.interpolate(
        h.reshape(-1, 1, 6), scale_factor=2.0).reshape(-1, 2, 6).sum(1) * 0.5,
        "interpolate in <root>: output 2x the size of its input: Lipschitz constant at least 1.41"),
    "where_data_mask": (lambda: lambda h, m: torch.where(h > 0, h, 1.0), "where in <root>: a mask"),
    "where_two": (lambda: lambda h, m: torch.where(_every_other(h), h, m.other(h)),
                  "where in <root>: entries of 2 activations"),
    "masked_fill_broadcast": (lambda: lambda h, m: h[:, :1].masked_fill(_every_other(h), 0.0),
                              "masked_fill in <root>: repeats entries 6x"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(_NOT_ONE_LIPSCHITZ_EITHER))
def test_the_same_operations_with_other_arguments_stay_no_guarantee(case: str) -> None:
    build, named = _NOT_ONE_LIPSCHITZ_EITHER[case]
    lip, _ = _checked(_Lambda(build()), (6,))
    assert not lip["guaranteed"]
    assert any(o.startswith(named) for o in lip["operations"]), lip["operations"]


class _Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.out = nn.Linear(6, 6), nn.Linear(6, 3)
        self.spare, self.spare_norm = nn.Conv2d(2, 2, 3), nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inner(x)))


def test_modules_the_forward_never_calls_are_not_listed_as_not_covered() -> None:
    """An unused Conv2d (no input shape, so no norm) was "not covered": no guarantee."""
    lip, _ = _checked(_Unused(), (6,))
    assert lip["guaranteed"] and lip["uncovered"] == [], lip


# ----------------------------------------------------------------------------- review12b


@dataclasses.dataclass
class _Record:
    x: torch.Tensor
    y: torch.Tensor


class _Plain:
    """A user's batch class (no dataclass): its tensors are attributes."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y


class _ReadsField(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, batch) -> torch.Tensor:
        return self.b(torch.relu(self.a(batch.x)))


@pytest.mark.parametrize("kind", [_Record, _Plain], ids=["dataclass", "object"])
def test_a_batch_object_read_by_the_model_keeps_the_bound_guaranteed(kind) -> None:
    """``model(batch)`` reading ``batch.x``: its tensor was taken for one no recorded operation
    made ("a torch.jit.script function ... or a global"), and the bound lost its guarantee."""
    torch.manual_seed(0)
    model = _ReadsField().double().eval()
    x, y = torch.randn(8, 6, dtype=F64), torch.randn(8, 3, dtype=F64)
    lip = diagnose(
        model, [kind(x, y)], lambda m, b: ((m(b) - b.y) ** 2).mean(), generator=0,
        gradients=False,
    ).meta["lipschitz"]  # fmt: skip
    own = copy.deepcopy(model)
    exact = max(
        _jacobian_norm(lambda v: own(kind(v.reshape(1, 6), y[:1])).reshape(-1), x[i])
        for i in range(5)
    )
    assert lip["guaranteed"] and lip["operations"] == [], lip
    assert exact <= lip["plain"] * (1 + 1e-9)


def _floor(h: torch.Tensor) -> torch.Tensor:
    return torch.full((1, 6), -1e9, dtype=h.dtype)


_BROADCAST_BOUNDS = {  # one entry of the activation against a (1, 6) constant: repeated 6x
    "maximum": lambda h, m: torch.maximum(h[:, :1], _floor(h)),
    "clamp_min": lambda h, m: torch.clamp(h[:, :1], min=_floor(h)),
    "max": lambda h, m: torch.max(h[:, :1], _floor(h)),
    "fmin": lambda h, m: torch.fmin(h[:, :1], -_floor(h)),
}


@pytest.mark.parametrize("case", list(_BROADCAST_BOUNDS))
def test_max_or_clamp_by_a_broadcasting_constant_makes_the_bound_no_guarantee(case: str) -> None:
    """``maximum(h[:, :1], c)``, ``c`` of shape (1, 6), repeats the entry 6 times (Lipschitz
    constant sqrt(6)): it was taken as 1-Lipschitz, a "guaranteed" bound below the exact norm."""
    model = _Lambda(_BROADCAST_BOUNDS[case])
    with torch.no_grad():
        model.out.weight.fill_(1.0)
    lip, exact = _checked(model, (6,))
    assert not lip["guaranteed"]
    assert any(
        "repeats entries 6x: Lipschitz constant up to 2.45" in o for o in lip["operations"]
    ), lip["operations"]
    assert exact > lip["plain"]


def _set_3i(model: nn.Module) -> nn.Module:
    """inner = I, other = 3I, out = the first 3 rows of I, no biases: exact norms by hand."""
    with torch.no_grad():
        model.inner.weight.copy_(torch.eye(6))
        model.other.weight.copy_(3 * torch.eye(6))
        model.out.weight.copy_(torch.eye(6)[:3])
        for layer in (model.inner, model.other, model.out):
            layer.bias.zero_()
    return model


_LAYER_WEIGHT_REUSED = {  # a covered layer's weight applied other than as the bound counts it
    "addmm_alpha": (lambda h, m: torch.addmm(m.other.bias, h, m.other.weight.t(), alpha=10.0),
                    "addmm in <root>: a linear map scaled by alpha = 10"),
    "addmm_alpha_both": (lambda h, m: m.other(torch.addmm(m.other.bias, h, m.other.weight.t(),
                                                          alpha=10.0)), "addmm in <root>"),
    "weight_x10": (lambda h, m: m.other(nn.functional.linear(h, m.other.weight * 10,
                                                             m.other.bias)),
                   "linear in <root>: a linear map of a weight that is no layer's parameter"),
    "applied_twice": (lambda h, m: nn.functional.linear(m.other(h), m.other.weight, m.other.bias),
                      "linear in <root>: applies other's weight 2 time(s) per forward, where the "
                      "bound counts its norm 1 time(s)"),
    "by_parent_only": (lambda h, m: nn.functional.linear(h, m.other.weight, m.other.bias),
                       "linear in <root>: applies other's weight 1 time(s) per forward, where the "
                       "bound counts its norm 0 time(s)"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(_LAYER_WEIGHT_REUSED))
def test_a_covered_layers_weight_reused_makes_the_bound_no_guarantee(case: str) -> None:
    """A linear map of a covered layer's weight passed as "the layer" whatever it did: alpha=10
    of addmm, ``W * 10`` (found through the bias), ``W`` applied twice (3I: bound 3, exact 9),
    or by the parent while the layer never runs (left out of the bound: bound 1, exact 3)."""
    fn, named = _LAYER_WEIGHT_REUSED[case]
    lip, exact = _checked(_set_3i(_Lambda(fn)), (6,))
    assert not lip["guaranteed"]
    assert any(o.startswith(named) for o in lip["operations"]), lip["operations"]
    assert exact > lip["plain"] * (1 + 1e-6)


class _OwnLinear(nn.Linear):
    """A Linear whose forward is the user's, applying its own weight once per call."""

    def __init__(self, *a, how: str) -> None:
        super().__init__(*a)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "addmm":
            return torch.addmm(self.bias, x, self.weight.t())
        return nn.functional.linear(x, self.weight, self.bias)


@pytest.mark.parametrize("how", ["linear", "addmm"])
def test_a_layer_applying_its_own_weight_once_keeps_the_bound_guaranteed(how: str) -> None:
    model = nn.Sequential(_OwnLinear(6, 6, how=how), nn.ReLU(), _OwnLinear(6, 3, how=how))
    lip, _ = _checked(model, (6,))
    assert lip["guaranteed"] and lip["operations"] == [], lip


@pytest.mark.parametrize("root", ["sequential", "linear"])
def test_a_forward_pre_hook_on_the_model_itself_makes_the_bound_no_guarantee(root: str) -> None:
    """The model's own pre-hook ran before the recorder's, outside the model: ``x * 10`` there
    went unjudged (guaranteed bound 0.81 where the exact Jacobian norm reaches 4.9)."""
    torch.manual_seed(0)
    layers = [nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3)]
    model = nn.Sequential(*layers) if root == "sequential" else nn.Linear(6, 3)
    model.register_forward_pre_hook(lambda mod, args: (args[0] * 10,))
    lip, exact = _checked(model, (6,))
    assert not lip["guaranteed"]
    assert any(o.startswith("mul in <root>: a factor 10") for o in lip["operations"]), lip
    assert exact > lip["plain"]


def test_a_forward_pre_hook_on_the_model_that_changes_nothing_keeps_the_bound() -> None:
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3))
    model.register_forward_pre_hook(lambda mod, args: (args[0].reshape(args[0].shape),))
    lip, _ = _checked(model, (6,))
    assert lip["guaranteed"] and lip["operations"] == [], lip


def _wrap_forward(layer: nn.Module, factor: float) -> None:
    """Replace ``layer.forward`` on the instance (accelerate's ``add_hook_to_module`` does)."""
    inner = layer.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        return factor * inner(x)

    layer.forward = forward


def test_a_layer_whose_forward_is_replaced_on_the_instance_is_not_trusted() -> None:
    """``layer.forward = wrapper`` multiplying by 10 ran inside a "trusted" Linear: guaranteed
    bound 0.79 where the exact Jacobian norm reaches 5.1."""
    model = _Lambda(lambda h, m: torch.relu(h))
    _wrap_forward(model.inner, 10.0)
    lip, exact = _checked(model, (6,))
    assert not lip["guaranteed"]
    assert any(o.startswith("mul in inner: a factor 10") for o in lip["operations"]), lip
    assert exact > lip["plain"]


def test_a_layer_whose_forward_is_wrapped_without_change_keeps_the_bound() -> None:
    model = _Lambda(lambda h, m: torch.relu(h))
    _wrap_forward(model.inner, 1.0)
    lip, _ = _checked(model, (6,))
    assert lip["guaranteed"] and lip["operations"] == [], lip


@pytest.mark.parametrize("form", ["keywords", "positional"])
def test_a_constant_divided_by_an_activation_makes_the_bound_no_guarantee(form: str) -> None:
    """``torch.div(input=c, other=h)`` read no positional argument: taken as a division by 1,
    guaranteed bound 0.59 where the exact Jacobian norm reaches 31."""

    def divide(h: torch.Tensor, m: nn.Module) -> torch.Tensor:
        c, d = torch.ones(6, dtype=h.dtype), h.abs() + 0.05
        return torch.div(input=c, other=d) if form == "keywords" else torch.div(c, d)

    lip, exact = _checked(_Lambda(divide), (6,))
    assert not lip["guaranteed"]
    assert any(o.startswith("div in <root>: a constant divided by an activation")
               for o in lip["operations"]), lip["operations"]  # fmt: skip
    assert exact > lip["plain"]


def test_an_activation_divided_by_a_constant_by_keyword_keeps_the_bound() -> None:
    lip, _ = _checked(_Lambda(lambda h, m: torch.div(input=h, other=2.0)), (6,))
    assert lip["guaranteed"] and lip["operations"] == [], lip


def test_dropout_with_p_1_is_the_zero_map_and_keeps_the_counts() -> None:
    """``F.dropout(h, p=1.0, training=True)`` raised ZeroDivisionError in the watch: the
    forward that counts the calls "failed", the operations unchecked."""
    model = _Lambda(lambda h, m: nn.functional.dropout(h, p=1.0, training=True))
    lip, exact = _checked(model, (6,))
    assert exact == 0.0
    assert lip["guaranteed"] and lip["operations"] == [], lip
    assert not any("failed" in n for n in lip["notes"]), lip["notes"]


class _DividedByBuffer(_Lambda):
    def __init__(self) -> None:
        super().__init__(lambda h, m: torch.nan_to_num(h / m.d, posinf=0.0, neginf=0.0))
        self.register_buffer("d", torch.tensor([1.0, 2.0, 0.0, 1.0, 1.0, 1.0]))


def test_a_division_by_a_constant_holding_0_is_named_not_a_crash() -> None:
    """``h / d`` with a 0 in ``d`` raised ZeroDivisionError in the watch (1 / min |d|)."""
    torch.manual_seed(0)
    model = _DividedByBuffer().double().eval()
    lip = _lipschitz(model, torch.randn(8, 6, dtype=F64), gradients=False)
    assert not lip["guaranteed"]
    assert any(o.startswith("div in <root>: a factor inf") for o in lip["operations"]), lip
    assert not any("failed" in n for n in lip["notes"]), lip["notes"]
