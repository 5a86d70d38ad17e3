"""A study's models: build a run's model from its config and its data set, and check a whole
study's models against its data before anything trains.

**Which model.** ``RunConfig.model`` is a zoo name (:func:`initlab.zoo.list_models`) or a user
factory ``"pkg.module:fn"`` (``fn`` a function or a class, importable wherever the study runs:
process-pool and Ray workers import it too).

**Its arguments** are the run's ``model_cfg`` plus what the data set determines, by name:

* ``n_in``: scalars per example (a vector model takes an image set flattened);
* ``in_channels``: an image set's channels;
* ``n_classes`` (or ``n_out``, the lecture MLPs' name for it): the data set's classes;
* ``input_shape``: one example's shape, e.g. ``(3, 32, 32)`` or ``(180,)`` (user factories).

A zoo model gets those of :data:`DATA_KEYS` its default configuration names; a user factory those
of :data:`DATA_KEYS` (and ``input_shape``) its signature names. ``model_cfg`` may not set them.

**Study options in model_cfg** (:data:`STUDY_KEYS`, not passed to the model):

* ``conditioning: kernel_size``: Defazio & Bottou's conditioning multipliers for kernel sizes
  (§5, App. E; their "preconditioned" AlexNet of Figure 3): every convolution gets
  ``alpha = kernel_size_alpha(k)`` (``alpha^4 k^2 = 1``, so ``1/sqrt(k)`` for a ``k × k``
  kernel; linear layers ``alpha = 1``), realized literally as ``W = alpha W'`` with
  ``W' = W_init / alpha`` (``ConditioningMultiplier`` parametrizations of
  :mod:`initlab.methods.precondition`, registered *after* the scheme's initialization by
  :func:`apply_study_options`): the forward pass at init is unchanged and SGD on ``W'`` moves
  ``W`` with ``alpha^2`` times the learning rate.

**The check** (:func:`check_study_models`) runs before any training: for every data set × model
configuration of the study it loads the data, builds the model as the trainer will, and runs two
examples through it, so a mismatch (an image model on a vector set, a 28×28 set for a 32×32 model,
a factory that ignores ``n_classes``) fails at once with a message naming the model, the data set
and what to do, not with a torch error after hours of other runs.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Collection, Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from initlab.study.config import RunConfig
from initlab.study.datasets import example_shape

__all__ = [
    "CONDITIONING",
    "DATA_KEYS",
    "STUDY_KEYS",
    "StudyModelError",
    "apply_study_options",
    "build_model",
    "check_model",
    "check_study_models",
    "data_arguments",
    "model_arguments",
]

#: Model arguments the runner fills from the data set (a spec's ``model_cfg`` may not set them).
DATA_KEYS = ("n_in", "in_channels", "n_classes", "n_out")
#: ``model_cfg`` keys the study applies itself (see the module doc); not passed to the model.
STUDY_KEYS = ("conditioning",)
#: Values of ``model_cfg["conditioning"]``.
CONDITIONING = ("kernel_size",)


class StudyModelError(ValueError):
    """A study's model does not fit its data (or cannot be built); raised before training."""


def _data_values(shape: tuple[int, ...], n_classes: int) -> dict[str, Any]:
    values: dict[str, Any] = {
        "n_in": math.prod(shape),
        "n_classes": n_classes,
        "n_out": n_classes,
        "input_shape": shape,
    }
    if len(shape) > 1:
        values["in_channels"] = shape[0]
    return values


def _user_factory(name: str) -> Callable[..., nn.Module]:
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise StudyModelError(
            f"model {name!r}: cannot import module {module_name!r} ({err}); a user factory must "
            "be importable here and in every worker (installed, or on PYTHONPATH)"
        ) from err
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise StudyModelError(f"model {name!r}: module {module_name!r} has no callable {attr!r}")
    return fn


def _factory(name: str) -> tuple[Callable[..., nn.Module], tuple[str, ...]]:
    """The builder of a model name and the data arguments it takes."""
    if ":" in name and not name.startswith(":"):
        fn = _user_factory(name)
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):  # builtins without a signature: nothing can be named
            params = {}
        return fn, tuple(k for k in (*DATA_KEYS, "input_shape") if k in params)
    from initlab.zoo import create_model, list_models

    defaults = {m["name"]: m["default_cfg"] for m in list_models()}
    if name not in defaults:
        raise StudyModelError(
            f"unknown model {name!r}: use a zoo name ({', '.join(defaults)}) or a user factory "
            "'pkg.module:fn'"
        )
    return (lambda **kw: create_model(name, **kw)), tuple(
        k for k in DATA_KEYS if k in defaults[name]
    )


def model_arguments(config: RunConfig, shape: tuple[int, ...], n_classes: int) -> dict[str, Any]:
    """The keyword arguments of a run's model: ``model_cfg`` (without :data:`STUDY_KEYS`) plus the
    data arguments its builder takes (see the module doc), for examples of ``shape``."""
    cfg = config.model_kwargs
    reserved = sorted(set(cfg) & {*DATA_KEYS, "input_shape"})
    if reserved:
        raise StudyModelError(
            f"model {config.model!r}: model_cfg sets {', '.join(reserved)}, which the runner "
            f"takes from data set {config.dataset!r}; remove it from model_cfg"
        )
    _factory(config.model)  # an unknown model, before its keys
    _check_zoo_keys(config)
    kwargs = {k: v for k, v in cfg.items() if k not in STUDY_KEYS}
    return {**kwargs, **data_arguments(config.model, config.dataset, shape, n_classes)}


def data_arguments(
    model: str,
    dataset: str,
    shape: tuple[int, ...],
    n_classes: int,
    given: Collection[str] = (),
) -> dict[str, Any]:
    """The arguments that the builder of ``model`` (a zoo name or ``"pkg.module:fn"``) takes
    from data set ``dataset`` (see the module doc), less those in ``given``: for examples of
    ``shape``, ``n_in = prod(shape)``, ``in_channels = shape[0]`` (images),
    ``n_classes = n_out = n_classes``, ``input_shape = shape``.

    Raises:
        StudyModelError: an unknown model, or a model that takes images (``in_channels``, not
            given) on a data set of vectors.
    """
    _, takes = _factory(model)
    values = _data_values(shape, n_classes)
    wanted = [k for k in takes if k not in given]
    if "in_channels" in wanted and "in_channels" not in values:
        raise StudyModelError(
            f"model {model!r} takes images (in_channels), but data set {dataset!r} gives vectors "
            f"of {shape[0]} features: use an image data set (mnist, cifar10) or a vector model "
            "(paper_mlp, lecture_mlp)"
        )
    return {k: values[k] for k in wanted}


def _check_zoo_keys(config: RunConfig) -> None:
    """Refuse ``model_cfg`` keys a zoo model does not take, listing those a spec may set (the
    zoo's own message lists the data keys too, which model_cfg may not set)."""
    if ":" in config.model:
        return  # a user factory: its own signature says
    from initlab.zoo import list_models

    defaults = next(m["default_cfg"] for m in list_models() if m["name"] == config.model)
    unknown = sorted(set(config.model_kwargs) - set(defaults) - set(STUDY_KEYS))
    if unknown:
        valid = sorted(k for k in defaults if k not in DATA_KEYS)
        data = ", ".join(k for k in DATA_KEYS if k in defaults)
        raise StudyModelError(
            f"model {config.model!r}: unknown model_cfg key(s) {', '.join(unknown)}; valid keys: "
            f"{', '.join(valid)}, and the study option {', '.join(STUDY_KEYS)} ({data}: taken "
            "from the data set)"
        )


def build_model(config: RunConfig, *, n_in: int, n_classes: int) -> nn.Module:
    """The (uninitialized) model of a run whose data set has ``n_in`` scalars per example and
    ``n_classes`` classes (an image set's shape comes from its name: :func:`example_shape`)."""
    fn, _ = _factory(config.model)
    kwargs = model_arguments(config, example_shape(config.dataset, n_in), n_classes)
    return fn(**kwargs)


def apply_study_options(model: nn.Module, config: RunConfig) -> nn.Module:
    """Apply the run's :data:`STUDY_KEYS` to its freshly initialized model, in place.

    ``conditioning: kernel_size`` registers ``W = alpha W'`` on every convolution weight with
    ``alpha = kernel_size_alpha(kernel_size) = (1 / k_taps)^(1/4)`` (Defazio & Bottou §5:
    ``alpha^4 k^2`` constant, linear layers ``k = 1``); ``W'`` is stored as ``W / alpha``, so the
    function is unchanged. Nothing happens without the key. A weight it would parametrize that
    is a distinct Parameter over another's memory (not a tie) is refused by name before any
    change.
    """
    conditioning = config.model_kwargs.get("conditioning")
    if conditioning is None:
        return model
    if conditioning not in CONDITIONING:
        raise StudyModelError(
            f"model_cfg conditioning={conditioning!r}: valid values are {', '.join(CONDITIONING)}"
        )
    from initlab._core.modules import refuse_shared_writes
    from initlab.methods.precondition import ConditioningMultiplier, kernel_size_alpha

    convs = [m for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)]
    if not convs:
        raise StudyModelError(
            f"model {config.model!r} has no convolution: conditioning='kernel_size' would change "
            "nothing; remove it"
        )
    alphas = [(conv, kernel_size_alpha(tuple(conv.kernel_size))) for conv in convs]
    refuse_shared_writes(
        "model_cfg conditioning='kernel_size'",
        model,
        [conv.weight for conv, alpha in alphas if alpha != 1.0],
        "registering W = alpha W' stores W' = W / alpha in memory of its own, so the two would "
        "silently stop sharing it (and train apart)",
    )
    for conv, alpha in alphas:
        if alpha != 1.0:
            parametrize.register_parametrization(conv, "weight", ConditioningMultiplier(alpha))
    return model


def _describe(config: RunConfig) -> str:
    cfg = ", ".join(f"{k}={v!r}" for k, v in config.model_cfg)
    return f"model {config.model!r}" + (f" ({cfg})" if cfg else "")


def _size_hint(config: RunConfig, shape: tuple[int, ...]) -> str:
    """What to do when an image model rejects the data's image size, if the zoo knows its size."""
    from initlab.zoo import input_shape

    if ":" in config.model or len(shape) != 3:
        return ""
    try:
        want = input_shape(config.model, in_channels=shape[0])
    except (TypeError, ValueError):
        return ""
    if len(want) == 3 and want[1:] != shape[1:] and want[1] >= shape[1] == shape[2]:
        pad = (want[1] - shape[1]) // 2
        name = config.dataset + ("&" if "?" in config.dataset else "?") + f"pad={pad}"
        return (
            f" {config.model} takes {want[1]}×{want[2]} images; pad them with the data option "
            f"pad={pad} (data set '{name}')."
        )
    return ""


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def check_model(config: RunConfig, data: Any) -> None:
    """Build ``config``'s model for ``data`` (a :class:`~initlab.study.runner.StudyData`) and run
    two training examples through it; :class:`StudyModelError` if anything does not fit."""
    x = data.train[0]
    shape = example_shape(config.dataset, int(data.n_features))
    what = f"{_describe(config)} on data set {config.dataset!r}"
    if x.shape[1:] not in (shape, (math.prod(shape),)):
        raise StudyModelError(
            f"{what}: the loaded examples have shape {tuple(x.shape[1:])}, the data set's name and "
            f"n_features={data.n_features} say {shape}; fix the data loader"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        try:
            model = build_model(config, n_in=int(data.n_features), n_classes=int(data.n_classes))
            apply_study_options(model, config)
        except StudyModelError:
            raise  # it names the model and the data set already
        except Exception as err:  # the model's own validation (unknown cfg key, bad value)
            raise StudyModelError(f"{what} cannot be built: {_first_line(err)}") from err
        model.eval()
        try:
            with torch.no_grad():
                out = model(x[:2].to(torch.float32))
        except Exception as err:  # a torch error from inside the model: say where it came from
            raise StudyModelError(
                f"{what} (examples of shape {shape}) fails on two training examples: "
                f"{_first_line(err)}.{_size_hint(config, shape)}"
            ) from err
    want = (min(2, x.shape[0]), int(data.n_classes))
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise StudyModelError(
            f"{what}: two examples give output {got}, not logits of shape {want} "
            f"({data.n_classes} classes); a user factory must take n_classes (or n_out) and "
            "return a module whose forward returns the logits"
        )


def check_study_models(
    configs: Iterable[RunConfig],
    load_fn: Callable[[str, str | None], Any],
    root: str | None = None,
) -> None:
    """Check every data set × model configuration of ``configs`` (:func:`check_model`), and
    every data-dependent init once, on the first of its runs
    (:func:`~initlab.study.pipelines.check_init`: a bad option value fails here, not in the middle
    of the study), loading each data set once with ``load_fn(name, root)``; the first misfit
    raises :class:`StudyModelError`."""
    from initlab.study.pipelines import check_init, is_data_dependent

    seen: dict[str, Any] = {}
    models: set[tuple[Any, ...]] = set()
    inits: set[str] = set()
    for config in configs:
        key = (config.dataset, config.model, config.model_cfg)
        init = is_data_dependent(config.scheme) and config.scheme not in inits
        if key in models and not init:
            continue
        if config.dataset not in seen:
            seen.clear()  # keep one data set in memory at a time (configs come grouped by it)
            seen[config.dataset] = load_fn(config.dataset, root)
        if key not in models:
            models.add(key)
            check_model(config, seen[config.dataset])
        if init:
            inits.add(config.scheme)
            check_init(config, seen[config.dataset])
