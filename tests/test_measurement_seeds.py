"""The measuring entry points draw their passes' random numbers (dropout masks) from their
``generator``, never from torch's global RNG: the same seed gives the same numbers whatever the
global RNG holds, a seed and a ``torch.Generator`` seeded alike agree, another seed gives other
masks, and the global RNG is left where it was."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import initlab


def dropout_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3)).train()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in "ab"]


def _moments(model: nn.Module, data: Any, generator: Any) -> list[float]:
    probe = initlab.measure_moments(model, data, nn.CrossEntropyLoss(), generator=generator)
    return [float(r["E_dy2"]) for r in probe.table()]


def _gr(model: nn.Module, data: Any, generator: Any) -> list[float]:
    rows = initlab.gr_scaling(model, data, nn.CrossEntropyLoss(), generator=generator)
    return [float(r["gamma_w"]) for r in rows]


def _gradients(model: nn.Module, data: Any, generator: Any) -> list[float]:
    rows = initlab.gradient_stats(model, data, nn.CrossEntropyLoss(), generator=generator)
    return [float(r["grad_norm"]) for r in rows]


def _diagnose(model: nn.Module, data: Any, generator: Any) -> list[float]:
    loss = nn.CrossEntropyLoss()
    report = initlab.diagnose(model, data, loss, spectra=False, generator=generator)
    return [float(v) for v in report.meta["loss"]] + [report.value("0", "gamma", "weight")]


def _doctor(model: nn.Module, data: Any, generator: Any) -> list[float]:
    report = initlab.doctor(model, data, nn.CrossEntropyLoss(), generator=generator)
    return [float(report.value("gamma_spread")), float(report.value("logit_std"))]


MEASURES: dict[str, Callable[[nn.Module, Any, Any], list[float]]] = {
    "measure_moments": _moments,
    "gr_scaling": _gr,
    "gradient_stats": _gradients,
    "diagnose": _diagnose,
    "doctor": _doctor,
}


@pytest.mark.parametrize("name", list(MEASURES))
def test_the_generator_not_the_global_rng_draws_the_dropout_masks(name: str) -> None:
    measure, model, data = MEASURES[name], dropout_mlp(), batches()
    results = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        state = torch.get_rng_state()
        results.append(measure(model, data, 0))
        assert torch.equal(torch.get_rng_state(), state)  # the global RNG is where it was
    assert results[0] == results[1]
    assert measure(model, data, torch.Generator().manual_seed(0)) == results[0]
    # another seed, other masks: the generator reaches the passes
    assert measure(model, data, 1) != results[0]
    assert model.training


@pytest.mark.parametrize("name", list(MEASURES))
def test_reading_a_dataloader_leaves_the_global_rng_where_it_was(name: str) -> None:
    """diagnose and doctor with a DataLoader moved torch's global RNG (the loader's iterator draws
    its base seed from it), though diagnose's docstring says it is neither read nor changed;
    measure_moments, gr_scaling and gradient_stats put it back."""
    from torch.utils.data import DataLoader, TensorDataset

    x = torch.cat([b[0] for b in batches()])
    y = torch.cat([b[1] for b in batches()])
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    model = dropout_mlp()
    for generator in (0, None):
        torch.manual_seed(5)
        state = torch.get_rng_state()
        MEASURES[name](model, loader, generator)
        assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("name", ["precondition_", "scale_output_"])
def test_the_methods_that_say_so_leave_the_global_rng_where_it_was(name: str) -> None:
    """precondition_'s and scale_output_'s module docs say torch's global RNG is untouched; a
    shuffling DataLoader's iterator drew its seed and permutation from it (take_batches now puts
    it back). Every batch is still read: a data generator drawing from the global RNG gets
    fresh draws per batch within the call."""
    from torch.utils.data import DataLoader, TensorDataset

    x = torch.cat([b[0] for b in batches()])
    y = torch.cat([b[1] for b in batches()])
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    method, model, other = getattr(initlab, name), dropout_mlp(), dropout_mlp()
    torch.manual_seed(5)
    state = torch.get_rng_state()
    method(model, loader, generator=0)
    assert torch.equal(torch.get_rng_state(), state)
    seen: list[torch.Tensor] = []

    def drawn() -> Any:
        for _ in range(3):
            seen.append(torch.randn(8, x.shape[1]))
            yield seen[-1], torch.randint(0, 3, (8,))

    method(other, drawn(), generator=0)
    assert len(seen) == 3 and not torch.equal(seen[0], seen[1])
    assert torch.equal(torch.get_rng_state(), state)


def _numbers(report: Any) -> list[float]:
    """Every number of a diagnose report: its rows, its tables and its landscape."""
    out = [v for r in report.to_rows() for v in r.values() if isinstance(v, float)]
    for rows in report.tables.values():
        out += [v for r in rows for v in r.values() if isinstance(v, float)]
    out += [float(v) for v in torch.as_tensor(report.landscape.values).flatten()]
    return [round(v, 12) for v in out if v == v]  # NaN != NaN


def test_diagnose_without_a_generator_gives_fixed_numbers_whatever_the_global_rng() -> None:
    """generator=None is documented as "fixed seeds for the pass", yet the curvature probes, the
    power iterations of the convolution norms and the landscape's directions drew from torch's
    global RNG: other global seeds, other numbers. Now the same, and the global RNG untouched."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(32, 3)
    ).eval()
    g = torch.Generator().manual_seed(4)
    data = [(torch.randn(6, 1, 4, 4, generator=g), torch.randint(0, 3, (6,), generator=g))
            for _ in "ab"]  # fmt: skip
    seen = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        state = torch.get_rng_state()
        report = initlab.diagnose(
            model, data, nn.CrossEntropyLoss(), curvature=True,
            curvature_options={"probes": 2}, landscape={"grid": 3},
        )  # fmt: skip
        assert torch.equal(torch.get_rng_state(), state)
        seen.append(_numbers(report))
    assert len(seen[0]) > 50 and seen[0] == seen[1]


def test_lsuv_without_a_generator_does_not_redraw_the_batches_it_read() -> None:
    """Reading the data put torch's global RNG back (64431f2), so lsuv_'s orthogonal pre-init
    (generator=None: torch's global RNG, as torch.nn.init) redrew the numbers of a batch made
    lazily from that RNG: every row of W was a batch row (|cos| 1.000). Reading now advances
    the RNG as iterating the data does, so the draws differ."""
    torch.manual_seed(123)
    model = nn.Sequential(nn.Linear(64, 8, bias=False), nn.ReLU(), nn.Linear(8, 3))
    torch.manual_seed(7)
    initlab.lsuv_(model, (torch.randn(32, 64) for _ in range(1)))
    torch.manual_seed(7)
    x = torch.randn(32, 64)  # the batch lsuv_ read
    w = model[0].weight.detach()
    cos = (w / w.norm(dim=1, keepdim=True)) @ (x / x.norm(dim=1, keepdim=True)).T
    # independent unit vectors in 64 dimensions: |cos| ~ 0.125; 0.9 is beyond 7 sigma
    assert cos.abs().max().item() < 0.9


def test_doctor_s_fixes_without_a_generator_do_not_redraw_the_batches_it_read() -> None:
    """With fixes and generator=None, doctor's init fix draws from torch's global RNG; putting
    the RNG back after reading the data would have it redraw a batch made lazily from it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 3))
    with torch.no_grad():
        model[0].weight.mul_(1e4)  # the logits explode: doctor applies its init fix
    torch.manual_seed(7)
    data = ((torch.randn(32, 64), torch.randint(0, 3, (32,))) for _ in range(2))
    report = initlab.doctor(model, data, nn.CrossEntropyLoss(), fix=["init"])
    assert report.applied == ["init"], (report.skipped, report.failed)
    torch.manual_seed(7)
    x = torch.randn(32, 64)  # the first batch doctor read
    w = model[0].weight.detach()
    cos = (w / w.norm(dim=1, keepdim=True)) @ (x / x.norm(dim=1, keepdim=True)).T
    assert cos.abs().max().item() < 0.9  # independent draws: |cos| ~ 0.125
