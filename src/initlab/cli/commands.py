"""What each ``initlab`` command does: ``schemes``, ``init``, ``diagnose``, ``doctor``, ``demo``,
``data`` (``bench``: :mod:`initlab.cli.bench`). Each takes the parsed options
(:mod:`initlab.cli.parser`), checks them before any work, and calls the library's public functions.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from initlab.cli._checks import (
    check_batch_count,
    check_distinct,
    check_not_empty,
    check_out_dir,
    check_out_file,
    data_root_note,
    make_parent,
    max_batches_for,
    note,
    split_names,
    translate,
    translate_strings,
)

if TYPE_CHECKING:
    from initlab.cli.inputs import NamedData

__all__ = [
    "METHODS",
    "cmd_data",
    "cmd_demo",
    "cmd_diagnose",
    "cmd_doctor",
    "cmd_init",
    "cmd_schemes",
]


def cmd_schemes(args: argparse.Namespace) -> int:
    from initlab._core.rows import Rows
    from initlab.init.schemes import list_schemes

    print(Rows(list_schemes(), title="initlab schemes"))
    return 0


#: ``initlab init --method NAME``: (module, function, takes a loss_fn).
METHODS = {
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


def _zoo_data(args: argparse.Namespace, batches: int) -> NamedData | None:
    """A data set that ``initlab data`` lists, named by --data, when --model is a zoo model: it
    is loaded first, and the model takes its sizes from it, as in a study (``None`` else)."""
    from initlab.cli.inputs import load_named_data

    if not args.model.startswith("zoo:"):
        return None
    return load_named_data(args.data, batch_size=args.batch_size, batches=batches,
                           seed=args.seed, data_dir=args.data_dir)  # fmt: skip


def _load_data(
    args: argparse.Namespace,
    shape: Any,
    batches: int,
    shape_flag: str | None = None,
    named: NamedData | None = None,
) -> tuple[list[Any], bool]:
    """The batches of --data (init, doctor; ``named``: those already loaded), and whether it
    came already batched (so --batch-size was not used: noted when it was given)."""
    from initlab.cli.inputs import load_data_spec

    if named is not None:
        return named.batches, False
    said: list[str] = []
    data = load_data_spec(
        args.data, shape, batch_size=args.batch_size, batches=batches, seed=args.seed,
        data_dir=args.data_dir, shape_flag=shape_flag, note=said.append,
    )  # fmt: skip
    tell = _batch_size_note(args)
    for text in said:
        tell(text)
    return data, bool(said)


def _run_method(args: argparse.Namespace, model: nn.Module, named: NamedData | None) -> Any:
    from initlab.cli.inputs import has_targets, load_loss

    module_name, fn_name, takes_loss = METHODS[args.method]
    method = getattr(importlib.import_module(module_name), fn_name)
    data, batched = _load_data(
        args, args.input_shape, max_batches_for(args), "--input-shape", named
    )
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
        where = (
            f"in {report_path} (its rows whose table is precondition_)"
            if report_path
            else "above (add --report FILE to save them)"
        )
        return [
            "note: precondition --how lr leaves the weights unchanged (the saved state dict is "
            "the init's); its result is the per-layer learning-rate scales lr_scale_sgd and "
            f"lr_scale_adam, {where}. --how rescale changes the weights instead."
        ]
    return []


def cmd_init(args: argparse.Namespace) -> int:
    from initlab.cli.inputs import load_model_spec, parse_shape
    from initlab.init.model import init_model

    bias = _parse_bias(args.bias)
    _check_init_options(args)
    out = check_out_file("--out", args.out)
    report_path = check_out_file("--report", args.report) if args.report is not None else None
    _check_paths(model=_model_file(args.model), data=_data_file(args.data), out=args.out,
                 report=args.report)  # fmt: skip
    named = _zoo_data(args, max_batches_for(args)) if args.method is not None else None
    model, shape = load_model_spec(args.model, args.model_kwargs, seed=args.seed, data=named)
    args.input_shape = parse_shape(args.input_shape) if args.input_shape else shape
    scheme = args.scheme or ("geometric" if args.method is None else None)
    report: Any = None
    printed: list[Any] = []
    if scheme is not None:
        report = init_model(model, scheme, generator=args.seed, bias=bias, policy=args.policy)
        printed.append(report)
    if args.method is not None:
        report = _run_method(args, model, named)
        if sys.stderr.isatty():
            print(file=sys.stderr)
        printed.append(report)
        if getattr(report, "trace", None) is not None:
            printed.append(report.trace)
    # the files first: a closed stdout (`| head -1`) must not cost the results
    torch.save(model.state_dict(), make_parent(out))
    if report_path is not None and printed:  # every table printed, each row naming its own
        rows = [{"table": item.title, **row} for item in printed for row in item.to_rows()]
        make_parent(report_path).write_text(json.dumps(rows, indent=1, default=str))
    for item in printed:
        print(item)
    print(f"\nsaved state dict to {out}")
    if report_path is not None and printed:
        print(f"saved report rows to {report_path}")
    for line in _method_notes(args, report_path):
        print(line)
    return 0


def cmd_diagnose(args: argparse.Namespace) -> int:
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


def cmd_doctor(args: argparse.Namespace) -> int:
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
    named = _zoo_data(args, args.max_batches)
    model, shape = load_model_spec(args.model, args.model_kwargs, seed=args.seed, data=named)
    data, _ = _load_data(args, shape, args.max_batches, named=named)
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
        # in the command line's wording, as printed below (the API's files keep the API's)
        (folder / "doctor.md").write_text(translate(report.to_markdown()), encoding="utf-8")
        saved = translate_strings(json.loads(report.to_json()))
        (folder / "doctor.json").write_text(json.dumps(saved, indent=1), encoding="utf-8")
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


@contextlib.contextmanager
def _demo_step(number: str, text: str) -> Iterator[None]:
    """Print a demo step's header, and when the step ends, its own duration (wall time from
    its start to its end; ``demo`` ends with the total)."""
    print(f"\n== {number} {text}", flush=True)
    start = time.perf_counter()
    yield
    print(f"   step {number} took {time.perf_counter() - start:.1f} s", flush=True)


def cmd_demo(args: argparse.Namespace) -> int:
    from initlab.cli.demo import DEMO_SCHEMES, run_demo

    schemes = _demo_schemes(args.schemes) if args.schemes is not None else list(DEMO_SCHEMES)
    start = time.perf_counter()
    out = Path(args.out if args.out is not None else "initlab-demo")
    if not args.quick:
        check_out_dir("--out", out)
    elif args.out is not None:
        note(args, "--out is unused with --quick (step 1 only, which writes nothing)")

    with _demo_step("1/3", f"moments: forward/backward second moments per layer and scheme "
                    f"(seed {args.seed}, batch {args.batch_size})"):  # fmt: skip
        print(run_demo(schemes, seed=args.seed, batch_size=args.batch_size))
    if not args.quick:
        from initlab.cli.demo import demo_training, no_empty_folders, training_schemes
        from initlab.cli.diagnose import diagnose_demo

        with no_empty_folders(out):  # an interrupted demo leaves no empty folder behind
            with _demo_step("2/3", "diagnosis: GR scaling, weight-to-gradient ratio, verdicts "
                            f"per layer (seed {args.seed})"):  # fmt: skip
                _, comparison = diagnose_demo(
                    schemes, seed=args.seed, out=out / "diagnosis",
                    progress=lambda msg: print(f"   {msg}", flush=True),
                )  # fmt: skip
                print(comparison)
            study_schemes = training_schemes(schemes)
            with _demo_step("3/3", f"training: {', '.join(study_schemes)} x 3 seeds (from "
                            f"{args.seed}) x 4 learning rates, 3 epochs (vectorized)"):  # fmt: skip
                print(demo_training(out, study_schemes, seed=args.seed,
                                    note=lambda t: note(args, t)))  # fmt: skip
        print(f"\nreport folder: {out}/ (diagnosis/*.html, study/table2.md, study/plots/)")
    print(f"\ndone in {time.perf_counter() - start:.1f} s")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from initlab._core.rows import Rows
    from initlab.data import list_datasets
    from initlab.data.cache import default_cache_dir
    from initlab.data.catalogue import data_root_source

    check_not_empty("--data-dir", args.data_dir, "the data root folder")
    root, how = data_root_source(args.data_dir)
    how = "from --data-dir" if args.data_dir is not None else how
    print(f"data root: {root} ({how})")
    cache = default_cache_dir()
    source = "from $INITLAB_CACHE_DIR" if os.environ.get("INITLAB_CACHE_DIR") else "the default"
    print(f"cache: {cache} ({source}; a named data set is decoded into it once, then read from it)")
    said = data_root_note(root, how)
    if said is not None:
        note(args, said)
    print(Rows(list_datasets(args.data_dir), title="initlab data sets"))
    return 0
