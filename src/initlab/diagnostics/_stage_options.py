"""The options :func:`initlab.diagnose` passes on to its optional stages, checked before its pass.

``curvature_options`` go to :func:`~initlab.measure.curvature.block_curvature` and
:func:`~initlab.measure.curvature.theory_vs_actual` (each call gets the ones it takes), and a
``landscape={...}`` to :func:`~initlab.loss_landscape`. A stage that fails on the model is a note
of the report ("report what failed, keep the rest"); the caller's own options are not the model's
failure: a key neither call takes (``{"probs": 4}``, with the name it is closest to) and a value
those calls refuse without data (``probes=0``, ``grid=0``, ``kind="gnn"``, a ``params=`` name the
model does not have) raise here, before any work, as the direct calls raise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from torch import nn

from initlab._core.knobs import check_kwargs, parameter_names
from initlab._core.loss import resolve_loss
from initlab._core.rng import as_generator
from initlab.measure.curvature import block_curvature, theory_vs_actual
from initlab.measure.curvature import estimators as _estimators
from initlab.measure.curvature.operators import _resolve_blocks
from initlab.measure.curvature.theory import check_gamma
from initlab.measure.landscape import check_options as check_landscape_values
from initlab.measure.landscape import loss_landscape

__all__ = ["CURVATURE_CALLS", "check_curvature_options", "check_landscape", "for_call"]

#: The calls ``curvature_options`` go to, in the order :func:`initlab.diagnose` runs them.
CURVATURE_CALLS: tuple[Callable[..., Any], ...] = (block_curvature, theory_vs_actual)


def option_names(fn: Callable[..., Any]) -> dict[str, str]:
    """The options ``fn`` takes after ``(model, data)``: name → the name it reads (a deprecated
    name, ``mode``, → its current one, ``ad_mode``)."""
    names = {n: n for n in parameter_names(fn) if n not in ("model", "data")}
    for old, new in getattr(fn, "__deprecated_kwargs__", {}).items():
        if new in names:
            names[old] = new
    return names


def for_call(fn: Callable[..., Any], options: Mapping[str, Any]) -> dict[str, Any]:
    """The ``options`` ``fn`` takes (``curvature_options`` hold both calls' options)."""
    names = option_names(fn)
    return {k: v for k, v in options.items() if k in names}


def check_curvature_options(model: nn.Module, options: Mapping[str, Any] | None) -> None:
    """Raise for ``curvature_options`` that neither curvature call takes, or whose values they
    refuse before reading data (:func:`~initlab.measure.curvature.estimators.check_options`,
    ``gamma``, ``params`` against the model's parameters, ``generator``, ``loss_fn``)."""
    if options is None:
        return
    opts = _known("curvature_options", options, CURVATURE_CALLS)
    if "loss_fn" in opts:  # as diagnose's _curvature resolves it
        resolve_loss(opts["loss_fn"], what="diagnose(curvature=True)")
    with _named("curvature_options"):
        values = parameter_names(_estimators.check_options)
        _estimators.check_options(**{k: opts[k] for k in values if k in opts})
        if "gamma" in opts:
            check_gamma(opts["gamma"])
        if opts.get("params") is not None:
            _resolve_blocks(model, opts["params"], opts.get("group", "tensor"))
        as_generator(opts.get("generator"))


def check_landscape(landscape: Any) -> None:
    """Raise a ``TypeError`` for a ``landscape=`` that is none of its forms (an int was dropped
    without a word: ``landscape=3`` computed nothing), and for a dict of options
    :func:`~initlab.loss_landscape` does not take or whose values it refuses before reading data
    (:func:`~initlab.measure.landscape.check_options`, ``generator``, ``loss_fn``)."""
    if isinstance(landscape, Mapping):
        opts = _known("landscape", landscape, (loss_landscape,))
        if "loss_fn" in opts:
            resolve_loss(opts["loss_fn"], what="diagnose(landscape=...)")
        with _named("landscape"):
            values = parameter_names(check_landscape_values)
            check_landscape_values(**{k: opts[k] for k in values if k in opts})
            as_generator(opts.get("generator"))
        return
    if landscape is None or isinstance(landscape, bool):
        return
    if callable(getattr(landscape, "to_rows", None)):
        return
    grid = f"; for a grid of {landscape} points per axis, landscape={{'grid': {landscape}}}"
    raise TypeError(
        "diagnose: landscape must be a Landscape to embed (from initlab.loss_landscape), True, "
        "or a dict of loss_landscape's options (grid=, directions=, bn=) to compute one; got "
        f"{type(landscape).__name__} {landscape!r}" + (grid if isinstance(landscape, int) else "")
    )


def _known(
    what: str, options: Mapping[Any, Any], fns: Sequence[Callable[..., Any]]
) -> dict[str, Any]:
    """``options`` under the names ``fns`` read, after a ``TypeError`` for a key none of them
    takes (with the closest name, :func:`~initlab._core.knobs.check_kwargs`)."""
    if not isinstance(options, Mapping):
        raise TypeError(
            f"diagnose: {what} must be a dict of options (keyword arguments of "
            f"{_names(fns)}), got {type(options).__name__} {options!r}"
        )
    names: dict[str, str] = {}
    for fn in fns:
        names.update(option_names(fn))
    out: dict[str, Any] = {}
    for key, value in options.items():
        if key not in names:
            _unknown(what, key, names, fns)
        if names[key] in out:
            raise TypeError(
                f"diagnose: {what} gives {names[key]} twice (as {names[key]} and its deprecated "
                "name); give it once"
            )
        out[names[key]] = value
    return out


def _unknown(
    what: str, key: object, names: Mapping[str, str], fns: Sequence[Callable[..., Any]]
) -> None:
    """Raise the ``TypeError`` for a key of ``what`` that is none of ``names``."""
    if not isinstance(key, str):
        raise TypeError(f"diagnose: {what} keys must be option names (str), got {key!r}")
    hint = ""
    try:
        check_kwargs(what, {key: None}, set(names.values()))  # the current names
    except TypeError as err:  # its hint: the closest name, or the accepted ones
        hint = "; " + str(err).split("; ", 1)[-1]
    raise TypeError(
        f"diagnose: unknown {what} option {key!r} (they are keyword arguments of "
        f"{_names(fns)}){hint}"
    )


def _names(fns: Sequence[Callable[..., Any]]) -> str:
    return " and ".join(fn.__name__ for fn in fns)


@contextmanager
def _named(what: str) -> Iterator[None]:
    """A ``TypeError`` or ``ValueError`` of the block raised again naming diagnose's ``what``
    (its subclasses, a ``TargetError``, pass as they are)."""
    try:
        yield
    except (TypeError, ValueError) as err:
        if type(err) not in (TypeError, ValueError):
            raise
        raise type(err)(f"diagnose: {what}: {err}") from err
