"""A torch.compile'd model: every entry point runs on the module it wraps (the same parameters),
with the values and layer names of the uncompiled model; the compiled model stays usable."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import initlab
from initlab._core.compiled import uncompiled


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=gen), torch.randint(0, 3, (16,), generator=gen))] * 4


_ENTRIES: dict[str, Callable[[nn.Module], Any]] = {
    "init_model": lambda m: initlab.init_model(m, "geometric", generator=0),
    "lsuv_": lambda m: initlab.lsuv_(m, _batches()[0][0], generator=0),
    "gradinit_": lambda m: initlab.gradinit_(m, _batches(), gamma=1e-6),
    "metainit_": lambda m: initlab.metainit_(m, _batches(), steps=2),
    "scale_output_": lambda m: initlab.scale_output_(m, _batches()),
    "precondition_": lambda m: initlab.precondition_(m, _batches()),
    "measure_moments": lambda m: initlab.measure_moments(m, _batches()).param_table(),
    "gr_scaling": lambda m: initlab.gr_scaling(m, _batches()),
    "gradient_stats": lambda m: initlab.gradient_stats(m, _batches()),
    "layer_spectra": lambda m: initlab.layer_spectra(m),
}


def _rows(report: Any) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if not k.endswith("_s")} for row in report]


@pytest.mark.parametrize("entry", list(_ENTRIES))
def test_a_compiled_model_is_run_through_the_module_it_wraps(entry: str) -> None:
    eager = _mlp()
    compiled = torch.compile(_mlp(), backend="eager")
    assert uncompiled(compiled) is compiled._orig_mod
    expected = _rows(_ENTRIES[entry](eager))
    got = _rows(_ENTRIES[entry](compiled))
    assert got == expected  # the same values, layers named "0", not "_orig_mod.0"
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        assert torch.equal(p, q), name  # the change made in place shows through the wrapper


def test_the_compiled_model_runs_its_changed_weights_after() -> None:
    model = _mlp()
    compiled = torch.compile(model, backend="eager")
    x = _batches()[0][0]
    compiled(x)  # compiled before the change, as a user's model would be
    initlab.lsuv_(compiled, x, generator=0)
    torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)
    assert uncompiled(model) is model


def test_a_probe_opened_on_a_compiled_model_says_to_probe_the_wrapped_module() -> None:
    compiled = torch.compile(_mlp(), backend="eager")
    with pytest.warns(UserWarning, match=r"Probe the module it wraps, MomentProbe\(model._orig"):
        initlab.MomentProbe(compiled)
