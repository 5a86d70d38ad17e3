r"""Top eigenpairs of a curvature operator: Lanczos with full reorthogonalization and deflation.

:func:`_lanczos` backs :meth:`~initlab.measure.curvature.operators.CurvatureOperator.eigenpairs`
(and so :func:`~initlab.measure.curvature.estimators.hessian_eigenpairs`); it uses only the
operator's ``shape``, ``dtype``, ``device``, ``matvec``, ``split`` and ``param_names``.

The Krylov space of one start vector holds one vector per eigenspace, so one Lanczos run sees a
repeated eigenvalue once (the Hessian ``c·XᵀX ⊗ I_m`` of a multi-output linear layer has every
eigenvalue ``m`` times). After the first run has converged, :func:`_deflate` restarts from a
random vector orthogonal to the ``k`` eigenvectors found (every step is kept orthogonal to them)
and takes in the Ritz pairs that belong in the top ``k``, until a restart finds nothing that
displaces the ``k``-th value.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, NamedTuple

import torch

from initlab._core.knobs import user_stacklevel
from initlab._core.rng import as_generator, draw_device

if TYPE_CHECKING:
    from initlab.measure.curvature.operators import CurvatureOperator

_KIND_NAMES = {"hessian": "Hessian", "ggn": "GGN"}

_Pair = tuple[float, torch.Tensor, float]
"""An eigenpair: value, unit vector (flat, in the operator's dtype), relative residual (that of
the run which found it, see :func:`_residuals`)."""


class _Run(NamedTuple):
    """One Lanczos run: its leading Ritz pairs in the order of ``which``, and its steps."""

    pairs: list[_Pair]
    steps: int
    converged: bool


def _key(which: str, value: float) -> float:
    return abs(value) if which == "LM" else value


def _fresh_direction(qmat: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """A random unit vector orthogonal to the columns of ``qmat`` (two Gram-Schmidt passes)."""
    r = torch.randn(qmat.shape[0], generator=gen, dtype=torch.float64, device=draw_device(gen))
    r = r.to(qmat.dtype).to(qmat.device)
    for _ in range(2):
        r = r - qmat @ (qmat.T @ r)
    return r / r.norm()


def _ritz(alphas: list[float], betas: list[float], which: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenpairs of the tridiagonal ``T_m``, in the order of ``which``."""
    m = len(alphas)
    t = torch.diag(torch.tensor(alphas, dtype=torch.float64, device="cpu"))
    if m > 1:
        off = torch.tensor(betas[: m - 1], dtype=torch.float64, device="cpu")
        t += torch.diag(off, 1) + torch.diag(off, -1)
    vals, vecs = torch.linalg.eigh(t)
    key = vals.abs() if which == "LM" else vals
    order = torch.argsort(key, descending=True)
    return vals[order], vecs[:, order]


def _residuals(vals: torch.Tensor, vecs: torch.Tensor, beta: float, kk: int) -> list[float]:
    """``|β_m s_i[m]| / |θ_i|``, the relative residual of the first ``kk`` Ritz pairs of the run's
    operator (in a restart: ``H`` in the complement of the locked eigenvectors, whose own
    residuals, at most ``tol`` relative, move its eigenvalues only to second order)."""
    return [abs(beta * float(vecs[-1, i])) / max(abs(float(vals[i])), 1e-30) for i in range(kk)]


def _done(
    keys: list[float], residuals: list[float], k: int, tol: float, below: float | None
) -> bool:
    """The stop test on the leading Ritz pairs (``keys`` in the order of ``which``). The first
    run (``below`` None): the top ``k`` have converged. A restart: they have converged up to the
    first one at or below ``below`` (no further one can enter the top ``k``), or all ``k`` have."""
    if below is not None:
        for key, res in zip(keys, residuals, strict=True):
            if res > tol:
                return False
            if key <= below:
                return True
    return len(keys) >= k and max(residuals) <= tol


def _run(
    op: CurvatureOperator,
    k: int,
    which: str,
    m_max: int,
    tol: float,
    gen: torch.Generator | None,
    locked: torch.Tensor,
    below: float | None = None,
) -> _Run:
    """One Lanczos run on ``H`` in the orthogonal complement of ``locked``'s columns, from a
    random start vector there (``below``: the restart's stop test, see :func:`_done`)."""
    basis = [_fresh_direction(locked, gen)]
    alphas: list[float] = []
    betas: list[float] = []
    for j in range(m_max):
        w = op.matvec(basis[j])
        if not bool(torch.isfinite(w).all()):  # eigh of a NaN T_m: a raw "failed to converge"
            raise FloatingPointError(
                f"{op._what}: a {_KIND_NAMES.get(op.kind, op.kind)} product in the Lanczos "
                "iteration holds NaN/inf: "
                f"{op.nonfinite_cause()}"
            )
        alphas.append(float(torch.dot(w.double(), basis[j].double())))
        qmat = torch.stack(basis, dim=1)
        full = torch.cat([locked, qmat], dim=1) if locked.shape[1] else qmat
        for _ in range(2):
            w = w - full @ (full.T @ w)
        beta = float(w.double().norm())
        vals, vecs = _ritz(alphas, betas, which)
        kk = min(k, len(alphas))
        residuals = _residuals(vals, vecs, beta, kk)
        keys = [_key(which, float(v)) for v in vals[:kk]]
        converged = _done(keys, residuals, k, tol, below)
        if converged or j == m_max - 1:
            break
        if beta <= 1e-12 * max(abs(a) for a in alphas):
            # An invariant subspace (a repeated eigenvalue, a start vector in few eigenspaces):
            # go on from a fresh direction orthogonal to it; T stays block-diagonal (beta = 0).
            w = _fresh_direction(full, gen)
            beta = 0.0
        else:
            w = w / beta
        betas.append(beta)
        basis.append(w)
    qmat = torch.stack(basis[: len(alphas)], dim=1).double()
    pairs = []
    for i in range(kk):
        vec = (qmat @ vecs[:, i]).to(op.dtype)
        pairs.append((float(vals[i]), vec / vec.norm(), residuals[i]))
    return _Run(pairs, len(alphas), converged)


def _deflate(
    op: CurvatureOperator,
    pairs: list[_Pair],
    which: str,
    m_max: int,
    tol: float,
    gen: torch.Generator | None,
) -> list[_Pair]:
    """Restart from vectors orthogonal to the ``k`` pairs found, taking in the Ritz pairs that
    belong in the top ``k``, until a restart finds none (at most ``k`` restarts, then a warning;
    a restart that does not converge in ``m_max`` steps also ends the search, with a warning).

    A value within ``tol·|θ_k|`` (and a few rounding units of the largest) of the ``k``-th one
    is a tie, not a displacement: the top ``k`` values are then right to that accuracy."""
    k, n = len(pairs), op.shape[0]
    eps = torch.finfo(op.dtype).eps
    scale = max(abs(p[0]) for p in pairs)
    for _ in range(k):
        kth = _key(which, pairs[-1][0])
        below = kth + tol * abs(kth) + 16 * eps * scale
        locked = torch.stack([p[1] for p in pairs], dim=1)
        run = _run(op, k, which, min(n - k, m_max), tol, gen, locked, below)
        new = [p for p in run.pairs if _key(which, p[0]) > below]
        if new:
            pairs = sorted(pairs + new, key=lambda p: -_key(which, p[0]))[:k]
        if not run.converged:
            worst = max(p[2] for p in run.pairs)
            _warn(
                f"Lanczos did not converge in {run.steps} steps of a restart orthogonal to the "
                f"top-{k} eigenvectors found (the search for further copies of a repeated "
                f"eigenvalue): relative residuals up to {worst:.2g} > tol={tol:g}, so a "
                "repeated eigenvalue may be counted too few times; raise iters"
            )
            return pairs
        if not new:
            return pairs
    _warn(
        f"Lanczos stopped after {k} restarts orthogonal to the top-{k} eigenvectors found, the "
        "last of which still found a larger eigenvalue: a repeated eigenvalue may be counted "
        "too few times"
    )
    return pairs


def _warn(message: str) -> None:
    warnings.warn(message, UserWarning, stacklevel=user_stacklevel())


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
    none = torch.zeros(n, 0, dtype=op.dtype, device=op.device)  # no vectors to deflate
    first = _run(op, k, which, m_max, tol, gen, none)
    if first.steps < k:  # m_max < k cannot happen (k <= n): the loop ran out of directions
        raise RuntimeError(f"Lanczos ran {first.steps} < k={k} steps; raise iters")
    pairs = first.pairs
    worst = max(p[2] for p in pairs)
    if worst > tol:
        _warn(
            f"Lanczos did not converge in {first.steps} steps (iters={iters}): the top-{k} "
            f"eigenpairs have relative residuals up to {worst:.2g} > tol={tol:g}, so "
            "the last ones may be wrong (a true eigenvalue skipped); raise iters"
        )
    elif 1 < k < n:  # k = 1: a repeated top eigenvalue is still the top one
        pairs = _deflate(op, pairs, which, m_max, tol, gen)
    vals = torch.tensor([p[0] for p in pairs], dtype=torch.float64, device="cpu")
    out = [
        dict(zip(op.param_names, (t.clone() for t in op.split(p[1])), strict=True)) for p in pairs
    ]
    return vals, out
