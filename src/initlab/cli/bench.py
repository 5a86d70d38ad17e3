"""``initlab bench run`` and ``initlab bench report``: a study spec into a store, a store into a
report. Argument parsing only; the work is :func:`initlab.study.run_study` and
:func:`initlab.study.report_study`."""

from __future__ import annotations

import argparse
import shlex
import sys
import warnings
from pathlib import Path
from typing import Any

from initlab.cli._checks import (
    check_device,
    check_not_empty,
    check_out_dir,
    check_store,
    fraction,
    note,
    number_type,
    positive_float,
    positive_int,
    store_schemes,
)

__all__ = ["add_bench", "bench_report", "bench_run"]


_rounds = number_type(int, lambda v: v >= 0, "a number of rounds >= 0")
#: The bootstrap's seed: what numpy.random.default_rng takes, any integer >= 0 (report_study's
#: seed=).
_boot_seed = number_type(
    int, lambda v: v >= 0, "must be an integer >= 0 (numpy's generator takes no negative seed)"
)


def _load_spec(path: str) -> Any:
    """The study spec of ``initlab bench run SPEC``; every error names the file."""
    from initlab.study.spec import StudySpec

    spec_path = Path(path)
    if spec_path.is_dir():
        raise ValueError(f"study spec {path} is a folder; give a YAML file")
    if not spec_path.is_file():
        raise ValueError(f"study spec {path} does not exist")
    try:
        return StudySpec.from_yaml(spec_path)
    except UnicodeDecodeError:
        raise ValueError(f"study spec {path} is not a text (YAML) file") from None
    except ImportError:
        raise
    except Exception as err:
        mark = getattr(err, "problem_mark", None)
        if mark is not None:  # a YAML syntax error: its problem and where
            problem = getattr(err, "problem", None) or "invalid YAML"
            where = f"line {mark.line + 1}, column {mark.column + 1}"
            raise ValueError(f"study spec {path} is not valid YAML: {problem} ({where})") from err
        text = " ".join((str(err).strip() or type(err).__name__).split())
        if text.startswith(f"{path}:"):
            text = text[len(path) + 1 :].strip()
        kind = "" if isinstance(err, (ValueError, TypeError)) else f"{type(err).__name__}: "
        raise ValueError(f"study spec {path}: {kind}{text}") from err


def format_summary(summary: Any) -> str:
    """A :class:`~initlab.study.runner.StudySummary` as a few readable lines.

    The first line counts the runs of the spec's grid and those grid extension added alike:
    ``n_runs + n_extended`` runs, of which ``n_already_stored`` (``n_skipped + n_extended -
    n_extended_new``) were already stored; the others were trained now, by other drivers, or
    failed."""
    runs = f"{summary.n_runs} runs"
    if summary.n_extended:
        runs = (
            f"{summary.n_runs + summary.n_extended} runs ({summary.n_runs} of the spec's grid, "
            f"{summary.n_extended} added by grid extension)"
        )
    lines = [
        f"study {summary.name}: {runs}, {summary.n_already_stored} already stored, "
        f"{summary.n_trained} trained now ({summary.n_chunks} chunk(s)), "
        f"{summary.n_by_others} by other drivers, {summary.n_failed} failed "
        f"({summary.wall_s:.1f} s)",
        f"store: {summary.store_path}",
    ]
    if summary.extension_rounds or summary.n_extended:
        lines.append(
            f"grid extension: {summary.extension_rounds} round(s), {summary.n_extended} run(s) "
            f"beyond the spec's grid, {summary.n_extended_new} of them new in this call"
        )
    if summary.edges_left:
        lines.append(f"best rates still at the grid's edge: {', '.join(summary.edges_left)}")
    for err in summary.errors:
        first = str(err).strip().splitlines()
        lines.append(f"failed chunk: {first[-1] if first else err}")
    return "\n".join(lines)


def bench_run(args: argparse.Namespace) -> int:
    """``initlab bench run SPEC``: train the study's missing runs (sharing the work with other
    drivers on the same store), then extend the grid if asked. Every argument is checked before
    the store is created."""
    from initlab.study.runner import StudyError, run_study

    check_device(args.device)
    check_not_empty("--data-dir", args.data_dir, "the data root folder")
    if args.extend_grid is not None and args.no_extend_grid:
        raise ValueError(
            "--extend-grid and --no-extend-grid contradict each other; give one of them"
        )
    if args.no_extend_grid:
        args.extend_grid = False
    rounds, extend = args.extend_rounds, args.extend_grid
    if rounds is not None and extend is not None and extend != (rounds > 0):
        given = "--extend-grid" if extend else "--no-extend-grid"
        raise ValueError(
            f"{given} and --extend-rounds {rounds} contradict each other; give one of them "
            "(--extend-rounds 0 means no grid extension)"
        )
    if args.ray_address is not None and args.backend != "ray":
        note(args, f"--ray-address is only used with --backend ray; ignored with --backend "
              f"{args.backend}")  # fmt: skip
    spec = _load_spec(args.spec)
    store = args.store if args.store is not None else f"results/{spec.name}.sqlite"
    check_store(store, flag="--store", must_exist=False)
    if args.data_dir is not None and spec.data_root is not None:
        note(args, f"--data-dir {args.data_dir} is used, not the spec's data_root "
              f"{spec.data_root}")  # fmt: skip
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
    except Exception as err:
        if args.data_dir is None and spec.data_root is not None and "from root=)" in str(err):
            # the data root came from the spec, not from --data-dir (the CLI's word for root=)
            raise ValueError(str(err).replace("from root=)", "from the spec's data_root)")) from err
        raise
    except KeyboardInterrupt:
        print(f"initlab bench run: interrupted; {_stored_text(store, spec.name)}", file=sys.stderr)
        return 130
    print(format_summary(summary))
    print(f"\nreport: initlab bench report {shlex.quote(store)} --study {shlex.quote(spec.name)}")
    return 0


def _stored_text(store: str, study: str) -> str:
    """What an interrupted ``bench run`` leaves: how many of the study's runs the store holds,
    and that the same command resumes."""
    from initlab.study.store import Store

    again = "run the same command again to train the rest (stored runs are not trained again)"
    try:
        with Store(store, read_only=True) as db:
            done, total = len(db.keys(study)), len(db.study_keys(study))
    except Exception:  # no store yet, or not readable: nothing was stored
        return f"no run of study {study!r} was stored; {again}"
    return f"{done} of the {total} runs of study {study!r} are stored in {store}; {again}"


def bench_report(args: argparse.Namespace) -> int:
    """``initlab bench report STORE``: Table 2 per variant with intervals, paired comparisons,
    the sensitivity table, plots; ``report.html`` and Markdown/CSV files. Everything is checked
    before the report folder is made."""
    from initlab.study.report import study_to_report

    store = check_store(args.store, flag="STORE", must_exist=True)
    where = f"{store}" + (f" (study {args.study!r})" if args.study else "")
    args.study = study_to_report(store, args.study)  # one study: never runs of two protocols
    schemes = store_schemes(store, args.study)
    reference = args.reference if args.reference is not None else _DEFAULT_REFERENCE
    if schemes and reference not in schemes:
        if args.reference is not None:
            raise ValueError(
                f"--reference {args.reference!r} is not a scheme of {where}; valid: "
                f"{', '.join(sorted(schemes))}"
            )
        others = (f"; pass --reference with one of {', '.join(sorted(schemes))} for them"
                  if len(schemes) > 1 else "")  # fmt: skip
        note(args, f"no {_DEFAULT_REFERENCE} runs in {where}, so no paired comparisons"
              f"{others}")  # fmt: skip
    out = args.out if args.out is not None else str(Path(args.store).with_suffix("")) + "-report"
    check_out_dir("--out", out)
    with warnings.catch_warnings():  # said above, in the command line's words
        warnings.filterwarnings("ignore", message="no runs of the reference scheme")
        rows = _report(args, out, reference)
    print(rows)
    print(f"\nreport written to {out} (open {Path(out) / 'report.html'})")
    return 0


def _report(args: argparse.Namespace, out: str, reference: str) -> Any:
    from initlab.study.report import report_study

    return report_study(
        args.store,
        out,
        study=args.study,
        plots=not args.no_plots,
        window=args.window,
        loss=args.loss,
        n_boot=args.n_boot,
        seed=args.seed,
        level=args.level,
        reference=reference,
    )


#: The scheme ``bench report`` pairs the others against when --reference is not given (the
#: library's default).
_DEFAULT_REFERENCE = "geometric"


def add_bench(sub: Any, *, data_dir_help: str, debug_help: str) -> None:
    """The ``bench`` command and its ``run`` and ``report`` subcommands."""
    bench = sub.add_parser("bench", help="run and report studies (schemes x seeds x LRs)")
    bench.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help
    )  # initlab bench --debug run ...
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="{run,report}", required=True)
    _add_bench_run(bench_sub, data_dir_help)
    _add_bench_report(bench_sub)


def _add_bench_run(bench_sub: Any, data_dir_help: str) -> None:
    """The ``bench run`` subcommand: its arguments, and :func:`bench_run` to run it."""
    from initlab.study.claims import DEFAULT_HEARTBEAT_S, DEFAULT_STALE_AFTER_S

    p = bench_sub.add_parser(
        "run",
        help="run a study spec (YAML); resumes where it stopped; several on one store share it",
    )
    p.add_argument("spec", help="study spec, e.g. benchmarks/studies/table2.yaml")
    p.add_argument("--store", help="SQLite store (default: results/<study name>.sqlite)")
    p.add_argument("--backend", default="local", choices=["local", "ray"])
    p.add_argument(
        "--workers", type=positive_int, default=1, help="parallel worker processes (default: 1)"
    )
    p.add_argument("--ray-address", help="Ray cluster address (default: a local Ray instance)")
    p.add_argument(
        "--chunk-size", type=positive_int, default=64,
        help="runs trained together per chunk (default: 64)",
    )  # fmt: skip
    p.add_argument(
        "--device", default="cpu", help="cpu, cuda, cuda:N or mps; checked first (default: cpu)"
    )
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
        "--no-extend-grid", action="store_true", help="no grid extension, whatever the spec says"
    )
    p.add_argument(
        "--extend-rounds",
        type=_rounds,
        metavar="N",
        help="grid extension with at most N rounds (0: none)",
    )
    p.add_argument(
        "--stale-after",
        type=positive_float,
        default=DEFAULT_STALE_AFTER_S,
        help="seconds without a heartbeat after which another driver's claimed runs are taken "
        f"over (default {DEFAULT_STALE_AFTER_S:g})",
    )
    p.add_argument(
        "--heartbeat",
        type=positive_float,
        default=DEFAULT_HEARTBEAT_S,
        help=f"seconds between renewals of this driver's claims (default {DEFAULT_HEARTBEAT_S:g})",
    )
    p.set_defaults(func=bench_run)


def _add_bench_report(bench_sub: Any) -> None:
    """The ``bench report`` subcommand: its arguments, and :func:`bench_report` to run it."""
    from initlab.study.config import LOSS_MEASURES

    p = bench_sub.add_parser(
        "report",
        help="a study store → report.html: Table 2 per variant with intervals, paired "
        "comparisons, sensitivity table, plots",
    )
    p.add_argument("store", help="SQLite store written by `initlab bench run`")
    p.add_argument(
        "--out",
        help="output folder (default: STORE without its suffix, then -report: "
        "results/x.sqlite -> results/x-report). A report replaces an earlier one there: the "
        "files that one wrote and this one does not (its plots, after --no-plots, or those of "
        "other variants and data sets) are removed, any other file is left; a report that "
        "fails writes nothing",
    )
    p.add_argument(
        "--study",
        help="the study of the store to report (needed when the store holds several: a report "
        "never pools studies, whose protocols may differ)",
    )
    p.add_argument(
        "--no-plots", action="store_true", help="tables and HTML only, no figures (no matplotlib)"
    )
    p.add_argument(
        "--window", type=positive_int, help="sliding window (steps, >= 1) for loss curves"
    )
    p.add_argument(
        "--loss",
        choices=list(LOSS_MEASURES),
        help="compare this training loss in every variant (default: each variant's `loss`)",
    )
    p.add_argument(
        "--n-boot", type=positive_int, default=2000, help="bootstrap replicates, >= 1 (2000)"
    )
    p.add_argument(
        "--seed", type=_boot_seed, default=0, help="seeds the bootstrap, an integer >= 0 (0)"
    )
    p.add_argument(
        "--level", type=fraction, default=0.95, help="interval coverage, in (0, 1) (0.95)"
    )
    p.add_argument(
        "--reference",
        help="scheme paired against; one of the store's schemes (default: geometric, when the "
        "store has it; else no paired comparisons)",
    )
    p.set_defaults(func=bench_report)
