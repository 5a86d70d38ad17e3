"""Conformance: every entry point reads every data form and every loss form the same way.

The contract (``initlab._core.data`` and ``initlab._core.loss``): one batch is a tensor, a tuple
``(x, y)``, a dict of model inputs, a ``[x, y]`` list or a custom object; many batches are a
``DataLoader``, any iterable or generator, a list of batches, or ``initlab.Batches([...])``. A loss
is ``loss_fn(model, batch)``, a criterion (``nn.CrossEntropyLoss()``, ``F.cross_entropy``), the
model's own loss (``None`` on dict batches) or a name.

The matrix below (entry point x data form x loss form x model) is data. Each case either

* **works and equals the canonical call**: the same entry point on an identical fresh model with
  ``initlab.Batches([...the same batches as (x, y) tuples...])`` and the ``loss_fn(model, batch)``
  form, the same generator: equal state (in-place methods) and equal numbers in the rows (rtol
  1e-5, NaN == NaN), and the same data use (``used.batches``, ``used.examples``); or
* **raises a clear error**: ``TypeError``/``ValueError`` whose message is initlab's (it names what
  is wrong and the accepted forms / what to do), never a raw torch or Python error.

Every call, either way, must leave no hook on any module or parameter, keep every module's
train/eval flag, keep tied weights tied, and (measurements, and any call that raised) leave the
model's state unchanged.

Deliberate choices (see the case builder): ``gradinit_`` runs ``steps=1`` (one GradInit iteration
reads batches t and t+1, so ``steps=2`` would need 3 batches of the 2 the data holds);
``metainit_`` runs ``steps=2`` (one batch per step). Both therefore need 2 batches and give a
clear error on one-batch forms. ``input_scale`` takes no model: it runs on the MLP's and the
CNN's (float) data only. The ``loss_fn(model, batch)`` form is not paired with bare-tensor data
(the user's own loss would index the tensor).
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import initlab
from initlab._core.data import Batches

from .conformance_models import (
    BATCH,
    N_BATCHES,
    TiedKeywordModel,
    dict_loss,
    make_data,
    make_model,
    tuple_batches,
    tuple_loss,
)

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL, ATOL = 1e-5, 1e-8
SEED = 0
GRID = (torch.linspace(-1, 1, 3), torch.linspace(-1, 1, 3))


def _api(name: str) -> Callable[..., Any]:
    """``initlab.<name>``, looked up at call time (a missing export fails only its cases)."""
    fn = getattr(initlab, name, None)
    if fn is None:
        raise AssertionError(f"initlab.{name} is not exported")
    return fn


# ----------------------------------------------------------------------------- entry points


@dataclass(frozen=True)
class Entry:
    """One entry point and how the matrix calls it.

    ``call(model, data, loss_fn, generator)``; ``reads``: the most batches it reads (``None``:
    all); ``min_batches``: fewer give a clear error; ``inplace``: changes the model (compare the
    state with the canonical call's) rather than measuring it (state must stay unchanged).
    """

    name: str
    call: Callable[[nn.Module, Any, Any, Any], Any]
    takes_loss: bool = True
    takes_model: bool = True
    takes_generator: bool = True
    inplace: bool = False
    reads: int | None = None
    min_batches: int = 1
    models: tuple[str, ...] = ("mlp", "cnn", "tied_kw")


ENTRIES: dict[str, Entry] = {
    e.name: e
    for e in (
        Entry(
            "measure_moments",
            lambda m, d, loss, g: _api("measure_moments")(m, d, loss, max_batches=None),
            takes_generator=False,
        ),
        Entry(
            "diagnose",
            lambda m, d, loss, g: _api("diagnose")(
                m, d, loss, max_batches=4, spectra=False, lint=False, generator=g
            ),
            reads=4,
        ),
        Entry(
            "lsuv_",
            lambda m, d, loss, g: _api("lsuv_")(m, d, max_batches=1, generator=g),
            takes_loss=False,
            inplace=True,
            reads=1,
        ),
        Entry(
            "gradinit_",
            lambda m, d, loss, g: _api("gradinit_")(m, d, loss, steps=1, generator=g),
            inplace=True,
            reads=2,
            min_batches=2,
        ),
        Entry(
            "metainit_",
            lambda m, d, loss, g: _api("metainit_")(m, d, loss, steps=2, generator=g),
            inplace=True,
            reads=2,
            min_batches=2,
        ),
        Entry(
            "scale_output_",
            lambda m, d, loss, g: _api("scale_output_")(
                m, d, target=0.05, max_batches=None, generator=g
            ),
            takes_loss=False,
            inplace=True,
        ),
        Entry(
            "input_scale",
            lambda m, d, loss, g: _api("input_scale")(d, max_batches=None),
            takes_loss=False,
            takes_model=False,
            takes_generator=False,
            models=("mlp", "cnn"),
        ),
        Entry(
            "precondition_",
            lambda m, d, loss, g: _api("precondition_")(m, d, loss, max_batches=None, generator=g),
            inplace=True,
        ),
        Entry(
            "gr_scaling",
            lambda m, d, loss, g: _api("gr_scaling")(m, d, loss, max_batches=None),
            takes_generator=False,
        ),
        Entry(
            "block_curvature",
            lambda m, d, loss, g: _api("block_curvature")(m, d, loss, probes=2, generator=g),
            reads=1,
        ),
        Entry(
            "theory_vs_actual",
            lambda m, d, loss, g: _api("theory_vs_actual")(m, d, loss, probes=2, generator=g),
            reads=1,
        ),
        Entry(
            "loss_landscape",
            lambda m, d, loss, g: _api("loss_landscape")(m, d, loss, grid=GRID, generator=g),
        ),
        Entry(
            "gradient_stats",
            lambda m, d, loss, g: _api("gradient_stats")(m, d, loss, max_batches=None),
            takes_generator=False,
        ),
        Entry(
            "layer_spectra",
            lambda m, d, loss, g: _api("layer_spectra")(m, d, generator=g),
            takes_loss=False,
            reads=1,
        ),
    )
}

# ----------------------------------------------------------------------------- data and losses

DATA_FORMS: dict[str, int] = {
    "tensor": 1,  # x of batch 1 only
    "tuple": 1,  # (x1, y1)
    "loader": 2,  # DataLoader(TensorDataset(x, y), batch_size=8): [x, y] lists
    "list": 2,  # [(x1, y1), (x2, y2)]
    "dict": 1,  # {"input_ids": x1, "labels": y1} (keyword model) / {"x": x1, "labels": y1}
    "dict_list": 2,  # [dict1, dict2]
    "generator": 2,  # a fresh generator of (x, y) tuples per call
}
"""data form -> number of batches it holds (each of ``BATCH`` examples)."""

LOSS_FORMS: dict[str, Callable[[str], Any]] = {
    # loss_fn(model, batch), written for the batch form at hand
    "model_batch": lambda data: dict_loss if data in ("dict", "dict_list") else tuple_loss,
    "module": lambda data: nn.CrossEntropyLoss(),
    "functional": lambda data: F.cross_entropy,
    # None: the model's own loss on dict batches, else auto (cross-entropy for int targets)
    "model_returned": lambda data: None,
    "named": lambda data: "cross_entropy",
}
"""loss form -> the ``loss_fn`` value for a data form."""

NO_LOSS = "no_loss"

# ----------------------------------------------------------------------------- expected errors

OURS = re.compile(
    r"accepted|Accepted|initlab\.|\(x, y\)|labels|returned no loss|keyword|forward="
    r"|needs (at least )?\d+ batch|[Uu]se \w+=|[Pp]ass \w+=|how='|module="
)
"""What initlab's own messages say (names the accepted forms or what to do)."""

RAW = re.compile(
    r"got an unexpected keyword argument '?\w*'?|got multiple values for (keyword )?argument"
    r"|missing \d+ required (positional|keyword-only) arguments?"
)
"""Raw Python phrases removed from a message before it is judged (they contain 'keyword')."""

ERRORS: dict[str, tuple[str, str]] = {
    "keywords": (
        r"keyword|forward=|\*\*batch",
        "the MLP/CNN cannot take the dict batch's keys as keyword arguments",
    ),
    "no_target": (r"\(x, y\)|labels|target", "a target-needing loss on a batch without targets"),
    "too_few_batches": (r"needs (at least )?\d+ batch", "the method needs 2 batches, data has 1"),
    "tied_head": (
        r"how='module'|module=",
        "the output scale cannot be folded into a head tied to the embedding",
    ),
}
"""reason -> (what the message must say, why the case errs)."""


def expected_errors(entry: Entry, data: str, loss: str, model: str) -> tuple[str, ...]:
    """The reasons the case must raise a clear error (empty: it must work and equal)."""
    reasons = []
    if entry.takes_model and data in ("dict", "dict_list") and model != "tied_kw":
        reasons.append("keywords")
    if entry.takes_loss and data == "tensor":
        reasons.append("no_target")
    if DATA_FORMS[data] < entry.min_batches:
        reasons.append("too_few_batches")
    if entry.name == "scale_output_" and model == "tied_kw":
        reasons.append("tied_head")
    return tuple(reasons)


@dataclass(frozen=True)
class Case:
    entry: str
    data: str
    loss: str
    model: str
    errors: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.entry}-{self.data}-{self.loss}-{self.model}"


def build_cases() -> list[Case]:
    cases = []
    for entry in ENTRIES.values():
        losses = list(LOSS_FORMS) if entry.takes_loss else [NO_LOSS]
        for data in DATA_FORMS:
            for loss in losses:
                if data == "tensor" and loss == "model_batch":
                    continue  # the user's loss_fn(model, batch) would index a bare tensor
                for model in entry.models:
                    errors = expected_errors(entry, data, loss, model)
                    cases.append(Case(entry.name, data, loss, model, errors))
    return cases


CASES = build_cases()

GENERATOR_CASES = [
    (name, model)
    for name, entry in ENTRIES.items()
    if entry.takes_generator
    for model in entry.models
    if not expected_errors(entry, "list", "model_batch", model)
]
"""(entry, model): ``generator=torch.Generator().manual_seed(0)`` equals ``generator=0``."""

INIT_MODEL_CASES = [(form, model) for form in ("int", "torch.Generator") for model in
                    ("mlp", "cnn", "tied_kw")]  # fmt: skip

# ----------------------------------------------------------------------------- the harness

_IGNORED_KEYS = re.compile(r"wall|time|elapsed|seconds|_s$")
_IDENTITY_KEYS = frozenset(
    {"layer", "param", "quantity", "stat", "module", "name", "kind", "block", "tensor", "row"}
    | {"col", "column", "method", "variant", "loss"}
)


def _numbers(result: Any) -> Any:
    """What to compare of a result: its rows (and trace / info / tables), recursively plain."""
    if isinstance(result, initlab.Report):
        out = {"rows": result.rows.to_rows(), "layers": result.layers.to_rows()}
        out.update({f"table:{k}": v.to_rows() for k, v in sorted(result.tables.items())})
        return out
    if hasattr(result, "param_table") and hasattr(result, "table"):  # MomentProbe
        return {"table": result.table().to_rows(), "params": result.param_table().to_rows()}
    if hasattr(result, "to_rows"):
        rows = result.to_rows()
        if hasattr(rows, "to_rows"):  # Landscape.to_rows() gives Rows
            rows = rows.to_rows()
        out = {"rows": rows}
        trace = getattr(result, "trace", None)
        if trace is not None:
            out["trace"] = trace.to_rows()
        if isinstance(getattr(result, "info", None), Mapping):
            out["info"] = dict(result.info)
        for attr in ("forward_passes", "backward_passes"):
            if hasattr(result, attr):
                out[attr] = getattr(result, attr)
        return out
    if dataclasses.is_dataclass(result):  # InputScaling
        return dataclasses.asdict(result)
    raise AssertionError(f"no rows to compare on a {type(result).__name__}")


def _leaf_difference(
    a: Any, b: Any, key: str, rtol: float = RTOL, atol: float = ATOL
) -> str | None:
    """How two leaves differ (tensors, numbers, strings, None), or ``None`` when they agree."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{type(a).__name__} vs {type(b).__name__}"
        if a.shape != b.shape:
            return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
        x, y = a.detach().double(), b.detach().double()
        if torch.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True):
            return None
        return f"tensors differ (max abs diff {(x - y).abs().nan_to_num().max().item():.3g})"
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return None if a == b else f"{a!r} vs {b!r}"
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        same = (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rtol, abs_tol=atol)
        return None if same else f"{a!r} vs {b!r}"
    if isinstance(a, str) and isinstance(b, str):
        return f"{a!r} vs {b!r}" if key in _IDENTITY_KEYS and a != b else None
    return None if type(a) is type(b) else f"{type(a).__name__} vs {type(b).__name__}"


def _same(
    a: Any,
    b: Any,
    where: str,
    problems: list[str],
    key: str = "",
    rtol: float = RTOL,
    atol: float = ATOL,
) -> None:
    """Append to ``problems`` where ``a`` and ``b`` differ (numbers: ``rtol``, default 1e-5, NaN ==
    NaN)."""
    if len(problems) > 8 or (key and _IGNORED_KEYS.search(key)):
        return
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if set(a) != set(b):
            problems.append(f"{where}: keys {sorted(map(str, set(a) ^ set(b)))} differ")
        for k in a:
            if k in b:
                _same(a[k], b[k], f"{where}.{k}", problems, str(k), rtol, atol)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            problems.append(f"{where}: {len(a)} vs {len(b)} items")
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            _same(x, y, f"{where}[{i}]", problems, key, rtol, atol)
    else:
        diff = _leaf_difference(a, b, key, rtol, atol)
        if diff is not None:
            problems.append(f"{where}: {diff}")


def _hooks(model: nn.Module) -> list[str]:
    """Hooks left on the model's modules or parameters (and global module hooks)."""
    found = []
    for name, module in model.named_modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                     "_backward_pre_hooks"):  # fmt: skip
            if getattr(module, attr, None):
                found.append(f"{name or '<root>'}.{attr}")
    for name, p in model.named_parameters(remove_duplicate=False):
        if getattr(p, "_backward_hooks", None):
            found.append(f"parameter {name}._backward_hooks")
    mm = torch.nn.modules.module
    for attr in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks"):  # fmt: skip
        if getattr(mm, attr, None):
            found.append(f"torch.nn.modules.module.{attr}")
    return found


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _tied(model: nn.Module) -> bool:
    return not isinstance(model, TiedKeywordModel) or model.head.weight is model.emb.weight


def _used(result: Any) -> tuple[int, int] | None:
    used = getattr(result, "used", None)
    if used is not None:
        return (used.batches, used.examples)
    if isinstance(result, initlab.Report) and "batches" in result.meta:
        return (result.meta["batches"], result.meta.get("examples"))
    return None


def _needs_used(result: Any) -> bool:
    """Whether the result type must say how much data it read (Landscape / InputScaling: when
    present)."""
    return isinstance(result, (initlab.Rows, initlab.Report, initlab.MomentProbe))


@dataclass
class Outcome:
    error: BaseException | None
    numbers: Any
    state: dict[str, torch.Tensor]
    used: tuple[int, int] | None
    needs_used: bool
    problems: list[str]  # hooks / flags / ties / state violations
    warned: list[str]  # the warnings the call gave ("Category: message")


def run_checked(entry: Entry, model_name: str, data: Any, loss_fn: Any, generator: Any) -> Outcome:
    """Call the entry point on a fresh model; check hooks, flags, ties and state around it."""
    model = make_model(model_name)
    flags = [m.training for m in model.modules()]
    before = _state(model)
    problems: list[str] = []
    error: BaseException | None = None
    result = None
    # Warnings are recorded (the suite turns them into errors) and must match the canonical call's.
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(1234)  # any use of the global RNG is the same in both calls
        try:
            result = entry.call(model, data, loss_fn, generator)
        except Exception as err:  # judged below
            error = err
    warned = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
    left = _hooks(model)
    if left:
        problems.append(f"hooks left after the call: {left}")
    if [m.training for m in model.modules()] != flags:
        problems.append("train/eval flags changed")
    if not _tied(model):
        problems.append("tied weights untied (head.weight is not emb.weight)")
    after = _state(model)
    if error is not None or not entry.inplace:
        changed: list[str] = []
        _same(after, before, "state", changed)
        if changed:
            why = "raised" if error is not None else "measured only"
            problems.append(f"the model's state changed although the call {why}: {changed[:3]}")
    numbers = used = None
    needs_used = False
    if error is None:
        try:
            numbers = _numbers(result)
        except Exception as err:
            problems.append(f"reading the result's rows failed: {type(err).__name__}: {err}")
        used, needs_used = _used(result), _needs_used(result)
    return Outcome(error, numbers, after, used, needs_used, problems, warned)


@cache
def canonical(entry_name: str, model_name: str, n_batches: int) -> Outcome:
    """The canonical call: ``Batches([(x, y), ...])``, ``loss_fn(model, batch)``, seed 0."""
    data = Batches(tuple_batches(model_name)[:n_batches])
    return run_checked(ENTRIES[entry_name], model_name, data, tuple_loss, SEED)


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err)[:400]}"


def assert_clear_error(err: BaseException | None, reasons: tuple[str, ...]) -> None:
    """``err`` is a TypeError/ValueError in initlab's words, about one of ``reasons``."""
    assert err is not None, f"expected a clear error ({', '.join(reasons)}), but the call worked"
    assert isinstance(err, (TypeError, ValueError)), f"not a TypeError/ValueError: {_describe(err)}"
    # initlab's words once raw Python phrases are removed; what is wrong may be said by the raw
    # cause it quotes (e.g. the user's loss_fn failing on a keyword the model does not take)
    assert OURS.search(RAW.sub("", str(err))), f"raw error, not initlab's message: {_describe(err)}"
    patterns = [ERRORS[r][0] for r in reasons]
    assert any(re.search(p, str(err)) for p in patterns), (
        f"the message does not say what is wrong (expected one of {reasons}): {_describe(err)}"
    )


def assert_equal_outcomes(got: Outcome, want: Outcome, entry: Entry, n_batches: int) -> None:
    if want.error is not None:
        raise AssertionError(
            f"the canonical call (Batches, loss_fn) failed: {_describe(want.error)}"
        )
    assert got.error is None, f"raised {_describe(got.error)}"
    problems: list[str] = []
    if entry.inplace:
        _same(got.state, want.state, "state_dict", problems)
    _same(got.numbers, want.numbers, "rows", problems)
    assert not problems, "differs from the canonical call:\n  " + "\n  ".join(problems)
    assert got.warned == want.warned, (
        f"warnings {got.warned} differ from the canonical {want.warned}"
    )
    expect_batches = n_batches if entry.reads is None else min(n_batches, entry.reads)
    expect = (expect_batches, expect_batches * BATCH)
    if got.needs_used or got.used is not None:
        assert got.used == expect, f"used {got.used}, expected (batches, examples) = {expect}"


# ----------------------------------------------------------------------------- the tests


def test_batches_is_exported() -> None:
    assert getattr(initlab, "Batches", None) is Batches


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_conformance(case: Case) -> None:
    entry = ENTRIES[case.entry]
    loss_fn = LOSS_FORMS[case.loss](case.data) if case.loss != NO_LOSS else None
    if case.entry == "measure_moments" and case.loss == "model_returned":
        # measure_moments(loss_fn=None) measures the forward pass only (documented); the model's
        # own loss is asked for by name there, and "auto" is the default loss on (x, y) batches.
        loss_fn = "model" if case.data in ("dict", "dict_list") else "auto"
    got = run_checked(entry, case.model, make_data(case.data, case.model), loss_fn, SEED)
    if case.errors:
        assert_clear_error(got.error, case.errors)
    else:
        want = canonical(case.entry, case.model, DATA_FORMS[case.data])
        assert not want.problems, "canonical call: " + "; ".join(want.problems)
        assert_equal_outcomes(got, want, entry, DATA_FORMS[case.data])
    assert not got.problems, "; ".join(got.problems)


@pytest.mark.parametrize(("entry", "model"), GENERATOR_CASES, ids=[f"{e}-{m}" for e, m in
                                                                  GENERATOR_CASES])  # fmt: skip
def test_generator_object_equals_int_seed(entry: str, model: str) -> None:
    data = Batches(tuple_batches(model))
    got = run_checked(ENTRIES[entry], model, data, tuple_loss, torch.Generator().manual_seed(SEED))
    assert_equal_outcomes(got, canonical(entry, model, N_BATCHES), ENTRIES[entry], N_BATCHES)
    assert not got.problems, "; ".join(got.problems)


INIT_MODEL = Entry(
    "init_model",
    lambda m, d, loss, g: _api("init_model")(m, "geometric", generator=g),
    takes_loss=False,
    inplace=True,
)


@cache
def _init_model_canonical(model: str) -> Outcome:
    return run_checked(INIT_MODEL, model, None, None, SEED)


@pytest.mark.parametrize(("form", "model"), INIT_MODEL_CASES, ids=[f"{f}-{m}" for f, m in
                                                                  INIT_MODEL_CASES])  # fmt: skip
def test_init_model_generator_forms(form: str, model: str) -> None:
    generator = SEED if form == "int" else torch.Generator().manual_seed(SEED)
    got = run_checked(INIT_MODEL, model, None, None, generator)
    want = _init_model_canonical(model)
    assert want.error is None, f"init_model failed: {_describe(want.error)}"
    assert got.error is None, f"raised {_describe(got.error)}"
    problems: list[str] = []
    _same(got.state, want.state, "state_dict", problems)
    _same(got.numbers, want.numbers, "rows", problems)
    assert not problems, "\n  ".join(problems)
    assert not got.problems, "; ".join(got.problems)


def test_matrix_size() -> None:
    """The size of the matrix, by expectation (printed with ``-s``; fixed so changes are seen)."""
    works = sum(1 for c in CASES if not c.errors)
    errors = sum(1 for c in CASES if c.errors)
    total = works + errors + len(GENERATOR_CASES) + len(INIT_MODEL_CASES)
    print(
        f"\nconformance matrix: {len(CASES)} (entry, data, loss, model) cases = {works} works and "
        f"equal + {errors} clear error; + {len(GENERATOR_CASES)} generator-object cases + "
        f"{len(INIT_MODEL_CASES)} init_model generator cases = {total} in all "
        f"({len(ENTRIES) + 1} entry points, {len(DATA_FORMS)} data forms, {len(LOSS_FORMS)} "
        "loss forms, 3 models)"
    )
    assert len({c.id for c in CASES}) == len(CASES)
    assert (works, errors) == (WORKS, ERRORS_COUNT)


WORKS, ERRORS_COUNT = 718, 379  # fixed: a change to the matrix must update these
