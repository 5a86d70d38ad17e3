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

Only this process writes the store: each finished chunk is committed in one transaction as it
arrives, so a study killed at any instant (``SIGKILL`` included) loses at most the chunks in flight,
and running it again trains exactly the missing runs. Results do not depend on the backend, the
number of workers or the chunking, as long as the trainer's results depend only on each run's config
(``initlab.study.trainer.train_runs`` seeds every run from its config).

The model for a run is ``build_model(config, n_in=..., n_classes=...)``: the spec's ``model_cfg``
plus the data set's number of features and classes, read from the loaded data.
"""

from __future__ import annotations

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

from initlab.study.config import RunConfig, RunResult
from initlab.study.spec import StudySpec
from initlab.study.store import Store

__all__ = [
    "BACKENDS",
    "StudyData",
    "StudyError",
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
    """A data set's train and (where it exists) test split, via :func:`initlab.data.load_dataset`.

    A data set published without a test split (several LIBSVM sets) gives ``test=None``; a
    missing file still raises.
    """
    from initlab.data import load_dataset

    train = load_dataset(name, "train", root=root)  # bad names and missing files raise here
    try:
        test = load_dataset(name, "test", root=root)
    except ValueError:  # the name resolved above, so this is "no 'test' split"
        test = None
    return StudyData(
        train=(train.x, train.y),
        test=None if test is None else (test.x, test.y),
        n_features=int(train.n_features),
        n_classes=int(train.n_classes),
    )


def build_model(config: RunConfig, *, n_in: int, n_classes: int) -> nn.Module:
    """The model of a run: ``create_model(config.model, n_in=..., n_classes=..., **model_cfg)``
    (the model registry ``initlab.zoo.create_model``)."""
    from initlab.zoo import create_model

    kwargs = {**config.model_kwargs, "n_in": n_in, "n_classes": n_classes}
    return create_model(config.model, **kwargs)


def _default_train_fn() -> TrainFn:
    from initlab.study.trainer import train_runs

    return train_runs


def _train_chunk(
    configs: Sequence[RunConfig], data: StudyData, train_fn: TrainFn | None, device: str
) -> list[RunResult]:
    """Train one chunk (runs sharing a group key) and check the trainer returned exactly them."""
    fn = train_fn if train_fn is not None else _default_train_fn()
    factory = partial(build_model, n_in=data.n_features, n_classes=data.n_classes)
    results = list(fn(list(configs), data.train, data.test, model_factory=factory, device=device))
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
    load_fn: LoadFn, root: str | None, train_fn: TrainFn | None, device: str, threads: int
) -> None:
    torch.set_num_threads(threads)
    _WORKER_STATE.update(cache=_DataCache(load_fn, root), train_fn=train_fn, device=device)
    # A driver killed with SIGKILL cannot stop its pool; without this watchdog the workers would
    # be orphaned, training chunks nobody will store.
    parent = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()


def _exit_with_parent(parent: int, period: float = 1.0) -> None:
    while os.getppid() == parent:
        time.sleep(period)
    os._exit(1)


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
        left = self.n_runs - self.done_runs
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


# -- the driver -------------------------------------------------------------------------------


class StudyError(RuntimeError):
    """Some chunks failed; the runs of all other chunks were stored."""


@dataclass
class StudySummary:
    """What :func:`run_study` did.

    Attributes:
        name: the study.
        store_path: the store written.
        n_runs: runs in the study.
        n_skipped: runs already in the store before this call.
        n_trained: runs trained and stored by this call.
        n_failed: runs of chunks that raised (not stored; a new call retries them).
        n_chunks: chunks executed.
        wall_s: wall time of the call.
        errors: one message (with traceback) per failed chunk.
    """

    name: str
    store_path: Path
    n_runs: int
    n_skipped: int
    n_trained: int = 0
    n_failed: int = 0
    n_chunks: int = 0
    wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)


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
) -> StudySummary:
    """Train every run of a study that the store does not hold yet, storing chunks as they finish.

    Args:
        spec: the study, or a path to its YAML file.
        store_path: the SQLite store (created if missing). Runs already stored (by any study) are
            skipped; the study's name and the keys of all its runs are recorded in the store.
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
            spawns its processes).
        load_fn: ``load_fn(name, data_root) -> StudyData``; default :func:`load_study_data`.
        chunk_size: most runs per ``train_fn`` call; a kill loses at most the chunks in flight.
        device: torch device the trainer uses.
        data_root: overrides ``spec.data_root``.

    Returns:
        a :class:`StudySummary`.

    Raises:
        StudyError: after all chunks ran, if some failed (their runs are not stored).
    """
    if not isinstance(spec, StudySpec):
        spec = StudySpec.from_yaml(spec)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    load = load_fn if load_fn is not None else load_study_data
    root = data_root if data_root is not None else spec.data_root
    start = time.perf_counter()

    configs = spec.runs()
    with Store(store_path) as store:
        store.register_study(spec.name, spec.to_dict(), (c.key() for c in configs))
        finished = store.keys()
        pending = [c for c in configs if c.key() not in finished]
        chunks = plan_chunks(pending, chunk_size)
        summary = StudySummary(
            name=spec.name,
            store_path=Path(store_path),
            n_runs=len(configs),
            n_skipped=len(configs) - len(pending),
            n_chunks=len(chunks),
        )
        bar = _Progress(spec.name, len(pending), len(chunks), progress)
        bar.say(
            f"[{spec.name}] {len(configs)} runs, {summary.n_skipped} already stored, "
            f"{len(pending)} to train in {len(chunks)} chunks ({backend}, workers={workers})"
        )

        def finish(chunk: list[RunConfig], results: list[RunResult] | None, error: str) -> None:
            if results is not None:
                summary.n_trained += store.write(results, study=spec.name)
            else:
                summary.n_failed += len(chunk)
                summary.errors.append(f"{chunk[0].dataset} ({len(chunk)} runs): {error}")
                bar.say(f"[{spec.name}] chunk failed: {error.strip().splitlines()[-1]}")
            bar.chunk_done(chunk, failed=results is None)

        try:
            if not chunks:
                pass
            elif backend == "ray":
                _execute_ray(chunks, load, root, train_fn, device, workers, ray_address, finish)
            elif workers == 1:
                cache = _DataCache(load, root)
                for chunk in chunks:
                    try:
                        results = _train_chunk(chunk, cache.get(chunk[0].dataset), train_fn, device)
                    except Exception:
                        finish(chunk, None, traceback.format_exc())
                    else:
                        finish(chunk, results, "")
            else:
                _execute_pool(chunks, load, root, train_fn, device, workers, finish)
        finally:
            bar.close()
    summary.wall_s = time.perf_counter() - start
    bar.say(
        f"[{spec.name}] finished: {summary.n_trained} runs trained, {summary.n_skipped} skipped, "
        f"{summary.n_failed} failed, {_duration(summary.wall_s)}"
    )
    if summary.errors:
        raise StudyError(
            f"{len(summary.errors)} of {len(chunks)} chunks failed ({summary.n_failed} runs not "
            f"stored; run the study again to retry them). First error:\n{summary.errors[0]}"
        )
    return summary


_Finish = Callable[[list[RunConfig], "list[RunResult] | None", str], None]


def _execute_pool(
    chunks: list[list[RunConfig]],
    load: LoadFn,
    root: str | None,
    train_fn: TrainFn | None,
    device: str,
    workers: int,
    finish: _Finish,
) -> None:
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    threads = max(1, (os.cpu_count() or 1) // workers)
    # spawn, not fork: forking a process that already runs torch's thread pools can deadlock.
    pool = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_pool_init,
        initargs=(load, root, train_fn, device, threads),
    )
    try:
        futures = {pool.submit(_pool_task, chunk): chunk for chunk in chunks}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                error = future.exception()
                if error is None:
                    finish(futures[future], future.result(), "")
                else:
                    text = "".join(traceback.format_exception(error))
                    finish(futures[future], None, text)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _execute_ray(
    chunks: list[list[RunConfig]],
    load: LoadFn,
    root: str | None,
    train_fn: TrainFn | None,
    device: str,
    workers: int,
    address: str | None,
    finish: _Finish,
) -> None:
    try:
        import ray
    except ImportError as err:
        raise ImportError("backend='ray' needs Ray: pip install ray (or initlab[ray])") from err

    started = False
    if not ray.is_initialized():
        if address is None:
            ray.init(address="local", num_cpus=workers, include_dashboard=False)
        else:
            ray.init(address=address)
        started = True
    try:
        task = ray.remote(num_cpus=1)(_ray_task)
        data_refs: dict[str, Any] = {}
        load_errors: dict[str, str] = {}
        refs = {}
        for chunk in chunks:
            name = chunk[0].dataset
            if name not in data_refs and name not in load_errors:
                try:
                    data_refs[name] = ray.put(load(name, root))
                except Exception:
                    load_errors[name] = traceback.format_exc()
            if name in load_errors:
                finish(chunk, None, load_errors[name])
            else:
                refs[task.remote(chunk, data_refs[name], train_fn, device)] = chunk
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                try:
                    results = ray.get(ref)
                except Exception:
                    finish(refs[ref], None, traceback.format_exc())
                else:
                    finish(refs[ref], results, "")
    finally:
        if started:
            ray.shutdown()
