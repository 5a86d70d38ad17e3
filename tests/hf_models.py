"""Tiny Hugging Face models built from configs (no download) and their dict batches, shared by
``tests/test_transformers.py``, ``tests/test_devices.py`` and ``tests/test_contract_edges.py``.
``transformers`` is imported by the callers' ``pytest.importorskip`` first; here it is looked up
when a model is built."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

try:
    import transformers
except ImportError:  # the callers skip
    transformers = None

V, T, B = 64, 8, 4


def gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=V, n_positions=16, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def bert() -> nn.Module:
    cfg = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        vocab_size=V, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        max_position_embeddings=16,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(cfg)


def llama() -> nn.Module:
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=V, max_position_embeddings=32,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def t5() -> nn.Module:
    cfg = transformers.T5Config(
        vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, dropout_rate=0.0, feed_forward_proj="gated-gelu", decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(cfg)


def gemma() -> nn.Module:
    """Gemma: its RMSNorm scales by ``1 + weight`` (weights start at 0)."""
    cfg = transformers.GemmaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=V, max_position_embeddings=32,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.GemmaForCausalLM(cfg)


def detr() -> nn.Module:
    """DETR with a small ResNet backbone (no timm): a class head of 5 labels + "no object", then
    a box MLP that runs after it."""
    backbone = transformers.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic",
        out_features=["stage2"],
    )  # fmt: skip
    return transformers.DetrForObjectDetection(transformers.DetrConfig(
        use_timm_backbone=False, backbone_config=backbone, use_pretrained_backbone=False,
        d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=5,
        num_labels=5,
    ))  # fmt: skip


def detection_batches(n: int = 2) -> list[dict[str, Any]]:
    """Images with a list of per-image targets (class labels, boxes), as DETR takes them."""
    g = torch.Generator().manual_seed(1)
    return [
        {"pixel_values": torch.randn(2, 3, 64, 64, generator=g),
         "labels": [{"class_labels": torch.randint(0, 5, (2,), generator=g),
                     "boxes": torch.rand(2, 4, generator=g) * 0.4 + 0.3} for _ in range(2)]}
        for _ in range(n)
    ]  # fmt: skip


FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "gpt2": gpt2,
    "bert": bert,
    "llama": llama,
    "t5": t5,
}


def model_of(family: str) -> nn.Module:
    torch.manual_seed(0)
    return FAMILIES[family]()


def batches(family: str, n: int = 3) -> list[dict[str, torch.Tensor]]:
    """Dict batches as a collator gives them: ids, an attention mask (BERT: padded), labels."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(1, V, (B, T), generator=g)
        mask = torch.ones(B, T, dtype=torch.long)
        if family == "bert":
            mask[0, T // 2 :] = 0  # one padded sequence
            labels = torch.randint(0, 3, (B,), generator=g)
        else:
            labels = ids
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out
