"""Init pipelines in a study: a data-free scheme followed by data-dependent methods.

An entry of a study spec's ``schemes`` is an *init*: a data-free scheme
(:func:`initlab.init.schemes.get_scheme`), optionally followed by data-dependent methods, each with
its options. Two spellings of the same init::

    schemes:
      - geometric                                  # a plain scheme (its runs keep their keys)
      - orthogonal + lsuv                          # Mishkin & Matas 2016
      - fan_in + gradinit(steps=200, lr=0.01)      # Zhu et al. 2021
      - geometric + precondition                   # Defazio & Bottou 2020, §5
      - metainit(variant=gradinit)                 # no scheme: the model's own constructor init
      - {scheme: fan_in, then: [{gradinit: {steps: 200, lr: 0.01}}, lsuv]}

The string form is ``[scheme] + method[(name=value, ...)] + ...``, each value YAML (``0.01``,
``true``, ``null``, ``gradinit``, ``[a, b]``); ``method {name: value, ...}`` is read too, but
YAML needs it quoted (``": "`` in a plain scalar starts a mapping). The mapping form is
``{scheme: name, then: [method | {method: {name: value}}, ...]}`` (``scheme`` optional). Either is
stored as its canonical text (:meth:`InitPipeline.label`: ``" + "`` between the parts, options
sorted by name, ``fan_in + gradinit(lr=0.01, steps=200)``), which is the run's
``RunConfig.scheme``: a plain scheme name is kept as written, so the runs, and the keys, of
existing specs do not change.

Methods (:data:`METHOD_NAMES`) are the library's ``lsuv_``, ``gradinit_``, ``metainit_``,
``precondition_`` and ``scale_output_``. Their options are checked against the methods'
signatures (name and type) when the spec is loaded, before any training: every keyword of the
method that plain data can set (numbers, booleans, strings, ``null``, lists of those), except
those the study fills in (:data:`STUDY_FILLED`: the model, the data, the loss, the generator).
Their values are the methods' to check: :func:`~initlab.study.runner.run_study` runs each
data-dependent init once, on the first of its runs, before any training (:func:`check_init`).
What a study needs beyond the library's defaults (:data:`STUDY_DEFAULTS`, :data:`STUDY_CHOICES`):

* ``precondition`` runs with ``how: rescale`` (the only choice: ``lr`` would need per-layer
  learning rates and ``parametrize`` a wrapper the study's trainer does not carry); it balances
  the layers in place and keeps the network function (MLP- and VGG-like chains only);
* ``scale_output`` runs with ``how: fold`` (the only choice, for the same reason);
* ``lsuv`` after a scheme starts from that scheme (``orthogonal: false`` unless given, so
  ``orthogonal + lsuv`` is the paper's algorithm with the study's seeded orthogonal draw);
  ``lsuv`` first, with no scheme, keeps the library's default (its own orthogonal pre-init).

How a run is initialized (:func:`initialize_run`), with its seed ``s``:

1. the model as every data-free run builds it (``initlab.study.trainer``, step 1): constructed
   under torch's RNG seeded with ``s``, the scheme drawn with a generator seeded with ``s``
   (skipped without a scheme), the study's model options applied: ``fan_in + gradinit`` and
   ``fan_in`` of one seed start from the same weights;
2. each method, in order, with a generator (and torch's forked global RNG) seeded from
   ``sha256(f"initlab.init:{s}:{i}")`` for the ``i``-th method, the loss the trainer trains
   (cross-entropy of the logits), and batches of the run's **training split only**, input
   normalization applied: the minibatches the run itself will see, in its order (epoch 0's
   :func:`~initlab.study.trainer.epoch_order`, then epoch 1's, ...): one epoch of them, or
   ``steps + 1`` where a ``steps`` option asks for more.

Its cost (:data:`INIT_COST_KEYS`) is stored with the run: the wall time of all of step 1-2, and
the forward and backward passes and examples the methods report (``MethodReport``).

Training: data-free inits keep the vectorized trainer untouched. A chunk holding data-dependent
inits initializes those runs one by one, then trains the whole chunk in one
:func:`~initlab.study.trainer.train_runs` call that takes the initialized models
(``initialized=``), stacked like any other: such runs train vectorized wherever the model allows
(the trainer's ``engine="auto"``; models with BatchNorm or dropout, and convolutional models on
the CPU, train one run at a time there, as data-free ones do).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import math
import re
import time
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from initlab.study.config import RunConfig, RunResult

__all__ = [
    "INIT_COST_KEYS",
    "METHOD_NAMES",
    "STUDY_CHOICES",
    "STUDY_DEFAULTS",
    "STUDY_FILLED",
    "InitPipeline",
    "Step",
    "canonical_init",
    "check_data_free",
    "check_init",
    "init_identity",
    "initialize_run",
    "is_data_dependent",
    "method_options",
    "parse_init",
    "train_chunk",
]

#: The methods an init may apply after its scheme: spec name → ``initlab`` function name.
_METHODS = {
    "lsuv": "lsuv_",
    "gradinit": "gradinit_",
    "metainit": "metainit_",
    "precondition": "precondition_",
    "scale_output": "scale_output_",
}
METHOD_NAMES = tuple(_METHODS)

#: Keywords the study fills in itself (not options of a spec).
STUDY_FILLED = (
    "model",
    "data",
    "loss_fn",
    "generator",
    "progress",
    "forward",
    "registry",
    "input_shape",
    "n_classes",
)

#: Option values a study needs, where the library's default would not fit (module docstring).
STUDY_DEFAULTS: dict[str, dict[str, Any]] = {
    "precondition": {"how": "rescale"},
    "scale_output": {"how": "fold"},
}

#: Options a study allows only some values of, with the reason.
STUDY_CHOICES: dict[tuple[str, str], tuple[tuple[Any, ...], str]] = {
    ("precondition", "how"): (
        ("rescale",),
        "a study trains one learning rate per run (how: lr needs one per layer) and no "
        "parametrization (how: parametrize)",
    ),
    ("scale_output", "how"): (("fold",), "a study's trainer carries no extra module or hook"),
}

#: Keys of a run's stored ``init_cost``: ``wall_s`` (the whole initialization, steps 1-2 of the
#: module docstring), ``forward_passes``, ``backward_passes``, ``examples`` (summed over the
#: methods, as their reports count them), ``steps`` (per method: ``method`` and the same four).
INIT_COST_KEYS = ("wall_s", "forward_passes", "backward_passes", "examples", "steps")

_NAME = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(\{.*\}|\(.*\))?\s*", re.DOTALL)
_ARG = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=(.*)", re.DOTALL)
_BARE = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_YAML_WORDS = {"true", "false", "null", "yes", "no", "on", "off", "y", "n", "nan", "inf"}


def _method(name: str) -> Callable[..., Any]:
    import initlab

    return getattr(initlab, _METHODS[name])


# -- options: checked against the methods' signatures ---------------------------------------------


@dataclass(frozen=True)
class _Option:
    name: str
    hint: Any
    default: Any


def _plain(hint: Any) -> bool:
    """Whether plain data (YAML scalars and lists) can give a value of type ``hint``."""
    origin = typing.get_origin(hint)
    if hint in (int, float, bool, str, type(None)) or origin is typing.Literal:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_plain(a) for a in typing.get_args(hint))
    if origin in (Sequence, list, tuple):
        args = typing.get_args(hint)
        return bool(args) and _plain(args[0])
    return False


@functools.cache
def method_options(method: str) -> dict[str, _Option]:
    """The options a spec may give ``method``: its keywords that plain data can set, without
    :data:`STUDY_FILLED`, as ``{name: _Option(name, type hint, default)}``."""
    fn = _method(method)
    hints = typing.get_type_hints(fn)
    out = {}
    for p in inspect.signature(fn).parameters.values():
        if p.name in STUDY_FILLED or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        if _plain(hints.get(p.name, Any)):
            out[p.name] = _Option(p.name, hints[p.name], p.default)
    return out


def _type_text(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return " | ".join(_text(a) for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_text(a) for a in typing.get_args(hint) if _plain(a))
    if origin in (Sequence, list, tuple):
        return f"a list of {_type_text(typing.get_args(hint)[0])}"
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))


def _coerce(hint: Any, value: Any) -> Any:
    """``value`` as type ``hint`` (a numeric string for a float: PyYAML reads ``1e-5`` as a
    string), or raise ``TypeError``."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        # numbers before strings, so that "1e-5" for ``str | float`` is the number
        ordered = sorted(args, key=lambda a: a is str)
        for arm in ordered:
            try:
                return _coerce(arm, value)
            except TypeError:
                continue
        raise TypeError
    if origin is typing.Literal:
        if value in typing.get_args(hint) and not isinstance(value, bool):
            return value
        raise TypeError
    if origin in (Sequence, list, tuple):
        if isinstance(value, (list, tuple)):
            return tuple(_coerce(typing.get_args(hint)[0], v) for v in value)
        raise TypeError
    if hint is type(None) and value is None:
        return None
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    numeric = isinstance(value, (int, float)) or (isinstance(value, str) and _is_number(value))
    if hint is float and numeric and not isinstance(value, bool) and math.isfinite(float(value)):
        return float(value)
    if hint is str and isinstance(value, str):
        return value
    raise TypeError


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _text(value: Any) -> str:
    """An option value as canonical YAML flow text."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_text(v) for v in value) + "]"
    text = str(value)
    if _BARE.fullmatch(text) and text.lower() not in _YAML_WORDS and not _is_number(text):
        return text
    return json.dumps(text)


# -- the pipeline -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One data-dependent method of an init with its (checked) options, sorted by name."""

    method: str
    options: tuple[tuple[str, Any], ...] = ()

    def label(self) -> str:
        """``method`` or ``method(name=value, ...)``."""
        if not self.options:
            return self.method
        return f"{self.method}(" + ", ".join(f"{k}={_text(v)}" for k, v in self.options) + ")"

    def kwargs(self, after_scheme: bool) -> dict[str, Any]:
        """The keyword arguments of the call: the study's defaults, then the options."""
        out = dict(STUDY_DEFAULTS.get(self.method, {}))
        if self.method == "lsuv" and after_scheme:
            out["orthogonal"] = False  # start from the scheme (module docstring)
        out.update((k, list(v) if isinstance(v, tuple) else v) for k, v in self.options)
        return out


@dataclass(frozen=True)
class InitPipeline:
    """An init of a study: a data-free ``scheme`` (``None``: the model's constructor init), then
    data-dependent ``steps``. Build it with :func:`parse_init`."""

    scheme: str | None
    steps: tuple[Step, ...] = ()

    def label(self) -> str:
        """The canonical text: ``scheme + method {options} + ...`` (a plain scheme: its name)."""
        parts = ([self.scheme] if self.scheme is not None else []) + [s.label() for s in self.steps]
        return " + ".join(parts)

    @property
    def data_dependent(self) -> bool:
        return bool(self.steps)


def _valid_text() -> str:
    from initlab.init.schemes import list_schemes

    schemes = ", ".join(s["name"] for s in list_schemes())
    return f"schemes: {schemes}; methods: {', '.join(METHOD_NAMES)}"


def _step(method: Any, options: Any, where: str) -> Step:
    if method not in _METHODS:
        raise ValueError(
            f"{where}: unknown init method {method!r}; methods: {', '.join(METHOD_NAMES)} "
            "(a data-free scheme may only come first)"
        )
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise ValueError(f"{where}: {method} options must be a mapping, got {options!r}")
    valid = method_options(method)
    unknown = sorted(str(k) for k in options if k not in valid)
    if unknown:
        listed = ", ".join(f"{o.name} ({_type_text(o.hint)})" for o in valid.values())
        filled = ", ".join(
            k for k in STUDY_FILLED if k in inspect.signature(_method(method)).parameters
        )
        raise ValueError(
            f"{where}: {method} has no option {', '.join(unknown)}; its options: {listed} "
            f"(the study sets {filled})"
        )
    out = []
    for name, value in options.items():
        option = valid[name]
        try:
            value = _coerce(option.hint, value)
        except TypeError:
            raise ValueError(
                f"{where}: {method} option {name} must be {_type_text(option.hint)}, got {value!r}"
            ) from None
        allowed, why = STUDY_CHOICES.get((method, name), (None, ""))
        if allowed is not None and value not in allowed:
            raise ValueError(
                f"{where}: {method} option {name} must be {' or '.join(map(str, allowed))} in a "
                f"study ({why}), got {value!r}"
            )
        out.append((str(name), value))
    return Step(method, tuple(sorted(out)))


def _split(text: str, sep: str = "+") -> list[str]:
    """``text`` split at each ``sep`` outside parentheses, braces, brackets and quotes."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "{[(":
            depth += 1
        elif ch in "}])":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _yaml(text: str, where: str) -> Any:
    try:
        import yaml
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("init options need PyYAML: pip install pyyaml") from err
    from initlab.study.spec import load_yaml

    try:
        return load_yaml(text)
    except yaml.YAMLError as err:
        problem = str(getattr(err, "problem", err))
        raise ValueError(f"{where}: cannot read {text.strip()!r} as YAML ({problem})") from None


def _options(text: str, where: str) -> Any:
    """``(name=value, ...)`` or ``{name: value, ...}`` as a mapping."""
    if text.startswith("{"):
        return _yaml(text, where)
    inner = text[1:-1]
    out: dict[str, Any] = {}
    for item in _split(inner, ",") if inner.strip() else []:
        match = _ARG.fullmatch(item)
        if match is None:
            raise ValueError(f"{where}: write options as (name=value, ...), got {item.strip()!r}")
        name, value = match.groups()
        if name in out:
            raise ValueError(f"{where}: option {name} given twice")
        out[name] = _yaml(value, where)
    return out


def _parse_text(text: str) -> InitPipeline:
    where = f"init {text!r}"
    parsed: list[tuple[str, Any]] = []
    for part in _split(text):
        match = _NAME.fullmatch(part)
        if match is None:
            raise ValueError(
                f"{where}: cannot read {part.strip()!r}; write 'scheme + method(option=value) + "
                f"...' ({_valid_text()})"
            )
        name, options = match.group(1), match.group(2)
        parsed.append((name, _options(options, where) if options else None))
    return _build(parsed, where)


def _build(parsed: list[tuple[Any, Any]], where: str) -> InitPipeline:
    from initlab.init.schemes import get_scheme

    scheme = None
    first, options = parsed[0]
    if first not in _METHODS:
        if options is not None:
            raise ValueError(f"{where}: a data-free scheme takes no options, got {options!r}")
        try:
            get_scheme(first)
        except (ValueError, KeyError, TypeError):
            raise ValueError(
                f"{where}: {first!r} is neither a scheme nor an init method ({_valid_text()})"
            ) from None
        scheme, parsed = str(first), parsed[1:]
    return InitPipeline(scheme, tuple(_step(m, o, where) for m, o in parsed))


def _parse_mapping(value: Mapping[str, Any]) -> InitPipeline:
    where = f"init {dict(value)!r}"
    unknown = sorted(str(k) for k in value if k not in ("scheme", "then"))
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {', '.join(unknown)}; an init mapping has scheme (a "
            "data-free scheme, optional) and then (a list of methods, each a name or "
            "{method: {option: value}})"
        )
    then = value.get("then") or []
    if isinstance(then, (str, Mapping)):
        then = [then]
    parsed: list[tuple[Any, Any]] = [] if value.get("scheme") is None else [(value["scheme"], None)]
    for item in then:
        if isinstance(item, Mapping) and len(item) == 1:
            parsed.append(next(iter(item.items())))
        elif isinstance(item, str):
            parsed.append((item, None))
        else:
            raise ValueError(
                f"{where}: each entry of then is a method name or {{method: {{option: value}}}}, "
                f"got {item!r}"
            )
    if not parsed:
        raise ValueError(f"{where}: give a scheme, methods (then), or both")
    return _build(parsed, where)


def parse_init(value: str | Mapping[str, Any]) -> InitPipeline:
    """An init of a study spec (module docstring) as a checked :class:`InitPipeline`.

    Raises:
        ValueError: an unknown scheme or method, an option the method does not have or of the
            wrong type, or a value a study does not allow; the message lists what is valid.
    """
    if isinstance(value, Mapping):
        return _parse_mapping(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(
            f"an init is a scheme name, 'scheme + method {{options}}' or "
            f"{{scheme: ..., then: [...]}}, got {value!r}"
        )
    return _parse_cached(value)


@functools.lru_cache(maxsize=1024)
def _parse_cached(text: str) -> InitPipeline:
    parts = _split(text)
    if len(parts) == 1 and not any(c in text for c in "{("):  # a plain name stays as written
        name = text.strip()
        if name in _METHODS:
            return InitPipeline(None, (Step(name),))
        from initlab.init.schemes import get_scheme

        try:
            get_scheme(name)
        except (ValueError, KeyError, TypeError):
            raise ValueError(
                f"init {text!r}: {name!r} is neither a scheme nor an init method ({_valid_text()})"
            ) from None
        return InitPipeline(text)
    return _parse_text(text)


def canonical_init(value: str | Mapping[str, Any]) -> str:
    """The canonical text of an init (:meth:`InitPipeline.label`); a plain scheme name as
    written."""
    return parse_init(value).label()


@functools.cache
def _registry_spelling(name: str) -> str:
    """The registry's spelling of scheme ``name``: the first registry name (in
    :func:`~initlab.init.schemes.list_schemes` order), or a name with a distribution suffix, that
    :func:`~initlab.init.schemes.get_scheme` turns into an equal :class:`Scheme` (``he``,
    ``Kaiming``, ``fan-in`` and ``kaiming_normal`` are all ``fan_in``; ``kaiming_uniform`` is
    ``fan_in_uniform``); the scheme's ``repr`` if none does."""
    from initlab.init.schemes import SAMPLED_DISTRIBUTIONS, get_scheme, list_schemes

    scheme = get_scheme(name)
    for row in list_schemes():
        for candidate in (row["name"], *(f"{row['name']}_{d}" for d in SAMPLED_DISTRIBUTIONS)):
            try:
                if get_scheme(candidate) == scheme:
                    return candidate
            except (ValueError, TypeError):  # no such distribution for this scheme
                continue
    return repr(scheme)


def init_identity(value: str | Mapping[str, Any]) -> str:
    """What an init does, as text: its canonical text (:func:`canonical_init`) with the scheme
    in the registry's spelling, so two spellings of one scheme (an alias, another case, a
    default distribution suffix) have one identity: ``he + lsuv`` and ``fan_in + lsuv`` are
    both ``fan_in + lsuv``. Inits of one identity draw the same weights (``init_model`` resolves
    the name with :func:`~initlab.init.schemes.get_scheme`) and run the same methods.

    Example:
        >>> init_identity("Kaiming") == init_identity("he") == "fan_in"
        True
    """
    pipeline = parse_init(value)
    if pipeline.scheme is None:
        return pipeline.label()
    return InitPipeline(_registry_spelling(pipeline.scheme), pipeline.steps).label()


def is_data_dependent(scheme: str) -> bool:
    """Whether a run's ``scheme`` (an init's canonical text) has data-dependent steps."""
    return parse_init(scheme).data_dependent


def check_data_free(config: RunConfig) -> None:
    """Raise if ``config``'s init needs data (the trainer cannot initialize it alone)."""
    if is_data_dependent(config.scheme):
        raise ValueError(
            f"run {config.scheme!r} (seed {config.seed}) has data-dependent init steps: "
            "initialize its model with initlab.study.pipelines.initialize_run and pass it to "
            "the trainer as initialized= (the study runner does this)"
        )


# -- running an init ------------------------------------------------------------------------------


def _step_seed(seed: int, index: int) -> int:
    digest = hashlib.sha256(f"initlab.init:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class RunBatches:
    """The minibatches a run's init methods read: its own training minibatches, in its order.

    Re-iterable (a method may read the data twice) and sized. Batch ``j`` is rows
    ``order_e[k*B : (k+1)*B]`` of the training split, ``e, k = divmod(j, steps_per_epoch)`` and
    ``order_e = epoch_order(seed, e, n)``.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, seed: int, batch_size: int, n: int):
        self.x, self.y, self.seed, self.batch_size, self.n_batches = x, y, seed, batch_size, n
        self.per_epoch = math.ceil(x.shape[0] / batch_size)

    def __len__(self) -> int:
        return self.n_batches

    def __iter__(self) -> typing.Iterator[tuple[torch.Tensor, torch.Tensor]]:
        from initlab.study.trainer import epoch_order

        order = None
        for j in range(self.n_batches):
            epoch, k = divmod(j, self.per_epoch)
            if k == 0:
                order = epoch_order(self.seed, epoch, self.x.shape[0])
            assert order is not None
            idx = order[k * self.batch_size : (k + 1) * self.batch_size].to(self.x.device)
            yield self.x[idx], self.y[idx]


def _n_batches(pipeline: InitPipeline, per_epoch: int) -> int:
    need = [dict(s.options).get("steps") for s in pipeline.steps]
    return max([per_epoch] + [int(n) + 1 for n in need if n is not None])


def initialize_run(
    config: RunConfig,
    train: tuple[torch.Tensor, torch.Tensor],
    model_factory: Callable[[RunConfig], nn.Module],
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[nn.Module, dict[str, Any]]:
    """Build and initialize one run's model with its init (module docstring, steps 1-2).

    Args:
        config: the run; ``config.scheme`` is an init's canonical text.
        train: ``(x, y)`` of the run's training split, before input normalization (the only data
            the methods see: the test split is never passed here).
        model_factory: builds the uninitialized model for a config.
        dtype: the model's floating dtype.
        device: where the methods run (the weights are drawn on the CPU first, as the trainer
            draws them, then moved).

    Returns:
        ``(model, init_cost)``, ``init_cost`` with :data:`INIT_COST_KEYS`.
    """
    from initlab.init.model import init_model
    from initlab.study.inputs import normalize_inputs
    from initlab.study.models import apply_study_options

    pipeline = parse_init(config.scheme)
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]):  # built and drawn in float32, as the trainer does
        torch.manual_seed(config.seed)
        model = model_factory(config).to(dtype=torch.float32)
    if pipeline.scheme is not None:
        generator = torch.Generator().manual_seed(config.seed)
        init_model(model, pipeline.scheme, generator=generator, measure=False)
    apply_study_options(model, config)
    model.to(dtype=dtype).to(device)
    (x, y), _ = normalize_inputs(config.input_norm, train, None)
    x, y = x.to(device=device, dtype=dtype), y.to(device=device, dtype=torch.long)
    per_epoch = math.ceil(x.shape[0] / config.batch_size)
    data = RunBatches(x, y, config.seed, config.batch_size, _n_batches(pipeline, per_epoch))
    steps = []
    for i, step in enumerate(pipeline.steps):
        fn = _method(step.method)
        kwargs = step.kwargs(after_scheme=pipeline.scheme is not None)
        if "loss_fn" in inspect.signature(fn).parameters:
            kwargs["loss_fn"] = torch.nn.functional.cross_entropy
        seed = _step_seed(config.seed, i)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            report = fn(model, data, generator=torch.Generator().manual_seed(seed), **kwargs)
        used = getattr(report, "used", None)
        steps.append(
            {
                "method": step.method,
                "wall_s": float(report.wall_s),
                "forward_passes": int(report.forward_passes),
                "backward_passes": int(report.backward_passes),
                "examples": int(used.examples) if used is not None else None,
            }
        )
    examples = [s["examples"] for s in steps]
    cost = {
        "wall_s": time.perf_counter() - start,
        "forward_passes": sum(s["forward_passes"] for s in steps),
        "backward_passes": sum(s["backward_passes"] for s in steps),
        "examples": None if None in examples else sum(examples),
        "steps": steps,
    }
    return model, cost


def check_init(config: RunConfig, data: Any) -> None:
    """Initialize ``config``'s run as its chunk will (:func:`initialize_run`, on ``data``'s
    training split, a :class:`~initlab.study.runner.StudyData`) and throw the model away; an
    error (an option value the method refuses, a model the method cannot take) is raised as a
    :class:`~initlab.study.models.StudyModelError` naming the init, before any run is trained or
    the study registered. Costs one init of each data-dependent init of a study."""
    from initlab.study.models import StudyModelError, _first_line, build_model

    def factory(c: RunConfig) -> nn.Module:
        return build_model(c, n_in=int(data.n_features), n_classes=int(data.n_classes))

    try:
        initialize_run(config, data.train, factory)
    except Exception as err:
        raise StudyModelError(
            f"schemes: {config.scheme!r} fails on data set {config.dataset!r} (its first run, "
            f"seed {config.seed}, checked before any training): {_first_line(err)}; fix its "
            "options"
        ) from err


def train_chunk(
    train_fn: Callable[..., list[RunResult]],
    configs: Sequence[RunConfig],
    train: tuple[torch.Tensor, torch.Tensor],
    test: tuple[torch.Tensor, torch.Tensor] | None,
    *,
    model_factory: Callable[[RunConfig], nn.Module],
    device: str,
) -> list[RunResult]:
    """Train one chunk of runs (one group): data-free runs as ``train_fn`` always did; with
    data-dependent inits, those runs initialized first (:func:`initialize_run`, from ``train``
    only) and the whole chunk trained in one ``train_fn(..., initialized=[model or None, ...])``
    call. The data-dependent runs' results carry their ``init_cost``."""
    configs = list(configs)
    pipelined = [is_data_dependent(c.scheme) for c in configs]
    if not any(pipelined):
        return list(train_fn(configs, train, test, model_factory=model_factory, device=device))
    models: list[nn.Module | None] = []
    costs: dict[str, dict[str, Any]] = {}
    for config, needs_data in zip(configs, pipelined, strict=True):
        if needs_data:
            model, costs[config.key()] = initialize_run(config, train, model_factory, device=device)
            models.append(model)
        else:
            models.append(None)
    results = train_fn(
        configs, train, test, model_factory=model_factory, device=device, initialized=models
    )
    return [
        dataclasses.replace(r, init_cost=costs[r.config.key()]) if r.config.key() in costs else r
        for r in results
    ]
