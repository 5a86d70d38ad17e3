"""In-place samplers: fill a tensor from an :class:`~initlab.init.schemes.InitSpec`, torch style.

Every sampler ends in ``_``: it fills the tensor in place under :func:`torch.no_grad` and returns
it. Randomness comes only from the keyword ``generator=`` (a ``torch.Generator`` or an int seed;
the global RNG when ``None``), so the same seed gives the same tensor.

Device and dtype rules (all samplers):

* the tensor is never moved. If ``generator`` lives on another device than the tensor, the values
  are drawn on the generator's device and copied into the tensor, so a CPU generator gives the
  same values whether the tensor is on the CPU or on a GPU;
* float16/bfloat16 (any float narrower than 32 bits) tensors are drawn in float32 and rounded on
  copy; orthogonal matrices are computed in float32 (float64 for float64 tensors);
* a tensor on the ``meta`` device has no storage: it is an error (materialize the model first with
  ``model.to_empty(device=...)``).

Determinism: for a given generator every sampler gives bit-identical tensors whatever
``torch.get_num_threads()`` is. The draws are serial; the one threaded computation, the QR
factorization of :func:`orthogonal_` (LAPACK's blocked Householder, whose threaded BLAS sums in
a thread-dependent order: up to 4.7e-7 apart on VGG-19 between 1 and 2 threads), runs on one
CPU thread.

The scheme samplers (:func:`fan_in_normal_`, ...) are each three visible lines:
``compute_fans`` -> ``Scheme.spec`` -> :func:`sample_`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from initlab._core.rng import as_generator
from initlab.init.fans import compute_fans
from initlab.init.gains import Nonlinearity
from initlab.init.schemes import (
    ArithmeticMean,
    FanIn,
    FanOut,
    GeometricMean,
    InitSpec,
    OperatorNorm,
)

__all__ = [
    "arithmetic_normal_",
    "arithmetic_uniform_",
    "dirac_",
    "fan_in_normal_",
    "fan_in_uniform_",
    "fan_out_normal_",
    "fan_out_uniform_",
    "geometric_normal_",
    "geometric_trunc_normal_",
    "geometric_uniform_",
    "normal_",
    "operator_norm_normal_",
    "orthogonal_",
    "sample_",
    "trunc_normal_",
    "uniform_",
]


# --------------------------------------------------------------------------------------------------
# Checks and the device/dtype-aware draw


def _check_tensor(tensor: object, caller: str) -> Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{caller} fills a torch.Tensor in place, got {type(tensor).__name__}")
    if tensor.is_meta:
        raise ValueError(
            f"{caller}: the tensor is on the meta device and has no storage to fill; materialize "
            "the model first with model.to_empty(device=...), then initialize it"
        )
    if not tensor.is_floating_point():
        raise ValueError(f"{caller} needs a floating-point tensor, got dtype {tensor.dtype}")
    return tensor


def _check_groups(tensor: Tensor, groups: object) -> int:
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups must be a positive int, got {groups!r}")
    if tensor.size(0) % groups:
        raise ValueError(
            f"dim 0 of shape {tuple(tensor.shape)} is not divisible by groups={groups}"
        )
    return groups


def _check_std(std: object) -> float:
    if isinstance(std, bool) or not isinstance(std, (int, float)) or not math.isfinite(std):
        raise ValueError(f"std must be a finite real number, got {std!r}")
    if std < 0:
        raise ValueError(f"std must be >= 0, got {std!r}")
    return std


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _draw_device(tensor: Tensor, generator: torch.Generator | None) -> torch.device:
    return generator.device if generator is not None else tensor.device


def _draw_dtype(tensor: Tensor) -> torch.dtype:
    return torch.float32 if tensor.dtype.itemsize < 4 else tensor.dtype


def _draw_(
    tensor: Tensor, generator: torch.Generator | None, fill: Callable[[Tensor], object]
) -> Tensor:
    """Run ``fill`` on the tensor itself, or on a buffer on the generator's device / in float32."""
    device, dtype = _draw_device(tensor, generator), _draw_dtype(tensor)
    with torch.no_grad():
        if dtype == tensor.dtype and _same_device(device, tensor.device):
            fill(tensor)
        else:
            buffer = torch.empty(tensor.shape, dtype=dtype, device=device)
            fill(buffer)
            tensor.copy_(buffer)
    return tensor


# --------------------------------------------------------------------------------------------------
# Distribution samplers


def normal_(
    tensor: Tensor, std: float, *, generator: torch.Generator | int | None = None
) -> Tensor:
    """Fill ``tensor`` with ``N(0, std**2)`` draws, in place; returns it.

    Same draws as ``tensor.normal_(0, std, generator=generator)`` for a float32/float64 tensor on
    the generator's device.

    Example:
        >>> w = normal_(torch.empty(100, 100), 0.1, generator=torch.Generator().manual_seed(0))
        >>> abs(w.var().item() / 0.01 - 1) < 0.1
        True
    """
    _check_tensor(tensor, "normal_")
    generator = as_generator(generator)
    std = _check_std(std)
    if tensor.numel() == 0:
        return tensor
    return _draw_(tensor, generator, lambda t: t.normal_(0, std, generator=generator))


def uniform_(
    tensor: Tensor, std: float, *, generator: torch.Generator | int | None = None
) -> Tensor:
    """Fill ``tensor`` with ``U(-b, b)``, ``b = sqrt(3) * std`` (so the std is ``std``), in place.

    Same draws as ``tensor.uniform_(-b, b, generator=generator)`` for a float32/float64 tensor on
    the generator's device (torch's ``kaiming_uniform_``/``xavier_uniform_`` bound).

    Example:
        >>> w = uniform_(torch.empty(10, 10), 1.0, generator=torch.Generator().manual_seed(0))
        >>> bool(w.abs().max() <= 3**0.5)
        True
    """
    _check_tensor(tensor, "uniform_")
    generator = as_generator(generator)
    std = _check_std(std)
    if tensor.numel() == 0:
        return tensor
    bound = math.sqrt(3.0) * std
    return _draw_(tensor, generator, lambda t: t.uniform_(-bound, bound, generator=generator))


def _truncated_std_ratio(truncation: float) -> float:
    """Std of ``N(0, 1)`` truncated to ``[-a, a]``: ``sqrt(1 - 2 a phi(a) / (2 Phi(a) - 1))``."""
    a = truncation
    mass = math.erf(a / math.sqrt(2.0))  # 2 Phi(a) - 1
    pdf = math.exp(-0.5 * a * a) / math.sqrt(2.0 * math.pi)
    return math.sqrt(1.0 - 2.0 * a * pdf / mass)


def trunc_normal_(
    tensor: Tensor,
    std: float,
    *,
    truncation: float = 2.0,
    generator: torch.Generator | int | None = None,
) -> Tensor:
    r"""Fill ``tensor`` with a normal truncated at ``±truncation * sigma'`` whose std is ``std``.

    The variance of a standard normal truncated to ``[-a, a]`` is
    :math:`1 - 2 a \varphi(a) / (2 \Phi(a) - 1)` (0.774 for ``a = 2``), so the pre-truncation std is
    ``sigma' = std / sqrt(that)`` and the values lie in ``[-a sigma', a sigma']``. Drawn by
    :func:`torch.nn.init.trunc_normal_` (rejection sampling) with those bounds.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> w = trunc_normal_(torch.empty(200, 200), 0.1, generator=g)
        >>> abs(w.var().item() / 0.01 - 1) < 0.05
        True
    """
    _check_tensor(tensor, "trunc_normal_")
    generator = as_generator(generator)
    std = _check_std(std)
    if isinstance(truncation, bool) or not isinstance(truncation, (int, float)):
        raise ValueError(f"truncation must be a positive real number, got {truncation!r}")
    if not math.isfinite(truncation) or truncation <= 0:
        raise ValueError(f"truncation must be a positive real number, got {truncation!r}")
    if tensor.numel() == 0:
        return tensor
    if std == 0:
        with torch.no_grad():
            return tensor.zero_()
    sigma = std / _truncated_std_ratio(truncation)
    bound = truncation * sigma
    return _draw_(
        tensor,
        generator,
        lambda t: torch.nn.init.trunc_normal_(t, 0.0, sigma, -bound, bound, generator=generator),
    )


@contextmanager
def _one_thread(device: torch.device) -> Iterator[None]:
    """One intra-op thread for a CPU computation whose result would depend on the thread count
    (the previous count is restored; a no-op on other devices or with one thread already)."""
    n = torch.get_num_threads()
    if device.type != "cpu" or n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _semi_orthogonal(
    rows: int,
    cols: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
    generator: torch.Generator | None,
) -> Tensor:
    """``rows x cols`` matrix with orthonormal rows or columns, Haar-distributed (Mezzadri 2007)."""
    matrix = torch.empty((rows, cols), dtype=dtype, device=device).normal_(
        0, 1, generator=generator
    )
    wide = rows < cols
    if wide:
        matrix = matrix.t()
    with _one_thread(matrix.device):  # bit-identical whatever the thread count
        q, r = torch.linalg.qr(matrix)
    q = q * torch.diagonal(r).sign()  # sign correction: Q uniform on the orthogonal group
    return q.t() if wide else q


def orthogonal_(
    tensor: Tensor,
    gain: float = 1.0,
    *,
    groups: int = 1,
    transposed: bool = False,
    generator: torch.Generator | int | None = None,
) -> Tensor:
    """Fill ``tensor`` with a (semi-)orthogonal matrix times ``gain`` (Saxe et al., 2014).

    The weight is viewed as a matrix ``rows x cols`` with ``rows = dim 0`` and ``cols`` the rest
    (conv kernels flattened); a standard normal matrix of that shape is factored ``QR`` and ``Q`` is
    sign-corrected by ``sign(diag(R))`` so it is uniformly (Haar) distributed. The result satisfies
    ``W^T W = gain**2 I`` (tall) or ``W W^T = gain**2 I`` (wide). With ``groups > 1`` each group's
    block of output channels is an independent orthogonal matrix; with ``transposed`` (layout
    ``(in, out / groups, *kernel)``) the matrix is the ``out x (in * k)`` one, matching
    :func:`initlab.compute_fans`. With ``groups=1, transposed=False`` and a float32/float64 tensor
    this equals :func:`torch.nn.init.orthogonal_` for the same generator run on one thread. The
    QR factorization runs on one CPU thread, so the result is bit-identical whatever
    ``torch.get_num_threads()`` is (torch's own differs by up to ~5e-7 between 1 and 2 threads).

    Example:
        >>> w = orthogonal_(torch.empty(5, 3), 2.0, generator=torch.Generator().manual_seed(0))
        >>> torch.allclose(w.T @ w, 4 * torch.eye(3), atol=1e-5)
        True
    """
    _check_tensor(tensor, "orthogonal_")
    generator = as_generator(generator)
    if tensor.dim() < 2:
        raise ValueError(
            "orthogonal_ needs a weight with at least 2 dimensions (out, in, *kernel); "
            f"got shape {tuple(tensor.shape)}"
        )
    _check_groups(tensor, groups)
    if tensor.numel() == 0:
        return tensor
    device = _draw_device(tensor, generator)
    dtype = tensor.dtype if tensor.dtype in (torch.float32, torch.float64) else torch.float32
    with torch.no_grad():
        for block in tensor.chunk(groups, dim=0):
            matrix_view = block.transpose(0, 1) if transposed else block
            rows = matrix_view.shape[0]
            cols = matrix_view.numel() // rows
            q = _semi_orthogonal(rows, cols, dtype=dtype, device=device, generator=generator)
            matrix_view.copy_(q.mul_(gain).reshape(matrix_view.shape))
    return tensor


def dirac_(
    tensor: Tensor,
    gain: float = 1.0,
    *,
    groups: int = 1,
    centre: Sequence[int] | None = None,
) -> Tensor:
    """Fill a weight with the identity map times ``gain`` (no randomness).

    A 2-D ``(out, in)`` weight gets ``gain`` on its diagonal (like :func:`torch.nn.init.eye_`),
    so a square Linear layer starts as ``gain`` times the identity.

    Like :func:`torch.nn.init.dirac_`: within each group, output channel ``d`` takes input channel
    ``d`` at the kernel centre, tap ``k // 2`` per spatial dim (or ``centre``, one tap per
    spatial dim), for ``d < min(out / groups, in / groups)``; all else is zero. A convolution
    with an odd kernel and ``padding = k // 2`` then maps its input to ``gain`` times itself (when
    ``in == out``). An *even* kernel has no centre: with ``padding="same"`` (torch pads
    ``(k - 1) // 2`` before, ``k // 2`` after) tap ``k // 2`` gives the input shifted by one
    position, tap ``centre = (k - 1) // 2`` the identity (:func:`~initlab.init_model` places it
    there). References: Zagoruyko & Komodakis (2017), DiracNets.

    Example:
        >>> w = dirac_(torch.empty(4, 4, 3, 3), 2.0)
        >>> x = torch.randn(1, 4, 5, 5, generator=torch.Generator().manual_seed(0))
        >>> torch.allclose(torch.nn.functional.conv2d(x, w, padding=1), 2 * x)
        True
    """
    _check_tensor(tensor, "dirac_")
    if tensor.dim() not in (2, 3, 4, 5):
        raise ValueError(
            "dirac_ needs a 2-D (out, in) or a 3-, 4- or 5-D convolution weight "
            "(out, in / groups, *kernel); "
            f"got shape {tuple(tensor.shape)}"
        )
    _check_groups(tensor, groups)
    if isinstance(gain, bool) or not isinstance(gain, (int, float)) or not math.isfinite(gain):
        raise ValueError(f"gain must be a finite real number, got {gain!r}")
    out_per_group = tensor.size(0) // groups
    channels = torch.arange(min(out_per_group, tensor.size(1)), device=tensor.device)
    kernel = tuple(tensor.shape[2:])
    centres = tuple(size // 2 for size in kernel)  # () for a 2-D weight
    if centre is not None:
        centres = tuple(centre)
        if len(centres) != len(kernel) or not all(
            isinstance(c, int) and 0 <= c < size for c, size in zip(centres, kernel, strict=False)
        ):
            raise ValueError(
                f"centre must give one tap per spatial dim of the kernel {kernel}, each in "
                f"[0, size), got {centre!r}"
            )
    with torch.no_grad():
        tensor.zero_()
        for group in range(groups):
            tensor[(group * out_per_group + channels, channels, *centres)] = gain
    return tensor


def sample_(
    tensor: Tensor,
    spec: InitSpec,
    *,
    generator: torch.Generator | int | None = None,
    groups: int = 1,
    transposed: bool = False,
) -> Tensor:
    """Fill ``tensor`` in place as ``spec`` says; returns it.

    ``normal``/``uniform``/``trunc_normal`` use ``spec.std`` (and ``spec.truncation``);
    ``orthogonal`` and ``dirac`` use ``spec.gain`` and the layout (``groups``; ``transposed`` for
    orthogonal); ``constant`` fills ``spec.value``. ``groups`` and ``transposed`` describe the
    weight's layout as in :func:`initlab.compute_fans`; the element-wise distributions ignore them.

    Example:
        >>> from initlab.init.schemes import InitSpec
        >>> w = sample_(torch.empty(3, 3), InitSpec("constant", 0.0, value=0.5))
        >>> w.sum().item()
        4.5
    """
    if not isinstance(spec, InitSpec):
        raise TypeError(f"sample_ takes an InitSpec, got {type(spec).__name__}")
    distribution = spec.distribution
    if distribution == "normal":
        return normal_(tensor, spec.std, generator=generator)
    if distribution == "uniform":
        return uniform_(tensor, spec.std, generator=generator)
    if distribution == "trunc_normal":
        return trunc_normal_(tensor, spec.std, truncation=spec.truncation, generator=generator)
    if distribution == "orthogonal":
        return orthogonal_(
            tensor, spec.gain, groups=groups, transposed=transposed, generator=generator
        )
    if distribution == "dirac":
        return dirac_(tensor, spec.gain, groups=groups)
    # "constant" (InitSpec validated the name)
    _check_tensor(tensor, "sample_")
    with torch.no_grad():
        return tensor.fill_(spec.value)


# --------------------------------------------------------------------------------------------------
# Scheme samplers: compute_fans -> Scheme.spec -> sample_


def fan_in_normal_(
    tensor: Tensor,
    *,
    nonlinearity: Nonlinearity = "relu",
    param: float | None = None,
    gain: float | None = None,
    groups: int = 1,
    transposed: bool = False,
    stride: int | Sequence[int] = 1,
    generator: torch.Generator | int | None = None,
) -> Tensor:
    """Fan-in normal: ``N(0, std**2)``, ``std = gain / sqrt(fan_in)`` (He et al., 2015).

    With the defaults (ReLU) this is ``torch.nn.init.kaiming_normal_(tensor, mode="fan_in",
    nonlinearity="relu")``, bit for bit for the same generator. ``gain`` overrides
    ``calculate_gain(nonlinearity, param)``.

    ``groups``, ``transposed`` and ``stride`` give the layout as in :func:`initlab.compute_fans`.
    ``stride`` is a ``ConvTranspose``'s (with ``transposed=True``; an int or one per spatial dim):
    ``fan_in = (n_in / g) * k / prod(stride)``, as :func:`~initlab.init_model` uses (left at 1, a
    strided ``ConvTranspose`` comes out ``prod(stride)`` times too small in variance), so
    ``std = gain * sqrt(prod(stride) / ((n_in / g) * k))``.

    Example:
        >>> w = torch.empty(64, 32, 3, 3)
        >>> ours = fan_in_normal_(w.clone(), generator=torch.Generator().manual_seed(0))
        >>> theirs = torch.nn.init.kaiming_normal_(
        ...     w.clone(), nonlinearity="relu", generator=torch.Generator().manual_seed(0))
        >>> torch.equal(ours, theirs)
        True
    """
    _check_tensor(tensor, "fan_in_normal_")
    fans = compute_fans(tensor, groups=groups, transposed=transposed, stride=stride)
    spec = FanIn(nonlinearity=nonlinearity, param=param, gain=gain).spec(fans)
    return sample_(tensor, spec, generator=generator, groups=groups, transposed=transposed)


def fan_in_uniform_(
    tensor: Tensor,
    *,
    nonlinearity: Nonlinearity = "relu",
    param: float | None = None,
    gain: float | None = None,
    groups: int = 1,
    transposed: bool = False,
    stride: int | Sequence[int] = 1,
    generator: torch.Generator | int | None = None,
) -> Tensor:
    """Fan-in uniform: ``U(-b, b)``, ``b = gain * sqrt(3 / fan_in)`` (He et al., 2015).

    Equals ``torch.nn.init.kaiming_uniform_(tensor, nonlinearity="relu")`` bit for bit for the same
    generator (note: ``nn.Linear``'s default init is ``kaiming_uniform_`` with ``a = sqrt(5)``).

    ``groups``, ``transposed`` and ``stride`` give the layout as in :func:`initlab.compute_fans`.
    ``stride`` is a ``ConvTranspose``'s (with ``transposed=True``; an int or one per spatial dim):
    ``fan_in = (n_in / g) * k / prod(stride)``, as :func:`~initlab.init_model` uses (left at 1, a
    strided ``ConvTranspose`` comes out ``prod(stride)`` times too small in variance), so
    ``b = gain * sqrt(3 * prod(stride) / ((n_in / g) * k))``.
    """
    _check_tensor(tensor, "fan_in_uniform_")
    fans = compute_fans(tensor, groups=groups, transposed=transposed, stride=stride)
    spec = FanIn(nonlinearity=nonlinearity, param=param, gain=gain, distribution="uniform").spec(
        fans
    )
    return sample_(tensor, spec, generator=generator, groups=groups, transposed=transposed)


def fan_out_normal_(
    tensor: Tensor,
    *,
    nonlinearity: Nonlinearity = "relu",
    param: float | None = None,
    gain: float | None = None,
    groups: int = 1,
    transposed: bool = False,
    stride: int | Sequence[int] = 1,
    generator: torch.Generator | int | None = None,
) -> Tensor:
    """Fan-out normal: ``N(0, std**2)``, ``std = gain / sqrt(fan_out)`` (He et al., 2015).

    Equals ``torch.nn.init.kaiming_normal_(mode="fan_out")`` for ungrouped weights.

    ``groups``, ``transposed`` and ``stride`` give the layout as in :func:`initlab.compute_fans`.
    ``stride`` (a ``ConvTranspose``'s, with ``transposed=True``) corrects ``fan_in`` only:
    ``fan_out = (n_out / g) * k`` whatever the stride, so this draw does not depend on it.
    """
    _check_tensor(tensor, "fan_out_normal_")
    fans = compute_fans(tensor, groups=groups, transposed=transposed, stride=stride)
    spec = FanOut(nonlinearity=nonlinearity, param=param, gain=gain).spec(fans)
    return sample_(tensor, spec, generator=generator, groups=groups, transposed=transposed)


def fan_out_uniform_(
    tensor: Tensor,
    *,
    nonlinearity: Nonlinearity = "relu",
    param: float | None = None,
    gain: float | None = None,
    groups: int = 1,
    transposed: bool = False,
    stride: int | Sequence[int] = 1,
    generator: torch.Generator | int | None = None,
) -> Tensor:
    """Fan-out uniform: ``U(-b, b)``, ``b = gain * sqrt(3 / fan_out)`` (He et al., 2015).

    ``groups``, ``transposed`` and ``stride`` give the layout as in :func:`initlab.compute_fans`.
    ``stride`` (a ``ConvTranspose``'s, with ``transposed=True``) corrects ``fan_in`` only:
    ``fan_out = (n_out / g) * k`` whatever the stride, so this draw does not depend on it.
    """
    _check_tensor(tensor, "fan_out_uniform_")
    fans = compute_fans(tensor, groups=groups, transposed=transposed, stride=stride)
    spec = FanOut(nonlinearity=nonlinearity, param=param, gain=gain, distribution="uniform").spec(
        fans
    )
    return sample_(tensor, spec, generator=generator, groups=groups, transposed=transposed)


def arithmetic_normal_(
    tensor: Tensor,
    *,
    nonlinearity: Nonlinearity = "relu",
    param: float | None = None,
    gain: float | None = None,
    groups: int = 1,
    transposed: bool = False,
    stride: int | Sequence[int] = 1,
    generator: torch.Generator | int | None = None,
) -> Tensor:
    """Arithmetic-mean normal: ``Var = 2 * gain**2 / (fan_in + fan_out)`` (Glorot & Bengio, 2010).

    ReLU default: ``4 / (fan_in + fan_out)``. With ``nonlinearity="linear"`` this is
    ``torch.nn.init.xavier_normal_`` bit for bit for the same generator (ungrouped weights).

    ``groups``, ``transposed`` and ``stride`` give the layout as in :func:`initlab.compute_fans`.
    ``stride`` is a ``ConvTranspose``'s (with ``transposed=True``; an int or one per spatial dim):
    ``fan_in = (n_in / g) * k / prod(stride)``, as :func:`~initlab.init_model` uses (left at 1, a
    strided ``ConvTranspose`` comes out too small in variance), so
    ``Var = 2 * gain**2 / ((n_in / g) * k / prod(stride) + (n_out / g) * k)``.
    """
    _check_tensor(tensor, "arithmetic_normal_")
    fans = compute_fans(tensor, groups=groups, transposed=transposed, stride=stride)
    spec = ArithmeticMean(nonlinearity=nonlinearity, param=param, gain=gain).spec(fans)
    return sample_(tensor, spec, generator=generator, groups=groups, transposed=transposed)


def arithmetic_uniform_(
    tensor: Tensor,
    *,
    nonlinearity: Nonlinearity = "relu",
    param: float | None = None,
    gain: float | None = None,
    groups: int = 1,
    transposed: bool = False,
    stride: int | Sequence[int] = 1,
    generator: torch.Generator | int | None = None,
) -> Tensor:
    """Arithmetic-mean uniform: ``b = gain * sqrt(6 / (fan_in + fan_out))`` (Glorot & Bengio, 2010).

    With ``nonlinearity="linear"`` this is ``torch.nn.init.xavier_uniform_`` bit for bit.

    ``groups``, ``transposed`` and ``stride`` give the layout as in :func:`initlab.compute_fans`.
    ``stride`` is a ``ConvTranspose``'s (with ``transposed=True``; an int or one per spatial dim):
    ``fan_in = (n_in / g) * k / prod(stride)``, as :func:`~initlab.init_model` uses (left at 1, a
    strided ``ConvTranspose`` comes out too small in variance), so
    ``b = gain * sqrt(6 / ((n_in / g) * k / prod(stride) + (n_out / g) * k))``.
    """
    _check_tensor(tensor, "arithmetic_uniform_")
    fans = compute_fans(tensor, groups=groups, transposed=transposed, stride=stride)
    spec = ArithmeticMean(
        nonlinearity=nonlinearity, param=param, gain=gain, distribution="uniform"
    ).spec(fans)
    return sample_(tensor, spec, generator=generator, groups=groups, transposed=transposed)


def geometric_normal_(
    tensor: Tensor,
    *,
    nonlinearity: Nonlinearity = "relu",
    param: float | None = None,
    gain: float | None = None,
    c: float | None = None,
    groups: int = 1,
    transposed: bool = False,
    stride: int | Sequence[int] = 1,
    generator: torch.Generator | int | None = None,
) -> Tensor:
    """Geometric-mean normal: ``Var = c / sqrt(fan_in * fan_out)`` (Defazio & Bottou 2020, Eq. 2/7).

    ``c`` defaults to ``gain**2`` (2 for ReLU). For a ``k x k`` conv this is
    ``c / (k**2 sqrt(n_in n_out))``.

    ``groups``, ``transposed`` and ``stride`` give the layout as in :func:`initlab.compute_fans`.
    ``stride`` is a ``ConvTranspose``'s (with ``transposed=True``; an int or one per spatial dim):
    ``fan_in = (n_in / g) * k / prod(stride)``, as :func:`~initlab.init_model` uses (left at 1, a
    strided ``ConvTranspose`` comes out ``sqrt(prod(stride))`` times too small in variance), so
    ``Var = c * sqrt(prod(stride)) / (k * sqrt((n_in / g) * (n_out / g)))``.

    Example:
        >>> w = geometric_normal_(torch.empty(200, 50), generator=torch.Generator().manual_seed(0))
        >>> abs(w.var().item() / (2 / (50 * 200) ** 0.5) - 1) < 0.1
        True
    """
    _check_tensor(tensor, "geometric_normal_")
    fans = compute_fans(tensor, groups=groups, transposed=transposed, stride=stride)
    spec = GeometricMean(nonlinearity=nonlinearity, param=param, gain=gain, c=c).spec(fans)
    return sample_(tensor, spec, generator=generator, groups=groups, transposed=transposed)


def geometric_uniform_(
    tensor: Tensor,
    *,
    nonlinearity: Nonlinearity = "relu",
    param: float | None = None,
    gain: float | None = None,
    c: float | None = None,
    groups: int = 1,
    transposed: bool = False,
    stride: int | Sequence[int] = 1,
    generator: torch.Generator | int | None = None,
) -> Tensor:
    """Geometric-mean uniform: ``U(-b, b)``, ``b**2 = 3 c / sqrt(fan_in * fan_out)``.

    Defazio & Bottou (2020), Eq. 2/7; ``c`` defaults to ``gain**2`` (2 for ReLU).

    ``groups``, ``transposed`` and ``stride`` give the layout as in :func:`initlab.compute_fans`.
    ``stride`` is a ``ConvTranspose``'s (with ``transposed=True``; an int or one per spatial dim):
    ``fan_in = (n_in / g) * k / prod(stride)``, as :func:`~initlab.init_model` uses (left at 1, a
    strided ``ConvTranspose`` comes out ``sqrt(prod(stride))`` times too small in variance), so
    ``b**2 = 3 * c * sqrt(prod(stride)) / (k * sqrt((n_in / g) * (n_out / g)))``.
    """
    _check_tensor(tensor, "geometric_uniform_")
    fans = compute_fans(tensor, groups=groups, transposed=transposed, stride=stride)
    spec = GeometricMean(
        nonlinearity=nonlinearity, param=param, gain=gain, c=c, distribution="uniform"
    ).spec(fans)
    return sample_(tensor, spec, generator=generator, groups=groups, transposed=transposed)


def geometric_trunc_normal_(
    tensor: Tensor,
    *,
    nonlinearity: Nonlinearity = "relu",
    param: float | None = None,
    gain: float | None = None,
    c: float | None = None,
    groups: int = 1,
    transposed: bool = False,
    stride: int | Sequence[int] = 1,
    generator: torch.Generator | int | None = None,
) -> Tensor:
    """Geometric-mean truncated normal (cut at ±2 sigma'): ``Var = c / sqrt(fan_in * fan_out)``.

    The variance is that of the truncated distribution.

    See :func:`trunc_normal_` for the rescaling; Defazio & Bottou (2020), Eq. 2/7.

    ``groups``, ``transposed`` and ``stride`` give the layout as in :func:`initlab.compute_fans`.
    ``stride`` is a ``ConvTranspose``'s (with ``transposed=True``; an int or one per spatial dim):
    ``fan_in = (n_in / g) * k / prod(stride)``, as :func:`~initlab.init_model` uses (left at 1, a
    strided ``ConvTranspose`` comes out ``sqrt(prod(stride))`` times too small in variance), so
    ``Var = c * sqrt(prod(stride)) / (k * sqrt((n_in / g) * (n_out / g)))``.
    """
    _check_tensor(tensor, "geometric_trunc_normal_")
    fans = compute_fans(tensor, groups=groups, transposed=transposed, stride=stride)
    spec = GeometricMean(
        nonlinearity=nonlinearity, param=param, gain=gain, c=c, distribution="trunc_normal"
    ).spec(fans)
    return sample_(tensor, spec, generator=generator, groups=groups, transposed=transposed)


def operator_norm_normal_(
    tensor: Tensor,
    *,
    nonlinearity: Nonlinearity = "relu",
    param: float | None = None,
    lipschitz: float | None = None,
    a: float = 1.0,
    groups: int = 1,
    transposed: bool = False,
    stride: int | Sequence[int] = 1,
    generator: torch.Generator | int | None = None,
) -> Tensor:
    """Operator-norm normal: ``std = 1 / ((sqrt(cols) + sqrt(n_out)) * L * a)`` (lecture).

    ``cols = n_in * k`` and ``n_out``: the reshaped ``n_out x (n_in * k)`` kernel (``cols`` is
    ``fan_in``, but ``fan_in * prod(stride)`` for a strided transposed convolution, whose
    ``fan_in`` is ``n_in * k / prod(stride)``: :attr:`initlab.Fans.cols`).
    Gives ``||W||_2 ~ 1 / L`` (2 for ReLU's average Lipschitz constant 0.5). ``lipschitz``
    defaults to :func:`initlab.average_lipschitz` of the nonlinearity; there is no ``gain``.

    ``groups``, ``transposed`` and ``stride`` give the layout as in :func:`initlab.compute_fans`.
    ``stride`` (a ``ConvTranspose``'s, with ``transposed=True``) divides ``fan_in`` by
    ``prod(stride)`` but leaves ``cols = fan_in * prod(stride) = (n_in / g) * k``, so this draw
    does not depend on it.

    Example:
        >>> w = operator_norm_normal_(torch.empty(1000, 1000),
        ...                           generator=torch.Generator().manual_seed(0))
        >>> abs(torch.linalg.matrix_norm(w, ord=2).item() - 2) < 0.05
        True
    """
    _check_tensor(tensor, "operator_norm_normal_")
    fans = compute_fans(tensor, groups=groups, transposed=transposed, stride=stride)
    spec = OperatorNorm(nonlinearity=nonlinearity, param=param, lipschitz=lipschitz, a=a).spec(fans)
    return sample_(tensor, spec, generator=generator, groups=groups, transposed=transposed)
