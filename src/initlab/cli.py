"""The ``initlab`` command: ``schemes``, ``init``, ``data``, ``bench run|report`` and ``demo``.

Argument parsing lives here and only here; every command calls the library's public functions.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["load_factory", "main"]


def load_factory(spec: str) -> Any:
    """Resolve ``"pkg.module:factory"`` or ``"path/to/file.py:factory"`` to the callable."""
    module_part, sep, attr = spec.partition(":")
    if not sep or not module_part or not attr:
        raise ValueError(
            f"--model must look like 'pkg.module:factory' or 'path/file.py:factory', got {spec!r}"
        )
    if module_part.endswith(".py"):
        path = Path(module_part)
        if not path.is_file():
            raise ValueError(f"--model file {path} does not exist")
        mod_spec = importlib.util.spec_from_file_location(path.stem, path)
        assert mod_spec is not None and mod_spec.loader is not None
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_part)
        except ImportError as err:
            raise ValueError(f"cannot import {module_part!r} for --model: {err}") from err
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{module_part!r} has no attribute {attr!r} (from --model {spec!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"--model {spec!r} is not callable")
    return obj


def _build_model(spec: str, kwargs_json: str | None) -> nn.Module:
    kwargs = json.loads(kwargs_json) if kwargs_json else {}
    if not isinstance(kwargs, dict):
        raise ValueError("--model-kwargs must be a JSON object, e.g. '{\"width\": 128}'")
    model = load_factory(spec)(**kwargs)
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {spec!r} returned {type(model).__name__}, not an nn.Module")
    return model


def _cmd_schemes(args: argparse.Namespace) -> int:
    from initlab.rows import Rows
    from initlab.schemes import list_schemes

    print(Rows(list_schemes(), title="initlab schemes"))
    return 0


def _cmd_init(args: argparse.Namespace) -> int:
    from initlab.initialize import init_model

    model = _build_model(args.model, args.model_kwargs)
    bias: str | float = args.bias
    if bias not in ("zeros", "keep"):
        bias = float(bias)
    report = init_model(model, args.scheme, generator=args.seed, bias=bias, policy=args.policy)
    print(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), out)
    print(f"\nsaved state dict to {out}")
    if args.report:
        Path(args.report).write_text(json.dumps(report.to_rows(), indent=1, default=str))
        print(f"saved report rows to {args.report}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from initlab.demo import DEMO_SCHEMES, run_demo

    schemes = args.schemes.split(",") if args.schemes else list(DEMO_SCHEMES)
    start = time.perf_counter()
    result = run_demo(schemes, seed=args.seed, batch_size=args.batch_size)
    print(result)
    print(f"\ndone in {time.perf_counter() - start:.1f} s")
    return 0


def _cmd_data(args: argparse.Namespace) -> int:
    from initlab.data import list_datasets
    from initlab.rows import Rows

    print(Rows(list_datasets(args.data_dir), title="initlab data sets"))
    return 0


def _cmd_bench_run(args: argparse.Namespace) -> int:
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
        )
    except StudyError as err:
        print(f"initlab bench run: {err}", file=sys.stderr)
        return 1
    print(summary)
    return 0


def _cmd_bench_report(args: argparse.Namespace) -> int:
    from initlab.study.aggregate import report_study

    out = args.out or str(Path(args.store).with_suffix("")) + "-report"
    rows = report_study(
        args.store, out, study=args.study, plots=not args.no_plots, window=args.window
    )
    print(rows)
    print(f"\nreport written to {out}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="initlab",
        description="Well-conditioned neural networks at step zero.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("schemes", help="list the initialization schemes with their formulas")
    p.set_defaults(func=_cmd_schemes)

    p = sub.add_parser("init", help="initialize a model and save its state dict")
    p.add_argument("--model", required=True, help="factory as 'pkg.module:factory' or 'file.py:fn'")
    p.add_argument("--model-kwargs", help="JSON object of keyword arguments for the factory")
    p.add_argument("--scheme", default="geometric", help="scheme name (see `initlab schemes`)")
    p.add_argument("--seed", type=int, default=0, help="seed of the init's torch.Generator")
    p.add_argument("--bias", default="zeros", help="'zeros', 'keep' or a number")
    p.add_argument(
        "--policy",
        default="warn",
        choices=["error", "warn", "skip"],
        help="what to do with parameters no handler claims",
    )
    p.add_argument("--out", required=True, help="where to save the state dict (.pt)")
    p.add_argument("--report", help="also save the report rows as JSON here")
    p.set_defaults(func=_cmd_init)

    p = sub.add_parser("data", help="list the data sets the loaders know and where they are")
    p.add_argument("--data-dir", help="data root (default: $INITLAB_DATA_DIR or ../shared/data)")
    p.set_defaults(func=_cmd_data)

    bench = sub.add_parser("bench", help="run and report studies (schemes x seeds x LRs)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    p = bench_sub.add_parser("run", help="run a study spec (YAML); resumes where it stopped")
    p.add_argument("spec", help="study spec, e.g. benchmarks/studies/table2.yaml")
    p.add_argument("--store", help="SQLite store (default: results/<study name>.sqlite)")
    p.add_argument("--backend", default="local", choices=["local", "ray"])
    p.add_argument("--workers", type=int, default=1, help="parallel worker processes")
    p.add_argument("--ray-address", help="Ray cluster address (default: a local Ray instance)")
    p.add_argument("--chunk-size", type=int, default=64, help="runs trained together per chunk")
    p.add_argument("--device", default="cpu")
    p.add_argument("--data-dir", help="data root (default: $INITLAB_DATA_DIR or ../shared/data)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=_cmd_bench_run)
    p = bench_sub.add_parser("report", help="aggregate a study store: Table 2, tables, plots")
    p.add_argument("store", help="SQLite store written by `initlab bench run`")
    p.add_argument("--out", help="output folder (default: <store>-report)")
    p.add_argument("--study", help="only this study of the store")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--window", type=int, help="sliding window (steps) for loss curves")
    p.set_defaults(func=_cmd_bench_report)

    p = sub.add_parser("demo", help="compare schemes on the paper MLP with bundled digits data")
    p.add_argument("--schemes", help="comma-separated scheme names (default: all demo schemes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=1024)
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``initlab`` command; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, TypeError, ImportError) as err:
        print(f"initlab {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
