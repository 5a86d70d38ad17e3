"""Sharing one study between several drivers: claims in the store, a heartbeat, a work queue.

Two ``initlab bench run`` on one store share the work instead of both training every run:

- before training a chunk, a driver **claims** its runs in the store (one transaction,
  :meth:`~initlab.study.store.Store.claim`): a run already stored, or claimed by another driver
  whose heartbeat is fresh, is not taken;
- a :class:`Heartbeat` thread renews the driver's claims every ``period`` seconds (its own SQLite
  connection); storing a run deletes its claim; a failed chunk's claims are released;
- a claim whose heartbeat is older than ``stale_after`` seconds belongs to a driver that was killed
  (or hangs): any driver takes it over. A claim of a driver on the same machine whose process is
  gone is dropped at once (the owner id holds the host name and the process id), so resuming a
  killed study on one machine does not wait ``stale_after``;
- when a driver has nothing left to claim but runs claimed by others are still unfinished, it
  waits for them (:meth:`WorkQueue.wait_for_others`) and takes over those that go stale, so every
  driver returns only when the whole study is stored (or failed in its hands).

A driver that is alive but silent for longer than ``stale_after`` (a suspended machine) may see its
runs trained a second time by another; the store keeps the first result (``INSERT OR IGNORE``),
so this costs time, never correctness.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

from initlab.study.config import RunConfig
from initlab.study.store import Store

__all__ = [
    "DEFAULT_HEARTBEAT_S",
    "DEFAULT_STALE_AFTER_S",
    "Heartbeat",
    "WorkQueue",
    "drop_dead_claims",
    "machine_id",
    "owner_id",
    "owner_is_dead",
    "process_is_gone",
]

#: Seconds between two renewals of a driver's claims.
DEFAULT_HEARTBEAT_S = 10.0
#: Seconds without a heartbeat after which a claim is taken over.
DEFAULT_STALE_AFTER_S = 60.0


def machine_id() -> str:
    """This machine's name, with the process-id namespace where Linux tells it (two containers
    with one host name do not see each other's processes)."""
    try:
        namespace = f"/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        namespace = ""
    return socket.gethostname().replace(":", "_") + namespace


def owner_id() -> str:
    """A driver's id in the claims table: ``machine:pid:random`` (unique per call)."""
    return f"{machine_id()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def owner_is_dead(owner: str) -> bool:
    """Whether ``owner`` (an :func:`owner_id`) ran on this machine in a process that is gone."""
    machine, _, rest = owner.partition(":")
    pid_text = rest.partition(":")[0]
    if machine != machine_id() or not pid_text.isdigit():
        return False
    return process_is_gone(int(pid_text))


def process_is_gone(pid: int) -> bool:
    """Whether no process of id ``pid`` runs on this machine (in this process-id namespace);
    ``False`` for one that runs, another user's included, and for an id no process can have
    (``os.kill`` would signal a process group for ``pid <= 0``)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):  # alive, another user's; no process id
        return False
    return False


def drop_dead_claims(store: Store) -> int:
    """Release the claims of drivers of this machine whose process is gone; returns how many."""
    dead = {owner for owner, _ in store.claims().values() if owner_is_dead(owner)}
    n = sum(1 for owner, _ in store.claims().values() if owner in dead)
    for owner in dead:
        store.release(owner)
    return n


class Heartbeat:
    """Renew ``owner``'s claims every ``period`` seconds from a thread, while in the ``with``.

    On exit the thread stops and all of ``owner``'s remaining claims are released (a driver that
    raises hands its claimed runs back at once instead of after ``stale_after``).
    """

    def __init__(self, store_path: str | Path, owner: str, period: float) -> None:
        if not period > 0:
            raise ValueError(f"the heartbeat period must be positive, got {period}")
        self.store_path, self.owner, self.period = store_path, owner, period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="initlab-heartbeat", daemon=True)

    def _run(self) -> None:
        with Store(self.store_path) as store:
            while not self._stop.wait(self.period):
                store.heartbeat(self.owner)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        with Store(self.store_path) as store:
            store.release(self.owner)


class WorkQueue:
    """The runs one driver still has to see finished, handed out as claimed chunks.

    Args:
        store: the driver's open store.
        owner: the driver's id (:func:`owner_id`).
        plan: ``plan(configs) -> chunks`` (:func:`initlab.study.runner.plan_chunks` with the
            chunk size).
        stale_after: seconds without a heartbeat after which another driver's claim is taken.
        poll: seconds between two looks at the store while waiting for other drivers.
    """

    def __init__(
        self,
        store: Store,
        owner: str,
        plan: Callable[[Sequence[RunConfig]], list[list[RunConfig]]],
        *,
        stale_after: float,
        poll: float = 0.5,
    ) -> None:
        if not stale_after > 0:
            raise ValueError(f"stale_after must be positive, got {stale_after}")
        self.store, self.owner, self.plan = store, owner, plan
        self.stale_after, self.poll = stale_after, poll
        self._chunks: list[list[RunConfig]] = []
        self._chunk_of: dict[str, int] = {}  # run key -> its planned chunk (the plan's order)
        self._planned = 0  # chunks planned so far
        self._waiting: dict[str, RunConfig] = {}  # claimed by another driver when we looked
        self.failed: set[str] = set()  # failed in this driver: not retried by it
        self.n_by_others = 0  # queued runs another driver stored

    def add(self, configs: Sequence[RunConfig]) -> int:
        """Queue runs (those not stored yet); returns how many were queued.

        The chunks are planned over all of ``configs``, stored or not, and then the stored runs
        are left out: a chunk is stored whole, so a study resumed after a kill trains the very
        chunks an uninterrupted call would have, and its runs' float32 arithmetic (which the
        number of runs sharing a product can change at the level of rounding:
        :mod:`initlab.study.runner`) is the same, bit for bit. Only a chunk some of whose runs
        another study stored trains the rest on their own."""
        drop_dead_claims(self.store)
        stored = self.store.keys()
        queued = 0
        for chunk in self.plan(configs):
            todo = [c for c in chunk if c.key() not in stored]
            if todo:
                self._chunk_of.update((c.key(), self._planned) for c in todo)
                self._planned += 1
                self._chunks.append(todo)
                queued += len(todo)
        return queued

    @property
    def n_planned(self) -> int:
        """Chunks queued and not handed out yet."""
        return len(self._chunks)

    def next_chunk(self, on_done: Callable[[int], None] | None = None) -> list[RunConfig] | None:
        """The next chunk this driver claimed (the part of a planned chunk it could claim), or
        ``None`` when no queued chunk has a claimable run; never waits. Runs another driver
        holds are remembered for :meth:`wait_for_others`; ``on_done(n)`` is called with the
        number of a planned chunk's runs another driver stored since this one planned them (as
        :meth:`wait_for_others` does for those it waited for)."""
        while self._chunks:
            chunk = self._chunks.pop(0)
            got = set(self.store.claim([c.key() for c in chunk], self.owner,
                                       stale_after=self.stale_after))  # fmt: skip
            stored = self.store.keys() if len(got) < len(chunk) else set()
            done = 0
            for c in chunk:
                if c.key() in got:
                    continue
                if c.key() in stored:  # stored by another driver since this one planned
                    done += 1
                else:
                    self._waiting[c.key()] = c
            self.n_by_others += done
            if done and on_done is not None:
                on_done(done)
            mine = [c for c in chunk if c.key() in got]
            if mine:
                return mine
        return None

    def release(self, chunk: Sequence[RunConfig]) -> None:
        """Hand a failed chunk's runs back (not retried by this driver)."""
        keys = [c.key() for c in chunk]
        self.failed.update(keys)
        self.store.release(self.owner, keys)

    def wait_for_others(self, on_done: Callable[[int], None] | None = None) -> bool:
        """Wait while runs claimed by other drivers are unfinished and their claims are fresh.

        Returns ``True`` when some of them went stale (or were released by a driver they failed
        in) and were queued again (call :meth:`next_chunk`), ``False`` when all are stored.
        ``on_done(n)`` is
        called with the number of runs other drivers stored since the last look.
        """
        while self._waiting:
            stored = self.store.keys()
            done = [k for k in self._waiting if k in stored]
            for k in done:
                del self._waiting[k]
            self.n_by_others += len(done)
            if done and on_done is not None:
                on_done(len(done))
            drop_dead_claims(self.store)
            claims = self.store.claims()
            free = [
                c
                for k, c in self._waiting.items()
                if k not in self.failed and (k not in claims or claims[k][1] >= self.stale_after)
            ]
            if free:
                by_chunk: dict[int, list[RunConfig]] = {}
                for c in free:  # in the chunks they were planned in, as the other driver had them
                    del self._waiting[c.key()]
                    by_chunk.setdefault(self._chunk_of[c.key()], []).append(c)
                self._chunks += [by_chunk[i] for i in sorted(by_chunk)]
                return True
            if self._waiting:
                time.sleep(self.poll)
        return False
