"""The ``initlab`` command: ``schemes``, ``init``, ``diagnose``, ``doctor``, ``data``, ``bench``,
``demo``.

Argument parsing lives here and only here; every command calls the library's public functions.

Errors: :func:`main` is the one place that handles them. Any exception a command raises is printed
as one line, ``initlab <command>: error: <message>``, without a traceback (the global ``--debug``
flag prints the traceback as well); the exit code is 2 for bad input (``ValueError``,
``TypeError``, ``ImportError``, ``LookupError``, ``OSError``, ``ArithmeticError``, and a model
that cannot run on the data: a shape or dtype mismatch) and 1 for anything else.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import math
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from initlab.cli._checks import (
    DEFAULT_INIT_BATCHES,
    check_batch_count,
    check_distinct,
    check_not_empty,
    check_out_dir,
    check_out_file,
    command_name,
    data_root_note,
    make_parent,
    max_batches_for,
    note,
    positive_int,
    seed_int,
    split_names,
    translate,
)

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


#: What ``initlab init`` options each --method reads (the others warn that they are unused).
_METHOD_OPTIONS = {
    "--loss": ("gradinit", "metainit", "precondition"),
    "--steps": ("gradinit", "metainit"),
    "--how": ("precondition",),
}


#: ``--max-batches`` without a value: this many, or what ``--steps`` needs.
def _given(args: argparse.Namespace, dest: str) -> bool:
    """Whether the user gave the option stored in ``dest`` (one with ``action=_Given``)."""
    return dest in getattr(args, "given", ())


def _batch_size_note(args: argparse.Namespace) -> Callable[[str], None]:
    """Where the data is already batched: a note that --batch-size is ignored, if it was given."""
    return (lambda text: note(args, text)) if _given(args, "batch_size") else (lambda text: None)


def _load_data(
    args: argparse.Namespace, shape: Any, batches: int, shape_flag: str | None = None
) -> tuple[list[Any], bool]:
    """The batches of --data (init, doctor), and whether it came already batched (so
    --batch-size was not used: noted when it was given)."""
    from initlab.cli.inputs import load_data_spec

    said: list[str] = []
    data = load_data_spec(
        args.data, shape, batch_size=args.batch_size, batches=batches, seed=args.seed,
        data_dir=args.data_dir, shape_flag=shape_flag, note=said.append,
    )  # fmt: skip
    tell = _batch_size_note(args)
    for text in said:
        tell(text)
    return data, bool(said)


def _run_method(args: argparse.Namespace, model: nn.Module) -> Any:
    from initlab.cli.inputs import has_targets, load_loss

    module_name, fn_name, takes_loss = _METHODS[args.method]
    method = getattr(importlib.import_module(module_name), fn_name)
    data, batched = _load_data(args, args.input_shape, max_batches_for(args), "--input-shape")
    check_batch_count(args, data, batched)
    kwargs: dict[str, Any] = {"generator": args.seed}
    if args.method == "lsuv":  # keep the scheme's weights (rescaled) and biases
        kwargs["orthogonal"] = args.scheme is None
        kwargs["max_batches"] = None  # the --max-batches batches loaded (lsuv_'s default is 1)
    if args.method in ("gradinit", "metainit"):
        kwargs["progress"] = _progress_printer(args.method, args.steps)
        if args.steps is not None:
            kwargs["steps"] = args.steps
    if args.method == "precondition":
        kwargs["how"] = args.how or "lr"
    if takes_loss:
        loss = args.loss or "auto"
        loss_fn = load_loss(loss, seed=args.seed, targets=has_targets(data[0]))
        return method(model, data, loss_fn, **kwargs)
    return method(model, data, **kwargs)


def _parse_bias(text: str) -> str | float:
    if text in ("zeros", "keep"):
        return text
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(
            f"--bias {text!r}: give 'zeros', 'keep' (the factory's biases) or a finite number"
        )
    return value


def _check_scheme(flag: str, name: str | None) -> None:
    """Refuse an unknown scheme name before any work."""
    from initlab.init.schemes import get_scheme

    if name is None:
        return
    try:
        get_scheme(name)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{flag} {name!r}: {err}") from None


def _check_data_options(args: argparse.Namespace, *, used: bool = True) -> None:
    """--loss, --data, --data-dir of init, diagnose and doctor: refused when bad, before any work;
    --data-dir noted when ``--data`` does not read it (``used``: the data is read at all)."""
    from initlab.cli.inputs import check_data_spec, check_loss_name, is_named_dataset

    check_not_empty("--data-dir", args.data_dir, "the data root folder")
    if args.loss is not None:
        check_loss_name(args.loss)
    if args.data is not None:
        check_data_spec(args.data)
    if used and args.data_dir is not None and not is_named_dataset(args.data):
        note(args, f"--data-dir is only used with a named data set (e.g. --data libsvm:letter, "
              f"mnist); ignored with --data {args.data or 'random'}")  # fmt: skip


def _check_paths(**named: str | None) -> None:
    """Refuse an output that is the same file as an input or another output (``flag=path``
    pairs, inputs first; the flag's ``_`` reads as ``-``)."""
    check_distinct(*((f"--{k.replace('_', '-')}", v) for k, v in named.items()))


def _model_file(spec: str) -> str | None:
    """The Python file of ``--model file.py:factory``, else ``None``."""
    file, sep, _ = spec.partition(":")
    return file if sep and file.endswith(".py") else None


def _data_file(spec: str | None) -> str | None:
    return spec if spec is not None and spec.endswith((".pt", ".pth")) else None


def _check_init_options(args: argparse.Namespace) -> None:
    """Refuse bad values and warn about options this run does not use, before any work."""
    from initlab.cli.inputs import parse_shape

    _check_scheme("--scheme", args.scheme)
    if args.input_shape is not None:
        parse_shape(args.input_shape, "--input-shape")
    _check_data_options(args, used=args.method is not None)
    if args.method is None:
        unused = [f for f, v in (("--data", args.data), ("--data-dir", args.data_dir),
                                 ("--input-shape", args.input_shape), ("--loss", args.loss),
                                 ("--steps", args.steps), ("--how", args.how),
                                 ("--max-batches", args.max_batches)) if v is not None]  # fmt: skip
        if unused:
            note(args, f"{', '.join(unused)} only used with --method (data-dependent init); "
                  "ignored here")  # fmt: skip
    else:
        for flag, methods in _METHOD_OPTIONS.items():
            if getattr(args, flag[2:]) is not None and args.method not in methods:
                note(args, f"{flag} is only used with --method {' or '.join(methods)}; "
                      f"ignored with --method {args.method}")  # fmt: skip
        if args.input_shape is not None and args.data not in (None, "random"):
            note(args, f"--input-shape is only used with random data (no --data, or --data "
                  f"random); ignored with --data {args.data}")  # fmt: skip
        if args.scheme is None and _given(args, "bias"):
            note(args, f"--bias is only used with --scheme (the scheme sets the biases); ignored "
                  f"with --method {args.method} alone: add --scheme NAME")  # fmt: skip
    if args.method == "gradinit" and args.max_batches is not None and args.max_batches < 2:
        raise ValueError(
            f"--max-batches {args.max_batches}: gradinit needs at least 2 batches (each step reads "
            "batch t and t+1); give --max-batches 2 or more"
        )
    if args.how == "parametrize" and args.method == "precondition":  # else: noted as unused
        raise ValueError(
            "--how parametrize registers torch parametrizations, which a state dict cannot "
            "carry (the multipliers are not tensors); use --how lr (weights unchanged, per-layer "
            "learning-rate scales in --report) or --how rescale (weights changed), or call "
            "`initlab.precondition_(model, data, loss_fn, how='parametrize')` in Python"
        )


def _method_notes(args: argparse.Namespace, report_path: Path | None) -> list[str]:
    """What ``initlab init`` says after the tables about what --method did to the weights."""
    if args.method == "lsuv" and args.scheme is None:
        return [
            "note: lsuv replaced the factory's weights with an orthogonal pre-init (biases zero) "
            "before rescaling them; give --scheme NAME (and --bias) to have lsuv rescale that "
            "scheme's weights and keep its biases instead."
        ]
    if args.method == "precondition" and (args.how or "lr") == "lr":
        where = f"in {report_path}" if report_path else "above (add --report FILE to save them)"
        return [
            "note: precondition --how lr leaves the weights unchanged (the saved state dict is "
            "the init's); its result is the per-layer learning-rate scales lr_scale_sgd and "
            f"lr_scale_adam, {where}. --how rescale changes the weights instead."
        ]
    return []


def _cmd_init(args: argparse.Namespace) -> int:
    from initlab.cli.inputs import load_model_spec, parse_shape
    from initlab.init.model import init_model

    bias = _parse_bias(args.bias)
    _check_init_options(args)
    out = check_out_file("--out", args.out)
    report_path = check_out_file("--report", args.report) if args.report is not None else None
    _check_paths(model=_model_file(args.model), data=_data_file(args.data), out=args.out,
                 report=args.report)  # fmt: skip
    model, shape = load_model_spec(args.model, args.model_kwargs, seed=args.seed)
    args.input_shape = parse_shape(args.input_shape) if args.input_shape else shape
    scheme = args.scheme or ("geometric" if args.method is None else None)
    report: Any = None
    printed: list[Any] = []
    if scheme is not None:
        report = init_model(model, scheme, generator=args.seed, bias=bias, policy=args.policy)
        printed.append(report)
    if args.method is not None:
        report = _run_method(args, model)
        if sys.stderr.isatty():
            print(file=sys.stderr)
        printed.append(report)
        if getattr(report, "trace", None) is not None:
            printed.append(report.trace)
    # the files first: a closed stdout (`| head -1`) must not cost the results
    torch.save(model.state_dict(), make_parent(out))
    if report_path is not None and report is not None:
        make_parent(report_path).write_text(json.dumps(report.to_rows(), indent=1, default=str))
    for item in printed:
        print(item)
    print(f"\nsaved state dict to {out}")
    if report_path is not None and report is not None:
        print(f"saved report rows to {report_path}")
    for line in _method_notes(args, report_path):
        print(line)
    return 0


def _cmd_diagnose(args: argparse.Namespace) -> int:
    from initlab.cli.diagnose import diagnose_command

    _check_data_options(args)
    _check_scheme("--init", args.init)
    if args.out is not None:
        check_out_dir("--out", args.out)
        _check_paths(model=_model_file(args.model), data=_data_file(args.data), out=args.out)
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
        note=_batch_size_note(args),
        progress=lambda msg: print(f"[diagnose] {msg}", file=sys.stderr, flush=True),
    )
    print(report.summary())
    if args.out is not None:
        print(f"\nreport written to {Path(args.out) / 'report.html'}")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from initlab.cli.inputs import has_targets, load_loss, load_model_spec
    from initlab.diagnostics.doctor import _fix_names as fix_names  # checks the names
    from initlab.diagnostics.doctor import doctor

    _check_data_options(args)
    fix: bool | list[str] = False
    if args.fix is not None:
        example = "--fix init,lsuv (or --fix alone for the recommended ones)"
        fix = True if args.fix == "recommended" else split_names("--fix", args.fix, "fix", example)
        if fix is not True:
            try:
                fix_names(fix)
            except ValueError as err:
                raise ValueError(f"--fix {args.fix}: {str(err).removeprefix('doctor: ')}") from None
    folder = check_out_dir("--out", args.out) if args.out is not None else None
    if folder is not None:
        _check_paths(model=_model_file(args.model), data=_data_file(args.data), out=args.out)
    model, shape = load_model_spec(args.model, args.model_kwargs, seed=args.seed)
    data, _ = _load_data(args, shape, args.max_batches)
    targets = has_targets(data[0])
    loss_name = args.loss or ("auto" if targets else "random_quadratic")
    loss_fn = load_loss(loss_name, seed=args.seed, targets=targets)
    report = doctor(
        model, data, loss_fn, fix=fix, max_batches=args.max_batches, generator=args.seed
    )
    report.meta["model"] = args.model[4:] if args.model.startswith("zoo:") else args.model
    report.meta["command"] = {
        "model": args.model, "data": args.data or "random", "loss": loss_name,
        "batch_size": args.batch_size, "max_batches": args.max_batches, "seed": args.seed,
    }  # fmt: skip
    if folder is not None:  # the files first: a closed stdout must not cost them
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "doctor.md").write_text(report.to_markdown(), encoding="utf-8")
        (folder / "doctor.json").write_text(report.to_json(indent=1), encoding="utf-8")
    print(translate(report.summary(how_to_fix="the same command with --fix applies the fixes")))
    if folder is not None:
        print(f"\nreport written to {folder}/doctor.md and {folder}/doctor.json")
    return 0


def _demo_schemes(text: str) -> list[str]:
    """The schemes of ``demo --schemes``, each under its registry name (aliases resolved as a
    study resolves them, :func:`~initlab.study.pipelines.init_identity`), each once."""
    from initlab.study.pipelines import init_identity

    given = split_names("--schemes", text, "scheme", "--schemes fan_in,geometric")
    for scheme in given:
        _check_scheme("--schemes", scheme)
    schemes = [init_identity(s) for s in given]
    for scheme in dict.fromkeys(schemes):
        same = [g for g, c in zip(given, schemes, strict=True) if c == scheme]
        if len(same) > 1:
            aliases = f" ({' and '.join(same)} are both {scheme})" if len(set(same)) > 1 else ""
            raise ValueError(f"--schemes {text}: {scheme} given twice{aliases}; name each "
                             "scheme once")  # fmt: skip
    return schemes


def _cmd_demo(args: argparse.Namespace) -> int:
    from initlab.cli.demo import DEMO_SCHEMES, run_demo

    schemes = _demo_schemes(args.schemes) if args.schemes is not None else list(DEMO_SCHEMES)
    start = time.perf_counter()
    out = Path(args.out if args.out is not None else "initlab-demo")
    if not args.quick:
        check_out_dir("--out", out)
    elif args.out is not None:
        note(args, "--out is unused with --quick (step 1 only, which writes nothing)")

    def step(text: str) -> None:
        print(f"\n== {text} ({time.perf_counter() - start:.1f} s)", flush=True)

    step(f"1/3 moments: forward/backward second moments per layer and scheme (seed {args.seed}, "
         f"batch {args.batch_size})")  # fmt: skip
    print(run_demo(schemes, seed=args.seed, batch_size=args.batch_size))
    if not args.quick:
        from initlab.cli.demo import demo_training, no_empty_folders, training_schemes
        from initlab.cli.diagnose import diagnose_demo

        with no_empty_folders(out):  # an interrupted demo leaves no empty folder behind
            step(f"2/3 diagnosis: GR scaling, weight-to-gradient ratio, verdicts per layer "
                 f"(seed {args.seed})")  # fmt: skip
            _, comparison = diagnose_demo(
                schemes, seed=args.seed, out=out / "diagnosis",
                progress=lambda msg: print(f"   {msg}", flush=True),
            )  # fmt: skip
            print(comparison)
            study_schemes = training_schemes(schemes)
            step(f"3/3 training: {', '.join(study_schemes)} x 3 seeds (from {args.seed}) x 4 "
                 "learning rates, 3 epochs (vectorized)")  # fmt: skip
            print(demo_training(out, study_schemes, seed=args.seed, note=lambda t: note(args, t)))
        print(f"\nreport folder: {out}/ (diagnosis/*.html, study/table2.md, study/plots/)")
    print(f"\ndone in {time.perf_counter() - start:.1f} s")
    return 0


def _cmd_data(args: argparse.Namespace) -> int:
    from initlab._core.rows import Rows
    from initlab.data import list_datasets
    from initlab.data.catalogue import data_root_source

    check_not_empty("--data-dir", args.data_dir, "the data root folder")
    root, how = data_root_source(args.data_dir)
    how = "from --data-dir" if args.data_dir is not None else how
    print(f"data root: {root} ({how})")
    said = data_root_note(root, how)
    if said is not None:
        note(args, said)
    print(Rows(list_datasets(args.data_dir), title="initlab data sets"))
    return 0


_MODEL_HELP = "'pkg.module:factory', 'file.py:factory' or 'zoo:NAME'"
_DATA_HELP = (
    "random | random:3x32x32 | digits | a data set `initlab data` lists (libsvm:letter, mnist, "
    "...), with a study spec's options: mnist?pad=2&train_per_class=50 (its training split) | "
    "file.pt | pkg.module:fn | file.py:fn"
)
_DATA_DIR_HELP = (
    "data root of the named data sets (default: $INITLAB_DATA_DIR, else ../shared/data if that "
    "folder exists, else ~/initlab-data; `initlab data` prints the one in use)"
)


def _loss_help(prefix: str) -> str:
    from initlab._core.loss import LOSSES

    return f"{prefix}{' | '.join(LOSSES)} | pkg.module:fn | file.py:fn (fn(model, batch) -> scalar)"


Subparsers = Any  # argparse's private _SubParsersAction


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
        "without --method, the factory's own init with --method (lsuv: see --method)",
    )
    p.add_argument(
        "--method",
        choices=sorted(_METHODS),
        help="data-dependent method run after the scheme. lsuv rescales the --scheme's weights "
        "and keeps its --bias; without --scheme, lsuv first replaces the factory's weights with "
        "an orthogonal pre-init and zero biases (Mishkin & Matas)",
    )
    p.add_argument("--data", help=f"data for --method: {_DATA_HELP}")
    p.add_argument("--data-dir", help=_DATA_DIR_HELP)
    p.add_argument(
        "--input-shape",
        help="per-example input shape of --method's random data (no --data, or --data random), "
        "e.g. 3x32x32; overrides a zoo model's shape",
    )
    p.add_argument(
        "--loss", help=_loss_help("loss of gradinit/metainit/precondition (default auto): ")
    )
    p.add_argument(
        "--batch-size", type=positive_int, default=64, action=_Given,
        help="examples per batch of --method's data (default: %(default)s); data that is already "
        "batched (a list of batches) keeps its own",
    )  # fmt: skip
    p.add_argument(
        "--max-batches", "--batches", dest="max_batches", type=positive_int, default=None,
        action=_MaxBatches,
        help=f"at most this many batches of --data for --method (default: "
        f"{DEFAULT_INIT_BATCHES}, or what --steps needs: steps+1 for gradinit, steps for "
        "metainit; --batches: the old name)",
    )  # fmt: skip
    p.add_argument(
        "--steps", type=positive_int,
        help="gradinit/metainit: optimization steps (default: one pass over the --max-batches "
        f"batches, {DEFAULT_INIT_BATCHES - 1} for gradinit and {DEFAULT_INIT_BATCHES} for "
        "metainit with the default)",
    )  # fmt: skip
    p.add_argument(
        "--how",
        choices=["lr", "rescale", "parametrize"],
        help="precondition: 'lr' (default) leaves the weights unchanged and reports per-layer "
        "learning-rate scales (save them with --report); 'rescale' changes the weights in "
        "place (ReLU chains without normalization only); 'parametrize' is refused: a state dict "
        "cannot carry it (use the Python API)",
    )
    p.add_argument(
        "--seed", type=seed_int, default=0,
        help="seeds the model's construction, the init's torch.Generator and the data "
        "(default: %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--bias", default="zeros", action=_Given,
        help="biases of --scheme: 'zeros', 'keep' (the factory's biases) or a number (default: "
        "%(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--policy",
        default="warn",
        choices=["error", "warn", "skip"],
        help="what to do with parameters no handler claims (default: %(default)s)",
    )
    p.add_argument("--out", required=True, help="where to save the state dict (.pt)")
    p.add_argument("--report", help="also save the report rows as JSON here")
    p.set_defaults(func=_cmd_init)


_SEED_HELP = (
    "seeds the model's construction, the data, the init/fixes and the random loss (default: "
    "%(default)s)"
)


def _add_diagnose(sub: Subparsers) -> None:
    p = sub.add_parser("diagnose", help="per-layer conditioning report of a model")
    _add_model_data_loss(p)
    p.add_argument("--init", help="initialize with this scheme first (default: keep)")
    p.add_argument("--out", help="folder for report.html, report.json, report.md, summary.txt")
    _add_batches(p)
    p.add_argument("--seed", type=seed_int, default=0, help=_SEED_HELP)
    p.add_argument("--curvature", action="store_true", help="also Hessian blocks (slower)")
    p.add_argument("--no-plots", action="store_true", help="skip the figures (no matplotlib)")
    p.set_defaults(func=_cmd_diagnose)


def _add_model_data_loss(p: argparse.ArgumentParser) -> None:
    """--model, --model-kwargs, --data, --loss: what ``diagnose`` and ``doctor`` load alike."""
    p.add_argument("--model", required=True, help=_MODEL_HELP)
    p.add_argument("--model-kwargs", help="JSON object of keyword arguments for the factory")
    p.add_argument("--data", help=f"{_DATA_HELP} (default: random inputs of a zoo model's shape)")
    p.add_argument("--data-dir", help=_DATA_DIR_HELP)
    p.add_argument(
        "--loss",
        help=_loss_help("default: auto with targets, random_quadratic without; "),
    )


class _Given(argparse.Action):
    """Stores the value, and its ``dest`` in ``namespace.given``: whether the user chose it
    (:func:`_given`), as the default alone would not say."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = {*getattr(namespace, "given", ()), self.dest}


class _MaxBatches(argparse.Action):
    """``--max-batches N``; its old name ``--batches`` still works, with a deprecation note."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        setattr(namespace, self.dest, values)
        if option == "--batches":
            namespace.deprecated = ["--batches is deprecated; use --max-batches (same meaning)"]


def _add_batches(p: argparse.ArgumentParser) -> None:
    """--batch-size and --max-batches (--batches: the old name) of ``diagnose`` and ``doctor``."""
    p.add_argument(
        "--batch-size", type=positive_int, default=64, action=_Given,
        help="examples per batch (default: %(default)s); data that is already batched (a list of "
        "batches) keeps its own",
    )  # fmt: skip
    p.add_argument(
        "--max-batches", "--batches", dest="max_batches", type=positive_int, default=4,
        action=_MaxBatches,
        help="at most this many batches of --data (default: %(default)s; --batches: the old "
        "name)",
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
    p.add_argument("--seed", type=seed_int, default=0, help=_SEED_HELP)
    p.set_defaults(func=_cmd_doctor)


def _add_data(sub: Subparsers) -> None:
    p = sub.add_parser("data", help="list the data sets the loaders know and where they are")
    p.add_argument("--data-dir", help=_DATA_DIR_HELP)
    p.set_defaults(func=_cmd_data)


def _add_bench(sub: Subparsers) -> None:
    from initlab.cli.bench import add_bench

    add_bench(sub, data_dir_help=_DATA_DIR_HELP, debug_help=_DEBUG_HELP)


def _demo_batch(text: str) -> int:
    """An argparse type: the demo's measured batch, 2 to 1,797 (the digits set's size)."""
    value = positive_int(text)
    if not 2 <= value <= 1797:
        raise argparse.ArgumentTypeError(f"must be in [2, 1797] (the digits set), got {text}")
    return value


def _add_demo(sub: Subparsers) -> None:
    p = sub.add_parser(
        "demo",
        help="compare schemes on the paper MLP with bundled digits data",
        description="Three steps: 1. moments of one batch per scheme; 2. the per-layer "
        "diagnosis per scheme (4 batches of 256); 3. a small training study of the schemes "
        "among --schemes that are one of fan_in, fan_out, arithmetic, geometric (all of "
        "--schemes when it names none of these four) x 3 seeds x 4 learning rates, batch 64, "
        "stored in OUT/demo.sqlite under a study named after the schemes and seed (finished "
        "runs of the same options are reused).",
    )
    p.add_argument("--schemes", help="comma-separated scheme names (default: all demo schemes)")
    p.add_argument(
        "--seed", type=seed_int, default=0,
        help="seeds all three steps: the init, the batches, and the study's seeds (SEED, "
        "SEED+1, SEED+2) (default: %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--batch-size", type=_demo_batch, default=1024,
        help="examples in step 1's measured batch, 2 to 1797 (default: %(default)s; steps 2 and "
        "3 use batches of 256 and 64)",
    )  # fmt: skip
    p.add_argument("--out", help="report folder (default: initlab-demo; unused with --quick)")
    p.add_argument("--quick", action="store_true", help="step 1 only (seconds); writes nothing")
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
    sub.metavar = "{" + ",".join(sub.choices) + "}"  # `initlab` alone names them, not "command"
    for command in _leaf_parsers(sub):  # also after the command: initlab init ... --debug
        command.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP
        )
    return parser


def _leaf_parsers(sub: Subparsers) -> Iterator[argparse.ArgumentParser]:
    """The parsers of every (sub)command that takes options: ``init``, ..., ``bench run``."""
    for command in sub.choices.values():
        nested = [a for a in command._actions if isinstance(a, argparse._SubParsersAction)]
        if nested:
            for inner in nested:
                yield from _leaf_parsers(inner)
        else:
            yield command


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


_DTYPE_ERRORS = ("same dtype", "expected scalar type", "should be the same")


def _mismatch_hint(err: BaseException, command: str) -> str | None:
    """What to check when the model could not run on the data (a shape or dtype mismatch torch
    raised: bad input), else ``None``."""
    if not isinstance(err, RuntimeError):
        return None
    text = str(err).lower()
    if any(s in text for s in _DTYPE_ERRORS):
        return (
            "its dtype is not the model's; convert the data before saving it, e.g. x.float() "
            "for float64 or uint8 inputs of a float32 model, y.long() for class labels"
        )
    if not any(s in text for s in _SHAPE_ERRORS):
        return None
    if command == "init":
        return "do --data, --input-shape and the model's input agree?"
    return (
        "do --data (e.g. random:3x32x32 for that shape per example) and the model's input "
        "agree? A factory's input size may be set with --model-kwargs"
    )


def _exit_code(err: BaseException) -> int:
    """2 for bad input (see the module docstring), 1 for any other failure."""
    return 2 if isinstance(err, _INPUT_ERRORS) or _mismatch_hint(err, "") else 1


def _message(err: BaseException, command: str = "init") -> str:
    """The one-line text of an error: its message, with the type where the message alone is
    unclear, a hint for a model that cannot run on the data, and the library's Python wording
    (``root=``, ``policy='warn'``) said with the command's flags."""
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        return f"{err.strerror}: {err.filename}"
    text = str(err).strip() or type(err).__name__
    if not isinstance(err, (ValueError, TypeError, ImportError, ArithmeticError, OSError)):
        text = f"{type(err).__name__}: {text}"
    hint = _mismatch_hint(err, command)
    if hint is not None:
        text += f" (the model could not run on the data: {hint})"
    return translate(text)


class _QuietStdout(io.TextIOBase):
    """``sys.stdout`` during a command: a reader that went away (``| head -1``) silences the
    output instead of failing the command, so every file it writes is still written.

    As Python's documentation recommends for SIGPIPE, the process's stdout is pointed at
    ``os.devnull`` once the pipe is broken, so the interpreter's final flush is quiet too.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.broken = False

    def _silence(self) -> None:
        self.broken = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):  # not a file (a test's capture)
            pass

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return int(self._stream.write(text))
            except BrokenPipeError:
                self._silence()
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._silence()

    def isatty(self) -> bool:
        return bool(self._stream.isatty())

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return str(getattr(self._stream, "encoding", "utf-8"))


@contextmanager
def _command_io(args: argparse.Namespace) -> Iterator[_QuietStdout]:
    """A broken-pipe-proof stdout, and warnings printed as ``initlab <cmd>: warning: ...``."""
    quiet = _QuietStdout(sys.stdout)

    def show(message: Any, category: Any, *_args: Any, **_kwargs: Any) -> None:
        note(args, translate(" ".join(str(message).split())))

    saved = sys.stdout
    sys.stdout = quiet  # type: ignore[assignment]
    try:
        with warnings.catch_warnings():
            warnings.showwarning = show
            yield quiet
    finally:
        quiet.flush()
        sys.stdout = saved


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``initlab`` command; returns the exit code.

    Every error of a command is printed as ``initlab <command>: error: <message>`` on stderr (the
    traceback too with ``--debug``); see the module docstring for the exit codes. A closed
    stdout (``initlab init ... | head -1``) is not an error: the files are written and the rest
    of the output is dropped.
    """
    args = _parser().parse_args(argv)
    name = command_name(args)
    with _command_io(args):
        for text in getattr(args, "deprecated", ()):
            note(args, text)
        try:
            return int(args.func(args))
        except KeyboardInterrupt:
            print(f"initlab {name}: interrupted", file=sys.stderr)
            return 130
        except Exception as err:
            if args.debug:
                traceback.print_exc()
            from initlab.cli.inputs import blame_loss

            # an error of the user's --loss function names it
            err = blame_loss(err, getattr(args, "loss", None), lambda e: _message(e, args.command))
            print(f"initlab {name}: error: {_message(err, args.command)}", file=sys.stderr)
            return _exit_code(err)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
