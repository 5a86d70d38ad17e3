"""What the command line names: models, data and losses given as strings.

* models: ``"pkg.module:factory"``, ``"path/file.py:factory"`` or ``"zoo:NAME"``;
* data: ``"random"``, ``"random:3x32x32"``, ``"digits"``, a data set name that ``initlab data``
  lists (``"libsvm:letter"`` or ``"letter"``, ``"mnist"``, ``"sklearn:iris"``), a ``.pt`` file or
  ``"pkg.module:fn"``;
* losses: a name of :data:`initlab._core.loss.LOSSES` or ``"pkg.module:fn"``.

Every error names the flag it is about (``--model``, ``--data``, ``--loss``) and what it accepts.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import json
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from initlab._core.data import batch_tensors, first_tensor, is_single_batch, take_batches
from initlab._core.loss import LOSSES, Loss, make_loss
from initlab._core.pytree import find_path, shallow_types

__all__ = [
    "DATA_SPECS",
    "NamedData",
    "blame_loss",
    "check_data_spec",
    "check_loss_name",
    "has_targets",
    "is_named_dataset",
    "load_data_spec",
    "load_factory",
    "load_loss",
    "load_model_spec",
    "load_named_data",
    "parse_shape",
]

DATA_SPECS = (
    "random, random:3x32x32, digits, a data set that `initlab data` lists (e.g. libsvm:letter, "
    "mnist, sklearn:iris) with options as in a study spec (e.g. mnist?pad=2&train_per_class=50), "
    "a .pt file or pkg.module:fn"
)


@functools.lru_cache(maxsize=16)
def _run_file(path: str, mtime_ns: int, size: int) -> Any:
    """The module of the Python file ``path``, executed once per version of the file (a
    ``--loss`` file is resolved when the options are checked and again when it is used)."""
    mod_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    assert mod_spec is not None and mod_spec.loader is not None
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


def load_factory(spec: str, flag: str = "--model") -> Any:
    """Resolve ``"pkg.module:factory"`` or ``"path/to/file.py:factory"`` to the callable; errors
    name ``flag`` (the option the spec came from)."""
    module_part, sep, attr = spec.partition(":")
    if not sep or not module_part or not attr:
        fn = "factory" if flag == "--model" else "function"
        raise ValueError(
            f"{flag} must look like 'pkg.module:{fn}' or 'path/file.py:{fn}', got {spec!r}"
        )
    if module_part.endswith(".py"):
        module = _load_file(Path(module_part), flag)
    else:
        module = _import_module(module_part, attr, flag)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{module_part!r} has no attribute {attr!r} (from {flag} {spec!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{flag} {spec!r} is not callable")
    return obj


def _failure(err: BaseException) -> str:
    """``Type: what happened`` of an error raised while a user's module ran."""
    detail = str(err).strip()
    if isinstance(err, SystemExit):
        detail = f"it called sys.exit({err.code!r})"
    return f"{type(err).__name__}: {detail}"


def _load_file(path: Path, flag: str) -> Any:
    """The module of ``--model file.py:factory``; any failure of the user's file is bad input."""
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder, not a Python file")
    if not path.is_file():
        raise ValueError(f"{flag} file {path} does not exist")
    stat = path.stat()
    try:
        return _run_file(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    except (Exception, SystemExit) as err:
        raise ValueError(f"{flag} {path}: executing the file failed: {_failure(err)}") from err


def _import_module(name: str, attr: str, flag: str) -> Any:
    """The module of ``--model pkg.module:factory``; any failure of the user's module is bad
    input, as for a file."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ValueError(
            f"cannot import {name!r} for {flag}: {err}{_local_module_hint(name, attr, flag, err)}"
        ) from err
    except (Exception, SystemExit) as err:
        raise ValueError(f"{flag} {name}:{attr}: importing {name} failed: {_failure(err)}") from err


def _local_module_hint(name: str, attr: str, flag: str, err: ImportError) -> str:
    """Where ``name`` is a file of the current folder, which the ``initlab`` console script does
    not import from (``python -m initlab`` does): how to name it."""
    if not isinstance(err, ModuleNotFoundError) or err.name != name.split(".")[0]:
        return ""
    file = Path(*name.split(".")).with_suffix(".py")
    if file.is_file():
        return (
            f"; {file} is in this folder, which is not on the import path: use {flag} "
            f"{file}:{attr}, or PYTHONPATH=."
        )
    if (file.with_suffix("") / "__init__.py").is_file():
        return (
            f"; {file.with_suffix('')} is a package in this folder, which is not on the "
            "import path: run with PYTHONPATH=."
        )
    return ""


def parse_shape(text: str, flag: str = "--input-shape", prefix: str = "") -> tuple[int, ...]:
    """``"3x32x32"`` -> ``(3, 32, 32)`` (``,`` joins sizes too, and spaces around a size are
    left out: ``"3, 32, 32"``); errors name ``flag`` (``prefix``: what precedes the shape in its
    value, ``random:`` for ``--data random:SHAPE``). Every size is decimal digits 0-9: an empty
    one (``3x32x``, ``x3``: a truncated shape) is refused, not dropped, and so are ``int()``'s
    other spellings (``1_0``, ``+3``, ``３``), each with what is wrong."""
    parts = [s.strip() for s in text.replace(",", "x").split("x")]
    digits = all(s.isascii() and s.isdigit() for s in parts)
    shape = tuple(int(s) for s in parts) if digits else ()
    if not shape or any(s < 1 for s in shape):
        raise ValueError(
            f"{flag} {prefix}{text}: {text!r} is not a shape (positive sizes joined by "
            f"x{_shape_fault(text, parts)}); write e.g. {flag} {prefix}3x32x32"
        )
    return shape


def _shape_fault(text: str, parts: list[str]) -> str:
    """What is wrong with a shape's sizes (``parts``, stripped), for :func:`parse_shape`'s
    message: no text, an empty size, one that reads as a number but is not plain digits 0-9 (a
    sign, a digit separator, a space inside, non-ASCII digits), or a 0; ``""`` where the text
    says it (``abc``)."""
    if not text.strip():
        return "; it is empty"
    if "" in parts:
        return "; it has an empty size"
    for size in parts:
        if (size.isascii() and size.isdigit()) or not any(c.isdigit() for c in size):
            continue
        if size[0] in "+-":
            why = "has a sign"
        elif "_" in size:
            why = "has an underscore"
        elif any(c.isspace() for c in size):
            why = "has a space inside"
        elif not size.isascii():
            why = "has characters other than the digits 0-9"
        else:
            why = "is not decimal digits"
        return f"; the size {size!r} {why}"
    zero = all(s.isascii() and s.isdigit() for s in parts) and any(int(s) == 0 for s in parts)
    return "; a size is 0" if zero else ""


@dataclass(frozen=True)
class NamedData:
    """A data set that ``initlab data`` lists, as ``--data`` names it: the batches drawn from its
    training split, and what a zoo model takes from it (as in a study,
    :func:`initlab.study.models.data_arguments`).

    Attributes:
        name: its catalogue name with its options (``"libsvm:letter"``, ``"mnist?pad=2"``).
        batches: ``(x, y)`` batches of the training split.
        shape: one example's shape (``(16,)``, ``(1, 28, 28)``).
        n_classes: the data set's classes.
    """

    name: str
    batches: list[Any]
    shape: tuple[int, ...]
    n_classes: int


def load_model_spec(
    spec: str,
    model_kwargs: str | Mapping[str, Any] | None,
    *,
    seed: int | None = None,
    data: NamedData | None = None,
) -> tuple[nn.Module, Any]:
    """``(model, example input shape or None)`` from ``zoo:NAME`` or ``pkg.module:factory``.

    With ``seed``, the model is built under that seed (a factory draws its initial weights from
    torch's global RNG; its state outside this call is left as it was). With ``data`` (a named
    ``--data`` set), a zoo model takes its sizes from it as in a study (``n_in``,
    ``in_channels``, ``n_classes``/``n_out``: :func:`initlab.study.models.data_arguments`);
    those that ``model_kwargs`` gives are kept."""
    if seed is None:
        return _load_model_spec(spec, model_kwargs, data)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _load_model_spec(spec, model_kwargs, data)


def _sized(name: str, kwargs: dict[str, Any], data: NamedData) -> dict[str, Any]:
    """``kwargs`` of zoo model ``name`` with the sizes it takes from ``data`` that they do not
    give; a class count given below the data set's is warned of (its labels would exceed it)."""
    from initlab.study.models import data_arguments
    from initlab.zoo import list_models

    defaults = {m["name"]: m["default_cfg"] for m in list_models()}
    if name not in defaults:  # create_model names the zoo's models
        return kwargs
    for key in ("n_classes", "n_out"):
        given = kwargs.get(key)
        if key in defaults[name] and isinstance(given, int) and given < data.n_classes:
            warnings.warn(
                f"--model-kwargs sets {key}={given}, but --data {data.name} has {data.n_classes} "
                f"classes (labels up to {data.n_classes - 1}); leave {key} out to take it from "
                "the data set",
                UserWarning,
                stacklevel=2,
            )
    return {**data_arguments(name, data.name, data.shape, data.n_classes, kwargs), **kwargs}


def _load_model_spec(
    spec: str, model_kwargs: str | Mapping[str, Any] | None, data: NamedData | None
) -> tuple[nn.Module, Any]:
    try:
        kwargs = json.loads(model_kwargs) if isinstance(model_kwargs, str) else model_kwargs
    except json.JSONDecodeError as err:
        raise ValueError(f"--model-kwargs is not valid JSON ({err}): {model_kwargs!r}") from err
    if not isinstance(kwargs, Mapping | None):
        raise ValueError("--model-kwargs must be a JSON object, e.g. '{\"width\": 128}'")
    kwargs = dict(kwargs or {})
    if spec.startswith("zoo:"):
        from initlab.zoo import create_model, input_shape

        name = spec[4:]
        if data is not None:
            kwargs = _sized(name, kwargs, data)
        return create_model(name, **kwargs), input_shape(name, **kwargs)
    factory = load_factory(spec, "--model")
    try:
        model = factory(**kwargs)
    except Exception as err:
        given = f" with --model-kwargs {json.dumps(kwargs)}" if kwargs else ""
        raise ValueError(
            f"--model {spec!r}{given}: the factory raised {type(err).__name__}: {err}"
        ) from err
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {spec!r} returned {type(model).__name__}, not an nn.Module")
    return model, None


def has_targets(batch: Any) -> bool:
    """Whether a batch carries targets: ``(x, y, ...)`` or a dict with ``labels``."""
    if isinstance(batch, Mapping):
        return any(k in batch for k in ("labels", "label", "targets", "target", "y"))
    return isinstance(batch, (tuple, list)) and len(batch) >= 2


def check_loss_name(name: str) -> Any:
    """Refuse a ``--loss`` that is neither a name of :data:`LOSSES` nor ``pkg.module:fn``, before
    any work; the function ``pkg.module:fn`` names (resolved now), ``None`` for a name."""
    if name in LOSSES:
        return None
    if ":" not in name:
        raise ValueError(f"unknown --loss {name!r}; valid: {', '.join(LOSSES)} or pkg.module:fn")
    fn = load_factory(name, "--loss")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: its call says
        return fn
    try:
        signature.bind(None, None)
    except TypeError:
        raise ValueError(
            f"--loss {name!r} must take two arguments, fn(model, batch) (a batch of --data), and "
            f"return the loss; it takes {signature}"
        ) from None
    return fn


#: How the command line calls a ``--loss pkg.module:fn`` function.
_LOSS_CALL = "it is called as fn(model, batch) on each batch of --data and returns the loss"


def blame_loss(
    err: BaseException, spec: str | None, describe: Callable[[BaseException], str] = str
) -> BaseException:
    """``err`` as a ``ValueError`` that names ``--loss spec`` when it was raised while the user's
    loss function ran (its frame is in the traceback of ``err`` or of an error that caused it),
    else ``err`` itself: a bare ``KeyError: 'labels'`` does not say whose code failed.
    ``describe`` gives the text of ``err`` (the command line's, with its hints)."""
    if spec is None or spec in LOSSES or ":" not in spec:
        return err
    try:
        code = getattr(load_factory(spec, "--loss"), "__code__", None)
    except Exception:  # the loss cannot be resolved now: nothing to blame
        return err
    if code is None or not _ran(code, err):
        return err
    text = describe(err).strip()
    kind = f"{type(err).__name__}: "
    return ValueError(f"--loss {spec!r} raised {text if text.startswith(kind) else kind + text} "
                      f"({_LOSS_CALL})")  # fmt: skip


def _ran(code: Any, err: BaseException) -> bool:
    """Whether a frame of ``code`` is in the traceback of ``err`` or of its causes."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        tb = cause.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code is code:
                return True
            tb = tb.tb_next
        cause = cause.__cause__ or cause.__context__
    return False


def check_data_spec(spec: str) -> None:
    """Refuse a ``--data`` that names a file that is not there, or nothing known, before any
    work (loading happens later)."""
    if spec == "random" or spec.startswith("random:"):
        if ":" in spec:
            parse_shape(spec.split(":", 1)[1], "--data", "random:")
        return
    if spec == "digits":
        return
    if spec.endswith((".pt", ".pth")):
        path = Path(spec)
        if path.is_dir():
            raise ValueError(f"--data {spec} is a folder; give a .pt file saved with torch.save")
        if not path.is_file():
            raise ValueError(f"--data file {spec} does not exist")
        return
    name = _named_spec(spec)
    if name is not None:
        _check_options(spec, name)
        return
    base = spec.partition("?")[0]
    if ":" in base:
        _check_catalogue_prefix(base)
    if ":" not in spec or "?" in spec:
        raise ValueError(f"unknown --data {spec!r}; give {DATA_SPECS}")


def _check_options(spec: str, name: str) -> None:
    """Refuse bad options of a named data set (``mnist?pad=x``), as a study spec would, naming
    --data."""
    from initlab.study.datasets import check_dataset_name

    try:
        check_dataset_name(name)
    except ValueError as err:
        text = str(err).removeprefix(f"data set {name!r}: ")
        raise ValueError(f"--data {spec!r}: {text}") from None


def _check_catalogue_prefix(spec: str) -> None:
    """Refuse ``libsvm:nosuch``: a catalogue prefix with a name it does not have (not a module
    ``libsvm`` to import)."""
    from initlab.data import CATALOGUE

    prefix = spec.split(":", 1)[0].strip().lower()
    prefixes = {n.split(":", 1)[0] for n in CATALOGUE if ":" in n}
    if prefix in prefixes and _dataset_name(spec) is None:
        known = ", ".join(n for n in CATALOGUE if n.startswith(f"{prefix}:"))
        raise ValueError(
            f"unknown data set --data {spec!r}; known {prefix} sets: {known} (all: `initlab data`)"
        )


def is_named_dataset(spec: str | None) -> bool:
    """Whether ``--data`` names a data set of the catalogue (read from the data root)."""
    if spec is None:
        return False
    try:
        return _named_spec(spec) is not None
    except ValueError:  # ambiguous: still a name
        return True


def _named_spec(spec: str) -> str | None:
    """The catalogue name ``spec`` means, with its options (``"MNIST?pad=2"`` ->
    ``"mnist?pad=2"``: the names a study spec takes, :mod:`initlab.study.datasets`), or
    ``None``."""
    base, sep, query = spec.partition("?")
    name = _dataset_name(base)
    return None if name is None else name + sep + query


def load_loss(name: str, *, seed: int, targets: bool) -> Loss | Any:
    """The loss ``--loss NAME`` names: a name of :data:`LOSSES` or ``pkg.module:fn``.

    Raises:
        ValueError: an unknown name, or a loss that needs targets (``auto``, ``cross_entropy``,
            ``mse``) on data without them (``targets`` false): the message points to
            ``--loss random_quadratic``.
    """
    if name not in LOSSES:
        return check_loss_name(name)
    if not targets and name in ("auto", "cross_entropy", "mse"):
        raise ValueError(
            f"--loss {name} needs targets, and the batches of --data hold inputs only; pass "
            "--loss random_quadratic (Defazio & Bottou's random quadratic loss of the outputs, "
            "which needs no targets), or --data with labels (digits, or a data set that "
            "`initlab data` lists)"
        )
    return make_loss(name, seed=seed)


def _dataset_name(spec: str) -> str | None:
    """The catalogue name ``spec`` means (``"letter"`` -> ``"libsvm:letter"``), or ``None``."""
    from initlab.data import CATALOGUE

    key = spec.strip().lower()
    if key in CATALOGUE:
        return key
    if f"libsvm:{key}" in CATALOGUE:  # bare names: the study's LIBSVM sets first, as load_dataset
        return f"libsvm:{key}"
    matches = [n for n in CATALOGUE if n.split(":", 1)[-1] == key]
    if len(matches) > 1:
        raise ValueError(f"--data {spec!r} is ambiguous: say {' or '.join(matches)}")
    return matches[0] if matches else None


def _sampled(
    x: torch.Tensor, y: torch.Tensor | None, batch_size: int, batches: int, gen: torch.Generator
) -> list[Any]:
    """``batches`` batches of ``batch_size`` examples drawn without replacement (``gen``)."""
    perm = torch.randperm(len(x), generator=gen)[: batch_size * batches]
    out = []
    for i in range(0, len(perm), batch_size):
        idx = perm[i : i + batch_size]
        out.append((x[idx],) if y is None else (x[idx], y[idx]))
    return out


def _read_pt(spec: str) -> Any:
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--data file {spec} does not exist")
    try:
        return torch.load(path, weights_only=True)
    except Exception as err:
        raise ValueError(
            f"--data {spec}: {_pt_problem(path, err)}; save a tensor, a tuple (x, y) or a list "
            "of batches with torch.save"
        ) from err


def _pt_problem(path: Path, err: Exception) -> str:
    """Why ``torch.load(path, weights_only=True)`` failed, in words: torch's own text is long, or
    a bare ``101`` (a ``KeyError`` of its unpickler) for a text file."""
    with path.open("rb") as fh:
        head = fh.read(512)
    if not head.startswith((b"PK\x03\x04", b"\x80")):  # torch.save's zip, or its legacy pickle
        text = head.decode("utf-8", "ignore")
        plain = b"\x00" not in head and all(c.isprintable() or c.isspace() for c in text)
        what = "an empty file" if not head else "a text file" if plain else "another kind of file"
        return f"it is {what}, not a file that torch.save wrote"
    refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
    if refused:
        return (
            f"it holds an object of type {refused.group(1)}, which torch.load(weights_only=True) "
            "does not load (only tensors, numbers, strings, lists, tuples and dicts)"
        )
    first = (str(err).strip() or type(err).__name__).splitlines()[0].split(". ")[0]
    return (
        f"torch.load(weights_only=True) cannot read it; is it damaged or truncated? "
        f"({type(err).__name__}: {first})"
    )


def _call_data_fn(spec: str) -> Any:
    fn = load_factory(spec, "--data")
    try:
        obj = fn()
    except Exception as err:
        raise ValueError(
            f"--data {spec!r}: the function raised {type(err).__name__}: {err}"
        ) from err
    if (
        obj is None
        or isinstance(obj, (str, bytes))
        or not (isinstance(obj, (torch.Tensor, Mapping, Iterable)))
    ):
        raise ValueError(
            f"--data {spec!r} returned {type(obj).__name__}; return a tensor, a tuple (x, y), a "
            "dict of model inputs, or an iterable of batches"
        )
    return obj


def load_data_spec(
    spec: str | None,
    shape: tuple[int, ...] | None,
    *,
    batch_size: int,
    batches: int,
    seed: int,
    data_dir: str | None = None,
    shape_flag: str | None = None,
    note: Callable[[str], None] | None = None,
) -> list[Any]:
    """Batches from a data spec (see :func:`~initlab.cli.diagnose.diagnose_command`).

    Random data, digits and the named data sets give ``batches`` batches of ``batch_size``
    examples (drawn without replacement with ``seed``); a ``.pt`` file or a function gives its
    batches (a big single batch is split into ``batch_size`` pieces), at most ``batches``; the
    function is called with torch's global RNG seeded by ``seed`` (its state outside the call is
    left as it was).
    ``data_dir`` is the data root of the named sets (default: see :func:`initlab.data.data_root`);
    ``shape_flag``: the command's option that gives random data's shape too (``--input-shape``);
    ``note`` is told when ``batch_size`` is not used: the data is already batched.
    """
    shape_hint = f", {shape_flag} SHAPE," if shape_flag else ","
    _check_counts(batch_size, batches)
    gen = torch.Generator().manual_seed(seed)
    if spec is None or spec == "random" or spec.startswith("random:"):
        if spec is not None and ":" in spec:
            shape = parse_shape(spec.split(":", 1)[1], "--data", "random:")
        if shape is None:
            given = "--data random needs" if spec is not None else "--data is needed:"
            raise ValueError(
                f"{given} the model's input shape, which is unknown: give --data random:SHAPE "
                f"(e.g. random:3x32x32){shape_hint} or another --data (digits, a data set that "
                "`initlab data` lists, a .pt file or pkg.module:fn)"
            )
        return [(torch.randn(batch_size, *shape, generator=gen),) for _ in range(batches)]
    if spec == "digits":
        from initlab.cli.demo import load_digits_tensors

        return _sampled(*load_digits_tensors(), batch_size, batches, gen)
    if spec.endswith((".pt", ".pth")):
        obj = _read_pt(spec)
    else:
        named = load_named_data(
            spec, batch_size=batch_size, batches=batches, seed=seed, data_dir=data_dir
        )
        if named is not None:
            return named.batches
        if ":" not in spec or "?" in spec:
            raise ValueError(f"unknown --data {spec!r}; give {DATA_SPECS}")
        _check_catalogue_prefix(spec)
        with torch.random.fork_rng(devices=[]):  # a function drawing from torch's global RNG
            torch.manual_seed(seed)  # draws the same data for the same --seed, in any process
            obj = _call_data_fn(spec)
    taken = _split_batches(obj, batch_size, batches, spec)
    if taken is None:
        if isinstance(obj, (list, tuple)):  # named here before the library refuses one
            _check_tensors(list(obj[:batches]), spec, len(obj))
        taken = take_batches(obj, batches, exact=False, what="--data")
        if note is not None:
            note(
                f"--batch-size is ignored with --data {spec}: the data is already batched (its "
                f"batches are used as they are, {len(taken)} of them here)"
            )
    _check_tensors(taken, spec)
    return taken


def _check_counts(batch_size: int, batches: int) -> None:
    for flag, value in (("--batch-size", batch_size), ("--max-batches", batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value!r}")


def load_named_data(
    spec: str | None, *, batch_size: int, batches: int, seed: int, data_dir: str | None = None
) -> NamedData | None:
    """A data set that ``initlab data`` lists, named by ``--data`` (``None`` for any other
    ``--data``): ``batches`` batches of ``batch_size`` examples of its training split (options
    applied, as in a study spec), drawn without replacement with ``seed``, with its example
    shape and classes (:func:`initlab.study.datasets.load_study_data`: as a study reads them)."""
    name = _named_spec(spec) if spec is not None else None
    if spec is None or name is None:
        return None
    from initlab.study.datasets import example_shape, load_study_data

    _check_counts(batch_size, batches)
    _check_options(spec, name)
    data = load_study_data(name, data_dir, test_split=False)
    gen = torch.Generator().manual_seed(seed)
    return NamedData(
        name=name,
        batches=_sampled(*data.train, batch_size, batches, gen),
        shape=example_shape(name, data.n_features),
        n_classes=data.n_classes,
    )


def _check_tensors(batches: list[Any], spec: str, total: int | None = None) -> None:
    """Refuse a ``.pt`` file's or a function's batch that holds no tensor, naming ``--data`` and
    what the batch is (a numpy array is left to the library's message, which names
    ``torch.from_numpy``); ``total``: the data's batches, where ``batches`` are the first."""
    for i, batch in enumerate(batches):
        numpy = find_path(batch, lambda v: type(v).__module__ == "numpy") is not None
        if batch_tensors(batch) or numpy:
            continue
        file = spec.endswith((".pt", ".pth"))
        one = (len(batches) if total is None else total) == 1
        which = ("the file" if file else "its data") if one else f"batch {i}"
        how = "save one batch with torch.save" if file else "return one batch"
        raise ValueError(
            f"--data {spec}: {which} holds no tensor: it is {shallow_types(batch)}; {how} (a "
            "tensor, a tuple (x, y) or a dict of model inputs, of tensors) or a list of batches"
        )


def _split_batches(obj: Any, batch_size: int, batches: int, spec: str) -> list[Any] | None:
    """The batches of one loaded batch: a big batch of tensors is split along dim 0; ``None``
    for data that is already batched."""
    if not is_single_batch(obj):
        return None
    parts = obj if isinstance(obj, (tuple, list)) else (obj,)
    tensors = all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in parts)
    if tensors and len({int(t.shape[0]) for t in parts}) != 1:
        rows = ", ".join(f"{int(t.shape[0])}" for t in parts)
        raise ValueError(
            f"--data {spec}: the tensors of its batch have different numbers of rows ({rows}); "
            "x and y need one row per example"
        )
    if not tensors:
        return [obj]
    n = int(first_tensor(obj).shape[0])
    if n <= batch_size:
        return [obj]
    return [
        tuple(t[i : i + batch_size] for t in parts)
        for i in range(0, min(n, batch_size * batches), batch_size)
    ]
