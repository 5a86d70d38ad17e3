"""How a loss is run for its gradient: the checks around ``loss.backward()`` that every entry
point shares.

* the model has a parameter that requires a gradient (:func:`check_trainable`);
* the loss carries a gradient (:func:`require_grad`, :func:`backward_of`): one computed from
  detached outputs or under ``torch.no_grad()`` is named, not torch's "element 0 of tensors does
  not require grad";
* the loss is defined on the batch (:func:`finite_loss`, :func:`check_defined`): a loss that is
  not finite while the model's outputs are (a mean over no target: every label the ignore index)
  raises, naming the batch, rather than being averaged in as zero or NaN gradients;
* the passes record a graph whatever the caller's grad mode (:func:`with_grad`, the decorator of
  every entry point that differentiates a loss): a call under ``torch.no_grad()`` (the usual
  context of init code) or ``torch.inference_mode()`` gives what a plain call gives.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch import nn

from initlab._core.data import output_tensor
from initlab._core.distributed import local_backward
from initlab._core.hooks import hook_handles
from initlab._core.loss import Loss
from initlab._core.modules import inference_tensors
from initlab._core.pytree import flatten_tensors

__all__ = [
    "backward_of",
    "check_defined",
    "check_trainable",
    "finite_loss",
    "outputs_finite",
    "outputs_watch",
    "refuse_complex",
    "require_grad",
    "with_grad",
]

F = TypeVar("F", bound=Callable[..., Any])


def with_grad(fn: F) -> F:
    """Run ``fn(model, ...)`` with torch's grad mode on, whatever the caller's: inside
    ``torch.inference_mode(False)`` and ``torch.enable_grad()``, the modes it had restored when it
    returns or raises (torch's own context managers). Its passes then record the graph its
    backward needs: under the caller's ``torch.no_grad()`` or ``torch.inference_mode()`` it
    gives what a plain call gives. Batches made under inference mode are cloned as they are read
    (:func:`~initlab._core.data.iter_batches`: an inference tensor cannot be saved for backward).
    A model made under it runs where nothing differentiates or saves its own tensors (a loss
    landscape, the curvature's functional passes); where torch then raises ("Inference tensors
    cannot be saved for backward", ...), the error names the model's inference tensors and what
    to do (:func:`_check_not_inference`; the writers refuse such a model before writing,
    :func:`~initlab._core.parametrized.check_writable`). The model is the first ``nn.Module`` of
    the first two arguments (``fn(model, ...)``; a method's ``self, model``) or ``model=``. On a
    class's methods (:class:`~initlab.measure.curvature.CurvatureOperator`'s ``__init__`` and
    those that run passes) the grad modes hold for each call; ``__init__``'s message names the
    class (the other methods take no model to name)."""
    what = fn.__qualname__.removesuffix(".__init__")

    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        model = next((a for a in args[:2] if isinstance(a, nn.Module)), kwargs.get("model"))
        with torch.inference_mode(False), torch.enable_grad():
            try:
                return fn(*args, **kwargs)
            except RuntimeError as err:
                if isinstance(model, nn.Module) and "nference tensor" in str(err):
                    _check_not_inference(model, what, err)
                raise

    return inner  # type: ignore[return-value]


def _check_not_inference(model: nn.Module, what: str, err: BaseException) -> None:
    """Raise ``ValueError`` (from torch's ``err``) naming the parameters and buffers of ``model``
    made under ``torch.inference_mode()`` (inference tensors: autograd refuses to differentiate
    them or to save them for the backward, as an eval-mode BatchNorm's running statistics are);
    nothing where it has none."""
    names = inference_tensors(model)
    if names:
        raise ValueError(
            f"{what}: the model's tensors ({names}) were created under torch.inference_mode(), "
            "and autograd cannot differentiate such tensors nor save them for its backward: "
            "build (or load) the model outside torch.inference_mode() (calling initlab under it "
            "is fine)"
        ) from err


def require_grad(loss: torch.Tensor, what: str = "") -> torch.Tensor:
    """``loss``, after checking that it carries a gradient: one that does not (the user's loss
    detached the outputs, or ran under ``torch.no_grad()``) raises a message saying so rather
    than torch's "element 0 of tensors does not require grad" (prefixed by ``what``)."""
    if not loss.requires_grad:
        raise ValueError(
            f"{what + ': ' if what else ''}the loss does not depend on the model's parameters: it "
            "carries no gradient (computed from detached outputs, under torch.no_grad(), or from "
            "no trainable parameter); return a loss computed from the model's outputs"
        )
    return loss


def backward_of(loss: torch.Tensor, what: str) -> None:
    """``loss.backward()``, the loss checked first (:func:`require_grad`); without DDP's
    reducer where a DDP runs its wrapped module
    (:func:`~initlab._core.distributed.local_backward`)."""
    local_backward(require_grad(loss, what), what)


def finite_loss(
    loss: Loss, model: nn.Module, batch: Any, *, what: str, index: int | None
) -> torch.Tensor:
    """``loss(model, batch)``, checked by :func:`check_defined` against every call of the model
    inside the loss (:func:`outputs_watch`)."""
    with outputs_watch(model) as finite:
        value = loss(model, batch)
    check_defined(value, all(finite), what=what, index=index)
    return value


@contextmanager
def outputs_watch(model: nn.Module) -> Iterator[list[bool]]:
    """A list that gets, for every call of ``model`` in the block, whether its output is finite
    (:func:`outputs_finite`; a forward hook, removed on exit). Not under ``vmap``. A TorchScript
    model takes no hook: its outputs are not known to be finite (``[False]``)."""
    if isinstance(model, torch.jit.ScriptModule):
        yield [False]
        return
    finite: list[bool] = []

    def watch(_module: nn.Module, _args: Any, output: Any) -> None:
        finite.append(outputs_finite(output))

    with hook_handles() as handles:
        handles.add(model.register_forward_hook(watch))
        yield finite


def check_defined(
    value: torch.Tensor, finite_outputs: bool, *, what: str, index: int | None
) -> None:
    """Raise if the loss ``value`` of a batch is not finite while the model's outputs on it are
    (``finite_outputs``): the loss is undefined on that batch (a mean over no target, every label
    the ignore index; a log of 0), and its backward gives zero or NaN gradients that a
    measurement would average in as the batch's. Non-finite outputs (the model overflows at
    this initialization) are for the measurement to report. ``index``: the batch's position in
    the data, named in the error."""
    if finite_outputs and not bool(value.detach().isfinite().all()):
        which = "the batch" if index is None else f"batch {index}"
        raise ValueError(
            f"{what}: the loss of {which} is {float(value.detach())} while the model's outputs "
            "on it are finite: the loss is undefined on that batch, not the model "
            "ill-conditioned (e.g. every target is the ignore index -100, and a mean over no "
            "target is 0/0). Drop such batches from the data, or pass a loss defined on them"
        )


def outputs_finite(output: Any) -> bool:
    """Whether the tensor a model's output stands for (:func:`output_tensor`; every
    floating-point tensor of it where there is none) is finite."""
    try:
        tensors = [output_tensor(output)]
    except TypeError:
        tensors = [t for _, t in flatten_tensors(output)]
    return all(bool(t.detach().isfinite().all()) for t in tensors if t.is_floating_point())


def refuse_complex(model: nn.Module, what: str, why: str) -> None:
    """Raise ``TypeError`` naming the trainable complex parameters of ``model`` (``why``: what
    is defined for real tensors only, and what to do)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad and p.is_complex()]
    if names:
        raise TypeError(f"{what}: parameter(s) {', '.join(names)} are complex; {why}")


def check_trainable(model: nn.Module, what: str, task: str = "measure") -> None:
    """Raise ValueError if ``model`` has no parameters (nothing for ``what`` to ``task``: the
    probe's own advice, ``MomentProbe(modules='leaves')``, is no option of an entry point that
    back-propagates a loss) or none of them requires a gradient: a loss of it has no gradient to
    measure (torch would say "element 0 of tensors does not require grad" from inside the
    backward); TypeError if a trainable one is complex (its gradient's moments would be read as
    their real parts)."""
    params = list(model.parameters())
    if not params:
        raise ValueError(
            f"{what}: the model has no parameters, so there is nothing to {task} (a loss of "
            f"{type(model).__name__} has no gradient); give a model with parameters"
        )
    refuse_complex(
        model, what, "initlab's moments, ratios and gradient statistics are defined for real "
        "tensors: freeze them for this call (requires_grad_(False); a frozen tensor is left out)"
    )  # fmt: skip
    if params and not any(p.requires_grad for p in params):
        raise ValueError(
            f"{what}: no parameter of the model requires a gradient (all {len(params)} are "
            "frozen), so the loss has no gradient to measure: unfreeze the layers to measure "
            "(model.requires_grad_(True)); a partly frozen model is measured on its trainable "
            "layers"
        )
