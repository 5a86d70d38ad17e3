"""Schemes as pure formulas: variances recomputed by hand from the papers, registry, validation."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

import initlab
from initlab.init.fans import Fans
from initlab.init.schemes import (
    DISTRIBUTIONS,
    SCHEME_NAMES,
    ArithmeticMean,
    Dirac,
    FanIn,
    FanOut,
    GeometricMean,
    InitSpec,
    OperatorNorm,
    Orthogonal,
    Scheme,
    arithmetic_variance,
    estimate_singular_ratio,
    fan_in_variance,
    fan_out_variance,
    geometric_variance,
    get_scheme,
    list_schemes,
    operator_norm_variance,
)

# Fans written out by hand: Linear(128 -> 256) and Conv2d(32 -> 64, 3x3).
LINEAR = Fans(fan_in=128, fan_out=256, receptive_field=1)
CONV = Fans(fan_in=32 * 9, fan_out=64 * 9, receptive_field=9)


# --------------------------------------------------------------------------------------------------
# Pure variance functions


def test_variance_functions_match_the_papers() -> None:
    assert fan_in_variance(128, math.sqrt(2.0)) == pytest.approx(2 / 128, rel=1e-15)
    assert fan_out_variance(256, math.sqrt(2.0)) == pytest.approx(2 / 256, rel=1e-15)
    # Glorot & Bengio with the ReLU gain: the paper's 4 / (fan_in + fan_out)
    assert arithmetic_variance(128, 256, math.sqrt(2.0)) == pytest.approx(4 / 384, rel=1e-15)
    assert arithmetic_variance(128, 256, 1.0) == pytest.approx(2 / 384, rel=1e-15)
    assert geometric_variance(128, 256) == pytest.approx(2 / math.sqrt(128 * 256), rel=1e-15)
    assert geometric_variance(128, 256, c=1.0) == pytest.approx(1 / math.sqrt(128 * 256))
    expected = 1 / ((math.sqrt(100) + math.sqrt(10)) ** 2 * 0.5**2 * 0.8**2)
    assert operator_norm_variance(100, 10, 0.5, 0.8) == pytest.approx(expected, rel=1e-15)


def test_geometric_conv_form_remark_6() -> None:
    # c / sqrt(fan_in fan_out) = c / (k^2 sqrt(n_in n_out)) for a k x k conv
    k, n_in, n_out = 3, 32, 64
    by_fans = geometric_variance(n_in * k * k, n_out * k * k, 2.0)
    assert by_fans == pytest.approx(2.0 / (k**2 * math.sqrt(n_in * n_out)), rel=1e-14)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), True])
def test_variance_functions_reject_bad_fans(bad) -> None:
    with pytest.raises(ValueError):
        fan_in_variance(bad, 1.0)
    with pytest.raises(ValueError):
        geometric_variance(10, bad)


# --------------------------------------------------------------------------------------------------
# Schemes: spec(fans) -> InitSpec, target variance written out by hand

# (scheme, fans, variance from the paper's formula written out by hand)
HAND_VARIANCES = [
    (FanIn(), LINEAR, 2 / 128),
    (FanIn(), CONV, 2 / 288),
    (FanIn(nonlinearity="linear"), CONV, 1 / 288),
    (FanIn(nonlinearity="leaky_relu", param=0.2), LINEAR, 2 / (1 + 0.04) / 128),
    (FanIn(gain=3.0), LINEAR, 9 / 128),
    (FanOut(), LINEAR, 2 / 256),
    (FanOut(), CONV, 2 / 576),
    (ArithmeticMean(), LINEAR, 4 / (128 + 256)),
    (ArithmeticMean(), CONV, 4 / (288 + 576)),
    (ArithmeticMean(nonlinearity="linear"), CONV, 2 / (288 + 576)),
    (GeometricMean(), LINEAR, 2 / math.sqrt(128 * 256)),
    (GeometricMean(), CONV, 2 / (9 * math.sqrt(32 * 64))),
    (GeometricMean(c=1.5), CONV, 1.5 / (9 * math.sqrt(32 * 64))),
    (OperatorNorm(), LINEAR, 4 / (math.sqrt(128) + math.sqrt(256)) ** 2),
    (OperatorNorm(), CONV, 4 / (math.sqrt(288) + math.sqrt(64)) ** 2),
    (
        OperatorNorm(nonlinearity="leaky_relu", param=0.2, a=0.5),
        LINEAR,
        1 / ((math.sqrt(128) + math.sqrt(256)) ** 2 * 0.6**2 * 0.25),
    ),
    (OperatorNorm(nonlinearity="tanh", lipschitz=1.0), LINEAR, 1 / (math.sqrt(128) + 16) ** 2),
]


@pytest.mark.parametrize(("scheme", "fans", "variance"), HAND_VARIANCES)
def test_spec_variance_matches_hand_formula(scheme: Scheme, fans: Fans, variance: float) -> None:
    spec = scheme.spec(fans)
    assert spec.distribution == "normal"
    assert spec.variance == pytest.approx(variance, rel=1e-13)


@pytest.mark.parametrize("distribution", ["normal", "uniform", "trunc_normal"])
def test_distribution_carries_through(distribution: str) -> None:
    spec = GeometricMean(distribution=distribution).spec(CONV)
    assert spec.distribution == distribution
    assert spec.variance == pytest.approx(2 / (9 * math.sqrt(32 * 64)), rel=1e-13)


def test_std_computed_like_torch() -> None:
    # Bit-exactness with torch needs torch's expressions, not sqrt(variance).
    assert FanIn().spec(CONV).std == math.sqrt(2.0) / math.sqrt(288)
    assert FanOut().spec(CONV).std == math.sqrt(2.0) / math.sqrt(576)
    xavier = ArithmeticMean(nonlinearity="linear").spec(CONV).std
    assert xavier == 1.0 * math.sqrt(2.0 / float(288 + 576))


def test_orthogonal_and_dirac_specs() -> None:
    spec = Orthogonal().spec(CONV)  # rows = n_out = 64, cols = fan_in = 288
    assert spec.distribution == "orthogonal"
    assert spec.gain == math.sqrt(2.0)
    assert spec.std == pytest.approx(math.sqrt(2.0) / math.sqrt(288), rel=1e-15)
    assert Orthogonal(nonlinearity="linear").spec(LINEAR).gain == 1.0
    spec = Dirac(gain=2.0).spec(CONV)
    assert spec.distribution == "dirac"
    assert spec.gain == 2.0
    assert spec.std == pytest.approx(2.0 / math.sqrt(576), rel=1e-15)


def test_schemes_are_frozen_and_hashable() -> None:
    scheme = FanIn()
    with pytest.raises(dataclasses.FrozenInstanceError):
        scheme.gain = 2.0  # type: ignore[misc]
    assert hash(scheme) == hash(FanIn())
    assert scheme == FanIn()


def test_scheme_validation() -> None:
    with pytest.raises(ValueError, match="normal, trunc_normal, uniform"):
        FanIn(distribution="gaussian")
    with pytest.raises(ValueError, match="unknown nonlinearity"):
        FanIn(nonlinearity="relu7")
    with pytest.raises(ValueError, match="gain"):
        FanIn(gain=float("nan"))
    with pytest.raises(ValueError, match="lipschitz="):
        OperatorNorm(nonlinearity="elu")  # no tabulated average Lipschitz constant
    with pytest.raises(ValueError, match="lipschitz"):
        OperatorNorm(lipschitz=0.0)
    with pytest.raises(ValueError, match="c must"):
        GeometricMean(c=-1.0)
    with pytest.raises(TypeError, match="Fans"):
        FanIn().spec((128, 256))  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# InitSpec


def test_initspec_validation() -> None:
    with pytest.raises(ValueError) as info:
        InitSpec("gaussian", 1.0)
    for name in DISTRIBUTIONS:
        assert name in str(info.value)
    for bad_std in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="std"):
            InitSpec("normal", bad_std)
    with pytest.raises(ValueError, match="truncation"):
        InitSpec("trunc_normal", 1.0, truncation=0.0)
    with pytest.raises(ValueError, match="value"):
        InitSpec("constant", 0.0, value=float("nan"))
    assert InitSpec("normal", 0.5).variance == 0.25


# --------------------------------------------------------------------------------------------------
# Registry


@pytest.mark.parametrize(
    ("name", "cls", "gain"),
    [
        ("fan_in", FanIn, math.sqrt(2.0)),
        ("kaiming", FanIn, math.sqrt(2.0)),
        ("he", FanIn, math.sqrt(2.0)),
        ("lecun", FanIn, 1.0),
        ("fan_out", FanOut, math.sqrt(2.0)),
        ("arithmetic", ArithmeticMean, math.sqrt(2.0)),
        ("xavier", ArithmeticMean, 1.0),
        ("Glorot", ArithmeticMean, 1.0),
        ("geometric", GeometricMean, math.sqrt(2.0)),
        ("orthogonal", Orthogonal, math.sqrt(2.0)),
        ("dirac", Dirac, math.sqrt(2.0)),
    ],
)
def test_get_scheme_names_and_aliases(name: str, cls: type, gain: float) -> None:
    scheme = get_scheme(name)
    assert type(scheme) is cls
    assert scheme.resolved_gain() == gain  # type: ignore[attr-defined]


def test_get_scheme_kwargs_and_passthrough() -> None:
    assert get_scheme("operator-norm", a=0.5) == OperatorNorm(a=0.5)
    assert get_scheme("lecun", distribution="uniform") == FanIn(
        nonlinearity="linear", distribution="uniform"
    )
    scheme = GeometricMean(c=1.0)
    assert get_scheme(scheme) is scheme
    with pytest.raises(ValueError, match="replace"):
        get_scheme(scheme, c=2.0)
    with pytest.raises(TypeError, match="valid"):
        get_scheme("fan_in", lipschitz=0.5)
    with pytest.raises(TypeError):
        get_scheme(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "torch_init"),
    [
        ("xavier_uniform", torch.nn.init.xavier_uniform_),
        ("glorot-normal", torch.nn.init.xavier_normal_),
        ("kaiming_uniform", lambda w, generator: torch.nn.init.kaiming_uniform_(
            w, nonlinearity="relu", generator=generator)),
        ("he_normal", lambda w, generator: torch.nn.init.kaiming_normal_(
            w, nonlinearity="relu", generator=generator)),
    ],
)  # fmt: skip
def test_torch_init_names_with_a_distribution_suffix(name: str, torch_init: Any) -> None:
    base, distribution = name.replace("-", "_").rsplit("_", 1)
    assert get_scheme(name) == get_scheme(base, distribution=distribution)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.ReLU(), torch.nn.Linear(20, 5))
    initlab.init_model(model, name, generator=7, head="off")
    expected = torch.empty(20, 30)
    torch_init(expected, generator=torch.Generator().manual_seed(7))
    assert torch.equal(model[0].weight, expected)  # bit for bit, as torch.nn.init draws it


def test_a_suffix_needs_a_scheme_that_draws_and_agrees_with_distribution() -> None:
    for name in ("orthogonal_uniform", "dirac_normal", "msra_normal"):
        with pytest.raises(ValueError, match="a name with a distribution suffix"):
            get_scheme(name)
    with pytest.raises(ValueError, match="names the distribution 'uniform'"):
        get_scheme("xavier_uniform", distribution="normal")
    assert get_scheme("fan_out_trunc_normal").distribution == "trunc_normal"


def test_unknown_scheme_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown scheme") as info:
        get_scheme("msra")
    message = str(info.value)
    for name in (*SCHEME_NAMES, "kaiming", "he", "glorot"):
        assert name in message


def test_list_schemes_rows() -> None:
    rows = list_schemes()
    assert [row["name"] for row in rows] == list(SCHEME_NAMES)
    for row in rows:
        assert set(row) == {"name", "aliases", "formula", "reference"}
        assert row["formula"] and row["reference"]
        get_scheme(row["name"])
    by_name = {row["name"]: row for row in rows}
    assert by_name["fan_in"]["aliases"] == "kaiming, he"
    assert "Defazio" in by_name["geometric"]["reference"]


def test_every_scheme_class_documents_its_formula() -> None:
    for cls in (FanIn, FanOut, ArithmeticMean, GeometricMean, OperatorNorm, Orthogonal, Dirac):
        assert cls.formula and cls.reference and cls.name
        assert cls.__doc__ and "(" in cls.__doc__


# --------------------------------------------------------------------------------------------------
# estimate_singular_ratio: the lecture's a


@pytest.mark.parametrize(("shape", "expected"), [((100, 10), 0.78), ((100, 100), 0.43)])
def test_singular_ratio_matches_lecture(shape: tuple[int, int], expected: float) -> None:
    ratio = estimate_singular_ratio(shape, generator=torch.Generator().manual_seed(0))
    assert abs(ratio - expected) <= 0.05


def test_singular_ratio_single_column_and_determinism() -> None:
    assert estimate_singular_ratio((100, 1), samples=3) == pytest.approx(1.0, abs=1e-15)
    first = estimate_singular_ratio((30, 20), generator=torch.Generator().manual_seed(1))
    again = estimate_singular_ratio((30, 20), generator=torch.Generator().manual_seed(1))
    assert first == again
    # an int seed, as every other generator= takes (it raised AttributeError: 'int' ... 'device')
    assert estimate_singular_ratio((30, 20), generator=1) == first
    with pytest.raises(ValueError):
        estimate_singular_ratio((10,))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        estimate_singular_ratio((10, 10), samples=0)
