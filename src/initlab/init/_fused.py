"""Fused projections: one weight that holds several matrices, drawn one matrix at a time.

A layer that computes several projections with one matrix multiply stores them stacked along
its outputs. :func:`~initlab.init.model.init_model` draws each as its own matrix (its own fans;
an orthogonal draw orthogonal per matrix), as ``nn.MultiheadAttention``'s ``in_proj_weight``.
"""

from __future__ import annotations

import dataclasses

from torch import Tensor

from initlab.init.fans import Fans
from initlab.init.registry import Block, ParamSpec

__all__ = ["fused_attention_blocks"]


def fused_attention_blocks(name: str, spec: ParamSpec, param: Tensor) -> ParamSpec:
    """``spec`` with one block per projection for GPT-2's fused attention ``c_attn`` (a
    ``Conv1D`` storing ``(n, 3n)``: q, k, v; ``(n, 2n)`` in cross-attention: k, v), so that
    init_model draws each as its own ``n x n`` matrix (fans, orthogonality), as
    ``nn.MultiheadAttention``'s ``in_proj_weight``; any other spec as it is."""
    if name.rsplit(".", 1)[-1] != "c_attn" or not spec.transposed or spec.blocks:
        return spec
    if spec.role != "weight" or param.dim() != 2:
        return spec
    n, out = (int(d) for d in param.shape)
    if out not in (2 * n, 3 * n):
        return spec
    fans = Fans(fan_in=n, fan_out=n)
    blocks = tuple(Block(i * n, (i + 1) * n, fans) for i in range(out // n))
    return dataclasses.replace(spec, fans=None, blocks=blocks)
