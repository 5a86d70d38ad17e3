"""Tiny seeded models, data and losses for the conformance suite (tests/test_conformance.py),
shared with other tests.

Every builder returns a fresh object on each call, identical for the same arguments: models are
built under a forked global RNG seeded per model, data comes from a fixed ``torch.Generator``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "BATCH",
    "MODELS",
    "N_BATCHES",
    "KeywordNet",
    "TiedKeywordModel",
    "TiedOutput",
    "make_data",
    "make_model",
]

BATCH = 8
"""Examples per batch."""

N_BATCHES = 2
"""Batches in the full data set (16 examples)."""

VOCAB, WIDTH, TOKENS = 10, 8, 5


@dataclass
class TiedOutput:
    """What :class:`TiedKeywordModel` returns: a custom object with ``.logits`` and ``.loss``."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


class TiedKeywordModel(nn.Module):
    """An embedding, a tanh layer and a head whose weight IS the embedding's (tied).

    ``forward(input_ids, labels=None)`` mean-pools the ``(B, T)`` tokens and returns
    :class:`TiedOutput` with ``logits`` ``(B, 10)`` and ``loss`` (cross-entropy when ``labels``
    are given, else ``None``), like a Hugging Face model.
    """

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.hidden = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> TiedOutput:
        h = torch.tanh(self.hidden(self.emb(input_ids))).mean(dim=1)
        logits = self.head(h)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return TiedOutput(logits, loss)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(inplace=True),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )


MODELS: dict[str, tuple[Callable[[], nn.Module], int]] = {
    "mlp": (_mlp, 0),
    "cnn": (_cnn, 1),
    "tied_kw": (TiedKeywordModel, 2),
}
"""name -> (builder, seed)."""


def make_model(name: str) -> nn.Module:
    """A fresh, seeded model. The CNN is put in eval mode (BatchNorm on running statistics) and
    the others stay in train mode, so the train/eval check sees both flags."""
    build, seed = MODELS[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build()
    if name == "cnn":
        model.eval()
    return model


def full_data(model: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` with ``N_BATCHES * BATCH`` examples for the named model (fixed generator)."""
    gen = torch.Generator().manual_seed(100)
    n = N_BATCHES * BATCH
    if model == "mlp":
        return torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen)
    if model == "cnn":
        return torch.randn(n, 3, 6, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen)
    if model == "tied_kw":
        ids = torch.randint(0, VOCAB, (n, TOKENS), generator=gen)
        return ids, torch.randint(0, VOCAB, (n,), generator=gen)
    raise KeyError(model)


def tuple_batches(model: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batches as ``(x, y)`` tuples (what the canonical call wraps in ``Batches``)."""
    x, y = full_data(model)
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(x), BATCH)]


def _dict(model: str, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    # The keyword model takes input_ids; the MLP/CNN cannot take {"x": ..., "labels": ...}.
    return {"input_ids": x, "labels": y} if model == "tied_kw" else {"x": x, "labels": y}


def make_data(form: str, model: str) -> Any:
    """The data in the named form, fresh (a new generator for ``"generator"``)."""
    batches = tuple_batches(model)
    (x1, y1) = batches[0]
    if form == "tensor":
        return x1
    if form == "tuple":
        return (x1, y1)
    if form == "loader":
        x, y = full_data(model)
        return torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=False
        )
    if form == "list":
        return list(batches)
    if form == "dict":
        return _dict(model, x1, y1)
    if form == "dict_list":
        return [_dict(model, x, y) for x, y in batches]
    if form == "generator":

        def gen() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            yield from batches

        return gen()
    raise KeyError(form)


def out_tensor(output: Any) -> torch.Tensor:
    """The logits of a model output (``.logits`` of :class:`TiedOutput`)."""
    return output.logits if isinstance(output, TiedOutput) else output


def tuple_loss(m: nn.Module, b: Any) -> torch.Tensor:
    """The canonical ``loss_fn(model, batch)`` on ``(x, y)`` batches."""
    return F.cross_entropy(out_tensor(m(b[0])), b[1])


def interrupted_loss(at: int = 2) -> Callable[[nn.Module, Any], torch.Tensor]:
    """:func:`tuple_loss` that raises ``KeyboardInterrupt`` on its ``at``-th call (a user's
    Ctrl-C in the middle of an entry point)."""
    calls = [0]

    def loss(m: nn.Module, b: Any) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == at:
            raise KeyboardInterrupt
        return tuple_loss(m, b)

    return loss


def dict_loss(m: nn.Module, b: Any) -> torch.Tensor:
    """``loss_fn(model, batch)`` on dict batches: the model called on the keyword inputs."""
    inputs = {k: v for k, v in b.items() if k != "labels"}
    return F.cross_entropy(out_tensor(m(**inputs)), b["labels"])


class KeywordNet(nn.Module):
    """Keyword inputs and a dict output with ``logits`` (and ``loss`` given labels), as Hugging
    Face models have: ``n_in -> hidden (tanh) -> n_out``."""

    def __init__(self, n_in: int = 5, hidden: int = 7, n_out: int = 3) -> None:
        super().__init__()
        self.body = nn.Linear(n_in, hidden)
        self.head = nn.Linear(hidden, n_out)

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.head(torch.tanh(self.body(features)))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


CPU_DATA_PARALLEL = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="nn.DataParallel moves its module to cuda:0 where CUDA is available: a CPU case "
    "(tests/test_devices.py has the CUDA one)",
)
"""For tests of ``nn.DataParallel`` around a CPU model: where CUDA is available its constructor
moves the module to the GPU (found on an H200: the batches stayed on the CPU)."""


class LSTMLM(nn.Module):
    """Embedding -> 2-layer LSTM -> head (vocabulary 20): logits ``(B, T, V)``; with PyTorch's
    default init its initial loss is near ``ln V``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.rnn = nn.LSTM(8, 12, num_layers=2, batch_first=True)
        self.head = nn.Linear(12, 20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.emb(x))[0])
