"""Which dtype a forward's data should have: torch's dtype errors made clear, never a conversion.

initlab converts no data: where a model's forward fails on torch's dtype mismatch because a
floating-point tensor of the batch is not of the model's floating-point dtype (float64 data from
numpy into a float32 model), or an integer or bool input (uint8 images, int64 features) reached a
floating-point layer, :func:`dtype_error` names that tensor, both dtypes, and how to convert the
data (or the model). Which tensor is blamed: :mod:`initlab._core.dtype_blame`.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from initlab._core.data import batch_tensors, forward_args
from initlab._core.devices import DataDeviceError, device_error
from initlab._core.dtype_blame import TYPE_NAMES, could_be_ids, failed_on
from initlab._core.pytree import flatten_tensors

__all__ = ["data_error", "dtype_error"]


#: torch's dtype errors that name both dtypes (any order), and those that name at most one (a
#: norm's "mixed dtype", a kernel's "not implemented for 'Long'"), for :func:`dtype_error`.
_DTYPE_WORDS = re.compile(
    r"same dtype|expected scalar type|Input type .* should be the same|Type promoting not supported"
)
_ONE_DTYPE_WORDS = re.compile(r"mixed dtype|not implemented for '\w+'")


def data_error(err: RuntimeError, model: Any, batch: Any) -> TypeError | DataDeviceError | None:
    """A clear error for a forward's ``RuntimeError`` caused by the data's dtype
    (:func:`dtype_error`) or device (:func:`~initlab._core.devices.device_error`), ``None``
    otherwise: what the default forward, the loss's call of the model and the functional call
    raise in place of torch's message."""
    return dtype_error(err, model, batch) or device_error(err, model, batch)


def dtype_error(err: RuntimeError, model: Any, batch: Any) -> TypeError | None:
    """A clear error for torch's dtype mismatch in a forward ("mat1 and mat2 must have the same
    dtype") where a floating-point tensor of the batch is not of the model's floating-point
    dtype (float64 data from numpy into a float32 model), or where an integer or bool input of
    the model (uint8 images, int64 features) reached a floating-point layer, a linear, conv or
    norm layer's error alike (:func:`_integer_input`), or a floating-point input of another
    dtype reached a norm layer (its "mixed dtype" names neither: :func:`_float_input`);
    ``None`` for any other error. The data is never converted
    behind the user's back: the message says how to. ``model``: a module, or a stand-in with its
    ``parameters()`` (GradInit's model at other tensors)."""
    named = _DTYPE_WORDS.search(str(err)) is not None
    if type(err) not in (RuntimeError, NotImplementedError) or not (
        named or _ONE_DTYPE_WORDS.search(str(err))
    ):
        return None
    params = model.parameters() if callable(getattr(model, "parameters", None)) else ()
    dtype = next((p.dtype for p in params if p.is_floating_point()), None)
    if dtype is None:
        return None
    short = _SHORT.get(dtype)
    as_method = f", x.{short}()" if short else ""
    integer = _integer_input(err, dtype, batch, model)  # named by the error: first
    if integer is not None:
        path, t = integer
        return TypeError(
            f"{_where(batch, path)} (shape {tuple(t.shape)}) is {t.dtype} and the model's "
            f"parameters are {dtype} ({err}): {'bool' if t.dtype == torch.bool else 'integer'} "
            "data reached a layer that computes in floating point. initlab does not convert data: "
            f"convert it (x.to({dtype}){as_method}, in the dataset or a collate_fn)"
            f"{_BYTES if t.dtype == torch.uint8 else ''}. Integer and bool inputs are right only "
            "for layers that take them (indices for nn.Embedding, masks): if this tensor is one, "
            "the mismatch is inside the model"
        )
    found = _float_input(err, dtype, batch, named)
    if found is None:
        return None
    path, t = found
    return TypeError(
        f"{_where(batch, path)} (shape {tuple(t.shape)}) is {t.dtype} and the model's parameters "
        f"are {dtype} ({err}). initlab does not convert data: convert it (x.to({dtype}){as_method}"
        f", in the dataset or a collate_fn), or the model (model.to({t.dtype}))"
    )


_BYTES = ", scaled as the model expects (image bytes: / 255)"


def _where(batch: Any, path: str) -> str:
    return "the batch" if isinstance(batch, torch.Tensor) else f"the batch's entry {path!r}"


#: The tensor method that converts to a dtype (``x.float()``), for :func:`dtype_error`.
_SHORT = {torch.float32: "float", torch.float64: "double", torch.float16: "half",
          torch.bfloat16: "bfloat16"}  # fmt: skip


def _float_input(
    err: BaseException, dtype: torch.dtype, batch: Any, named: bool
) -> tuple[str, torch.Tensor] | None:
    """The first floating-point tensor of the batch not of the model's ``dtype``, with its path,
    when torch's error ``err`` names both dtypes (``named``: "mat1 and mat2 must have the same
    dtype, but got Double and Float"); for a norm's error that names neither ("mixed dtype
    (CPU): all inputs must share same datatype"), the first such tensor the default forward
    passes to the model that the failing norm took while every other floating-point tensor it
    took (its weight, bias, running statistics) is of ``dtype``
    (:func:`~initlab._core.dtype_blame.failed_on`: not one the model made, nor a norm of
    another dtype than the model's; a kernel's "not implemented for 'Half'" must name the
    tensor's dtype). ``None`` if there is none."""
    found = [(k, t) for k, t in batch_tensors(batch) if t.is_floating_point() and t.dtype != dtype]
    if named:
        return found[0] if found else None
    inputs = {id(t) for _, t in flatten_tensors(forward_args(batch))}
    one = re.search(r"not implemented for '(\w+)'", str(err))
    for path, t in found:
        if one is not None and not re.fullmatch(TYPE_NAMES.get(t.dtype, "$^"), one[1]):
            continue
        if id(t) in inputs and failed_on(err, t, rest=dtype):
            return path, t
    return None


def _integer_input(
    err: BaseException, dtype: torch.dtype, batch: Any, model: Any
) -> tuple[str, torch.Tensor] | None:
    """The first integer or bool tensor the default forward passes to the model
    (:func:`~initlab._core.data.forward_args`: a tuple batch's targets are not inputs) that torch's
    error ``err`` blames, with its path in the batch; ``None`` if there is none. Blamed: a tensor
    the failing torch function took as an argument (:func:`~initlab._core.dtype_blame.failed_on`:
    not one the model made, such as its own integer positions) whose dtype the error names together
    with the model's ``dtype``, in either order ("mat1 and mat2 must have the same dtype, but got
    Byte and Float", a bias-free conv's "expected scalar type Byte but found Float"), or that names
    at most the tensor's dtype (LayerNorm's "mixed dtype", BatchNorm's '"batch_norm" not implemented
    for 'Long''). Token ids are integer inputs too: the error must have come from the model first,
    and reach them; ids the model's embeddings can take are not blamed
    (:func:`~initlab._core.dtype_blame.could_be_ids`: the model fed them on itself)."""
    text = str(err)
    inputs = {id(t) for _, t in flatten_tensors(forward_args(batch))}
    model_names = TYPE_NAMES.get(dtype)
    expected = re.search(r"expected scalar type (\w+) but found (\w+)", text)
    one = re.search(r"not implemented for '(\w+)'", text)
    for path, t in batch_tensors(batch):
        names = TYPE_NAMES.get(t.dtype)
        if id(t) not in inputs or names is None or t.is_floating_point() or model_names is None:
            continue
        if not failed_on(err, t) or could_be_ids(model, t):
            continue
        if expected is not None:
            pair = (expected[1], expected[2])
            if any(re.fullmatch(names, a) and re.fullmatch(model_names, b) for a, b in
                   (pair, pair[::-1])):  # fmt: skip
                return path, t
        elif _ONE_DTYPE_WORDS.search(text):
            if one is None or re.fullmatch(names, one[1]):
                return path, t
        elif re.search(names, text) and re.search(model_names, text):
            return path, t
    return None
