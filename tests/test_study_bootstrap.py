"""Bootstrap intervals for Table 2 and paired comparisons (issue 12, item 2): coverage of known
distributions, the point estimates against the plain aggregation, hand-computed tables,
determinism."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest

from initlab.study.aggregate import per_dataset_table, sensitivity_table, table2
from initlab.study.bootstrap import (
    LossCube,
    loss_cubes,
    paired_comparisons,
    percentile_interval,
    table2_intervals,
)

# Coverage: 200 simulated studies; a 95 % interval covers in Binomial(200, 0.95) of them, whose
# standard deviation is sqrt(0.95 * 0.05 / 200) = 0.0154. The bounds are 3 of those below, and an
# upper bound that a method with far too wide intervals (coverage ~1) exceeds.
N_SIMS = 200
LOW, HIGH = 0.95 - 3 * 0.0154, 0.995


def _records(rng: np.random.Generator, n_datasets: int = 4) -> list[dict[str, Any]]:
    """Random runs: 3 schemes x 3 rates x 5 seeds per data set, some diverged, some exact ties."""
    out = []
    for d in range(n_datasets):
        for scheme in ("arithmetic", "fan_in", "geometric"):
            for lr in (0.1, 0.01, 0.001):
                for seed in range(5):
                    loss = float(np.round(rng.uniform(0.1, 1.0), 1))  # rounding makes ties
                    diverged = bool(rng.uniform() < 0.1)
                    out.append({"dataset": f"d{d}", "scheme": scheme, "lr": lr, "seed": seed,
                                "final_train_loss": math.nan if diverged else loss,
                                "diverged": diverged})  # fmt: skip
    return out


@pytest.mark.parametrize("seed", range(5))
def test_point_estimates_equal_the_aggregation(seed: int) -> None:
    records = _records(np.random.default_rng(seed))
    plain = {r["scheme"]: r for r in table2(per_dataset_table(records))}
    rows = table2_intervals(loss_cubes(records), n_boot=50, seed=seed)
    assert {r["scheme"] for r in rows} == set(plain)
    for r in rows:
        p = plain[r["scheme"]]
        assert r["avg_normalized_loss"] == pytest.approx(p["avg_normalized_loss"], abs=1e-12)
        assert (r["worst_in"], r["best_in"], r["n_datasets"]) == (
            p["worst_in"],
            p["best_in"],
            p["n_datasets"],
        )
        assert r["avg_lo"] <= r["avg_hi"] and 0 <= r["p_first"] <= 1
    ranks = sorted((r["avg_normalized_loss"], r["rank"]) for r in rows)
    assert ranks[0][1] == 1 and all(a[1] <= b[1] for a, b in itertools.pairwise(ranks))


def _cube(name: str, losses: dict[str, list[float]], lrs: tuple[float, ...] = (0.1,)) -> LossCube:
    schemes = tuple(sorted(losses))
    n = len(next(iter(losses.values())))
    array = np.array([losses[s] for s in schemes], dtype=float).reshape(len(schemes), len(lrs), n)
    return LossCube(name, schemes, lrs, tuple(range(n)), array)


def test_table2_interval_covers_at_the_nominal_rate() -> None:
    """25 data sets with medians mu_d ~ U(0.2, 0.6), 9 seeds of N(mu_d, 0.15) each; scheme b is
    constant 2 (always worst), so a's normalized loss is its median / 2 and the target of the
    average is E[mu] / 2 = 0.2. The two-level interval covers it in ~95 % of studies."""
    rng = np.random.default_rng(1)
    hits = 0
    for k in range(N_SIMS):
        cubes = []
        for d in range(25):
            mu = rng.uniform(0.2, 0.6)
            cubes.append(_cube(f"d{d}", {"a": mu + rng.normal(0, 0.15, 9), "b": [2.0] * 9}))
        row = next(r for r in table2_intervals(cubes, n_boot=300, seed=k) if r["scheme"] == "a")
        hits += row["avg_lo"] <= 0.2 <= row["avg_hi"]
    assert LOW <= hits / N_SIMS <= HIGH, hits / N_SIMS


def test_seed_level_interval_covers_the_median() -> None:
    """One data set (the outer level has nothing to resample): the interval comes from the seeds
    alone; 41 seeds of N(0.5, 0.2): a's normalized median covers 0.5 / 2 at ~95 %."""
    rng = np.random.default_rng(2)
    hits = 0
    for k in range(N_SIMS):
        cube = _cube("d", {"a": 0.5 + rng.normal(0, 0.2, 41), "b": [2.0] * 41})
        row = next(r for r in table2_intervals([cube], n_boot=300, seed=k) if r["scheme"] == "a")
        hits += row["avg_lo"] <= 0.25 <= row["avg_hi"]
    assert LOW - 0.03 <= hits / N_SIMS <= HIGH, hits / N_SIMS  # the median's bootstrap is coarse


def test_paired_difference_covers_at_the_nominal_rate() -> None:
    """s = mu_d + e, geometric = mu_d + delta_d + e' (delta_d ~ U(0, 0.2)), a worst scheme w
    fixed at 2: the mean normalized difference (s - geometric) / 2 has target -E[delta] / 2 =
    -0.05."""
    rng = np.random.default_rng(3)
    hits = 0
    for k in range(N_SIMS):
        cubes = []
        for d in range(20):
            mu, delta = rng.uniform(0.3, 0.6), rng.uniform(0.0, 0.2)
            s = mu + rng.normal(0, 0.05, 8)
            g = mu + delta + rng.normal(0, 0.05, 8)
            cubes.append(_cube(f"d{d}", {"s": s, "geometric": g, "w": [2.0] * 8}))
        rows = paired_comparisons(cubes, n_boot=300, seed=k).filter(dataset="all", scheme="s")
        hits += rows[0]["diff_lo"] <= -0.05 <= rows[0]["diff_hi"]
    assert LOW <= hits / N_SIMS <= HIGH, hits / N_SIMS


def test_paired_comparison_by_hand() -> None:
    """Two data sets, three seeds, one rate; worst scheme w: W = 2 on d0 and 4 on d1."""
    d0 = _cube("d0", {"geometric": [0.5, 0.6, 0.7], "s": [0.4, 0.6, 0.9], "w": [2.0] * 3})
    # d1: seed 2 of s diverged (+inf): it loses, and is left out of the difference
    d1 = _cube("d1", {"geometric": [1.0, 1.0, 1.0], "s": [1.2, 0.8, math.inf], "w": [4.0] * 3})
    rows = paired_comparisons([d0, d1], n_boot=100, seed=0)
    by = {(r["dataset"], r["scheme"]): r for r in rows}
    assert set(by) == {("all", "s"), ("all", "w"), ("d0", "s"), ("d0", "w"), ("d1", "s"),
                       ("d1", "w")}  # fmt: skip
    # d0: geometric wins seed 2 (0.7 < 0.9), ties seed 1, loses seed 0 → (0 + 0.5 + 1) / 3
    assert by["d0", "s"]["ref_win_rate"] == pytest.approx(0.5)
    assert by["d0", "s"]["mean_diff"] == pytest.approx(((-0.1) + 0.0 + 0.2) / 3 / 2)
    # d1: geometric wins seeds 0 and 2, loses seed 1; the diverged pair is left out
    assert by["d1", "s"]["ref_win_rate"] == pytest.approx(2 / 3)
    assert by["d1", "s"]["mean_diff"] == pytest.approx((0.2 - 0.2) / 2 / 4)
    assert (by["d1", "s"]["n_pairs"], by["d1", "s"]["n_left_out"]) == (3, 1)
    # over data sets: each weighs the same
    assert by["all", "s"]["ref_win_rate"] == pytest.approx((0.5 + 2 / 3) / 2)
    assert by["all", "s"]["mean_diff"] == pytest.approx((0.1 / 3 / 2 + 0.0) / 2)
    assert (by["all", "s"]["n_pairs"], by["all", "s"]["n_left_out"]) == (6, 1)
    assert by["all", "w"]["ref_win_rate"] == 1.0
    with pytest.raises(ValueError, match="reference scheme 'fan_in'"):
        paired_comparisons([d0], reference="fan_in")


def test_an_undefined_difference_has_no_interval() -> None:
    """The worst scheme's median infinite everywhere: every pair left out, mean_diff nan, yet a
    finite "95% interval" came from the quarter of the replicates that happened to be finite.
    Now nan, as is an interval over fewer finite replicates than its level."""
    inf = math.inf  # a tester's store: 3 data sets, 3 seeds, lr 64 (most runs diverged)
    cubes = [
        _cube("glass", {"fan_in": [1.58, 1442.66, inf], "fan_out": [4.99, inf, inf],
                        "geometric": [75.69, 1.59, 6437.34]}),
        _cube("iris", {"fan_in": [1.28, inf, 10.50], "fan_out": [inf, inf, 36.12],
                       "geometric": [1.10, 0.68, 1.10]}),
        _cube("wine", {"fan_in": [inf, inf, 1.09], "fan_out": [1.08, 1.06, 1.09],
                       "geometric": [1.09, inf, 6.36]}),
    ]  # fmt: skip
    rows = paired_comparisons(cubes, n_boot=2000, seed=0)
    for row in rows:
        if math.isnan(row["mean_diff"]):
            assert math.isnan(row["diff_lo"]) and math.isnan(row["diff_hi"]), row


def test_best_rate_is_chosen_per_replicate_by_the_median() -> None:
    """Two rates: scheme a's median is lower at 0.01 (0.3 vs 0.5); at its best rate its losses
    are [0.2, 0.3, 0.4] → median 0.3, normalized by b's 0.6 → 0.5."""
    losses = np.array([[[0.2, 0.3, 0.4], [0.5, 0.5, 0.5]], [[0.6, 0.6, 0.6], [0.9, 0.9, 0.9]]])
    cube = LossCube("d", ("a", "b"), (0.01, 0.1), (0, 1, 2), losses)
    rows = {r["scheme"]: r for r in table2_intervals([cube], n_boot=20, seed=0)}
    assert rows["a"]["avg_normalized_loss"] == pytest.approx(0.5)
    assert rows["b"]["avg_normalized_loss"] == 1.0 and rows["b"]["worst_in"] == 1


def test_no_noise_gives_a_point_interval_and_seeds_are_deterministic() -> None:
    flat = [_cube(f"d{d}", {"a": [0.3] * 4, "b": [0.6] * 4}) for d in range(3)]
    (a, b) = table2_intervals(flat, n_boot=200, seed=0)
    assert (a["avg_lo"], a["avg_normalized_loss"], a["avg_hi"]) == (0.5, 0.5, 0.5)
    assert (b["worst_lo"], b["worst_hi"], a["p_first"]) == (3.0, 3.0, 1.0)
    rng = np.random.default_rng(4)
    cubes = [_cube(f"d{d}", {"a": rng.uniform(0, 1, 6), "b": rng.uniform(0, 1, 6)})
             for d in range(5)]  # fmt: skip
    one = table2_intervals(cubes, n_boot=200, seed=7).to_rows()
    assert table2_intervals(cubes, n_boot=200, seed=7).to_rows() == one
    other = table2_intervals(cubes, n_boot=200, seed=8).to_rows()
    assert [(r["avg_lo"], r["avg_hi"]) for r in other] != [(r["avg_lo"], r["avg_hi"]) for r in one]
    with pytest.raises(ValueError, match="n_boot"):
        table2_intervals(cubes, n_boot=0)


def test_loss_cubes_and_missing_runs() -> None:
    records = [
        {"dataset": "d", "scheme": s, "lr": lr, "seed": seed, "final_train_loss": 1.0 + seed,
         "last_epoch_minibatch_loss": 5.0, "diverged": False}
        for s in ("a", "b") for lr in (0.1, 0.2) for seed in (0, 1)
    ]  # fmt: skip
    records = [r for r in records if not (r["scheme"] == "b" and r["lr"] == 0.2)]  # b: one rate
    records.append({**records[0], "dataset": "only_a"})  # incomplete data set: left out
    (cube,) = loss_cubes(records)
    assert (cube.schemes, cube.lrs, cube.seeds) == (("a", "b"), (0.1, 0.2), (0, 1))
    assert np.isnan(cube.loss[1, 1]).all() and cube.loss[0, 1].tolist() == [1.0, 2.0]
    (minibatch,) = loss_cubes(records, "last_epoch_minibatch")
    assert (minibatch.loss[~np.isnan(minibatch.loss)] == 5.0).all()
    with pytest.raises(ValueError, match="loss must be one of"):
        loss_cubes(records, "test_loss")
    rows = {r["scheme"]: r for r in table2_intervals([cube], n_boot=30)}
    assert rows["a"]["avg_normalized_loss"] == rows["b"]["avg_normalized_loss"] == 1.0


def test_percentile_interval_and_sensitivity_table() -> None:
    x = np.arange(101, dtype=float)
    assert percentile_interval(x, 0.9) == pytest.approx((5.0, 95.0), abs=1e-12)
    assert percentile_interval(np.array([math.nan, math.inf, 1.0]), 0.5) == (1.0, 1.0)
    assert all(math.isnan(v) for v in percentile_interval(np.array([math.nan])))
    with pytest.raises(ValueError, match="level"):
        percentile_interval(x, 1.0)
    cubes = [_cube("d", {"a": [0.3, 0.4], "b": [0.6, 0.5]})]
    table = sensitivity_table({"v1": table2_intervals(cubes, n_boot=20),
                               "v2": table2_intervals(cubes[::-1], n_boot=20)})  # fmt: skip
    assert [(r["variant"], r["scheme"], r["rank"]) for r in table] == [
        ("v1", "a", 1),
        ("v1", "b", 2),
        ("v2", "a", 1),
        ("v2", "b", 2),
    ]


@pytest.mark.parametrize(
    ("diff", "win", "verdict"),
    [
        ((0.1, 0.3), (0.55, 0.8), "geometric better"),
        ((0.1, 0.3), (0.4, 0.8), "geometric better (the win rate within its interval)"),
        ((-0.1, 0.3), (0.525, 0.75), "geometric wins more pairs (beyond the win rate's"),
        ((-0.2, 0.1), (0.19, 0.46), "fan_in wins more pairs (beyond the win rate's"),
        ((-0.3, -0.1), (0.1, 0.4), "fan_in better"),
        ((0.1, 0.3), (0.1, 0.4), "mixed (geometric better on the mean difference, fan_in wins"),
        ((-0.1, 0.3), (0.4, 0.6), "no difference beyond either interval"),
        ((math.nan, 0.3), (0.4, 0.6), "undefined (2 of 120 pairs left out"),
    ],
)
def test_the_paired_verdict_reads_both_intervals(diff, win, verdict) -> None:
    """The report said "no difference beyond the interval" where the win rate's interval
    excluded 0.5 (geometric winning 60% [52.5%, 75%] of 120 pairs at batch 128)."""
    from initlab.study.report import _paired_verdict

    row = {"scheme": "fan_in", "diff_lo": diff[0], "diff_hi": diff[1], "win_lo": win[0],
           "win_hi": win[1], "n_pairs": 120, "n_left_out": 2}  # fmt: skip
    assert _paired_verdict(row, "geometric").startswith(verdict)


def test_the_reference_line_gives_the_counts_intervals() -> None:
    from initlab.study.report import _count_text

    assert _count_text(2, 0.0, 5.0) == "2 [0, 5]"
    assert _count_text(2, math.nan, 5.0) == "2"
