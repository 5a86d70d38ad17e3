"""Initialization schemes as pure formulas: fans (and a gain) in, a distribution and a std out.

A scheme never draws random numbers and never touches a tensor: :meth:`Scheme.spec` maps the
:class:`~initlab.Fans` of a weight to an :class:`InitSpec` (which distribution, which std), and
:func:`initlab.init.sampling.sample_` fills a tensor from that spec. The pure variance functions
(:func:`fan_in_variance`, ...) are the formulas of the papers, one per function, with the paper
in the docstring.

Notation: ``fan_in = n_in * k`` and ``fan_out = n_out * k`` where ``k`` is the number of kernel taps
(1 for Linear), as in :func:`initlab.init.fans.compute_fans`. For a convolution the matrix a scheme
reasons about is the reshaped kernel, ``n_out x (n_in * k)``: rows ``fans.n_out``, columns
``fans.cols`` (``fans.fan_in``, except for a strided transposed convolution, whose ``fan_in`` is
``n_in * k / prod(stride)``: :mod:`initlab.init.fans`).

Table (ReLU gain, ``gain**2 = 2``; Defazio & Bottou 2020, Section 4):

==============================  ======================================================
scheme                          ``Var[W]``
==============================  ======================================================
fan-in (He; LeCun: gain 1)      ``gain**2 / fan_in``
fan-out                         ``gain**2 / fan_out``
arithmetic (Glorot)             ``2 gain**2 / (fan_in + fan_out)`` (ReLU: ``4 / (...)``)
geometric (Defazio & Bottou)    ``c / sqrt(fan_in * fan_out)``, ``c = gain**2`` (ReLU: 2)
operator norm (lecture)         ``1 / ((sqrt(cols) + sqrt(rows))**2 * L**2 * a**2)``
==============================  ======================================================
"""

from __future__ import annotations

import abc
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from initlab._core.rng import as_generator
from initlab.init.fans import Fans
from initlab.init.gains import Nonlinearity, average_lipschitz, calculate_gain

__all__ = [
    "DISTRIBUTIONS",
    "SCHEME_NAMES",
    "ArithmeticMean",
    "Dirac",
    "FanIn",
    "FanOut",
    "GeometricMean",
    "InitSpec",
    "OperatorNorm",
    "Orthogonal",
    "Scheme",
    "arithmetic_variance",
    "estimate_singular_ratio",
    "fan_in_variance",
    "fan_out_variance",
    "geometric_variance",
    "get_scheme",
    "list_schemes",
    "operator_norm_variance",
]

#: Distributions an :class:`InitSpec` can name.
DISTRIBUTIONS: tuple[str, ...] = (
    "normal",
    "trunc_normal",
    "uniform",
    "orthogonal",
    "dirac",
    "constant",
)
#: Distributions a variance-based scheme can draw from (same variance, different shape).
SAMPLED_DISTRIBUTIONS: tuple[str, ...] = ("normal", "trunc_normal", "uniform")

_HE = "He, Zhang, Ren & Sun (2015), Delving Deep into Rectifiers, ICCV"
_LECUN = "LeCun, Bottou, Orr & Müller (1998), Efficient BackProp"
_GLOROT = (
    "Glorot & Bengio (2010), Understanding the difficulty of training deep feedforward "
    "neural networks, AISTATS"
)
_DEFAZIO = (
    "Defazio & Bottou (2020), Scaling laws for the principled design, initialization and "
    "preconditioning of ReLU networks, Eq. 2/7"
)
_LECTURE = (
    "Giselsson, Deep Learning lecture notes, 'Initialization' (E||M|| ~ sqrt(n) + sqrt(m) for an "
    "n x m standard normal M)"
)
_SAXE = (
    "Saxe, McClelland & Ganguli (2014), Exact solutions to the nonlinear dynamics of learning in "
    "deep linear neural networks, ICLR"
)
_DIRAC = "Zagoruyko & Komodakis (2017), DiracNets; torch.nn.init.dirac_"


def _check_real(name: str, value: object, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite real number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if not positive and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return float(value)


# --------------------------------------------------------------------------------------------------
# InitSpec


@dataclass(frozen=True)
class InitSpec:
    """What to draw: a distribution and its per-entry std (plus the extras some distributions need).

    Attributes:
        distribution: one of :data:`DISTRIBUTIONS`.
        std: target per-entry standard deviation (the mean is always 0). For ``"normal"``,
            ``"uniform"`` (bound ``sqrt(3) * std``) and ``"trunc_normal"`` (the std *after*
            truncation) it is what the sampler produces. For ``"orthogonal"`` and ``"dirac"`` it is
            the RMS entry of the result, informational only (the sampler uses ``gain``): see
            :class:`Orthogonal` and :class:`Dirac`. For ``"constant"`` it is 0.
        gain: scale of the orthogonal matrix or of the identity kernel.
        truncation: ``"trunc_normal"`` cuts at ``±truncation * sigma'`` where ``sigma'`` is the
            pre-truncation std, rescaled so the truncated distribution has std ``std``.
        value: the fill value of ``"constant"``.
    """

    distribution: str
    std: float
    gain: float = 1.0
    truncation: float = 2.0
    value: float = 0.0

    def __post_init__(self) -> None:
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(
                f"unknown distribution {self.distribution!r}; valid: {', '.join(DISTRIBUTIONS)}"
            )
        _check_real("InitSpec.std", self.std)
        if isinstance(self.gain, bool) or not isinstance(self.gain, (int, float)):
            raise ValueError(f"InitSpec.gain must be a finite real number, got {self.gain!r}")
        if not math.isfinite(self.gain):
            raise ValueError(f"InitSpec.gain must be a finite real number, got {self.gain!r}")
        _check_real("InitSpec.truncation", self.truncation, positive=True)
        if (
            isinstance(self.value, bool)
            or not isinstance(self.value, (int, float))
            or not math.isfinite(self.value)
        ):
            raise ValueError(f"InitSpec.value must be a finite real number, got {self.value!r}")

    @property
    def variance(self) -> float:
        """``std ** 2``."""
        return self.std**2


# --------------------------------------------------------------------------------------------------
# Pure variance formulas


def fan_in_variance(fan_in: float, gain: float) -> float:
    """Fan-in variance ``gain**2 / fan_in``: keeps the forward second moment (He et al., 2015).

    With ``gain = sqrt(2)`` (ReLU) this is He et al.'s ``2 / fan_in``; with ``gain = 1`` it is
    LeCun et al. (1998).

    Example:
        >>> fan_in_variance(128, 2**0.5)
        0.015625000000000003
    """
    _check_real("fan_in", fan_in, positive=True)
    return gain**2 / fan_in


def fan_out_variance(fan_out: float, gain: float) -> float:
    """Fan-out variance ``gain**2 / fan_out``: keeps the backward second moment (He et al., 2015).

    Example:
        >>> fan_out_variance(4, 1.0)
        0.25
    """
    _check_real("fan_out", fan_out, positive=True)
    return gain**2 / fan_out


def arithmetic_variance(fan_in: float, fan_out: float, gain: float) -> float:
    """Arithmetic-mean variance ``2 * gain**2 / (fan_in + fan_out)`` (Glorot & Bengio, 2010).

    The harmonic compromise between the forward (fan-in) and backward (fan-out) conditions. With
    ``gain = 1`` it is Xavier/Glorot; with the ReLU gain ``gain**2 = 2`` it is the ReLU-corrected
    ``4 / (fan_in + fan_out)`` of Defazio & Bottou (2020, Section 4).

    Example:
        >>> arithmetic_variance(100, 300, 1.0)
        0.005
    """
    _check_real("fan_in", fan_in, positive=True)
    _check_real("fan_out", fan_out, positive=True)
    return 2 * gain**2 / (fan_in + fan_out)


def geometric_variance(fan_in: float, fan_out: float, c: float = 2.0) -> float:
    """Geometric-mean variance ``c / sqrt(fan_in * fan_out)`` (Defazio & Bottou 2020, Eq. 2/7).

    ``c = 2`` for ReLU networks: it balances the diagonal Hessian blocks of consecutive ReLU layers
    (Prop. 5) and is the only constant that also balances biases against weights (Prop. 7/9).
    Because the fans include the kernel, for a ``k x k`` convolution this is
    ``c / (k**2 * sqrt(n_in * n_out))`` (Remark 6).

    Example:
        >>> geometric_variance(100, 400)
        0.01
    """
    _check_real("fan_in", fan_in, positive=True)
    _check_real("fan_out", fan_out, positive=True)
    _check_real("c", c)
    return c / math.sqrt(fan_in * fan_out)


def operator_norm_variance(
    n_in: float, n_out: float, lipschitz: float = 0.5, a: float = 1.0
) -> float:
    """Operator-norm variance ``1 / ((sqrt(n_in) + sqrt(n_out))**2 * L**2 * a**2)`` (lecture).

    For an ``n x m`` standard normal matrix ``E||M||_2 ~ sqrt(n) + sqrt(m)``, so entries with this
    variance give ``||W||_2 ~ 1 / L`` and ``L * ||W||_2 ~ 1``: neither vanishing nor exploding
    gradients for an activation with average Lipschitz constant ``L`` (ReLU: 0.5, so
    ``Var = 4 / (sqrt(n_in) + sqrt(n_out))**2`` and ``||W|| ~ 2``). ``a`` in ``[0.4, 1]`` is the
    ratio of the average non-zero singular value to the largest one (see
    :func:`estimate_singular_ratio`); with ``a < 1`` the *average* singular value is ``~ 1 / L``.
    For a convolution, ``n_in = fans.cols`` (``n_in * k``, kernel included) and
    ``n_out = fans.n_out``: the dimensions of the reshaped ``n_out x (n_in * k)`` kernel.
    ``fans.cols`` is ``fans.fan_in`` except for a strided transposed convolution, whose
    ``fan_in`` is ``n_in * k / prod(stride)`` (:mod:`initlab.init.fans`): there pass
    ``fans.cols = fan_in * prod(stride)``, as :class:`OperatorNorm` does.

    Example:
        >>> operator_norm_variance(100, 100)
        0.01
    """
    _check_real("n_in", n_in, positive=True)
    _check_real("n_out", n_out, positive=True)
    _check_real("lipschitz", lipschitz, positive=True)
    _check_real("a", a, positive=True)
    return 1.0 / ((math.sqrt(n_in) + math.sqrt(n_out)) ** 2 * lipschitz**2 * a**2)


# --------------------------------------------------------------------------------------------------
# Schemes


@dataclass(frozen=True)
class Scheme(abc.ABC):
    """A pure initialization formula: :meth:`spec` maps a weight's fans to an :class:`InitSpec`.

    Subclasses are frozen keyword-only dataclasses; ``name``, ``formula`` and ``reference`` are
    class attributes (shown by ``initlab schemes``).
    """

    name: ClassVar[str] = ""
    formula: ClassVar[str] = ""
    reference: ClassVar[str] = ""

    @abc.abstractmethod
    def spec(self, fans: Fans) -> InitSpec:
        """Distribution and std for a weight with these fans."""


def _check_fans(fans: object) -> Fans:
    if not isinstance(fans, Fans):
        raise TypeError(
            f"Scheme.spec takes a Fans (see initlab.compute_fans), got {type(fans).__name__}"
        )
    return fans


def _check_distribution(distribution: object) -> None:
    if distribution not in SAMPLED_DISTRIBUTIONS:
        raise ValueError(
            f"unknown distribution {distribution!r}; valid: {', '.join(SAMPLED_DISTRIBUTIONS)}"
        )


@dataclass(frozen=True, kw_only=True)
class _GainScheme(Scheme):
    """A scheme with a gain: ``gain`` if given, else :func:`calculate_gain` of the nonlinearity."""

    nonlinearity: Nonlinearity = "relu"
    param: float | None = None
    gain: float | None = None

    def __post_init__(self) -> None:
        if self.gain is None:
            calculate_gain(self.nonlinearity, self.param)  # validates name and param now
        else:
            _check_real("gain", self.gain)

    def resolved_gain(self) -> float:
        """The explicit ``gain``, or ``calculate_gain(nonlinearity, param)``."""
        if self.gain is not None:
            return self.gain
        return calculate_gain(self.nonlinearity, self.param)

    def resolved_gain_squared(self) -> float:
        """``gain**2``, exact for ReLU (2) and LeakyReLU (``2 / (1 + a**2)``)."""
        if self.gain is None and isinstance(self.nonlinearity, str):
            name = self.nonlinearity.lower()
            if name == "relu":
                return 2.0
            if name == "leaky_relu":
                a = 0.01 if self.param is None else float(self.param)
                return 2.0 / (1.0 + a**2)
        return self.resolved_gain() ** 2


@dataclass(frozen=True, kw_only=True)
class _SampledScheme(_GainScheme):
    distribution: str = "normal"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_distribution(self.distribution)


@dataclass(frozen=True, kw_only=True)
class FanIn(_SampledScheme):
    """Fan-in: ``std = gain / sqrt(fan_in)``, ``Var = gain**2 / fan_in`` (He et al., 2015).

    ReLU (default): ``Var = 2 / fan_in`` (Kaiming/He). ``nonlinearity="linear"``: LeCun et al.
    (1998). The std is computed as torch does, so on a Linear layer or a convolution the
    normal/uniform draws equal ``torch.nn.init.kaiming_normal_``/``kaiming_uniform_`` (mode
    ``fan_in``) bit for bit for the same generator. Not on a transposed convolution: torch reads
    its ``(in, out / groups, *k)`` weight as a convolution's and takes ``(out / groups) * k`` for
    its fan-in, where initlab takes the inputs that reach one output, ``(in / groups) * k /
    prod(stride)`` (:func:`~initlab.init.fans.compute_fans`).

    Example:
        >>> FanIn().spec(Fans(fan_in=50, fan_out=10)).variance
        0.04000000000000001
    """

    name: ClassVar[str] = "fan_in"
    formula: ClassVar[str] = "std = gain / sqrt(fan_in)   (Var = gain²/fan_in; ReLU: 2/fan_in)"
    reference: ClassVar[str] = _HE

    def spec(self, fans: Fans) -> InitSpec:
        fans = _check_fans(fans)
        std = self.resolved_gain() / math.sqrt(fans.fan_in)
        return InitSpec(self.distribution, std)


@dataclass(frozen=True, kw_only=True)
class FanOut(_SampledScheme):
    """Fan-out: ``std = gain / sqrt(fan_out)``, ``Var = gain**2 / fan_out`` (He et al., 2015).

    Equals ``torch.nn.init.kaiming_normal_(mode="fan_out")`` for ungrouped Linear layers and
    convolutions (for grouped convolutions initlab's ``fan_out`` is ``(n_out / groups) * k``,
    torch's is ``n_out * k``; for a transposed convolution torch takes ``in * k``, initlab its
    ``(out / groups) * k``: see :func:`~initlab.init.fans.compute_fans`).
    """

    name: ClassVar[str] = "fan_out"
    formula: ClassVar[str] = "std = gain / sqrt(fan_out)   (Var = gain²/fan_out; ReLU: 2/fan_out)"
    reference: ClassVar[str] = _HE

    def spec(self, fans: Fans) -> InitSpec:
        fans = _check_fans(fans)
        std = self.resolved_gain() / math.sqrt(fans.fan_out)
        return InitSpec(self.distribution, std)


@dataclass(frozen=True, kw_only=True)
class ArithmeticMean(_SampledScheme):
    """Arithmetic mean: ``Var = 2 * gain**2 / (fan_in + fan_out)`` (Glorot & Bengio, 2010).

    Default ReLU gain: the ReLU-corrected ``4 / (fan_in + fan_out)`` (Defazio & Bottou 2020).
    ``nonlinearity="linear"``: Xavier/Glorot, equal to ``torch.nn.init.xavier_normal_`` /
    ``xavier_uniform_`` bit for bit (std computed in torch's form
    ``gain * sqrt(2 / (fan_in + fan_out))``).
    """

    name: ClassVar[str] = "arithmetic"
    formula: ClassVar[str] = (
        "Var = 2·gain²/(fan_in + fan_out)   (ReLU: 4/(fan_in + fan_out); gain 1: Xavier)"
    )
    reference: ClassVar[str] = _GLOROT

    def spec(self, fans: Fans) -> InitSpec:
        fans = _check_fans(fans)
        std = self.resolved_gain() * math.sqrt(2.0 / float(fans.fan_in + fans.fan_out))
        return InitSpec(self.distribution, std)


@dataclass(frozen=True, kw_only=True)
class GeometricMean(_SampledScheme):
    """Geometric mean: ``Var = c / sqrt(fan_in * fan_out)`` (Defazio & Bottou 2020, Eq. 2/7).

    ``c`` defaults to ``gain**2`` (exactly 2 for ReLU). For a ``k x k``
    convolution the fans include the kernel, so this is ``c / (k**2 * sqrt(n_in * n_out))``
    (Remark 6). An explicit ``c`` overrides the gain.
    """

    name: ClassVar[str] = "geometric"
    formula: ClassVar[str] = (
        "Var = c / sqrt(fan_in·fan_out), c = gain² (ReLU: 2); conv: c / (k²·sqrt(n_in·n_out))"
    )
    reference: ClassVar[str] = _DEFAZIO

    c: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.c is not None:
            _check_real("c", self.c)

    def spec(self, fans: Fans) -> InitSpec:
        fans = _check_fans(fans)
        c = self.c if self.c is not None else self.resolved_gain_squared()
        std = math.sqrt(geometric_variance(fans.fan_in, fans.fan_out, c))
        return InitSpec(self.distribution, std)


@dataclass(frozen=True, kw_only=True)
class OperatorNorm(Scheme):
    """Operator norm: ``std = 1 / ((sqrt(cols) + sqrt(rows)) * L * a)`` (lecture, Giselsson).

    ``rows = fans.n_out`` and ``cols = fans.cols``: the reshaped ``n_out x (n_in * k)`` kernel.
    Gaussian entries with this std give ``||W||_2 ~ 1 / L`` (``E||M|| ~ sqrt(n) + sqrt(m)`` for a
    standard normal ``n x m`` matrix). ``lipschitz`` defaults to :func:`average_lipschitz` of the
    nonlinearity (ReLU 0.5, so ``||W|| ~ 2``); ``a`` is the average-to-largest singular value
    ratio (1 targets the largest singular value; see :func:`estimate_singular_ratio`).
    There is no ``gain``: ``lipschitz`` plays its role.
    """

    name: ClassVar[str] = "operator_norm"
    formula: ClassVar[str] = (
        "Var = 1/((sqrt(cols) + sqrt(n_out))²·L²·a²), cols = n_in·k (fan_in·stride for a strided "
        "transposed conv), L = average Lipschitz (ReLU 0.5)"
    )
    reference: ClassVar[str] = _LECTURE

    nonlinearity: Nonlinearity = "relu"
    param: float | None = None
    lipschitz: float | None = None
    a: float = 1.0
    distribution: str = "normal"

    def __post_init__(self) -> None:
        _check_distribution(self.distribution)
        if self.lipschitz is None:
            average_lipschitz(self.nonlinearity, self.param)  # validates now
        else:
            _check_real("lipschitz", self.lipschitz, positive=True)
        _check_real("a", self.a, positive=True)

    def resolved_lipschitz(self) -> float:
        """The explicit ``lipschitz``, or ``average_lipschitz(nonlinearity, param)``."""
        if self.lipschitz is not None:
            return self.lipschitz
        return average_lipschitz(self.nonlinearity, self.param)

    def spec(self, fans: Fans) -> InitSpec:
        fans = _check_fans(fans)
        lipschitz = self.resolved_lipschitz()
        std = 1.0 / ((math.sqrt(fans.cols) + math.sqrt(fans.n_out)) * lipschitz * self.a)
        return InitSpec(self.distribution, std)


@dataclass(frozen=True, kw_only=True)
class Orthogonal(_GainScheme):
    """Orthogonal: ``W = gain * Q`` with ``Q`` (semi-)orthogonal (Saxe et al., 2014).

    The gain defaults to the nonlinearity's (ReLU: ``sqrt(2)``); pass ``nonlinearity="linear"`` for
    gain 1. The sampler (:func:`initlab.init.sampling.orthogonal_` with the same ``groups`` and
    ``transposed``) orthogonalizes each group's reshaped kernel, ``rows x cols`` with
    ``rows = fans.n_out`` and ``cols = fans.cols``, so ``Q^T Q = I`` or ``Q Q^T = I`` per group
    and the RMS entry, reported as ``InitSpec.std``, is exactly ``gain / sqrt(max(rows, cols))``.
    """

    name: ClassVar[str] = "orthogonal"
    formula: ClassVar[str] = "W = gain·Q, QᵀQ = I or QQᵀ = I (RMS entry gain/sqrt(max(rows, cols)))"
    reference: ClassVar[str] = _SAXE

    def spec(self, fans: Fans) -> InitSpec:
        fans = _check_fans(fans)
        gain = self.resolved_gain()
        std = gain / math.sqrt(max(fans.n_out, fans.cols))
        return InitSpec("orthogonal", std, gain=gain)


@dataclass(frozen=True, kw_only=True)
class Dirac(_GainScheme):
    """Dirac: the identity convolution scaled by ``gain`` (``torch.nn.init.dirac_`` times gain).

    The gain defaults to the nonlinearity's (ReLU: ``sqrt(2)``); pass ``nonlinearity="linear"`` for
    an exact identity. Each group's kernel has ``min(n_in, n_out)`` entries equal to ``gain`` out of
    ``n_out * n_in * k``, so its RMS entry, reported as ``InitSpec.std``, is exactly
    ``gain / sqrt(max(n_in * k, fan_out))`` (``fans.cols``: ``fan_in`` but for a strided
    transposed convolution).
    """

    name: ClassVar[str] = "dirac"
    formula: ClassVar[str] = (
        "W = gain·δ (identity kernel; RMS entry gain/sqrt(max(cols, fan_out)), cols = n_in·k)"
    )
    reference: ClassVar[str] = _DIRAC

    def spec(self, fans: Fans) -> InitSpec:
        fans = _check_fans(fans)
        gain = self.resolved_gain()
        std = gain / math.sqrt(max(fans.cols, fans.fan_out))
        return InitSpec("dirac", std, gain=gain)


# --------------------------------------------------------------------------------------------------
# Registry


@dataclass(frozen=True)
class _Entry:
    name: str
    aliases: tuple[str, ...]
    cls: type[Scheme]
    defaults: tuple[tuple[str, Any], ...]
    formula: str
    reference: str


_REGISTRY: tuple[_Entry, ...] = (
    _Entry("fan_in", ("kaiming", "he"), FanIn, (), FanIn.formula, _HE),
    _Entry("lecun", (), FanIn, (("nonlinearity", "linear"),), "std = 1 / sqrt(fan_in)", _LECUN),
    _Entry("fan_out", (), FanOut, (), FanOut.formula, _HE),
    _Entry(
        "arithmetic",
        (),
        ArithmeticMean,
        (),
        "Var = 2·gain²/(fan_in + fan_out)   (ReLU: 4/(fan_in + fan_out))",
        _GLOROT + "; ReLU-corrected as in " + _DEFAZIO,
    ),
    _Entry(
        "xavier",
        ("glorot",),
        ArithmeticMean,
        (("nonlinearity", "linear"),),
        "Var = 2/(fan_in + fan_out)   (torch.nn.init.xavier_*)",
        _GLOROT,
    ),
    _Entry("geometric", (), GeometricMean, (), GeometricMean.formula, _DEFAZIO),
    _Entry("operator_norm", (), OperatorNorm, (), OperatorNorm.formula, _LECTURE),
    _Entry("orthogonal", (), Orthogonal, (), Orthogonal.formula, _SAXE),
    _Entry("dirac", (), Dirac, (), Dirac.formula, _DIRAC),
)

#: Canonical scheme names accepted by :func:`get_scheme` (aliases: see :func:`list_schemes`).
SCHEME_NAMES: tuple[str, ...] = tuple(entry.name for entry in _REGISTRY)


def _valid_names_text() -> str:
    parts = []
    for entry in _REGISTRY:
        aliases = f" (aliases: {', '.join(entry.aliases)})" if entry.aliases else ""
        parts.append(entry.name + aliases)
    return ", ".join(parts)


def _find(key: str) -> tuple[_Entry | None, str | None]:
    """``(registry entry, distribution)`` for a name or alias, optionally with a distribution
    suffix (``"xavier_uniform"``: torch.nn.init's names) on a scheme that has that field;
    ``(None, None)`` if nothing matches."""
    for entry in _REGISTRY:
        if key == entry.name or key in entry.aliases:
            return entry, None
    for distribution in SAMPLED_DISTRIBUTIONS:
        base = key.removesuffix("_" + distribution)
        if base == key:
            continue
        for entry in _REGISTRY:
            fields = {field.name for field in dataclasses.fields(entry.cls)}
            if (base == entry.name or base in entry.aliases) and "distribution" in fields:
                return entry, distribution
    return None, None


def get_scheme(name_or_scheme: str | Scheme, **kwargs: Any) -> Scheme:
    """A scheme from its name (or alias) and keyword fields; a :class:`Scheme` passes through.

    Names: ``fan_in`` (``kaiming``, ``he``), ``lecun`` (fan-in with ``nonlinearity="linear"``),
    ``fan_out``, ``arithmetic`` (ReLU-corrected Glorot), ``xavier`` (``glorot``: arithmetic with
    ``nonlinearity="linear"``, as torch's ``xavier_*``), ``geometric``, ``operator_norm``,
    ``orthogonal``, ``dirac``. Names are case-insensitive; ``-`` reads as ``_``. A name (or alias)
    with a distribution suffix, ``_normal``, ``_trunc_normal`` or ``_uniform``, sets the
    distribution of a scheme that draws from one: ``"xavier_uniform"``, ``"kaiming_normal"``
    (torch.nn.init's names). ``kwargs`` are the scheme's dataclass fields and override the name's
    defaults.

    Raises:
        ValueError: unknown name (the message lists the valid names and aliases), or keyword
            arguments given together with a Scheme instance.
        TypeError: a keyword the scheme does not have (the message lists the valid ones).

    Example:
        >>> get_scheme("he")
        FanIn(nonlinearity='relu', param=None, gain=None, distribution='normal')
        >>> get_scheme("glorot", distribution="uniform").resolved_gain()
        1.0
        >>> get_scheme("xavier_uniform") == get_scheme("xavier", distribution="uniform")
        True
    """
    if isinstance(name_or_scheme, Scheme):
        if kwargs:
            raise ValueError(
                f"keyword arguments {sorted(kwargs)} are only used with a scheme name; to change a "
                "Scheme instance use dataclasses.replace(scheme, ...)"
            )
        return name_or_scheme
    if not isinstance(name_or_scheme, str):
        raise TypeError(
            f"get_scheme takes a scheme name or a Scheme, got {type(name_or_scheme).__name__}"
        )
    key = name_or_scheme.strip().lower().replace("-", "_")
    entry, distribution = _find(key)
    if entry is None:
        raise ValueError(
            f"unknown scheme {name_or_scheme!r}; valid names: {_valid_names_text()}; a name with "
            f"a distribution suffix (_{', _'.join(SAMPLED_DISTRIBUTIONS)}: 'xavier_uniform', "
            "'kaiming_normal') where the scheme draws from one"
        )
    if distribution is not None:
        if kwargs.get("distribution", distribution) != distribution:
            raise ValueError(
                f"scheme {name_or_scheme!r} names the distribution {distribution!r}, but "
                f"distribution={kwargs['distribution']!r} was given too"
            )
        kwargs = {**kwargs, "distribution": distribution}
    valid = sorted(field.name for field in dataclasses.fields(entry.cls))
    unexpected = sorted(set(kwargs) - set(valid))
    if unexpected:
        raise TypeError(
            f"scheme {entry.name!r} got unexpected keyword(s) {unexpected}; valid: {valid}"
        )
    return entry.cls(**{**dict(entry.defaults), **kwargs})


def list_schemes() -> list[dict[str, str]]:
    """One row per scheme name for ``initlab schemes``.

    Returns:
        A list of dicts with keys ``name``, ``aliases`` (comma-separated, possibly empty),
        ``formula`` and ``reference``, in registry order.
    """
    return [
        {
            "name": entry.name,
            "aliases": ", ".join(entry.aliases),
            "formula": entry.formula,
            "reference": entry.reference,
        }
        for entry in _REGISTRY
    ]


# --------------------------------------------------------------------------------------------------
# Helper for the operator-norm scheme's ``a``


def estimate_singular_ratio(
    shape: tuple[int, int],
    *,
    samples: int = 10,
    generator: torch.Generator | int | None = None,
) -> float:
    """Mean over ``samples`` draws of (mean non-zero singular value) / (largest singular value).

    The lecture's ``a`` for :class:`OperatorNorm`: for a standard normal matrix of this shape,
    about 1.0 for one row or column, 0.78 for ``(100, 10)``, 0.76 for ``(1000, 100)`` and 0.43 for
    square matrices. The matrices are drawn in float64 on the generator's device (CPU if none);
    singular values below ``max(shape) * eps * s_max`` count as zero.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> 0.73 < estimate_singular_ratio((100, 10), generator=g) < 0.83
        True
    """
    if len(shape) != 2:
        raise ValueError(f"shape must be (rows, cols), got {shape!r}")
    rows, cols = (int(s) for s in shape)
    if rows < 1 or cols < 1:
        raise ValueError(f"shape must have positive dims, got {shape!r}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be a positive int, got {samples!r}")
    generator = as_generator(generator)  # an int seeds a fresh generator, as everywhere
    device = generator.device if generator is not None else torch.device("cpu")
    eps = torch.finfo(torch.float64).eps
    total = 0.0
    for _ in range(samples):
        matrix = torch.randn(rows, cols, dtype=torch.float64, device=device, generator=generator)
        singular = torch.linalg.svdvals(matrix)
        largest = singular[0]
        nonzero = singular[singular > largest * max(rows, cols) * eps]
        total += float(nonzero.mean() / largest)
    return total / samples
