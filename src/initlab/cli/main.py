"""The ``initlab`` command: ``schemes``, ``init``, ``diagnose``, ``doctor``, ``data``, ``bench``,
``demo``.

Argument parsing lives here and only here; every command calls the library's public functions.

Errors: :func:`main` is the one place that handles them. Any exception a command raises is printed
as one line, ``initlab <command>: error: <message>``, without a traceback (the global ``--debug``
flag prints the traceback as well); the exit code is 2 for bad input (``ValueError``,
``TypeError``, ``ImportError``, ``LookupError``, ``OSError``, ``ArithmeticError``) and 1 for
anything else.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["main"]


def _cmd_schemes(args: argparse.Namespace) -> int:
    from initlab._core.rows import Rows
    from initlab.init.schemes import list_schemes

    print(Rows(list_schemes(), title="initlab schemes"))
    return 0


#: ``initlab init --method NAME``: (module, function, takes a loss_fn).
_METHODS = {
    "lsuv": ("initlab.methods.lsuv", "lsuv_", False),
    "gradinit": ("initlab.methods.gradinit", "gradinit_", True),
    "metainit": ("initlab.methods.metainit", "metainit_", True),
    "scale_output": ("initlab.methods.output_scale", "scale_output_", False),
    "precondition": ("initlab.methods.precondition", "precondition_", True),
}


def _progress_printer(label: str, total: int | None) -> Any:
    """A callback printing ``label: k/total`` on one refreshed line (plain lines when piped)."""
    state = {"k": 0}
    tty = sys.stderr.isatty()

    def tick(_row: Any = None) -> None:
        state["k"] += 1
        text = f"{label}: {state['k']}" + (f"/{total}" if total else "")
        if tty:
            print(f"\r{text}", end="", file=sys.stderr, flush=True)
        elif total is None or state["k"] == total or state["k"] % 50 == 0:
            print(text, file=sys.stderr, flush=True)

    return tick


def _run_method(args: argparse.Namespace, model: nn.Module) -> Any:
    from initlab.cli.inputs import has_targets, load_data_spec, load_loss

    module_name, fn_name, takes_loss = _METHODS[args.method]
    method = getattr(importlib.import_module(module_name), fn_name)
    data = load_data_spec(
        args.data, args.input_shape, batch_size=args.batch_size, batches=args.max_batches,
        seed=args.seed, data_dir=args.data_dir,
    )  # fmt: skip
    kwargs: dict[str, Any] = {"generator": args.seed}
    if args.method in ("gradinit", "metainit"):
        kwargs["progress"] = _progress_printer(args.method, args.steps)
        if args.steps is not None:
            kwargs["steps"] = args.steps
    if takes_loss:
        loss = args.loss or "auto"
        loss_fn = load_loss(loss, seed=args.seed, targets=has_targets(data[0]))
        return method(model, data, loss_fn, **kwargs)
    return method(model, data, **kwargs)


def _cmd_init(args: argparse.Namespace) -> int:
    from initlab.cli.inputs import load_model_spec, parse_shape
    from initlab.init.model import init_model

    model, shape = load_model_spec(args.model, args.model_kwargs)
    args.input_shape = parse_shape(args.input_shape) if args.input_shape else shape
    bias: str | float = args.bias
    if bias not in ("zeros", "keep"):
        bias = float(bias)
    scheme = args.scheme or ("geometric" if args.method is None else None)
    report: Any = None
    if scheme is not None:
        report = init_model(model, scheme, generator=args.seed, bias=bias, policy=args.policy)
        print(report)
    if args.method is not None:
        report = _run_method(args, model)
        if sys.stderr.isatty():
            print(file=sys.stderr)
        print(report)
        if getattr(report, "trace", None) is not None:
            print(report.trace)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), out)
    print(f"\nsaved state dict to {out}")
    if args.report and report is not None:
        Path(args.report).write_text(json.dumps(report.to_rows(), indent=1, default=str))
        print(f"saved report rows to {args.report}")
    return 0


def _cmd_diagnose(args: argparse.Namespace) -> int:
    from initlab.cli.diagnose import diagnose_command

    report = diagnose_command(
        args.model,
        args.data,
        args.loss,
        args.out,
        model_kwargs=args.model_kwargs,
        init=args.init,
        batch_size=args.batch_size,
        max_batches=args.max_batches,
        seed=args.seed,
        data_dir=args.data_dir,
        curvature=args.curvature,
        plots=not args.no_plots,
        progress=lambda msg: print(f"[diagnose] {msg}", file=sys.stderr, flush=True),
    )
    print(report.summary())
    if args.out:
        print(f"\nreport written to {args.out}/report.html")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from initlab.cli.inputs import has_targets, load_data_spec, load_loss, load_model_spec
    from initlab.diagnostics.doctor import doctor

    model, shape = load_model_spec(args.model, args.model_kwargs)
    data = load_data_spec(
        args.data, shape, batch_size=args.batch_size, batches=args.max_batches, seed=args.seed,
        data_dir=args.data_dir,
    )  # fmt: skip
    targets = has_targets(data[0])
    loss_name = args.loss or ("auto" if targets else "random_quadratic")
    loss_fn = load_loss(loss_name, seed=args.seed, targets=targets)
    fix: bool | list[str] = False
    if args.fix is not None:
        fix = True if args.fix == "recommended" else [f for f in args.fix.split(",") if f]
    report = doctor(
        model, data, loss_fn, fix=fix, max_batches=args.max_batches, generator=args.seed
    )
    report.meta["model"] = args.model[4:] if args.model.startswith("zoo:") else args.model
    report.meta["command"] = {
        "model": args.model, "data": args.data or "random", "loss": loss_name,
        "batch_size": args.batch_size, "max_batches": args.max_batches, "seed": args.seed,
    }  # fmt: skip
    print(report.summary(how_to_fix="the same command with --fix applies the fixes"))
    if args.out:
        folder = Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "doctor.md").write_text(report.to_markdown(), encoding="utf-8")
        (folder / "doctor.json").write_text(report.to_json(indent=1), encoding="utf-8")
        print(f"\nreport written to {folder}/doctor.md and {folder}/doctor.json")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from initlab.cli.demo import DEMO_SCHEMES, demo_study, run_demo

    schemes = args.schemes.split(",") if args.schemes else list(DEMO_SCHEMES)
    start = time.perf_counter()
    out = Path(args.out)

    def step(text: str) -> None:
        print(f"\n== {text} ({time.perf_counter() - start:.1f} s)", flush=True)

    step("1/3 moments: forward/backward second moments per layer and scheme")
    print(run_demo(schemes, seed=args.seed, batch_size=args.batch_size))
    if not args.quick:
        from initlab.cli.diagnose import diagnose_demo

        step("2/3 diagnosis: GR scaling, weight-to-gradient ratio, verdicts per layer")
        _, comparison = diagnose_demo(
            schemes, seed=args.seed, out=out / "diagnosis",
            progress=lambda msg: print(f"   {msg}", flush=True),
        )  # fmt: skip
        print(comparison)
        step("3/3 training: schemes x 3 seeds x 4 learning rates, 3 epochs (vectorized)")
        study_schemes = [
            s for s in schemes if s in ("fan_in", "fan_out", "arithmetic", "geometric")
        ]
        print(demo_study(out, study_schemes or schemes))
        print(f"\nreport folder: {out}/ (diagnosis/*.html, study/table2.md, study/plots/)")
    print(f"\ndone in {time.perf_counter() - start:.1f} s")
    return 0


def _cmd_data(args: argparse.Namespace) -> int:
    from initlab._core.rows import Rows
    from initlab.data import list_datasets

    print(Rows(list_datasets(args.data_dir), title="initlab data sets"))
    return 0


_MODEL_HELP = "'pkg.module:factory', 'file.py:factory' or 'zoo:NAME'"
_DATA_HELP = (
    "random | random:3x32x32 | digits | a data set `initlab data` lists (libsvm:letter, mnist, "
    "...) | file.pt | pkg.module:fn"
)
_DATA_DIR_HELP = "data root (default: $INITLAB_DATA_DIR or ../shared/data)"

Subparsers = Any  # argparse's private _SubParsersAction


def _positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _add_schemes(sub: Subparsers) -> None:
    p = sub.add_parser("schemes", help="list the initialization schemes with their formulas")
    p.set_defaults(func=_cmd_schemes)


def _add_init(sub: Subparsers) -> None:
    p = sub.add_parser("init", help="initialize a model (data-free or data-dependent), save it")
    p.add_argument("--model", required=True, help=_MODEL_HELP)
    p.add_argument("--model-kwargs", help="JSON object of keyword arguments for the factory")
    p.add_argument(
        "--scheme",
        help="data-free scheme (see `initlab schemes`); default geometric "
        "without --method, the factory's own init with --method",
    )
    p.add_argument(
        "--method", choices=sorted(_METHODS), help="data-dependent method run after the scheme"
    )
    p.add_argument("--data", help=f"data for --method: {_DATA_HELP}")
    p.add_argument("--data-dir", help=_DATA_DIR_HELP)
    p.add_argument("--input-shape", help="per-example input shape for random data, e.g. 3x32x32")
    p.add_argument(
        "--loss",
        help="loss for gradinit/metainit/precondition: auto | "
        "cross_entropy | mse | random_quadratic | pkg.module:fn",
    )
    p.add_argument("--batch-size", type=_positive_int, default=64)
    p.add_argument(
        "--max-batches", "--batches", dest="max_batches", type=_positive_int, default=8,
        help="at most this many batches of --data for --method (--batches: the old name)",
    )  # fmt: skip
    p.add_argument(
        "--steps", type=_positive_int,
        help="gradinit/metainit: optimization steps (default: one pass)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the init's torch.Generator")
    p.add_argument("--bias", default="zeros", help="'zeros', 'keep' or a number")
    p.add_argument(
        "--policy",
        default="warn",
        choices=["error", "warn", "skip"],
        help="what to do with parameters no handler claims",
    )
    p.add_argument("--out", required=True, help="where to save the state dict (.pt)")
    p.add_argument("--report", help="also save the method's report rows as JSON here")
    p.set_defaults(func=_cmd_init)


def _add_diagnose(sub: Subparsers) -> None:
    p = sub.add_parser("diagnose", help="per-layer conditioning report of a model")
    _add_model_data_loss(p)
    p.add_argument("--init", help="initialize with this scheme first (default: keep)")
    p.add_argument("--out", help="folder for report.html, report.json, report.md, summary.txt")
    _add_batches(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--curvature", action="store_true", help="also Hessian blocks (slower)")
    p.add_argument("--no-plots", action="store_true")
    p.set_defaults(func=_cmd_diagnose)


def _add_model_data_loss(p: argparse.ArgumentParser) -> None:
    """--model, --model-kwargs, --data, --loss: what ``diagnose`` and ``doctor`` load alike."""
    p.add_argument("--model", required=True, help=_MODEL_HELP)
    p.add_argument("--model-kwargs", help="JSON object of keyword arguments for the factory")
    p.add_argument("--data", help=f"{_DATA_HELP} (default: random inputs of a zoo model's shape)")
    p.add_argument("--data-dir", help=_DATA_DIR_HELP)
    p.add_argument("--loss", help="auto | cross_entropy | mse | random_quadratic | pkg.module:fn")


def _add_batches(p: argparse.ArgumentParser) -> None:
    """--batch-size and --max-batches (--batches: the old name) of ``diagnose`` and ``doctor``."""
    p.add_argument("--batch-size", type=_positive_int, default=64)
    p.add_argument(
        "--max-batches", "--batches", dest="max_batches", type=_positive_int, default=4,
        help="at most this many batches of --data (--batches: the old name)",
    )  # fmt: skip


def _add_doctor(sub: Subparsers) -> None:
    p = sub.add_parser(
        "doctor", help="check a model at step zero, recommend fixes (--fix: apply them)"
    )
    _add_model_data_loss(p)
    p.add_argument(
        "--fix", nargs="?", const="recommended",
        help="apply the recommended fixes, or these (comma-separated: init, lsuv, output_scale, "
        "precondition), then re-measure; the model built here is not saved",
    )  # fmt: skip
    p.add_argument("--out", help="folder for doctor.md and doctor.json")
    _add_batches(p)
    p.add_argument("--seed", type=int, default=0, help="seeds the data, the fixes and the loss")
    p.set_defaults(func=_cmd_doctor)


def _add_data(sub: Subparsers) -> None:
    p = sub.add_parser("data", help="list the data sets the loaders know and where they are")
    p.add_argument("--data-dir", help=_DATA_DIR_HELP)
    p.set_defaults(func=_cmd_data)


def _add_bench(sub: Subparsers) -> None:
    from initlab.cli.bench import add_bench

    add_bench(sub, data_dir_help=_DATA_DIR_HELP)


def _add_demo(sub: Subparsers) -> None:
    p = sub.add_parser("demo", help="compare schemes on the paper MLP with bundled digits data")
    p.add_argument("--schemes", help="comma-separated scheme names (default: all demo schemes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--out", default="initlab-demo", help="report folder (default: initlab-demo)")
    p.add_argument("--quick", action="store_true", help="moments only (seconds)")
    p.set_defaults(func=_cmd_demo)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="initlab",
        description="Well-conditioned neural networks at step zero.",
    )
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (
        _add_schemes, _add_init, _add_diagnose, _add_doctor, _add_data, _add_bench, _add_demo,
    ):  # fmt: skip
        add(sub)
    for command in sub.choices.values():  # also after the command: initlab init ... --debug
        command.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP
        )
    return parser


_DEBUG_HELP = "on an error, print the full traceback too (default: the message alone)"

#: Exceptions that report bad input (exit code 2); any other exception exits with 1.
_INPUT_ERRORS = (ValueError, TypeError, ImportError, LookupError, OSError, ArithmeticError)

_SHAPE_ERRORS = (
    "shapes cannot be multiplied",
    "size of tensor",
    "expected input",
    "input of size",
    "channels, but got",
)


def _message(err: BaseException) -> str:
    """The one-line text of an error: its message, with the type where the message alone is
    unclear, and a hint for a model that cannot run on the data."""
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        return f"{err.strerror}: {err.filename}"
    text = str(err).strip() or type(err).__name__
    if not isinstance(err, (ValueError, TypeError, ImportError, ArithmeticError, OSError)):
        text = f"{type(err).__name__}: {text}"
    if isinstance(err, RuntimeError) and any(s in text.lower() for s in _SHAPE_ERRORS):
        text += (
            " (the model could not run on the data: do --data, --input-shape and the model's "
            "input agree?)"
        )
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``initlab`` command; returns the exit code.

    Every error of a command is printed as ``initlab <command>: error: <message>`` on stderr (the
    traceback too with ``--debug``); see the module docstring for the exit codes.
    """
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print(f"initlab {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if args.debug:
            traceback.print_exc()
        print(f"initlab {args.command}: error: {_message(err)}", file=sys.stderr)
        return 2 if isinstance(err, _INPUT_ERRORS) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
