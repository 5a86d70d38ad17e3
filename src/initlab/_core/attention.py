"""Attention that can be differentiated twice, selected inside the methods that need it.

PyTorch's fused attention kernels (flash and memory-efficient, on CPU and CUDA) have no double
backward: a method that differentiates a gradient (GradInit's look-ahead, MetaInit's gradient
quotient, Hessian-vector products) or evaluates a model functionally under ``vmap`` stops with
"derivative for aten::_scaled_dot_product_flash_attention_for_cpu_backward is not implemented".
The math backend of ``F.scaled_dot_product_attention`` computes the same function with ordinary
differentiable operations. :func:`math_attention` selects it for the duration of a call and turns
off the fused fast path of ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` (which
bypasses autograd); both of the user's settings come back on exit, also after an exception.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["math_attention", "with_math_attention"]

F = TypeVar("F", bound=Callable[..., Any])


@contextmanager
def math_attention() -> Iterator[None]:
    """Inside the block: SDPA's math backend, the module fast path off; the user's choice after."""
    mha = getattr(torch.backends, "mha", None)
    fastpath = mha.get_fastpath_enabled() if mha is not None else None
    try:
        if mha is not None:
            mha.set_fastpath_enabled(False)
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        if mha is not None and fastpath is not None:
            mha.set_fastpath_enabled(fastpath)


def with_math_attention(fn: F) -> F:
    """Run ``fn`` inside :func:`math_attention` (for methods that differentiate twice)."""

    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        with math_attention():
            return fn(*args, **kwargs)

    return inner  # type: ignore[return-value]
