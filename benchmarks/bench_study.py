"""Speed of a whole study: Defazio & Bottou's Table 2 study (6,720 runs) and its letter slice.

Two timings, each against the machine's fp32 matmul (sgemm) peak measured in the same process:

* **slice**: the runs of one data set and one scheme (default: letter, geometric: 10 seeds × 14
  learning rates = 140 runs, 15,000 rows, 5 epochs), one ``train_runs`` call in this process with
  ``--threads`` threads (best of ``--repeats``), and the same runs as the study runs them:
  ``run_study`` of a spec cut down to them, ``--workers`` processes of one thread each (with
  2 workers: two chunks of 70 runs; start-up of the workers and data loading included);
* **full study**: ``run_study`` of the whole spec into a fresh store, ``--workers`` processes
  (each with ``cpu_count / workers`` threads), ``--chunk-size`` runs per chunk; wall time from
  the call to its return (worker start-up, data loading and the store included).

Each runs once per ``--evaluate`` mode of the trainer: ``every_epoch`` (full passes over the
training and test splits after every epoch, the default) or ``last_epoch`` (after the last epoch
only, the one pass ``final_train_loss`` needs).

**Counted work** (GFLOP/s and % of peak): only what the result needs. Per run with ``P``
parameters and ``n`` training rows, ``6·n·P`` per epoch (forward, input gradients, weight
gradients) plus ``2·n·P`` for the final pass over the training split. Per-epoch evaluation passes,
the test split, the first layer's skipped input gradient and everything that is not a matmul are
cost, not credit. The peak is the best of ``--peak-repeats`` ``torch.mm`` of two 4096 × 4096 fp32
matrices with all the machine's cores (and, printed beside it, with one thread), taken before and
after the timings; the larger value is used.

The machine may be shared: the load average is printed before and after, the modes run
alternately (slice: interleaved per repeat) so they see the same conditions, and the CPU time of
this process and its worker processes is printed beside the wall time: GFLOP per CPU-second
against the one-thread peak (also per CPU-second) is the efficiency per core, which other
people's jobs disturb much less than the wall time (they take cores away more than they slow a
running thread).

Run: ``python benchmarks/bench_study.py`` (both timings, both modes; ~15 min on 2 cores), or
``--skip-full`` for the slice alone. Data: ``--data-dir``, else ``$INITLAB_DATA_DIR``, else
``../shared/data``.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import os
import resource
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from initlab.study.runner import build_model, load_study_data, run_study
from initlab.study.spec import StudySpec
from initlab.study.trainer import train_runs

REPO = Path(__file__).resolve().parents[1]


def sgemm_peak(threads: int, repeats: int, clock: Any = time.perf_counter, n: int = 4096) -> float:
    """Best fp32 ``torch.mm`` GFLOP/s of two ``n x n`` matrices with ``threads`` threads, timed
    by ``clock`` (wall time, or ``time.process_time`` for GFLOP per CPU-second)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)
        best = math.inf
        for _ in range(repeats):
            start = clock()
            torch.mm(a, b)
            best = min(best, clock() - start)
    finally:
        torch.set_num_threads(before)
    return 2 * n**3 / best / 1e9


def cpu_seconds() -> float:
    """CPU time of this process and of its finished child processes (the pool's workers)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def needed_flops(spec: StudySpec, root: str | None, datasets: list[str] | None = None) -> float:
    """``sum over runs of (epochs·6·n·P + 2·n·P)`` (module docstring)."""
    total = 0.0
    configs = spec.runs()
    for name in datasets or list(spec.datasets):
        runs = [c for c in configs if c.dataset == name]
        data = load_study_data(name, root)
        n = data.train[0].shape[0]
        for config in runs:
            model = build_model(config, n_in=data.n_features, n_classes=data.n_classes)
            p = sum(t.numel() for t in model.parameters())
            total += (config.epochs * 6 + 2) * n * p
    return total


def _evaluate_kw(mode: str) -> dict[str, str]:
    """``evaluate=`` for trainers that have it (a tree before the option: every epoch only)."""
    if "evaluate" in inspect.signature(train_runs).parameters:
        return {"evaluate": mode}
    if mode != "every_epoch":
        raise SystemExit("this train_runs has no evaluate= option: use --evaluate every_epoch")
    return {}


Times = tuple[float, float]  # (wall, CPU) seconds


def time_slice(
    spec: StudySpec, dataset: str, scheme: str, modes: list[str], threads: int, repeats: int
) -> dict[str, Times]:
    """Best (wall, CPU) seconds of one ``train_runs`` call on the slice, per mode (the modes
    interleaved)."""
    configs = [c for c in spec.runs() if c.dataset == dataset and c.scheme == scheme]
    data = load_study_data(dataset, spec.data_root)
    factory = partial(build_model, n_in=data.n_features, n_classes=data.n_classes)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    best = dict.fromkeys(modes, (math.inf, math.inf))
    try:
        train_runs(configs[:2], data.train, data.test, model_factory=factory)  # lazy imports
        for _ in range(repeats):
            for mode in modes:
                start, cpu = time.perf_counter(), cpu_seconds()
                kw = _evaluate_kw(mode)
                train_runs(configs, data.train, data.test, model_factory=factory, **kw)
                best[mode] = min(best[mode], (time.perf_counter() - start, cpu_seconds() - cpu))
    finally:
        torch.set_num_threads(before)
    return best


def time_study(spec: StudySpec, mode: str, workers: int, chunk_size: int) -> Times:
    """(Wall, CPU) seconds of ``run_study`` of the whole spec into a fresh store."""
    train_fn = partial(train_runs, **_evaluate_kw(mode))
    with tempfile.TemporaryDirectory(prefix="bench-study-") as tmp:
        start, cpu = time.perf_counter(), cpu_seconds()
        summary = run_study(
            spec,
            Path(tmp) / "store.sqlite",
            workers=workers,
            chunk_size=chunk_size,
            train_fn=train_fn,
            progress=False,
        )
        took = (time.perf_counter() - start, cpu_seconds() - cpu)
    if summary.n_trained != spec.n_runs:
        raise SystemExit(f"trained {summary.n_trained} of {spec.n_runs} runs")
    return took


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default=str(REPO / "benchmarks/studies/table2.yaml"))
    parser.add_argument("--dataset", default="libsvm:letter", help="the slice's data set")
    parser.add_argument("--scheme", default="geometric", help="the slice's scheme")
    parser.add_argument(
        "--evaluate", nargs="+", default=["every_epoch", "last_epoch"],
        choices=["every_epoch", "last_epoch"],
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="slice threads")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="study processes")
    parser.add_argument("--chunk-size", type=int, default=140)
    parser.add_argument(
        "--slice-chunk-size", type=int, default=None,
        help="chunk size of the slice through run_study (default: its runs / --workers)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=1, help="slice repeats (best of)")
    parser.add_argument("--peak-repeats", type=int, default=5)
    parser.add_argument("--skip-slice", action="store_true")
    parser.add_argument("--skip-full", action="store_true")
    parser.add_argument("--data-dir", default=None)
    return parser.parse_args()


def _peaks(cores: int, repeats: int) -> tuple[float, float, float]:
    """sgemm GFLOP/s: all cores (wall), one thread (wall), one thread (per CPU-second)."""
    return (
        sgemm_peak(cores, repeats),
        sgemm_peak(1, repeats),
        sgemm_peak(1, repeats, clock=time.process_time),
    )


def main() -> None:
    args = _arguments()
    spec = StudySpec.from_yaml(args.spec)
    root = args.data_dir or os.environ.get("INITLAB_DATA_DIR") or str(REPO.parent / "shared/data")
    spec = dataclasses.replace(spec, data_root=root)
    cores = os.cpu_count() or 1
    print(
        f"torch {torch.__version__}, {cores} CPUs, load average {os.getloadavg()[0]:.2f}; "
        f"spec {args.spec} ({spec.n_runs} runs); data {root}"
    )
    before = _peaks(cores, args.peak_repeats)
    rows: list[tuple[str, str, Times, float]] = []  # (what, mode, times, flops)
    if not args.skip_slice:
        one_scheme = dataclasses.replace(spec, schemes=(args.scheme,))
        flops = needed_flops(one_scheme, root, [args.dataset])
        times = time_slice(
            spec, args.dataset, args.scheme, args.evaluate, args.threads, args.repeats
        )
        what = f"slice {args.dataset}/{args.scheme}, {args.threads} thread(s)"
        rows += [(what, mode, t, flops) for mode, t in times.items()]
        cut = dataclasses.replace(one_scheme, datasets=(args.dataset,))
        size = args.slice_chunk_size or -(-cut.n_runs // args.workers)
        threads = max(1, cores // args.workers)
        what = f"slice {args.dataset}/{args.scheme}, {args.workers} worker(s) × {threads} thread(s)"
        for mode in args.evaluate:
            rows.append((what, mode, time_study(cut, mode, args.workers, size), flops))
    if not args.skip_full:
        flops = needed_flops(spec, root)
        threads = max(1, cores // args.workers)
        what = f"full study, {args.workers} worker(s) × {threads} thread(s)"
        for mode in args.evaluate:
            rows.append((what, mode, time_study(spec, mode, args.workers, args.chunk_size), flops))
    peak, peak1, peak1_cpu = map(max, zip(before, _peaks(cores, args.peak_repeats), strict=True))

    header = ["run", "evaluate", "wall s", "CPU s", "needed TFLOP", "GFLOP/s", "% of peak",
              "GFLOP per CPU-s", "% of 1-thread peak"]  # fmt: skip
    print("\n" + _row(header) + "\n" + _row(["---"] * len(header)))
    for what, mode, (wall, cpu), flops in rows:
        rate, per_cpu = flops / wall / 1e9, flops / cpu / 1e9
        cells = [what, mode, f"{wall:.1f}", f"{cpu:.1f}", f"{flops / 1e12:.2f}", f"{rate:.1f}"]
        cells += [
            f"{100 * rate / peak:.0f}%",
            f"{per_cpu:.1f}",
            f"{100 * per_cpu / peak1_cpu:.0f}%",
        ]
        print(_row(cells))
    print(
        f"\nsgemm peak (best torch.mm 4096^3): {peak:.0f} GFLOP/s on {cores} threads, "
        f"{peak1:.0f} GFLOP/s on 1 thread ({peak1_cpu:.0f} per CPU-second); load average now "
        f"{os.getloadavg()[0]:.2f}. Counted: 6·n·P per epoch + 2·n·P for the final pass over "
        "the training split."
    )


if __name__ == "__main__":
    sys.exit(main())
