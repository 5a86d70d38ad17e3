"""Studies: compare initialization schemes over data sets × seeds × learning rates.

* :mod:`~initlab.study.config`: :class:`RunConfig` (one run, keyed by a hash of its full config)
  and :class:`RunResult`;
* :mod:`~initlab.study.trainer`: :func:`train_runs` trains many runs of one architecture at once
  (batched matmuls / ``vmap``), equal to :func:`train_one`, the plain PyTorch loop;
* :mod:`~initlab.study.spec`: :class:`StudySpec`, the declarative study (YAML);
* :mod:`~initlab.study.store`: :class:`Store`, the SQLite results store (resumable);
* :mod:`~initlab.study.runner`: :func:`run_study` (local process pool or Ray);
* :mod:`~initlab.study.variants`: protocol variants of one study (several values of a key, or
  named overrides), each run once and shared between variants that agree;
* :mod:`~initlab.study.claims`: several drivers on one store share the work (claims, heartbeat);
* :mod:`~initlab.study.aggregate` and :mod:`~initlab.study.plots`: Table 2 as in Defazio &
  Bottou, per-data-set tables, interquartile plots and loss curves;
* :mod:`~initlab.study.bootstrap`: two-level bootstrap intervals for Table 2 and paired comparisons
  against geometric; :mod:`~initlab.study.report`: the per-variant report, the sensitivity table
  and its HTML page (:func:`report_study`).
"""

from initlab.study.aggregate import (
    PAPER_TABLE2,
    lr_table,
    per_dataset_table,
    sensitivity_table,
    table2,
)
from initlab.study.bootstrap import paired_comparisons, table2_intervals
from initlab.study.config import RunConfig, RunResult
from initlab.study.report import report_study, study_to_report
from initlab.study.runner import (
    StudyData,
    StudyError,
    StudySpecMismatch,
    StudySummary,
    build_model,
    load_study_data,
    run_study,
)
from initlab.study.spec import StudySpec
from initlab.study.store import Store
from initlab.study.trainer import epoch_order, train_one, train_runs

__all__ = [
    "PAPER_TABLE2",
    "RunConfig",
    "RunResult",
    "Store",
    "StudyData",
    "StudyError",
    "StudySpec",
    "StudySpecMismatch",
    "StudySummary",
    "build_model",
    "epoch_order",
    "load_study_data",
    "lr_table",
    "paired_comparisons",
    "per_dataset_table",
    "report_study",
    "run_study",
    "sensitivity_table",
    "study_to_report",
    "table2",
    "table2_intervals",
    "train_one",
    "train_runs",
]
