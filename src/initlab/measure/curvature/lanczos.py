r"""Top eigenpairs of a curvature operator: Lanczos with full reorthogonalization.

:func:`_lanczos` backs :meth:`~initlab.measure.curvature.operators.CurvatureOperator.eigenpairs`
(and so :func:`~initlab.measure.curvature.estimators.hessian_eigenpairs`); it uses only the
operator's ``shape``, ``dtype``, ``device``, ``matvec``, ``split`` and ``param_names``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from initlab._core.rng import as_generator

if TYPE_CHECKING:
    from initlab.measure.curvature.operators import CurvatureOperator


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
        converged = len(alphas) >= k and all(
            abs(beta * float(vecs[-1, i])) <= tol * max(abs(float(vals[i])), 1e-30)
            for i in range(kk)
        )
        if converged or j == m_max - 1 or beta <= 1e-12 * max(abs(a) for a in alphas):
            break
        betas.append(beta)
        basis.append(w / beta)
    vals, vecs = ritz()
    if len(alphas) < k:
        raise RuntimeError(
            f"Lanczos found an invariant subspace of dimension {len(alphas)} < k={k}; "
            "draw another start vector (generator=)"
        )
    qmat = torch.stack(basis[: len(alphas)], dim=1)
    out = []
    for i in range(k):
        vec = (qmat.double() @ vecs[:, i]).to(op.dtype)
        vec = vec / vec.norm()
        out.append(dict(zip(op.param_names, (t.clone() for t in op.split(vec)), strict=True)))
    return vals[:k].clone(), out
