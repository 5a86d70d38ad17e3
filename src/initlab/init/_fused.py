"""Fused projections: one weight that holds several matrices, drawn one matrix at a time.

A layer that computes several projections with one matrix multiply stores them stacked along
its outputs. :func:`~initlab.init.model.init_model` draws each as its own matrix (its own fans;
an orthogonal draw orthogonal per matrix), as ``nn.MultiheadAttention``'s ``in_proj_weight``.
Drawn as one matrix, a ``(3n, n)`` q/k/v weight gets fans ``(n, 3n)`` (a geometric std 0.134
for the 0.177 of each ``32 x 32`` projection) and an orthogonal q block with singular values
from 0.93 down to 0.02.

The layouts, read from the layer's name and the ``config`` of the module holding it (a Hugging
Face attention or MLP module); a weight whose shape does not match its layout is left as it is:

* GPT-2's ``c_attn`` (a ``Conv1D`` storing ``(n, 3n)``: q, k, v; ``(n, 2n)`` in cross-attention:
  k, v);
* q, k and v one after the other (``qkv_proj``: Phi-3, Phi-4-multimodal; ``Wqkv``: ModernBERT,
  MPT, DBRX; ``c_attn`` as an ``nn.Linear``: GPTBigCode with one key/value head): the query's
  ``heads * head_dim`` rows, then the key's and the value's ``kv_heads * head_dim`` each;
  without a config (nanoGPT's ``c_attn``, timm's ``qkv``), three equal thirds;
* groups of heads: GPT-NeoX's, Bloom's, Persimmon's and GPTBigCode's (with as many key/value
  heads as query heads) store ``(q, k, v)`` head by head; Falcon's ``query_key_value`` too, or
  one ``(q..., k, v)`` group per key/value head (``new_decoder_architecture``), or all query
  heads then one key and one value head (``multi_query``);
* a gate and its input one after the other (``gate_up_proj``: Phi-3; ``Wi``: ModernBERT), each
  ``intermediate_size`` rows, the input :attr:`~initlab.init.specs.Block.gated` (gain 1 where
  the gate gets its activation's); Mamba's ``in_proj``: its input and its gate, both activated;
* Mamba 2's ``in_proj``: its gate ``z``, input ``x``, ``B``, ``C`` (``n_groups * state_size``
  each) and ``dt`` (one row per head);
* CodeGen's ``qkv_proj``: four groups of (query, value, key), each ``n / 4`` rows;
* DeepSeek's ``kv_a_proj_with_mqa``: the compressed key/value (``kv_lora_rank`` rows), then the
  key's rotary part (``qk_rope_head_dim``).

Each block keeps the fans of the projection it is part of: ``(hidden, heads * head_dim)`` for a
query head, ``(hidden, kv_heads * head_dim)`` for a key or value head.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor, nn

from initlab.init.fans import Fans
from initlab.init.registry import Block, ParamSpec

__all__ = ["fused_blocks"]

_CONCATENATED_QKV = frozenset({"c_attn", "qkv_proj", "Wqkv", "qkv"})
_CONCATENATED_TYPES = frozenset(
    {"phi3", "phi4_multimodal", "modernbert", "gpt_bigcode", "mpt", "dbrx"}
)
"""Hugging Face model types whose ``_CONCATENATED_QKV`` weight is ``[q; k; v]`` (GPTBigCode: with
one key/value head; with as many as query heads it stores them head by head)."""
_HEAD_BY_HEAD_TYPES = frozenset({"gpt_neox", "bloom", "persimmon"})
"""Model types whose ``query_key_value`` holds ``(q, k, v)`` head by head."""
_GATE_UP = frozenset({"gate_up_proj", "Wi"})
_MAMBA_TYPES = frozenset({"mamba", "falcon_mamba"})  # ``in_proj``: [x; z], intermediate_size each
_FUSED_NAMES = _CONCATENATED_QKV | _GATE_UP | {"query_key_value", "kv_a_proj_with_mqa", "in_proj"}


def fused_blocks(model: nn.Module, name: str, spec: ParamSpec, param: Tensor) -> ParamSpec:
    """``spec`` with one block per matrix for a fused projection (see the module docstring) of
    the module ``name`` of ``model``; any other spec as it is."""
    if spec.role != "weight" or spec.blocks or param.dim() != 2:
        return spec
    leaf = name.rsplit(".", 1)[-1]
    if leaf not in _FUSED_NAMES:
        return spec
    if leaf == "c_attn" and spec.transposed:
        blocks = _gpt2_c_attn(*(int(d) for d in param.shape))
    elif spec.transposed:
        return spec
    else:
        out, n = (int(d) for d in param.shape)
        blocks = _linear_blocks(leaf, out, n, _config(model, name))
    return spec if blocks is None else dataclasses.replace(spec, fans=None, blocks=blocks)


def _config(model: nn.Module, name: str) -> Any:
    """The ``config`` of the nearest module above ``name`` that has one (Bloom's attention
    keeps none; the model's own does), ``None`` when none has."""
    parts = name.split(".")[:-1]
    for depth in range(len(parts), -1, -1):
        config = getattr(model.get_submodule(".".join(parts[:depth])), "config", None)
        if config is not None:
            return config
    return None


def _gpt2_c_attn(n: int, out: int) -> tuple[Block, ...] | None:
    if out not in (2 * n, 3 * n):
        return None
    fans = Fans(fan_in=n, fan_out=n)
    return tuple(Block(i * n, (i + 1) * n, fans) for i in range(out // n))


def _linear_blocks(leaf: str, out: int, n: int, config: Any) -> tuple[Block, ...] | None:
    """The blocks of an ``nn.Linear``-layout weight ``(out, n)`` named ``leaf``."""
    model_type = _attr(config, "model_type", None)
    if leaf in _GATE_UP or (leaf == "in_proj" and model_type in _MAMBA_TYPES):
        width = _attr(config, "intermediate_size", None)
        blocks = _rows(out, n, (width, width))
        if blocks is None or leaf == "in_proj":  # Mamba: both halves go through its SiLU
            return blocks
        return (blocks[0], dataclasses.replace(blocks[1], gated=True))  # [gate; input]
    if leaf == "in_proj" and model_type == "mamba2":  # [z; x; B; C; dt], split so in its forward
        inner = _attr(config, "expand", 0) * _attr(config, "hidden_size", 0)
        bc = _attr(config, "n_groups", 0) * _attr(config, "state_size", 0)
        heads = _attr(config, "num_heads")
        return _rows(out, n, (int(inner), int(inner), bc, bc, heads)) if inner else None
    if leaf == "in_proj":
        return None
    if leaf == "kv_a_proj_with_mqa":  # DeepSeek's latent: [compressed kv; the key's rotary part]
        return _rows(out, n, (_attr(config, "kv_lora_rank"), _attr(config, "qk_rope_head_dim")))
    if leaf == "qkv_proj" and model_type == "codegen" and out == 3 * n and n % 4 == 0:
        local = n // 4  # 4 groups of (query, value, key), n / 4 rows each; fans of (n, n)
        return tuple(Block(i * local, (i + 1) * local, Fans(n, n)) for i in range(12))
    heads = _heads(config, n)
    if heads is None:  # no config: three equal projections (nanoGPT, timm), or nothing known
        if leaf in _CONCATENATED_QKV and out == 3 * n:
            return tuple(Block(i * n, (i + 1) * n, Fans(fan_in=n, fan_out=n)) for i in range(3))
        return None
    h, kv, _ = heads
    if leaf == "query_key_value":
        return _query_key_value(out, n, heads, config)
    if leaf == "c_attn" and model_type == "gpt_bigcode" and kv == h:  # head by head
        return _grouped(out, n, heads, groups=h, per_group=(1, 1, 1))
    if leaf in _CONCATENATED_QKV and model_type in _CONCATENATED_TYPES:
        return _grouped(out, n, heads, groups=1, per_group=(h, kv, kv))
    return None


def _rows(out: int, n: int, widths: tuple[Any, ...]) -> tuple[Block, ...] | None:
    """Consecutive blocks of ``widths`` rows, each its own matrix ``(width, n)``; ``None`` where
    a width is unknown or they do not add up to ``out``."""
    if not all(isinstance(w, int) and w > 0 for w in widths) or sum(widths) != out:
        return None
    starts = [sum(widths[:i]) for i in range(len(widths))]
    return tuple(
        Block(s, s + w, Fans(fan_in=n, fan_out=w)) for s, w in zip(starts, widths, strict=True)
    )


def _attr(config: Any, name: str, default: Any = None) -> Any:
    """``getattr(config, name, default)``, also where reading it raises: a Hugging Face config
    whose attributes vary per layer (Gemma 4's ``head_dim``) refuses a global read."""
    try:
        return getattr(config, name, default)
    except Exception:
        return default


def _heads(config: Any, n: int) -> tuple[int, int, int] | None:
    """``(heads, kv_heads, head_dim)`` from a Hugging Face config, ``None`` without one."""
    heads = _attr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or heads < 1:
        return None
    kv = _attr(config, "num_key_value_heads", None) or _attr(config, "num_kv_heads", None)
    if _attr(config, "multi_query", False) and not _attr(config, "new_decoder_architecture"):
        kv = 1  # GPTBigCode, Falcon: one key/value head (Falcon's new layout has num_kv_heads)
    kv = kv if isinstance(kv, int) and kv >= 1 else heads
    head_dim = _attr(config, "head_dim", None)
    if not isinstance(head_dim, int) or head_dim < 1:
        hidden = _attr(config, "hidden_size", n)
        head_dim = hidden // heads if isinstance(hidden, int) and hidden % heads == 0 else None
    return None if head_dim is None else (heads, kv, head_dim)


def _query_key_value(
    out: int, n: int, heads: tuple[int, int, int], config: Any
) -> tuple[Block, ...] | None:
    h, kv, _ = heads
    if _attr(config, "model_type", None) == "falcon":
        if _attr(config, "new_decoder_architecture", False):
            return _grouped(out, n, heads, groups=kv, per_group=(h // kv, 1, 1))
        if _attr(config, "multi_query", False):
            return _grouped(out, n, heads, groups=1, per_group=(h, 1, 1))
    elif _attr(config, "model_type", None) not in _HEAD_BY_HEAD_TYPES:
        return None  # a layout not known here
    return _grouped(out, n, (h, h, heads[2]), groups=h, per_group=(1, 1, 1))


def _grouped(
    out: int,
    n: int,
    heads: tuple[int, int, int],
    *,
    groups: int,
    per_group: tuple[int, int, int],
) -> tuple[Block, ...] | None:
    """``groups`` groups of rows, each ``per_group`` = (query, key, value) heads of
    ``head_dim`` rows one after the other; ``None`` where that is not ``out`` rows."""
    h, kv, head_dim = heads
    if groups * sum(per_group) * head_dim != out:
        return None
    fans = (Fans(fan_in=n, fan_out=h * head_dim), *[Fans(fan_in=n, fan_out=kv * head_dim)] * 2)
    blocks, row = [], 0
    for _ in range(groups):
        for count, block_fans in zip(per_group, fans, strict=True):
            blocks.append(Block(row, row + count * head_dim, block_fans))
            row += count * head_dim
    return tuple(blocks)
