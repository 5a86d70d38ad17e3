"""How every entry point turns its ``loss_fn`` argument into ``loss(model, batch) -> scalar``.

One resolver, :func:`resolve_loss`, reads every accepted form:

(a) ``loss_fn(model, batch) -> scalar``: any other callable (its first parameter is the model);
(b) a standard criterion ``criterion(output, target)``, applied as ``criterion(model(x), y)`` to
    ``(x, y)`` batches (and to dict batches, with the target from ``labels``): any ``nn.Module``
    (``nn.CrossEntropyLoss()``), any function of ``torch.nn.functional`` (``F.cross_entropy``), a
    ``functools.partial`` of one, a callable whose first parameter is named like an output
    (``input``, ``output``, ``logits``, ``pred``, ...), or any callable wrapped in
    :func:`criterion`;
(c) the model's own loss: ``None`` on dict batches (``model(**batch).loss`` when the batch carries
    the labels, as Hugging Face models do), or the name ``"model"`` on any batch;
(d) the named losses ``"auto"``, ``"cross_entropy"``, ``"mse"``, ``"random_quadratic"``.

``None`` (the default of every method that needs a loss) is the model's own loss when the model
returns one, else ``"auto"`` (cross-entropy for integer targets, MSE for float ones) on ``(x, y)``
batches. On a dict batch that fallback is refused with a :class:`TargetError` where it would stand
in for a loss the model has but did not compute: its forward takes a switch for it
(``return_loss``, CLIP's) that the batch does not set, or its output has a ``loss`` field left
``None`` although the batch carries labels; an output without a ``loss`` field (or behind a wrapper
keeping no ``module``) falls back. An unresolved loss raises a ``TypeError`` listing the forms.

Losses on the model's outputs (criteria, named losses, :func:`outputs_loss`) keep the split
``loss(model, batch) = on_outputs(forward(model, batch), batch)`` that curvature needs for the
Gauss-Newton matrix; :attr:`Loss.splittable` says whether a loss has it.
"""

from __future__ import annotations

import functools
import inspect
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from initlab._core.batch_shape import TARGET_KEYS, forward_params
from initlab._core.criteria import (
    ELEMENTWISE_CRITERIA,
    class_options,
    declared_reduction,
    is_one_of,
    takes_class_indices,
    weight_error,
)
from initlab._core.data import (
    default_forward,
    find_target,
    keyword_error,
    one_example_error,
    output_tensor,
)
from initlab._core.devices import target_device_error
from initlab._core.dtypes import data_error
from initlab._core.knobs import user_stacklevel

__all__ = [
    "LOSSES",
    "LOSS_FORMS",
    "Loss",
    "LossLike",
    "NamedLoss",
    "TargetError",
    "classes_dim",
    "criterion",
    "default_loss",
    "make_loss",
    "model_inputs",
    "outputs_loss",
    "resolve_loss",
]

LOSSES = ("auto", "cross_entropy", "mse", "random_quadratic", "model")
"""Loss names :func:`make_loss` and :func:`resolve_loss` know."""

LOSS_FORMS = (
    "loss_fn(model, batch) -> scalar; a criterion(output, target) such as nn.CrossEntropyLoss() "
    "or F.cross_entropy (or any callable wrapped in initlab.criterion) for (x, y) batches; None "
    "or 'model' for a model that returns its own loss (output.loss); or a name: "
    + ", ".join(repr(n) for n in LOSSES)
)

_OUTPUT_NAMES = frozenset(
    {"input", "inputs", "output", "outputs", "out", "logits", "pred", "preds", "prediction"}
    | {"predictions", "y_pred", "y_hat", "yhat", "scores"}
)

LossLike = Callable[..., torch.Tensor] | nn.Module | str | None


class TargetError(ValueError):
    """The batch's targets do not fit the loss (none, or of a shape it cannot pair with the
    output); the message says what to pass."""


class _OwnMessage(ValueError):
    """An error one of initlab's losses raises with a message of its own (passed on unwrapped)."""


class Loss:
    """A resolved loss: ``loss(model, batch) -> scalar tensor``.

    Attributes:
        name: how it reads in reports (``"cross_entropy"``, ``"CrossEntropyLoss"``, ``"model"``).
        form: ``"model_batch"``, ``"criterion"``, ``"outputs"``, ``"model_output"`` or ``"named"``.
        reduction: how it reduces over the batch where the loss says so (``"mean"``, ``"sum"``: a
            criterion's ``reduction``, the named losses' mean), else ``None`` (unknown).
    """

    form = "model_batch"
    reduction: str | None = None

    def __init__(self, name: str, fn: Callable[[Any, Any], torch.Tensor] | None = None) -> None:
        self.name = name
        self._fn = fn

    @property
    def splittable(self) -> bool:
        """Whether the loss is ``on_outputs(forward(model, batch), batch)`` (see module doc)."""
        return False

    def __call__(self, model: Any, batch: Any) -> torch.Tensor:
        assert self._fn is not None
        try:
            loss = self._fn(model, batch)
        except TypeError as err:
            clear = keyword_error(err, batch, f"loss_fn {self.name!r}")
            if clear is not None:
                raise clear from err
            if type(model).__name__ not in str(err) or "forward()" in str(err):
                raise  # not about calling a criterion with the model (the model's own error)
            raise TypeError(
                f"loss_fn {self.name!r} was called as loss_fn(model, batch) and failed ({err}); if "
                f"it is a criterion(output, target), pass initlab.criterion({self.name}). "
                f"Accepted forms: {LOSS_FORMS}"
            ) from err
        except ValueError as err:
            single = one_example_error(err)
            if single is None:
                raise
            raise single from err
        except RuntimeError as err:  # the model called by the loss, on data of another dtype
            clear = data_error(err, model, batch)
            if clear is None:
                raise
            raise clear from err
        return _scalar(loss, self.name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, form={self.form!r})"


class NamedLoss(Loss):
    """A loss on the model's outputs: ``loss(model, batch) = outputs_loss(forward(model, batch),
    batch)`` with the default forward (:func:`~initlab._core.data.default_forward`).

    ``outputs_loss(outputs, batch)`` receives the output tensor (``.logits`` of a Hugging Face
    output) and the whole batch.
    """

    form = "named"
    criterion_fn: Any = None
    """The ``fn(output, target)`` of a loss made by :func:`criterion` (``None`` otherwise)."""

    def __init__(
        self,
        name: str,
        outputs_loss: Callable[[torch.Tensor, Any], torch.Tensor],
        *,
        form: str = "named",
        reduction: str | None = None,
    ) -> None:
        super().__init__(name)
        self.outputs_loss = outputs_loss
        self.form = form
        self.reduction = reduction

    @property
    def splittable(self) -> bool:
        return True

    @staticmethod
    def forward(model: Any, batch: Any) -> Any:
        """The default forward: ``model(x)``, ``model(batch[0])`` or ``model(**batch)``; a
        Hugging Face model gets a dict batch without its labels (:func:`model_inputs`)."""
        return default_forward(model, model_inputs(model, batch))

    def on_outputs(self, outputs: Any, batch: Any) -> torch.Tensor:
        """The loss of ``outputs`` (what :meth:`forward` returned) on ``batch``.

        Raises:
            TargetError: the loss failed on the output and the targets (a raw torch error, e.g.
                targets of a shape it does not take); the message gives both shapes.
            ValueError: a criterion's own ``weight=`` or ``pos_weight=`` does not fit the
                output (:func:`~initlab._core.criteria.weight_error`).
        """
        out = output_tensor(outputs, way_out="loss_fn")  # every entry point takes one
        fn = _class_criterion(self)
        if fn is not None:
            ignore = class_options(fn)[0]
            _check_unshifted(outputs, batch, self.name, ignore)
            if self.reduction != "sum":  # a sum over no target is 0, and defined
                _check_counted(find_target(batch), ignore, self.name)
        try:
            loss = self.outputs_loss(out, batch)
        except (TargetError, _OwnMessage):
            raise
        except (RuntimeError, ValueError, IndexError) as err:
            moved = target_device_error(out, batch, err)
            if moved is not None:
                raise moved from err
            own = weight_error(self.criterion_fn, out, err, self.name)
            if own is not None:  # the criterion's weight=, not the targets
                raise own from err
            if not _is_pairing_error(err):  # out of memory, a transform's limit, the user's own
                raise
            raise _pairing_error(self.name, out, batch, err, fn is not None) from err
        return _scalar(loss, self.name)

    def __call__(self, model: Any, batch: Any) -> torch.Tensor:
        return self.on_outputs(self.forward(model, batch), batch)


def model_inputs(model: Any, batch: Any) -> Any:
    """A dict batch without its target (``labels``, ...) for a Hugging Face model: the loss comes
    from the outputs, and given the labels the model would compute its own loss as well (failing
    on labels it does not take, such as class probabilities for a single-label head, with its
    own raw error) and record ``config.problem_type`` from them. An encoder-decoder model that
    builds its decoder inputs from the labels gets them built the same way
    (``prepare_decoder_input_ids_from_labels``). Any other model and batch: the batch as it is
    (a model of one's own may read the labels, e.g. for teacher forcing)."""
    if not isinstance(batch, Mapping) or not _is_hugging_face(model):
        return batch
    found = find_target(batch)
    if found is None:
        return batch
    key, y = found
    inputs = {k: v for k, v in batch.items() if k != key}
    prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    decoder_given = "decoder_input_ids" in batch or "decoder_inputs_embeds" in batch
    if key == "labels" and callable(prepare) and not decoder_given:
        inputs["decoder_input_ids"] = prepare(labels=y)
    return inputs


def _is_hugging_face(model: Any) -> bool:
    """A ``transformers`` model: its ``config`` is a ``PreTrainedConfig`` (``PretrainedConfig``
    before transformers 5; read by name, so that ``transformers`` is never imported here; a
    stand-in that forwards ``config`` counts)."""
    config = getattr(model, "config", None)
    return any(
        c.__name__.lower() == "pretrainedconfig" and c.__module__.startswith("transformers")
        for c in type(config).__mro__
    )


class _ModelOutputLoss(Loss):
    """The model's own loss: ``model(**batch).loss`` (or ``["loss"]``, or a tuple's first item)."""

    form = "model_output"

    def __call__(self, model: Any, batch: Any) -> torch.Tensor:
        if isinstance(batch, Mapping):
            _check_counted(find_target(batch), -100, "model")  # Hugging Face's convention
        loss = model_loss(default_forward(model, batch))
        if loss is None:
            switch = _loss_switch(model, batch) if isinstance(batch, Mapping) else None
            ask = "pass the labels in the batch (e.g. a dict with 'labels')"
            if switch:
                ask = _NEEDS if switch[1] else f"pass {switch[0]}=True in every batch"
            raise TypeError(
                f"the model returned no loss (no .loss, no 'loss' entry): {ask}, or a loss; "
                f"accepted forms: {LOSS_FORMS}"
            )
        return _scalar(loss, self.name)


class _AutoLoss(Loss):
    """``None``: the model's own loss on dict batches when it returns one, else ``"auto"``."""

    form = "auto"

    def __call__(self, model: Any, batch: Any) -> torch.Tensor:
        if isinstance(batch, Mapping):
            out = default_forward(model, batch)
            loss = model_loss(out)
            if loss is not None:
                _check_counted(find_target(batch), -100, "model")  # Hugging Face's convention
                return _scalar(loss, "model")
            _check_no_own_loss(model, out, batch)
            return default_loss.on_outputs(out, batch)  # a pairing error named, as on tuples
        return default_loss(model, batch)


#: Keyword arguments by which a model's forward is asked to compute its own loss (CLIP's,
#: SigLIP's, BLIP's ``return_loss``): without it, labels or not, its output's ``loss`` is None.
_LOSS_SWITCHES = ("return_loss",)
_NEEDS = "give the batch what its forward needs for its loss (its switch for it is on)"


def _loss_switch(model: Any, batch: Mapping[str, Any]) -> tuple[str, bool] | None:
    """The keyword of :data:`_LOSS_SWITCHES` that ``model``'s forward takes and whether it is on
    for ``batch`` (set true there, or true by default: PatchTSMixer's ``return_loss=True``
    computes the loss unless told not to), or ``None``."""
    params = forward_params(model)
    k = next((k for k in _LOSS_SWITCHES if k in params), None)
    return None if k is None else (k, batch.get(k, params[k].default) is True)


def _check_no_own_loss(model: Any, outputs: Any, batch: Mapping[str, Any]) -> None:
    """Raise :class:`TargetError` before the ``"auto"`` fallback (a loss on the first output tensor)
    where it would silently replace the model's own loss: its forward (a wrapper's read through,
    :func:`~initlab._core.batch_shape.forward_params`) takes a loss switch (``return_loss``) off for
    the batch, or its output's ``loss`` field is ``None`` though the batch carries labels under a
    key the forward names, or none with the switch on. An output without a ``loss`` field, and
    labels the forward does not name (``label`` into ``**kwargs``), keep the documented fallback."""
    sw = _loss_switch(model, batch)
    switch = sw[0] if sw is not None and not sw[1] else None  # off: the one to advise
    has_field = hasattr(outputs, "loss") or (isinstance(outputs, Mapping) and "loss" in outputs)
    found = find_target(batch)
    named = found is not None and found[0] in forward_params(model)
    if switch is None and not (has_field and (named or (sw is not None and found is None))):
        return
    kind = type(outputs).__name__
    ignored = (
        f"the batch carries labels ({found[0]!r}) but the model's output ({kind}) has loss None"
        if found is not None
        else f"the model's output ({kind}) has no loss"
    )
    ask = (
        f"pass {switch}=True in every batch (the model's own switch for its loss: "
        f"{{**batch, {switch!r}: True}})"
        if switch
        else "give the batch what its forward needs for it (the model computes its loss from "
        "other entries)"
    )
    raise TargetError(
        f"{ignored}: the loss on its first output that initlab would fall back to is not the "
        f"model's own loss. To use the model's own loss, {ask}; for another loss, pass it as "
        f"loss_fn (e.g. a loss_fn(model, batch)); accepted forms: {LOSS_FORMS}"
    )


def _check_unshifted(outputs: Any, batch: Any, name: str, ignore_index: int) -> None:
    """Warn when a class criterion meets a causal language model's logits and labels that are
    the batch's input ids (``input_ids`` and ``labels`` of a dict, ``(ids, ids)``; Hugging Face's
    convention: the model's own loss shifts them, so position ``t`` predicts token ``t + 1``); the
    criterion compares them position by position, each token predicted from itself. The advice
    names ``loss_fn=`` (every entry point's keyword) and a shifting ``loss_fn(model, batch)`` for
    the batch's form; for a tuple batch, dict batches for the model's own loss (``model(batch
    [0])`` gets no labels, so returns no loss)."""
    kind = type(outputs).__name__
    if not kind.startswith("CausalLMOutput"):
        return
    if isinstance(batch, Mapping):
        ids, labels = batch.get("input_ids"), batch.get("labels")
        # the model's own loss reads the dict's labels (loss_fn=None, or 'model')
        own = "Pass loss_fn=None (the model's own loss; --loss model on the command line)"
        call, target = "model(**batch)", "batch['labels']"
    elif isinstance(batch, (tuple, list)) and len(batch) >= 2:
        ids, labels = batch[0], batch[1]
        # model(batch[0]) gets no labels, so returns no loss: the own loss needs a dict batch
        own = (
            "Pass dict batches {'input_ids': ids, 'labels': ids} with loss_fn=None (the "
            "model's own loss)"
        )
        call, target = "model(batch[0])", "batch[1]"
    else:
        return
    if not isinstance(ids, torch.Tensor) or not isinstance(labels, torch.Tensor):
        return
    if ids.shape != labels.shape or not bool(((labels == ids) | (labels == ignore_index)).all()):
        return
    warnings.warn(
        f"{name}: the model is a causal language model ({kind}) and the labels are its "
        "input_ids, as Hugging Face has them: its own loss predicts each token from the ones "
        f"before it (it shifts the labels by one), while {name} compares each position's logits "
        f"with that position's own token. {own}, or a loss_fn(model, batch) that shifts: "
        f"lambda model, batch: F.cross_entropy({call}.logits[:, :-1].flatten(0, 1), "
        f"{target}[:, 1:].flatten())",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def _check_counted(found: tuple[str, Any] | None, ignore_index: int, name: str) -> None:
    """Raise :class:`TargetError` when every class target of the batch is ``ignore_index``: a
    mean-reduced class loss then averages over nothing (0/0, NaN) and no gradient flows, which
    measurements would read as zero gradients."""
    y = None if found is None else found[1]
    if not isinstance(y, torch.Tensor) or y.is_floating_point() or y.numel() == 0:
        return
    if bool((y == ignore_index).all()):
        raise TargetError(
            f"the loss {name!r} got a batch whose {y.numel()} targets (entry {found[0]!r}) are all "
            f"ignore_index ({ignore_index}): it averages over no target (NaN) and no gradient "
            "flows. Drop such batches (or the examples without a counted label) from the data"
        )


def model_loss(outputs: Any) -> torch.Tensor | None:
    """The loss a model returned with its outputs, or ``None``: ``outputs.loss``, ``outputs
    ["loss"]``, the first item of a tuple or list when it is a scalar beside other outputs
    (a Hugging Face model called with ``return_dict=False``: ``(loss, logits, ...)``), or the
    output itself when it is one floating scalar (a model whose forward returns its loss);
    ``None`` for a tensor of outputs or a tuple of them."""
    if isinstance(outputs, torch.Tensor):
        return outputs if outputs.dim() == 0 and outputs.is_floating_point() else None
    loss = getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, Mapping):
        loss = outputs.get("loss")
    if isinstance(outputs, (tuple, list)) and len(outputs) > 1:
        first = outputs[0]
        if isinstance(first, torch.Tensor) and first.dim() == 0 and first.is_floating_point():
            loss = first
    return loss if isinstance(loss, torch.Tensor) else None


def _scalar(loss: Any, name: str) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"the loss {name!r} returned {type(loss).__name__}, not a tensor")
    if loss.numel() != 1:
        raise ValueError(
            f"the loss {name!r} returned a tensor of shape {tuple(loss.shape)}, not a scalar; "
            "reduce it (e.g. reduction='mean')"
        )
    return loss.reshape(())


def _target(batch: Any, what: str | None, *, name: str = "", tensor: bool = True) -> Any:
    """``batch[1]`` of an ``(x, y, ...)`` batch, or the ``labels`` entry of a dict batch
    (:func:`~initlab._core.data.find_target`): the one place the losses on the outputs (the named
    ones, the default one, a criterion ``name``) take the target from the batch.

    Raises:
        TargetError: no target; or (``tensor``: every loss but a criterion of one's own, which
            may take a list) a target that is no tensor (a ``collate_fn`` that left the labels a
            list, an ``(x, None)`` batch), named by its entry and type.
    """
    found = find_target(batch)
    if found is None and isinstance(batch, Mapping):  # find_target reads only a tensor's key
        found = next(((k, batch[k]) for k in TARGET_KEYS if batch.get(k) is not None), None)
    if found is not None:
        if tensor and not isinstance(found[1], torch.Tensor):
            loss = f"the {what} loss" if what else f"the loss {name!r}" if name else "the loss"
            raise TargetError(_not_a_tensor(loss, *found))
        return found[1]
    kind = f"the {what} loss" if what else "a criterion(output, target)"
    got = f"a {type(batch).__name__} batch"
    if isinstance(batch, Mapping):  # a model of its own computes no loss without labels either
        got = f"a dict batch without 'labels' (keys {sorted(map(str, batch))})"
    raise TargetError(
        f"{kind} needs (x, y) batches or dict batches with 'labels'; got {got}. Give every "
        "batch its targets; for data without targets pass loss_fn(model, batch), or "
        "'random_quadratic' (Defazio & Bottou's random loss y^T R y)"
    )


def _not_a_tensor(kind: str, key: str, y: Any) -> str:
    """The message of :func:`_target`'s error for a target ``y`` (entry ``key``) that is no
    tensor."""
    got = "None" if y is None else f"a {type(y).__module__}.{type(y).__qualname__}"
    got = got.replace("builtins.", "")
    if isinstance(y, (list, tuple)):
        got += f" of {len(y)} items"
    way = (
        "give every batch its targets (check the dataset and the DataLoader's collate_fn); for "
        "data without targets pass a loss_fn(model, batch), or 'random_quadratic'"
        if y is None
        else "convert the labels to one tensor (torch.tensor(labels)), or fix the DataLoader's "
        "collate_fn so that it stacks them (the default collate_fn does)"
    )
    return (
        f"{kind} takes the batch's targets as a tensor, and entry {key!r} of the batch (its "
        f"targets) is {got}, not a tensor: {way}"
    )


_PAIRING_WORDS = re.compile(r"target|shape|size|dimension|out of bounds|dtype|Long|Byte|multi")
_AUTOGRAD_WORDS = re.compile(
    r"derivative|forward[- ]mode|forward AD|vmap|functorch|grad|not implemented"
)


def _is_pairing_error(err: Exception) -> bool:
    """Whether torch's error from a loss is about pairing the output with the targets (their
    shapes, sizes, dtypes, class indices), as opposed to memory, autograd transforms, or an error
    the user's own criterion raises with its own message."""
    if isinstance(err, torch.OutOfMemoryError):
        return False
    text = str(err)
    return bool(_PAIRING_WORDS.search(text)) and not _AUTOGRAD_WORDS.search(text)


def _pairing_error(
    name: str, out: torch.Tensor, batch: Any, err: Exception, classes: bool
) -> TargetError:
    """A loss on the outputs failed: say so with the output's and the target's shapes (and, for a
    class criterion, ``classes``, on integer targets that are not int64: ``y.long()``)."""
    hint, target = "", None
    try:
        target = _target(batch, None, tensor=False)  # a criterion of one's own may take a list
        given = f"targets of type {type(target).__name__}"
    except TargetError:
        given = "no targets"
    if isinstance(target, torch.Tensor):
        given = f"targets of shape {tuple(target.shape)} ({target.dtype})"
        if classes and not target.is_floating_point() and target.dtype != torch.long:
            hint = (
                f" Class indices are int64 for torch's losses: pass y.long(), not {target.dtype}."
            )
    return TargetError(
        f"the loss {name!r} failed on the model's output of shape {tuple(out.shape)} "
        f"({out.dtype}) and {given}: {str(err).rstrip('.')}.{hint} Check that the targets are "
        "what the loss takes "
        "(cross-entropy: class indices of the output's shape without its class dimension, or "
        "class probabilities of the output's shape; MSE: the output's shape)"
    )


def _cross_entropy_out(out: torch.Tensor, y: torch.Tensor, batch: Any = None) -> torch.Tensor:
    if y.is_floating_point() and y.shape == out.shape and out.dim() >= 1:
        c = out.shape[-1]  # class probabilities (soft or one-hot labels), classes last
        return F.cross_entropy(out.reshape(-1, c), y.reshape(-1, c))
    if y.shape == out.shape and out.dim() >= 2:
        raise TargetError(
            f"cross-entropy got integer targets of the logits' shape {tuple(out.shape)}, which "
            "look one-hot: pass class indices of shape "
            f"{tuple(out.shape[:-1])} (y.argmax(-1)), or float class probabilities (y.float())"
        )
    if not y.is_floating_point() and y.dtype != torch.long:
        y = y.long()  # class indices as int32/int16 (numpy's int32, a smaller label dtype)
    if classes_dim(out, y, batch) == 1:
        return F.cross_entropy(out, y)  # dense logits (B, C, *S), targets (B, *S)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def classes_dim(out: torch.Tensor, y: torch.Tensor, batch: Any = None, *, warn: bool = True) -> int:
    """Where the classes of logits ``out`` lie for class-index targets ``y``: ``1`` in torch's
    dense layout, logits ``(B, C, *S)`` with targets ``(B, *S)``; ``-1`` otherwise (``(B, C)``
    with ``(B,)``, token logits ``(B, T, C)`` with ``(B, T)``).

    Token logits with ``T == C`` read both ways. They are read as tokens (classes last) when the
    batch holds another integer tensor of the targets' shape (token ids, an attention mask: the
    ``input_ids`` of a Hugging Face batch, ``x`` of ``(x, y)`` for a token model), else in torch's
    layout with a ``UserWarning`` (``warn``) that names the other reading and the way to choose it.
    """
    if out.dim() < 3 or tuple(y.shape) != (out.shape[0], *out.shape[2:]):
        return -1
    if tuple(y.shape) != tuple(out.shape[:-1]):
        return 1
    if out.dim() == 3 and _has_token_ids(batch, y):
        return -1
    if warn:
        warnings.warn(
            f"cross-entropy: logits of shape {tuple(out.shape)} with targets of shape "
            f"{tuple(y.shape)} read both as torch's layout (classes on dim 1) and as tokens "
            "(classes last); read in torch's layout. If the classes are last, put the token ids "
            "(or an attention mask) of the targets' shape in the batch, or pass a "
            "loss_fn(model, batch) that flattens them: "
            "F.cross_entropy(out.flatten(0, -2), y.flatten())",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    return 1


def _has_token_ids(batch: Any, y: torch.Tensor) -> bool:
    """Whether ``batch`` holds an integer tensor of ``y``'s shape besides its targets (``y``, or
    the batch's own target tensor, which ``y`` may be a converted copy of)."""
    found = find_target(batch)
    targets = (y, None if found is None else found[1])
    if isinstance(batch, Mapping):
        entries = list(batch.values())
    elif isinstance(batch, (tuple, list)):
        entries = list(batch)
    else:
        return False
    return any(
        isinstance(t, torch.Tensor)
        and all(t is not target for target in targets)
        and not t.is_floating_point()
        and t.shape == y.shape
        for t in entries
    )


def _paired(out: torch.Tensor, y: torch.Tensor, name: str) -> torch.Tensor:
    """The targets ``y`` of an elementwise loss (``name``) in the shape of the outputs, up to
    dimensions of size 1 (``(B, 1)`` outputs with ``(B,)`` targets); any other pair of shapes
    raises rather than broadcast (``(B, 1) - (B,)`` is ``(B, B)``)."""
    if y.shape != out.shape:
        if out.squeeze().shape != y.squeeze().shape:
            raise TargetError(
                f"{name} needs outputs and targets of one shape; got outputs "
                f"{tuple(out.shape)} and targets {tuple(y.shape)}. Reshape the targets, or pass "
                "a loss_fn(model, batch) that pairs them"
            )
        y = y.reshape(out.shape)
    return y


def _mse_out(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, _paired(out, y, "mean squared error"))


def _auto(out: torch.Tensor, y: torch.Tensor, batch: Any) -> torch.Tensor:
    return _mse_out(out, y) if y.is_floating_point() else _cross_entropy_out(out, y, batch)


_QUADRATIC_MAX = 8192
"""Largest per-example output size of ``random_quadratic`` (its matrix: 512 MiB in float64)."""


def _random_quadratic(seed: int) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    cache: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}

    def loss(out: torch.Tensor, batch: Any) -> torch.Tensor:
        flat = out.reshape(out.shape[0], -1)
        key = (flat.shape[1], flat.device, flat.dtype)
        if key not in cache:
            gen = torch.Generator().manual_seed(seed)
            d = flat.shape[1]
            if d > _QUADRATIC_MAX:
                raise _OwnMessage(
                    f"random_quadratic draws a d x d matrix over an example's d outputs; the "
                    f"output {tuple(out.shape)} has d = {d} per example (at most {_QUADRATIC_MAX}: "
                    f"{d * d * 8 / 2**30:.3g} GiB in float64 here). Pass a loss on the outputs "
                    "instead: a criterion with targets in the batch, the model's own loss, or a "
                    "loss_fn(model, batch)"
                )
            r = torch.randn(d, d, generator=gen, dtype=torch.float64, device="cpu") / d
            cache[key] = r.to(flat.device, flat.dtype)
        return ((flat @ cache[key]) * flat).sum(1).mean()

    return loss


default_loss = NamedLoss(
    "auto", lambda out, batch: _auto(out, _target(batch, "default"), batch), reduction="mean"
)
"""Cross-entropy for integer targets, mean squared error for float targets, on ``(x, y, ...)``
batches (or dict batches with ``labels``): logits ``(B, C)`` with targets ``(B,)``, ``(B, T, C)``
with ``(B, T)``, or dense ``(B, C, *S)`` with ``(B, *S)``. A batch without targets raises
``ValueError``."""


def make_loss(name: str = "auto", *, seed: int = 0) -> Loss:
    """A loss by name (see :data:`LOSSES`).

    * ``"auto"``: :data:`default_loss` (cross-entropy or MSE from the targets' dtype);
    * ``"cross_entropy"``/``"mse"``: on ``(x, y)`` batches, mean-reduced;
    * ``"random_quadratic"``: Defazio & Bottou's random loss ``y^T R y / d`` per example (``y`` the
      flattened output, ``R`` i.i.d. normal, fixed by ``seed``), averaged over the batch; needs no
      targets (their Figure 2 setup);
    * ``"model"``: the loss the model returns (``model(**batch).loss``).
    """
    if name == "auto":
        return default_loss
    if name == "random_quadratic":
        return NamedLoss(name, _random_quadratic(seed), reduction="mean")
    if name == "cross_entropy":
        return NamedLoss(
            name,
            lambda o, b: _cross_entropy_out(o, _target(b, "cross-entropy"), b),
            reduction="mean",
        )
    if name == "mse":
        return NamedLoss(name, lambda o, b: _mse_out(o, _target(b, "mse")), reduction="mean")
    if name == "model":
        return _ModelOutputLoss("model")
    raise ValueError(f"unknown loss {name!r}; valid: {', '.join(LOSSES)} or 'pkg.module:fn'")


def criterion(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    name: str = "",
    *,
    reduction: str | None = None,
) -> Loss:
    """Read ``fn(output, target)`` as a criterion: ``fn(model(x), y)`` on ``(x, y)`` batches, with
    the target from ``labels`` on dict batches and the output's ``.logits`` for Hugging Face
    outputs.

    ``reduction``: how ``fn`` reduces over the batch, ``"mean"`` or ``"sum"``, for a callable that
    cannot say (a lambda summing with ``reduction="sum"`` inside); default: what ``fn`` declares
    (``nn.CrossEntropyLoss(reduction="sum")``, a ``functools.partial`` with ``reduction=``), else
    unknown (read as a mean).

    Example:
        >>> loss = criterion(lambda out, y: (out - y).abs().mean())
        >>> float(loss(nn.Identity(), (torch.ones(2), torch.zeros(2))))
        1.0
    """
    label = name or _callable_name(fn)
    tensor = takes_class_indices(fn) or is_one_of(fn, ELEMENTWISE_CRITERIA) or _of_torch(fn)
    target = functools.partial(_target, what=None, name=label, tensor=tensor)
    if takes_class_indices(fn):
        outputs_loss = lambda out, b: fn(*_classes_last(out, target(b), b))  # noqa: E731
    elif is_one_of(fn, ELEMENTWISE_CRITERIA):  # paired as "mse" pairs them, never broadcast
        outputs_loss = lambda out, b: fn(out, _paired(out, target(b), repr(label)))  # noqa: E731
    else:
        outputs_loss = lambda out, batch: fn(out, target(batch))  # noqa: E731
    declared = declared_reduction(fn)
    if reduction not in (None, "mean", "sum"):
        raise ValueError(f"criterion: reduction must be 'mean', 'sum' or None, got {reduction!r}")
    if reduction is not None and declared not in (None, reduction):
        raise ValueError(
            f"criterion: reduction={reduction!r}, but {label!r} declares reduction={declared!r}"
        )
    loss = NamedLoss(label, outputs_loss, form="criterion", reduction=reduction or declared)
    loss.criterion_fn = fn
    return loss


def _of_torch(fn: Any) -> bool:
    """Whether ``fn`` is one of torch's criteria (a module or function of ``torch``, or a partial
    of one: they take a tensor target), not one's own (which may take a list of targets)."""
    inner = fn.func if isinstance(fn, functools.partial) else fn
    where = type(inner) if isinstance(inner, nn.Module) else inner
    return (getattr(where, "__module__", None) or "").startswith("torch.")


def _class_criterion(loss: Loss) -> Any:
    """The torch cross-entropy/NLL function or module ``loss`` applies, or ``None``: a
    criterion's own; ``F.cross_entropy`` for initlab's ``"cross_entropy"`` and ``"auto"``, and
    for the model's own loss (``None`` on a dict batch, ``"model"``), read by the Hugging Face
    convention (a mean over the labels that are not -100; the callers check the labels)."""
    fn = getattr(loss, "criterion_fn", None)
    if fn is None and (loss.name in ("auto", "cross_entropy") or loss.form == "model_output"):
        fn = F.cross_entropy
    return fn if fn is not None and takes_class_indices(fn) else None


def _classes_last(
    out: torch.Tensor, y: torch.Tensor, batch: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token logits ``(B, T, C)`` with targets ``(B, T)`` (a language model's layout) as
    ``(B*T, C)`` and ``(B*T,)``, the layout torch's cross-entropy takes (it wants the classes on
    dim 1); the same loss, ``ignore_index``, weights and reduction included. Any other pair is
    passed as it is; ``T == C`` as :func:`classes_dim` reads it."""
    if (
        out.dim() >= 3
        and not y.is_floating_point()
        and tuple(y.shape) == tuple(out.shape[:-1])
        and classes_dim(out, y, batch) == -1
    ):
        return out.reshape(-1, out.shape[-1]), y.reshape(-1)
    return out, y


def outputs_loss(fn: Callable[[torch.Tensor, Any], torch.Tensor], name: str = "") -> Loss:
    """Read ``fn(outputs, batch)`` as a loss on the model's outputs (receiving the whole batch):
    for losses that need no target, or several entries of the batch."""
    return NamedLoss(name or _callable_name(fn), fn, form="outputs")


def _callable_name(fn: Any) -> str:
    if isinstance(fn, functools.partial):
        return _callable_name(fn.func)
    if isinstance(fn, nn.Module):
        return type(fn).__name__
    return getattr(fn, "__name__", type(fn).__name__)


def _positional_names(fn: Any) -> list[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name.lower() for p in params if p.kind in kinds]


def _is_outputs_batch(fn: Any) -> bool:
    """The loss form curvature and landscapes took before 0.2: ``fn(outputs, batch)``."""
    if isinstance(fn, (nn.Module, functools.partial)):
        return False
    names = _positional_names(fn)
    return len(names) == 2 and names[0] in _OUTPUT_NAMES and names[1] in ("batch", "b")


def _is_criterion(fn: Any) -> bool:
    """A standard criterion: an ``nn.Module``, a torch function, or first parameter an output."""
    if isinstance(fn, nn.Module):
        return True
    inner = fn.func if isinstance(fn, functools.partial) else fn
    if (getattr(inner, "__module__", "") or "").startswith("torch."):
        return True
    names = _positional_names(fn)
    return bool(names) and names[0] in _OUTPUT_NAMES


def resolve_loss(loss_fn: LossLike, *, what: str = "this method") -> Loss:
    """The :class:`Loss` for any accepted form (see the module docstring).

    Raises:
        TypeError: ``loss_fn`` is none of the accepted forms; the message lists them.
        ValueError: an unknown loss name.
    """
    if isinstance(loss_fn, Loss):
        return loss_fn
    if loss_fn is None:
        return _AutoLoss("auto")
    if isinstance(loss_fn, str):
        if loss_fn not in LOSSES:
            raise ValueError(f"{what}: unknown loss {loss_fn!r}; accepted forms: {LOSS_FORMS}")
        return make_loss(loss_fn)
    if not callable(loss_fn):
        raise TypeError(
            f"{what}: loss_fn is a {type(loss_fn).__name__}; accepted forms: {LOSS_FORMS}"
        )
    if isinstance(loss_fn, type) and issubclass(loss_fn, nn.Module):
        raise TypeError(
            f"{what}: loss_fn is the class {loss_fn.__name__}, not a criterion: pass an instance, "
            f"{loss_fn.__name__}()"
        )
    if _is_outputs_batch(loss_fn):
        warnings.warn(
            f"{what}: a loss_fn(outputs, batch) is read as initlab.outputs_loss(fn); that reading "
            "of a bare callable is deprecated: pass initlab.outputs_loss(fn), a "
            "criterion(output, target) or loss_fn(model, batch)",
            DeprecationWarning,
            stacklevel=user_stacklevel(),
        )
        return outputs_loss(loss_fn)
    if _is_criterion(loss_fn):
        return criterion(loss_fn)  # type: ignore[arg-type]
    return Loss(_callable_name(loss_fn), loss_fn)
