"""Bootstrap confidence intervals for Table 2 and for paired comparisons of schemes.

The numbers of Table 2 (Defazio & Bottou, Section 8; :mod:`initlab.study.aggregate`) come from
a few data sets and a few seeds each, and from a best learning rate picked on those same seeds. How
much they would move with other seeds, or other data sets of the same kind, is estimated by a
**two-level (cluster) bootstrap**: one replicate

1. draws ``D`` data sets with replacement from the ``D`` data sets (the outer level: data sets are
   the units the conclusion should generalize over);
2. for each draw, independently, draws that data set's ``N`` seeds with replacement (the inner
   level: the seed noise). A seed carries all its runs along (every scheme and learning rate):
   the same seed index means the same data order, so schemes stay paired;
3. recomputes the whole statistic from the drawn runs: per scheme and learning rate the median
   over the drawn seeds, the best learning rate (so the selection's own noise is in the interval),
   the normalization by the worst scheme, the average over the drawn data sets, the worst/best
   counts.

The interval is the percentile interval of ``n_boot`` replicates (``level=0.95``: the 2.5 % and
97.5 % quantiles, linear interpolation). Replicates are drawn by ``numpy.random.default_rng(seed)``
in a fixed order (outer draws, then each data set's inner draws in data set order), so the same
inputs and seed give the same intervals.

**Paired comparison** of a scheme ``s`` against a reference ``r`` (geometric): on each data set, at
each scheme's best learning rate, pair the two runs of the same seed; per pair

- ``r`` wins when its loss is lower (a tie counts one half; two diverged runs tie);
- the difference of normalized losses ``(L_s - L_r) / W``, ``W`` the worst scheme's median (Table
  2's normalizer): positive means the reference is better. Pairs where either run diverged, or
  where ``W`` is 0 or infinite, are left out of the mean difference (and counted).

The win rate and mean difference average over seeds within a data set, then over data sets (every
data set weighs the same, as in Table 2); their intervals come from the same two-level bootstrap,
and a per-data-set table uses the inner level only. A paired interval is ``nan`` where its
point estimate is (every pair left out) or where fewer than ``level`` of the replicates give a
finite value: percentiles of the finite ones alone would not have the level.

**Coverage is nominal only for studies of some size.** The percentile interval of a two-level
bootstrap is not exact; a synthetic check (two identical schemes, 200 simulated studies per
row, by a tester) covered the true win rate 0.5 / difference 0 in 88% / 78% of studies with 2
data sets × 2 seeds, 96% / 92% with 3 × 3, 99% / 100% with 6 × 5 and 100% / 100% with 12 × 10:
too narrow for tiny studies, conservative for larger ones. Read a tiny study's intervals as rough.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from initlab._core.rows import Rows
from initlab.study.config import LOSS_MEASURES

__all__ = [
    "PAIRED_COLUMNS",
    "TABLE2_CI_COLUMNS",
    "LossCube",
    "check_bootstrap",
    "loss_cubes",
    "paired_comparisons",
    "percentile_interval",
    "table2_intervals",
]

TABLE2_CI_COLUMNS = (
    "scheme",
    "avg_normalized_loss",
    "avg_lo",
    "avg_hi",
    "rank",
    "p_first",
    "worst_in",
    "worst_lo",
    "worst_hi",
    "best_in",
    "best_lo",
    "best_hi",
    "n_datasets",
)
PAIRED_COLUMNS = (
    "dataset",
    "scheme",
    "reference",
    "ref_win_rate",
    "win_lo",
    "win_hi",
    "mean_diff",
    "diff_lo",
    "diff_hi",
    "n_pairs",
    "n_left_out",
)


@dataclass(frozen=True)
class LossCube:
    """One data set's losses as an array ``loss[scheme, lr, seed]``.

    ``+inf`` marks a diverged run (or a non-finite loss), ``nan`` a run that is not there (a
    learning rate one scheme tried and another did not, after a grid extension; an unfinished
    study). ``lrs`` ascend, so the first of tied best rates is the smaller one, as in
    :func:`~initlab.study.aggregate.per_dataset_table`.
    """

    dataset: str
    schemes: tuple[str, ...]
    lrs: tuple[float, ...]
    seeds: tuple[int, ...]
    loss: np.ndarray


def _record_loss(record: Mapping[str, Any], column: str) -> float:
    value = record.get(column)
    if record.get("diverged") or value is None or not math.isfinite(float(value)):
        return math.inf
    return float(value)


def loss_cubes(records: Iterable[Mapping[str, Any]], loss: str = "full_pass") -> list[LossCube]:
    """One :class:`LossCube` per data set on which every scheme of ``records`` has runs and some
    scheme has a finite median loss at some rate (a data set where all diverged everywhere is left
    out, as in :func:`~initlab.study.aggregate.per_dataset_table`).

    Args:
        records: runs with ``dataset, scheme, lr, seed, diverged`` and the loss column.
        loss: a key of :data:`~initlab.study.config.LOSS_MEASURES`.

    Returns:
        cubes sorted by data set, all with the same schemes (sorted).
    """
    if loss not in LOSS_MEASURES:
        raise ValueError(f"loss must be one of {tuple(LOSS_MEASURES)}, got {loss!r}")
    column = LOSS_MEASURES[loss]
    cells: dict[str, dict[tuple[str, float, int], float]] = {}
    for r in records:
        if column not in r:
            raise ValueError(f"a run's record has no {column!r} (loss={loss!r}): use Store.records")
        cell = cells.setdefault(r["dataset"], {})
        cell[r["scheme"], float(r["lr"]), int(r["seed"])] = _record_loss(r, column)
    schemes = tuple(sorted({s for cell in cells.values() for s, _, _ in cell}))
    cubes = []
    for dataset in sorted(cells):
        cell = cells[dataset]
        if {s for s, _, _ in cell} != set(schemes):
            continue
        lrs = tuple(sorted({lr for _, lr, _ in cell}))
        seeds = tuple(sorted({seed for _, _, seed in cell}))
        cube = np.full((len(schemes), len(lrs), len(seeds)), np.nan)
        si = {s: i for i, s in enumerate(schemes)}
        li = {lr: i for i, lr in enumerate(lrs)}
        ni = {seed: i for i, seed in enumerate(seeds)}
        for (s, lr, seed), value in cell.items():
            cube[si[s], li[lr], ni[seed]] = value
        medians = _median_last(cube)
        if np.all(np.isnan(medians) | np.isinf(medians)):
            continue  # every scheme diverged at every rate: no comparison (as per_dataset_table)
        cubes.append(LossCube(dataset, schemes, lrs, seeds, cube))
    return cubes


def percentile_interval(samples: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """The percentile interval ``(q_{(1-level)/2}, q_{(1+level)/2})`` of the finite samples
    (linear interpolation); ``(nan, nan)`` when none is finite."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    x = np.asarray(samples, dtype=np.float64)
    x = x[np.isfinite(x)]
    if not x.size:
        return math.nan, math.nan
    lo, hi = np.quantile(x, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def _ci(
    prefix: str, samples: np.ndarray, level: float, point: float | None = None
) -> dict[str, float]:
    """The percentile interval of ``samples``. With the ``point`` estimate (the paired
    statistics): ``nan`` where it is not finite, or where more than ``1 - level`` of the
    replicates are not (an interval of the replicates that happen to be finite would not have
    its level: a quarter of them once gave a "95%" interval around an undefined difference)."""
    finite = np.isfinite(np.asarray(samples, dtype=np.float64))
    if point is not None and (not math.isfinite(point) or (finite.size and finite.mean() < level)):
        return {f"{prefix}_lo": math.nan, f"{prefix}_hi": math.nan}
    lo, hi = percentile_interval(samples, level)
    return {f"{prefix}_lo": lo, f"{prefix}_hi": hi}


def _median_last(x: np.ndarray) -> np.ndarray:
    """Median over the last axis ignoring ``nan`` (``+inf`` counts), exactly as
    :func:`initlab.study._stats.quantile` at 0.5; ``nan`` where nothing is left."""
    xs = np.sort(x, axis=-1)  # nan sorts last, after inf
    n = (~np.isnan(xs)).sum(axis=-1, keepdims=True)
    a = np.take_along_axis(xs, np.maximum((n - 1) // 2, 0), axis=-1)
    b = np.take_along_axis(xs, n // 2, axis=-1)  # n = 0 gives index 0: masked below
    with np.errstate(invalid="ignore"):
        mid = np.where(a == b, a, a + (b - a) * 0.5)
    mid = np.where(n > 0, mid, np.nan)
    return mid[..., 0]


def _nanmean(x: np.ndarray, axis: int) -> np.ndarray:
    """Mean over ``axis`` of the non-``nan`` entries; ``nan`` where there are none (no warning)."""
    ok = ~np.isnan(x)
    total = np.where(ok, x, 0.0).sum(axis=axis)
    count = ok.sum(axis=axis)
    return np.divide(total, count, out=np.full(total.shape, np.nan), where=count > 0)


def _normalize(loss: np.ndarray, worst: np.ndarray) -> np.ndarray:
    """Table 2's normalization ``loss / worst`` with its degenerate cases (``worst = inf``: finite
    → 0, infinite → 1; ``worst = 0``: 1)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = loss / worst
    out = np.where(np.isinf(worst), np.where(np.isinf(loss), 1.0, 0.0), ratio)
    return np.where(worst == 0.0, 1.0, out)


def _selection(cube: LossCube, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For seed draws ``idx`` ``(M, N)``: each scheme's runs at its best learning rate
    ``(M, S, N)``, their median ``(M, S)`` and the best rate's index ``(M, S)`` (lowest median;
    ties → the smaller rate). A median with no run under it counts as ``+inf``."""
    drawn = np.moveaxis(cube.loss[:, :, idx], 2, 0)  # (M, S, K, N)
    med = _median_last(drawn)  # (M, S, K)
    med = np.where(np.isnan(med), np.inf, med)
    best = np.argmin(med, axis=2)
    at_best = np.take_along_axis(drawn, best[:, :, None, None], axis=2)[:, :, 0]
    return at_best, np.take_along_axis(med, best[:, :, None], axis=2)[:, :, 0], best


def _table2_stats(cube: LossCube, idx: np.ndarray) -> tuple[np.ndarray, ...]:
    """Normalized loss, worst flag and best flag ``(M, S)`` of one data set per seed draw."""
    _, med, _ = _selection(cube, idx)
    worst = med.max(axis=1, keepdims=True)
    low = med.min(axis=1, keepdims=True)
    return _normalize(med, worst), med == worst, med == low


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_bootstrap(*, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> None:
    """Refuse bootstrap options the intervals cannot use (``ValueError`` naming the argument):
    ``n_boot`` an integer >= 1, ``seed`` an integer >= 0 (what ``numpy.random.default_rng``
    takes: any non-negative integer), ``level`` in (0, 1)."""
    if not _is_int(n_boot) or n_boot < 1:
        raise ValueError(f"n_boot must be >= 1 (an integer), got {n_boot!r}")
    if not _is_int(seed) or seed < 0:
        raise ValueError(
            f"seed must be an integer >= 0 (it seeds numpy.random.default_rng, which takes no "
            f"negative seed), got {seed!r}"
        )
    if isinstance(level, bool) or not isinstance(level, numbers.Real) or not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), e.g. 0.95, got {level!r}")


def _two_level(
    cubes: Sequence[LossCube], n_boot: int, seed: int
) -> tuple[np.ndarray, list[np.ndarray]]:
    """The outer draws ``(n_boot, D)`` and, per data set, the inner seed draws of every slot
    where it was drawn (``(M_d, N_d)``, in row-major order of those slots)."""
    check_bootstrap(n_boot=n_boot, seed=seed)
    rng = np.random.default_rng(seed)
    d = len(cubes)
    outer = rng.integers(0, d, size=(n_boot, d))
    inner = []
    for i, cube in enumerate(cubes):
        m = int((outer == i).sum())
        n = len(cube.seeds)
        inner.append(rng.integers(0, n, size=(m, n)))
    return outer, inner


def _scatter(outer: np.ndarray, per_cube: Sequence[np.ndarray]) -> np.ndarray:
    """Place each data set's per-draw values ``(M_d, ...)`` at its slots of ``outer``."""
    shape = (*outer.shape, *per_cube[0].shape[1:])
    out = np.empty(shape, dtype=np.float64)
    for i, values in enumerate(per_cube):
        out[outer == i] = values
    return out


def _identity(cube: LossCube) -> np.ndarray:
    return np.arange(len(cube.seeds))[None, :]


def table2_intervals(
    cubes: Sequence[LossCube], *, n_boot: int = 2000, seed: int = 0, level: float = 0.95
) -> Rows:
    """Table 2 with two-level bootstrap intervals (module docstring).

    Args:
        cubes: :func:`loss_cubes` of one variant's runs.
        n_boot: bootstrap replicates.
        seed: seeds the replicates (``numpy.random.default_rng``).
        level: coverage of the intervals.

    Returns:
        :class:`~initlab.Rows` with :data:`TABLE2_CI_COLUMNS`, one row per scheme: the point
        estimates (as :func:`~initlab.study.aggregate.table2`), their intervals, ``rank`` (1 =
        lowest average normalized loss; ties share the better rank) and ``p_first``, the share of
        replicates in which the scheme has the lowest average (ties count for each).
    """
    if not cubes:
        return Rows([], TABLE2_CI_COLUMNS, title="Table 2 with intervals (no complete data set)")
    schemes = cubes[0].schemes
    point = [_table2_stats(c, _identity(c)) for c in cubes]
    avg = np.mean([p[0][0] for p in point], axis=0)
    worst = np.sum([p[1][0] for p in point], axis=0)
    best = np.sum([p[2][0] for p in point], axis=0)
    outer, inner = _two_level(cubes, n_boot, seed)
    stats = [_table2_stats(c, idx) for c, idx in zip(cubes, inner, strict=True)]
    b_avg = _scatter(outer, [s[0] for s in stats]).mean(axis=1)  # (n_boot, S)
    b_worst = _scatter(outer, [s[1] for s in stats]).sum(axis=1)
    b_best = _scatter(outer, [s[2] for s in stats]).sum(axis=1)
    p_first = (b_avg == b_avg.min(axis=1, keepdims=True)).mean(axis=0)
    rows = []
    for i, scheme in enumerate(schemes):
        rows.append(
            {
                "scheme": scheme,
                "avg_normalized_loss": float(avg[i]),
                **_ci("avg", b_avg[:, i], level),
                "rank": 1 + int((avg < avg[i]).sum()),
                "p_first": float(p_first[i]),
                "worst_in": int(worst[i]),
                **_ci("worst", b_worst[:, i], level),
                "best_in": int(best[i]),
                **_ci("best", b_best[:, i], level),
                "n_datasets": len(cubes),
            }
        )
    title = f"Table 2 with {level:.0%} two-level bootstrap intervals ({len(cubes)} data sets)"
    return Rows(rows, TABLE2_CI_COLUMNS, title=title)


def _paired_stats(cube: LossCube, idx: np.ndarray, ref: int) -> tuple[np.ndarray, ...]:
    """Per seed draw ``(M,)`` and scheme: the reference's win rate, the mean normalized
    difference (``nan`` where no pair counts), pairs counted and pairs left out."""
    at_best, med, _ = _selection(cube, idx)  # (M, S, N), (M, S)
    worst = med.max(axis=1)  # (M,)
    mine, theirs = at_best, at_best[:, ref : ref + 1]
    present = ~np.isnan(mine) & ~np.isnan(theirs)
    wins = np.where(present, (theirs < mine) + 0.5 * (theirs == mine), np.nan)
    usable = present & np.isfinite(mine) & np.isfinite(theirs)
    usable &= (np.isfinite(worst) & (worst > 0))[:, None, None]
    with np.errstate(invalid="ignore", divide="ignore"):
        diff = np.where(usable, (mine - theirs) / worst[:, None, None], np.nan)
    return _nanmean(wins, 2), _nanmean(diff, 2), present.sum(axis=2), (present & ~usable).sum(2)


def paired_comparisons(
    cubes: Sequence[LossCube],
    *,
    reference: str = "geometric",
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> Rows:
    """Every scheme against ``reference``, paired by data set and seed (module docstring).

    Returns:
        :class:`~initlab.Rows` with :data:`PAIRED_COLUMNS`: per scheme one row over all data sets
        (``dataset = "all"``, two-level intervals), then one per data set and scheme (intervals
        from the seeds only). ``ref_win_rate``: the share of pairs the reference wins;
        ``mean_diff``: mean of ``(L_scheme - L_reference) / W``, positive when the reference is
        better.
    """
    if not cubes:
        return Rows([], PAIRED_COLUMNS, title="paired comparisons (no complete data set)")
    schemes = cubes[0].schemes
    if reference not in schemes:
        raise ValueError(f"reference scheme {reference!r} is not in the study: {schemes}")
    ref = schemes.index(reference)
    point = [_paired_stats(c, _identity(c), ref) for c in cubes]
    outer, inner = _two_level(cubes, n_boot, seed)
    boot = [_paired_stats(c, idx, ref) for c, idx in zip(cubes, inner, strict=True)]
    b_win = _scatter(outer, [b[0] for b in boot]).mean(axis=1)
    b_diff = _nanmean(_scatter(outer, [b[1] for b in boot]), axis=1)
    win = np.mean([p[0][0] for p in point], axis=0)
    diff = _nanmean(np.stack([p[1][0] for p in point]), axis=0)
    rows = []
    for i, scheme in enumerate(schemes):
        if i == ref:
            continue
        n_pairs = sum(int(p[2][0, i]) for p in point)
        n_out = sum(int(p[3][0, i]) for p in point)
        rows.append(_paired_row("all", scheme, reference, win[i], b_win[:, i], diff[i],
                                b_diff[:, i], n_pairs, n_out, level))  # fmt: skip
    for cube, p, b in zip(cubes, point, boot, strict=True):
        # the per-data-set interval: this data set's inner draws alone (one draw per slot)
        for i, scheme in enumerate(schemes):
            if i != ref:
                rows.append(_paired_row(cube.dataset, scheme, reference, p[0][0, i], b[0][:, i],
                                        p[1][0, i], b[1][:, i], int(p[2][0, i]),
                                        int(p[3][0, i]), level))  # fmt: skip
    title = f"paired against {reference}: data set and seed pairs, {level:.0%} intervals"
    return Rows(rows, PAIRED_COLUMNS, title=title)


def _paired_row(
    dataset: str,
    scheme: str,
    reference: str,
    win: float,
    b_win: np.ndarray,
    diff: float,
    b_diff: np.ndarray,
    n_pairs: int,
    n_out: int,
    level: float,
) -> dict[str, Any]:
    return {
        "dataset": dataset,
        "scheme": scheme,
        "reference": reference,
        "ref_win_rate": float(win),
        **_ci("win", b_win, level, float(win)),
        "mean_diff": float(diff),
        **_ci("diff", b_diff, level, float(diff)),
        "n_pairs": n_pairs,
        "n_left_out": n_out,
    }
