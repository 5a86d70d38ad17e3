"""Run a :class:`~initlab.study.spec.StudySpec` into a :class:`~initlab.study.store.Store`.

:func:`run_study` expands the spec, drops the runs the store already holds, groups the rest by
``RunConfig.group_key()`` (runs that one vectorized ``train_runs`` call can train together), splits
big groups into chunks of at most ``chunk_size`` runs, and executes the chunks:

- ``backend="local"``, ``workers=1``: in this process;
- ``backend="local"``, ``workers>1``: a :class:`concurrent.futures.ProcessPoolExecutor` (spawned
  processes; each loads a data set once and keeps the last two it used);
- ``backend="ray"``: one ``ray.remote`` task per chunk. The driver loads each data set once and puts
  it in Ray's object store, so workers need neither the data files nor a shared file system.
  ``ray_address=None`` starts a private local Ray instance with ``workers`` CPUs
  (``ray.init(address="local", num_cpus=workers)``; Ray 2.60 removed ``local_mode``), an address
  such as ``"auto"`` or ``"ray://host:10001"`` connects to a cluster, and a Ray session that is
  already initialized is used as it is (and left running).

Only the driver writes the store (workers send results back): each finished chunk is committed in
one transaction as it arrives, so a study killed at any instant (``SIGKILL`` included) loses at
most the chunks in flight, and running it again trains exactly the missing runs, in the chunks an
uninterrupted call would have trained them in (planned over all the study's runs: the same numbers,
bit for bit, see below). Several drivers
(two ``initlab bench run`` of one study on one store) share the work: a driver claims each chunk's
runs in the store just before training them, keeps its claims alive with a heartbeat, skips runs
another live driver holds, waits for them at the end, and takes over the claims of a driver that
died (:mod:`initlab.study.claims`).

With ``extend_grid``, once all runs are stored the learning-rate grid is extended where a best
rate sits at its edge, and those runs are trained, in rounds (:mod:`initlab.study.extend`).

What a run's result depends on: ``initlab.study.trainer.train_runs`` seeds every run from its
config, so its initial weights, data order and hyper-parameters do not depend on the backend, the
number of workers, the drivers or the chunking. Its float32 arithmetic may, at the level of
rounding: MKL's batched products take kernel paths that depend on how many runs share a product.
A resumed study trains the chunks the uninterrupted one would have (:meth:`WorkQueue.add
<initlab.study.claims.WorkQueue.add>`); a run another study stored is not trained again, so a chunk
some of whose runs it holds trains the others on their own.
On the vectorized engines (``train_runs``'s explicit MLP engine and its vmap engine), a chunk
of 16 runs or more trains as blocks of at most 16 runs fixed by the chunk's size, each block on
one intra-op thread (``trainer._blocks``), so its numbers do not depend on the thread count, by
construction (tested on 16 and 66 runs: ``tests/test_hardening_determinism.py``,
``tests/test_trainer.py``); a smaller chunk is one block on torch's threads. This does not hold
for models trained one run at a time (``engine="loop"``: BatchNorm, dropout, convolutions on the
CPU): each run trains on torch's threads, whatever the chunk's size, so its numbers may differ
between thread counts at the level of rounding, and between ``workers=1`` (this process's
threads) and ``workers > 1`` (``cpu_count // workers`` threads per worker). Measured: a BatchNorm
MLP on svmguide4, one chunk of 16 runs on 1 vs 2 threads, all 16 step-loss curves differ, final
losses by up to 2e-7 (chaotic runs at high learning rates: up to 1e-2); each thread count gives
the same numbers run to run. Such runs are not pinned to one thread, since convolutions gain from
torch's threads (16 resnet20 runs on 400 CIFAR-10 images, 2 cores: 21 s on 2 threads, 35 s on
one). Measured on 54 paper_mlp runs (18 each of dna, satimage, vowel; 5 epochs): chunks
of 18 and of 64 runs on 1 vs 2 threads, 0 differ; one run per chunk vs 18 per chunk (one thread),
8 differ (final losses by up to 1.2e-2, chaotic runs at high learning rates); one run per chunk on
1 vs 2 threads, 11 differ (up to 3.0e-6). (Before the blocks, with MKL's threads inside every
product: chunks of 64 on 1 vs 2 threads 0 differ, tested in
``tests/test_hardening_determinism.py``; one run vs 64 per chunk 9 differ, up to 1.5e-5; one run
per chunk on 1 vs 2 threads 18 differ, up to 4.8e-7; ``MKL_CBWR=AVX2,STRICT`` set before torch is
imported made all 54 bit-identical across both thread counts and chunkings.)

The model for a run is ``build_model(config, n_in=..., n_classes=...)``: the spec's ``model_cfg``
plus the data set's number of features and classes, read from the loaded data. A run whose init
has data-dependent steps (``orthogonal + lsuv``) is initialized in the worker that trains its
chunk, from that data set's training split only, and trained with the chunk
(:mod:`initlab.study.pipelines`); its init's cost is stored with it.

Every chunk trains inside :func:`~initlab._core.heap.kept_heap` (glibc on Linux): a training
step no longer faults in again the memory the step before gave back (12-13% of a CIFAR step on
the strided AlexNet and ResNet-20 at batch 128, ``benchmarks/bench_heap_training.py``; the
numbers are unchanged, only the allocator's settings).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from initlab._core.heap import kept_heap
from initlab.study.claims import (
    DEFAULT_HEARTBEAT_S,
    DEFAULT_STALE_AFTER_S,
    Heartbeat,
    WorkQueue,
    owner_id,
)
from initlab.study.config import RunConfig, RunResult
from initlab.study.extend import extension_runs
from initlab.study.models import check_study_models
from initlab.study.spec import StudySpec, extend_rounds
from initlab.study.store import Store

__all__ = [
    "BACKENDS",
    "StudyData",
    "StudyError",
    "StudySpecMismatch",
    "StudySummary",
    "build_model",
    "load_study_data",
    "plan_chunks",
    "run_study",
]

BACKENDS = ("local", "ray")

#: ``train_fn(configs, train, test, *, model_factory, device, progress) -> list[RunResult]``, the
#: signature of :func:`initlab.study.trainer.train_runs`.
TrainFn = Callable[..., list[RunResult]]

Tensors = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class StudyData:
    """One data set as the runner hands it to a trainer.

    Attributes:
        train: ``(x, y)`` of the training split.
        test: ``(x, y)`` of the test split, or ``None`` when the data set has none.
        n_features: input features (the model's ``n_in``).
        n_classes: classes (the model's ``n_classes``).
    """

    train: Tensors
    test: Tensors | None
    n_features: int
    n_classes: int


#: ``load_fn(dataset_name, data_root) -> StudyData``; must be picklable (a module-level function)
#: for ``workers > 1`` and for Ray.
LoadFn = Callable[[str, "str | None"], StudyData]


def load_study_data(name: str, root: str | None = None) -> StudyData:
    """A data set's train and (where it exists) test split, via :func:`initlab.data.load_dataset`;
    ``name`` may carry options (``"cifar10?train_per_class=500"``: subsets, padding, pixel range;
    see :mod:`initlab.study.datasets`).

    A data set published without a test split (several LIBSVM sets) gives ``test=None``; a
    missing file, or any error reading a published test split, raises.
    """
    from initlab.study.datasets import load_study_data as load

    return load(name, root)


def build_model(config: RunConfig, *, n_in: int, n_classes: int) -> nn.Module:
    """The model of a run: a zoo model or a user factory ``"pkg.module:fn"`` with ``model_cfg``
    plus what the data set determines (``n_in``, ``in_channels``, ``n_classes``; see
    :mod:`initlab.study.models`)."""
    from initlab.study.models import build_model as build

    return build(config, n_in=n_in, n_classes=n_classes)


def _default_train_fn() -> TrainFn:
    from initlab.study.trainer import train_runs

    return train_runs


def _train_chunk(
    configs: Sequence[RunConfig], data: StudyData, train_fn: TrainFn | None, device: str
) -> list[RunResult]:
    """Train one chunk (runs sharing a group key) and check the trainer returned exactly them.

    Runs with a data-dependent init are initialized first, from ``data.train`` only, and handed
    to the trainer as ``initialized`` models (:func:`initlab.study.pipelines.train_chunk`).
    """
    from initlab.study.pipelines import train_chunk

    fn = train_fn if train_fn is not None else _default_train_fn()
    factory = partial(build_model, n_in=data.n_features, n_classes=data.n_classes)
    # the training loop's steps take back what the previous one freed: keep the C heap
    # (glibc: 12-13% of a CIFAR step's time in page faults otherwise; initlab._core.heap)
    with kept_heap():
        results = train_chunk(
            fn, configs, data.train, data.test, model_factory=factory, device=device
        )
    want = sorted(c.key() for c in configs)
    got = sorted(r.config.key() for r in results)
    if got != want:
        raise RuntimeError(
            f"train_fn returned {len(results)} results for {len(configs)} runs, "
            "or results for other configs"
        )
    return results


class _DataCache:
    """The last ``size`` data sets a worker loaded (groups arrive ordered by data set)."""

    def __init__(self, load_fn: LoadFn, root: str | None, size: int = 2) -> None:
        self.load_fn, self.root, self.size = load_fn, root, size
        self._items: OrderedDict[str, StudyData] = OrderedDict()

    def get(self, name: str) -> StudyData:
        if name in self._items:
            self._items.move_to_end(name)
        else:
            self._items[name] = self.load_fn(name, self.root)
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return self._items[name]


# -- process-pool workers ---------------------------------------------------------------------
# A worker process serves one study; its state is set once by the pool's initializer.
_WORKER_STATE: dict[str, Any] = {}


def _pool_init(
    load_fn: LoadFn,
    root: str | None,
    train_fn: TrainFn | None,
    device: str,
    threads: int,
    driver: int,
) -> None:
    """A worker's state; ``driver`` is the pid of the driver that started the pool."""
    torch.set_num_threads(threads)
    _WORKER_STATE.update(cache=_DataCache(load_fn, root), train_fn=train_fn, device=device)
    # A driver killed with SIGKILL cannot stop its pool; without this watchdog the workers would
    # be orphaned, training chunks nobody will store. The driver's pid comes from the driver: a
    # worker reading os.getppid() here would get the pid of init (1) or a subreaper if the driver
    # died while the worker started, and would then wait for that one forever.
    threading.Thread(target=_exit_with_parent, args=(driver,), daemon=True).start()


def _exit_with_parent(
    driver: int, period: float = 1.0, exit_fn: Callable[[int], object] = os._exit
) -> None:
    """Return only through ``exit_fn(1)`` (``os._exit``), called as soon as this process's parent
    is not ``driver`` (it died and the process was reparented), checked every ``period`` s."""
    while os.getppid() == driver:
        time.sleep(period)
    exit_fn(1)


def _pool_task(configs: list[RunConfig]) -> list[RunResult]:
    state = _WORKER_STATE
    data = state["cache"].get(configs[0].dataset)
    return _train_chunk(configs, data, state["train_fn"], state["device"])


# -- Ray --------------------------------------------------------------------------------------


def _ray_task(
    configs: list[RunConfig], data: StudyData, train_fn: TrainFn | None, device: str
) -> list[RunResult]:
    return _train_chunk(configs, data, train_fn, device)


# -- planning and progress --------------------------------------------------------------------


def plan_chunks(configs: Sequence[RunConfig], chunk_size: int) -> list[list[RunConfig]]:
    """Group runs by ``group_key()`` (in order of first appearance) and split each group into chunks
    of at most ``chunk_size`` runs, as even as possible."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    groups: dict[Any, list[RunConfig]] = {}
    for config in configs:
        groups.setdefault(config.group_key(), []).append(config)
    chunks = []
    for runs in groups.values():
        n_chunks = -(-len(runs) // chunk_size)
        size = -(-len(runs) // n_chunks)
        chunks.extend(runs[i : i + size] for i in range(0, len(runs), size))
    return chunks


def _duration(seconds: float) -> str:
    if seconds != seconds:  # nan
        return "?"
    if seconds < 10:
        return f"{seconds:.1f}s"
    seconds = round(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class _Progress:
    """One line per finished chunk on stderr (a tqdm bar instead when stderr is a terminal)."""

    def __init__(self, name: str, n_runs: int, n_chunks: int, enabled: bool) -> None:
        self.name, self.n_runs, self.n_chunks, self.enabled = name, n_runs, n_chunks, enabled
        self.done_runs = self.done_chunks = 0
        self.start = time.perf_counter()
        self.bar: Any = None
        if enabled and n_runs and sys.stderr.isatty():
            try:
                from tqdm.auto import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=n_runs, unit="run", desc=name, file=sys.stderr)

    def say(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def add(self, n_runs: int, n_chunks: int) -> None:
        """More work (a grid extension round)."""
        self.n_runs += n_runs
        self.n_chunks += n_chunks
        if self.bar is not None:
            self.bar.total = self.n_runs
            self.bar.refresh()

    def others_done(self, n_runs: int) -> None:
        """Runs another driver stored (they count as done here too)."""
        self.done_runs += n_runs
        if self.bar is not None:
            self.bar.update(n_runs)
        self.say(
            f"[{self.name}] {n_runs} runs stored by another driver | "
            f"runs {self.done_runs}/{self.n_runs}"
        )

    def chunk_done(self, chunk: Sequence[RunConfig], failed: bool = False) -> None:
        self.done_runs += len(chunk)
        self.done_chunks += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(len(chunk))
            self.bar.set_postfix_str(f"chunk {self.done_chunks}/{self.n_chunks}")
            if not failed:
                return
        elapsed = time.perf_counter() - self.start
        left = max(0, self.n_runs - self.done_runs)
        eta = elapsed / self.done_runs * left if self.done_runs else float("nan")
        status = "FAILED" if failed else "done"
        self.say(
            f"[{self.name}] chunk {self.done_chunks}/{self.n_chunks} {status} "
            f"({chunk[0].dataset}, {len(chunk)} runs) | runs {self.done_runs}/{self.n_runs} | "
            f"elapsed {_duration(elapsed)} | ETA {_duration(eta) if left else '0s'}"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# -- executors: pull claimed chunks, train them, hand back the results ------------------------

_NextChunk = Callable[[], "list[RunConfig] | None"]
_Finish = Callable[[list[RunConfig], "list[RunResult] | None", str], None]


class _LocalExecutor:
    """Chunks trained one after the other in this process."""

    def __init__(self, load: LoadFn, root: str | None, train_fn: TrainFn | None, device: str):
        self.cache = _DataCache(load, root)
        self.train_fn, self.device = train_fn, device

    def __enter__(self) -> _LocalExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def run(self, next_chunk: _NextChunk, finish: _Finish) -> None:
        while (chunk := next_chunk()) is not None:
            try:
                data = self.cache.get(chunk[0].dataset)
                results = _train_chunk(chunk, data, self.train_fn, self.device)
            except Exception:
                finish(chunk, None, traceback.format_exc())
            else:
                finish(chunk, results, "")


class _PoolExecutor:
    """A process pool; ``workers + 1`` chunks in flight (claimed just before they are sent)."""

    def __init__(
        self,
        load: LoadFn,
        root: str | None,
        train_fn: TrainFn | None,
        device: str,
        workers: int,
    ) -> None:
        threads = max(1, (os.cpu_count() or 1) // workers)
        self.args = (load, root, train_fn, device, threads, os.getpid())
        self.workers = workers
        self.pool: Any = None

    def __enter__(self) -> _PoolExecutor:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # spawn, not fork: forking a process that already runs torch's thread pools can deadlock.
        self.pool = ProcessPoolExecutor(
            max_workers=self.workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_pool_init,
            initargs=self.args,
        )
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def run(self, next_chunk: _NextChunk, finish: _Finish) -> None:
        from concurrent.futures import FIRST_COMPLETED, wait

        running: dict[Any, list[RunConfig]] = {}

        def top_up() -> None:
            while len(running) <= self.workers and (chunk := next_chunk()) is not None:
                running[self.pool.submit(_pool_task, chunk)] = chunk

        top_up()
        while running:
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                chunk, error = running.pop(future), future.exception()
                if error is None:
                    finish(chunk, future.result(), "")
                else:
                    finish(chunk, None, "".join(traceback.format_exception(error)))
            top_up()


class _RayExecutor:
    """One ``ray.remote`` task per chunk; twice the cluster's CPUs in flight. The driver loads each
    data set once and puts it in Ray's object store."""

    def __init__(
        self,
        load: LoadFn,
        root: str | None,
        train_fn: TrainFn | None,
        device: str,
        workers: int,
        address: str | None,
        quiet: bool = False,
    ) -> None:
        self.load, self.root, self.train_fn, self.device = load, root, train_fn, device
        self.workers, self.address, self.quiet = workers, address, quiet
        self.started = False
        self.data_refs: dict[str, Any] = {}
        self.load_errors: dict[str, str] = {}

    def __enter__(self) -> _RayExecutor:
        try:
            import ray
        except ImportError as err:
            raise ImportError("backend='ray' needs Ray: pip install ray (or initlab[ray])") from err
        if not ray.is_initialized():
            # quiet (progress=False): neither Ray's own log lines nor its workers' output
            logs: dict[str, Any] = (
                {"log_to_driver": False, "logging_level": logging.ERROR} if self.quiet else {}
            )
            if self.address is None:
                ray.init(address="local", num_cpus=self.workers, include_dashboard=False, **logs)
            else:
                ray.init(address=self.address, **logs)
            self.started = True
        self.ray = ray
        self.task = ray.remote(num_cpus=1)(_ray_task)
        self.in_flight = 2 * max(1, int(ray.cluster_resources().get("CPU", self.workers)))
        return self

    def __exit__(self, *exc: object) -> None:
        if self.started:
            self.ray.shutdown()

    def _submit(self, chunk: list[RunConfig], refs: dict[Any, list[RunConfig]], finish: _Finish):
        name = chunk[0].dataset
        if name not in self.data_refs and name not in self.load_errors:
            try:
                self.data_refs[name] = self.ray.put(self.load(name, self.root))
            except Exception:
                self.load_errors[name] = traceback.format_exc()
        if name in self.load_errors:
            finish(chunk, None, self.load_errors[name])
        else:
            ref = self.task.remote(chunk, self.data_refs[name], self.train_fn, self.device)
            refs[ref] = chunk

    def run(self, next_chunk: _NextChunk, finish: _Finish) -> None:
        refs: dict[Any, list[RunConfig]] = {}

        def top_up() -> None:
            while len(refs) < self.in_flight and (chunk := next_chunk()) is not None:
                self._submit(chunk, refs, finish)

        top_up()
        while refs:
            done, _ = self.ray.wait(list(refs), num_returns=1)
            for ref in done:
                chunk = refs.pop(ref)
                try:
                    results = self.ray.get(ref)
                except Exception:
                    finish(chunk, None, traceback.format_exc())
                else:
                    finish(chunk, results, "")
            top_up()


# -- the driver -------------------------------------------------------------------------------


class StudyError(RuntimeError):
    """Some chunks failed; the runs of all other chunks were stored."""


@dataclass
class StudySummary:
    """What :func:`run_study` did.

    Attributes:
        name: the study.
        store_path: the store written.
        n_runs: runs in the study (of all its variants, each distinct run once), before any grid
            extension.
        n_skipped: runs already in the store before this call.
        n_trained: runs trained by this call (all stored; a run another driver stored first,
            after this one took over its stale claim, keeps the first result).
        n_by_others: runs of this call's queue that another driver trained and stored.
        n_failed: runs of chunks that raised (not stored; a new call retries them).
        n_chunks: chunks executed by this call.
        n_extended: runs added by grid extension (stored by this call or another driver, or
            stored before).
        n_extended_new: of those, the runs that were not stored yet when this call added them.
        extension_rounds: grid extension rounds that added runs.
        edges_left: ``variant/dataset/scheme (edge)`` of the best rates still at the grid's edge
            when extension stopped at its round limit (empty without extension).
        wall_s: wall time of the call.
        errors: one message (with traceback) per failed chunk.
    """

    name: str
    store_path: Path
    n_runs: int
    n_skipped: int
    n_trained: int = 0
    n_by_others: int = 0
    n_failed: int = 0
    n_chunks: int = 0
    n_extended: int = 0
    n_extended_new: int = 0
    extension_rounds: int = 0
    edges_left: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def n_already_stored(self) -> int:
        """Runs of the spec's grid and of grid extension found stored when this call queued
        them: ``n_skipped + n_extended - n_extended_new``."""
        return self.n_skipped + self.n_extended - self.n_extended_new


def run_study(
    spec: StudySpec | str | Path,
    store_path: str | Path,
    *,
    backend: str = "local",
    workers: int = 1,
    ray_address: str | None = None,
    progress: bool = True,
    train_fn: TrainFn | None = None,
    load_fn: LoadFn | None = None,
    chunk_size: int = 64,
    device: str = "cpu",
    data_root: str | None = None,
    extend_grid: bool | int | None = None,
    heartbeat_s: float = DEFAULT_HEARTBEAT_S,
    stale_after: float = DEFAULT_STALE_AFTER_S,
) -> StudySummary:
    """Train every run of a study that the store does not hold yet, storing chunks as they finish.

    Args:
        spec: the study, or a path to its YAML file. All its variants run; a run two variants
            share is trained once.
        store_path: the SQLite store file (created if missing). Runs already stored (by any
            study) are skipped; the study's name, spec and the keys of all its runs (per variant)
            are recorded in the store. The name is bound to the spec's runs: the same spec (or
            one differing only in ``loss``, ``extend_grid`` or ``data_root``) resumes, a spec
            with other runs under that name is refused (:class:`StudySpecMismatch`). Other
            drivers may run the same study on the same store at the same time: the work is shared
            through claims (:mod:`initlab.study.claims`).
        backend: ``"local"`` or ``"ray"``.
        workers: local: processes (1: this process); Ray: CPUs of the local instance started when
            ``ray_address`` is ``None`` (ignored when connecting to a cluster).
        ray_address: Ray cluster address (``"auto"``, ``"ray://host:10001"``, ...); ``None``:
            a private local instance (or the already initialized session).
        progress: print a line per finished chunk (runs done, elapsed, ETA) to stderr.
        train_fn: trains one chunk, with the signature of
            :func:`initlab.study.trainer.train_runs` (the default). Must be picklable (a
            module-level function) for ``workers > 1`` and for Ray, and importable by the workers
            (Ray on a cluster: installed there, or shipped with a ``runtime_env``). A script that
            runs with ``workers > 1`` needs the ``if __name__ == "__main__":`` guard (the pool
            spawns its processes). A chunk with data-dependent inits (``orthogonal + lsuv``) is
            also given ``initialized=[model or None, ...]``, the initialized models of those runs
            (:func:`initlab.study.pipelines.train_chunk`).
        load_fn: ``load_fn(name, data_root) -> StudyData``; default :func:`load_study_data`.
        chunk_size: most runs per ``train_fn`` call; a kill loses at most the chunks in flight.
        device: torch device the trainer uses.
        data_root: overrides ``spec.data_root``.
        extend_grid: after the runs, extend the learning-rate grid where a best rate sits at its
            edge (:mod:`initlab.study.extend`) for at most this many rounds (``True``: the spec's
            default of 6, ``False``: none); ``None``: the spec's ``extend_grid``.
        heartbeat_s: seconds between renewals of this driver's claims.
        stale_after: seconds without a heartbeat after which another driver's claims are taken
            over (keep it several times the longest ``heartbeat_s`` of the drivers).

    Returns:
        a :class:`StudySummary`.

    Raises:
        StudySpecMismatch: the store holds a study of this name with other runs; nothing is
            trained or written.
        ValueError: a bad option (``stale_after`` not longer than ``heartbeat_s``, ``workers``
            or ``chunk_size`` below 1, an unknown ``backend``), before the store is created.
        StudyError: after all chunks ran, if some failed (their runs are not stored).
    """
    if not isinstance(spec, StudySpec):
        spec = StudySpec.from_yaml(spec)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if workers < 1 or chunk_size < 1:
        raise ValueError(f"workers and chunk_size must be >= 1, got {workers}, {chunk_size}")
    if not stale_after > heartbeat_s:
        raise ValueError(
            f"stale_after ({stale_after:g} s) must be longer than heartbeat_s ({heartbeat_s:g} s), "
            "or other drivers take over this driver's live runs"
        )
    rounds = spec.extend_grid if extend_grid is None else extend_rounds(extend_grid)
    load = load_fn if load_fn is not None else load_study_data
    root = data_root if data_root is not None else spec.data_root
    start = time.perf_counter()
    configs = spec.runs()
    check_study_models(configs, load, root)  # a model/data misfit fails here, before any training
    owner = owner_id()
    with Store(store_path) as store, Heartbeat(store_path, owner, heartbeat_s):
        _register(store, spec, configs)
        queue = WorkQueue(
            store, owner, partial(plan_chunks, chunk_size=chunk_size), stale_after=stale_after
        )
        n_pending = queue.add(configs)
        summary = StudySummary(spec.name, Path(store_path), len(configs), len(configs) - n_pending)
        bar = _Progress(spec.name, n_pending, queue.n_planned, progress)
        bar.say(
            f"[{spec.name}] {len(configs)} runs in {len(spec.variant_specs())} variant(s), "
            f"{summary.n_skipped} already stored, {n_pending} to train in {queue.n_planned} "
            f"chunks ({backend}, workers={workers})"
        )
        recorder = _Recorder(store, queue, summary, bar)
        if backend == "ray":
            executor: Any = _RayExecutor(
                load, root, train_fn, device, workers, ray_address, quiet=not progress
            )
        elif workers > 1:
            executor = _PoolExecutor(load, root, train_fn, device, workers)
        else:
            executor = _LocalExecutor(load, root, train_fn, device)
        try:
            with executor:
                drain = partial(_drain, queue, executor, recorder, bar)
                drain()
                if rounds and not summary.errors:
                    _extend(spec, store, queue, rounds, summary, bar, drain)
        finally:
            bar.close()
        summary.n_by_others = queue.n_by_others
    return _finished(summary, bar, start)


class StudySpecMismatch(ValueError):
    """A study's name is registered in the store with a spec of other runs."""


def _register(store: Store, spec: StudySpec, configs: Sequence[RunConfig]) -> None:
    """The study's spec, all its runs and each variant's runs, in the store.

    A study's name is bound to its runs: a spec that adds, drops or changes runs (other data sets,
    seeds, epochs, ...) is refused under a name registered with another spec, since its records,
    tables and report would mix the two. The members a store holds that are not runs of the spec
    (left by an initlab that let a name change its runs) stop being members; grid extension runs
    (the spec's runs at other rates) stay.
    """
    flat = spec.variant_specs()
    variants = {name: [c.key() for c in s.runs()] for name, s in flat.items()}
    current = {name: set(keys) for name, keys in variants.items()}

    def check(registered: dict[str, Any]) -> None:
        differences = spec.run_differences(registered, current)
        if differences:
            raise StudySpecMismatch(
                f"study {spec.name!r} is registered in {store.path or ':memory:'} with a spec of "
                f"other runs ({'; '.join(differences)}). A study's name is bound to its runs, "
                "so that its records and report never mix two protocols: run this spec under a "
                "new name (runs already in this store are reused, not trained again) or in a new "
                "store."
            )

    def keep(variant: str, key: str, config: dict[str, Any]) -> bool:
        try:
            run = RunConfig.from_dict(config)
        except (TypeError, ValueError):
            return False
        return variant in flat and flat[variant].owns(run) and run.key() == key

    store.register_study(
        spec.name, spec.to_dict(), [c.key() for c in configs], variants, check=check, keep=keep
    )


class _Recorder:
    """What happens to a finished chunk: its results stored (or its claims released and the
    error kept), the summary and the progress updated."""

    def __init__(self, store: Store, queue: WorkQueue, summary: StudySummary, bar: _Progress):
        self.store, self.queue, self.summary, self.bar = store, queue, summary, bar

    def __call__(self, chunk: list[RunConfig], results: list[RunResult] | None, error: str):
        summary = self.summary
        summary.n_chunks += 1
        if results is not None:
            self.store.write(results, study=summary.name)
            summary.n_trained += len(results)
        else:
            self.queue.release(chunk)
            summary.n_failed += len(chunk)
            summary.errors.append(f"{chunk[0].dataset} ({len(chunk)} runs): {error}")
            self.bar.say(f"[{summary.name}] chunk failed: {error.strip().splitlines()[-1]}")
        self.bar.chunk_done(chunk, failed=results is None)


def _finished(summary: StudySummary, bar: _Progress, start: float) -> StudySummary:
    summary.wall_s = time.perf_counter() - start
    bar.say(
        f"[{summary.name}] finished: {summary.n_trained} runs trained, "
        f"{summary.n_already_stored} already stored, {summary.n_by_others} trained by another "
        f"driver, {summary.n_failed} failed, "
        f"{_duration(summary.wall_s)}"
    )
    if summary.errors:
        raise StudyError(
            f"{len(summary.errors)} of {summary.n_chunks} chunks failed ({summary.n_failed} runs "
            f"not stored; run the study again to retry them). First error:\n{summary.errors[0]}"
        )
    return summary


def _drain(queue: WorkQueue, executor: Any, finish: _Finish, bar: _Progress) -> None:
    """Train what this driver can claim; wait for the runs other drivers hold; take over the
    stale ones; return when every queued run is stored (or failed here)."""
    while True:
        executor.run(partial(queue.next_chunk, bar.others_done), finish)
        if not queue.wait_for_others(bar.others_done):
            return


def _extend(
    spec: StudySpec,
    store: Store,
    queue: WorkQueue,
    rounds: int,
    summary: StudySummary,
    bar: _Progress,
    drain: Callable[[], None],
) -> None:
    """Grid extension (:mod:`initlab.study.extend`): up to ``rounds`` rounds, each adding the next
    power of two beyond every edge cell of every variant, then training those runs.

    Round ``r`` looks only at the spec's runs and this call's rounds ``1 .. r-1`` (all stored when
    it starts), not at runs another driver's later rounds stored meanwhile: every driver, and
    every resumed call, then computes the same rounds.
    """
    flat = spec.variant_specs()
    known = {name: {c.key() for c in vspec.runs()} for name, vspec in flat.items()}

    def grid(name: str) -> list[dict[str, Any]]:
        return [r for r in store.records(spec.name, variant=name) if r["key"] in known[name]]

    for round_ in range(1, rounds + 1):
        added: dict[str, list[RunConfig]] = {}
        n_cells = 0
        for name, vspec in flat.items():
            runs, cells = extension_runs(vspec, grid(name))
            if runs:
                added[name], n_cells = runs, n_cells + len(cells)
                known[name].update(c.key() for c in runs)
        if not added:
            return
        store.add_runs(spec.name, {v: [c.key() for c in runs] for v, runs in added.items()})
        new = list({c.key(): c for runs in added.values() for c in runs}.values())
        n_todo = queue.add(new)
        summary.n_extended += len(new)
        summary.n_extended_new += n_todo
        summary.extension_rounds = round_
        bar.add(n_todo, queue.n_planned)
        bar.say(
            f"[{spec.name}] grid extension round {round_}/{rounds}: {n_cells} cells with the best "
            f"rate at an edge, {len(new)} runs ({n_todo} not stored yet)"
        )
        drain()
        if summary.errors:
            return
    for name, vspec in flat.items():
        _, cells = extension_runs(vspec, grid(name))
        summary.edges_left += [f"{name}/{d}/{s} ({e})" for d, s, e in cells]
    if summary.edges_left:
        bar.say(
            f"[{spec.name}] grid extension stopped after {rounds} rounds; best rates still at an "
            f"edge: {', '.join(summary.edges_left)}"
        )
