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
from initlab.methods.output_scale import measure_output_std


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


def _with_compiled_part(compiled: bool) -> nn.Module:
    """``_mlp``'s layers with its first two inside a submodule, compiled or not."""
    first, act, last = _mlp()
    part = nn.Sequential(first, act)
    return nn.Sequential(torch.compile(part, backend="eager") if compiled else part, last)


@pytest.mark.parametrize("entry", list(_ENTRIES))
def test_a_compiled_submodule_is_run_through_the_module_it_wraps(entry: str) -> None:
    """A submodule compiled on its own (``self.encoder = torch.compile(...)``): every entry point
    runs the module it wraps (layers named "0.0", not "0._orig_mod.0"; lsuv_ took 4.6 s through
    dynamo for this MLP); the parent holds the compiled submodule again after."""
    eager, model = _with_compiled_part(False), _with_compiled_part(True)
    compiled_part = model[0]
    assert _rows(_ENTRIES[entry](model)) == _rows(_ENTRIES[entry](eager))
    assert model[0] is compiled_part
    for (name, p), q in zip(eager.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_a_compiled_submodule_is_put_back_when_the_call_fails() -> None:
    model = _with_compiled_part(True)
    compiled_part = model[0]
    with pytest.raises(ValueError, match="batch"):
        initlab.lsuv_(model, torch.randn(0, 8))
    assert model[0] is compiled_part


def _outputs(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def test_an_output_scale_hook_on_a_compiled_model_scales_what_the_compiled_model_returns() -> None:
    """The hook went on the wrapped module, which the compiled graph (traced before the hook, or
    for another instance of the class) never ran: the report said 0.05, the model kept its std."""
    model = _mlp()
    compiled = torch.compile(model, backend="eager")
    x = _batches()[0][0]
    ref = _outputs(compiled, x)  # compiled before the hook, as a user's model would be
    report = initlab.scale_output_(compiled, x, how="hook", target=0.05)
    s = report.info["scale"]
    torch.testing.assert_close(_outputs(compiled, x), ref * s)
    assert measure_output_std(compiled, x) == pytest.approx(0.05, rel=1e-5)
    report.info["handle"].remove()
    torch.testing.assert_close(_outputs(compiled, x), ref, rtol=0, atol=0)


def test_doctors_output_scale_on_a_compiled_model_scales_what_the_compiled_model_returns() -> None:
    model = _mlp()
    with torch.no_grad():
        model[2].weight.mul_(40)  # logits far too large
    compiled = torch.compile(model, backend="eager")
    x = _batches()[0][0]
    ref = _outputs(compiled, x)
    report = initlab.doctor(compiled, _batches(), nn.CrossEntropyLoss(), fix=["scale_output"])
    assert report.applied == ["output_scale"]
    s = report.reports["output_scale"].info["scale"]
    torch.testing.assert_close(_outputs(compiled, x), ref * s)


def test_an_output_scale_hook_inside_compiled_code_is_refused() -> None:
    first, act, last = _mlp()
    model = nn.Sequential(first, act, torch.compile(nn.Sequential(last), backend="eager"))
    x = _batches()[0][0]
    ref = _outputs(model, x)
    with pytest.raises(ValueError, match=r"'2.0' is inside '2', which is torch.compile'd"):
        initlab.scale_output_(model, x, how="hook", module="2.0")
    report = initlab.scale_output_(model, x, how="hook", module="2")  # the compiled head
    torch.testing.assert_close(_outputs(model, x), ref * report.info["scale"])
    report.info["handle"].remove()
