r"""Block values of the Hessian (or GGN) by Hutchinson-type probes, and its top eigenpairs.

:func:`block_curvature` estimates the average squared singular value ``‖H_lk‖_F² / N_lk`` of
every block with its standard error (definitions, ``N_lk``, estimator and cost in
:mod:`initlab.measure.curvature`) and returns a :class:`BlockCurvature` (columns
:data:`BLOCK_COLUMNS`); :func:`_estimate` runs the probes on a
:class:`~initlab.measure.curvature.operators.CurvatureOperator`. :func:`hessian_eigenpairs` gives
the top eigenpairs (Lanczos).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from initlab._core.attention import with_math_attention
from initlab._core.backward import with_grad
from initlab._core.compiled import takes_compiled
from initlab._core.data import data_use, take_batches
from initlab._core.knobs import renamed_kwargs, user_stacklevel
from initlab._core.rng import as_generator, draw_device
from initlab._core.rows import Rows, shown
from initlab._core.state import keeps_config
from initlab._core.underflow import FLOAT16_ADVICE
from initlab.measure.curvature.functional import Forward, LossFn, tie_note
from initlab.measure.curvature.operators import _GROUPS, _KINDS, CurvatureOperator, Kind
from initlab.measure.curvature.products import Mode, _check_mode

__all__ = ["BLOCK_COLUMNS", "BlockCurvature", "block_curvature", "hessian_eigenpairs"]

ProbeKind = Literal["rademacher", "gaussian"]
Normalize = Literal["min", "row", "col", "geometric", "none"]

_PROBES = ("rademacher", "gaussian")
_NORMALIZE = ("min", "row", "col", "geometric", "none")
_NAN = float("nan")

BLOCK_COLUMNS: tuple[str, ...] = (
    "block_row",
    "block_col",
    "value",
    "stderr",
    "probes",
    "n_row",
    "n_col",
    "row_index",
    "col_index",
    "kind",
    "nonfinite",
    "note",
)
"""Columns of :func:`block_curvature`: ``block_row``/``block_col`` block names (parameter or
module names), ``value`` = ``‖H_lk‖_F² / N_lk`` (see the module docstring for ``N_lk``),
``stderr`` its standard error over probes, ``probes`` the number of probes, ``n_row``/``n_col``
the block sizes, ``row_index``/``col_index`` positions in the block order, ``kind``
(``"hessian"``/``"ggn"``), ``nonfinite`` probes whose product held NaN/inf, ``note``."""


def _draw(
    n: int, probe: str, gen: torch.Generator | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A probe with ``E[r rᵀ] = I``, drawn on the CPU (same values on every device)."""
    if probe == "rademacher":
        r = torch.randint(0, 2, (n,), generator=gen, dtype=torch.float64, device=draw_device(gen))
        r = r.mul_(2).sub_(1)
    else:
        r = torch.randn(n, generator=gen, dtype=torch.float64, device=draw_device(gen))
    return r.to(dtype=dtype, device=device)


def _norm(n_row: int, n_col: int, normalize: str) -> float:
    if normalize == "min":
        return float(min(n_row, n_col))
    if normalize == "row":
        return float(n_row)
    if normalize == "col":
        return float(n_col)
    if normalize == "geometric":
        return math.sqrt(n_row * n_col)
    return 1.0


class BlockCurvature(Rows):
    """Rows of :func:`block_curvature` (columns :data:`BLOCK_COLUMNS`) plus the block order.

    Attributes:
        blocks: block names in order (``row_index``/``col_index`` index this list).
        sizes: block sizes.
        kind: ``"hessian"`` or ``"ggn"``.
        notes: global notes (unused parameters, ``rel_tol`` not reached, non-finite products).
        samples: ``(probes, L, L)`` float64 tensor of the per-probe values
            ``‖H_lk r_k‖² / N_lk`` (every block, also with ``full_matrix=False``); ``value`` is
            their mean over probes.
    """

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        blocks: Sequence[str],
        sizes: Sequence[int],
        kind: str,
        notes: Sequence[str],
        samples: torch.Tensor | None = None,
    ) -> None:
        super().__init__(rows, BLOCK_COLUMNS, title=f"block curvature ({kind})")
        self.blocks = list(blocks)
        self.sizes = list(sizes)
        self.kind = kind
        self.notes = list(notes)
        n = len(self.blocks)
        self.samples = (
            samples
            if samples is not None
            else torch.empty(0, n, n, dtype=torch.float64, device="cpu")
        )

    def matrix(self, column: str = "value") -> torch.Tensor:
        """``L × L`` float64 tensor of ``column`` (NaN where no row: off-diagonal blocks when
        ``full_matrix=False``). ``matrix().sqrt()`` is the average singular value of Figure 1."""
        out = torch.full(
            (len(self.blocks), len(self.blocks)), _NAN, dtype=torch.float64, device="cpu"
        )
        for r in self._rows:
            out[r["row_index"], r["col_index"]] = float(r[column])
        return out


@takes_compiled
@with_grad
@renamed_kwargs(batch="data", mode="ad_mode")
@with_math_attention
@keeps_config
def block_curvature(
    model: nn.Module,
    data: Any,
    loss_fn: LossFn = None,
    *,
    kind: Kind = "hessian",
    params: Sequence[str] | Mapping[str, Sequence[str]] | None = None,
    group: Literal["tensor", "module"] = "tensor",
    probes: int = 16,
    rel_tol: float | None = None,
    max_probes: int | None = None,
    generator: torch.Generator | int | None = None,
    full_matrix: bool = False,
    probe: ProbeKind = "rademacher",
    normalize: Normalize = "min",
    ad_mode: Mode = "rev_rev",
    forward: Forward | None = None,
) -> BlockCurvature:
    r"""Average squared singular value of every block of the Hessian (or GGN), with its stderr.

    ``value(l, k) = ‖H_lk‖_F² / N_lk``, estimated as the mean over probes ``r`` supported on
    block ``k`` of ``‖H_lk r‖² / N_lk`` (module docstring: definitions, ``N_lk``, cost). Each probe
    costs one product per block and gives a sample of every block, so the full ``L × L`` map
    (``full_matrix=True``) costs the same products as the diagonal.

    Args:
        model: any ``nn.Module`` (not mutated; train/eval modes as they are).
        data: one batch, or many (:mod:`initlab._core.data`): the first batch is used (the
            curvature of that batch's loss; formerly ``batch=``).
        loss_fn: the loss, in any form :func:`~initlab._core.loss.resolve_loss` accepts:
            ``loss_fn(model, batch)``, a criterion (``nn.CrossEntropyLoss()``,
            ``F.cross_entropy``), the model's own loss, a name (``"cross_entropy"``, ``"mse"``,
            ``"random_quadratic"``, ...) or ``initlab.outputs_loss(fn)``. ``None``: the
            resolver's default (the model's own loss, else cross-entropy/MSE from the targets).
        kind: ``"hessian"`` or ``"ggn"`` (generalized Gauss–Newton ``Jᵀ H_out J``; needs a loss
            on the outputs: a criterion, a named loss or ``initlab.outputs_loss(fn)``).
        params: ``None`` (all trainable parameters), parameter names, or block name → names.
            A tied tensor may be named by any of its names; it is one tensor, in one block, under
            its first name in ``named_parameters()``, and its rows say so in ``note``.
        group: ``"tensor"`` (one block per parameter tensor) or ``"module"`` (weight + bias of a
            module in one block), used when ``params`` is ``None`` or a sequence.
        probes: number of probes (the minimum when ``rel_tol`` is given); at least 2 for a stderr.
        rel_tol: keep adding probes until ``stderr <= rel_tol * |value|`` for every reported
            block with a finite nonzero value, up to ``max_probes``.
        max_probes: cap on probes with ``rel_tol`` (default ``max(probes, 256)``).
        generator: ``torch.Generator``, int seed, or ``None`` (torch's global RNG).
        full_matrix: report all ``L × L`` blocks (default: only the diagonal blocks ``H_ll``).
        probe: ``"rademacher"`` (default) or ``"gaussian"``.
        normalize: ``"min"`` (default), ``"row"``, ``"col"``, ``"geometric"`` or ``"none"``.
        ad_mode: ``"rev_rev"`` (default) or ``"fwd_rev"`` (formerly ``mode=``).
        forward: ``forward(model, batch) -> outputs`` for a loss on the outputs (default
            :func:`~initlab._core.data.default_forward`); one that passes the target
            ``batch[1]`` a criterion reads to the model raises
            (:func:`~initlab._core.forward_loss.target_kept`).

    Returns:
        :class:`BlockCurvature` rows (:data:`BLOCK_COLUMNS`), diagonal blocks in block order, or
        all blocks row-major with ``full_matrix``; ``.matrix()`` gives the heat map; ``.used``:
        one batch and its examples.

    Raises:
        DoubleBackwardError: a module without double backward (named in the message).
        ValueError: ``kind="ggn"`` with a loss that runs the model itself.
    """
    max_probes = check_options(
        kind=kind, group=group, probes=probes, rel_tol=rel_tol, max_probes=max_probes,
        probe=probe, normalize=normalize, ad_mode=ad_mode,
    )  # fmt: skip
    batch = take_batches(data, 1, exact=False, what="block_curvature")[0]
    op = CurvatureOperator(
        model,
        batch,
        loss_fn,
        kind=kind,
        params=params,
        group=group,
        ad_mode=ad_mode,
        forward=forward,
        _what="block_curvature",
    )
    rows = _estimate(
        op, probes, rel_tol, max_probes, as_generator(generator), full_matrix, probe, normalize
    )
    rows.used = data_use([batch])
    return rows


def check_options(
    *,
    kind: str = "hessian",
    group: str = "tensor",
    probes: int = 16,
    rel_tol: float | None = None,
    max_probes: int | None = None,
    probe: str = "rademacher",
    normalize: str = "min",
    ad_mode: str = "rev_rev",
) -> int:
    """The checks of :func:`block_curvature`'s options that need neither the model nor data (run
    at its entry, and by :func:`initlab.diagnose` on its ``curvature_options`` before its pass);
    returns ``max_probes`` (``None``: ``max(probes, 256)`` with ``rel_tol``, else ``probes``).

    Raises:
        ValueError: an unknown ``kind``, ``group``, ``probe``, ``normalize`` or ``ad_mode``;
            ``probes`` not a positive int; ``rel_tol`` not a positive number or ``None``;
            ``max_probes < probes``.
    """
    if kind not in _KINDS:
        raise ValueError(f"unknown kind {kind!r}; valid kinds: {list(_KINDS)}")
    if group not in _GROUPS:
        raise ValueError(f"unknown group {group!r}; valid values: {list(_GROUPS)}")
    _check_mode(ad_mode)
    if probe not in _PROBES:
        raise ValueError(f"unknown probe {probe!r}; valid probes: {list(_PROBES)}")
    if normalize not in _NORMALIZE:
        raise ValueError(f"unknown normalize {normalize!r}; valid values: {list(_NORMALIZE)}")
    if isinstance(probes, bool) or not isinstance(probes, int) or probes < 1:
        raise ValueError(f"probes must be a positive int, got {probes!r}")
    if rel_tol is not None and not (isinstance(rel_tol, (int, float)) and rel_tol > 0):
        raise ValueError(f"rel_tol must be a positive number or None, got {rel_tol!r}")
    if max_probes is None:
        max_probes = max(probes, 256) if rel_tol is not None else probes
    if max_probes < probes:
        raise ValueError(f"max_probes ({max_probes}) must be >= probes ({probes})")
    return max_probes


def _estimate(
    op: CurvatureOperator,
    probes: int,
    rel_tol: float | None,
    max_probes: int,
    gen: torch.Generator | None,
    full_matrix: bool,
    probe: str,
    normalize: str,
) -> BlockCurvature:
    """Draw probes until ``probes`` (or, with ``rel_tol``, convergence or ``max_probes``)."""
    blocks = op.blocks
    n_blocks = len(blocks)
    used_param = dict(zip(op.param_names, op.used, strict=True))
    block_used = [any(used_param[n] for n in b.params) for b in blocks]
    norms = torch.tensor(
        [[_norm(bl.size, bk.size, normalize) for bk in blocks] for bl in blocks],
        dtype=torch.float64,
        device="cpu",
    )
    samples: list[torch.Tensor] = []  # each L x L (row l, col k) for one probe
    index = {n: i for i, n in enumerate(op.param_names)}
    zeros = [torch.zeros_like(p) for p in op._values]
    report = (
        [(l_, k) for l_ in range(n_blocks) for k in range(n_blocks)]
        if full_matrix
        else [(l_, l_) for l_ in range(n_blocks)]
    )
    done = 0
    while done < max_probes:
        samples.append(_probe_sample(op, block_used, index, zeros, probe, gen) / norms)
        done += 1
        if done < probes:
            continue
        if rel_tol is None or done >= max_probes:
            break
        if _converged(torch.stack(samples), done, report, rel_tol):
            break
    stack = torch.stack(samples)
    nonfinite = (~torch.isfinite(stack)).sum(0)
    mean = stack.mean(0)
    se = stack.std(0, unbiased=True) / math.sqrt(done) if done > 1 else torch.full_like(mean, _NAN)
    notes: list[str] = []
    unused = [n for n in op.param_names if not used_param[n]]
    if unused:
        notes.append(
            f"the loss does not depend on {unused}: their rows and columns of the "
            f"{op.kind} are exactly zero"
        )
    notes += [tie_note(n, aliases) for n, aliases in op.tied.items()]
    rows, unconverged = _block_rows(op, report, block_used, mean, se, nonfinite, done, rel_tol)
    if unconverged:
        notes.append(
            f"rel_tol={rel_tol} not reached for {unconverged} blocks after {done} probes "
            f"(max_probes)"
        )
    if int(nonfinite.sum()):
        notes.append(
            f"some products held NaN/inf (see the nonfinite column): {op.nonfinite_cause()}"
        )
    if op._float16:
        _note_underflow(op, rows, report, block_used, probe, notes)
    names, sizes = [b.name for b in blocks], [b.size for b in blocks]
    return BlockCurvature(rows, names, sizes, op.kind, notes, samples=stack)


def _probe_sample(
    op: CurvatureOperator,
    block_used: Sequence[bool],
    index: Mapping[str, int],
    zeros: Sequence[torch.Tensor],
    probe: str,
    gen: torch.Generator | None,
) -> torch.Tensor:
    """One probe per block ``k``: ``‖H_lk r_k‖²`` for every ``(l, k)`` (``L × L``, float64).

    ``index``: position of each parameter name; ``zeros``: one zero tensor per parameter.
    Columns of blocks the loss does not depend on are exactly zero and get no product.
    """
    blocks = op.blocks
    n_blocks = len(blocks)
    sample = torch.zeros(n_blocks, n_blocks, dtype=torch.float64, device="cpu")
    for k, bk in enumerate(blocks):
        if not block_used[k]:
            continue  # the column is exactly zero
        r = _draw(bk.size, probe, gen, op.dtype, op.device)
        v = list(zeros)
        start = 0
        for name, shape in zip(bk.params, bk.shapes, strict=True):
            n, i = math.prod(shape), index[name]
            v[i] = r[start : start + n].view(shape).to(dtype=zeros[i].dtype)  # its own dtype
            start += n
        hv = op.product(v, [index[name] for name in bk.params])
        for l_, bl in enumerate(blocks):
            sq = sum(
                float(torch.linalg.vector_norm(hv[index[n]], dtype=torch.float64)) ** 2
                for n in bl.params
            )
            sample[l_, k] = sq
    return sample


_SCALES = (2.0**8, 2.0**4)
"""The loss scales of :func:`_underflow_gaps` (the second where the first overflows)."""
UNDERFLOW_GAP = 0.05
"""A block whose loss-scaled product differs from this one's by more (relatively) is flagged."""
FLOAT16_UNDERFLOW = "float16 underflow"
"""How a block's note starts where its float16 products change with the loss's scale."""
FLOAT16_ZERO = "0 in float16"
"""How a block's note starts where it is 0 in float16 at every loss scale tried."""
_LOST = (
    "gradients below float16's smallest subnormal (5.96e-8) were rounded to 0 (and those below "
    "6.1e-5 lost bits), so the value is not the float32 one"
)


def _underflow_gaps(
    op: CurvatureOperator,
    report: Sequence[tuple[int, int]],
    block_used: Sequence[bool],
    probe: str,
) -> tuple[dict[tuple[int, int], tuple[float, float]], float]:
    r"""``({(l, k): (gap, S)}, S)`` for the reported blocks of a float16 model whose products
    passed float16's small end: ``gap = |s_S / S² - s| / max(s_S / S², s)`` above
    :data:`UNDERFLOW_GAP`, with ``s = ‖H_lk r‖²`` of one probe and ``s_S`` the same with the loss
    scaled by ``S = 2^8`` (:meth:`CurvatureOperator._loss_scaled`; ``2^4`` where that overflows).

    Why this test: every backward value (the gradient at each layer, and each value of a Hessian
    product's second backward) is linear in the loss's gradient seed, and multiplying by a power
    of two is exact in binary floating point and commutes with every rounding, except at the ends
    of the range. So ``s_S = S² s`` bit for bit unless a value left float16's range: a gradient
    below its smallest subnormal ``2^-24`` rounds to 0 unscaled and not scaled (or keeps fewer
    bits), which is what float16 underflow is, and what a float32 copy (or training with loss
    scaling) does not have. Exact zeros of the model itself (unused rows, dead units, masks) stay
    zero at every scale and raise no gap. The tolerance, 5%, is far above float16's rounding of a
    sum of products (the reductions run in float32; on CPU healthy blocks agree exactly), and
    smaller underflow effects are within a block estimate's usual standard error. Cost, for
    float16 models only: one more forward and backward (the twin's graph, held while it runs) and
    two products per block. A GGN's ``J v`` does not depend on the loss, so only its
    ``Jᵀ H_out J v`` part is checked."""
    index = {n: i for i, n in enumerate(op.param_names)}
    zeros = [torch.zeros_like(p) for p in op._values]
    plain = _probe_sample(op, block_used, index, zeros, probe, torch.Generator().manual_seed(0))
    finite = [lk for lk in report if math.isfinite(float(plain[lk]))]
    for scale in _SCALES:
        gen = torch.Generator().manual_seed(0)  # the same probe; the twin's graph freed after
        scaled = _probe_sample(op._loss_scaled(scale), block_used, index, zeros, probe, gen)
        scaled /= scale**2
        if all(math.isfinite(float(scaled[lk])) for lk in finite):
            break
    gaps = {}
    for lk in finite:
        a, b = float(plain[lk]), float(scaled[lk])
        top = max(a, b)
        if math.isfinite(b) and top > 0 and abs(b - a) > UNDERFLOW_GAP * top:
            gaps[lk] = (abs(b - a) / top, scale)
    return gaps, scale


def _note_underflow(
    op: CurvatureOperator,
    rows: list[dict[str, Any]],
    report: Sequence[tuple[int, int]],
    block_used: Sequence[bool],
    probe: str,
    notes: list[str],
) -> None:
    """Flag the blocks of a float16 model whose products underflowed (:func:`_underflow_gaps`),
    and the blocks the loss depends on whose value is exactly 0 there (every product entry
    below float16's smallest subnormal at both scales, or a true 0: undecided): a note on
    their rows and in ``notes``, and a warning."""
    gaps, scale = _underflow_gaps(op, report, block_used, probe)
    flagged = []
    for r in rows:
        lk = (r["row_index"], r["col_index"])
        if lk in gaps:
            here = (
                f"{FLOAT16_UNDERFLOW}: with the loss scaled by {gaps[lk][1]:g} (loss scaling) the "
                f"products are {gaps[lk][0]:.0%} off {gaps[lk][1]:g}x these: {_LOST}; "
                + FLOAT16_ADVICE
            )
        elif r["value"] == 0.0 and block_used[lk[0]] and block_used[lk[1]]:
            here = (
                f"{FLOAT16_ZERO}, also with the loss scaled by {scale:g}: every product entry may "
                f"be below float16's smallest subnormal (5.96e-8), or the block 0; {FLOAT16_ADVICE}"
            )
        else:
            continue
        r["note"] = "; ".join(x for x in (r["note"], here) if x)
        flagged.append(r["block_row"] + ("" if lk[0] == lk[1] else f" x {r['block_col']}"))
    if not flagged:
        return
    message = (
        f"{len(flagged)} block(s) of this float16 model ({shown(flagged, 4)}) may be off by "
        f"float16 underflow (their products change with the loss's scale, or are 0): {_LOST}; "
        f"{FLOAT16_ADVICE} (the batch's floating-point tensors in float32)"
    )
    notes.append(message)
    warnings.warn(f"block_curvature: {message}", UserWarning, stacklevel=user_stacklevel())


def _converged(
    stack: torch.Tensor, done: int, report: Sequence[tuple[int, int]], rel_tol: float
) -> bool:
    """Every reported block with a finite nonzero mean has ``stderr <= rel_tol * |mean|``."""
    mean, se = stack.mean(0), stack.std(0, unbiased=True) / math.sqrt(done)
    return all(
        not (math.isfinite(float(mean[l_, k])) and float(mean[l_, k]) != 0.0)
        or float(se[l_, k]) <= rel_tol * abs(float(mean[l_, k]))
        for l_, k in report
    )


def _block_rows(
    op: CurvatureOperator,
    report: Sequence[tuple[int, int]],
    block_used: Sequence[bool],
    mean: torch.Tensor,
    se: torch.Tensor,
    nonfinite: torch.Tensor,
    done: int,
    rel_tol: float | None,
) -> tuple[list[dict[str, Any]], int]:
    """The :data:`BLOCK_COLUMNS` rows of the reported blocks, and how many missed ``rel_tol``."""
    blocks = op.blocks
    rows = []
    unconverged = 0
    for l_, k in report:
        bl, bk = blocks[l_], blocks[k]
        note = [
            tie_note(n, op.tied[n]) for n in dict.fromkeys((*bl.params, *bk.params)) if n in op.tied
        ]
        if not block_used[l_] or not block_used[k]:
            pairs = ((bl, block_used[l_]), (bk, block_used[k]))
            names = sorted({b.name for b, u in pairs if not u})
            note.append(f"loss does not depend on block(s) {names}: exactly zero")
        value = float(mean[l_, k])
        stderr = float(se[l_, k])
        bad = int(nonfinite[l_, k])
        if bad:
            value, stderr = _NAN, _NAN
            note.append(f"non-finite products in {bad} of {done} probes")
        elif rel_tol is not None and value != 0.0 and not stderr <= rel_tol * abs(value):
            unconverged += 1
        rows.append(
            {
                "block_row": bl.name,
                "block_col": bk.name,
                "value": value,
                "stderr": stderr,
                "probes": done,
                "n_row": bl.size,
                "n_col": bk.size,
                "row_index": l_,
                "col_index": k,
                "kind": op.kind,
                "nonfinite": bad,
                "note": "; ".join(note),
            }
        )
    return rows, unconverged


@with_grad
@renamed_kwargs(batch="data", mode="ad_mode")
@with_math_attention
def hessian_eigenpairs(
    model: nn.Module,
    data: Any,
    loss_fn: LossFn = None,
    k: int = 2,
    *,
    kind: Kind = "hessian",
    params: Sequence[str] | Mapping[str, Sequence[str]] | None = None,
    which: Literal["LM", "LA"] = "LM",
    iters: int | None = None,
    tol: float = 1e-6,
    generator: torch.Generator | int | None = None,
    ad_mode: Mode = "rev_rev",
    forward: Forward | None = None,
) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """Top-``k`` eigenpairs of the Hessian (or GGN) of a model's batch loss.

    :meth:`CurvatureOperator.eigenpairs` on ``CurvatureOperator(model, batch, loss_fn, ...)``
    with the first batch of ``data``; arguments (``data``, ``loss_fn``, ``ad_mode``) as in
    :func:`block_curvature`.
    """
    batch = take_batches(data, 1, exact=False, what="hessian_eigenpairs")[0]
    op = CurvatureOperator(
        model,
        batch,
        loss_fn,
        kind=kind,
        params=params,
        ad_mode=ad_mode,
        forward=forward,
        _what="hessian_eigenpairs",
    )
    return op.eigenpairs(k, which=which, iters=iters, tol=tol, generator=generator)
