"""Lipschitz upper bounds from the operator norms of :func:`~initlab.diagnostics.spectra.
layer_spectra` (the lecture's products, seeds digest §3; see :mod:`initlab.diagnostics.spectra`).
Importable from :mod:`initlab.diagnostics.spectra` and :mod:`initlab.diagnostics`."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from initlab._core.rows import Rows, shown

__all__ = ["lipschitz_bounds"]

INFERRED_CALLS = "not called itself: its parent"
"""How the note of a :func:`~initlab.diagnostics.spectra.layer_spectra` row starts whose call
count is inferred from its parent's (:meth:`~initlab.diagnostics.spectra.InputShapes.calls_of`):
a guess, so the bounds are no guarantee."""

SEVERAL_SHAPES = "called with several input shapes: norm at the first"
"""The note of a :func:`~initlab.diagnostics.spectra.layer_spectra` row whose layer (a
convolution: its operator norm depends on the input size) ran at several input sizes: its norm
holds at the first only, so the bounds are no guarantee."""


UNCERTIFIED = "operator norm an estimate no bound certifies"
"""The note of a :func:`~initlab.diagnostics.spectra.layer_spectra` row whose ``op_bound`` is a
Lanczos estimate raised by its residual that neither converged nor has the symbol's bound (a
padding mode other than zeros): it may lie below the norm where the top singular values cluster,
so the bounds are no guarantee."""


def lipschitz_bounds(
    spectra: Rows | Iterable[Mapping[str, Any]],
    residual_blocks: Sequence[Mapping[str, Any]] = (),
    *,
    uncovered: Sequence[str] = (),
    branch_sums: Sequence[Mapping[str, Any]] | None = None,
    operations: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Lipschitz upper bounds from operator norms (see :mod:`initlab.diagnostics.spectra`).

    A layer that runs ``k`` times in one forward (a shared or looped module: row ``calls``)
    contributes ``||W||^k``; a layer that never runs (``calls == 0``) contributes nothing. Rows
    without a known call count (``calls`` ``None`` or absent: no forward was watched) count once,
    and then the bounds are not a guarantee (noted); so are they where a count is inferred (a
    weight its parent's forward applies, taken as used once per call of the parent: the row's
    note starts with :data:`INFERRED_CALLS`).

    Args:
        spectra: rows of :func:`layer_spectra` (``layer``, ``op_norm``, ``calls``; the bounds
            take ``op_bound``, an upper bound on ``op_norm``, where a row has one).
        residual_blocks: dicts with ``name``, ``branch`` (layer names on the residual branch) and
            ``shortcut`` (layer names on the shortcut; empty for an identity shortcut), as found by
            :func:`initlab.diagnostics.linter.find_residual_blocks`.
        uncovered: names of parameterized layers the bound does not cover (noted).
        branch_sums: additions that sum parallel branches (``p(x) + q(x)``, no residual block;
            :func:`initlab.measure.residual.find_branch_sums`, ``LintResult.branch_sums``): the
            products assume every branch is a chain, which such a sum is not (``||p|| + ||q||``
            bounds it, ``||p|| * ||q||`` does not), so each one not declared as a block makes
            the bounds no guarantee. ``None``: not looked for (the assumption is noted).
        operations: the operations of the forward not known to be 1-Lipschitz (one text each,
            as :class:`~initlab.diagnostics._lipschitz_ops.OperationWatch` words them: GELU,
            upsampling, overlapping max pooling, ``torch.cat`` of two activations, ``10 * x``):
            any makes the bounds no guarantee. ``None``: not checked (the assumption that every
            parameter-free operation is 1-Lipschitz is noted).

    Returns:
        ``{"plain": prod ||W_j||, "residual": the residual bound, "layers": n, "guaranteed":
        no layer was left uncovered, every call count was known (not inferred), no convolution
        ran at several input sizes and no operation
        found that is not 1-Lipschitz, "uncovered": [...], "operations": [...] or None,
        "notes": [...]}``. ``plain`` bounds a chain; with skip connections only ``residual`` is
        an upper bound. ``guaranteed`` holds for the norms the rows give: :func:`layer_spectra`'s
        ``op_bound``, an exact SVD's for a Linear (to float64 rounding), an eval BatchNorm's
        diagonal, and for a convolution an upper bound, never the Lanczos Ritz value
        ``op_norm``, which lies below the norm (by up to 1e-5 relative where the top singular
        values cluster): the Ritz value raised by its residual where the iteration converged to
        its tolerance (``r <= 1e-10 theta``: below the norm only by that tolerance's order),
        else the symbol's bound, which holds whatever the spectrum; where neither is had (a
        padding mode other than zeros, unconverged), the note :data:`UNCERTIFIED` makes the
        bounds no guarantee.
    """
    spectra = list(spectra)
    norms, calls, notes, known = _norms_and_calls(spectra)
    if uncovered:
        notes.append(
            f"not covered (assumed 1-Lipschitz, so not a guarantee): {shown(uncovered, 6)}"
        )
    plain = math.prod(v ** calls[n] for n, v in norms.items()) if norms else math.nan
    blocks, strangers = _blocks(residual_blocks, norms)
    strangers = [n for n in strangers if n not in {r["layer"] for r in spectra} | set(uncovered)]
    if strangers:
        notes.append(
            f"residual blocks name layers without a spectra row: {shown(strangers, 6)} (assumed "
            "1-Lipschitz, so not a guarantee)"
        )
    residual, sure = _residual_bound(norms, calls, blocks, notes)
    summed = _branch_sums(branch_sums, blocks, notes)
    _operations(operations, notes)
    return {
        "plain": plain, "residual": residual, "layers": len(norms),
        "guaranteed": not uncovered and known and sure and not strangers and not summed
        and not operations,
        "uncovered": list(uncovered), "notes": notes,
        "operations": None if operations is None else list(operations),
    }  # fmt: skip


def _operations(operations: Sequence[str] | None, notes: list[str]) -> None:
    """Note the operations not known to be 1-Lipschitz, or the assumption where none were
    checked."""
    if operations is None:
        notes.append(
            "assumes every operation besides the layers is 1-Lipschitz (ReLU, tanh, average "
            "pooling, non-overlapping max pooling): the forward's operations were not checked"
        )
    elif operations:
        notes.append(
            f"operations not known to be 1-Lipschitz: {'; '.join(operations[:4])}"
            f"{f' and {len(operations) - 4} more' if len(operations) > 4 else ''}; a product of "
            "norms does not bound them: not a guarantee"
        )


def _blocks(
    residual_blocks: Sequence[Mapping[str, Any]], norms: Mapping[str, float]
) -> tuple[list[tuple[str, set[str], Any, frozenset[str]]], list[str]]:
    """``(blocks, names)``: each block as ``(name, members of known norm, block, every name on
    it)``, smallest first (a block nested in another one's branch has fewer names), and every
    layer name the blocks hold. Nesting is decided on every name, not only those of known norm
    (a block whose layers have no norm, such as an attention branch, is no subset of every
    block). A block with an empty branch is refused: ``x + F(x)`` needs F's layers."""
    blocks, names = [], []
    for b in residual_blocks:
        branch, shortcut = list(b.get("branch", ())), list(b.get("shortcut", ()))
        if not branch:
            raise ValueError(
                f"lipschitz_bounds: residual block {b.get('name', '?')!r} has an empty branch: "
                "a residual block x + F(x) needs the layers of F"
            )
        every = frozenset([*branch, *shortcut])
        blocks.append((b.get("name", "?"), {n for n in every if n in norms}, b, every))
        names += [n for n in every if n not in names]
    blocks.sort(key=lambda t: len(t[3]))
    return blocks, names


def _branch_sums(
    sums: Sequence[Mapping[str, Any]] | None,
    blocks: list[tuple[str, set[str], Any, frozenset[str]]],
    notes: list[str],
) -> bool:
    """Note the sums of parallel branches (those not declared as a block with the same layers)
    or, where none were looked for, the assumption; whether there was one."""
    if sums is None:
        notes.append(
            "assumes every branch is a chain: sums of parallel branches (p(x) + q(x), no "
            "residual block) were not looked for, and a product of norms does not bound them"
        )
        return False
    declared = {b[3] for b in blocks}
    found = [
        f"{s.get('name', '?')} ({' + '.join(s.get('shortcut', ()))} + "
        f"{' + '.join(s.get('branch', ()))})"
        for s in sums
        if frozenset([*s.get("branch", ()), *s.get("shortcut", ())]) not in declared
    ]
    if found:
        notes.append(
            f"sums of parallel branches, not residual blocks: {shown(found, 3)}; a product of "
            "norms does not bound p(x) + q(x) (||p|| + ||q|| does): not a guarantee"
        )
    else:  # the trace sees sums whose operands meet within SHORTCUT_STEPS calls, not every sum
        notes.append(
            "assumes every branch is a chain: the trace found no sum of parallel branches "
            "(p(x) + q(x)) outside the residual blocks"
        )
    return bool(found)


def _norms_and_calls(
    spectra: Iterable[Mapping[str, Any]],
) -> tuple[dict[str, float], dict[str, int], list[str], bool]:
    """``(norms, calls, notes, known)``: the finite operator norm of each layer that runs (its
    first row's ``op_bound`` where it has one, else its ``op_norm``) and how often it runs per
    forward (1 where not known), notes on layers that run never or several times, and whether
    every call count was known (none inferred), every norm holds at each call (no layer ran at
    several input sizes: :data:`SEVERAL_SHAPES`) and is bounded (:data:`UNCERTIFIED`)."""
    norms: dict[str, float] = {}
    calls: dict[str, int] = {}
    never, unknown, inferred, shapes, estimated = [], [], [], [], []
    for r in spectra:
        layer, k = r["layer"], r.get("calls")
        if not math.isfinite(r["op_norm"]) or layer in norms or layer in never:
            continue
        if k is not None and int(k) == 0:
            never.append(layer)
            continue
        bound = r.get("op_bound")
        upper = bound if isinstance(bound, (int, float)) and math.isfinite(bound) else None
        norms[layer] = float(r["op_norm"] if upper is None else upper)
        calls[layer] = 1 if k is None else int(k)
        if k is None:
            unknown.append(layer)
        elif INFERRED_CALLS in str(r.get("note") or ""):
            inferred.append(layer)
        if SEVERAL_SHAPES in str(r.get("note") or ""):
            shapes.append(layer)
        if UNCERTIFIED in str(r.get("note") or ""):
            estimated.append(layer)
    notes = []
    if never:
        notes.append(f"not run in the forward, so not in the bounds: {shown(never, 6)}")
    repeated = [f"{n} ({k} calls)" for n, k in calls.items() if k > 1]
    if repeated:
        notes.append(f"run several times per forward, the norm counted once per call: "
                     f"{shown(repeated, 6)}")  # fmt: skip
    if unknown:
        notes.append(
            "how often each layer runs per forward is not known (no forward was watched): each "
            "is counted once, which is no bound where a layer runs several times (shared or "
            "looped) or never; not a guarantee"
        )
    if inferred:
        notes.append(
            f"applied by their parent's forward, not called themselves: {shown(inferred, 6)}; "
            "each is taken to run once per call of the parent, a guess (the parent may apply "
            "the weight several times): not a guarantee"
        )
    if shapes:
        notes.append(
            f"called at several input sizes: {shown(shapes, 6)}; a convolution's operator norm "
            "depends on the input size, and the norm taken holds at the first size only: not a "
            "guarantee"
        )
    if estimated:
        notes.append(
            f"operator norms estimated without a certified upper bound: {shown(estimated, 6)} (a "
            "Lanczos estimate that did not converge, of a convolution padded other than with "
            "zeros): it may lie below the norm, not a guarantee"
        )
    return norms, calls, notes, not (unknown or inferred or shapes or estimated)


def _residual_bound(
    norms: Mapping[str, float],
    calls: Mapping[str, int],
    blocks: list[tuple[str, set[str], Any, frozenset[str]]],
    notes: list[str],
) -> tuple[float, bool]:
    """``(residual bound, sure)`` (see the module docstring of :mod:`initlab.diagnostics.
    spectra`); each top-level block holding a layer takes one of its calls, the calls left over
    are outside the blocks. ``sure`` is False where a layer runs more often than the blocks that
    hold it (where the extra calls fall is unknown)."""

    def factor(idx: int) -> float:
        _, _, b, every = blocks[idx]
        inner = _maximal(
            [j for j in range(len(blocks)) if j != idx and blocks[j][3] < every], blocks
        )
        covered = set().union(*(blocks[j][1] for j in inner)) if inner else set()
        branch = [n for n in b.get("branch", ()) if n in norms and n not in covered]
        shortcut = [n for n in b.get("shortcut", ()) if n in norms and n not in covered]
        inner_factors = [factor(j) for j in inner]
        return math.prod(norms[n] for n in shortcut) + math.prod(
            [*(norms[n] for n in branch), *inner_factors]
        )

    top = _maximal(list(range(len(blocks))), blocks)
    uses = Counter(n for j in top for n in blocks[j][1])
    for j in top:
        overlap = sorted(n for n in blocks[j][1] if uses[n] > calls[n])
        if overlap:
            notes.append(
                f"residual block {blocks[j][0]} overlaps another block ({overlap}): "
                "residual bound not available"
            )
            return math.nan, False
    extra = sorted(n for n in uses if calls[n] > uses[n])
    if extra:
        notes.append(
            f"run more often than the residual blocks that hold them: {shown(extra, 6)}; the "
            "residual bound counts one call in each block and the rest outside, no bound if a "
            "block runs the layer more than once (not a guarantee)"
        )
    outside = [v ** (calls[n] - uses[n]) for n, v in norms.items()]
    residual = math.prod([*outside, *(factor(j) for j in top)]) if norms else math.nan
    return residual, not extra


def _maximal(
    indices: list[int], blocks: list[tuple[str, set[str], Any, frozenset[str]]]
) -> list[int]:
    """Blocks among ``indices`` not strictly contained in another one among them (by names)."""
    return [i for i in indices if not any(blocks[i][3] < blocks[j][3] for j in indices if j != i)]
