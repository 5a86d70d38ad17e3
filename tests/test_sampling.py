"""Samplers: achieved variances against the papers' formulas written out by hand, exact properties
(orthogonality, identity convolution), equality with torch.nn.init, seeds, devices, bad input."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import initlab
from initlab.init.fans import compute_fans
from initlab.init.sampling import (
    arithmetic_normal_,
    arithmetic_uniform_,
    dirac_,
    fan_in_normal_,
    fan_in_uniform_,
    fan_out_normal_,
    fan_out_uniform_,
    geometric_normal_,
    geometric_trunc_normal_,
    geometric_uniform_,
    normal_,
    operator_norm_normal_,
    orthogonal_,
    sample_,
    trunc_normal_,
    uniform_,
)
from initlab.init.schemes import Dirac, InitSpec, Orthogonal, get_scheme


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------------------------------
# Cases as data: weight layouts with their fans written out by hand.
# fan_in = (n_in / groups) * k, fan_out = (n_out / groups) * k, n_out = fan_out / k.

CASES = [
    pytest.param(
        {"shape": (256, 128), "groups": 1, "transposed": False, "fi": 128, "fo": 256, "no": 256},
        id="linear",
    ),
    pytest.param(
        {"shape": (64, 32, 3, 3), "groups": 1, "transposed": False, "fi": 288, "fo": 576, "no": 64},
        id="conv2d",
    ),
    pytest.param(
        {"shape": (64, 32, 5), "groups": 1, "transposed": False, "fi": 160, "fo": 320, "no": 64},
        id="conv1d",
    ),
    pytest.param(
        {"shape": (96, 16, 3, 3), "groups": 4, "transposed": False, "fi": 144, "fo": 216, "no": 24},
        id="grouped_conv2d",
    ),
    pytest.param(
        {"shape": (32, 24, 3, 3), "groups": 2, "transposed": True, "fi": 144, "fo": 216, "no": 24},
        id="grouped_conv_transpose2d",
    ),
]

# Target variances from the papers, written out by hand (not via initlab's functions); ReLU gain 2.
HAND_VARIANCE: dict[str, Callable[[dict[str, Any]], float]] = {
    "fan_in": lambda c: 2 / c["fi"],  # He et al. 2015
    "lecun": lambda c: 1 / c["fi"],  # LeCun et al. 1998
    "fan_out": lambda c: 2 / c["fo"],  # He et al. 2015, backward
    "arithmetic": lambda c: 4 / (c["fi"] + c["fo"]),  # Glorot & Bengio, ReLU-corrected
    "xavier": lambda c: 2 / (c["fi"] + c["fo"]),  # Glorot & Bengio 2010
    "geometric": lambda c: 2 / math.sqrt(c["fi"] * c["fo"]),  # Defazio & Bottou, Eq. 2/7
    # lecture: 1 / ((sqrt(cols) + sqrt(rows))^2 L^2), L = 0.5, matrix n_out x fan_in
    "operator_norm": lambda c: 1 / ((math.sqrt(c["fi"]) + math.sqrt(c["no"])) ** 2 * 0.25),
}


def _truncated_moments(a: float) -> tuple[float, float]:
    """E[x^2] and E[x^4] of N(0, 1) truncated to [-a, a] (integration by parts)."""
    mass = math.erf(a / math.sqrt(2.0))
    pdf = math.exp(-0.5 * a * a) / math.sqrt(2.0 * math.pi)
    m2 = (mass - 2 * a * pdf) / mass
    m4 = (3 * (mass - 2 * a * pdf) - 2 * a**3 * pdf) / mass
    return m2, m4


_M2, _M4 = _truncated_moments(2.0)
# Kurtosis of each distribution; for trunc_normal computed from its formula (about 2.36 at ±2σ').
KURTOSIS = {"normal": 3.0, "uniform": 1.8, "trunc_normal": _M4 / _M2**2}


def test_truncated_kurtosis_formula() -> None:
    assert 2.3 < KURTOSIS["trunc_normal"] < 2.4
    assert abs(_M2 - 0.7737413) <= 1e-6


@pytest.mark.parametrize("distribution", ["normal", "uniform", "trunc_normal"])
@pytest.mark.parametrize("scheme_name", list(HAND_VARIANCE))
@pytest.mark.parametrize("case", CASES)
def test_achieved_variance(case: dict[str, Any], scheme_name: str, distribution: str) -> None:
    weight = torch.empty(case["shape"])
    fans = compute_fans(weight, groups=case["groups"], transposed=case["transposed"])
    spec = get_scheme(scheme_name, distribution=distribution).spec(fans)
    sample_(weight, spec, generator=gen(1), groups=case["groups"], transposed=case["transposed"])

    n = weight.numel()
    assert n >= 5_000
    target = HAND_VARIANCE[scheme_name](case)
    achieved = weight.double().pow(2).mean().item()  # the mean is 0 by construction
    rel_tol = 5 * math.sqrt((KURTOSIS[distribution] - 1) / n)
    assert abs(achieved / target - 1) <= rel_tol, (achieved, target, rel_tol)
    assert abs(weight.double().mean().item()) <= 5 * math.sqrt(target / n)
    if distribution == "uniform":
        assert weight.abs().max().item() <= math.sqrt(3 * target) * (1 + 1e-6)
    if distribution == "trunc_normal":
        assert weight.abs().max().item() <= 2 * math.sqrt(target / _M2) * (1 + 1e-6)


# --------------------------------------------------------------------------------------------------
# Public samplers: compute_fans -> Scheme.spec -> sample_

SAMPLERS = [
    (fan_in_normal_, "fan_in", "normal"),
    (fan_in_uniform_, "fan_in", "uniform"),
    (fan_out_normal_, "fan_out", "normal"),
    (fan_out_uniform_, "fan_out", "uniform"),
    (arithmetic_normal_, "arithmetic", "normal"),
    (arithmetic_uniform_, "arithmetic", "uniform"),
    (geometric_normal_, "geometric", "normal"),
    (geometric_uniform_, "geometric", "uniform"),
    (geometric_trunc_normal_, "geometric", "trunc_normal"),
    (operator_norm_normal_, "operator_norm", "normal"),
]
SAMPLER_IDS = [fn.__name__ for fn, _, _ in SAMPLERS]


@pytest.mark.parametrize(("sampler", "name", "distribution"), SAMPLERS, ids=SAMPLER_IDS)
@pytest.mark.parametrize("case", CASES)
def test_public_sampler_is_the_scheme_path(
    case: dict[str, Any], sampler: Callable[..., torch.Tensor], name: str, distribution: str
) -> None:
    layout = {"groups": case["groups"], "transposed": case["transposed"]}
    ours = torch.empty(case["shape"])
    returned = sampler(ours, generator=gen(3), **layout)
    assert returned is ours
    reference = torch.empty(case["shape"])
    spec = get_scheme(name, distribution=distribution).spec(compute_fans(reference, **layout))
    sample_(reference, spec, generator=gen(3), **layout)
    assert torch.equal(ours, reference)


@pytest.mark.parametrize(("sampler", "name", "distribution"), SAMPLERS, ids=SAMPLER_IDS)
def test_seeds(sampler: Callable[..., torch.Tensor], name: str, distribution: str) -> None:
    first = sampler(torch.empty(64, 32, 3, 3), generator=gen(7))
    again = sampler(torch.empty(64, 32, 3, 3), generator=gen(7))
    other = sampler(torch.empty(64, 32, 3, 3), generator=gen(8))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


# A strided ConvTranspose2d(48, 32, 4, groups=2): weight (48, 16, 4, 4), n_in / g = 24, k = 16,
# n_out / g = 16. Each output sums (n_in / g) * k / prod(stride) inputs: fi below, by hand.
STRIDED = [
    pytest.param({"stride": 2, "fi": 24 * 16 / 4}, id="stride2"),
    pytest.param({"stride": (2, 3), "fi": 24 * 16 / 6}, id="stride2x3"),
]


@pytest.mark.parametrize(("sampler", "name", "distribution"), SAMPLERS, ids=SAMPLER_IDS)
@pytest.mark.parametrize("case", STRIDED)
def test_a_scheme_sampler_takes_a_conv_transpose_s_stride(
    case: dict[str, Any], sampler: Callable[..., torch.Tensor], name: str, distribution: str
) -> None:
    """The samplers had no stride=: on a strided ConvTranspose they drew with fan_in =
    (n_in / g) * k, prod(stride) times (fan_in) or sqrt of it (geometric) below init_model."""
    hand = {"fi": case["fi"], "fo": 16 * 16, "no": 16}
    if name == "operator_norm":  # cols of the n_out x (n_in * k) matrix, whatever the stride
        hand["fi"] = 24 * 16
    target = HAND_VARIANCE[name](hand)
    weight = sampler(
        torch.empty(48, 16, 4, 4),
        groups=2,
        transposed=True,
        stride=case["stride"],
        generator=gen(5),
    )
    achieved = weight.double().pow(2).mean().item()
    rel_tol = 5 * math.sqrt((KURTOSIS[distribution] - 1) / weight.numel())
    assert abs(achieved / target - 1) <= rel_tol, (achieved, target, rel_tol)
    # init_model draws the layer with the same variance (ReLU gain, as the samplers' default)
    layer = torch.nn.ConvTranspose2d(48, 32, 4, stride=case["stride"], groups=2)
    report = initlab.init_model(torch.nn.Sequential(layer), name, gains="scheme", generator=0)
    (row,) = [r for r in report if r["param"] == "weight"]
    assert abs(row["target_std"] ** 2 / target - 1) <= 1e-12
    with pytest.raises(ValueError, match=r"stride=2 changes the fans of a transposed convolution"):
        sampler(torch.empty(48, 16, 4, 4), stride=2)  # not transposed: fan_in is (n_in / g) * k


def test_orthogonal_seeds() -> None:
    assert torch.equal(
        orthogonal_(torch.empty(8, 5), generator=gen(0)),
        orthogonal_(torch.empty(8, 5), generator=gen(0)),
    )
    assert not torch.equal(
        orthogonal_(torch.empty(8, 5), generator=gen(0)),
        orthogonal_(torch.empty(8, 5), generator=gen(1)),
    )


def test_scheme_keywords_reach_the_sampler() -> None:
    w = geometric_normal_(torch.empty(200, 100), c=8.0, generator=gen(0))
    rel = w.double().pow(2).mean().item() / (8 / math.sqrt(200 * 100))
    assert abs(rel - 1) <= 5 * math.sqrt(2 / w.numel())
    w = operator_norm_normal_(torch.empty(200, 100), lipschitz=1.0, a=0.5, generator=gen(0))
    target = 1 / ((math.sqrt(100) + math.sqrt(200)) ** 2 * 1.0 * 0.25)
    assert abs(w.double().pow(2).mean().item() / target - 1) <= 5 * math.sqrt(2 / w.numel())
    w = fan_in_normal_(torch.empty(200, 100), gain=1.0, generator=gen(0))
    assert abs(w.double().pow(2).mean().item() * 100 - 1) <= 5 * math.sqrt(2 / w.numel())


# --------------------------------------------------------------------------------------------------
# Equivalences with torch.nn.init (claimed in the docstrings)

TORCH_SHAPES = [(256, 128), (64, 32, 3, 3), (16, 8, 5)]


@pytest.mark.parametrize("shape", TORCH_SHAPES)
def test_fan_in_equals_kaiming(shape: tuple[int, ...]) -> None:
    ours = fan_in_normal_(torch.empty(shape), generator=gen(0))
    theirs = torch.nn.init.kaiming_normal_(
        torch.empty(shape), nonlinearity="relu", generator=gen(0)
    )
    assert torch.equal(ours, theirs)
    ours = fan_in_uniform_(torch.empty(shape), generator=gen(0))
    theirs = torch.nn.init.kaiming_uniform_(
        torch.empty(shape), nonlinearity="relu", generator=gen(0)
    )
    assert torch.equal(ours, theirs)
    ours = fan_in_normal_(
        torch.empty(shape), nonlinearity="leaky_relu", param=0.2, generator=gen(0)
    )
    theirs = torch.nn.init.kaiming_normal_(torch.empty(shape), a=0.2, generator=gen(0))
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("shape", TORCH_SHAPES)
def test_fan_out_equals_kaiming_fan_out(shape: tuple[int, ...]) -> None:
    ours = fan_out_normal_(torch.empty(shape), generator=gen(0))
    theirs = torch.nn.init.kaiming_normal_(
        torch.empty(shape), mode="fan_out", nonlinearity="relu", generator=gen(0)
    )
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("shape", TORCH_SHAPES)
def test_arithmetic_linear_equals_xavier(shape: tuple[int, ...]) -> None:
    ours = arithmetic_normal_(torch.empty(shape), nonlinearity="linear", generator=gen(0))
    assert torch.equal(ours, torch.nn.init.xavier_normal_(torch.empty(shape), generator=gen(0)))
    ours = arithmetic_uniform_(torch.empty(shape), nonlinearity="linear", generator=gen(0))
    assert torch.equal(ours, torch.nn.init.xavier_uniform_(torch.empty(shape), generator=gen(0)))


@pytest.mark.parametrize("shape", TORCH_SHAPES)
def test_orthogonal_equals_torch(shape: tuple[int, ...]) -> None:
    ours = orthogonal_(torch.empty(shape), 1.5, generator=gen(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ours factors on one thread; torch's depends on the thread count
    try:
        theirs = torch.nn.init.orthogonal_(torch.empty(shape), 1.5, generator=gen(0))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(ours, theirs)


# --------------------------------------------------------------------------------------------------
# Orthogonal: W^T W = g^2 I (tall) or W W^T = g^2 I (wide), per group


@pytest.mark.parametrize(
    ("shape", "groups", "transposed"),
    [
        ((256, 128), 1, False),  # tall
        ((128, 256), 1, False),  # wide
        ((200, 200), 1, False),  # square
        ((64, 32, 3, 3), 1, False),  # conv, wide 64 x 288
        ((512, 8, 3, 3), 1, False),  # conv, tall 512 x 72
        ((96, 16, 3, 3), 4, False),  # grouped: 4 blocks of 24 x 144
        ((32, 24, 3, 3), 2, True),  # transposed, grouped: 2 blocks of 24 x 144
    ],
)
@pytest.mark.parametrize("gain", [1.0, math.sqrt(2.0), 0.5])
def test_orthogonal_gram(
    shape: tuple[int, ...], groups: int, transposed: bool, gain: float
) -> None:
    weight = orthogonal_(
        torch.empty(shape), gain, groups=groups, transposed=transposed, generator=gen(0)
    )
    for block in weight.chunk(groups, dim=0):
        matrix = block.transpose(0, 1) if transposed else block
        matrix = matrix.reshape(matrix.shape[0], -1)
        rows, cols = matrix.shape
        gram = matrix @ matrix.T if rows <= cols else matrix.T @ matrix
        identity = torch.eye(min(rows, cols))
        assert (gram - gain**2 * identity).abs().max().item() <= 1e-5
    # the scheme's std is the exact RMS entry
    spec = Orthogonal(gain=gain).spec(compute_fans(weight, groups=groups, transposed=transposed))
    rms = weight.double().pow(2).mean().sqrt().item()
    assert rms == pytest.approx(spec.std, rel=1e-5)


def test_orthogonal_through_sample_and_half_precision() -> None:
    spec = Orthogonal(nonlinearity="linear").spec(compute_fans((40, 30)))
    weight = sample_(torch.empty(40, 30, dtype=torch.float64), spec, generator=gen(0))
    assert (weight.T @ weight - torch.eye(30, dtype=torch.float64)).abs().max() <= 1e-12
    half = orthogonal_(torch.empty(40, 30, dtype=torch.float16), generator=gen(0))
    single = orthogonal_(torch.empty(40, 30), generator=gen(0))
    assert torch.equal(half, single.half())


# --------------------------------------------------------------------------------------------------
# Dirac: a convolution passes its input through unchanged (times gain)


@pytest.mark.parametrize("gain", [1.0, math.sqrt(2.0)])
@pytest.mark.parametrize(
    ("conv", "weight_shape", "input_shape", "groups"),
    [
        (F.conv1d, (6, 6, 3), (2, 6, 11), 1),
        (F.conv2d, (6, 6, 3, 3), (2, 6, 7, 7), 1),
        (F.conv2d, (8, 4, 5, 5), (2, 8, 9, 9), 2),
        (F.conv3d, (4, 4, 3, 3, 3), (1, 4, 5, 5, 5), 1),
        (F.conv_transpose2d, (6, 6, 3, 3), (2, 6, 7, 7), 1),
    ],
)
def test_dirac_identity_convolution(
    conv: Callable[..., torch.Tensor],
    weight_shape: tuple[int, ...],
    input_shape: tuple[int, ...],
    groups: int,
    gain: float,
) -> None:
    weight = dirac_(torch.empty(weight_shape), gain, groups=groups)
    x = torch.randn(input_shape, generator=gen(0))
    padding = weight_shape[-1] // 2
    out = conv(x, weight, padding=padding, groups=groups)
    torch.testing.assert_close(out, gain * x, rtol=1e-6, atol=1e-6)


def test_dirac_spec_std_and_sample_path() -> None:
    weight = torch.empty(96, 16, 3, 3)  # groups = 4: per group 24 out x 16 in
    spec = Dirac(gain=2.0).spec(compute_fans(weight, groups=4))
    sample_(weight, spec, groups=4)
    assert (weight != 0).sum().item() == 4 * 16
    rms = weight.double().pow(2).mean().sqrt().item()
    assert rms == pytest.approx(spec.std, rel=1e-12)


def test_dirac_on_a_linear_weight_is_the_identity() -> None:
    x = torch.randn(5, 6, generator=gen(0))
    torch.testing.assert_close(F.linear(x, dirac_(torch.empty(6, 6), 3.0)), 3.0 * x)
    torch.testing.assert_close(dirac_(torch.empty(2, 3)), torch.eye(2, 3))


def test_dirac_rejects_non_conv_shapes() -> None:
    for shape in [(4,), (1, 1, 1, 1, 1, 1)]:
        with pytest.raises(ValueError, match="3-, 4- or 5-D"):
            dirac_(torch.empty(shape))
    with pytest.raises(ValueError, match="divisible"):
        dirac_(torch.empty(6, 2, 3), groups=4)


# --------------------------------------------------------------------------------------------------
# The lecture's table: L = 0.5, a = 1 gives ||W||_2 close to 1/L = 2

LECTURE_SHAPES = [(100, 1), (100, 10), (100, 100), (1000, 1), (1000, 100), (1000, 1000)]


def _spectral_norm(weight: torch.Tensor) -> float:
    """Largest singular value, as sqrt of the top eigenvalue of the smaller Gram matrix (float64).

    eigvalsh (single-threaded) is used rather than svdvals: it is several times faster on a
    1000 x 1000 matrix, and neither slows down badly when the CPU is shared.
    """
    w = weight.double()
    gram = w @ w.T if w.shape[0] <= w.shape[1] else w.T @ w
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # multi-threaded LAPACK is ~15x slower on an oversubscribed CPU
    try:
        return math.sqrt(torch.linalg.eigvalsh(gram)[-1].item())
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize(("n_j", "n_j1"), LECTURE_SHAPES)
def test_operator_norm_lecture_table(n_j: int, n_j1: int) -> None:
    generator = gen(0)
    sigma = 1 / ((math.sqrt(n_j) + math.sqrt(n_j1)) * 0.5)  # the lecture's std, by hand
    norms = []
    for _ in range(10):
        weight = operator_norm_normal_(torch.empty(n_j1, n_j), generator=generator)  # (n_out, n_in)
        norms.append(_spectral_norm(weight))
    mean = sum(norms) / len(norms)
    # The 10-draw mean is about 2 for every shape (1.81 for the 1 x 100 vector; the lecture: 1.80).
    assert 1.6 <= mean <= 2.05, norms
    if n_j1 == 1:
        # A 1 x n weight is a vector: ||W||^2 / sigma^2 is chi-square with n degrees of freedom
        # (mean n, std sqrt(2n)); every draw within 5 of those std. The fixed band [1.6, 2.05] is
        # not used here: for n = 100 a draw leaves it with probability ~8% (||W|| ~ 1.81 ± 0.13).
        for norm in norms:
            assert abs((norm / sigma) ** 2 - n_j) <= 5 * math.sqrt(2 * n_j), norms
    else:
        # Largest singular value: below sigma * (sqrt(n) + sqrt(m) + 5) = 2 + 5 sigma except with
        # probability exp(-12.5) (Gordon's bound on the mean plus Gaussian concentration of the
        # 1-Lipschitz norm), and above the lecture's 1.6.
        for norm in norms:
            assert 1.6 <= norm <= 2 + 5 * sigma, norms
        if n_j >= 1000:
            # Tracy-Widom-scale fluctuations: here every draw also lies in [1.6, 2.05].
            assert all(1.6 <= norm <= 2.05 for norm in norms), norms
    if (n_j, n_j1) == (1000, 1000):
        assert abs(mean - 2) <= 0.02 * 2, norms


# --------------------------------------------------------------------------------------------------
# Distribution samplers, dtypes, devices


def test_trunc_normal_rescaling_and_bounds() -> None:
    weight = trunc_normal_(torch.empty(200, 100), 0.1, truncation=1.0, generator=gen(0))
    m2, m4 = _truncated_moments(1.0)
    n = weight.numel()
    achieved = weight.double().pow(2).mean().item()
    assert abs(achieved / 0.01 - 1) <= 5 * math.sqrt((m4 / m2**2 - 1) / n)
    assert weight.abs().max().item() <= 1.0 * 0.1 / math.sqrt(m2) * (1 + 1e-6)


def test_zero_std_and_constant() -> None:
    for sampler in (normal_, uniform_, trunc_normal_):
        weight = sampler(torch.ones(5, 5), 0.0, generator=gen(0))
        assert torch.equal(weight, torch.zeros(5, 5))
    weight = sample_(torch.empty(3, 3), InitSpec("constant", 0.0, value=0.25))
    assert torch.equal(weight, torch.full((3, 3), 0.25))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sampler", [fan_in_normal_, fan_in_uniform_, geometric_trunc_normal_])
def test_half_precision_draws_in_float32(
    sampler: Callable[..., torch.Tensor], dtype: torch.dtype
) -> None:
    low = sampler(torch.empty(64, 32, 3, 3, dtype=dtype), generator=gen(0))
    single = sampler(torch.empty(64, 32, 3, 3), generator=gen(0))
    assert low.dtype == dtype
    assert torch.equal(low, single.to(dtype))


def test_parameter_with_requires_grad() -> None:
    layer = torch.nn.Linear(32, 16)
    out = fan_in_normal_(layer.weight, generator=gen(0))
    assert out is layer.weight
    assert out.requires_grad
    assert torch.equal(out.detach(), fan_in_normal_(torch.empty(16, 32), generator=gen(0)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_generator_gives_same_values_on_cuda() -> None:
    cpu = fan_in_normal_(torch.empty(64, 32, 3, 3), generator=gen(0))
    cuda = fan_in_normal_(torch.empty(64, 32, 3, 3, device="cuda"), generator=gen(0))
    assert cuda.device.type == "cuda"
    assert torch.equal(cuda.cpu(), cpu)
    ortho_cpu = orthogonal_(torch.empty(30, 20), generator=gen(0))
    ortho_cuda = orthogonal_(torch.empty(30, 20, device="cuda"), generator=gen(0))
    assert torch.equal(ortho_cuda.cpu(), ortho_cpu)


# --------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(("sampler", "name", "distribution"), SAMPLERS, ids=SAMPLER_IDS)
def test_one_dim_weight_is_rejected(
    sampler: Callable[..., torch.Tensor], name: str, distribution: str
) -> None:
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        sampler(torch.empty(10))


@pytest.mark.parametrize(("sampler", "name", "distribution"), SAMPLERS, ids=SAMPLER_IDS)
def test_meta_tensor_is_rejected(
    sampler: Callable[..., torch.Tensor], name: str, distribution: str
) -> None:
    with pytest.raises(ValueError, match=r"to_empty"):
        sampler(torch.empty(8, 4, device="meta"))


@pytest.mark.parametrize(("sampler", "name", "distribution"), SAMPLERS, ids=SAMPLER_IDS)
def test_a_scheme_sampler_names_itself_in_its_errors(
    sampler: Callable[..., torch.Tensor], name: str, distribution: str
) -> None:
    """geometric_normal_ said "normal_ needs a floating-point tensor" (the draw it calls)."""
    me = re.escape(sampler.__name__)
    with pytest.raises(ValueError, match=rf"^{me} needs a floating-point tensor, got dtype"):
        sampler(torch.empty(4, 4, dtype=torch.complex64))
    with pytest.raises(ValueError, match=rf"^{me}: the tensor is on the meta device"):
        sampler(torch.empty(4, 4, device="meta"))


def test_meta_and_bad_tensors_for_primitive_samplers() -> None:
    meta = torch.empty(8, 4, 3, device="meta")
    for call in (
        lambda: normal_(meta, 1.0),
        lambda: uniform_(meta, 1.0),
        lambda: trunc_normal_(meta, 1.0),
        lambda: orthogonal_(meta),
        lambda: dirac_(meta),
        lambda: sample_(meta, InitSpec("constant", 0.0)),
    ):
        with pytest.raises(ValueError, match="to_empty"):
            call()
    with pytest.raises(ValueError, match="floating-point"):
        normal_(torch.zeros(3, 3, dtype=torch.int64), 1.0)
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        orthogonal_(torch.empty(5))
    with pytest.raises(ValueError, match="std"):
        normal_(torch.empty(3), -1.0)
    with pytest.raises(TypeError, match="Generator"):
        normal_(torch.empty(3), 1.0, generator="0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="InitSpec"):
        sample_(torch.empty(3), "normal")  # type: ignore[arg-type]


def test_samplers_take_an_int_seed_like_init_model() -> None:
    """``generator=`` is an int seed or a ``torch.Generator`` everywhere, samplers included."""
    for sampler in (normal_, uniform_):
        a = sampler(torch.empty(50, 40), 0.3, generator=7)
        b = sampler(torch.empty(50, 40), 0.3, generator=torch.Generator().manual_seed(7))
        assert torch.equal(a, b)
    a = fan_in_normal_(torch.empty(30, 20), generator=3)
    assert torch.equal(a, fan_in_normal_(torch.empty(30, 20), generator=gen(3)))
    a = orthogonal_(torch.empty(6, 4), generator=5)
    assert torch.equal(a, orthogonal_(torch.empty(6, 4), generator=gen(5)))
