"""Gains: torch's table bit for bit; numeric gains against independent float64 paths."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from initlab.init.gains import GAIN_NAMES, average_lipschitz, calculate_gain

TORCH_NAMES = [
    "linear",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "sigmoid",
    "tanh",
    "relu",
    "leaky_relu",
    "selu",
]


def _phi_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def _trapezoid_second_moment(fn) -> float:
    """E[fn(z)^2], z ~ N(0, 1), by the trapezoid rule in numpy on 2e6 points over [-15, 15]."""
    z, step = np.linspace(-15.0, 15.0, 2_000_001, retstep=True)
    integrand = fn(z) ** 2 * np.exp(-0.5 * z**2) / math.sqrt(2.0 * math.pi)
    return float(step * (integrand.sum() - 0.5 * (integrand[0] + integrand[-1])))


@pytest.mark.parametrize("name", TORCH_NAMES)
def test_matches_torch_for_every_torch_name(name: str) -> None:
    assert calculate_gain(name) == torch.nn.init.calculate_gain(name)


@pytest.mark.parametrize("slope", [None, 0.0, 0.2, 1, 3.0])
def test_leaky_relu_param_matches_torch(slope: float | None) -> None:
    assert calculate_gain("leaky_relu", slope) == torch.nn.init.calculate_gain("leaky_relu", slope)


def test_table_values() -> None:
    assert calculate_gain("identity") == 1.0
    assert calculate_gain("relu") == math.sqrt(2.0)
    assert calculate_gain("tanh") == 5.0 / 3
    assert calculate_gain("selu") == 0.75
    assert calculate_gain("leaky_relu") == math.sqrt(2.0 / (1 + 0.01**2))
    assert calculate_gain("ReLU") == calculate_gain("relu")  # case-insensitive


def test_numeric_relu_via_callable_is_sqrt2() -> None:
    assert calculate_gain(torch.relu) == pytest.approx(math.sqrt(2.0), rel=1e-9, abs=0)
    assert calculate_gain(lambda x: x.clamp(min=0)) == pytest.approx(math.sqrt(2.0), rel=1e-9)


def test_numeric_identity_callable_is_one() -> None:
    assert calculate_gain(lambda x: x) == pytest.approx(1.0, rel=1e-9, abs=0)


def test_gelu_against_closed_form() -> None:
    # E[z^2 Phi(z)^2] = E[Phi^2] + E[phi(z)^2] = 1/3 + 1/(2 pi sqrt 3) (Stein's identity twice).
    second_moment = 1.0 / 3.0 + 1.0 / (2.0 * math.pi * math.sqrt(3.0))
    assert calculate_gain("gelu") == pytest.approx(1.0 / math.sqrt(second_moment), rel=1e-9, abs=0)


@pytest.mark.parametrize("alpha", [None, 0.5, 1.0, 2.0])
def test_elu_against_closed_form(alpha: float | None) -> None:
    # E[elu^2] = 1/2 + alpha^2 (e^2 Phi(-2) - 2 e^(1/2) Phi(-1) + 1/2), using
    # E[e^{tz}; z < 0] = e^{t^2/2} Phi(-t).
    a = 1.0 if alpha is None else alpha
    second_moment = 0.5 + a**2 * (
        math.exp(2.0) * _phi_cdf(-2.0) - 2.0 * math.exp(0.5) * _phi_cdf(-1.0) + 0.5
    )
    expected = 1.0 / math.sqrt(second_moment)
    assert calculate_gain("elu", alpha) == pytest.approx(expected, rel=1e-9, abs=0)


def test_silu_against_numpy_trapezoid() -> None:
    second_moment = _trapezoid_second_moment(lambda z: z / (1.0 + np.exp(-z)))
    expected = 1.0 / math.sqrt(second_moment)
    assert calculate_gain("silu") == pytest.approx(expected, rel=1e-9, abs=0)
    assert calculate_gain("swish") == calculate_gain("silu")


def test_callable_gain_is_cached_by_identity() -> None:
    calls = []

    def softplus(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return torch.nn.functional.softplus(x)

    first = calculate_gain(softplus)
    second = calculate_gain(softplus)
    assert first == second
    assert len(calls) == 1


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown nonlinearity") as info:
        calculate_gain("relu6")
    for name in GAIN_NAMES:
        assert name in str(info.value)


def test_param_for_a_function_without_one() -> None:
    with pytest.raises(ValueError, match="takes no param"):
        calculate_gain("relu", 0.1)
    with pytest.raises(ValueError, match="takes no param"):
        calculate_gain("gelu", 1.0)
    with pytest.raises(ValueError, match="callable"):
        calculate_gain(torch.relu, 0.1)


def test_bad_param_and_bad_callable() -> None:
    with pytest.raises(ValueError, match="finite real"):
        calculate_gain("leaky_relu", True)
    with pytest.raises(ValueError, match="finite real"):
        calculate_gain("elu", float("nan"))
    with pytest.raises(ValueError, match="second moment"):
        calculate_gain(torch.zeros_like)
    with pytest.raises(ValueError, match="unknown nonlinearity"):
        calculate_gain(3.0)  # type: ignore[arg-type]


def test_average_lipschitz() -> None:
    assert average_lipschitz("relu") == 0.5
    assert average_lipschitz("leaky_relu") == pytest.approx((1 + 0.01) / 2)
    assert average_lipschitz("leaky_relu", 0.2) == pytest.approx(0.6)
    assert average_lipschitz("linear") == 1.0
    assert average_lipschitz("identity") == 1.0


def test_average_lipschitz_of_smooth_nonlinearities_is_the_mean_absolute_slope() -> None:
    """``E|phi'(z)|``, z ~ N(0, 1), checked against autograd on a large sample (5 sigma)."""
    z = torch.randn(200_000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    z.requires_grad_(True)
    fns = {"gelu": F.gelu, "silu": F.silu, "swish": F.silu, "tanh": torch.tanh}
    fns["sigmoid"] = torch.sigmoid
    for name, fn in fns.items():
        (slope,) = torch.autograd.grad(fn(z).sum(), z)
        slope = slope.abs()
        sem = float(slope.std()) / math.sqrt(z.numel())
        assert average_lipschitz(name) == pytest.approx(float(slope.mean()), abs=5 * sem), name
    assert average_lipschitz("gelu") == pytest.approx(0.53932, abs=1e-5)
    assert average_lipschitz("tanh") == pytest.approx(0.60571, abs=1e-5)


@pytest.mark.parametrize("nonlinearity", ["elu", "selu", "nope", torch.relu])
def test_average_lipschitz_unknown_asks_for_explicit_value(nonlinearity) -> None:
    with pytest.raises(ValueError, match="lipschitz="):
        average_lipschitz(nonlinearity)
