"""One training run as data: :class:`RunConfig` (what to run), :class:`RunResult` (what came out).

Both are plain, JSON-serializable records (``to_dict`` / ``from_dict``), so a study runner can store
them anywhere. :meth:`RunConfig.key` is a content hash of every field, stable across processes and
sessions; :meth:`RunConfig.group_key` says which runs may share one vectorized batch in
:func:`initlab.study.trainer.train_runs`.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

__all__ = [
    "DIVERGENCE_FACTOR",
    "INPUT_NORMS",
    "LOSS_MEASURES",
    "OPTIMIZERS",
    "RunConfig",
    "RunResult",
    "divergence_limit",
    "last_epoch_mean",
]

#: Optimizers the trainers implement (``torch.optim`` semantics, see the trainer module).
OPTIMIZERS = ("sgd", "adam")

#: ``RunConfig.input_norm`` values (see :func:`initlab.study.inputs.normalize_inputs`).
INPUT_NORMS = ("none", "layernorm", "standardize")

#: Which training loss a study's report compares (``loss:`` in a study spec), and the record
#: column holding it: the full pass over the training split after the last epoch, or the mean of
#: the last epoch's minibatch losses (:func:`last_epoch_mean`). Both are kept for every run, so the
#: choice is made when reporting and needs no training.
LOSS_MEASURES = {
    "full_pass": "final_train_loss",
    "last_epoch_minibatch": "last_epoch_minibatch_loss",
}

#: A run has diverged once a training loss is not finite or exceeds this factor times its start
#: (:func:`divergence_limit`). Cross-entropy starts near ``log(n_classes)`` (about 1 with the
#: output scale at 0.05); a loss a million times that means logits of order 1e6: the run no longer
#: learns, and its finite loss would enter the medians and Table 2's normalizer (the worst
#: scheme's loss) as a number where the protocol counts a failed run (+inf in the aggregation).
DIVERGENCE_FACTOR = 1e6

#: Fields added after the first stored studies, with the value that reproduces the earlier runs.
#: At that value a field is left out of :meth:`RunConfig.canonical_json`, so the keys of runs that
#: do not use it are the keys they always had.
_LATER_FIELDS = {"input_norm": "none"}


def _freeze(value: Any) -> Any:
    """Lists (e.g. from JSON) → tuples, recursively, so configs stay hashable."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    return value


def _thaw(value: Any) -> Any:
    """Tuples → lists, recursively (the JSON form)."""
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


@dataclass(frozen=True)
class RunConfig:
    """Everything that determines one training run (with the data and the model factory).

    Attributes:
        dataset: catalogue name of the data set, e.g. ``"dna"``.
        model: model registry name.
        model_cfg: the model's keyword arguments as sorted ``(name, value)`` pairs; a ``dict`` is
            accepted and converted (lists become tuples). :meth:`make` is the convenient spelling.
        scheme: initialization scheme for :func:`initlab.init_model`.
        seed: seeds the initialization and the per-epoch data order.
        lr: learning rate.
        optimizer: ``"sgd"`` or ``"adam"`` (Adam: betas (0.9, 0.999), eps 1e-8).
        momentum: SGD momentum (dampening 0, no Nesterov); must be 0 for Adam.
        weight_decay: coupled L2 (added to the gradient), as ``torch.optim.SGD``/``Adam`` do.
        epochs: passes over the training split.
        batch_size: minibatch size (the last, partial batch of an epoch is included).
        output_std: scale the logits to this std after the first minibatch's forward, with a
            constant fixed from then on (Defazio & Bottou use 0.05); ``None``: no scaling. An
            output *variance* target ``v`` is the std target ``sqrt(v)`` (the study spec's
            ``output_scale: {variance: v}`` is stored that way).
        input_norm: how the inputs are normalized before the model sees them (the trainer applies
            it to the data, :func:`initlab.study.inputs.normalize_inputs`): ``"none"``,
            ``"layernorm"`` (per example, LayerNorm without affine parameters, eps 1e-5: the
            paper's input whitening) or ``"standardize"`` (per feature, with the mean and std of
            the training split only). A model with its own input LayerNorm (``model_cfg``
            ``input_norm: true``, the earlier spelling) takes ``"none"`` here.
    """

    dataset: str
    model: str = "paper_mlp"
    model_cfg: tuple[tuple[str, Any], ...] = ()
    scheme: str = "geometric"
    seed: int = 0
    lr: float = 0.1
    optimizer: str = "sgd"
    momentum: float = 0.0
    weight_decay: float = 0.0
    epochs: int = 5
    batch_size: int = 64
    output_std: float | None = 0.05
    input_norm: str = "none"

    def __post_init__(self) -> None:
        # Normalize types so that equal configs hash (and serialize) equally: lr=1 and lr=1.0 are
        # the same run.
        norm = object.__setattr__
        cfg = self.model_cfg
        items = cfg.items() if isinstance(cfg, Mapping) else cfg
        norm(self, "model_cfg", tuple(sorted((str(k), _freeze(v)) for k, v in items)))
        for name in ("seed", "epochs", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or int(value) != value:
                raise ValueError(f"RunConfig.{name} must be an integer, got {value!r}")
            norm(self, name, int(value))
        for name in ("lr", "momentum", "weight_decay"):
            norm(self, name, float(getattr(self, name)))
        if self.output_std is not None:
            norm(self, "output_std", float(self.output_std))
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"RunConfig.optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}"
            )
        if self.optimizer == "adam" and self.momentum != 0.0:
            raise ValueError("RunConfig.momentum is for SGD; Adam uses fixed betas (0.9, 0.999)")
        if not (self.lr >= 0 and math.isfinite(self.lr)):
            raise ValueError(f"RunConfig.lr must be >= 0 and finite, got {self.lr}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"RunConfig.momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ValueError(f"RunConfig.weight_decay must be >= 0, got {self.weight_decay}")
        if self.epochs < 1 or self.batch_size < 1:
            raise ValueError(
                f"epochs and batch_size must be >= 1, got epochs {self.epochs}, batch_size "
                f"{self.batch_size}"
            )
        if self.output_std is not None and not self.output_std > 0:
            raise ValueError(
                f"RunConfig.output_std must be positive or None, got {self.output_std}"
            )
        self._check_input_norm()

    def _check_input_norm(self) -> None:
        if self.input_norm not in INPUT_NORMS:
            raise ValueError(
                f"RunConfig.input_norm must be one of {INPUT_NORMS}, got {self.input_norm!r}"
            )
        if self.input_norm != "none" and dict(self.model_cfg).get("input_norm"):
            raise ValueError(
                f"RunConfig.input_norm={self.input_norm!r} with model_cfg input_norm=true would "
                "normalize the inputs twice; drop model_cfg's input_norm (input_norm='layernorm' "
                "is the same LayerNorm, applied to the data)"
            )

    @classmethod
    def make(
        cls, dataset: str, *, model_cfg: Mapping[str, Any] | None = None, **kw: Any
    ) -> RunConfig:
        """Build a config with ``model_cfg`` given as a dict, e.g.
        ``RunConfig.make("dna", model_cfg={"input_norm": True}, lr=0.5)``."""
        return cls(dataset=dataset, model_cfg=tuple((model_cfg or {}).items()), **kw)

    @property
    def model_kwargs(self) -> dict[str, Any]:
        """``model_cfg`` as a dict of keyword arguments for the model constructor."""
        return dict(self.model_cfg)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of all fields (``model_cfg`` as a dict, tuples as lists)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["model_cfg"] = {k: _thaw(v) for k, v in self.model_cfg}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunConfig:
        """Inverse of :meth:`to_dict` (also accepts ``model_cfg`` as pairs)."""
        return cls(**dict(d))

    def canonical_json(self) -> str:
        """The canonical JSON text that :meth:`key` hashes (sorted keys, no spaces).

        Fields added after the first stored studies (``input_norm``) are left out at their
        default, so a run that does not use them keeps the key it had before they existed.
        """
        d = self.to_dict()
        for name, default in _LATER_FIELDS.items():
            if d[name] == default:
                del d[name]
        return json.dumps(d, sort_keys=True, separators=(",", ":"), allow_nan=False)

    def key(self) -> str:
        """SHA-256 hex digest of :meth:`canonical_json`: a stable identifier of the run."""
        return hashlib.sha256(self.canonical_json().encode("utf-8")).hexdigest()

    def group_key(self) -> tuple[Any, ...]:
        """Runs with equal group keys can be trained together by one ``train_runs`` call.

        They share the data (and its input normalization), the architecture, the optimizer kind
        and the step schedule; scheme, seed, lr, momentum, weight decay and output std may differ
        per run.
        """
        return (
            self.dataset,
            self.model,
            self.model_cfg,
            self.optimizer,
            self.epochs,
            self.batch_size,
            self.input_norm,
        )


def divergence_limit(first_loss: float) -> float:
    """The largest training loss of a run that has not diverged: :data:`DIVERGENCE_FACTOR` times
    its first step's loss, that loss taken as at least 1 (a lucky first minibatch with a loss
    near 0 must not make an ordinary loss look like a blow-up). A loss above it, or a non-finite
    one (a step's or an epoch's full pass over the training split), marks the run diverged
    (:mod:`initlab.study.trainer`, step 6). ``nan`` for a non-finite first loss (diverged then).

    Example:
        >>> divergence_limit(1.1), divergence_limit(0.01)
        (1100000.0, 1000000.0)
    """
    if not math.isfinite(first_loss):
        return math.nan
    return DIVERGENCE_FACTOR * max(float(first_loss), 1.0)


def last_epoch_mean(step_loss: Sequence[float], epochs: int) -> float:
    """The mean of the last epoch's step losses: ``mean(step_loss[-steps:])`` with
    ``steps = len(step_loss) // epochs``; ``nan`` if one of them is not finite (a diverged run).

    Each step's minibatch loss counts once, the last (partial) minibatch included: this is the
    running "epoch loss" most training loops print, the other measure of "the training loss
    after the last epoch" beside the full pass (``final_train_loss``).
    """
    if epochs < 1 or len(step_loss) < epochs or len(step_loss) % epochs:
        raise ValueError(
            f"step_loss has {len(step_loss)} entries, not a whole number of {epochs} epochs"
        )
    last = [float(v) for v in step_loss[len(step_loss) - len(step_loss) // epochs :]]
    if not all(math.isfinite(v) for v in last):
        return math.nan
    return math.fsum(last) / len(last)


@dataclass
class RunResult:
    """What one training run produced.

    Attributes:
        config: the run.
        step_loss: training loss of every step (the minibatch's mean cross-entropy before that
            step's update); always ``epochs * ceil(n_train / batch_size)`` entries. After a
            divergence the entries are ``nan``.
        epoch_train_loss, epoch_train_acc: full-pass evaluation on the training split after each
            epoch (``nan`` for epochs that ended after the run diverged).
        epoch_test_loss, epoch_test_acc: the same on the test split (empty without a test split).
        diverged: a training loss (a step loss or an epoch's train loss) was not finite or
            above :func:`divergence_limit` of the first step's loss (a million times it); the
            run was frozen from then on.
        final_train_loss: the last ``epoch_train_loss`` (``nan`` if diverged).
        wall_s: the wall time of the ``train_runs`` call divided by its number of runs.
        state: the final ``state_dict`` when the trainer was asked to keep it (``keep_state``);
            never serialized.
        init_cost: what a data-dependent init cost (:data:`initlab.study.pipelines.
            INIT_COST_KEYS`: wall time, forward/backward passes, examples, per method); ``None``
            for a data-free init.
    """

    config: RunConfig
    step_loss: list[float]
    epoch_train_loss: list[float]
    epoch_train_acc: list[float]
    epoch_test_loss: list[float]
    epoch_test_acc: list[float]
    diverged: bool
    final_train_loss: float
    wall_s: float
    state: dict[str, torch.Tensor] | None = field(default=None, repr=False, compare=False)
    init_cost: dict[str, Any] | None = None

    @property
    def last_epoch_minibatch_loss(self) -> float:
        """:func:`last_epoch_mean` of ``step_loss``: the last epoch's minibatch average; ``nan``
        for a diverged run (also one whose steps stayed finite and whose final pass diverged)."""
        if self.diverged:
            return math.nan
        return last_epoch_mean(self.step_loss, self.config.epochs)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (``config`` nested as :meth:`RunConfig.to_dict`; ``state`` left out).

        Non-finite floats stay ``float('nan')``/``inf``; serialize with ``allow_nan=True`` or map
        them yourself.
        """
        return {
            "config": self.config.to_dict(),
            "step_loss": list(self.step_loss),
            "epoch_train_loss": list(self.epoch_train_loss),
            "epoch_train_acc": list(self.epoch_train_acc),
            "epoch_test_loss": list(self.epoch_test_loss),
            "epoch_test_acc": list(self.epoch_test_acc),
            "diverged": bool(self.diverged),
            "final_train_loss": float(self.final_train_loss),
            "wall_s": float(self.wall_s),
            "init_cost": self.init_cost,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunResult:
        """Inverse of :meth:`to_dict` (``None`` values in float lists become ``nan``)."""

        def floats(xs: Any) -> list[float]:
            return [math.nan if x is None else float(x) for x in xs]

        final = d["final_train_loss"]
        return cls(
            config=RunConfig.from_dict(d["config"]),
            step_loss=floats(d["step_loss"]),
            epoch_train_loss=floats(d["epoch_train_loss"]),
            epoch_train_acc=floats(d["epoch_train_acc"]),
            epoch_test_loss=floats(d["epoch_test_loss"]),
            epoch_test_acc=floats(d["epoch_test_acc"]),
            diverged=bool(d["diverged"]),
            final_train_loss=math.nan if final is None else float(final),
            wall_s=float(d["wall_s"]),
            init_cost=d.get("init_cost"),
        )
