"""diagnose()'s Lipschitz bound (``meta["lipschitz"]``) on forwards whose recorded operations
hide a factor (in-place writes, subclassed layers, values read out of torch, ...): a bound
claimed guaranteed must hold against the exact float64 Jacobian spectral norm
(``torch.autograd.functional.jacobian``) at several inputs."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

from initlab.diagnostics import diagnose

F64 = torch.float64


def _square_mean(model: nn.Module, batch) -> torch.Tensor:
    return (model(batch[0]) ** 2).mean()


def _exact(model: nn.Module, x: torch.Tensor, scales=(1.0, 10.0, 0.01, 100.0, 1000.0)) -> float:
    """``max ||J(s x)||_2`` over the scales ``s`` (and a second random point)."""
    model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    points = [s * x for s in scales] + [3 * torch.randn(x.shape, dtype=F64, generator=g)]
    best = 0.0
    for v in points:
        jac = torch.autograd.functional.jacobian(
            lambda u: model(u.reshape(x.shape)).reshape(-1), v.reshape(-1).clone()
        )
        best = max(best, float(torch.linalg.matrix_norm(jac.reshape(-1, x.numel()), ord=2)))
    return best


def _run(model: nn.Module, x: torch.Tensor, **kw) -> tuple[dict, float, float]:
    """``(meta["lipschitz"], its bound, the exact norm)``; a guaranteed bound must hold."""
    lip = diagnose(model, [(x,)], _square_mean, generator=0).meta["lipschitz"]
    bound = lip["residual"] if math.isfinite(lip["residual"]) else lip["plain"]
    exact = _exact(model, x, **kw)
    assert not lip["guaranteed"] or exact <= bound * (1 + 1e-9), (exact, bound, lip)
    return lip, bound, exact


class _Two(nn.Module):
    """``b(fn(a(x)))`` with ``a`` the identity and ``b`` of norm 1 (4 -> 1)."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn, self.a, self.b = fn, nn.Linear(4, 4, bias=False), nn.Linear(4, 1, bias=False)
        with torch.no_grad():
            self.a.weight.copy_(torch.eye(4))
            self.b.weight.fill_(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.fn(self.a(x)))


def _x() -> torch.Tensor:
    return torch.randn(3, 4, dtype=F64, generator=torch.Generator().manual_seed(0))


def _repeat_first(h: torch.Tensor) -> torch.Tensor:
    h = h.clone()
    h[:, 1] = h[:, 0]
    h[:, 2] = h[:, 0]
    h[:, 3] = h[:, 0]
    return h


def _into_zeros_then_10(h: torch.Tensor) -> torch.Tensor:
    y = torch.zeros_like(h)
    y[:] = h
    return 10 * y


def _into_a_view_then_10(h: torch.Tensor) -> torch.Tensor:
    y = torch.zeros(h.shape[0], 8, dtype=h.dtype)
    y[:, :4].copy_(h)
    return 10 * y[:, 4:] + 10 * y[:, :4]


def test_in_place_writes_of_activations_are_judged() -> None:
    """``h[:, 1] = h[:, 0]`` (returns None, never recorded) repeats entries; ``y[:] = h`` into a
    fresh tensor took every later op (a factor 10) off the data path: guaranteed, bound 1."""
    for fn in (_repeat_first, _into_zeros_then_10, _into_a_view_then_10):
        lip, bound, exact = _run(_Two(fn).double(), _x())
        assert exact > bound * 1.5, fn.__name__
        assert not lip["guaranteed"] and lip["operations"], (fn.__name__, lip)


def _sibling_view_then_10(h: torch.Tensor) -> torch.Tensor:
    buf = torch.zeros(h.shape[0], 8, dtype=h.dtype)
    v = buf.view(h.shape[0], 2, 4)
    buf[:, :4] = h
    return 10 * v[:, 0]


def _view_of_target_then_10(h: torch.Tensor) -> torch.Tensor:
    y = torch.zeros_like(h)
    v = y[:]
    y.copy_(h)
    return 10 * v


def _nested_view_then_10(h: torch.Tensor) -> torch.Tensor:
    buf = torch.zeros(h.shape[0], 8, dtype=h.dtype)
    a = buf[:, :4]
    a[:, :4].copy_(h)
    return 10 * a


def _view_made_before_then_relu(h: torch.Tensor) -> torch.Tensor:
    y = torch.zeros_like(h)
    v = y[:, :]
    y.copy_(h)
    return torch.relu(v)


def _untouched_half_then_2(h: torch.Tensor) -> torch.Tensor:
    buf = torch.zeros(h.shape[0], 8, dtype=h.dtype)
    v = buf[:, 4:]  # the half no write touches: it stays 0
    buf[:, :4].copy_(h)
    return buf[:, :4] + 2 * v


def test_a_view_of_a_region_no_write_touches_stays_a_constant() -> None:
    """A view made before a write into another region of the same buffer (``buf[:, 4:]`` beside
    ``buf[:, :4].copy_(h)``, interleaved in memory) was taken for the write: ``2 * v`` was
    judged as a factor 2 on the data path, a false alarm for an output that is ``h`` exactly."""
    lip, bound, exact = _run(_Two(_untouched_half_then_2).double(), _x())
    assert lip["guaranteed"] and lip["operations"] == [], lip
    assert bound == pytest.approx(exact, rel=1e-9)


def test_views_made_before_an_in_place_write_hold_what_was_written() -> None:
    """A view of a tensor taken before an in-place write into the same storage (a sibling view,
    a view of the target, the view a slice of the target was cut from) holds the written
    activation: ``10 * v`` is on the data path (it was read as a constant: guaranteed, bound 1,
    exact 10); a 1-Lipschitz op on such a view keeps the bound."""
    for fn in (_sibling_view_then_10, _view_of_target_then_10, _nested_view_then_10):
        lip, bound, exact = _run(_Two(fn).double(), _x())
        assert exact > bound * 1.5, fn.__name__
        assert not lip["guaranteed"] and lip["operations"], (fn.__name__, lip)
        assert any("10" in op for op in lip["operations"]), (fn.__name__, lip)
    lip, _, _ = _run(_Two(_view_made_before_then_relu).double(), _x())
    assert lip["guaranteed"] and lip["operations"] == [], lip


def _copied(h: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(h)
    y.copy_(h)
    z = torch.zeros_like(h)
    z[:, :2] = h[:, 2:]
    return y + 0.0, z


def test_writing_one_activation_over_a_fresh_tensor_keeps_the_bound() -> None:
    """``y.copy_(h)`` and ``y[:] = h`` of a fresh ``y`` are 1-Lipschitz (``copy_`` was a false
    alarm)."""
    lip, _, _ = _run(_Two(lambda h: _copied(h)[0]).double(), _x())
    assert lip["guaranteed"] and lip["operations"] == [], lip
    lip, _, _ = _run(_Two(lambda h: _copied(h)[1]).double(), _x())
    assert lip["guaranteed"] and lip["operations"] == [], lip


class _ScaledConv(nn.Conv1d):
    """Keeps torch's forward, overrides the helper it calls."""

    def _conv_forward(self, input, weight, bias):
        return super()._conv_forward(10 * input, weight, bias)


class _ScalingBN(nn.BatchNorm1d):
    def _check_input_dim(self, input) -> None:
        input.mul_(10)


def test_a_subclass_of_a_torch_layer_overriding_a_helper_is_not_trusted() -> None:
    torch.manual_seed(0)
    conv = nn.Sequential(_ScaledConv(2, 2, 3, padding=1), nn.ReLU(), nn.Conv1d(2, 1, 1))
    bn = nn.Sequential(nn.Linear(4, 4), _ScalingBN(4), nn.Linear(4, 2))
    for model, x in ((conv, torch.randn(2, 2, 8, dtype=F64)), (bn, torch.randn(3, 4, dtype=F64))):
        lip, bound, exact = _run(model.double().eval(), x)
        assert exact > bound * 1.5
        assert not lip["guaranteed"] and any("factor 10" in o for o in lip["operations"]), lip


class _TwoSizes(nn.Module):
    """One convolution at width 1 (only its centre tap acts: norm 0.2), then at width 9."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv1d(1, 1, 3, padding=1, bias=False)
        with torch.no_grad():
            self.c.weight.copy_(torch.tensor([[[1.0, 0.2, 1.0]]]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(nn.functional.pad(self.c(x), (4, 4)))


def test_a_convolution_called_at_two_input_sizes_makes_the_bound_no_guarantee() -> None:
    lip, bound, exact = _run(_TwoSizes().double(), torch.randn(2, 1, 1, dtype=F64))
    assert exact > bound * 1.5
    assert not lip["guaranteed"], lip
    assert any("several input sizes: c" in n for n in lip["notes"]), lip["notes"]


def _times_item(h: torch.Tensor) -> torch.Tensor:
    return h * h.abs().amax().item()


def _times_long(h: torch.Tensor) -> torch.Tensor:
    return h * (h.abs().amax().to(torch.long) + 1)


def _branch(h: torch.Tensor) -> torch.Tensor:
    return h * 100 if float(h.detach().abs().amax()) > 5 else h


def _allclose_branch(h: torch.Tensor) -> torch.Tensor:
    return h if torch.allclose(h, h.clamp(-5, 5)) else 100 * h


def _equal_branch(h: torch.Tensor) -> torch.Tensor:
    return h if torch.equal(h, h.clamp(-5, 5)) else 100 * h


def test_values_read_out_of_the_data_make_the_bound_no_guarantee() -> None:
    """Recorded at a small input, ``h * max|h|`` looks like a product by a constant below 1; a
    branch on ``torch.allclose``/``torch.equal`` of the data reads a bool as ``float(h)`` does."""
    x = 0.01 * torch.randn(3, 4, dtype=F64, generator=torch.Generator().manual_seed(0))
    for fn in (_times_item, _times_long, _branch, _allclose_branch, _equal_branch):
        lip, bound, exact = _run(_Two(fn).double(), x)
        assert exact > bound * 1.5, fn.__name__
        assert not lip["guaranteed"], (fn.__name__, lip)
        assert any("reads a value of the data" in o for o in lip["operations"]), lip


def test_celu_with_alpha_below_0_makes_the_bound_no_guarantee() -> None:
    """``celu`` has slope ``exp(x / alpha)`` below 0: unbounded for ``alpha < 0``."""
    lip, bound, exact = _run(_Two(nn.CELU(alpha=-1.0)).double(), _x(), scales=(1.0, 3.0))
    assert exact > bound * 1.5
    assert not lip["guaranteed"] and any("celu" in o for o in lip["operations"]), lip


def test_softplus_with_a_low_threshold_steps_and_makes_the_bound_no_guarantee() -> None:
    """``softplus(x, threshold=0)`` is ``x`` above 0 and ``log(1 + exp(x))`` below: a step of
    ``log 2`` at 0, so two inputs on either side of it give a quotient far above the bound."""
    model = _Two(nn.Softplus(threshold=0.0)).double()
    lip = diagnose(model, [(_x(),)], _square_mean, generator=0).meta["lipschitz"]
    lo, hi = torch.full((1, 4), -1e-4, dtype=F64), torch.full((1, 4), 1e-4, dtype=F64)
    with torch.no_grad():
        quotient = float((model(hi) - model(lo)).norm() / (hi - lo).norm())
    assert quotient > 10 * lip["plain"]
    assert not lip["guaranteed"] and any("softplus" in o for o in lip["operations"]), lip


def test_celu_and_softplus_with_safe_arguments_keep_the_bound() -> None:
    for act in (nn.CELU(0.1), nn.Softplus(), nn.Softplus(beta=-2.0)):
        lip, _, _ = _run(_Two(act).double(), _x())
        assert lip["guaranteed"] and lip["operations"] == [], (act, lip)


class _Rsub(nn.Module):
    def __init__(self, alpha: float) -> None:
        super().__init__()
        self.alpha, self.a, self.b = alpha, nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.rsub(input=self.a(x), other=1.0, alpha=self.alpha))


def test_rsub_with_keyword_arguments_is_judged_not_a_crash() -> None:
    """``torch.rsub(input=h, other=c, alpha=a)`` is ``c - a h``: it raised IndexError inside the
    watch, so the call counts were lost and the operations left unchecked."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, dtype=F64)
    report = diagnose(_Rsub(0.5).double(), [(x,)], _square_mean, generator=0)
    assert not any("failed" in n for n in report.meta["notes"]), report.meta["notes"]
    lip, _, _ = _run(_Rsub(0.5).double(), x)
    assert lip["guaranteed"] and lip["operations"] == [], lip
    lip, bound, exact = _run(_Rsub(20.0).double(), x)
    assert exact > bound * 1.5
    assert not lip["guaranteed"] and any("alpha = 20" in o for o in lip["operations"]), lip


def test_softmin_keeps_the_bound() -> None:
    """``softmin(x) = softmax(-x)`` is 1-Lipschitz (it was a false alarm)."""
    lip, _, _ = _run(_Two(nn.Softmin(dim=1)).double(), _x())
    assert lip["guaranteed"] and lip["operations"] == [], lip


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class _OwnCall(_Plain):
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return super().__call__(10 * x)


def test_what_runs_before_the_model_is_entered_makes_the_bound_no_guarantee() -> None:
    """A global forward pre-hook on the model and a class overriding ``__call__`` scale the
    input by 10 before the recorder enters the model: those calls were taken as the loss's."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, dtype=F64)
    plain = _Plain().double()
    handle = nn.modules.module.register_module_forward_pre_hook(
        lambda m, a: (a[0] * 10,) if type(m) is _Plain else None
    )
    try:
        lip, bound, exact = _run(plain, x)
    finally:
        handle.remove()
    assert exact > bound * 1.5
    assert not lip["guaranteed"] and any("global forward pre-hooks" in o for o in lip["operations"])
    torch.manual_seed(0)
    lip, bound, exact = _run(_OwnCall().double(), x)
    assert exact > bound * 1.5
    assert not lip["guaranteed"] and any("overrides __call__" in o for o in lip["operations"])


class _Times10(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 10 * w


class _ScaledInput(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(10 * x)


def _parametrized(layer: nn.Linear, how) -> nn.Module:
    """``Linear(8, 2)(relu(layer(x)))`` with ``layer``'s weight parametrized by ``how``."""
    if isinstance(how, nn.Module):
        parametrize.register_parametrization(layer, "weight", how)
    else:
        layer = how(layer)
    return nn.Sequential(layer, nn.ReLU(), nn.Linear(8, 2)).double()


def test_parametrized_layers_are_covered_by_their_computed_weight() -> None:
    """A Linear under ``weight_norm``, ``spectral_norm`` (eval mode) or a parametrization of
    one's own (``10 * W``) applies the computed weight the bound takes the norm of: guaranteed
    (they were listed as not covered, their linear map as one of a derived weight). A
    ``spectral_norm`` in training mode moves its weight on each forward (not guaranteed, the
    advice ``model.eval()``); a subclass of Linear under a parametrization is no torch layer."""
    torch.manual_seed(0)
    x = torch.randn(6, 4, dtype=F64)
    for how in (weight_norm, _Times10(), spectral_norm):
        model = _parametrized(nn.Linear(4, 8), how).eval()
        lip, bound, exact = _run(model, x)
        assert lip["guaranteed"] and not lip["uncovered"] and lip["operations"] == [], (how, lip)
        assert bound < 3 * exact, (how, bound, exact)
    lip, _, _ = _run(_parametrized(nn.Linear(4, 8), spectral_norm).train(), x)
    assert not lip["guaranteed"] and "model.eval()" in lip["operations"][0], lip
    lip, bound, exact = _run(_parametrized(_ScaledInput(4, 8), _Times10()), x)
    assert not lip["guaranteed"] and exact > 1.5 * bound, (lip, bound, exact)


class _Complex(nn.Module):
    """``head(|fn(i x)|)``: a frozen complex Linear of weight ``i I`` (norm 1), ``fn``, the
    modulus (1-Lipschitz from C^n to R^n), a real head of norm 1 reading the first entry."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn
        self.a = nn.Linear(4, 4, bias=False, dtype=torch.complex128).requires_grad_(False)
        self.b = nn.Linear(4, 1, bias=False, dtype=F64)
        with torch.no_grad():
            self.a.weight.copy_(1j * torch.eye(4, dtype=torch.complex128))
            self.b.weight.copy_(torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=F64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.fn(self.a(x.to(torch.complex128))).abs())


def test_tanh_and_sigmoid_of_a_complex_tensor_make_the_bound_no_guarantee() -> None:
    """tanh, sigmoid and tanhshrink were taken as 1-Lipschitz whatever their argument: of a
    complex one they have poles (tanh(i t) = i tan t), so at t = 0.999 pi / 2 the model's
    Jacobian norm is 4e5 under a 'guaranteed' bound of 1."""
    x = torch.zeros(2, 4, dtype=F64)  # two examples: the probe takes variances
    x[0, 0], x[1, 0] = 0.999 * math.pi / 2, 0.3
    for fn in (torch.tanh, nn.Tanhshrink()):
        lip, bound, exact = _run(_Complex(fn), x, scales=(1.0,))
        assert exact > 1e4 * bound
        assert not lip["guaranteed"] and any("of a complex tensor" in o for o in lip["operations"])
    x[0, 0] = 0.999 * math.pi  # sigmoid(i t) = 1 / (1 + exp(-i t)): a pole at t = pi
    lip, bound, exact = _run(_Complex(torch.sigmoid), x, scales=(1.0,))
    assert exact > 1e2 * bound and not lip["guaranteed"], lip


def test_a_complex_linear_and_the_modulus_keep_the_bound() -> None:
    """The modulus and the real-to-complex cast are 1-Lipschitz: the bound is the complex
    weight's norm (that of the real 8 x 8 matrix [[Re W, -Im W], [Im W, Re W]]) times the
    head's."""
    model = _Complex(lambda z: z)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.a.weight.copy_(torch.randn(4, 4, dtype=torch.complex128, generator=g))
        model.b.weight.copy_(torch.randn(1, 4, dtype=F64, generator=g))
    w = model.a.weight.detach()
    realified = torch.cat([torch.cat([w.real, -w.imag], 1), torch.cat([w.imag, w.real], 1)])
    expected = float(torch.linalg.matrix_norm(realified, ord=2)) * float(
        model.b.weight.detach().norm()
    )
    lip, bound, _ = _run(model, _x())
    assert lip["guaranteed"] and lip["operations"] == [], lip
    assert bound == pytest.approx(expected, rel=1e-12)


class _Functional(nn.Module):
    """A torch layer run by ``torch.func.functional_call`` with ``swap(layer)`` as its tensors
    (a hypernetwork's or a meta-learning step's pattern), then a Linear of norm 1."""

    def __init__(self, layer: nn.Module, swap) -> None:
        super().__init__()
        self.layer, self.swap, self.b = layer, swap, nn.Linear(4, 1, bias=False)
        with torch.no_grad():
            self.b.weight.fill_(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.func.functional_call(self.layer, self.swap(self.layer), (x,)))


def _eye_linear() -> nn.Linear:
    lin = nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(4))
    return lin


def _eval_bn() -> nn.BatchNorm1d:
    bn = nn.BatchNorm1d(4).eval()
    with torch.no_grad():
        bn.running_var.fill_(1.0)
    return bn


def test_a_torch_layer_run_with_another_weight_makes_the_bound_no_guarantee() -> None:
    """``functional_call(lin, {"weight": 10 * lin.weight}, (x,))`` runs torch's own Linear, whose
    calls were trusted without a look at the weight they applied: guaranteed, bound 1, exact 10.
    The same for a running variance swapped into an eval-mode BatchNorm. With the layer's own
    tensors it keeps the bound."""
    for layer, swap in (
        (_eye_linear(), lambda m: {"weight": 10 * m.weight}),
        (_eval_bn(), lambda m: {"running_var": 0.01 * m.running_var}),
    ):
        lip, bound, exact = _run(_Functional(layer, swap).double().eval(), _x())
        assert exact > bound * 5, (layer, exact, bound)
        assert not lip["guaranteed"], (layer, lip)
        assert any("layer:" in o and "own" in o for o in lip["operations"]), lip
    for layer in (_eye_linear(), _eval_bn()):
        own = _Functional(layer, lambda m: dict(m.named_parameters())).double().eval()
        lip, _, _ = _run(own, _x())
        assert lip["guaranteed"] and lip["operations"] == [], (layer, lip)


def _expanded_before_write(h: torch.Tensor) -> torch.Tensor:
    y = torch.zeros(1, 4, dtype=h.dtype)
    v = y.expand(3, 4)  # made while y holds constants
    y.copy_(h[:1])
    return v


def _strided_before_write(h: torch.Tensor) -> torch.Tensor:
    y = torch.zeros(4, dtype=h.dtype)
    v = y.as_strided((3, 4), (0, 1))
    y.copy_(h[0])
    return v


def _overlapping_before_write(h: torch.Tensor) -> torch.Tensor:
    y = torch.zeros(6, dtype=h.dtype)
    v = y.as_strided((3, 4), (1, 1))  # rows overlap: y[0:4], y[1:5], y[2:6]
    y[:4].copy_(h[0])
    return v


class _Last(nn.Module):
    """``fn(a(x))``: ``fn``'s result is the model's output, read only by the loss."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn, self.a = fn, _eye_linear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self.a(x))


def test_a_view_repeating_entries_made_before_a_write_is_judged() -> None:
    """``v = y.expand(3, 4)`` (or an ``as_strided`` view repeating entries) of a constant ``y``,
    then ``y.copy_(h[:1])``: ``v`` repeats ``h[0]`` 3 times (Lipschitz constant sqrt(3)), and
    nothing judged the repetition (guaranteed, bound 1). Read by a layer or as the output."""
    for fn in (_expanded_before_write, _strided_before_write, _overlapping_before_write):
        for model in (_Two(fn), _Last(fn)):
            lip, bound, exact = _run(model.double(), _x())
            assert exact > bound * 1.2, (fn.__name__, exact, bound)
            assert not lip["guaranteed"], (fn.__name__, lip)
            assert any("repeats entries" in o for o in lip["operations"]), lip


def test_prelu_with_a_slope_computed_from_the_data_makes_the_bound_no_guarantee() -> None:
    """``F.prelu(h, 0.01 * h[0])`` is a product of two activations; its slope was read from the
    recorded values (below 1 there): guaranteed, bound 1, exact 2.3 at 100 x and unbounded. A
    PReLU's own slope (a parameter) keeps the bound."""
    lip, bound, exact = _run(_Two(lambda h: nn.functional.prelu(h, 0.01 * h[0])).double(), _x())
    assert exact > bound * 1.5, (exact, bound)
    assert not lip["guaranteed"] and any("prelu" in o for o in lip["operations"]), lip
    lip, _, _ = _run(_Two(nn.PReLU(4, init=-0.5)).double(), _x())
    assert lip["guaranteed"] and lip["operations"] == [], lip


_STEPS = {
    "div": lambda h: torch.div(h, 1.0, rounding_mode="floor"),
    "div_": lambda h: h.clone().div_(2.0, rounding_mode="trunc"),
    "__floordiv__": lambda h: h.detach() // 2,  # no derivative: the backward would raise
    "floor_divide": lambda h: torch.floor_divide(h.detach(), 2),
    "round": torch.round,
    "floor": torch.floor,
    "ceil": torch.ceil,
    "trunc": torch.trunc,
    "frac": torch.frac,
    "sign": torch.sign,
    "fmod": lambda h: torch.fmod(h, 1.5),
    "remainder": lambda h: h % 1.5,
}


def test_step_functions_make_the_bound_no_guarantee() -> None:
    """``torch.div(h, 1, rounding_mode="floor")`` was judged as a division by 1 (guaranteed,
    bound 1); it jumps by 1 at each integer, as a rounding, a sign or a remainder does: not
    Lipschitz, each named. Its Jacobian is 0 almost everywhere, so the check is a difference
    quotient across a jump (``1 - 1e-7`` to ``1``).
    Without ``rounding_mode`` the division keeps the bound."""
    for name, fn in _STEPS.items():
        model = _Two(fn).double()
        lip = diagnose(model, [(_x(),)], _square_mean, generator=0).meta["lipschitz"]
        assert not lip["guaranteed"], (name, lip)
        assert any(o.startswith(f"{name} in") and "step" in o for o in lip["operations"]), lip
    lo, hi = torch.full((1, 4), 1 - 1e-7, dtype=F64), torch.full((1, 4), 1.0, dtype=F64)
    with torch.no_grad():
        model = _Two(_STEPS["div"]).double()
        assert float((model(hi) - model(lo)).norm() / (hi - lo).norm()) > 1e6
    lip, _, _ = _run(_Two(lambda h: torch.div(h, 2.0, rounding_mode=None)).double(), _x())
    assert lip["guaranteed"] and lip["operations"] == [], lip


def _quotient(model: nn.Module, lo: torch.Tensor, hi: torch.Tensor) -> float:
    """``|f(hi) - f(lo)| / |hi - lo|``: the forward's own values, where autograd sees nothing
    (a copy that leaves the graph has Jacobian 0, yet its values move)."""
    with torch.no_grad():
        return float((model(hi) - model(lo)).norm() / (hi - lo).norm())


def _out_into_view(h: torch.Tensor) -> torch.Tensor:
    buf = torch.zeros(h.shape[0], 4, dtype=h.dtype)
    with torch.no_grad():
        torch.abs(h, out=buf[:])
    return 10 * buf


def _data_set(h: torch.Tensor) -> torch.Tensor:
    v = torch.zeros_like(h)
    v.data = h
    return 10 * v


_COPIES = {
    "torch.tensor": lambda h: 10 * torch.tensor(h),
    "new_tensor": lambda h: 10 * h.new_tensor(h),
    ".data =": _data_set,
    "nn.Parameter": lambda h: 10 * nn.Parameter(h),
    "out=": _out_into_view,
}


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")
def test_copies_and_aliases_of_an_activation_stay_on_the_data_path() -> None:
    """``torch.tensor(h)``, ``h.new_tensor(h)`` (taken for factories), ``v.data = h`` (never
    recorded), ``nn.Parameter(h)`` (taken for a constant of the model) and ``out=`` into a view
    of a buffer (its storage write not tracked) took ``h`` off the data path: ``10 * copy`` was
    guaranteed with bound 1 while the values move 10 times as far (autograd, blind to the copy,
    says 0). A mask computed from a copy jumps. A copy alone keeps the bound."""
    x, d = _x(), torch.full((3, 4), 1e-3, dtype=F64)
    for name, fn in _COPIES.items():
        model = _Two(fn).double()
        lip = diagnose(model, [(x,)], _square_mean, generator=0).meta["lipschitz"]
        assert max(_quotient(model, x, x + d), _quotient(model, x, 1.001 * x)) > 5, name
        assert lip["plain"] < 1.5, (name, lip)
        assert not lip["guaranteed"] and lip["operations"], (name, lip)
    model = _Two(lambda h: torch.where(torch.tensor(h) > 0, h, -10.0)).double()
    lip = diagnose(model, [(x,)], _square_mean, generator=0).meta["lipschitz"]
    lo, hi = torch.full((1, 4), -1e-6, dtype=F64), torch.full((1, 4), 1e-6, dtype=F64)
    assert _quotient(model, lo, hi) > 1e3 * lip["plain"]
    assert not lip["guaranteed"] and any("reads a value" in o for o in lip["operations"]), lip
    for fn in (torch.tensor, torch.as_tensor, lambda h: torch.asarray(h, requires_grad=False)):
        lip, _, _ = _run(_Two(fn).double(), x)
        assert lip["guaranteed"] and lip["operations"] == [], lip


class _Rescaled(nn.Module):
    """``b(a(x))`` with ``a``'s weight (or an eval BatchNorm's running variance) scaled in place
    by ``how`` before ``a`` runs and put back after: the norms are read from the restored one."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.a, self.bn = how, _eye_linear(), _eval_bn()
        self.b = nn.Linear(4, 1, bias=False)
        with torch.no_grad():
            self.b.weight.fill_(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, v = self.a.weight, self.bn.running_var
        with torch.no_grad():
            if self.how == "mul_":
                w.mul_(10)
            elif self.how == "data":
                w.data.mul_(10)
            elif self.how == "data =":
                kept, w.data = w.data, 10 * w.data
            else:  # through .data: the saved running variance keeps its version for backward
                v.data.mul_(0.01)
        y = self.b(self.bn(self.a(x)))
        with torch.no_grad():
            if self.how == "data =":
                w.data = kept
            elif self.how == "running_var":
                v.data.div_(0.01)
            else:
                w.div_(10)
        return y


def test_a_weight_written_in_the_forward_makes_the_bound_no_guarantee() -> None:
    """``a.weight.mul_(10)`` before ``a(x)`` and ``div_(10)`` after (through ``.data`` too, or
    ``a.weight.data = 10 * a.weight.data``; a BatchNorm's running variance alike): the forward
    applies 10 times the weight whose norm the bound takes after it (guaranteed, bound 1, a
    quotient of 10 along ``b``'s direction; autograd's Jacobian, taken on the restored weight
    as the bound is, cannot see it)."""
    x, d = _x(), torch.zeros(3, 4, dtype=F64)
    d[0] = 1e-3
    for how in ("mul_", "data", "data =", "running_var"):
        model = _Rescaled(how).double().eval()
        lip = diagnose(model, [(x,)], _square_mean, generator=0).meta["lipschitz"]
        bound = lip["residual"] if math.isfinite(lip["residual"]) else lip["plain"]
        assert _quotient(model, x, x + d) > 5 * bound, (how, bound)
        assert not lip["guaranteed"], (how, lip)
        assert any("during the forward" in o for o in lip["operations"]), (how, lip)


def test_torch_dropout_with_train_false_keeps_the_bound() -> None:
    """``torch.dropout(h, p, train=False)`` (the identity) was read as train mode (the judge
    looked for ``training``, ``F.dropout``'s keyword), with the advice to call ``model.eval()``
    on a model in eval mode. ``train=True`` stays no guarantee."""
    for fn in (
        lambda h: torch.dropout(h, p=0.5, train=False),
        lambda h: torch.dropout(h, 0.5, False),
        lambda h: torch.alpha_dropout(h, 0.5, train=False),
    ):
        lip, _, _ = _run(_Two(fn).double().eval(), _x())
        assert lip["guaranteed"] and lip["operations"] == [], lip
    model = _Two(lambda h: torch.dropout(h, p=0.5, train=True)).double().eval()
    lip = diagnose(model, [(_x(),)], _square_mean, generator=0).meta["lipschitz"]
    assert not lip["guaranteed"] and any("train mode" in o for o in lip["operations"]), lip


class _Wide(nn.Module):
    """``b(fn(a(x)))`` with ``b`` of shape (1, 8) and norm 1."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn, self.a, self.b = fn, _eye_linear(), nn.Linear(8, 1, bias=False)
        with torch.no_grad():
            self.b.weight.fill_(8**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.fn(self.a(x)))


def _out_twice(h: torch.Tensor) -> torch.Tensor:
    buf = torch.zeros(h.shape[0], 8, dtype=h.dtype)
    with torch.no_grad():
        torch.neg(h, out=buf[:, :4])
        torch.neg(h, out=buf[:, 4:])
    return buf


def _out_once(h: torch.Tensor) -> torch.Tensor:
    buf = torch.zeros(h.shape[0], 8, dtype=h.dtype)
    with torch.no_grad():
        torch.neg(h, out=buf[:, 4:])
    return buf


def test_out_into_a_tensor_holding_an_activation_is_judged_as_a_write() -> None:
    """``torch.neg(h, out=buf[:, :4])`` then ``torch.neg(h, out=buf[:, 4:])``: ``buf`` holds
    ``h`` twice (Lipschitz constant sqrt(2) there, a quotient of 1.41 along ``b``) and the
    second write was judged as ``neg`` alone. One ``out=`` write into a fresh buffer keeps the
    bound."""
    x = _x()
    model = _Wide(_out_twice).double()
    lip = diagnose(model, [(x,)], _square_mean, generator=0).meta["lipschitz"]
    assert _quotient(model, x, x + 1e-3 * torch.ones_like(x)) > 1.3 * lip["plain"], lip
    assert not lip["guaranteed"] and any("neg in" in o for o in lip["operations"]), lip
    model = _Wide(_out_once).double()
    lip = diagnose(model, [(x,)], _square_mean, generator=0).meta["lipschitz"]
    assert _quotient(model, x, x + 1e-3 * torch.ones_like(x)) <= lip["plain"] * (1 + 1e-9)
    assert lip["guaranteed"] and lip["operations"] == [], lip


def _eye(n_out: int, n_in: int, scale: float = 1.0) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=False)
    with torch.no_grad():
        layer.weight.copy_(scale * torch.eye(n_out, n_in))
    return layer


class _BroadcastSum(nn.Module):
    """``h + f(...)`` where one operand broadcasts: a global-max context added to each token
    (``f(h.amax(1, keepdim=True))``, ``(N, 1, C)`` over ``L`` tokens), a per-example scalar
    branch (``(N, 1) + (N, 4)``), a sliced shortcut (``h[:, :1] + f(h)``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.a = how, _eye(4, 4)
        self.f = _eye(1, 4) if how == "scalar" else _eye(4, 4, 0.1 if how == "slice" else 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.how == "context":
            return h + self.f(h.amax(dim=1, keepdim=True))
        if self.how == "scalar":
            return h + self.f(h)
        return h[:, :1] + self.f(h)


@pytest.mark.parametrize("how", ["context", "scalar", "slice"])
def test_a_residual_sum_whose_operand_broadcasts_is_no_modelled_block(how: str) -> None:
    """A sum ``x + F(x)`` whose operand broadcasts repeats its entries: the residual bound
    ``||x|| + ||F||`` (2, or 1.1 for the slice) was guaranteed below the exact norm (3.41,
    2.73, 2.05). The bound now says why it is no guarantee."""
    shape = (2, 8, 4) if how == "context" else (3, 4)
    x = torch.randn(shape, dtype=F64, generator=torch.Generator().manual_seed(0))
    lip, bound, exact = _run(_BroadcastSum(how).double(), x)
    assert exact > bound * 1.2, (exact, bound)
    assert not lip["guaranteed"] and any("broadcast" in o for o in lip["operations"]), lip


class _BatchStatsBN(nn.Module):
    """``bn(a(x))`` with the BatchNorm put in train mode for its call (test-time adaptation):
    it normalizes by the batch's statistics, and updates its running ones."""

    def __init__(self, momentum: float | None) -> None:
        super().__init__()
        self.a, self.bn = _eye_linear(), nn.BatchNorm1d(4, momentum=momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.bn.train()
        y = self.bn(self.a(x))
        self.bn.eval()
        return y


@pytest.mark.parametrize("momentum", [0.1, 0.0, None])
def test_a_batchnorm_called_in_train_mode_is_not_trusted_with_its_eval_norm(momentum) -> None:
    """The BatchNorm is in eval mode when the norms are read, so its row is the eval map's
    (1 here), but its call in the forward used the batch's statistics (exact norm 240):
    guaranteed with bound 1. Now the call's ``training`` and its running-statistics update
    make the bound no guarantee."""
    lip, bound, exact = _run(_BatchStatsBN(momentum).double().eval(), _x())
    assert exact > 10 * bound, (exact, bound)
    assert not lip["guaranteed"], lip
    assert any("batch's statistics" in o for o in lip["operations"]), lip
    assert any("running_var during the forward" in o for o in lip["operations"]), lip


def _max_indices(h: torch.Tensor) -> torch.Tensor:
    return h.max(dim=1).indices.to(h.dtype)[:, None] * h.new_ones(1, 4) * 0.5


def _tuple_indices(h: torch.Tensor) -> torch.Tensor:
    return torch.max(h, 1)[1].double().unsqueeze(1) * h.new_ones(1, 4) * 0.5


def _pool_indices(h: torch.Tensor) -> torch.Tensor:
    idx = torch.nn.functional.max_pool1d(h.unsqueeze(1), 2, return_indices=True)[1]
    return torch.cat([idx, idx], -1).to(h.dtype).squeeze(1) * 0.5


def _max_values(h: torch.Tensor) -> torch.Tensor:
    values, _ = torch.max(h, 1, keepdim=True)
    return values * h.new_full((1, 4), 0.5)  # 4 copies of 0.5 max: Lipschitz constant 1


def test_integer_indices_of_a_max_used_as_data_make_the_bound_no_guarantee() -> None:
    """The indices of ``max``/``min`` over a dim and of max pooling with ``return_indices``
    passed as 1-Lipschitz (only a single integer output was looked for): an argmax cast to
    floats was guaranteed with bound 1, while across a tie the quotient is 7e8 (autograd says
    0 there). The values alone keep the bound."""
    x = _x()
    tie = torch.tensor([[1.0, 1.0, 0.0, 0.0]] * 3, dtype=F64)
    e = 1e-9 * torch.tensor([[1.0, 0.0, 0.0, 0.0]] * 3, dtype=F64)
    for fn in (_max_indices, _tuple_indices, _pool_indices):
        model = _Two(fn).double()
        lip = diagnose(model, [(x,)], _square_mean, generator=0).meta["lipschitz"]
        assert _quotient(model, tie + e, tie + e.roll(1, 1)) > 1e6 * lip["plain"], fn.__name__
        assert not lip["guaranteed"], (fn.__name__, lip)
        assert any("integer indices" in o for o in lip["operations"]), (fn.__name__, lip)
    lip, _, _ = _run(_Two(_max_values).double(), x)
    assert lip["guaranteed"] and lip["operations"] == [], lip


class _Cast(nn.Module):
    """``b(fn(a(x)))`` in ``dtype`` (``a`` the identity, ``b`` of norm 1)."""

    def __init__(self, fn, dtype: torch.dtype) -> None:
        super().__init__()
        self.inner = _Two(fn).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_a_cast_to_a_narrower_float_dtype_or_a_dtype_view_is_no_guarantee() -> None:
    """``h.half()``, ``h.to(torch.bfloat16)``, ``h.to(torch.float8_e4m3fn)`` and
    ``h.view(torch.float32)`` passed as dtype changes, 1-Lipschitz: bound 1, guaranteed, while
    across a float16 rounding boundary the quotient is 1e4 (and f(65519) = 131008, f(65521) =
    inf) and the bits' view jumps by 1e42."""
    x, half = _x(), 1 + 2.0**-11  # halfway between two float16 numbers
    lo, hi = torch.full((3, 4), half - 1e-7, dtype=F64), torch.full((3, 4), half + 1e-7, dtype=F64)
    for fn in (
        lambda h: h.half().double(),
        lambda h: h.to(torch.bfloat16).double(),
        lambda h: h.to(torch.float8_e4m3fn).double(),
        lambda h: h.contiguous().view(torch.float32).double()[:, :4],
        lambda h: torch.as_tensor(h, dtype=torch.half).double(),
    ):
        model = _Two(fn).double()
        lip = diagnose(model, [(x,)], _square_mean, generator=0).meta["lipschitz"]
        assert not lip["guaranteed"], lip
        assert any("casts" in o or "bits" in o for o in lip["operations"]), lip
    assert _quotient(_Two(lambda h: h.half().double()).double(), lo, hi) > 1e3


def test_casts_that_do_not_round_below_the_models_arithmetic_keep_the_bound() -> None:
    """Widening (float32 to float64), ``x.float()`` of a float32 input, a round trip back to the
    model's own float32, and a float32 model under bfloat16 autocast stay guaranteed; a float16
    cast in that float32 model does not."""
    x = _x().float()

    def autocast_loss(model: nn.Module, batch) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (model(batch[0]).float() ** 2).mean()

    for fn, loss in (
        (lambda h: h.float(), _square_mean),
        (lambda h: h.double().relu().float(), _square_mean),
        (lambda h: torch.relu(h), autocast_loss),
        (lambda h: h.to(torch.bfloat16), autocast_loss),
    ):
        lip = diagnose(_Cast(fn, torch.float32), [(x,)], loss, generator=0).meta["lipschitz"]
        assert lip["guaranteed"] and lip["operations"] == [], lip
    model = _Cast(lambda h: h.half().float(), torch.float32)
    lip = diagnose(model, [(x,)], _square_mean, generator=0).meta["lipschitz"]
    assert not lip["guaranteed"] and any("float16" in o for o in lip["operations"]), lip


def _times_10_linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return 10 * torch.nn.functional.linear(x, self.weight, self.bias)


def _times_10_conv(self: nn.Conv1d, x, weight, bias) -> torch.Tensor:
    return 10 * torch.nn.functional.conv1d(x, weight, bias, self.stride, self.padding)


class _ConvHead(nn.Module):
    """``b(conv(x))`` with a Conv1d of norm 1 at length 4 (a 1-tap identity)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.b = nn.Conv1d(1, 1, 1, bias=False), nn.Linear(4, 1, bias=False)
        with torch.no_grad():
            self.conv.weight.fill_(1.0)
            self.b.weight.fill_(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.conv(x.unsqueeze(1)).squeeze(1))


@pytest.mark.parametrize("where", ["Linear.forward", "Conv1d._conv_forward", "F.linear"])
def test_a_torch_layer_patched_on_its_class_is_not_trusted(where: str, monkeypatch) -> None:
    """``nn.Linear.forward`` (or ``_conv_forward``, or ``F.linear``) replaced by one scaling by
    10: the layers stayed "torch's own class", their calls trusted, bound 1 guaranteed where
    the exact norm is 10. Now their calls are judged, as with a replacement on the instance."""
    if where == "Linear.forward":
        monkeypatch.setattr(nn.Linear, "forward", _times_10_linear)
    elif where == "F.linear":
        real = torch.nn.functional.linear
        monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, b=None: 10 * real(x, w, b))
    else:
        monkeypatch.setattr(nn.Conv1d, "_conv_forward", _times_10_conv)
    model = (_ConvHead() if where.startswith("Conv") else _Two(torch.relu)).double()
    lip, bound, exact = _run(model, _x())
    assert exact > 5 * bound, (exact, bound)
    assert not lip["guaranteed"] and any("a factor 10" in o for o in lip["operations"]), lip


class _BoolMasked(nn.Module):
    """``b(a(x) * mask)`` with a bool mask buffer: a product with 0s and 1s, 1-Lipschitz."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _eye_linear(), nn.Linear(4, 1, bias=False)
        self.register_buffer("mask", torch.tensor([True, False, True, True]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * self.mask)


def test_a_product_with_a_bool_mask_buffer_keeps_the_bound() -> None:
    """The judge took ``abs()`` of the bool constant, which raised inside the forward, and
    diagnose said the model's forward failed (call counts not known, nothing checked)."""
    model = _BoolMasked().double()
    model.mask = model.mask.bool()
    report = diagnose(model, [(_x(),)], _square_mean, generator=0)
    lip = report.meta["lipschitz"]
    assert lip["guaranteed"] and lip["operations"] == [], lip
    assert not any("failed" in n for n in report.meta.get("notes", [])), report.meta["notes"]
    _run(model, _x())


def test_an_error_of_the_watch_is_never_reported_as_the_forward_failing(monkeypatch) -> None:
    """An error in the watch's own code (a judge, the recorder's bookkeeping) ran up through the
    model's forward and was reported as that forward failing. A judge's error now leaves its
    call not known (the forward goes on, the counts known); the recorder's is named as
    initlab's."""
    from initlab.diagnostics import _lipschitz_ops
    from initlab.measure import runtime_trace

    def broken(*args, **kwargs):
        raise NotImplementedError("a bug of the judge")

    monkeypatch.setattr(_lipschitz_ops, "_judge", broken)
    report = diagnose(_Two(torch.relu).double(), [(_x(),)], _square_mean, generator=0)
    lip, notes = report.meta["lipschitz"], report.meta.get("notes", [])
    assert not any(n.startswith("the forward that counts") for n in notes), notes
    assert not lip["guaranteed"] and any("bug in initlab" in o for o in lip["operations"]), lip
    monkeypatch.undo()
    monkeypatch.setattr(runtime_trace._Recorder, "inputs_of", broken)
    report = diagnose(_Two(torch.relu).double(), [(_x(),)], _square_mean, generator=0,
                      lint=False)  # fmt: skip
    notes = report.meta.get("notes", [])
    assert not any(n.startswith("the forward that counts") for n in notes), notes
    assert any("watch of the forward" in n and "bug in initlab" in n for n in notes), notes
    assert not report.meta["lipschitz"]["guaranteed"]
