"""Lipschitz upper bounds from the operator norms of :func:`~initlab.diagnostics.spectra.
layer_spectra` (the lecture's products, seeds digest §3; see :mod:`initlab.diagnostics.spectra`).
Importable from :mod:`initlab.diagnostics.spectra` and :mod:`initlab.diagnostics`."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from initlab._core.rows import Rows

__all__ = ["lipschitz_bounds"]


def lipschitz_bounds(
    spectra: Rows | Iterable[Mapping[str, Any]],
    residual_blocks: Sequence[Mapping[str, Any]] = (),
    *,
    uncovered: Sequence[str] = (),
) -> dict[str, Any]:
    """Lipschitz upper bounds from operator norms (see :mod:`initlab.diagnostics.spectra`).

    Args:
        spectra: rows of :func:`layer_spectra` (``layer``, ``op_norm``, ``order``).
        residual_blocks: dicts with ``name``, ``branch`` (layer names on the residual branch) and
            ``shortcut`` (layer names on the shortcut; empty for an identity shortcut), as found by
            :func:`initlab.diagnostics.linter.find_residual_blocks`.
        uncovered: names of parameterized layers the bound does not cover (noted).

    Returns:
        ``{"plain": prod ||W_j||, "residual": the residual bound, "layers": n, "guaranteed":
        no layer was left uncovered, "uncovered": [...], "notes": [...]}``. ``plain`` bounds a
        chain; with skip connections only ``residual`` is an upper bound.
    """
    norms: dict[str, float] = {}
    for r in spectra:
        if math.isfinite(r["op_norm"]) and r["layer"] not in norms:
            norms[r["layer"]] = float(r["op_norm"])
    notes = []
    if uncovered:
        shown = ", ".join(uncovered[:6]) + (
            f" and {len(uncovered) - 6} more" if len(uncovered) > 6 else ""
        )
        notes.append(f"not covered (assumed 1-Lipschitz, so not a guarantee): {shown}")
    plain = math.prod(norms.values()) if norms else math.nan
    blocks = []
    for b in residual_blocks:
        members = {n for n in [*b.get("branch", ()), *b.get("shortcut", ())] if n in norms}
        blocks.append((b.get("name", "?"), members, b))
    # nesting: a block inside another block's branch is one element of that branch
    blocks.sort(key=lambda t: len(t[1]))

    def factor(idx: int) -> float:
        _, members, b = blocks[idx]
        inner = _maximal(
            [j for j in range(len(blocks)) if j != idx and blocks[j][1] < members], blocks
        )
        covered = set().union(*(blocks[j][1] for j in inner)) if inner else set()
        branch = [n for n in b.get("branch", ()) if n in norms and n not in covered]
        shortcut = [n for n in b.get("shortcut", ()) if n in norms and n not in covered]
        inner_factors = [factor(j) for j in inner]
        return math.prod(norms[n] for n in shortcut) + math.prod(
            [*(norms[n] for n in branch), *inner_factors]
        )

    top = _maximal(list(range(len(blocks))), blocks)
    seen: set[str] = set()
    for j in top:
        overlap = blocks[j][1] & seen
        if overlap:
            notes.append(
                f"residual block {blocks[j][0]} overlaps another block ({sorted(overlap)}): "
                "residual bound not available"
            )
            return {
                "plain": plain, "residual": math.nan, "layers": len(norms),
                "guaranteed": False, "uncovered": list(uncovered), "notes": notes,
            }  # fmt: skip
        seen |= blocks[j][1]
    outside = [v for n, v in norms.items() if n not in seen]
    residual = math.prod([*outside, *(factor(j) for j in top)]) if norms else math.nan
    return {
        "plain": plain, "residual": residual, "layers": len(norms),
        "guaranteed": not uncovered, "uncovered": list(uncovered), "notes": notes,
    }  # fmt: skip


def _maximal(indices: list[int], blocks: list[tuple[str, set[str], Any]]) -> list[int]:
    """Blocks among ``indices`` not strictly contained in another one among them."""
    return [i for i in indices if not any(blocks[i][1] < blocks[j][1] for j in indices if j != i)]
