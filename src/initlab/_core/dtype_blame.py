"""Which batch tensor a torch dtype error inside a model's forward may be blamed on, for
:func:`initlab._core.dtypes.dtype_error`: only a tensor the failing torch function took (not one
the model made), and not integer ids the model's own embeddings can take."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["TYPE_NAMES", "could_be_ids", "failed_on"]

#: How torch's dtype errors name a dtype: its ScalarType ("Long", "LongTensor") or C++ type
#: ("long int"), for :func:`initlab._core.dtypes.dtype_error`.
TYPE_NAMES = {
    torch.uint8: r"\bByte(?:Tensor)?\b|unsigned char",
    torch.int8: r"\bChar(?:Tensor)?\b|(?<!un)signed char",
    torch.int16: r"\bShort(?:Tensor)?\b|short int",
    torch.int32: r"\bInt(?:Tensor)?\b|(?<!short )(?<!long )\bint\b",
    torch.int64: r"\bLong(?:Tensor)?\b|long int",
    torch.bool: r"\bBool(?:Tensor)?\b|\bbool\b",
    torch.float32: r"\bFloat(?:Tensor)?\b|\bfloat\b",
    torch.float64: r"\bDouble(?:Tensor)?\b|\bdouble\b",
    torch.float16: r"\bHalf(?:Tensor)?\b|\bhalf\b",
    torch.bfloat16: r"\bBFloat16(?:Tensor)?\b",
}


def could_be_ids(model: Any, t: torch.Tensor) -> bool:
    """Whether ``t`` could be indices of one of ``model``'s embeddings (``nn.Embedding``,
    ``nn.EmbeddingBag``): int32 or int64 with every value in ``[0, num_embeddings)``. Such a
    tensor reaching a floating-point layer is the model's doing (``self.linear(ids)``), not data
    to convert: converting it would break the embedding."""
    modules = model.modules() if callable(getattr(model, "modules", None)) else ()
    sizes = [m.num_embeddings for m in modules if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    if t.dtype not in (torch.int32, torch.int64) or not sizes:
        return False
    return t.numel() == 0 or (int(t.min()) >= 0 and int(t.max()) < max(sizes))


def failed_on(err: BaseException, t: torch.Tensor, rest: torch.dtype | None = None) -> bool:
    """Whether the innermost Python frame of ``err``'s traceback is torch's own (``F.layer_norm``,
    a linear's ``forward``, a conv's ``_conv_forward``) or a ``__torch_function__`` /
    ``__torch_dispatch__`` handler (a mode that intercepts the op, as metainit_'s does) and took
    as an argument (the handler: as one of the op's ``args``/``kwargs``) a tensor of ``t``'s
    dtype that is ``t``, a view of it, or a copy (equal shape and values): the op that failed was
    called on ``t``, not on a tensor the model made (a model calling the op from its own forward,
    or feeding it its own integer positions, is not blamed). With ``rest``: also every other
    floating-point tensor the op took (a norm's weight, bias, running statistics) is of dtype
    ``rest``, so that ``t``'s dtype is the only one out of step (a norm's "mixed dtype" names
    neither)."""
    args = _failing_args(err)
    if args is None:
        return False
    base = t if t._base is None else t._base
    took = [
        isinstance(a, torch.Tensor) and a.dtype == t.dtype and a.device == t.device
        and (a is base or a._base is base or (a.shape == t.shape and torch.equal(a, t)))
        for a in args
    ]  # fmt: skip
    others = [
        a for a, is_t in zip(args, took, strict=True) if not is_t and isinstance(a, torch.Tensor)
    ]
    return any(took) and (
        rest is None or all(a.dtype == rest for a in others if a.is_floating_point())
    )


def _failing_args(err: BaseException) -> list[Any] | None:
    """The arguments of the innermost Python frame of ``err``'s traceback when it is torch's own
    function or a ``__torch_function__`` / ``__torch_dispatch__`` handler (the op's ``args`` and
    ``kwargs``), else ``None``: see :func:`failed_on`."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return None
    code, values = tb.tb_frame.f_code, tb.tb_frame.f_locals
    if code.co_name in ("__torch_function__", "__torch_dispatch__"):
        kwargs = values.get("kwargs")
        return [*(values.get("args") or ()), *(kwargs.values() if isinstance(kwargs, dict) else ())]
    if str(tb.tb_frame.f_globals.get("__name__", "")).startswith("torch."):
        return [
            values.get(n) for n in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        ]
    return None
