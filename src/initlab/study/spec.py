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
    output_std: 0.05
    data_root: null            # optional; null: the data loader's default location

Loading is strict: an unknown key is an error that names it (a typo such as ``weight_dacay`` must
not silently fall back to a default).

``model_cfg`` holds the model's options *except* ``n_in`` and ``n_classes``: those are properties of
the data set, not of the study, so they are not part of a run's config (nor of its key). The runner
fills them from the loaded data set's metadata when it builds each model
(:func:`initlab.study.runner.build_model`), which keeps :meth:`StudySpec.runs` free of I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from initlab.study.config import OPTIMIZERS, RunConfig

__all__ = ["RESERVED_MODEL_KEYS", "StudySpec", "expand_lrs", "expand_seeds"]

#: ``model_cfg`` keys the runner fills from the data set; a spec may not set them.
RESERVED_MODEL_KEYS = ("n_in", "n_classes")


#: Keys a spec mapping must have (the others have defaults).
_REQUIRED = ("name", "datasets", "schemes", "seeds", "lrs")


def _thaw(value: Any) -> Any:
    """Tuples → lists, recursively (the YAML/JSON form of ``model_cfg`` values)."""
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


def expand_lrs(lrs: Any) -> tuple[float, ...]:
    """Learning rates from a list, or from ``{"pow2": [hi, lo]}`` (``2**hi ... 2**lo``, inclusive).

    The power-of-two range runs in steps of one exponent in the direction from the first to the
    second endpoint, so ``{"pow2": [1, -12]}`` gives the 14 rates ``2, 1, 0.5, ..., 2**-12``.
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
    return tuple(int(s) for s in seeds)


def _names(value: Any, what: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, Sequence) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{what} must be a list of names, got {value!r}")
    return tuple(value)


def _unique(values: tuple[Any, ...], what: str) -> None:
    dupes = sorted({str(v) for v in values if values.count(v) > 1})
    if dupes:
        raise ValueError(f"{what} has duplicates: {', '.join(dupes)}")


@dataclass(frozen=True)
class StudySpec:
    """A declarative study: which runs to train, with which settings.

    Attributes:
        name: the study's name (results in a store are tagged with it).
        datasets: catalogue names for :func:`initlab.data.load_dataset`, e.g. ``"libsvm:iris"``
            (the name is part of every run's key: keep one spelling per data set).
        schemes: initialization schemes (names accepted by :func:`initlab.init.schemes.get_scheme`).
        seeds: a count ``n`` (seeds ``0..n-1``) or a list; stored as a tuple of ints.
        lrs: a list of learning rates or ``{"pow2": [first, last]}``; stored as a tuple of floats.
        model: model registry name (``initlab.zoo.create_model``).
        model_cfg: the model's keyword arguments, without ``n_in``/``n_classes`` (the runner fills
            them from the data set). A ``dict`` is accepted; stored as sorted pairs.
        epochs, batch_size, optimizer, momentum, weight_decay, output_std: as in
            :class:`~initlab.study.config.RunConfig`.
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
    data_root: str | None = None

    def __post_init__(self) -> None:
        norm = object.__setattr__
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"StudySpec.name must be a non-empty string, got {self.name!r}")
        norm(self, "datasets", _names(self.datasets, "datasets"))
        norm(self, "schemes", _names(self.schemes, "schemes"))
        norm(self, "seeds", expand_seeds(self.seeds))
        norm(self, "lrs", expand_lrs(self.lrs))
        for attr in ("datasets", "schemes", "seeds", "lrs"):
            values = getattr(self, attr)
            if not values:
                raise ValueError(f"StudySpec.{attr} is empty")
            _unique(values, attr)
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
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        norm(self, "momentum", _number(self.momentum, "momentum"))
        norm(self, "weight_decay", _number(self.weight_decay, "weight_decay"))
        if self.output_std is not None:
            norm(self, "output_std", _number(self.output_std, "output_std", positive=True))
        for attr in ("epochs", "batch_size"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{attr} must be an integer, got {value!r}")
        if self.data_root is not None:
            norm(self, "data_root", str(self.data_root))
        from initlab.init.schemes import get_scheme

        for scheme in self.schemes:
            get_scheme(scheme)  # raises with the list of valid names
        # RunConfig validates momentum, weight decay, epochs, ... with clear messages.
        RunConfig(
            dataset=self.datasets[0],
            model=self.model,
            model_cfg=self.model_cfg,
            scheme=self.schemes[0],
            seed=self.seeds[0],
            lr=self.lrs[0],
            optimizer=self.optimizer,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            epochs=self.epochs,
            batch_size=self.batch_size,
            output_std=self.output_std,
        )

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The keys a spec mapping (or YAML file) may have."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StudySpec:
        """Build a spec from a mapping, rejecting unknown keys (the error names them)."""
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
        return cls(**dict(data))

    @classmethod
    def from_yaml(cls, path: str | Path) -> StudySpec:
        """Load a spec from a YAML file (needs PyYAML); strict about unknown keys."""
        try:
            import yaml
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError("StudySpec.from_yaml needs PyYAML: pip install pyyaml") from err
        text = Path(path).read_text(encoding="utf-8")
        data = yaml.safe_load(text)
        try:
            return cls.from_dict(data if data is not None else {})
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from err

    def to_dict(self) -> dict[str, Any]:
        """Plain, YAML/JSON-ready dict; ``StudySpec.from_dict(spec.to_dict()) == spec``."""
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        for key in ("datasets", "schemes", "seeds", "lrs"):
            d[key] = list(d[key])
        d["model_cfg"] = {k: _thaw(v) for k, v in self.model_cfg}
        return d

    def to_yaml(self, path: str | Path | None = None) -> str:
        """The spec as YAML text (rates written out as a list), also written to ``path``."""
        import yaml

        text = yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    # -- expansion ----------------------------------------------------------------------------

    @property
    def n_runs(self) -> int:
        """``len(datasets) * len(schemes) * len(seeds) * len(lrs)``."""
        return len(self.datasets) * len(self.schemes) * len(self.seeds) * len(self.lrs)

    def runs(self) -> list[RunConfig]:
        """Every run of the study, ordered by dataset, scheme, seed, learning rate."""
        return [
            RunConfig(
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
            )
            for dataset in self.datasets
            for scheme in self.schemes
            for seed in self.seeds
            for lr in self.lrs
        ]
