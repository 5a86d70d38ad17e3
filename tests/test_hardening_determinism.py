"""Issue 13, determinism: what the docs claim about thread counts, tested on 1 and 2 threads.

:mod:`initlab.init.sampling` claims every sampler gives bit-identical tensors for a given
generator whatever ``torch.get_num_threads()`` is (the QR of ``orthogonal_`` runs on one thread;
before, ``init_model(..., "orthogonal")`` differed by up to 4.7e-7 between 1 and 2 threads).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from initlab.init.model import init_model
from initlab.init.sampling import orthogonal_
from initlab.init.schemes import list_schemes
from initlab.zoo import create_model

SCHEMES = [row["name"] for row in list_schemes()]


@contextmanager
def threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _on(n: int, make: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    with threads(n):
        return make()


def _initialized(name: str, scheme: str) -> Callable[[], dict[str, torch.Tensor]]:
    def make() -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = create_model(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # parameters a scheme does not cover: not the point
            init_model(model, scheme, generator=7)
        return {k: v.clone() for k, v in model.state_dict().items()}

    return make


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("name", ["paper_mlp", "resnet20"])
def test_init_model_is_bit_identical_on_1_and_2_threads(name: str, scheme: str) -> None:
    one, two = _on(1, _initialized(name, scheme)), _on(2, _initialized(name, scheme))
    assert one.keys() == two.keys()
    for key in one:
        assert torch.equal(one[key], two[key]), key


@pytest.mark.parametrize(
    ("shape", "groups", "transposed"),
    [
        ((384, 64), 1, False),
        ((64, 384), 1, False),
        ((512, 256, 3, 3), 1, False),
        ((256, 64, 3, 3), 4, False),
        ((64, 128, 3, 3), 1, True),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_orthogonal_is_bit_identical_on_1_and_2_threads(
    shape: tuple[int, ...], groups: int, transposed: bool, dtype: torch.dtype
) -> None:
    def make() -> dict[str, torch.Tensor]:
        w = torch.empty(shape, dtype=dtype)
        orthogonal_(w, 1.3, groups=groups, transposed=transposed, generator=3)
        return {"w": w}

    one, two = _on(1, make)["w"], _on(2, make)["w"]
    assert torch.equal(one, two)


def test_orthogonal_restores_the_thread_count() -> None:
    with threads(2):
        orthogonal_(nn.Linear(64, 64).weight, generator=0)
        assert torch.get_num_threads() == 2


def test_a_study_chunk_is_bit_identical_on_1_and_2_threads() -> None:
    """:mod:`initlab.study.runner`'s claim: for a given chunking (several runs per chunk), the
    results do not depend on the thread count."""
    from initlab.study import RunConfig, train_runs
    from initlab.zoo.paper_mlp import PaperMLP

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(151, 10, generator=g) * 2, torch.randint(0, 6, (151,), generator=g)
    configs = [
        RunConfig.make("synthetic", model_cfg={"widths": [384, 64]}, scheme=scheme, seed=seed,
                       lr=0.05, momentum=0.9, batch_size=64, epochs=2)
        for scheme in ("fan_in", "geometric") for seed in range(2)
    ]  # fmt: skip

    def train() -> list:
        return train_runs(
            configs, (x, y), model_factory=lambda c: PaperMLP(10, 6, **c.model_kwargs)
        )

    one, two = _on(1, train), _on(2, train)
    for a, b in zip(one, two, strict=True):
        assert a.step_loss == b.step_loss and a.epoch_train_loss == b.epoch_train_loss


@pytest.mark.parametrize("act", [nn.ReLU, nn.Tanh])  # engine="auto": explicit MLP engine, vmap
def test_a_chunk_of_16_vectorized_runs_is_bit_identical_on_1_and_2_threads(act: type) -> None:
    """:mod:`initlab.study.runner`'s claim, at its threshold: on the vectorized engines a chunk
    of 16 runs (two blocks of 8) gives the same numbers, bit for bit, on 1 and 2 threads (runs
    at high rates included, where a rounding difference would grow)."""
    from initlab.study import RunConfig, train_runs

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(300, 20, generator=g), torch.randint(0, 5, (300,), generator=g)
    configs = [
        RunConfig.make("synthetic", scheme="fan_in", seed=i % 4, lr=(0.05, 0.4, 1.6, 6.4)[i // 4],
                       momentum=0.9, batch_size=32, epochs=2)
        for i in range(16)
    ]  # fmt: skip

    def make(c: RunConfig) -> nn.Module:
        return nn.Sequential(nn.Linear(20, 64), act(), nn.Linear(64, 5))

    def train() -> list:
        return train_runs(configs, (x, y), model_factory=make, keep_state=True)

    one, two = _on(1, train), _on(2, train)
    for a, b in zip(one, two, strict=True):
        assert a.step_loss == b.step_loss and a.epoch_train_loss == b.epoch_train_loss
        assert a.final_train_loss == b.final_train_loss or (a.diverged and b.diverged)
        assert a.state is not None and b.state is not None
        assert all(torch.equal(a.state[k], b.state[k]) for k in a.state)
