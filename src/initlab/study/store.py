"""Study results on disk: a SQLite file with one row per finished run, keyed by ``RunConfig.key()``.

Why SQLite: a study of thousands of runs is killed, restarted, extended with new seeds or learning
rates (as a study of another name: the runs already stored are reused), and read by a report while
it still runs. SQLite gives atomic multi-row transactions (a
group's results are committed all at once or not at all, so a ``SIGKILL`` at any instant loses at
most the group in flight and never leaves half a group), a primary key that makes a run impossible
to store twice (``INSERT OR IGNORE``), and WAL mode so readers do not block the writer. Only the
study driver writes; workers send their results back to it. Several drivers may run one study on
one store at the same time: each claims the runs it is about to train (``claims``), keeps its
claims alive with a heartbeat, and skips runs claimed by a live driver; the claims of a driver that
stopped beating (killed) go stale and are taken by the others (:mod:`initlab.study.runner`).

Schema (``SCHEMA_VERSION`` 2; a version-1 store is upgraded in place when opened: the two tables
``variant_runs`` and ``claims`` are added, nothing else changes):

``runs``
    ``key`` (primary key), ``config`` (``RunConfig.to_dict()`` as JSON), the denormalized config
    fields ``dataset, model, scheme, seed, lr`` for queries, ``final_train_loss`` (``NULL`` for
    ``nan``), ``diverged`` (0/1), ``wall_s``, ``metrics`` (JSON of the four per-epoch lists and,
    for a data-dependent init, its ``init_cost``: :data:`initlab.study.pipelines.INIT_COST_KEYS`),
    ``step_loss`` (``float64`` little-endian, zlib-compressed) and ``created_at`` (UTC ISO 8601).
``study_runs``
    ``(study, key)``: which runs belong to which study (a run shared by two studies is stored once).
``studies``
    ``name`` (primary key), ``spec`` (``StudySpec.to_dict()`` as JSON, the latest registered),
    ``created_at``. The runner binds a name to its spec's runs: a spec that would add, drop or
    change runs is refused under a registered name (only ``loss``, ``extend_grid`` and
    ``data_root`` may change).
``variant_runs``
    ``(study, variant, key)``: which runs make each protocol variant of a study (a run shared by
    two variants is one row in ``runs``, two here). A study registered without variants has none:
    it reads as the one variant ``"base"`` holding all its runs.
``claims``
    ``key`` (primary key), ``owner`` (a driver's id), ``heartbeat`` (Unix time of the owner's last
    sign of life), ``claimed_at``: runs being trained right now. A claim is *fresh* while its
    heartbeat is younger than the ``stale_after`` the claimants use; a stored run's claim is
    deleted in the transaction that stores it.
"""

from __future__ import annotations

import json
import math
import sqlite3
import time
import urllib.parse
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from initlab.study.config import RunConfig, RunResult, last_epoch_mean

__all__ = ["BASE_VARIANT", "RECORD_COLUMNS", "SCHEMA_VERSION", "Store"]

SCHEMA_VERSION = 2

#: The variant name of a study registered without variants.
BASE_VARIANT = "base"

#: The config fields among :data:`RECORD_COLUMNS` (``RunConfig.to_dict()``; ``model_cfg`` as a
#: JSON string; ``input_norm`` is ``"none"`` for runs stored before it existed).
_CONFIG_COLUMNS = (
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
    "input_norm",
)

#: Columns of :meth:`Store.records` / :meth:`Store.to_pandas`: the key, the config fields, then
#: the results. ``last_epoch_minibatch_loss`` is the mean of the last epoch's step losses
#: (:func:`~initlab.study.config.last_epoch_mean`, ``nan`` for a diverged run, also one whose
#: steps stayed finite and whose final full pass diverged), read from the
#: stored step losses. With ``curves=True`` the lists ``step_loss, epoch_train_loss,
#: epoch_train_acc, epoch_test_loss, epoch_test_acc`` follow. The ``init_*`` columns are the cost
#: of a data-dependent init (:data:`initlab.study.pipelines.INIT_COST_KEYS`): its wall time, the
#: forward and backward passes and the examples its methods read; ``None`` for a data-free init.
RECORD_COLUMNS = (
    "key",
    *_CONFIG_COLUMNS,
    "final_train_loss",
    "last_epoch_minibatch_loss",
    "diverged",
    "final_train_acc",
    "final_test_loss",
    "final_test_acc",
    "n_steps",
    "wall_s",
    "init_wall_s",
    "init_forward_passes",
    "init_backward_passes",
    "init_examples",
    "created_at",
)

#: ``init_*`` record columns → keys of the stored ``init_cost``.
_INIT_COST_COLUMNS = {
    "init_wall_s": "wall_s",
    "init_forward_passes": "forward_passes",
    "init_backward_passes": "backward_passes",
    "init_examples": "examples",
}

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
CREATE TABLE IF NOT EXISTS variant_runs (
    study TEXT NOT NULL,
    variant TEXT NOT NULL,
    key TEXT NOT NULL,
    PRIMARY KEY (study, variant, key)
);
CREATE TABLE IF NOT EXISTS claims (
    key TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    heartbeat REAL NOT NULL,
    claimed_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS claims_owner ON claims (owner);
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


def _write_ahead_log(conn: sqlite3.Connection, timeout: float) -> None:
    """Switch ``conn``'s database to WAL mode, waiting up to ``timeout`` seconds for other
    connections.

    Changing the journal mode needs an exclusive lock, and SQLite answers "database is locked"
    at once (without its busy handler) while another connection is opening or creating the same
    file: two ``initlab bench run`` started together on a new store both get here. The mode is
    stored in the file, so once one connection has switched it the others' switch is a no-op.
    """
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as err:
            if "locked" not in str(err) or time.monotonic() >= deadline:
                raise
        time.sleep(delay)
        delay = min(2 * delay, 0.25)


def _logs(path: Path) -> tuple[Path, Path]:
    """The write-ahead log and shared-memory files SQLite keeps beside a WAL store."""
    return path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")


def logs_are_unused(path: Path) -> bool:
    """``path`` has no write-ahead log beside it, or an empty one (no transaction waits in it).

    A reader that finds it so may remove the logs when done (:func:`remove_unused_logs`): that
    changes nothing in the store. A log a killed writer left with transactions is kept.
    """
    try:
        return _logs(path)[0].stat().st_size == 0
    except FileNotFoundError:
        return True
    except OSError:
        return False


def remove_unused_logs(path: Path) -> None:
    """Have SQLite remove the ``-wal`` and ``-shm`` files of ``path`` if no connection uses them.

    SQLite's last connection to close removes them, but only one that may write: a read-only
    connection (a report) makes them where they are missing and leaves them. This opens one that
    may write (``query_only``: it writes no row) and closes it, which is SQLite's own close:
    where it gets the exclusive lock, that is where no other connection (a driver writing the
    store, another report) has the store open, it checkpoints what a writer committed meanwhile
    (as that writer would have on closing, had the reader not held the store) and removes the
    files; otherwise it leaves them to the others. Where the store cannot be written, SQLite opens
    it read-only and leaves them too.
    """
    if not any(log.exists() for log in _logs(path)):
        return
    try:
        conn = sqlite3.connect(str(path), timeout=1.0, isolation_level=None)
    except sqlite3.Error:
        return
    try:
        conn.execute("PRAGMA query_only=1")
        conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()  # opens the log
    except sqlite3.Error:
        pass
    finally:
        conn.close()


def connect_read_only(path: Path, timeout: float = 5.0) -> sqlite3.Connection:
    """A connection to the existing SQLite file ``path`` that can only read (``mode=ro``).

    It sees what concurrent writers commit (their write-ahead log included). In a folder where
    SQLite cannot make the WAL's shared-memory file, it reads the file as ``immutable`` (there is
    no writer there: a writer needs that file too). Close it with :func:`remove_unused_logs`
    (see :func:`reading`).
    """
    uri = f"file:{urllib.parse.quote(str(path.resolve()))}?mode=ro"
    conn = sqlite3.connect(uri, uri=True, timeout=timeout, isolation_level=None)
    try:
        conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
    except sqlite3.OperationalError as err:  # a WAL store in a folder it cannot make -shm in
        conn.close()
        if "locked" in str(err):  # a writer held it past the timeout: it is being written
            raise
        conn = sqlite3.connect(
            f"{uri}&immutable=1", uri=True, timeout=timeout, isolation_level=None
        )
    return conn


@contextmanager
def reading(path: Path, timeout: float = 5.0) -> Iterator[sqlite3.Connection]:
    """:func:`connect_read_only` for the block; the folder is left as it was found (the ``-wal``
    and ``-shm`` files the reading made are removed where no other connection uses them)."""
    tidy = logs_are_unused(path)
    conn = connect_read_only(path, timeout)
    try:
        yield conn
    finally:
        conn.close()
        if tidy:
            remove_unused_logs(path)


#: The first 16 bytes of every SQLite database file.
SQLITE_HEADER = b"SQLite format 3\x00"


def not_a_store(path: Path) -> str | None:
    """Why the existing, non-empty file ``path`` is no initlab store to open, read only (nothing
    in it changes); ``None`` where it is one, or a SQLite database without tables (a new store,
    or one another driver is making: its tables come in one transaction with its ``meta``).

    The reason completes a sentence that starts with the file's name: another kind of file, a
    damaged SQLite file (its header, then pages SQLite cannot read), or a SQLite database with
    tables of its own and no store's ``meta`` (a store is never made in a database of something
    else: a mistyped path must not change it).
    """
    with open(path, "rb") as fh:
        if fh.read(len(SQLITE_HEADER)) != SQLITE_HEADER:
            return "is not a SQLite database (it is another kind of file)"
    try:
        with reading(path) as conn:
            tables = [
                str(name)
                for (name,) in conn.execute(
                    "SELECT name FROM sqlite_master WHERE type IN ('table', 'view') ORDER BY name"
                )
                if not str(name).startswith("sqlite_")
            ]
            if not tables:
                return None
            try:
                row = conn.execute("SELECT 1 FROM meta WHERE name = 'schema_version'").fetchone()
            except sqlite3.OperationalError:  # no meta table, or another one of that name
                row = None
    except sqlite3.OperationalError:  # locked, or not readable here: opening it says why
        return None
    except sqlite3.DatabaseError as err:  # "file is not a database", "... malformed"
        return f"is a damaged SQLite file, which SQLite cannot read ({err})"
    if row is None:
        return (
            f"is a SQLite database but not an initlab store (it holds the tables "
            f"{', '.join(tables)}, and no store's meta table)"
        )
    return None


def _open_read_only(path: Path | None, timeout: float) -> sqlite3.Connection:
    """A read-only connection to the existing store ``path``, its schema version checked."""
    if path is None or not path.is_file():
        raise FileNotFoundError(f"no study store at {path}")
    try:
        conn = connect_read_only(path, timeout)
    except sqlite3.OperationalError:
        raise
    except sqlite3.DatabaseError as err:  # not a database, or a damaged one
        reason = not_a_store(path) or f"cannot be read by SQLite ({err})"
        raise ValueError(f"{path} {reason}; give the study store run_study wrote") from err
    try:
        row = conn.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone()
    except sqlite3.OperationalError as err:
        conn.close()
        if "no such table" in str(err):
            raise ValueError(f"{path}: not an initlab study store (no meta table)") from err
        raise
    version = int(row[0]) if row else 0
    if version not in (1, SCHEMA_VERSION):
        conn.close()
        raise ValueError(
            f"{path}: store schema version {version}, this initlab reads {SCHEMA_VERSION} (and "
            "1); use the initlab that wrote it"
        )
    if version == 1:  # read as version 2: the tables it added, empty, for this connection only
        have = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        for statement in _SCHEMA.split(";"):
            table = statement.split("EXISTS", 1)[-1].split("(", 1)[0].strip()
            if "CREATE TABLE" in statement and table not in have:
                conn.execute(statement.replace("CREATE TABLE", "CREATE TEMP TABLE", 1))
    return conn


def _refuse_another_file(path: Path) -> None:
    """Refuse to make a store of an existing file that is not one (:func:`not_a_store`), before
    anything is written to it."""
    try:
        if path.stat().st_size == 0:
            return
    except FileNotFoundError:
        return
    reason = not_a_store(path)
    if reason is not None:
        raise ValueError(
            f"{path} {reason}; initlab writes nothing to it: give another store path (a new "
            "file is made there)"
        )


class Store:
    """A SQLite results store (created on first use); use as a context manager or call ``close``.

    Args:
        path: the database file (its folder is created): a store, or a new or empty file. An
            existing file of something else (another application's SQLite database, another
            kind of file) is refused with ``ValueError``, unchanged. ``":memory:"`` works for
            tests.
        timeout: seconds to wait for a lock held by another connection.
        read_only: open an existing store for reading only (a report): nothing is created or
            written, so a store on a read-only disk or folder, or owned by another user, can be
            read (SQLite's ``mode=ro``, or ``immutable=1`` where even that needs a write); any
            write raises ``sqlite3.OperationalError``. The ``-wal`` and ``-shm`` files SQLite
            makes for a reader are removed on closing, where no other connection uses them.
    """

    def __init__(self, path: str | Path, *, timeout: float = 60.0, read_only: bool = False) -> None:
        self.path = Path(path) if str(path) != ":memory:" else None
        #: a read-only store whose logs were unused when opened: left so when closed
        self._tidy = False
        if read_only:
            self._tidy = self.path is not None and logs_are_unused(self.path)
            self._conn = _open_read_only(self.path, timeout)
            return
        if self.path is not None:
            if self.path.is_dir():
                raise IsADirectoryError(
                    f"{self.path}: is a directory; a store is one SQLite file: give a file path "
                    f"such as {self.path / 'study.sqlite'}"
                )
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _refuse_another_file(self.path)
        self._conn = sqlite3.connect(
            str(path) if self.path is None else str(self.path),
            timeout=timeout,
            isolation_level=None,  # explicit BEGIN/COMMIT below
        )
        _write_ahead_log(self._conn, timeout)
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
            version = int(
                cur.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone()[0]
            )
            if version == 1:  # version 2 only added tables, created above
                cur.execute(
                    "UPDATE meta SET value = ? WHERE name = 'schema_version'",
                    (str(SCHEMA_VERSION),),
                )
                version = SCHEMA_VERSION
            if version != SCHEMA_VERSION:  # raised inside the transaction: nothing is written
                raise ValueError(
                    f"{path}: store schema version {version}, this initlab reads "
                    f"{SCHEMA_VERSION} (and upgrades 1); use the initlab that wrote it"
                )

    # -- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection (idempotent). A read-only store leaves its folder as it found it:
        the ``-wal`` and ``-shm`` files its reading made are removed where no other connection
        uses them (:func:`remove_unused_logs`)."""
        self._conn.close()
        if self._tidy and self.path is not None:
            self._tidy = False
            remove_unused_logs(self.path)

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

    def register_study(
        self,
        name: str,
        spec: dict[str, Any],
        keys: Iterable[str],
        variants: Mapping[str, Iterable[str]] | None = None,
        *,
        check: Callable[[dict[str, Any]], None] | None = None,
        keep: Callable[[str, str, dict[str, Any]], bool] | None = None,
    ) -> None:
        """Record a study's spec and the keys of all its runs (finished or not); one transaction.

        Args:
            name: the study.
            spec: its spec (``StudySpec.to_dict()``), replacing the one registered before.
            keys: all its runs' keys.
            variants: ``{variant: keys}``, the runs of each protocol variant (``None``: the study
                has no variants).
            check: called with the spec registered before under ``name`` (if any), inside the
                transaction, before anything is written; it raises to refuse the registration
                (the runner refuses a spec with other runs: a study's name is bound to its runs).
            keep: ``keep(variant, key, config)`` for each finished run that is a member of the
                study (``config`` as ``RunConfig.to_dict()``); a member it rejects stops being
                one (it stays stored: other studies may share it). Unfinished members are kept.
        """
        with self._transaction() as cur:
            if check is not None:
                row = cur.execute("SELECT spec FROM studies WHERE name = ?", (name,)).fetchone()
                if row is not None:
                    check(json.loads(row[0]))
            if keep is not None:
                self._prune(cur, name, keep)
            cur.execute(
                "INSERT INTO studies (name, spec, created_at) VALUES (?, ?, ?) "
                "ON CONFLICT (name) DO UPDATE SET spec = excluded.spec",
                (name, json.dumps(spec, sort_keys=True), _now()),
            )
            cur.executemany(
                "INSERT OR IGNORE INTO study_runs (study, key) VALUES (?, ?)",
                ((name, k) for k in keys),
            )
            self._add_variant_rows(cur, name, variants or {})

    def add_runs(self, study: str, variants: Mapping[str, Iterable[str]]) -> None:
        """Make runs members of a registered study's variants (e.g. a grid extension's)."""
        with self._transaction() as cur:
            keys = {k for ks in variants.values() for k in ks}
            cur.executemany(
                "INSERT OR IGNORE INTO study_runs (study, key) VALUES (?, ?)",
                ((study, k) for k in sorted(keys)),
            )
            self._add_variant_rows(cur, study, variants)

    @staticmethod
    def _prune(
        cur: sqlite3.Cursor, study: str, keep: Callable[[str, str, dict[str, Any]], bool]
    ) -> None:
        """Drop the finished members of ``study`` that ``keep`` rejects (see register_study)."""
        rows = cur.execute(
            "SELECT v.variant, v.key, r.config FROM variant_runs AS v JOIN runs AS r "
            "ON r.key = v.key WHERE v.study = ?",
            (study,),
        ).fetchall()
        if not rows:  # registered without variant rows: its runs are the one variant "base"
            rows = cur.execute(
                "SELECT ?, s.key, r.config FROM study_runs AS s JOIN runs AS r ON r.key = s.key "
                "WHERE s.study = ?",
                (BASE_VARIANT, study),
            ).fetchall()
        drop = [(v, k) for v, k, config in rows if not keep(v, k, json.loads(config))]
        if not drop:
            return
        cur.executemany(
            "DELETE FROM variant_runs WHERE study = ? AND variant = ? AND key = ?",
            ((study, v, k) for v, k in drop),
        )
        dropped = set(drop)
        kept = {k for v, k, _ in rows if (v, k) not in dropped}
        cur.executemany(
            "DELETE FROM study_runs WHERE study = ? AND key = ?",
            ((study, k) for k in {k for _, k in drop} - kept),
        )

    @staticmethod
    def _add_variant_rows(
        cur: sqlite3.Cursor, study: str, variants: Mapping[str, Iterable[str]]
    ) -> None:
        cur.executemany(
            "INSERT OR IGNORE INTO variant_runs (study, variant, key) VALUES (?, ?, ?)",
            ((study, v, k) for v, keys in variants.items() for k in keys),
        )

    # -- claims: several drivers on one store ---------------------------------------------------

    def claim(self, keys: Iterable[str], owner: str, *, stale_after: float) -> list[str]:
        """Claim runs for ``owner`` in one transaction; returns the keys it got, in order.

        A key is taken when it is not stored yet and has no *fresh* claim of another owner (one
        whose heartbeat is younger than ``stale_after`` seconds); a stale claim is taken over.
        """
        now = time.time()
        got = []
        with self._transaction() as cur:
            for key in keys:
                if cur.execute("SELECT 1 FROM runs WHERE key = ?", (key,)).fetchone():
                    continue
                row = cur.execute(
                    "SELECT owner, heartbeat FROM claims WHERE key = ?", (key,)
                ).fetchone()
                if row is not None and row[0] != owner and now - row[1] < stale_after:
                    continue
                cur.execute(
                    "INSERT OR REPLACE INTO claims (key, owner, heartbeat, claimed_at) "
                    "VALUES (?, ?, ?, ?)",
                    (key, owner, now, _now()),
                )
                got.append(key)
        return got

    def heartbeat(self, owner: str) -> int:
        """Renew all of ``owner``'s claims; returns how many it holds."""
        with self._transaction() as cur:
            cur.execute("UPDATE claims SET heartbeat = ? WHERE owner = ?", (time.time(), owner))
            return int(cur.rowcount)

    def release(self, owner: str, keys: Iterable[str] | None = None) -> None:
        """Drop ``owner``'s claims (all, or those of ``keys``)."""
        with self._transaction() as cur:
            if keys is None:
                cur.execute("DELETE FROM claims WHERE owner = ?", (owner,))
            else:
                cur.executemany(
                    "DELETE FROM claims WHERE owner = ? AND key = ?", ((owner, k) for k in keys)
                )

    def claims(self) -> dict[str, tuple[str, float]]:
        """``{key: (owner, seconds since its last heartbeat)}`` of all claims."""
        now = time.time()
        rows = self._conn.execute("SELECT key, owner, heartbeat FROM claims")
        return {key: (owner, now - beat) for key, owner, beat in rows}

    def write(self, results: Sequence[RunResult], *, study: str | None = None) -> int:
        """Store finished runs in **one** transaction; runs already stored are left untouched.

        Their claims (whoever holds them) are deleted in the same transaction.

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
            metrics: dict[str, Any] = {name: list(getattr(r, name)) for name in _EPOCH_FIELDS}
            if r.init_cost is not None:
                metrics["init_cost"] = r.init_cost
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
            cur.executemany("DELETE FROM claims WHERE key = ?", ((row[0],) for row in rows))
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

    def _check_study(self, study: str) -> None:
        """Raise ``KeyError`` naming the registered studies if ``study`` is not one (a typo
        read as a study without runs)."""
        if self._conn.execute("SELECT 1 FROM studies WHERE name = ?", (study,)).fetchone():
            return
        names = ", ".join(repr(n) for n in self.studies()) or "none"
        raise KeyError(f"no study {study!r} is registered in this store; it has: {names}")

    def study_keys(self, study: str) -> set[str]:
        """Keys of all runs of a registered study, finished or not (``KeyError``: no such
        study)."""
        self._check_study(study)
        rows = self._conn.execute("SELECT key FROM study_runs WHERE study = ?", (study,))
        return {k for (k,) in rows}

    def variants(self, study: str) -> dict[str, set[str]]:
        """``{variant: keys of its runs, finished or not}`` of a registered study, in the order
        first registered; a study without variants is ``{"base": study_keys(study)}``
        (``KeyError``: no such study)."""
        self._check_study(study)
        rows = self._conn.execute(
            "SELECT variant, key FROM variant_runs WHERE study = ? ORDER BY rowid", (study,)
        )
        out: dict[str, set[str]] = {}
        for variant, key in rows:
            out.setdefault(variant, set()).add(key)
        return out or {BASE_VARIANT: self.study_keys(study)}

    def _select(
        self, columns: str, study: str | None, variant: str | None = None
    ) -> sqlite3.Cursor:
        if study is None:
            if variant is not None:
                raise ValueError("records of a variant need the study's name too")
            return self._conn.execute(f"SELECT {columns} FROM runs ORDER BY rowid")
        self._check_study(study)
        if variant is not None:
            names = self.variants(study)
            if variant not in names:
                raise ValueError(
                    f"study {study!r} has no variant {variant!r}; it has: {', '.join(names)}"
                )
            if self._conn.execute(
                "SELECT 1 FROM variant_runs WHERE study = ? LIMIT 1", (study,)
            ).fetchone():
                return self._conn.execute(
                    f"SELECT {columns} FROM runs WHERE key IN (SELECT key FROM variant_runs "
                    "WHERE study = ? AND variant = ?) ORDER BY rowid",
                    (study, variant),
                )
        return self._conn.execute(
            f"SELECT {columns} FROM runs WHERE key IN "
            "(SELECT key FROM study_runs WHERE study = ?) ORDER BY rowid",
            (study,),
        )

    def keys(self, study: str | None = None) -> set[str]:
        """Keys of the finished runs (of one registered study, or all)."""
        return {k for (k,) in self._select("key", study)}

    def __len__(self) -> int:
        return int(self._conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0])

    def __contains__(self, key: object) -> bool:
        row = self._conn.execute("SELECT 1 FROM runs WHERE key = ?", (key,)).fetchone()
        return row is not None

    def results(self, study: str | None = None) -> list[RunResult]:
        """Finished runs as :class:`RunResult` (of one registered study, or all), in the order
        stored."""
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
                    init_cost=epochs.get("init_cost"),
                    **{name: [_float_or_nan(v) for v in epochs[name]] for name in _EPOCH_FIELDS},
                )
            )
        return out

    def records(
        self, study: str | None = None, *, variant: str | None = None, curves: bool = False
    ) -> list[dict[str, Any]]:
        """Finished runs as flat dicts with the columns :data:`RECORD_COLUMNS` (tidy rows).

        Args:
            study: only this study's runs.
            variant: only this variant's runs (of ``study``).
            curves: also include the per-step and per-epoch lists.
        """
        out = []
        for key, config, final, diverged, wall_s, metrics, blob, created in self._select(
            "key, config, final_train_loss, diverged, wall_s, metrics, step_loss, created_at",
            study,
            variant,
        ):
            cfg = json.loads(config)
            stored = json.loads(metrics)
            epochs = {k: [_float_or_nan(v) for v in stored[k]] for k in _EPOCH_FIELDS}
            cost = stored.get("init_cost") or {}
            step_loss = _decode_curve(blob)
            row: dict[str, Any] = {"key": key}
            for name in _CONFIG_COLUMNS:
                value = cfg.get(name, "none" if name == "input_norm" else None)
                row[name] = json.dumps(value, sort_keys=True) if name == "model_cfg" else value
            row.update(
                final_train_loss=_float_or_nan(final),
                last_epoch_minibatch_loss=(
                    math.nan if diverged else last_epoch_mean(step_loss, int(cfg["epochs"]))
                ),
                diverged=bool(diverged),
                final_train_acc=_last(epochs["epoch_train_acc"]),
                final_test_loss=_last(epochs["epoch_test_loss"]),
                final_test_acc=_last(epochs["epoch_test_acc"]),
                n_steps=len(step_loss),
                wall_s=float(wall_s),
                **{col: cost.get(key) for col, key in _INIT_COST_COLUMNS.items()},
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
