"""The ``initlab`` command line's options: one parser per command, its help texts, and the
actions that record what the user gave. Argument parsing lives here and only here."""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from typing import Any

from initlab.cli._checks import DEFAULT_INIT_BATCHES, command_name, positive_int, seed_int
from initlab.cli.commands import (
    METHODS,
    cmd_data,
    cmd_demo,
    cmd_diagnose,
    cmd_doctor,
    cmd_init,
    cmd_schemes,
)

__all__ = ["DEBUG_HELP", "build_parser", "parse"]

DEBUG_HELP = "on an error, print the full traceback too (default: the message alone)"


_MODEL_HELP = (
    "'pkg.module:factory', 'file.py:factory' or 'zoo:NAME' (on a data set that `initlab data` "
    "lists, a zoo model takes its n_in, in_channels and n_classes from it, as in a study, "
    "unless --model-kwargs gives them)"
)
_DATA_HELP = (
    "random | random:3x32x32 | digits | a data set `initlab data` lists (libsvm:letter, mnist, "
    "...), with a study spec's options: mnist?pad=2&train_per_class=50 (its training split) | "
    "file.pt | pkg.module:fn | file.py:fn"
)
_DATA_DIR_HELP = (
    "data root of the named data sets (default: $INITLAB_DATA_DIR, else ../shared/data if that "
    "folder exists, else ~/initlab-data; `initlab data` prints the one in use). A named data "
    "set is decoded once into a cache: $INITLAB_CACHE_DIR, else ~/.cache/initlab"
)


def _loss_help(prefix: str) -> str:
    from initlab._core.loss import LOSSES

    return f"{prefix}{' | '.join(LOSSES)} | pkg.module:fn | file.py:fn (fn(model, batch) -> scalar)"


Subparsers = Any  # argparse's private _SubParsersAction


def _add_schemes(sub: Subparsers) -> None:
    p = sub.add_parser("schemes", help="list the initialization schemes with their formulas")
    p.set_defaults(func=cmd_schemes)


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
        choices=sorted(METHODS),
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
    p.add_argument(
        "--report",
        help="also save the rows of every table printed (the scheme's, the method's, its trace) "
        "as JSON here, each row with its table's name under 'table'",
    )
    p.set_defaults(func=cmd_init)


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
    p.set_defaults(func=cmd_diagnose)


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
    p.set_defaults(func=cmd_doctor)


def _add_data(sub: Subparsers) -> None:
    p = sub.add_parser("data", help="list the data sets the loaders know and where they are")
    p.add_argument("--data-dir", help=_DATA_DIR_HELP)
    p.set_defaults(func=cmd_data)


def _add_bench(sub: Subparsers) -> None:
    from initlab.cli.bench import add_bench

    add_bench(sub, data_dir_help=_DATA_DIR_HELP, debug_help=DEBUG_HELP)


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
    p.set_defaults(func=cmd_demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="initlab",
        description="Well-conditioned neural networks at step zero.",
    )
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (
        _add_schemes, _add_init, _add_diagnose, _add_doctor, _add_data, _add_bench, _add_demo,
    ):  # fmt: skip
        add(sub)
    sub.metavar = "{" + ",".join(sub.choices) + "}"  # `initlab` alone names them, not "command"
    for command in _leaf_parsers(sub):  # also after the command: initlab init ... --debug
        command.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP
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


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The options of ``argv``. One the command does not take is refused by the command's own
    parser, with its usage (argparse's top-level parser answered with the top level's)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        command = parser
        for word in command_name(args).split():  # "init", or "bench run"
            sub = next(a for a in command._actions if isinstance(a, argparse._SubParsersAction))
            command = sub.choices[word]
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    return args
