"""A study as data: :class:`StudySpec`, loadable from YAML and expanding to :class:`RunConfig` s.

A study is the product ``datasets × schemes × seeds × learning rates`` of training runs that share
one model, optimizer and schedule (Defazio & Bottou's Table 2 study is one). The YAML form::

    name: table2
    datasets: [libsvm:dna, libsvm:glass, libsvm:iris]
    model: paper_mlp
    model_cfg: {widths: [384, 64], input_norm: true}
    schemes: [arithmetic, fan_in, fan_out, geometric]
    seeds: 10                  # a count (seeds 0..9) or an explicit list
    lrs: {pow2: [1, -12]}      # 2^1, 2^0, ..., 2^-12; or an explicit list of floats
    epochs: 5
    batch_size: 64
    optimizer: sgd
    momentum: 0.9
    weight_decay: 1.0e-5
    output_scale: {std: 0.05}  # or {variance: 0.05}, or null; `output_std: 0.05` is the same
    input_norm: none           # none | layernorm | standardize (RunConfig.input_norm)
    loss: full_pass            # which loss the report compares: full_pass | last_epoch_minibatch
    extend_grid: false         # true (at most 6 rounds) or a number of rounds: see the runner
    data_root: null            # optional; null: the data loader's default location

**Inits** (:mod:`initlab.study.pipelines`): an entry of ``schemes`` is a data-free scheme, or a
scheme followed by data-dependent methods with their options, each seeded from the run's seed and
fed from the run's own training minibatches (never the test split); what each costs (wall time,
forward and backward passes) is stored with the run and shown in the report::

    schemes:
      - geometric                               # data-free, trained vectorized as always
      - orthogonal + lsuv                       # LSUV on the orthogonal draw
      - fan_in + gradinit(steps=200, lr=0.01)   # options: the method's keywords, checked
      - geometric + precondition                # conditioning multipliers, folded in place
      - metainit(variant=gradinit)              # no scheme: the model's constructor init
      - {scheme: fan_in, then: [{gradinit: {steps: 200}}]}   # the mapping form

Methods: ``lsuv``, ``gradinit``, ``metainit``, ``precondition``, ``scale_output``. The method names,
option names and option types are checked against the methods' signatures when the spec is built,
before any training. Each init is stored in its canonical text
(``fan_in + gradinit(lr=0.01, steps=200)``); a plain scheme name is kept as written, so the runs of
specs without data-dependent inits keep their keys.

Loading is strict: an unknown key is an error that names it (a typo such as ``weight_dacay`` must
not silently fall back to a default).

**Protocol variants** (:mod:`initlab.study.variants`): ``variants: {name: {key: value, ...}}``, or
several values of a protocol key (a full factorial, or ``design: one_at_a_time``), run as separate
variants of one study in one store. Each variant is a flat spec (:meth:`StudySpec.variant_specs`);
a run that two variants share (the same config) is trained and stored once. ``loss`` is not part
of a run: variants that differ only in ``loss`` share all their runs.

``model_cfg`` holds the model's options *except* ``n_in`` and ``n_classes``: those are properties of
the data set, not of the study, so they are not part of a run's config (nor of its key). The runner
fills them from the loaded data set's metadata when it builds each model
(:func:`initlab.study.runner.build_model`), which keeps :meth:`StudySpec.runs` free of I/O.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from initlab.study.config import INPUT_NORMS, LOSS_MEASURES, OPTIMIZERS, RunConfig
from initlab.study.datasets import dataset_identity
from initlab.study.pipelines import init_identity
from initlab.study.variants import BASE, VARIANT_KEYS, apply_overrides, expand_variants

__all__ = [
    "DEFAULT_EXTEND_ROUNDS",
    "OUTPUT_SCALE_KINDS",
    "RESERVED_MODEL_KEYS",
    "UNBOUND_KEYS",
    "StudySpec",
    "expand_lrs",
    "expand_seeds",
    "extend_rounds",
    "load_yaml",
]

#: ``model_cfg`` keys the runner fills from the data set; a spec may not set them.
RESERVED_MODEL_KEYS = ("n_in", "n_classes")


#: Keys a spec mapping must have (the others have defaults).
_REQUIRED = ("name", "datasets", "schemes", "seeds", "lrs")

#: ``output_scale: {KIND: value}``: the logits' std, or their variance (the std ``sqrt(value)``).
OUTPUT_SCALE_KINDS = ("std", "variance")

#: Rounds of grid extension ``extend_grid: true`` allows (each adds at most one power of two at
#: each edge of each data set and scheme).
DEFAULT_EXTEND_ROUNDS = 6

#: Keys of a spec mapping that are not fields of :class:`StudySpec` (consumed by ``from_dict``).
_EXTRA_KEYS = ("design",)

#: Spec fields that change neither which runs a study has nor what they compute: a study may run
#: again under its name with other values of these (:meth:`StudySpec.run_differences`).
UNBOUND_KEYS = ("name", "loss", "extend_grid", "data_root")

#: Spec fields that are sets of values (their order changes no run), with the name of one value
#: (one and several) as :meth:`StudySpec.run_differences` says it: "seeds: added seed 2".
_AXES = {
    "datasets": ("data set", "data sets"),
    "schemes": ("scheme", "schemes"),
    "seeds": ("seed", "seeds"),
    "lrs": ("rate", "rates"),
}


def _thaw(value: Any) -> Any:
    """Tuples → lists, recursively (the YAML/JSON form of ``model_cfg`` values)."""
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


#: The exponents ``k`` whose ``2.0**k`` is a finite float > 0: ``2**1023`` is the largest power
#: of two a float holds (``2**1024`` overflows), ``2**-1074`` the smallest (a subnormal;
#: ``2**-1075`` rounds to 0.0).
_POW2_RANGE = (sys.float_info.min_exp - sys.float_info.mant_dig, sys.float_info.max_exp - 1)


def expand_lrs(lrs: Any) -> tuple[float, ...]:
    """Learning rates from a list, or from ``{"pow2": [hi, lo]}`` (``2**hi ... 2**lo``, inclusive).

    The power-of-two range runs in steps of one exponent in the direction from the first to the
    second endpoint, so ``{"pow2": [1, -12]}`` gives the 14 rates ``2, 1, 0.5, ..., 2**-12``, and
    ``{"pow2": [k, k]}`` the one rate ``2**k`` (a range whose ends meet, as ``range`` counts;
    its exponents are distinct, so it can never give a rate twice, the duplicate that an
    explicit list such as ``[1, 1.0]`` can give and :class:`StudySpec` refuses). Every rate is
    positive and finite, as in a list: an exponent outside [-1074, 1023] is refused.
    """
    if isinstance(lrs, Mapping):
        if set(lrs) != {"pow2"}:
            raise ValueError(f"lrs as a mapping must be {{pow2: [first, last]}}, got {dict(lrs)!r}")
        ends = lrs["pow2"]
        if (
            not isinstance(ends, Sequence)
            or isinstance(ends, str)
            or len(ends) != 2
            or not all(isinstance(e, int) and not isinstance(e, bool) for e in ends)
        ):
            raise ValueError(f"lrs: pow2 needs two integer exponents [first, last], got {ends!r}")
        first, last = ends
        low, high = _POW2_RANGE
        for k in ends:
            if not low <= k <= high:
                what = "overflows a float" if k > high else "rounds to 0.0 in a float"
                raise ValueError(
                    f"lrs: pow2 exponent {k}: 2**{k} {what}, and a learning rate must be "
                    f"positive and finite; use exponents from {low} to {high}"
                )
        step = -1 if last < first else 1
        return tuple(2.0**k for k in range(first, last + step, step))
    if isinstance(lrs, (str, bytes)) or not isinstance(lrs, Sequence):
        raise ValueError(f"lrs must be a list of numbers or {{pow2: [first, last]}}, got {lrs!r}")
    return tuple(_number(lr, "lrs: a learning rate", positive=True) for lr in lrs)


def _number(value: Any, what: str, *, positive: bool = False) -> float:
    """A finite float from a number or a numeric string (PyYAML reads ``1e-5`` as a string)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{what} must be a number, got {value!r}")
    try:
        out = float(value)
    except ValueError:
        raise ValueError(f"{what} must be a number, got {value!r}") from None
    if not math.isfinite(out) or (positive and out <= 0):
        raise ValueError(
            f"{what} must be {'positive and ' if positive else ''}finite, got {value!r}"
        )
    return out


def expand_seeds(seeds: Any) -> tuple[int, ...]:
    """Seeds from a count ``n`` (``0 .. n-1``) or an explicit list of integers."""
    if isinstance(seeds, int) and not isinstance(seeds, bool):
        if seeds < 1:
            raise ValueError(f"seeds as a count must be >= 1, got {seeds}")
        return tuple(range(seeds))
    if isinstance(seeds, (str, bytes)) or not isinstance(seeds, Sequence):
        raise ValueError(f"seeds must be a count or a list of integers, got {seeds!r}")
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise ValueError(f"seeds: every seed must be an integer, got {list(seeds)!r}")
    # The store keeps seeds in SQLite's INTEGER column, a signed 64-bit integer.
    too_big = [s for s in seeds if not -(2**63) <= s < 2**63]
    if too_big:
        raise ValueError(
            f"seeds: {too_big[0]} does not fit in a signed 64-bit integer (the store's seed "
            f"column); use seeds in [-2**63, 2**63)"
        )
    return tuple(int(s) for s in seeds)


def _names(value: Any, what: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, Sequence) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{what} must be a list of names, got {value!r}")
    return tuple(value)


def _inits(value: Any) -> tuple[str, ...]:
    """``schemes`` as the canonical texts of its inits (:func:`initlab.study.pipelines.
    canonical_init`: checked, a plain scheme name as written)."""
    from initlab.study.pipelines import canonical_init

    if isinstance(value, (str, Mapping)):
        value = [value]
    if not isinstance(value, Sequence) or not all(isinstance(v, (str, Mapping)) for v in value):
        raise ValueError(f"schemes must be a list of inits (names or mappings), got {value!r}")
    try:
        return tuple(canonical_init(v) for v in value)
    except ValueError as err:
        raise ValueError(f"schemes: {err}") from None


def _unique(values: tuple[Any, ...], what: str) -> None:
    dupes = sorted({str(v) for v in values if values.count(v) > 1})
    if dupes:
        raise ValueError(f"{what} has duplicates: {', '.join(dupes)}")


def _no_aliases(
    values: tuple[str, ...], identity: Callable[[str], str], attr: str, what: str
) -> None:
    """Refuse two spellings (of one ``identity``) of one data set or one scheme among ``values``
    (the spec's ``attr``): they would train it twice and count it twice in Table 2."""
    spellings: dict[str, list[str]] = {}
    for value in values:
        spellings.setdefault(identity(value), []).append(value)
    aliases = [(ident, names) for ident, names in spellings.items() if len(names) > 1]
    if aliases:
        ident, names = aliases[0]
        raise ValueError(
            f"{attr}: {' and '.join(repr(n) for n in names)} are the same {what} "
            f"({ident!r}); keep one spelling"
        )


def _study_name(name: Any) -> str:
    """A study's name, checked: it names the study in a store and, by default, its files
    (``results/<name>.sqlite``), so it may not leave their folder."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"StudySpec.name must be a non-empty string, got {name!r}")
    if "/" in name or "\\" in name or name in (".", ".."):
        raise ValueError(
            f"StudySpec.name {name!r} is not a plain name: it names the study's files, so it may "
            "not contain '/' or '\\' nor be '.' or '..' (e.g. 'table2')"
        )
    return name


def _integer(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    return value


def _output_scale(value: Any) -> tuple[str, float] | None:
    """``{std: v}`` / ``{variance: v}`` (or the pair ``("std", v)``) → ``(kind, v)``; ``None``."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        value = tuple(value.items())
        if len(value) == 1:
            value = value[0]
    if (
        not isinstance(value, Sequence)
        or isinstance(value, str)
        or len(value) != 2
        or value[0] not in OUTPUT_SCALE_KINDS
    ):
        raise ValueError(
            f"output_scale must be {{std: value}}, {{variance: value}} or null, got {value!r}"
        )
    return str(value[0]), _number(value[1], f"output_scale: {value[0]}", positive=True)


def extend_rounds(value: Any) -> int:
    """``extend_grid`` as a number of rounds: ``True`` → :data:`DEFAULT_EXTEND_ROUNDS`,
    ``False`` → 0, an integer ``>= 0`` as it is."""
    if isinstance(value, bool):
        return DEFAULT_EXTEND_ROUNDS if value else 0
    if not isinstance(value, int) or value < 0:
        raise ValueError(
            f"extend_grid must be true, false or a number of rounds >= 0, got {value!r}"
        )
    return value


def _choice(value: Any, valid: Sequence[str], what: str) -> str:
    if value not in valid:
        raise ValueError(f"{what} must be one of {tuple(valid)}, got {value!r}")
    return str(value)


def _canonical_override(key: str, value: Any) -> tuple[str, Any]:
    """A variant override in canonical form (``output_std`` becomes ``output_scale``)."""
    if key == "lrs":
        return key, expand_lrs(value)
    if key in ("momentum", "weight_decay"):
        return key, _number(value, key)
    if key in ("epochs", "batch_size"):
        return key, _integer(value, key)
    if key == "optimizer":
        return key, _choice(value, OPTIMIZERS, key)
    if key == "input_norm":
        return key, _choice(value, INPUT_NORMS, key)
    if key == "loss":
        return key, _choice(value, tuple(LOSS_MEASURES), key)
    if key == "output_std":
        return "output_scale", None if value is None else _output_scale({"std": value})
    if key == "output_scale":
        return key, _output_scale(value)
    items = value.items() if isinstance(value, Mapping) else value  # model_cfg
    try:
        return key, RunConfig(dataset="-", model_cfg=tuple(items)).model_cfg
    except (TypeError, ValueError):
        raise ValueError(f"model_cfg must be a mapping, got {value!r}") from None


def _thaw_override(key: str, value: Any) -> Any:
    if key == "lrs":
        return list(value)
    if key == "output_scale":
        return None if value is None else {value[0]: value[1]}
    if key == "model_cfg":
        return {k: _thaw(v) for k, v in value}
    return value


#: The form of ``variants:``, for the errors that refuse another.
_VARIANTS_FORM = (
    "variants must be {name: {key: value, ...}} (each variant's name: the keys it changes)"
)


def _listed(value: Any) -> Any:
    """An iterable that is no sequence, mapping or string (``dict.items()``, a generator, a
    ``zip``) as the list of its items, read once; any other ``value`` as it is."""
    if isinstance(value, (str, bytes, Mapping, Sequence)) or not isinstance(value, Iterable):
        return value
    return list(value)


def _pairs(value: Any) -> bool:
    """Whether ``value`` is a sequence of ``(str, value)`` pairs (the stored form of a mapping;
    a view or iterator of them is one once :func:`_listed`)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return False
    return all(
        isinstance(p, Sequence) and not isinstance(p, (str, bytes)) and len(p) == 2
        and isinstance(p[0], str)
        for p in value
    )  # fmt: skip


def _variant_items(variants: Any) -> list[tuple[Any, Any]]:
    """``(name, overrides)`` of ``variants:`` (a mapping, or its stored form: pairs, in any
    iterable, ``dict.items()`` too)."""
    if isinstance(variants, Mapping):
        return list(variants.items())
    variants = _listed(variants)
    if not _pairs(variants):
        raise ValueError(f"{_VARIANTS_FORM}, got {variants!r}")
    return [(name, overrides) for name, overrides in variants]


def _override_items(name: str, overrides: Any) -> tuple[tuple[Any, Any], ...]:
    """The ``(key, value)`` pairs of variant ``name`` (a mapping, pairs in any iterable, or
    ``None``: none)."""
    if overrides is None:
        return ()
    if isinstance(overrides, Mapping):
        return tuple(overrides.items())
    overrides = _listed(overrides)
    if _pairs(overrides):
        return tuple((k, v) for k, v in overrides)
    hint = ""
    if name in VARIANT_KEYS:  # {epochs: [1, 2]}: a protocol key where a variant's name goes
        several = isinstance(overrides, Sequence) and not isinstance(overrides, (str, bytes))
        what = "several values of a key become variants" if several else "it changes every run"
        hint = (
            f"; {name} is a protocol key, not a variant's name: write "
            f"`{name}: {json.dumps(overrides, default=str)}` at the top level of the spec "
            f"({what}), or name each variant: {{NAME: {{{name}: VALUE}}, ...}}"
        )
    raise ValueError(f"{_VARIANTS_FORM}, got {name}: {overrides!r}{hint}")


def _canonical_variants(variants: Any) -> tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]:
    if variants is None:
        return ()
    out = []
    for name, overrides in _variant_items(variants):
        if not isinstance(name, str) or not name:
            raise ValueError(f"a variant's name must be a non-empty string, got {name!r}")
        items = _override_items(name, overrides)
        if {"output_std", "output_scale"} <= {k for k, _ in items}:
            raise ValueError(f"variant {name!r}: give output_scale or output_std, not both")
        bad = sorted(str(k) for k, _ in items if k not in VARIANT_KEYS)
        if bad:
            raise ValueError(
                f"variant {name!r} may not set {', '.join(bad)}; a variant changes only: "
                f"{', '.join(VARIANT_KEYS)}"
            )
        try:
            pairs = dict(_canonical_override(str(k), v) for k, v in items)
        except ValueError as err:
            raise ValueError(f"variant {name!r}: {err}") from None
        out.append((name, tuple(sorted(pairs.items()))))
    names = [n for n, _ in out]
    _unique(tuple(names), "variants")
    return tuple(out)


@dataclass(frozen=True)
class StudySpec:
    """A declarative study: which runs to train, with which settings.

    Attributes:
        name: the study's name (results in a store are tagged with it). It names the study's
            files too (the CLI's default store is ``results/<name>.sqlite``), so it may not
            contain ``/`` or ``\\`` nor be ``.`` or ``..``.
        datasets: catalogue names for :func:`initlab.data.load_dataset`, e.g. ``"libsvm:iris"``
            (the name is part of every run's key: two spellings of one data set, such as
            ``iris`` and ``libsvm:iris``, or ``mnist`` and ``mnist?pad=0``, are refused; see
            :func:`initlab.study.datasets.dataset_identity`).
        schemes: inits: data-free schemes (names accepted by :func:`initlab.init.schemes.
            get_scheme`), or a scheme followed by data-dependent methods (module docstring,
            :mod:`initlab.study.pipelines`), given as text or as a mapping; stored as their
            canonical text. Two spellings of one scheme (``fan_in``, ``kaiming`` and ``He``;
            ``he + lsuv`` and ``fan_in + lsuv``) are refused
            (:func:`initlab.study.pipelines.init_identity`).
        seeds: a count ``n`` (seeds ``0..n-1``) or a list; stored as a tuple of ints.
        lrs: a list of learning rates or ``{"pow2": [first, last]}``; stored as a tuple of floats.
        model: model registry name (``initlab.zoo.create_model``).
        model_cfg: the model's keyword arguments, without ``n_in``/``n_classes`` (the runner fills
            them from the data set). A ``dict`` is accepted; stored as sorted pairs.
        epochs, batch_size, optimizer, momentum, weight_decay, input_norm: as in
            :class:`~initlab.study.config.RunConfig`.
        output_std: the logits' std target (``RunConfig.output_std``); derived from
            ``output_scale`` when that is given.
        output_scale: ``{"std": v}`` or ``{"variance": v}`` (the std target ``sqrt(v)``); stored
            as ``(kind, v)``, or ``None`` for no scaling. ``None`` given: ``("std",
            output_std)``.
        loss: which training loss the report compares, a key of
            :data:`~initlab.study.config.LOSS_MEASURES` (not part of any run).
        variants: ``{name: {key: value}}`` overrides of the protocol keys
            (:data:`~initlab.study.variants.VARIANT_KEYS`); stored as sorted pairs in canonical
            form. Empty: one variant, ``"base"``, the spec itself.
        extend_grid: rounds of learning-rate grid extension after the runs
            (:func:`initlab.study.runner.run_study`); ``True`` is
            :data:`DEFAULT_EXTEND_ROUNDS`, ``False`` is 0.
        data_root: the data root for :func:`initlab.data.load_dataset` (a relative path is taken
            from the current directory); ``None``: the loader's default (``$INITLAB_DATA_DIR``,
            else ``../shared/data``, ...).
    """

    name: str
    datasets: tuple[str, ...]
    schemes: tuple[str, ...]
    seeds: tuple[int, ...]
    lrs: tuple[float, ...]
    model: str = "paper_mlp"
    model_cfg: tuple[tuple[str, Any], ...] = field(default=())
    epochs: int = 5
    batch_size: int = 64
    optimizer: str = "sgd"
    momentum: float = 0.0
    weight_decay: float = 0.0
    output_std: float | None = 0.05
    output_scale: tuple[str, float] | None = None
    input_norm: str = "none"
    loss: str = "full_pass"
    variants: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    extend_grid: int = 0
    data_root: str | None = None

    def __post_init__(self) -> None:
        norm = object.__setattr__
        _study_name(self.name)
        norm(self, "datasets", _names(self.datasets, "datasets"))
        norm(self, "schemes", _inits(self.schemes))
        norm(self, "seeds", expand_seeds(self.seeds))
        norm(self, "lrs", expand_lrs(self.lrs))
        for attr in ("datasets", "schemes", "seeds", "lrs"):
            values = getattr(self, attr)
            if not values:
                raise ValueError(f"{attr} is empty; give at least one")
            _unique(values, attr)
        _no_aliases(self.datasets, dataset_identity, "datasets", "data set")
        _no_aliases(self.schemes, init_identity, "schemes", "scheme")
        cfg = self.model_cfg
        if isinstance(cfg, Mapping):
            cfg = tuple(cfg.items())
        # RunConfig owns the canonical form of model_cfg (sorted pairs, lists as tuples).
        norm(self, "model_cfg", RunConfig(dataset="-", model_cfg=cfg).model_cfg)
        reserved = [k for k, _ in self.model_cfg if k in RESERVED_MODEL_KEYS]
        if reserved:
            raise ValueError(
                f"model_cfg may not set {', '.join(reserved)}: the runner takes them from each "
                "data set"
            )
        _choice(self.optimizer, OPTIMIZERS, "optimizer")
        _choice(self.input_norm, INPUT_NORMS, "input_norm")
        _choice(self.loss, tuple(LOSS_MEASURES), "loss")
        norm(self, "momentum", _number(self.momentum, "momentum"))
        norm(self, "weight_decay", _number(self.weight_decay, "weight_decay"))
        if self.output_scale is None and self.output_std is not None:
            norm(
                self, "output_scale", ("std", _number(self.output_std, "output_std", positive=True))
            )
        else:
            norm(self, "output_scale", _output_scale(self.output_scale))
        scale = self.output_scale
        std = None if scale is None else scale[1] if scale[0] == "std" else math.sqrt(scale[1])
        norm(self, "output_std", std)
        for attr in ("epochs", "batch_size"):
            _integer(getattr(self, attr), attr)
        norm(self, "extend_grid", extend_rounds(self.extend_grid))
        norm(self, "variants", _canonical_variants(self.variants))
        if self.data_root is not None:
            norm(self, "data_root", str(self.data_root))
        # RunConfig validates momentum, weight decay, epochs, ... with clear messages; every
        # variant is a flat spec, validated the same way.
        self.run_config(self.datasets[0], self.schemes[0], self.seeds[0], self.lrs[0])
        if self.variants:
            self.variant_specs()

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The keys a spec mapping (or YAML file) may have."""
        return (*(f.name for f in fields(cls)), *_EXTRA_KEYS)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StudySpec:
        """Build a spec from a mapping, rejecting unknown keys (the error names them).

        Keys with several values become variants (:func:`initlab.study.variants.expand_variants`).
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"a study spec must be a mapping, got {type(data).__name__}")
        valid = cls.field_names()
        unknown = sorted(str(k) for k in data if k not in valid)
        if unknown:
            raise ValueError(
                f"unknown study spec key(s): {', '.join(unknown)}; valid keys: {', '.join(valid)}"
            )
        missing = [k for k in _REQUIRED if k not in data]
        if missing:
            raise ValueError(f"study spec is missing required key(s): {', '.join(missing)}")
        if "output_std" in data and "output_scale" in data:
            raise ValueError(
                "give output_scale ({std: v} or {variance: v}) or output_std, not both"
            )
        kwargs = expand_variants(data)
        if "output_scale" in kwargs and kwargs["output_scale"] is None:
            kwargs["output_std"] = None  # output_scale: null is "no scaling"
        return cls(**kwargs)

    @classmethod
    def from_yaml(cls, path: str | Path) -> StudySpec:
        """Load a spec from a YAML file (needs PyYAML); strict about unknown keys and about a
        key given twice (:func:`load_yaml`)."""
        text = Path(path).read_text(encoding="utf-8")
        data = load_yaml(text)
        try:
            return cls.from_dict(data if data is not None else {})
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from err

    def to_dict(self) -> dict[str, Any]:
        """Plain, YAML/JSON-ready dict; ``StudySpec.from_dict(spec.to_dict()) == spec``.

        The output target is written as ``output_scale`` (``output_std`` is derived from it).
        """
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        for key in ("datasets", "schemes", "seeds", "lrs"):
            d[key] = list(d[key])
        d["model_cfg"] = {k: _thaw(v) for k, v in self.model_cfg}
        del d["output_std"]
        d["output_scale"] = _thaw_override("output_scale", self.output_scale)
        d["variants"] = {
            name: {k: _thaw_override(k, v) for k, v in overrides}
            for name, overrides in self.variants
        }
        return d

    def to_yaml(self, path: str | Path | None = None) -> str:
        """The spec as YAML text (rates written out as a list), also written to ``path``."""
        import yaml

        text = yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    # -- variants -----------------------------------------------------------------------------

    def variant_specs(self) -> dict[str, StudySpec]:
        """``{variant name: its flat spec}`` (no variants of its own, the same name).

        A spec without variants is one variant, ``"base"``: itself.
        """
        if not self.variants:
            return {BASE: self}
        base = self.to_dict()
        out = {}
        for name, overrides in self.variants:
            thawed = {k: _thaw_override(k, v) for k, v in overrides}
            merged = apply_overrides(base, thawed, name)
            merged["variants"] = {}
            try:
                out[name] = StudySpec.from_dict(merged)
            except ValueError as err:
                raise ValueError(f"variant {name!r}: {err}") from None
        return out

    def variant_runs(self) -> dict[str, list[RunConfig]]:
        """``{variant name: its runs}`` (:meth:`runs` of each flat spec)."""
        return {name: spec.runs() for name, spec in self.variant_specs().items()}

    # -- a study's name is bound to its runs ------------------------------------------------------

    def run_differences(
        self, registered: Mapping[str, Any], current: Mapping[str, set[str]] | None = None
    ) -> list[str]:
        """How this spec's runs differ from those of ``registered`` (a spec's :meth:`to_dict`, as
        a store keeps it), one text per differing field; empty when both define the same runs in
        the same variants.

        A store binds a study's name to its runs (:func:`initlab.study.runner.run_study`): a spec
        may differ from the registered one only in :data:`UNBOUND_KEYS` (or in the order of its
        lists), which change neither which runs exist nor what they compute. ``current``: this
        spec's run keys by variant, where the caller has them.
        """
        try:
            old = StudySpec.from_dict(registered)
        except (TypeError, ValueError) as err:
            return [f"the registered spec is not a valid spec for this initlab ({err})"]

        def keys(spec: StudySpec) -> dict[str, set[str]]:
            return {name: {c.key() for c in runs} for name, runs in spec.variant_runs().items()}

        if keys(old) == (keys(self) if current is None else current):
            return []
        before, now = old.to_dict(), self.to_dict()
        out = []
        for key, value in now.items():
            was = before[key]
            if key in UNBOUND_KEYS or was == value:
                continue
            if key in _AXES:
                added = [v for v in value if v not in was]
                removed = [v for v in was if v not in value]
                one, several = _AXES[key]
                change = [
                    f"{label} {one if len(vs) == 1 else several} {', '.join(map(str, vs))}"
                    for label, vs in (("added", added), ("removed", removed))
                    if vs
                ]
                if change:
                    out.append(f"{key}: {'; '.join(change)}")
            else:
                out.append(f"{key}: {was!r} registered, {value!r} now")
        return out or ["its runs"]

    def owns(self, config: RunConfig) -> bool:
        """Whether ``config`` is a run of this flat spec (no variants) at any learning rate: one
        of its grid's, or one a grid extension added (:mod:`initlab.study.extend`)."""
        return (
            config.dataset in self.datasets
            and config.scheme in self.schemes
            and config.seed in self.seeds
            and config == self.run_config(config.dataset, config.scheme, config.seed, config.lr)
        )

    # -- expansion ----------------------------------------------------------------------------

    @property
    def n_runs(self) -> int:
        """Distinct runs of all variants (without variants: ``len(datasets) * len(schemes) *
        len(seeds) * len(lrs)``)."""
        if not self.variants:
            return len(self.datasets) * len(self.schemes) * len(self.seeds) * len(self.lrs)
        return len(self.runs())

    def run_config(self, dataset: str, scheme: str, seed: int, lr: float) -> RunConfig:
        """The run of this spec (its base protocol) for one data set, scheme, seed and rate."""
        return RunConfig(
            dataset=dataset,
            model=self.model,
            model_cfg=self.model_cfg,
            scheme=scheme,
            seed=seed,
            lr=lr,
            optimizer=self.optimizer,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            epochs=self.epochs,
            batch_size=self.batch_size,
            output_std=self.output_std,
            input_norm=self.input_norm,
        )

    def runs(self) -> list[RunConfig]:
        """Every run of the study, ordered by variant, dataset, scheme, seed, learning rate; a
        run that several variants share appears once (at its first variant)."""
        if self.variants:
            seen: dict[str, RunConfig] = {}
            for runs in self.variant_runs().values():
                for config in runs:
                    seen.setdefault(config.key(), config)
            return list(seen.values())
        return [
            self.run_config(dataset, scheme, seed, lr)
            for dataset in self.datasets
            for scheme in self.schemes
            for seed in self.seeds
            for lr in self.lrs
        ]


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` that refuses a key given twice in one mapping (PyYAML keeps the last
    one without a word: ``epochs: 3`` then ``epochs: 1`` ran one epoch) with a
    ``yaml.constructor.ConstructorError`` that names the key and where it is."""
    try:
        import yaml
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("reading a study spec needs PyYAML: pip install pyyaml") from err

    class _Strict(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if isinstance(key, list | dict | set):
                    continue  # unhashable: PyYAML's own error follows
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while reading a mapping", node.start_mark,
                        f"found the key {key!r} twice (remove one)", key_node.start_mark,
                    )  # fmt: skip
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return yaml.load(text, Loader=_Strict)  # a SafeLoader: no arbitrary objects
