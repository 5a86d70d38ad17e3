"""``initlab bench run`` and ``initlab bench report``: a study spec into a store, a store into a
report. Argument parsing only; the work is :func:`initlab.study.run_study` and
:func:`initlab.study.report_study`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_bench", "bench_report", "bench_run"]


def _rounds(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of rounds, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a number of rounds >= 0, got {value}")
    return value


def bench_run(args: argparse.Namespace) -> int:
    """``initlab bench run SPEC``: train the study's missing runs (sharing the work with other
    drivers on the same store), then extend the grid if asked."""
    from initlab.study.runner import StudyError, run_study
    from initlab.study.spec import StudySpec

    spec = StudySpec.from_yaml(args.spec)
    store = args.store or f"results/{spec.name}.sqlite"
    Path(store).parent.mkdir(parents=True, exist_ok=True)
    try:
        summary = run_study(
            spec,
            store,
            backend=args.backend,
            workers=args.workers,
            ray_address=args.ray_address,
            progress=not args.quiet,
            chunk_size=args.chunk_size,
            device=args.device,
            data_root=args.data_dir,
            extend_grid=args.extend_grid if args.extend_rounds is None else args.extend_rounds,
            heartbeat_s=args.heartbeat,
            stale_after=args.stale_after,
        )
    except StudyError as err:
        print(f"initlab bench run: {err}", file=sys.stderr)
        return 1
    print(summary)
    print(f"\nreport: initlab bench report {store}")
    return 0


def bench_report(args: argparse.Namespace) -> int:
    """``initlab bench report STORE``: Table 2 per variant with intervals, paired comparisons,
    the sensitivity table, plots; ``report.html`` and Markdown/CSV files."""
    from initlab.study.report import report_study

    out = args.out or str(Path(args.store).with_suffix("")) + "-report"
    rows = report_study(
        args.store,
        out,
        study=args.study,
        plots=not args.no_plots,
        window=args.window,
        loss=args.loss,
        n_boot=args.n_boot,
        seed=args.seed,
        level=args.level,
        reference=args.reference,
    )
    print(rows)
    print(f"\nreport written to {out} (open {Path(out) / 'report.html'})")
    return 0


def add_bench(sub: Any, *, data_dir_help: str) -> None:
    """The ``bench`` command and its ``run`` and ``report`` subcommands."""
    from initlab.study.claims import DEFAULT_HEARTBEAT_S, DEFAULT_STALE_AFTER_S
    from initlab.study.config import LOSS_MEASURES

    bench = sub.add_parser("bench", help="run and report studies (schemes x seeds x LRs)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    p = bench_sub.add_parser(
        "run",
        help="run a study spec (YAML); resumes where it stopped; several on one store share it",
    )
    p.add_argument("spec", help="study spec, e.g. benchmarks/studies/table2.yaml")
    p.add_argument("--store", help="SQLite store (default: results/<study name>.sqlite)")
    p.add_argument("--backend", default="local", choices=["local", "ray"])
    p.add_argument("--workers", type=int, default=1, help="parallel worker processes")
    p.add_argument("--ray-address", help="Ray cluster address (default: a local Ray instance)")
    p.add_argument("--chunk-size", type=int, default=64, help="runs trained together per chunk")
    p.add_argument("--device", default="cpu")
    p.add_argument("--data-dir", help=data_dir_help)
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument(
        "--extend-grid",
        action="store_const",
        const=True,
        default=None,
        help="after the runs, add the next power of two beyond every best learning rate at the "
        "grid's edge, train, repeat until none is at an edge (at most 6 rounds; see "
        "--extend-rounds); default: the spec's extend_grid",
    )
    p.add_argument(
        "--no-extend-grid",
        dest="extend_grid",
        action="store_const",
        const=False,
        help="no grid extension, whatever the spec says",
    )
    p.add_argument(
        "--extend-rounds",
        type=_rounds,
        metavar="N",
        help="grid extension with at most N rounds (0: none)",
    )
    p.add_argument(
        "--stale-after",
        type=float,
        default=DEFAULT_STALE_AFTER_S,
        help="seconds without a heartbeat after which another driver's claimed runs are taken "
        f"over (default {DEFAULT_STALE_AFTER_S:g})",
    )
    p.add_argument(
        "--heartbeat",
        type=float,
        default=DEFAULT_HEARTBEAT_S,
        help=f"seconds between renewals of this driver's claims (default {DEFAULT_HEARTBEAT_S:g})",
    )
    p.set_defaults(func=bench_run)
    p = bench_sub.add_parser(
        "report",
        help="a study store → report.html: Table 2 per variant with intervals, paired "
        "comparisons, sensitivity table, plots",
    )
    p.add_argument("store", help="SQLite store written by `initlab bench run`")
    p.add_argument("--out", help="output folder (default: <store>-report)")
    p.add_argument("--study", help="only this study of the store")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--window", type=int, help="sliding window (steps) for loss curves")
    p.add_argument(
        "--loss",
        choices=list(LOSS_MEASURES),
        help="compare this training loss in every variant (default: each variant's `loss`)",
    )
    p.add_argument("--n-boot", type=int, default=2000, help="bootstrap replicates (2000)")
    p.add_argument("--seed", type=int, default=0, help="seeds the bootstrap (0)")
    p.add_argument("--level", type=float, default=0.95, help="interval coverage (0.95)")
    p.add_argument("--reference", default="geometric", help="scheme paired against (geometric)")
    p.set_defaults(func=bench_report)
