"""Studies: compare initialization schemes over data sets × seeds × learning rates.

* :mod:`~initlab.study.config`: :class:`RunConfig` (one run, keyed by a hash of its full config)
  and :class:`RunResult`;
* :mod:`~initlab.study.trainer`: :func:`train_runs` trains many runs of one architecture at once
  (batched matmuls / ``vmap``), equal to :func:`train_one`, the plain PyTorch loop;
* :mod:`~initlab.study.spec`: :class:`StudySpec`, the declarative study (YAML);
* :mod:`~initlab.study.store`: :class:`Store`, the SQLite results store (resumable);
* :mod:`~initlab.study.runner`: :func:`run_study` (local process pool or Ray);
* :mod:`~initlab.study.aggregate` and :mod:`~initlab.study.plots`: Table 2 as in Defazio &
  Bottou, per-data-set tables, interquartile plots and loss curves (:func:`report_study`).
"""

from initlab.study.aggregate import PAPER_TABLE2, lr_table, per_dataset_table, report_study, table2
from initlab.study.config import RunConfig, RunResult
from initlab.study.runner import (
    StudyData,
    StudyError,
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
    "StudySummary",
    "build_model",
    "epoch_order",
    "load_study_data",
    "lr_table",
    "per_dataset_table",
    "report_study",
    "run_study",
    "table2",
    "train_one",
    "train_runs",
]
