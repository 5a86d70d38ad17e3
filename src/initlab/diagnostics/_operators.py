"""Convolutions as linear maps and their operator norms, for :mod:`initlab.diagnostics.spectra`
(see its module docstring): :func:`conv_operator` (a convolution's map at an input shape and its
exact adjoint), :func:`top_singular_value` (restarted Lanczos on ``A^T A``) and
:func:`conv_operator_norm`. Importable from :mod:`initlab.diagnostics.spectra`."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from initlab._core.parametrized import layer_tensor
from initlab._core.rng import draw_device

__all__ = ["conv_norm_bound", "conv_operator", "conv_operator_norm", "top_singular_value"]

_CONVS: dict[type[nn.Module], int] = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}
_CONVTS: dict[type[nn.Module], int] = {
    nn.ConvTranspose1d: 1, nn.ConvTranspose2d: 2, nn.ConvTranspose3d: 3,
}  # fmt: skip
_CONV_FNS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONVT_FNS = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
_F64 = torch.float64
_CPU = torch.device("cpu")  # bookkeeping grids: never torch's default device


def _conv_dims(module: nn.Module) -> int:
    for cls, nd in (*_CONVS.items(), *_CONVTS.items()):
        if isinstance(module, cls):
            return nd
    raise TypeError(
        f"expected nn.Conv1d/2d/3d or nn.ConvTranspose1d/2d/3d, got {type(module).__name__}"
    )


def operator_dtype(module: nn.Module, dtype: torch.dtype) -> torch.dtype:
    """``dtype``, or its complex counterpart (``float64 -> complex128``, ``float32 ->
    complex64``) for a convolution with a complex weight (a real dtype would drop its imaginary
    part)."""
    if _weight(module).is_complex() and not dtype.is_complex:
        return dtype.to_complex()
    return dtype


def conv_operator(
    module: nn.Module,
    input_shape: Sequence[int],
    *,
    dtype: torch.dtype = _F64,
    output_padding: Sequence[int] | None = None,
) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor], tuple]:
    """The linear map of a convolution (bias excluded) at ``input_shape`` and its adjoint.

    Args:
        module: an ``nn.Conv1d/2d/3d`` (any stride, padding, padding mode, dilation, groups) or
            an ``nn.ConvTranspose1d/2d/3d``.
        input_shape: ``(C, *spatial)`` of one example (a leading batch dim of 1 is accepted).
        dtype: dtype of the computation (the weight is cast to it; a complex weight to the
            complex dtype of its precision, :func:`operator_dtype`).
        output_padding: a transposed convolution's, where a call's ``output_size`` chose it
            (``None``: the module's own).

    Returns:
        ``(A, AT, out_shape)``: ``A`` maps ``(1, C, *spatial)`` to ``(1, *out_shape)`` and ``AT``
        back, with ``<A x, y> == <x, AT y>`` (``<a, b> = sum conj(a) b``: ``AT`` is the
        conjugate transpose ``A^H``, the convolution's transpose with the conjugate weight).
    """
    nd = _conv_dims(module)
    shape = _conv_shape(module, input_shape)
    dtype = operator_dtype(module, dtype)
    if isinstance(module, tuple(_CONVTS)):
        return _transposed_operator(module, shape, dtype, output_padding)
    conv, convt = _CONV_FNS[nd], _CONVT_FNS[nd]
    w = _weight(module).to(dtype)
    wh = w.conj().resolve_conj()
    stride, dilation, groups = tuple(module.stride), tuple(module.dilation), module.groups
    kernel = tuple(w.shape[2:])
    device = w.device
    pad, spatial, pre, pre_t = _conv_padding(module, shape, nd, dtype, device)
    out_spatial = tuple(
        (s + 2 * p - d * (k - 1) - 1) // st + 1
        for s, p, d, k, st in zip(spatial, pad, dilation, kernel, stride, strict=True)
    )
    if any(o < 1 for o in out_spatial):
        raise ValueError(f"input {shape} is too small for {module}")
    output_padding = tuple(
        s - ((o - 1) * st - 2 * p + d * (k - 1) + 1)
        for s, o, st, p, d, k in zip(
            spatial, out_spatial, stride, pad, dilation, kernel, strict=True
        )
    )

    def forward(x: torch.Tensor) -> torch.Tensor:
        return conv(pre(x), w, None, stride, pad, dilation, groups)

    def adjoint(y: torch.Tensor) -> torch.Tensor:
        return pre_t(convt(y, wh, None, stride, pad, output_padding, groups, dilation))

    return forward, adjoint, (w.shape[0], *out_spatial)


def _sizes(sizes: Any, what: str) -> tuple[int, ...]:
    """``sizes`` as a tuple of integers >= 1; a ``ValueError`` names ``what`` for anything else
    (``2.5`` was truncated to 2)."""
    try:
        shape = tuple(operator.index(s) for s in sizes)
    except TypeError:
        raise ValueError(f"{what} must be a sequence of integer sizes, got {sizes!r}") from None
    if any(s < 1 for s in shape):
        raise ValueError(f"{what} must hold sizes >= 1, got {shape}")
    return shape


def _conv_shape(module: nn.Module, input_shape: Sequence[int]) -> tuple[int, ...]:
    """``(C, *spatial)`` of a convolution's input (a leading batch dim of 1 dropped), checked:
    integer sizes, ``nd + 1`` of them, ``C == in_channels``."""
    nd = _conv_dims(module)
    kind = type(module).__name__
    shape = _sizes(input_shape, f"input_shape of {kind}")
    if len(shape) == nd + 2 and shape[0] == 1:
        shape = shape[1:]
    if len(shape) != nd + 1:
        raise ValueError(
            f"input_shape must be (C, *spatial) with {nd} spatial dims for {kind}, got {shape}"
        )
    if shape[0] != module.in_channels:
        raise ValueError(
            f"input_shape {shape} has {shape[0]} channels, {kind} expects "
            f"in_channels={module.in_channels}"
        )
    return shape


def _conv_padding(
    module: nn.Module,
    shape: tuple[int, ...],
    nd: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[
    tuple[int, ...],
    tuple[int, ...],
    Callable[[torch.Tensor], torch.Tensor],
    Callable[[torch.Tensor], torch.Tensor],
]:
    """``(pad, spatial, pre, pre_t)`` of a convolution at ``shape``: its zero padding passed to
    ``conv`` as ``pad``, or any other padding applied first by ``pre`` (``F.pad``, of adjoint
    ``pre_t``); ``spatial`` is the spatial shape ``conv`` then sees."""
    if module.padding_mode == "zeros" and not isinstance(module.padding, str):
        pad = tuple(module.padding)
        spatial = shape[1:]

        def pre(x: torch.Tensor) -> torch.Tensor:
            return x

        def pre_t(z: torch.Tensor) -> torch.Tensor:
            return z

    else:
        pad = (0,) * nd
        rp = tuple(module._reversed_padding_repeated_twice)
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        spatial = tuple(
            s + rp[2 * (nd - 1 - i)] + rp[2 * (nd - 1 - i) + 1] for i, s in enumerate(shape[1:])
        )

        def pre(x: torch.Tensor) -> torch.Tensor:
            return F.pad(x, rp, mode=mode)

        def pre_t(z: torch.Tensor) -> torch.Tensor:
            # F.pad is linear, so its vector-Jacobian product is its adjoint; autograd runs
            # whatever the caller's mode (under torch.inference_mode() it records nothing)
            with torch.inference_mode(False), torch.enable_grad():
                x0 = torch.zeros((1, *shape), dtype=dtype, device=device, requires_grad=True)
                z = z.clone() if z.is_inference() else z
                (g,) = torch.autograd.grad(F.pad(x0, rp, mode=mode), x0, z)
            return g

    return pad, spatial, pre, pre_t


def _transposed_operator(
    module: nn.Module,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    output_padding: Sequence[int] | None,
) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor], tuple]:
    """:func:`conv_operator` of a transposed convolution: ``A`` is ``F.conv_transpose{1,2,3}d``
    and its adjoint the convolution with the same (conjugate) weight (``output_padding <
    stride``, so the convolution of ``A x`` has ``x``'s size)."""
    nd = _conv_dims(module)
    w = _weight(module).to(dtype)
    wh = w.conj().resolve_conj()
    stride, pad, dilation = tuple(module.stride), tuple(module.padding), tuple(module.dilation)
    extra = tuple(module.output_padding if output_padding is None else output_padding)
    _check_output_padding(module, extra, nd, stride, dilation)
    kernel, groups = tuple(w.shape[2:]), module.groups
    out_spatial = tuple(
        (s - 1) * st - 2 * p + d * (k - 1) + e + 1
        for s, st, p, d, k, e in zip(shape[1:], stride, pad, dilation, kernel, extra, strict=True)
    )
    if any(o < 1 for o in out_spatial):
        raise ValueError(f"input {shape} is too small for {module}")
    conv, convt = _CONV_FNS[nd], _CONVT_FNS[nd]

    def forward(x: torch.Tensor) -> torch.Tensor:
        return convt(x, w, None, stride, pad, extra, groups, dilation)

    def adjoint(y: torch.Tensor) -> torch.Tensor:
        return conv(y, wh, None, stride, pad, dilation, groups)

    return forward, adjoint, (w.shape[1] * groups, *out_spatial)


def _check_output_padding(
    module: nn.Module, extra: tuple, nd: int, stride: tuple, dilation: tuple
) -> None:
    """A ``ValueError`` unless ``extra`` is ``nd`` integers, each in ``[0, max(stride,
    dilation))`` (what ``F.conv_transpose{1,2,3}d`` takes)."""
    kind = type(module).__name__
    if len(extra) != nd or not all(isinstance(e, int) and not isinstance(e, bool) for e in extra):
        raise ValueError(
            f"output_padding of a {kind} must be {nd} integer(s), one per spatial dim, got {extra}"
        )
    if any(not 0 <= e < max(st, d) for e, st, d in zip(extra, stride, dilation, strict=True)):
        raise ValueError(
            f"output_padding {extra} of a {kind} must be >= 0 and smaller than its stride "
            f"{stride} or its dilation {dilation} in each dim"
        )


def top_singular_value(
    forward: Callable[[torch.Tensor], torch.Tensor],
    adjoint: Callable[[torch.Tensor], torch.Tensor],
    shape: Sequence[int],
    *,
    tol: float = 1e-10,
    value_tol: float | None = None,
    krylov: int = 48,
    max_matvecs: int = 600,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = _F64,
    device: torch.device | str | None = None,
    start: torch.Tensor | None = None,
) -> tuple[float, dict[str, Any]]:
    """Largest singular value of a linear map given as ``forward``/``adjoint`` closures.

    Power iteration on ``A^T A`` accelerated by a restarted Lanczos process: up to ``krylov``
    vectors per cycle with full reorthogonalization, Rayleigh-Ritz on the Krylov basis, restart
    from the top Ritz vector (the Ritz value never decreases between cycles). A complex
    ``dtype`` iterates on ``A^H A`` (``adjoint`` the conjugate transpose; inner products
    ``sum conj(a) b``).

    Args:
        forward: ``x -> A x`` for ``x`` of ``shape``.
        adjoint: ``y -> A^T y``.
        shape: shape of the input ``x``.
        tol: converged when the Ritz residual ``||A^T A u - theta u|| <= tol * theta``.
        value_tol: also converged when ``theta`` changed by at most ``value_tol * theta`` over a
            cycle (useful when the top eigenvalues are clustered: the value converges long
            before the vector).
        krylov: Krylov basis size per cycle (at least 1; 1 is the plain power iteration).
        max_matvecs: at most this many applications of ``A^T A`` (at least 1).
        generator: seeds the random start vector.
        dtype: dtype of the iteration.
        device: device of the iteration.
        start: start vector (default: random normal from ``generator``).

    Returns:
        ``(sigma, info)`` with ``info = {"matvecs", "residual", "converged", "value_change",
        "vector", "upper"}`` (``value_change``: relative change of ``theta`` over the last cycle;
        ``vector``: the top right singular vector found, flat). ``sigma = sqrt(theta)`` is a
        Ritz value, never above the largest singular value. ``upper = sqrt(theta + r + 1e4 eps
        theta)`` (``r`` the Ritz residual ``||A^T A u - theta u||`` of the unit Ritz vector,
        ``eps`` of ``dtype``: the rounding of the products) is above it where the eigenvalue of
        ``A^T A`` within ``r`` of ``theta`` (one is, ``A^T A`` being symmetric) is the largest;
        not where the top eigenvalues cluster closer than the iteration resolves and the Ritz
        vector leans to a lower one (``r`` does not see that: seen 1e-5 below the norm with
        ``r = 1e-5 theta``), which :func:`conv_norm_bound` rules out for a convolution.
    """
    for what, value in (("krylov", krylov), ("max_matvecs", max_matvecs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"top_singular_value: {what} must be an integer >= 1, got {value!r}")
    n = math.prod(shape)
    if start is None:
        start = torch.randn(n, generator=generator, dtype=dtype, device=draw_device(generator))
    v = start.reshape(-1).to(device=device, dtype=dtype)
    v = v / torch.linalg.vector_norm(v)
    steps = max(1, min(krylov, n))
    tiny = 100 * torch.finfo(dtype).eps
    used, theta, residual, converged, change = 0, 0.0, math.inf, False, math.inf
    while used < max_matvecs and not converged:
        basis: list[torch.Tensor] = [v]
        images: list[torch.Tensor] = []
        invariant = False
        for j in range(steps):
            w = adjoint(forward(basis[j].reshape(shape))).reshape(-1)
            used += 1
            images.append(w)
            if j == steps - 1 or used >= max_matvecs:
                break
            r = w
            stacked = torch.stack(basis)
            for _ in range(2):  # twice is enough (Kahan-Parlett)
                r = r - (stacked.conj() @ r) @ stacked
            beta = torch.linalg.vector_norm(r)
            if beta <= tiny * torch.linalg.vector_norm(w):
                invariant = True  # the Krylov space is invariant: the Ritz values are exact
                break
            basis.append(r / beta)
        vm, wm = torch.stack(basis[: len(images)]), torch.stack(images)
        t = vm.conj() @ wm.T
        evals, evecs = torch.linalg.eigh((t + t.mH) / 2)
        previous, theta = theta, float(evals[-1])
        y = evecs[:, -1]
        u = y @ vm
        residual = float(torch.linalg.vector_norm(y @ wm - theta * u))
        v = u / torch.linalg.vector_norm(u)
        if len(images) == 1 and float(torch.linalg.vector_norm(images[0])) > 0:
            # one vector: the Ritz vector is the start vector; step on to A^T A v (power iteration)
            v = images[0] / torch.linalg.vector_norm(images[0])
        converged = (
            invariant
            or theta <= 0.0
            or residual <= tol * theta
            or (value_tol is not None and abs(theta - previous) <= value_tol * theta)
        )
        change = abs(theta - previous) / theta if theta > 0 else 0.0
    theta = max(theta, 0.0)
    slack = residual + 1e4 * torch.finfo(dtype).eps * theta  # see Returns
    info = {
        "matvecs": used,
        "residual": residual,
        "converged": converged,
        "value_change": change,
        "vector": v,
        "upper": math.sqrt(theta + slack) if math.isfinite(slack) else math.inf,
    }
    return math.sqrt(theta), info


def conv_operator_norm(
    module: nn.Module,
    input_shape: Sequence[int],
    *,
    tol: float = 1e-10,
    max_matvecs: int = 600,
    polish: int = 32,
    generator: torch.Generator | None = None,
    output_padding: Sequence[int] | None = None,
) -> tuple[float, dict[str, Any]]:
    """Operator norm ``||A||_2`` of a convolution's (or a transposed convolution's, with
    ``output_padding`` as :func:`conv_operator`'s) linear map at ``input_shape``.

    Two stages, because float64 convolutions are slow on CPU: the Krylov iteration runs in float32
    until the Ritz value is stable to 1e-6, then continues in float64 from the float32 top vector
    until the Ritz residual is ``tol`` or the value is stable to 1e-11 over a cycle (at most
    ``polish`` products; the float32 vector is already close); a complex weight in complex64,
    then complex128, on ``A^H A``. See the module
    docstring. ``input_shape`` is ``(C, *spatial)`` of one example. Returns ``(sigma, info)`` as
    :func:`top_singular_value` (``matvecs`` counts both stages).
    """
    shape = _conv_shape(module, input_shape)
    device = _weight(module).device
    n = math.prod(shape)
    krylov = int(max(8, min(48, (1 << 26) // max(n, 1))))  # at most ~256 MiB of float32 basis
    low, high = operator_dtype(module, torch.float32), operator_dtype(module, _F64)
    fwd32, adj32, _ = conv_operator(module, shape, dtype=low, output_padding=output_padding)
    _, first = top_singular_value(
        fwd32, adj32, (1, *shape), tol=1e-4, value_tol=1e-6, krylov=krylov,
        max_matvecs=max_matvecs, generator=generator, dtype=low, device=device,
    )  # fmt: skip
    fwd, adj, _ = conv_operator(module, shape, dtype=high, output_padding=output_padding)
    sigma, info = top_singular_value(
        fwd, adj, (1, *shape), tol=tol, value_tol=1e-11, krylov=min(krylov, 16),
        max_matvecs=polish, dtype=high, device=device,
        start=first["vector"],
    )  # fmt: skip
    info["matvecs"] += first["matvecs"]
    return sigma, info


def conv_norm_bound(
    module: nn.Module,
    input_shape: Sequence[int],
    *,
    output_padding: Sequence[int] | None = None,
    max_work: float = 1e11,
) -> float | None:
    """An upper bound on ``||A||_2`` of a zero-padded (or circularly padded) convolution's map
    at ``input_shape`` (or a transposed convolution's, with ``output_padding`` as
    :func:`conv_operator`'s), from its symbol: no iteration, so it holds whatever the spectrum
    (up to float64 rounding: ``1e-12`` relative is added).

    The padded input of length ``N_p`` (per spatial dim) is embedded, with zeros, in a periodic
    one of length ``M``, the multiple of the stride ``s`` at or above ``N_p``; there the
    convolution's outputs are those of the periodic strided convolution, which wraps around
    nowhere they are read. So ``A`` is a part of that periodic map (an isometric embedding, then
    a selection of outputs), and ``||A||_2`` is at most its norm, by the DFT on the ``M``-grid
    ``max_nu sigma_max([H(nu_0), ..., H(nu_{s-1})]) / sqrt(s)`` over the ``M / s`` coarse
    frequencies ``nu`` and their ``s`` aliases ``nu_l = nu + 2 pi l / s`` (products over the
    spatial dims), ``H(w) = sum_j W_j exp(-i w j d)`` the dilated kernel's symbol (each group's
    ``out / g x in / g`` block). A transposed convolution's norm is its adjoint's, the
    convolution with its weight on its output size. Tight for a large input (the zero padding
    adds little: 2e-3 above the norm at 40 x 40, 7e-7 at a length of 1000), looser for a small
    one (up to 0.7 at 5 x 5). A circular padding makes the map periodic itself, of period the
    input's length ``N`` where the stride divides it and no output repeats: then ``M = N`` and
    the bound is the norm.

    Returns:
        the bound, or ``None`` for a padding other than those (``"reflect"``, ``"replicate"``;
        a circular one whose stride does not divide the input), or where the SVDs would take
        more than ``max_work`` multiply-adds.
    """
    shape = _conv_shape(module, input_shape)
    period_of = _periodic(module, shape, output_padding)
    if period_of is None:
        return None
    w = _weight(module).to(torch.complex128)
    stride, dilation, groups = tuple(module.stride), tuple(module.dilation), module.groups
    coarse = [n // st for n, st in zip(period_of, stride, strict=True)]  # M / s per dim
    rows, cols = w.shape[0] // groups, w.shape[1] * math.prod(stride)
    if math.prod(coarse) * groups * rows * cols * min(rows, cols) > max_work:
        return None
    taps = _grid([torch.arange(k, dtype=_F64, device=_CPU) * d
                  for k, d in zip(w.shape[2:], dilation, strict=True)])  # fmt: skip
    aliases = _grid([torch.arange(st, dtype=_F64, device=_CPU) for st in stride])
    period = torch.tensor(
        [st * n for st, n in zip(stride, coarse, strict=True)], dtype=_F64, device=_CPU
    )
    kernel = w.reshape(*w.shape[:2], -1).to(w.device)
    points, top = _grid([torch.arange(n, dtype=_F64, device=_CPU) for n in coarse]), 0.0
    chunk = max(1, (1 << 22) // (len(aliases) * w.shape[0] * w.shape[1]))
    for part in points.split(chunk):
        tc = torch.tensor(coarse, dtype=_F64, device=_CPU)
        omega = 2 * math.pi * (part[:, None, :] + aliases[None, :, :] * tc) / period
        phase = torch.exp(-1j * (omega @ taps.T)).to(w.device)  # (B, aliases, taps)
        symbol = torch.einsum("bat,oct->boca", phase, kernel)
        blocks = symbol.reshape(len(part), groups, rows, cols)
        top = max(top, float(torch.linalg.matrix_norm(blocks, ord=2).max()))
    return top / math.sqrt(math.prod(stride)) * (1 + 1e-12)


def _grid(axes: list[torch.Tensor]) -> torch.Tensor:
    """Every point of the product of ``axes``, one per row: ``(prod len, len(axes))``."""
    return torch.cartesian_prod(*axes).reshape(-1, len(axes))


def _periodic(
    module: nn.Module, shape: tuple[int, ...], output_padding: Sequence[int] | None
) -> tuple[int, ...] | None:
    """The period ``M`` (per spatial dim, a multiple of the stride) of a periodic strided
    convolution of which the convolution's map is a part (:func:`conv_norm_bound`), else
    ``None``. Zero padding: the padded size ``N_p`` rounded up to the stride (a transposed
    convolution's: its adjoint's, the convolution on its output size). Circular padding: the
    input's size ``N``, where the stride divides it, each padding is at most ``N`` and the
    outputs, ``floor((N_p - d (k - 1) - 1) / s) + 1``, are at most ``N / s`` (none repeats)."""
    nd = _conv_dims(module)
    kernel, stride, dilation = _weight(module).shape[2:], module.stride, module.dilation
    if isinstance(module, tuple(_CONVTS)):  # output size + 2 padding: the padding cancels
        extra = tuple(module.output_padding if output_padding is None else output_padding)
        sizes = zip(shape[1:], stride, dilation, kernel, extra, strict=True)
        padded = tuple((n - 1) * st + d * (k - 1) + e + 1 for n, st, d, k, e in sizes)
        return tuple(st * -(-n // st) for n, st in zip(padded, stride, strict=True))
    if isinstance(module.padding, str) or module.padding_mode != "zeros":
        rp = tuple(module._reversed_padding_repeated_twice)
        pads = [(rp[2 * (nd - 1 - i)], rp[2 * (nd - 1 - i) + 1]) for i in range(nd)]
    else:
        pads = [(p, p) for p in module.padding]
    padded = tuple(n + a + b for n, (a, b) in zip(shape[1:], pads, strict=True))
    if module.padding_mode == "zeros":
        return tuple(st * -(-n // st) for n, st in zip(padded, stride, strict=True))
    if module.padding_mode != "circular":
        return None
    for n, (a, b), npad, st, d, k in zip(shape[1:], pads, padded, stride, dilation, kernel,
                                         strict=True):  # fmt: skip
        outputs = (npad - d * (k - 1) - 1) // st + 1
        if n % st or max(a, b) > n or outputs > n // st:
            return None
    return tuple(shape[1:])


def _output_padding(
    module: nn.Module, in_shape: Sequence[int], out_shape: Sequence[int]
) -> tuple[int, ...]:
    """The ``output_padding`` a transposed convolution's call used: the output's size beyond
    ``(s - 1) * stride - 2 * padding + dilation * (k - 1) + 1``."""
    nd = _conv_dims(module)
    k = _weight(module).shape[2:]
    return tuple(
        int(o) - ((int(s) - 1) * st - 2 * p + d * (kk - 1) + 1)
        for o, s, st, p, d, kk in zip(
            out_shape[-nd:], in_shape[-nd:], module.stride, module.padding, module.dilation, k,
            strict=True,
        )
    )  # fmt: skip


def _weight(module: nn.Module) -> torch.Tensor:
    """``module.weight``, detached; a computed one without side effects."""
    weight = layer_tensor(module, "weight")
    assert weight is not None
    return weight.detach()
