"""LSUV's moment vectors and the output arithmetic of a rescaled layer.

A layer's output is ``y = z + b`` with ``z = W x``; every statistic that decides a scale is a sum
over its elements (``n, Σz, Σ|z|², Σ Re(z conj b), Σb, Σ|b|²``, the sums of ``z`` and ``b`` with
their imaginary parts kept apart), so it adds over calls, batches and ranks (:func:`reduce_ranks`),
and the variance of ``s z + b`` is a quadratic in ``s`` (:func:`solve_scale`). The variance of a
complex output is ``E|y - E y|² = Var(Re y) + Var(Im y)``, the same formulas with ``|.|²`` for
squares (a real output: the imaginary sums are 0). :func:`rescaled_output` is what the layer
computes once its weight is multiplied by ``s``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from initlab._core.distributed import all_reduce_sum, checkpoint, is_distributed
from initlab._core.reductions import sum_of_squares

__all__ = [
    "SB",
    "SBB",
    "SB_IM",
    "SZ",
    "SZB",
    "SZZ",
    "SZ_IM",
    "WIDTH",
    "N",
    "bias_dim",
    "broadcast_shape",
    "is_dead",
    "moment_vector",
    "nonzero_bias",
    "reduce_ranks",
    "rescaled_output",
    "scaled_moments",
    "solve_scale",
    "variance",
]

# A layer whose output variance is below this fraction of its mean square is constant: dead.
_DEAD_RELATIVE = 1e-10

# Moment vectors: sums over the elements of z = W x (the output without its bias) and b (the bias
# broadcast to the output): [n, Σ Re z, Σ|z|², Σ Re(z conj b), Σ Re b, Σ|b|², Σ Im z, Σ Im b].
# Sums, so they add over calls, batches and ranks, and the variance of y = s z + b is a quadratic
# in s. A real output has Σ Im z = Σ Im b = 0.
N, SZ, SZZ, SZB, SB, SBB, SZ_IM, SB_IM = range(8)
WIDTH = 8


def _mean_and_variance(z: torch.Tensor) -> tuple[torch.Tensor, list[float], float]:
    """``z`` in float32 at least, its mean (``[Re]``, or ``[Re, Im]`` for a complex ``z``) and
    its variance ``E|z|² - |E z|²`` (two-pass where that difference cancels)."""
    n = z.numel()
    if z.is_complex():
        zf = z if z.dtype in (torch.complex64, torch.complex128) else z.to(torch.complex64)
        parts = torch.view_as_real(zf).reshape(-1, 2)  # columns Re z, Im z
        means = [float(x) / n for x in parts.sum(0)]
    else:
        zf = z if z.dtype in (torch.float32, torch.float64) else z.float()
        parts = zf.reshape(-1)
        means = [float(parts.sum()) / n]
    # Σz and Σ|z|² (accurate at any size, ~30x faster than torch.var_mean's Welford pass).
    mean_sq = sum(m * m for m in means)
    v = float(sum_of_squares(parts)) / n - mean_sq
    if v < 1e-3 * mean_sq:  # E|z|² - |E z|² cancels: take the two-pass variance instead
        if zf.is_complex():
            var, mean = torch.var_mean(parts, dim=0, correction=0)
        else:
            var, mean = torch.var_mean(zf, correction=0)
        means, v = [float(m) for m in mean.reshape(-1)], float(var.sum())
    return zf, means, max(v, 0.0)


def moment_vector(z: torch.Tensor, bias: torch.Tensor | None, channel_dim: int) -> list[float]:
    """The moment vector of ``z`` (and of ``bias`` broadcast along ``channel_dim``); a complex
    ``z`` or ``bias`` is summed as its real and imaginary parts (``|z|² = Re² + Im²``)."""
    n = z.numel()
    vec = [0.0] * WIDTH
    if n == 0:
        return vec
    zf, means, v = _mean_and_variance(z)
    mean_sq = sum(m * m for m in means)
    vec[N], vec[SZ], vec[SZZ] = float(n), n * means[0], n * (v + mean_sq)
    if len(means) == 2:
        vec[SZ_IM] = n * means[1]
    if bias is not None:
        wide = torch.complex128 if zf.is_complex() or bias.is_complex() else torch.float64
        b = bias.detach().reshape(-1).to(wide)
        per_channel = n / b.numel()
        dims = [d for d in range(z.dim()) if d != channel_dim]
        high = torch.complex128 if zf.is_complex() else torch.float64
        channel_sums = (zf.sum(dim=dims, dtype=high) if dims else zf.to(high)).to(wide)
        vec[SZB] = float(torch.real(channel_sums * b.conj()).sum())
        vec[SB] = per_channel * float(torch.real(b).sum())
        vec[SBB] = per_channel * float(torch.real(b * b.conj()).sum())
        if b.is_complex():
            vec[SB_IM] = per_channel * float(b.imag.sum())
    return vec


def _parts(vec: Sequence[float]) -> tuple[float, float, float]:
    """``(Var(z), Re Cov(z, b), Var(b))`` of a moment vector: ``Var(z) = E|z|² - |E z|²``,
    ``Re Cov(z, b) = E Re(z conj b) - Re(E z conj E b)``."""
    n = vec[N]
    mz, mb = vec[SZ] / n, vec[SB] / n
    mzi, mbi = vec[SZ_IM] / n, vec[SB_IM] / n
    return (
        vec[SZZ] / n - (mz * mz + mzi * mzi),
        vec[SZB] / n - (mz * mb + mzi * mbi),
        vec[SBB] / n - (mb * mb + mbi * mbi),
    )


def variance(vec: Sequence[float]) -> float:
    """Variance ``E|y - E y|²`` of ``y = z + b`` over all elements (``nan`` for an empty
    vector): ``Var(z) + 2 Re Cov(z, b) + Var(b)``."""
    if vec[N] == 0:
        return math.nan
    var_z, cov, var_b = _parts(vec)
    return max(var_z + 2.0 * cov + var_b, 0.0)


def scaled_moments(vec: Sequence[float], s: float) -> list[float]:
    """The moment vector of ``s z + b``."""
    out = list(vec)
    out[SZ], out[SZZ], out[SZB], out[SZ_IM] = (
        s * vec[SZ],
        s * s * vec[SZZ],
        s * vec[SZB],
        s * vec[SZ_IM],
    )
    return out


def is_dead(vec: Sequence[float]) -> bool:
    var_z = _parts(vec)[0]
    mean_sq = vec[SZZ] / vec[N]
    return mean_sq == 0.0 or var_z <= _DEAD_RELATIVE * mean_sq


def solve_scale(vec: Sequence[float], target: float) -> float | None:
    """The factor ``s > 0`` with ``Var(s z + b) = target``; ``None`` if there is none.

    ``Var(s z + b) = s² Var(z) + 2 s Re Cov(z, b) + Var(b)`` (real ``s``); for ``b = 0`` this is
    ``sqrt(target / Var(z))``. With two positive roots the one closer to 1 is taken.
    """
    var_z, cov, var_b = _parts(vec)
    if var_z <= 0.0:
        return None
    disc = cov * cov - var_z * (var_b - target)
    if disc < 0.0:
        return None
    root = math.sqrt(disc)
    roots = [r for r in ((-cov + root) / var_z, (-cov - root) / var_z) if r > 0.0]
    if not roots:
        return None
    return min(roots, key=lambda r: abs(math.log(r)))


def reduce_ranks(vecs: list[list[float]], step: str) -> list[list[float]]:
    """Sum moment vectors over ranks (identity without a process group). ``step`` names what
    they are the moments of: every rank must reduce the same step (else RankMismatchError)."""
    if not vecs or not is_distributed():
        return vecs
    # a peer that failed in its pass, or whose data ran another layer, raises here too
    checkpoint("lsuv_", step)
    t = torch.tensor(vecs, dtype=torch.float64, device="cpu")
    all_reduce_sum([t])
    return t.tolist()


def bias_dim(module: nn.Module, output: torch.Tensor) -> int:
    """The dim of ``output`` a bias is added along: channels for a convolution, else the last."""
    if isinstance(module, nn.modules.conv._ConvNd):
        return output.dim() - len(module.kernel_size) - 1
    return output.dim() - 1


def nonzero_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    """``bias`` unless it is ``None`` or all zeros (then the output is ``z`` itself)."""
    if bias is None or not bool(torch.any(bias)):
        return None
    return bias.detach()


def broadcast_shape(bias: torch.Tensor, ndim: int, channel_dim: int) -> list[int]:
    shape = [1] * ndim
    shape[channel_dim] = bias.numel()
    return shape


def rescaled_output(
    y: torch.Tensor,
    bias: torch.Tensor | None,
    channel_dim: int,
    s: float,
    *,
    in_place: bool = False,
) -> torch.Tensor:
    """``s (y - b) + b``: the output the layer computes once its weight is multiplied by ``s``.

    With ``in_place`` ``y`` itself is overwritten (the same values, one pass and no new tensor)
    and returned.
    """
    if bias is None:
        return y.mul_(s) if in_place else y * s
    b = bias.reshape(broadcast_shape(bias, y.dim(), channel_dim)).to(y.dtype)
    shift = b * (1.0 - s)
    return y.mul_(s).add_(shift) if in_place else y * s + shift
