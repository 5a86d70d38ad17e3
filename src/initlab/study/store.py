"""Study results on disk: a SQLite file with one row per finished run, keyed by ``RunConfig.key()``.

Why SQLite: a study of thousands of runs is killed, restarted, extended with new seeds or learning
rates, and read by a report while it still runs. SQLite gives atomic multi-row transactions (a
group's results are committed all at once or not at all, so a ``SIGKILL`` at any instant loses at
most the group in flight and never leaves half a group), a primary key that makes a run impossible
to store twice (``INSERT OR IGNORE``), and WAL mode so readers do not block the writer. Only the
study driver writes; workers send their results back to it.

Schema (``SCHEMA_VERSION`` 1):

``runs``
    ``key`` (primary key), ``config`` (``RunConfig.to_dict()`` as JSON), the denormalized config
    fields ``dataset, model, scheme, seed, lr`` for queries, ``final_train_loss`` (``NULL`` for
    ``nan``), ``diverged`` (0/1), ``wall_s``, ``metrics`` (JSON of the four per-epoch lists),
    ``step_loss`` (``float64`` little-endian, zlib-compressed) and ``created_at`` (UTC ISO 8601).
``study_runs``
    ``(study, key)``: which runs belong to which study (a run shared by two studies is stored once).
``studies``
    ``name`` (primary key), ``spec`` (``StudySpec.to_dict()`` as JSON, the latest registered),
    ``created_at``.
"""

from __future__ import annotations

import json
import math
import sqlite3
import zlib
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from initlab.study.config import RunConfig, RunResult

__all__ = ["RECORD_COLUMNS", "SCHEMA_VERSION", "Store"]

SCHEMA_VERSION = 1

#: Columns of :meth:`Store.records` / :meth:`Store.to_pandas` (config fields come from
#: ``RunConfig.to_dict()``; ``model_cfg`` as a JSON string). With ``curves=True`` the lists
#: ``step_loss, epoch_train_loss, epoch_train_acc, epoch_test_loss, epoch_test_acc`` follow.
RECORD_COLUMNS = (
    "key",
    "dataset",
    "model",
    "model_cfg",
    "scheme",
    "seed",
    "lr",
    "optimizer",
    "momentum",
    "weight_decay",
    "epochs",
    "batch_size",
    "output_std",
    "final_train_loss",
    "diverged",
    "final_train_acc",
    "final_test_loss",
    "final_test_acc",
    "n_steps",
    "wall_s",
    "created_at",
)

_EPOCH_FIELDS = ("epoch_train_loss", "epoch_train_acc", "epoch_test_loss", "epoch_test_acc")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS runs (
    key TEXT PRIMARY KEY,
    config TEXT NOT NULL,
    dataset TEXT NOT NULL,
    model TEXT NOT NULL,
    scheme TEXT NOT NULL,
    seed INTEGER NOT NULL,
    lr REAL NOT NULL,
    final_train_loss REAL,
    diverged INTEGER NOT NULL,
    wall_s REAL NOT NULL,
    metrics TEXT NOT NULL,
    step_loss BLOB NOT NULL,
    created_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS runs_dataset_scheme ON runs (dataset, scheme);
CREATE TABLE IF NOT EXISTS study_runs (
    study TEXT NOT NULL,
    key TEXT NOT NULL,
    PRIMARY KEY (study, key)
);
CREATE TABLE IF NOT EXISTS studies (
    name TEXT PRIMARY KEY,
    spec TEXT NOT NULL,
    created_at TEXT NOT NULL
);
"""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _encode_curve(values: Sequence[float]) -> bytes:
    return zlib.compress(np.asarray(values, dtype="<f8").tobytes())


def _decode_curve(blob: bytes) -> list[float]:
    return np.frombuffer(zlib.decompress(blob), dtype="<f8").tolist()


def _float_or_nan(value: float | None) -> float:
    return math.nan if value is None else float(value)


def _last(values: Sequence[float]) -> float:
    return float(values[-1]) if len(values) else math.nan


class Store:
    """A SQLite results store (created on first use); use as a context manager or call ``close``.

    Args:
        path: the database file (its folder is created). ``":memory:"`` works for tests.
        timeout: seconds to wait for a lock held by another connection.
    """

    def __init__(self, path: str | Path, *, timeout: float = 60.0) -> None:
        self.path = Path(path) if str(path) != ":memory:" else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(
            str(path) if self.path is None else str(self.path),
            timeout=timeout,
            isolation_level=None,  # explicit BEGIN/COMMIT below
        )
        self._conn.execute("PRAGMA journal_mode=WAL")
        # FULL: a committed group survives a power cut too, not just a killed process; the cost is
        # one fsync per group, negligible next to training it.
        self._conn.execute("PRAGMA synchronous=FULL")
        with self._transaction() as cur:
            # executescript() would commit on its own; run the statements inside our transaction.
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    cur.execute(statement)
            cur.execute(
                "INSERT OR IGNORE INTO meta (name, value) VALUES ('schema_version', ?)",
                (str(SCHEMA_VERSION),),
            )
        version = self._conn.execute(
            "SELECT value FROM meta WHERE name = 'schema_version'"
        ).fetchone()[0]
        if int(version) != SCHEMA_VERSION:
            raise ValueError(
                f"{path}: store schema version {version}, this initlab reads {SCHEMA_VERSION}"
            )

    # -- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection (idempotent)."""
        self._conn.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({str(self.path) if self.path else ':memory:'!r})"

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Cursor]:
        cur = self._conn.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            yield cur
        except BaseException:
            cur.execute("ROLLBACK")
            raise
        else:
            cur.execute("COMMIT")
        finally:
            cur.close()

    # -- writing ------------------------------------------------------------------------------

    def register_study(self, name: str, spec: dict[str, Any], keys: Iterable[str]) -> None:
        """Record a study's spec and the keys of all its runs (finished or not); one transaction."""
        with self._transaction() as cur:
            cur.execute(
                "INSERT INTO studies (name, spec, created_at) VALUES (?, ?, ?) "
                "ON CONFLICT (name) DO UPDATE SET spec = excluded.spec",
                (name, json.dumps(spec, sort_keys=True), _now()),
            )
            cur.executemany(
                "INSERT OR IGNORE INTO study_runs (study, key) VALUES (?, ?)",
                ((name, k) for k in keys),
            )

    def write(self, results: Sequence[RunResult], *, study: str | None = None) -> int:
        """Store finished runs in **one** transaction; runs already stored are left untouched.

        Args:
            results: the runs (typically one finished group).
            study: also tag the runs as members of this study.

        Returns:
            the number of new rows.
        """
        now = _now()
        rows = []
        for r in results:
            cfg = r.config
            metrics = {name: list(getattr(r, name)) for name in _EPOCH_FIELDS}
            final = float(r.final_train_loss)
            rows.append(
                (
                    cfg.key(),
                    json.dumps(cfg.to_dict(), sort_keys=True),
                    cfg.dataset,
                    cfg.model,
                    cfg.scheme,
                    cfg.seed,
                    cfg.lr,
                    None if math.isnan(final) else final,
                    int(bool(r.diverged)),
                    float(r.wall_s),
                    json.dumps(metrics),
                    _encode_curve(r.step_loss),
                    now,
                )
            )
        with self._transaction() as cur:
            before = self._conn.total_changes
            cur.executemany(
                "INSERT OR IGNORE INTO runs (key, config, dataset, model, scheme, seed, lr, "
                "final_train_loss, diverged, wall_s, metrics, step_loss, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
            inserted = self._conn.total_changes - before
            if study is not None:
                cur.executemany(
                    "INSERT OR IGNORE INTO study_runs (study, key) VALUES (?, ?)",
                    ((study, row[0]) for row in rows),
                )
        return inserted

    # -- reading ------------------------------------------------------------------------------

    def studies(self) -> dict[str, dict[str, Any]]:
        """``{study name: spec dict}`` of every registered study."""
        rows = self._conn.execute("SELECT name, spec FROM studies ORDER BY created_at, name")
        return {name: json.loads(spec) for name, spec in rows}

    def study_keys(self, study: str) -> set[str]:
        """Keys of all runs of a registered study, finished or not."""
        rows = self._conn.execute("SELECT key FROM study_runs WHERE study = ?", (study,))
        return {k for (k,) in rows}

    def _select(self, columns: str, study: str | None) -> sqlite3.Cursor:
        if study is None:
            return self._conn.execute(f"SELECT {columns} FROM runs ORDER BY rowid")
        return self._conn.execute(
            f"SELECT {columns} FROM runs WHERE key IN "
            "(SELECT key FROM study_runs WHERE study = ?) ORDER BY rowid",
            (study,),
        )

    def keys(self, study: str | None = None) -> set[str]:
        """Keys of the finished runs (of one study, or all)."""
        return {k for (k,) in self._select("key", study)}

    def __len__(self) -> int:
        return int(self._conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0])

    def __contains__(self, key: object) -> bool:
        row = self._conn.execute("SELECT 1 FROM runs WHERE key = ?", (key,)).fetchone()
        return row is not None

    def results(self, study: str | None = None) -> list[RunResult]:
        """Finished runs as :class:`RunResult` (of one study, or all), in the order stored."""
        out = []
        for config, final, diverged, wall_s, metrics, blob in self._select(
            "config, final_train_loss, diverged, wall_s, metrics, step_loss", study
        ):
            epochs = json.loads(metrics)
            out.append(
                RunResult(
                    config=RunConfig.from_dict(json.loads(config)),
                    step_loss=_decode_curve(blob),
                    diverged=bool(diverged),
                    final_train_loss=_float_or_nan(final),
                    wall_s=float(wall_s),
                    **{name: [_float_or_nan(v) for v in epochs[name]] for name in _EPOCH_FIELDS},
                )
            )
        return out

    def records(self, study: str | None = None, *, curves: bool = False) -> list[dict[str, Any]]:
        """Finished runs as flat dicts with the columns :data:`RECORD_COLUMNS` (tidy rows).

        Args:
            study: only this study's runs.
            curves: also include the per-step and per-epoch lists.
        """
        out = []
        for key, config, final, diverged, wall_s, metrics, blob, created in self._select(
            "key, config, final_train_loss, diverged, wall_s, metrics, step_loss, created_at",
            study,
        ):
            cfg = json.loads(config)
            epochs = {k: [_float_or_nan(v) for v in vs] for k, vs in json.loads(metrics).items()}
            step_loss = _decode_curve(blob)
            row: dict[str, Any] = {"key": key}
            for name in RECORD_COLUMNS[1:13]:
                value = cfg.get(name)
                row[name] = json.dumps(value, sort_keys=True) if name == "model_cfg" else value
            row.update(
                final_train_loss=_float_or_nan(final),
                diverged=bool(diverged),
                final_train_acc=_last(epochs["epoch_train_acc"]),
                final_test_loss=_last(epochs["epoch_test_loss"]),
                final_test_acc=_last(epochs["epoch_test_acc"]),
                n_steps=len(step_loss),
                wall_s=float(wall_s),
                created_at=created,
            )
            if curves:
                row["step_loss"] = step_loss
                row.update(epochs)
            out.append(row)
        return out

    # -- export -------------------------------------------------------------------------------

    def to_pandas(self, study: str | None = None, *, curves: bool = False) -> Any:
        """:meth:`records` as a ``pandas.DataFrame`` (needs pandas)."""
        try:
            import pandas as pd
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError("Store.to_pandas() needs pandas: pip install pandas") from err
        columns = list(RECORD_COLUMNS)
        if curves:
            columns += ["step_loss", *_EPOCH_FIELDS]
        return pd.DataFrame(self.records(study, curves=curves), columns=columns)

    def to_csv(self, path: str | Path, study: str | None = None) -> Path:
        """Write :meth:`records` (without curves) as CSV (no pandas needed); returns the path."""
        import csv

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(RECORD_COLUMNS))
            writer.writeheader()
            for row in self.records(study):
                writer.writerow({k: "" if v is None else v for k, v in row.items()})
        return path
