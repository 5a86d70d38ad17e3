r"""Top eigenpairs of a curvature operator: Lanczos with full reorthogonalization.

:func:`_lanczos` backs :meth:`~initlab.measure.curvature.operators.CurvatureOperator.eigenpairs`
(and so :func:`~initlab.measure.curvature.estimators.hessian_eigenpairs`); it uses only the
operator's ``shape``, ``dtype``, ``device``, ``matvec``, ``split`` and ``param_names``.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from initlab._core.knobs import user_stacklevel
from initlab._core.rng import as_generator

if TYPE_CHECKING:
    from initlab.measure.curvature.operators import CurvatureOperator


def _fresh_direction(qmat: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """A random unit vector orthogonal to the columns of ``qmat`` (two Gram-Schmidt passes)."""
    r = torch.randn(qmat.shape[0], generator=gen, dtype=torch.float64)
    r = r.to(qmat.dtype).to(qmat.device)
    for _ in range(2):
        r = r - qmat @ (qmat.T @ r)
    return r / r.norm()


def _lanczos(
    op: CurvatureOperator,
    k: int,
    which: str,
    iters: int | None,
    tol: float,
    generator: torch.Generator | int | None,
) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    if which not in ("LM", "LA"):
        raise ValueError(f"unknown which {which!r}; valid values: ['LM', 'LA']")
    n = op.shape[0]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise ValueError(f"k must be an int in [1, {n}], got {k!r}")
    m_max = min(n, iters if iters is not None else max(4 * k, 40))
    gen = as_generator(generator)
    q = torch.randn(n, generator=gen, dtype=torch.float64).to(op.dtype).to(op.device)
    q = q / q.norm()
    basis = [q]
    alphas: list[float] = []
    betas: list[float] = []

    def ritz() -> tuple[torch.Tensor, torch.Tensor]:
        m = len(alphas)
        t = torch.diag(torch.tensor(alphas, dtype=torch.float64))
        if m > 1:
            off = torch.tensor(betas[: m - 1], dtype=torch.float64)
            t += torch.diag(off, 1) + torch.diag(off, -1)
        vals, vecs = torch.linalg.eigh(t)
        key = vals.abs() if which == "LM" else vals
        order = torch.argsort(key, descending=True)
        return vals[order], vecs[:, order]

    residuals: list[float] = []
    for j in range(m_max):
        w = op.matvec(basis[j])
        alpha = float(torch.dot(w.double(), basis[j].double()))
        alphas.append(alpha)
        qmat = torch.stack(basis, dim=1)
        for _ in range(2):
            w = w - qmat @ (qmat.T @ w)
        beta = float(w.double().norm())
        vals, vecs = ritz()
        kk = min(k, len(alphas))
        residuals = [
            abs(beta * float(vecs[-1, i])) / max(abs(float(vals[i])), 1e-30) for i in range(kk)
        ]
        if (len(alphas) >= k and max(residuals) <= tol) or j == m_max - 1:
            break
        if beta <= 1e-12 * max(abs(a) for a in alphas):
            # An invariant subspace (a repeated eigenvalue, a start vector in few eigenspaces):
            # go on from a fresh direction orthogonal to it; T stays block-diagonal (beta = 0).
            w = _fresh_direction(qmat, gen)
            beta = 0.0
        else:
            w = w / beta
        betas.append(beta)
        basis.append(w)
    vals, vecs = ritz()
    if len(alphas) < k:  # m_max < k cannot happen (k <= n): the loop ran out of directions
        raise RuntimeError(f"Lanczos ran {len(alphas)} < k={k} steps; raise iters")
    if max(residuals) > tol:
        warnings.warn(
            f"Lanczos did not converge in {len(alphas)} steps (iters={iters}): the top-{k} "
            f"eigenpairs have relative residuals up to {max(residuals):.2g} > tol={tol:g}, so "
            "the last ones may be wrong (a true eigenvalue skipped); raise iters",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    qmat = torch.stack(basis[: len(alphas)], dim=1)
    out = []
    for i in range(k):
        vec = (qmat.double() @ vecs[:, i]).to(op.dtype)
        vec = vec / vec.norm()
        out.append(dict(zip(op.param_names, (t.clone() for t in op.split(vec)), strict=True)))
    return vals[:k].clone(), out
