"""MetaInit (Dauphin & Schoenholz 2019): the gradient quotient against a dense float64 Hessian, the
signSGD step against finite differences, GQ decreasing, seeding, state and failure.

(The two-rank DDP check of ``metainit_`` shares the spawn of ``test_gradinit.py``.)"""

from __future__ import annotations

import copy
import math
import re
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from initlab._core.loss import resolve_loss
from initlab._core.norms import composite_norms
from initlab.methods._alpha import (
    evaluation_modes,
    loss_at,
    nonzero,
    scaled_params,
    select_tensors,
)
from initlab.methods.lsuv import lsuv_
from initlab.methods.metainit import (
    _gq,
    _meta_gradient,
    _QuotientSum,
    gradient_quotient,
    metainit_,
)

from .half_models import HandNorm

D = torch.float64


def _tanh_mlp(seed: int = 0, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    ).to(dtype)
    with torch.no_grad():
        for m in net:
            if isinstance(m, nn.Linear):
                m.weight.mul_(scale)
    return net


def _batches(n: int, size: int, seed: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 8, generator=g).to(dtype), torch.randint(0, 4, (size,), generator=g))
        for _ in range(n)
    ]


def test_gradient_quotient_matches_dense_hessian() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    x, y = torch.randn(6, 3, dtype=D), torch.randint(0, 2, (6,))
    names = [n for n, _ in net.named_parameters()]
    shapes = [p.shape for p in net.parameters()]
    flat0 = torch.cat([p.detach().reshape(-1) for p in net.parameters()])

    def loss(flat: torch.Tensor) -> torch.Tensor:
        parts = torch.split(flat, [s.numel() for s in shapes])
        params = {n: p.reshape(s) for n, p, s in zip(names, parts, shapes, strict=True)}
        return F.cross_entropy(functional_call(net, params, (x,)), y)

    g = torch.autograd.functional.jacobian(loss, flat0)
    h = torch.autograd.functional.hessian(loss, flat0)
    eps = 1e-5
    sgn = torch.where(g >= 0, 1.0, -1.0).to(D)
    expected = ((g - h @ g) / (g + eps * sgn) - 1).abs().mean()
    assert gradient_quotient(net, (x, y), eps=eps) == pytest.approx(float(expected), rel=1e-10)


def test_paper_step_is_minus_lr_sign_of_the_finite_difference_slope() -> None:
    net = _tanh_mlp(scale=0.5, dtype=D)
    batch = _batches(1, 16, seed=1, dtype=D)[0]
    lr = 0.01

    def gq_with(name: str, factor: float) -> float:
        other = copy.deepcopy(net)
        with torch.no_grad():
            other.get_parameter(name).mul_(factor)
        return gradient_quotient(other, batch, batch_stats=False)

    report = metainit_(copy.deepcopy(net), [batch], lr=lr)
    assert [(r["layer"], r["param"]) for r in report] == [
        ("0", "weight"),
        ("2", "weight"),
        ("4", "weight"),
    ]  # >= 2-D tensors
    h = 1e-6
    for row in report:
        name = f"{row['layer']}.{row['param']}"
        slope = gq_with(name, 1 + h) - gq_with(name, 1 - h)
        assert abs(slope) > 1e-9
        expected = -lr * math.copysign(1.0, slope)  # s <- s + m, m = -lr sign(dGQ/ds)
        assert row["norm_after"] - row["norm_before"] == pytest.approx(expected, rel=1e-9)


def test_gradient_quotient_decreases_gradinit_variant() -> None:
    net = _tanh_mlp(seed=2, scale=0.3)
    held_out = _batches(4, 64, seed=102)
    before = sum(gradient_quotient(net, b) for b in held_out) / 4
    report = metainit_(net, _batches(40, 32, seed=202), variant="gradinit", lr=0.02)
    after = sum(gradient_quotient(net, b) for b in held_out) / 4
    assert after < 0.8 * before
    gq = [r["gq"] for r in report.trace]
    assert sum(gq[-10:]) < sum(gq[:10])
    assert report.info["steps"] == 40 and report.info["variant"] == "gradinit"


def test_seeded_random_data_runs_are_identical() -> None:
    def run(seed: int):
        net = _tanh_mlp()
        report = metainit_(net, input_shape=(16, 8), steps=4, generator=seed)
        return [p.detach().clone() for p in net.parameters()], report.trace.to_rows()

    (p1, t1), (p2, t2), (p3, _) = run(0), run(0), run(1)
    assert all(torch.equal(a, b) for a, b in zip(p1, p2, strict=True))
    assert [r["gq"] for r in t1] == [r["gq"] for r in t2]
    assert not all(torch.equal(a, b) for a, b in zip(p1, p3, strict=True))


class _ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def _state(model: nn.Module):
    return {k: v.clone() for k, v in model.state_dict().items()}, [
        m.training for m in model.modules()
    ]


def test_buffers_identical_and_failure_leaves_model_unchanged() -> None:
    torch.manual_seed(0)
    model = _ConvBN().train()
    state, modes = _state(model)
    metainit_(model, input_shape=(8, 2, 4, 4), steps=2, generator=0, variant="gradinit")
    for k, v in model.named_buffers():
        assert torch.equal(v, state[k]), k
    assert [m.training for m in model.modules()] == modes

    state, modes = _state(model)
    calls = 0

    def loss_fn(m, batch):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("injected")
        return F.cross_entropy(m(batch[0]), batch[1])

    with pytest.raises(RuntimeError, match="injected"):
        metainit_(model, loss_fn=loss_fn, input_shape=(8, 2, 4, 4), steps=5, generator=0)
    with pytest.raises(FloatingPointError, match="first iteration"):
        metainit_(
            model,
            loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]) * math.nan,
            input_shape=(8, 2, 4, 4),
            steps=2,
        )
    with pytest.raises(ValueError, match="needs 3 batches"):
        metainit_(model, [(torch.randn(8, 2, 4, 4), torch.randint(0, 3, (8,)))] * 2, steps=3)
    with pytest.raises(ValueError, match="input_shape"):
        metainit_(model)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert [m.training for m in model.modules()] == modes
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_a_float16_model_gets_finite_scale_gradients() -> None:
    """The quotient ``(g - Hg) / (g + eps)`` overflowed float16: NaN scale gradients, then a NaN
    loss blamed at iteration 1. It is formed in float32 now; the model stays float16."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5)).half()
    gen = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(16, 8, generator=gen).half(), torch.randint(0, 5, (16,), generator=gen))
        for _ in range(3)
    ]
    loss = lambda m, b: F.cross_entropy(m(b[0]).float(), b[1])  # noqa: E731
    # the sign steps on a half-precision model's quotient can land far from float32's: said
    with pytest.warns(UserWarning, match=r"metainit_: the model's weights are float16: .*float32"):
        report = metainit_(model, data, loss, variant="gradinit", steps=2)
    assert all(math.isfinite(r["alpha"]) for r in report.to_rows())
    assert all(p.dtype == torch.float16 and bool(p.isfinite().all()) for p in model.parameters())


@pytest.mark.parametrize("norm", [nn.LayerNorm, nn.RMSNorm])
def test_a_nonfinite_meta_gradient_of_a_float16_model_is_named_for_what_it_is(norm) -> None:
    """Where a gradient entry is small, the quotient's derivative (about ``h / g**2``) overflows
    float16 in the meta-gradient's backward: the scales' gradient was NaN, reported one
    iteration on as "the loss is nan" (or as non-finite scales, "lower lr"). It is named where
    it happens, with float16 and the float32 copy to use; the float32 copy runs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), norm(16), nn.ReLU(), nn.Linear(16, 5))
    with torch.no_grad():
        model[0].weight.mul_(0.5)
    gen = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(16, 8, generator=gen), torch.randint(0, 5, (16,), generator=gen))
        for _ in range(3)
    ]
    loss = lambda m, b: F.cross_entropy(m(b[0]).float(), b[1])  # noqa: E731
    half = copy.deepcopy(model).half()
    before = copy.deepcopy(half.state_dict())
    with pytest.warns(UserWarning, match="float16"), pytest.raises(FloatingPointError) as info:
        metainit_(half, [(x.half(), y) for x, y in data], loss, variant="gradinit", steps=2)
    message = str(info.value)
    assert re.search(r"metainit_: the alpha-gradient of the gradient quotient is not finite "
                     r"for \d tensor\(s\) .* at the first iteration", message), message  # fmt: skip
    assert "float16" in message and "float32 copy" in message
    assert "lower lr" not in message and "loss is nan" not in message
    assert all(torch.equal(v, before[k]) for k, v in half.state_dict().items())
    report = metainit_(model, data, loss, variant="gradinit", steps=2)  # the advice runs
    assert all(math.isfinite(r["alpha"]) for r in report.to_rows())


def test_a_nonfinite_gradient_quotient_of_a_float16_model_names_float16() -> None:
    """A float16 LayerNorm written by hand on inputs x1e-3: the quotient's pass overflows and GQ
    is NaN, reported bare ("the gradient quotient is nan") while the float32 copy runs; it names
    float16 and the float32 copy now."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), HandNorm(), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        net[0].bias.zero_()
    gen = torch.Generator().manual_seed(11)
    data = [
        (torch.randn(16, 8, generator=gen) * 1e-3, torch.randint(0, 4, (16,), generator=gen))
        for _ in range(2)
    ]
    loss = lambda m, b: F.cross_entropy(m(b[0]).float(), b[1])  # noqa: E731
    half = copy.deepcopy(net).half()
    with pytest.warns(UserWarning, match="float16"), pytest.raises(FloatingPointError) as info:
        metainit_(half, [(x.half(), y) for x, y in data], loss, steps=2)
    message = str(info.value)
    assert "gradient quotient is nan" in message and "float32 copy" in message, message
    report = metainit_(net, data, loss, steps=2)  # the advice runs
    assert all(math.isfinite(r["alpha"]) for r in report.to_rows())


def test_random_data_for_a_token_model_says_to_pass_token_batches() -> None:
    """data=None draws float N(0, 1) inputs: a Hugging Face model of token ids failed inside its
    embedding with torch's "Expected ... Long, Int; but got torch.FloatTensor"."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32,
                                             n_positions=16))  # fmt: skip
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"this model takes token ids .* pass data"):
        metainit_(model, None, steps=1, input_shape=(4, 8))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def _unchanged(model: nn.Module) -> Any:
    before = {k: v.clone() for k, v in model.state_dict().items()}
    return lambda: all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_per_example_input_shape_is_named_as_the_batch_shape() -> None:
    """input_shape=(8,), one example's shape (what the CLI's --input-shape takes), drew x of
    shape (8,) and labels of shape (8,): the TargetError blamed the loss and the targets, which
    metainit_ drew itself, and never named input_shape."""
    model = _tanh_mlp()
    same = _unchanged(model)
    with pytest.raises(ValueError) as err:
        metainit_(model, input_shape=(8,), n_classes=4, steps=2, generator=0)
    text = str(err.value)
    assert text.startswith("metainit_: the model or the loss failed on the random batch of "
                           "input_shape=(8,), which is the whole batch's shape, batch dimension "
                           "first: inputs x of shape (8,), a batch of 8 scalars"), text  # fmt: skip
    assert "pass input_shape=(B, 8), e.g. (64, 8). The error: the loss" in text, text
    assert same()
    with pytest.raises(RuntimeError, match=r"input_shape=\(16, 5\), .*16 examples of shape \(5,\)"
                       r".* Is that what the model takes\? The error: mat1"):  # fmt: skip
        metainit_(model, input_shape=(16, 5), steps=2, generator=0)
    assert same()


def test_a_later_steps_error_on_random_data_is_passed_as_it_is() -> None:
    calls = 0

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("injected")
        return F.cross_entropy(m(batch[0]), batch[1])

    with pytest.raises(RuntimeError) as err:
        metainit_(_tanh_mlp(), loss_fn=loss_fn, input_shape=(16, 8), steps=3, generator=0)
    assert str(err.value) == "injected"


def test_a_batch_of_scalars_is_a_shape_a_model_may_take() -> None:
    """input_shape=(B,) is not refused: a model may take a batch of B scalar inputs."""

    class Scalars(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(1, 8), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(x.unsqueeze(-1))))

    report = metainit_(Scalars(), input_shape=(16,), steps=2, generator=0)
    assert report.info["steps"] == 2


def test_an_input_shape_of_numpy_integers_is_a_shape() -> None:
    """(np.int64(16), 8) was refused ('input_shape must be the whole batch's shape') since the
    check took only Python ints; it draws the batches (16, 8) draws."""
    weights = []
    for shape in (
        (16, 8),
        (np.int64(16), np.int32(8)),
        (torch.tensor(16), 8),
        # a whole shape as a 1-D integer array or tensor: refused since the check took sequences
        # only, though it drew the (16, 8) batches before
        np.array([16, 8]),
        torch.tensor([16, 8]),
        torch.Size([16, 8]),
    ):
        model = _tanh_mlp()
        metainit_(model, input_shape=shape, steps=2, generator=0)
        weights.append([p.detach().clone() for p in model.parameters()])
    for other in weights[1:]:
        assert all(torch.equal(a, b) for a, b in zip(weights[0], other, strict=True))


@pytest.mark.parametrize(
    "shape",
    [
        (),
        (0, 8),
        (-1, 8),
        (16.0, 8),
        (True, 8),
        16,
        "16x8",
        (np.float64(16), 8),
        (np.bool_(True), 8),
        (torch.tensor(True), 8),
        (np.int64(0), 8),
        np.array([16.0, 8.0]),
        np.array([[16, 8]]),
        np.array(16),
        torch.tensor([16, 0]),
        torch.tensor([True, True]),
        torch.tensor([], dtype=torch.int64),
    ],
)
def test_an_input_shape_that_is_no_shape_is_refused(shape: Any) -> None:
    """() gave an IndexError, 16 "'int' object is not iterable", (-1, 8) torch's error and
    (0, 8) a NaN loss blamed on the first iteration."""
    model = _tanh_mlp()
    same = _unchanged(model)
    with pytest.raises(
        ValueError, match=r"^metainit_: input_shape must be the whole batch's shape"
    ):
        metainit_(model, input_shape=shape, steps=1, generator=0)
    assert same()


def test_a_loss_function_that_turns_autocast_on_is_refused() -> None:
    """metainit_ turns autocast off around its passes, but a loss_fn's own autocast turned it on
    again around the model: the scales moved the wrong way (+0.29 where float32 and float64 runs
    move -0.09), silently. An autocast around the call is still neutralized."""

    def ce(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]), batch[1])

    def ce_autocast(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return ce(model, batch)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    data = [(torch.randn(8, 6), torch.randint(0, 3, (8,))) for _ in range(3)]
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"^metainit_: the model ran under torch\.autocast \(cpu "
                       r"\(torch\.bfloat16\)\), turned on inside the loss function"):  # fmt: skip
        metainit_(model, data, ce_autocast, steps=2)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not model._forward_pre_hooks
    reference = copy.deepcopy(model)
    metainit_(reference, data, ce, steps=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        metainit_(model, data, ce, steps=2)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)


def _conv_bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 3, 3, bias=False), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
        nn.Linear(3 * 4 * 4, 3),
    ).double()  # fmt: skip


def _ln_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 8), nn.LayerNorm(8), nn.Tanh(),
        nn.Linear(8, 3),
    ).double()  # fmt: skip


def _meta_gradients(model: nn.Module, batch: Any) -> dict[str, float]:
    """dGQ/dalpha per scaled tensor, as metainit_'s steps compute it (its ``_meta_gradient``)."""
    ts = select_tensors(model, "default", nonzero, "test")
    a = torch.ones(len(ts.scaled), dtype=torch.float64)
    with evaluation_modes(model, batch_stats=True):
        grad, *_ = _meta_gradient(model, resolve_loss(None), ts, a, batch, 1e-5, ("test", 0))
    return {ts.names[i]: float(grad[k]) for k, i in enumerate(ts.scaled)}


@pytest.mark.parametrize("make", [_conv_bn_net, _ln_mlp], ids=["batchnorm", "layernorm"])
def test_the_meta_gradient_through_norm_layers_is_the_finite_difference_one(make: Any) -> None:
    """The meta-gradient is a third derivative; PyTorch's native BatchNorm (batch statistics)
    and LayerNorm give a wrong one (their double backward holds the statistics constant): a
    conv's -2.64 where finite differences give +3.38, LayerNorm ~10% off."""
    model = make()
    g = torch.Generator().manual_seed(1)
    shape = (12, 2, 6, 6) if isinstance(model[0], nn.Conv2d) else (12, 5)
    batch = (
        torch.randn(*shape, generator=g, dtype=torch.float64),
        torch.randint(0, 3, (12,), generator=g),
    )

    def gq_at(name: str, factor: float) -> float:
        other = copy.deepcopy(model)
        with torch.no_grad():
            other.get_parameter(name).mul_(factor)
        return gradient_quotient(other, batch)

    exact = _meta_gradients(model, batch)
    h = 1e-6
    for name, value in exact.items():
        fd = (gq_at(name, 1 + h) - gq_at(name, 1 - h)) / (2 * h)
        assert value == pytest.approx(fd, rel=1e-4, abs=1e-6), name


def _old_quotient_sum(gi: torch.Tensor, hi: torch.Tensor, eps: float) -> torch.Tensor:
    """The elementwise chain ``_gq`` built before ``_QuotientSum`` (autograd kept ``g - h``,
    ``g + eps * s`` and ``q`` per parameter for the meta-gradient's backward)."""
    wide = torch.promote_types(gi.dtype, torch.float32)
    gi, hi = gi.to(wide), hi.to(wide)
    sgn = torch.where(gi >= 0, 1.0, -1.0).to(wide).detach()
    return ((gi - hi) / (gi + eps * sgn) - 1).abs().sum()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
def test_the_quotient_function_has_the_old_chains_value_and_gradients(dtype: torch.dtype) -> None:
    """``_QuotientSum`` keeps only ``g`` and ``H g``; its value is the old chain's bit for bit and
    its gradients are the old chain's autograd ones, at ``g = 0`` (``s = +1``) and ``q = 0``
    (``sign 0``, abs's subgradient) too."""
    eps = 1e-5
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(40, generator=gen, dtype=torch.float64) * 1e-3
    h = torch.randn(40, generator=gen, dtype=torch.float64) * 1e-3
    g[:6] = 0.0  # g exactly 0: s = +1, d = eps
    h[3:6] = 0.0
    g[6:9], h[6:9] = 0.5, -eps  # q = (0.5 + eps) / (0.5 + eps) - 1 = 0 exactly (float64)
    g, h = g.to(dtype), h.to(dtype)
    assert bool((g == 0).any())
    if dtype == torch.float64:
        q = (g - h) / (g + eps * torch.where(g >= 0, 1.0, -1.0).to(dtype)) - 1
        assert int((q == 0).sum()) == 3
    results = []
    for fn in (_old_quotient_sum, _QuotientSum.apply):
        gl, hl = g.clone().requires_grad_(), h.clone().requires_grad_()
        value = fn(gl, hl, eps)
        value.backward(torch.tensor(0.75, dtype=value.dtype))
        results.append((value.detach(), gl.grad, hl.grad))
    (v0, dg0, dh0), (v1, dg1, dh1) = results
    assert v1.dtype == v0.dtype == torch.promote_types(dtype, torch.float32)
    assert torch.equal(v1, v0)
    assert dg1.dtype == dh1.dtype == dtype
    # float32: the chain's dg = 1/d - (g - h)/d**2 loses digits to cancellation (1e-5 here)
    rtol = {torch.float64: 1e-12, torch.float32: 1e-4, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(dg1, dg0, rtol=rtol, atol=0)
    torch.testing.assert_close(dh1, dh0, rtol=rtol, atol=0)
    if dtype == torch.float64:  # the q = 0 entries get no gradient (sign 0), the g = 0 ones do
        assert bool((dg1[6:9] == 0).all() and (dh1[6:9] == 0).all())
        # g = h = 0: q = -1, d = eps: dg = -0.75 * eps / eps**2, dh = +0.75 / eps
        assert bool((dg1[3:6] == -0.75 / eps).all() and (dh1[3:6] == 0.75 / eps).all())


def _zero_feature_batch(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch whose first input feature (or channel) is 0: the first layer's gradient is exactly
    0 on the weights reading it."""
    g = torch.Generator().manual_seed(2)
    dtype = next(model.parameters()).dtype
    shape = (12, 2, 6, 6) if isinstance(model[0], nn.Conv2d) else (12, 8)
    x = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    x[:, 0] = 0
    return x, torch.randint(0, 3, (12,), generator=g)


@pytest.mark.parametrize(
    "make",
    [partial(_tanh_mlp, 3, dtype=D), _conv_bn_net, partial(_tanh_mlp, 3, dtype=torch.float32)],
    ids=["mlp-float64", "batchnorm-float64", "mlp-float32"],
)
def test_the_meta_gradient_is_the_old_elementwise_chains(make: Any) -> None:
    """``_gq``'s meta-gradient (``_QuotientSum``) against the elementwise chain it replaced,
    formed here from ``g`` and ``H g`` with plain torch ops and differentiated by autograd."""
    model = make()
    batch = _zero_feature_batch(model)
    eps = 1e-5
    ts = select_tensors(model, "default", nonzero, "test")
    a = torch.ones(len(ts.scaled), dtype=torch.float64, requires_grad=True)
    loss_fn = resolve_loss(None)
    with evaluation_modes(model, batch_stats=True), composite_norms():  # as _meta_gradient
        gq, _, _ = _gq(model, loss_fn, ts, scaled_params(ts, a), batch, eps)
        (new,) = torch.autograd.grad(gq, a)
        theta = scaled_params(ts, a)
        loss = loss_at(model, loss_fn, ts, theta, batch)
        g = torch.autograd.grad(loss, theta, create_graph=True)
        half_sq = torch.stack([x.square().sum() for x in g]).sum() / 2
        hg = torch.autograd.grad(half_sq, theta, create_graph=True)
    assert any(bool((x == 0).any()) for x in g)  # entries where g is exactly 0
    total = half_sq.new_zeros((), dtype=torch.promote_types(half_sq.dtype, torch.float32))
    for gi, hi in zip(g, hg, strict=True):
        total = total + _old_quotient_sum(gi, hi, eps)
    old_gq = total / ts.numel
    (old,) = torch.autograd.grad(old_gq, a)
    assert torch.equal(gq.detach(), old_gq.detach())
    rtol = 1e-12 if g[0].dtype == torch.float64 else 1e-4
    torch.testing.assert_close(new, old, rtol=rtol, atol=0)


# torch 2.4's checkpoint calls its own deprecated torch.cpu.amp.autocast
@pytest.mark.filterwarnings("ignore:`torch.cpu.amp.autocast:FutureWarning")
def test_metainit_through_a_checkpointed_norm_block_says_what_to_do() -> None:
    """A checkpointed block recomputes its forward in the meta-gradient's backward with the
    native norms (torch's CheckpointError, raw): said with what to do, the model unchanged."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.norm, self.b = nn.Linear(5, 8), nn.LayerNorm(8), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = checkpoint(lambda z: torch.tanh(self.norm(self.a(z))), x, use_reentrant=False)
            return self.b(h)

    torch.manual_seed(0)
    model = Checkpointed().double()
    batch = (torch.randn(12, 5, dtype=torch.float64), torch.randint(0, 3, (12,)))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(
        ValueError, match=r"activation checkpointing .*gradient_checkpointing_disable"
    ):
        metainit_(model, [batch], variant="gradinit", steps=1, lr=1e-3, clip=None)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


class _ComplexFirst(nn.Module):
    """A complex Linear (complex128), its modulus, a real Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(8, 16, dtype=torch.complex128)
        self.l2 = nn.Linear(16, 4, dtype=D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.l1(x.to(torch.complex128)).abs())


def test_the_advice_on_a_complex_parameter_names_only_what_works() -> None:
    """The refusal said "use gradinit_ or lsuv_": gradinit_ died in torch on the same model and
    lsuv_ (orthogonal by default) in orthogonal_; every route it names now runs."""
    model = _ComplexFirst()
    batches = [(x.to(D), y) for x, y in _batches(3, 16, 1)]
    with pytest.raises(TypeError) as info:
        metainit_(model, batches, nn.CrossEntropyLoss(), steps=1)
    text = str(info.value)
    assert text.startswith("metainit_: parameter(s) l1.weight, l1.bias are complex; ")
    assert "lsuv_(orthogonal=False)" in text and "gradinit_" not in text
    # lsuv_(orthogonal=False): the complex layer's output gets E|y - E y|^2 = 1 (own complex128)
    x = torch.cat([b[0] for b in batches])
    lsuv_(model, x, orthogonal=False, tol=1e-3)
    with torch.no_grad():
        y = model.l1(x.to(torch.complex128))
    assert float((y - y.mean()).abs().square().mean()) == pytest.approx(1.0, abs=1e-3)
    with pytest.raises(
        TypeError, match=r"^lsuv_: layer\(s\) l1 have a complex weight.*orthogonal=False"
    ):
        lsuv_(model, x)
    # frozen, the complex layer is left as it is and metainit_ scales the real one
    model.l1.requires_grad_(False)
    before = model.l1.weight.clone()
    report = metainit_(model, batches, nn.CrossEntropyLoss(), steps=2)
    assert {r["layer"] for r in report} == {"l2"}
    assert torch.equal(model.l1.weight, before)
