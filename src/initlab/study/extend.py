"""Learning-rate grid extension: :func:`extension_runs`.

A best learning rate at the edge of the grid says the grid was too narrow for that data set and
scheme: the true best may lie beyond it, and Table 2 then compares a scheme at a rate the grid
forced on it (10 of the 48 best rates of our first Table 2 run sat at the top edge, 2).
Extension adds, for every (variant, data set, scheme) whose best rate sits at an edge, the **next
power of two beyond that edge** (``2^(floor(log2 max) + 1)`` above the top, ``2^(ceil(log2 min) -
1)`` below the bottom) for all the variant's seeds; the runner trains those runs, looks again,
and repeats until no best rate sits at an edge or a number of rounds is reached
(:func:`initlab.study.runner.run_study`, ``extend_grid``). A rate where the runs diverge has an
infinite median, so a best rate just below divergence stops being "at the edge" after one round.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from initlab.study.aggregate import per_dataset_table
from initlab.study.config import RunConfig
from initlab.study.spec import StudySpec

__all__ = ["extension_runs", "next_rate"]


def next_rate(lrs: Sequence[float], edge: str) -> float:
    """The next power of two beyond the ``"top"`` or ``"bottom"`` edge of ``lrs``.

    >>> next_rate([2.0, 1.0, 0.5], "top"), next_rate([2.0, 1.0, 0.5], "bottom")
    (4.0, 0.25)
    >>> next_rate([0.3, 0.1], "top"), next_rate([0.3, 0.1], "bottom")
    (0.5, 0.0625)
    """
    if edge == "top":
        return 2.0 ** (math.floor(math.log2(max(lrs))) + 1)
    if edge == "bottom":
        return 2.0 ** (math.ceil(math.log2(min(lrs))) - 1)
    raise ValueError(f"edge must be 'top' or 'bottom', got {edge!r}")


def extension_runs(
    spec: StudySpec, records: Iterable[Mapping[str, Any]]
) -> tuple[list[RunConfig], list[tuple[str, str, str]]]:
    """The runs one round of extension adds to one variant.

    Args:
        spec: the variant's flat spec (:meth:`StudySpec.variant_specs`): its protocol, seeds and
            ``loss`` measure.
        records: the variant's finished runs (``Store.records(study, variant=...)``).

    Returns:
        ``(runs, cells)``: the new runs (every seed of the spec at the next rate of each edge
        cell) and the cells ``(dataset, scheme, edge)`` they extend.
    """
    records = list(records)
    lrs: dict[tuple[str, str], set[float]] = {}
    for r in records:
        lrs.setdefault((r["dataset"], r["scheme"]), set()).add(float(r["lr"]))
    runs, cells = [], []
    for row in per_dataset_table(records, spec.loss):
        if not row["grid_edge"]:
            continue
        dataset, scheme = row["dataset"], row["scheme"]
        lr = next_rate(sorted(lrs[dataset, scheme]), row["grid_edge"])
        runs += [spec.run_config(dataset, scheme, seed, lr) for seed in spec.seeds]
        cells.append((dataset, scheme, row["grid_edge"]))
    return runs, cells
